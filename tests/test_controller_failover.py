"""A standby controller that takes the lease carries on from the leader's latest record.

Two controllers in-process on one file:// registry, on a clock the test
moves by hand, and a real node on loopback (``edgecache serve``). The record
(task and job records, pins, node ids) changes while the first leads; the
one that leads next must act on that record, not on the one it read when it
started, and must not save over it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import stub
from test_controller import Clock, job, one_region

from edgecache.clients.controller import Controller, ControllerState, read_state
from edgecache.clients.node_client import LocalNode
from edgecache.v1 import edge_pb2

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)


def pinned(node: LocalNode) -> set[str]:
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    return {f"{v.dataset}@{v.version}" for v in status.versions if v.HasField("pinned_until")}


def saved(registry: str) -> ControllerState:
    state = read_state(registry)
    assert state is not None
    return state


def controller(root: Path, clock: Clock, **options: object) -> Controller:
    return Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=clock, **options)  # type: ignore[arg-type]


def test_a_standby_that_takes_over_carries_on_from_the_leaders_latest_record(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
    clock = Clock(T0 - MINUTE)
    second = controller(root, clock)  # reads the record as it is now: empty
    first = controller(root, clock)
    try:
        first.refresh()  # sees j before its start, without acting
        clock.now = T0 + 10 * MINUTE  # j started without b@1: missed, staged after its start
        assert first.tick() is not None
        first.wait_idle()
        assert second.tick() is None  # standing by
        # The first leads on: k is added, and c@1 pinned for it.
        one_region(
            root,
            registry,
            node,
            job("j", "eu", T0, 1, "b@1"),
            job("k", "eu", T0 + 5 * HOUR, 1, "c@1"),
        )
        clock.now += MINUTE
        assert first.tick() is not None
        first.wait_idle()
        assert second.tick() is None  # still standing by
        before = saved(registry)
        assert before.holder == first.holder
        assert before.jobs["j"].complete_at_start is False and before.jobs["j"].why_missed
        assert before.tasks["eu b@1"].state == "done"
        assert f"{node.address} c@1" in before.pins
        assert pinned(node) == {"b@1", "c@1"}
    finally:
        first.close()  # stops: gives the lease up
    try:
        # k is cancelled while nobody leads: its pin, placed by the first, must go.
        one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
        clock.now += MINUTE
        assert second.tick() is not None  # takes over
        after = saved(registry)
        assert after.holder == second.holder
        assert after.jobs["j"].complete_at_start is False  # not "complete": b@1 came late
        assert after.jobs["j"].why_missed == before.jobs["j"].why_missed
        assert after.jobs["j"].ready_at == before.jobs["j"].ready_at
        assert after.tasks["eu b@1"] == before.tasks["eu b@1"]  # the first's run, kept
        assert after.nodes == before.nodes
        assert f"{node.address} c@1" not in after.pins
        assert pinned(node) == {"b@1"}  # the first's pin for k, released by the second
    finally:
        second.close()


def test_a_controller_that_leads_again_after_a_lapse_carries_on_from_the_record_since(
    eu,
) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
    clock = Clock(T0 - MINUTE)
    # The second stands by while the first's lease is live, in real time: the first's
    # round and staging b@1 (wait_idle) must end inside it. 8 s, not 2: a loaded host takes
    # seconds for that. The pause below then waits for the lease's own expiry.
    first = controller(root, clock, lease_ttl=8)
    second: Controller | None = controller(root, clock, lease_ttl=8)
    try:
        assert second is not None
        first.refresh()  # sees j before its start, without acting
        clock.now = T0 + 10 * MINUTE  # j started without b@1
        assert first.tick() is not None
        first.wait_idle()
        assert second.tick() is None
        assert saved(registry).jobs["j"].complete_at_start is False
        # The first pauses (no round, no renewal) past its lease; k, starting at 08:25, is
        # added.
        lease = first._await(first.lease.current())
        assert lease is not None and lease.holder == first.holder
        time.sleep(max(0.0, lease.expires - time.time()) + 0.2)
        one_region(
            root,
            registry,
            node,
            job("j", "eu", T0, 1, "b@1"),
            job("k", "eu", T0 + 25 * MINUTE, 1, "c@1"),
        )
        clock.now = T0 + 20 * MINUTE
        assert second.tick() is not None  # takes over
        second.wait_idle()
        clock.now = T0 + 26 * MINUTE  # k has started, with c@1 there
        assert second.tick() is not None
        led = saved(registry)
        assert led.holder == second.holder
        assert led.jobs["j"].complete_at_start is False  # the first's view of j, kept
        assert led.tasks["eu b@1"].state == "done"
        assert led.jobs["k"].complete_at_start is True
        assert led.tasks["eu c@1"].state == "done"
        second.close()  # gives the lease up
        second = None
        # The first, back from its pause, never saw that it lost the lease: it leads again
        # and carries on from the second's record, not from its own.
        clock.now += MINUTE
        assert first.tick() is not None
        again = saved(registry)
        assert again.holder == first.holder
        # The second's verdict on k, not a first sight of k after its start ("unknown").
        assert again.jobs["k"].complete_at_start is True
        assert again.jobs["k"].ready_at == led.jobs["k"].ready_at
        assert again.tasks["eu c@1"] == led.tasks["eu c@1"]
        assert again.tasks["eu b@1"] == led.tasks["eu b@1"]
        assert again.pins == led.pins
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_standby_looking_at_the_nodes_does_not_save_over_the_leaders_record(eu) -> None:
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0, 1, "b@1"))
    clock = Clock(T0 - MINUTE)
    second = controller(root, clock)  # its record: empty
    first = controller(root, clock)
    try:
        first.refresh()  # sees j before its start, without acting
        clock.now = T0 + 10 * MINUTE
        assert first.tick() is not None
        first.wait_idle()
        before = saved(registry)
        assert before.jobs["j"].complete_at_start is False
        second.wait_idle()  # records what the nodes hold only while it leads: it does not
        assert saved(registry) == before
    finally:
        first.close()
        second.close()


def test_a_leader_paused_mid_round_past_its_lease_neither_stages_nor_saves(eu, monkeypatch) -> None:  # noqa: ANN001
    """Paused after its round's last lease check (a stopped process, a stalled VM), the
    first controller resumed to save over the record of the one that had taken the lease
    meanwhile (and to stage, paused before its tasks); a standby's frozen node_up kept an
    alert firing."""
    root, registry, node = eu
    one_region(root, registry, node, job("j", "eu", T0 + HOUR, 1, "b@1"))
    clock = Clock(T0)
    first = controller(root, clock, lease_ttl=2)
    second = controller(root, clock, lease_ttl=2)
    try:
        update = first._update_metrics

        def pause_then_lose_the_lease(*args: object) -> None:
            update(*args)  # type: ignore[arg-type]
            time.sleep(2.2)  # past the lease, after the round's last lease check
            assert second.tick() is not None  # takes over and saves its record
            second.wait_idle()

        monkeypatch.setattr(first, "_update_metrics", pause_then_lose_the_lease)
        assert first.tick() is None  # it found the lease lost before saving
        assert saved(registry).holder == second.holder  # the new leader's record stands
        exported = first.metrics.registry.get_sample_value(
            "edgecache_controller_node_up",
            {"node": saved(registry).nodes.get(node.address, node.address), "region": "eu",
             "address": node.address},
        )  # fmt: skip
        assert exported is not None  # the first set it in its round, as leader
        monkeypatch.undo()
        assert first.tick() is None  # stands by now: its node series go
        assert not [
            s for m in first.metrics.registry.collect() if m.name == "edgecache_controller_node_up"
            for s in m.samples
        ]  # fmt: skip
    finally:
        first.close()
        second.close()
