"""When the controller gives up a plan's peer source for origin, and when it waits for it.

No node is asked: the decision reads the plan and the controller's record alone.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from edgecache.cache.planner import Plan, RegionPlan, StageTask
from edgecache.clients.controller import Controller

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
V = ("v", 1)


def _task(region: str, source: str, start: datetime, finish: datetime, deadline: datetime):
    return StageTask(region, V, 10**6, source, start, finish, deadline, (f"{region}-job",))


def test_a_peer_that_stages_the_version_twice_serves_the_copy_from_its_first(
    tmp_path: Path,
) -> None:
    """c stages v@1 for its job at 3 h, evicts it, stages it again for 12 h; a copies it
    from c's first copy for 4 h. The controller compared the copy with c's last copy
    (ready at 11:xx), called it too late and fetched from origin hours early."""
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n"
        "  a: {nodes: ['127.0.0.1:1'], origin_bandwidth: 800Mbit/s, peers: {c: 8Gbit/s}}\n"
        "  c: {nodes: ['127.0.0.1:2'], origin_bandwidth: 800Mbit/s}\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs: []\n")
    (tmp_path / "registry").mkdir()
    controller = Controller(
        tmp_path / "edgecache.yaml", tmp_path / "schedule.yaml", clock=lambda: T0
    )
    try:
        first = _task("c", "origin", T0 + 2 * HOUR, T0 + 2.5 * HOUR, T0 + 3 * HOUR)
        again = _task("c", "origin", T0 + 11 * HOUR, T0 + 11.5 * HOUR, T0 + 12 * HOUR)
        copy = _task("a", "c", T0 + 2.5 * HOUR, T0 + 2.6 * HOUR, T0 + 4 * HOUR)
        plan = Plan(
            regions={"a": RegionPlan(tasks=[copy]), "c": RegionPlan(tasks=[first, again])},
            infeasible=[],
            transfers={},
            cost={},
        )
        assert controller._peer_wont_do(copy, plan, {}) is None  # wait for c's first copy
        # Where c's only copy comes too late for a's job, origin now is sooner.
        late = Plan(
            regions={"a": RegionPlan(tasks=[copy]), "c": RegionPlan(tasks=[again])},
            infeasible=[],
            transfers={},
            cost={},
        )
        assert "after the deadline" in (controller._peer_wont_do(copy, late, {}) or "")
    finally:
        controller.close()


def test_a_failing_peer_source_gives_way_to_origin_with_the_room_made_in_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a copies v@1 from c after a0 ends and x@1 is evicted for room; c's own staging
    fails (its origins refuse the source). Every round re-planned the copy, and the
    eviction of its room, at c's next finish, a moment after now: neither was ever due,
    and a1 started without v@1. The room is made at once and v@1 comes from origin."""
    from edgeutil import publish, stub, write_parquet_shards

    from edgecache.clients.node_client import start_local_node
    from edgecache.v1 import edge_pb2

    registry = f"file://{tmp_path}/registry"
    for name in ("x", "v"):
        write_parquet_shards(tmp_path / "origin" / name, 2, rows=2000)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    a = start_local_node("a", tmp_path / "cache-a", registry, capacity="400KiB")
    c = start_local_node(
        "c", tmp_path / "cache-c", registry, env={"EDGECACHE_ORIGINS": "file:///nowhere/"}
    )
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n"
            f"  a: {{nodes: ['{a.address}'], origin_bandwidth: 1MB/s, peers: {{c: 1GB/s}}}}\n"
            f"  c: {{nodes: ['{c.address}'], origin_bandwidth: 1MB/s}}\n"
        )
        jobs = [
            ("a0", "a", T0 + 0.2 * HOUR, T0 + 2.5 * HOUR, "x@1"),
            ("a1", "a", T0 + 3 * HOUR, T0 + 4 * HOUR, "v@1"),
            ("c0", "c", T0 + 6 * HOUR, T0 + 7 * HOUR, "v@1"),
        ]
        (tmp_path / "schedule.yaml").write_text(
            "jobs:\n"
            + "".join(
                f"  - {{name: {n}, region: {r}, start: '{s.isoformat()}', "
                f"duration: {int((e - s).total_seconds() // 60)}m, datasets: [{d}]}}\n"
                for n, r, s, e, d in jobs
            )
        )
        # x@1 held in a (a0's), so the plan knows its stored size: one version fits, not two.
        # (staged on the node itself: warm refuses it by the plan's estimate of its size).
        list(stub(a.address).Stage(edge_pb2.StageRequest(dataset="x", version=1)))
        clock = {"now": T0}
        controller = Controller(
            tmp_path / "edgecache.yaml",
            tmp_path / "schedule.yaml",
            clock=lambda: clock["now"],
            retry_backoff=0.1,
        )
        try:
            plan = controller.tick()
            controller.wait_idle()
            assert plan is not None
            copies = [t for t in plan.regions["a"].tasks if t.spec == "v@1"]
            assert len(copies) == 1, (plan.regions, plan.infeasible)
            assert copies[0].source == "c", plan.regions["a"]  # the plan's cheaper way
            for minutes in (140, 141, 142):  # a0 still reads x@1: the room is refused
                clock["now"] = T0 + timedelta(minutes=minutes)
                controller.tick()
                controller.wait_idle()
            # Refused each round (counted), said once: it filled the log every round.
            said = [
                r.getMessage()
                for r in caplog.records
                if r.levelno >= logging.WARNING and "not evicting x@1" in r.getMessage()
            ]
            assert len(said) == 1 and "a0 is reading it" in said[0], said
            assert controller.metrics.evictions_refused._value.get() == 3
            for minutes in (160, 161, 162):  # a0 has ended: x@1 may go
                clock["now"] = T0 + timedelta(minutes=minutes)
                controller.tick()
                controller.wait_idle()
            held = {
                f"{v.dataset}@{v.version}"
                for v in stub(a.address).Status(edge_pb2.StatusRequest()).versions
                if v.shard_count
            }
            assert held == {"v@1"}, held  # x@1 evicted for it, before a1's start at 3 h
        finally:
            controller.close()
    finally:
        a.stop()
        c.stop()


def test_a_name_resolves_to_its_recorded_version_beside_an_explicit_one() -> None:
    """A job reading ``books`` and ``books@3``, recorded through warm's record (keys as
    ``name@N``): two candidates, so ``books`` was left to follow the newest version."""
    from edgecache.clients.controller import _resolved_spec

    resolved = {"books@5": "books@5", "books@3": "books@3"}
    listed = ["books", "books@3"]
    assert _resolved_spec("books", resolved, listed) == "books@5"
    assert _resolved_spec("books@3", resolved, listed) == "books@3"
    assert _resolved_spec("books", {"books": "books@4"}, ["books"]) == "books@4"
    assert _resolved_spec("other", resolved, ["other"]) == "other"
