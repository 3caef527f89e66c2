"""Arrow rows → batch tensors: kinds, one-copy gather, padding, lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.clients.batch_memory import ReusedMemory
from edgecache.clients.packed import Packed
from edgecache.clients.tensors import Gather, assemble, chunk_views, column_kinds, with_forms

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
    assert kinds["text"].kind == kinds["blob"].kind == "packed"  # the default form
    assert (kinds["text"].item, kinds["blob"].item) == ("string", "binary")
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
    blob = batch["blob"]
    assert isinstance(blob, Packed) and blob.values.dtype == torch.uint8
    assert blob.offsets.tolist() == [0, 1, 2, 2, 2] and blob[1] == bytes([7])
    assert blob.view(0).tolist() == [1] and blob.lengths().tolist() == [1, 1, 0, 0]
    assert batch["text"][3] == "s15" and list(batch["text"]) == [f"s{i}" for i in rows]


@pytest.mark.parametrize("binary", ["packed", "list"])
@pytest.mark.parametrize("ragged", ["padded", "packed"])
def test_every_form_gives_the_same_values_in_reused_memory(binary: str, ragged: str) -> None:
    kinds = with_forms(column_kinds(SCHEMA, None), binary=binary, ragged=ragged)  # type: ignore[arg-type]
    memory = ReusedMemory()
    rows = [3, 0, 9, 4]
    for round_ in range(3):  # the same buffer again: padding and offsets rewritten each time
        start = 10 * round_
        batch = assemble([Gather(chunk(start, 10), np.array(rows))], kinds, memory=memory)
        ids = [start + r for r in rows]
        assert batch["ids"].tolist() == [[i, i + 1, i + 2] for i in ids]
        assert batch["blob"] == [bytes([i % 256]) * (i % 3) for i in ids]
        assert isinstance(batch["blob"], Packed if binary == "packed" else list)
        assert batch["text"] == [f"s{i}" for i in ids]
        if ragged == "padded":
            assert batch["ragged_lengths"].tolist() == [i % 4 for i in ids]
            padded = batch["ragged"].tolist()
        else:
            assert batch["ragged"].tolist() == [list(range(i % 4)) for i in ids]
            padded = batch["ragged"].padded()[0].tolist()
        assert padded == [list(range(i % 4)) + [0] * (3 - i % 4) for i in ids]
        del batch
    assert memory.idle == 1  # one buffer, handed out again each time


def test_a_batch_keeps_its_buffer_while_any_view_of_it_lives() -> None:
    memory = ReusedMemory()
    kinds = column_kinds(SCHEMA, ["ids", "blob"])
    first = assemble([Gather(chunk(0, 10), np.arange(10))], kinds, memory=memory)
    kept = first["ids"][2:4]  # a view outlives the batch
    blob = first["blob"]
    del first
    second = assemble([Gather(chunk(50, 10), np.arange(10))], kinds, memory=memory)
    assert kept.tolist() == [[2, 3, 4], [3, 4, 5]] and blob[5] == bytes([5]) * 2
    assert second["ids"][0].tolist() == [50, 51, 52]


def test_packed_moves_pins_and_pickles_like_tensors() -> None:
    import pickle

    values = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    packed = Packed(values, torch.tensor([0, 2, 2, 5]), "binary")
    assert len(packed) == 3 and packed.tolist() == [b"\x01\x02", b"", b"\x03\x04\x05"]
    assert pickle.loads(pickle.dumps(packed)) == packed
    moved = packed.to("cpu", non_blocking=True)
    assert moved == packed and moved.offsets.dtype == torch.int64
    numbers = Packed(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 3]), "list")
    padded, lengths = numbers.padded(-1)
    assert padded.tolist() == [[1.0, -1.0], [2.0, 3.0]] and lengths.tolist() == [1, 2]
    # A list item is a 1-D tensor however it is reached: indexing, slicing or iterating
    # (iterating gave Python lists); tolist() is the one that gives lists.
    for items in (list(numbers), numbers[0:2], [numbers[0], numbers[1]]):
        assert all(isinstance(x, torch.Tensor) for x in items)
        assert [x.tolist() for x in items] == [[1.0], [2.0, 3.0]]
    assert numbers.tolist() == [[1.0], [2.0, 3.0]]
    assert packed.cpu() is packed and packed.cpu().device.type == "cpu"
    with pytest.raises(IndexError):
        packed.view(3)


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


@pytest.mark.parametrize("kind", [pa.string(), pa.binary(), pa.large_string()])
def test_dictionary_strings_are_packed_like_plain_ones(kind: pa.DataType) -> None:
    """Strings stored as a dictionary (pandas categoricals written to Parquet) came back as
    lists even with binary="packed": one pickled object per sample in workers."""
    words = ["cat", "", "dog", "ünïcode", "cat"]
    values = [w.encode() if kind == pa.binary() else w for w in words]
    column = pa.array(values, kind).dictionary_encode()
    batch = pa.record_batch([column], names=["label"])
    (packed,) = column_kinds(batch.schema, None)
    assert (packed.kind, packed.item) == ("packed", "binary" if kind == pa.binary() else "string")
    rows = np.array([4, 0, 3, 1, 2])
    got = assemble([Gather(batch, rows)], [packed])["label"]
    assert isinstance(got, Packed)
    assert [got[i] for i in range(len(rows))] == [values[r] for r in rows]
    (listed,) = with_forms([packed], binary="list")
    assert assemble([Gather(batch, rows)], [listed])["label"] == [values[r] for r in rows]
    nulls = pa.record_batch([pa.array(["a", None], kind).dictionary_encode()], names=["label"])
    with pytest.raises(ValueError, match="nulls"):
        assemble([Gather(nulls, np.array([0, 1]))], [packed])


def test_a_padded_list_whose_lengths_name_a_column_is_refused() -> None:
    """``toks`` padded beside a data column ``toks_lengths``: the lengths silently replaced it."""
    schema = pa.schema([("toks", pa.list_(pa.int32())), ("toks_lengths", pa.int64())])
    with pytest.raises(ValueError, match="toks_lengths.*ragged='packed'"):
        with_forms(column_kinds(schema, None))
    assert with_forms(column_kinds(schema, None), ragged="packed")  # no lengths column then
    assert with_forms(column_kinds(schema, ["toks"]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.filterwarnings("error")
def test_large_byte_values_copy_alike_whatever_torch_threads(threads: int) -> None:
    # Rows of >= 512 bytes on average take one torch.cat per batch where torch has one
    # intra-op thread (DataLoader workers), the per-row copy otherwise: same bytes both ways,
    # and through the chunks' views (the pipeline's gathers: each row's bounds as ints).
    rng = np.random.default_rng(threads)
    schema = pa.schema([("image", pa.binary()), ("text", pa.string())])

    def images(start: int, rows: int) -> pa.RecordBatch:
        sizes = rng.integers(0, 4096, rows)
        blobs = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in sizes]
        offsets = np.cumsum([0, *map(len, blobs)], dtype=np.int32)
        # Read-only value bytes, as LMDB's views are (torch warns on non-writable arrays).
        data = pa.py_buffer(memoryview(b"".join(blobs)))
        image = pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets), data])
        return pa.record_batch(
            [image, pa.array([f"t{start + i}" for i in range(rows)])], schema=schema
        )

    a, b = images(0, 12), images(12, 9).slice(1)
    kinds = column_kinds(schema, None)
    views = {"a": chunk_views(a, kinds), "b": chunk_views(b, kinds)}
    assert all(v["image"].large is not None for v in views.values())  # type: ignore[union-attr]
    expected = [a.column(0)[r].as_py() for r in (11, 0, 5, 5)]
    expected += [b.column(0)[r].as_py() for r in (7, 2)]
    assert not a.column(0).buffers()[2].is_mutable
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        memory = ReusedMemory()
        for with_views in (False, True, False, True):  # reused memory: each overwrites the last
            gathers = [
                Gather(a, np.array([11, 0, 5, 5]), views["a"] if with_views else None),
                Gather(b, np.array([7, 2]), views["b"] if with_views else None),
            ]
            batch = assemble(gathers, kinds, memory=memory)
            image = batch["image"]
            assert isinstance(image, Packed) and list(image) == expected
            assert image.offsets.tolist() == np.cumsum([0, *map(len, expected)]).tolist()
            assert batch["text"] == ["t11", "t0", "t5", "t5", "t20", "t15"]
            del batch, image
    finally:
        torch.set_num_threads(before)


_VARIABLE = [
    pa.binary(),
    pa.large_binary(),
    pa.string(),
    pa.large_string(),
    pa.binary(3),
    pa.dictionary(pa.int16(), pa.string()),
    pa.list_(pa.int64()),
    pa.large_list(pa.int16()),
]


def _values_of(kind: pa.DataType, draw: st.DrawFn, rows: int) -> pa.Array:
    if pa.types.is_fixed_size_binary(kind):
        return pa.array([draw(st.binary(min_size=3, max_size=3)) for _ in range(rows)], kind)
    if pa.types.is_dictionary(kind):
        words = draw(st.lists(st.text(max_size=4), min_size=1, max_size=5))
        picks = [draw(st.sampled_from(words)) for _ in range(rows)]
        return pa.array(picks, pa.string()).dictionary_encode().cast(kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lists = st.lists(st.integers(-100, 100), max_size=4)
        return pa.array([draw(lists) for _ in range(rows)], kind)
    item = (
        st.text(max_size=6)
        if pa.types.is_string(kind) or pa.types.is_large_string(kind)
        else st.binary(max_size=6)
    )
    return pa.array([draw(item) for _ in range(rows)], kind)


@st.composite
def _gathers(draw: st.DrawFn) -> tuple[pa.DataType, list[tuple[pa.RecordBatch, list[int]]]]:
    kind = draw(st.sampled_from(_VARIABLE))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(1, 12))
        batch = pa.record_batch([_values_of(kind, draw, rows)], names=["v"])
        skip = draw(st.integers(0, rows - 1))  # a sliced chunk: offsets start mid-buffer
        batch = batch.slice(skip)
        picked = draw(st.lists(st.integers(0, batch.num_rows - 1), min_size=1, max_size=6))
        parts.append((batch, picked))
    return kind, parts


@settings(max_examples=150, deadline=None)
@given(_gathers(), st.sampled_from(["padded", "packed"]))
def test_a_chunks_row_table_gathers_what_its_column_holds(
    case: tuple[pa.DataType, list[tuple[pa.RecordBatch, list[int]]]], ragged: str
) -> None:
    """Gathers through each chunk's views (RowTable, worked out once per chunk, as the
    pipeline does) and straight from the column give the rows' own values."""
    _, parts = case
    kinds = with_forms(column_kinds(parts[0][0].schema, None), ragged=ragged)  # type: ignore[arg-type]
    expected = [batch.column(0)[r].as_py() for batch, rows in parts for r in rows]
    for with_views in (False, True):
        gathers = [
            Gather(b, np.array(rows), chunk_views(b, kinds) if with_views else None)
            for b, rows in parts
        ]
        got = assemble(gathers, kinds)["v"]
        if isinstance(got, Packed) and got.kind == "list":
            got = [got.view(i).tolist() for i in range(len(expected))]
        elif isinstance(got, torch.Tensor):  # padded lists
            lengths = assemble(gathers, kinds)["v_lengths"].tolist()
            got = [row[:n] for row, n in zip(got.tolist(), lengths, strict=True)]
        else:
            got = list(got)
        assert got == expected


@pytest.mark.parametrize("arrow_type", [pa.uint16(), pa.uint32(), pa.uint64(), pa.uint8()])
@pytest.mark.parametrize("ragged", ["padded", "packed"])
def test_unsigned_token_lists_pad_like_signed_ones(arrow_type: pa.DataType, ragged: str) -> None:
    """Token ids stored as list<uint16>: torch has no index_put for uint16/32/64 on CPU,
    and padding them (ragged="padded", Packed.padded, collate_samples) raised."""
    top = {8: 255, 16: 65535, 32: 2**32 - 1, 64: 2**63}[arrow_type.bit_width]
    values = [[top, 1], [], [2, 3, top]]
    batch_schema = pa.schema([("tokens", pa.list_(arrow_type))])
    table = pa.record_batch([pa.array(values, pa.list_(arrow_type))], schema=batch_schema)
    kinds = with_forms(column_kinds(batch_schema, None), binary="packed", ragged=ragged)  # type: ignore[arg-type]
    batch = assemble([Gather(table, np.arange(3))], kinds, memory=ReusedMemory())
    tokens = batch["tokens"] if ragged == "padded" else batch["tokens"].padded()[0]
    assert tokens.tolist() == [[top, 1, 0], [0, 0, 0], [2, 3, top]]
    assert str(tokens.dtype) == f"torch.uint{arrow_type.bit_width}"


@pytest.mark.parametrize("binary", ["packed", "list"])
def test_view_columns_read_like_plain_ones(binary: str) -> None:
    """A version with a string_view column (published from Polars' files): Arrow has no
    take for views, and the first batch raised ArrowNotImplementedError."""
    texts, blobs = ["a", "", "ccc", "dd"], [b"x", b"yy", b"", b"\\x00z"]
    views = pa.schema([("text", pa.string_view()), ("blob", pa.binary_view())])
    table = pa.record_batch(
        [pa.array(texts, pa.string_view()), pa.array(blobs, pa.binary_view())], schema=views
    )
    kinds = with_forms(column_kinds(views, None), binary=binary)  # type: ignore[arg-type]
    rows = np.array([3, 0, 2])
    batch = assemble([Gather(table, rows)], kinds, memory=ReusedMemory())
    assert batch["text"] == [texts[r] for r in rows]
    assert batch["blob"] == [blobs[r] for r in rows]
    assert isinstance(batch["text"], Packed if binary == "packed" else list)


def test_a_dictionary_of_string_views_reads_like_one_of_strings() -> None:
    """The dictionary's values were read through offsets a view has none of: garbage."""
    values = pa.array(["ab", "c", "def"], pa.string_view())
    column = pa.DictionaryArray.from_arrays(pa.array([2, 0, 1, 0], pa.int32()), values)
    schema = pa.schema([("text", column.type)])
    batch = pa.record_batch([column], schema=schema)
    kinds = with_forms(column_kinds(schema, None), binary="packed")
    out = assemble([Gather(batch, np.array([0, 1, 3]))], kinds, memory=ReusedMemory())
    assert out["text"] == ["def", "ab", "ab"]
