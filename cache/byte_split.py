"""Byte splitting: the fixed-width buffers of an Arrow IPC stream, their bytes transposed.

zstd-1 on int32 token ids was most of an edge node's staging CPU, and the
ids' bytes are the reason: in ``[b0 b1 b2 b3][b0 b1 b2 b3]…`` the high bytes
(almost always 0 for a 50k vocabulary) sit between the low ones, so zstd sees
short, broken matches everywhere. Split each value's bytes into streams —
all the b0s, then all the b1s, … (what Blosc calls *shuffle* and Parquet
``BYTE_STREAM_SPLIT``) — and the high streams become long runs of zeros that
zstd passes over at memory speed, while the low ones compress as their own
distribution. Measured on token ids (``bench.codec_store``): about 3× less
compression CPU, ratio 3.3 instead of 2.5, and zstd also decompresses the
split bytes about twice as fast, which pays for joining the bytes back.

Only the buffers whose element width is known are split (primitive data,
list and string offsets, dictionary indices; 2, 4 or 8 bytes); metadata,
validity bitmaps, strings' bytes and anything of a width 1 stay as they are.
Which byte ranges were split, and how wide their elements are, is written
down explicitly (:func:`pack_regions`): decoding never has to guess the
layout from the Arrow types, so a type this module does not know is merely
left unsplit, never decoded wrongly.

A byte stream that holds one value throughout (the high bytes of token ids
under 65,536, of small labels, of offsets) is not stored at all: the table
records its value. That halves what is split, compressed, decompressed and
joined for token ids, and is what makes decoding faster than plain zstd
rather than merely as fast: joining is the costly step here.

numpy does the transposes (its loops release the GIL, so readers still decode
chunks on several threads): splitting casts whole words to bytes, read k bytes
on for stream k (:func:`_byte_stream`), joining shifts them left and ORs them
together, both on 2-, 4- or 8-byte integers, where numpy's strided copies of
every width-th byte are 2-3× slower.
Constant streams are found with an OR and an AND reduction (~25 GB/s).

A stream that is mostly zeros but not all (the second byte of Zipf-like
token ids: ids under 256 are most of them) is zstd's slowest input: every
non-zero byte ends a run of zeros, so it emits a sequence for almost every
one, at 0.3 GB/s where the dense low byte goes at 0.8-1. Such a stream is
stored *sparse* instead: a bitmap of its non-zero bytes, then those bytes in
order (``np.compress`` gathers them at ~1.6 GB/s; numpy's boolean indexing
would take 6× as long), and zstd then passes over a bitmap and a short run of
values at memory speed: on token ids of a 50k vocabulary the stream costs
1.1 ms per MiB instead of 3.2 and stores 0.35 of its bytes instead of 0.42.
Which streams are sparse is in the regions table; a chunk with any is
framed as ``BYTE_SPLIT_SPARSE_ZSTD``, so a chunk without one is byte for
byte what earlier releases wrote and read.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from edgecache.cache import recycled
from edgecache.cache.errors import ChunkCorrupt

__all__ = [
    "Region",
    "Span",
    "has_sparse",
    "join",
    "pack_regions",
    "spans_of",
    "split",
    "stored_bounds",
    "stored_length",
    "unpack_regions",
    "write_stream",
]

Span = tuple[int, int, int]  # (offset, length, width): bytes [offset, offset + length)
WIDTHS = (2, 4, 8)
MIN_REGION_BYTES = 256  # smaller buffers gain nothing worth a table entry
# Splitting costs a copy of the whole stream both ways (the bytes between regions too):
# below this share of the stream in regions (images with their offsets) it is not done.
MIN_SHARE = 1 / 8
# A stream is stored sparse when at most this share of its bytes is non-zero: measured on
# 1 MiB streams, zstd-1 of a stream at share 0.3 takes 3.1 ms and the sparse form 1.1 (and
# stores less); at 0.6 the two are even, above it the dense stream is faster and smaller
# (real text's second id byte, share 0.74: 2.4 against 3.0 ms), and below 1/64 zstd
# passes over the long zero runs faster than the gather.
SPARSE_SHARE = 1 / 2
MIN_SPARSE_SHARE = 1 / 64
_COUNT = struct.Struct("<I")
_ENTRY = struct.Struct("<QQBBQ")  # offset, length, width, constant-stream mask, their bytes
_SPARSE_ENTRY = struct.Struct("<QQBBQB")  # the same, then the sparse-stream mask
_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class Region(NamedTuple):
    """One split byte range: ``length`` bytes at ``offset`` of elements ``width`` bytes wide.

    Bit k of ``constant`` set: byte k of every element is byte k of ``values``
    (little-endian), and that stream is not stored. The stored streams follow
    each other in byte order, ``length // width`` bytes each, but for those
    whose bit is set in ``sparse``: a bitmap of ``ceil(length / width / 8)``
    bytes (bit i, little-endian bit order, set: byte i is non-zero), then the
    non-zero bytes in order.
    """

    offset: int
    length: int
    width: int
    constant: int = 0
    values: int = 0
    sparse: int = 0

    @property
    def stored(self) -> int:
        """Bytes of this region in the split data with every stream dense: the most it takes."""
        return (self.width - self.constant.bit_count()) * (self.length // self.width)


def _widths(kind: pa.DataType) -> list[int] | None:
    """Element width of each buffer, in ``Array.buffers()`` order; 0 = leave as is.

    None when the layout is not known here (views, unions, run-end encoded):
    the column is then left whole.
    """
    t = pa.types
    if isinstance(kind, pa.ExtensionType):
        return _widths(kind.storage_type)
    if t.is_null(kind):
        return [0]
    if t.is_boolean(kind) or t.is_fixed_size_binary(kind) or t.is_decimal(kind):
        return [0, 0]
    if t.is_dictionary(kind):
        return [0, kind.index_type.bit_width // 8]
    if t.is_string(kind) or t.is_binary(kind):
        return [0, 4, 0]
    if t.is_large_string(kind) or t.is_large_binary(kind):
        return [0, 8, 0]
    if t.is_fixed_size_list(kind):
        return _nested([0], [kind.value_type])
    if t.is_map(kind):
        return _nested([0, 4, 0], [kind.key_type, kind.item_type])
    if t.is_list(kind):
        return _nested([0, 4], [kind.value_type])
    if t.is_large_list(kind):
        return _nested([0, 8], [kind.value_type])
    if t.is_struct(kind):
        return _nested([0], [kind.field(i).type for i in range(kind.num_fields)])
    if t.is_integer(kind) or t.is_floating(kind) or t.is_temporal(kind):
        try:
            width = kind.bit_width // 8
        except ValueError:  # e.g. month_day_nano intervals
            return None
        return [0, width if width in WIDTHS else 0]
    return None


def _nested(own: list[int], children: Sequence[pa.DataType]) -> list[int] | None:
    out = list(own)
    for child in children:
        widths = _widths(child)
        if widths is None:
            return None
        out += widths
    return out


def spans_of(stream: pa.Buffer) -> list[Span]:
    """The byte ranges of ``stream`` (one Arrow IPC stream, one batch) worth splitting.

    The stream is read back zero-copy, so each buffer's place in it is its
    address minus the stream's. Ranges are sorted and never overlap; none when
    they would be less than :data:`MIN_SHARE` of the stream.
    """
    batch = pa.ipc.open_stream(stream).read_next_batch()
    base, end = stream.address, stream.size
    found: list[Span] = []
    for column in batch.columns:
        buffers = column.buffers()
        widths = _widths(column.type)
        if widths is None or len(widths) != len(buffers):
            continue
        for buffer, width in zip(buffers, widths, strict=True):
            if buffer is None or width < 2:
                continue
            offset = buffer.address - base
            length = buffer.size - buffer.size % width
            if length >= MIN_REGION_BYTES and 0 <= offset and offset + length <= end:
                found.append((offset, length, width))
    found.sort()
    kept: list[Span] = []
    for span in found:  # IPC writes each buffer once; never trust that blindly
        if not kept or span[0] >= kept[-1][0] + kept[-1][1]:
            kept.append(span)
    if sum(length for _, length, _ in kept) < MIN_SHARE * end:
        return []
    return kept


class _Pieces:
    """A write-only file for Arrow's IPC writer that keeps what it is given, copying nothing.

    The writer hands each body buffer over as it is (a ``pa.Buffer`` over the
    batch's own memory) and the rest (metadata, padding) as small ``bytes``.
    """

    closed = False

    def __init__(self) -> None:
        self.pieces: list[tuple[int, Any]] = []  # (offset in the stream, bytes or pa.Buffer)
        self.size = 0

    def write(self, data: Any) -> int:
        size = data.size if isinstance(data, pa.Buffer) else len(data)
        self.pieces.append((self.size, data))
        self.size += size
        return size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False


def write_stream(
    batch: pa.RecordBatch, schema: pa.Schema
) -> tuple[pa.Buffer, list[Span], dict[int, pa.Buffer]]:
    """``batch`` as one Arrow IPC stream, its spans worth splitting, and the spans' bytes.

    The stream is the one ``pa.ipc.new_stream`` writes to a BufferOutputStream,
    byte for byte, but for the spans, left unwritten there: their bytes are in
    the returned dict (by offset), the batch's own buffers, which :func:`split`
    reads in place. Writing the stream whole copied every chunk's data once
    more before splitting copied it again: on the bench's token ids this takes
    0.08 CPU-s per GB of Parquet where that copy and reading it back took 0.24.
    Pass all three to :func:`split`; with no span the stream is whole.
    """
    sink = _Pieces()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    stream = pa.allocate_buffer(sink.size)  # Arrow's pool reuses it
    dst = np.frombuffer(stream, np.uint8)
    bodies: dict[int, pa.Buffer] = {}
    for at, data in sink.pieces:
        if isinstance(data, pa.Buffer) and data.size >= MIN_REGION_BYTES:
            bodies[at] = data  # a span only if spans_of says so: written below if not
        else:
            dst[at : at + len(data)] = np.frombuffer(data, np.uint8)
    spans = spans_of(stream)  # reads the metadata alone: the holes may hold anything meanwhile
    sources = {o: bodies[o] for o, n, _ in spans if o in bodies and n <= bodies[o].size}
    for at, data in bodies.items():
        if at not in sources:
            dst[at : at + data.size] = np.frombuffer(data, np.uint8)
    return stream, spans, sources


def _constant_streams(elements: np.ndarray, width: int) -> tuple[int, int]:
    """(mask, values) of the byte streams that hold one value in every element."""
    words = elements.view(_WORDS[width])
    ones = int(np.bitwise_or.reduce(words))
    zeros = int(np.bitwise_and.reduce(words))
    mask = values = 0
    for k in range(width):
        byte = (ones >> 8 * k) & 0xFF
        if byte == (zeros >> 8 * k) & 0xFF:  # the OR and the AND agree: one value only
            mask |= 1 << k
            values |= byte << 8 * k
    return mask, values


def split(
    stream: pa.Buffer, spans: Sequence[Span], sources: Mapping[int, pa.Buffer] | None = None
) -> tuple[pa.Buffer, list[Region]]:
    """``stream`` with each span's element bytes split into streams, constant ones left out.

    Returns the split data (shorter than ``stream`` by the streams left out
    and those stored sparse) and the regions that describe it. ``sources``
    (from :func:`write_stream`): each span's bytes, by its offset, where
    ``stream`` left them unwritten.
    """
    if not spans:
        return stream, []
    src = np.frombuffer(stream, np.uint8)
    sources = sources or {}
    elements_of = [
        np.frombuffer(sources[offset], np.uint8, length)
        if offset in sources
        else src[offset : offset + length]
        for offset, length, _ in spans
    ]
    regions = []
    for (offset, length, width), elements in zip(spans, elements_of, strict=True):
        mask, values = _constant_streams(elements, width)
        regions.append(Region(offset, length, width, mask, values))
    out = pa.allocate_buffer(stored_length(regions, stream.size))  # Arrow's pool reuses it
    dst = np.frombuffer(out, np.uint8)
    done = at = 0
    for i, r in enumerate(regions):
        gap = r.offset - done
        dst[at : at + gap] = src[done : r.offset]
        at += gap
        sparse, used = _split_one(elements_of[i], dst[at : at + r.stored], r)
        regions[i] = r._replace(sparse=sparse)
        at += used
        done = r.offset + r.length
    tail = stream.size - done
    dst[at : at + tail] = src[done:]
    at += tail
    return (out if at == out.size else out.slice(0, at)), regions


def _split_one(elements: np.ndarray, dst: np.ndarray, region: Region) -> tuple[int, int]:
    """Write the region's stored streams to ``dst``; their sparse mask and bytes written."""
    kept = [k for k in range(region.width) if not region.constant >> k & 1]
    words = elements.view(_WORDS[region.width])
    count = len(words)
    at = sparse = 0
    for k in kept:
        out = dst[at : at + count]
        _byte_stream(elements, words, k, out)
        packed = _sparse(out)
        if packed is None:
            at += count
            continue
        sparse |= 1 << k
        at += packed  # the stream's sparse form, written over its dense bytes
    return sparse, at


def _byte_stream(elements: np.ndarray, words: np.ndarray, k: int, out: np.ndarray) -> None:
    """Byte ``k`` of every word of ``elements`` into ``out``, in one pass straight into the stream.

    A cast to uint8 keeps each word's low byte (the words are little-endian), so
    stream 0 is the words cast, and stream k is the words of a view ``k`` bytes
    further on cast: its word i starts at byte k of element i. That view is
    unaligned, which numpy's casts do not mind: 0.09 ms per million 4-byte words
    here, where shifting the words right by 8k into the stream took 0.17-0.22 (a
    shift with a cast goes through numpy's buffered loop), and a strided copy of
    every width-th byte 0.29. The view stops one word short (its last word would
    end past the elements); the last byte is shifted out alone.
    """
    if not k:
        np.copyto(out, words, casting="unsafe")
        return
    count = len(words)
    if count > 1:
        ahead = elements[k : k + words.itemsize * (count - 1)].view(words.dtype)
        np.copyto(out[:-1], ahead, casting="unsafe")
    out[-1] = (words[-1] >> 8 * k) & 0xFF


def _sparse(stream: np.ndarray) -> int | None:
    """Rewrite ``stream`` in place in its sparse form if it is one; the bytes that takes."""
    count = len(stream)
    nonzero = int(np.count_nonzero(stream))
    if not MIN_SPARSE_SHARE * count <= nonzero <= SPARSE_SHARE * count:
        return None
    if (count + 7) // 8 + nonzero >= count:  # a handful of elements: nothing to gain
        return None
    present = stream != 0
    values = np.compress(present, stream)  # ~6x numpy's boolean indexing
    bits = np.packbits(present, bitorder="little")
    stream[: len(bits)] = bits
    stream[len(bits) : len(bits) + nonzero] = values
    return len(bits) + nonzero


def has_sparse(regions: Sequence[Region]) -> bool:
    """Whether any stream is stored sparse: such chunks are framed BYTE_SPLIT_SPARSE_ZSTD."""
    return any(r.sparse for r in regions)


def stored_length(regions: Sequence[Region], raw_len: int) -> int:
    """Bytes of split data that ``regions`` describe for ``raw_len`` bytes of stream.

    Exact when no stream is sparse; with sparse streams, the most it can be.
    """
    return raw_len - sum(r.length - r.stored for r in regions)


def stored_bounds(regions: Sequence[Region], raw_len: int) -> tuple[int, int]:
    """The least and the most bytes of split data ``regions`` can describe for ``raw_len``.

    The same with no sparse stream; a sparse one holds at least its bitmap. A
    reader checks the size zstd declares against these before it allocates
    ``raw_len`` bytes, so a damaged ``raw_len`` is refused, not allocated.
    """
    most = stored_length(regions, raw_len)
    saved = 0
    for r in regions:
        count = r.length // r.width
        saved += r.sparse.bit_count() * (count - (count + 7) // 8)
    return most - saved, most


def join(data: pa.Buffer, regions: Sequence[Region], raw_len: int) -> pa.Buffer:
    """Undo :func:`split`: the ``raw_len`` bytes of stream, in a new buffer.

    Split data that does not hold exactly what ``regions`` describe (a sparse
    stream's values running past the end, bytes left over) raises
    :class:`ChunkCorrupt`.
    """
    if not regions:
        return data
    dst, out = recycled.buffers.allocate(raw_len)
    src = np.frombuffer(data, np.uint8)
    done = at = 0
    for r in regions:
        gap = r.offset - done
        if at + gap > len(src):
            raise ChunkCorrupt(_SHORT)
        dst[done : r.offset] = src[at : at + gap]
        at += gap
        dense, sparse, at = _streams(src, at, r)
        _join_one(dense, sparse, dst[r.offset : r.offset + r.length], r)
        done = r.offset + r.length
    if len(src) - at != raw_len - done:
        raise ChunkCorrupt(
            f"byte-split data holds {len(src)} bytes, not what its regions table describes "
            f"for {raw_len}; the entry is damaged — drop it and fetch the shard again"
        )
    dst[done:] = src[at:]
    return out


class _Sparse(NamedTuple):
    """A sparse stream read back: byte ``k`` of the elements at ``where`` is ``values``, else 0."""

    k: int
    where: np.ndarray  # element indices, ascending
    values: np.ndarray  # uint8, one for each index


def _streams(
    src: np.ndarray, at: int, region: Region
) -> tuple[list[tuple[int, np.ndarray]], list[_Sparse], int]:
    """The region's stored streams read from ``src`` at ``at``: (k, dense), sparse ones; the end.

    A sparse stream is not expanded to a dense one: its bytes are written
    straight into their elements (:func:`_join_one`), which spares a zeroed
    stream, a scatter into it and a shift and an OR of the whole of it.
    """
    count = region.length // region.width
    dense: list[tuple[int, np.ndarray]] = []
    sparse: list[_Sparse] = []
    for k in range(region.width):
        if region.constant >> k & 1:
            continue
        if region.sparse >> k & 1:
            bits = src[at : at + (count + 7) // 8]
            present = np.unpackbits(bits, count=count, bitorder="little").view(bool)
            where = np.flatnonzero(present)  # of a bool array: 7x that of the same uint8s
            at += len(bits)
            values = src[at : at + len(where)]
            if len(bits) != (count + 7) // 8 or len(values) != len(where):
                raise ChunkCorrupt(_SHORT)
            sparse.append(_Sparse(k, where, values))
            at += len(where)
        else:
            stream = src[at : at + count]
            if len(stream) != count:
                raise ChunkCorrupt(_SHORT)
            dense.append((k, stream))
            at += count
    return dense, sparse, at


_SHORT = (
    "byte-split data ends inside one of its streams; the entry is damaged — drop it and "
    "fetch the shard again"
)


def _join_one(
    dense: list[tuple[int, np.ndarray]], sparse: list[_Sparse], dst: np.ndarray, region: Region
) -> None:
    # Little-endian words: byte k of each element is dense stream k shifted left by 8k. Each
    # step is one vectorised pass over a whole stream; a constant stream costs nothing
    # unless it is non-zero (then one OR at the end). Sparse streams come last, each byte
    # written into its element in place (an index array: 4x numpy's boolean-mask
    # assignment): on token ids, whose second byte is the sparse one, the words are then
    # their low bytes cast, with no shift at all.
    # Dense streams in the low bytes only (token ids whose second byte is dense, under
    # 65,536) are joined in words as narrow as they need, cast to the full width once:
    # shifting and ORing 2-byte words moves half the bytes of 4-byte ones.
    words = dst.view(_WORDS[region.width])
    if not dense:
        words.fill(region.values)
    else:
        narrow = next(w for w in WIDTHS if w > dense[-1][0])
        temp = None
        if len(dense) > 1 and narrow < region.width:  # one stream alone is one cast
            array, temp = recycled.buffers.allocate(len(words) * narrow)
            joined = array.view(_WORDS[narrow])
        else:
            joined = words
        above, top = dense[-1]
        np.copyto(joined, top, casting="unsafe")
        for k, stream in reversed(dense[:-1]):
            joined <<= 8 * (above - k)
            joined |= stream
            above = k
        if above:
            joined <<= 8 * above
        if temp is not None:
            np.copyto(words, joined)
            del joined, array, temp  # back to the pool
        if region.values:
            words |= region.values
    for k, where, values in sparse:
        where *= region.width  # the array is this call's own
        where += k
        dst[where] = values


def pack_regions(regions: Sequence[Region]) -> bytes:
    """The regions table as stored in a frame's payload, before the zstd data.

    With a sparse stream (:func:`has_sparse`) each entry carries the sparse
    mask too; without, the table is the one earlier releases wrote.
    """
    if has_sparse(regions):
        return _COUNT.pack(len(regions)) + b"".join(_SPARSE_ENTRY.pack(*r) for r in regions)
    return _COUNT.pack(len(regions)) + b"".join(_ENTRY.pack(*r[:5]) for r in regions)


def unpack_regions(
    payload: memoryview, raw_len: int, *, sparse: bool = False
) -> tuple[list[Region], int]:
    """Parse and check a regions table; returns it and its size in bytes.

    ``sparse``: the table of a ``BYTE_SPLIT_SPARSE_ZSTD`` frame, whose entries
    carry a sparse mask. A table that does not describe sorted, disjoint
    ranges of whole 2-, 4- or 8-byte elements inside the ``raw_len`` decoded
    bytes, with constants only for streams it marks constant and sparse
    streams only among those stored, raises :class:`ChunkCorrupt` before
    anything is decompressed.
    """
    entry = _SPARSE_ENTRY if sparse else _ENTRY
    if len(payload) < _COUNT.size:
        raise ChunkCorrupt("byte-split payload is shorter than its regions table")
    (count,) = _COUNT.unpack_from(payload)
    size = _COUNT.size + count * entry.size
    if size > len(payload):
        raise ChunkCorrupt(
            f"byte-split payload lists {count} regions, more than its {len(payload)} bytes hold; "
            "the entry is damaged — drop it and fetch the shard again"
        )
    regions: list[Region] = []
    done = 0
    for fields in entry.iter_unpack(payload[_COUNT.size : size]):
        r = Region(*fields)
        if (
            r.width not in WIDTHS
            or r.length == 0
            or r.length % r.width
            or r.offset < done
            or r.offset + r.length > raw_len
            or r.constant >> r.width
            or r.values & ~_bytes_of(r.constant)
            or r.sparse >> r.width
            or r.sparse & r.constant
        ):
            raise ChunkCorrupt(
                f"byte-split region {tuple(r)} is not a range of whole 2-, 4- or 8-byte "
                f"elements after the last one inside {raw_len} bytes with constants for its "
                "constant streams only (and sparse ones among those stored); the entry is "
                "damaged — drop it and fetch the shard again"
            )
        regions.append(r)
        done = r.offset + r.length
    return regions, size


def _bytes_of(mask: int) -> int:
    """The bits of the bytes that ``mask`` marks (bit k set: byte k, 0xFF << 8k)."""
    return sum(0xFF << 8 * k for k in range(8) if mask >> k & 1)
