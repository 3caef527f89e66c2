import datetime
import importlib.metadata
import io
import json
import math
import re
import struct
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecache.cache.errors import MalformedShard, UnknownTransform
from edgecache.cache.preprocess import (
    FORMATS,
    describe,
    format_from_key,
    format_from_name,
    load_transform,
    parse_type,
    preprocess,
    read_source,
    register_transform,
    unregister_transform,
)
from edgecache.cache.preprocess import transforms as pp
from edgecache.cache.preprocess.casts import lossless_cast
from edgecache.v1 import manifest_pb2 as pb

SRC = "s3://bucket/prefix/part-3"
IDENTITY = pb.PreprocessSpec(transform="identity")
TABLE = pa.table(
    {
        "id": pa.array(range(100), pa.int64()),
        "score": pa.array([i / 4 for i in range(100)], pa.float64()),
        "name": pa.array([f"row-{i}" if i % 7 else None for i in range(100)], pa.string()),
    }
)


def to_parquet(table: pa.Table, **kwargs: object) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **kwargs)  # type: ignore[arg-type]
    return sink.getvalue()


def to_ipc_file(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=30)
    return sink.getvalue().to_pybytes()


def to_ipc_stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=30)
    return sink.getvalue().to_pybytes()


def to_feather(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    feather.write_feather(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def to_csv(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pa_csv.write_csv(table, sink)
    return sink.getvalue()


def to_jsonl(table: pa.Table) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode()


WRITERS: dict[str, tuple[pb.SourceFormat.ValueType, Callable[[pa.Table], bytes]]] = {
    "parquet": (pb.SOURCE_FORMAT_PARQUET, to_parquet),
    "jsonl": (pb.SOURCE_FORMAT_JSONL, to_jsonl),
    "csv": (pb.SOURCE_FORMAT_CSV, to_csv),
    "ipc-file": (pb.SOURCE_FORMAT_ARROW_IPC, to_ipc_file),
    "ipc-stream": (pb.SOURCE_FORMAT_ARROW_IPC, to_ipc_stream),
    "feather": (pb.SOURCE_FORMAT_ARROW_IPC, to_feather),
}


def run(data: bytes | memoryview, fmt: pb.SourceFormat.ValueType, **kwargs: object) -> pa.Table:
    kwargs.setdefault("spec", IDENTITY)
    batches = list(preprocess(data, fmt=fmt, source=SRC, **kwargs))  # type: ignore[arg-type]
    return pa.Table.from_batches(batches)


@pytest.fixture
def registry() -> Iterator[None]:
    saved = dict(pp._registered)
    yield
    pp._registered.clear()
    pp._registered.update(saved)


@pytest.mark.parametrize("kind", WRITERS)
def test_each_format_round_trips(kind: str) -> None:
    fmt, write = WRITERS[kind]
    data = write(TABLE)
    assert run(data, fmt, schema=TABLE.schema).equals(TABLE)
    assert run(memoryview(data), fmt, schema=TABLE.schema).equals(TABLE)


@pytest.mark.parametrize("kind", WRITERS)
def test_batch_rows_respected(kind: str) -> None:
    fmt, write = WRITERS[kind]
    batches = list(read_source(write(TABLE), fmt=fmt, source=SRC, batch_rows=16))
    assert max(b.num_rows for b in batches) <= 16
    assert sum(b.num_rows for b in batches) == 100


@pytest.mark.parametrize(
    "data",
    [b"garbage bytes, not parquet" * 10, to_parquet(TABLE)[:300], to_parquet(TABLE)[:-3], b"PAR1"],
    ids=["garbage", "truncated-head", "truncated-tail", "magic-only"],
)
def test_corrupt_parquet_names_source(data: bytes) -> None:
    with pytest.raises(MalformedShard, match="s3://bucket/prefix/part-3") as info:
        list(read_source(data, fmt=pb.SOURCE_FORMAT_PARQUET, source=SRC))
    assert "publish a new version" in str(info.value)


def test_corrupt_parquet_pages_fail_on_read() -> None:
    data = bytearray(to_parquet(TABLE, compression="none"))
    footer = len(data) - 8 - struct.unpack("<i", data[-8:-4])[0]
    data[4:footer] = b"\xff" * (footer - 4)
    with pytest.raises(MalformedShard, match=SRC):
        list(read_source(bytes(data), fmt=pb.SOURCE_FORMAT_PARQUET, source=SRC))
    # describe() reads only the footer, so it still answers.
    schema, rows = describe(bytes(data), fmt=pb.SOURCE_FORMAT_PARQUET, source=SRC, spec=IDENTITY)
    assert rows == 100
    assert schema.equals(TABLE.schema)


@pytest.mark.parametrize("kind", WRITERS)
def test_empty_input_is_malformed(kind: str) -> None:
    with pytest.raises(MalformedShard, match="empty"):
        list(read_source(b"", fmt=WRITERS[kind][0], source=SRC))


def test_truncated_ipc_is_malformed() -> None:
    for data in (to_ipc_file(TABLE)[:-40], to_ipc_stream(TABLE)[:200], b"\x00\x01\x02junk"):
        with pytest.raises(MalformedShard, match=SRC):
            list(read_source(data, fmt=pb.SOURCE_FORMAT_ARROW_IPC, source=SRC))


def test_unknown_format() -> None:
    with pytest.raises(MalformedShard, match="parquet, jsonl, csv"):
        list(read_source(b"x", fmt=pb.SOURCE_FORMAT_UNSPECIFIED, source=SRC))


def test_jsonl_bad_line_is_named() -> None:
    data = b'{"a": 1}\n{"a": 2}\n{"a" 3}\n{"a": 4}\n'
    with pytest.raises(MalformedShard) as info:
        list(read_source(data, fmt=pb.SOURCE_FORMAT_JSONL, source=SRC + ".jsonl"))
    message = str(info.value)
    assert f"{SRC}.jsonl line 3: not valid JSON" in message
    assert "Expecting ':' delimiter" in message


def test_jsonl_type_clash_and_non_object_lines() -> None:
    data = b'{"a": 1}\n\n{"a": 2.5}\n{"a": "x"}\n'
    with pytest.raises(MalformedShard, match="line 4: field 'a' is a string but line 1"):
        list(read_source(data, fmt=pb.SOURCE_FORMAT_JSONL, source=SRC))
    with pytest.raises(MalformedShard, match="line 2: not a JSON object"):
        list(read_source(b'{"a": 1}\n[1]\n', fmt=pb.SOURCE_FORMAT_JSONL, source=SRC))


def test_jsonl_long_line_beyond_block_size() -> None:
    row = {"text": "x" * (3 << 20)}
    data = (json.dumps(row) + "\n" + json.dumps({"text": "y"}) + "\n").encode()
    table = pa.Table.from_batches(read_source(data, fmt=pb.SOURCE_FORMAT_JSONL, source=SRC))
    assert table.num_rows == 2


def test_csv_wrong_arity_names_row() -> None:
    data = b"a,b,c\n1,2,3\n4,5\n6,7,8\n"
    with pytest.raises(MalformedShard) as info:
        list(read_source(data, fmt=pb.SOURCE_FORMAT_CSV, source=SRC + ".csv"))
    message = str(info.value)
    assert message.startswith(f"{SRC}.csv: ")
    assert "Row #3: Expected 3 columns, got 2" in message


def test_missing_column_for_schema() -> None:
    schema = pa.schema([("id", pa.int64()), ("label", pa.int32())])
    with pytest.raises(MalformedShard, match="'label'.*missing.*id, score, name") as info:
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, schema=schema)
    assert SRC in str(info.value)


def test_conform_selects_reorders_and_casts() -> None:
    schema = pa.schema([("name", pa.large_string()), ("id", pa.int32())], metadata={b"k": b"v"})
    data = to_csv(TABLE)
    batches = list(preprocess(data, fmt=FORMATS["csv"], source=SRC, spec=IDENTITY, schema=schema))
    assert all(b.schema.equals(schema, check_metadata=True) for b in batches)
    assert pa.Table.from_batches(batches).column("id").to_pylist() == list(range(100))


def test_failed_cast_is_malformed() -> None:
    schema = pa.schema([("name", pa.int32())])
    with pytest.raises(MalformedShard, match="column 'name' cannot be cast from string to int32"):
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, schema=schema)
    unsafe = pa.schema([("score", pa.int64())])  # 0.25 -> 0 would lose data
    with pytest.raises(MalformedShard, match="'score'"):
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, schema=unsafe)


def test_non_nullable_field_with_nulls() -> None:
    schema = pa.schema([pa.field("name", pa.string(), nullable=False)])
    with pytest.raises(MalformedShard, match="'name' has 15 nulls"):
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, schema=schema)


def test_columns_transform_select_rename_cast() -> None:
    spec = pb.PreprocessSpec(
        transform="columns",
        params={"select": "name, id", "rename": "id=row_id", "cast": "row_id=int32, name=utf8"},
    )
    out = run(to_ipc_file(TABLE), pb.SOURCE_FORMAT_ARROW_IPC, spec=spec)
    assert out.schema == pa.schema([("name", pa.string()), ("row_id", pa.int32())])
    assert out.column("row_id").to_pylist() == list(range(100))


def test_columns_transform_list_cast() -> None:
    table = pa.table({"v": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64()))})
    spec = pb.PreprocessSpec(transform="columns", params={"cast": "v=fixed_size_list<int16, 2>"})
    out = run(to_parquet(table), pb.SOURCE_FORMAT_PARQUET, spec=spec)
    assert out.schema.field("v").type == pa.list_(pa.int16(), 2)


def test_columns_transform_errors() -> None:
    with pytest.raises(ValueError, match="allowed: select, rename, cast"):
        load_transform("columns", {"drop": "a"})
    with pytest.raises(ValueError, match="'int33'"):
        load_transform("columns", {"cast": "a=int33"})
    with pytest.raises(ValueError, match="takes no params"):
        load_transform("identity", {"x": "1"})
    spec = pb.PreprocessSpec(transform="columns", params={"select": "id,nope"})
    with pytest.raises(MalformedShard, match="'nope'.*missing.*id, score, name"):
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, spec=spec)
    spec = pb.PreprocessSpec(transform="columns", params={"cast": "name=int64"})
    with pytest.raises(MalformedShard, match="column 'name' cannot be cast"):
        run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, spec=spec)


NOON = datetime.datetime(2024, 1, 1, 12)
LOSSY_CASTS = [
    # (column values, its type, cast param, a change the error must show)
    (list(range(10)), pa.int64(), "bool", "2 → True"),
    ([0.0, 0.5], pa.float64(), "bool", "0.5 → True"),
    ([2048, 2049], pa.int32(), "float16", "2049 → 2048.0"),
    ([1.0, 1e300], pa.float64(), "float32", "1e+300 → inf"),
    ([1.0, 1e-50], pa.float64(), "float32", "1e-50 → 0.0"),
    (["1.5", "1e400"], pa.string(), "double", "'1e400' → inf"),
    ([NOON], pa.timestamp("us"), "date32", "2024-01-01 12:00:00 → 2024-01-01"),
    ([[0, 1], [2, 0]], pa.list_(pa.int64()), "fixed_size_list<bool, 2>", "2 → True"),
]


@pytest.mark.parametrize(
    ("values", "kind", "cast", "change"),
    LOSSY_CASTS,
    ids=["int-bool", "float-bool", "int-float16", "overflow", "underflow", "text", "date", "list"],
)
def test_a_cast_that_would_change_values_fails_naming_them(
    values: list[object], kind: pa.DataType, cast: str, change: str
) -> None:
    data = to_parquet(pa.table({"x": pa.array(values, kind)}))
    spec = pb.PreprocessSpec(transform="columns", params={"cast": f"x={cast}"})
    with pytest.raises(MalformedShard) as info:
        run(data, pb.SOURCE_FORMAT_PARQUET, spec=spec)
    message = str(info.value)
    assert message.startswith(f"{SRC}: transform 'columns': column 'x' cannot be cast from ")
    assert change in message
    assert "cast 'x' to a type that holds its values, or leave it out of cast" in message
    # The version's schema is held to the same rule when a shard is conformed to it.
    with pytest.raises(MalformedShard, match=f"column 'x' .*{re.escape(change)}"):
        run(data, pb.SOURCE_FORMAT_PARQUET, schema=pa.schema([("x", parse_type(cast))]))


def test_the_lossy_cast_error_counts_the_values_that_would_change() -> None:
    labels = pa.table({"label": pa.array([i % 10 for i in range(100)], pa.int64())})
    spec = pb.PreprocessSpec(transform="columns", params={"cast": "label=bool"})
    with pytest.raises(
        MalformedShard,
        match="80 of 100 values in one batch would change, e.g. 2 → True, 3 → True, 4 → True;",
    ):
        run(to_parquet(labels), pb.SOURCE_FORMAT_PARQUET, spec=spec)


def test_casts_that_keep_every_value_pass() -> None:
    table = pa.table(
        {
            "flag": pa.array([0, 1, None], pa.int64()),
            "f": pa.array([0.1, float("nan"), -float("inf")], pa.float64()),
            "n": pa.array(["01", "-7", None]),
            "day": pa.array([datetime.datetime(2024, 1, 1), None, NOON.replace(hour=0)]),
        }
    )
    cast = "flag=bool,f=float32,n=int16,day=date32"
    spec = pb.PreprocessSpec(transform="columns", params={"cast": cast})
    out = run(to_parquet(table), pb.SOURCE_FORMAT_PARQUET, spec=spec)
    assert out.column("flag").to_pylist() == [False, True, None]
    f = out.column("f").to_pylist()  # a narrower float holds the nearest value
    assert f[0] == pytest.approx(0.1, rel=1e-7) and math.isnan(f[1]) and f[2] == -math.inf
    assert out.column("n").to_pylist() == [1, -7, None]
    assert out.column("day").to_pylist() == [datetime.date(2024, 1, 1), None, NOON.date()]


def test_a_cast_pyarrow_cannot_undo_is_refused() -> None:
    stamps = pa.array([NOON], pa.timestamp("us"))
    with pytest.raises(ValueError, match="cannot cast time64.* back to timestamp"):
        lossless_cast(stamps, pa.time64("us"))


def _same(a: object, b: object) -> bool:
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


def _reversible(before: pa.Array, target: pa.DataType) -> bool:
    """The oracle: pyarrow's safe cast accepts it, and casting back gives every value."""
    try:
        back = before.cast(target, safe=True).cast(before.type, safe=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return all(_same(a, b) for a, b in zip(before.to_pylist(), back.to_pylist(), strict=True))


def _types(names: str, *more: pa.DataType) -> st.SearchStrategy[pa.DataType]:
    return st.sampled_from([*map(parse_type, names.split()), *more])


def _arrays(values: st.SearchStrategy[object], kind: pa.DataType) -> st.SearchStrategy[pa.Array]:
    return st.lists(st.one_of(st.none(), values), max_size=8).map(lambda v: pa.array(v, kind))


some_ints = st.one_of(
    st.integers(-3, 3), st.integers(-3000, 3000), st.integers(-(2**63), 2**63 - 1)
)
some_floats = st.one_of(st.floats(width=64), st.sampled_from([0.5, -1.5]), some_ints.map(float))
some_times = st.one_of(
    st.datetimes(), st.dates().map(lambda d: datetime.datetime(*d.timetuple()[:3]))
)
CAST_CASES = st.one_of(
    st.tuples(
        _arrays(some_ints, pa.int64()),
        _types("bool int8 uint16 float16 float32 string timestamp[s]", pa.decimal128(20, 0)),
    ),
    st.tuples(
        _arrays(some_floats, pa.float64()),
        _types("bool int8 int64 string", pa.decimal128(12, 3)),
    ),
    st.tuples(
        _arrays(some_times, pa.timestamp("us")),
        _types("date32 date64 timestamp[s] timestamp[ms] int64 string"),
    ),
)


@settings(max_examples=300, deadline=None)
@given(case=CAST_CASES)
def test_a_cast_passes_exactly_when_it_can_be_undone(case: tuple[pa.Array, pa.DataType]) -> None:
    before, target = case
    try:
        after = lossless_cast(before, target)
    except ValueError:
        assert not _reversible(before, target)
    else:
        assert _reversible(before, target)
        assert after.type == target


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.floats(width=64)), max_size=8),
    target=st.sampled_from([pa.float32(), pa.float16()]),
)
def test_a_narrower_float_holds_the_nearest_value_or_fails(
    values: list[float | None], target: pa.DataType
) -> None:
    before = pa.array(values, pa.float64())
    nearest = before.cast(target, safe=False).cast(pa.float64()).to_pylist()
    out_of_range = any(
        x is not None
        and y is not None
        and ((math.isfinite(x) and math.isinf(y)) or (x != 0 and y == 0))
        for x, y in zip(values, nearest, strict=True)
    )
    try:
        after = lossless_cast(before, target)
    except ValueError:
        assert out_of_range
    else:
        assert not out_of_range
        assert all(
            _same(a, b) for a, b in zip(after.cast(pa.float64()).to_pylist(), nearest, strict=True)
        )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("int8", pa.int8()),
        ("uint64", pa.uint64()),
        ("float", pa.float32()),
        ("double", pa.float64()),
        ("float16", pa.float16()),
        ("bool", pa.bool_()),
        ("utf8", pa.string()),
        ("large_binary", pa.large_binary()),
        ("list<int32>", pa.list_(pa.int32())),
        ("large_list<list<string>>", pa.large_list(pa.list_(pa.string()))),
        ("fixed_size_list<float32, 64>", pa.list_(pa.float32(), 64)),
        ("fixed_size_list<item: int32>[64]", pa.list_(pa.int32(), 64)),
        ("list<item: fixed_size_list<int8, 3>>", pa.list_(pa.list_(pa.int8(), 3))),
    ],
)
def test_parse_type(text: str, expected: pa.DataType) -> None:
    assert parse_type(text) == expected
    assert parse_type(str(expected)) == expected


@pytest.mark.parametrize("text", ["int33", "list<int32", "fixed_size_list<int32>", "list<x>[2]"])
def test_parse_type_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="Arrow type"):
        parse_type(text)


def test_unknown_transform_lists_names(registry: None) -> None:
    register_transform("mine", lambda params: lambda batch: batch)
    with pytest.raises(UnknownTransform) as info:
        run(to_csv(TABLE), pb.SOURCE_FORMAT_CSV, spec=pb.PreprocessSpec(transform="nope"))
    message = str(info.value)
    assert "'nope'" in message and "columns, identity, images, mine, tokens" in message
    assert '[project.entry-points."edgecache.transforms"]' in message


def test_registered_transform(registry: None) -> None:
    def factory(params: dict[str, str]) -> pp.Transform:
        factor = int(params["factor"])
        return lambda b: b.set_column(0, "id", pa.compute.multiply(b.column(0), factor))

    register_transform("scale", factory)
    with pytest.raises(ValueError, match="already registered"):
        register_transform("scale", factory)
    register_transform("scale", factory, overwrite=True)
    with pytest.raises(ValueError, match="built-in"):
        register_transform("identity", factory, overwrite=True)
    spec = pb.PreprocessSpec(transform="scale", params={"factor": "3"})
    out = run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, spec=spec)
    assert out.column("id").to_pylist() == [3 * i for i in range(100)]
    unregister_transform("scale")
    with pytest.raises(UnknownTransform):
        load_transform("scale", {})
    with pytest.raises(KeyError):
        unregister_transform("scale")


def test_registry_restored_by_fixture() -> None:
    assert "scale" not in pp._registered and "mine" not in pp._registered


def test_entry_point_transform(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "edgecache.transforms"
    eps = [
        importlib.metadata.EntryPoint(
            "plain", "edgecache.cache.preprocess.transforms:_identity", group
        ),
        importlib.metadata.EntryPoint("broken", "no_such_module_xyz:factory", group),
    ]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **kw: eps if kw.get("group") == group else real(**kw),
    )
    batch = TABLE.to_batches()[0]
    assert load_transform("plain", {})(batch) is batch
    with pytest.raises(UnknownTransform, match="'broken'.*fails to load"):
        load_transform("broken", {})
    with pytest.raises(UnknownTransform, match="broken, columns, identity, images, plain, tokens"):
        load_transform("other", {})


def test_empty_transform_name_means_identity() -> None:
    assert run(to_parquet(TABLE), pb.SOURCE_FORMAT_PARQUET, spec=pb.PreprocessSpec()).equals(TABLE)


def test_describe_parquet_and_jsonl() -> None:
    spec = pb.PreprocessSpec(transform="columns", params={"select": "id", "cast": "id=int32"})
    data = to_parquet(TABLE, row_group_size=30)
    assert describe(data, fmt=pb.SOURCE_FORMAT_PARQUET, source=SRC, spec=IDENTITY) == (
        TABLE.schema,
        100,
    )
    schema, rows = describe(data, fmt=pb.SOURCE_FORMAT_PARQUET, source=SRC, spec=spec)
    assert (schema, rows) == (pa.schema([("id", pa.int32())]), 100)
    schema, rows = describe(to_jsonl(TABLE), fmt=pb.SOURCE_FORMAT_JSONL, source=SRC, spec=IDENTITY)
    assert rows == 100
    assert schema == TABLE.schema
    schema, rows = describe(b"a,b\n", fmt=pb.SOURCE_FORMAT_CSV, source=SRC, spec=IDENTITY)
    assert (schema.names, rows) == (["a", "b"], 0)


def test_format_names_and_keys() -> None:
    assert format_from_name("Parquet") == pb.SOURCE_FORMAT_PARQUET
    assert format_from_name("feather") == FORMATS["arrow"] == pb.SOURCE_FORMAT_ARROW_IPC
    with pytest.raises(ValueError, match="parquet, jsonl, csv, arrow"):
        format_from_name("orc")
    assert format_from_key("s3://b/p/part-0.PQ") == pb.SOURCE_FORMAT_PARQUET
    assert format_from_key("p/x.ndjson") == pb.SOURCE_FORMAT_JSONL
    assert format_from_key("p/x.csv") == pb.SOURCE_FORMAT_CSV
    assert format_from_key("p/x.ipc") == pb.SOURCE_FORMAT_ARROW_IPC
    assert format_from_key("p.d/README") is None
    assert format_from_key("p/x.jsonl.gz") == pb.SOURCE_FORMAT_JSONL  # compression looked through
    assert format_from_key("p/x.csv.zst") == pb.SOURCE_FORMAT_CSV
    assert format_from_key("p/shard-000.tar") == pb.SOURCE_FORMAT_WEBDATASET
    assert format_from_key("p/shard.00000.mds.zstd") == pb.SOURCE_FORMAT_MDS
    assert format_from_key("p/x.gz") is None


ints = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))
floats = st.one_of(st.none(), st.floats(allow_nan=False, width=64))
texts = st.one_of(st.none(), st.text(max_size=20))
rows = st.lists(st.tuples(ints, floats, texts), max_size=60)
SCHEMA = pa.schema([("i", pa.int64()), ("f", pa.float64()), ("s", pa.string())])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, batch_rows=st.integers(1, 25))
def test_identity_round_trip_property(rows: list[tuple[object, ...]], batch_rows: int) -> None:
    table = pa.Table.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows], SCHEMA)
    for fmt, write in (WRITERS["parquet"], WRITERS["ipc-file"], WRITERS["ipc-stream"]):
        batches = list(
            preprocess(write(table), fmt=fmt, source=SRC, spec=IDENTITY, batch_rows=batch_rows)
        )
        assert all(0 < b.num_rows <= batch_rows for b in batches)
        assert pa.Table.from_batches(batches, schema=SCHEMA).equals(table)


def test_describe_runs_user_transforms_in_full(registry: None) -> None:
    def evens(batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch.filter(pa.compute.equal(pa.compute.bit_wise_and(batch.column(0), 1), 0))

    register_transform("evens", lambda params: evens)
    spec = pb.PreprocessSpec(transform="evens")
    assert describe(to_parquet(TABLE), fmt=FORMATS["parquet"], source=SRC, spec=spec)[1] == 50


@pytest.mark.parametrize("name", ["parquet", "feather", "ipc-stream", "csv", "jsonl"])
def test_the_thread_that_reads_a_shard_pays_for_decoding_it(name: str) -> None:
    """A node meters each shard by its preprocessing threads' CPU clocks (StagingRate).

    pq.read_table decoded on Arrow's executor even with use_threads=False, so
    that clock saw none of the Parquet decode and the node promised the
    planner about twice the staging rate it had. Every format is decoded in
    the thread that asks for the batches.
    """
    import threading
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    rows = 60_000 if name in ("csv", "jsonl") else 1_000_000
    table = pa.table(
        {
            "ids": pa.array(rng.integers(0, 50_000, rows, dtype=np.int32)),
            "x": pa.array(rng.random(rows)),
            "label": pa.array(np.arange(rows, dtype=np.int64)),
        }
    )
    fmt, write = WRITERS[name]
    data = write(table)
    clocks: dict[str, float] = {}

    def read() -> None:
        started, process = time.thread_time(), time.process_time()
        got = sum(b.num_rows for b in read_source(data, fmt=fmt, source=SRC))
        clocks["thread"] = time.thread_time() - started
        clocks["process"] = time.process_time() - process
        clocks["rows"] = got

    for _ in range(2):  # the first pass also pays for first-use setup
        reader = threading.Thread(target=read)
        reader.start()
        reader.join()
    assert clocks["rows"] == rows
    assert clocks["thread"] >= 0.7 * clocks["process"], clocks
