"""Real-world sources: compressed objects, CSV reader options on scikit-learn's own CSVs,
WebDataset tars and MosaicML MDS shards, published through a real registry on file://."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from datagen import tar_archive
from edgeutil import streaming_module
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import canonical_options, describe, preprocess, read_source
from edgecache.cache.preprocess.compressed import compression_of, decompress
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

sklearn = pytest.importorskip("sklearn")
SKLEARN_DATA = Path(sklearn.__file__).parent / "datasets" / "data"
CSV, JSONL = pb.SOURCE_FORMAT_CSV, pb.SOURCE_FORMAT_JSONL
COMPRESSORS = {
    "gzip": gzip.compress,
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
    "bz2": bz2.compress,
    "xz": lambda b: lzma.compress(b, format=lzma.FORMAT_XZ),
}


def read(data: bytes, fmt: pb.SourceFormat.ValueType, **options: str) -> pa.Table:
    return pa.Table.from_batches(
        list(read_source(data, fmt=fmt, source="s3://b/x", options=canonical_options(fmt, options)))
    )


def publish(tmp_path: Path, source: Path, name: str, **spec: object) -> pb.Manifest:
    registry = f"file://{tmp_path}/registry"
    options = spec.pop("source_options", {})
    fmt = spec.pop("fmt", None)
    preprocess = preprocess_spec(**spec)  # type: ignore[arg-type]
    preprocess.source_options.update(options)  # type: ignore[arg-type]
    return Registry.run(
        registry, lambda reg: reg.publish(f"file://{source}", name, fmt=fmt, spec=preprocess)
    )


# ---------------------------------------------------------------- compression


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_compressed_jsonl_reads_like_the_plain_one(kind: str) -> None:
    plain = b"".join(json.dumps({"id": i, "text": f"doc {i}"}).encode() + b"\n" for i in range(50))
    packed = COMPRESSORS[kind](plain)
    assert compression_of(packed) == kind
    assert read(packed, JSONL).equals(read(plain, JSONL))


def test_concatenated_gzip_members_and_zstd_frames_are_read_whole() -> None:
    parts = [b"a,b\n1,2\n", b"3,4\n"]
    assert read(gzip.compress(parts[0]) + gzip.compress(parts[1]), CSV).num_rows == 2
    cctx = zstandard.ZstdCompressor()
    assert read(cctx.compress(parts[0]) + cctx.compress(parts[1]), CSV).num_rows == 2


def test_truncated_compressed_object_names_itself() -> None:
    packed = gzip.compress(b"a,b\n" + b"1,2\n" * 1000)
    with pytest.raises(MalformedShard, match=r"s3://b/x looks gzip-compressed.*truncated"):
        read(packed[: len(packed) // 2], CSV)


@pytest.mark.parametrize(
    ("name", "data", "fmt", "said"),
    [
        ("p.csv.gz", b"a,b\n1,2,3\n", CSV, "gzip-compressed but is not"),
        ("d.jsonl.zst", b"plain text, not JSON\n", JSONL, "zstd-compressed but is not"),
        ("d.jsonl.gz", zstandard.ZstdCompressor().compress(b"{,\n"), JSONL, "but is zstd-"),
    ],
)
def test_an_object_named_compressed_that_is_not_says_so_before_its_error(
    name: str, data: bytes, fmt: pb.SourceFormat.ValueType, said: str
) -> None:
    # Read by its bytes, such an object failed as text that does not parse ("one column,
    # looks space-separated", "not valid JSON"), with no word of its name's compression.
    with pytest.raises(MalformedShard, match=f"s3://b/{re.escape(name)} is named as .*{said}"):
        list(read_source(data, fmt=fmt, source=f"s3://b/{name}", options={}))


def test_an_object_named_compressed_that_reads_as_it_is_still_reads() -> None:
    table = read_source(b"a,b\n1,2\n", fmt=CSV, source="s3://b/p.csv.gz", options={})
    assert pa.Table.from_batches(list(table)).num_rows == 1


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(
        st.tuples(
            st.one_of(
                st.binary(max_size=3000), st.builds(lambda n: b"a" * n, st.integers(0, 5000))
            ),
            st.booleans(),  # a content checksum
            st.integers(1, 19),  # level
        ),
        min_size=1,
        max_size=4,
    ),
    skippable=st.booleans(),
    data=st.data(),
)
def test_a_zstd_object_cut_anywhere_but_between_frames_is_refused(
    frames: list[tuple[bytes, bool, int]], skippable: bool, data: st.DataObject
) -> None:
    """zstd's stream reader ends quietly where its input ends: a .csv.zst cut in half
    published half its rows. Any cut inside a frame is now refused; a cut between
    frames leaves whole frames, which is all the object can say."""
    parts = [
        zstandard.ZstdCompressor(level=level, write_checksum=check).compress(payload)
        for payload, check, level in frames
    ]
    if skippable:  # pzstd and seekable-zstd write these; they carry no data
        parts.insert(1, (0x184D2A5E).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!")
    whole = b"".join(parts)
    out, kind = decompress(whole, "x")
    assert (bytes(out), kind) == (b"".join(p for p, _, _ in frames), "zstd")
    boundaries = {sum(len(p) for p in parts[:i]) for i in range(len(parts) + 1)}
    cut = data.draw(st.integers(4, len(whole) - 1))
    if cut in boundaries:
        decompress(whole[:cut], "x")  # whole frames: nothing to tell
    else:
        with pytest.raises(
            MalformedShard, match=r"x is zstd-compressed but truncated: (it ends|\d+ byte)"
        ):
            decompress(whole[:cut], "x")


def test_a_zstd_cut_is_said_where_it_is() -> None:
    """Cut inside the frame header, inside a block's header, or after whole frames: each
    said as what it is (a cut inside the header was 'between two blocks')."""
    payload = b"x,y\n" + b"1,2\n" * 50_000  # 200 kB: a 4-byte content size, a 9-byte header
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(payload)
    header = zstandard.frame_header_size(frame[:18])
    said = {}
    for cut in (header - 1, header, header + 1):
        with pytest.raises(MalformedShard) as info:
            decompress(frame[:cut], "x")
        said[cut - header] = str(info.value)
    assert "it ends inside a frame header" in said[-1], said
    assert "it ends before a frame's last block" in said[0], said
    assert "it ends inside a block header" in said[1], said
    with pytest.raises(MalformedShard, match=r"1 byte\(s\) follow its last whole frame"):
        decompress(frame + b"\n", "x")


def test_text_that_starts_like_bz2_is_not_taken_for_it() -> None:
    assert compression_of(b"BZh,col\n1,2\n") is None
    assert read(b"BZh,col\n1,2\n", CSV).column_names == ["BZh", "col"]


@settings(max_examples=40, deadline=None)
@given(payload=st.binary(max_size=4096), kind=st.sampled_from(sorted(COMPRESSORS)))
def test_decompress_round_trips_any_bytes(payload: bytes, kind: str) -> None:
    out, found = decompress(COMPRESSORS[kind](payload), "x")
    assert (bytes(out), found) == (payload, kind)


def test_sklearn_digits_csv_gz_publishes_headerless(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    shutil.copy(SKLEARN_DATA / "digits.csv.gz", tmp_path / "src")
    with pytest.raises(MalformedShard, match="does not look like a header.*--no-header"):
        publish(tmp_path, tmp_path / "src", "digits")
    manifest = publish(tmp_path, tmp_path / "src", "digits", source_options={"header": "false"})
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert manifest.source_format == CSV and len(schema) == 65 and schema.names[0] == "f0"
    assert manifest.shards[0].row_count == 1797  # scikit-learn's digits: 1,797 images


# ---------------------------------------------------------------- CSV options, sklearn's files


def test_iris_first_row_is_refused_as_a_header_and_read_with_options() -> None:
    data = (SKLEARN_DATA / "iris.csv").read_bytes()
    with pytest.raises(MalformedShard, match=r"'150', '4' are numbers.*--skip-rows 1"):
        read(data, CSV)
    names = "sepal_length,sepal_width,petal_length,petal_width,target"
    table = read(data, CSV, skip_rows="1", header="false", column_names=names)
    assert table.num_rows == 150 and table.column_names == names.split(",")
    assert table.column("target").type == pa.int64()
    assert table.column("sepal_length").to_pylist()[0] == 5.1
    typed = read(data, CSV, skip_rows="1", column_names=names, column_types="target=int8")
    assert typed.column("target").type == pa.int8() and typed.equals(
        table.set_column(4, "target", table.column("target").cast(pa.int8()))
    )


def test_wine_and_breast_cancer_headers_are_refused_too() -> None:
    for name in ("wine_data.csv", "breast_cancer.csv"):
        with pytest.raises(MalformedShard, match="does not look like a header"):
            read((SKLEARN_DATA / name).read_bytes(), CSV)


def test_space_separated_linnerud_is_not_one_string_column() -> None:
    data = (SKLEARN_DATA / "linnerud_exercise.csv").read_bytes()
    with pytest.raises(MalformedShard, match="looks space-separated.*--delimiter space"):
        read(data, CSV)
    table = read(data, CSV, delimiter="space")
    assert table.column_names == ["Chins", "Situps", "Jumps"] and table.num_rows == 20
    assert read(data, CSV, delimiter=",").num_columns == 1  # asked for: allowed


def test_diabetes_gz_space_separated_headerless() -> None:
    data = (SKLEARN_DATA / "diabetes_data_raw.csv.gz").read_bytes()
    table = read(data, CSV, delimiter="space", header="false")
    assert table.shape == (442, 10)


@pytest.mark.parametrize(
    ("name", "options", "fix"),
    [
        ("diabetes_data_raw.csv.gz", {"header": "false", "column_names": "a,b,c,d,e,f,g,h,i,j"},
         "--delimiter space"),
        ("linnerud_exercise.csv", {"header": "true", "column_names": "chins,situps,jumps"},
         "--delimiter space"),
        ("iris.csv", {"skip_rows": "1", "header": "false", "column_names": "a,b,c,d,e",
                      "delimiter": ";"}, "--delimiter comma"),
    ],
)  # fmt: skip
def test_column_names_with_the_wrong_separator_name_the_separator(
    name: str, options: dict[str, str], fix: str
) -> None:
    # With --column-names the separator check never ran: the parse failed first and said
    # "name every column" of columns already named (a helper's walk, on these files).
    data = (SKLEARN_DATA / name).read_bytes()
    with pytest.raises(MalformedShard, match=f"publish with {fix} ") as refused:
        read(data, CSV, **options)
    assert "name every column" not in str(refused.value)


def test_whitespace_delimiter_takes_runs_of_blanks() -> None:
    text = b"  a    b\tc\n  1  2   3\n10 20\t\t30  \n"
    table = read(text, CSV, delimiter="whitespace")
    assert table.to_pydict() == {"a": [1, 10], "b": [2, 20], "c": [3, 30]}


def test_whitespace_delimiter_keeps_the_blanks_inside_quoted_fields() -> None:
    text = b'name      value\n"New  York"   5\n"tab\there"  6\n  "say ""hi""  now"  7  \n'
    table = read(text, CSV, delimiter="whitespace")
    assert table.to_pydict() == {
        "name": ["New  York", "tab\there", 'say "hi"  now'],
        "value": [5, 6, 7],
    }


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.text('ab \t"', min_size=1, max_size=6), st.text(" \t", max_size=3)),
            min_size=2,
            max_size=2,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_whitespace_delimiter_reads_quoted_values_back_exactly(
    rows: list[list[tuple[str, str]]],
) -> None:
    # Every value quoted (inner quotes doubled), fields separated by at least one blank.
    lines = [
        " ".join('"' + value.replace('"', '""') + '"' + pad for value, pad in row) for row in rows
    ]
    text = ("x y\n" + "\n".join(lines) + "\n").encode()
    table = read(text, CSV, delimiter="whitespace", column_types="x=string,y=string")
    assert table.to_pydict() == {
        "x": [row[0][0] for row in rows],
        "y": [row[1][0] for row in rows],
    }


def test_a_header_of_nan_or_infinity_is_a_header() -> None:
    table = read(b"id,Infinity,NaN,inf\n1,2,3,4\n", CSV)
    assert table.column_names == ["id", "Infinity", "NaN", "inf"]
    with pytest.raises(MalformedShard, match="does not look like a header"):
        read(b"1e5,b\n1,2\n", CSV)


def test_tsv_objects_are_read_tab_separated(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.tsv").write_bytes(b"name\tnote, remark\nParis\thello, world\n")
    (tmp_path / "src" / "y.tsv.gz").write_bytes(
        gzip.compress(b"name\tnote, remark\nRome\tciao, bella\n")
    )
    manifest = publish(tmp_path, tmp_path / "src", "tsv")
    assert dict(manifest.preprocess.source_options) == {"delimiter": "\t", "null_values": ""}
    data = (tmp_path / "src" / "x.tsv").read_bytes()
    table = pa.Table.from_batches(
        list(preprocess(data, fmt=CSV, source="x.tsv", spec=manifest.preprocess, schema=None))
    )
    assert table.to_pydict() == {"name": ["Paris"], "note, remark": ["hello, world"]}
    # An explicit delimiter wins; a prefix mixing .tsv with .csv implies none and is refused.
    manifest = publish(tmp_path, tmp_path / "src", "tsv2", source_options={"delimiter": ","})
    assert dict(manifest.preprocess.source_options) == {"delimiter": ",", "null_values": ""}
    (tmp_path / "src" / "z.csv").write_bytes(b"name,note\nOslo,hei\n")
    with pytest.raises(ValueError, match="mixes tab-separated .tsv objects.*pass --delimiter"):
        publish(tmp_path, tmp_path / "src", "tsv3")


def test_a_compressed_parquet_object_publishes_and_reads_like_the_plain_one(tmp_path: Path) -> None:
    """Publish reads a Parquet footer alone; a ``.parquet.gz`` has none at its end.

    It was refused ("not a Parquet file (no PAR1 footer magic)") though every object
    may be compressed; it is read whole and decompressed, as a node stages it.
    """
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(50))}), sink)
    (tmp_path / "src" / "a.parquet.gz").write_bytes(gzip.compress(sink.getvalue()))
    (tmp_path / "src" / "b.parquet").write_bytes(sink.getvalue())
    manifest = publish(tmp_path, tmp_path / "src", "pqgz")
    assert [s.row_count for s in manifest.shards] == [50, 50]
    data = (tmp_path / "src" / "a.parquet.gz").read_bytes()
    batches = preprocess(data, fmt=pb.SOURCE_FORMAT_PARQUET, source="a", spec=manifest.preprocess)
    assert pa.Table.from_batches(list(batches)).column("x").to_pylist() == list(range(50))


def test_objects_without_rows_are_refused_at_publish_naming_them(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_bytes(b"a,b\n1,2\n")
    (tmp_path / "src" / "b.csv").write_bytes(b"a,b\n")  # a header alone
    with pytest.raises(MalformedShard, match=r"b\.csv gives no rows after preprocessing.*move"):
        publish(tmp_path, tmp_path / "src", "hdr")
    assert not (tmp_path / "registry" / "hdr").exists()


def test_objects_that_disagree_are_named_on_one_line(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_bytes(b"a,b\n1,2\n")
    (tmp_path / "src" / "b.csv").write_bytes(b"a,b\n1,x\n")
    with pytest.raises(MalformedShard) as refused:
        publish(tmp_path, tmp_path / "src", "mix")
    message = str(refused.value)
    assert "\n" not in message
    assert "has columns (a: int64, b: string) after preprocessing" in message


def test_duplicate_column_names_are_refused_at_publish(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_bytes(b"a,a,b\n1,2,3\n")
    with pytest.raises(MalformedShard, match="name a more than once") as refused:
        publish(tmp_path, tmp_path / "src", "dup")
    # The advice, followed, publishes (a rename cannot tell the two a's apart).
    assert "--header --column-names a,a_2,b" in str(refused.value), refused.value
    assert "rename" not in str(refused.value)
    options = {"header": "true", "column_names": "a,a_2,b"}
    assert publish(tmp_path, tmp_path / "src", "dup", source_options=options).version == 1
    # Parquet: no reader option names its columns; nor can a transform.
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table([[1], [2]], names=["a", "a"]), tmp_path / "pq" / "p.parquet")
    with pytest.raises(MalformedShard, match=r"rewrite its files.*rename_columns"):
        publish(tmp_path, tmp_path / "pq", "dup2")
    (tmp_path / "src" / "a.csv").write_bytes(b"x,y\n1,2\n")
    with pytest.raises(MalformedShard, match="name y more than once"):
        publish(
            tmp_path,
            tmp_path / "src",
            "dup",
            transform="columns",
            params={"rename": "x=y"},
        )


def test_unknown_names_beside_shards_are_named_with_the_way_out(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_bytes(b"a,b\n1,2\n")
    (tmp_path / "src" / "README.txt").write_bytes(b"about this data\n")
    with pytest.raises(MalformedShard, match=r"README\.txt under .* tell no format.*move files"):
        publish(tmp_path, tmp_path / "src", "readme")


def test_the_way_out_past_a_models_config_json_names_the_shards_alone(tmp_path: Path) -> None:
    """Parquet beside config.json and a README: told --include '*.json' --include
    '*.parquet', which was then refused as several formats with --include '*.json' as the
    example (a tie, 1 to 1): the way out publishes as printed now."""
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"a": [1, 2]}), src / "part-0.parquet")
    (src / "config.json").write_text('{"hidden_size": 8}\n')
    (src / "README.md").write_text("about\n")
    with pytest.raises(MalformedShard) as info:
        publish(tmp_path, src, "ds")
    said = str(info.value)
    assert "--exclude 'README.md' --exclude 'config.json'" in said, said
    includes = re.findall(r"--include '([^']+)'", said)
    assert includes == ["*.parquet"], said
    registry = f"file://{tmp_path}/registry"
    manifest = Registry.run(
        registry,
        lambda reg: reg.publish(f"file://{src}", "ds", spec=preprocess_spec(), include=includes),
    )
    assert sum(s.row_count for s in manifest.shards) == 2
    (src / "README.md").unlink()
    with pytest.raises(
        MalformedShard, match=r"several formats .*\(e\.g\. --include '\*\.parquet';"
    ):
        publish(tmp_path, src, "mixed")


def test_json_lines_integers_past_int64_are_refused_or_typed_never_rounded() -> None:
    """12345678901234567890 was read as float64 (1.2345678901234567e+19) without a word,
    and JSON Lines had no way to say the type."""
    data = b'{"a": 12345678901234567890, "b": 1}\n{"a": 1, "b": 2.5}\n'
    with pytest.raises(MalformedShard, match=r"line 1: field 'a' holds the integer .*=uint64"):
        read(data, JSONL)
    table = read(data, JSONL, column_types="a=uint64")
    assert table.column_names == ["a", "b"]  # the data's order, typed or not
    assert table.column("a").to_pylist() == [12345678901234567890, 1]
    assert table.column("b").to_pylist() == [1.0, 2.5]  # a float column stays one
    assert read(b'{"x": 1e300}\n{"x": -12345678901234567890.5}\n', JSONL).num_rows == 2
    with pytest.raises(MalformedShard, match=r"column_types names nope, but"):
        read(b'{"a": 1}\n', JSONL, column_types="nope=int8")
    assert (
        read(b'{"a": 1, "b": null}\n', JSONL, column_types="b=int8").schema.field("b").type
        == pa.int8()
    )  # present, all null: typed, not refused
    with pytest.raises(ValueError, match=r"column_types only"):
        canonical_options(JSONL, {"delimiter": ","})


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown CSV options"):
        canonical_options(CSV, {"headers": "true"})
    with pytest.raises(ValueError, match="header must be true, false or auto"):
        canonical_options(CSV, {"header": "yes"})
    with pytest.raises(ValueError, match="delimiter must be one character"):
        canonical_options(CSV, {"delimiter": "::"})
    with pytest.raises(ValueError, match="take no reader options"):
        canonical_options(pb.SOURCE_FORMAT_PARQUET, {"delimiter": ","})
    assert canonical_options(CSV, {"delimiter": "tab", "header": "auto", "skip_rows": "0"}) == {
        "delimiter": "\t",
        "null_values": "",  # recorded on every CSV version (test_publish_review44.py)
    }
    with pytest.raises(MalformedShard, match=r"column_types names nope, but"):
        read(b"a,b\n1,2\n", CSV, column_types="nope=int8")


def test_publish_records_options_and_nodes_parse_alike(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    shutil.copy(SKLEARN_DATA / "iris.csv", tmp_path / "src")
    options = {"skip_rows": "1", "header": "false", "column_names": "a,b,c,d,target"}
    manifest = publish(tmp_path, tmp_path / "src", "iris", source_options=options)
    assert dict(manifest.preprocess.source_options) == {**options, "null_values": ""}
    assert manifest.shards[0].row_count == 150
    data = (tmp_path / "src" / "iris.csv").read_bytes()
    batches = list(
        preprocess(data, fmt=CSV, source="iris.csv", spec=manifest.preprocess, schema=None)
    )
    assert sum(b.num_rows for b in batches) == 150 and batches[0].schema.names[-1] == "target"


# ---------------------------------------------------------------- WebDataset


def _image_bytes() -> dict[str, bytes]:
    mpl = pytest.importorskip("matplotlib")
    sample = Path(mpl.get_data_path()) / "sample_data"
    return {
        "jpg": (sample / "grace_hopper.jpg").read_bytes(),
        "png": (sample / "Minduka_Present_Blue_Pack.png").read_bytes(),
    }


def test_webdataset_tar_groups_members_by_key(tmp_path: Path) -> None:
    images = _image_bytes()
    members = []
    for i in range(5):
        members += [(f"train/s{i:03d}.jpg", images["jpg"]), (f"train/s{i:03d}.cls", b"%d" % i)]
        if i % 2:
            members.append((f"train/s{i:03d}.json", json.dumps({"i": i}).encode()))
    data = tar_archive(members)
    table = read(data, pb.SOURCE_FORMAT_WEBDATASET)
    assert table.column_names == ["__key__", "cls", "jpg", "json"]
    assert table.column("__key__").to_pylist()[:2] == ["train/s000", "train/s001"]
    assert table.column("cls").to_pylist() == [0, 1, 2, 3, 4]
    assert table.column("jpg").to_pylist()[3] == images["jpg"]
    assert table.column("json").to_pylist()[:2] == [None, '{"i": 1}']
    schema, rows = describe(
        data, fmt=pb.SOURCE_FORMAT_WEBDATASET, source="x.tar", spec=pb.PreprocessSpec()
    )
    assert (schema, rows) == (table.schema, 5)


def test_webdataset_errors_name_object_and_sample() -> None:
    bad_cls = tar_archive([("a.cls", b"seven")])
    with pytest.raises(MalformedShard, match=r"x: sample 'a': cls holds b'seven'"):
        read(bad_cls, pb.SOURCE_FORMAT_WEBDATASET)
    twice = tar_archive([("a.jpg", b"1"), ("a.jpg", b"2")])
    with pytest.raises(MalformedShard, match="sample 'a' has two members with extension 'jpg'"):
        read(twice, pb.SOURCE_FORMAT_WEBDATASET)
    whole = tar_archive([("a.jpg", b"x" * 5000)])
    with pytest.raises(MalformedShard, match="s3://b/x"):
        read(whole[:1500], pb.SOURCE_FORMAT_WEBDATASET)


def test_a_webdataset_tar_cut_at_or_inside_a_member_header_is_refused() -> None:
    # tarfile ends its listing quietly at a header cut short or missing past the first
    # member: such a shard published with its last samples gone (a helper's walk).
    members = [(f"s{i}.{ext}", f"{i}{ext}".encode() * 40) for i in range(4) for ext in "ab"]
    whole = tar_archive(members)
    assert read(whole, pb.SOURCE_FORMAT_WEBDATASET).num_rows == 4
    boundary = 2 * 512 * 2  # two members of one header and one data block each
    for cut in (boundary, boundary + 100, len(whole) - len(whole) // 3 // 512 * 512):
        data = whole[:cut]
        with pytest.raises(MalformedShard, match="truncated or damaged there"):
            read(data, pb.SOURCE_FORMAT_WEBDATASET)
    lone_zero_block = whole[: 8 * 1024] + bytes(512)  # GNU tar reads it, with a warning
    assert read(lone_zero_block, pb.SOURCE_FORMAT_WEBDATASET).num_rows == 4


def test_publish_webdataset_prefix(tmp_path: Path) -> None:
    images = _image_bytes()
    (tmp_path / "wds").mkdir()
    for shard in range(2):
        members = [(f"k{shard}_{i}.png", images["png"]) for i in range(3)]
        members += [(f"k{shard}_{i}.cls", b"1") for i in range(3)]
        members.sort()  # key order: png and cls of one key side by side
        (tmp_path / "wds" / f"shard-{shard:04d}.tar").write_bytes(tar_archive(members))
    manifest = publish(tmp_path, tmp_path / "wds", "wds")
    assert manifest.source_format == pb.SOURCE_FORMAT_WEBDATASET
    assert [s.row_count for s in manifest.shards] == [3, 3]


# ---------------------------------------------------------------- MDS


def needs_streaming() -> None:
    import importlib.util

    if importlib.util.find_spec("streaming") is None:
        pytest.skip(
            "mosaicml-streaming is not installed (make test installs bench/requirements.txt)"
        )


def _write_mds(out: Path, compression: str | None) -> list[dict]:
    MDSWriter = streaming_module().MDSWriter  # noqa: N806 - the class, as streaming names it

    images = _image_bytes()
    columns = {
        "id": "int",
        "label": "uint8",
        "caption": "str",
        "jpeg": "jpeg",
        "tokens": "ndarray:int32:2,4",
        "raw": "bytes",
    }
    samples = []
    from PIL import Image

    picture = Image.open(io.BytesIO(images["jpg"]))
    picture.load()
    with MDSWriter(
        out=str(out), columns=columns, compression=compression, size_limit=1 << 16
    ) as writer:
        for i in range(12):
            sample = {
                "id": i,
                "label": np.uint8(i % 3),
                "caption": f"caption {i} ✓",
                "jpeg": picture,
                "tokens": np.arange(8, dtype=np.int32).reshape(2, 4) + i,
                "raw": bytes([i]) * i,
            }
            writer.write(sample)
            samples.append(sample)
    return samples


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_publishes_from_index_alone_and_reads_back(
    tmp_path: Path, compression: str | None
) -> None:
    needs_streaming()
    samples = _write_mds(tmp_path / "mds", compression)
    manifest = publish(tmp_path, tmp_path / "mds", "mds")
    assert manifest.source_format == pb.SOURCE_FORMAT_MDS
    assert sum(s.row_count for s in manifest.shards) == 12 and len(manifest.shards) > 1
    assert all(".mds" in s.source_key for s in manifest.shards)
    schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
    assert schema.field("tokens").type == pa.list_(pa.list_(pa.int32(), 4), 2)
    rows = []
    for shard in manifest.shards:
        data = (tmp_path / "mds" / shard.source_key).read_bytes()
        for batch in preprocess(
            data,
            fmt=pb.SOURCE_FORMAT_MDS,
            source=shard.source_key,
            spec=manifest.preprocess,
            schema=schema,
        ):
            rows += batch.to_pylist()
    assert [r["id"] for r in rows] == list(range(12))
    assert rows[5]["caption"] == "caption 5 ✓" and rows[5]["label"] == 2
    assert rows[5]["tokens"] == samples[5]["tokens"].tolist()
    assert rows[5]["raw"] == b"\x05" * 5 and rows[5]["jpeg"][:2] == b"\xff\xd8"


def test_an_empty_mds_shard_from_an_oversized_sample_is_left_out(tmp_path: Path) -> None:
    """MDSWriter writes an empty first shard when a sample outgrows size_limit; it was
    refused as giving no rows, and --exclude'd, refused as missing from the index."""
    needs_streaming()
    from streaming import MDSWriter

    with MDSWriter(
        out=str(tmp_path / "mds"), columns={"id": "int", "blob": "bytes"}, size_limit="1kb"
    ) as writer:
        for i in range(3):
            writer.write({"id": i, "blob": bytes(4096)})
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    assert [s["samples"] for s in index["shards"]][0] == 0  # the writer's empty shard
    manifest = publish(tmp_path, tmp_path / "mds", "mds")
    assert [s.row_count for s in manifest.shards] == [1, 1, 1]


def test_mds_publish_reads_only_the_index(tmp_path: Path) -> None:
    needs_streaming()
    _write_mds(tmp_path / "mds", None)
    for shard in (tmp_path / "mds").glob("*.mds"):
        shard.write_bytes(b"\0" * shard.stat().st_size)  # unreadable, same size: never read
    manifest = publish(tmp_path, tmp_path / "mds", "mds")
    assert sum(s.row_count for s in manifest.shards) == 12


def test_mds_damaged_shard_is_named(tmp_path: Path) -> None:
    needs_streaming()
    _write_mds(tmp_path / "mds", None)
    manifest = publish(tmp_path, tmp_path / "mds", "mds")
    key = manifest.shards[0].source_key
    data = bytearray((tmp_path / "mds" / key).read_bytes())
    data[8:12] = (10**6).to_bytes(4, "little")  # an offset past the end
    with pytest.raises(MalformedShard, match=rf"{key}: sample offsets do not fit"):
        list(
            preprocess(bytes(data), fmt=pb.SOURCE_FORMAT_MDS, source=key, spec=manifest.preprocess)
        )


def test_objects_whose_types_differ_are_told_the_type_that_makes_them_agree(
    tmp_path: Path,
) -> None:
    """It said "(a: double…) but (a: int64…); must agree" and left the fix to the reader."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "p0.csv").write_bytes(b"a,b\n1,x\n")
    (tmp_path / "src" / "p1.csv").write_bytes(b"a,b\n1.5,y\n")
    with pytest.raises(MalformedShard) as refused:
        publish(tmp_path, tmp_path / "src", "ab")
    message = str(refused.value)
    assert "a: float64" in message and "double" not in message, message
    assert "--column-types a=float64" in message, message
    (tmp_path / "src" / "p0.csv").write_bytes(b"a,b\n1,x\n")
    typed = publish(tmp_path, tmp_path / "src", "ab", source_options={"column_types": "a=float64"})
    assert typed.version == 1
