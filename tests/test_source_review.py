"""How sources are read, as a new user met it (review 17): aligned text tables, integers
past int64 (CSV, and JSON Lines fields nested in objects and arrays), comment lines above a
header, nested JSON Lines types, hints that fit the file, and CSV footguns (names over a
header, Latin-1 text, an empty header cell). Real files shipped by scikit-learn and
matplotlib, and small files written here; publish through a real registry on file://."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import canonical_options, describe, preprocess, read_source
from edgecache.cache.preprocess.arrow_types import parse_type, type_name
from edgecache.cache.preprocess.fixes import schema_mismatch
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

mpl = pytest.importorskip("matplotlib")
sklearn = pytest.importorskip("sklearn")
MPL_DATA = Path(mpl.get_data_path()) / "sample_data"
SKLEARN_DATA = Path(sklearn.__file__).parent / "datasets" / "data"
CSV, JSONL = pb.SOURCE_FORMAT_CSV, pb.SOURCE_FORMAT_JSONL


def read(data: bytes, fmt: pb.SourceFormat.ValueType, **options: str) -> pa.Table:
    return pa.Table.from_batches(
        list(read_source(data, fmt=fmt, source="s3://b/x", options=canonical_options(fmt, options)))
    )


def refused(data: bytes, fmt: pb.SourceFormat.ValueType, **options: str) -> str:
    with pytest.raises(MalformedShard) as info:
        read(data, fmt, **options)
    return str(info.value)


def publish(tmp_path: Path, files: dict[str, bytes], name: str, **options: str) -> pb.Manifest:
    source = tmp_path / name
    source.mkdir()
    for key, data in files.items():
        (source / key).write_bytes(data)
    spec = preprocess_spec()
    spec.source_options.update(options)
    return Registry.run(
        f"file://{tmp_path}/registry",
        lambda reg: reg.publish(f"file://{source}", name, spec=spec),
    )


# ---------------------------------------------------------------- 1: aligned tables


def test_an_aligned_whitespace_table_is_refused_naming_whitespace_and_no_header(
    tmp_path: Path,
) -> None:
    """matplotlib's data_x_x2_x3.csv (' 0   0    0') published as one string column named
    ' 0   0    0', exit 0: the separator check wanted the same count of spaces per line."""
    data = (MPL_DATA / "data_x_x2_x3.csv").read_bytes()
    message = refused(data, CSV)
    assert "aligned text table" in message
    assert "--delimiter whitespace --no-header" in message
    with pytest.raises(MalformedShard, match="--delimiter whitespace"):
        publish(tmp_path, {"data_x_x2_x3.csv": data}, "aligned")
    manifest = publish(
        tmp_path, {"data_x_x2_x3.csv": data}, "aligned2", delimiter="whitespace", header="false"
    )
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert schema.names == ["f0", "f1", "f2"] and manifest.shards[0].row_count == 11
    # A header above aligned columns: whitespace, and no --no-header hint.
    text = b"x    y\n1    2\n10   20\n100  200\n"
    message = refused(text, CSV)
    assert "--delimiter whitespace" in message and "--no-header" not in message
    # Told there is no header already: not told again.
    assert "--no-header" not in refused(data, CSV, header="false")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(min_value=-(10**6), max_value=10**6), min_size=3, max_size=3),
        min_size=2,
        max_size=12,
    ),
    st.integers(min_value=1, max_value=4),
)
def test_any_right_aligned_numeric_table_is_refused_then_read_back(
    rows: list[list[int]], pad: int
) -> None:
    width = max(len(str(v)) for row in rows for v in row) + pad
    text = "".join("".join(str(v).rjust(width) for v in row) + "\n" for row in rows).encode()
    message = refused(text, CSV)
    assert "--delimiter whitespace --no-header" in message
    table = read(text, CSV, delimiter="whitespace", header="false")
    assert [list(r.values()) for r in table.to_pylist()] == rows


def test_a_semicolon_file_is_not_told_to_try_whitespace() -> None:
    message = refused(b"x;y\n1;2\n3;4\n", CSV)
    assert "--delimiter semicolon" in message and "whitespace" not in message


# ---------------------------------------------------------------- 2, 3: integers past int64


def test_nested_json_lines_integers_past_int64_are_refused_with_the_type_to_give() -> None:
    """{"a":{"id":12345678901234567890}} published as struct<id: double>, and
    {"xs":[1,12345678901234567890]} as list<float64>: only top-level fields were checked."""
    struct = b'{"a": {"n": "q", "id": 1}}\n{"a": {"n": "r", "id": 12345678901234567890}}\n'
    message = refused(struct, JSONL)
    assert "line 2: field 'a.id' holds the integer 12345678901234567890" in message
    assert "--column-types 'a=struct<id: uint64>'" in message
    table = read(struct, JSONL, column_types="a=struct<id: uint64>")
    assert table.column("a").to_pylist()[1] == {"id": 12345678901234567890, "n": "r"}

    lists = b'{"xs": [1, 12345678901234567890]}\n'
    message = refused(lists, JSONL)
    assert "line 1: field 'xs[]'" in message and "'xs=list<uint64>'" in message
    assert "'xs=list<float64>' to accept the rounding" in message
    assert read(lists, JSONL, column_types="xs=list<uint64>").to_pylist() == [
        {"xs": [1, 12345678901234567890]}
    ]
    # Past uint64 too, in a list of objects: a decimal keeps every digit.
    deep = b'{"a": [{"id": -123456789012345678901}]}\n'
    message = refused(deep, JSONL)
    assert "field 'a[].id'" in message and "'a=list<struct<id: decimal128(38, 0)>>'" in message
    typed = read(deep, JSONL, column_types="a=list<struct<id: decimal128(38, 0)>>")
    assert str(typed.column("a").to_pylist()[0][0]["id"]) == "-123456789012345678901"
    # Floats that are floats stay allowed, nested or not.
    assert read(b'{"a": {"x": 1e300, "y": [0.5, 2]}}\n', JSONL).num_rows == 1


def test_csv_integers_past_int64_are_refused_naming_column_and_line(tmp_path: Path) -> None:
    """id,x / 12345678901234567890,1 published id: float64 and read back 1.2345678901234567e+19."""
    data = b"id,x\n1,1\n12345678901234567890,2\n"
    message = refused(data, CSV)
    assert "line 3: column 'id' holds the integer 12345678901234567890" in message
    assert "--column-types id=uint64" in message
    with pytest.raises(MalformedShard, match="id=uint64"):
        publish(tmp_path, {"a.csv": data}, "big")
    manifest = publish(tmp_path, {"a.csv": data}, "big2", column_types="id=uint64")
    assert dict(manifest.preprocess.source_options) == {
        "column_types": "id=uint64",
        "null_values": "",
    }
    assert read(data, CSV, column_types="id=uint64").column("id").to_pylist() == [
        1,
        12345678901234567890,
    ]
    # Past uint64: a decimal; without a header, the generated name; typed float64: accepted.
    huge = b"1,-123456789012345678901234\n"
    message = refused(huge, CSV, header="false")
    assert "line 1: column 'f1'" in message and "'f1=decimal128(38, 0)'" in message
    # Said as what it is: past uint64; no fractions to speak of, nor places (a hunt found
    # "beside fractions … (0 decimal places, all that 38 digits leave …)").
    assert "below int64's least" in message and "no integer type holds it" in message, message
    assert "fractions" not in message and "decimal places" not in message, message
    jsonl = b'{"a": [{"id": -123456789012345678901}]}\n'
    for text, form in ((b"id\n123456789012345678901234\n1\n", CSV), (jsonl, JSONL)):
        said = refused(text, form)
        assert "fractions" not in said and "decimal places" not in said, said
    said = refused(b"id\n123456789012345678901234\n1\n", CSV)
    assert "past int64, so" in said and "past uint64 too, so no integer type holds it" in said
    negative = refused(b"v\n1\n-9223372036854775809\n", CSV)
    assert "below int64's least, so it would be read as float64" in negative, negative
    assert "; no integer type holds it" in negative and "uint64" not in negative, negative
    # A column that does hold fractions keeps saying so.
    mixed = refused(b"v\n0.5\n123456789012345678901234\n", CSV)
    assert "beside fractions that an integer type would refuse" in mixed, mixed
    assert read(huge, CSV, header="false", column_types="f1=float64").num_rows == 1
    # A float column whose values are floats: no refusal (nothing reaches past int64 here
    # but 1e19, written as a float).
    assert read(b"v\n1e19\n2.5\n", CSV).column("v").type == pa.float64()


# ---------------------------------------------------------------- 5: comments above the header


@pytest.mark.parametrize(
    "data", [b"id,name,note\n1,a,hello\n2,b\n3,c\n4,d\n", b"a,b,c\n1,2,3\n4,5\n6,7\n"]
)
def test_a_ragged_row_below_a_header_and_a_row_is_the_objects_fault(data: bytes) -> None:
    """A hunt: the header and the first row were called "a comment, title or count line"
    and --skip-rows 2 advised; followed (with the --no-header it then asked for), the
    version published without its header, a row and a column, exit 0."""
    message = refused(data, CSV)
    assert "Row #3: Expected 3 columns, got 2" in message, message
    assert "skip-rows" not in message and "fix or remove the object" in message, message


def test_two_title_lines_of_a_comma_each_above_a_wider_header_stay_titles() -> None:
    """A review of the fix above: lines of equal width were all taken for a header and a
    row, and two titles of two cells each lost their --skip-rows advice."""
    data = b"Daily prices, USD\nSource: ACME, 2024\nd,o,h,l,c\n1,2,3,4,5\n6,7,8,9,10\n"
    message = refused(data, CSV)
    assert "its first 2 lines ('Daily prices, USD')" in message, message
    assert "--skip-rows 2" in message, message


def test_comment_lines_above_the_header_are_named_with_skip_rows(tmp_path: Path) -> None:
    """matplotlib's Stocks.csv starts '# Data source…': the error was 'Expected 1 columns,
    got 11 … fix or remove the object'."""
    data = (MPL_DATA / "Stocks.csv").read_bytes()
    message = refused(data, CSV)
    assert "'# Data source" in message and "--skip-rows 1" in message
    manifest = publish(tmp_path, {"Stocks.csv": data}, "stocks", skip_rows="1")
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert schema.names[:3] == ["Date", "IBM", "AAPL"]
    two = b"# title\n# more notes, about it\nx,y,z\n1,2,3\n4,5,6\n"
    assert "--skip-rows 2" in refused(two, CSV)
    # breast_cancer.csv's count line, read as data: the same advice.
    cancer = (SKLEARN_DATA / "breast_cancer.csv").read_bytes()
    assert "--skip-rows 1" in refused(cancer, CSV, header="false")


def test_a_comment_that_parses_as_the_header_is_refused_with_skip_rows() -> None:
    """Review 41: a comment with as many commas as the rows raised no parse error, so it
    became the header ('# generated by tool', ' v2') and the real one a row, every number
    column text; with the semicolons of the rows below, a one-column read was not told."""
    message = refused(b"# generated by tool, v2\nx,y\n1,2\n3,4\n", CSV)
    assert "'# generated by tool, v2'" in message and "('x,y') names the columns" in message
    assert "--skip-rows 1" in message
    assert read(b"# generated by tool, v2\nx,y\n1,2\n", CSV, skip_rows="1").column_names == [
        "x",
        "y",
    ]
    semicolons = refused(b"# exported\n# by tool\nx;y\n1;2\n3;4\n", CSV)
    assert "--delimiter semicolon --skip-rows 2" in semicolons
    # A '#' line that is the header itself (as in BED or VCF-derived tables) stays one.
    table = read(b"#chrom,start,end\nchr1,10,20\nchr2,30,40\n", CSV)
    assert table.column_names == ["#chrom", "start", "end"] and table.num_rows == 2
    assert read(b"#,name\n1,a\n2,b\n", CSV).column_names == ["#", "name"]


def test_column_names_of_another_count_than_the_values_are_named_so() -> None:
    """Review 41: two names for three values said only 'Row #2: Expected 2 columns, got 3'."""
    data = b"p,q,r\n1,2,3\n4,5,6\n"
    message = refused(data, CSV, header="true", column_names="a,b")
    assert "--column-names gives 2 names (a, b), but its rows hold 3 values" in message
    assert "hold 3 values" in refused(data, CSV, header="true", column_names="a,b,c,d")
    assert read(data, CSV, header="true", column_names="a,b,c").column_names == ["a", "b", "c"]


def test_skip_rows_advice_counts_blank_lines_among_the_comments() -> None:
    """--skip-rows counts every line, blank or not: advice counting the comments alone
    ('--skip-rows 2' for two comments around a blank line) was refused again when taken."""
    data = b"# exported\n\n# by tool\nx;y\n1;2\n3;4\n"
    message = refused(data, CSV)
    assert "--delimiter semicolon --skip-rows 3" in message, message
    taken = read(data, CSV, delimiter="semicolon", skip_rows="3")
    assert taken.column_names == ["x", "y"] and taken.num_rows == 2
    header = b"# generated by tool, v2\n\nx,y\n1,2\n3,4\n"
    message = refused(header, CSV)
    assert "are comments or blank, and the line after ('x,y') names the columns" in message
    assert "--skip-rows 2" in message, message
    assert read(header, CSV, skip_rows="2").column_names == ["x", "y"]


# ---------------------------------------------------------------- 6: nested JSON Lines types


def test_json_lines_takes_list_and_struct_types() -> None:
    """--column-types 'tags=list<int32>' on JSON Lines was refused: 'a CSV cell holds one value'."""
    data = b'{"tags": [1, 2], "m": {"k": 3}}\n{"tags": [], "m": {"k": 4}}\n'
    options = canonical_options(JSONL, {"column_types": "tags=list<int32>,m=struct<k: int8>"})
    assert options == {"column_types": "tags=list<int32>,m=struct<k: int8>"}
    table = read(data, JSONL, column_types="tags=list<int32>,m=struct<k: int8>")
    assert table.schema.field("tags").type == pa.list_(pa.int32())
    assert table.schema.field("m").type == pa.struct([("k", pa.int8())])
    with pytest.raises(ValueError, match="JSON Lines reader cannot read a value as fixed_size"):
        canonical_options(JSONL, {"column_types": "tags=fixed_size_list<int32, 2>"})
    with pytest.raises(ValueError, match="a CSV cell holds one value, not a list<int32>"):
        canonical_options(CSV, {"column_types": "tags=list<int32>"})


# ---------------------------------------------------------------- 7: hints that fit


def test_types_are_recorded_as_publish_prints_them() -> None:
    """column_types=f0=float was echoed where float32 is what is used."""
    assert canonical_options(CSV, {"column_types": "f0=float,f1=double"}) == {
        "column_types": "f0=float32,f1=float64",
        "null_values": "",
    }
    for text in ("float16", "list<double>", "struct<a: list<float>, b: string>", "decimal(20,2)"):
        kind = parse_type(text)
        assert parse_type(type_name(kind)) == kind
        assert "double" not in type_name(kind) and "item:" not in type_name(kind)
    assert "unknown CSV options headers;" in str(
        pytest.raises(ValueError, canonical_options, CSV, {"headers": "1"}).value
    )


def test_the_header_hint_names_a_count_line_only_when_there_is_one() -> None:
    """'(iris.csv starts with a count line)' was said of every file."""
    plain = refused(b"5,2\n3,4\n", CSV)
    assert "iris" not in plain and "count" not in plain and "--skip-rows 1" in plain
    iris = refused((SKLEARN_DATA / "iris.csv").read_bytes(), CSV)
    assert "(a count line: its first cell, 150, is the number of rows below it)" in iris
    # Followed as printed, it publishes: --skip-rows 1 alone left a row of data first, and
    # the next refusal's "--skip-rows 2" would have dropped it (a helper's hunt).
    assert "add --skip-rows 1 --no-header (the rows below it are data)" in iris, iris
    table = read((SKLEARN_DATA / "iris.csv").read_bytes(), CSV, skip_rows="1", header="false")
    assert table.num_rows == 150
    wine = refused((SKLEARN_DATA / "wine_data.csv").read_bytes(), CSV)
    assert "its first cell, 178, is the number of rows below it" in wine
    title = refused(b"2024,report\nx,y,z\n1,2,3\n", CSV)
    assert "(it has 2 cells where the next row has 3: a title line)" in title
    assert "--no-header" not in title.split("line to drop")[1]  # a header follows it
    # A pandas-style header (its first cell empty) is a header too, not data (a review).
    pandas = refused(b"2024,report,x\n,a,b\n1,2,3\n", CSV)
    assert "--skip-rows 1;" in pandas and "--no-header (the rows" not in pandas, pandas


# ---------------------------------------------------------------- 8: CSV footguns


def test_column_names_over_a_file_with_a_header_are_refused() -> None:
    """--column-names on a file with a text header made the header a row: every column string."""
    data = b"a,b\n1,2\n3,4\n"
    message = refused(data, CSV, column_names="x,y")
    assert "looks like the file's header" in message
    assert "--header" in message and "--skip-rows 1" in message
    assert read(data, CSV, column_names="x,y", header="true").to_pydict() == {
        "x": [1, 3],
        "y": [2, 4],
    }
    assert read(data, CSV, column_names="x,y", skip_rows="1").column("x").type == pa.int64()
    # Said to be data: it is data.
    assert read(data, CSV, column_names="x,y", header="false").num_rows == 3
    # The very names given, over text columns: a header too.
    assert "the very names given" in refused(b"p,q\nu,v\n", CSV, column_names="p,q")
    # Text rows under text: data (no way to tell), read as asked.
    assert read(b"u,v\nw,z\n", CSV, column_names="p,q").num_rows == 2
    iris = (SKLEARN_DATA / "iris.csv").read_bytes()
    assert read(iris, CSV, skip_rows="1", column_names="a,b,c,d,t").num_rows == 150
    # What pandas' to_csv writes: its index column's header cell empty. The empty cell
    # skipped the check, and the header was served as a row, x and y made strings.
    pandas = b",x,y\n0,1.5,2\n1,2.5,3\n"
    assert "text over columns of numbers (x, y)" in refused(pandas, CSV, column_names="i,x,y")
    assert read(pandas, CSV, column_names="i,x,y", header="true").to_pydict() == {
        "i": [0, 1],
        "x": [1.5, 2.5],
        "y": [2, 3],
    }


def test_latin1_text_is_refused_not_published_as_binary() -> None:
    data = "name,v\ncafé,1\nthé,2\n".encode("latin-1")
    message = refused(data, CSV)
    assert "is not UTF-8 text (line 2: b'caf\\xe9,1', byte 0xe9)" in message
    assert "iconv" in message and "--column-types name=binary" in message
    assert read(data, CSV, column_types="name=binary").column("name").type == pa.binary()
    assert read("name,v\ncafé,1\n".encode(), CSV).column("name").to_pylist() == ["café"]


def test_an_empty_header_cell_is_refused_naming_the_column() -> None:
    message = refused(b"a,,c\n1,2,3\n", CSV, header="true")
    assert "the header (row 1) has no name for column 2 (of 3)" in message
    assert "--column-names" in message
    assert read(b"a,,c\n1,2,3\n", CSV, header="true", column_names="a,b,c").column_names == [
        "a",
        "b",
        "c",
    ]


# ---------------------------------------------------------------- 4: objects that disagree


def test_disagreeing_objects_are_told_the_type_that_makes_them_agree() -> None:
    """p0.csv a=1, p1.csv a=1.5: 'has columns (a: double…) but … (a: int64…)' and no fix.
    (schema_mismatch is what cache/registry.py's publish should say; see the report.)"""
    ints, floats = pa.schema([("a", pa.int64())]), pa.schema([("a", pa.float64())])
    message = schema_mismatch("p1.csv", floats, "p0.csv", ints, CSV)
    assert "p1.csv has columns (a: float64) after preprocessing" in message
    assert message.endswith("publish with --column-types a=float64")
    nulls = pa.schema([("a", pa.null())])
    assert schema_mismatch("p1", nulls, "p0", pa.schema([("a", pa.string())]), CSV).endswith(
        "--column-types a=string"
    )
    narrow = pa.schema([("a", pa.int32())])
    assert schema_mismatch("p1", narrow, "p0", ints, pb.SOURCE_FORMAT_PARQUET).endswith(
        "--transform columns --param 'cast=a=int64'"
    )
    tags = pa.schema([("t", pa.list_(pa.int64()))])
    json_floats = pa.schema([("t", pa.list_(pa.float64()))])
    assert schema_mismatch("p1", tags, "p0", json_floats, JSONL).endswith(
        "--column-types 't=list<float64>'"
    )
    # No type both read as (JSON text against numbers): no advice rather than a wrong one.
    text = pa.schema([("a", pa.string())])
    assert schema_mismatch("p1", text, "p0", ints, JSONL).endswith("must agree")


def test_json_lines_records_mixed_inference_stay_readable() -> None:
    rows = [{"id": i, "tags": [i, i + 1], "m": {"k": float(i)}} for i in range(5)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    assert read(data, JSONL).to_pylist() == rows


def test_the_types_advice_pasted_as_printed_publishes_not_loops(tmp_path: Path) -> None:
    """a is 1, 1.5, 2 and b "x", "y", null in three objects: told from one pair at a time the
    advice said a=float64, then b=string, then (pasted as printed) a=float64 again."""
    rows = [{"a": 1, "b": "x"}, {"a": 1.5, "b": "y"}, {"a": 2, "b": None}]
    files = {f"p{i}.jsonl": json.dumps(r).encode() + b"\n" for i, r in enumerate(rows)}
    told: list[str] = []
    options: dict[str, str] = {}
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        try:
            manifest = publish(tmp_path / str(attempt), files, "ds", **options)
            break
        except MalformedShard as exc:
            advice = str(exc).rsplit("publish with --column-types ", 1)[-1]
            told.append(advice)
            options = {"column_types": advice}
    else:
        pytest.fail(f"still refused after following the advice: {told}")
    assert told == ["a=float64,b=string"], told  # both columns at once
    assert manifest.shards and options == {"column_types": "a=float64,b=string"}
    # A publish that already gives one column's type is told it with the other's.
    (tmp_path / "given").mkdir()
    with pytest.raises(MalformedShard) as info:
        publish(tmp_path / "given", files, "ds", column_types="a=float64")
    assert str(info.value).endswith("--column-types a=float64,b=string"), str(info.value)


def test_real_csvs_that_published_still_publish(tmp_path: Path) -> None:
    """The checks added refuse nothing that read right before: the sklearn/matplotlib files
    with the options the docs give."""
    cases = {
        "iris.csv": {"skip_rows": "1", "header": "false"},
        "linnerud_exercise.csv": {"delimiter": "space"},
        "boston_house_prices.csv": {"skip_rows": "1"},
    }
    for name, options in cases.items():
        path = SKLEARN_DATA / name
        if not path.exists():
            continue
        assert read(path.read_bytes(), CSV, **options).num_rows > 0
    shutil.copy(MPL_DATA / "msft.csv", tmp_path / "msft.csv")
    assert read((tmp_path / "msft.csv").read_bytes(), CSV).num_columns == 7


def test_a_node_stages_a_version_published_before_these_checks_as_recorded() -> None:
    """The new refusals are publish's: a version published before them (an aligned table as
    one column, Latin-1 as binary, names over a header, a rounded id) still stages as its
    schema says, while describe (publish) refuses the same object."""
    cases = {
        (MPL_DATA / "data_x_x2_x3.csv").read_bytes(): {},
        "name,v\ncafé,1\n".encode("latin-1"): {},
        b"a,b\n1,2\n": {"column_names": "x,y"},
        b"a,,c\n1,2,3\n": {"header": "true"},
        b"id,x\n12345678901234567890,1\n": {},
    }
    for data, options in cases.items():
        spec = pb.PreprocessSpec(source_options=canonical_options(CSV, options))
        with pytest.raises(MalformedShard):
            describe(data, fmt=CSV, source="x.csv", spec=spec)
        batches = list(preprocess(data, fmt=CSV, source="x.csv", spec=spec))
        assert sum(b.num_rows for b in batches) >= 1
    nested = b'{"a": {"id": 12345678901234567890}}\n'
    with pytest.raises(MalformedShard, match="a.id"):
        describe(nested, fmt=JSONL, source="x.jsonl", spec=pb.PreprocessSpec())
    rows = list(preprocess(nested, fmt=JSONL, source="x.jsonl", spec=pb.PreprocessSpec()))
    assert rows[0].schema.field("a").type == pa.struct([("id", pa.float64())])


def test_publish_help_gives_the_delimiter_default_for_tsv_too() -> None:
    """--help said the default was "," where a folder of .tsv objects is read tab-separated."""
    from typer.testing import CliRunner

    from edgecache.clients.cli.app import app

    said = " ".join(
        CliRunner().invoke(app, ["publish", "--help"], env={"COLUMNS": "300"}).output.split()
    )
    assert "(default: comma; tab when every object is .tsv)" in said, said
