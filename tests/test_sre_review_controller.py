"""The SRE review of the controller across regions: fallbacks, verdicts at a job's start, CLI.

Real nodes on loopback (``edgecache serve`` subprocesses), a file:// origin
and registry, the controller in-process on a clock the test moves by hand
(or as an ``edgecache controller`` subprocess where its exit and output are
the point).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import publish, stub, write_parquet_shards
from test_controller import Clock, controller_process, job, one_region, versions_on
from test_controller_longrun import wait_answering
from test_controller_records import views
from typer.testing import CliRunner

from edgecache.clients.cli import app
from edgecache.clients.controller import Controller, read_state
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.ops import gather_status, make_plan
from edgecache.clients.plan_status import job_views
from edgecache.clients.topology import load_schedule, load_topology
from edgecache.v1 import edge_pb2

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)


def controller(root: Path, clock: Clock, **options: object) -> Controller:
    return Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock, **options)  # type: ignore[arg-type]


def gauge(controller: Controller, state: str) -> float:
    return controller.metrics.tasks.labels(state=state)._value.get()


# ------------------------------------------------- H2: peer source that cannot finish


@pytest.fixture
def two_regions(tmp_path: Path) -> Iterator[tuple[Path, LocalNode, LocalNode]]:
    """b@1 (4 shards); region eu, whose node cannot stage it; region us copies from eu.

    eu's node reads another registry, which lacks b: it answers its status,
    and every stage of b on it fails, retry after retry.
    """
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "b", 4, rows=300)
    publish(registry, f"file://{tmp_path}/origin/b", "b")
    write_parquet_shards(tmp_path / "origin" / "other", 1, rows=10)
    publish(f"file://{tmp_path}/elsewhere", f"file://{tmp_path}/origin/other", "other")
    eu = start_local_node("eu", tmp_path / "cache-eu", f"file://{tmp_path}/elsewhere")
    us = start_local_node("us", tmp_path / "cache-us", registry)
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n"
            f"  eu:\n    nodes: ['{eu.address}']\n    origin_bandwidth: 10MB/s\n"
            f"  us:\n    nodes: ['{us.address}']\n    origin_bandwidth: 1MB/s\n"
            "    peers: {eu: 1GB/s}\n"
        )
        (tmp_path / "schedule.yaml").write_text(
            "jobs:\n"
            + job("eu-job", "eu", T0 + 2 * HOUR, 1, "b@1")
            + job("us-job", "us", T0 + 2 * HOUR, 1, "b@1")
        )
        yield tmp_path, eu, us
    finally:
        eu.stop()
        us.stop()


def test_a_task_copying_from_a_peer_whose_staging_failed_stages_from_origin(
    two_regions, caplog
) -> None:
    root, eu, us = two_regions
    clock = Clock(T0)
    ctl = controller(root, clock, retry_backoff=0.0, lease_ttl=5)
    try:
        plan = ctl.tick()
        assert plan is not None
        (us_task,) = plan.regions["us"].tasks
        assert us_task.source == "eu"  # the plan copies us from eu
        with caplog.at_level(logging.WARNING, logger="edgecache.clients.controller"):
            for _ in range(4):  # eu's stage fails every round, retried each time
                ctl.wait_idle()
                clock.now += 5 * MINUTE
                ctl.tick()
            ctl.wait_idle()
        assert versions_on(eu) == {}
        assert versions_on(us) == {"b@1": 4}  # from origin, long before the start
        record = ctl.state.tasks["us b@1"]
        assert record.state == "done" and record.source == "origin"
        note = "from origin: eu will not hold b@1 (its staging failed)"
        assert note in record.notes, record.notes
        assert any(note in r.getMessage() for r in caplog.records), caplog.text
        fetched = stub(us.address).Status(edge_pb2.StatusRequest()).origin_bytes
        assert fetched > 0
        # Counted as what the node fetched from origin (not the plan's estimate, nor "peer").
        assert ctl.metrics.staged_bytes["origin"]._value.get() == fetched
        assert ctl.metrics.staged_bytes["peer"]._value.get() == 0
    finally:
        ctl.close()


# --------------------------------------- H3, M2: readiness of the versions read now


def test_data_evicted_before_the_start_is_a_miss_and_ready_again_only_when_back(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    clock = Clock(T0)
    ctl = controller(root, clock, retry_backoff=0.0)
    try:
        ctl.tick()
        ctl.wait_idle()  # looks again once staged: seen complete
        assert ctl.state.jobs["j"].ready_at == T0.isoformat()
        # Evicted (as with evict --force), and its origin files gone: staging it fails.
        stub(node.address).Evict(edge_pb2.EvictRequest(dataset="b", version=1))
        shutil.move(root / "origin" / "b", root / "b-aside")
        clock.now = T0 + 30 * MINUTE
        ctl.tick()
        ctl.wait_idle()
        assert ctl.state.jobs["j"].ready_at is None  # seen missing: not ready any more
        clock.now = T0 + HOUR + MINUTE  # j has started without b@1
        ctl.tick()
        ctl.wait_idle()
        record = ctl.state.jobs["j"]
        assert record.complete_at_start is False and record.missing_at_start == ["b@1"]
        assert "staging b@1 failed" in record.why_missed, record.why_missed
        assert ctl.metrics.jobs_unready_at_start._value.get() == 1
        shutil.move(root / "b-aside", root / "origin" / "b")
        clock.now = T0 + HOUR + 10 * MINUTE
        ctl.tick()
        ctl.wait_idle()
        clock.now = T0 + HOUR + 20 * MINUTE
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert versions_on(node) == {"b@1": 2}
        assert record.complete_at_start is False  # as at its start
        assert record.ready_at is not None
        assert datetime.fromisoformat(record.ready_at) > T0 + HOUR  # when it came back
    finally:
        ctl.close()
    view = views(root, clock.now)["j"]
    assert view.state == "missed" and view.complete_at_start is False
    assert view.ready_at is not None and view.ready_at > T0 + HOUR


def test_a_job_switched_to_another_version_has_no_ready_time_of_the_old_one(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 3 * HOUR, 1, "b@1"))
    clock = Clock(T0)
    ctl = controller(root, clock)
    try:
        ctl.tick()
        ctl.wait_idle()
        ctl.tick()
        assert ctl.state.jobs["j"].ready_at == T0.isoformat()  # b@1, seen complete
        # The schedule switches j to c@1, which is there already; no round since.
        one_region(root, registry, node, job("j", "eu", T0 + 3 * HOUR, 1, "c@1"))
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="c", version=1)))
        assert views(root, T0 + HOUR)["j"].ready_at is None  # b@1's time is not c@1's
        clock.now = T0 + HOUR
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert record.versions == ["c@1"]
        assert record.ready_at == (T0 + HOUR).isoformat()  # when c@1 was first seen
    finally:
        ctl.close()
    assert views(root, T0 + HOUR)["j"].ready_at == T0 + HOUR


# ------------------------------------------------- M1: a job first seen after its start


def test_a_job_first_seen_after_its_start_has_an_unknown_verdict(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 2, "b@1"))
    list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="b", version=1)))
    clock = Clock(T0 + 10 * MINUTE)  # j started 10 minutes before any round saw it
    ctl = controller(root, clock)
    try:
        ctl.tick()
        ctl.wait_idle()
        clock.now = T0 + 20 * MINUTE
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert record.complete_at_start is None  # not "complete", nor "missed"
        assert record.unknown_at_start == "no controller round saw the job before it started"
        assert ctl.metrics.jobs_unready_at_start._value.get() == 0
    finally:
        ctl.close()
    view = views(root, clock.now)["j"]
    assert view.state == "unknown" and view.complete_at_start is None
    assert "no controller round saw the job before it started" in view.why, view.why
    at = ["--at", clock.now.isoformat()]
    args = ["plan", str(root / "schedule.yaml"), "--config", str(root / "edgecache.yaml"), *at]
    shown = CliRunner().invoke(app, [*args, "--status", "--json"])
    (row,) = json.loads(shown.stdout)
    assert row["state"] == "unknown" and row["complete_at_start"] is None, row
    assert row["unknown_at_start"] == "no controller round saw the job before it started", row


# ------------------------------------------------------- M5: --at against live nodes


def test_at_against_live_nodes_is_refused_without_yes(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    process = controller_process(root, "--once", "--at", (T0 + 30 * MINUTE).isoformat())
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 2, out
    assert "--yes" in out and "live nodes" in out, out
    assert read_state(registry) is None  # nothing recorded
    assert versions_on(node) == {}  # nothing staged
    process = controller_process(root, "--once", "--yes", "--at", (T0 + 30 * MINUTE).isoformat())
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    assert versions_on(node) == {"b@1": 2}


# ------------------------------------------------ L2: another controller holds the lease


def test_once_while_another_leads_names_it_and_a_standby_says_so_once(eu, caplog) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    first = controller(root, Clock(T0), lease_ttl=60)
    second = controller(root, Clock(T0), lease_ttl=60)
    try:
        assert first.tick() is not None
        first.wait_idle()
        process = controller_process(root, "--once")
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 1, out
        assert f"controller {first.holder} holds the lease" in out, out
        assert "stop it" in out and "Wait" in out, out
        assert "standing by" not in out, out  # it exits: it does not stand by
        with caplog.at_level(logging.INFO, logger="edgecache.clients.controller"):
            for _ in range(3):
                assert second.tick() is None
        said = [r.getMessage() for r in caplog.records if "standing by" in r.getMessage()]
        assert len(said) == 1 and first.holder in said[0], said
    finally:
        second.close()
        first.close()


# ------------------------------------------------------ L5: a stage waiting to retry


def test_a_failed_stage_waiting_to_retry_is_its_own_state_with_the_retry_time(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 3 * HOUR, 1, "b@1"))
    for shard in (root / "origin" / "b").iterdir():
        shard.unlink()  # every stage of b fails
    clock = Clock(T0)
    ctl = controller(root, clock, retry_backoff=300)
    try:
        ctl.tick()
        ctl.wait_idle()
        assert ctl.state.tasks["eu b@1"].retry_at == (T0 + 5 * MINUTE).isoformat()
        clock.now = T0 + 2 * MINUTE
        ctl.tick()  # in its backoff: planned, not run
        topology = load_topology(root / "edgecache.yaml")
        schedule = load_schedule(root / "schedule.yaml", topology)
        reports = gather_status(topology)
        plan, manifests = make_plan(topology, schedule, now=clock.now, reports=reports)
        state = read_state(registry)
        (view,) = job_views(
            schedule, plan, manifests, reports, state, clock.now, controller_running=True
        )
    finally:
        ctl.close()
    assert view.state == "waiting to retry", view
    assert "tries again at 2026-12-01 08:05:00" in view.hint, view.hint
    assert "staging b@1 failed (attempt 1" in view.hint, view.hint


# ---------------------------------------------- L6: down since, across a takeover


def test_back_up_after_a_takeover_says_since_when_the_first_leader_saw_it_down(eu, caplog) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 5 * HOUR, 1, "b@1"))
    clock = Clock(T0 + MINUTE)
    first = controller(root, clock, lease_ttl=5)
    second = controller(root, clock, lease_ttl=5)
    try:
        with caplog.at_level(logging.INFO, logger="edgecache.clients.controller"):
            node.process.send_signal(signal.SIGSTOP)  # accepts TCP, answers nothing
            try:
                first.tick()
                first.close()  # gives the lease up
                clock.now = T0 + 5 * MINUTE
                assert second.tick() is not None  # takes over: the node is still down
            finally:
                node.process.send_signal(signal.SIGCONT)
            # A resumed node first works through what queued while it was stopped, which
            # takes a loaded host more than the round's 1 s status calls: the round below
            # is for a node that answers again.
            wait_answering(node)
            clock.now = T0 + 6 * MINUTE
            second.tick()
        said = [r.getMessage() for r in caplog.records if "is back up" in r.getMessage()]
        assert len(said) == 1, said
        assert f"down since at least {(T0 + MINUTE).isoformat()}" in said[0], said
    finally:
        node.process.send_signal(signal.SIGCONT)
        second.close()


# -------------------------------------------------------- L7: one state per task


def test_a_running_task_past_its_deadline_counts_as_late_only(eu) -> None:
    root, registry, _ = eu
    # Staging throttled, so the task still runs when the round is counted: unthrottled,
    # two small shards could be staged before the tick returned (a CI run found it done).
    slow = start_local_node(
        "eu", root / "cache-slow", registry, extra_args=["--staging-rate", "20KB/s"]
    )
    one_region(root, registry, slow, job("j", "eu", T0, 1, "b@1"))
    ctl = controller(root, Clock(T0 + 10 * MINUTE))
    try:
        ctl.tick()  # starts b@1, already past j's start
        assert ctl.state.tasks["eu b@1"].state == "running"
        assert gauge(ctl, "late") == 1
        assert gauge(ctl, "running") == 0
        total = sum(gauge(ctl, s) for s in ("pending", "running", "done", "failed", "late"))
        assert total == 1
        ctl.wait_idle()
    finally:
        ctl.close()
        slow.stop()


def test_staged_bytes_count_what_the_nodes_moved_not_the_plans_estimate(eu) -> None:
    """A version partly held already moves only the rest; the controller counted the
    plan's whole estimate as staged from origin."""
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    client = stub(node.address)
    list(client.Stage(edge_pb2.StageRequest(dataset="b", version=1, shards=[0])))
    before = client.Status(edge_pb2.StatusRequest()).origin_bytes
    ctl = controller(root, Clock(T0), retry_backoff=0.0)
    try:
        ctl.tick()
        ctl.wait_idle()
        assert versions_on(node) == {"b@1": 2}
        moved = client.Status(edge_pb2.StatusRequest()).origin_bytes - before
        assert 0 < moved < client.Status(edge_pb2.StatusRequest()).origin_bytes
        assert ctl.metrics.staged_bytes["origin"]._value.get() == moved
    finally:
        ctl.close()


# ------------------------------------------- a job moved to another region before its start


@pytest.fixture
def eu_and_us(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """b@1 published; regions eu and us of one node each; job ``j`` in eu at T0 + 1 h.

    Yields the folder and the us node (a test may stop it)."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "b", 2, rows=300)
    publish(registry, f"file://{tmp_path}/origin/b", "b")
    eu = start_local_node("eu", tmp_path / "cache-eu", registry)
    us = start_local_node("us", tmp_path / "cache-us", registry)
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{eu.address}']\n"
            f"  us:\n    nodes: ['{us.address}']\n"
        )
        (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0 + HOUR, 1, "b@1"))
        yield tmp_path, us
    finally:
        eu.stop()
        us.stop()


def _ready_in_eu(root: Path, clock: Clock) -> Controller:
    ctl = controller(root, clock, lease_ttl=5)
    assert ctl.tick() is not None
    ctl.wait_idle()
    ctl.tick()
    record = ctl.state.jobs["j"]
    assert record.region == "eu" and record.ready_at is not None, record
    return ctl


def test_a_job_moved_to_another_region_is_recorded_and_judged_there(eu_and_us) -> None:
    """The record kept the first region: ready as seen there, a miss named there."""
    root, us = eu_and_us
    clock = Clock(T0)
    ctl = _ready_in_eu(root, clock)
    try:
        (root / "schedule.yaml").write_text("jobs:\n" + job("j", "us", T0 + HOUR, 1, "b@1"))
        us.stop()  # us cannot stage it: the job misses its start there
        clock.now += 2 * MINUTE
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert record.region == "us" and record.ready_at is None, record
        clock.now = T0 + HOUR + MINUTE
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert record.complete_at_start is False, record
        assert "us" in record.why_missed and "eu" not in record.why_missed, record
    finally:
        ctl.close()


def test_a_job_moved_after_its_start_is_unknown_there_not_judged_on_the_old_region(
    eu_and_us,
) -> None:
    """Moved at 14:59 and first planned at 15:01, it was judged on eu's data (complete
    there) though us, where it runs, was never seen before its start."""
    root, _ = eu_and_us
    clock = Clock(T0)
    ctl = _ready_in_eu(root, clock)
    try:
        (root / "schedule.yaml").write_text("jobs:\n" + job("j", "us", T0 + HOUR, 1, "b@1"))
        clock.now = T0 + HOUR + MINUTE
        ctl.tick()
        record = ctl.state.jobs["j"]
        assert record.region == "us" and record.complete_at_start is None, record
        assert record.unknown_at_start, record
    finally:
        ctl.close()
