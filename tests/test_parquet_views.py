"""Parquet string_view / binary_view columns: held to the same dictionary-bomb limits.

pyarrow writes a table's view columns to Parquet with the Arrow schema saying so,
and reads them back as views. The reader took only string/binary columns as
dictionaries, so a view column of one value repeated on every row was decoded
whole, past MAX_DECODED_BYTES, before the limit was checked.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess import limits, read_source
from edgecache.v1 import manifest_pb2 as pb

MiB = 1 << 20


def view_parquet(value_bytes: int, rows: int, kind: pa.DataType) -> bytes:
    """One random value on every row of a view column; every view points at one copy."""
    value = np.random.default_rng(0).bytes(value_bytes).hex()[:value_bytes].encode()
    view = struct.pack("<i4sii", len(value), value[:4], 0, 0)  # length, prefix, buffer, offset
    column = pa.Array.from_buffers(
        kind, rows, [None, pa.py_buffer(view * rows), pa.py_buffer(value)]
    )
    out = io.BytesIO()
    pq.write_table(pa.table({"s": column}), out, compression="zstd")
    return out.getvalue()


@pytest.fixture
def own_pool() -> Iterator[pa.MemoryPool]:
    """A default memory pool of this test's own, so its peak is this test's peak."""
    before = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(before)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(before)


@pytest.mark.parametrize("kind", [pa.string_view(), pa.binary_view()], ids=str)
def test_a_parquet_view_column_bomb_is_refused_before_expanding(
    kind: pa.DataType, monkeypatch: pytest.MonkeyPatch, own_pool: pa.MemoryPool
) -> None:
    data = view_parquet(32 << 10, 4096, kind)  # 128 MiB of values when expanded
    assert len(data) < 64 << 10
    assert pq.ParquetFile(pa.BufferReader(data)).schema_arrow.field("s").type == kind
    monkeypatch.setattr(limits, "MAX_DECODED_BYTES", 16 * MiB)
    with pytest.raises(MalformedShard, match=r"s3://b/p\.parquet decodes to more than 16\.0 MiB"):
        list(read_source(data, fmt=pb.SOURCE_FORMAT_PARQUET, source="s3://b/p.parquet"))
    assert own_pool.max_memory() < 16 * MiB


@pytest.mark.parametrize("kind", [pa.string_view(), pa.binary_view()], ids=str)
def test_parquet_view_columns_expand_a_slice_at_a_time_keeping_their_type(
    kind: pa.DataType, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = view_parquet(32 << 10, 256, kind)  # 8 MiB expanded
    monkeypatch.setattr(limits, "BATCH_DECODED_BYTES", 1 * MiB)
    batches = list(read_source(data, fmt=pb.SOURCE_FORMAT_PARQUET, source="p.parquet"))
    assert sum(b.num_rows for b in batches) == 256
    assert all(b.schema.field("s").type == kind for b in batches)
    assert max(b.nbytes for b in batches) <= 1 * MiB + (32 << 10) + 4096
    values = {v for b in batches for v in b.column(0).to_pylist()}
    assert len(values) == 1
    assert len(values.pop()) == 32 << 10


def test_parquet_view_columns_keep_their_nulls() -> None:
    out = io.BytesIO()
    table = pa.table({"s": pa.array(["a", None, "bc" * 20], pa.string_view())})
    pq.write_table(table, out)
    batches = list(read_source(out.getvalue(), fmt=pb.SOURCE_FORMAT_PARQUET, source="p"))
    assert pa.Table.from_batches(batches).equals(table)
