"""Planning a schedule: its versions resolved and sized, and each region's room and pins.

:func:`make_plan` gives :func:`edgecache.cache.planner.plan` what the registry and nodes say.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from edgecache.cache import rendezvous
from edgecache.cache.errors import ManifestError, VersionNotFound
from edgecache.cache.manifest import manifest_schema
from edgecache.cache.planner import (
    PRIORITIES,
    Infeasible,
    Job,
    Plan,
    RegionState,
    VersionKey,
    VersionSize,
    plan,
)
from edgecache.cache.registry import Registry
from edgecache.cache.row_grid import fixed_row_bytes
from edgecache.cache.units import format_bytes, format_bytes_at_least
from edgecache.clients.ops.status import (
    Holding,
    NodeReport,
    _resident,
    gather_status,
    holdings,
    region_outages,
    replica_names,
)
from edgecache.clients.ops.warm_record import WarmPin
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

# The package's logger, as before the split: log lines still name edgecache.clients.ops.
log = logging.getLogger(__package__)


DEFAULT_BANDWIDTH = 1e9 / 8  # 1 Gbit/s when neither the file nor the nodes say


# How a spec's reason begins its advice when the registry's record of it no longer parses
# (``plan --status`` words its row by it).
DAMAGED_RECORD = "the registry's record of"


async def resolve_specs(
    registry: Registry, specs: set[str]
) -> tuple[dict[str, pb.Manifest], dict[str, str]]:
    """Manifests of every spec (``latest`` resolved now), and why each other spec cannot be read.

    The reason is the registry's own: it names the registry's URL and says
    whether that exists at all or which versions it holds (a typo in the
    registry URL made every version "not in the registry", with nothing to
    say where the plan had looked).
    """
    found: dict[str, pb.Manifest] = {}
    missing: dict[str, str] = {}
    for spec in sorted(specs):
        try:
            found[spec] = await registry.resolve(spec)
        except VersionNotFound as exc:
            missing[spec] = str(exc)
        except ManifestError as exc:
            # One damaged record stopped the whole plan (and warm, and every controller
            # round) with exit 2 and no word of the jobs that were fine: it is that
            # version's job that cannot be met.
            missing[spec] = (
                f"{str(exc).rstrip('.')}; {DAMAGED_RECORD} {spec} is damaged: restore "
                "it, or publish the data again and point the schedule at the new version"
            )
    return found, missing


def make_plan(
    topology: Topology,
    schedule: Schedule,
    *,
    now: datetime | None = None,
    reports: list[NodeReport] | None = None,
    token: str | None = None,
) -> tuple[Plan, dict[str, pb.Manifest]]:
    """Resolve the schedule against the registry and the nodes, then plan."""
    now = now or datetime.now(UTC)
    reports = gather_status(topology, token=token) if reports is None else reports
    # Jobs that have ended need nothing more: neither staging nor a verdict.
    current = [job for job in schedule.jobs if job.end > now]
    specs = {spec for job in current for spec in job.datasets}

    held_keys = {(v.dataset, v.version) for _, v in _resident(reports)}
    # A pinned version not held (yet) may be another schedule's, whose room the plan keeps:
    # its manifest sizes it.
    held_keys |= {key for key, _ in _pins(reports, now)}

    async def resolve(
        reg: Registry,
    ) -> tuple[dict[str, pb.Manifest], dict[str, str], dict[str, pb.Manifest]]:
        found, absent = await resolve_specs(reg, specs)
        return found, absent, await held_manifests(reg, held_keys, found)

    manifests, missing, others = Registry.run(topology.registry, resolve)
    held = holdings(reports, {**others, **manifests})
    sizes = version_sizes(manifests, held, others=others)
    jobs = [
        Job(
            name=job.name,
            region=job.region,
            start=job.start,
            end=job.end,
            versions=tuple(
                (manifests[s].dataset, manifests[s].version) for s in job.datasets if s in manifests
            ),
            priority=job.priority,
        )
        for job in current
    ]
    outages = region_outages(reports)
    own: dict[tuple[str, VersionKey], datetime] = {}
    for job in jobs:
        for version in job.versions:
            own[(job.region, version)] = max(own.get((job.region, version), job.end), job.end)
    pinned = foreign_pins(reports, own, now)
    reserved = _reserved_room(pinned, held, manifests, others)
    regions = {}
    short_room: dict[str, list[str]] = {}  # region → why its room is less than its capacity
    for name, config in topology.regions.items():
        alive = [r.status for r in reports if r.region == name and r.status is not None]
        held_here = held.get(name, {})
        # The room the nodes use is every copy they store (their used_bytes): a version held
        # whole takes all its copies, and evicting it frees them. Of a version held in part,
        # staging fetches what the nodes' shares lack (its bytes counted once, which is what
        # the plan counts as held); copies beyond the shares stay on their nodes until it is
        # evicted, room the region does not have.
        resident = {v: h.used_bytes for v, h in held_here.items() if h.complete}
        partial = {v: h.stored_bytes for v, h in held_here.items() if not h.complete}
        extra = {v: h.used_bytes - h.stored_bytes for v, h in held_here.items() if not h.complete}
        extra = {v: b for v, b in extra.items() if b > 0}
        # Replicas split shards (rendezvous hashing): their capacities add up, each
        # bounded by the room its cache's disk has left.
        capacity = max(sum(_room(status) for status in alive) - sum(extra.values()), 0)
        disk_bound = [
            r
            for r in reports
            if r.region == name and r.status and _room(r.status) < r.status.capacity_bytes
        ]
        if disk_bound:
            short_room.setdefault(name, []).append(
                "; ".join(
                    f"the cache's disk on {r.address} has "
                    f"{format_bytes(r.status.disk_free_bytes)} "
                    f"free{' (full)' if r.status.disk_full else ''}"
                    for r in disk_bound
                    if r.status is not None
                )
                + ": the room counted is what the disk holds, not --capacity; free space on "
                "the volume or give the cache a larger one"
            )
        if extra:
            short_room.setdefault(name, []).append(
                "; ".join(
                    f"its nodes hold {format_bytes(b)} of {v[0]}@{v[1]} beyond their shares "
                    f"(copies staged while a replica was down), room only evicting "
                    f"{v[0]}@{v[1]} frees"
                    for v, b in sorted(extra.items())
                )
            )
        measured = [s.origin_bytes_per_second for s in alive if s.origin_bytes_per_second]
        # Replicas split shards, so their staging rates add up; one that has not staged yet
        # counts as the average of those that have.
        rates = [s.staging_bytes_per_second for s in alive if s.staging_bytes_per_second]
        staging_rate = sum(rates) / len(rates) * len(alive) if rates else None
        outage = outages.get(name)
        regions[name] = RegionState(
            name=name,
            capacity_bytes=capacity,
            origin_bandwidth=config.origin_bandwidth
            or (min(measured) if measured else DEFAULT_BANDWIDTH),
            resident=resident,
            partial=partial,
            peer_bandwidth=dict(config.peers),
            egress_price_per_gb=config.egress_price_per_gb,
            staging_rate=staging_rate,
            # Nothing can be planned where no node answers; a degraded region is planned
            # on the nodes that did (and the command fails all the same, naming the rest).
            unreachable=outage.message() if outage is not None and outage.unreachable else "",
            pinned=pinned.get(name, {}),
            reserved=reserved.get(name, {}),
        )
    missing_items = [
        (job.name, job.region, spec) for job in current for spec in job.datasets if spec in missing
    ]

    def replan(kept: list[Job], waits: Waits) -> Plan:
        waiting = {
            name: replace(state, not_before={v: w for (r, v), w in waits.items() if r == name})
            for name, state in regions.items()
        }
        return plan(kept, waiting, sizes, now=now, missing=missing_items, why_missing=missing)

    # The per-node check counts another schedule's pinned versions too (their room is
    # kept region-wide above): their manifests size each node's share of them.
    every = {**others, **manifests}
    every_size = version_sizes(every, held)

    placements: dict[str, _Placement | None] = {}

    def unholdable(kept: list[Job], made: Plan) -> Shares:
        return _share_rows(
            topology,
            reports,
            kept,
            every,
            every_size,
            held,
            made,
            now,
            foreign=pinned,
            placements=placements,
        )

    result = holdable_plan(jobs, replan, unholdable, replan(list(jobs), {}))
    result.infeasible.sort(key=lambda i: (i.region, i.job, i.version))
    result.infeasible[:] = [
        replace(row, reason=f"{row.reason} ({'; '.join(short_room[row.region])})")
        if row.region in short_room and "capacity" in row.reason
        else row
        for row in result.infeasible
    ]
    return result, manifests


# (region, version) → (the earliest its staging may begin, why): RegionState.not_before.
Waits = dict[tuple[str, VersionKey], tuple[datetime, str]]
# (version, held from: None for now) → held until: what a region keeps while a job's
# versions are checked; a version staged twice (evicted between) has two entries.
Beside = dict[tuple[VersionKey, datetime | None], datetime]


@dataclass
class Shares:
    """What the region's node split makes of a plan (:func:`_share_rows`).

    ``rows``: versions no split holds beside what the region keeps meanwhile
    (cannot be met). ``waits``: versions a node's share fits beside only once a
    pin there has run out, before their job starts: staged from then on.
    """

    rows: list[Infeasible] = field(default_factory=list)
    waits: Waits = field(default_factory=dict)


def holdable_plan(
    jobs: Sequence[Job],
    replan: Callable[[list[Job], Waits], Plan],
    unholdable: Callable[[list[Job], Plan], Shares],
    result: Plan,
) -> Plan:
    """``result`` made again so that every node holds its share of what it stages.

    A version a node's share fits beside the versions that node keeps only once
    one of their pins runs out (before the version's job starts) begins then:
    staged at the plan's first time, it failed RESOURCE_EXHAUSTED on that node
    every round until the pin ran out, while the plan showed it staged hours
    before. A version no split of a region's nodes holds in time is neither
    staged (its stage failed on the node its shards hash to, and the shards
    the others took stayed pinned there), nor pinned, nor made room for. One
    job at a time, in the planner's order (start, then priority): each job is
    checked beside the jobs before it (:func:`_share_rows`), so of two
    overlapping jobs that each fit alone but not together the later is the one
    that cannot be met, and the first job with rows is dropped first, then all
    checked again (a later job's rows may have been for its versions). Dropping
    the last of them instead dropped a job whose version an earlier one read
    too (freeing nothing), then a job that fit.
    """
    kept, rows = list(jobs), []
    waits: Waits = {}
    while True:
        found = unholdable(kept, result)
        later = {k: w for k, w in found.waits.items() if k not in waits or w[0] > waits[k][0]}
        if later:  # each wait only moves later, to one of finitely many pin ends: it ends
            waits |= later
            result = replan(kept, waits)
            continue
        if not found.rows:
            break
        first = min({row.job for row in found.rows}, key=_job_order(kept))
        dropped = {(row.job, row.version) for row in found.rows if row.job == first}
        rows += [row for row in found.rows if row.job == first]
        kept = [
            replace(
                job,
                versions=tuple(
                    v for v in job.versions if (job.name, f"{v[0]}@{v[1]}") not in dropped
                ),
            )
            for job in kept
        ]
        # The waits were for room beside what is now dropped, among others: found afresh.
        # A task kept waiting "until X is no longer pinned" for an X nothing pins any
        # more was deferred by warm for nothing.
        waits = {}
        result = replan(kept, waits)
    result.infeasible += rows
    return result


def _job_order(jobs: Sequence[Job]) -> Callable[[str], tuple[datetime, int, str]]:
    """A job's place in the planner's order, by name: its start, then its priority."""
    keys = {job.name: (job.start, -PRIORITIES.get(job.priority, 1), job.name) for job in jobs}
    return keys.__getitem__


def _share_rows(
    topology: Topology,
    reports: list[NodeReport],
    jobs: Sequence[Job],
    manifests: Mapping[str, pb.Manifest],
    sizes: Mapping[VersionKey, VersionSize],
    held: Mapping[str, Mapping[VersionKey, Holding]],
    result: Plan,
    now: datetime | None = None,
    *,
    foreign: Mapping[str, Mapping[VersionKey, datetime]] | None = None,
    placements: dict[str, _Placement | None] | None = None,
) -> Shares:
    """The versions, not held yet, that no node split lets their region hold when planned.

    The plan counts a region's capacity as one pool (:func:`share_overflow` says
    why that is not enough). A job's versions are checked from ``now`` (``warm``
    stages every task now) to the end of their pin, node by node, at each
    moment the region's other holdings change: the versions of the jobs before
    it in the planner's order (from their task's start, or now, to their pin's
    end; a version one of them reads is theirs, not this job's) and the nodes'
    own pins, the ones held already at what each node holds of them. A moment
    whose other holdings overflow a node without this job's is theirs, not
    this job's; a later job's versions are checked beside this one's in its
    own turn. Checked against the jobs' own times alone, a version staged an
    hour before its job, while another job's pin still held its node, was said
    to fit, and failed RESOURCE_EXHAUSTED there round after round. Where the
    overflow ends when such a pin runs out, before the first job reading the
    version starts, the versions it is due to wait for it (:class:`Shares`);
    else they cannot be met.
    """
    now = now or datetime.now(UTC)
    by_key = {(m.dataset, m.version): m for m in manifests.values()}
    placements = {} if placements is None else placements  # kept by the caller across calls
    if foreign is None:  # the pins of the schedule's jobs are its own (as make_plan reckons)
        own = {(job.region, v): job.end for job in jobs for v in job.versions}
        foreign = foreign_pins(reports, own, now)
    # Versions a row calls late are still staged and pinned: they take room beside others.
    planned = {(r, t.spec) for r, region_plan in result.regions.items() for t in region_plan.tasks}
    unmet = {
        (row.job, row.version)
        for row in result.infeasible
        if (row.region, row.version) not in planned
    }
    out = Shares()
    order = _job_order(jobs)
    for job in jobs:
        if job.region not in topology.regions:
            continue
        # The jobs before this one in the planner's order were checked first: their
        # versions are kept, this job's own are checked beside them (and beside its
        # versions held whole already, which it keeps).
        before = [
            other
            for other in jobs
            if other.region == job.region and order(other.name) <= order(job.name)
        ]
        earlier = {v for other in before if other is not job for v in other.versions}
        whole = {v for v, h in held.get(job.region, {}).items() if h.complete}
        # Not a version the planner's own rows leave unstaged for this job: it takes no
        # room, and as the one that "overflows alone" it hid the job's other versions.
        staged = [
            by_key[v]
            for v in job.versions
            if v not in whole
            and v in by_key
            and v not in earlier
            and (job.name, f"{v[0]}@{v[1]}") not in unmet
        ]
        if not staged:
            continue
        region_plan = result.regions.get(job.region)
        tasks = list(region_plan.tasks) if region_plan else []
        # A version may be staged twice (evicted in a gap between its jobs): each job's
        # own task says when its copy arrives; taking the last of them for every job hid
        # an earlier copy's room from the jobs beside it.
        serving = {(name, t.version): t for t in tasks for name in t.jobs}
        last = {t.version: t for t in tasks}
        pins = region_plan.pins if region_plan else {}
        mine = [(m.dataset, m.version) for m in staged]
        high = max([pins.get(v, job.end) for v in mine])
        # What the region keeps meanwhile (:data:`Beside`). The
        # nodes' own pins count too: of versions held whole, and another schedule's
        # (:func:`foreign_pins`: room kept from now, as the plan keeps it region-wide).
        # One this schedule set for a version not held yet takes room from its task's
        # start, below: counted from now, it hid a job's overflow until then.
        theirs = foreign.get(job.region, {})
        beside: Beside = {}
        for v, until in _pins(reports, now, region=job.region):
            if (v in whole or (v in by_key and v in theirs)) and v not in mine:
                beside[(v, None)] = max(beside.get((v, None), until), until)
        for other in jobs:
            if other.region != job.region:
                continue
            for v in other.versions:
                if v not in by_key or (other.name, f"{v[0]}@{v[1]}") in unmet or v in mine:
                    continue
                # A later job's staging is checked beside this one in its own turn; a
                # version held whole is there now, whichever job keeps it (one the plan
                # evicts in a gap and stages again is counted throughout).
                if other not in before and v not in whole:
                    continue
                task = serving.get((other.name, v))
                since = task.start if task is not None and v not in whole else None
                until = max(other.end, beside.get((v, since), now))
                if task is None or task is last.get(v):  # pinned to the end from then on
                    until = max(until, pins.get(v, other.end))
                if (since is None or since < high) and until > now:
                    beside[(v, since)] = until
        if job.region not in placements:
            placements[job.region] = _Placement.of(topology, reports, job.region, sizes)
        placement = placements[job.region]
        if placement is None:
            continue  # one node holds everything: the plan's capacity is its own
        check = _ShareCheck(placement, mine, whole, by_key, beside)
        why = check.first_overflow(now, high)
        if why is None:
            continue
        # The first pin end, before this job starts, from which the shares fit. Past an
        # earlier job's start (one task serves both) it is no wait: that job cannot be met
        # (its own check says so), and once it is dropped the task waits for this one.
        for at in sorted({until for until in beside.values() if now < until < job.start}):
            if check.first_overflow(at, high) is None:
                # Only the versions that overflow a node before then, where some do alone.
                waiting = check.alone(now, at) or mine
                waiting_tasks = [
                    serving[(job.name, v)] for v in waiting if (job.name, v) in serving
                ]
                if at >= min((t.deadline for t in waiting_tasks), default=job.start):
                    break
                ending = sorted({v for (v, _), until in beside.items() if until <= at})
                names = ", ".join(f"{d}@{n}" for d, n in ending)
                note = (
                    f"waits for room on one node until {names} "
                    f"{'is' if len(ending) == 1 else 'are'} no longer pinned: before then, {why}"
                )
                for v in waiting:
                    out.waits[(job.region, v)] = (at, note)
                break
        else:
            for v in _to_drop(check, now, high):
                spec = f"{v[0]}@{v[1]}"
                if (job.name, spec) not in unmet:
                    out.rows.append(Infeasible(job.name, job.region, spec, why))
    return out


def _to_drop(check: _ShareCheck, now: datetime, high: datetime) -> list[VersionKey]:
    """The versions of a job that cannot be met for a node's share: as few as will do.

    Those that overflow a node alone; where only together, the largest (by
    stored bytes, then name), and the check runs again without it. All of
    them were dropped: a job reading one version that never fits and one
    that does lost both, and one reading two that fit only apart was told
    neither could be met while one of them stayed staged for another job.
    """
    return check.alone(now, high) or [
        max(check.mine, key=lambda v: (check.placement.sizes[v].stored, v))
    ]


@dataclass(frozen=True)
class _ShareCheck:
    """:func:`share_overflow` of one job's versions beside what the region keeps over time.

    ``beside``: what the region keeps meanwhile (:data:`Beside`).
    """

    placement: _Placement
    mine: list[VersionKey]
    whole: set[VersionKey]
    by_key: Mapping[VersionKey, pb.Manifest]
    beside: Beside

    def first_overflow(self, begin: datetime, end: datetime) -> str | None:
        """Why ``mine`` overflows a node at some moment in [begin, end); or None.

        The moments are ``begin`` and each start and end of another holding
        after it (what is held only changes then: checked at starts only, a node
        full of another schedule's pinned room until its pin ran out hid this
        job's overflow after it, and warm failed RESOURCE_EXHAUSTED there). A
        node the other holdings overflow without ``mine`` is not ``mine``'s doing.
        Of several moments, the one that lacks the most bytes: its advice ("give
        NODE at least …") is then enough for them all.
        """
        changes = {t for (_, since), until in self.beside.items() for t in (since, until) if t}
        # A node ``mine`` overflows by itself is never the others' doing: one that another
        # schedule's pinned room (larger than the node) overflowed spared it, and a
        # version that could never fit there was staged onto it.
        alone = self._overflow(self.mine)
        own = alone.nodes if alone is not None else frozenset()
        worst: _Overflow | None = None
        for at in [begin, *sorted(t for t in changes if begin < t < end)]:
            held = sorted(
                {
                    v
                    for (v, since), until in self.beside.items()
                    if (since is None or since <= at) and until > at
                }
            )
            # A node the others overflow alone is theirs: their jobs' checks say it. Only
            # that node: one node full of theirs hid this job's overflow of another.
            theirs = self._overflow(held)
            spared = theirs.nodes - own if theirs is not None else frozenset()
            found = self._overflow([*self.mine, *held], spared)
            if found is not None and (worst is None or found.lacking > worst.lacking):
                worst = found
        return worst.why if worst is not None else None

    def alone(self, begin: datetime, end: datetime) -> list[VersionKey]:
        """Those of ``mine`` that overflow a node in [begin, end) without the others."""
        return [v for v in self.mine if replace(self, mine=[v]).first_overflow(begin, end)]

    def _overflow(
        self, needed: Sequence[VersionKey], spared: Collection[str] = ()
    ) -> _Overflow | None:
        return self.placement.overflow(
            {v: self.by_key[v] for v in needed if v not in self.whole},
            kept=[v for v in needed if v in self.whole],
            spared=spared,
        )


def share_overflow(
    topology: Topology,
    reports: list[NodeReport],
    region: str,
    manifests: Sequence[pb.Manifest],
    sizes: Mapping[VersionKey, VersionSize],
    kept: Sequence[VersionKey] = (),
) -> str | None:
    """Why the region's nodes cannot hold these versions at once, node by node; or None.

    Replicas split a version's shards by rendezvous hashing over the nodes that
    answer, and each node keeps its share in its own cache: the capacities add
    up only as far as the shares are even. Two versions of four large shards
    in a region of two 2.5 MiB nodes (3.5 MiB in all, in 5 MiB) put all four on
    one node: plan and its dry run said they fit, and every warm failed there
    RESOURCE_EXHAUSTED. A share's bytes are the version's stored bytes in the
    proportion of its shards' source bytes. ``kept``: versions the region holds
    whole and keeps meanwhile, counted at what each node holds of them.
    """
    placement = _Placement.of(topology, reports, region, sizes)
    if placement is None:
        return None
    found = placement.overflow({(m.dataset, m.version): m for m in manifests}, kept)
    return found.why if found is not None else None


@dataclass
class _Placement:
    """Each node's room in one region and each version's share of it, worked out once.

    Where every shard lies is fixed within a plan (the nodes that answered, their
    ids), and the per-node check asks the same versions again at every moment
    of every job's check, each drop of a version, each re-plan: hashing every
    shard each time made ``plan`` of 50 jobs take 26 s instead of 3.
    """

    nodes: list[str]
    room: dict[str, int]
    names: dict[str, str]
    sizes: Mapping[VersionKey, VersionSize]
    resident: dict[VersionKey, dict[str, int]]  # what each node holds of a version now
    shares: dict[VersionKey, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        topology: Topology,
        reports: list[NodeReport],
        region: str,
        sizes: Mapping[VersionKey, VersionSize],
    ) -> _Placement | None:
        """The region's placement; None where fewer than two nodes answer (one holds all)."""
        room = {
            r.address: _room(r.status)
            for r in reports
            if r.region == region and r.status is not None
        }
        nodes = [node for node in topology.regions[region].nodes if node in room]
        if len(nodes) < 2:
            return None
        resident: dict[VersionKey, dict[str, int]] = {}
        for report, v in _resident(reports):
            if report.address in room:
                on = resident.setdefault((v.dataset, v.version), {})
                on[report.address] = on.get(report.address, 0) + v.stored_bytes
        return cls(nodes, room, replica_names(reports), sizes, resident)

    def share(self, manifest: pb.Manifest) -> tuple[dict[str, int], dict[str, int]]:
        """Node → the stored bytes of ``manifest``'s version it keeps, and its shards."""
        key = (manifest.dataset, manifest.version)
        if key not in self.shares:
            share = dict.fromkeys(self.nodes, 0)
            owned = dict.fromkeys(self.nodes, 0)
            stored, source = self.sizes[key].stored, sum(s.source_size for s in manifest.shards)
            for index, shard in enumerate(manifest.shards):
                node = rendezvous.owner(self.nodes, *key, index, names=self.names)
                part = shard.source_size / source if source else 1 / len(manifest.shards)
                share[node] += math.ceil(stored * part)
                owned[node] += 1
            self.shares[key] = (share, owned)
        return self.shares[key]

    def overflow(
        self,
        manifests: Mapping[VersionKey, pb.Manifest],
        kept: Collection[VersionKey] = (),
        spared: Collection[str] = (),
    ) -> _Overflow | None:
        """The nodes ``manifests`` (not held yet) and ``kept`` (held whole) overflow.

        ``spared``: nodes not to count (others overflow them without these versions).
        """
        share = dict.fromkeys(self.nodes, 0)
        owned = dict.fromkeys(self.nodes, 0)
        holds = dict.fromkeys(self.nodes, 0)  # of the kept versions
        for key in kept:
            for node, held in self.resident.get(key, {}).items():
                if node in holds:
                    holds[node] += held
        for manifest in manifests.values():
            bytes_on, shards_on = self.share(manifest)
            for node in self.nodes:
                share[node] += bytes_on[node]
                owned[node] += shards_on[node]
        over = [n for n in self.nodes if n not in spared and share[n] + holds[n] > self.room[n]]
        if not over:
            return None
        node = max(over, key=lambda n: share[n] + holds[n] - self.room[n])
        lacking = share[node] + holds[node] - self.room[node]

        def why() -> str:
            # Sorted: the words must not change with the order of the schedule's jobs.
            specs = ", ".join(sorted(f"{d}@{n}" for d, n in manifests))
            shards = sum(len(m.shards) for m in manifests.values())
            beside = (
                f" beside the {format_bytes(holds[node])} it holds of "
                f"{', '.join(sorted(f'{d}@{n}' for d, n in kept))}, kept meanwhile,"
                if holds[node]
                else ""
            )
            return (
                f"{node}'s share of {specs} ({owned[node]} of {shards} shards, "
                f"{format_bytes(share[node])}){beside} is more than its cache holds "
                f"({format_bytes(self.room[node])}): replicas split a version's shards by "
                "hash and each keeps its own share, so the region's capacities add up only "
                f"as far as the shares are even; give {node} at least "
                f"{format_bytes_at_least(lacking)} more (its --capacity), "
                "or publish the versions with more, smaller shards"
            )

        return _Overflow(lacking, frozenset(over), why)


@dataclass(frozen=True)
class _Overflow:
    """Nodes a set of versions overflows: the worst one's shortfall, all of them, and why."""

    lacking: int
    nodes: frozenset[str]
    say: Callable[[], str]  # the words, made only for the overflow that is shown

    @property
    def why(self) -> str:
        return self.say()


def _room(status: edge_pb2.NodeStatus) -> int:
    """What a node's cache can hold: its capacity, or less where its disk has less left.

    A cache of ``--capacity 64MiB`` on a 6 MiB volume was planned as 64 MiB: the
    plan said the job was met, and every warm and controller round failed
    RESOURCE_EXHAUSTED. Evicting frees pages inside the LMDB file for new
    chunks, so the bound is what is held plus what the disk has free. A node
    that reports no free bytes and no full disk (a release before it said)
    is taken at its capacity.
    """
    if not status.disk_free_bytes and not status.disk_full:
        return status.capacity_bytes
    return min(status.capacity_bytes, status.used_bytes + status.disk_free_bytes)


def _pins(
    reports: list[NodeReport], now: datetime, region: str | None = None
) -> Iterator[tuple[VersionKey, datetime]]:
    """Each pin an answering node (of ``region``) holds that has not run out: (version, until)."""
    for report in reports:
        if report.status is None or region not in (None, report.region):
            continue
        for v in report.status.versions:
            if v.HasField("pinned_until"):
                until = v.pinned_until.ToDatetime(tzinfo=UTC)
                if until > now:
                    yield (v.dataset, v.version), until


def _reserved_room(
    pinned: dict[str, dict[VersionKey, datetime]],
    held: dict[str, dict[VersionKey, Holding]],
    manifests: dict[str, pb.Manifest],
    others: dict[str, pb.Manifest],
) -> dict[str, dict[VersionKey, int]]:
    """Region → version → the stored bytes another schedule's pinned version still lacks there.

    Warm pins every version a job reads, and stages one that does not fit yet
    later (deferred until a job ends); the controller stages it in its time.
    Until then the pin holds no data, and a plan counting only what is held
    gave its room to another schedule, whose job then could not be met. A
    version whose manifest is gone cannot be staged, so it keeps no room.
    """
    by_key = {(m.dataset, m.version): m for m in [*others.values(), *manifests.values()]}
    lacking = {
        (region, key)
        for region, versions in pinned.items()
        for key in versions
        if key in by_key and not (held.get(region, {}).get(key) or Holding()).complete
    }
    wanted = {f"{d}@{v}": by_key[(d, v)] for _, (d, v) in lacking}
    sizes = version_sizes(wanted, held, others={**others, **manifests})
    out: dict[str, dict[VersionKey, int]] = {}
    for region, key in lacking:
        have = held.get(region, {}).get(key)
        rest = sizes[key].stored - (have.stored_bytes if have is not None else 0)
        if rest > 0:
            out.setdefault(region, {})[key] = rest
    return out


def foreign_pins(
    reports: list[NodeReport], own: dict[tuple[str, VersionKey], datetime], now: datetime
) -> dict[str, dict[VersionKey, datetime]]:
    """Region → version → until when its nodes pin it for jobs other than ``own``'s.

    ``own`` is (region, version) → the end of the last job of the schedule at
    hand that reads it there: the pin warm and the controller place for it. A
    node's pin that has not run out and lasts longer than that (or pins a
    version the schedule does not read there) is another schedule's, which
    counts on the version staying: neither the plan nor the executor may evict
    it before then, as ``edgecache evict`` refuses to.
    """
    out: dict[str, dict[VersionKey, datetime]] = {}
    for report in reports:
        if report.status is None:
            continue
        for v in report.status.versions:
            if not v.HasField("pinned_until"):
                continue
            key, until = (v.dataset, v.version), v.pinned_until.ToDatetime(tzinfo=UTC)
            ours = own.get((report.region, key))
            if until <= now or (ours is not None and until <= ours + timedelta(seconds=1)):
                continue
            region = out.setdefault(report.region, {})
            region[key] = max(region.get(key, until), until)
    return out


def without_pins(reports: Sequence[NodeReport], pins: Sequence[WarmPin]) -> list[NodeReport]:
    """``reports`` as they would read once ``pins`` are released (or shortened): copies.

    ``warm --dry-run`` plans on this, so it shows what the real run, which
    releases the pins first and then asks the nodes again, carries out.
    """
    gone = {(pin.node, pin.key): pin.shorten_to for pin in pins}
    out = []
    for report in reports:
        if report.status is not None and any(node == report.address for node, _ in gone):
            status = edge_pb2.NodeStatus()
            status.CopyFrom(report.status)
            for v in status.versions:
                key = (report.address, (v.dataset, v.version))
                if key in gone:
                    if (shorter := gone[key]) is not None:
                        v.pinned_until.FromDatetime(shorter.astimezone(UTC).replace(tzinfo=None))
                    else:
                        v.ClearField("pinned_until")
            report = replace(report, status=status)
        out.append(report)
    return out


async def held_manifests(
    registry: Registry, held: set[VersionKey], known: dict[str, pb.Manifest]
) -> dict[str, pb.Manifest]:
    """Manifests of the versions nodes hold that ``known`` lacks (gone or unreadable: left out).

    A held version's stored bytes against its manifest's source bytes is the
    stored/source ratio that sizes the versions no node holds yet, so every
    held version counts, not only those a schedule reads. These serve only
    that estimate, so one that cannot be had is skipped: a version deleted
    from the registry silently, one whose manifest cannot be parsed with a
    warning naming it (left to fail, it would stop every plan, warm and
    controller round over a version no job reads).
    """
    have = {(m.dataset, m.version) for m in known.values()}

    async def one(dataset: str, version: int) -> pb.Manifest | None:
        try:
            return await registry.manifest(dataset, version)
        except VersionNotFound:
            return None
        except ManifestError as exc:
            log.warning(
                "%s@%d, held or pinned by a node, is left out of the size estimates: its manifest "
                "cannot be read (%s)",
                dataset,
                version,
                exc,
            )
            return None

    found = await asyncio.gather(*(one(d, v) for d, v in sorted(held - have)))
    return {f"{m.dataset}@{m.version}": m for m in found if m is not None}


def version_sizes(
    manifests: dict[str, pb.Manifest],
    held: dict[str, dict[VersionKey, Holding]],
    *,
    others: dict[str, pb.Manifest] | None = None,
) -> dict[VersionKey, VersionSize]:
    """Stored and source bytes of every version in ``manifests``: stored as held, else estimated.

    Preprocessing changes size a lot (Parquet → Arrow grows, JSON text → zstd
    shrinks, and a version stored uncompressed grows about three times more
    than one byte-split and compressed), so source bytes alone would misjudge
    capacity. A version no region holds whole is estimated, in this order, from:

    1. the stored/source ratio of the dataset's held versions with the same
       chunk codec (same data, same preprocessing, as a rule);
    2. for an uncompressed version with fixed-width rows, its rows times their
       decoded width: what it will store, whatever anything else holds;
    3. that ratio over the held versions of the same codec, then over the
       dataset's held versions whatever their codec, then over everything held;
       else 1.

    (A version's own shards held by a region say little of the rest: shards
    differ in size, and a status says how many are held, not which.)

    The ratio of versions of another codec came before these: a `none` version
    of a dataset held compressed elsewhere was planned at a third of its size,
    and staging it failed on a full cache the plan had said it would fit.
    ``others`` are the manifests of held versions that ``manifests`` lacks
    (versions no job reads): their ratios count too, though they get no size of
    their own.
    """
    every = {(m.dataset, m.version): m for m in [*(others or {}).values(), *manifests.values()]}
    source = {key: sum(s.source_size for s in m.shards) for key, m in every.items()}
    wanted = {(m.dataset, m.version) for m in manifests.values()}
    stored: dict[VersionKey, int] = {}
    for region in held.values():
        for key, holding in region.items():
            if holding.complete:
                stored[key] = max(stored.get(key, 0), holding.stored_bytes)
    ratios: dict[tuple[str | None, int | None], list[float]] = {}
    for key, size in stored.items():
        if source.get(key):
            ratio = size / source[key]
            codec = _codec(every[key])
            for group in ((key[0], codec), (None, codec), (key[0], None), (None, None)):
                ratios.setdefault(group, []).append(ratio)
    sizes = {}
    for key in sorted(wanted):
        source_bytes = source[key]
        if key in stored:
            sizes[key] = VersionSize(stored=stored[key], source=source_bytes)
            continue
        manifest, codec = every[key], _codec(every[key])
        estimate: float | None = None
        if known := ratios.get((key[0], codec)):
            estimate = source_bytes * sum(known) / len(known)
        elif codec == pb.COMPRESSION_NONE and (decoded := _decoded_bytes(manifest)) is not None:
            estimate = decoded
        else:
            groups = ((None, codec), (key[0], None), (None, None))
            known = next((ratios[g] for g in groups if g in ratios), [1.0])
            estimate = source_bytes * sum(known) / len(known)
        sizes[key] = VersionSize(stored=max(int(estimate), 1), source=source_bytes)
    return sizes


def _codec(manifest: pb.Manifest) -> int:
    """The version's chunk codec; versions from before the choice are plain zstd."""
    compression = manifest.preprocess.compression
    return pb.COMPRESSION_ZSTD if compression == pb.COMPRESSION_UNSPECIFIED else compression


def _decoded_bytes(manifest: pb.Manifest) -> float | None:
    """Rows × decoded row width where every column has a fixed width; None otherwise."""
    try:
        width = fixed_row_bytes(manifest_schema(manifest))
    except ManifestError:
        return None
    rows = sum(s.row_count for s in manifest.shards)
    return None if width is None or not rows else rows * width
