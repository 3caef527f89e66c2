"""A long-running controller, as an operator runs it: edits, outages, failures, stops.

Real ``edgecache serve`` nodes on loopback, a file:// registry and origin; the
controller runs in-process on a clock the test sets, rounds driven by hand
(``tick``), so each scenario takes seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import pins_on, publish, stub, write_parquet_shards
from tcpproxy import FaultyProxy

from edgecache.clients.controller import Controller, read_state
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2, edge_pb2_grpc

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
EDGECACHE = [sys.executable, "-m", "edgecache.clients.cli"]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def job(name: str, region: str, start: datetime, hours: float, *datasets: str) -> str:
    return (
        f"  - name: {name}\n    region: {region}\n    start: '{start.isoformat()}'\n"
        f"    duration: {int(hours * 60)}m\n    datasets: [{', '.join(datasets)}]\n"
    )


def wait_answering(node: LocalNode, seconds: float = 30.0) -> None:
    """Until ``node`` answers a Status call (one resumed by SIGCONT takes a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with grpc.insecure_channel(node.address) as channel:
                edge_pb2_grpc.EdgeCacheStub(channel).Status(edge_pb2.StatusRequest(), timeout=5)
            return
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, f"{node.address} never answered again: {exc}"
            time.sleep(0.1)


def versions_on(node: LocalNode) -> dict[str, int]:
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    return {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions if v.shard_count}


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, str, LocalNode]]:
    """Versions a@1 and b@1 in a file:// registry; one node in region eu; no schedule yet."""
    registry = f"file://{tmp_path}/registry"
    for name in ("a", "b"):
        write_parquet_shards(tmp_path / "origin" / name, 3, rows=500)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    node = start_local_node("eu", tmp_path / "cache-eu", registry)
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    try:
        yield tmp_path, registry, node
    finally:
        node.stop()


def schedule(root: Path, *jobs: str) -> None:
    (root / "schedule.yaml").write_text("jobs:\n" + "".join(jobs) if jobs else "jobs: []\n")


def test_a_failing_task_is_retried_with_backoff_in_one_record(site, caplog) -> None:
    root, registry, node = site
    shutil.move(root / "origin" / "b", root / "origin-b-away")  # staging b fails
    schedule(root, job("j", "eu", T0 + HOUR, 1, "b@1"))
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), retry_backoff=60
    )
    try:
        with caplog.at_level(logging.WARNING, logger="edgecache.clients.controller"):
            for _ in range(6):  # rounds well inside the first backoff: no second run
                controller.tick()
                controller.wait_idle()
        assert set(controller.state.tasks) == {"eu b@1"}
        record = controller.state.tasks["eu b@1"]
        assert record.state == "failed" and record.attempts == 1
        assert "b@1" in record.error
        warned = [r.getMessage() for r in caplog.records if "staging b@1" in r.getMessage()]
        assert warned and "retrying in 60 s" in warned[0], warned
        assert controller.metrics.task_failures._value.get() == 1
        shutil.move(root / "origin-b-away", root / "origin" / "b")  # origin is back
        controller.retry_backoff = 0.2  # and the backoff over
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while controller.state.tasks["eu b@1"].state != "done":
            assert datetime.now(UTC) < deadline, "the task was never retried"
            controller.tick()
            controller.wait_idle()
        assert set(controller.state.tasks) == {"eu b@1"}  # the retry is the same task
        record = controller.state.tasks["eu b@1"]
        assert record.attempts == 2 and record.error == ""
        assert versions_on(node) == {"b@1": 3}
        assert read_state(registry).tasks["eu b@1"].state == "done"  # type: ignore[union-attr]
    finally:
        controller.close()


def test_a_task_waiting_out_its_backoff_does_not_hold_its_link(site) -> None:
    """b@1 fails to stage and waits out its backoff; a@1, a later job's, is planned behind
    it on the region's origin link. The plan put b@1 at "now" every round and a@1 after it,
    so a@1 was never due while b@1 failed: a healthy job missed its data (a helper's hunt).
    The link is idle while b@1 waits: a@1 starts."""
    root, _, node = site
    shutil.move(root / "origin" / "b", root / "origin-b-away")  # staging b fails
    schedule(root, job("j", "eu", T0 + HOUR, 1, "b@1"), job("k", "eu", T0 + 2 * HOUR, 1, "a@1"))
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), retry_backoff=60
    )
    try:
        for _ in range(6):  # well inside b@1's first backoff
            controller.tick()
            controller.wait_idle()
        assert controller.state.tasks["eu b@1"].state == "failed"
        assert controller.state.tasks["eu b@1"].attempts == 1  # its backoff is kept
        assert versions_on(node) == {"a@1": 3}
    finally:
        controller.close()


def test_a_restarted_controller_keeps_a_failed_tasks_backoff(site) -> None:
    """The backoff lived in memory only: a controller restarted (or a standby taking over)
    retried a failing task at once and counted from the first backoff again (a helper's
    hunt). It carries on from the record's failures and retry time."""
    root, _, _ = site
    shutil.move(root / "origin" / "b", root / "origin-b-away")  # staging b fails
    schedule(root, job("j", "eu", T0 + HOUR, 1, "b@1"))
    paths = (root / "edgecache.yaml", root / "schedule.yaml")
    first = Controller(*paths, clock=Clock(T0), retry_backoff=60)
    try:
        first.tick()
        first.wait_idle()
        assert first.state.tasks["eu b@1"].attempts == 1
    finally:
        first.close()
    again = Controller(*paths, clock=Clock(T0), retry_backoff=60)
    try:
        for _ in range(4):  # well inside the backoff the record says
            again.tick()
            again.wait_idle()
        record = again.state.tasks["eu b@1"]
        assert record.state == "failed" and record.attempts == 1, record
    finally:
        again.close()


def test_a_malformed_edit_keeps_the_last_good_schedule_running(site, caplog) -> None:
    root, _, node = site
    schedule(root, job("j1", "eu", T0 + HOUR, 1, "a@1"))
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        controller.tick()
        controller.wait_idle()
        assert versions_on(node) == {"a@1": 3}
        assert controller.metrics.schedule_valid._value.get() == 1
        # A half-saved edit, then a version vanishing behind the controller's back.
        (root / "schedule.yaml").write_text("jobs:\n  - name: j1\n    start: [oops\n")
        stub(node.address).Evict(edge_pb2.EvictRequest(dataset="a", version=1))
        with caplog.at_level(logging.INFO, logger="edgecache.clients.controller"):
            for _ in range(3):
                assert controller.tick() is not None  # rounds go on, on the last good plan
                controller.wait_idle()
        assert versions_on(node) == {"a@1": 3}  # restaged for j1, as the last plan says
        assert pins_on(node)["a@1"] == T0 + 2 * HOUR
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors  # said once, not every round
        assert "schedule.yaml:4: not valid YAML" in errors[0] and "last good schedule" in errors[0]
        assert "schedule.yaml:4" in controller.schedule_error
        assert controller.metrics.schedule_valid._value.get() == 0
        # A job in a region the topology lacks is a bad edit too: nothing acts on it.
        schedule(root, job("j1", "eu", T0 + HOUR, 1, "a@1"), job("x", "mars", T0, 1, "b@1"))
        controller.tick()
        assert "mars" in controller.schedule_error
        # Fixed: the new job is planned and staged.
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="edgecache.clients.controller"):
            schedule(root, job("j1", "eu", T0 + HOUR, 1, "a@1"), job("j2", "eu", T0, 1, "b@1"))
            controller.tick()
            controller.wait_idle()
        assert versions_on(node) == {"a@1": 3, "b@1": 3}
        assert controller.schedule_error == ""
        assert controller.metrics.schedule_valid._value.get() == 1
        assert any("schedule.yaml is valid again" in r.getMessage() for r in caplog.records)
    finally:
        controller.close()


def test_a_version_published_while_a_job_runs_does_not_change_what_it_reads(site) -> None:
    root, registry, node = site
    schedule(root, job("j", "eu", T0, 2, "a"))  # no @N: latest when planned
    clock = Clock(T0 - timedelta(minutes=10))
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.tick()
        controller.wait_idle()
        assert versions_on(node) == {"a@1": 3}
        clock.now = T0 + timedelta(minutes=10)  # j is reading a@1
        controller.tick()
        write_parquet_shards(root / "origin" / "a2", 2, rows=400)
        publish(registry, f"file://{root}/origin/a2", "a")  # a@2, the new latest
        for minutes in (20, 30):
            clock.now = T0 + timedelta(minutes=minutes)
            controller.tick()
            controller.wait_idle()
        assert versions_on(node) == {"a@1": 3}  # nothing staged for j from a@2
        assert pins_on(node) == {"a@1": T0 + 2 * HOUR}
        record = controller.state.jobs["j"]
        assert record.versions == ["a@1"] and record.complete_at_start is True
        # plan --status agrees: j has what it reads.
        shown = subprocess.run(
            [
                *EDGECACHE,
                "plan",
                str(root / "schedule.yaml"),
                "--status",
                "--json",
                "--config",
                str(root / "edgecache.yaml"),
                "--at",
                clock.now.isoformat(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        (view,) = json.loads(shown.stdout)
        assert view["missing"] == [] and view["state"] == "ready", shown.stdout
        # A job that has not started yet follows latest: it gets a@2.
        schedule(root, job("j", "eu", T0, 2, "a"), job("later", "eu", T0 + HOUR, 1, "a"))
        controller.tick()
        controller.wait_idle()
        assert versions_on(node) == {"a@1": 3, "a@2": 2}
        assert controller.state.jobs["later"].versions == ["a@2"]
    finally:
        controller.close()


def test_a_stop_mid_task_leaves_the_record_saying_what_is_true(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 12, rows=3000)
    publish(registry, f"file://{tmp_path}/origin", "big")
    # Staging crawls, so the stop lands mid-version.
    node = start_local_node(
        "eu", tmp_path / "cache", registry, extra_args=["--staging-rate", "400KB/s"]
    )
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        schedule(tmp_path, job("j", "eu", T0 + HOUR, 1, "big@1"))
        controller = Controller(
            tmp_path / "edgecache.yaml", tmp_path / "schedule.yaml", clock=Clock(T0)
        )
        try:
            controller.tick()
            deadline = time.monotonic() + 30
            while not versions_on(node).get("big@1"):
                assert time.monotonic() < deadline, "staging never started"
                time.sleep(0.05)
        finally:
            controller.close()  # what SIGTERM and Ctrl-C do
        held = versions_on(node)["big@1"]
        assert held < 12
        state = read_state(registry)
        assert state is not None
        # Not "running": nothing runs it now; the next controller resumes it.
        assert state.tasks["eu big@1"].state == "pending"
        assert pins_on(node) == {"big@1": T0 + 2 * HOUR}  # what it keeps, until j ends
    finally:
        node.stop()


def test_a_job_removed_from_the_schedule_releases_the_pins_placed_for_it(site) -> None:
    root, _, node = site
    schedule(root, job("j1", "eu", T0 + HOUR, 1, "a@1"), job("j2", "eu", T0 + HOUR, 3, "b@1"))
    clock = Clock(T0)
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        for minutes in (0, 1):  # one link: b@1 is staged after a@1
            clock.now = T0 + timedelta(minutes=minutes)
            controller.tick()
            controller.wait_idle()
        assert versions_on(node) == {"a@1": 3, "b@1": 3}
        assert pins_on(node) == {"a@1": T0 + 2 * HOUR, "b@1": T0 + 4 * HOUR}
        schedule(root, job("j1", "eu", T0 + HOUR, 1, "a@1"))  # j2 is cancelled
        controller.tick()
        # b@1 is the LRU's again (still cached); j1's pin stays.
        assert pins_on(node) == {"a@1": T0 + 2 * HOUR}
        assert versions_on(node) == {"a@1": 3, "b@1": 3}
        # A pin someone else set (another time) is not the controller's to remove.
        request = edge_pb2.PinRequest(dataset="b", version=1)
        request.until.FromDatetime((T0 + 9 * HOUR).replace(tzinfo=None))
        stub(node.address).Pin(request)
        schedule(root)  # every job cancelled
        controller.tick()
        assert pins_on(node) == {"b@1": T0 + 9 * HOUR}
    finally:
        controller.close()


def test_a_job_moved_to_end_sooner_has_its_pin_shortened_then_released(site) -> None:
    """Pin never cuts a longer pin short (it may be someone else's): the controller's own pin
    for a job that now ends sooner stayed at the old end, and the record's new time then
    did not match the node's, so cancelling the job released nothing."""
    root, _, node = site
    schedule(root, job("j", "eu", T0 + HOUR, 6, "a@1"))
    clock = Clock(T0)
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.tick()
        controller.wait_idle()
        assert pins_on(node) == {"a@1": T0 + 7 * HOUR}
        schedule(root, job("j", "eu", T0 + HOUR, 2, "a@1"))  # j now ends at +3 h
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 3 * HOUR}
        schedule(root)  # j is cancelled
        controller.tick()
        assert pins_on(node) == {}
    finally:
        controller.close()


def test_a_shortening_held_back_for_warms_job_keeps_the_nodes_time_in_the_record(
    site, monkeypatch
) -> None:
    """The controller keeps its longer pin while a job warm recorded reads the version; its
    record took the plan's sooner time all the same, no longer matched the node's, and the
    pin was never released once both jobs were gone. What warm's record says is given
    through ``_warm_reads`` (warm runs on the real clock; this controller's is set by hand)."""
    root, _, node = site
    schedule(root, job("j", "eu", T0 + HOUR, 6, "a@1"))
    clock = Clock(T0)
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.tick()
        controller.wait_idle()
        monkeypatch.setattr(controller, "_warm_reads", lambda: {("eu", "a@1"): T0 + 9 * HOUR})
        schedule(root, job("j", "eu", T0 + HOUR, 2, "a@1"))  # j now ends at +3 h
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 7 * HOUR}  # kept: warm's job reads it longer
        monkeypatch.setattr(controller, "_warm_reads", lambda: {("eu", "a@1"): T0 + 5 * HOUR})
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 5 * HOUR}  # to warm's job's end, not j's
        monkeypatch.setattr(controller, "_warm_reads", dict)  # warm's job is over
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 3 * HOUR}  # now shortened to j's end
        schedule(root)
        clock.now = T0 + 2 * HOUR
        controller.tick()
        assert pins_on(node) == {}
    finally:
        controller.close()


def test_a_cancelled_jobs_pin_that_warms_job_reads_is_cut_to_warms_end(site, monkeypatch) -> None:
    """The controller's job is cancelled while a job warm recorded reads the version until
    +4 h: the pin is kept for warm's job, to its end, not to the cancelled job's +7 h; once
    warm's job is over it is released. Unreadable, warm's record keeps the pin whole."""
    root, _, node = site
    schedule(root, job("j", "eu", T0 + HOUR, 6, "a@1"))
    clock = Clock(T0)
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock)
    try:
        controller.tick()
        controller.wait_idle()
        assert pins_on(node) == {"a@1": T0 + 7 * HOUR}
        schedule(root)  # j is cancelled
        monkeypatch.setattr(controller, "_warm_reads", lambda: None)  # unreadable
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 7 * HOUR}
        monkeypatch.setattr(controller, "_warm_reads", lambda: {("eu", "a@1"): T0 + 4 * HOUR})
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 4 * HOUR}
        controller.tick()  # the record matches the node's time: nothing more to do
        assert pins_on(node) == {"a@1": T0 + 4 * HOUR}
        monkeypatch.setattr(controller, "_warm_reads", dict)
        controller.tick()
        assert pins_on(node) == {}
    finally:
        controller.close()


# ------------------------------------------------------- a node that never answers


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Path, LocalNode, FaultyProxy]]:
    """Versions a@1, b@1, c@1; region eu of two nodes, the second behind a proxy.

    A job reads all three: a round pins three versions on each node, and a call
    to a blackholed node lasts seconds (gRPC's connect and keepalive timeouts).
    """
    registry = f"file://{tmp_path}/registry"
    for name in ("a", "b", "c"):
        write_parquet_shards(tmp_path / "origin" / name, 2, rows=300)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    first = start_local_node("eu", tmp_path / "cache-1", registry)
    second = start_local_node("eu", tmp_path / "cache-2", registry)
    proxy = FaultyProxy(second.address)
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n"
        f"    nodes: ['{first.address}', '{proxy.address}']\n"
    )
    schedule(tmp_path, job("j", "eu", T0 + HOUR, 1, "a@1", "b@1", "c@1"))
    try:
        yield tmp_path, first, proxy
    finally:
        proxy.close()
        first.stop()
        second.stop()


# The lease of the rounds timed below, and a bound on such a round that is inside it. The
# lease is long enough that a loaded host (seconds of its own work per round) stays inside
# it; the bound still catches a round that overruns its lease (a call not bounded by it,
# or a blackholed node called again).
LEASE = 16
INSIDE_LEASE = 12


def timed_tick(controller: Controller) -> float:
    """Seconds one round takes (the caller compares them with the lease)."""
    started = time.monotonic()
    controller.tick()
    return time.monotonic() - started


def holds_lease(controller: Controller) -> bool:
    record = controller._await(controller.lease.current())
    return record is not None and record.holder == controller.holder and record.live(time.time())


def test_a_blackholed_node_is_not_called_again_and_the_round_ends_inside_the_lease(
    two_nodes,
) -> None:
    root, eu, proxy = two_nodes
    proxy.blackhole()  # accepts TCP, never answers: its status report says down
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=LEASE
    )
    try:
        took = timed_tick(controller)
        assert took < INSIDE_LEASE, f"the round took {took:.1f} s of a {LEASE} s lease"
        assert holds_lease(controller)
        assert pins_on(eu) == dict.fromkeys(
            ("a@1", "b@1", "c@1"), T0 + 2 * HOUR
        )  # the node that answers
        assert any(proxy.address in f for f in controller.failures)  # named as down
    finally:
        proxy.close()
        controller.close()


def test_a_node_that_stops_answering_mid_round_costs_one_bounded_call(
    two_nodes, monkeypatch
) -> None:
    root, eu, proxy = two_nodes
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=LEASE
    )
    pin = controller.executor.pin

    def blackhole_then_pin(*args, **kwargs):  # the node answered the status, then went dark
        proxy.blackhole()
        return pin(*args, **kwargs)

    monkeypatch.setattr(controller.executor, "pin", blackhole_then_pin)
    try:
        took = timed_tick(controller)
        assert took < INSIDE_LEASE, f"the round took {took:.1f} s of a {LEASE} s lease"
        assert holds_lease(controller)
        assert pins_on(eu) == dict.fromkeys(("a@1", "b@1", "c@1"), T0 + 2 * HOUR)
        us_failures = [f for f in controller.failures if proxy.address in f]
        assert len(us_failures) == 1, controller.failures  # one call timed out, no second
    finally:
        proxy.close()
        controller.close()


def test_a_node_whose_pin_timed_out_is_not_called_again_to_unpin_in_that_round(
    two_nodes, monkeypatch
) -> None:
    root, eu, proxy = two_nodes
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=LEASE
    )
    called: list[tuple[str, str]] = []
    node_call = controller.executor._node_call

    def counted(node, what, *args, **kwargs):
        called.append((node, what))
        return node_call(node, what, *args, **kwargs)

    monkeypatch.setattr(controller.executor, "_node_call", counted)
    pin = controller.executor.pin

    def blackhole_then_pin(*args, **kwargs):  # the node answered the status, then went dark
        proxy.blackhole()
        return pin(*args, **kwargs)

    try:
        controller.tick()  # a, b and c pinned on both nodes
        controller.wait_idle()
        assert pins_on(eu) == dict.fromkeys(("a@1", "b@1", "c@1"), T0 + 2 * HOUR)
        # j now reads a and b for longer: both re-pinned, c's pins released.
        schedule(root, job("j", "eu", T0 + HOUR, 2, "a@1", "b@1"))
        monkeypatch.setattr(controller.executor, "pin", blackhole_then_pin)
        called.clear()
        took = timed_tick(controller)
        assert [what for node, what in called if node == proxy.address] == ["pinning a@1"]
        assert took < INSIDE_LEASE, f"the round took {took:.1f} s of a {LEASE} s lease"
        assert holds_lease(controller)
        assert pins_on(eu) == dict.fromkeys(("a@1", "b@1"), T0 + 3 * HOUR)
        us_failures = [f for f in controller.failures if proxy.address in f]
        assert len(us_failures) == 1, controller.failures  # the Pin that timed out
        # The pin it could not release is kept on record: the next round releases it.
        assert f"{proxy.address} c@1" in controller.state.pins
        assert f"{eu.address} c@1" not in controller.state.pins
    finally:
        proxy.close()
        controller.close()


def test_a_node_going_down_and_coming_back_is_logged_once_each(site, caplog) -> None:
    root, _, node = site
    schedule(root, job("j", "eu", T0 + HOUR, 1, "a@1"))
    controller = Controller(
        root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0), lease_ttl=5
    )

    def up() -> float:
        """The node's one node_up sample (its `node` label turns from address to id)."""
        [sample] = [s for m in controller.metrics.node_up.collect() for s in m.samples]
        return sample.value

    try:
        with caplog.at_level(logging.INFO, logger="edgecache.clients.controller"):
            node.process.send_signal(signal.SIGSTOP)  # accepts TCP, answers nothing
            try:
                for _ in range(3):
                    controller.tick()
                    assert up() == 0
            finally:
                node.process.send_signal(signal.SIGCONT)
            # A resumed node first works through what queued while it was stopped, which
            # takes a loaded host more than the round's 1 s status calls: the rounds below
            # are for a node that answers again.
            wait_answering(node)
            for _ in range(2):
                controller.tick()
                assert up() == 1
        said = [r.getMessage() for r in caplog.records if node.address in r.getMessage()]
        down = [m for m in said if "is down" in m]
        back = [m for m in said if "is back up" in m]
        assert len(down) == 1, said
        assert "edgecache status" in down[0] and "edgecache doctor" in down[0]
        assert len(back) == 1, said
    finally:
        node.process.send_signal(signal.SIGCONT)
        controller.close()


# ------------------------------------------------------------------- signals


def controller_process(root: Path, *extra: str) -> subprocess.Popen[str]:
    """``edgecache controller`` on ``root``'s files, stdout and stderr apart."""
    return subprocess.Popen(
        [
            *EDGECACHE,
            "controller",
            "--config",
            str(root / "edgecache.yaml"),
            "--schedule",
            str(root / "schedule.yaml"),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_running(process: subprocess.Popen[str]) -> None:
    """Read stdout until the controller says it runs (its first round begins then)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("controller "):
            return
    raise AssertionError(f"the controller never ran: {process.communicate()[1]}")


@pytest.fixture
def slow_site(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """big@1 (12 shards) staged at a crawl into region eu's one node; a job reads it."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 12, rows=3000)
    publish(registry, f"file://{tmp_path}/origin", "big")
    node = start_local_node(
        "eu", tmp_path / "cache", registry, extra_args=["--staging-rate", "400KB/s"]
    )
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    schedule(tmp_path, job("j", "eu", datetime.now(UTC) + HOUR, 1, "big@1"))
    try:
        yield tmp_path, node
    finally:
        node.stop()


def test_ctrl_c_exits_130_with_once_and_running_and_sigterm_0(slow_site) -> None:
    root, node = slow_site
    for args, signum, code in (
        (["--once"], signal.SIGINT, 130),
        (["--interval", "0.5"], signal.SIGINT, 130),
        (["--interval", "0.5"], signal.SIGTERM, 0),
    ):
        process = controller_process(root, "--lease-ttl", "2", *args)
        try:
            wait_running(process)
            deadline = time.monotonic() + 30
            while not versions_on(node).get("big@1"):  # mid-task
                assert time.monotonic() < deadline, "staging never started"
                time.sleep(0.05)
            process.send_signal(signum)
            _, err = process.communicate(timeout=30)
        finally:
            process.kill()
        assert process.returncode == code, (args, signum, err)
        if code == 130:
            assert "run the same command again to resume" in err, err
    assert versions_on(node)["big@1"] < 12  # each stop landed mid-version


class Lines:
    """A process's output, read line by line on a thread of its own as it comes."""

    def __init__(self, stream: Iterable[str] | None) -> None:
        self.lines: list[str] = []
        self._came = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Iterable[str] | None) -> None:
        for line in stream or ():
            with self._came:
                self.lines.append(line)
                self._came.notify_all()

    def wait_for(self, text: str, seconds: float) -> bool:
        """Whether a line with ``text`` came within ``seconds``."""
        with self._came:
            return self._came.wait_for(lambda: any(text in x for x in self.lines), seconds)

    def all(self) -> str:
        """Everything, once the stream ended (the process exited)."""
        self._thread.join(timeout=30)
        return "".join(self.lines)


def test_a_second_ctrl_c_stops_at_once(two_nodes) -> None:
    root, _, proxy = two_nodes
    proxy.blackhole()  # a round asks it for seconds: a stop waits for the round
    for _ in range(3):
        process = controller_process(root, "--lease-ttl", "60", "--interval", "0.5")
        try:
            wait_running(process)
            _, err = Lines(process.stdout), Lines(process.stderr)  # both read: no pipe fills
            time.sleep(0.3)
            process.send_signal(signal.SIGINT)  # stop after this round
            # The second only once the first was handled: two sent together may reach
            # Python's handler as one (it then runs once), which a loaded host made likely.
            assert err.wait_for("stopping (Ctrl-C again", 30), "".join(err.lines)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # no: now
                second = time.monotonic()
                process.wait(timeout=60)
                took = time.monotonic() - second
                break
            process.wait(timeout=60)  # the round ended first (3 s; a crawling host): again
        finally:
            process.kill()
    else:
        raise AssertionError("each time, the round ended before the second Ctrl-C was sent")
    said = err.all()
    assert process.returncode == 130, said
    # What only the second Ctrl-C's stop says ("stop at once" is in the first's line too):
    # a second Ctrl-C ignored ends the process cleanly after the round, saying "interrupted".
    assert "stopped at once" in said, said
    # It exits at once; 5 s, not 1.5, for a loaded host's slow scheduling.
    assert took < 5, f"exited {took:.1f} s after the second Ctrl-C"
