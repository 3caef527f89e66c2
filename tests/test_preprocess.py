import datetime
import importlib.metadata
import io
import json
import math
import re
import struct
from collections.abc import Callable, Iterator
from decimal import Decimal

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


def test_a_float_becomes_the_decimal_it_rounds_to_when_that_is_the_same_float() -> None:
    floats = pa.array([1.9, 2.675, 0.1, None, -123456.789])
    after = lossless_cast(floats, pa.decimal128(12, 3))
    assert after.to_pylist() == [
        Decimal("1.900"), Decimal("2.675"), Decimal("0.100"), None, Decimal("-123456.789")
    ]  # fmt: skip
    expected = "1 of 2 values in one batch would change, e.g. 0.0001 → 0.000"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        lossless_cast(pa.array([1.5, 0.0001]), pa.decimal128(12, 3))


def test_a_cast_pyarrow_cannot_undo_is_refused() -> None:
    stamps = pa.array([NOON], pa.timestamp("us"))
    with pytest.raises(ValueError, match="cannot cast time64.* back to timestamp"):
        lossless_cast(stamps, pa.time64("us"))


def _same(a: object, b: object) -> bool:
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


# Nested values are held to the rules of their own types: each field of a struct, each
# item of a list, each key and value of a map.
XN = pa.struct([("x", pa.float64()), ("n", pa.int64())])


def test_a_nan_inside_a_struct_or_a_list_is_kept() -> None:
    rows = pa.array([{"x": math.nan, "n": 1}, None, {"x": 2.5, "n": None}], XN)
    after = lossless_cast(rows, pa.struct([("x", pa.float64()), ("n", pa.int32())])).to_pylist()
    assert math.isnan(after[0]["x"]) and after[0]["n"] == 1
    assert after[1:] == [None, {"x": 2.5, "n": None}]

    lists = pa.array([[math.nan, 1.0], None, [2.5]], pa.list_(pa.float64()))
    after = lossless_cast(lists, pa.list_(pa.float32())).to_pylist()
    assert math.isnan(after[0][0]) and after[0][1:] == [1.0] and after[1:] == [None, [2.5]]

    nested = pa.array([{"v": [math.nan]}, {"v": None}], pa.struct([("v", pa.list_(pa.float64()))]))
    after = lossless_cast(nested, pa.struct([("v", pa.large_list(pa.float32()))])).to_pylist()
    assert math.isnan(after[0]["v"][0]) and after[1] == {"v": None}


def test_a_float_inside_a_struct_narrows_to_the_nearest_value() -> None:
    rows = pa.array([{"x": 0.1, "n": 7}, {"x": -math.inf, "n": 0}], XN)
    after = lossless_cast(rows, pa.struct([("x", pa.float32()), ("n", pa.int8())]))
    # 0.10000000149011612 is float32's nearest value to 0.1
    assert after.to_pylist() == [{"x": 0.10000000149011612, "n": 7}, {"x": -math.inf, "n": 0}]


def test_a_schema_differing_only_in_a_struct_field_nullability_conforms() -> None:
    strict = pa.struct([pa.field("x", pa.float64(), nullable=False)])
    table = pa.table({"s": pa.array([{"x": math.nan}, {"x": 1.0}], strict)})
    schema = pa.schema([("s", pa.struct([("x", pa.float64())]))])
    out = run(to_ipc_file(table), pb.SOURCE_FORMAT_ARROW_IPC, schema=schema)
    assert out.schema == schema
    x = [row["x"] for row in out.column("s").to_pylist()]
    assert math.isnan(x[0]) and x[1] == 1.0


@pytest.mark.parametrize(
    ("before", "target", "change"),
    [
        (
            pa.array([{"x": 1.0, "n": 1}, None, {"x": 1.0, "n": 2}], XN),
            pa.struct([("x", pa.float64()), ("n", pa.bool_())]),
            "{'x': 1.0, 'n': 2} → {'x': 1.0, 'n': True}",
        ),
        (
            pa.array([{"x": 1.0, "n": 1}, None, {"x": 1e300, "n": 2}], XN),
            pa.struct([("x", pa.float32()), ("n", pa.int64())]),
            "{'x': 1e+300, 'n': 2} → {'x': inf, 'n': 2}",
        ),
        (  # the cast drops a field the target lacks
            pa.array([{"x": 1.0, "n": None}, None, {"x": 1.0, "n": 5}], XN),
            pa.struct([("x", pa.float64())]),
            "{'x': 1.0, 'n': 5} → {'x': 1.0}",
        ),
        (
            pa.array(
                [{"v": [1.0]}, None, {"v": [2.0, 1e-50]}],
                pa.struct([("v", pa.list_(pa.float64()))]),
            ),
            pa.struct([("v", pa.list_(pa.float32()))]),
            "{'v': [2.0, 1e-50]} → {'v': [2.0, 0.0]}",
        ),
    ],
    ids=["int-bool", "overflow", "dropped-field", "list-in-struct"],
)
def test_a_value_lost_inside_a_struct_fails_showing_the_struct(
    before: pa.Array, target: pa.DataType, change: str
) -> None:
    expected = f"1 of 3 values in one batch would change, e.g. {change}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        lossless_cast(before, target)


STOCK = pa.map_(pa.string(), pa.int64())


def test_a_map_cast_that_keeps_every_value_passes() -> None:
    # The slice leaves out ("z", 9): were it checked, 9 → True would fail the cast.
    maps = pa.array([[("z", 9)], [("a", 1), ("b", 0)], None, [], [("c", 1)]], STOCK).slice(1)
    after = lossless_cast(maps, pa.map_(pa.large_string(), pa.bool_()))
    assert after.type == pa.map_(pa.large_string(), pa.bool_())
    assert after.to_pylist() == [[("a", True), ("b", False)], None, [], [("c", True)]]
    assert lossless_cast(maps.slice(0, 0), pa.map_(pa.string(), pa.bool_())).to_pylist() == []


@pytest.mark.parametrize(
    ("before", "target", "change"),
    [
        (
            pa.array([[("a", 1)], None, [("b", 2), ("c", 0)]], STOCK),
            pa.map_(pa.string(), pa.bool_()),
            "{'key': 'b', 'value': 2} → {'key': 'b', 'value': True}",
        ),
        (
            pa.array([[(1, 1)], None, [(2049, 1), (2, 1)]], pa.map_(pa.int64(), pa.int64())),
            pa.map_(pa.float16(), pa.int64()),
            "{'key': 2049, 'value': 1} → {'key': 2048.0, 'value': 1}",
        ),
    ],
    ids=["value", "key"],
)
def test_a_map_cast_that_loses_a_key_or_value_fails_naming_the_entry(
    before: pa.Array, target: pa.DataType, change: str
) -> None:
    expected = f"1 of 3 values in one batch would change, e.g. {change}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        lossless_cast(before, target)


def test_text_becoming_inf_or_zero_fails_unless_it_says_so() -> None:
    said = ["1.5", "0", "-inf", None, ".0e7", "Infinity", "-0", "3.4e38"]
    assert lossless_cast(pa.array(said), pa.float32()).to_pylist() == [
        1.5,
        0.0,
        -math.inf,
        None,
        0.0,
        math.inf,
        -0.0,
        3.3999999521443642e38,  # fmt: skip
    ]
    text = pa.array(["1.5", "0", "1e400", None, "-inf", "1e-400", "2"])
    expected = "2 of 7 values in one batch would change, e.g. '1e400' → inf, '1e-400' → 0.0"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        lossless_cast(text, pa.float64())
    # 1e39 and 1e-50 are float64s, but float32 holds neither: they overflow and underflow.
    expected = "2 of 4 values in one batch would change, e.g. '1e39' → inf, '1e-50' → 0.0"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        lossless_cast(pa.array(["1", "1e39", "0.0", "1e-50"]), pa.float32())


# The oracle for the property test below: whether ``target`` holds ``value`` exactly,
# by arithmetic on Python values, independent of pyarrow.
def _float16_holds(n: int) -> bool:
    """Up to 65504, an integer whose odd part fits float16's 11 significand bits."""
    odd = abs(n) // (abs(n) & -abs(n)) if n else 0  # trailing zero bits go to the exponent
    return abs(n) <= 65504 and odd.bit_length() <= 11


def _holds(value: object, target: str) -> bool:
    """Whether a cast of ``value`` (an int64, float64 or timestamp) to ``target`` keeps it."""
    if isinstance(value, datetime.datetime):
        return {
            "date32": value.time() == datetime.time(0),
            "date64": value.time() == datetime.time(0),
            "timestamp[s]": value.microsecond == 0,
            "timestamp[ms]": value.microsecond % 1000 == 0,
        }.get(target, True)  # int64, string
    if isinstance(value, int):
        return {
            "bool": value in (0, 1),
            "int8": -128 <= value <= 127,
            "uint16": 0 <= value <= 65535,
            "float16": _float16_holds(value),
            # float32 holds every integer up to 2**24, and pyarrow's safe cast refuses
            # any larger one, even one it holds (16777218)
            "float32": abs(value) <= 2**24,
        }.get(target, True)  # string, timestamp[s], decimal128(20, 0)
    assert isinstance(value, float)
    whole = math.isfinite(value) and value.is_integer()
    if target == "bool":
        return value in (0.0, 1.0)
    if target == "int8":
        return whole and -128 <= value <= 127
    if target == "int64":
        return whole and -(2**63) <= value < 2**63
    if target == "decimal128(12, 3)":  # 3 decimals, 9 before the point
        if not math.isfinite(value) or abs(value) >= 1e9:
            return False
        return float(Decimal(value).quantize(Decimal("0.001"))) == value
    return True  # string: the shortest text that parses back to the same float


def _integers() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 3), st.integers(-3000, 3000), st.integers(-(2**63), 2**63 - 1))


CAST_CASES = st.one_of(
    st.tuples(
        st.just(pa.int64()),
        st.lists(st.one_of(st.none(), _integers()), max_size=8),
        st.sampled_from(
            [*"bool int8 uint16 float16 float32 string timestamp[s]".split(), "decimal128(20, 0)"]
        ),
    ),
    st.tuples(
        st.just(pa.float64()),
        st.lists(
            st.one_of(
                st.none(),
                st.floats(width=64),
                st.sampled_from([0.5, -1.5, 0.1, 1.9, 2.675, 123456.789]),
                _integers().map(float),
            ),
            max_size=8,
        ),
        st.sampled_from(["bool", "int8", "int64", "string", "decimal128(12, 3)"]),
    ),
    st.tuples(
        st.just(pa.timestamp("us")),
        st.lists(
            st.one_of(
                st.none(),
                st.datetimes(),
                st.dates().map(lambda d: datetime.datetime(d.year, d.month, d.day)),
            ),
            max_size=8,
        ),
        st.sampled_from("date32 date64 timestamp[s] timestamp[ms] int64 string".split()),
    ),
)


def _type(name: str) -> pa.DataType:
    return (
        pa.decimal128(*map(int, name[11:-1].split(",")))
        if name.startswith("dec")
        else parse_type(name)
    )


def _nested(values: pa.Array, target: pa.DataType, how: str) -> tuple[pa.Array, pa.DataType]:
    """``values`` as a struct field, list items or map values, and ``target`` nested alike."""
    if how == "struct":
        flag = pa.array([i % 2 for i in range(len(values))], pa.int64())  # bool holds 0 and 1
        struct = pa.StructArray.from_arrays([flag, values], ["flag", "v"])
        return struct, pa.struct([("flag", pa.bool_()), ("v", target)])
    half = pa.array([0, len(values) // 2, len(values)], pa.int32())
    if how == "list":
        return pa.ListArray.from_arrays(half, values), pa.list_(target)
    keys = pa.array([f"k{i}" for i in range(len(values))])
    return pa.MapArray.from_arrays(half, keys, values), pa.map_(pa.string(), target)


@settings(max_examples=300, deadline=None)
@given(case=CAST_CASES, how=st.sampled_from(["flat", "struct", "list", "map"]))
def test_a_cast_passes_exactly_when_the_target_holds_every_value(
    case: tuple[pa.DataType, list[object], str], how: str
) -> None:
    kind, values, name = case
    before, target = pa.array(values, kind), _type(name)
    if how != "flat":
        before, target = _nested(before, target, how)
    fits = all(v is None or _holds(v, name) for v in values)
    try:
        after = lossless_cast(before, target)
    except ValueError:
        assert not fits
    else:
        assert fits
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
