"""Publishing real-world sources (stop 44, found by a helper publishing its own data).

CSV cells that read as null: an empty unquoted cell, and the texts the version records.

pyarrow's default list made ``NA`` (Namibia's country code), ``null``, ``N/A``,
``NULL`` and ``nan`` nulls, silently: a text column of notes was published as
type ``null`` with every value lost, and a float ``nan`` became a null that
EdgeDataset then refused. Every CSV version now records its ``null_values``
(none but the empty cell by default, ``--null-values NA,N/A`` for more); a
version recorded without them (published before) is read as it was.

A dictionary column beside plain strings is told the cast that publishes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
from typer.testing import CliRunner

from edgecache.cache.preprocess import canonical_options, read_source
from edgecache.cache.registry import Registry
from edgecache.clients.cli.app import app
from edgecache.v1 import manifest_pb2 as pb

CSV = pb.SOURCE_FORMAT_CSV
DATA = b'id,country,note,x,n,s\n1,NA,null,nan,,""\n2,DE,N/A,1.5,3,a\n3,FR,NULL,2.5,4,\n'


def _read(options: dict[str, str]) -> pa.Table:
    batches = read_source(DATA, fmt=CSV, source="file:///x.csv", options=options)
    return pa.Table.from_batches(list(batches))


def test_texts_stay_text_and_only_an_empty_cell_is_null() -> None:
    table = _read(canonical_options(CSV, {}))
    assert table.column("country").to_pylist() == ["NA", "DE", "FR"]
    assert table.column("note").type == pa.string()
    assert table.column("note").to_pylist() == ["null", "N/A", "NULL"]
    x = table.column("x").to_pylist()
    assert math.isnan(x[0]) and x[1:] == [1.5, 2.5]  # NaN, not a null
    assert table.column("n").to_pylist() == [None, 3, 4]  # the empty cell
    assert table.column("s").to_pylist() == ["", "a", None]  # "" is an empty string


def test_the_texts_given_read_as_null() -> None:
    options = canonical_options(CSV, {"null_values": "NA, N/A"})
    assert options["null_values"] == "NA,N/A"
    table = _read(options)
    assert table.column("country").to_pylist() == [None, "DE", "FR"]
    assert table.column("note").to_pylist() == ["null", None, "NULL"]


def test_a_version_recorded_without_them_reads_as_it_was_published() -> None:
    table = _read({})  # an older version's spec: pyarrow's list, as its schema says
    assert table.column("country").to_pylist() == [None, "DE", "FR"]
    assert table.column("note").type == pa.null()


def test_publish_records_them_and_takes_the_flag(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part-0.csv").write_bytes(DATA)
    registry = f"file://{tmp_path}/registry"
    runner = CliRunner()
    for flags, recorded in (([], ""), (["--null-values", "NA,N/A"], "NA,N/A")):
        done = runner.invoke(
            app,
            ["publish", str(tmp_path / "src"), "--dataset", "c", "--registry", registry, *flags],
        )
        assert done.exit_code == 0, done.output
        manifest = Registry.run(registry, lambda reg: reg.resolve("c@latest"))
        assert manifest.preprocess.source_options["null_values"] == recorded
        schema = pa.ipc.read_schema(pa.py_buffer(manifest.arrow_schema))
        assert schema.field("note").type == pa.string()


def test_a_dictionary_column_beside_plain_strings_is_told_the_cast(tmp_path: Path) -> None:
    """pandas' category column in one file, plain strings in the next: refused with no fix
    ('all objects of a version must agree'), though a cast to string publishes it."""
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    categories = pa.array(["a", "b"]).dictionary_encode()
    pq.write_table(pa.table({"id": [1, 2], "c": categories}), tmp_path / "src" / "part-0.parquet")
    pq.write_table(pa.table({"id": [3, 4], "c": ["c", "d"]}), tmp_path / "src" / "part-1.parquet")
    registry = f"file://{tmp_path}/registry"
    refused = CliRunner().invoke(
        app, ["publish", str(tmp_path / "src"), "--dataset", "d", "--registry", registry]
    )
    assert refused.exit_code == 2, refused.output
    assert "--transform columns --param 'cast=c=string'" in " ".join(refused.output.split())
    done = CliRunner().invoke(
        app,
        ["publish", str(tmp_path / "src"), "--dataset", "d", "--registry", registry]
        + ["--transform", "columns", "--param", "cast=c=string"],
    )
    assert done.exit_code == 0, done.output


def test_a_file_url_with_one_slash_is_the_file_and_a_one_slash_s3_url_is_refused(
    tmp_path: Path,
) -> None:
    """file:/abs/path (RFC 8089) read as a relative directory "file:"; s3:/bucket likewise,
    "no objects under file:///here/s3:/bucket" hiding the missing slash."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part-0.csv").write_bytes(DATA)
    registry = f"file://{tmp_path}/registry"
    runner = CliRunner()
    done = runner.invoke(
        app, ["publish", f"file:{tmp_path}/src", "--dataset", "f", "--registry", registry]
    )
    assert done.exit_code == 0, done.output
    typo = runner.invoke(
        app, ["publish", "s3:/bucket/raw", "--dataset", "f", "--registry", registry]
    )
    assert typo.exit_code == 2, typo.output
    assert "write s3://bucket/raw" in " ".join(typo.output.split()), typo.output


def test_nulls_in_text_and_variable_lists_are_warned_at_publish(tmp_path: Path) -> None:
    """A null string (a packed column by default) and a null list of numbers (padded by
    default) published silently, and the first read of each raised ValueError."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part-0.jsonl").write_text(
        '{"id": 1, "name": "a", "ids": [1, 2]}\n{"id": 2, "name": null, "ids": null}\n'
        '{"id": 3, "name": "c", "ids": [3, null]}\n'
    )
    registry = f"file://{tmp_path}/registry"
    done = CliRunner().invoke(
        app,
        ["publish", str(tmp_path / "src"), "--dataset", "j", "--registry", registry, "--json"],
    )
    assert done.exit_code == 0, done.output
    printed = json.loads(done.output)
    assert {(n["column"], n["count"]) for n in printed["nulls"]} == {("name", 1), ("ids", 2)}
    said = " ".join(printed["warnings"])
    assert "packed column (binary='packed', the default)" in said, said
    assert "pads it into a tensor (ragged='padded', the default)" in said, said


def test_a_webdataset_key_that_is_not_utf8_is_refused_at_publish_naming_it(
    tmp_path: Path,
) -> None:
    """A Latin-1 member name published, and every node failed the shard ("surrogates not
    allowed"), naming no member."""
    import io
    import tarfile

    (tmp_path / "src").mkdir()
    with tarfile.open(
        tmp_path / "src" / "a.tar", "w", format=tarfile.GNU_FORMAT, encoding="latin-1"
    ) as tar:
        for name, data in (("caf\u00e9.txt", b"one"), ("plain.txt", b"two")):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    refused = CliRunner().invoke(
        app,
        ["publish", str(tmp_path / "src"), "--dataset", "w", "--registry", f"file://{tmp_path}/r"],
    )
    assert refused.exit_code == 2, refused.output
    said = " ".join(refused.output.split())
    assert "b'caf\\xe9' is not UTF-8" in said and "convmv" in said, said
