"""What publish tells before training does: nulls in tensor columns, the type that keeps an
integer beside fractions, the version as a number in ``--json``, what WebDataset costs."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgeutil import publish_cli as publish
from typer.testing import CliRunner

from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.clients.cli import app

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[1] / "docs" / "preprocessing.md"


def _nulled_table() -> pa.Table:
    return pa.table(
        {
            "a": pa.array([1, None, 3, 4], pa.int64()),
            "emb": pa.array([[1.0, 2.0], None, [None, 3.0], [4.0, 5.0]], pa.list_(pa.float32(), 2)),
            "b": pa.array([0.5, 1.5, None, 2.5]),
            "s": pa.array(["x", "w", "y", "z"]),  # no null: a version of it alone is fine
        }
    )


def test_nulls_in_parquet_tensor_columns_are_warned_from_the_footer(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(_nulled_table(), raw / "a.parquet", row_group_size=2)
    pq.write_table(_nulled_table().slice(2), raw / "b.parquet")
    code, out = publish(tmp_path, raw, "--dataset", "pq")
    assert code == 0, out
    url_a, url_b = f"file://{raw}/a.parquet", f"file://{raw}/b.parquet"
    assert f"column 'a' (int64) holds 1 null in 1 object ({url_a}: 1)" in out, out
    assert f"column 'emb' (float32[2]) holds 3 nulls in 2 objects ({url_a}: 2, {url_b}: 1)" in out
    assert f"column 'b' (float64) holds 2 nulls in 2 objects ({url_a}: 1, {url_b}: 1)" in out
    assert "column 's'" not in out
    assert "ValueError" in out and "--transform columns --param select=s" in out
    assert "EdgeDataset columns=[...] without it" in out

    code, out = publish(tmp_path, raw, "--dataset", "pq", "--json")
    assert code == 0, out
    printed = json.loads(out)
    assert {(n["column"], n["object"], n["count"]) for n in printed["nulls"]} == {
        ("a", url_a, 1),
        ("emb", url_a, 2),
        ("emb", url_b, 1),
        ("b", url_a, 1),
        ("b", url_b, 1),
    }
    assert len(printed["warnings"]) == 4  # three columns, and the same content as pq@1
    assert any("same content as pq@1" in w for w in printed["warnings"])


def test_parquet_nulls_follow_the_columns_transform(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(_nulled_table(), raw / "a.parquet")
    code, out = publish(
        tmp_path,
        raw,
        *("--dataset", "pq", "--transform", "columns"),
        *("--param", "select=s,b", "--param", "rename=b=bee", "--param", "cast=bee=float32"),
    )
    assert code == 0, out
    assert "column 'bee' (float32) holds 1 null in 1 object" in out, out
    assert "column 'a'" not in out and "column 'emb'" not in out and "column 'b'" not in out


def test_no_statistics_no_warning(tmp_path: Path) -> None:
    """A footer without null counts says nothing, and publish reads no more to find out."""
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(_nulled_table(), raw / "a.parquet", write_statistics=False)
    code, out = publish(tmp_path, raw, "--dataset", "pq", "--json")
    assert code == 0, out
    assert json.loads(out)["nulls"] == [] and json.loads(out)["warnings"] == []


def test_nulls_in_csv_are_counted_after_the_transform(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text("id,score,name,tag\n1,0.5,a,t\n,1.5,b,u\n3,,c,v\n4,,,w\n")
    code, out = publish(tmp_path, raw, "--dataset", "csv")
    assert code == 0, out
    url = f"file://{raw}/x.csv"
    assert f"column 'id' (int64) holds 1 null in 1 object ({url}: 1)" in out, out
    assert f"column 'score' (float64) holds 2 nulls in 1 object ({url}: 2)" in out
    # The empty name cell: a packed column's null, warned too (stop 44: strings were left
    # out, "read as lists", and the first read of one raised mid-epoch), with the list form.
    assert f"column 'name' (string) holds 1 null in 1 object ({url}: 1)" in out
    assert "read it with binary='list'" in out
    # A version without the nulled columns: nothing to say.
    code, out = publish(
        tmp_path, raw, "--dataset", "csv", "--transform", "columns", "--param", "select=tag"
    )
    assert code == 0 and "warning" not in out, out


def test_the_python_api_logs_the_nulls(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text("id,x\n1,a\n,b\n2,c\n")
    spec = preprocess_spec(transform="identity", params={})

    async def go(reg: Registry) -> None:
        await reg.publish(str(raw), "csv", spec=spec)

    with caplog.at_level(logging.WARNING, logger="edgecache.cache.registry"):
        Registry.run(f"file://{tmp_path}/reg", go)
    assert any("column 'id' (int64) holds 1 null" in r.getMessage() for r in caplog.records)


def test_an_integer_past_int64_beside_fractions_is_told_decimal(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text("id,v\n1.5,2\n18446744073709551615,3\n")
    code, out = publish(tmp_path, raw, "--dataset", "d")
    assert code == 2 and "past int64" in out, out
    assert "'id=decimal128(38, 9)'" in out and "uint64" not in out, out
    # The hint, followed, keeps both values exactly.
    code, out = publish(tmp_path, raw, "--dataset", "d", "--column-types", "id=decimal128(38, 9)")
    assert code == 0, out
    # JSON Lines, a nested field: the same.
    (raw / "x.csv").unlink()
    (raw / "x.jsonl").write_text('{"a": {"xs": [1.5]}}\n{"a": {"xs": [18446744073709551615]}}\n')
    code, out = publish(tmp_path, raw, "--dataset", "j")
    assert code == 2 and "'a=struct<xs: list<decimal128(38, 9)>>'" in out, out
    assert "uint64" not in out
    # Integers alone past int64 still fit uint64, the narrowest type.
    (raw / "x.jsonl").write_text('{"id": 3}\n{"id": 18446744073709551615}\n')
    code, out = publish(tmp_path, raw, "--dataset", "j")
    assert code == 2 and "--column-types id=uint64" in out, out


def test_publish_json_version_is_name_at_n_with_the_number_beside(tmp_path: Path) -> None:
    # Scripts pass .version on to warm / EdgeDataset as is: it stays name@N.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "x.csv").write_text("id\n1\n2\n")
    code, out = publish(tmp_path, raw, "--dataset", "n", "--json")
    assert code == 0, out
    printed = json.loads(out)
    assert (printed["version"], printed["dataset"], printed["number"]) == ("n@1", "n", 1)
    listed = runner.invoke(app, ["versions", "n", "--registry", str(tmp_path / "reg"), "--json"])
    assert json.loads(listed.output)[0]["version"] == printed["number"]


def test_the_docs_say_publish_reads_each_tar_whole() -> None:
    (row,) = [r for r in DOCS.read_text().splitlines() if r.startswith("| `webdataset`")]
    assert "member headers (read once)" not in row
    assert re.search(r"read once, whole", row) and "downloads" in row


def test_the_advice_selects_the_data_columns_not_the_partitions(tmp_path: Path) -> None:
    """Partition columns come after the transform: a select= naming one would be refused."""
    raw = tmp_path / "raw" / "year=2024"
    raw.mkdir(parents=True)
    (raw / "x.csv").write_text("id,name\n1,a\n,b\n")
    code, out = publish(tmp_path, tmp_path / "raw", "--dataset", "p")
    assert code == 0 and "year: int64" in out, out
    assert "--transform columns --param select=name)" in out, out


def test_the_select_advice_names_every_column_kept_and_can_be_pasted(tmp_path: Path) -> None:
    """It printed select=c0,c1,c2,c3,c4,c5,…: a command that cannot be pasted."""
    raw = tmp_path / "raw"
    raw.mkdir()
    names = [f"c{i}" for i in range(9)]
    (raw / "x.csv").write_text(",".join(["id", *names]) + "\n" + "1" + ",x" * 9 + "\n" + ",z" * 9)
    code, out = publish(tmp_path, raw, "--dataset", "w")
    assert code == 0 and "…" not in out, out
    assert f"--param select={','.join(names)})" in out, out
    # Too many to paste: said in words, naming the column to leave out.
    wide = [f"column_with_a_long_name_{i}" for i in range(40)]
    (raw / "x.csv").write_text(",".join(["id", *wide]) + "\n1" + ",x" * 40 + "\n" + ",z" * 40)
    code, out = publish(tmp_path, raw, "--dataset", "w2")
    assert code == 0 and "…" not in out and "select=column_with" not in out, out
    assert "naming every one of its 41 columns but 'id'" in out, out


def test_the_select_advice_is_said_in_the_publishs_own_transform(tmp_path: Path) -> None:
    """The null warning's "--transform columns --param select=…" was refused pasted beside
    another --transform ("given twice"), and under columns with a rename it named the
    renamed column, which select (run before rename) does not know (a helper's hunt). Under
    columns it gives the params to use in place of those given; under another transform,
    none (the source and the reader are the ways out)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "t.csv").write_text("id,score\n1,\n2,3\n")
    given = ("--dataset", "r", "--transform", "columns", "--param", "rename=id=user_id")
    code, out = publish(tmp_path, raw, *given)
    assert code == 0, out
    said = " ".join(out.split())
    advice = re.search(r"\(--param (.*) in place of the --param ones given\)", said)
    assert advice, said
    params = [p.strip() for p in advice.group(1).split("--param")]
    assert params == ["select=id", "rename=id=user_id"], params
    pasted = [x for p in params for x in ("--param", p)]
    code, out = publish(tmp_path, raw, "--dataset", "r", "--transform", "columns", *pasted)
    assert code == 0 and "null" not in out, out
    # Under a transform of its own: no second --transform is suggested.
    from edgecache.cache.preprocess.nulls import NullCount, null_warnings

    nulled = [NullCount("caption", "string", "file:///x/a.parquet", 1)]
    (text,) = null_warnings(nulled, ["image", "caption"], "images", {"size": "16"})
    assert "--transform columns" not in text and "EdgeDataset columns=[...]" in text, text
