import importlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datagen import TOKEN_SCHEMA, token_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecache.cache.codec import (
    MAX_CHUNK_FACTOR,
    CodecOptions,
    ShardEncoder,
    decode_chunk,
    encode_shard,
)
from edgecache.cache.errors import ChunkCorrupt, ChunkTruncated, EmptyShard, SchemaMismatch
from edgecache.cache.frame import HEADER_SIZE, Codec, read_header, verify_frame
from edgecache.cache.row_grid import fixed_row_bytes, rows_per_window
from edgecache.v1 import manifest_pb2 as pb


def roundtrip(frames: list[bytes], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_batches([decode_chunk(f, schema) for f in frames], schema=schema)


# Zipf ids' second byte is mostly zeros: byte-split stores it sparse (a frame of its own codec).
CODECS = {"byte-split-zstd": Codec.BYTE_SPLIT_SPARSE_ZSTD, "zstd": Codec.ZSTD, "none": Codec.NONE}


@pytest.mark.parametrize("compression", sorted(CODECS))
def test_round_trip_tokens(compression: str) -> None:
    batches = [token_batch(3000, seed=i, start=3000 * i) for i in range(4)]
    opts = CodecOptions(compression=compression, chunk_bytes=256 << 10)  # type: ignore[arg-type]
    frames = encode_shard(batches, TOKEN_SCHEMA, opts)
    assert len(frames) > 4
    assert roundtrip(frames, TOKEN_SCHEMA).equals(pa.Table.from_batches(batches))
    assert {read_header(f).codec for f in frames} == {CODECS[compression]}


def test_byte_split_stores_token_ids_smaller_than_plain_zstd() -> None:
    batches = [token_batch(20_000, seed=2)]
    sizes = {
        c: sum(map(len, encode_shard(batches, TOKEN_SCHEMA, CodecOptions(compression=c))))  # type: ignore[arg-type]
        for c in ("byte-split-zstd", "zstd")
    }
    assert sizes["byte-split-zstd"] < 0.85 * sizes["zstd"]
    assert CodecOptions().compression == "byte-split-zstd"  # the default for new versions


def test_byte_split_keeps_the_repeats_of_real_text() -> None:
    """Token ids of real text repeat phrases; splitting their bytes must not lose those matches.

    The standard library's sources through a BPE trained here (bench.datasets.text_tokens).
    With a zstd match table of 2^11 entries, tuned on independent Zipf ids, the split
    chunks of these stored ~1 % more than plain zstd-1's (10 % at 32 MiB); with 2^13, 2 % less.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        datasets = importlib.import_module("bench.datasets")
    finally:
        sys.path.pop(0)
    batches = datasets.text_tokens(4 << 20, vocabulary=8192)
    schema = batches[0].schema
    sizes = {
        c: sum(map(len, encode_shard(batches, schema, CodecOptions(compression=c))))  # type: ignore[arg-type]
        for c in ("byte-split-zstd", "zstd")
    }
    assert sizes["byte-split-zstd"] <= sizes["zstd"], sizes


def test_chunks_are_bounded() -> None:
    limit = 128 << 10
    frames = encode_shard(
        [token_batch(10_000)], TOKEN_SCHEMA, CodecOptions(compression="none", chunk_bytes=limit)
    )
    raw = [read_header(f).raw_len for f in frames]
    # IPC framing adds a schema message and padding on top of the Arrow buffers.
    assert max(raw) <= limit + 4096
    assert min(raw[:-1]) >= limit // 2


def test_zstd_shrinks_token_data() -> None:
    frames = encode_shard([token_batch(20_000)], TOKEN_SCHEMA)
    stored = sum(len(f) for f in frames)
    raw = sum(read_header(f).raw_len for f in frames)
    assert stored < 0.8 * raw


def test_oversized_row_gets_its_own_chunk() -> None:
    schema = pa.schema([("blob", pa.binary())])
    big = pa.record_batch([pa.array([b"x" * (64 << 10), b"y", b"z" * (64 << 10)])], schema=schema)
    frames = encode_shard([big], schema, CodecOptions(chunk_bytes=16 << 10))
    assert [read_header(f).rows for f in frames] == [1, 1, 1]
    assert roundtrip(frames, schema).column("blob").to_pylist() == big.column(0).to_pylist()


def test_uncompressed_decode_is_zero_copy() -> None:
    frame = encode_shard([token_batch(100)], TOKEN_SCHEMA, CodecOptions(compression="none"))[0]
    backing = pa.py_buffer(frame)
    batch = decode_chunk(backing, TOKEN_SCHEMA)
    values = batch.column(0).values.buffers()[1]
    assert backing.address <= values.address < backing.address + backing.size


def test_zero_row_batches_are_skipped_and_empty_shard_refused() -> None:
    enc = ShardEncoder(TOKEN_SCHEMA)
    assert enc.add(token_batch(0)) == []
    with pytest.raises(EmptyShard, match="no rows"):
        enc.finish()
    frames = encode_shard([token_batch(0), token_batch(10), token_batch(0)], TOKEN_SCHEMA)
    assert roundtrip(frames, TOKEN_SCHEMA).num_rows == 10


def test_wrong_schema_is_refused_on_encode_and_decode() -> None:
    other = pa.schema([("input_ids", pa.list_(pa.int64(), 64)), ("label", pa.int64())])
    enc = ShardEncoder(other)
    with pytest.raises(SchemaMismatch, match="'input_ids' is fixed_size_list<item: int32>"):
        enc.add(token_batch(5))
    frame = encode_shard([token_batch(5)], TOKEN_SCHEMA)[0]
    with pytest.raises(SchemaMismatch, match="publish a new version"):
        decode_chunk(frame, other)
    missing = pa.schema([("label", pa.int64())])
    with pytest.raises(SchemaMismatch, match="unexpected column 'input_ids'"):
        decode_chunk(frame, missing)


@pytest.mark.parametrize("compression", sorted(CODECS))
def test_every_flipped_byte_is_detected(compression: str) -> None:
    frame = encode_shard([token_batch(50)], TOKEN_SCHEMA, CodecOptions(compression=compression))[0]  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    positions = list(range(HEADER_SIZE)) + list(rng.integers(HEADER_SIZE, len(frame), 200))
    for pos in positions:
        damaged = bytearray(frame)
        damaged[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(ChunkCorrupt):  # ChunkTruncated is a ChunkCorrupt too
            decode_chunk(bytes(damaged), TOKEN_SCHEMA)


@pytest.mark.parametrize("compression", sorted(CODECS))
def test_every_header_bit_is_checked_even_without_the_checksum(compression: str) -> None:
    # decode_chunk(verify=False) trusts the checksum but not the header: every flipped bit
    # of magic, format, codec, rows and both lengths is still ChunkCorrupt (never a
    # MemoryError, an OverflowError or a ValueError of another kind).
    frame = encode_shard([token_batch(50)], TOKEN_SCHEMA, CodecOptions(compression=compression))[0]  # type: ignore[arg-type]
    for pos in range(HEADER_SIZE - 8):  # the last 8 bytes are the checksum
        for bit in range(8):
            damaged = bytearray(frame)
            damaged[pos] ^= 1 << bit
            with pytest.raises(ChunkCorrupt):
                decode_chunk(bytes(damaged), TOKEN_SCHEMA, verify=False)


def test_truncated_chunks() -> None:
    frame = encode_shard([token_batch(50)], TOKEN_SCHEMA)[0]
    with pytest.raises(ChunkTruncated, match="shorter than its 32-byte header"):
        decode_chunk(frame[:10])
    with pytest.raises(ChunkTruncated, match="truncated"):
        decode_chunk(frame[:-1])
    with pytest.raises(ChunkCorrupt):
        verify_frame(frame + b"\0")


def test_decode_on_threads_matches_serial() -> None:
    frames = encode_shard(
        [token_batch(20_000, seed=3)], TOKEN_SCHEMA, CodecOptions(chunk_bytes=64 << 10)
    )
    serial = [decode_chunk(f, TOKEN_SCHEMA) for f in frames]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda f: decode_chunk(f, TOKEN_SCHEMA), frames))
    assert all(a.equals(b) for a, b in zip(serial, threaded, strict=True))


def test_options_are_validated_and_read_from_spec() -> None:
    with pytest.raises(ValueError, match="compression"):
        CodecOptions(compression="lz4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="level"):
        CodecOptions(level=99)
    with pytest.raises(ValueError, match="chunk_bytes"):
        CodecOptions(chunk_bytes=10)
    spec = pb.PreprocessSpec(compression=pb.COMPRESSION_NONE, chunk_bytes=1 << 20)
    assert CodecOptions.from_spec(spec) == CodecOptions(compression="none", chunk_bytes=1 << 20)
    # Unset is what versions published before the choice existed carry: plain zstd-1.
    assert CodecOptions.from_spec(pb.PreprocessSpec()) == CodecOptions(compression="zstd")
    split = pb.PreprocessSpec(compression=pb.COMPRESSION_BYTE_SPLIT_ZSTD, compression_level=3)
    assert CodecOptions.from_spec(split) == CodecOptions(compression="byte-split-zstd", level=3)
    with pytest.raises(ValueError, match="does not know"):
        CodecOptions.from_spec(pb.PreprocessSpec(compression=99))  # type: ignore[arg-type]


# ---- property test: arbitrary schemas and chunk sizes round-trip exactly --------------------

_TYPES = {
    "int8": (pa.int8(), st.integers(-128, 127)),
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "uint32": (pa.uint32(), st.integers(0, 2**32 - 1)),
    "float32": (pa.float32(), st.floats(width=32, allow_nan=False)),
    "float64": (pa.float64(), st.floats(allow_nan=False)),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=40)),
    "binary": (pa.binary(), st.binary(max_size=3000)),
    "list_int32": (pa.list_(pa.int32()), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=30)),
    "list_str": (pa.list_(pa.string()), st.lists(st.text(max_size=5), max_size=5)),
    # Widths and layouts the byte-split codec handles each its own way:
    "int16": (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    "float16": (pa.float16(), st.sampled_from([np.float16(x) for x in (0.0, -1.5, 65504.0)])),
    "timestamp": (pa.timestamp("us", "UTC"), st.integers(0, 2**60)),
    "large_string": (pa.large_string(), st.text(max_size=20)),
    "fsl_uint16": (
        pa.list_(pa.uint16(), 3),
        st.lists(st.integers(0, 65535), min_size=3, max_size=3),
    ),
    "struct": (
        pa.struct([("a", pa.int32()), ("b", pa.string())]),
        st.fixed_dictionaries({"a": st.integers(-5, 5), "b": st.text(max_size=3)}),
    ),
    "map": (
        pa.map_(pa.int32(), pa.float64()),
        st.dictionaries(st.integers(0, 9), st.floats(allow_nan=False), max_size=3).map(
            lambda d: list(d.items())
        ),
    ),
    "decimal": (pa.decimal128(12, 2), st.decimals(-(10**9), 10**9, places=2)),
}


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    names = draw(st.lists(st.sampled_from(sorted(_TYPES)), min_size=1, max_size=5, unique=True))
    rows = draw(st.integers(1, 300))
    columns = {}
    for name in names:
        pa_type, values = _TYPES[name]
        nullable = draw(st.booleans())
        elem = st.one_of(st.none(), values) if nullable else values
        columns[name] = pa.array(draw(st.lists(elem, min_size=rows, max_size=rows)), type=pa_type)
    table = pa.table(columns)
    splits = sorted(draw(st.lists(st.integers(0, rows), max_size=4)))
    return table, [0, *splits, rows]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=tables(),
    chunk_bytes=st.integers(4 << 10, 64 << 10),
    compression=st.sampled_from(sorted(CODECS)),
    level=st.integers(-3, 6),
)
def test_codec_round_trip_property(data, chunk_bytes: int, compression: str, level: int) -> None:
    table, cuts = data
    batches = [
        b
        for lo, hi in zip(cuts, cuts[1:], strict=False)
        for b in table.slice(lo, hi - lo).to_batches()
    ]
    opts = CodecOptions(compression=compression, level=level, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
    frames = encode_shard(batches, table.schema, opts)
    out = roundtrip(frames, table.schema)
    assert out.equals(table)
    assert sum(read_header(f).rows for f in frames) == table.num_rows


def _reference_decode(frame: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """decode_chunk as it was with ``ZstdDecompressor().decompress`` into fresh bytes."""
    import zstandard

    from edgecache.cache.frame import payload_view

    header = verify_frame(frame)
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload_view(frame, header))
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(str(exc)) from exc
    if len(raw) != header.raw_len:
        raise ChunkCorrupt("length")
    return pa.ipc.open_stream(pa.py_buffer(raw)).read_next_batch()


def test_zstd_payload_edge_cases_decode_as_before() -> None:
    # Decompression writes into a pooled Arrow buffer (readinto) instead of fresh bytes:
    # the first frame must still be decoded exactly, its declared size enforced both
    # ways, and whatever follows it ignored, as ZstdDecompressor.decompress does.
    import zstandard

    from edgecache.cache.frame import pack_frame

    batch = token_batch(20, seed=1)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TOKEN_SCHEMA) as writer:
        writer.write_batch(batch)
    raw = sink.getvalue().to_pybytes()
    assert 256 < len(raw) < 65536
    compressed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    assert compressed[4] & 0xC0 == 0x40 and compressed[4] & 0x20  # 2-byte size, one segment

    def declaring(size: int) -> bytes:  # the same frame, lying about its content size
        return compressed[:5] + (size - 256).to_bytes(2, "little") + compressed[7:]

    cases = {
        "plain": (compressed, len(raw)),
        "frame after": (compressed + zstandard.ZstdCompressor().compress(b"zz"), len(raw)),
        "garbage after": (compressed + b"garbage!", len(raw)),
        "truncated": (compressed[:-5], len(raw)),
        "declares less": (declaring(len(raw) - 1), len(raw) - 1),
        "declares more": (declaring(len(raw) + 1), len(raw) + 1),
    }
    outcomes = {}
    for name, (payload, raw_len) in cases.items():
        frame = pack_frame(payload, codec=Codec.ZSTD, rows=20, raw_len=raw_len)
        try:
            want = _reference_decode(frame, TOKEN_SCHEMA)
        except ChunkCorrupt:
            with pytest.raises(ChunkCorrupt):
                decode_chunk(frame, TOKEN_SCHEMA)
            outcomes[name] = "corrupt"
            continue
        assert decode_chunk(frame, TOKEN_SCHEMA).equals(want), name
        outcomes[name] = "decoded"
    assert outcomes == {
        "plain": "decoded",
        "frame after": "decoded",
        "garbage after": "decoded",
        "truncated": "corrupt",
        "declares less": "corrupt",
        "declares more": "corrupt",
    }


def test_decoded_batches_survive_later_decodes() -> None:
    # Decompressed chunks live in pooled memory that is reused once freed; a batch
    # still referenced must never see a later chunk's bytes.
    batches = [token_batch(2000, seed=i, start=2000 * i) for i in range(6)]
    frames = encode_shard(batches, TOKEN_SCHEMA, CodecOptions(chunk_bytes=256 << 10))
    kept = [decode_chunk(f, TOKEN_SCHEMA) for f in frames[::2]]
    for _ in range(3):
        for f in frames:
            decode_chunk(f, TOKEN_SCHEMA)  # decoded and dropped at once: memory recycled
    again = [decode_chunk(f, TOKEN_SCHEMA) for f in frames[::2]]
    assert all(a.equals(b) for a, b in zip(kept, again, strict=True))


def test_the_most_compressible_chunk_still_decodes() -> None:
    """All-zero columns compress to ~4 bytes per 128 KiB block: within the size-claim bound."""
    import numpy as np

    batch = pa.record_batch({"z": pa.array(np.zeros(1 << 20, dtype=np.int64))})
    frames = encode_shard([batch], batch.schema, CodecOptions(compression="zstd", level=19))
    assert sum(decode_chunk(f).num_rows for f in frames) == 1 << 20


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=6),
    chunk_bytes=st.sampled_from([8 << 10, 20_000, 64 << 10]),
)
def test_fixed_width_rows_are_chunked_on_the_readers_window_grid(
    sizes: list[int], chunk_bytes: int
) -> None:
    """Whatever batches the source gives, chunks hold rows_per_window rows (the last the rest).

    Readers cut their shuffle windows on that grid from the manifest alone
    (clients.shuffle._windows), so each window is one chunk.
    """
    if not sum(sizes):
        return
    per_row = fixed_row_bytes(TOKEN_SCHEMA)
    assert per_row == 64 * 4 + 8
    grid = rows_per_window(per_row, chunk_bytes)
    # Through Parquet, as sources arrive: the batches then carry validity bitmaps that
    # Arrow's nbytes counts, which a size estimate would cut the chunks by.
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_batches([token_batch(sum(sizes))]), sink)
    table = pq.read_table(sink.getvalue())
    batches, start = [], 0
    for n in sizes:
        batches.extend(table.slice(start, n).to_batches() or [])
        start += n
    frames = encode_shard(batches, TOKEN_SCHEMA, CodecOptions(chunk_bytes=chunk_bytes))
    rows = [read_header(f).rows for f in frames]
    whole, rest = divmod(sum(sizes), grid)
    assert rows == [grid] * whole + ([rest] if rest else [])
    assert roundtrip(frames, TOKEN_SCHEMA).column("label").to_pylist() == list(range(sum(sizes)))


def test_variable_width_rows_have_no_grid() -> None:
    assert fixed_row_bytes(pa.schema([("text", pa.string()), ("label", pa.int64())])) is None
    assert fixed_row_bytes(pa.schema([("ids", pa.list_(pa.int32()))])) is None
    assert fixed_row_bytes(pa.schema([("flag", pa.bool_()), ("x", pa.float32())])) == 4.125


def test_rows_of_variable_width_follow_the_grid_they_are_given_up_to_a_cap() -> None:
    """The node passes the manifest's grid (row_grid.chunk_rows) for strings and binary.

    A chunk holds that many rows whatever their size, but rows far larger
    than the estimate close it at MAX_CHUNK_FACTOR * chunk_bytes instead.
    """
    schema = pa.schema([("blob", pa.binary())])
    small = pa.record_batch([pa.array([b"x" * 100] * 95)], schema=schema)
    frames = encode_shard_with(small, schema, chunk_rows=20, chunk_bytes=16 << 10)
    assert [read_header(f).rows for f in frames] == [20, 20, 20, 20, 15]
    big = pa.record_batch([pa.array([b"y" * (10 << 10)] * 30)], schema=schema)
    frames = encode_shard_with(big, schema, chunk_rows=20, chunk_bytes=16 << 10)
    rows = [read_header(f).rows for f in frames]
    assert sum(rows) == 30 and max(rows) < 20  # closed by the cap, off the grid
    assert max(read_header(f).raw_len for f in frames) <= MAX_CHUNK_FACTOR * (16 << 10) + 4096
    assert roundtrip(frames, schema).column("blob").to_pylist() == big.column(0).to_pylist()


def encode_shard_with(
    batch: pa.RecordBatch, schema: pa.Schema, *, chunk_rows: int, chunk_bytes: int
) -> list[bytes]:
    encoder = ShardEncoder(schema, CodecOptions(chunk_bytes=chunk_bytes), chunk_rows=chunk_rows)
    return encoder.add(batch) + encoder.finish()


def test_the_largest_chunk_the_encoder_may_write_is_one_every_reader_accepts() -> None:
    """--chunk-size goes up to 256 MiB and a chunk on the row grid to 4x that, but readers
    and peers refused messages over 256 MiB: a version published with --chunk-size 256MiB
    was staged, and every read and peer copy of it failed RESOURCE_EXHAUSTED ("Received
    message larger than max"), the copy as UNAVAILABLE, retried in vain (a helper's hunt)."""
    from edgecache.cache import codec, wire
    from edgecache.clients.channels import CHANNEL_OPTIONS
    from edgecache.edge import peers

    largest_raw = codec.MAX_CHUNK_FACTOR * codec.MAX_CHUNK_BYTES
    assert wire.MAX_FRAME_BYTES >= largest_raw + HEADER_SIZE + (1 << 20)  # IPC's own framing
    assert wire.MAX_MESSAGE_BYTES > wire.MAX_FRAME_BYTES
    for options in (CHANNEL_OPTIONS, peers._OPTIONS):
        assert dict(options)["grpc.max_receive_message_length"] == wire.MAX_MESSAGE_BYTES


def test_a_chunk_larger_than_a_reader_accepts_is_refused_when_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stored, it could never be read; refused naming what to do (a smaller --chunk-size)."""
    from edgecache.cache import codec
    from edgecache.cache.errors import ChunkTooLarge

    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 32 << 10)  # stands for 1 GiB
    batch = token_batch(2000, seed=1)
    options = CodecOptions(compression="none", chunk_bytes=1 << 20)
    with pytest.raises(ChunkTooLarge, match="smaller --chunk-size"):
        encode_shard([batch], TOKEN_SCHEMA, options)
    small = CodecOptions(compression="none", chunk_bytes=16 << 10)
    frames = encode_shard([batch], TOKEN_SCHEMA, small)
    assert all(len(f) <= 32 << 10 for f in frames) and len(frames) > 1
    # One row larger than the limit: no chunk size helps, and the advice says so.
    schema = pa.schema([("blob", pa.binary())])
    huge = pa.record_batch([pa.array([b"\1" * (64 << 10), b"x"])], schema=schema)
    tiny = CodecOptions(compression="none", chunk_bytes=4 << 10)
    with pytest.raises(ChunkTooLarge, match="no chunk size splits a row"):
        encode_shard([huge], schema, tiny)
