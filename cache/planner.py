"""The prefetch planner: a schedule of jobs → staging tasks and evictions per region.

Pure and deterministic: the same inputs give the same plan. It knows the
future, so it evicts what is needed furthest ahead or never (Belady), not
what was used least recently, and it never evicts a version that a job
reads between that job's start and end, nor one the region's nodes pin for
jobs outside the plan (``RegionState.pinned``) before that pin runs out. A
version so pinned that is not held yet keeps its room until then too
(``RegionState.reserved``): the schedule that pinned it stages it before its
job, and this plan must not fill that room.

Per region, jobs are taken in order of start time (then priority, then
name). Each version a job reads must be resident by the job's start. A
version not yet resident becomes a staging task on the region's origin link
(or from a peer region that will hold it in time: no origin egress, so a peer
wins whenever it makes the deadline; when nothing does, the earliest finish
wins; a region planned earlier sees what one planned later will stage once
every region is planned, and copies from it where that is in time:
:func:`_copy_from_later_regions`); tasks on
one link run one after another in deadline order (earliest deadline first,
which meets every deadline that any order could). Room is made by evicting
versions whose next use is furthest away, among those no job needs between
the task's start and the job's end, at the first time there is room (a job
ending or a foreign pin running out may make it): the controller re-plans
every round and acts then, so the plan shows then. What cannot be met is
reported with the reason: the version does not exist, the region is too
small even after evicting everything not needed sooner, or the link is too
slow before the start time. Capacity advice is what a job as a whole lacks,
counted so that adding it is enough whatever the jobs before it then do with
the room (:class:`_Lacks`).

Sizes come in two kinds (:class:`VersionSize`): the bytes a version takes in
a cache once stored (Arrow, compressed), which fill capacity and cross a peer
link (a peer sends stored chunks), and its source bytes, which cross the
origin link. Preprocessing changes the size (Parquet decodes to more Arrow;
JSON text compresses to much less), so capacity arithmetic on source bytes
is wrong by that factor. The caller gives the stored size where a cache
holds a copy and an estimate otherwise.

Besides tasks and evictions, the plan says what to pin: every version a job
in a region reads, until the last such job ends, resident ones included, so
a node's own LRU never evicts what the plan counted on keeping. Only the
plan's evictions (carried out explicitly) remove pinned versions.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import NamedTuple

from edgecache.cache.units import format_bytes, format_bytes_at_least

__all__ = [
    "VersionSize",
    "Eviction",
    "Infeasible",
    "Job",
    "Plan",
    "RegionPlan",
    "RegionState",
    "StageTask",
    "plan",
]

PRIORITIES = {"low": 0, "normal": 1, "high": 2}
VersionKey = tuple[str, int]
# A resident version as room: (version, bytes, from when it may go (None: at any time),
# when a job next reads it (None: no later job does)).
_Freed = tuple[VersionKey, int, datetime | None, datetime | None]


@dataclass(frozen=True, slots=True)
class VersionSize:
    """How big a version is in a cache (``stored``) and at its origin (``source``)."""

    stored: int
    source: int


@dataclass(frozen=True, slots=True)
class Job:
    """One scheduled job: reads ``versions`` in ``region`` from ``start`` to ``end``."""

    name: str
    region: str
    start: datetime
    end: datetime
    versions: tuple[VersionKey, ...]
    priority: str = "normal"


@dataclass(frozen=True, slots=True)
class RegionState:
    """What the planner knows of a region now."""

    name: str
    capacity_bytes: int
    origin_bandwidth: float  # bytes/s
    resident: Mapping[VersionKey, int] = field(default_factory=dict)  # version → bytes held
    # Versions only partly held (a stage cut short): their bytes fill the cache too, and
    # staging them again fetches only the rest.
    partial: Mapping[VersionKey, int] = field(default_factory=dict)
    peer_bandwidth: Mapping[str, float] = field(default_factory=dict)  # region → bytes/s
    egress_price_per_gb: float = 0.0  # origin → region
    # Source bytes/s the region's nodes turn into cached chunks (fetch + preprocess),
    # measured; staging from origin goes no faster than this or the link.
    staging_rate: float | None = None
    # Why nothing can be planned here now (no node answered, so neither capacity nor
    # holdings are known); "" when the region is up. Its jobs are reported with this.
    unreachable: str = ""
    # version → until when the region's nodes pin it for jobs this plan does not know
    # (another schedule's): no eviction before then, whatever this plan would gain by it.
    pinned: Mapping[VersionKey, datetime] = field(default_factory=dict)
    # Of those, versions not held whole: version → the stored bytes they still lack. The
    # schedule that pinned them stages them before its job (a stage deferred for room, or
    # not begun yet); this plan keeps that room free until the pin runs out. Counting only
    # what is held let a second tool stage into it, and the first schedule's job could
    # not be met.
    reserved: Mapping[VersionKey, int] = field(default_factory=dict)
    # Of ``pinned``, versions the plan itself keeps here until then, for a copy another
    # region makes from what this one holds now (:func:`plan`): not another schedule's pin,
    # and said so where they leave a job without room.
    lent: Mapping[VersionKey, datetime] = field(default_factory=dict)
    # version → (the earliest its staging here may begin, why): the region's capacity is
    # one pool here, but each node keeps its own share of a version, and a node's share
    # may fit beside what that node keeps only once a pin there runs out
    # (edgecache.clients.ops.planning decides it, node by node).
    not_before: Mapping[VersionKey, tuple[datetime, str]] = field(default_factory=dict)

    @property
    def origin_rate(self) -> float:
        """What staging from origin achieves: the slower of the link and the nodes."""
        if self.staging_rate:
            return min(self.origin_bandwidth, self.staging_rate)
        return self.origin_bandwidth


@dataclass(frozen=True, slots=True)
class StageTask:
    """Stage one version into a region, from origin or a peer, before a deadline."""

    region: str
    version: VersionKey
    bytes: int
    source: str  # "origin" or a region name
    start: datetime
    finish: datetime
    deadline: datetime
    jobs: tuple[str, ...]
    # Why it may begin no sooner than ``RegionState.not_before`` (a node's room, not its
    # link or the region's room as a whole): ``warm``, which stages everything now, defers
    # it while that time is to come, and the controller never begins it early.
    waits: str = ""

    @property
    def spec(self) -> str:
        """``name@N``."""
        return f"{self.version[0]}@{self.version[1]}"


@dataclass(frozen=True, slots=True)
class Eviction:
    """Remove a version from a region at a time, and why that one."""

    region: str
    version: VersionKey
    bytes: int
    at: datetime
    next_use: datetime | None
    reason: str


@dataclass(frozen=True, slots=True)
class Infeasible:
    """A job's version that cannot be ready in time, and why."""

    job: str
    region: str
    version: str
    reason: str
    # The reason is the region's outage (RegionState.unreachable), not the plan: callers
    # report the outage once as the node failure it is, and leave these rows out of the
    # plan's own reasons, without having to recognise its text.
    unreachable: bool = False
    # While plan() weighs orders of the regions: what makes the reason, called only for
    # the rows of the plan it keeps (it fills ``reason`` then). A no-room reason's advice
    # (a start at which the job fits) was half the CPU of a 10k-job plan, spent as much
    # on the orders tried and dropped. None in every row plan() returns.
    explain: Callable[[], str] | None = field(default=None, repr=False)


@dataclass
class RegionPlan:
    """Ordered staging tasks and evictions of one region."""

    tasks: list[StageTask] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    # version → pin until: the end of the last job here that reads it, or the end of the
    # last copy another region makes from it here, whichever is later
    pins: dict[VersionKey, datetime] = field(default_factory=dict)
    # Of ``pins``, the versions another region copies from here: version → those regions.
    # The plan counts on this region keeping them until those copies end; a pin is what
    # makes its nodes do so (without one, their own LRU could take the copy's source).
    lends: dict[VersionKey, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class Plan:
    """The whole plan: per region, what cannot be met, and what moves over each link."""

    regions: dict[str, RegionPlan]
    infeasible: list[Infeasible]
    # (job, link) → bytes, where link is "origin→R" or "P→R"
    transfers: dict[tuple[str, str], int]
    cost: dict[str, float]  # job → egress cost, where prices are known

    def feasible(self, job: str) -> bool:
        """Whether all of ``job``'s data will be there in time."""
        return not any(i.job == job for i in self.infeasible)


# Other orders of the regions a plan tries (see plan): each costs up to a whole plan
# again. bench.planner (10k jobs x 20 regions, a random mesh of peer links): one try
# takes the plan from 0.81 to 1.45 s and cuts origin egress 0.6 %; where two regions
# read one version, as in most real sites, it halves it (tests/test_planner.py).
MAX_REORDERS = 1


def _order_key(job: Job) -> tuple[datetime, int, str]:
    return (job.start, -PRIORITIES.get(job.priority, 1), job.name)


def plan(
    jobs: Sequence[Job],
    regions: Mapping[str, RegionState],
    sizes: Mapping[VersionKey, int | VersionSize],
    *,
    now: datetime,
    missing: Iterable[tuple[str, str, str]] = (),
    why_missing: Mapping[str, str] | None = None,
) -> Plan:
    """Plan staging for ``jobs``.

    Args:
        jobs: the schedule, versions already resolved (``latest`` pinned by the caller).
        regions: capacity, link speeds and current contents of every region.
        sizes: every version the jobs read (a version without a size does not exist), as a
            :class:`VersionSize` or one number for both.
        now: when staging can begin.
        missing: (job, region, spec) of datasets the caller could not resolve.
        why_missing: spec → the registry's own words for why it did not resolve (they name
            the registry's URL and what it holds); without them a reason says only that
            the spec does not exist in the registry.
    """
    why_missing = why_missing or {}
    sized = {
        version: size if isinstance(size, VersionSize) else VersionSize(size, size)
        for version, size in sizes.items()
    }
    infeasible = [
        Infeasible(job, region, spec, _not_found(spec, why_missing))
        for job, region, spec in missing
    ]
    by_region: dict[str, list[Job]] = defaultdict(list)
    for job in sorted(jobs, key=_order_key):
        if job.region not in regions:
            infeasible.extend(
                Infeasible(job.name, job.region, f"{d}@{v}", f"region {job.region!r} is unknown")
                for d, v in job.versions
            )
            continue
        if regions[job.region].unreachable:
            infeasible.extend(
                Infeasible(
                    job.name,
                    job.region,
                    f"{d}@{v}",
                    regions[job.region].unreachable,
                    unreachable=True,
                )
                for d, v in job.versions
            )
            continue
        by_region[job.region].append(job)

    # Regions whose jobs start first are planned first: they fetch a version from origin,
    # and regions that need it later can copy it from them, whatever their names.
    never = datetime.max.replace(tzinfo=now.tzinfo)

    def first_need(name: str) -> tuple[datetime, str]:
        return min((job.start for job in by_region.get(name, [])), default=never), name

    def plan_in(
        order: Sequence[str],
        reuse: Mapping[str, _Part],
        *,
        lend_until: Mapping[tuple[str, VersionKey], datetime] | None = None,
    ) -> tuple[Plan, dict[str, _Part], _Holds]:
        """The plan with regions planned in ``order``, each copying from those before it.

        With each region's own part (its plan, unmet versions, transfers, cost, and
        what it kept for another region's copy from it), so that another order
        sharing a first stretch of regions reuses their parts: a region's plan
        depends only on the regions planned before it. The (region, version) pairs
        in ``lend_until`` are lent before the region is planned only until then,
        when its own plan would evict the version (see :func:`plan`'s last try).
        And when each region holds each version in it, every region being planned.
        """
        # Who holds what, when: for peer sourcing. A region planned after another copies
        # from it only while it holds the version (from its task's finish, or now, to its
        # eviction); regions not planned yet hold what they hold now, to no known end.
        holds: _Holds = {}
        for name, state in regions.items():
            if state.unreachable:  # what it holds cannot be copied while it does not answer
                continue
            for version in state.resident:
                until = never if lend_until is None else lend_until.get((name, version), never)
                if until > now:
                    holds[(name, version)] = [(now, until)]
        # A copy from a region planned later, out of what it holds now: that region keeps
        # the version until the copy ends (as it keeps a pin), or the copy would have
        # no source. (region, version) → the last such copy's end.
        reserved: dict[tuple[str, VersionKey], datetime] = {}
        parts: dict[str, _Part] = {}
        for name in order:
            part = reuse.get(name)
            if part is None:
                kept = {v: until for (r, v), until in reserved.items() if r == name}
                inputs = _inputs_of(regions[name], read_in[name], kept, holds, parts)
                if (known := planned.get(name)) is not None and known[0] == inputs:
                    part = known[1]  # another order gave this region the same inputs
            if part is None:
                state = regions[name]
                if kept:
                    pinned = {
                        v: max(state.pinned.get(v, until), until) for v, until in kept.items()
                    }
                    state = replace(state, pinned={**state.pinned, **pinned}, lent=kept)
                own = Plan(regions={}, infeasible=[], transfers={}, cost={})
                own.regions[name] = _plan_region(
                    state,
                    by_region.get(name, []),
                    sized,
                    now,
                    holds,
                    own,
                    why_missing,
                    settled=frozenset(parts),
                )
                part = _Part(own, frozenset(kept))
                planned[name] = (inputs, part)
            holds.update(_holds_of(regions[name], part.plan.regions[name], now))
            parts[name] = part
            for task in part.plan.regions[name].tasks:
                if task.source != "origin" and task.source not in parts:
                    key = (task.source, task.version)
                    reserved[key] = max(reserved.get(key, task.finish), task.finish)
        result = Plan(regions={}, infeasible=list(infeasible), transfers={}, cost={})
        for part in parts.values():
            result.regions.update(part.plan.regions)
            result.infeasible.extend(part.plan.infeasible)
            result.transfers.update(part.plan.transfers)  # (job, link): a job is in one region
            result.cost.update(part.plan.cost)
        result.regions = dict(sorted(result.regions.items()))
        result.infeasible.sort(key=lambda i: (i.region, i.job, i.version))
        _drop_unstaged_pins(result, regions)
        return result, parts, holds

    # Each region's plan with what it was planned from: an order that gives a region the
    # same inputs (its loans, and what its peers hold of the versions its jobs read, and
    # which of them were planned before it) gets the same plan, not planned again.
    planned: dict[str, tuple[tuple[object, ...], _Part]] = {}
    read_in = {
        name: sorted({v for job in by_region.get(name, []) for v in job.versions})
        for name in regions
    }

    # A region planned first cannot copy from one planned after it: when that one fetches
    # the same version from origin and its copy would be ready in time for the first
    # (its job starts later, but it stages early), both paid origin egress where one
    # would do. Such a later region is tried just before the earlier one, and the plan
    # that meets the most jobs at the least origin egress is kept (the first on a tie).
    # The largest saving is tried (MAX_REORDERS: how many); the regions before the
    # earlier one keep their plans.
    order = sorted(regions, key=first_need)
    best, parts, holds = plan_in(order, {})
    best_parts, best_order, best_holds = parts, order, holds
    tries = _reorders(best, order, regions)[:MAX_REORDERS] if MAX_REORDERS else []
    for ahead, behind in tries:
        i = order.index(ahead)
        moved = [*order[:i], behind, *(r for r in order[i:] if r != behind)]
        candidate, candidate_parts, candidate_holds = plan_in(
            moved, {name: parts[name] for name in order[:i]}
        )
        if _plan_score(candidate) < _plan_score(best):
            best, best_parts, best_order = candidate, candidate_parts, moved
            best_holds = candidate_holds
    # A copy from what a region planned later holds now makes that region keep the
    # version until the copy ends, as if pinned: room its own jobs may need meanwhile.
    # Seen in bench.schedule: us copied books@1 for a job at 22:00 from eu's copy, so eu
    # kept it to 20:30 and a job of eu at 15:00 could not get its room ("cannot be met",
    # met in the first plan of the day). Where such a region leaves a job short, the
    # plan in which it lends those versions ahead only until its own plan, made without
    # the loans, would evict them is tried too (later copies come from origin, other
    # peers or its planned holdings), and kept if it meets more jobs.
    short_regions = {row.region for row in best.infeasible if not row.unreachable}
    short = {(r, v) for r in short_regions & best_parts.keys() for v in best_parts[r].lent}
    if short:
        limits: dict[tuple[str, VersionKey], datetime] = {}
        for name in {r for r, _ in short}:
            scratch = Plan(regions={}, infeasible=[], transfers={}, cost={})
            alone = _plan_region(
                regions[name], by_region.get(name, []), sized, now, {}, scratch, why_missing
            )
            spans = _holds_of(regions[name], alone, now)
            for region, version in short:
                if region == name:
                    held = [end for start, end in spans.get((name, version), []) if start <= now]
                    limits[(name, version)] = held[0] if held else now
        candidate, _, candidate_holds = plan_in(best_order, {}, lend_until=limits)
        if _plan_score(candidate) < _plan_score(best):
            best, best_holds = candidate, candidate_holds
    # A copy that now finishes sooner may bring a version in time for a job the region's
    # plan had found it late for (it arrived after that job, so the job was left out).
    for name in _copy_from_later_regions(best, regions, sized, best_holds):
        _met_after_all(name, by_region.get(name, []), now, best.regions[name], best)
    _pin_lent(best)
    best.infeasible = _explained(best.infeasible)
    return best


def _pin_lent(result: Plan) -> None:
    """Pin each version a region lends until the last copy from it ends there.

    The plan copies from a peer only while that peer holds the version (its
    own plan evicts it after the copy, with margin), but a peer whose jobs had
    ended held it unpinned: its nodes' LRU could evict the copy's source while
    the copy ran, and the copy fell back to origin or failed. Pinned, the
    version stays there exactly as long as the plan counts on it.
    """
    for name, region_plan in result.regions.items():
        for task in region_plan.tasks:
            lender = result.regions.get(task.source) if task.source != "origin" else None
            if lender is None:
                continue
            version = task.version
            lender.pins[version] = max(lender.pins.get(version, task.finish), task.finish)
            borrowers = lender.lends.get(version, ())
            if name not in borrowers:
                lender.lends[version] = (*borrowers, name)


def _copy_from_later_regions(
    result: Plan,
    regions: Mapping[str, RegionState],
    sizes: Mapping[VersionKey, VersionSize],
    holds: _Holds,
) -> set[str]:
    """Source from a peer each origin fetch that a region's planned copy can serve in time.

    A region planned before another sees only what that one holds now, not what
    its plan will stage: in bench.schedule us fetched ``books@1`` from origin for
    a job at 22:00 while eu, planned after it, staged it again at 19:00 for its
    own job and held it past 22:00 (4 of the controller's 11 origin fetches had
    such a peer). With every region's plan known, each in-time origin task that
    a peer holding the version throughout can replace, finishing no later, is
    copied from that peer instead (the earliest finish among them): no task is
    moved later, so every hold another copy counts on still stands, and the
    peer keeps its own plan (its eviction comes after the copy, with margin).
    ``holds``: every region's, as its plan in ``result`` has it (updated here).
    Returns the regions whose tasks it changed.
    """
    changed: set[str] = set()
    holders: dict[VersionKey, list[tuple[str, list[tuple[datetime, datetime]]]]]
    holders = defaultdict(list)  # version → (region, its spans): few per version
    for (region, version), spans in holds.items():
        holders[version].append((region, spans))
    # (peer, region) → the copies planned over that link: one at a time, as planned.
    busy: dict[tuple[str, str], list[tuple[datetime, datetime]]] = defaultdict(list)
    for name, region_plan in result.regions.items():
        for task in region_plan.tasks:
            if task.source != "origin":
                busy[(task.source, name)].append((task.start, task.finish))
    for copies in busy.values():
        copies.sort()
    for name, region_plan in result.regions.items():
        state = regions[name]
        seen: set[VersionKey] = set()
        for index, task in enumerate(region_plan.tasks):
            first, version = task.version not in seen, task.version
            seen.add(version)
            if task.source != "origin" or task.finish > task.deadline or version not in sizes:
                continue
            # A stage cut short kept its shards: its first task moves only the rest.
            held_now = min(state.partial.get(version, 0), task.bytes) if first else 0
            moved = task.bytes - held_now
            options = []  # (finish, peer, begin)
            for peer, spans in holders.get(version, ()):
                bandwidth = state.peer_bandwidth.get(peer, 0.0)
                if bandwidth <= 0 or peer == name:
                    continue
                copying = timedelta(seconds=moved / bandwidth)
                for start, end in spans:
                    begin = _link_free_at(busy[(peer, name)], max(task.start, start), copying)
                    finish = begin + copying
                    if finish <= task.finish and end >= finish + _margin(copying):
                        options.append((finish, peer, begin))
                        break
            if not options:
                continue
            finish, peer, begin = min(options)
            region_plan.tasks[index] = replace(task, source=peer, start=begin, finish=finish)
            changed.add(name)
            bisect.insort(busy[(peer, name)], (begin, finish))
            # Its copy is held from its new finish (in place: holders shares the list).
            spans = holds[(name, version)]
            spans[:] = [(finish if start == task.finish else start, end) for start, end in spans]
            job = task.jobs[0]  # the job it was staged for: its transfers and cost
            origin_key = (job, f"origin→{name}")
            from_origin = _origin_bytes(sizes[version], held_now)
            left = result.transfers.get(origin_key, 0) - from_origin
            if left > 0:
                result.transfers[origin_key] = left
            else:
                result.transfers.pop(origin_key, None)
            peer_key = (job, f"{peer}→{name}")
            result.transfers[peer_key] = result.transfers.get(peer_key, 0) + moved
            if state.egress_price_per_gb and job in result.cost:
                result.cost[job] -= from_origin / 1e9 * state.egress_price_per_gb
    return changed


def _link_free_at(
    copies: Sequence[tuple[datetime, datetime]], begin: datetime, copying: timedelta
) -> datetime:
    """The first time from ``begin`` that a copy ``copying`` long overlaps none of ``copies``.

    ``copies``: the link's, in order, one after another (so only the one begun
    last before ``begin`` may still run then).
    """
    i = max(bisect.bisect_left(copies, (begin,)) - 1, 0)
    for start, finish in itertools.islice(copies, i, None):
        if start >= begin + copying:
            break  # it fits before this one, and so before every later one
        if begin < finish:
            begin = finish  # in the way: after it
    return begin


class _Part(NamedTuple):
    """One region's share of a plan, as planned after the regions before it."""

    plan: Plan  # its RegionPlan, unmet versions, transfers and cost
    lent: frozenset[VersionKey]  # what it kept for a copy by a region planned before it


# (region, version) → the spans of time a region holds a version: [(from, until)].
_Holds = dict[tuple[str, VersionKey], list[tuple[datetime, datetime]]]


def _inputs_of(
    state: RegionState,
    versions: Sequence[VersionKey],
    kept: Mapping[VersionKey, datetime],
    holds: _Holds,
    settled: Mapping[str, object],
) -> tuple[object, ...]:
    """What a region's plan depends on beyond its own jobs and state, as one comparable value.

    :func:`_plan_region` reads of the other regions only what its peers hold of
    the ``versions`` its jobs read (``holds``), and which peers were planned
    before it (``settled``: the advice counts only on their copies); plus what
    it keeps for a copy by a region planned before it (``kept``).
    """
    peers = sorted(state.peer_bandwidth)
    return (
        tuple(sorted(kept.items())),
        tuple(p for p in peers if p in settled),
        tuple(tuple(holds.get((p, v), ())) for p in peers for v in versions),
    )


def _holds_of(state: RegionState, region_plan: RegionPlan, now: datetime) -> _Holds:
    """When ``region_plan`` has its region hold each version, span by span.

    From now (held already) or a task's finish, to the first eviction of it
    after that (the far future if none): a peer copy must end within a span.
    """
    if state.unreachable:  # a peer that does not answer serves no copy
        return {}
    never = datetime.max.replace(tzinfo=now.tzinfo)
    starts: dict[VersionKey, list[datetime]] = defaultdict(list)
    for version in state.resident:
        starts[version].append(now)
    for task in region_plan.tasks:
        starts[task.version].append(task.finish)
    ends: dict[VersionKey, list[datetime]] = defaultdict(list)
    for eviction in region_plan.evictions:
        ends[eviction.version].append(eviction.at)
    out: _Holds = {}
    for version, froms in starts.items():
        untils = sorted(ends.get(version, ()))
        spans = []
        for start in sorted(froms):
            i = bisect.bisect_left(untils, start)
            spans.append((start, untils[i] if i < len(untils) else never))
        out[(state.name, version)] = spans
    return out


def _holding(
    spans: Iterable[tuple[datetime, datetime]],
    need: datetime,
    cursor: datetime,
    latest: datetime,
    copying: timedelta,
) -> datetime | None:
    """When a peer holding ``spans`` has the version for a copy, or None.

    The start of the first span that begins by ``need`` and lasts until the copy
    ends, begun as soon as it may or as late as ``latest`` (waiting for room).
    """
    for start, end in spans:
        begin = max(cursor, start)
        if start <= need and end >= max(begin, latest) + copying:
            return start
    return None


def _reorders(
    result: Plan, order: Sequence[str], regions: Mapping[str, RegionState]
) -> list[tuple[str, str]]:
    """(region, later region) pairs where the first could copy what both fetch from origin.

    The later region's origin copy is ready, and sent over the first one's peer link
    from it, before the first one's job starts. Largest saving first.
    """
    place = {name: i for i, name in enumerate(order)}
    fetches: dict[VersionKey, list[StageTask]] = defaultdict(list)
    for region_plan in result.regions.values():
        for task in region_plan.tasks:
            if task.source == "origin":
                fetches[task.version].append(task)
    evicted: dict[tuple[str, VersionKey], list[datetime]] = defaultdict(list)
    for name, region_plan in result.regions.items():
        for eviction in region_plan.evictions:
            evicted[(name, eviction.version)].append(eviction.at)
    for times in evicted.values():
        times.sort()
    found: dict[tuple[str, str], int] = defaultdict(int)
    for tasks in fetches.values():
        for early in tasks:
            links = regions[early.region].peer_bandwidth
            for late in tasks:
                bandwidth = links.get(late.region, 0.0)
                if place[late.region] <= place[early.region] or bandwidth <= 0:
                    continue
                copied = late.finish + timedelta(seconds=early.bytes / bandwidth)
                times = evicted.get((late.region, late.version), [])
                i = bisect.bisect_left(times, late.finish)
                gone = i < len(times) and times[i] < copied  # evicted before the copy ends
                if copied <= early.deadline and not gone:
                    found[(early.region, late.region)] += early.bytes
    return sorted(found, key=lambda pair: (-found[pair], pair))


def _plan_score(result: Plan) -> tuple[int, int, int, float]:
    """Lower is better: versions jobs never get, then those they get late, origin bytes, cost.

    A version staged for its job after the job started (a running job's, or one that
    arrives late) is a row too, but the job gets it: a plan in which a running job found
    no room at all (its region kept a version another region copied from it) had as many
    rows as the one that stages it a moment later, less origin egress, and was kept.
    """
    staged = {
        (name, job, task.spec)
        for name, region in result.regions.items()
        for task in region.tasks
        for job in task.jobs
    }
    never = sum((row.region, row.job, row.version) not in staged for row in result.infeasible)
    egress = sum(size for (_, link), size in result.transfers.items() if link.startswith("origin→"))
    return never, len(result.infeasible), egress, sum(result.cost.values())


def _drop_unstaged_pins(result: Plan, regions: Mapping[str, RegionState]) -> None:
    """Take out of ``result`` the pins of versions it will not stage where it pins them.

    Every version a job reads is pinned first, and some are then reported as
    unable to be met (larger than the region, no room, arriving after the job).
    Pinned anyway, such a version holding no data yet had each shard a reader then
    fetched through pinned in place: the version's own pin left no room for its
    next shards, and training on it failed. A pin is kept where the version is
    held already, where a task stages it (late, or for another job), and where the
    region holds part of it: dropping that pin would leave a running job's shards
    evictable mid-job while the rest cannot arrive in time. Rows that only report
    a region's outage keep theirs (the outage is the news).
    """
    unmet: dict[str, set[str]] = defaultdict(set)
    for row in result.infeasible:
        if not row.unreachable:
            unmet[row.region].add(row.version)
    for region, specs in unmet.items():
        region_plan, state = result.regions.get(region), regions.get(region)
        if region_plan is None or state is None:
            continue
        kept = {task.version for task in region_plan.tasks}
        kept |= set(state.resident) | {v for v, held in state.partial.items() if held}
        for version in list(region_plan.pins):
            if version not in kept and f"{version[0]}@{version[1]}" in specs:
                del region_plan.pins[version]


def _not_found(spec: str, why_missing: Mapping[str, str]) -> str:
    """Why ``spec`` cannot be planned: the registry's words when the caller has them.

    They say where the registry is and what it holds ("the registry file:///…
    does not exist"), which "does not exist in the registry" alone left out.
    """
    why = why_missing.get(spec)
    if why is None:
        return f"{spec} does not exist in the registry"
    return why if why.startswith(f"{spec} ") else f"{spec}: {why}"


def _plan_region(
    state: RegionState,
    jobs: list[Job],
    sizes: Mapping[VersionKey, VersionSize],
    now: datetime,
    holds: _Holds,
    result: Plan,
    why_missing: Mapping[str, str],
    settled: frozenset[str] | None = None,
) -> RegionPlan:
    """The tasks, evictions and pins of one region, and its rows in ``result``.

    ``holds``: what the other regions hold when; of them, those in ``settled``
    (None: all) were planned before this one, so their spans are their plans'.
    The others' are what they hold now, to no known end: a copy from one makes
    it keep the version (the loan in :func:`plan`), but the start the advice
    names does not count on such a copy, which that region's own plan may
    take away (it evicts the version for its own jobs).
    """
    out = RegionPlan()
    for job in jobs:
        if job.end > now:
            for version in job.versions:
                if version in sizes:
                    out.pins[version] = max(out.pins.get(version, job.end), job.end)
    # Uses of each version in this region, for "next use" (Belady) and "in use" checks.
    uses: dict[VersionKey, list[tuple[datetime, datetime]]] = defaultdict(list)
    for job in jobs:
        for version in job.versions:
            uses[version].append((job.start, job.end))
    starts: dict[VersionKey, list[datetime]] = {}
    reach: dict[VersionKey, list[datetime]] = {}  # running max of ends, in start order
    # Per version: its starts, and the instant after each running max of ends (when it
    # may go, for a job ending by then): room_frees looks both up for every version held.
    freeing: dict[VersionKey, tuple[list[datetime], list[datetime]]] = {}
    for version, intervals in uses.items():
        intervals.sort()
        starts[version] = [s for s, _ in intervals]
        reach[version] = list(itertools.accumulate((e for _, e in intervals), max))
        freeing[version] = (starts[version], [e + _AFTER for e in reach[version]])

    def last_end(version: VersionKey, until: datetime) -> datetime:
        """The latest end of the jobs reading ``version`` that start by ``until``."""
        i = bisect.bisect_right(starts.get(version, []), until) - 1
        return reach[version][i] if i >= 0 else now

    def in_use(version: VersionKey, lo: datetime, hi: datetime) -> bool:
        """Whether a job reads ``version`` at any time in [lo, hi] (O(log n))."""
        i = bisect.bisect_right(starts.get(version, []), hi) - 1
        return i >= 0 and reach[version][i] >= lo

    # Every use in start order, built when first needed: starts, ends, versions, and the
    # running max of ends (which only grows, so bisect finds where a walk back would stop).
    by_start_starts: list[datetime] = []
    by_start_ends: list[datetime] = []
    by_start_versions: list[VersionKey] = []
    by_start_reach: list[datetime] = []

    def used_between(lo: datetime, hi: datetime) -> dict[VersionKey, datetime]:
        """The versions some job here reads at a time in [lo, hi]: each one's last end.

        The uses that start by ``hi``, back to the first one that (or an earlier
        one) still runs at ``lo``: before it, every use has ended by ``lo``. The
        latest end among a version's uses seen is its ``last_end(version, hi)``
        (the uses not seen end before ``lo``), which the caller needs next: one
        pass instead of a search each.
        """
        if not by_start_starts:
            every = sorted((s, e, v) for v, spans in uses.items() for s, e in spans)
            by_start_starts.extend(s for s, _, _ in every)
            by_start_ends.extend(e for _, e, _ in every)
            by_start_versions.extend(v for _, _, v in every)
            by_start_reach.extend(itertools.accumulate(by_start_ends, max))
        i = bisect.bisect_right(by_start_starts, hi)
        j = bisect.bisect_left(by_start_reach, lo, 0, i)
        found: dict[VersionKey, datetime] = {}
        get = found.get
        for end, version in zip(by_start_ends[j:i], by_start_versions[j:i], strict=True):
            if end >= lo:
                seen = get(version)
                if seen is None or end > seen:
                    found[version] = end
        return found

    def room_frees(hi: datetime) -> list[_Freed]:
        """Per version held (whole or in part): from when it may go for a job ending at ``hi``.

        That is the first instant after the last job reading it (of those that
        start by ``hi``) ends, or when its foreign pin runs out, whichever is
        later (None: at any time): exactly when "a job reads it in [then, hi],
        or the region's nodes pin it then for a job outside the plan" turns
        false. So room only grows with time, and only at these instants. With
        its bytes and its next use after ``hi``.
        """
        out: list[_Freed] = []
        pinned, bisect_right, unread = state.pinned, bisect.bisect_right, ((), ())
        append, freeing_of = out.append, freeing.get
        # A version held in part (a stage cut short) fills the cache too, and goes the same
        # way: it was never evicted, and a job that needed its room could not be met.
        # Room kept for another schedule's pinned version goes when its pin runs out; one
        # held in part is one entry, its held bytes and the room kept for the rest.
        kept_only = ((v, b) for v, b in reserved.items() if v not in partial)
        with_kept = ((v, b + reserved.get(v, 0)) for v, b in partial.items())
        for version, held in itertools.chain(resident.items(), with_kept, kept_only):
            times, frees = freeing_of(version, unread)
            i = bisect_right(times, hi)
            free = frees[i - 1] if i else None
            if pinned:
                until = pinned.get(version)
                if until is not None and (free is None or until > free):
                    free = until
            append((version, held, free, times[i] if i < len(times) else None))
        return out

    resident: dict[VersionKey, int] = dict(state.resident)
    stored_bytes = {v: sized.stored for v, sized in sizes.items()}  # for the advice's checks
    partial: dict[VersionKey, int] = {v: b for v, b in state.partial.items() if v not in resident}
    # A version a job here reads is staged by this plan (then held): no room kept twice.
    reserved = {
        v: b for v, b in state.reserved.items() if b > 0 and v not in resident and v not in uses
    }
    # Copies: the loop below gives a reservation's room back once its pin runs out, and
    # the advice ("add at least …") must still count the room kept until then.
    lacks = _Lacks(state, jobs, sizes, dict(partial), holds, dict(reserved))
    used = sum(resident.values()) + sum(partial.values()) + sum(reserved.values())
    link_free = now  # the origin link is busy until then
    peer_free: dict[str, datetime] = {}  # and each peer's link into this region
    cursor = now  # tasks and evictions happen in time order
    task_of: dict[VersionKey, int] = {}  # version → index of its task in out.tasks
    for position, job in enumerate(jobs):
        # This job's versions that found no room, and those larger than the region: (spec,
        # bytes), reported once what the job lacks as a whole is known.
        unroomed: list[_Unroomed] = []
        too_big: list[tuple[str, int]] = []
        # Its late rows: where each will be in result.infeasible, and its reason's maker.
        late_rows: list[tuple[int, Callable[..., str]]] = []
        for version in job.versions:
            spec = f"{version[0]}@{version[1]}"
            sized = sizes.get(version)
            if sized is None:
                result.infeasible.append(
                    Infeasible(job.name, state.name, spec, _not_found(spec, why_missing))
                )
                continue
            if version in resident:
                index = task_of.get(version)
                if index is None:
                    continue  # resident before planning began
                task = out.tasks[index]
                if job.name not in task.jobs:
                    out.tasks[index] = _with_job(task, job.name)
                if task.finish <= job.start:
                    continue
                result.infeasible.append(
                    Infeasible(
                        job.name, state.name, spec, "staged for an earlier job but not in time"
                    )
                )
                continue
            size = sized.stored
            # Only what is not held yet moves (a stage cut short kept its whole shards).
            held_now = min(partial.get(version, 0), size)
            # Choose a source: the cheapest that makes the deadline. A peer region that
            # will hold the version costs no origin egress, so it wins whenever it makes
            # the deadline, slower link or not; when nothing makes it, the fastest does.
            # A peer sends stored bytes, origin sends source bytes.
            wait = state.not_before.get(version)
            earliest = wait[0] if wait else cursor  # a node's room may hold it back
            origin_begin = max(cursor, link_free, earliest)
            options = []  # (misses the deadline, from origin, finish, source, bw, bytes, begin)
            if state.origin_rate > 0:
                moved = _origin_bytes(sized, held_now)
                finish = origin_begin + timedelta(seconds=moved / state.origin_rate)
                options.append(
                    (finish > job.start, True, finish, "origin", state.origin_rate, moved,
                     origin_begin)
                )  # fmt: skip
            for peer, peer_bw in sorted(state.peer_bandwidth.items()):
                if peer_bw <= 0:
                    continue
                moved = size - held_now
                copying = timedelta(seconds=moved / peer_bw)
                # The peer must hold it until the copy ends, even one that waits for room
                # here until the latest it may begin (see "Make room" below).
                latest = job.start - copying - _margin(copying)
                spans = holds.get((peer, version), ())
                # Copies from one peer run one after another, as on the origin link:
                # two were planned over one link at once, each at its whole speed.
                ready = max(cursor, peer_free.get(peer, cursor), earliest)
                # A started job needs it now: a peer's copy from now on is in its past
                # otherwise, and its version came from origin, slowly, at egress cost.
                held = _holding(spans, max(job.start, now), ready, latest, copying)
                if held is None:
                    continue
                peer_begin = max(ready, held)
                finish = peer_begin + copying
                options.append(
                    (finish > job.start, False, finish, peer, peer_bw, moved, peer_begin)
                )
            if options:
                # In time: peers first, then the earliest finish. Late anyway: the earliest.
                options.sort(key=lambda o: (True, o[2]) if o[0] else (False, o[1], o[2]))
                _, _, _, source, bandwidth, moved, begin = options[0]
            else:
                source, bandwidth, moved, begin = "origin", 0.0, 0, origin_begin
            if bandwidth <= 0:
                result.infeasible.append(
                    Infeasible(job.name, state.name, spec, "the region has no origin bandwidth")
                )
                continue
            duration = timedelta(seconds=moved / bandwidth)
            finish = begin + duration
            if size > state.capacity_bytes:
                too_big.append((spec, size))
                continue
            too_slow: Infeasible | None = None
            if finish > job.start:
                # Held back by a node's room, not the link: said so, with what to change.
                held_back = wait[1] if wait is not None and begin == wait[0] else None
                lateness = functools.partial(
                    _late_reason, job, spec, now, begin, finish, duration, bandwidth, source,
                    held_back=held_back,
                )  # fmt: skip
                too_slow = Infeasible(job.name, state.name, spec, lateness())
                if finish >= job.end:  # it would arrive after the job: no use staging it
                    late_rows.append((len(result.infeasible), lateness))
                    result.infeasible.append(too_slow)
                    continue
                # Late, but the job still reads it after it arrives: stage it anyway (the
                # job reads through to origin until then), and say it is late.
            # Make room. Best: evict only versions no job needs again, now or, failing
            # that, as soon as waiting makes room (later, more jobs have finished and
            # more pins have run out), at the latest just in time. Otherwise Belady:
            # what is needed furthest ahead, to be staged again for its job, again as
            # soon as there is room. Never what a job reads between this task's start
            # and this job's end. The controller re-plans every round and acts as soon
            # as the room exists, so the plan shows that earliest time, not the latest.
            shortfall = used + size - partial.get(version, 0) - state.capacity_bytes
            victims: list[tuple[VersionKey, datetime | None]] = []
            late = job.start - duration - _margin(duration)
            if shortfall > 0:
                frees = room_frees(job.end)
                when, room, victims = _make_room(frees, shortfall, begin, late, now)
                if when is not None and when != begin:
                    begin, finish = when, when + duration
                # A source in time may need room sooner than there is any (a slow peer's
                # copy begins early): another in time, faster, may find it. Chosen first
                # regardless, the job was "not enough capacity" where origin would do.
                for other in options[1:] if when is None else ():
                    if other[0]:  # late: so are the rest
                        break
                    _, _, _, o_source, o_bandwidth, o_moved, o_begin = other
                    o_duration = timedelta(seconds=o_moved / o_bandwidth)
                    o_late = job.start - o_duration - _margin(o_duration)
                    found, _, o_victims = _make_room(frees, shortfall, o_begin, o_late, now)
                    if found is not None:
                        when, victims = found, o_victims
                        source, bandwidth, moved = o_source, o_bandwidth, o_moved
                        begin = max(found, o_begin)
                        finish = begin + o_duration
                        break
                if when is None:
                    in_way = [v for v in resident if in_use(v, begin, job.end)]
                    own_held = sum(resident.get(v, 0) + partial.get(v, 0) for v in job.versions)
                    unroomed.append(
                        _Unroomed(
                            spec,
                            missing=size - held_now,
                            kept=used - room,
                            others_kept=used - room - own_held,
                            in_way=in_way,
                            begin=begin,
                            held_then={
                                v: resident.get(v, 0) + partial.get(v, 0) + reserved.get(v, 0)
                                for v in (*in_way, *state.pinned)
                                if v in resident or v in partial or v in reserved
                            },
                            lead=duration + _margin(duration),
                        )
                    )
                    continue
            for victim, victim_next in victims:
                # The room kept for it goes with it (its pin has run out by then).
                used -= reserved.pop(victim, 0)
                if victim not in resident and victim not in partial:
                    continue  # it held no data: nothing to evict
                victim_size = resident.pop(victim) if victim in resident else partial.pop(victim)
                used -= victim_size
                out.evictions.append(
                    Eviction(
                        region=state.name,
                        version=victim,
                        bytes=victim_size,
                        at=begin,
                        next_use=victim_next,
                        reason=(
                            "not needed again"
                            if victim_next is None
                            else f"next needed at {victim_next.astimezone(UTC):%Y-%m-%dT%H:%MZ}, "
                            "furthest ahead"
                        ),
                    )
                )
                task_of.pop(victim, None)
            task = StageTask(
                region=state.name,
                version=version,
                bytes=size,
                source=source,
                start=begin,
                finish=finish,
                deadline=job.start,
                jobs=(job.name,),
                waits=wait[1] if wait is not None else "",
            )
            if source == "origin":
                link_free = finish
            else:
                peer_free[source] = finish
            cursor = begin
            out.tasks.append(task)
            if too_slow is not None:
                late_rows.append((len(result.infeasible), lateness))
                result.infeasible.append(too_slow)
            task_of[version] = len(out.tasks) - 1
            resident[version] = size
            used += size - partial.pop(version, 0)
            link = f"{source}→{state.name}"
            result.transfers[(job.name, link)] = result.transfers.get((job.name, link), 0) + moved
            if source == "origin" and state.egress_price_per_gb:
                result.cost[job.name] = (
                    result.cost.get(job.name, 0.0) + moved / 1e9 * state.egress_price_per_gb
                )
        if too_big or unroomed:
            # A later start is no fix for a late version of a job that does not fit: moved,
            # the job's versions meet the room in another order, and the one staged now may
            # be the one left out (the late row said "start at T", which then found no room).
            blocking = ", ".join(spec for spec, _ in too_big) or ", ".join(u.spec for u in unroomed)
            for index, late_reason in late_rows:
                row = result.infeasible[index]
                result.infeasible[index] = replace(row, reason=late_reason(blocked=blocking))
            # One fix for the whole job: the capacity all its versions need together with
            # what may be held and in use with them, and a start after what holds back
            # every one that found no room (if each has one).
            short = lacks(position)
            for spec, size in too_big:
                reason = (
                    f"{spec} ({format_bytes(size)} once stored) is larger than the region's "
                    f"capacity ({format_bytes(state.capacity_bytes)}); "
                    f"{_to_meet(state, job, short)}"
                )
                result.infeasible.append(Infeasible(job.name, state.name, spec, reason))
            # What is in the way of each version, named on its row; and one start for the
            # job as a whole: all its versions need room then, those staged now too (a
            # start that made room for one left the next without: the job did not fit).
            # Worked out only for the plan kept (Infeasible.explain): everything they read is
            # fixed by now (``holds`` gains only regions planned later, which ``settled``
            # leaves out), so they come out as they would have here.
            if unroomed:
                advice = functools.cache(
                    functools.partial(
                        _advice,
                        state,
                        job,
                        unroomed,
                        None if too_big else sizes,
                        last_end,
                        _Elsewhen(
                            used_between,
                            stored_bytes,
                            functools.partial(
                                _lead_at, state, job, sizes, holds=holds, settled=settled
                            ),
                        ),
                    )
                )
            for i, u in enumerate(unroomed):
                result.infeasible.append(
                    Infeasible(
                        job.name,
                        state.name,
                        u.spec,
                        "",
                        explain=functools.partial(_no_room_reason, state, job, u, short, advice, i),
                    )
                )
    _met_after_all(state.name, jobs, now, out, result)
    return out


def _advice(
    state: RegionState,
    job: Job,
    unroomed: list[_Unroomed],
    sizes: Mapping[VersionKey, VersionSize] | None,
    last_end: Callable[[VersionKey, datetime], datetime],
    elsewhen: _Elsewhen,
) -> tuple[list[list[str]], datetime | None]:
    """What is in the way of each version of ``job`` that found no room, and one start for all.

    All its versions need room at that start, those staged now too (a start that
    made room for one left the next without: the job did not fit). No start
    (``sizes`` None) where one of its versions is larger than the region.
    """
    named = [
        _in_the_way(state, job, u.in_way, u.begin, last_end, u.held_then, 0, u.lead)[0]
        for u in unroomed
    ]
    if sizes is None:
        return named, None
    everything = sum(sizes[v].stored if v in sizes else 0 for v in dict.fromkeys(job.versions))
    _, after = _in_the_way(
        state,
        job,
        sorted({v for u in unroomed for v in u.in_way}),
        min(u.begin for u in unroomed),
        last_end,
        {v: b for u in unroomed for v, b in u.held_then.items()},
        everything + max(u.others_kept for u in unroomed) - state.capacity_bytes,
        max(u.lead for u in unroomed),
        elsewhen,
    )
    return named, after


def _no_room_reason(
    state: RegionState,
    job: Job,
    unroomed: _Unroomed,
    short: int,
    advice: Callable[[], tuple[list[list[str]], datetime | None]],
    index: int,
) -> str:
    """The reason of the row of ``job``'s ``index``-th version that found no room."""
    named, after = advice()
    return _no_room(state, job, unroomed.missing, short, unroomed.kept, named[index], after)


def _explained(rows: list[Infeasible]) -> list[Infeasible]:
    """``rows`` with every reason worked out (see :attr:`Infeasible.explain`)."""
    return [
        row if row.explain is None else replace(row, reason=row.explain(), explain=None)
        for row in rows
    ]


def _met_after_all(
    region: str, jobs: Sequence[Job], now: datetime, out: RegionPlan, result: Plan
) -> None:
    """Take back a row whose version a later job's task has there in time, kept to its end.

    A job is decided at its turn: a version it found no room for then may still be
    staged for a job after it, ready before this job starts and kept (pinned, not
    evicted) until it ends. The plan staged it and pinned it, and said this job
    could not be met for it (exit 3). Such a job is among the task's jobs instead.
    """
    starts = {job.name: job for job in jobs}
    rows = [
        (row, job)
        for row in result.infeasible
        if row.region == region and (job := starts.get(row.job)) is not None and job.start > now
    ]
    if not rows:
        return
    by_spec: dict[str, list[int]] = defaultdict(list)  # a version's tasks, in plan order
    for i, task in enumerate(out.tasks):
        by_spec[task.spec].append(i)
    for row, job in rows:
        for i in by_spec.get(row.version, ()):
            task = out.tasks[i]
            if task.finish > job.start:
                continue
            if out.pins.get(task.version, task.deadline) < job.end:
                continue
            if any(
                e.version == task.version and task.finish <= e.at < job.end for e in out.evictions
            ):
                continue
            out.tasks[i] = replace(task, jobs=(*task.jobs, job.name))
            result.infeasible.remove(row)
            break


class _Unroomed(NamedTuple):
    """A version of a job that found no room, as it stood then: for the job's row and advice."""

    spec: str
    missing: int  # the bytes of it not held
    kept: int  # the region's bytes held after every eviction allowed by its latest start
    others_kept: int  # ... of them, those not the job's own versions
    in_way: list[VersionKey]  # other jobs' versions in use then
    begin: datetime  # when its transfer would begin
    held_then: dict[VersionKey, int]  # bytes of what is in the way, by version
    lead: timedelta  # its transfer and margin


class _Lacks:
    """What a region lacks for a job as a whole: the bytes to add so that all of it fits.

    All that may have to be held at once while the job's versions are staged
    and read, less the capacity: the job's versions, each whole (one larger
    than the region too), the bytes of partly held versions read or pinned
    then, and every version a job reads (of the jobs that start by this one's
    end) at some time from ``lo`` to this job's end, or that a foreign pin holds
    after ``lo``, provided it can be held then at all: the region holds it now,
    a foreign pin keeps room for it (``RegionState.reserved``), or a job planned
    before this one reads it (met or not). ``lo`` is the job's
    start less the slowest transfer any of its versions could get, with that
    transfer's margin: room for a version is looked for until its start less
    its transfer and margin (``late``), never earlier than ``lo``.

    Enough, whatever the jobs planned before this one do with the extra room
    (stage what did not fit before, keep what they evicted before): when one
    of this job's versions looks for room, what the region holds is held now
    or was staged for one of those jobs, and what of it no eviction may take
    by ``late`` is counted here, so the room is there. Adding what this plan
    left the job short was not enough for that reason: the extra room let an
    earlier job that had not fit stage more, or let a version stay that a
    later job reads while this one runs, and the next plan asked for more. It
    can be more than the least that would do (what is counted may be gone
    before it is in the way), never less. The count walks back over the jobs
    planned before this one while their reach (the latest end so far) meets
    this one's times: few jobs usually, all earlier ones behind a job that runs
    for long (4,000 jobs that cannot fit behind one ten-year job: 0.6 s).
    """

    def __init__(
        self,
        state: RegionState,
        jobs: list[Job],
        sizes: Mapping[VersionKey, VersionSize],
        partial: Mapping[VersionKey, int],
        holds: _Holds,
        reserved: Mapping[VersionKey, int],
    ) -> None:
        self.state, self.jobs, self.sizes, self.partial = state, jobs, sizes, partial
        self.holds, self.reserved = holds, reserved
        self.starts: list[datetime] = []  # jobs are in start order
        self.reach: list[datetime] = []  # the latest end of jobs[: i + 1]
        self.first: dict[VersionKey, int] = {}  # version → the first job reading it
        self.bytes: dict[VersionKey, int] = {}  # version → the most it can take

    def __call__(self, position: int) -> int:
        """The bytes to add for ``self.jobs[position]``.

        More than zero for a job that did not fit: what it could not evict is
        counted here.
        """
        state, jobs, sizes, first = self.state, self.jobs, self.sizes, self.first
        if not self.starts:  # built once, for the first job that does not fit
            self.starts = [job.start for job in jobs]
            self.reach = list(itertools.accumulate((job.end for job in jobs), max))
            for i, job in enumerate(jobs):
                for version in job.versions:
                    first.setdefault(version, i)
        job = jobs[position]
        own = {v for v in job.versions if v in sizes}
        lo = job.start - max((self._slowest(v, job) for v in own), default=timedelta(0))
        # Read from lo to the job's end (by jobs that start by then), or pinned then.
        kept = {v for v, until in state.pinned.items() if until > lo}
        i = bisect.bisect_right(self.starts, job.end) - 1
        reach = self.reach
        while i >= 0 and reach[i] >= lo:
            if jobs[i].end >= lo:
                kept.update(jobs[i].versions)
            i -= 1
        # ... and could be held by then: held now, or read by a job planned before this one.
        resident, reserved, window = state.resident, self.reserved, kept
        kept = {
            v
            for v in kept - own
            if v in resident or v in reserved or (v in sizes and first.get(v, position) < position)
        }
        # What is held in part goes for room like the rest (room_frees), unless read or
        # pinned then: its bytes stay.
        total = sum(
            held
            for v, held in self.partial.items()
            if v in window and v not in own and v not in kept
        )
        bytes_of = self.bytes
        for version in own | kept:
            size = bytes_of.get(version)
            if size is None:
                sized = sizes.get(version)
                size = bytes_of[version] = max(
                    sized.stored if sized else 0,
                    resident.get(version, 0),
                    self.partial.get(version, 0) + reserved.get(version, 0),
                )
            total += size
        return total - state.capacity_bytes

    def _slowest(self, version: VersionKey, job: Job) -> timedelta:
        """The longest a transfer of ``version`` for ``job`` could take, with its margin.

        Room for the version is looked for until the job's start less that.
        """
        state, sized = self.state, self.sizes[version]
        held = _kept_part(state, version, sized, job.start)
        seconds = []
        if state.origin_rate > 0:
            moved = _origin_bytes(sized, held)
            seconds.append(moved / state.origin_rate)
        for peer, bandwidth in state.peer_bandwidth.items():
            spans = self.holds.get((peer, version), ())
            if bandwidth > 0 and any(start <= job.start for start, _ in spans):
                seconds.append((sized.stored - held) / bandwidth)
        duration = timedelta(seconds=max(seconds, default=0.0))
        return duration + _margin(duration)


def _lead_at(
    state: RegionState,
    job: Job,
    sizes: Mapping[VersionKey, VersionSize],
    start: datetime,
    *,
    holds: _Holds,
    settled: frozenset[str] | None,
) -> timedelta:
    """The staging and margin ``job``'s versions need before a start at ``start``.

    Each version not held whole comes from the fastest peer planned already
    (``settled``) that holds it from the latest the copy may begin to ``start``
    (a peer in time wins over origin, as in the plan), else from origin; those
    over one link go one after another, so their transfers add up there (two
    versions over a 4 kB/s link: advised the longer one's time, the job moved
    there found the second late).
    """
    by_source: dict[str, timedelta] = defaultdict(timedelta)
    for version in dict.fromkeys(job.versions):
        sized = sizes.get(version)
        if sized is None:
            continue
        if version in state.resident:
            if _pinned_through(state, version, start):
                continue
            held = 0  # a job planned before may evict it for its room, as a part held
        else:
            held = _kept_part(state, version, sized, start)
        copies = []
        for peer, bandwidth in state.peer_bandwidth.items():
            if bandwidth <= 0 or (settled is not None and peer not in settled):
                continue
            copying = timedelta(seconds=(sized.stored - held) / bandwidth)
            lead = copying + _margin(copying)
            if any(s <= start - lead and e >= start for s, e in holds.get((peer, version), ())):
                copies.append((copying, peer))
        if copies:
            copying, peer = min(copies)
            by_source[peer] += copying
        elif state.origin_rate > 0:
            by_source["origin"] += timedelta(seconds=_origin_bytes(sized, held) / state.origin_rate)
    return max((d + _margin(d) for d in by_source.values()), default=timedelta(0))


def _kept_part(state: RegionState, version: VersionKey, sized: VersionSize, until: datetime) -> int:
    """The bytes of ``version`` held in part that are surely still held at ``until``.

    Only those a foreign pin keeps that long: otherwise a job planned before may
    evict them for its room (Belady's victim is what is needed furthest ahead,
    and a job moved later needs its part later). Counted held anyway, a start
    advised for after what was in the way found the part evicted and the whole
    version to stage (advised 12:36 for 100 KiB of 925; moved, the job needed
    it all: 12:39), and the bytes to add came out negative. A version held
    whole is taken the same way at an advised start (:func:`_lead_at`).
    """
    part = min(state.partial.get(version, 0), sized.stored)
    return part if _pinned_through(state, version, until) else 0


def _pinned_through(state: RegionState, version: VersionKey, until: datetime) -> bool:
    """Whether another schedule's pin keeps ``version`` here until ``until`` at least."""
    pinned = state.pinned.get(version)
    return pinned is not None and pinned >= until


def _origin_bytes(sized: VersionSize, held: int) -> int:
    """The source bytes origin sends for a version of which ``held`` stored bytes are held.

    Origin sends source bytes (a peer stored ones): the share not held yet, of them.
    """
    return sized.source - sized.source * held // max(sized.stored, 1)


def _in_the_way(
    state: RegionState,
    job: Job,
    in_use: list[VersionKey],
    begin: datetime,
    last_end: Callable[[VersionKey, datetime], datetime],
    held: Mapping[VersionKey, int],
    short: int,
    lead: timedelta,
    elsewhen: _Elsewhen | None = None,
) -> tuple[list[str], datetime | None]:
    """What keeps a version of ``job`` from fitting at ``begin``, and the earliest start that would.

    Named: other jobs' versions in use (the job's own are what it needs, not
    what to evict) and versions pinned for jobs outside the plan. The time is
    when enough of them (``held``: their bytes) is free for the ``short`` bytes
    the job lacks, plus ``lead`` (its transfer and margin) to stage it then;
    None: nothing is in the way, or not enough of it (the job's own other
    versions fill the rest), or the job runs already and cannot be started
    later. It was when the last of them is free, with no lead: a start hours
    late, and one that still had no time to stage. Only what is still held
    when the version's room is last looked for (the start less ``lead``) is in
    the way: what is free by then is room the plan counted already (counted
    twice, it made the advice a start at which the job still did not fit).
    With ``elsewhen``, the start is checked against what is in use in the
    window the job would be moved to (:class:`_Elsewhen`), and moved on until
    that leaves the room too.
    """
    own, late = set(job.versions), job.start - lead
    others = sorted(v for v in in_use if v not in own and last_end(v, job.end) >= late)
    pinned = sorted(
        (v, until)
        for v, until in state.pinned.items()
        if v not in own and until > begin and until > late
    )
    named = [f"in use then: {', '.join(f'{d}@{v}' for d, v in others[:5]) or 'nothing'}"]
    lent = [(v, until) for v, until in pinned if state.lent.get(v, begin) >= until]
    foreign = [(v, until) for v, until in pinned if (v, until) not in lent]
    if foreign:
        named.append(
            "pinned for jobs outside this schedule: "
            + ", ".join(
                f"{d}@{v} until {_utc(until)}"
                + (" (not staged yet: its room is kept)" if (d, v) in state.reserved else "")
                for (d, v), until in foreign[:5]
            )
        )
    if lent:
        named.append(
            "kept here for another region's copy from it: "
            + ", ".join(f"{d}@{v} until {_utc(until)}" for (d, v), until in lent[:5])
        )
    if not (others or pinned) or job.start <= begin:  # a running job cannot start later
        return named, None

    def earliest(end: datetime) -> datetime | None:
        """The start at which enough is free, for the job ending at ``end``."""
        # Room a job's version takes is free the instant after the job ends (_AFTER), as
        # room_frees has it (at the end itself, a start rounded to the minute exactly had
        # no room); a version in use and pinned too, once both are over, counted once (as
        # two frees its bytes made room at the end of its use, while still pinned).
        free_at = {v: last_end(v, end) + _AFTER for v in others}
        for v, until in pinned:
            free_at[v] = max(free_at.get(v, until), until)
        freed = 0
        for when, v in sorted((when, v) for v, when in free_at.items()):
            freed += held.get(v, 0)
            if freed >= short:
                # As advised: to the minute, up. Checked unrounded, a start of 12:58:40
                # ended clear of a job starting at 13:30; advised as 13:00, it met it.
                return _minute_up(when + lead)
        return None  # not enough even once all of it is free: no start helps

    # Moved to that start, the job runs to a later end, and a job that reads what is in the
    # way in between keeps it longer: advised once, the start met that job, and a second
    # plan advised a later one. Again from the moved window until the start stays.
    after, length = earliest(job.end), job.end - job.start
    for _ in range(8):
        if after is None:
            break
        moved = earliest(after + length)
        if moved is None or moved <= after:
            break
        after = moved
    if elsewhen is None:
        return named, after
    # What may stay beside the job: of what is in the way now, all but the bytes it lacks.
    # In the window it is moved to, other jobs may read versions nothing read before (a
    # start after what was in the way landed on a job reading something else, and the
    # next plan advised a later start again): the start moves on until what is in use
    # or pinned there fits in that, or no start would.
    budget = sum(held.get(v, 0) for v in {*others, *(v for v, _ in pinned)}) - short

    def fits_from(start: datetime) -> datetime | None:
        """The earliest start from ``start`` at which what is in the way leaves room.

        In the way of the job moved to ``start``: what other jobs read from its
        staging (the start less ``lead``) to its end, and what is pinned then;
        room is left once that is at most ``budget`` bytes. ``start`` itself if
        so, else when enough of it is free (with ``lead`` to stage), None if never.
        """
        lo, end = start - lead, start + length
        used = elsewhen.used_between(lo, end)
        for version in own:
            used.pop(version, None)
        pins = {v: u for v, u in state.pinned.items() if v not in own and u > lo}
        held_get, stored_get = held.get, elsewhen.stored.get
        sizes = {
            v: size if (size := held_get(v)) is not None else stored_get(v, 0)
            for v in ((used.keys() | pins.keys()) if pins else used)
        }
        remaining = sum(sizes.values())
        if remaining <= budget:
            return start
        frees = {v: last + _AFTER for v, last in used.items()}
        for version, until in pins.items():
            frees[version] = max(frees.get(version, until), until)
        # By time alone: versions freed at the same instant make room at that instant in
        # any order (sizes are never negative), so which of them comes first changes nothing.
        for version, when in sorted(frees.items(), key=_second):
            remaining -= sizes[version]
            if remaining <= budget:
                return max(start, _minute_up(when + lead))
        return None

    for _ in range(16):
        if after is None:
            break
        lead = max(lead, elsewhen.lead_at(after))
        moved = fits_from(after)
        if moved is None:
            return named, None
        if moved <= after:
            break
        after = moved
    return named, after


@dataclass(frozen=True, slots=True)
class _Elsewhen:
    """What other jobs of the region read at other times, to check a start the advice names."""

    used_between: Callable[[datetime, datetime], dict[VersionKey, datetime]]  # read in [lo, hi]
    stored: Mapping[VersionKey, int]  # stored bytes of each version known
    # The transfer and margin the job's versions need for a start then: the source may
    # differ (a peer that holds a version for one start has evicted it by a later one).
    lead_at: Callable[[datetime], timedelta]


def _no_room(
    state: RegionState,
    job: Job,
    missing: int,
    short: int,
    kept: int,
    held: list[str],
    after: datetime | None,
) -> str:
    """Why a version does not fit for ``job``, and what to change: capacity, or the start.

    ``missing`` is what the region lacks of the version (a partly held one
    needs only the rest), ``kept`` the bytes held after every allowed
    eviction, ``held`` what stays in the way (:func:`_in_the_way`). ``short``
    is what the region lacks for ``job`` as a whole (:class:`_Lacks`): its
    versions, the one too big for the region included, with every version
    that may be held and in use beside them, whatever the jobs planned before
    it in the region stage once the capacity is larger (with the extra room
    they stage what did not fit before and keep what they evicted). Adding it,
    rounded up, is enough for every one of the job's versions, so each of
    their rows says the same; it can be more than the least that would do,
    never less. ``after`` is when what is in the way of every one of them is
    free.
    """
    fix = _to_meet(state, job, short)
    if after is not None:
        fix += f", or start {job.name} at {_utc(after, ceil=True)} or later"
    free = max(state.capacity_bytes - kept, 0)
    return (
        f"not enough capacity: needs {format_bytes(missing)}, only {format_bytes(free)} "
        f"free even after evicting everything not needed sooner; {'; '.join(held)}; {fix}"
    )


def _to_meet(state: RegionState, job: Job, short: int) -> str:
    """The capacity advice of a row: the bytes ``job`` as a whole lacks (:class:`_Lacks`)."""
    fix = f"add at least {format_bytes_at_least(short)} to {state.name}"
    if len(job.versions) > 1:
        return f"to meet it, for all of {job.name}'s versions: {fix}"
    return f"to meet it: {fix}"


def _make_room(
    frees: Sequence[_Freed], shortfall: int, begin: datetime, late: datetime, now: datetime
) -> tuple[datetime | None, int, list[tuple[VersionKey, datetime | None]]]:
    """When ``shortfall`` bytes can be freed from ``begin`` to ``late``, the room, what goes.

    Versions no job needs again are evicted if that is enough (:func:`_room_time`),
    else Belady's victims; (None, the room there is, []) if neither makes room in time.
    """
    room = 0
    for spare_needed in (True, False):
        when, room = _room_time(frees, shortfall, begin, late, spare_needed)
        if when is not None:
            victims, _ = _victims(frees, shortfall, when, now, spare_needed)
            return when, room, victims
    return None, room, []


def _room_time(
    frees: Iterable[_Freed],
    shortfall: int,
    begin: datetime,
    late: datetime,
    spare_needed: bool,
) -> tuple[datetime | None, int]:
    """The earliest time from ``begin`` to ``late`` at which evictions free ``shortfall``.

    Tried: ``begin``, then the instants in (``begin``, ``late``] at which room
    frees up (a job reading a resident version ends, a foreign pin runs out:
    ``frees``, from ``room_frees`` in :func:`_plan_region`), earliest first,
    each once. Room only grows with time, so the first that has enough is the
    time the controller, re-planning every round, will act at. With
    ``spare_needed``, only versions no later job needs count. Returns that
    time (None: none has room) and the bytes evictable then (or by the last
    time tried).
    """
    ready = 0
    coming: list[tuple[datetime, int]] = []  # freed later, inside (begin, late]
    for _, held, free, following in frees:
        if spare_needed and following is not None:
            continue
        if free is None or free <= begin:
            ready += held
        elif free <= late:
            coming.append((free, held))
    if ready >= shortfall:
        return begin, ready
    coming.sort()
    for when, held in coming:
        ready += held
        if ready >= shortfall:
            return when, ready
    return None, ready


def _late_reason(
    job: Job,
    spec: str,
    now: datetime,
    begin: datetime,
    finish: datetime,
    duration: timedelta,
    bandwidth: float,
    source: str,
    *,
    held_back: str | None = None,
    blocked: str | None = None,
) -> str:
    """Why ``spec`` cannot be there when ``job`` starts: it already has, or the link is too slow.

    A job that has started is past any deadline, so the transfer time is
    beside the point: what matters is that it runs without the data until
    the version arrives (or to its end, when it would arrive too late).
    ``held_back``: why the transfer cannot begin sooner (a node's room), when
    that, not the link, makes it late. ``blocked``: the job's versions that
    find no room; while they do, no start is advised (the job does not fit
    as it is, and moved, its versions may meet the room in another order).
    """
    if job.start <= now:
        started = f"{job.name} already started at {_utc(job.start)} without {spec}"
        if finish >= job.end:
            ends = f"{job.end.astimezone(UTC):%H:%M}"
            return f"{started}, and it could not arrive before the job ends at {ends}"
        return (
            f"{started}: the plan stages it now, ready about {finish.astimezone(UTC):%H:%M:%S}; "
            "until then the job reads it through to origin, slowly"
        )
    # What to change: the start, to when the data would be there, or the link's speed.
    fixes = [] if blocked else [f"start {job.name} at {_utc(finish, ceil=True)} or later"]
    if held_back is not None:
        why = (
            f"begins at {_utc(begin)} at the earliest ({held_back}), and needs "
            f"{duration.total_seconds():,.0f} s from {source} after that"
        )
    else:
        available = max((job.start - begin).total_seconds(), 0.0)
        why = (
            f"needs {duration.total_seconds():,.0f} s at {_rate(bandwidth)} from {source}, only "
            f"{available:,.0f} s before the start"
        )
        if available > 0:
            link = "origin_bandwidth" if source == "origin" else f"peers.{source}"
            # Rounded up, and a byte/s over (the topology reads a rate as whole bytes/s):
            # the speed advised, written into the topology, makes it in time.
            needed = bandwidth * duration.total_seconds() / available + 1
            fixes.append(
                f"make the link at least {_rate(needed, up=True)} ({link} in the topology)"
            )
    reason = f"{why}; to meet it: {', or '.join(fixes)}" if fixes else why
    if blocked:
        reason += (
            f"; no start is advised while {job.name} does not fit: {blocked} finds no room "
            "(see its row)"
        )
    return reason


def _rate(bytes_per_second: float, *, up: bool = False) -> str:
    """A link speed as people write it: 8 Mbit/s, 2.5 Gbit/s (a fixed Gbit/s showed 0.00).

    ``up``: rounded up to the three digits shown, never down (advice to meet).
    """
    bits = bytes_per_second * 8
    unit, scale = next(
        ((u, x) for u, x in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)) if bits >= x),
        ("bit/s", 1.0),
    )
    value = bits / scale
    if up and value > 0:
        step = 10.0 ** (math.floor(math.log10(value)) - 2)
        value = math.ceil(value / step - 1e-9) * step
    return f"{value:.3g} {unit}"


def _utc(when: datetime, *, ceil: bool = False) -> str:
    """A time in reasons: UTC to the minute (rounded up with ``ceil``, for an earliest start)."""
    when = _minute_up(when) if ceil else when.astimezone(UTC)
    return f"{when:%Y-%m-%d %H:%M}"


def _minute_up(when: datetime) -> datetime:
    """``when`` in UTC, rounded up to the whole minute: a start as the reasons advise it."""
    when = when.astimezone(UTC)
    if when.second or when.microsecond:
        when = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
    return when


# The first instant after a job ends: the planner counts a job as reading its versions
# up to and including its end (nothing it reads is evicted at its end itself), so room a
# job's end frees is there from this much after it. The plan's table and its reasons
# write times to the minute, where this reads as the end; `plan --json` writes the
# instant exactly, `…:00.000001+00:00`. The controller drops a job once its end has come
# and so acts at the end itself, this much sooner.
_AFTER = timedelta(microseconds=1)

_second = itemgetter(1)  # a (key, value) pair's value: sorts dict items by value


_LEAST_MARGIN = timedelta(minutes=5)
_QUARTER_ABOVE_LEAST = 4 * _LEAST_MARGIN  # a transfer longer than this gets a quarter of it


def _margin(duration: timedelta) -> timedelta:
    """Slack left before a job's start when a task starts as late as it can.

    Transfer times are predictions (links and nodes vary): a quarter of the
    transfer, at least five minutes, keeps a just-in-time task from being late
    when it runs a little slow. (Compared first, divided only when a quarter is
    more: the plan asks this ~200,000 times for 10k jobs, mostly of transfers
    under 20 minutes, and a division and a new timedelta each were 7 % of it.)
    """
    return duration / 4 if duration > _QUARTER_ABOVE_LEAST else _LEAST_MARGIN


def _victims(
    frees: Iterable[_Freed],
    shortfall: int,
    when: datetime,
    now: datetime,
    spare_needed: bool = False,
) -> tuple[list[tuple[VersionKey, datetime | None]], int]:
    """Belady: versions evictable at ``when``, never-needed first, then needed furthest ahead.

    With ``spare_needed``, only versions no later job needs (none has to be
    staged again).
    """
    candidates = []
    for held, held_size, free, following in frees:
        if free is not None and free > when:
            continue
        if spare_needed and following is not None:
            continue
        key = (following is not None, -(following or now).timestamp(), -held_size, held)
        candidates.append((key, held, held_size, following))
    candidates.sort()
    picked: list[tuple[VersionKey, int, datetime | None]] = []
    freed = 0
    for _, held, held_size, following in candidates:
        if freed >= shortfall:
            break
        picked.append((held, held_size, following))
        freed += held_size
    # A victim the later ones make unneeded stays: 100 KiB needed furthest ahead, then
    # 101 KiB needed sooner, for 101 KiB short, evicted both, and the first was staged
    # again at once into the room it had left.
    chosen: list[tuple[VersionKey, datetime | None]] = []
    for held, held_size, following in picked:  # the last one picked is always needed
        if freed - held_size >= shortfall:
            freed -= held_size
            continue
        chosen.append((held, following))
    return chosen, freed


def _with_job(task: StageTask, job: str) -> StageTask:
    return replace(task, jobs=(*task.jobs, job))
