"""Room another schedule's pinned, not yet staged version needs is kept for it.

warm pins every version a job reads and stages one that does not fit yet later
(deferred until a job in the way ends); the controller stages each in its time.
Until then the pin holds no data, and a second tool's plan counted only what the
region held: it staged into that room, and the first schedule's job could not
be met (a user's report: two tools on one registry, tight room). The plan now
keeps the room of such a version until its pin runs out, and says so.

And the earliest-start advice of a job that finds no room counted what is
free before the version's room is last looked for twice (in the room it had,
and again as what is in the way): a start at which the job still did not fit.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, stub, write_parquet_shards
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.cache.planner import Job, RegionState, VersionSize, plan
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

NOW = datetime(2026, 12, 5, 11, 49, tzinfo=UTC)
MINUTE = timedelta(minutes=1)
MiB = 2**20
A, B, C = ("a", 1), ("b", 1), ("c", 1)


def _advised_start(reason: str, job: str) -> datetime:
    found = re.search(rf"start {job} at (\d{{4}}-\d\d-\d\d \d\d:\d\d) or later", reason)
    assert found, reason
    return datetime.strptime(found[1], "%Y-%m-%d %H:%M").replace(tzinfo=UTC)


def _region(**changes: object) -> RegionState:
    """4 MiB: a@1 held and pinned by another schedule for 5 min, b@1 pinned by it for 47
    min and not staged yet (its 2.8 MiB deferred until a@1's job ends)."""
    state = RegionState(
        "r1",
        capacity_bytes=4 * MiB,
        origin_bandwidth=12.5e6,
        resident={A: 2 * MiB},
        pinned={A: NOW + 5 * MINUTE, B: NOW + 47 * MINUTE},
        reserved={B: int(2.8 * MiB)},
    )
    return replace(state, **changes)  # type: ignore[arg-type]


def _small(start: datetime) -> Job:
    return Job("c-small", "r1", start, start + 30 * MINUTE, (C,))


SIZES = {C: int(1.5 * MiB)}


def test_a_pinned_version_not_staged_yet_keeps_its_room() -> None:
    result = plan([_small(NOW + 20 * MINUTE)], {"r1": _region()}, SIZES, now=NOW)
    (row,) = result.infeasible
    assert "not enough capacity" in row.reason, row
    assert "b@1 until 2026-12-05 12:36 (not staged yet: its room is kept)" in row.reason, row
    assert result.regions["r1"].tasks == [] and result.regions["r1"].evictions == []
    # Counting only what is held, as the plan did, c@1 went into b@1's room.
    assert plan([_small(NOW + 20 * MINUTE)], {"r1": _region(reserved={})}, SIZES, now=NOW).feasible(
        "c-small"
    )


def test_the_advised_start_is_after_the_pin_runs_out_and_meets_the_job() -> None:
    (row,) = plan([_small(NOW + 20 * MINUTE)], {"r1": _region()}, SIZES, now=NOW).infeasible
    advised = _advised_start(row.reason, "c-small")
    # It said 12:01: a@1's pin (11:54) counted as room twice, and c@1 did not fit then.
    assert advised >= NOW + 47 * MINUTE, row.reason
    moved = plan([_small(advised)], {"r1": _region()}, SIZES, now=NOW)
    assert moved.feasible("c-small"), moved.infeasible
    # The room is b@1's until its pin runs out; there is nothing to evict (it holds no data).
    (task,) = moved.regions["r1"].tasks
    assert task.start >= NOW + 47 * MINUTE and moved.regions["r1"].evictions == []
    early = plan([_small(NOW + 46 * MINUTE)], {"r1": _region()}, SIZES, now=NOW)
    assert not early.feasible("c-small")


def test_room_kept_goes_with_the_pin_and_evicts_nothing_not_held() -> None:
    job = _small(NOW + 120 * MINUTE)
    result = plan([job], {"r1": _region()}, SIZES, now=NOW)
    assert not result.infeasible, result.infeasible
    (task,) = result.regions["r1"].tasks
    evicted = [e.version for e in result.regions["r1"].evictions]
    assert B not in evicted  # not held: no Evict call for it
    assert task.start <= job.start - 5 * MINUTE


def test_a_version_the_schedule_reads_itself_keeps_no_room_twice() -> None:
    """The other schedule's pinned version is one this plan stages too: counted once."""
    job = Job("b-reader", "r1", NOW + 20 * MINUTE, NOW + 40 * MINUTE, (B,))
    state = _region(resident={}, pinned={B: NOW + 47 * MINUTE}, capacity_bytes=3 * MiB)
    result = plan([job], {"r1": state}, {B: int(2.8 * MiB)}, now=NOW)
    assert not result.infeasible, result.infeasible
    assert [t.version for t in result.regions["r1"].tasks] == [B]


@st.composite
def one_job(draw: st.DrawFn) -> tuple[Job, RegionState, dict]:
    """A region holding versions another schedule pins for a while and keeping room for
    others it pinned and has not staged; one job that may not fit until some pins run out."""
    theirs = [("t", v) for v in range(draw(st.integers(1, 4)))]
    mine = [("m", v) for v in range(draw(st.integers(1, 2)))]
    sizes = {v: VersionSize(draw(st.integers(1, 16)) * MiB // 4, MiB) for v in theirs + mine}
    held = draw(st.lists(st.sampled_from(theirs), max_size=len(theirs), unique=True))
    pinned = {v: NOW + draw(st.integers(1, 240)) * MINUTE for v in theirs}
    reserved = {v: sizes[v].stored for v in theirs if v not in held}
    floor = sum(sizes[v].stored for v in held)
    state = RegionState(
        "eu",
        capacity_bytes=max(floor, max(sizes[v].stored for v in mine))
        + draw(st.integers(0, 12)) * MiB // 4,
        origin_bandwidth=draw(st.sampled_from([1e9, 1e5, 1e4])),
        resident={v: sizes[v].stored for v in held},
        pinned=pinned,
        reserved=reserved,
    )
    start = NOW + draw(st.integers(1, 200)) * MINUTE
    job = Job("J", "eu", start, start + draw(st.integers(5, 120)) * MINUTE, tuple(mine))
    return job, state, sizes


CHECKED = [0]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(scenario=one_job())
def _the_advised_start_fits(scenario) -> None:  # noqa: ANN001
    job, state, sizes = scenario
    result = plan([job], {"eu": state}, sizes, now=NOW)
    reasons = [row.reason for row in result.infeasible if "not enough capacity" in row.reason]
    advice = {_advised_start(r, "J") for r in reasons if "or start J at" in r}
    if not advice or len(advice) < len(reasons):
        return
    (advised,) = advice
    moved = replace(job, start=advised, end=advised + (job.end - job.start))
    again = plan([moved], {"eu": state}, sizes, now=NOW)
    assert not [r for r in again.infeasible if "capacity" in r.reason], (reasons, again)
    CHECKED[0] += 1


def test_a_job_started_when_the_advice_says_finds_its_room() -> None:
    """Re-planned with the start the advice gives, the job fits; not vacuously."""
    CHECKED[0] = 0
    _the_advised_start_fits()
    assert CHECKED[0] > 40, CHECKED


def test_plan_on_real_nodes_keeps_the_room_of_a_version_another_tool_pinned(
    tmp_path: Path,
) -> None:
    """Another tool pinned pq@1 for its job and has not staged it; this schedule's pq@2
    would take its room. The plan says so (exit 3) instead of staging into it."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=500)
    publish(registry, f"file://{tmp_path}/origin", "pq")
    publish(registry, f"file://{tmp_path}/origin", "pq")  # pq@2: the same size
    source = sum(p.stat().st_size for p in (tmp_path / "origin").iterdir())
    node = start_local_node("r1", tmp_path / "cache", registry, capacity=str(source * 3 // 2))
    try:
        config = tmp_path / "edgecache.yaml"
        config.write_text(f"registry: {registry}\nregions:\n  r1:\n    nodes: ['{node.address}']\n")
        until = datetime.now(UTC) + timedelta(hours=3)
        request = edge_pb2.PinRequest(dataset="pq", version=1)
        request.until.FromDatetime(until)
        stub(node.address).Pin(request)  # as warm does for a version it defers
        start = datetime.now(UTC) + timedelta(hours=1)
        schedule = tmp_path / "mine.yaml"
        schedule.write_text(
            f"jobs:\n  - name: mine\n    region: r1\n    start: '{start.isoformat()}'\n"
            "    duration: 1h\n    datasets: [pq@2]\n"
        )
        code, out, err = edgecache("plan", str(schedule), "--config", str(config), "--json")
        assert code == 3, (code, out, err)
        rows = json.loads(out)["infeasible"]
        (row,) = rows
        assert row["job"] == "mine" and "(not staged yet: its room is kept)" in row["reason"]
        assert f"pq@1 until {until:%Y-%m-%d %H:%M}" in row["reason"], row
        code, out, err = edgecache("warm", str(schedule), "--config", str(config))
        assert code == 3, (code, out, err)
        status = stub(node.address).Status(edge_pb2.StatusRequest())
        assert not [v for v in status.versions if v.shard_count], status  # nothing staged
    finally:
        node.stop()


def test_a_pin_dropped_because_its_job_cannot_be_met_says_so() -> None:
    """warm released such a pin saying "no job of the schedule reads it there any more"
    while the schedule's job still read it (it could not be met: no room)."""
    from edgecache.cache.planner import Infeasible, Plan
    from edgecache.clients.executor import release_line
    from edgecache.clients.ops import WarmPin

    pin = WarmPin("/w.yaml", "10.0.0.1:7070", "r1", "b@1", NOW + 47 * MINUTE)
    unmet = Infeasible("w-big", "r1", "b@1", "not enough capacity: …")
    plan_ = Plan(regions={}, infeasible=[unmet], transfers={}, cost={})
    line = release_line(pin, plan_, dry_run=True)
    assert line == (
        "r1: would release the pin of b@1 on 10.0.0.1:7070 (until 2026-12-05 12:36): w-big, "
        "which reads it, cannot be met there: the plan does not stage it, and keeps no pin for it"
    ), line
    elsewhere = Plan(regions={}, infeasible=[replace(unmet, region="r2")], transfers={}, cost={})
    assert release_line(pin, elsewhere).endswith("no job of the schedule reads it there any more")


def test_a_pinned_version_held_in_part_is_evicted_with_the_room_kept_for_the_rest() -> None:
    """b@1 held in part (4 MiB) with room kept for its last 1 MiB: made room by popping the
    kept room alone, the plan evicted nothing and staged c@1 beside b@1's 4 MiB, 12 MiB in
    10 (found by the review of 92fc79d)."""
    b, c = ("b", 1), ("c", 1)
    state = RegionState(
        "r1",
        capacity_bytes=10 * MiB,
        origin_bandwidth=100e6,
        partial={b: 4 * MiB},
        pinned={b: NOW + 5 * MINUTE},
        reserved={b: 1 * MiB},
    )
    job = Job("c-job", "r1", NOW + 30 * MINUTE, NOW + 60 * MINUTE, (c,))
    result = plan([job], {"r1": state}, {b: 5 * MiB, c: 8 * MiB}, now=NOW)
    assert result.feasible("c-job"), result.infeasible
    (eviction,) = result.regions["r1"].evictions
    (task,) = result.regions["r1"].tasks
    assert eviction.version == b and eviction.bytes == 4 * MiB
    assert eviction.at <= task.start and eviction.at >= NOW + 5 * MINUTE  # after its pin
