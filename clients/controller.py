"""The controller: runs a schedule's plan, on time, and records plan against reality.

Every ``interval`` seconds (a *tick*) it re-reads the schedule, asks every
node for its status, plans from what is actually there (a node that died, a
version that vanished, a task that finished are all planned around), and
then carries out what is due: pins for every scheduled version, evictions
whose time has come, and staging tasks whose planned start has come, each on
a thread of its own, from the plan's source.

It keeps a record of plan against reality in the registry
(``<registry>/_controller/state.json``): per task the predicted and actual
ready time, per job whether its data was complete when it started and what
was missing. ``edgecache plan --status`` reads it; Prometheus metrics say the
same (:mod:`edgecache.clients.controller_metrics`). The metrics count only
live tasks (the plan still has them, or their data waits for a job to start),
so a late task stops counting once its jobs have started and its data is
there or no longer needed; the records stay ``record_retention`` after their
jobs end, for ``plan --status``, then go (at once when the jobs leave the
schedule).

Only one controller acts at a time: it holds a lease in the registry's object
store (:mod:`edgecache.cache.lease`) and does nothing while another holds it.
One that takes the lease (a standby taking over, or a leader back from a
pause past its lease) first reads the record again: the controller that led
in between may have changed it, and acting on, then saving, the copy read
earlier would undo that. A registry on a local filesystem must exist: the
controller does not create one where a mistyped ``registry:`` points.
A controller killed mid-task loses nothing: staging commits whole shards, the
next tick (of this controller or of the next leaseholder) plans the rest of
the version and fetches only the missing shards.

The clock is injectable (``clock``) so a test or a benchmark can run a day of
schedule in minutes: times in the schedule and the plan are then simulated,
and link speeds in the topology must be given in simulated bytes per second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from edgecache.cache.errors import ConfigError, EdgeCacheError, ObjectNotFound, OriginError
from edgecache.cache.lease import Lease, LeaseRecord
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import (
    Eviction,
    Infeasible,
    Plan,
    RegionPlan,
    StageTask,
    VersionKey,
)
from edgecache.cache.storage import Stores
from edgecache.clients.controller_metrics import NODE_LABELS, ControllerMetrics
from edgecache.clients.executor import (
    MIN_CALL_SECONDS,
    NodeCalls,
    NodesSeen,
    PlanExecutor,
    TaskRun,
    copies_before,
)
from edgecache.clients.ops import (
    NodeReport,
    Outage,
    WarmItem,
    WarmPin,
    complete_versions,
    gather_status,
    local_registry,
    make_plan,
    peers_refused_text,
    region_outages,
    schedule_owner,
    status_call_timeout,
    unreachable_regions,
    warm_readers,
    warm_started,
    without_pins,
)
from edgecache.clients.ops.at_start import Known, newest_at_start
from edgecache.clients.topology import Schedule, Topology, load_schedule, load_topology
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "Controller",
    "ControllerState",
    "JobRecord",
    "SimulatedClock",
    "TaskRecord",
    "as_started",
    "started_schedule",
    "infeasible_reason",
    "lease_holder",
    "read_state",
]

log = logging.getLogger(__name__)

STATE_NAME = "_controller/state.json"
LEASE_PREFIX = "_controller/lease"
RETRY_BACKOFF_MAX = 600.0  # seconds: the longest wait between runs of a failing task
STATUS_PINGS = 3  # health checks per node and round (the RTT is their median)
STATUS_TIMEOUT = 3.0  # seconds a status call may take, at most (less for a short lease)
STATUS_FLOOR = 1.0  # seconds a status call may take, at least, however short the lease
# Fewer seconds than this left before the calls' deadline: the lease is renewed before the
# next Pin or Evict call, which then has at least this long (MIN_CALL_SECONDS, and a margin).
RENEW_AHEAD = MIN_CALL_SECONDS + 0.25
# Half the lease bounds each call after a renewal: it must hold the renewal and a call.
MIN_LEASE_TTL = 2.0
RECORD_RETENTION = timedelta(days=1)  # records of a job and its tasks stay this long past its end
UNSEEN_BEFORE_START = "no controller round saw the job before it started"


class _Stopping(threading.Event):
    """The controller's stop: setting it also does ``on_set`` (stops the running term's runs).

    A run carries its term's event (``TaskRun.stop``), which the executor reads instead
    of its own stop: Ctrl-C set only this one, and ``controller --once`` staged on to
    the end of every version before it exited.
    """

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        """Set it, and stop the runs."""
        super().set()
        self._on_set()


class LeaseLost(EdgeCacheError):
    """Another controller took the lease during this one's round: the round stops."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"controller {holder} took the lease mid-round")
        self.holder = holder


@dataclass
class TaskRecord:
    """One staging task as planned and as it went."""

    region: str
    version: str
    source: str
    jobs: list[str]
    deadline: str
    planned_start: str
    predicted_ready: str  # the plan's finish when the task started
    state: str = "pending"  # pending, running, done, failed
    started_at: str | None = None
    ready_at: str | None = None
    error: str = ""  # the last attempt's error; "" once done
    notes: list[str] = field(default_factory=list)
    attempts: int = 0  # runs started: a failed task is retried in the same record
    retry_at: str | None = None  # failed: when the controller runs it again (its backoff)


@dataclass
class JobRecord:
    """One scheduled job, and whether its data was there when it started."""

    name: str
    region: str
    start: str
    end: str
    versions: list[str]
    planned_ready: str | None = None  # when the plan says its data is complete
    # When the controller saw the versions it reads now complete, since they last were
    # not (cleared when a round sees them missing, or when the job reads others).
    ready_at: str | None = None
    complete_at_start: bool | None = None  # None until the job starts
    missing_at_start: list[str] = field(default_factory=list)
    infeasible: list[str] = field(default_factory=list)  # the planner's reasons
    # Why its data was not complete at its start, as known then (a failed stage and its
    # error, capacity, a plan that had it ready later, no round before the start).
    why_missed: str = ""
    # Each of the job's specs as resolved ("tokens" → "tokens@3"): followed until the
    # job starts, then kept, so the job reads one version however many are published.
    resolved: dict[str, str] = field(default_factory=dict)
    # Why nobody knows whether its data was there at its start (no round saw the job
    # before it started); "" otherwise. Such a job is neither complete nor missed at its
    # start: ``complete_at_start`` stays None, and it is counted in
    # ``edgecache_controller_jobs_unknown_at_start_total``, not as unready.
    unknown_at_start: str = ""


@dataclass
class ControllerState:
    """What the controller has seen, persisted between ticks and restarts."""

    updated_at: str = ""
    holder: str = ""
    tasks: dict[str, TaskRecord] = field(default_factory=dict)  # "region version" → record
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    # The pins this controller placed: "node name@N" → until. One the plan no longer
    # keeps (its job removed or moved) is released, if the node still has it as placed.
    pins: dict[str, str] = field(default_factory=dict)
    # Each node's id as it last reported it (address → node_id): the `node` label of a
    # node that is down now, after a restart or a takeover too (ControllerMetrics).
    nodes: dict[str, str] = field(default_factory=dict)
    # The nodes down now: address → when a round first saw it down (kept across a restart
    # or a takeover, so "back up" says since when, not since the new leader looked).
    down_since: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The state as JSON."""
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ControllerState:
        """Read a saved state; fields added later get their defaults."""
        data = json.loads(raw)
        return cls(
            updated_at=data.get("updated_at", ""),
            holder=data.get("holder", ""),
            tasks={k: TaskRecord(**v) for k, v in data.get("tasks", {}).items()},
            jobs={k: JobRecord(**v) for k, v in data.get("jobs", {}).items()},
            pins=dict(data.get("pins", {})),
            nodes=dict(data.get("nodes", {})),
            down_since=dict(data.get("down_since", {})),
        )


def _unreachable(
    registry: str, doing: str, exc: OriginError, topology_path: object = None
) -> OriginError:
    """The error for a registry whose store does not answer: which registry, and what to check.

    The store's own error names an object URL deep inside the registry and
    calls it origin: the operator has to know it is the ``registry:`` of the
    topology file that points at nothing.
    """
    where = topology_path or "the topology file"
    return OriginError(
        f"cannot {doing}: the version registry {registry.rstrip('/')} (registry: in {where}) "
        f"does not answer: {exc}. Check that URL, and that its store is reachable from here "
        "with these credentials: the controller keeps its lease and its record there"
    )


def _missing_registry(
    registry: str, doing: str, topology_path: object = None
) -> ConfigError | None:
    """The error for a registry on a local filesystem that does not exist; None if it does.

    A filesystem store creates the folders a write needs: the lease or the
    record written to a mistyped ``registry:`` made a new, empty registry
    there, and every later command said it "holds no datasets", hiding the
    typo. An object store has no folders to tell a new registry from a
    mistyped one (a missing bucket, the store itself refuses).
    """
    local = local_registry(registry)
    if local is None or os.path.isdir(local):
        return None
    state = "is not a directory" if os.path.exists(local) else "does not exist"
    where = topology_path or "the topology file"
    return ConfigError(
        f"cannot {doing}: the version registry {registry.rstrip('/')} (registry: in {where}) "
        f"{state}; check the registry URL for a typo, or publish a version there first "
        "(edgecache publish creates the registry): the controller keeps its lease and its "
        "record in the registry, and does not create one"
    )


def infeasible_reason(item: Infeasible) -> str:
    """``item``'s reason after its version, once (``b@1: the registry … does not exist``).

    The registry's reason for a version that does not resolve already starts
    with the spec: prefixed again, it read "b@1: b@1: the registry …".
    """
    if item.reason.startswith((f"{item.version}: ", f"{item.version} ")):
        return item.reason
    return f"{item.version}: {item.reason}"


def read_state(registry: str) -> ControllerState | None:
    """The controller's last saved state in ``registry``, or None if none ran there.

    A registry on a local filesystem that does not exist is a
    :class:`ConfigError` naming it (``plan --status`` on a mistyped
    ``registry:``), not an empty record.
    """
    missing = _missing_registry(registry, "read the controller's record")
    if missing is not None:
        raise missing

    async def go() -> ControllerState | None:
        stores = Stores()
        try:
            raw = await stores.for_url(registry).get(f"{registry.rstrip('/')}/{STATE_NAME}")
        except ObjectNotFound:
            return None
        except OriginError as exc:
            raise _unreachable(registry, "read the controller's record", exc) from exc
        finally:
            await stores.close()
        return ControllerState.from_json(raw)

    return asyncio.run(go())


class SimulatedClock:
    """A clock that starts at ``start`` and runs ``speed`` times faster than real time."""

    def __init__(self, start: datetime, speed: float = 1.0) -> None:
        if start.tzinfo is None:
            raise ValueError(f"the clock's start {start} needs a time zone")
        if speed <= 0:
            raise ValueError(f"the clock's speed must be positive, got {speed}")
        self.start, self.speed = start, speed
        self._origin = time.monotonic()

    def __call__(self) -> datetime:
        """Now, on this clock."""
        return self.start + timedelta(seconds=(time.monotonic() - self._origin) * self.speed)


def lease_holder(registry: str) -> LeaseRecord | None:
    """The controller that holds the lease on ``registry`` now, if one does."""

    async def go() -> LeaseRecord | None:
        stores = Stores()
        try:
            url = f"{registry.rstrip('/')}/{LEASE_PREFIX}"
            record = await Lease(stores.for_url(registry), url, "reader").current()
        except ObjectNotFound:
            raise
        except OriginError as exc:
            raise _unreachable(registry, "read the controller's lease", exc) from exc
        finally:
            await stores.close()
        return record if record is not None and record.live(time.time()) else None

    return asyncio.run(go())


def as_started(schedule: Schedule, state: ControllerState | None, now: datetime) -> Schedule:
    """The schedule with each started job reading the versions resolved before its start.

    ``name`` and ``name@latest`` are resolved once: a job reads one version
    from its start to its end. Re-resolved every round, a version published
    while the job runs would be staged and pinned for it, and the one it
    reads left to the LRU and to the plan's evictions. ``state`` is the
    controller's record (:attr:`JobRecord.resolved`); without one, nothing changes.
    """
    covered = recorded_started(schedule, state, now)
    jobs = []
    for job in schedule.jobs:
        if state is not None and job.name in covered:
            resolved = state.jobs[job.name].resolved
            datasets = [_resolved_spec(spec, resolved, job.datasets) for spec in job.datasets]
            job = job.model_copy(update={"datasets": list(dict.fromkeys(datasets))})
        jobs.append(job)
    return schedule.model_copy(update={"jobs": jobs})


def _resolved_spec(spec: str, resolved: Mapping[str, str], listed: Sequence[str]) -> str:
    """What the record resolved ``spec`` to; ``name`` is found under its ``name@N`` too.

    A round that first saw a job after its start read the schedule through warm's
    record (:func:`started_schedule`): the job's ``name`` was already ``name@N``
    there, and that is the key the round recorded it under. ``listed``: the job's
    specs; a ``name@N`` it names itself is not what its ``name`` resolved to.
    """
    if spec in resolved:
        return resolved[spec]
    name, _, version = spec.partition("@")
    if version in ("", "latest"):
        found = {v for v in resolved.values() if v.partition("@")[0] == name and v not in listed}
        if len(found) == 1:
            return found.pop()
    return spec


def started_schedule(
    schedule: Schedule,
    state: ControllerState | None,
    registry: str,
    now: datetime,
    owner: str = "",
) -> Schedule:
    """The schedule with its started jobs on the versions either record kept for them.

    The controller's record first (:func:`as_started`), warm's for the jobs it
    does not hold (:func:`~edgecache.clients.ops.warm_started`; ``owner``: the
    schedule file's), the registry's publish times for a job neither holds
    (:func:`~edgecache.clients.ops.at_start.newest_at_start`). ``plan``, ``warm``
    and the controller all read a schedule through this: the controller read its
    own record alone, so a job warm had staged and no round had seen start was
    switched to a version published while it ran, and the pin of the one it
    reads released.
    """
    covered = recorded_started(schedule, state, now)
    started = as_started(schedule, state, now)
    known: Known = {}  # the registry's publish times, read once for both steps
    try:
        started = warm_started(started, registry, now, covered, owner, known)
    except (OriginError, TypeError, ValueError) as exc:
        # One object origin will not give must not stop every round (warm_readers too).
        log.warning("warm's record could not be read (%s): planning from the controller's", exc)
    # A job neither record holds: the version newest at its start, not the newest now.
    return newest_at_start(started, registry, now, known)


def recorded_started(schedule: Schedule, state: ControllerState | None, now: datetime) -> set[str]:
    """The started jobs whose versions the controller's record holds (for this start)."""
    if state is None:
        return set()
    return {
        job.name
        for job in schedule.jobs
        if job.start <= now
        and (record := state.jobs.get(job.name)) is not None
        and record.resolved
        and record.start == _iso(job.start)
    }


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.astimezone(UTC).isoformat()


_WARM_READS_IT = "a job warm recorded reads it until then"  # why a pin is kept that long


def _waits_for_room(task: StageTask, region_plan: RegionPlan, now: datetime) -> bool:
    """Whether ``task``, started before its planned start, would lack an eviction's room.

    The plan starts it once an eviction planned before then has freed room; one
    started early (its peer source will not hold the version, the task before it
    on the link waits out a backoff) would start without it.
    """
    return task.start > now and any(e.at <= task.start for e in region_plan.evictions if e.at > now)


def _spec(version: VersionKey) -> str:
    return f"{version[0]}@{version[1]}"


def _run_number(key: str) -> int:
    """Which run of its task a record key is: "eu b@1" is 1, "eu b@1 #2" is 2."""
    return int(key.partition(" #")[2] or 1)


def _minute(text: str | None) -> str:
    """An ISO time of the record as ``plan`` shows times (UTC, to the minute)."""
    return f"{datetime.fromisoformat(text):%Y-%m-%d %H:%M}" if text else "an unknown time"


def _remove_series(gauge: Gauge, labels: dict[str, str]) -> None:
    """Drop ``gauge``'s series of ``labels``, if it has one (``remove`` may raise otherwise)."""
    try:
        gauge.remove(*(labels[name] for name in NODE_LABELS))
    except KeyError:
        pass  # an older prometheus_client raises for a series it does not have


def default_holder() -> str:
    """Unique per process: hostname, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Controller:
    """Runs the schedule in ``schedule_path`` against the nodes of ``topology_path``."""

    def __init__(
        self,
        topology_path: str | os.PathLike[str] | None,
        schedule_path: str | os.PathLike[str],
        *,
        token: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        lease_ttl: float = 30.0,
        holder: str | None = None,
        metrics: ControllerMetrics | None = None,
        retry_backoff: float = 10.0,
        record_retention: timedelta = RECORD_RETENTION,
        standby: bool = True,
        retry_failed_now: bool = False,
    ) -> None:
        """Load the topology and the last saved record; nothing is asked of nodes yet.

        ``standby``: a round that finds another controller's lease logs that this
        one stands by to take over; False for ``--once``, which then exits instead.
        ``retry_failed_now``: tasks that failed are due now, not at the retry time
        the record gives them (``--once``: a run that skipped such a task exited 0
        and said nothing of it while the job's data was known to be missing).

        ``retry_backoff``: seconds before a failed task runs again, doubled per
        failure in a row up to ``RETRY_BACKOFF_MAX``, so a broken origin or node
        is not hammered every round. ``record_retention``: how long the records of
        a job and its tasks are kept after the job ends, for ``plan --status`` to
        say how it went; it must be positive.
        """
        if record_retention <= timedelta(0):
            raise ValueError(f"record_retention must be positive, got {record_retention}")
        if lease_ttl < MIN_LEASE_TTL:
            raise ValueError(
                f"the lease time to live (--lease-ttl) must be at least {MIN_LEASE_TTL:g} s, "
                f"got {lease_ttl:g}: each Pin and Evict call ends within half of it after "
                "a renewal, and a shorter one leaves no room for a call"
            )
        self.topology_path, self.schedule_path = topology_path, Path(schedule_path)
        self.topology: Topology = load_topology(topology_path)
        self.token, self.clock = token, clock
        self.holder = holder or default_holder()
        self.metrics = metrics or ControllerMetrics()
        for region in self.topology.regions:  # at 0 from the start: a rate needs its zero
            self.metrics.peer_refusals.labels(region=region)
        # Set when this controller stops leading (the lease lost, or the process stopping):
        # the staging runs started under that lease stop with it (TaskRun.stop). They kept
        # staging beside the new leader's plan, which may evict what they stage.
        self._term = threading.Event()
        # Whoever stops the controller (a signal handler, close) stops the runs with it.
        self.stop = _Stopping(lambda: self._term.set())
        self.executor = PlanExecutor(self.topology, token=token, stop=self.stop, clock=clock)
        self._loop = asyncio.new_event_loop()
        self._stores = Stores()
        registry = self.topology.registry.rstrip("/")
        self._state_url = f"{registry}/{STATE_NAME}"
        self.lease = Lease(
            self._stores.for_url(registry), f"{registry}/{LEASE_PREFIX}", self.holder, lease_ttl
        )
        # The record as last read from or written to the registry (None: there was none):
        # a controller taking the lease reloads the record only if it changed since.
        self._record_raw: bytes | None = None
        self._runs: dict[tuple[str, VersionKey], tuple[TaskRun, threading.Thread]] = {}
        # Each run's record (its key and the record its thread updates), kept across a reload.
        self._run_records: dict[tuple[str, VersionKey], tuple[str, TaskRecord]] = {}
        try:
            self._require_registry("start the controller")
            self.state = self._load_state()
        except BaseException:
            self._await(self._stores.close())  # no client session left open behind the error
            self._loop.close()
            raise
        self._ended: dict[tuple[str, VersionKey], float] = {}  # when each run last ended
        # Why each eviction was last refused: a refusal is said when it is new or its reason
        # changes, not every round (one refused for hours filled the log every 10 s).
        self._refused: dict[tuple[str, VersionKey], str] = {}
        self.retry_backoff = retry_backoff
        self.record_retention = record_retention
        self._live_tasks: set[str] = set()  # task records counted in the gauges (_prune)
        self._failed_in_row: dict[tuple[str, VersionKey], int] = {}
        self._lock = threading.Lock()
        self._retry_failed_now = retry_failed_now
        self._adopt_backoffs()
        self._leading = False  # held the lease at the last round: the record is ours to save
        self._renewed_at = -math.inf  # time.monotonic() when the lease was last taken or renewed
        self._exported: dict[str, dict[str, str]] = {}  # address → its node series' labels
        self.last_plan: Plan | None = None
        self.last_error = ""
        # A schedule edit that does not validate leaves the last good schedule running;
        # this says why (file, line, field) until the file reads again.
        self.schedule_error = ""
        self._schedule: Schedule | None = None
        self._schedule_read_at: datetime | None = None
        # What went wrong in the latest round: unreachable regions, pins and evictions
        # that failed, staging tasks it started that failed. `controller --once` exits
        # non-zero on any; a running controller logs them and tries again next round.
        self.failures: list[str] = []
        # Staging runs of the latest round whose version came from origin because the
        # peers the plan chose refused the node's configuration (a peer token): said as
        # `peer refused:`, exit 2 for `controller --once`, as warm does.
        self.peer_refusals: list[str] = []
        # Staging tasks this controller has started, every round: `controller --once` runs
        # rounds until one starts none (the next task on a link, a copy of what it staged).
        self.started = 0
        self._complete: dict[str, set[VersionKey]] = {}
        # The other controller holding the lease at the last round (None: this one led).
        self.other_leader: LeaseRecord | None = None
        self._standing_by_for: str | None = None  # the leader last logged as standing by for
        self._standby = standby

    # -------------------------------------------------------------- plumbing

    def _await(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    def _registry_call(self, coroutine: Any, doing: str) -> Any:
        """Await a call on the registry's store; one that cannot reach it names the registry."""
        try:
            return self._await(coroutine)
        except ObjectNotFound:
            raise
        except OriginError as exc:
            raise _unreachable(self.topology.registry, doing, exc, self.topology_path) from exc

    def _require_registry(self, doing: str) -> None:
        """Refuse to go on when the registry, on a local filesystem, does not exist.

        Checked before each write to it (the lease, the record): one would
        create it, and a mistyped registry would look like an empty one.
        """
        missing = _missing_registry(self.topology.registry, doing, self.topology_path)
        if missing is not None:
            raise missing

    def _read_record(self) -> bytes | None:
        """The record as saved in the registry now; None when no controller saved one."""
        try:
            raw: bytes = self._registry_call(
                self._stores.for_url(self._state_url).get(self._state_url),
                "read the controller's record",
            )
        except ObjectNotFound:
            return None
        return raw

    def _parse_record(self, raw: bytes | None) -> ControllerState:
        if raw is None:
            return ControllerState()
        try:
            return ControllerState.from_json(raw)
        except (ValueError, TypeError, KeyError):
            log.warning("%s is unreadable; starting a fresh record", self._state_url)
            return ControllerState()

    def _load_state(self) -> ControllerState:
        raw = self._read_record()
        self._record_raw = raw
        return self._parse_record(raw)

    def _take_up_record(self) -> None:
        """Having taken the lease anew, carry on from the record as it is saved now.

        Another controller may have led since this one read or wrote the
        record (it stood by since it started, or lost the lease for a while):
        that one's task and job records, pins and node ids are the truth now.
        Acting on the copy in memory would forget its work (a pin it placed
        never released, a job that missed its data recorded as complete), and
        saving that copy would write over its record. A record nobody wrote
        since stays as it is in memory, which is newer (runs ended since the
        last save). A run still in flight here keeps its own record: its
        thread goes on updating it.
        """
        raw = self._read_record()
        if raw == self._record_raw:
            return
        state = self._parse_record(raw)
        with self._lock:
            for record_key, record in self._run_records.values():
                state.tasks[record_key] = record
        log.info(
            "took the lease: carrying on from the record controller %s saved at %s",
            state.holder or "(unknown)",
            state.updated_at or "(unknown)",
        )
        self.state, self._record_raw = state, raw
        self._adopt_backoffs()

    def _adopt_backoffs(self) -> None:
        """Each failed task's backoff as the record says it: its failures, and when it retries.

        Kept in memory only, they were lost by a restart or a takeover: the new
        leader retried at once and counted from the first backoff again, so a
        controller restarted beside a broken origin hit it every 10 s (a helper's
        hunt). A failed record's runs all failed (a success closes the record), so
        its ``attempts`` are its failures in a row.
        """
        if self._retry_failed_now:
            return
        now, monotonic = self.clock(), time.monotonic()
        with self._lock:
            for record in self.state.tasks.values():
                if record.state != "failed" or not record.retry_at or record.attempts < 1:
                    continue
                try:
                    parsed = parse_spec(record.version)
                    retry = datetime.fromisoformat(record.retry_at)
                except (EdgeCacheError, ValueError):
                    continue
                if parsed.version is None:
                    continue
                key = (record.region, (parsed.dataset, parsed.version))
                if key in self._runs:
                    continue
                self._failed_in_row[key] = max(self._failed_in_row.get(key, 0), record.attempts)
                left = (retry - now).total_seconds()
                self._ended[key] = min(monotonic, monotonic + left - self._backoff(key))

    def _save_state(self) -> None:
        self._require_registry("save the controller's record")
        self.state.updated_at = _iso(self.clock()) or ""
        self.state.holder = self.holder
        raw = self.state.to_json()
        self._registry_call(
            self._stores.for_url(self._state_url).put(self._state_url, raw),
            "save the controller's record",
        )
        self._record_raw = raw

    def close(self) -> None:
        """Stop running tasks, give the lease up, close connections."""
        self.stop.set()  # and the runs' term (_Stopping)
        with self._lock:
            threads = [thread for _, thread in self._runs.values()]
        if threads:
            log.info(
                "stopping: %d staging task(s) interrupted; the next run resumes them", len(threads)
            )
        for thread in threads:
            thread.join(timeout=30)
        if self._leading:
            # The record said "running" for the tasks just stopped: say what is true now,
            # if the lease is still ours (another holder's record is not ours to save over).
            try:
                other = self.leader()
                if other is None:
                    self._save_state()
                else:
                    log.info("controller %s holds the lease now: its record stands", other.holder)
            except EdgeCacheError as exc:
                log.warning("could not save the record on stopping: %s", exc)
        try:
            self._require_registry("give the lease up")  # a write: it would create it
            self._await(self.lease.release())
        except Exception:  # noqa: BLE001 - the lease expires by itself anyway
            log.debug("could not release the lease", exc_info=True)
        self._await(self._stores.close())
        self._loop.close()

    # ----------------------------------------------------------------- ticks

    def leader(self) -> LeaseRecord | None:
        """Take or renew the lease: None when this controller holds it, else the holder's record.

        Taken anew (not renewed), the record is read again first if another
        controller saved it since (:meth:`_take_up_record`).
        """
        asked = time.monotonic()  # the lease runs from no later than this
        self._require_registry("take the controller's lease")
        held = self._registry_call(self.lease.acquire(), "take the controller's lease")
        self._leading = held is None
        if held is None:
            self._renewed_at = asked
            if self.lease.gained:  # another may have led since: its record is the truth
                self._take_up_record()
        self.metrics.leader.set(0 if held else 1)
        return held

    def _keep_lease(self, *, check: bool = False) -> None:
        """Renew the lease when due (``check``: now), and end the calls that follow inside it.

        A round's Pin and Evict calls must end while this controller holds the
        lease: past it another controller may take over, and two would act at
        once. Every call ends half the time to live after the last renewal
        (``NodeCalls.deadline``); the other half is left for the renewal itself
        and for clocks that differ. This runs between a round's steps and
        before each call (``NodeCalls.renew``), and renews the lease when a
        third of it has gone (so it never lapses mid-round) or when fewer than
        ``RENEW_AHEAD`` seconds are left before the deadline. The second rule
        is for short leases: a call is not begun with less than
        ``MIN_CALL_SECONDS`` left, and a third of a 2 s lease is 0.67 s: by
        the first rule alone, every call from 0.5 s to 0.67 s after a renewal
        would be skipped as out of time, with nothing to renew the lease.
        Raises :class:`LeaseLost` when another holds it, or held it since the
        round began (the lease lapsed mid-round and the record changed): the
        round acted on a record that is no longer true.
        """
        since = time.monotonic() - self._renewed_at
        if check or since > self.lease.ttl / 3 or self.lease.ttl / 2 - since < RENEW_AHEAD:
            before = self.state
            other = self.leader()
            if other is not None:
                raise LeaseLost(other.holder)
            if self.state is not before:
                raise LeaseLost(self.state.holder or "(unknown)")
        self.executor.calls.deadline = self._renewed_at + self.lease.ttl / 2

    def _status_timeout(self) -> float:
        """Each status call's timeout: its share of half the lease, at least ``STATUS_FLOOR``.

        The share (:func:`status_call_timeout`: half the time to live over a
        node's ``STATUS_PINGS + 2`` calls, at most ``STATUS_TIMEOUT``) ends the
        round's status within half the lease even for a node that answers the
        first call and hangs on each of the others. With a short lease the
        share is too little for a loaded host (0.2 s at 2 s, 0.5 s at 5 s): a
        node busy staging, or a controller sharing its cores, misses it, and
        the round holds a healthy node as down (not called, no RTT series, an
        outage logged). Hence the floor, which a loaded host meets. It costs
        nothing the lease guards: status calls only read, and the Pin and
        Evict calls after them renew the lease first, or stop the round when
        another controller took it meanwhile (:meth:`_keep_lease`). It does
        cost time: a node that answers its first call and hangs on each
        later one holds the status for ``STATUS_PINGS + 2`` floors (5 s),
        past a lease under 5 s, which a standby may then take (this round
        then stops; docs/operations.md advises 10 s or more beside a standby).
        """
        share = status_call_timeout(self.lease.ttl / 2, pings=STATUS_PINGS, longest=STATUS_TIMEOUT)
        return max(STATUS_FLOOR, share)

    def _note_nodes(self, reports: list[NodeReport]) -> None:
        """Export each node's health; log a node going down once, and its return once.

        Warned every round, an outage drowned the rest of the log, and nothing
        said when the node was back. A node down has no RTT series: its last
        value, held, drew a flat line on the RTT panel for a dead node.
        """
        known = {address for cfg in self.topology.regions.values() for address in cfg.nodes}
        for address in set(self.state.nodes) - known:
            del self.state.nodes[address]  # a node since removed from the topology
        for address in set(self.state.down_since) - known:
            del self.state.down_since[address]
        for report in reports:
            labels = self._node_labels(report)
            self.metrics.node_up.labels(**labels).set(0 if report.status is None else 1)
            name = self._node_name(report.address)
            since = self.state.down_since.get(report.address)
            if report.status is None:
                _remove_series(self.metrics.node_rtt, labels)
                if since is None:
                    self.state.down_since[report.address] = _iso(self.clock()) or ""
                    log.warning(
                        "node %s of %s is down: %s; check that it runs and is reachable from "
                        "here (edgecache status, edgecache doctor). Rounds plan around it and "
                        "do not call it until it answers a round's status again",
                        name,
                        report.region,
                        report.error,
                    )
                continue
            self.metrics.node_rtt.labels(**labels).set(report.rtt_ms / 1e3)
            if since is not None:
                del self.state.down_since[report.address]
                # The first round that saw it down: it may have gone down before that.
                log.info(
                    "node %s of %s is back up (down since at least %s); planning with it again",
                    name,
                    report.region,
                    since,
                )

    def _node_labels(self, report: NodeReport) -> dict[str, str]:
        """The labels of a node's series: ``node`` its node id, ``address`` the topology's.

        ``node`` is what the node's own metrics call it (the ``node_id`` of its
        Status), so an alert or panel on the controller's series joins the
        node's. A node that is down keeps the id it last reported (kept in the
        record, so a restarted controller says the same); one never heard from
        is named by its address. When a node's id changes, its old series go.
        """
        if report.status is not None and report.status.node_id:
            self.state.nodes[report.address] = report.status.node_id
        node = self.state.nodes.get(report.address, report.address)
        labels = {"region": report.region, "node": node, "address": report.address}
        before = self._exported.get(report.address)
        if before is not None and before != labels:
            _remove_series(self.metrics.node_up, before)
            _remove_series(self.metrics.node_rtt, before)
        self._exported[report.address] = labels
        return labels

    def _forget_what_the_leader_says(self) -> None:
        """Drop the node and task series a controller that stands by would leave as they were.

        The leader says them; a standby's last values froze (a node it saw down stayed 0,
        and the alert on the lowest node_up of all controllers fired until it restarted).
        """
        self.metrics.node_up.clear()
        self.metrics.node_rtt.clear()
        self._exported.clear()
        self.metrics.tasks.clear()
        self.metrics.jobs_infeasible.set(0)

    def _end_term(self, holder: str) -> None:
        """Stop the staging runs started under the lease just lost; later runs get a new term.

        Each stops between its calls (a node keeps the whole shards it committed) and
        its record says pending: the new leader's record is the truth from now on, and
        this one, should it lead again, takes that record up.
        """
        with self._lock:
            running = len(self._runs)
        if running:
            log.warning(
                "stopping %d staging task(s) started under the lease controller %s holds now",
                running,
                holder,
            )
        self._term.set()
        self._term = threading.Event()
        if self.stop.is_set():  # stopping meanwhile: the new term is over before it begins
            self._term.set()

    def _node_name(self, address: str) -> str:
        """A node as the log names it: its id and address (``eu-west-1 (10.0.0.5:7070)``)."""
        node = self.state.nodes.get(address, address)
        return address if node == address else f"{node} ({address})"

    def tick(self) -> Plan | None:
        """One round: lease, status, plan, then pins, due evictions and due tasks.

        Returns the plan acted on, or None when another controller holds the lease
        (or took it mid-round). A node down in the status is not called in the
        round, and every call ends inside the lease (:meth:`_keep_lease`).
        """
        other = self.leader()
        self.other_leader = other
        if other is not None:
            if self._standby and other.holder != self._standing_by_for:  # once per leader
                log.info(
                    "controller %s holds the lease (until %s unless renewed); standing by: "
                    "this one takes over if it stops renewing",
                    other.holder,
                    datetime.fromtimestamp(other.expires, UTC).isoformat(timespec="seconds"),
                )
            self._standing_by_for = other.holder
            self._forget_what_the_leader_says()
            self._end_term(other.holder)
            # A standby's round (the lease checked, found held) is a round: without it,
            # /healthz failed a standby after 90 s and its liveness probe restarted it
            # in a loop, and one failed lease check raised "every round failed".
            self.metrics.ticks.inc()
            self.metrics.last_tick.set(time.time())
            return None
        if self._standing_by_for is not None:
            log.info("took the lease from controller %s; acting", self._standing_by_for)
        self._standing_by_for = None
        now = self.clock()
        with self._lock:
            self.failures = []
            self.peer_refusals = []
        schedule = self._started_schedule(now)
        looked = time.monotonic()  # runs that end after this are not in the status below
        reports = gather_status(
            self.topology, self._status_timeout(), token=self.token, pings=STATUS_PINGS
        )
        self._note_nodes(reports)
        seen = NodesSeen.of(reports)  # down nodes and current pins, for the whole round
        self.executor.calls = NodeCalls(down=set(seen.down), renew=self._keep_lease)
        plan, manifests = make_plan(
            self.topology,
            schedule,
            now=now,
            reports=self._without_released(reports, schedule),
            token=self.token,
        )
        self.last_plan = plan
        self._observe(plan, schedule, manifests, reports, now)
        self._failed(*(o.message() for o in unreachable_regions(reports, schedule, now).values()))
        try:
            if not self.stop.is_set():  # stopping: no new calls; the next run makes them
                self._keep_lease()
                failures = self.executor.pin(plan, seen)
                self._keep_lease()
                failures += self._unpin_dropped(plan, reports, seen)
                for failure in failures:
                    log.warning("%s", failure)
                self.metrics.pin_failures.inc(len(failures))
                self._failed(*failures)
            self._evict_due(plan, schedule, manifests, now)
            # Renewed before starting tasks and saving the record: a controller paused
            # past its lease (a stopped process, a stalled VM) staged and saved over the
            # new leader's record when it resumed.
            self._keep_lease(check=True)
            self._start_due(plan, schedule, manifests, now, looked, region_outages(reports))
            self._prune(plan, schedule, reports, now)
            self._update_metrics(now)
            self._keep_lease(check=True)
        except LeaseLost as lost:
            log.warning("%s; stopping this round and standing by", lost)
            self._end_term(lost.holder)
            return None
        self._save_state()
        self.metrics.ticks.inc()
        self.metrics.last_tick.set(time.time())
        return plan

    def _without_released(self, reports: list[NodeReport], schedule: Schedule) -> list[NodeReport]:
        """``reports`` without this controller's pins of datasets no job names any more.

        The round releases those pins (:meth:`_unpin_dropped`), but after it plans:
        planned on them, a round after a job was removed called another job
        "cannot be met", its room "pinned for jobs outside this schedule" by the
        removed job's pin, with advice to add capacity (a helper's walk). Only
        datasets no current job names at all (any version), and no job in warm's
        record reads, are certain to go; anything else the plan decides, as before.
        """
        named = {parse_spec(spec).dataset for job in schedule.jobs for spec in job.datasets}
        going = []  # (node, name@N, until) of each pin of this controller's that goes
        for key, until in self.state.pins.items():
            node, _, spec = key.partition(" ")
            if spec.rpartition("@")[0] not in named:
                going.append((node, spec, until))
        if not going:
            return reports
        warm = self._warm_reads()
        if warm is None:  # unreadable: warm's jobs may read any of them; kept
            return reports
        region_of = {n: r for r, cfg in self.topology.regions.items() for n in cfg.nodes}
        pins = [
            WarmPin(
                schedule="",
                node=node,
                region=region_of.get(node, ""),
                version=spec,
                until=datetime.fromisoformat(until) if until else self.clock(),
            )
            for node, spec, until in going
            if (region_of.get(node, ""), spec) not in warm
        ]
        return without_pins(reports, pins) if pins else reports

    def _unpin_dropped(self, plan: Plan, reports: list[NodeReport], seen: NodesSeen) -> list[str]:
        """Release the pins this controller placed that the plan no longer keeps; failures.

        A cancelled job's versions would otherwise stay pinned until its old
        end, holding room the LRU and the next plans need. Only a pin the node
        still has as placed is released (someone may have pinned it since),
        nothing in a region with a node down (the plan there is partial), and
        nothing a job in warm's record still reads there: warm's pin of a
        version the controller's jobs read too is the same pin, counted here
        as placed, and releasing it would let the node evict what warm's job
        needs (``edgecache evict`` refuses for that job). It is shortened to
        the end of the last such job (warm's record gives it) when that comes
        before the pin's, and stays in the record, to be released once neither
        needs it.
        """
        down = set(region_outages(reports))
        region_of = {n: r for r, cfg in self.topology.regions.items() for n in cfg.nodes}
        failures = []
        warm_reads: dict[tuple[str, str], datetime] | None = None  # read once, if a pin is to go
        warm_read = False  # whether it was tried (None after a try: it could not be read)
        unshortened: dict[str, str] = {}  # pins to shorten next round: the record keeps them

        def warm_needs(region: str | None, spec: str) -> datetime | None:
            """Until when a job in warm's record reads it there (the far future: unknown)."""
            nonlocal warm_reads, warm_read
            if not warm_read:  # once a round, read or not: each read retries origin
                warm_reads, warm_read = self._warm_reads(), True
            if warm_reads is None:
                return datetime.max.replace(tzinfo=UTC)
            return warm_reads.get((region or "", spec))

        def shorten(
            node: str, version: VersionKey, key: str, placed: datetime, to: datetime, why: str
        ) -> None:
            """Set this controller's pin, placed until ``placed``, to ``to``.

            The record keeps the node's time where it failed (to match and try
            again), and the new one where it did; a pin someone lengthened since
            is left as it is and is theirs: the record follows the plan again.
            """
            done = self.executor.shorten(node, version, to, placed=placed)
            if done.taken:
                return
            if not done.released:
                if done.problem:
                    failures.append(done.problem)
                unshortened[key] = self.state.pins[key]
                return
            unshortened[key] = _iso(to) or ""
            log.info(
                "%s: shortened the pin of %s on %s to %s: %s",
                region_of.get(node), key.partition(" ")[2], node, _iso(to), why,
            )  # fmt: skip

        for key, until in sorted(self.state.pins.items()):
            node, _, spec = key.partition(" ")
            region = region_of.get(node)
            dataset, _, number = spec.rpartition("@")
            version = (dataset, int(number))
            region_plan = plan.regions.get(region) if region else None
            if region is not None and (region in down or region_plan is None):
                continue  # nothing known there this round: keep the pin and its record
            have = seen.pins.get((node, version))
            recorded = datetime.fromisoformat(until) if until else None
            placed = (
                have is not None
                and recorded is not None
                and abs((have - recorded).total_seconds()) < 1
            )
            if region_plan is not None and version in region_plan.pins:
                # Still kept, re-placed below if its time changed; but Pin never cuts a
                # longer pin short (it may be someone else's), so the controller's own,
                # for a job that now ends sooner, is shortened here: left, it outlived the
                # job, and the record's new time then failed to match the node's.
                sooner = region_plan.pins[version]
                if placed and recorded is not None and recorded - sooner > timedelta(seconds=1):
                    # No sooner than a job warm recorded reads it there (kept whole when
                    # warm's record cannot be read); the record keeps the node's time, to
                    # match (and release) it later.
                    warm_end = warm_needs(region, spec)
                    to = sooner if warm_end is None else max(sooner, warm_end)
                    if recorded - to <= timedelta(seconds=1):
                        unshortened[key] = until
                    else:
                        why = "its job ends then" if to == sooner else _WARM_READS_IT
                        shorten(node, version, key, recorded, to, why)
                continue
            if placed and recorded is not None:
                warm_end = warm_needs(region, spec)
                if warm_end is not None:
                    # A job warm recorded reads it (or may: unreadable): kept for it, to
                    # its end, not to this controller's cancelled job's.
                    if recorded - warm_end > timedelta(seconds=1):
                        shorten(node, version, key, recorded, warm_end, _WARM_READS_IT)
                    continue
                unpinned = self.executor.unpin(node, version, placed=recorded)
                if unpinned.taken:  # someone pinned it since: theirs, and no longer ours
                    log.info("%s: left the pin of %s on %s: pinned again since", region, spec, node)
                elif unpinned.released:
                    log.info(
                        "%s: unpinned %s on %s: the plan keeps it for no job (none reads it, "
                        "or the one that does cannot be met: see plan)",
                        region, spec, node,
                    )  # fmt: skip
                else:
                    if unpinned.problem:
                        failures.append(unpinned.problem)
                    continue  # try again next round (a node down this round: not called)
            del self.state.pins[key]
        for region, region_plan in plan.regions.items():
            if region in down:
                continue
            for node in self.topology.regions[region].nodes:
                for version, pin_until in region_plan.pins.items():
                    self.state.pins[f"{node} {_spec(version)}"] = _iso(pin_until) or ""
        self.state.pins.update(unshortened)  # the node's time, to match and try again
        return failures

    def _warm_reads(self) -> dict[tuple[str, str], datetime] | None:
        """(region, name@N) → until when jobs in warm's record read it; None when unreadable.

        Unread, every pin is kept this round: releasing one warm's job needs
        costs that job its data, keeping it a round costs nothing.
        """
        try:
            return warm_readers(self.topology.registry, self.clock())
        except (OriginError, TypeError, ValueError) as exc:  # unreadable, or edited by hand
            log.warning("cannot read warm's record, so no pin is released this round: %s", exc)
            return None

    def _read_schedule(self) -> Schedule:
        """The schedule file as it reads now, or the last good one while an edit is broken.

        An operator's half-saved or mistyped edit must neither stop the
        controller nor be acted on: the rounds go on with the last schedule
        that validated, and the error is logged once (not every round).
        Without a good schedule yet, the error is raised.
        """
        try:
            schedule = load_schedule(self.schedule_path, self.topology)
        except EdgeCacheError as exc:
            if self._schedule is None:
                raise
            self.metrics.schedule_valid.set(0)
            if str(exc) != self.schedule_error:
                log.error(
                    "%s; running on the last good schedule (read %s) until the file is "
                    "fixed: it is read again every round",
                    exc,
                    _iso(self._schedule_read_at),
                )
            self.schedule_error = str(exc)
            return self._schedule
        if self.schedule_error:
            log.info("%s is valid again; planning from it", self.schedule_path.name)
        self.schedule_error = ""
        self._schedule, self._schedule_read_at = schedule, self.clock()
        self.metrics.schedule_valid.set(1)
        return schedule

    def _evict_due(
        self, plan: Plan, schedule: Schedule, manifests: dict[str, pb.Manifest], now: datetime
    ) -> None:
        for region, region_plan in plan.regions.items():
            for eviction in region_plan.evictions:
                if eviction.at > now or self.stop.is_set():
                    continue  # not due, or stopping: begin nothing new
                self._evict(region, region_plan, eviction, schedule, manifests)

    def _evict(
        self,
        region: str,
        region_plan: RegionPlan,
        eviction: Eviction,
        schedule: Schedule,
        manifests: dict[str, pb.Manifest],
    ) -> bool:
        """Carry out one planned eviction; whether it was (the executor's guard may refuse it)."""
        key = (region, eviction.version)
        with self._lock:
            if key in self._runs:
                return False  # being staged right now: the plan is behind; next tick
            if any(r.task.source == region and r.key[1] == eviction.version for r, _ in
                   self._runs.values()):  # fmt: skip
                return False  # another region copies it from here right now: next tick
        self._keep_lease()
        evicted = self.executor.evict(
            eviction,
            schedule,
            manifests,
            planned_pin=region_plan.pins.get(eviction.version),
        )
        freed, problem = evicted.freed, evicted.problem
        if problem:
            if evicted.errors:  # not the guard's refusal: a node failed
                log.warning("%s: %s", region, problem)
                self.metrics.evictions_failed.inc()
                self._failed(f"{region}: {problem}")
            else:
                said = self._refused.get(key) == problem
                log.log(logging.DEBUG if said else logging.WARNING, "%s: %s", region, problem)
                self._refused[key] = problem
                self.metrics.evictions_refused.inc()
            return False
        self._refused.pop(key, None)
        log.info(
            "%s: evicted %s (%d bytes): %s",
            region,
            _spec(eviction.version),
            freed,
            eviction.reason,
        )
        self.metrics.evictions.inc()
        return True

    def _start_due(
        self,
        plan: Plan,
        schedule: Schedule,
        manifests: dict[str, pb.Manifest],
        now: datetime,
        looked: float,
        outages: dict[str, Outage],
    ) -> None:
        """Start each task whose planned start has come, from the plan's source.

        A task that copies from a peer region waits for the peer to hold the
        version, unless the peer cannot (:meth:`_peer_wont_do`): then it stages
        from origin now, and its log line and record say why. The job needs
        the data; the peer is only the cheaper way to it.
        """
        ends = {job.name: job.end for job in schedule.jobs}
        for region, region_plan in plan.regions.items():
            # Whether a task of this region's origin link waits out a failure's backoff:
            # the plan, which knows nothing of it, puts that task at "now" every round and
            # the next ones after it, so they were never due while it failed (a job whose
            # data was fine missed it). While it waits the link is idle: the next one is due.
            backing_off = False
            for task in region_plan.tasks:
                key = (region, task.version)
                record_key = f"{region} {task.spec}"
                with self._lock:
                    running = key in self._runs
                    ended = self._ended.get(key, 0.0)
                if running or ended >= looked:
                    continue  # running, or ended after this round's status: next round
                runs = self._runs_of(record_key)
                record = self.state.tasks[runs[-1]] if runs else None
                if record is not None and record.state == "done":
                    # Staged again (evicted since): a new record; the old stays.
                    record_key = f"{record_key} #{_run_number(runs[-1]) + 1}"
                    record = None
                if record is None:
                    record = self.state.tasks[record_key] = TaskRecord(
                        region=region,
                        version=task.spec,
                        source=task.source,
                        jobs=list(task.jobs),
                        deadline=_iso(task.deadline) or "",
                        planned_start=_iso(task.start) or "",
                        predicted_ready=_iso(task.finish) or "",
                    )
                else:  # pending, or failed and retried: the latest plan's view of it,
                    # deadline included (the same version may now be for a later job).
                    record.source, record.jobs = task.source, list(task.jobs)
                    record.deadline = _iso(task.deadline) or ""
                    record.planned_start = _iso(task.start) or ""
                    record.predicted_ready = _iso(task.finish) or ""
                if time.monotonic() < ended + self._backoff(key):
                    backing_off = backing_off or task.source == "origin"
                    continue  # failed lately: wait before trying again
                if self.stop.is_set():
                    continue  # stopping: begin nothing new
                if task.waits and task.start > now:
                    # A node's share fits only once a pin there runs out, at the task's
                    # start: never begun early, whatever its source or the link's backoff.
                    continue
                note = ""
                if task.source != "origin" and not self._peer_holds(task.source, task.version):
                    why = self._peer_wont_do(task, plan, outages)
                    if why is None:
                        continue  # the plan counts on the peer's own task, still on time
                    early = [e for e in region_plan.evictions if now < e.at <= task.start]
                    if _waits_for_room(task, region_plan, now) and (
                        # Another region's planned copy from here needs what it evicts.
                        any(copies_before(plan, e) for e in early)
                        # Its room is planned at the peer's finish, which every round
                        # re-plans after now while the peer fails: it never came, and
                        # the job started without its data. Made now, as the plan makes
                        # it then (the executor's guard refuses what a job still reads).
                        or not all(
                            self._evict(region, region_plan, e, schedule, manifests) for e in early
                        )
                    ):
                        continue  # it needs the room of an eviction still to come
                    # Its start was the peer's planned finish, re-planned every round
                    # while the peer fails: from origin, it is due now.
                    note = f"from origin: {task.source} will not hold {task.spec} ({why})"
                    log.warning("%s: staging %s %s", region, task.spec, note)
                    task = replace(task, source="origin")
                    record.source = "origin"
                elif task.start > now and not (
                    backing_off
                    and task.source == "origin"
                    and not self._origin_link_busy(region)
                    and not _waits_for_room(task, region_plan, now)
                ):
                    continue  # not due (unless only a task waiting out a backoff was before it)
                pin_until = max((ends[j] for j in task.jobs if j in ends), default=None)
                run = self.executor.make_run(task, manifests, pin_until)
                run.stop = self._term
                if note:
                    run.note = note
                    run.item.notes.append(note)
                    record.notes = [note]
                record.state, record.started_at, record.retry_at = "running", _iso(now), None
                record.attempts += 1
                record.predicted_ready = _iso(task.finish) or ""
                thread = threading.Thread(
                    target=self._run_task, args=(run, record), name=f"stage-{region}", daemon=True
                )
                with self._lock:
                    self._runs[key] = (run, thread)
                    self._run_records[key] = (record_key, record)
                log.info(
                    "%s: staging %s from %s (planned ready %s)",
                    region,
                    task.spec,
                    task.source,
                    record.predicted_ready,
                )
                thread.start()
                self.started += 1

    def _runs_of(self, task_key: str) -> list[str]:
        """The record keys of ``task_key``'s runs ("eu b@1", "eu b@1 #2", …), oldest first."""
        return sorted(
            (k for k in self.state.tasks if k.partition(" #")[0] == task_key), key=_run_number
        )

    def _prune(
        self, plan: Plan, schedule: Schedule, reports: list[NodeReport], now: datetime
    ) -> None:
        """Mark which task records are live, and drop the records that have had their day.

        A task is live while there is something to do or to wait for: it runs
        here, or it is the run the plan has (not an older run of the same
        task), or it is the last run, done, of a version a job that has not
        started reads. Only live
        tasks count in the ``edgecache_controller_tasks`` gauges: one that was
        late stops counting once its data is there and its jobs have started
        (the job's record keeps whether its data was there, and why not).
        Records are history for ``plan --status`` after that: a task's goes
        ``record_retention`` after the end of its last job, a job's
        ``record_retention`` after its end, and either goes at once when its
        jobs leave the schedule. In a region where no node answers (nothing is
        known there) nothing changes; a region with some of its nodes down is
        planned and staged on those that answer, so its tasks are judged as
        anywhere (frozen as well, its late and failed tasks never reached the
        gauges, and the alerts on them never fired).
        """
        down = {region for region, outage in region_outages(reports).items() if outage.unreachable}
        planned = {
            f"{r} {t.spec}" for r, region_plan in plan.regions.items() for t in region_plan.tasks
        }
        # What the region's jobs read now (the plan pins each): a job that follows a
        # dataset to its next version no longer waits for the one it was staged for.
        read = {
            f"{r} {_spec(v)}" for r, region_plan in plan.regions.items() for v in region_plan.pins
        }
        starts = {job.name: job.start for job in schedule.jobs}
        ends = {job.name: job.end for job in schedule.jobs}
        with self._lock:
            running = {f"{region} {_spec(version)}" for region, version in self._runs}
        latest: dict[str, str] = {}
        for key in self.state.tasks:
            base = key.partition(" #")[0]
            latest[base] = max(latest.get(base, key), key, key=_run_number)
        live = set()
        for key, record in list(self.state.tasks.items()):
            base = key.partition(" #")[0]
            if record.region in down:
                live |= {key} & self._live_tasks  # as it was: nothing is known there now
                continue
            waiting = any(starts.get(j, now) > now for j in record.jobs)
            if latest[base] == key and (base in running or base in planned):
                live.add(key)
            elif record.state == "done" and waiting and latest[base] == key and base in read:
                live.add(key)  # ready for a job still to come (its last run: one task)
            elif all(j not in ends or ends[j] + self.record_retention <= now for j in record.jobs):
                del self.state.tasks[key]
        self._live_tasks = live
        for name, job_record in list(self.state.jobs.items()):
            end = datetime.fromisoformat(job_record.end) if job_record.end else None
            if name not in starts or (end is not None and end + self.record_retention <= now):
                del self.state.jobs[name]

    def _origin_link_busy(self, region: str) -> bool:
        """Whether a run of ``region`` is staging from origin now (its link in use)."""
        with self._lock:
            return any(
                run.task.region == region and run.task.source == "origin"
                for run, _ in self._runs.values()
            )

    def _backoff(self, key: tuple[str, VersionKey]) -> float:
        """Seconds to wait after a run of ``key`` ended before starting another."""
        failures = self._failed_in_row.get(key, 0)
        if not failures:
            return 0.0
        return min(self.retry_backoff * 2 ** (failures - 1), RETRY_BACKOFF_MAX)

    def _peer_holds(self, region: str, version: VersionKey) -> bool:
        return version in self._complete.get(region, set())

    def _started_schedule(self, now: datetime) -> Schedule:
        """The schedule file, its started jobs on the versions they read."""
        return started_schedule(
            self._read_schedule(),
            self.state,
            self.topology.registry,
            now,
            schedule_owner(self.schedule_path),
        )

    def _peer_wont_do(self, task: StageTask, plan: Plan, outages: dict[str, Outage]) -> str | None:
        """Why ``task``'s peer source will not hold its version in time; None: wait for it.

        The peer cannot complete it when no node of the peer region answers,
        when the peer's own last run of it failed (its retries wait out a
        backoff and may fail again: a node of the peer that cannot stage it
        fails every one), or when no plan of the peer stages it. It is too
        late when the peer's planned finish plus the copy ends past the
        task's deadline, while origin, started now, would end sooner.
        """
        source, spec = task.source, task.spec
        outage = outages.get(source)
        if outage is not None and outage.unreachable:
            return "no node of it answers"
        runs = self._runs_of(f"{source} {spec}")
        with self._lock:
            failing = self._failed_in_row.get((source, task.version), 0)
        if failing or (runs and self.state.tasks[runs[-1]].state == "failed"):
            return "its staging failed"  # its retry (running now, maybe) may fail again
        source_plan = plan.regions.get(source)
        theirs = [t for t in source_plan.tasks if t.version == task.version] if source_plan else []
        if not theirs:
            return "nothing stages it there"
        copy = task.finish - task.start
        # The peer's copy this task copies from: the last one ready by its start (the
        # plan's source), not the peer's last copy of the version. A peer that stages
        # it again later (evicted in between) made every round call its copy too late
        # and fetch from origin, hours early.
        serving = [t.finish for t in theirs if t.finish <= task.start]
        peer_ready = (max(serving) if serving else min(t.finish for t in theirs)) + copy
        if peer_ready <= task.deadline:
            return None
        rate = self.topology.regions[task.region].origin_bandwidth
        if rate and self.clock() + timedelta(seconds=task.bytes / rate) >= peer_ready:
            return None  # origin would be no sooner: the peer is still the best way
        return (
            f"it would hold it only at {peer_ready:%Y-%m-%d %H:%M:%S}, after the deadline "
            f"{task.deadline:%Y-%m-%d %H:%M:%S}"
        )

    def _run_task(self, run: TaskRun, record: TaskRecord) -> None:
        try:
            self.executor.run(run, peer_wait=5.0)
            record.notes = list(run.item.notes)
            if run.item.peers_refused:
                self._peers_refused(record.region, run.item)
            if run.state == "done":
                record.state, record.ready_at, record.error = "done", _iso(self.clock()), ""
                log.info(
                    "%s: staged %s, ready at %s", record.region, record.version, record.ready_at
                )
                # What the nodes moved, by where it came from: a peer task may have fallen
                # back to origin, and a partly held version moves only the rest.
                self.metrics.staged_bytes["origin"].inc(run.item.origin_bytes)
                self.metrics.staged_bytes["peer"].inc(run.item.peer_bytes)
                predicted = datetime.fromisoformat(record.predicted_ready)
                self.metrics.ready_delay.observe((self.clock() - predicted).total_seconds())
            elif run.state == "pending":  # stopped: the next leaseholder resumes it
                record.state = "pending"
            else:
                record.state, record.error = "failed", "; ".join(run.item.failures)
        except EdgeCacheError as exc:
            record.state, record.error = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001 - a task thread must never die silently
            log.exception("staging %s in %s failed", record.version, record.region)
            record.state, record.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                if record.state == "failed":
                    self._failed_in_row[run.key] = self._failed_in_row.get(run.key, 0) + 1
                elif record.state == "done":
                    self._failed_in_row.pop(run.key, None)
            record.retry_at = None
            if record.state == "failed":
                retry = self.clock() + timedelta(seconds=self._backoff(run.key))
                record.retry_at = _iso(retry)
                problem = f"staging {record.version} in {record.region}: {record.error}"
                self._failed(problem)
                self.metrics.task_failures.inc()
                log.warning(
                    "%s (attempt %d); retrying in %.0f s if the plan still needs it",
                    problem,
                    record.attempts,
                    self._backoff(run.key),
                )
            with self._lock:
                self._runs.pop(run.key, None)
                self._run_records.pop(run.key, None)
                self._ended[run.key] = time.monotonic()

    def _peers_refused(self, region: str, item: WarmItem) -> None:
        """Say, count and keep a run whose peers refused the staging node's configuration.

        Each version staged from those peers comes from origin, at its egress price,
        until the setting the node's note names is fixed.
        """
        why = next((n for n in item.notes if any(p in n for p in item.peers_refused)), "")
        said = peers_refused_text(item.spec, region, item.peers_refused)
        said += f"; its note: {why}" if why else ""
        log.warning("peer refused: %s", said)
        self.metrics.peer_refusals.labels(region=region).inc()
        with self._lock:
            self.peer_refusals.append(said)

    def _failed(self, *problems: str) -> None:
        with self._lock:
            self.failures.extend(problems)

    # ------------------------------------------------------ plan vs reality

    def _observe(
        self,
        plan: Plan,
        schedule: Schedule,
        manifests: dict[str, pb.Manifest],
        reports: list[NodeReport],
        now: datetime,
    ) -> None:
        """Record which jobs' data is complete, and whether it was when each job started."""
        complete = complete_versions(reports, manifests)
        self._complete = complete
        for region, versions in complete.items():
            for version in versions:
                self.executor.mark_resident(region, version)
        reasons: dict[str, list[str]] = {}
        for item in plan.infeasible:
            reasons.setdefault(item.job, []).append(infeasible_reason(item))
        down = {region for region, outage in region_outages(reports).items() if outage.unreachable}
        # Not for a region that does not answer (its plan is made blind): the node-down
        # alert says that, with the right advice; this one says a plan that cannot be met.
        short = {item.job for item in plan.infeasible if not item.unreachable}
        for job in schedule.jobs:
            record = self.state.jobs.get(job.name)
            if job.end <= now:  # over: settle what is known, look no further
                if (
                    record is not None
                    and record.complete_at_start is None
                    and not record.unknown_at_start
                    and record.ready_at
                ):
                    record.complete_at_start = datetime.fromisoformat(record.ready_at) <= job.start
                continue
            reads = [
                (manifests[s].dataset, manifests[s].version) for s in job.datasets if s in manifests
            ]
            # Moved to another region and not judged yet: what was seen and planned was of
            # the old region's nodes (its readiness, its planned time, a miss named there),
            # so it is seen afresh; moved after its start, it is a job no round saw there
            # before it started (unknown at its start), not judged on the old region's data.
            moved = (
                record is not None
                and record.region != job.region
                and record.complete_at_start is None
                and not record.unknown_at_start
            )
            first_seen = record is None or record.start != _iso(job.start) or moved
            if record is None or first_seen:
                record = self.state.jobs[job.name] = JobRecord(
                    name=job.name,
                    region=job.region,
                    start=_iso(job.start) or "",
                    end=_iso(job.end) or "",
                    versions=[_spec(v) for v in reads],
                )
            if job.start > now or not record.resolved:  # kept from the start on
                record.resolved = {
                    s: _spec((manifests[s].dataset, manifests[s].version))
                    for s in job.datasets
                    if s in manifests
                }
                if record.versions != [_spec(v) for v in reads]:
                    # The schedule switched it to other versions: what was seen and planned
                    # was of the old ones.
                    record.ready_at = record.planned_ready = None
                record.versions = [_spec(v) for v in reads]
            planned_infeasible = record.infeasible  # the reasons of the last round before
            record.infeasible = reasons.get(job.name, [])
            if record.infeasible and record.infeasible != planned_infeasible and job.start > now:
                # Said when it becomes so, not first at the job's start (a version that does
                # not exist, a region too small): the plan knew rounds before.
                log.warning(
                    "job %s (starts %s) cannot be met: %s",
                    job.name,
                    f"{job.start:%Y-%m-%d %H:%M} UTC",
                    "; ".join(record.infeasible),
                )
            held = complete.get(job.region, set())
            missing = [_spec(v) for v in reads if v not in held] + [
                s for s in job.datasets if s not in manifests
            ]
            region_plan = plan.regions.get(job.region)
            tasks = [t for t in region_plan.tasks if job.name in t.jobs] if region_plan else []
            if missing and job.region not in down:
                record.ready_at = None  # gone since it was seen (evicted, lost): not ready
            elif not missing and record.ready_at is None:
                record.ready_at = _iso(now)
            if job.start > now:  # from the start on, the time planned stays as it was
                if tasks:
                    record.planned_ready = _iso(max(t.finish for t in tasks))
                elif not missing and record.planned_ready is None:
                    record.planned_ready = record.ready_at
            if record.complete_at_start is not None or record.unknown_at_start:
                continue  # judged at its start, once
            if job.start < now and first_seen:
                # No round saw it before it started: what was there at its start is not
                # known, whatever is there now (or whether its region answers now).
                record.unknown_at_start = UNSEEN_BEFORE_START
                self.metrics.jobs_unknown_at_start.inc()
                log.warning(
                    "job %s had started (%s) before this controller first saw it: %s; "
                    "whether its data was there at its start is unknown",
                    job.name,
                    _minute(record.start),
                    UNSEEN_BEFORE_START,
                )
                continue
            if job.start <= now:
                # Complete now, or, where no node of the region answers now, when last seen
                # before the start (ready_at is cleared whenever a round sees data missing).
                ready = record.ready_at and datetime.fromisoformat(record.ready_at) <= job.start
                record.complete_at_start = bool(ready) or not missing
                record.missing_at_start = [] if record.complete_at_start else missing
                if not record.complete_at_start:
                    record.why_missed = self._why_missed(
                        record,
                        missing,
                        planned_infeasible,
                        down=job.region in down,
                        first_seen=first_seen,
                    )
                    self.metrics.jobs_unready_at_start.inc()
                    log.warning(
                        "job %s started without %s: %s",
                        job.name,
                        ", ".join(missing),
                        record.why_missed,
                    )

        # Jobs yet to start, and running ones no round saw before their start: one that
        # started without its data is the plan's too (staged now), but it is
        # jobs_unready_at_start_total's, counted at its start; counted here as well it
        # fired the cannot-be-met alert, whose advice does not fit it (a hunt). One no
        # round saw before its start was in neither, and no alert said it (another hunt).
        self.metrics.jobs_infeasible.set(
            sum(
                1
                for job in schedule.jobs
                if job.name in short
                and job.end > now
                and (job.start > now or self.state.jobs[job.name].unknown_at_start)
            )
        )

    def _why_missed(
        self,
        record: JobRecord,
        missing: list[str],
        infeasible: list[str],
        *,
        down: bool,
        first_seen: bool,
    ) -> str:
        """Why a job started without ``missing``, from what is known at its start.

        ``infeasible``: the planner's reasons of the last round before the start
        (capacity, bandwidth); a plan made after the start only says the job
        started without its data. Kept in the job's record: the task records it
        is built from change with later runs and go after the retention
        (:meth:`_prune`), and ``plan --status`` must still say why the job
        missed once its data has come.
        """
        if down:
            return f"no node of {record.region} answered at the start"
        why = []
        for spec in missing:
            planned = any(reason.startswith((f"{spec}: ", f"{spec} ")) for reason in infeasible)
            runs = self._runs_of(f"{record.region} {spec}")
            task = self.state.tasks[runs[-1]] if runs else None
            if planned and (task is None or task.state == "done"):
                continue  # the planner's reason (below) says why nothing was staged
            # What its task did is what happened, and is said first: the planner's "cannot
            # be met" (it would be late) came before and was kept alone, hiding that the
            # staging was still running, or had failed, at the start.
            if task is None or task.state == "done":
                if spec.partition("@")[2].isdigit():
                    again = " (staged before, gone since)" if task is not None else ""
                    why.append(f"nothing staged {spec} before the start{again}")
                else:
                    why.append(f"{spec} is not in the registry")
            elif task.state == "failed":
                why.append(f"staging {spec} failed: {task.error}")
            elif task.state == "running":
                why.append(
                    f"staging {spec} was still running at the start (started "
                    f"{_minute(task.started_at)}, planned ready {_minute(task.predicted_ready)})"
                )
            else:
                why.append(
                    f"staging {spec} had not begun before the start (planned start "
                    f"{_minute(task.planned_start)}, ready {_minute(task.predicted_ready)})"
                )
        if infeasible:
            why.append("cannot be met: " + "; ".join(infeasible))
        if first_seen:
            why.append("no controller round saw the job before it started")
        return "; ".join(why)

    def _update_metrics(self, now: datetime) -> None:
        counts = dict.fromkeys(("pending", "running", "done", "failed", "late"), 0)
        for key, record in self.state.tasks.items():
            if key not in self._live_tasks:
                continue  # history: kept for plan --status, not counted as if still at stake
            # One state per task: a late one counts as late only, so the states add up to
            # the live tasks (a running task past its deadline was counted twice).
            deadline = datetime.fromisoformat(record.deadline) if record.deadline else None
            ready = datetime.fromisoformat(record.ready_at) if record.ready_at else None
            late = deadline is not None and (ready or now) > deadline
            state = "late" if late else record.state
            counts[state] = counts.get(state, 0) + 1
        for state, count in counts.items():
            self.metrics.tasks.labels(state=state).set(count)

    # ------------------------------------------------------------------ loop

    def health(self, interval: float) -> str | None:
        """None while rounds keep turning; else why not (for a liveness probe)."""
        last = self.metrics.last_tick._value.get()
        if last and time.time() - last > max(3 * interval, 60.0):
            return f"no planning round for {time.time() - last:.0f} s"
        return None

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until every task started so far has ended, then record what is there."""
        with self._lock:
            threads = [thread for _, thread in self._runs.values()]
        for thread in threads:
            thread.join(timeout)
        self.refresh()

    def held_whole(self) -> set[tuple[str, VersionKey]]:
        """(region, version) pairs the region's nodes held whole at the last look.

        After :meth:`wait_idle`, what the round left: ``controller --once`` does not
        call a job's version "cannot be met" when its own round staged it whole.
        """
        return {(region, v) for region, versions in self._complete.items() for v in versions}

    @property
    def last_schedule(self) -> Schedule | None:
        """The last schedule that validated (the one the rounds act on)."""
        return self._schedule

    def refresh(self) -> None:
        """Look at the nodes and record which jobs' data is complete, without acting.

        Only while this controller holds the lease: the record is the leader's
        (a standby's copy, saved, would write over it).
        """
        other = self.leader()
        if other is not None:
            log.info("controller %s holds the lease: its record stands", other.holder)
            return
        now = self.clock()
        schedule = self._started_schedule(now)
        reports = gather_status(
            self.topology, self._status_timeout(), token=self.token, pings=STATUS_PINGS
        )
        plan, manifests = make_plan(
            self.topology, schedule, now=now, reports=reports, token=self.token
        )
        self._observe(plan, schedule, manifests, reports, now)
        self._prune(plan, schedule, reports, now)
        self._update_metrics(now)
        self._save_state()

    def run(self, interval: float) -> None:
        """Tick every ``interval`` seconds until :attr:`stop` is set (SIGTERM, Ctrl-C)."""
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
                self.last_error = ""
            except EdgeCacheError as exc:
                # A bad schedule edit or an unreachable registry: say so, keep the last
                # work running, and try again next tick.
                self.last_error = str(exc)
                self.metrics.tick_errors.inc()
                self.metrics.last_tick.set(time.time())  # alive, if unhappy: alerts say so
                log.error("tick failed: %s", exc)
            self.stop.wait(max(interval - (time.monotonic() - started), 0.0))
