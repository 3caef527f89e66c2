"""The ops CLI's answers to bad input and unreachable places: the right exit, the right culprit.

A reviewer's list: an unreachable registry said to hold nothing (exit 2), a
raw socket error naming no registry, a file taken for a missing registry,
``ready --timeout`` ignored without ``--wait``, ``healthcheck --timeout 0``
blaming a healthy node, ``--at`` suggesting a form it refused, ``warm``
saying "would stage" a version held whole and sizes a dry run and its real
run counted differently, and help and error texts that read badly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import typer
from edgeutil import node_settings, write_parquet_shards
from rich.cells import cell_len
from typer.testing import CliRunner

from edgecache.cache.preprocess.arrow_types import parse_type
from edgecache.clients import healthcheck
from edgecache.clients.cli import app
from edgecache.clients.cli.context import flowing
from edgecache.clients.cli.render import format_bytes
from edgecache.clients.cli.staging import parse_at
from edgecache.edge.server import running_node

runner = CliRunner()


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


# ------------------------------------------------------------------ the registry


def test_an_unreachable_http_registry_is_a_failure_naming_it_not_an_empty_one(
    closed_port: int,
) -> None:
    """fsspec's HTTP listing answers "nothing there" for a host it cannot reach."""
    url = f"http://127.0.0.1:{closed_port}/reg"
    code, out = cli("versions", "t-x", "--registry", url)
    assert code == 1, out
    assert f"cannot reach registry {url}:" in out and "check --registry" in out, out
    assert "holds no datasets" not in out, out


@pytest.mark.parametrize("command", ["versions", "publish"])
def test_a_raw_socket_error_names_the_registry_and_what_to_check(
    command: str, closed_port: int, tmp_path: Path
) -> None:
    """An FTP filesystem connects when opened: its error said only "[Errno …] …"."""
    url = f"ftp://127.0.0.1:{closed_port}/reg"
    if command == "versions":
        code, out = cli("versions", "t-pq", "--registry", url)
    else:
        write_parquet_shards(tmp_path / "raw", 1, rows=10)
        code, out = cli("publish", str(tmp_path / "raw"), "--dataset", "t-x", "--registry", url)
    assert code == 1, out
    assert out.startswith(f"error: cannot reach registry {url}: [Errno"), out
    assert "check --registry (or registry: in the topology file) and the network" in out, out


def test_an_unreachable_source_is_named_as_the_source(closed_port: int, tmp_path: Path) -> None:
    url = f"ftp://127.0.0.1:{closed_port}/raw"
    code, out = cli("publish", url, "--dataset", "t-x", "--registry", str(tmp_path / "reg"))
    assert code == 1 and f"cannot reach source {url}" in out and "the source URL" in out, out


def test_a_registry_that_is_a_file_is_said_to_be_one(tmp_path: Path) -> None:
    (tmp_path / "registry").write_text("not a registry")
    code, out = cli("versions", "t-x", "--registry", str(tmp_path / "registry"))
    assert code == 2, out
    assert "is a file, not a directory" in out and "does not exist" not in out, out


# ------------------------------------------------------------------ options


def test_ready_refuses_a_timeout_without_wait() -> None:
    """--timeout without --wait was taken and ignored: the check ran once."""
    code, out = cli("ready", "t-x@1", "--region", "eu", "--timeout", "3")
    assert code == 2 and "--timeout needs --wait" in out, out
    code, out = cli("ready", "--help")
    assert "needs --wait" in " ".join(out.replace("│", " ").split()), out


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_healthcheck_refuses_a_timeout_that_is_no_wait(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC took it for a deadline already past: DEADLINE_EXCEEDED, a healthy node blamed."""
    code, out = cli("healthcheck", "127.0.0.1:7071", "--timeout", timeout)
    assert code == 2 and f"--timeout {timeout}" in out and "more than 0" in out, out
    assert "DEADLINE_EXCEEDED" not in out, out
    # The image's HEALTHCHECK runs the module: the same check, the same exit.
    assert healthcheck.main(["127.0.0.1:7071", "--timeout", timeout]) == 2
    err = capsys.readouterr().err
    assert f"--timeout {timeout}" in err and "DEADLINE_EXCEEDED" not in err, err


@pytest.mark.parametrize(
    ("given", "suggestion"),
    [
        ("2026-12-06", "2026-12-06T00:00:00Z"),
        ("2026-12-06Z", "2026-12-06T00:00:00Z"),  # a date takes no zone in fromisoformat
        ("2026-12-06T09:30", "2026-12-06T09:30:00Z"),
        ("2026-12-06T09:30:15.5", "2026-12-06T09:30:15.500000Z"),
        ("2026-12-06T25:00Z", None),
        ("soon", None),
    ],
)
def test_every_time_parse_at_suggests_is_one_it_accepts(given: str, suggestion: str | None) -> None:
    """2026-12-06 was told to add Z; 2026-12-06Z was then "not a time"."""
    with pytest.raises(ValueError, match="--at") as caught:
        parse_at(given)
    said = str(caught.value)
    advice = said.replace(repr(given), "")  # what it suggests, not what it was given
    suggested = re.findall(r"\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:\d\d)", advice)
    assert suggested, said
    for each in suggested:
        assert parse_at(each) is not None, each
    assert suggestion is None or suggestion in suggested, said


# ------------------------------------------------------------------ texts


def test_the_known_arrow_types_read_as_a_list() -> None:
    with pytest.raises(ValueError) as caught:
        parse_type("int99")
    assert ",," not in str(caught.value) and "decimal128(P,S)" in str(caught.value)


# Every command, and the root ("").
COMMANDS = ["", *sorted(typer.main.get_command(app).commands)]  # type: ignore[attr-defined]
_ITEM = re.compile(r"\s*(?:[-*•]|\d+[.)])\s")


def help_paragraphs(cli_app: typer.Typer, args: list[str], columns: int) -> list[list[str]]:
    """The paragraphs of a ``--help`` above its boxes (options, commands), as printed."""
    result = runner.invoke(cli_app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = next(i for i, text in enumerate(lines) if text.strip().startswith("Usage:")) + 1
    end = next(i for i, text in enumerate(lines) if text.lstrip().startswith("╭"))
    paragraphs: list[list[str]] = [[]]
    for text in lines[start:end]:
        if text.strip():
            paragraphs[-1].append(text.rstrip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", COMMANDS)
def test_help_paragraphs_wrap_at_the_terminal_not_mid_sentence(command: str, columns: int) -> None:
    """The docstring's own line breaks were kept: "…with --if-changed, an" / "earlier".

    Each line of a paragraph but its last is full: the next line's first word
    would not have fitted on it (the help body is indented one column, and
    rich keeps one free at the right). A list item or an indented block may
    start a line wherever.
    """
    args = [command, "--help"] if command else ["--help"]
    paragraphs = help_paragraphs(app, args, columns)
    assert len(paragraphs) > 1, paragraphs  # a summary, then what the command says
    for paragraph in paragraphs:
        for text, after in zip(paragraph, paragraph[1:], strict=False):
            if _ITEM.match(after[1:]) or after[1:2].isspace():
                continue
            assert cell_len(text.strip()) <= columns - 2, paragraph
            fitted = cell_len(text.strip()) + 1 + cell_len(after.split()[0])
            assert fitted > columns - 2, f"{text!r} broke early, before {after.split()[0]!r}"


def test_flowing_keeps_a_docstrings_lists_and_blocks_as_lines() -> None:
    """Only prose joins: an item starts its line, a wrapped item joins it, a block stays."""
    one = typer.Typer()

    @one.command()
    @flowing
    def cmd() -> None:
        """Do a thing.

        What it says, over two lines of
        the source. Exit codes:
        - 0 done, an item long enough that
          its source wraps
        - 1 failed; --force is
        --force. then prose
        2. numbered

            edgecache cmd --flag
            edgecache cmd
        """

    paragraphs = help_paragraphs(one, ["--help"], 120)
    assert paragraphs[1:] == [
        [
            " What it says, over two lines of the source. Exit codes:",
            " - 0 done, an item long enough that its source wraps",
            " - 1 failed; --force is",
            " --force. then prose",
            " 2. numbered",
        ],
        ["     edgecache cmd --flag", "     edgecache cmd"],
    ], paragraphs


def test_a_format_the_names_contradict_is_said_so_not_as_bytes(tmp_path: Path) -> None:
    """Parquet read as CSV dumped the file's binary into the parse error."""
    write_parquet_shards(tmp_path / "raw", 2, rows=50)
    code, out = cli(
        "publish", str(tmp_path / "raw"), "--dataset", "t-x", "--format", "csv",
        "--registry", str(tmp_path / "reg"),
    )  # fmt: skip
    assert code == 2, out
    assert "says Parquet, and --format says csv" in out and "--format parquet" in out, out
    assert "parse error" not in out and "\ufffd" not in out, out


def test_json_lines_published_as_csv_are_refused_not_cut_into_columns(tmp_path: Path) -> None:
    """Review 41: --format csv on docs.jsonl parsed (commas split each object) and published
    columns named '{"id": 0' and ' "text": "doc 0"}', exit 0."""
    (tmp_path / "raw").mkdir()
    lines = "".join(f'{{"id": {i}, "text": "doc {i}"}}\n' for i in range(3))
    (tmp_path / "raw" / "docs.jsonl").write_text(lines)
    code, out = cli(
        "publish", str(tmp_path / "raw"), "--dataset", "docs", "--format", "csv",
        "--registry", str(tmp_path / "reg"),
    )  # fmt: skip
    assert code == 2, out
    assert "only as pieces of JSON" in out and "--format jsonl" in out, out
    code, out = cli(
        "publish", str(tmp_path / "raw"), "--dataset", "docs", "--registry", str(tmp_path / "reg")
    )
    assert code == 0 and "id: int64" in out and "text: string" in out, out


# ------------------------------------------------------------------ warm


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A registry with pq@1 and more@1 (other data), a node of region eu; the topology file."""
    root = tmp_path_factory.mktemp("warm")
    registry = f"file://{root}/registry"
    for name, rows in (("pq", 200), ("more", 300)):
        write_parquet_shards(root / name, 3, rows=rows)
        code, out = cli("publish", str(root / name), "--dataset", name, "--registry", registry)
        assert code == 0, out
    with running_node(node_settings(root, registry)) as node:
        config = root / "topology.yaml"
        config.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n")
        yield config


def source_size(config: Path, name: str) -> str:
    """The source bytes of a dataset's files, as warm prints a size."""
    return format_bytes(sum(p.stat().st_size for p in (config.parent / name).iterdir()))


def test_warm_one_version_says_what_it_staged_and_its_dry_run_what_is_held(site: Path) -> None:
    """The real run said a count alone (not pq@1, not the bytes); its dry run "would stage"
    a version held whole."""
    config = f"--config={site}"
    size = source_size(site, "pq")
    code, out = cli("evict", "pq@1", "--region", "eu", "--force", config)
    assert code == 0, out
    code, out = cli("warm", "pq", "--region", "eu", "--dry-run", config)
    assert code == 0, out
    assert f"eu: would stage pq@1 ({size}) from origin" in out, out
    code, out = cli("warm", "pq", "--region", "eu", config)
    assert code == 0, out
    assert f"eu: staged pq@1 ({size}) from origin" in out, out  # what NAME resolved to
    assert "sizes are source bytes from origin" in out, out
    code, out = cli("warm", "pq", "--region", "eu", "--dry-run", config)
    assert code == 0 and "eu: would stage pq@1 (nothing to move: its shards are held" in out, out
    assert "held already) from" not in out, out  # nothing comes from origin (a helper's hunt)
    code, out = cli("warm", "pq@1", "--region", "eu", "--dry-run", "--json", config)
    assert code == 0 and json.loads(out)["items"][0]["state"] == "held", out
    code, out = cli("warm", "pq", "--region", "eu", config)
    assert code == 0 and "eu: staged pq@1 (nothing moved: its shards were held already)" in out
    assert "held already) from" not in out, out
    # Counted as its dry run counts it: it said "1 of 1 item(s) staged".
    assert "warm: 0 of 1 item(s) staged (1 held already)" in out, out


def test_a_dry_run_and_its_real_run_say_the_same_size(site: Path) -> None:
    """The dry run gave the plan's estimate of stored bytes (from what the region holds:
    pq@1's ratio), the real run the source bytes the node fetched."""
    config = f"--config={site}"
    code, out = cli("warm", "pq", "--region", "eu", config)  # held: the plan's ratio
    assert code == 0, out
    start = datetime.now(UTC) + timedelta(hours=2)
    schedule = site.parent / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: j\n    region: eu\n    start: '{start.isoformat()}'\n"
        "    duration: 1h\n    datasets: [more@1]\n"
    )
    code, planned = cli("plan", str(schedule), "--json", config)
    assert code == 0, planned
    (task,) = json.loads(planned)["regions"]["eu"]["tasks"]
    size = source_size(site, "more")
    assert format_bytes(task["bytes"]) != size  # the premise: the estimate is not it
    code, dry = cli("warm", str(schedule), "--dry-run", config)
    assert code == 0, dry
    code, real = cli("warm", str(schedule), config)
    assert code == 0, real
    assert f"eu: would stage more@1 ({size}) from origin" in dry, dry
    assert f"eu: staged more@1 ({size}) from origin" in real, real
    for out in (dry, real):
        assert "sizes are source bytes from origin" in out, out


def test_an_option_of_one_value_given_twice_is_refused_not_the_last_kept(tmp_path: Path) -> None:
    """click keeps the last of an option given twice without a word: ``--column-types
    a=int32 --column-types b=int32`` published ``a`` as inferred (int64), exit 0."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "t.csv").write_text("a,b\n1,2\n3,4\n")
    registry = f"file://{tmp_path}/registry"
    for second in (["--column-types", "b=int32"], ["--column-types=b=int32"]):
        code, out = cli(
            "publish", f"file://{src}", "--dataset", "t", "--registry", registry,
            "--column-types", "a=int32", *second,
        )  # fmt: skip
        text = " ".join(out.replace("│", " ").split())
        assert code == 2 and "--column-types" in text and "given twice" in text, out
        assert "--column-types a=int32,b=int32" in text, out  # what to write instead
    assert not (tmp_path / "registry").exists()  # nothing published
    code, out = cli("versions", "t", "--registry", registry, "--registry", registry)
    assert code == 2 and "--registry" in out and "given twice" in out, out
    # Options that take several, and flags, may repeat as before.
    code, out = cli(
        "publish", f"file://{src}", "--dataset", "t", "--registry", registry,
        "--column-types", "a=int32,b=int32", "--include", "t.*", "--include", "*.csv", "--json",
    )  # fmt: skip
    assert code == 0, out
    assert '"a": "int32"' in out or "a: int32" in out or '"int32"' in out, out


def test_errors_a_helpers_walk_found_mute_say_what_to_do(tmp_path: Path, closed_port: int) -> None:
    """Each said what failed and not what to do about it."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    code, out = cli("publish", str(tmp_path / "raw"), "--dataset", "x", "--registry", registry,
                    "--param", "foo=1")  # fmt: skip
    assert code == 2 and "drop --param, or name the transform they are for" in out, out
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['127.0.0.1:{closed_port}']\n"
    )
    config = str(tmp_path / "edgecache.yaml")
    code, out = cli("plan", str(tmp_path / "no-such.yaml"), "--config", config)
    assert code == 2 and "No such file or directory (check the path)" in out, out
    code, out = cli("status", "--config", config)
    said = " ".join(out.split())
    assert code == 1 and "is down: UNAVAILABLE" in said, out
    assert "check that it runs and that this host reaches it (edgecache doctor)" in said, out
