"""Arrow rows → batch tensors: kinds, one-copy gather, padding, lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from edgecache.clients.tensors import Gather, assemble, column_kinds

SCHEMA = pa.schema(
    [
        ("ids", pa.list_(pa.int32(), 3)),
        ("grid", pa.list_(pa.list_(pa.float32(), 2), 2)),
        ("ragged", pa.list_(pa.int64())),
        ("flag", pa.bool_()),
        ("text", pa.string()),
        ("blob", pa.binary()),
    ]
)


def chunk(start: int, rows: int) -> pa.RecordBatch:
    r = range(start, start + rows)
    return pa.record_batch(
        [
            pa.array([[i, i + 1, i + 2] for i in r], SCHEMA.field("ids").type),
            pa.array([[[i, -i], [0.5, 1.5]] for i in r], SCHEMA.field("grid").type),
            pa.array([list(range(i % 4)) for i in r], pa.list_(pa.int64())),
            pa.array([i % 2 == 0 for i in r]),
            pa.array([f"s{i}" for i in r]),
            pa.array([bytes([i % 256]) * (i % 3) for i in r]),
        ],
        schema=SCHEMA,
    )


def test_kinds_and_assembly_across_chunks() -> None:
    kinds = {k.name: k for k in column_kinds(SCHEMA, None)}
    assert kinds["ids"].kind == "fixed" and kinds["ids"].shape == (3,)
    assert kinds["grid"].shape == (2, 2) and kinds["ragged"].kind == "ragged"
    assert kinds["text"].kind == kinds["blob"].kind == "list"
    a, b = chunk(0, 10), chunk(10, 10).slice(2)  # a sliced chunk too
    batch = assemble(
        [Gather(a, np.array([1, 7])), Gather(b, np.array([0, 3]))],
        list(kinds.values()),
        pin_memory=False,
    )
    rows = [1, 7, 12, 15]
    assert batch["ids"].tolist() == [[i, i + 1, i + 2] for i in rows]
    assert batch["ids"].dtype == torch.int32
    assert batch["grid"].shape == (4, 2, 2) and batch["grid"][2, 0, 1] == -12
    assert batch["ragged_lengths"].tolist() == [i % 4 for i in rows]
    assert batch["ragged"].shape == (4, 3) and batch["ragged"][1].tolist() == [0, 1, 2]
    assert batch["ragged"][0].tolist() == [0, 0, 0]  # length 1 → [0] then padding
    assert batch["flag"].tolist() == [i % 2 == 0 for i in rows]
    assert batch["text"] == [f"s{i}" for i in rows]
    assert batch["blob"] == [bytes([i % 256]) * (i % 3) for i in rows]


def test_unknown_columns_and_nulls_are_refused() -> None:
    with pytest.raises(KeyError, match="not in the dataset"):
        column_kinds(SCHEMA, ["ids", "nope"])
    schema = pa.schema([("x", pa.int32())])
    nulls = pa.record_batch([pa.array([1, None], pa.int32())], schema=schema)
    with pytest.raises(ValueError, match="has nulls"):
        assemble([Gather(nulls, np.array([0, 1]))], column_kinds(schema, None), pin_memory=False)


@pytest.mark.parametrize("rows", [[0, 10], [-1, 2], [10]])
def test_rows_outside_the_chunk_are_refused_not_clipped(rows: list[int]) -> None:
    # Fixed columns gather with mode="clip": an index out of range must raise, never
    # silently repeat the chunk's first or last row.
    kinds = column_kinds(SCHEMA, ["ids"])
    with pytest.raises(IndexError, match="outside the chunk"):
        assemble([Gather(chunk(0, 10), np.array(rows))], kinds, pin_memory=False)
