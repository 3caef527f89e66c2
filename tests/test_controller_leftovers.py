"""Controller leftovers: a metric for jobs first seen after their start, the most specific
reason a job missed its data, and schedule errors whose every line reads as one error.

Real nodes on loopback (``edgecache serve`` subprocesses), a file:// origin and registry,
the controller in-process on a clock the test moves by hand; the schedule errors through
the real CLI (typer's runner, and the controller's own log).
"""

from __future__ import annotations

import json
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


def test_staging_still_running_at_the_start_is_said_beside_cannot_be_met(slow_eu) -> None:
    """The planner's "cannot be met" (too slow) was recorded alone: the job's record, and
    plan --status, hid that its staging was running when the job started."""
    root, _, node = slow_eu
    clock = Clock(T0)
    ctl = controller(root, clock)
    try:
        plan = ctl.tick()
        assert plan is not None
        assert [i.version for i in plan.infeasible if i.job == "j"] == ["b@1"]  # too slow
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
