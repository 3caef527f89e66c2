"""Property test: the region-level planner (``plan`` via ``make_plan``) carried out on a model.

Small random multi-region sites (2-3 regions of one node each, so the per-node share check of
``make_plan`` is out of the way and the region planner is what is tested; capacities, origin
links, peer links with their speeds, egress prices; versions of a few shards in a real
``file://`` registry, held whole or in part and pinned in some regions, by this schedule or
another; 1-6 jobs reading 1-2 versions, some running already, some reading a version that does
not exist) are planned by ``make_plan`` exactly as ``edgecache plan``/``warm``/the controller do
(node reports given). The plan is then carried out on a model: per region, what is held from
now (held whole, held in part, room kept for another schedule's pinned version until its pin
runs out), each task's bytes held from its start, each eviction freeing its version at its
time. Checked (docs/operations.md "The planner"):

* (a) no region ever holds more than its capacity;
* (b) no eviction takes a version a job reads then, one another schedule pins then, or one the
  region does not hold then;
* (c) a task copying from a peer region starts when the peer holds the whole version and the
  peer keeps it until the copy ends;
* (d) every job's every version is there from its start (now, for a running job) to its end, or
  the job is reported, with a reason that names the real cause and whose advice, followed,
  works; a task takes its bytes over its link's speed; tasks over one link run one at a time;
* (e) the bytes over each link and the egress cost are what the tasks move;
* (f) the plan is deterministic, whatever the schedule's job order;
* (g) a peer that makes the deadline wins over origin; else the earliest finish wins.

Defects this test found (each check is tagged with the defect that breaks it; each shrunk
example at the bottom failed on the code before its fix, checked for its own tag alone):
  DEFECT-1 (tag D-add-advice): "add at least B to R" leaves out the room another schedule's
    pin keeps once an earlier task of the job waited for that pin's end: _Lacks shares the
    planner's ``reserved`` dict, which the planning loop empties as it goes.
  DEFECT-2 (tag D-link-advice): "make the link at least X" is rounded to the nearest 3
    significant figures (often down): followed, the version is late again, same advice.
  DEFECT-3 (tag G-earliest): a running job's version is never copied from a peer that holds
    it (a span starting now is "after" the job's start): slow origin, egress paid.
  DEFECT-4 (tag D-start-advice-room): "or start J at T or later" ignores jobs that read what
    is in the way after J's own end: moved to T, J is blocked by them, with a new T.
  DEFECT-8 (tag D-start-advice-room): beyond DEFECT-4, the start advised, followed, still
    found the region short: in the window the job moves to, another job reads a version
    nothing read in its own window (the start only waited for what was in the way there).
  DEFECT-6 (tag D-add-advice): beyond DEFECT-1, on some sites "add at least B to R",
    followed, still left the job short of room (e.g. us of 5.9 MiB, origin 4 kB/s, a peer
    eu at 1 GB/s; us holds v57 of 4.1 MiB pinned by another schedule until 12:30; j0 reads
    v4 of 1.1 MiB 12:30-13:00: "add at least 1.2 MiB to us", then short again). Two causes
    found: this test's own (B was added to the site's capacity, but a node that holds more
    than its capacity reports what it holds as its capacity, and the advice counts from
    that), and DEFECT-9.
  DEFECT-9 (tag D-add-advice): of two plans with as many rows, the one with less origin
    egress was kept, although in it a running job found no room at all (its region kept a
    version another region was copying from it) where the other staged the job's version a
    moment later: rows the job gets late and rows it never gets counted alike.
  DEFECT-7 (tag D-link-advice): beyond DEFECT-2, "make the link at least X" for a peer's
    link, followed, could leave the version late from origin instead (the faster peer link
    did not hold it in time). Not seen again in 2,000 random sites with its check alone,
    nor in the hunts with every check since (stop 55); its check runs on every site again.
  DEFECT-10 (tag D-start-advice-room): a version in use and pinned by another schedule
    was counted as freed twice, at the end of its use and again when its pin ran out: the
    start advised came at the first, while it was still pinned.
  DEFECT-11 (tag D-start-advice-room): the start advised was the end of what is in the way
    plus the lead, but room is free the instant after a job ends: where that came to a whole
    minute, the start advised (rounded up to it) left the room a microsecond short.
  DEFECT-12 (tag D-start-advice-room): the start advised counted on the transfer the plan
    had chosen for the original start, a copy from a peer region planned after this one,
    whose own plan then evicts the version: moved there, the job's version came from origin,
    slower, and the start was too early.
  DEFECT-13 (tag D-start-advice-room): a job that origin's copy would meet was "not enough
    capacity": a slow peer's copy in time was chosen first, and it needed room sooner than
    the region had any; the other sources in time are now tried for room before that.
  DEFECT-14 (tag D-start-advice-room): the start advised gave the job's versions the
    longest one's transfer, but those over one link are staged one after another.
  DEFECT-15 (tag D-start-advice-late): a job whose versions can never fit together (eu
    of 2 MiB; j0 reads v0 of 1.4 MiB and v1 of 2 MiB over a 1 kB/s link) had a row "v1 …
    add at least 1.5 MiB" and one "v0 late …; start j0 at 13:01": moved there, v0 found no
    room instead (the start only cured its lateness). Found on a random site at stop 55;
    since stop 56 a late row of a job that does not fit advises no start, only the link
    (tests/test_planner.py: test_a_late_version_of_a_job_that_does_not_fit_is_advised_no_start).
  DEFECT-16 (tag D-start-advice-room), NOT FIXED: beyond DEFECT-8, a start advised after
    another schedule's pin runs out (v29 until 14:00: "start j0 at 14:06") lands on a
    lower-priority job that starts just before it (j1 at 14:00, reading j0's v12 and v50,
    whose room another schedule's pin keeps): j1 is planned first there and stages v50,
    and j0 is short 750 KiB, advised 20:06. Found on a random three-region site at stop 55
    (eu of 7.5 MiB, 1 GB/s origin); not understood yet; the derandomized sites do not meet it.
  DEFECT-17 (tag D-start-advice-room, D-add-advice): a version held in part, unpinned, was
    counted held at an advised start and in the bytes to add; a job planned before, no longer
    reading beside the moved one, evicted the part for its own room, and the moved job needed
    the whole version (advised 12:36 for 100 KiB of 925, then 12:39; "add at least -99.0
    KiB"). Found by a random hunt at stop 56; fixed there: a part counts held only while a
    foreign pin keeps it.
  DEFECT-18 (tag D-met-reported): a version late for a job (from origin at 1 kB/s it came at
    the job's end, so the job was left out) was then staged for a later job and that task
    copied from a peer region's planned copy instead, there hours before the first job: the
    first still had its late row and was not among the task's jobs. Found by a random hunt
    at stop 56; fixed there: a re-sourced task takes such rows back, as a region's plan does.
  DEFECT-19 (tag D-start-advice-room): DEFECT-17 for a version held whole: the advised
    start counted the job's held version as there; moved, a job before it (no longer reading
    beside it) evicted it for its room, and staged again over the same slow link it made the
    job's other version late (15:49 advised, then 15:50). Found by a random hunt at stop 56;
    fixed there: at an advised start, the job's held versions count as held only while a
    foreign pin keeps them (else their transfer is in the lead).
  DEFECT-20 (tag D-start-advice-room): the advised start was checked as computed (12:58:40,
    its window clear of a job reading what is in the way from 13:30) but printed rounded up
    to the minute (13:00), where the moved job ends at 13:30 and meets that job. Found by a
    random hunt at stop 56; fixed there: the start is rounded up before it is checked.
  DEFECT-21 (tag D-cut): Belady's victims were taken until enough was freed, and one picked
    first that the later picks made unneeded was evicted too: 101 KiB short, v0 (100 KiB,
    needed furthest ahead) and v1 (101 KiB) went, and v0 was staged again at once into the
    room it left (an eviction and a copy of the same version at the same instant). Found by
    a random hunt at stop 56 (fails on stop 55's code too); fixed there: no victim beyond
    what the room needs.
  DEFECT-22 (tag D-link-advice), NOT FIXED: "make the link at least 10.9 kbit/s" for a
    version 4,864 s late at 8 kbit/s; at 10.9 kbit/s the plan changed and the version began
    staging later, 605 s before the start, still late ("64.4 kbit/s"). Found by the last
    random hunt of stop 56 (not shrunk); fails on stop 55's code too.
  DEFECT-5 (tag D-met-reported): a job is reported "not enough capacity" although the plan
    stages its version (for a later job) before its start and keeps it through its end.
Checks that held over thousands of sites: A, A-reserved, B-*, C-lender, D-time, D-link-busy,
D-cut, D-unreported, D-missing, D-too-big, D-late-*, E-bytes, E-cost, F-same, F-order,
G-peer-wins, P-pin. PROPERTY_EXAMPLES=3000 hunts longer; PROPERTY_SKIP=A,C skips checks by tag;
PROPERTY_SHRINK=1 shrinks; PROPERTY_STATS=1 prints what the sites exercised.
"""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import (
    TaggedChecks,
    in_scratch,
    property_settings,
    scheduled_jobs,
    write_manifests,
)
from hypothesis import given
from hypothesis import strategies as st

from edgecache.cache.planner import Plan
from edgecache.clients.ops import NodeReport
from edgecache.clients.ops.planning import make_plan
from edgecache.clients.topology import RegionConfig, Schedule, ScheduledJob, Topology
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

KIB = 1024
NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
HALF = timedelta(minutes=30)
FAST = 1_000_000_000  # bytes/s: MiBs in milliseconds
MID = 4000  # bytes/s: about 4.4 minutes a MiB
SLOW = 1000  # bytes/s: about 17 minutes a MiB
RATES = {FAST: "1GB/s", MID: "4kB/s", SLOW: "1kB/s"}
EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "100"))
# Tags whose checks are skipped on random sites (PROPERTY_SKIP overrides; "" checks all); the
# examples check their own tags. None: the derandomized sites CI runs pass every check. A hunt
# (PROPERTY_RANDOM=1) may meet DEFECT-16, still open: it shares its tag with the fixed
# start-advice defects.
OPEN = ""
CHECKS = TaggedChecks(OPEN)
expect = CHECKS.expect
STATS: dict | None = (
    __import__("collections").Counter() if os.environ.get("PROPERTY_STATS") else None
)
EPS = timedelta(microseconds=3)
NEVER = datetime.max.replace(tzinfo=UTC)
MISSING = "nope"  # a dataset no one published


# ---------------------------------------------------------------- generation

REGIONS = ["eu", "us", "ap"]


@st.composite
def sites(draw: st.DrawFn) -> dict:
    regions = REGIONS[: draw(st.integers(2, 3))]
    origin = {r: draw(st.sampled_from([FAST, FAST, MID, SLOW])) for r in regions}
    peers = {
        r: {
            p: draw(st.sampled_from([FAST, MID, SLOW]))
            for p in regions
            if p != r and draw(st.integers(0, 2))
        }
        for r in regions
    }
    price = {r: draw(st.sampled_from([0.0, 0.02, 0.09])) for r in regions}
    names = draw(st.lists(st.integers(0, 60), min_size=1, max_size=5, unique=True))
    versions = {
        f"v{n}": draw(st.lists(st.integers(100, 3000), min_size=1, max_size=4)) for n in names
    }  # shard sizes in KiB (source)
    ratio = draw(st.sampled_from([1, 1, 2]))  # stored/source of what nodes hold
    # Capacities: a fixed range, or a share of all versions together (room is tight: evictions)
    total = sum(sum(v) for v in versions.values()) * KIB
    caps = {
        r: draw(
            st.one_of(
                st.integers(2, 20).map(lambda n: n * 512 * KIB),
                st.integers(3, 10).map(lambda n: total * n // 10),
            )
        )
        for r in regions
    }
    specs = sorted(versions)
    jobs = []
    for j in range(draw(st.integers(1, 7))):
        pool = specs + ([MISSING] if draw(st.integers(0, 9)) == 0 else [])
        jobs.append(
            dict(
                name=f"j{j}",
                region=draw(st.sampled_from([regions[0], *regions])),
                start=draw(st.integers(-1, 16)),  # half hours from NOW; -1: running
                duration=draw(st.integers(1, 10)),
                datasets=draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True)),
                priority=draw(st.sampled_from(["normal", "normal", "high", "low"])),
            )
        )
    held = []  # (region, dataset, shards held (None: all), pin: None | half hours | "own")
    for r in regions:
        for spec in draw(st.lists(st.sampled_from(specs), max_size=4, unique=True)):
            count = draw(st.sampled_from([None, None, None, 0, 1]))
            pin = draw(st.sampled_from([None, None, "own", 1, 4, 8, 16]))
            if count == 0 and pin is None:
                continue
            held.append((r, spec, count, pin))
    shuffle = draw(st.randoms(use_true_random=False))
    return dict(
        regions=regions, caps=caps, origin=origin, peers=peers, price=price, versions=versions,
        ratio=ratio, jobs=jobs, held=held, shuffle=shuffle,
    )  # fmt: skip


@dataclass
class Site:
    topology: Topology
    schedule: Schedule
    reports: list[NodeReport]
    manifests: dict[str, pb.Manifest]  # dataset -> manifest (version 1)
    spec: dict


def _rate(value: float) -> str | float:
    return RATES.get(value, value)


def build(spec: dict, root: Path, *, order: list[int] | None = None) -> Site:
    registry = root / "registry"
    manifests = write_manifests(registry, spec["versions"], NOW - timedelta(days=1))
    address = {r: f"127.0.0.1:{18000 + i}" for i, r in enumerate(spec["regions"])}
    topology = Topology(
        registry=f"file://{registry}",
        regions={
            r: RegionConfig(
                nodes=[address[r]],
                origin_bandwidth=_rate(spec["origin"][r]),
                peers={p: _rate(b) for p, b in spec["peers"][r].items()},
                egress_price_per_gb=spec["price"][r],
            )
            for r in spec["regions"]
        },
    )
    jobs = scheduled_jobs(spec["jobs"], NOW, HALF)
    statuses = {
        r: edge_pb2.NodeStatus(region=r, node_id=f"{r}-0", capacity_bytes=spec["caps"][r])
        for r in spec["regions"]
    }
    for r, name, count, pin in spec["held"]:
        m = manifests[name]
        n = len(m.shards) if count is None else min(count, len(m.shards))
        if pin == "own":
            ends = [j.end for j in jobs if j.region == r and f"{name}@1" in j.datasets]
            if not ends:
                continue
            until = max(ends)
        else:
            until = None if pin is None else NOW + pin * HALF
        v = statuses[r].versions.add(
            dataset=name, version=1, shard_count=n, total_shards=len(m.shards),
            stored_bytes=sum(s.source_size for s in m.shards[:n]) * spec["ratio"],
            digest=m.digest,
        )  # fmt: skip
        statuses[r].used_bytes += v.stored_bytes
        if until is not None:
            v.pinned_until.FromDatetime(until.astimezone(UTC).replace(tzinfo=None))
    for status in statuses.values():  # a node holds no more than its capacity
        status.capacity_bytes = max(status.capacity_bytes, status.used_bytes)
    reports = [
        NodeReport(r, address[r], True, rtt_ms=1.0, status=statuses[r]) for r in spec["regions"]
    ]
    if order is not None:
        jobs = [jobs[i] for i in order]
    return Site(topology, Schedule(jobs=jobs), reports, manifests, spec)


def planned(site: Site) -> Plan:
    result, _ = make_plan(site.topology, site.schedule, now=NOW, reports=site.reports)
    return result


# ---------------------------------------------------------------- the model


@dataclass
class Region:
    """What the model knows of one region now, from the site (not from the planner)."""

    name: str
    capacity: int
    whole: dict[tuple, int]  # version -> bytes held whole now
    part: dict[tuple, int]  # version -> stored bytes held of a version held in part
    pins: dict[tuple, datetime]  # node pins (any schedule's), not run out
    foreign: dict[tuple, datetime]  # of those, another schedule's
    reserved: dict[tuple, int]  # another schedule's pinned version not held whole: room kept
    origin: float
    peers: dict[str, float]
    price: float


def sizes_of(site: Site) -> dict[tuple, tuple[int, int]]:
    """Version -> (stored, source): stored as a region holds it whole, else estimated."""
    source = {(n, 1): sum(s.source_size for s in m.shards) for n, m in site.manifests.items()}
    whole = {}
    for rep in site.reports:
        for v in rep.status.versions:
            if v.shard_count and v.shard_count == v.total_shards:
                key = (v.dataset, v.version)
                whole[key] = max(whole.get(key, 0), v.stored_bytes)
    ratio = site.spec["ratio"] if whole else 1
    return {k: (whole.get(k) or max(int(src * ratio), 1), src) for k, src in source.items()}


def regions_of(site: Site) -> dict[str, Region]:
    sizes = sizes_of(site)
    out = {}
    for rep in site.reports:
        r = rep.region
        own: dict[tuple, datetime] = {}
        for j in site.schedule.jobs:
            if j.region == r and j.end > NOW:
                for d in j.datasets:
                    key = (d.split("@")[0], 1)
                    own[key] = max(own.get(key, j.end), j.end)
        whole, part, pins, foreign = {}, {}, {}, {}
        for v in rep.status.versions:
            key = (v.dataset, v.version)
            if v.shard_count == v.total_shards:
                whole[key] = v.stored_bytes
            elif v.shard_count:
                part[key] = v.stored_bytes
            if v.HasField("pinned_until"):
                until = v.pinned_until.ToDatetime(tzinfo=UTC)
                if until > NOW:
                    pins[key] = until
                    if key not in own or until > own[key] + timedelta(seconds=1):
                        foreign[key] = until
        reserved = {
            k: sizes[k][0] - part.get(k, 0)
            for k in foreign
            if k not in whole and k not in own and sizes[k][0] - part.get(k, 0) > 0
        }
        cfg = site.topology.regions[r]
        out[r] = Region(
            r, rep.status.capacity_bytes, whole, part, pins, foreign, reserved,
            cfg.origin_bandwidth, dict(cfg.peers), cfg.egress_price_per_gb,
        )  # fmt: skip
    return out


def spans(region: Region, result: Plan, version: tuple) -> list[tuple[datetime, datetime]]:
    """When the region holds the whole version, the plan carried out: [(from, until)]."""
    rp = result.regions.get(region.name)
    tasks = [t for t in rp.tasks if t.version == version] if rp else []
    gone = sorted(e.at for e in rp.evictions if e.version == version) if rp else []

    def until(after: datetime) -> datetime:
        later = [g for g in gone if g >= after]
        return later[0] if later else NEVER

    out = [(NOW, until(NOW))] if version in region.whole else []
    out += [(t.finish, until(t.start)) for t in tasks]  # gone mid-stage: until < from
    return sorted(out)


def held_at(region: Region, result: Plan, version: tuple, at: datetime) -> bool:
    """Whether the region holds any of ``version`` just before ``at`` (whole, part, staging)."""
    rp = result.regions.get(region.name)
    since = [NOW] if version in region.whole or version in region.part else []
    since += [t.start for t in rp.tasks if t.version == version and t.start < at] if rp else []
    since = [s for s in since if s <= at]
    if not since:
        return False
    last = max(since)
    gone = [e.at for e in rp.evictions if e.version == version and last <= e.at < at] if rp else []
    return not gone


def part_left(region: Region, result: Plan, task) -> int:  # noqa: ANN001
    """What the region holds of a version held in part when its first task starts."""
    rp = result.regions[region.name]
    if any(e.version == task.version and e.at <= task.start for e in rp.evictions):
        return 0
    return region.part.get(task.version, 0)


def holds_through(s: list[tuple[datetime, datetime]], lo: datetime, hi: datetime) -> bool:
    """Whether one span holds the version at ``lo`` and past ``hi`` (``hi`` included)."""
    return any(a <= lo and b > hi for a, b in s)


def used_over_time(region: Region, result: Plan) -> list[tuple[datetime, int, int, str]]:
    """After each moment something changes, the plan carried out: (when, bytes the node
    stores, those and the room kept for another schedule's pinned versions, what changed)."""
    rp = result.regions.get(region.name)
    amount = {**region.part, **region.whole}
    events = []  # (when, 0 frees first | 1 adds, kind, version, bytes)
    for v, b in region.reserved.items():
        events.append((region.foreign[v], 0, "pin-ends", v, b))
    if rp:
        events += [(e.at, 0, "evict", e.version, e.bytes) for e in rp.evictions]
        events += [(t.start, 1, "task", t.version, t.bytes) for t in rp.tasks]
    kept = dict(region.reserved)
    out = [(NOW, sum(amount.values()), sum(amount.values()) + sum(kept.values()), "now")]
    for when, _, kind, v, b in sorted(events, key=lambda e: e[:2]):
        if kind == "pin-ends":
            kept.pop(v, 0)
        elif kind == "evict":
            amount.pop(v, 0)
            kept.pop(v, 0)
        else:
            amount[v] = b
        stored = sum(amount.values())
        out.append((when, stored, stored + sum(kept.values()), f"{kind} {v[0]}"))
    return out


def normal(result: Plan) -> tuple:
    return (
        {r: ([(t.spec, t.start, t.finish, t.source, t.bytes, t.jobs) for t in p.tasks],
             [(e.version, e.at, e.bytes) for e in p.evictions], sorted(p.pins.items()))
         for r, p in result.regions.items()},
        sorted((i.job, i.region, i.version, i.reason) for i in result.infeasible),
        sorted(result.transfers.items()),
        sorted((j, round(c, 9)) for j, c in result.cost.items()),
    )  # fmt: skip


def _bare(n: tuple) -> tuple:
    """Without the jobs a task lists first (which job's transfer a shared task counts)."""
    return (
        {r: ([t[:5] for t in tasks], ev, pins) for r, (tasks, ev, pins) in n[0].items()},
        n[1],
    )


UNITS = {"B": 1, "KiB": KIB, "MiB": KIB**2, "GiB": KIB**3, "KB": 1000, "MB": 10**6}
ADD = re.compile(r"add at least (-?[\d.]+) (B|KiB|MiB|GiB) to (\w+)")
START = re.compile(r"start (\w+) at (\d{4}-\d\d-\d\d \d\d:\d\d) or later")
LINK = re.compile(r"make the link at least ([\d.]+ \w+/s) \((origin_bandwidth|peers\.(\w+))")
LATE = re.compile(r"^needs [\d,]+ s at .* from (\S+), only [\d,]+ s before the start")


# ---------------------------------------------------------------- the property


@property_settings(EXAMPLES)
@given(spec=sites())
def test_plan_holds_when_carried_out(spec: dict) -> None:
    in_scratch("plan-", lambda root: check(spec, root))


def check(spec: dict, root: Path, *, advice: bool = True) -> None:
    site = build(spec, root)
    for rep in site.reports:  # held data larger than the node: not a state a node reports
        if rep.status.used_bytes > rep.status.capacity_bytes:
            return
    result = planned(site)
    model = regions_of(site)
    sizes = sizes_of(site)
    rows = {(i.job, i.version): i for i in result.infeasible}
    current = [j for j in site.schedule.jobs if j.end > NOW]

    # (f) deterministic, whatever the order of the schedule's jobs
    expect(normal(planned(site)) == normal(result), "F-same")
    order = list(range(len(site.schedule.jobs)))
    spec["shuffle"].shuffle(order)
    shuffled = normal(planned(build(spec, root, order=order)))
    expect(_bare(shuffled) == _bare(normal(result)), "F-order", order, shuffled, normal(result))

    for name, region in model.items():
        rp = result.regions.get(name)
        tasks = rp.tasks if rp else []
        evictions = rp.evictions if rp else []
        # (a) capacity never exceeded
        for when, stored, kept, what in used_over_time(region, result):
            expect(stored <= region.capacity, "A", name, when, what, stored, region.capacity,
                   normal(result))  # fmt: skip
            # the room another schedule's pin keeps is not staged into
            if what.startswith("task"):
                expect(kept <= region.capacity, "A-reserved", name, when, what, kept,
                       region.capacity, normal(result))  # fmt: skip

        # (b) evictions: not read then, not another schedule's pin then, held then
        for e in evictions:
            readers = [
                j.name
                for j in current
                if j.region == name
                and f"{e.version[0]}@1" in j.datasets
                and j.start <= e.at <= j.end
                and (j.name, f"{e.version[0]}@1") not in rows
            ]
            expect(not readers, "B-read", e, readers, normal(result))
            # its "next needed at": the first start after it of a job here that reads it
            later = [
                j.start
                for j in current
                if j.region == name and f"{e.version[0]}@1" in j.datasets and j.start > e.at
            ]
            expect(e.next_use == min(later, default=None), "B-next-use", e, later)
            pin = region.foreign.get(e.version)
            expect(pin is None or pin <= e.at, "B-pin", e, pin, normal(result))
            expect(held_at(region, result, e.version, e.at), "B-unheld", e, normal(result))

        # (d) a task's time is its bytes over its link; one task at a time per link
        seen: set[tuple] = set()
        links: dict[str, list] = {}
        for t in tasks:
            stored, source = sizes[t.version]
            held = min(part_left(region, result, t), stored) if t.version not in seen else 0
            seen.add(t.version)
            if t.source == "origin":
                moved, bw = source - source * held // max(stored, 1), region.origin
            else:
                moved, bw = stored - held, region.peers.get(t.source, 0)
                expect(bw > 0, "D-link", t, region.peers)
            expect(t.bytes == stored, "D-bytes", t, stored)
            if bw:
                took = timedelta(seconds=moved / bw)
                expect(abs((t.finish - t.start) - took) <= EPS, "D-time", t, took)
            expect(t.start >= NOW, "D-past", t)
            links.setdefault(t.source, []).append((t.start, t.finish, t.spec))
            # a task is evicted before it finishes
            cut = [e for e in evictions if e.version == t.version and t.start <= e.at < t.finish]
            expect(not cut, "D-cut", t, cut)
        for source, copies in links.items():
            copies.sort()
            for (_, f0, a), (s1, _, b) in zip(copies, copies[1:], strict=False):
                expect(s1 >= f0, "D-link-busy", name, source, a, b, copies)

        # (c) a copy from a peer: the peer holds it whole from its start to its end
        for t in tasks:
            if t.source == "origin":
                continue
            lender = model[t.source]
            s = spans(lender, result, t.version)
            expect(holds_through(s, t.start, t.finish - EPS), "C-lender", t, s, normal(result))

        # (g) a peer that makes the deadline wins; else the earliest finish
        for t in tasks:
            stored, source = sizes[t.version]
            for peer, bw in region.peers.items():
                if peer == t.source or not bw:
                    continue
                copy = timedelta(seconds=stored / bw)  # (a partly held one moves less)
                lender = model[peer]
                if t.version not in lender.whole:
                    continue
                s = spans(lender, result, t.version)
                busy = [(a, b) for a, b, _ in links.get(peer, [])]
                idle = all(b <= t.start or a >= t.start + copy for a, b in busy)
                margin = max(copy / 4, timedelta(minutes=5))
                kept = holds_through(s, NOW, max(t.start, t.deadline) + copy + margin)
                if not (idle and kept):
                    continue
                # Where room is made for it (waited for, or evicted then), a copy must leave
                # the planner's margin before the job too (its room is looked for until the
                # start less transfer and margin): else origin's copy, with room, is right.
                made = t.start > NOW or any(e.at == t.start for e in rp.evictions)
                slack = margin if made else timedelta(0)
                if t.source == "origin" and t.finish <= t.deadline:
                    expect(
                        t.start + copy + slack > t.deadline, "G-peer-wins", t, peer, normal(result)
                    )
                if t.finish > t.deadline:
                    expect(t.start + copy >= t.finish - EPS, "G-earliest", t, peer, copy)

        # pins: every version a job here reads, to the last such job's end, but unstaged ones
        if rp:
            for j in current:
                if j.region != name:
                    continue
                for d in j.datasets:
                    v = (d.split("@")[0], 1)
                    if v not in sizes:
                        continue
                    staged = any(t.version == v for t in tasks) or v in region.whole
                    staged = staged or v in region.part
                    if staged:
                        expect(rp.pins.get(v, NOW) >= j.end, "P-pin", j.name, v, rp.pins)
                    elif (j.name, d) in rows:
                        expect(v not in rp.pins, "P-unstaged-pin", j.name, v, rp.pins)

    # Every row says why, worked out for the plan kept (not the orders it weighed).
    for row in rows.values():
        expect(row.explain is None and row.reason, "D-reason", row)

    # (d) every version of every job is there through the job, or reported
    for j in current:
        region = model.get(j.region)
        for d in j.datasets:
            v = (d.split("@")[0], 1)
            row = rows.get((j.name, d))
            if v not in sizes:
                expect(row is not None and MISSING in row.reason, "D-missing", j, row)
                continue
            s = spans(region, result, v)
            there = holds_through(s, max(j.start, NOW), j.end)
            if row is None:
                expect(there, "D-unreported", j.name, d, s, normal(result))
                continue
            expect(not there or j.start <= NOW, "D-met-reported", j.name, row.reason, s)
            classify(site, spec, root, result, region, j, d, v, row, sizes, advice)

    if STATS is not None:
        for rp in result.regions.values():
            STATS["tasks"] += len(rp.tasks)
            STATS["peer tasks"] += sum(t.source != "origin" for t in rp.tasks)
            STATS["evictions"] += len(rp.evictions)
            STATS["needed-later evictions"] += sum(e.next_use is not None for e in rp.evictions)
            for t in rp.tasks:
                if t.source != "origin" and any(
                    e.version == t.version for e in result.regions[t.source].evictions
                ):
                    STATS["lender evicts"] += 1
        STATS["rows"] += len(result.infeasible)
        STATS["sites"] += 1

    # (e) bytes over each link and the egress cost
    moved_by: dict[tuple[str, str], int] = {}
    for name, rp in result.regions.items():
        region = model[name]
        seen = set()
        for t in rp.tasks:
            stored, source = sizes[t.version]
            held = min(part_left(region, result, t), stored) if t.version not in seen else 0
            seen.add(t.version)
            moved = source - source * held // stored if t.source == "origin" else stored - held
            key = (t.jobs[0], f"{t.source}→{name}")
            moved_by[key] = moved_by.get(key, 0) + moved
    expect(result.transfers == moved_by, "E-bytes", result.transfers, moved_by)
    for j in current:
        price = model[j.region].price if j.region in model else 0
        egress = result.transfers.get((j.name, f"origin→{j.region}"), 0)
        want = egress / 1e9 * price
        got = result.cost.get(j.name, 0.0)
        expect(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), "E-cost", j.name, got, want)


def classify(
    site: Site, spec: dict, root: Path, result: Plan, region: Region, job: ScheduledJob,
    d: str, v: tuple, row, sizes: dict, advice: bool,  # noqa: ANN001
) -> None:  # fmt: skip
    """A row names the real cause, and its advice, followed, works."""
    reason = row.reason
    stored = sizes[v][0]
    if "larger than the region's capacity" in reason:
        expect(stored > region.capacity, "D-too-big", row, stored, region.capacity)
    if reason.startswith("not enough capacity"):
        everything = (
            sum(region.whole.values()) + sum(region.part.values()) + sum(region.reserved.values())
        )
        read = {(x.split("@")[0], 1) for j in site.schedule.jobs if j.region == region.name
                for x in j.datasets}  # fmt: skip
        everything += sum(sizes[k][0] for k in read if k in sizes and k not in region.whole)
        expect(everything > region.capacity, "D-capacity-ghost", row, everything)
    late = LATE.match(reason)
    if late:  # still staged when it arrives before the job ends, from the source it names
        rp = result.regions.get(region.name)
        mine = [t for t in rp.tasks if t.version == v and job.name in t.jobs] if rp else []
        arrives = START.search(reason)
        after = arrives and datetime.strptime(arrives.group(2), "%Y-%m-%d %H:%M").replace(
            tzinfo=UTC
        ) >= job.end - timedelta(minutes=1)
        expect(mine or after, "D-late-unstaged", row, normal(result))
        expect(all(t.source == late.group(1) for t in mine), "D-late-source", row, mine)
        expect(all(t.finish > job.start for t in mine), "D-late-not-late", row, mine)
    if not advice:
        return
    m = ADD.search(reason)
    if m and "capacity" in reason:
        more = math.ceil(float(m.group(1)) * UNITS[m.group(2)])
        expect(more > 0, "D-add-advice", reason)
        # Added to the capacity the node has: the site's own, or what it holds where more.
        caps = {**spec["caps"], region.name: region.capacity + more}
        again = _row(spec, root, job.name, d, caps=caps)
        expect(again is None or "capacity" not in again, "D-add-advice", reason, again)
    m = START.search(reason)
    if m and m.group(1) == job.name and job.start > NOW:
        at = datetime.strptime(m.group(2), "%Y-%m-%d %H:%M").replace(tzinfo=UTC)
        halves = (at - NOW) / HALF
        if True:  # a start between the half hours is fine: build takes any multiple
            changed = [{**x, "start": halves} if x["name"] == job.name else x for x in spec["jobs"]]
            alone = [x for x in site.schedule.jobs if x.region == job.region] == [job]
            kind = "D-start-advice-late" if LATE.match(reason) else "D-start-advice-room"
            if alone or kind == "D-start-advice-room":  # moved, a late job may meet others
                again = _row(spec, root, job.name, d, jobs=changed)
                expect(again is None, kind, reason, again)
    m = LINK.search(reason)
    if m and job.start > NOW:
        rate = m.group(1)
        if m.group(2) == "origin_bandwidth":
            again = _row(spec, root, job.name, d, origin={**spec["origin"], region.name: rate})
        else:
            peers = {**spec["peers"], region.name: {**spec["peers"][region.name], m.group(3): rate}}
            again = _row(spec, root, job.name, d, peers=peers)
        expect(again is None or not LATE.match(again), "D-link-advice", reason, again)


def _row(spec: dict, root: Path, job: str, d: str, **changes: object) -> str | None:
    """The reason ``job`` reads ``d`` in the site ``spec`` with ``changes``, or None: met."""
    sub = root / f"again{random.random()}"
    site = build({**spec, **changes}, sub)
    for i in planned(site).infeasible:
        if i.job == job and i.version == d:
            return i.reason
    return None


def test_smoke_two_regions() -> None:
    """One fixed site runs end to end (a guard against the model itself breaking)."""
    spec = dict(
        regions=["eu", "us"], caps={"eu": 8 << 20, "us": 8 << 20},
        origin={"eu": FAST, "us": MID}, peers={"eu": {}, "us": {"eu": FAST}},
        price={"eu": 0.02, "us": 0.09}, versions={"v1": [1000, 1000], "v2": [500]}, ratio=1,
        jobs=[dict(name="j0", region="eu", start=2, duration=4, datasets=["v1"],
                   priority="normal"),
              dict(name="j1", region="us", start=3, duration=4, datasets=["v1", "v2"],
                   priority="normal")],
        held=[("eu", "v1", None, None)], shuffle=random.Random(0),
    )  # fmt: skip
    in_scratch("plan-", lambda root: check(spec, root))


def teardown_module() -> None:
    if STATS is not None:
        print("\nSTATS", dict(STATS))


def _shrunk(versions: dict, jobs: list[dict], held: list = (), **extra: object) -> dict:
    """A site of eu (the one the example is about) and an idle us, both 1 MiB unless said."""
    base = dict(
        regions=["eu", "us"], caps={"eu": 1 << 20, "us": 1 << 20},
        origin={"eu": FAST, "us": FAST}, peers={"eu": {}, "us": {}},
        price={"eu": 0.0, "us": 0.0}, versions=versions, ratio=1,
        jobs=[{"region": "eu", "priority": "normal", **j} for j in jobs],
        held=list(held), shuffle=random.Random(0),
    )  # fmt: skip
    return {**base, **extra}


SHRUNK = {
    # another schedule pins v46 (no data yet) until 12:30; v55 waits for that pin to end, and
    # j0's advice then leaves v46's room out: 2.2 MiB added, j0 is short 665 KiB still
    "DEFECT-1 D-add-advice": (
        _shrunk(
            {"v46": [667], "v55": [421], "v53": [2854]},
            [dict(name="j0", start=3, duration=1, datasets=["v55", "v53"])],
            held=[("eu", "v46", 0, 1)],
            origin={"eu": SLOW, "us": FAST},
        ),
        {"D-add-advice"},
    ),
    # 5.4 MB in 1,800 s at 1 kB/s: needs 24.51 kbit/s, advised "24.5 kbit/s"
    "DEFECT-2 D-link-advice": (
        _shrunk(
            {"v50": [2999, 2386]},
            [dict(name="j2", start=1, duration=7, datasets=["v50"])],
            caps={"eu": 8 << 20, "us": 8 << 20},
            origin={"eu": SLOW, "us": FAST},
        ),
        {"D-link-advice"},
    ),
    # us's job runs since 11:30; eu holds v1 whole over a 1 GB/s link; us's origin is 1 kB/s
    "DEFECT-3 G-earliest": (
        {
            **_shrunk({"v1": [1000]}, [], held=[("eu", "v1", None, None)]),
            "origin": {"eu": FAST, "us": SLOW},
            "peers": {"eu": {}, "us": {"eu": FAST}},
            "price": {"eu": 0.0, "us": 0.09},
            "jobs": [
                dict(
                    name="j0", region="us", start=-1, duration=4, datasets=["v1"], priority="normal"
                )
            ],
        },  # fmt: skip
        {"G-earliest"},
    ),
    # v1 or v2 fits, not both; j1 (v2) is told to start after j0 (v1) ends, into j2 (v1)
    "DEFECT-4 D-start-advice-room": (
        _shrunk(
            {"v1": [800], "v2": [800]},
            [
                dict(name="j0", start=1, duration=2, datasets=["v1"]),
                dict(name="j1", start=2, duration=4, datasets=["v2"]),
                dict(name="j2", start=7, duration=2, datasets=["v1"]),
            ],
            held=[("eu", "v1", None, None)],
        ),
        {"D-start-advice-room"},
    ),
    # ap (1 MiB) holds v0 and v3; eu's running j4 copies v3 from ap (its origin link is busy
    # with v0). v1 is 1 KiB larger than ap: "add at least 1.0 KiB to ap". Added, ap's running
    # j0 found no room (ap kept v3 for eu's copy) in the plan kept, which had as many rows
    # (late ones included) as the one that stages v1 a moment later, and less egress
    "DEFECT-9 D-add-advice": (
        {
            **_shrunk(
                {"v0": [100], "v3": [100], "v1": [100, 100, 825]},
                [
                    dict(name="j0", region="ap", start=0, duration=1, datasets=["v1"]),
                    dict(name="j1", start=0, duration=1, datasets=["v0"]),
                    dict(name="j2", region="ap", start=2, duration=1, datasets=["v0"]),
                    dict(name="j4", start=0, duration=1, datasets=["v0", "v3"]),
                ],
                held=[("ap", "v3", None, None), ("ap", "v0", None, None)],
            ),
            "regions": ["eu", "us", "ap"],
            "caps": {"eu": 1 << 20, "us": 1 << 20, "ap": 1 << 20},
            "origin": {"eu": FAST, "us": FAST, "ap": FAST},
            "peers": {"eu": {"ap": FAST}, "us": {}, "ap": {"eu": FAST}},
            "price": {"eu": 0.0, "us": 0.0, "ap": 0.0},
        },
        {"D-add-advice"},
    ),
    # j4 (v2 and v0, 14:30-16:30) fits once j3's v3 is free (20:00): "start j4 at 20:06",
    # where j0 (20:00-20:30) reads v1, which nothing read in j4's own window: short again
    "DEFECT-8 D-start-advice-room": (
        _shrunk(
            {"v3": [100, 172], "v0": [823, 1663], "v2": [869], "v1": [100]},
            [
                dict(name="j0", start=16, duration=1, datasets=["v0", "v1"]),
                dict(name="j1", start=0, duration=1, datasets=["v0", "v3"]),
                dict(name="j3", start=9, duration=7, datasets=["v3"]),
                dict(name="j4", start=5, duration=4, datasets=["v2", "v0"]),
            ],
            caps={"eu": 3439411, "us": 1 << 20},
        ),
        {"D-start-advice-room"},
    ),
    # v0, read by j0 until 12:30, is pinned by another schedule until 14:00: its bytes were
    # counted free at 12:30 and again at 14:00, and the advice said 12:36
    "DEFECT-10 D-start-advice-room": (
        _shrunk(
            {"v0": [100], "v1": [100], "v2": [100, 725]},
            [
                dict(name="j0", start=0, duration=1, datasets=["v0"]),
                dict(name="j2", start=1, duration=1, datasets=["v1", "v2"]),
            ],
            held=[("eu", "v0", None, 4)],
        ),
        {"D-start-advice-room"},
    ),
    # v0 is read until 12:30; v3 takes 25.6 min at 1 kB/s and 6.4 min of margin: room from
    # the instant after 12:30, "start j1 at 13:02" (12:30 + 32 min, to the minute) had none
    "DEFECT-11 D-start-advice-room": (
        _shrunk(
            {"v2": [1500], "v0": [100], "v3": [1500]},
            [
                dict(name="j1", start=1, duration=1, datasets=["v3"]),
                dict(name="j2", start=0, duration=1, datasets=["v0"]),
            ],
            held=[("eu", "v2", None, None)],
            origin={"eu": SLOW, "us": FAST},
        ),
        {"D-start-advice-room"},
    ),
    # us (planned first) would copy v0 from eu in milliseconds, and was told "start j0 at
    # 12:36"; eu's own plan evicts v0 at 12:00 for v1, so v0 comes from origin at 4 kB/s
    "DEFECT-12 D-start-advice-room": (
        {
            **_shrunk(
                {"v0": [100, 135], "v1": [100, 690], "v2": [100]},
                [
                    dict(name="j0", region="us", start=1, duration=1, datasets=["v0"]),
                    dict(name="j1", start=1, duration=1, datasets=["v1"]),
                    dict(name="j2", start=1, duration=1, datasets=["v1"]),
                    dict(name="j3", start=-1, duration=1, datasets=["v0"]),
                    dict(name="j4", region="us", start=0, duration=1, datasets=["v1"]),
                ],
                held=[("eu", "v0", None, None)],
                origin={"eu": FAST, "us": MID},
            ),
            "peers": {"eu": {}, "us": {"eu": FAST}},
        },
        {"D-start-advice-room"},
    ),
    # eu is full until another schedule's pin of v2 runs out at 12:30; j0 moved to 12:36 as
    # advised, us's 1 kB/s copy of v1 (30 min, from 12:00) is "in time" and chosen first,
    # but needs room by 11:58: "not enough capacity", where origin's copy at 12:30 would do
    "DEFECT-13 D-start-advice-room": (
        {
            **_shrunk(
                {"v1": [1758], "v0": [100], "v2": [1758]},
                [
                    dict(name="j0", start=1, duration=1, datasets=["v0", "v1"]),
                    dict(name="j1", start=0, duration=1, datasets=["v0"]),
                ],
                held=[
                    ("eu", "v2", None, 1),
                    ("eu", "v0", None, None),
                    ("us", "v0", None, None),
                    ("us", "v1", None, None),
                ],
            ),
            "peers": {"eu": {"us": SLOW}, "us": {}},
        },
        {"D-start-advice-room"},
    ),
    # j1's v1 (300 s) and v2 (540 s) go over one 4 kB/s link one after the other: "start j1
    # at 12:44" (12:30 + v2's 540 s + margin) left v2 late behind v1
    "DEFECT-14 D-start-advice-room": (
        _shrunk(
            {"v1": [1173], "v2": [2109], "v0": [2110]},
            [
                dict(name="j0", start=0, duration=1, datasets=["v0"]),
                dict(name="j1", start=1, duration=1, datasets=["v1", "v2"]),
            ],
            caps={"eu": 3360768, "us": 1 << 20},
            origin={"eu": MID, "us": FAST},
        ),
        {"D-start-advice-room"},
    ),
    # 825 of v30's 925 KiB held, unpinned; j3 (12:30) is short 1 KiB while v0 is read, and was
    # advised 12:36 for the last 100 KiB; moved there, j4 (12:00) evicts the part for v1 and j3
    # needs all 925 KiB: "add at least -99.0 KiB …, or start j3 at 12:39"
    "DEFECT-17 D-start-advice-room": (
        _shrunk(
            {"v0": [100], "v30": [825, 100], "v1": [100]},
            [
                *(dict(name=f"j{i}", start=0, duration=1, datasets=["v0"]) for i in range(3)),
                dict(name="j3", start=1, duration=1, datasets=["v30"]),
                dict(name="j4", start=0, duration=1, datasets=["v0", "v1"]),
            ],
            held=[("eu", "v30", 1, None)],
            origin={"eu": MID, "us": FAST},
        ),
        {"D-start-advice-room", "D-add-advice"},
    ),
    # ap's origin is 1 kB/s: v0 for j1 (12:30) would come at 13:00, its end, so j1 is left out;
    # j2's (13:30) from origin is then copied from us instead, there at 12:00: j1 is met
    "DEFECT-18 D-met-reported": (
        {
            **_shrunk({"v0": [100, 416, 3000]}, []),
            "regions": ["eu", "us", "ap"],
            "caps": {"eu": 3670016, "us": 3670016, "ap": 3670016},
            "origin": {"eu": FAST, "us": FAST, "ap": SLOW},
            "peers": {"eu": {}, "us": {"eu": FAST}, "ap": {"us": FAST}},
            "price": {"eu": 0.0, "us": 0.0, "ap": 0.0},
            "jobs": [
                {
                    "name": n,
                    "region": r,
                    "start": t,
                    "duration": 1,
                    "datasets": ["v0"],
                    "priority": "normal",
                }
                for n, r, t in [("j0", "us", 1), ("j1", "ap", 1), ("j2", "ap", 3), ("j3", "eu", 0)]
            ],
        },  # fmt: skip
        {"D-met-reported"},
    ),
    # j3 reads v2 (held whole, unpinned) and v4 (no room while j2 reads v0 to 15:30): advised
    # 15:49 for v4 alone; moved there, j2 (12:00) evicts v2 for v1, and v2 and v4 are staged
    # one after another from 15:30 over the 4 kB/s link: v4 late ("start j3 at 15:50")
    "DEFECT-19 D-start-advice-room": (
        _shrunk(
            {
                "v2": [100, 100, 1151],
                "v0": [100, 100, 172, 2631],
                "v1": [172, 128],
                "v3": [100, 100, 100, 100],
                "v4": [100, 100, 100, 2803],
            },
            [
                dict(name="j2", start=0, duration=7, datasets=["v1", "v0"]),
                dict(name="j3", start=1, duration=8, datasets=["v2", "v4"]),
            ],
            held=[("eu", "v0", None, None), ("eu", "v3", 1, None), ("eu", "v2", None, None)],
            caps={"eu": 1572864, "us": 1 << 20},
            origin={"eu": MID, "us": FAST},
        ),  # fmt: skip
        {"D-start-advice-room"},
    ),
    # v0 is read to 12:30 and again from 13:30 (j3); j2 was advised 12:58:40, checked clear of
    # j3, and printed as 13:00: moved there, j2 ends at 13:30, when j3 starts reading v0
    "DEFECT-20 D-start-advice-room": (
        _shrunk(
            {
                "v1": [100, 825],
                "v0": [100],
                "v3": [100, 100],
                "v4": [100, 100, 580, 3000],
                "v2": [435],
            },
            [
                dict(name="j0", start=0, duration=1, datasets=["v0"]),
                dict(name="j1", start=0, duration=1, datasets=["v0"]),
                dict(name="j2", start=1, duration=1, datasets=["v1", "v2"]),
                dict(name="j3", start=3, duration=1, datasets=["v0"]),
            ],
            held=[("us", "v0", None, None)],
            caps={"eu": 2785280, "us": 1 << 20},
            origin={"eu": SLOW, "us": FAST},
            ratio=2,
        ),  # fmt: skip
        {"D-start-advice-room"},
    ),
    # v2 (924 KiB) needs 101 KiB of room at 12:00: v0 (100 KiB, next read at 13:30) then v1
    # (101 KiB, at 13:00) were evicted, and v0 copied back from ap at once into its room
    "DEFECT-21 D-cut": (
        {
            **_shrunk(
                {"v1": [101], "v2": [924], "v0": [100]},
                [
                    dict(name="j0", start=-1, duration=1, datasets=["v0"]),
                    dict(name="j1", start=3, duration=1, datasets=["v0"]),
                    dict(name="j2", start=2, duration=1, datasets=["v1", "v2"]),
                    dict(name="j6", start=0, duration=1, datasets=["v2"]),
                ],
                held=[("eu", "v0", None, None), ("eu", "v1", None, None), ("ap", "v0", None, None)],
            ),
            "regions": ["eu", "us", "ap"],
            "caps": {"eu": 1 << 20, "us": 1 << 20, "ap": 1 << 20},
            "origin": {"eu": FAST, "us": FAST, "ap": FAST},
            "peers": {"eu": {"ap": FAST}, "us": {}, "ap": {}},
            "price": {"eu": 0.0, "us": 0.0, "ap": 0.0},
        },  # fmt: skip
        {"D-cut"},
    ),
    # v2 is staged from 13:00 (v1's job ends) for j2, ready 13:15; j1 at 13:18 is "not met"
    "DEFECT-5 D-met-reported": (
        _shrunk(
            {"v1": [900], "v2": [900]},
            [
                dict(name="j0", start=-1, duration=3, datasets=["v1"]),
                dict(name="j1", start=2.6, duration=2, datasets=["v2"]),
                dict(name="j2", start=5, duration=2, datasets=["v2"]),
            ],
            held=[("eu", "v1", None, None)],
            origin={"eu": SLOW, "us": FAST},
        ),
        {"D-met-reported"},
    ),
}


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_shrunk_example(name: str) -> None:
    spec, tags = SHRUNK[name]
    CHECKS.example(tags, "plan-", lambda root: check(spec, root))
