"""The controller's record of plan against reality: what it keeps, how long, why a job missed.

Real nodes on loopback (``edgecache serve`` subprocesses), a file:// origin
and registry, the controller in-process on a clock the test moves by hand.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_controller import Clock, controller_process, job, one_region

from edgecache.clients.controller import Controller, read_state
from edgecache.clients.ops import gather_status, make_plan
from edgecache.clients.plan_status import JobView, job_views
from edgecache.clients.topology import load_schedule, load_topology

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)


def late(controller: Controller) -> float:
    return controller.metrics.tasks.labels(state="late")._value.get()


def views(root: Path, now: datetime) -> dict[str, JobView]:
    """``plan --status`` as the CLI builds it, from the controller's saved record."""
    topology = load_topology(root / "edgecache.yaml")
    schedule = load_schedule(root / "schedule.yaml", topology)
    reports = gather_status(topology)
    plan, manifests = make_plan(topology, schedule, now=now, reports=reports)
    state = read_state(topology.registry)
    return {v.job: v for v in job_views(schedule, plan, manifests, reports, state, now)}


def plan_status(root: Path, now: datetime) -> tuple[int, dict[str, str]]:
    """``edgecache plan --status --json`` at ``now``: its exit code and each job's state."""
    done = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "plan", str(root / "schedule.yaml")]
        + ["--status", "--json", "--config", str(root / "edgecache.yaml")]
        + ["--at", now.isoformat()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, {v["job"]: v["state"] for v in json.loads(done.stdout or "[]")}


def test_a_late_task_stops_counting_once_done_and_records_go_after_the_retention(
    eu,
) -> None:
    root, _, node = eu
    one_region(root, "file://" + str(root / "registry"), node, job("j", "eu", T0, 1, "b@1"))
    clock = Clock(T0 + timedelta(minutes=10))  # j started without b@1: staging is late
    controller = Controller(
        root / "edgecache.yaml",
        root / "schedule.yaml",
        clock=clock,
        record_retention=timedelta(hours=6),
    )
    try:
        controller.tick()
        assert late(controller) == 1  # running past its deadline: the alert's case
        controller.wait_idle()
        # Done, no longer planned, and its job has started: nothing is late any more.
        assert late(controller) == 0
        assert controller.state.tasks["eu b@1"].state == "done"  # kept, as history
        for hours in (2, 5, 30):  # nothing comes back, round after round
            clock.now = T0 + hours * HOUR
            controller.tick()
            assert late(controller) == 0
            # Kept while the job runs and 6 h after its end, then dropped.
            assert ("j" in controller.state.jobs) == (hours < 7)
            assert ("eu b@1" in controller.state.tasks) == (hours < 7)
        state = read_state(f"file://{root}/registry")
        assert state is not None and state.jobs == {} and state.tasks == {}
    finally:
        controller.close()
    assert plan_status(root, clock.now) == (0, {"j": "over"})  # nothing wrong: exit 0


def test_a_missed_job_says_why_even_once_its_data_is_there(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
    clock = Clock(T0 - timedelta(minutes=1))  # seen before its start: its start is judged
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.refresh()  # looks, without acting: nothing staged before the start
        clock.now = T0 + timedelta(minutes=10)
        controller.tick()
        controller.wait_idle()
    finally:
        controller.close()
    view = views(root, clock.now)["j"]
    assert view.state == "missed" and not view.missing  # staged since, after the start
    assert "b@1" in view.why and "before the start" in view.why, view.why
    # What the command says, its exit code too: the job started without its data, so it
    # was not met, though every version is there now and the plan is feasible (it exited
    # 0, as if all were well). Once it has ended there is nothing left to do: still shown
    # missed (the record keeps it), no longer exit 3 (an alert gate stayed red for a day).
    assert plan_status(root, clock.now) == (3, {"j": "missed"})
    assert plan_status(root, T0 + 2 * HOUR) == (0, {"j": "missed"})


def test_a_reused_task_record_takes_its_current_jobs_deadline(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 2 * HOUR, 1, "b@1"))
    for shard in (root / "origin" / "b").iterdir():
        shard.unlink()  # every stage of b fails: the record stays, to be retried
    clock = Clock(T0)
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=clock, retry_backoff=3600
    )
    try:
        controller.tick()
        controller.wait_idle()
        record = controller.state.tasks["eu b@1"]
        assert record.state == "failed" and record.deadline == (T0 + 2 * HOUR).isoformat()
        # j moves to the afternoon: the same task, for a later start.
        one_region(root, registry, node, job("j", "eu", T0 + 6 * HOUR, 1, "b@1"))
        clock.now = T0 + 3 * HOUR  # past the old deadline, long before the new one
        controller.tick()  # in its backoff: not run again, but planned for the new start
        record = controller.state.tasks["eu b@1"]
        assert record.attempts == 1
        assert record.deadline == (T0 + 6 * HOUR).isoformat()
        assert late(controller) == 0
    finally:
        controller.close()


def test_a_missed_job_keeps_its_planned_ready_time_and_names_the_failed_stage(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 3, "b@1"))
    for shard in (root / "origin" / "b").iterdir():
        shard.unlink()  # the origin lost b's files: every stage of it fails
    clock = Clock(T0)
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=clock, retry_backoff=0.0
    )
    try:
        plan = controller.tick()
        assert plan is not None
        (task,) = plan.regions["eu"].tasks
        clock.now = task.start + timedelta(seconds=1)
        plan = controller.tick()
        assert plan is not None
        (task,) = plan.regions["eu"].tasks
        controller.wait_idle()
        assert controller.state.tasks["eu b@1"].state == "failed"
        # The last plan before the start had b@1 ready in time.
        planned = controller.state.jobs["j"].planned_ready
        assert planned == task.finish.isoformat() and task.finish <= T0 + HOUR
        for minutes in (65, 90):  # j has started without b@1; the plan now says later
            clock.now = T0 + timedelta(minutes=minutes)
            controller.tick()
            controller.wait_idle()
            record = controller.state.jobs["j"]
            assert record.complete_at_start is False
            assert record.planned_ready == planned  # the time planned, not re-planned
            # Missed, counted at its start; not "cannot be met", whose alert's advice
            # (publish it, raise the capacity, move the start) does not fit (a hunt).
            assert controller.metrics.jobs_infeasible._value.get() == 0
    finally:
        controller.close()
    view = views(root, clock.now)["j"]
    assert view.state == "missed"
    assert view.planned_ready == task.finish
    assert "staging b@1 failed" in view.why and "part-0000" in view.why, view.why
    assert plan_status(root, clock.now) == (3, {"j": "missed"})


def test_a_registry_that_does_not_answer_is_named_with_what_to_check(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there once it is closed
    registry = f"http://127.0.0.1:{port}/registry"
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0, 1, "b@1"))
    process = controller_process(tmp_path, "--once")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 1, out
    assert f"the version registry {registry} (registry: in " in out, out
    assert "edgecache.yaml) does not answer" in out, out
    assert "Check that URL" in out, out
    assert "Unclosed client session" not in out, out  # nothing left open behind the error
    status = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "plan", str(tmp_path / "schedule.yaml")]
        + ["--status", "--config", str(tmp_path / "edgecache.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 1, status
    assert f"the version registry {registry} (registry: in " in status.stderr, status.stderr


def test_keep_records_sets_how_long_the_record_keeps_an_ended_job(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        controller.tick()  # j is recorded from its start
        controller.wait_idle()
    finally:
        controller.close()
    state = read_state(registry)
    assert state is not None and "j" in state.jobs
    after = (T0 + 3 * HOUR).isoformat()  # j ended two hours before
    for hours, kept in (("3", True), ("1.5", False)):
        process = controller_process(
            root, "--once", "--yes", "--at", after, "--keep-records", hours
        )
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, out
        state = read_state(registry)
        assert state is not None and ("j" in state.jobs) == kept, (hours, out)
        assert ("eu b@1" in state.tasks) == kept, (hours, out)


@pytest.mark.parametrize("hours", ["0", "-2", "nan", "inf", "100000"])
def test_keep_records_out_of_range_is_bad_input_naming_it(tmp_path: Path, hours: str) -> None:
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0, 1, "b@1"))
    process = controller_process(tmp_path, "--once", "--keep-records", hours)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 2, out
    assert f"--keep-records {hours}" in out and "above 0 and at most 87600" in out, out
    assert not (tmp_path / "registry").exists()  # refused before it acted


def done(controller: Controller) -> float:
    return controller.metrics.tasks.labels(state="done")._value.get()


def test_done_counts_one_task_per_version_a_job_still_reads(eu) -> None:
    """A re-stage after an eviction is the same task again, not another live one; a
    version its job no longer reads (it follows the dataset to a new one) is not live.
    The gauge read 1, 2, 3 as a version was evicted and staged again, and kept a version
    left behind: ``done 8`` on a site of 3 live tasks (the docs: they add up to the live
    tasks)."""
    from edgeutil import publish, stub

    from edgecache.v1 import edge_pb2

    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + 2 * HOUR, 1, "b"))
    clock = Clock(T0)
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.tick()
        controller.wait_idle()
        assert done(controller) == 1
        for round_ in (2, 3):  # evicted under it (an operator, a full disk): staged again
            stub(node.address).Evict(edge_pb2.EvictRequest(dataset="b", version=1), timeout=10)
            clock.now += timedelta(minutes=1)
            controller.tick()
            controller.wait_idle()
            assert f"eu b@1 #{round_}" in controller.state.tasks
            assert done(controller) == 1, round_
        publish(registry, f"file://{root}/origin/c", "b")  # b@2: the job reads it now
        clock.now += timedelta(minutes=1)
        controller.tick()
        controller.wait_idle()
        assert controller.state.tasks["eu b@2"].state == "done"
        assert done(controller) == 1
    finally:
        controller.close()


def test_a_running_job_no_round_saw_before_its_start_that_cannot_be_met_is_alerted(eu) -> None:
    """A job already running when the controller first saw it, reading a version that does not
    exist: counted neither as cannot be met (only jobs yet to start were) nor as unready at its
    start (unknown then), so no alert said it while `plan` exited 3 (a helper's hunt)."""
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 - timedelta(minutes=5), 1, "nope@1"))
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        controller.tick()
        controller.wait_idle()
        assert controller.state.jobs["j"].unknown_at_start
        assert controller.metrics.jobs_infeasible._value.get() == 1
    finally:
        controller.close()
