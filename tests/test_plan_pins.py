"""Pins other schedules' jobs hold on the nodes, and room the plan cannot make, against real nodes.

Region ``small`` (one node on loopback, real LMDB, a file:// registry) holds
pq@2 and has room for one version only, as in ``test_plan_defects``. Another
schedule's ``warm`` pins pq@2 there for its job; a second schedule that
needs the room for pq@1 must not get it by evicting pq@2: neither its plan,
nor ``warm``, nor the executor (the controller's) may take it, as
``edgecache evict`` refuses to.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, stub, write_parquet_shards
from test_plan_defects import resident, schedule, status, topology_file

from edgecache.cache.planner import Eviction, Job, Plan, RegionPlan, RegionState, plan
from edgecache.cache.registry import Registry
from edgecache.clients.executor import PlanExecutor
from edgecache.clients.node_client import start_local_node
from edgecache.clients.ops import make_plan
from edgecache.clients.topology import load_schedule, load_topology
from edgecache.v1 import edge_pb2

NOW = datetime(2026, 12, 1, tzinfo=UTC)
GiB = 2**30


def pinned_by_another_schedule(root: Path, now: datetime) -> datetime:
    """Warm schedule "a": its job-a reads pq@2 in small from +1 h, so pq@2 is pinned to +2 h."""
    path = schedule(root, "a", ("job-a", "small", now + timedelta(hours=1), "pq@2"))
    code, out, err = edgecache("warm", str(path), "--config", str(root / "small.yaml"))
    assert code == 0, (out, err)
    return now + timedelta(hours=2)


def test_a_plan_and_warm_never_evict_a_version_pinned_for_another_schedules_job(small) -> None:
    root, node = small
    now = datetime.now(UTC)
    until = pinned_by_another_schedule(root, now)
    assert resident(node, "pq", 2).HasField("pinned_until")
    # Schedule "b" knows nothing of job-a: its job-b needs pq@1 in 30 min, in the only room.
    path = schedule(root, "b", ("job-b", "small", now + timedelta(minutes=30), "pq@1"))
    topology = load_topology(root / "small.yaml")
    result, _ = make_plan(topology, load_schedule(path, topology))
    assert result.regions["small"].evictions == [], result.regions["small"].evictions
    (why,) = [i.reason for i in result.infeasible if i.job == "job-b"]
    assert "not enough capacity" in why and "pq@2 until" in why, why
    # When the pin runs out, and the version staged after it with the margin (5 min).
    said = datetime.strptime(why.split("start job-b at ")[1][:16], "%Y-%m-%d %H:%M")
    said = said.replace(tzinfo=UTC)
    assert until + timedelta(minutes=5) <= said <= until + timedelta(minutes=7), (until, why)
    config = ["--config", str(root / "small.yaml")]
    code, out, err = edgecache("warm", str(path), "--json", *config)
    assert code == 3, (code, out, err)  # job-b cannot be met; said, not forced
    done = json.loads(out)
    assert done["evicted"] == [] and done["items"] == [], done
    held = resident(node, "pq", 2)
    assert held.shard_count == 1 and held.HasField("pinned_until"), held  # job-a keeps it


def test_the_executor_refuses_to_evict_a_version_pinned_for_another_schedules_job(
    small,
) -> None:
    """The controller's guard: the eviction is handed over as a plan made without the pins
    (an older plan, or a planner that did not know them) would make it."""
    root, node = small
    now = datetime.now(UTC)
    until = pinned_by_another_schedule(root, now)
    path = schedule(root, "b", ("job-b", "small", now + timedelta(minutes=30), "pq@1"))
    topology = load_topology(root / "small.yaml")
    jobs = load_schedule(path, topology)
    registry = f"file://{root}/registry"
    manifests = {
        f"pq@{n}": Registry.run(registry, lambda reg, n=n: reg.manifest("pq", n)) for n in (1, 2)
    }
    executor = PlanExecutor(topology)
    eviction = Eviction("small", ("pq", 2), 40_000, now, None, "not needed again")
    evicted = executor.evict(eviction, jobs, manifests)
    assert evicted.refused is not None and evicted.freed == 0, evicted
    assert f"{node.address} pins it until {until:%Y-%m-%d %H:%M} UTC" in evicted.refused
    assert resident(node, "pq", 2).shard_count == 1
    # Nor does its pinning cut job-a's pin short: schedule b pinning pq@2 for 30 min
    # would let the node's LRU drop it before job-a.
    short = Plan(
        regions={"small": RegionPlan(pins={("pq", 2): now + timedelta(minutes=30)})},
        infeasible=[],
        transfers={},
        cost={},
    )
    assert executor.pin(short) == []
    kept = resident(node, "pq", 2).pinned_until.ToDatetime(tzinfo=UTC)
    assert abs((kept - until).total_seconds()) < 1, kept


def test_warm_of_one_version_larger_than_the_region_refuses_and_evicts_nothing(small) -> None:
    root, node = small
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin-big", 4, rows=500)
    publish(registry, f"file://{root}/origin-big", "big")  # four times pq: 4 × 40 KB > 50 KiB
    config = ["--config", str(root / "small.yaml")]
    code, out, err = edgecache("warm", "big@1", "--region", "small", *config)
    assert code == 2, (code, out, err)
    said = " ".join(err.split())
    assert "big@1 (" in said and "once stored) is larger than region small's whole capacity" in (
        said
    ), said
    assert "nothing was staged or evicted" in said and "more (a larger capacity" in said, said
    assert resident(node, "pq", 2).shard_count == 1  # the cache is as it was
    assert not [v for v in status(node).versions if v.dataset == "big"]


def test_capacity_advice_names_other_jobs_versions_and_only_the_bytes_missing() -> None:
    """A job reading ds@1 and ds@2 where only one fits: the advice named ds@1 (the job's
    own) as in use, and said to start the job after its own end."""
    job = Job(
        "both", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 1), ("ds", 2))
    )
    state = RegionState("eu", capacity_bytes=10 * GiB, origin_bandwidth=1e9)
    result = plan([job], {"eu": state}, {("ds", 1): 6 * GiB, ("ds", 2): 6 * GiB}, now=NOW)
    (why,) = [i.reason for i in result.infeasible]
    assert "in use then: nothing" in why and "ds@1" not in why, why
    assert "start both after" not in why, why  # its own end frees nothing for it
    assert "add at least 2.0 GiB to eu" in why, why


def test_capacity_advice_counts_only_what_is_missing_of_a_partly_held_version() -> None:
    """ds@2 is 6 GiB, 5 GiB of it already held: what the region lacks is 1 GiB, not 6."""
    other = Job("other", "eu", NOW, NOW + timedelta(hours=5), (("ds", 1),))
    job = Job("late", "eu", NOW + timedelta(hours=1), NOW + timedelta(hours=5), (("ds", 2),))
    state = RegionState(
        "eu",
        capacity_bytes=10 * GiB,
        origin_bandwidth=1e9,
        resident={("ds", 1): 4 * GiB + GiB // 2},
        partial={("ds", 2): 5 * GiB},
    )
    sizes = {("ds", 1): 4 * GiB + GiB // 2, ("ds", 2): 6 * GiB}
    result = plan([other, job], {"eu": state}, sizes, now=NOW)
    (why,) = [i.reason for i in result.infeasible if i.job == "late"]
    assert "needs 1.0 GiB," in why, why
    assert "in use then: ds@1" in why and "add at least 512.0 MiB to eu" in why, why


def test_evict_names_only_the_jobs_whose_pins_hold_the_version_there(small, tmp_path: Path) -> None:
    """job-old's pin was taken away (evict --force) before job-new pinned pq@2 again, and
    job-far pins it in region far, where it was evicted too: evict named all three."""
    root, node = small
    registry = f"file://{root}/registry"
    far = start_local_node("far", root / "cache-far", registry)
    try:
        two = topology_file(root / "two.yaml", registry, small=node.address, far=far.address)
        config = ["--config", str(two)]
        now = datetime.now(UTC)
        for name, start, region in (
            ("old", now + timedelta(hours=5), "small"),
            ("far", now + timedelta(hours=1), "far"),
        ):
            path = schedule(root, name, (f"job-{name}", region, start, "pq@2"))
            code, out, err = edgecache("warm", str(path), *config)
            assert code == 0, (out, err)
        for region in ("small", "far"):
            code, out, err = edgecache("evict", "pq@2", "--region", region, "--force", *config)
            assert code == 0, (out, err)
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=2)))
        path = schedule(root, "new", ("job-new", "small", now + timedelta(hours=1), "pq@2"))
        code, out, err = edgecache("warm", str(path), *config)
        assert code == 0, (out, err)
        code, out, err = edgecache("evict", "pq@2", *config)
        assert code == 2, (out, err)
        said = " ".join(err.split())
        assert "read by job-new (small" in said, said
        assert "job-old" not in said and "job-far" not in said, said
    finally:
        far.stop()


def test_the_planner_evicts_around_a_pin_or_after_it_runs_out() -> None:
    """A pinned version is passed over for one that is not, and taken only once its pin ends."""
    job = Job("train", "eu", NOW + timedelta(hours=3), NOW + timedelta(hours=4), (("ds", 3),))
    sizes = {("ds", 1): 4 * GiB, ("ds", 2): 4 * GiB, ("ds", 3): 4 * GiB}
    state = RegionState(
        "eu",
        capacity_bytes=8 * GiB,
        origin_bandwidth=1e9,
        resident={("ds", 1): 4 * GiB, ("ds", 2): 4 * GiB},
        pinned={("ds", 1): NOW + timedelta(days=1)},
    )
    result = plan([job], {"eu": state}, sizes, now=NOW)
    assert not result.infeasible, result.infeasible
    assert [e.version for e in result.regions["eu"].evictions] == [("ds", 2)]
    # Only ds@1 to make room with, pinned for an hour: evicted just in time, after the pin.
    state = RegionState(
        "eu",
        capacity_bytes=4 * GiB,
        origin_bandwidth=1e9,
        resident={("ds", 1): 4 * GiB},
        pinned={("ds", 1): NOW + timedelta(hours=1)},
    )
    result = plan([job], {"eu": state}, sizes, now=NOW)
    assert not result.infeasible, result.infeasible
    (eviction,) = result.regions["eu"].evictions
    assert eviction.version == ("ds", 1) and eviction.at >= NOW + timedelta(hours=1), eviction


def test_a_pin_two_schedules_share_is_shortened_then_released_as_their_jobs_go(small) -> None:
    """Review 41: warm of schedule "a" (job until +7 h) then of "b" (job until +3 h) on one
    version; a node keeps one pin time, the longest. Emptying "a" released nothing (b
    still reads it) and dropped a's record of the 7 h pin; emptying "b" found 7 h on the
    node, not the 3 h it recorded, and released nothing: pinned for hours for no job, and
    only evict --force freed it. Warm also said "pinned until +3 h" of a 7 h pin."""
    root, node = small
    now = datetime.now(UTC)
    config = ["--config", str(root / "small.yaml")]
    a = schedule(root, "a", ("long", "small", now + timedelta(hours=6), "pq@2"))
    b = schedule(root, "b", ("short", "small", now + timedelta(hours=2), "pq@2"))

    def pinned_until() -> datetime | None:
        held = resident(node, "pq", 2)
        return held.pinned_until.ToDatetime(tzinfo=UTC) if held.HasField("pinned_until") else None

    def near(when: datetime | None, expected: datetime) -> bool:
        return when is not None and abs(when - expected) < timedelta(seconds=2)

    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0 and near(pinned_until(), now + timedelta(hours=7)), (out, err)
    code, out, err = edgecache("warm", str(b), "--json", *config)
    assert code == 0, (out, err)
    (pin,) = json.loads(out)["pins"]
    assert pin["held_until"] is not None and near(
        datetime.fromisoformat(pin["held_until"]), now + timedelta(hours=7)
    ), pin
    code, out, err = edgecache("warm", str(b), *config)
    assert "its nodes keep it until" in out, out
    # "a" goes: the pin is shortened to b's job's end, not kept for a's.
    a.write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(a), *config)
    assert code == 0, (out, err)
    assert "shortened the pin of pq@2" in out, out
    assert near(pinned_until(), now + timedelta(hours=3)), pinned_until()
    # "b" goes too: nothing reads it, the pin is released.
    b.write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(b), *config)
    assert code == 0 and "released the pin of pq@2" in out, (out, err)
    assert pinned_until() is None
