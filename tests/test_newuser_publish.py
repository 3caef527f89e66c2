"""What a new user meets publishing: an unchanged version found among all versions, image
folders, a tokenizer beside JSONL, ``versions NAME@N``, a CSV delimiter that splits
nothing, WebDataset samples without the images' member, and counts spelled right."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from edgecache.clients.cli import app

runner = CliRunner()


def cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(
        app, [*args, "--registry", str(tmp_path / "reg")], env={"COLUMNS": "400"}
    )
    return result.exit_code, result.output


def _parquet(folder: Path, shards: int = 2) -> Path:
    folder.mkdir()
    for i in range(shards):
        pq.write_table(pa.table({"a": list(range(i, i + 10))}), folder / f"part-{i}.parquet")
    return folder


def _image(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(out, format=fmt)
    return out.getvalue()


def test_if_changed_and_the_warning_compare_with_every_version(tmp_path: Path) -> None:
    raw = _parquet(tmp_path / "tok")
    assert cli(tmp_path, "publish", str(raw), "--dataset", "tok")[0] == 0
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--chunk-size", "256KiB")
    assert code == 0 and out.startswith("tok@2"), out

    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--if-changed")
    assert code == 0, out
    assert out.startswith("tok@1 ") and ": unchanged" in out, out
    assert "tok@2 is newer" in out and "read tok@1" in out, out
    assert sorted(p.name for p in (tmp_path / "reg" / "tok" / "versions").iterdir()) == [
        "1.json",
        "2.json",
    ]
    assert (tmp_path / "reg" / "tok" / "latest").read_text().strip() == "2"  # never back

    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--json")
    assert code == 0, out
    done = json.loads(out[out.index("{") :])
    assert done["version"] == "tok@3" and done["same_content_as"] == "tok@1", done
    assert any("same content as tok@1" in w for w in done["warnings"]), done


def test_an_unreadable_earlier_manifest_does_not_fail_a_written_version(tmp_path: Path) -> None:
    # The comparison runs after the version is committed: failing it then made a
    # retrying script publish a copy. The unreadable manifest is skipped, said once.
    raw = _parquet(tmp_path / "tok")
    assert cli(tmp_path, "publish", str(raw), "--dataset", "tok")[0] == 0
    assert cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--chunk-size", "256KiB")[0] == 0
    versions = tmp_path / "reg" / "tok" / "versions"
    (versions / "1.json").write_text("{not a manifest")

    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--json")
    assert code == 0, out
    done = json.loads(out[out.index("{") :])
    assert done["version"] == "tok@3" and done["same_content_as"] is None, done
    (said,) = [w for w in done["warnings"] if "could not read the manifest" in w]
    assert "tok@1" in said and "tok@2" not in said, said
    assert sorted(p.name for p in versions.iterdir()) == ["1.json", "2.json", "3.json"]
    # --if-changed asks before writing: not knowing, it publishes nothing (it skipped the
    # unreadable versions and wrote a copy of the content they may hold).
    (versions / "3.json").write_text("{not a manifest either")
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--if-changed")
    assert code == 1, out
    text = " ".join(out.split())
    assert "cannot tell whether tok holds this content" in text and "tok@1, tok@3" in text, out
    assert "without --if-changed" in text, out
    assert sorted(p.name for p in versions.iterdir()) == ["1.json", "2.json", "3.json"]
    # versions, where that message sends the user, lists what it can read and names the
    # rest (it listed nothing, exit 2, at the first damaged manifest).
    code, out = cli(tmp_path, "versions", "tok", "--json")
    assert code == 1, out
    listed = json.loads(next(x for x in out.splitlines() if x.startswith("[")))
    assert [(e["version"], "error" in e) for e in listed] == [(1, True), (2, False), (3, True)]
    code, out = cli(tmp_path, "versions", "tok")
    assert code == 1 and "tok@1: its manifest cannot be read" in out, out
    assert "tok@3: its manifest cannot be read" in out and "256.0 KiB" in out, out
    # One version asked for by number or as the latest: 1 too, as --help says (it was 2,
    # bad input, for the registry's damaged content), and a readable one still shows.
    for spec in ("tok@3", "tok@latest"):
        code, out = cli(tmp_path, "versions", spec)
        assert code == 1 and "tok@3: its manifest cannot be read" in out, (spec, out)
        assert "Traceback" not in out, out
    code, out = cli(tmp_path, "versions", "tok@3", "--json")
    assert code == 1 and '"error"' in out, out
    code, out = cli(tmp_path, "versions", "tok@2")
    assert code == 0 and "tok@2 in" in " ".join(out.split()), out


def test_a_folder_of_images_is_told_how_to_pack_them(tmp_path: Path) -> None:
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(3):
        (imgs / f"a_{i}.jpg").write_bytes(_image("JPEG"))
        (imgs / f"b_{i}.png").write_bytes(_image("PNG"))
    args = ("--transform", "images", "--param", "size=4")
    code, out = cli(tmp_path, "publish", str(imgs), "--dataset", "imgs", *args)
    assert code == 2, out
    assert "image files" in out and "WebDataset tars" in out, out
    command = re.search(r"e\.g\. (.+?), then publish (\S+) with", " ".join(out.split()))
    assert command, out
    subprocess.run(["bash", "-c", command.group(1)], check=True)  # the advice, as given
    code, out = cli(
        tmp_path, "publish", command.group(2), "--dataset", "imgs", *args, "--param", "column=img"
    )
    assert code == 0, out
    assert "(1 shard, 6 rows)" in out, out
    assert "img: uint8[4,4,3]" in out, out


@pytest.mark.parametrize(
    ("names", "column", "rows"),
    [
        (["2024.01.05.jpg", "2024.01.06.jpg", "scan.v2.final.jpg"], "jpg", 3),
        (["a.JPG", "b.jpg", "c.v1.JPG"], "jpg", 3),
        (["x.1.jpg", "x.1.png", "y.png"], "img", 3),  # one stem, two kinds: two samples
    ],
)
def test_the_image_folder_advice_works_for_any_name(
    tmp_path: Path, names: list[str], column: str, rows: int
) -> None:
    """A WebDataset key ends at the first dot: names with several dots, or with
    extensions spelled otherwise, are renamed by the advice's tar command."""
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for name in names:
        (imgs / name).write_bytes(_image("PNG" if name.endswith("png") else "JPEG"))
    args = ("--transform", "images", "--param", "size=4")
    code, out = cli(tmp_path, "publish", str(imgs), "--dataset", "imgs", *args)
    assert code == 2, out
    flat = " ".join(out.split())
    command = re.search(r"e\.g\. (.+?), then publish (\S+) with .*?--param column=(\w+)", flat)
    assert command and command.group(3) == column, out
    subprocess.run(["bash", "-c", command.group(1)], check=True)
    code, out = cli(
        tmp_path,
        "publish",
        command.group(2),
        "--dataset",
        "imgs",
        *args,
        "--param",
        f"column={column}",
    )
    assert code == 0, out
    assert f"(1 shard, {rows} rows)" in out, out
    assert f"{column}: uint8[4,4,3]" in out, out


def test_a_tokenizer_beside_jsonl_is_named_briefly_with_exclude(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.mkdir()
    for name in ("train-0.jsonl", "train-1.jsonl"):
        rows = [json.dumps({"id": i, "text": f"doc {i}"}) for i in range(5)]
        (text / name).write_text("\n".join(rows) + "\n")
    vocab = {f"tok{i}": i for i in range(3000)}
    (text / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": vocab}}))
    code, out = cli(tmp_path, "publish", str(text), "--dataset", "text")
    assert code == 2, out
    assert len(out) < 1500, out
    assert "--exclude 'tokenizer.json'" in out, out
    assert "tok2999" not in out, out
    # The shards are the reference, not the tokenizer that sorts before train-*.
    assert f"{text}/tokenizer.json has columns" in out, out
    code, out = cli(
        tmp_path, "publish", str(text), "--dataset", "text", "--exclude", "tokenizer.json"
    )
    assert code == 0, out

    alone = tmp_path / "alone"  # one-row .json files with no shard beside them are the data
    alone.mkdir()
    (alone / "x.json").write_text('{"a": 1}')
    (alone / "y.json").write_text('{"b": "s"}')
    code, out = cli(tmp_path, "publish", str(alone), "--dataset", "alone")
    assert code == 2 and "has columns" in out and "--exclude" not in out, out


def test_versions_name_at_n_shows_that_version(tmp_path: Path) -> None:
    raw = _parquet(tmp_path / "tok", shards=1)
    assert cli(tmp_path, "publish", str(raw), "--dataset", "tok")[0] == 0
    assert cli(tmp_path, "publish", str(raw), "--dataset", "tok", "--chunk-size", "1MiB")[0] == 0
    code, out = cli(tmp_path, "versions", "tok@1", "--json")
    assert code == 0, out
    assert [v["version"] for v in json.loads(out)] == [1]
    code, out = cli(tmp_path, "versions", "tok@latest")
    assert code == 0 and "tok@2 in" in out, out
    code, out = cli(tmp_path, "versions", "tok@7")
    assert code == 2 and "known versions: 1, 2" in out, out


def test_a_delimiter_that_splits_nothing_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "csv"
    raw.mkdir()
    lines = ["sensor_id,timestamp,temp"] + [f"s{i},2024-01-0{i + 1},{i}.5" for i in range(5)]
    (raw / "m.csv").write_text("\n".join(lines) + "\n")
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "m", "--delimiter", ";")
    assert code == 2, out
    assert "Publish with --delimiter comma" in out, out
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "m", "--delimiter", "comma")
    assert code == 0 and "(1 shard, 5 rows)" in out, out


def test_webdataset_samples_without_the_images_column_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "wds"
    raw.mkdir()
    with tarfile.open(raw / "shard-0.tar", "w") as tar:
        for i in range(4):
            ext, data = ("jpg", _image("JPEG")) if i % 2 else ("png", _image("PNG"))
            for name, body in ((f"s{i}.{ext}", data), (f"s{i}.cls", str(i).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    args = ("--transform", "images", "--param", "size=4", "--param", "column=jpg")
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "w", *args)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "2 samples (s0, s2) have no .jpg member (they hold png)" in flat, out
    assert "on_error=skip" in flat, out
    # The repack advised, done with GNU tar as printed: the labels keep their .cls (a
    # rename of every member's extension named them .jpg too: refused as two .jpg).
    renames = re.findall(r"--transform '(s/[^']+/)'", flat)
    assert renames == ["s/[.]png$/.jpg/"], out
    (tmp_path / "members").mkdir()
    with tarfile.open(raw / "shard-0.tar") as tar:
        members = tar.getnames()
        tar.extractall(tmp_path / "members", filter="data")
    (tmp_path / "repacked").mkdir()
    repack = ["tar", "cf", str(tmp_path / "repacked" / "shard-0.tar")]
    repack += [arg for rename in renames for arg in ("--transform", rename)]
    subprocess.run([*repack, *members], cwd=tmp_path / "members", check=True)
    code, again = cli(tmp_path, "publish", str(tmp_path / "repacked"), "--dataset", "w2", *args)
    assert code == 0 and "(1 shard, 4 rows)" in again, again
    code, out = cli(
        tmp_path, "publish", str(raw), "--dataset", "w", *args, "--param", "on_error=skip"
    )
    assert code == 0 and "(1 shard, 2 rows)" in out, out
    flat = " ".join(out.split())
    assert "2 samples of 4 are left out of the version (on_error=skip)" in flat, out
    assert "(key 's0')" in flat and "(key 's2')" in flat, out
    code, out = cli(
        tmp_path, "publish", str(raw), "--dataset", "w", *args, "--param", "on_error=skip",
        "--json",
    )  # fmt: skip
    shown = json.loads(out)
    assert [d["count"] for d in shown["dropped"]] == [2], out
    assert shown["dropped"][0]["object"].endswith("shard-0.tar"), out


def test_webdataset_samples_without_the_only_image_member_are_refused(tmp_path: Path) -> None:
    """Without column=, images decodes the only binary column; a sample lacking it
    (a label alone) used to publish and then fail every staging ("it is null")."""
    raw = tmp_path / "wds"
    raw.mkdir()
    with tarfile.open(raw / "shard-0.tar", "w") as tar:
        for i in range(4):
            members = [(f"s{i}.cls", str(i).encode())]
            if i != 3:
                members.insert(0, (f"s{i}.jpg", _image("JPEG")))
            for name, body in members:
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    args = ("--transform", "images", "--param", "size=4")
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "w", *args)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "1 sample (s3) has no .jpg member" in flat and "on_error=skip" in flat, out
    code, out = cli(tmp_path, "publish", str(raw), "--dataset", "w", *args, "--param",
                    "on_error=skip")  # fmt: skip
    assert code == 0 and "(1 shard, 3 rows)" in out, out
