"""When the controller gives up a plan's peer source for origin, and when it waits for it.

No node is asked: the decision reads the plan and the controller's record alone.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

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
