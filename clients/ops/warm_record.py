"""``warm``'s record in the registry (``_warm/jobs.json``): the jobs it pinned for, its pins.

Read to release the pins a schedule no longer needs, and to name a pin's job in refusals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgecache.cache.errors import EdgeCacheError, ObjectNotFound, OriginError
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import Plan, VersionKey
from edgecache.cache.storage import Stores
from edgecache.clients.ops.at_start import Known, versions_at
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import manifest_pb2 as pb

# The package's logger, as before the split: log lines still name edgecache.clients.ops.
log = logging.getLogger(__package__)


WARMED_JOBS = "_warm/jobs.json"  # in the registry: the jobs warm pinned versions for


@dataclass(frozen=True)
class PinnedJob:
    """A scheduled job whose versions were pinned for it, as whoever pinned them recorded it."""

    name: str
    region: str
    start: datetime
    end: datetime
    versions: tuple[str, ...]  # name@N
    # Who pinned for it: "warm" (with the schedule file it ran, "" in a record older than
    # that) or "controller"; an eviction refusal names the command that releases the pin.
    by: str = "warm"
    schedule: str = ""


@dataclass(frozen=True)
class WarmPin:
    """A pin ``warm`` placed on a node, as its record keeps it: the schedule it ran owns it.

    Kept so a later warm of the same schedule file can release it once no job
    of that schedule reads the version there (a job removed or moved), as the
    controller releases its own; without it the pin stayed to its old end and
    only ``evict --force`` could free the room.
    """

    schedule: str  # the schedule file warm ran, as an absolute path
    node: str
    region: str
    version: str  # name@N
    until: datetime
    # Set by dropped_warm_pins: not released but shortened to this time, because a job
    # another record holds still reads the version there until then (see there).
    shorten_to: datetime | None = None

    @property
    def key(self) -> VersionKey:
        """The version as the plan and the nodes name it."""
        dataset, _, number = self.version.rpartition("@")
        return dataset, int(number)


def local_registry(registry: str) -> str | None:
    """The directory of a registry on this machine's filesystem, or None for an object store."""
    if registry.startswith("file://"):
        return registry[len("file://") :]
    return None if "://" in registry else registry


def schedule_owner(path: str | os.PathLike[str]) -> str:
    """How warm's record names a schedule file: its absolute path, whatever the cwd."""
    return str(Path(path).resolve())


def record_warmed_jobs(
    topology: Topology,
    schedule: Schedule,
    manifests: dict[str, pb.Manifest],
    now: datetime,
    *,
    owner: str = "",
    plan: Plan | None = None,
    unreleased: Sequence[WarmPin] = (),
) -> None:
    """Record in the registry which jobs ``warm`` pins versions for, so ``evict`` can name them.

    The controller keeps its own record (``_controller/state.json``); this is
    warm's (``_warm/jobs.json``). A warm run owns what an earlier run of the
    same schedule file (``owner``) recorded: those jobs and pins are replaced
    by this run's (a job removed from the schedule goes), while other
    schedules' are kept until they end, so warm runs of two schedules do not
    erase each other's, whatever their jobs are named: two schedule files may
    each have an ``etl`` (keyed by name alone, the second replaced the first,
    whose pins then named no job and ``evict`` said nobody would release them).
    ``plan``'s pins are recorded as placed on every node of their region;
    ``unreleased`` are this schedule's earlier pins that no job reads any
    more but that could not be released yet (a node down): kept, to be
    released by the next run. Its earlier pins on nodes ``topology`` does not
    list are kept too, until they run out.
    """
    local = local_registry(topology.registry)
    if local is not None and not os.path.isdir(local):
        # A mistyped local registry: its versions did not resolve, so nothing was pinned;
        # writing the record would create the folder, a new empty registry hiding the typo.
        return
    old_jobs, old_pins = _warm_record(topology.registry)
    mine = bool(owner)
    kept = {
        (job.schedule, job.name): job
        for job in old_jobs
        if job.end > now and not (mine and job.schedule == owner)
    }
    for job in schedule.jobs:
        if job.end > now:
            versions = tuple(
                f"{manifests[s].dataset}@{manifests[s].version}"
                for s in job.datasets
                if s in manifests
            )
            kept[(owner, job.name)] = PinnedJob(
                job.name, job.region, job.start, job.end, versions, schedule=owner
            )
    pins = [p for p in old_pins if p.until > now and not (mine and p.schedule == owner)]
    pins += unreleased
    # This schedule's pins on nodes this topology does not list (an earlier run's other
    # --config) are not this run's to see or release: kept until they run out, whatever
    # the plan says. Replaced by this run's, they were forgotten while the nodes kept them.
    held = {(p.node, p.region, p.version) for p in pins}
    pins += [
        p
        for p in old_pins
        if mine
        and p.schedule == owner
        and p.until > now
        and not topology.lists(p.node, p.region)
        and (p.node, p.region, p.version) not in held
    ]
    if plan is not None and mine:
        for region, region_plan in plan.regions.items():
            for node in topology.regions[region].nodes:
                for version, until in sorted(region_plan.pins.items()):
                    spec = f"{version[0]}@{version[1]}"
                    pins.append(WarmPin(owner, node, region, spec, until))
    body = json.dumps(
        {
            "jobs": [
                {
                    "name": job.name,
                    "region": job.region,
                    "start": job.start.isoformat(),
                    "end": job.end.isoformat(),
                    "versions": list(job.versions),
                    "schedule": job.schedule,
                }
                for job in sorted(kept.values(), key=lambda j: (j.start, j.name))
            ],
            "pins": [
                {
                    "schedule": pin.schedule,
                    "node": pin.node,
                    "region": pin.region,
                    "version": pin.version,
                    "until": pin.until.isoformat(),
                }
                for pin in sorted(pins, key=lambda p: (p.schedule, p.node, p.version))
            ],
        },
        indent=1,
    ).encode()
    url = _warmed_jobs_url(topology.registry)

    async def write() -> None:
        stores = Stores()
        try:
            await stores.for_url(url).put(url, body)
        finally:
            await stores.close()

    asyncio.run(write())


def dropped_warm_pins(
    topology: Topology,
    owner: str,
    plan: Plan,
    now: datetime,
    *,
    readers: dict[tuple[str, str], datetime] | None = None,
) -> list[WarmPin]:
    """The pins an earlier warm of schedule ``owner`` placed that its plan no longer keeps so.

    Their job was removed from the schedule (or moved, or reads another
    version now): warm releases them, as the controller releases its own. A
    pin still needed by a job another schedule's warm or the controller
    recorded (same region, same version, not ended) is left to that record:
    not returned when it ends by that job's end, and returned with
    ``shorten_to`` (that job's end) when it outlasts it. A pin the plan still
    keeps, but to an earlier time (the schedule moved its job's end earlier),
    is returned with ``shorten_to`` the plan's time, or the other record's
    job's end when that is later. A node keeps one pin time per version, and
    warm's Pin never shortens one (it may be another schedule's): left as it
    was, such a pin outlived every job, since a later release found another
    time on the node than the one recorded, and only ``evict --force`` freed
    the room. ``readers`` is :func:`other_readers` for ``owner``, when the
    caller has it. A record that cannot be read gives nothing.
    """
    try:
        _, pins = _warm_record(topology.registry)
    except OriginError as exc:
        _unreadable_record(_warmed_jobs_url(topology.registry), exc)
        return []
    if readers is None:
        readers = other_readers(topology, owner, now)
    dropped = []
    for pin in pins:
        if pin.schedule != owner or pin.until <= now:
            continue
        region_plan = plan.regions.get(pin.region)
        needed = [
            until
            for until in (
                region_plan.pins.get(pin.key) if region_plan is not None else None,
                readers.get((pin.region, pin.version)),
            )
            if until is not None
        ]
        if not needed:
            dropped.append(pin)
        elif pin.until - max(needed) > timedelta(seconds=1):
            dropped.append(replace(pin, shorten_to=max(needed)))
    return dropped


def other_readers(topology: Topology, owner: str, now: datetime) -> dict[tuple[str, str], datetime]:
    """(region, name@N) → the end of the last job reading it there that others recorded.

    Others: the controller, and warm runs of schedules other than ``owner``;
    jobs that have ended are left out. A pin on a node that lasts longer than
    ``owner``'s plan keeps it is theirs only when one of these jobs ends then
    (:func:`pinned_jobs`, whose records that cannot be read are left out).
    """
    out: dict[tuple[str, str], datetime] = {}
    for job in pinned_jobs(topology):
        if job.end <= now or (job.by == "warm" and job.schedule == owner):
            continue
        for spec in job.versions:
            out[(job.region, spec)] = max(out.get((job.region, spec), job.end), job.end)
    return out


def warm_readers(registry: str, now: datetime) -> dict[tuple[str, str], datetime]:
    """(region, name@N) → the end of the last job in warm's record (any schedule) reading it.

    Jobs that have ended are left out. The controller releases a pin only
    when no such job needs it, and shortens its own no further than their end:
    warm and the controller pin a version a job of both reads at the same
    time, so the controller took warm's pin for its own, and its next schedule
    released what warm's jobs still read. A record origin will not give is
    :class:`OriginError`, raised.
    """
    jobs, _ = _warm_record(registry)
    out: dict[tuple[str, str], datetime] = {}
    for job in jobs:
        if job.end > now:
            for spec in job.versions:
                out[(job.region, spec)] = max(out.get((job.region, spec), job.end), job.end)
    return out


def warm_started(
    schedule: Schedule,
    registry: str,
    now: datetime,
    skip: Set[str],
    owner: str = "",
    known: Known | None = None,
) -> Schedule:
    """The schedule with each started job reading the versions warm pinned for it.

    The controller's record keeps what a job's ``name`` resolved to at its start
    (:func:`~edgecache.clients.controller.as_started`); warm run alone (from cron,
    say) had only its own record, which plan and warm did not read: a version
    published after the job started was staged and pinned for it, and the pin
    of the one it reads released, for ``evict`` to free under the running job.
    A started job warm recorded (the same name, region and start) reads the
    version newest at its start by the registry's publish times (warm's record
    is of its last run, which may be hours before the start, when the job's
    reader resolved ``name``), the recorded one where the registry cannot say
    (:func:`_as_recorded`); ``skip``: jobs the
    controller's record covers; ``owner``: the schedule file's
    (:func:`schedule_owner`), whose own record is read, not another schedule's
    job of the same name, region and start; ``known``: see
    :func:`~edgecache.clients.ops.at_start.versions_at`. A record origin will
    not give is :class:`OriginError`, raised.
    """
    if not any(job.start <= now < job.end and job.name not in skip for job in schedule.jobs):
        return schedule
    recorded = {
        (j.name, j.region, j.start): j
        for j in _warm_record(registry)[0]
        if not owner or j.schedule in (owner, "")
    }
    started = [
        (job, record)
        for job in schedule.jobs
        if job.start <= now
        and job.name not in skip
        and (record := recorded.get((job.name, job.region, job.start))) is not None
        and record.versions
    ]
    asked = {
        (parse_spec(spec).dataset, job.start)
        for job, _ in started
        for spec in job.datasets
        if parse_spec(spec).version is None
    }
    try:
        at = versions_at(registry, asked, known)
    except EdgeCacheError:
        at = None  # the registry cannot say: the records stand
    read = {(job.name, job.region, job.start): record for job, record in started}
    jobs = []
    for job in schedule.jobs:
        record = read.get((job.name, job.region, job.start))
        if record is not None:
            datasets = [_as_recorded(spec, record.versions, job.start, at) for spec in job.datasets]
            job = job.model_copy(update={"datasets": list(dict.fromkeys(datasets))})
        jobs.append(job)
    return schedule.model_copy(update={"jobs": jobs})


def _as_recorded(
    spec: str,
    versions: Sequence[str],
    start: datetime,
    at: Mapping[tuple[str, datetime], tuple[int, bool]] | None,
) -> str:
    """``spec`` (``name``, ``name@latest``) as the job read it from ``start``; ``name@N`` as is.

    The version newest at ``start`` by the registry's publish times (``at``:
    :func:`~edgecache.clients.ops.at_start.versions_at`), left as ``spec`` when
    it is the newest still; the recorded ``name@N`` where the registry cannot
    say. Compared with the newest alone, a record of ``@1`` stood when ``@2``
    came before the start and ``@3`` after it: the job reads ``@2``.
    """
    wanted = parse_spec(spec)
    if wanted.version is not None:
        return spec
    same = [v for v in versions if v.rpartition("@")[0] == wanted.dataset]
    if not same:
        return spec
    if at is None:
        return max(same, key=lambda v: int(v.rpartition("@")[2]))
    found = at.get((wanted.dataset, start))
    if found is None:  # none published by the start: the record is all there is
        return max(same, key=lambda v: int(v.rpartition("@")[2]))
    number, newest = found
    return spec if newest else f"{wanted.dataset}@{number}"


def _warmed_jobs_url(registry: str) -> str:
    return f"{registry.rstrip('/')}/{WARMED_JOBS}"


def _warmed_jobs(registry: str) -> list[PinnedJob]:
    """The jobs :func:`record_warmed_jobs` recorded (see :func:`_warm_record`)."""
    return _warm_record(registry)[0]


def _warm_record(registry: str) -> tuple[list[PinnedJob], list[WarmPin]]:
    """What :func:`record_warmed_jobs` recorded: nothing if warm never ran or it does not parse.

    A record origin will not give is :class:`OriginError`, raised: ``warm`` then
    warns instead of writing over the jobs of earlier runs after a passing
    failure, and :func:`pinned_jobs`, which only names jobs, goes on without it.
    A record written before warm kept its pins (a bare list of jobs) has jobs
    owned by no schedule and no pins.
    """
    url = _warmed_jobs_url(registry)

    async def read() -> bytes | None:
        stores = Stores()
        try:
            return await stores.for_url(url).get(url)
        except ObjectNotFound:
            return None
        finally:
            await stores.close()

    raw = asyncio.run(read())
    try:
        data = json.loads(raw or b"[]")
        if isinstance(data, list):
            data = {"jobs": data, "pins": []}
        jobs = [
            PinnedJob(
                j["name"],
                j["region"],
                datetime.fromisoformat(j["start"]),
                datetime.fromisoformat(j["end"]),
                tuple(j["versions"]),
                schedule=str(j.get("schedule", "")),
            )
            for j in data.get("jobs", [])
        ]
        pins = [
            WarmPin(
                str(p["schedule"]),
                str(p["node"]),
                str(p["region"]),
                str(p["version"]),
                datetime.fromisoformat(p["until"]),
            )
            for p in data.get("pins", [])
        ]
        if not all(pin.version.rpartition("@")[2].isdigit() for pin in pins):
            raise ValueError("a pin's version is not NAME@N")
    except (ValueError, TypeError, KeyError, AttributeError):
        return [], []  # a record that cannot be read only costs the job's name in a message
    return jobs, pins


def pinned_jobs(topology: Topology) -> list[PinnedJob]:
    """The jobs pins were set for: the controller's record, and warm's jobs it lacks.

    The names only explain an eviction refusal, so a record that cannot be read
    (origin failing, a damaged file) is left out with a warning: the refusal
    stands (exit 2), it must not turn into a failure (exit 1).
    """
    from edgecache.clients.controller import STATE_NAME, read_state  # it builds on ops

    # Keyed by what a job is and who recorded it, not its name alone: warm's schedule and
    # the controller's may each have a job of one name (the demo's eval-us and yours), and
    # the one that holds the pin must not be dropped for the other. The same job in both
    # records is kept twice: each releases the pin only once its own schedule drops the
    # job, and an eviction refusal that named the controller alone sent the operator
    # round twice.
    jobs: dict[tuple[object, ...], PinnedJob] = {}

    def key(job: PinnedJob) -> tuple[object, ...]:
        return (job.name, job.region, job.start, job.end, tuple(job.versions), job.by, job.schedule)

    try:
        state = read_state(topology.registry)
        for job in state.jobs.values() if state else []:
            pinned = PinnedJob(
                job.name,
                job.region,
                datetime.fromisoformat(job.start),
                datetime.fromisoformat(job.end),
                tuple(job.versions),
                by="controller",
            )
            jobs[key(pinned)] = pinned
    except (OriginError, ValueError, TypeError) as exc:
        _unreadable_record(f"{topology.registry.rstrip('/')}/{STATE_NAME}", exc)
    try:
        warmed = _warmed_jobs(topology.registry)
    except OriginError as exc:
        _unreadable_record(_warmed_jobs_url(topology.registry), exc)
        warmed = []
    for pinned in warmed:
        jobs.setdefault(key(pinned), pinned)
    return sorted(jobs.values(), key=lambda j: (j.start, j.name, j.region, j.by))


def _unreadable_record(url: str, exc: BaseException) -> None:
    log.warning("cannot read %s, so the jobs it records go unnamed: %s", url, exc)


def _job_times(job: PinnedJob, now: datetime) -> str:
    """``name (region, starts …, until … UTC)``: a job as an eviction refusal names it."""
    start = f"{job.start.astimezone(UTC):%Y-%m-%d %H:%M}"
    when = f"running since {start}" if job.start <= now else f"starts {start}"
    return f"{job.name} ({job.region}, {when}, until {job.end.astimezone(UTC):%Y-%m-%d %H:%M} UTC)"


def _pinned_message(
    topology: Topology,
    spec: str,
    pins: list[tuple[str, str, datetime]],
    now: datetime,
    *,
    flags: str = "",
) -> str:
    """Which scheduled jobs a pinned version is kept for, and when they start.

    ``pins`` are (region, node, until) of the pins that have not run out. A
    recorded job is named only when it reads the version in a region whose
    nodes pin it, has not ended, and ends within that pin: a job of another
    region is unrelated, and one that runs past the pin no longer holds it
    (its pin was released or replaced since the record was written).
    """
    # Each node's own end (a node keeps one time per version; two nodes may differ):
    # one time for all of them named the latest, and the other node's was hours sooner.
    ends: dict[datetime, set[str]] = defaultdict(set)
    for _, node, when in pins:
        ends[when.replace(second=0, microsecond=0)].add(node)
    said = "; ".join(
        f"on {', '.join(sorted(nodes))} until {when:%Y-%m-%d %H:%M} UTC"
        for when, nodes in sorted(ends.items())
    )
    held_until: dict[str, datetime] = {}
    for region, _, when in pins:
        held_until[region] = max(held_until.get(region, when), when)
    readers = [
        job
        for job in pinned_jobs(topology)
        if spec in job.versions
        and job.region in held_until
        and now < job.end <= held_until[job.region] + timedelta(seconds=1)
    ]
    pinned = f"{spec} is pinned {said}"
    if not readers:
        # Nothing names its job, so no warm run or controller round will release it: the
        # advice to edit a schedule and run warm again did nothing, --force is the way.
        return (
            f"{pinned}, kept for a scheduled job or for another region's copy from here, but "
            "neither warm nor the controller recorded a job here that reads it (`edgecache plan "
            "SCHEDULE` lists the jobs that read it, and says `kept for R's copy from here` of "
            "a pin for a copy), so neither will release the pin before it runs out; evicting "
            "it would leave that job or copy without its data. If nothing needs it any more, "
            "pass --force"
        )
    reads = ", ".join(dict.fromkeys(_job_times(job, now) for job in readers))  # once each
    return (
        f"{pinned}, read by {reads}; evicting it would leave that job without its data. "
        f"{_how_to_release(readers, flags)}"
    )


def _how_to_release(readers: list[PinnedJob], flags: str = "") -> str:
    """The command that releases the pin once its job is no longer scheduled.

    Editing the schedule alone changes nothing on the nodes: warm releases
    the pins it placed when it runs that schedule file again, the controller
    on its next round. A warm record older than the pins it keeps names no
    pin to release: only ``--force`` frees it before it runs out.
    """
    schedules = sorted({job.schedule for job in readers if job.by == "warm" and job.schedule})
    steps = [
        f"remove the job from {path} and run `edgecache warm {shlex.quote(path)}{flags}` again "
        "(it releases the pins it placed for jobs no longer there)"
        for path in schedules
    ]
    if any(job.by == "controller" for job in readers):
        steps.append(
            "remove the job from the controller's schedule (its next round releases the pin)"
        )
    if len(steps) > 1:  # each record that holds the job keeps the pin until it lets go
        steps[-1] = "and " + steps[-1]
    if not steps:  # only jobs an older warm recorded, with no schedule file and no pins
        return (
            "An older warm recorded the job without its pins, so no warm run releases this "
            "one: once no job needs it, pass --force"
        )
    text = "; ".join(steps) + ", or pass --force"
    return text[0].upper() + text[1:]
