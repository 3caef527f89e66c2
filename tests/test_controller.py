"""The controller carries the plan out: pins, evictions, sources and start times, on real nodes.

Nodes are ``edgecache serve`` subprocesses on loopback; the controller runs
in-process on a clock the test sets (a day of schedule in seconds), or as
``edgecache controller`` subprocesses where killing it is the point. Link
speeds in the topology are in simulated bytes per second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import ConfigError
from edgecache.clients.controller import Controller, read_state
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def versions_on(node: LocalNode) -> dict[str, int]:
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    return {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions if v.shard_count}


def status(node: LocalNode) -> edge_pb2.NodeStatus:
    return stub(node.address).Status(edge_pb2.StatusRequest())


def job(name: str, region: str, start: datetime, hours: float, *datasets: str) -> str:
    return (
        f"  - name: {name}\n    region: {region}\n    start: '{start.isoformat()}'\n"
        f"    duration: {int(hours * 60)}m\n    datasets: [{', '.join(datasets)}]\n"
    )


def one_region(root: Path, registry: str, node: LocalNode, *jobs: str) -> None:
    """``edgecache.yaml`` with region eu of ``node`` alone, and ``schedule.yaml`` of ``jobs``."""
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    (root / "schedule.yaml").write_text("jobs:\n" + "".join(jobs))


def two_regions(root: Path, registry: str, eu: LocalNode, us: LocalNode) -> None:
    """``edgecache.yaml`` of eu and us: us reaches origin slowly (1 kB/s) and eu quickly."""
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n"
        f"  eu:\n    nodes: ['{eu.address}']\n    origin_bandwidth: 10MB/s\n"
        f"    peers: {{us: 1GB/s}}\n"
        f"  us:\n    nodes: ['{us.address}']\n    origin_bandwidth: 1kB/s\n"
        f"    peers: {{eu: 1GB/s}}\n"
    )


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    registry = f"file://{tmp_path}/registry"
    for name in ("kept", "b", "c"):
        write_parquet_shards(tmp_path / "origin" / name, 3, rows=500)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    yield tmp_path, registry


def test_plan_is_carried_out_pins_sources_evictions_and_start_times(site) -> None:
    root, registry = site
    # eu has room for two versions; us reaches origin slowly and eu quickly.
    eu = start_local_node("eu", root / "cache-eu", registry, capacity="300KB")
    us = start_local_node("us", root / "cache-us", registry)
    try:
        two_regions(root, registry, eu, us)
        list(stub(eu.address).Stage(edge_pb2.StageRequest(dataset="kept", version=1)))
        list(stub(eu.address).Stage(edge_pb2.StageRequest(dataset="b", version=1)))
        stored = status(eu).used_bytes
        assert stored <= 300_000 < stored * 3 // 2  # two fit, three do not
        (root / "schedule.yaml").write_text(
            "jobs:\n"
            + job("uses-b", "eu", T0, 1.5, "b@1")
            + job("uses-c", "eu", T0 + 2 * HOUR, 1, "c@1")
            + job("uses-kept", "eu", T0 + 5 * HOUR, 1, "kept@1")
            + job("us-kept", "us", T0 + 3 * HOUR, 1, "kept@1")
        )
        clock = Clock(T0 + timedelta(minutes=1))
        controller = Controller(
            root / "edgecache.yaml", root / "schedule.yaml", clock=clock, lease_ttl=5
        )
        try:
            plan = controller.tick()
            controller.wait_idle()
            assert plan is not None and not plan.infeasible
            (c_task,) = [t for t in plan.regions["eu"].tasks if t.spec == "c@1"]
            assert c_task.start >= T0 + 1.5 * HOUR  # just in time, after uses-b ends
            (us_task,) = plan.regions["us"].tasks
            assert us_task.source == "eu"  # faster than us's own origin link
            # Pins: every version a job reads, resident ones included, until its job ends.
            eu_versions = status(eu).versions
            pins = {f"{v.dataset}@{v.version}": v for v in eu_versions}
            assert pins["kept@1"].pinned_until.ToDatetime(tzinfo=UTC) == T0 + 6 * HOUR
            assert pins["b@1"].pinned_until.ToDatetime(tzinfo=UTC) == T0 + 1.5 * HOUR
            # Nothing for c yet: its planned start has not come; us copied kept from eu.
            assert "c@1" not in versions_on(eu)
            us_status = status(us)
            assert versions_on(us) == {"kept@1": 3}
            assert us_status.staged_peer_bytes > 0 and us_status.origin_bytes == 0
            for minutes in (30, 60, 80):  # still before c's start: nothing changes in eu
                clock.now = T0 + timedelta(minutes=minutes)
                controller.tick()
                controller.wait_idle()
                assert versions_on(eu) == {"kept@1": 3, "b@1": 3}
            clock.now = c_task.start + timedelta(seconds=1)
            controller.tick()
            controller.wait_idle()
            # b (never needed again) made room for c; kept, needed at +5 h, stayed.
            assert versions_on(eu) == {"kept@1": 3, "c@1": 3}
            clock.now = T0 + 5 * HOUR + timedelta(minutes=1)
            controller.tick()
            controller.wait_idle()
            state = read_state(registry)
            assert state is not None
            assert state.jobs["uses-c"].complete_at_start is True
            assert state.jobs["uses-kept"].complete_at_start is True
            assert state.jobs["us-kept"].complete_at_start is True
            assert state.tasks["eu c@1"].state == "done"
            assert state.tasks["us kept@1"].source == "eu"
            # kept was fetched from origin once, before the controller began.
            fetches = status(eu).origin_bytes
            assert fetches == sum(
                (root / "origin" / name / f"part-{i:05d}.parquet").stat().st_size
                for name in ("kept", "b", "c")
                for i in range(3)
            )
        finally:
            controller.close()
    finally:
        eu.stop()
        us.stop()


def test_a_second_controller_stands_by(site) -> None:
    root, registry = site
    node = start_local_node("eu", root / "cache-eu", registry)
    try:
        one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
        clock = Clock(T0)
        first = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
        second = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
        try:
            assert first.tick() is not None
            assert second.tick() is None  # refused: the first holds the lease
            assert second.metrics.leader._value.get() == 0
            # Standing by is a round: /healthz stays healthy (it failed a standby after
            # 90 s, and its liveness probe restarted it in a loop), and the round counts.
            second.metrics.last_tick.set(time.time() - 3600)
            assert second.health(30) is not None
            assert second.tick() is None and second.health(30) is None
            assert second.metrics.ticks._value.get() == 2
            first.wait_idle()
            first.close()  # gives the lease up
            assert second.tick() is not None
        finally:
            second.close()
    finally:
        node.stop()


def controller_process(root: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "controller",
            "--config",
            str(root / "edgecache.yaml"),
            "--schedule",
            str(root / "schedule.yaml"),
            "--interval",
            "0.5",
            "--lease-ttl",
            "2",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_controller_killed_mid_task_is_finished_by_the_next_without_refetching(
    tmp_path: Path,
) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 12, rows=3000)
    publish(registry, f"file://{tmp_path}/origin", "big")
    # Staging crawls (64 KB/s of origin), so the kill lands mid-version.
    node = start_local_node(
        "eu", tmp_path / "cache", registry, extra_args=["--staging-rate", "400KB/s"]
    )
    try:
        start = datetime.now(UTC) + timedelta(days=1)
        one_region(tmp_path, registry, node, job("j", "eu", start, 1, "big@1"))
        first = controller_process(tmp_path)
        deadline = time.monotonic() + 60
        while not 2 <= versions_on(node).get("big@1", 0) < 12:
            assert time.monotonic() < deadline, "staging never started"
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        held = versions_on(node)["big@1"]
        second = controller_process(tmp_path)
        try:
            deadline = time.monotonic() + 120
            while versions_on(node).get("big@1", 0) < 12:
                assert time.monotonic() < deadline, "the second controller did not finish"
                time.sleep(0.2)
        finally:
            second.send_signal(signal.SIGTERM)
            out, _ = second.communicate(timeout=30)
        assert second.returncode == 0, out
        assert held < 12
        metrics = stub(node.address).Status(edge_pb2.StatusRequest())
        # Every shard came from origin once: the kill lost at most the shards in flight,
        # which never committed; nothing committed was fetched again.
        sizes = [(tmp_path / "origin" / f"part-{i:05d}.parquet").stat().st_size for i in range(12)]
        assert sum(sizes) <= metrics.origin_bytes <= sum(sizes) + 4 * max(sizes)
    finally:
        node.stop()


def test_bad_schedules_are_refused_with_the_file_and_line(site) -> None:
    root, registry = site
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    (root / "schedule.yaml").write_text(
        "jobs:\n  - name: a\n    region: eu\n    start: 2026-12-01T08:00:00\n    datasets: [b]\n"
    )
    process = controller_process(root, "--once")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 2, out
    assert "schedule.yaml:4: jobs.0.start" in out


def test_runs_are_recorded_once_each_and_never_restarted_from_a_stale_view(site) -> None:
    root, registry = site
    node = start_local_node("eu", root / "cache-eu", registry)
    try:
        one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
        clock = Clock(T0)
        controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
        try:
            controller.tick()
            for _ in range(3):  # rounds while and after the run: no second run of it
                controller.tick()
            controller.wait_idle()
            controller.tick()
            assert set(controller.state.tasks) == {"eu b@1"}
            assert controller.state.tasks["eu b@1"].state == "done"
            assert status(node).versions[0].shard_count == 3
            # Evicted behind the plan's back: staged again, as a second run beside the first.
            stub(node.address).Evict(edge_pb2.EvictRequest(dataset="b", version=1))
            controller.tick()
            controller.wait_idle()
            assert set(controller.state.tasks) == {"eu b@1", "eu b@1 #2"}
            assert all(t.state == "done" for t in controller.state.tasks.values())
        finally:
            controller.close()
    finally:
        node.stop()


def test_a_round_reads_each_nodes_status_once_for_its_pins_and_unpins(site, monkeypatch) -> None:
    # One status per node serves the whole round: pinning skips what it shows pinned
    # as planned, and releasing a cancelled job's pins checks the same status.
    from edgecache.v1 import edge_pb2_grpc

    root, registry = site
    node = start_local_node("eu", root / "cache-eu", registry)
    calls: Counter[str] = Counter()

    class Counting(edge_pb2_grpc.EdgeCacheStub):
        """A stub that counts the Status and Pin calls made through it."""

        def __init__(self, channel) -> None:
            super().__init__(channel)
            for name in ("Status", "Pin"):
                rpc = getattr(self, name)

                def counted(*args, _rpc=rpc, _name=name, **kwargs):
                    calls[_name] += 1
                    return _rpc(*args, **kwargs)

                setattr(self, name, counted)

    far = T0 + 10 * HOUR  # no staging is due this morning: only pins are at stake
    try:
        one_region(
            root, registry, node, job("j", "eu", far, 1, "b@1"), job("k", "eu", far, 1, "c@1")
        )
        monkeypatch.setattr(edge_pb2_grpc, "EdgeCacheStub", Counting)
        controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
        try:
            controller.tick()
            assert calls == {"Status": 1, "Pin": 2}  # b and c pinned
            calls.clear()
            controller.tick()
            assert calls == {"Status": 1}  # both shown pinned as planned: no Pin
            one_region(root, registry, node, job("j", "eu", far, 1, "b@1"))  # k cancelled
            calls.clear()
            controller.tick()
            assert calls == {"Status": 1, "Pin": 1}  # c's pin released
        finally:
            controller.close()
        monkeypatch.undo()
        pinned = {v.dataset for v in status(node).versions if v.HasField("pinned_until")}
        assert pinned == {"b"}
    finally:
        node.stop()


def test_a_region_that_failed_to_stage_is_a_peer_source_again_once_it_holds_it() -> None:
    # The controller keeps one executor for its life: a region whose staging failed
    # (so peer tasks from it went to origin) is trusted again once it holds the
    # version. After an eviction there, peer tasks go to origin at once, saying why
    # (they waited up to an hour on a region that had just dropped the version), until
    # the region holds it again.
    from edgecache.cache.planner import Eviction, StageTask
    from edgecache.clients.executor import Evicted, PlanExecutor, TaskRun
    from edgecache.clients.ops import WarmItem
    from edgecache.clients.topology import Schedule, Topology

    class Offline(PlanExecutor):
        """Evictions ask no node (there is none here); everything else is the real code."""

        def _evict_nodes(self, eviction: Eviction, *, unless_pinned_after: datetime) -> Evicted:
            return Evicted(eviction.bytes)

    topology = Topology.model_validate(
        {"registry": "file:///nowhere", "regions": {"a": {"nodes": ["127.0.0.1:1"]}}}
    )
    executor = Offline(topology)
    now = datetime.now(UTC)

    def peer_task() -> TaskRun:
        task = StageTask("b", ("pq", 1), 1, "a", now, now, now, ("job",))
        return TaskRun(task, WarmItem("b", "pq@1", ["127.0.0.1:2"], 1, peers=["127.0.0.1:1"]))

    executor.mark_wont_hold("a", ("pq", 1), "its staging failed")
    gave_up = peer_task()
    assert executor.await_source(gave_up, peer_wait=1.0)
    assert not gave_up.item.peers and "a will not hold pq@1" in gave_up.note
    executor.mark_resident("a", ("pq", 1))  # restaged (the controller saw it held)
    trusted = peer_task()
    assert executor.await_source(trusted, peer_wait=1.0)
    assert trusted.item.peers == ["127.0.0.1:1"] and not trusted.note
    executor.mark_wont_hold("a", ("pq", 1), "its staging failed")
    evicted = executor.evict(Eviction("a", ("pq", 1), 1, now, None, ""), Schedule(jobs=[]), {})
    assert evicted.problem is None
    after = peer_task()
    assert executor.await_source(after, peer_wait=0.3)
    assert not after.item.peers and "a will not hold pq@1 (pq@1 was evicted there)" in after.note
    executor.mark_resident("a", ("pq", 1))  # staged there again
    again = peer_task()
    assert executor.await_source(again, peer_wait=1.0)
    assert again.item.peers == ["127.0.0.1:1"] and not again.note


def test_a_registry_that_does_not_exist_is_refused_not_created(tmp_path: Path) -> None:
    # A typo in registry: made the lease and the record create a new, empty registry
    # there; every later command then said it "holds no datasets".
    registry = f"file://{tmp_path}/registy"
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs:\n" + job("j", "eu", T0, 1, "b@1"))
    for extra in (["--once"], []):  # a round, and the long-running controller
        process = controller_process(tmp_path, *extra)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 2, out  # bad input, before anything was done
        said = " ".join(out.split())
        assert f"the version registry {registry} (registry: in " in said, out
        assert "edgecache.yaml) does not exist; check the registry URL" in said, out
        assert not (tmp_path / "registy").exists()
    status = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "plan", str(tmp_path / "schedule.yaml")]
        + ["--status", "--config", str(tmp_path / "edgecache.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 2, status
    said = " ".join(status.stderr.split())
    assert f"the version registry {registry} " in said and "does not exist" in said, said
    assert "holds no datasets" not in said, said
    assert not (tmp_path / "registy").exists()


def test_a_registry_gone_under_a_running_controller_is_not_created_again(site) -> None:
    root, registry = site
    node = start_local_node("eu", root / "cache-eu", registry)
    try:
        one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
        controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
        try:
            assert controller.tick() is not None
            controller.wait_idle()
            (root / "registry").rename(root / "unmounted")
            with pytest.raises(ConfigError, match="does not exist; check the registry URL"):
                controller.tick()  # a running controller logs it and tries again next round
            assert not (root / "registry").exists()
        finally:
            controller.close()  # neither the record nor the lease's release creates it
        assert not (root / "registry").exists()
    finally:
        node.stop()


def test_warm_counts_an_eviction_a_node_failed_as_a_failure(capsys) -> None:  # noqa: ANN001
    """A node's error on Evict was filed as a deferral, beside the guard's refusals: warm
    said 'run warm again then' at the plan's start and exited 0 with nothing staged."""
    from edgecache.cache.planner import Eviction, Plan, RegionPlan, StageTask
    from edgecache.clients.cli.context import ExitCode
    from edgecache.clients.cli.staging import (
        _exit_code,
        _report_failures,
        _report_json,
        _ScheduleWork,
        _Warmed,
    )
    from edgecache.clients.executor import Evicted, PlanExecutor, Released, WarmOutcome
    from edgecache.clients.topology import Schedule, ScheduledJob, Topology

    failure = "evicting pq@1 on 127.0.0.1:1: INTERNAL: mdb_del: Input/output error"

    class EvictFails(PlanExecutor):
        """The node's Evict answers an error (fault injection at the node call only)."""

        def _evict_nodes(self, eviction: Eviction, *, unless_pinned_after: datetime) -> Evicted:
            return Evicted(errors=(failure,))

    topology = Topology.model_validate(
        {"registry": "file:///nowhere", "regions": {"a": {"nodes": ["127.0.0.1:1"]}}}
    )
    now = datetime.now(UTC)
    later = now + timedelta(hours=1)
    plan = Plan(
        {
            "a": RegionPlan(
                tasks=[StageTask("a", ("pq", 2), 1, "origin", now, now, later, ("job",))],
                evictions=[Eviction("a", ("pq", 1), 1, now, None, "the room pq@2 needs")],
            )
        },
        [],
        {},
        {},
    )
    schedule = Schedule(jobs=[ScheduledJob(name="job", region="a", start=later, datasets=["pq@2"])])
    from edgecache.v1 import manifest_pb2

    manifests = {"pq@2": manifest_pb2.Manifest(dataset="pq", version=2)}
    outcome = EvictFails(topology).warm(plan, schedule, manifests, reports=[])
    assert outcome.evict_failures == [failure]
    assert [d.what for d in outcome.deferred] == ["stage pq@2"]  # the eviction is not one
    (run,) = outcome.runs  # the stage behind it waits, and says for what
    assert run.state == "deferred" and "once that node answers" in run.note, run.note
    work = _ScheduleWork(schedule, plan, manifests, now, {}, released=Released())
    warmed = _Warmed(rows=[], failed=[], work=work, outcome=outcome)
    assert _exit_code(warmed) is ExitCode.FAILED
    _report_failures(warmed)
    assert f"evict failed: {failure}" in capsys.readouterr().err
    _report_json(warmed, dry_run=False)
    assert json.loads(capsys.readouterr().out)["evict_failures"] == [failure]
    # A pin of a job gone from the schedule that a node failed to release was a warning
    # in the text report only, left out of --json, with exit 0.
    stuck = "releasing pq@1 on 127.0.0.1:1: UNAVAILABLE: Connection refused"
    released = Released(problems=[stuck])
    work = _ScheduleWork(schedule, plan, manifests, now, {}, released=released)
    warmed = _Warmed(rows=[], failed=[], work=work, outcome=WarmOutcome())
    assert _exit_code(warmed) is ExitCode.FAILED
    _report_failures(warmed)
    assert f"release failed: {stuck}" in capsys.readouterr().err
    _report_json(warmed, dry_run=False)
    assert json.loads(capsys.readouterr().out)["release_failures"] == [stuck]


def test_node_failures_to_evict_and_pin_are_counted_apart_from_refusals(site) -> None:
    """A node's Evict error was counted as edgecache_controller_evictions_refused_total
    (documented as the guard protecting a job), and pin failures reached only the log."""
    from edgecache.cache.planner import Eviction
    from edgecache.clients.executor import Evicted

    root, registry = site
    eu = start_local_node("eu", root / "cache-eu", registry, capacity="300KB")
    try:
        # Room for two versions, both held: c's job needs kept's room now.
        for name in ("kept", "b"):
            list(stub(eu.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)))
        jobs = (job("uses-b", "eu", T0, 1.5, "b@1"), job("uses-c", "eu", T0, 1, "c@1"))
        one_region(root, registry, eu, *jobs)
        clock = Clock(T0 - timedelta(minutes=1))
        controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
        failure = f"evicting kept@1 on {eu.address}: INTERNAL: mdb_del: Input/output error"
        pin_failure = f"pinning b@1 on {eu.address}: UNAVAILABLE: Connection reset"

        # Fault injection at the node calls only (a node failing Evict and Pin); the
        # controller's decisions and its accounting are the real code.
        def evict_fails(eviction: Eviction, *, unless_pinned_after: datetime) -> Evicted:
            return Evicted(errors=(failure,))

        controller.executor._evict_nodes = evict_fails  # type: ignore[method-assign]
        controller.executor.pin = lambda plan, seen=None: [pin_failure]  # type: ignore[method-assign]
        try:
            plan = controller.tick()
            controller.wait_idle()
            assert plan is not None and plan.regions["eu"].evictions, plan
            metrics = controller.metrics
            assert metrics.evictions_failed._value.get() == 1
            assert metrics.evictions_refused._value.get() == 0
            assert metrics.pin_failures._value.get() == 1
            assert f"eu: {failure}" in controller.failures and pin_failure in controller.failures
        finally:
            controller.close()
    finally:
        eu.stop()


def test_once_carries_out_the_tasks_that_come_due_as_its_own_end(site) -> None:
    # A helper's walk: two versions over one origin link and a peer region's copy of one,
    # all due within seconds; `controller --once` staged the first alone and exited 0,
    # the next run the second, the third the copy: each was due only once the one before
    # it had ended, after its round had looked.
    root, registry = site
    eu = start_local_node("eu", root / "cache-eu", registry)
    us = start_local_node("us", root / "cache-us", registry)
    try:
        two_regions(root, registry, eu, us)
        soon = datetime.now(UTC) + timedelta(minutes=10)
        (root / "schedule.yaml").write_text(
            "jobs:\n"
            + job("eu-job", "eu", soon, 1, "b@1", "c@1")
            + job("us-job", "us", soon, 1, "c@1")
        )
        process = controller_process(root, "--once")
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out
        assert versions_on(eu) == {"b@1": 3, "c@1": 3}, out
        assert versions_on(us) == {"c@1": 3}, out
        assert "not due yet" not in out, out
    finally:
        eu.stop()
        us.stop()


def test_once_retries_a_failed_task_now_rather_than_exit_0_past_it(site) -> None:
    # The record gives a failed task a retry time (its backoff); a --once run before it
    # skipped the task, printed nothing of it and exited 0 while the job's data was known
    # to be missing (a helper's walk). --once retries it: here it fails again, exit 1.
    root, registry = site
    for part in sorted((root / "origin" / "b").iterdir())[-1:]:
        part.unlink()  # origin lost an object of a published version: staging fails
    eu = start_local_node("eu", root / "cache-eu", registry)
    try:
        soon = datetime.now(UTC) + timedelta(minutes=10)
        one_region(root, registry, eu, job("needs-b", "eu", soon, 1, "b@1"))
        for attempt in range(2):
            process = controller_process(root, "--once")
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 1, (attempt, out)
            assert "b@1" in out and "staging" in out, (attempt, out)
        record = read_state(registry)
        (task,) = [t for k, t in record.tasks.items() if k.startswith("eu b@1")]
        assert task.state == "failed" and task.attempts == 2, task
    finally:
        eu.stop()


def test_a_removed_jobs_pin_is_not_planned_around_in_the_round_that_releases_it(site) -> None:
    # A helper's walk: the round after a job was removed planned on that job's pin (the
    # controller's own, released later in the same round), called another job "cannot be
    # met", its room "pinned for jobs outside this schedule", and said to add capacity.
    root, registry = site
    t0 = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)  # pins the node keeps
    eu = start_local_node("eu", root / "cache-eu", registry, capacity="300KB")
    try:
        one_region(
            root,
            registry,
            eu,
            job("uses-b", "eu", t0, 3, "b@1"),
            job("uses-kept", "eu", t0, 3, "kept@1"),
            job("uses-c", "eu", t0 + HOUR, 1, "c@1"),
        )
        (root / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{eu.address}']\n"
            "    origin_bandwidth: 10MB/s\n"
        )
        for name in ("kept", "b"):  # two fit, three do not (sizes known from the cache)
            list(stub(eu.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)))
        clock = Clock(t0 + timedelta(minutes=1))
        controller = Controller(
            root / "edgecache.yaml", root / "schedule.yaml", clock=clock, lease_ttl=5
        )
        try:
            plan = controller.tick()
            controller.wait_idle()
            assert plan is not None and [i.job for i in plan.infeasible] == ["uses-c"]
            assert set(versions_on(eu)) == {"b@1", "kept@1"}
            (root / "schedule.yaml").write_text(
                "jobs:\n"
                + job("uses-kept", "eu", t0, 3, "kept@1")
                + job("uses-c", "eu", t0 + HOUR, 1, "c@1")
            )
            clock.now += timedelta(minutes=1)
            plan = controller.tick()
            controller.wait_idle()
            assert plan is not None and not plan.infeasible, plan.infeasible
            held = versions_on(eu)  # c staged in b's room in the same round (LRU or plan)
            assert held["kept@1"] == 3 and held["c@1"] == 3, held
            pins = {
                f"{v.dataset}@{v.version}" for v in status(eu).versions if v.pinned_until.seconds
            }
            assert pins == {"kept@1", "c@1"}, pins
        finally:
            controller.close()
    finally:
        eu.stop()
