"""The byte-split chunk codec: its transposes, its regions table, and frames that carry it."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest
import zstandard
from datagen import TOKEN_SCHEMA, token_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecache.cache import byte_split
from edgecache.cache.codec import CodecOptions, decode_chunk, encode_shard
from edgecache.cache.errors import ChunkCorrupt
from edgecache.cache.frame import HEADER_SIZE, Codec, pack_frame, payload_view, read_header


def _stream(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


@st.composite
def buffers_with_spans(draw: st.DrawFn) -> tuple[pa.Buffer, list[byte_split.Span]]:
    """Bytes (often with constant byte streams) and sorted, disjoint spans at any alignment."""
    size = draw(st.integers(0, 4096))
    data = bytearray(draw(st.binary(min_size=size, max_size=size)))
    spans: list[byte_split.Span] = []
    at = 0
    for _ in range(draw(st.integers(0, 5))):
        width = draw(st.sampled_from(byte_split.WIDTHS))
        offset = at + draw(st.integers(0, 64))
        count = draw(st.integers(1, 40))
        if offset + count * width > len(data):
            break
        for k in draw(st.sets(st.integers(0, width - 1))):  # make these streams constant
            value = draw(st.sampled_from([0, 0xFF, draw(st.integers(0, 255))]))
            data[offset + k : offset + count * width : width] = bytes([value]) * count
        for k in draw(st.sets(st.integers(0, width - 1))):  # and these mostly zeros
            keep = draw(st.lists(st.booleans(), min_size=count, max_size=count))
            stream = data[offset + k : offset + count * width : width]
            data[offset + k : offset + count * width : width] = bytes(
                b if kept and b else 0 for b, kept in zip(stream, keep, strict=True)
            )
        spans.append((offset, count * width, width))
        at = offset + count * width
    return pa.py_buffer(bytes(data)), spans


@settings(max_examples=300, deadline=None)
@given(case=buffers_with_spans())
def test_join_undoes_split_for_any_spans(case: tuple[pa.Buffer, list[byte_split.Span]]) -> None:
    data, spans = case
    split, regions = byte_split.split(data, spans)
    sparse = byte_split.has_sparse(regions)
    dense = byte_split.stored_length(regions, data.size)
    assert split.size < dense if sparse else split.size == dense
    assert byte_split.join(split, regions, data.size).to_pybytes() == data.to_pybytes()
    raw = np.frombuffer(data, np.uint8)
    for r in regions:  # constant streams are exactly those holding one value
        elements = raw[r.offset : r.offset + r.length].reshape(-1, r.width)
        for k in range(r.width):
            constant = len(set(elements[:, k].tolist())) == 1
            assert bool(r.constant >> k & 1) == constant
            if constant:
                assert (r.values >> 8 * k) & 0xFF == elements[0, k]
            share = np.count_nonzero(elements[:, k]) / len(elements)
            stored_sparse = byte_split.MIN_SPARSE_SHARE <= share <= byte_split.SPARSE_SHARE and (
                len(elements) + 7
            ) // 8 + share * len(elements) < len(elements)
            assert bool(r.sparse >> k & 1) == (stored_sparse and not constant)
    table = byte_split.pack_regions(regions)
    unpacked = byte_split.unpack_regions(memoryview(table), data.size, sparse=sparse)
    assert unpacked == (regions, len(table))
    if sparse:  # every byte of a sparse stream's data is needed: one fewer is refused
        with pytest.raises(ChunkCorrupt, match="damaged"):
            byte_split.join(split.slice(0, split.size - 1), regions, data.size)


def test_token_ids_and_labels_are_split_and_nothing_else() -> None:
    stream = _stream(token_batch(500))
    spans = byte_split.spans_of(stream)
    # The ids (500 x 64 int32) and the labels (500 int64); metadata and bitmaps stay.
    assert sorted((length, width) for _, length, width in spans) == [
        (500 * 8, 8),
        (500 * 64 * 4, 4),
    ]
    batch = pa.ipc.open_stream(stream).read_next_batch()
    ids = batch.column(0).values.buffers()[1]
    assert (ids.address - stream.address, ids.size, 4) in spans
    split, regions = byte_split.split(stream, spans)
    by_width = {r.width: r for r in regions}
    assert by_width[4].constant == 0b1100  # ids < 50,000: the two high byte streams are 0
    assert by_width[8].constant == 0b11111100 and by_width[8].values == 0  # labels 0..499
    # Ids under 256 are most of them, so their second byte is stored sparse; the low
    # byte is not (share ~1), and neither is the labels' second (244 of 500 are >= 256).
    assert by_width[4].sparse == 0b10 and by_width[8].sparse == 0b10
    assert split.size < byte_split.stored_length(regions, stream.size)


@pytest.mark.parametrize(
    "batch",
    [
        token_batch(500).slice(37, 400),  # sliced: the writer cuts the ids' buffer at an offset
        pa.record_batch(
            {
                "text": pa.array(["ab", None, "cde"] * 202).slice(6),  # offsets rebased
                "dict": pa.array(["x", "yy"] * 300).dictionary_encode(),
                "view": pa.array(["a" * 5] * 600, pa.string_view()),  # a layout left whole
                "ints": pa.array(range(600), pa.int16()),
            }
        ),
        pa.record_batch({"image": pa.array([bytes(range(256)) * 40] * 64)}),  # no span
    ],
)
def test_write_stream_splits_as_the_whole_stream_does(batch: pa.RecordBatch) -> None:
    """write_stream leaves the spans unwritten, and split gives what it gave on the whole."""
    whole = _stream(batch)
    stream, spans, sources = byte_split.write_stream(batch, batch.schema)
    assert stream.size == whole.size and spans == byte_split.spans_of(whole)
    if not spans:
        assert stream.equals(whole)
    split, regions = byte_split.split(stream, spans, sources)
    expected, expected_regions = byte_split.split(whole, spans)
    assert split.equals(expected) and regions == expected_regions
    assert byte_split.join(split, regions, whole.size).equals(whole)


def test_zipf_ids_second_byte_is_stored_sparse_smaller_and_decodes() -> None:
    """The case sparse streams are for: a chunk of token ids, framed so old readers refuse it."""
    batch = token_batch(2000, seed=3)
    frame = encode_shard([batch], TOKEN_SCHEMA)[0]
    assert read_header(frame).codec is Codec.BYTE_SPLIT_SPARSE_ZSTD
    assert decode_chunk(frame, TOKEN_SCHEMA).equals(batch)
    dense = _dense_frame(batch)
    assert read_header(dense).codec is Codec.BYTE_SPLIT_ZSTD
    assert decode_chunk(dense, TOKEN_SCHEMA).equals(batch)
    assert len(frame) < 0.97 * len(dense)  # ~5 % smaller: the second byte stream ~15 %


def _dense_frame(batch: pa.RecordBatch) -> bytes:
    """The frame an earlier release wrote for ``batch``: no stream sparse."""
    raw = _stream(batch)
    _, regions = byte_split.split(raw, byte_split.spans_of(raw))
    dense = [r._replace(sparse=0) for r in regions]  # split picks sparse streams itself
    src = np.frombuffer(raw, np.uint8)
    parts, done = [], 0
    for r in dense:
        parts.append(src[done : r.offset].tobytes())
        elements = src[r.offset : r.offset + r.length].reshape(-1, r.width)
        parts += [elements[:, k].tobytes() for k in range(r.width) if not r.constant >> k & 1]
        done = r.offset + r.length
    parts.append(src[done:].tobytes())
    data = pa.py_buffer(b"".join(parts))
    assert byte_split.join(data, dense, raw.size).equals(raw)
    payload = byte_split.pack_regions(dense) + zstandard.compress(data.to_pybytes(), 1)
    return pack_frame(payload, codec=Codec.BYTE_SPLIT_ZSTD, rows=batch.num_rows, raw_len=raw.size)


@pytest.mark.parametrize(
    ("dtype", "high", "dense_streams"),
    [
        (np.uint32, 32_000, 2),
        (np.uint64, 50_000, 2),
        (np.uint64, 1 << 24, 3),
        (np.uint32, 1 << 20, 3),
    ],
)
def test_dense_low_streams_join_through_narrow_words_into_reused_memory(
    dtype: type, high: int, dense_streams: int
) -> None:
    """Ids whose dense streams are their low bytes are joined in 2- or 4-byte words and
    widened once; the decode buffer is reused memory, so garbage left in it by an earlier
    decode must never show through (the high bytes are written, not assumed zero)."""
    ids = np.random.default_rng(7).integers(0, high, 1 << 16).astype(dtype)
    ids[::997] = high - 1  # every stream below the top one holds more than one value
    raw = pa.py_buffer(ids.tobytes())
    split, regions = byte_split.split(raw, [(0, raw.size, ids.itemsize)])
    (region,) = regions
    stored = ids.itemsize - region.constant.bit_count()
    assert stored == dense_streams and not region.sparse, region
    for _ in range(3):  # the pool hands back the buffers of the decodes before
        garbage = byte_split.recycled.buffers.allocate(raw.size)[0]
        garbage[:] = 0xA5
        del garbage
        joined = byte_split.join(split, regions, raw.size)
        assert np.array_equal(np.frombuffer(joined, dtype), ids)


def test_layouts_it_does_not_know_are_left_whole() -> None:
    batch = pa.record_batch(
        {
            "view": pa.array(["a" * 5] * 400, pa.string_view()),
            "union": pa.UnionArray.from_sparse(
                pa.array([0, 1] * 200, pa.int8()),
                [pa.array(range(400), pa.int64()), pa.array([1.0] * 400)],
            ),
            "ids": pa.array(range(1000, 1400), pa.int64()),
        }
    )
    stream = _stream(batch)
    spans = byte_split.spans_of(stream)
    assert [width for *_, width in spans] == [8]  # only the int64 column
    frame = encode_shard([batch], batch.schema)[0]
    assert decode_chunk(frame, batch.schema).equals(batch)


def test_a_chunk_with_little_to_split_is_a_plain_zstd_frame() -> None:
    """Encoded images: only their offsets could be split, not worth a copy of the chunk."""
    blobs = pa.array([bytes(range(256)) * 40] * 64, pa.binary())
    batch = pa.record_batch({"image": blobs, "label": pa.array(range(64), pa.int64())})
    assert byte_split.spans_of(_stream(batch)) == []
    frame = encode_shard([batch], batch.schema)[0]
    assert read_header(frame).codec is Codec.ZSTD
    assert decode_chunk(frame, batch.schema).equals(batch)


def _table(*entries: tuple[int, int, int, int, int]) -> bytes:
    return struct.pack("<I", len(entries)) + b"".join(struct.pack("<QQBBQ", *e) for e in entries)


def _forged(table: bytes, *, codec: Codec = Codec.BYTE_SPLIT_ZSTD) -> bytes:
    """A frame with a valid checksum whose regions table is ``table``."""
    raw = _stream(token_batch(50)).to_pybytes()
    payload = table + zstandard.ZstdCompressor(level=1).compress(raw)
    return pack_frame(payload, codec=codec, rows=50, raw_len=len(raw))


def _sparse_table(*entries: tuple[int, int, int, int, int, int]) -> bytes:
    return struct.pack("<I", len(entries)) + b"".join(struct.pack("<QQBBQB", *e) for e in entries)


@pytest.mark.parametrize(
    ("table", "why"),
    [
        (_sparse_table((64, 16, 4, 0, 0, 0b10000)), "sparse"),  # a stream beyond the width
        (_sparse_table((64, 16, 4, 0b0010, 0, 0b0010)), "sparse"),  # a constant one
        (_sparse_table((64, 16, 4, 0, 0, 0b0010)), "regions table"),  # sizes that disagree
        (_table((64, 16, 4, 0, 0)), "damaged"),  # a dense entry read as a sparse one
    ],
)
def test_a_damaged_sparse_table_is_refused(table: bytes, why: str) -> None:
    frame = _forged(table, codec=Codec.BYTE_SPLIT_SPARSE_ZSTD)
    for verify in (True, False):
        with pytest.raises(ChunkCorrupt, match=why):
            decode_chunk(frame, TOKEN_SCHEMA, verify=verify)


@pytest.mark.parametrize(
    ("table", "why"),
    [
        (b"", "regions"),  # the zstd magic read as a count
        (b"\x01\x00", "regions"),
        (struct.pack("<I", 10**6), "more than its"),
        (_table((0, 16, 1, 0, 0)), "not a range"),  # width 1
        (_table((0, 24, 3, 0, 0)), "not a range"),  # width 3
        (_table((0, 15, 4, 0, 0)), "not a range"),  # 15 % 4
        (_table((0, 0, 4, 0, 0)), "not a range"),  # empty
        (_table((1 << 40, 16, 4, 0, 0)), "not a range"),  # outside
        (_table((2**64 - 8, 16, 8, 0, 0)), "not a range"),  # wraps
        (_table((64, 16, 4, 0, 0), (72, 16, 4, 0, 0)), "not a range"),  # overlapping
        (_table((128, 16, 4, 0, 0), (64, 16, 4, 0, 0)), "not a range"),  # unsorted
        (_table((64, 16, 4, 0b10000, 0)), "constant"),  # a stream beyond the width
        (_table((64, 16, 4, 0b0001, 0x0100)), "constant"),  # a value for a stored stream
    ],
)
def test_a_damaged_regions_table_is_refused_before_decompressing(table: bytes, why: str) -> None:
    frame = _forged(table)
    for verify in (True, False):
        with pytest.raises(ChunkCorrupt, match=why):
            decode_chunk(frame, TOKEN_SCHEMA, verify=verify)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=st.binary(max_size=80), seed=st.integers(0, 2**32 - 1), sparse=st.booleans())
def test_any_regions_table_decodes_or_is_corrupt(table: bytes, seed: int, sparse: bool) -> None:
    """Checksummed frames with arbitrary tables (a buggy or hostile writer) never crash a reader."""
    rng = np.random.default_rng(seed)
    if table and rng.random() < 0.5:  # often a plausible count, to reach the entries' checks
        count = min(len(table) // (27 if sparse else 26), int(rng.integers(0, 4)))
        table = struct.pack("<I", count) + table[4:]
    codec = Codec.BYTE_SPLIT_SPARSE_ZSTD if sparse else Codec.BYTE_SPLIT_ZSTD
    try:
        batch = decode_chunk(_forged(table, codec=codec), TOKEN_SCHEMA)
    except ChunkCorrupt:
        return
    assert batch.num_rows == 50  # decoded: rows and schema were checked like any chunk's


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, 10**9), bit=st.integers(0, 7), verify=st.booleans())
def test_a_flipped_bit_anywhere_is_caught(position: int, bit: int, verify: bool) -> None:
    sparse = encode_shard([token_batch(300, seed=5)], TOKEN_SCHEMA)[0]
    assert read_header(sparse).codec is Codec.BYTE_SPLIT_SPARSE_ZSTD
    dense = _dense_frame(token_batch(300, seed=5))
    for frame in (sparse, dense):
        damaged = bytearray(frame)
        damaged[position % len(frame)] ^= 1 << bit
        if verify:
            with pytest.raises(ChunkCorrupt):
                decode_chunk(bytes(damaged), TOKEN_SCHEMA)
            continue
        # Without the checksum a flip inside the zstd data may decode to other values, but
        # the codec never lets it through as anything other than a valid batch or ChunkCorrupt.
        try:
            decode_chunk(bytes(damaged), TOKEN_SCHEMA, verify=False)
        except ChunkCorrupt:
            pass


def test_a_payload_shorter_than_a_count_is_corrupt() -> None:
    frame = pack_frame(b"\x01", codec=Codec.BYTE_SPLIT_ZSTD, rows=1, raw_len=100)
    with pytest.raises(ChunkCorrupt, match="shorter than its regions table"):
        decode_chunk(frame)


def test_frames_of_every_codec_decode_side_by_side() -> None:
    """Old versions keep their plain zstd and uncompressed chunks; a reader takes all three."""
    batch = token_batch(200, seed=9)
    raw = _stream(batch).to_pybytes()
    old_zstd = pack_frame(
        zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw),
        codec=Codec.ZSTD,
        rows=200,
        raw_len=len(raw),
    )
    old_none = pack_frame(raw, codec=Codec.NONE, rows=200, raw_len=len(raw))
    new = encode_shard([batch], TOKEN_SCHEMA)[0]
    stored = (Codec.NONE, Codec.ZSTD, Codec.BYTE_SPLIT_ZSTD, Codec.BYTE_SPLIT_SPARSE_ZSTD)
    assert stored == (0, 1, 2, 3)  # stored values
    # Encoding a version that names plain zstd still writes exactly the old frames.
    assert encode_shard([batch], TOKEN_SCHEMA, CodecOptions(compression="zstd"))[0] == old_zstd
    for frame in (old_zstd, old_none, _dense_frame(batch), new):
        assert decode_chunk(frame, TOKEN_SCHEMA).equals(batch)
    payload = payload_view(new, read_header(new))
    assert len(new) - HEADER_SIZE == len(payload) < len(old_zstd) - HEADER_SIZE


def test_a_codec_from_a_newer_edgecache_says_to_upgrade() -> None:
    """A reader older than the writer must say what to do, not only that the entry is bad."""
    frame = pack_frame(b"\x00" * 16, codec=Codec.NONE, rows=1, raw_len=16)
    newer = bytearray(frame)
    newer[3] = int(max(Codec)) + 1  # the codec byte, after the magic and the format
    with pytest.raises(ChunkCorrupt, match=r"newer than this edgecache reads \(codecs 0-3\)"):
        read_header(bytes(newer))
