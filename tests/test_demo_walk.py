"""The demo walked as a first-time user runs it: failures, signals, reruns, --json, the story.

Each test uses the demo's small mode (a few MiB, two shards) so it stays
within seconds; the demo's nodes are real ``edgecache serve`` processes, so
every test checks none is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.progress import Progress
from typer.testing import CliRunner

import edgecache.clients.demo as demo_module
from edgecache.clients.cli.app import app
from edgecache.clients.demo import run_demo
from edgecache.clients.node_client import LocalNode

SMALL = {"total_mib": 2, "shards": 2}


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (the demo's nodes name their cache dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and "serve" in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def started_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[LocalNode]]:
    """Every node the demo starts, killed afterwards whatever the test found."""
    nodes: list[LocalNode] = []
    real = demo_module.start_local_node

    def recording(*args: object, **kwargs: object) -> LocalNode:
        node = real(*args, **kwargs)  # type: ignore[arg-type]
        nodes.append(node)
        return node

    monkeypatch.setattr(demo_module, "start_local_node", recording)
    yield nodes
    for node in nodes:
        if node.process.poll() is None:
            node.process.kill()
            node.process.wait()


def test_a_failure_after_the_nodes_started_stops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started_nodes: list[LocalNode]
) -> None:
    """A failed step (or `edgecache demo | head`, a broken pipe) must not leave nodes up."""

    def broken(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError("stdout went away")

    monkeypatch.setattr(demo_module, "train", broken)
    with pytest.raises(BrokenPipeError):
        run_demo(tmp_path, **SMALL)  # type: ignore[arg-type]
    assert len(started_nodes) == 2
    assert [n.process.poll() is not None for n in started_nodes] == [True, True]


def test_sigterm_stops_the_nodes_and_removes_the_temporary_directory(tmp_path: Path) -> None:
    """`kill`, `timeout` or a closed terminal: exit 128 + signal, nothing left behind."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", "demo", "--size-mib", "2"]
        + ["--shards", "2", "--keep-nodes"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            if line.startswith("Ctrl-C stops the nodes"):
                break
        assert len(_processes_mentioning(str(tmp_path))) == 2
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if demo.poll() is None:
            demo.kill()
        left = _processes_mentioning(str(tmp_path))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert list(tmp_path.glob("edgecache-demo-*")) == []


def test_ctrl_c_in_a_terminal_stops_the_demo_not_its_nodes_first(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group.

    The nodes used to share the demo's group, so they died of it first and the
    demo reported "region eu-west is unreachable"; now they run in their own
    session, and the demo stops them, says so and exits 130.
    """
    # The demo runs ~2 s after it names its nodes. On a loaded host this test was once
    # scheduled too late for that (the demo had ended, exit 0): such a run is tried again;
    # a Ctrl-C the demo itself missed would miss every time.
    for attempt in range(3):
        stderr, late = _ctrl_c_while_the_demo_runs(tmp_path / f"try-{attempt}")
        if not late:
            break
    else:
        pytest.fail("the demo ended before Ctrl-C reached it, three times")
    assert "stopped by Ctrl-C" in stderr and "unreachable" not in stderr


def _ctrl_c_while_the_demo_runs(tmp_path: Path) -> tuple[str, bool]:
    """Ctrl-C to the demo's process group once it names its nodes: (stderr, whether it was late)."""
    tmp_path.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", "demo", "--size-mib", "2"]
        + ["--shards", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # a process group of its own, as a terminal's job has
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            if line.startswith("nodes: "):
                break
        assert len(_processes_mentioning(str(tmp_path))) == 2
        os.killpg(demo.pid, signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=60)
        # Late: the demo had ended (exit 0) or was exiting (killed by SIGINT as it did).
        late = demo.returncode in (0, -signal.SIGINT) and "--keep-nodes" in stdout
        assert late or demo.returncode == 130, stderr
    finally:
        if demo.poll() is None:
            demo.kill()
        left = _processes_mentioning(str(tmp_path))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert list(tmp_path.glob("edgecache-demo-*")) == []
    return stderr, late


def test_an_error_is_said_once_with_its_own_exit_code(tmp_path: Path) -> None:
    """A bad --workdir printed its error, then "error: 2", and exited 1 (typer.Exit is a
    RuntimeError, which the demo's handler took for a failed step)."""
    (tmp_path / "file").write_text("not a directory")
    result = CliRunner().invoke(
        app, ["demo", "--size-mib", "1", "--workdir", str(tmp_path / "file" / "w")]
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "file" in errors[0], result.output


def test_json_names_no_deleted_workdir() -> None:
    """Without --workdir the files are removed at the end: --json must not point at them."""
    result = CliRunner().invoke(app, ["demo", "--size-mib", "2", "--shards", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["workdir"] is None or Path(figures["workdir"]).is_dir()
    assert figures["verified"] is True


def test_a_second_run_in_one_workdir_reports_this_versions_bytes(tmp_path: Path) -> None:
    """'cached in eu-west' is this version's bytes, not every version the node kept."""
    first = run_demo(tmp_path, **SMALL)  # type: ignore[arg-type]
    second = run_demo(tmp_path, **SMALL)  # type: ignore[arg-type]
    assert (first.dataset, second.dataset) == ("demo-tokens@1", "demo-tokens@2")
    assert second.stored_bytes == first.stored_bytes
    # Fewer shards the third time: the earlier run's shards are not published with them.
    third = run_demo(tmp_path, total_mib=1, shards=1)
    assert third.dataset == "demo-tokens@3" and third.shards == 1 and third.verified
    assert sorted(p.name for p in (tmp_path / "origin").iterdir()) == ["part-00000.parquet"]


def test_the_story_shows_the_pin_with_time_zones_and_a_bar_for_every_step(
    tmp_path: Path,
) -> None:
    """Writing the origin (the longest step of `make demo`) has a bar; the plan's pin is said."""
    lines: list[str] = []
    progress = Progress(disable=True)
    run_demo(tmp_path, progress=progress, say=lines.append, **SMALL)  # type: ignore[arg-type]
    bars = [task.description for task in progress.tasks]
    assert bars[0].startswith("write origin"), bars
    plan = [line for line in lines if line.startswith("plan: ")]
    assert any("pin demo-tokens@1 until" in line for line in plan), plan
    assert all("UTC" in line for line in plan), plan


def test_json_names_its_nodes_as_status_does() -> None:
    """Its nodes had ``address`` and ``shards_resident`` where status, evict and doctor
    say ``node``: a script joining the demo's figures with status found no key in common."""
    result = CliRunner().invoke(app, ["demo", "--size-mib", "1", "--shards", "1", "--json"])
    assert result.exit_code == 0, result.output
    nodes = json.loads(result.stdout)["nodes"]
    assert [n["region"] for n in nodes] == ["eu-west", "us-east"], nodes
    status_keys = {"region", "node", "used_bytes", "hits", "misses", "bytes_served", "versions"}
    for node in nodes:
        assert set(node) == status_keys, node  # each one of status --json's keys
        assert node["node"].startswith("127.0.0.1:"), node
        (held,) = node["versions"]
        assert held == {"version": "demo-tokens@1", "shards": 1, "total_shards": 1}, node


def test_a_copy_that_did_not_happen_or_was_too_quick_has_no_rate_not_0_b_s() -> None:
    """``--size-mib 1 --shards 1`` said "stage us-east from eu-west: 0 B/s": the timed cold
    read had cached the only shard, so nothing was copied, and 0 B/s read as a stalled link."""
    tiny = ["demo", "--size-mib", "1", "--shards", "1"]
    result = CliRunner().invoke(app, tiny, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.stdout.splitlines() if "stage us-east" in line]
    assert "0 B/s" not in row and "nothing to copy" in row, row
    assert "warm: us-east copied nothing from eu-west" in result.stdout, result.stdout
    result = CliRunner().invoke(app, [*tiny, "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["peer_copy_bytes_per_s"] is None, figures
    assert figures["peer_copy_why"].startswith("nothing to copy"), figures
    assert demo_module._rate(1 << 20, 0.0) is None  # no interval to speak of: no rate
    assert demo_module._rate(1 << 20, 0.5) == 2 << 20


def test_a_signal_while_a_node_starts_leaves_no_node_running(tmp_path: Path) -> None:
    """A Ctrl-C or SIGTERM landing while ``start_local_node`` waited for "serving on" left
    that node running in its own session (never handed back, so never stopped) and its
    cache dir written again after the demo removed it (a helper's hunt)."""
    import time

    from edgecache.clients.node_client import start_local_node

    cache = tmp_path / "cache-starting"
    (tmp_path / "registry").mkdir()  # a node that would serve, left alone

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # a node takes seconds to import and serve
    try:
        with pytest.raises(KeyboardInterrupt):
            start_local_node("eu", cache, f"file://{tmp_path}/registry")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    time.sleep(0.5)

    def running() -> list[str]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(cache) in line:
                found.append(line)
        return found

    assert running() == [], running()
