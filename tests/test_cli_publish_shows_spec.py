"""`publish` and `versions` say how each version was prepared; a closed pipe ends them quietly.

Two versions of one dataset can share a schema and differ only in how their
source was read (`--column-names`, `--delimiter`), transformed or encoded: the
text output and `--json` show all of it. `edgecache versions big | head -1` is
what a shell user types: the command stops without a word when head is done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgecache.clients.cli import app

runner = CliRunner()
NARROW = {"COLUMNS": "80"}


def cli(*args: str) -> str:
    result = runner.invoke(app, list(args), env=NARROW)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_publish_and_versions_show_format_reader_options_transform_and_codec(
    tmp_path: Path,
) -> None:
    registry = f"file://{tmp_path}/reg"
    semicolons = tmp_path / "semicolons"
    semicolons.mkdir()
    (semicolons / "pairs.csv").write_text("1;2\n3;4\n")
    out = cli(
        *("publish", str(semicolons), "--dataset", "pairs", "--registry", registry),
        *("--no-header", "--column-names", "a,b", "--delimiter", ";"),
        *("--transform", "columns", "--param", "rename=a=x"),
    )
    assert out.splitlines()[1:] == [
        f"  source file://{semicolons}/ (CSV; header=false, column_names=a,b, delimiter=semicolon)",
        "  transform columns (rename=a=x) · chunks byte-split-zstd-1, 4.0 MiB",
        "  x: int64",
        "  b: int64",
    ], out

    # The same numbers, tab-separated, read with other options and stored another way.
    tabs = tmp_path / "tabs"
    tabs.mkdir()
    (tabs / "pairs.csv").write_text("1\t2\n3\t4\n")
    published = json.loads(
        cli(
            *("publish", str(tabs), "--dataset", "pairs", "--registry", registry, "--json"),
            *("--no-header", "--column-names", "x,b", "--delimiter", "tab"),
            *("--compression", "zstd", "--level", "3"),
        )
    )
    spelled = (published["version"], published["dataset"], published["number"])
    assert spelled == ("pairs@2", "pairs", 2)
    assert published["reused"] is False
    assert published["source_url"] == f"file://{tabs}/" and published["format"] == "csv"
    assert published["source_options"] == {
        "column_names": "x,b",
        "delimiter": "\t",
        "header": "false",
        "null_values": "",  # as recorded: every CSV version records its null texts
    }
    assert published["transform"] == "identity" and published["params"] == {}
    assert (published["compression"], published["compression_level"]) == ("zstd", 3)

    listed = json.loads(cli("versions", "pairs", "--registry", registry, "--json"))
    first, second = listed
    # The keys scripts already read are all still there.
    assert {"version", "digest", "shards", "rows", "source_bytes", "created_at", "schema"} <= set(
        first
    )
    assert [f["name"] for f in first["schema"]] == [f["name"] for f in second["schema"]]
    assert {k: v for k, v in first.items() if k not in ("digest", "created_at")} == {
        "version": 1,
        "shards": 1,
        "rows": 2,
        "source_bytes": 8,
        "schema": first["schema"],
        "source_url": f"file://{semicolons}/",
        "format": "csv",
        "source_options": {
            "column_names": "a,b",
            "delimiter": ";",
            "header": "false",
            "null_values": "",
        },
        "transform": "columns",
        "params": {"rename": "a=x"},
        "compression": "byte-split-zstd",
        "compression_level": 1,
        "chunk_bytes": 4 << 20,
    }
    assert second["source_options"]["delimiter"] == "\t" and second["compression"] == "zstd"

    text = cli("versions", "pairs", "--registry", registry)
    assert "\t" not in text  # a tab delimiter is named, never printed raw
    blocks = text.split("\n2\n")
    assert len(blocks) == 2, text
    assert "(CSV; header=false, column_names=a,b, delimiter=semicolon)" in blocks[0]
    assert "transform columns (rename=a=x) · chunks byte-split-zstd-1, 4.0 MiB" in blocks[0]
    assert "(CSV; header=false, column_names=x,b, delimiter=tab)" in blocks[1]
    assert "    chunks zstd-3, 4.0 MiB\n" in blocks[1]
    assert "transform" not in blocks[1]  # the identity transform goes without saying
    boxed = [line for line in text.splitlines() if set(line) & set("│┃━─┏┗┡└")]
    assert all(len(line) <= 80 for line in boxed), text


@pytest.mark.parametrize(
    "command",
    [
        ["versions", "wide"],
        ["versions", "wide", "--json"],
        ["publish", "SOURCE", "--dataset", "w2"],
    ],
    ids=["versions", "versions-json", "publish"],
)
def test_a_closed_pipe_ends_the_command_quietly_with_141(
    tmp_path: Path, command: list[str]
) -> None:
    """`edgecache versions wide | head -1`: no traceback, no error, exit 128 + SIGPIPE."""
    source = tmp_path / "raw"
    source.mkdir()
    names = [f"a_column_with_a_rather_long_name_{i:04d}" for i in range(2000)]
    (source / "wide.csv").write_text(f"{','.join(names)}\n{','.join(['1'] * len(names))}\n")
    registry = f"file://{tmp_path}/reg"
    for _ in range(2):  # two versions: some 180 KB of listing, past any pipe's buffer
        cli("publish", str(source), "--dataset", "wide", "--registry", registry, "--json")
    args = [str(source) if a == "SOURCE" else a for a in command]
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", *args, "--registry", registry],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env={**os.environ, **NARROW},
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as out:
        head = out.read(64)  # what head -c 64 takes, then it exits
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert head.startswith((b"wide in ", b"[{", b"w2@1  sha256:")), head
    assert err == b""
    assert proc.returncode == 141


def test_column_names_that_would_read_as_something_else_are_quoted(tmp_path: Path) -> None:
    """A header cell "a, b" printed bare read as two columns in `name: type` lines; names
    are shown as params write them (select=, cast=), and the param takes them back."""
    registry = f"file://{tmp_path}/reg"
    src = tmp_path / "odd"
    src.mkdir()
    (src / "part.csv").write_text('"a, b",x=1," lead",plain,"say ""hi"""\n1,2,3,4,5\n')
    out = cli("publish", str(src), "--dataset", "odd", "--registry", registry)
    assert out.splitlines()[-5:] == [
        '  "a, b": int64',
        '  "x=1": int64',
        '  " lead": int64',
        "  plain: int64",
        '  "say ""hi""": int64',
    ], out
    table = cli("versions", "odd", "--registry", registry)
    assert '"a, b": int64' in table and "plain: int64" in table, table
    # What is shown is what a param takes: select the quoted names back by copying them.
    picked = cli(
        *("publish", str(src), "--dataset", "picked", "--registry", registry),
        *("--transform", "columns", "--param", 'select="a, b"," lead"'),
    )
    assert picked.splitlines()[-2:] == ['  "a, b": int64', '  " lead": int64'], picked


def test_a_stdout_closed_from_the_start_or_full_ends_with_a_word_not_a_traceback(
    tmp_path: Path,
) -> None:
    """`edgecache versions t --json >&-` crashed with AttributeError (Python's stdout is None
    then), exit 120; `>/dev/full` printed a traceback of the failed flush, exit 1."""
    source = tmp_path / "raw"
    source.mkdir()
    (source / "p.csv").write_text("a,b\n1,2\n3,4\n")
    registry = f"file://{tmp_path}/reg"
    cli("publish", str(source), "--dataset", "t", "--registry", registry, "--json")
    command = [sys.executable, "-m", "edgecache.clients.cli", "versions", "t", "--json"]
    closed = subprocess.run(
        [*command, "--registry", registry],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),  # noqa: PLW1509 (no threads in this test process)
        timeout=120,
    )
    assert (closed.returncode, closed.stderr) == (141, b""), closed.stderr.decode()
    with open("/dev/full", "wb") as full:
        failed = subprocess.run(
            [*command, "--registry", registry], stdout=full, stderr=subprocess.PIPE, timeout=120
        )
    said = failed.stderr.decode()
    assert failed.returncode == 1, said
    assert said == "error: cannot write the output to stdout: [Errno 28] No space left on device\n"
