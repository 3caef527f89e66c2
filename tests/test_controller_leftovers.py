"""Controller leftovers: a metric for jobs first seen after their start, the most specific
reason a job missed its data, and schedule errors whose every line reads as one error.

Real nodes on loopback (``edgecache serve`` subprocesses), a file:// origin and registry,
the controller in-process on a clock the test moves by hand; the schedule errors through
the real CLI (typer's runner, and the controller's own log).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import pytest
from edgeutil import publish, write_parquet_shards
from prometheus_client.parser import text_string_to_metric_families
from test_controller import Clock, job, one_region, versions_on
from test_controller_records import views
from typer.testing import CliRunner

from edgecache.clients.cli import app
from edgecache.clients.controller import Controller
from edgecache.clients.node_client import LocalNode, start_local_node

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)
UNKNOWN = "edgecache_controller_jobs_unknown_at_start_total"
UNREADY = "edgecache_controller_jobs_unready_at_start_total"


def controller(root: Path, clock: Clock, **options: object) -> Controller:
    return Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock, **options)  # type: ignore[arg-type]


def scraped(port: int) -> dict[str, float]:
    """Every unlabelled sample of the controller's ``/metrics`` page: name → value."""
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


# ------------------------------------- 1: a job first seen after its start is counted


def test_a_job_first_seen_after_its_start_is_counted_unknown_on_metrics(eu) -> None:
    """It was recorded "unknown" but no metric counted it: a late restart left no trace."""
    root, registry, node = eu
    one_region(
        root,
        registry,
        node,
        job("late", "eu", T0, 2, "b@1"),  # started 10 minutes before any round
        job("soon", "eu", T0 + 30 * MINUTE, 2, "c@1"),  # seen before its start
    )
    clock = Clock(T0 + 10 * MINUTE)
    ctl = controller(root, clock)
    port = ctl.metrics.serve("127.0.0.1", 0, lambda: None)
    try:
        for _ in range(2):  # one task runs at a time in a region: b@1's, then c@1's
            ctl.tick()
            ctl.wait_idle()
        clock.now = T0 + 40 * MINUTE  # soon starts, with its data; late is judged once
        ctl.tick()
        ctl.wait_idle()
        assert ctl.state.jobs["late"].unknown_at_start
        assert ctl.state.jobs["soon"].complete_at_start is True
        metrics = scraped(port)
        assert metrics[UNKNOWN] == 1, metrics
        assert metrics[UNREADY] == 0, metrics
    finally:
        ctl.close()
        ctl.metrics.shutdown()
    # A restarted controller reads the record: the job was judged, and is not counted again.
    again = controller(root, Clock(T0 + 50 * MINUTE))
    try:
        again.tick()
        again.wait_idle()
        assert again.metrics.jobs_unknown_at_start._value.get() == 0
    finally:
        again.close()


# ------------------------- 2: staging still running at the start, and "cannot be met"


@pytest.fixture
def slow_eu(tmp_path: Path) -> Iterator[tuple[Path, str, LocalNode]]:
    """b@1 (4 shards) staged at a crawl into region eu, whose origin link the plan thinks slow."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "b", 4, rows=300)
    publish(registry, f"file://{tmp_path}/origin/b", "b")
    node = start_local_node(
        "eu", tmp_path / "cache-eu", registry, extra_args=["--staging-rate", "20KB/s"]
    )
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
            "    origin_bandwidth: 1KB/s\n"
        )
        (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0 + MINUTE, 100, "b@1"))
        yield tmp_path, registry, node
    finally:
        node.stop(timeout=1)  # its drain would wait for the crawl: the test is over


def test_staging_still_running_at_the_start_is_said_beside_cannot_be_met(
    slow_eu, caplog: pytest.LogCaptureFixture
) -> None:
    """The planner's "cannot be met" (too slow) was recorded alone: the job's record, and
    plan --status, hid that its staging was running when the job started. And the
    long-running controller said it first at the start (its log, rounds after it knew)."""
    root, _, node = slow_eu
    clock = Clock(T0)
    ctl = controller(root, clock)
    try:
        with caplog.at_level(logging.WARNING, logger="edgecache.clients.controller"):
            plan = ctl.tick()
            assert plan is not None
            ctl.tick()  # the same reasons: said once
        assert [i.version for i in plan.infeasible if i.job == "j"] == ["b@1"]  # too slow
        said = [r.getMessage() for r in caplog.records if "cannot be met" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("job j (starts 2026-"), said
        # And a metric an alert can fire on before the start (it was a log line only).
        assert ctl.metrics.jobs_infeasible._value.get() == 1
        deadline = time.monotonic() + 30
        while ctl.state.tasks.get("eu b@1") is None or ctl.state.tasks["eu b@1"].state != (
            "running"
        ):
            assert time.monotonic() < deadline, ctl.state.tasks
            time.sleep(0.05)
        clock.now = T0 + 2 * MINUTE  # j starts while b@1 is still staging
        ctl.tick()
        assert versions_on(node).get("b@1", 0) < 4  # really still running
        record = ctl.state.jobs["j"]
        assert record.complete_at_start is False
        assert "staging b@1 was still running at the start" in record.why_missed, record
        assert "cannot be met: b@1:" in record.why_missed, record  # kept beside it
        assert record.why_missed.startswith("staging b@1 was still running"), record
    finally:
        ctl.close()
    view = views(root, clock.now)["j"]
    assert view.state == "missed"
    assert "staging b@1 was still running at the start" in view.why, view.why
    args = ["plan", str(root / "schedule.yaml"), "--config", str(root / "edgecache.yaml")]
    at = ["--at", clock.now.isoformat()]
    shown = CliRunner().invoke(app, [*args, *at, "--status", "--json"])
    (row,) = json.loads(shown.stdout)
    assert row["state"] == "missed", row
    assert "staging b@1 was still running at the start" in row["why"], row
    table = CliRunner().invoke(app, [*args, *at, "--status"])
    assert "staging b@1 was still running at the" in " ".join(table.stdout.split()), table.stdout


def test_a_region_that_does_not_answer_is_not_a_job_that_cannot_be_met(tmp_path: Path) -> None:
    # The plan calls its jobs infeasible (it is made blind there), and the gauge counted
    # them: EdgecacheJobCannotBeMet fired for a down node, saying to publish or add room.
    import socket

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there once it is closed
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "b")
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['127.0.0.1:{port}']\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0 + HOUR, 2, "b@1"))
    ctl = controller(tmp_path, Clock(T0))
    try:
        plan = ctl.tick()
        assert plan is not None and [i.unreachable for i in plan.infeasible] == [True]
        assert ctl.metrics.jobs_infeasible._value.get() == 0
    finally:
        ctl.close()


def test_staging_started_under_a_lost_lease_stops_with_it(slow_eu) -> None:
    """A controller paused past its lease kept its staging threads running beside the new
    leader's plan (which may evict what they stage) until the versions were done."""
    root, _, node = slow_eu
    lease = 3.0
    first = controller(root, Clock(T0), lease_ttl=lease, holder="first")
    second = controller(root, Clock(T0), lease_ttl=lease, holder="second")
    try:
        assert first.tick() is not None
        deadline = time.monotonic() + 30
        while "eu b@1" not in first.state.tasks or first.state.tasks["eu b@1"].state != "running":
            assert time.monotonic() < deadline, first.state.tasks
            time.sleep(0.05)
        time.sleep(lease + 0.5)  # first is paused past its lease: second takes it over
        assert second.tick() is not None
        assert first.tick() is None  # first finds the lease lost: it stands by ...
        deadline = time.monotonic() + 20
        while first._runs:  # ... and the run it started under that lease stops
            assert time.monotonic() < deadline, "first's staging went on under second's lease"
            time.sleep(0.05)
        assert first.state.tasks["eu b@1"].state == "pending", first.state.tasks
        assert versions_on(node).get("b@1", 0) < 4  # stopped mid-version, not finished
    finally:
        first.close()
        second.close()


# ----------------------------- 3: every line of a schedule error belongs to the error


BROKEN = (
    "jobs:\n"
    "  - name: a\n    region: eu\n    start: nope\n    duration: 1h\n    datasets: [b@1]\n"
    "  - name: c\n    region: eu\n    start: '2026-12-01T08:00:00+00:00'\n"
    "    duration: xx\n    datasets: [b@1]\n"
)


def error_block(stderr: str) -> list[str]:
    """The lines of the one error on stderr: its first starts ``error:``."""
    lines = stderr.rstrip("\n").splitlines()
    assert lines and lines[0].startswith("error: "), stderr
    return lines


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "{schedule}"],
        ["plan", "{schedule}", "--status"],
        ["warm", "{schedule}"],
        ["controller", "--schedule", "{schedule}", "--once"],
    ],
)
def test_each_line_of_a_schedule_error_is_indented_under_its_error_line(
    eu, command: list[str]
) -> None:
    root, registry, node = eu
    one_region(root, registry, node)
    schedule = root / "schedule.yaml"
    schedule.write_text(BROKEN)
    args = [part.format(schedule=schedule) for part in command]
    result = CliRunner().invoke(app, [*args, "--config", str(root / "edgecache.yaml")])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = error_block(result.stderr)
    assert len(lines) == 2, result.stderr  # both problems, one per line
    assert f"{schedule}:4: jobs.0.start: 'nope' is not a time" in lines[0], lines
    assert lines[1].startswith(f"  {schedule}:10: jobs.1.duration:"), lines


def test_a_broken_schedule_edit_is_logged_with_its_lines_indented(eu, caplog) -> None:
    """The controller logs an edit that does not validate and runs on: the log's
    continuation lines were flush left, like lines of another record."""
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    ctl = controller(root, Clock(T0))
    try:
        ctl.tick()
        ctl.wait_idle()
        (root / "schedule.yaml").write_text(BROKEN)
        with caplog.at_level(logging.ERROR, logger="edgecache.clients.controller"):
            ctl.tick()
    finally:
        ctl.close()
    (message,) = [r.getMessage() for r in caplog.records if "last good schedule" in r.getMessage()]
    first, *rest = message.splitlines()
    assert "jobs.0.start" in first, message
    assert rest and all(line.startswith("  ") for line in rest), message
    assert any("jobs.1.duration" in line for line in rest), message


def test_every_line_of_a_multi_line_cli_error_reads_as_part_of_it(tmp_path: Path) -> None:
    """The CLI's error printer indents what a message left flush left: the node's settings
    error ended with a flush-left "Set them with flags…" line, read as output of its own."""
    args = ["serve", "--region", "eu", "--cache-dir", str(tmp_path / "cache")]
    args += ["--registry", f"file://{tmp_path}", "--staging-rate", "xx", "--capacity", "yy"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    first, *rest = error_block(result.stderr)
    assert first == "error: invalid node settings:", result.stderr
    assert len(rest) == 3 and all(line.startswith("  ") for line in rest), result.stderr
    assert rest[-1] == "  Set them with flags, EDGECACHE_<NAME> variables or a --config file."
