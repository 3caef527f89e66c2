"""The shard codec: Arrow record batches ⇄ a sequence of bounded, checksummed chunk frames.

A shard is re-sliced into chunks of about ``chunk_bytes`` of uncompressed
Arrow data (a few MiB: large enough that LMDB stores them in contiguous
overflow pages and gRPC sends them at full speed, small enough to bound
memory and to resume a broken stream cheaply). Each chunk is one Arrow IPC
stream, stored as it is, compressed whole with zstd, or — the default for
new versions — with its fixed-width buffers byte-split first
(:mod:`edgecache.cache.byte_split`: on token ids about 3× less compression
CPU than plain zstd, a better ratio, and faster decode), wrapped in a frame
(:mod:`edgecache.cache.frame`). Every codec a frame may carry stays
decodable: old versions keep their plain zstd chunks.

Decoding an uncompressed chunk is zero-copy: the returned batch points into
the caller's buffer, so the caller must keep that buffer alive (the store's
``read_shard`` does). A compressed one is decompressed into a buffer from
Arrow's memory pool that the batch then points into. zstd, xxh3 and numpy's
loops release the GIL, so callers may decode chunks on several threads.

Encoding is most of an edge node's staging CPU, so :class:`ShardEncoder`
can compress a shard's chunks on a pool of threads (zstd and Arrow's IPC
writer release the GIL) while the caller parses the next batches; the frames
come out in order and byte for byte the same as serially: chunk boundaries
depend on the rows alone, and every chunk is compressed with the same
parameters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import zstandard

from edgecache.cache import byte_split, recycled
from edgecache.cache.errors import ChunkCorrupt, ChunkTooLarge, EmptyShard, SchemaMismatch
from edgecache.cache.frame import Buffer, Codec, pack_frame, payload_view, read_header, verify_frame
from edgecache.cache.row_grid import DEFAULT_CHUNK_BYTES, fixed_row_bytes, rows_per_window
from edgecache.cache.wire import MAX_FRAME_BYTES
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["COMPRESSIONS", "CodecOptions", "ShardEncoder", "decode_chunk", "encode_shard"]

_local = threading.local()  # per-thread zstd contexts

MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 256 << 20
MAX_CHUNK_FACTOR = 4  # a chunk on the row grid is closed early at this many chunk_bytes

Compression = Literal["byte-split-zstd", "zstd", "none"]
# The names a version's spec may give, and the manifest's enum for each.
COMPRESSIONS: dict[str, pb.Compression.ValueType] = {
    "byte-split-zstd": pb.COMPRESSION_BYTE_SPLIT_ZSTD,
    "zstd": pb.COMPRESSION_ZSTD,
    "none": pb.COMPRESSION_NONE,
}
_FROM_SPEC: dict[int, Compression] = {
    pb.COMPRESSION_UNSPECIFIED: "zstd",  # versions from before the choice existed
    pb.COMPRESSION_ZSTD: "zstd",
    pb.COMPRESSION_NONE: "none",
    pb.COMPRESSION_BYTE_SPLIT_ZSTD: "byte-split-zstd",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecOptions:
    """How a version's chunks are encoded; part of the version's preprocessing spec.

    Fields:
        compression: "byte-split-zstd" (the default) splits fixed-width values'
            bytes into streams before zstd: on token ids ratio 3.3 against plain
            zstd's 2.5, about 3× less CPU to compress and faster to decode;
            "zstd" compresses the Arrow stream as it is (what versions published
            before byte-split use); "none" decodes zero-copy at memory speed.
        level: zstd level (negative levels are faster, 1-3 is the usual trade).
            With "none" no codec reads it, so it is always 1 there: options that
            encode the same chunks are equal, and a spec written from them (at
            publish) records one level, so one content keeps one digest.
        chunk_bytes: target uncompressed bytes per chunk.
    """

    compression: Compression = "byte-split-zstd"
    level: int = 1
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, "
                f"got {self.compression!r}"
            )
        if self.compression == "none":
            object.__setattr__(self, "level", 1)  # frozen: set once, here
        elif not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in -7..22, got {self.level}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, "
                f"got {self.chunk_bytes}"
            )

    @classmethod
    def from_spec(cls, spec: pb.PreprocessSpec) -> CodecOptions:
        """Read the codec settings out of a manifest's preprocessing spec.

        An unset compression is plain zstd, as every version published before
        the choice existed was encoded; a value this node does not know is
        refused rather than guessed.
        """
        compression = _FROM_SPEC.get(spec.compression)
        if compression is None:
            raise ValueError(
                f"the version's chunks use compression {spec.compression}, which this "
                "edgecache does not know; upgrade it"
            )
        return cls(
            compression=compression,
            level=spec.compression_level or 1,
            chunk_bytes=spec.chunk_bytes or DEFAULT_CHUNK_BYTES,
        )


class ShardEncoder:
    """Turns a stream of record batches into chunk frames of bounded size.

    Feed batches with :meth:`add`, which returns any frames completed so far;
    :meth:`finish` returns the rest. Rows keep their order.

    With ``pool``, full chunks are serialized and compressed on the pool's
    threads, at most ``in_flight`` at a time (memory stays bounded: each holds
    one chunk's rows and frame), and :meth:`add` returns the frames finished so
    far, in order. ``cpu_seconds`` sums the thread CPU time the encoding took
    wherever it ran.

    ``chunk_rows`` puts that many rows in every chunk but the last, the grid
    readers cut their shuffle windows by (:func:`edgecache.cache.row_grid.chunk_rows`
    gives it from the manifest); by default fixed-width rows get that grid
    from the schema and others are cut at ``chunk_bytes``.
    """

    def __init__(
        self,
        schema: pa.Schema,
        options: CodecOptions | None = None,
        *,
        pool: Executor | None = None,
        in_flight: int = 8,
        chunk_rows: int | None = None,
    ) -> None:
        self.schema = schema
        self.options = options or CodecOptions()
        self.rows = 0
        self.cpu_seconds = 0.0
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0.0
        # Chunks are cut on the grid readers cut windows by (cache/row_grid.py): every
        # chunk but a shard's last holds this many rows (0: cut by bytes alone).
        fixed = fixed_row_bytes(schema)
        if chunk_rows is None and fixed is not None:
            chunk_rows = rows_per_window(fixed, self.options.chunk_bytes)
        self._chunk_rows = max(chunk_rows or 0, 0)
        self._pending_rows = 0
        self._pool = pool
        self._in_flight = max(1, in_flight)
        self._futures: deque[Future[tuple[bytes, float]]] = deque()

    def add(self, batch: pa.RecordBatch) -> list[bytes]:
        """Queue ``batch``; return the frames that are now finished."""
        if not batch.schema.equals(self.schema):
            raise SchemaMismatch(_schema_diff(self.schema, batch.schema))
        frames: list[bytes] = []
        if batch.num_rows == 0:
            return self._collect(frames)
        if self._chunk_rows:
            self._add_rows(batch, frames)
            return self._collect(frames)
        bytes_per_row = max(batch.nbytes / batch.num_rows, 1.0)
        limit = self.options.chunk_bytes
        offset = 0
        while offset < batch.num_rows:
            room = limit - self._pending_bytes
            take = min(int(room // bytes_per_row), batch.num_rows - offset)
            if take <= 0:
                if self._pending:
                    self._flush(frames)
                    continue
                take = 1  # a single row larger than a chunk gets a chunk of its own
            self._pending.append(batch.slice(offset, take))
            self._pending_bytes += take * bytes_per_row
            offset += take
            if limit - self._pending_bytes < bytes_per_row:
                self._flush(frames)
        return self._collect(frames)

    def _add_rows(self, batch: pa.RecordBatch, frames: list[bytes]) -> None:
        """Chunks of ``_chunk_rows`` rows, the readers' window grid.

        Rows far larger than the grid assumed (an estimate from the manifest
        for rows of variable width) still close a chunk at MAX_CHUNK_FACTOR
        times ``chunk_bytes``: such a chunk is off the grid, never unbounded.
        """
        bytes_per_row = max(batch.nbytes / batch.num_rows, 1.0)
        cap = MAX_CHUNK_FACTOR * self.options.chunk_bytes
        offset = 0
        while offset < batch.num_rows:
            room = max(int((cap - self._pending_bytes) // bytes_per_row), 1)
            take = min(self._chunk_rows - self._pending_rows, batch.num_rows - offset, room)
            self._pending.append(batch.slice(offset, take))
            self._pending_rows += take
            self._pending_bytes += take * bytes_per_row
            offset += take
            if self._pending_rows == self._chunk_rows or self._pending_bytes >= cap - bytes_per_row:
                self._flush(frames)

    def finish(self) -> list[bytes]:
        """Return the remaining frames, the last one partly filled; raise if there were no rows."""
        frames: list[bytes] = []
        if self._pending:
            self._flush(frames)
        while self._futures:
            frames.append(self._take(self._futures.popleft()))
        if self.rows == 0:
            raise EmptyShard(
                "the shard has no rows; remove it from the manifest or check the source object"
            )
        return frames

    def _collect(self, frames: list[bytes]) -> list[bytes]:
        """Append the frames whose compression has finished, oldest first, to ``frames``."""
        while self._futures and self._futures[0].done():
            frames.append(self._take(self._futures.popleft()))
        return frames

    def _take(self, future: Future[tuple[bytes, float]]) -> bytes:
        frame, cpu = future.result()
        self.cpu_seconds += cpu
        return frame

    def _flush(self, frames: list[bytes]) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0.0
        self._pending_rows = 0
        self.rows += sum(b.num_rows for b in pending)
        if self._pool is None:
            frame, cpu = _encode_chunk(pending, self.schema, self.options)
            self.cpu_seconds += cpu
            frames.append(frame)
            return
        while len(self._futures) >= self._in_flight:  # bound memory: wait for the oldest
            frames.append(self._take(self._futures.popleft()))
        self._futures.append(self._pool.submit(_encode_chunk, pending, self.schema, self.options))


SPLIT_HASH_LOG = 13  # entries of zstd's match table for split streams at fast levels: 2^13


def _compressor(level: int, *, split: bool = False) -> zstandard.ZstdCompressor:
    """The calling thread's compressor for ``level`` (ZstdCompressor is not thread-safe).

    Split byte streams at the fast levels (1 and below) get a match table of
    2^SPLIT_HASH_LOG entries instead of zstd's 2^14, which lies outside the
    core's L1/L2 caches. How small is set by real text, not by random ids:
    the ids of real text repeat whole phrases (code, boilerplate, quotations),
    and a table too small to remember them loses those matches. Measured with
    ``python -m bench.codec_store`` (4 MiB chunks): on the ids of the standard
    library's sources (a 32,000-id BPE) 2^11 entries stored 10 % more than
    plain zstd-1 (ratio 3.94 against 4.32) and 2^13 stores slightly less
    (4.36), encodes as fast and decodes 5-8 % faster; on the bench's Zipf
    ids, drawn independently so that nothing repeats, 2^11 encodes ~10 %
    faster at the same ratio (3.26). zstd's own 2^14 encodes both ~4 % slower
    again for under 1 % more on real text.
    """
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, split and level <= 1)
    found = cache.get(key)
    if found is None and key[1]:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, hash_log=SPLIT_HASH_LOG, write_content_size=True
        )
        found = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    elif found is None:  # zstd's own parameters, adapted to each input's size
        found = cache[key] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return found


def _encode_chunk(
    batches: list[pa.RecordBatch], schema: pa.Schema, options: CodecOptions
) -> tuple[bytes, float]:
    """One chunk's frame from its row slices, and the thread CPU seconds it took."""
    started = time.thread_time()
    batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    rows = batch.num_rows
    spans: list[byte_split.Span] = []
    sources: dict[int, pa.Buffer] = {}
    if options.compression == "byte-split-zstd":
        # The stream without its spans' bytes: split reads those from the batch itself.
        raw, spans, sources = byte_split.write_stream(batch, schema)
    else:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_batch(batch)
        raw = sink.getvalue()
    if options.compression == "none":
        frame = pack_frame(raw, codec=Codec.NONE, rows=rows, raw_len=raw.size)
    elif spans:
        split, regions = byte_split.split(raw, spans, sources)
        codec = (
            Codec.BYTE_SPLIT_SPARSE_ZSTD
            if byte_split.has_sparse(regions)
            else Codec.BYTE_SPLIT_ZSTD
        )
        data = _compressor(options.level, split=True).compress(split)
        # The table and the data are hashed and copied into the frame as they are, not joined.
        table = byte_split.pack_regions(regions)
        frame = pack_frame(table, data, codec=codec, rows=rows, raw_len=raw.size)
    else:  # plain zstd, or byte-split with nothing worth splitting (e.g. encoded images)
        payload = _compressor(options.level).compress(raw)
        frame = pack_frame(payload, codec=Codec.ZSTD, rows=rows, raw_len=raw.size)
    if len(frame) > MAX_FRAME_BYTES:
        # Stored, it could never be read: every reader and peer refuses the message.
        if rows == 1:  # a chunk holds one row at least: no --chunk-size makes it smaller
            raise ChunkTooLarge(
                f"one row is {len(frame):,} bytes stored, more than the {MAX_FRAME_BYTES:,} a "
                "reader accepts in one message: no chunk size splits a row; leave that "
                "column out (a columns transform), or keep such values as objects of their "
                "own and store their URLs"
            )
        raise ChunkTooLarge(
            f"a chunk of {rows} rows is {len(frame):,} bytes, more than the "
            f"{MAX_FRAME_BYTES:,} a reader accepts in one message (rows of about "
            f"{raw.size // max(rows, 1):,} bytes, chunks of {options.chunk_bytes:,}): publish "
            "the version again with a smaller --chunk-size"
        )
    return frame, time.thread_time() - started


def encode_shard(
    batches: Iterable[pa.RecordBatch], schema: pa.Schema, options: CodecOptions | None = None
) -> list[bytes]:
    """Encode a whole shard; the frames are in row order."""
    encoder = ShardEncoder(schema, options)
    frames: list[bytes] = []
    for batch in batches:
        frames.extend(encoder.add(batch))
    frames.extend(encoder.finish())
    return frames


_ZSTD_BLOCK_MAX = 128 << 10  # zstd's largest block (Block_Maximum_Size)


def _decompressor() -> zstandard.ZstdDecompressor:
    # ZstdDecompressor is not thread-safe; one per thread keeps decode parallel.
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _decompress(payload: Buffer, raw_len: int) -> Buffer:
    """The first zstd frame of ``payload``, which declares ``raw_len`` bytes, decompressed.

    The output goes into a recycled decode buffer (:mod:`edgecache.cache.recycled`)
    rather than a fresh ``bytes``: the batch decoded from it points into it
    (zero-copy), and the memory is handed to the next decode once no batch
    does, where every ``bytes`` of a few MiB was a new mapping, page-faulted
    in and unmapped again. One ``readinto`` of exactly ``raw_len`` bytes takes
    zstd's single-pass path over the first frame, as ``decompress`` does: a
    frame that decodes to more or fewer bytes than it declares raises
    ZstdError, anything after the frame is ignored.
    """
    if raw_len == 0:
        return _decompressor().decompress(payload)
    target, out = recycled.buffers.allocate(raw_len)
    with _decompressor().stream_reader(payload) as reader:
        filled = reader.readinto(target)
    return out if filled == raw_len else memoryview(out)[:filled]


def _unzstd(payload: memoryview, raw_len: int, *, at_least: int | None = None) -> Buffer:
    """A chunk's zstd frame decompressed, checked against the header's ``raw_len`` first.

    ``at_least``: the frame may declare any size from it to ``raw_len`` (split data
    with sparse streams, whose size is their data's); otherwise exactly ``raw_len``.
    """
    # zstd allocates what its own frame header declares, not max_output_size:
    # check that against ours first, so a lying frame cannot make us allocate.
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd payload has no valid frame header: {exc}") from exc
    least = raw_len if at_least is None else at_least
    if not least <= declared <= raw_len:
        expects = f"{raw_len}" if least == raw_len else f"{least} to {raw_len}"
        raise ChunkCorrupt(
            f"zstd payload declares {'no size' if declared < 0 else f'{declared} bytes'}, "
            f"the frame expects {expects}; the entry is damaged — drop it and fetch the "
            "shard again"
        )
    raw_len = declared  # what to allocate: the declared size, now known to be in bounds
    if raw_len > (len(payload) // 3 + 1) * _ZSTD_BLOCK_MAX:
        # Each zstd block takes at least a 3-byte header and yields at most 128 KiB:
        # a header claiming more than that is a lie; refuse it before allocating.
        raise ChunkCorrupt(
            f"header says the chunk decodes to {raw_len} bytes, more than "
            f"{len(payload)} bytes of zstd can hold; the entry is damaged — drop it and "
            "fetch the shard again"
        )
    try:
        return _decompress(payload, raw_len)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd payload cannot be decompressed: {exc}") from exc
    except (MemoryError, OverflowError) as exc:
        raise ChunkCorrupt(
            f"header says the chunk decodes to {raw_len} bytes, more than can be "
            "allocated; the entry is damaged — drop it and fetch the shard again"
        ) from exc


def decode_chunk(
    frame: Buffer, schema: pa.Schema | None = None, *, verify: bool = True
) -> pa.RecordBatch:
    """Decode one frame into a record batch.

    With ``verify`` (the default) the checksum is checked first and a damaged
    chunk raises :class:`ChunkCorrupt`; pass ``verify=False`` only for bytes
    that were verified already. When ``schema`` is given the chunk must carry
    it. Uncompressed chunks decode zero-copy: the batch references ``frame``.
    """
    header = verify_frame(frame) if verify else read_header(frame)
    payload = payload_view(frame, header)
    raw: Buffer
    if header.codec is Codec.ZSTD:
        raw = _unzstd(payload, header.raw_len)
    elif header.codec in (Codec.BYTE_SPLIT_ZSTD, Codec.BYTE_SPLIT_SPARSE_ZSTD):
        sparse = header.codec is Codec.BYTE_SPLIT_SPARSE_ZSTD
        regions, table = byte_split.unpack_regions(payload, header.raw_len, sparse=sparse)
        least, most = byte_split.stored_bounds(regions, header.raw_len)  # equal unless sparse
        split = _unzstd(payload[table:], most, at_least=least)
        raw = (
            byte_split.join(split, regions, header.raw_len)
            if regions and isinstance(split, pa.Buffer)  # else short: the check below fails
            else split
        )
    else:
        raw = payload
    if len(raw) != header.raw_len:
        raise ChunkCorrupt(f"payload decodes to {len(raw)} bytes, header says {header.raw_len}")
    try:
        reader = pa.ipc.open_stream(raw if isinstance(raw, pa.Buffer) else pa.py_buffer(raw))
        batch = reader.read_next_batch()
        batch.validate()  # buffer sizes against lengths, which reading leaves unchecked; O(columns)
    except (pa.ArrowException, OSError, StopIteration) as exc:  # also ArrowNotImplementedError
        raise ChunkCorrupt(f"chunk payload is not a valid Arrow IPC stream: {exc}") from exc
    if schema is None or not batch.schema.equals(schema):
        if not utf8_field_names(batch.schema):
            raise ChunkCorrupt(
                "chunk's schema has a column name that is not UTF-8; the entry is damaged — "
                "drop it and fetch the shard again"
            )
        if schema is not None:
            raise SchemaMismatch(_schema_diff(schema, batch.schema))
    if batch.num_rows != header.rows:
        raise ChunkCorrupt(f"chunk decodes to {batch.num_rows} rows, header says {header.rows}")
    return batch


def utf8_field_names(schema: pa.Schema) -> bool:
    """Whether every field name, nested ones too, is UTF-8.

    Arrow IPC stores names as raw bytes and pyarrow decodes them only when
    asked, so a damaged or forged schema would otherwise raise
    UnicodeDecodeError wherever a name is first used.
    """
    fields = list(schema)
    while fields:
        field = fields.pop()
        try:
            field.name  # noqa: B018 - decoding is the check
        except UnicodeDecodeError:
            return False
        fields.extend(field.type.field(i) for i in range(field.type.num_fields))
    return True


def _schema_diff(expected: pa.Schema, actual: pa.Schema) -> str:
    want = {f.name: f.type for f in expected}
    got = {f.name: f.type for f in actual}
    problems = [f"missing column {n!r} ({t})" for n, t in want.items() if n not in got]
    problems += [f"unexpected column {n!r} ({t})" for n, t in got.items() if n not in want]
    problems += [
        f"column {n!r} is {got[n]}, expected {t}"
        for n, t in want.items()
        if n in got and got[n] != t
    ]
    if not problems:
        problems = ["column order or nullability differs"]
    return (
        "schema mismatch: "
        + "; ".join(problems)
        + ". Data must match the schema the version declares; publish a new version to change it"
    )
