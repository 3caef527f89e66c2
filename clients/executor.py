"""Carrying out a plan: pins, evictions and staging, from the plan's sources, at its times.

The planner decides; this module does what it decided, for ``edgecache warm``
(everything now) and for the controller (each task when its start comes):

* **Pins.** Every version a scheduled job reads is pinned on its region's
  nodes until that job ends, resident ones included, so a node's LRU never
  evicts what the plan counts on keeping.
* **Evictions.** The plan's evictions run with ``Evict`` before the staging
  that needs their room, and never take a version a job is reading now, or
  will read before the plan's eviction time (``warm`` runs early; the guard
  holds the plan's promise to the jobs in between), nor one a node pins for
  a job outside the schedule (another schedule's warm or controller), as
  ``edgecache evict`` refuses to. A pin is never cut short either: a node
  pinning a version longer than the plan keeps that pin (``warm`` shortens
  a longer pin its own record placed beforehand, with :meth:`~PlanExecutor.release`).
* **Staging.** Each task stages on the region's nodes that answer (each
  node its own shards among them: a node down leaves its share to the
  others), from the source the plan chose: origin, or a peer region's nodes,
  which the receiving node copies chunk for chunk. A task from a peer waits
  until the peer region holds the whole version.

Everything is idempotent: staging skips shards already cached, pins and
evictions are set states, so running the same plan again finishes what a
crash or a Ctrl-C left undone without fetching anything twice.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import grpc

from edgecache.cache.planner import Eviction, Plan, StageTask, VersionKey
from edgecache.clients.channels import bearer, edge_stub, node_error
from edgecache.clients.ops import (
    NodeReport,
    WarmItem,
    WarmPin,
    complete_versions,
    gather_status,
    region_nodes,
    replica_names,
    stage_item,
)
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

__all__ = [
    "SAME_PIN",
    "Deferred",
    "Evicted",
    "NodeCalls",
    "NodesSeen",
    "PinReleased",
    "PlanExecutor",
    "Released",
    "TaskRun",
    "WarmOutcome",
    "eviction_blocker",
    "release_line",
]

log = logging.getLogger(__name__)

PEER_WAIT_SECONDS = 3600.0  # how long a peer-sourced task waits for its source region
CALL_TIMEOUT = 30.0  # seconds: the longest a Pin or Evict call may take
MIN_CALL_SECONDS = 0.5  # less time left than this: a call is not begun
SAME_PIN = timedelta(seconds=1)  # pins this close are the same (a Timestamp round trip)

_Request = TypeVar("_Request")
_Answer = TypeVar("_Answer")


class _NotDone(Exception):
    """A node call that failed or was not begun; its text is the failure, one line."""

    @property
    def code(self) -> grpc.StatusCode | None:
        """The status the node answered with; None for a call not begun."""
        cause = self.__cause__
        code = getattr(cause, "code", None) if isinstance(cause, grpc.RpcError) else None
        return code() if callable(code) else None


@dataclass(frozen=True)
class NodesSeen:
    """What a round's status says of the nodes, read once and shared by the round's steps.

    ``down``: the nodes that did not answer (a round starts :class:`NodeCalls`
    with them). ``pins``: (node, version) → the time each answering node pins
    the version until; pinning skips what is already pinned as planned, and the
    controller releases only a pin a node still has as it placed it.
    """

    down: frozenset[str] = frozenset()
    pins: Mapping[tuple[str, VersionKey], datetime] = field(default_factory=dict)
    # address → the id each answering node reports: what replicas split shards by
    names: Mapping[str, str] = field(default_factory=dict)
    # address → the registry each answering node reads ("" from a node too old to say):
    # staging refuses a node that reads another than the topology's
    registries: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, reports: Sequence[NodeReport]) -> NodesSeen:
        """Read ``reports`` (:func:`~edgecache.clients.ops.gather_status`)."""
        down, pins, registries = set(), {}, {}
        for report in reports:
            if report.status is None:
                down.add(report.address)
                continue
            registries[report.address] = report.status.registry
            for v in report.status.versions:
                if v.HasField("pinned_until"):
                    until = v.pinned_until.ToDatetime(tzinfo=UTC)
                    pins[(report.address, (v.dataset, v.version))] = until
        return cls(frozenset(down), pins, replica_names(reports), registries)


@dataclass
class NodeCalls:
    """Which nodes may still be called (Pin, Evict), and by when every call must end.

    A node that accepts connections and never answers makes each call run to
    its timeout, one after another over versions and nodes: a controller's
    round would outlast its lease. So a node that did not answer the status
    (``down``), or whose call timed out or found it unavailable since, is not
    called again; and no call runs past ``deadline`` (``time.monotonic()``),
    which the controller keeps inside its lease. ``renew``, when set, runs
    before each call: the controller renews its lease there when ``deadline``
    is near, and moves it, so that a call is not skipped merely because the
    lease was last renewed a while ago (its raising stops the calls: another
    controller took the lease). Calls not made are failures of this round:
    the next one makes them.
    """

    deadline: float = math.inf
    down: set[str] = field(default_factory=set)
    renew: Callable[[], None] | None = None

    def timeout(self) -> float | None:
        """Seconds the next call may take, or None when there is no time left for one."""
        if self.renew is not None:
            self.renew()
        left = self.deadline - time.monotonic()
        return min(CALL_TIMEOUT, left) if left >= MIN_CALL_SECONDS else None

    def failed(self, node: str, exc: grpc.RpcError) -> None:
        """Note a failed call: a node that timed out or is unavailable is not called again."""
        if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            self.down.add(node)

    @staticmethod
    def out_of_time(node: str, what: str) -> str:
        """The failure for a call not made because the round ran out of time."""
        return (
            f"{what} on {node}: not tried, this round ran out of time (the controller's "
            "lease; see --lease-ttl); the next round tries again"
        )


@dataclass(frozen=True)
class PinReleased:
    """What :meth:`PlanExecutor.shorten` or :meth:`~PlanExecutor.unpin` did with a caller's pin.

    Done, failed (``problem`` says why), taken, or not tried. Taken: the node
    holds the pin until another time than the one the caller placed, so
    someone pinned it since, and it was left as it is (the caller's record of
    it is stale: drop it). Not tried (nothing set): the node is down this
    round, so it was not called; nothing to report, the next round tries again.
    """

    released: bool = False
    problem: str | None = None
    taken: bool = False


@dataclass
class Released:
    """What :meth:`PlanExecutor.release` did with the pins of jobs no longer scheduled."""

    released: list[WarmPin] = field(default_factory=list)
    kept: list[WarmPin] = field(default_factory=list)  # not released yet: the next run tries
    problems: list[str] = field(default_factory=list)  # why a release failed (a failure)
    # Pins on nodes this run's topology does not list: kept, said, not a failure (a node
    # taken out of the topology would fail every run until its pin ran out).
    notes: list[str] = field(default_factory=list)


_STAYS = "the pin stays, and the next warm of this schedule releases it"


def _unlisted(pin: WarmPin) -> str:
    """Why a pin on a node this run's topology does not list is neither released nor dropped."""
    return (
        f"{pin.region}: the pin of {pin.version} on {pin.node} (until "
        f"{pin.until:%Y-%m-%d %H:%M}), which an earlier warm of this schedule placed, is "
        f"not released: this run's topology does not list {pin.node} in region "
        f"{pin.region}. It stays in warm's record until it runs out; a warm with the "
        "topology that lists that node (--config) releases it sooner"
    )


def release_line(pin: WarmPin, plan: Plan, *, dry_run: bool = False, who: str = "") -> str:
    """What :meth:`PlanExecutor.release` did with ``pin`` (or would), as warm and the demo say it.

    A pin with ``shorten_to`` was set to that time, not released: saying
    "released" of it sent an operator looking for a pin the node still keeps.
    ``who`` names the one that acts (``plan`` says what warm would do).
    """
    region = f"{pin.region}: {who} " if who else f"{pin.region}: "
    if pin.shorten_to is None:
        unmet = sorted(
            {
                row.job
                for row in plan.infeasible
                if (row.region, row.version) == (pin.region, pin.version)
            }
        )
        why = (
            # Still read, but not to be staged (the plan drops such a pin: a reader's
            # fetches through it would be kept with no room for the rest).
            f"{', '.join(unmet)}, which reads it, cannot be met there: the plan does not "
            "stage it, and keeps no pin for it"
            if unmet
            else "no job of the schedule reads it there any more"
        )
        return (
            f"{region}{'would release' if dry_run else 'released'} the pin of "
            f"{pin.version} on {pin.node} (until {pin.until:%Y-%m-%d %H:%M}): {why}"
        )
    region_plan = plan.regions.get(pin.region)
    planned = region_plan.pins.get(pin.key) if region_plan is not None else None
    others = "a job another schedule or the controller recorded reads it until then"
    if planned is None:
        why = f"no job of the schedule reads it there any more, and {others}"
    elif pin.shorten_to - planned <= SAME_PIN:
        why = "the schedule's last job that reads it there now ends then (moved earlier)"
    else:
        why = (
            f"the schedule's last job that reads it there now ends at "
            f"{planned:%Y-%m-%d %H:%M}, and {others}"
        )
    return (
        f"{region}{'would shorten' if dry_run else 'shortened'} the pin of "
        f"{pin.version} on {pin.node} from {pin.until:%Y-%m-%d %H:%M} to "
        f"{pin.shorten_to:%Y-%m-%d %H:%M}: {why}"
    )


@dataclass
class TaskRun:
    """One staging task being carried out, and what happened to it."""

    task: StageTask
    item: WarmItem
    state: str = "pending"  # pending, waiting (for a peer), running, done, failed, deferred
    started_at: datetime | None = None
    finished_at: datetime | None = None
    note: str = ""
    # Stops this run instead of the executor's own stop (whoever sets it sets it when the
    # executor's would be): a controller ends its runs with the lease they were started
    # under, since another controller acts on the version from then on.
    stop: threading.Event | None = None

    @property
    def key(self) -> tuple[str, VersionKey]:
        """(region, version): at most one run of it at a time."""
        return self.task.region, self.task.version

    @property
    def staged(self) -> bool:
        """Whether the region holds the version after the run (or would, rehearsed)."""
        return self.state in ("done", "would stage")


@dataclass(frozen=True)
class Deferred:
    """Something of the plan that could not be done now, and why."""

    region: str
    what: str
    reason: str


@dataclass(frozen=True)
class Evicted:
    """What one eviction came to: bytes freed, or the guard's refusal, or nodes' errors."""

    freed: int = 0
    # "not evicting NAME@N: job … reads it" (no node was asked), or a node found it pinned
    # since the plan's status read (Evict's unless_pinned_after: ABORTED)
    refused: str | None = None
    errors: tuple[str, ...] = ()

    @property
    def problem(self) -> str | None:
        """The refusal or the errors, as one line; None when it was done."""
        return self.refused or "; ".join(self.errors) or None


@dataclass
class WarmOutcome:
    """What ``warm`` did with a plan."""

    runs: list[TaskRun] = field(default_factory=list)
    evicted: list[tuple[Eviction, int]] = field(default_factory=list)  # (eviction, bytes freed)
    deferred: list[Deferred] = field(default_factory=list)
    pin_failures: list[str] = field(default_factory=list)
    pins_failed: set[tuple[str, VersionKey]] = field(default_factory=set)  # (region, version)
    # Evictions a node failed (not the guard's refusals, which are deferrals): a failure
    # like a stage's, so warm exits 1, where a deferral waits for the plan's time.
    evict_failures: list[str] = field(default_factory=list)
    # (region, version) the region's nodes hold whole once the plan was carried out (or,
    # rehearsed, would): a pin on any other holds no data yet (its staging deferred or failed).
    held: set[tuple[str, VersionKey]] = field(default_factory=set)

    @property
    def failed(self) -> list[TaskRun]:
        """Runs that failed (a node or a transfer)."""
        return [r for r in self.runs if r.state == "failed"]


def _deferred_note(task: StageTask, why: str, *, failed: bool = False) -> str:
    """Why a task waits (``why``), and when to act: warm acts now, the plan starts it later.

    The task needs the room of an eviction refused now, or of a pin on one node
    that runs out at its start, so it can only run then: the plan's start says
    when that is. An eviction a node failed is not waited out: it is retried
    once the node is mended, so the note says that instead.
    """
    if failed:
        return (
            f"{why}; run warm again once that node answers (its status and "
            "logs say why it failed), or let `edgecache controller` retry it"
        )
    start = f"{task.start.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    return (
        f"{why}; the plan starts it at {start}: run warm again then, or let "
        "`edgecache controller` stage it on time"
    )


def copies_before(plan: Plan, eviction: Eviction) -> list[StageTask]:
    """Other regions' tasks that copy what ``eviction`` removes, planned to begin by then.

    The plan keeps the version in the lending region until those copies end:
    warm waits for them before evicting, and the controller evicts no sooner.
    """
    return [
        task
        for name, region_plan in plan.regions.items()
        if name != eviction.region
        for task in region_plan.tasks
        if task.source == eviction.region
        and task.version == eviction.version
        and task.start <= eviction.at
    ]


def eviction_blocker(
    eviction: Eviction, schedule: Schedule, manifests: Mapping[str, pb.Manifest], now: datetime
) -> str | None:
    """The job that evicting now would break, or None.

    A job in the eviction's region that reads the version and is running, or
    starts before the plan's eviction time, counts on the version being there.
    """
    latest = max(now, eviction.at)
    for job in schedule.jobs:
        if job.region != eviction.region or job.end <= now or job.start > latest:
            continue
        for spec in job.datasets:
            manifest = manifests.get(spec)
            if manifest is not None and (manifest.dataset, manifest.version) == eviction.version:
                when = "is reading it" if job.start <= now else f"starts at {job.start:%H:%M}"
                return f"job {job.name} {when} (until {job.end:%Y-%m-%d %H:%M})"
    return None


class PlanExecutor:
    """Pins, evicts and stages as a plan says, on the nodes of a topology."""

    def __init__(
        self,
        topology: Topology,
        *,
        token: str | None = None,
        stop: threading.Event | None = None,
        on_progress: Callable[[TaskRun], None] = lambda run: None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.topology, self.token = topology, token
        self.stop = stop or threading.Event()
        self.on_progress = on_progress
        self.clock = clock
        self._resident: dict[tuple[str, VersionKey], threading.Event] = {}
        # → why a region will not hold a version (its staging deferred or failed),
        # until it does or drops it: peer tasks stage from origin meanwhile.
        self._wont_hold: dict[tuple[str, VersionKey], str] = {}
        self._lock = threading.Lock()
        # Which nodes Pin and Evict may still call, and until when: a controller sets a
        # fresh one each round (its lease bounds the round); warm keeps this one.
        self.calls = NodeCalls()
        # (node, version) → pin, as the round's status found them before this plan
        # pinned anything: what the eviction guard reads for other schedules' pins.
        self._pins_seen: dict[tuple[str, VersionKey], datetime] | None = None
        # address → node id, from the status rounds seen (NodesSeen.names): staging splits
        # a version's shards by them
        self._names: dict[str, str] = {}
        # address → the registry the node reads, from the same rounds (NodesSeen.registries):
        # staging refuses a node that reads another than the topology's
        self._registries: dict[str, str] = {}

    # ------------------------------------------------------------------ pins

    def pin(self, plan: Plan, seen: NodesSeen | None = None) -> list[str]:
        """Pin every version the plan keeps, on every node of its region; failures listed.

        ``seen`` is the round's status, whose down nodes the caller has put in
        :attr:`calls`; without it the nodes are asked now. A node already
        pinning a version until that time is not asked again; nor is one
        :attr:`calls` holds as down (its outage is the failure to report, not
        each pin).
        """
        return [problem for _, _, problem in self._pin(plan, seen)]

    def _pin(self, plan: Plan, seen: NodesSeen | None) -> list[tuple[str, VersionKey, str]]:
        """:meth:`pin`, each failure with its (region, version), for those who report pins."""
        seen = self._see(gather_status(self.topology, token=self.token)) if seen is None else seen
        self._pins_seen = dict(seen.pins)
        self._names.update(seen.names)
        self._registries.update(seen.registries)
        calls = self.calls
        failures = []
        for region, region_plan in plan.regions.items():
            for node in self.topology.regions[region].nodes:
                for version, until in sorted(region_plan.pins.items()):
                    have = seen.pins.get((node, version))
                    # Pinned as planned, or longer (for another schedule's job: Pin sets
                    # the time, and a shorter one would let the node drop what it needs).
                    # A longer pin warm's own record placed was shortened before, by
                    # release (dropped_warm_pins' shorten_to), when nothing else needs it.
                    if node in calls.down or (have is not None and have > until - SAME_PIN):
                        continue
                    problem = self._pin_node(node, version, until)
                    if problem is not None:
                        failures.append((region, version, problem))
        return failures

    def _pin_node(self, node: str, version: VersionKey, until: datetime) -> str | None:
        """Pin ``version`` on ``node`` until at least ``until``; why not, or None when it did.

        Pin's ``extend``: the node keeps a later pin it holds, so one someone placed
        after the status read this decision came from is not cut back.
        """
        request = edge_pb2.PinRequest(dataset=version[0], version=version[1], extend=True)
        request.until.FromDatetime(until)  # an aware time: protobuf turns it into UTC
        try:
            self._node_call(node, f"pinning {version[0]}@{version[1]}", lambda s: s.Pin, request)
        except _NotDone as failure:
            return str(failure)
        return None

    def _pin_region(self, region: str, version: VersionKey, until: datetime) -> str | None:
        """Pin ``version`` until ``until`` on every node of ``region``; the first failure."""
        for node in self.topology.regions[region].nodes:
            if node not in self.calls.down and (problem := self._pin_node(node, version, until)):
                return problem
        return None

    def shorten(
        self, node: str, version: VersionKey, until: datetime, *, placed: datetime
    ) -> PinReleased:
        """Set the caller's pin of ``version`` on ``node``, placed until ``placed``, to ``until``.

        For the caller's own pin only (its job now ends sooner): :meth:`pin` never
        cuts a longer pin short, since it may be another schedule's. The node
        changes it only while it still holds ``placed`` (Pin's ``if_until``), in
        the same transaction: a pin someone lengthened since, even between the
        caller's status read and this call, is theirs too and stays. A node held
        as down this round is not called again: that is said, as a failure to
        shorten, and the caller keeps the node's time in its record to try again.
        """
        if node in self.calls.down:
            return PinReleased(
                problem=f"{node} is down this round: its pin of {version[0]}@{version[1]} stays"
            )
        return self._release_pin(node, version, until, placed, "shortening")

    def unpin(self, node: str, version: VersionKey, *, placed: datetime) -> PinReleased:
        """Remove the caller's pin of ``version`` on ``node``, placed until ``placed``.

        Only while the node still holds ``placed``, as :meth:`shorten`. A node
        :attr:`calls` holds as down is not called, as :meth:`pin` skips it: its
        outage is already this round's failure, and another call would only cost
        another timeout. Nothing is reported; the pin stays, for the next round
        to release.
        """
        if node in self.calls.down:
            return PinReleased()
        return self._release_pin(node, version, None, placed, "unpinning")

    def _release_pin(
        self,
        node: str,
        version: VersionKey,
        until: datetime | None,
        placed: datetime,
        doing: str,
    ) -> PinReleased:
        """One conditional Pin call (``if_until=placed``) setting ``until`` (None: unpin)."""
        request = edge_pb2.PinRequest(dataset=version[0], version=version[1])
        if until is not None:
            request.until.FromDatetime(until)
        request.if_until.FromDatetime(placed)
        try:
            self._node_call(node, f"{doing} {version[0]}@{version[1]}", lambda s: s.Pin, request)
        except _NotDone as failure:
            if failure.code == grpc.StatusCode.ABORTED:
                log.info("%s", failure)  # names the node, the pin and the time it holds
                return PinReleased(taken=True)
            return PinReleased(problem=str(failure))
        return PinReleased(released=True)

    def release(
        self, pins: Sequence[WarmPin], reports: Sequence[NodeReport], *, dry_run: bool = False
    ) -> Released:
        """Release pins an earlier warm placed that its plan keeps no more (``dropped_warm_pins``).

        Only a pin the node still has as placed is released: one gone, or set
        to another time since (someone pinned it again), is not warm's any
        more, and its record is dropped. A pin with ``shorten_to`` is set to that
        time instead (the schedule's own job, moved earlier, or a job another
        record holds reads the version until then): Pin sets the time a node
        keeps, shorter or not. A pin on a node that did not answer (a problem
        says so), or whose release failed, is kept for the next run. One on a
        node this run's topology does not list (another ``--config``) is left
        alone, with a note saying which topology releases it (warm's record
        keeps it). ``dry_run`` releases nothing and lists what would be.
        """
        seen = self._see(reports)
        out = Released()
        for pin in pins:
            if pin.node in self.calls.down:
                # Said: in a region no job of the schedule uses any more, nothing else
                # named the node, and warm exited 0 with the pin in place (a helper's hunt).
                out.kept.append(pin)
                out.problems.append(
                    f"{pin.region}: the pin of {pin.version} on {pin.node} (until "
                    f"{pin.until:%Y-%m-%d %H:%M}): the node did not answer; {_STAYS}"
                )
                continue
            if not self.topology.lists(pin.node, pin.region):
                # Not asked for its pins at all: taken as "gone", the pin was dropped from
                # the record while the node kept it, and only evict --force freed the room.
                # The record keeps it (record_warmed_jobs keeps every pin of the schedule
                # on a node the topology does not list); here it is only said.
                out.notes.append(_unlisted(pin))
                continue
            have = seen.pins.get((pin.node, pin.key))
            if have is None or abs(have - pin.until) >= SAME_PIN:
                continue
            if dry_run:
                out.released.append(pin)
                continue
            if pin.shorten_to is not None:  # a job still reads it there, until then
                done = self.shorten(pin.node, pin.key, pin.shorten_to, placed=pin.until)
            else:
                done = self.unpin(pin.node, pin.key, placed=pin.until)
            if done.released:
                out.released.append(pin)
            elif not done.taken:  # taken: pinned again since, not warm's any more
                out.kept.append(pin)
                if done.problem:
                    out.problems.append(f"{done.problem}; {_STAYS}")
        return out

    def _see(self, reports: Sequence[NodeReport]) -> NodesSeen:
        """Read a status round once; the nodes that did not answer join :attr:`calls`' down."""
        seen = NodesSeen.of(reports)
        self.calls.down |= seen.down
        self._pins_seen = dict(seen.pins)
        self._names.update(seen.names)
        self._registries.update(seen.registries)
        return seen

    def _node_call(
        self,
        node: str,
        what: str,
        rpc: Callable[
            [edge_pb2_grpc.EdgeCacheStub], grpc.UnaryUnaryMultiCallable[_Request, _Answer]
        ],
        request: _Request,
    ) -> _Answer:
        """One call of ``rpc`` (Pin, Evict) to ``node`` within :attr:`calls`' time: its answer.

        Raises :class:`_NotDone` with the failure as one line naming the node
        and ``what`` was being done: the call was not begun for want of time,
        or it failed, and then a node that timed out or is unavailable is held
        as down (:meth:`NodeCalls.failed`). Whether to call a node held as down
        is the caller's to decide: a pin skips it, an eviction counts it as not
        done.
        """
        calls = self.calls
        timeout = calls.timeout()
        if timeout is None:
            raise _NotDone(calls.out_of_time(node, what))
        try:
            with edge_stub(node) as stub:
                return rpc(stub)(request, timeout=timeout, metadata=bearer(self.token))
        except grpc.RpcError as exc:
            calls.failed(node, exc)
            raise _NotDone(str(node_error(exc, endpoint=node, what=what))) from exc

    # ------------------------------------------------------------- evictions

    def evict(
        self,
        eviction: Eviction,
        schedule: Schedule,
        manifests: Mapping[str, pb.Manifest],
        *,
        planned_pin: datetime | None = None,
    ) -> Evicted:
        """Carry out one eviction on every node of its region, unless the guard refuses it.

        ``planned_pin``: the plan's own pin of the version in the region (it pins
        for a later job what it evicts now), which the eviction may drop.
        """
        spec = f"{eviction.version[0]}@{eviction.version[1]}"
        now = self.clock()
        own = self._own_end(eviction, schedule, manifests, now)
        blocker = eviction_blocker(eviction, schedule, manifests, now) or self._pinned_elsewhere(
            eviction, own, now
        )
        if blocker is not None:
            return Evicted(refused=f"not evicting {spec}: {blocker}")
        # What the guard allowed, the node checks again in the eviction's transaction: a
        # pin another tool placed since the round's status read makes it refuse.
        limit = max(t for t in (own, planned_pin, now) if t is not None)
        done = self._evict_nodes(eviction, unless_pinned_after=limit)
        # Tasks of other regions that would copy it from here stage from origin instead.
        # Dropping the region's record left a task already waiting on it (the plan evicts
        # here at the moment another region copies from here) to wait out
        # PEER_WAIT_SECONDS, an hour, on an event nothing would set.
        self.mark_wont_hold(eviction.region, eviction.version, f"{spec} was evicted there")
        return done

    def _pinned_elsewhere(
        self, eviction: Eviction, own: datetime | None, now: datetime
    ) -> str | None:
        """The pin of a job outside the schedule that keeps the version on a node, or None.

        The pins are those the round's status found (before this plan pinned
        anything), else the region's nodes are asked now. A pin is the
        schedule's own when it lasts no longer than ``own``, the end of the last
        of its jobs in the region that read the version (:meth:`_own_end`; what
        :meth:`pin` places); a longer one, or one on a version no such job
        reads, was placed for someone else.
        """
        region, version = eviction.region, eviction.version
        pins = self._pins_seen
        if pins is None:
            pins = dict(
                NodesSeen.of(gather_status(self.topology, token=self.token, regions={region})).pins
            )
        for node in self.topology.regions[region].nodes:
            until = pins.get((node, version))
            if until is None or until <= now or (own is not None and until <= own + SAME_PIN):
                continue
            spec = f"{version[0]}@{version[1]}"
            return (
                f"{node} pins it until {until.astimezone(UTC):%Y-%m-%d %H:%M} UTC for a job "
                f"outside this schedule (`edgecache evict {spec} --region {region}` names "
                "it); change that job's schedule, or wait until then"
            )
        return None

    @staticmethod
    def _own_end(
        eviction: Eviction,
        schedule: Schedule,
        manifests: Mapping[str, pb.Manifest],
        now: datetime,
    ) -> datetime | None:
        """The end of the last job of ``schedule`` in the region that reads the version.

        A pin up to then is the schedule's own (what :meth:`pin` places).
        """
        ours = [
            job.end
            for job in schedule.jobs
            if job.region == eviction.region and job.end > now
            and any(
                (m.dataset, m.version) == eviction.version
                for spec in job.datasets
                if (m := manifests.get(spec)) is not None
            )
        ]  # fmt: skip
        return max(ours, default=None)

    def _evict_nodes(self, eviction: Eviction, *, unless_pinned_after: datetime) -> Evicted:
        """Ask every node of the eviction's region to drop the version.

        A node :attr:`calls` holds as down is not asked: it is named in the errors,
        so the eviction counts as not done there (the next round's plan sees
        whether the node still holds the version when it answers again). A node
        that answers NOT_FOUND holds nothing of a version no longer published:
        nothing to free there, which is what the eviction asked for.
        """
        what = f"evicting {eviction.version[0]}@{eviction.version[1]}"
        freed, errors, pinned = 0, [], []
        request = edge_pb2.EvictRequest(dataset=eviction.version[0], version=eviction.version[1])
        request.unless_pinned_after.FromDatetime(unless_pinned_after)
        for node in region_nodes(self.topology, eviction.region)[eviction.region]:
            if node in self.calls.down:
                errors.append(f"{what} on {node}: not tried, the node is not answering")
                continue
            try:
                freed += self._node_call(node, what, lambda stub: stub.Evict, request).bytes_freed
            except _NotDone as failure:
                if failure.code == grpc.StatusCode.ABORTED:
                    # Pinned there since the round's status read: the guard's refusal, made
                    # by the node (no node failed); the next plan sees the pin.
                    pinned.append(str(failure))
                elif failure.code != grpc.StatusCode.NOT_FOUND:
                    errors.append(str(failure))
        spec = f"{eviction.version[0]}@{eviction.version[1]}"
        refused = f"not evicting {spec}: {'; '.join(pinned)}" if pinned else None
        return Evicted(freed, refused=refused, errors=tuple(errors))

    # --------------------------------------------------------------- staging

    def make_run(
        self, task: StageTask, manifests: Mapping[str, pb.Manifest], pin_until: datetime | None
    ) -> TaskRun:
        """A run of ``task``: the item to stage, with the source's nodes as peers.

        The region's nodes :attr:`calls` holds as down are the item's ``down``:
        never called, the nodes that answer split the whole version between
        them (:func:`~edgecache.clients.ops.stage_item`); the source's down
        nodes are left out of the peers. The item carries the topology's
        registry and the ones the nodes said they read, so a node that reads
        another is refused before staging.
        """
        manifest = next(m for m in manifests.values() if (m.dataset, m.version) == task.version)
        peers = [] if task.source == "origin" else list(self.topology.regions[task.source].nodes)
        # A source node known down is not asked either (its shards are on the others);
        # with every one down the nodes fall back to origin shard by shard, as they would.
        peers = [node for node in peers if node not in self.calls.down] or peers
        nodes = list(self.topology.regions[task.region].nodes)
        item = WarmItem(
            task.region,
            task.spec,
            nodes,
            task.bytes,
            pin_until=pin_until,
            shard_count=len(manifest.shards),
            peers=peers,
            down=[node for node in nodes if node in self.calls.down],
            names={node: self._names[node] for node in nodes if node in self._names},
            registry=self.topology.registry,
            registries={n: self._registries[n] for n in nodes if n in self._registries},
        )
        return TaskRun(task, item)

    def _resident_event(self, region: str, version: VersionKey) -> threading.Event:
        with self._lock:
            return self._resident.setdefault((region, version), threading.Event())

    def mark_resident(self, region: str, version: VersionKey) -> None:
        """Tell tasks waiting on ``region`` as their peer source that it holds ``version``."""
        with self._lock:
            self._wont_hold.pop((region, version), None)  # it does now, whatever failed before
        self._resident_event(region, version).set()

    def mark_wont_hold(self, region: str, version: VersionKey, reason: str) -> None:
        """Tell tasks waiting on ``region`` as their source that it will not hold ``version``.

        Its staging was deferred or failed in this run: they stage from origin
        rather than wait out ``PEER_WAIT_SECONDS`` for nothing.
        """
        with self._lock:
            self._wont_hold[(region, version)] = reason
        self._resident_event(region, version).set()

    def await_source(self, run: TaskRun, *, peer_wait: float) -> bool:
        """Wait until the run's peer source holds its version; False if stopped or failed.

        A source that will not hold it turns the run into one from origin, with
        a note saying why: the job needs the data, the plan's cheaper source is
        only a means to it.
        """
        task = run.task
        if task.source == "origin":
            return True
        run.state = "waiting"
        self.on_progress(run)
        source_ready = self._resident_event(task.source, task.version)
        deadline = time.monotonic() + peer_wait
        while not source_ready.wait(0.2):
            if (run.stop or self.stop).is_set():
                return False
            if time.monotonic() > deadline:
                run.state, run.note = "failed", f"{task.source} never held {task.spec}"
                run.item.failures.append(run.note)
                return False
        with self._lock:
            reason = self._wont_hold.get((task.source, task.version))
        if reason is not None:
            run.item.peers = []
            run.note = f"from origin: {task.source} will not hold {task.spec} ({reason})"
            run.item.notes.append(run.note)
        return True

    def run(self, run: TaskRun, *, peer_wait: float = PEER_WAIT_SECONDS) -> TaskRun:
        """Stage one task to the end (blocking); from a peer, once the peer holds it."""
        task = run.task
        if not self.await_source(run, peer_wait=peer_wait):
            if run.state == "failed":
                self.mark_wont_hold(task.region, task.version, run.note)
            return run
        return self._stage(run)

    def _stage(self, run: TaskRun) -> TaskRun:
        """Stage the run from the source it has now, and tell the tasks waiting on it."""
        task = run.task
        run.state, run.started_at = "running", self.clock()
        self.on_progress(run)
        stage_item(
            run.item,
            token=self.token,
            stop=run.stop or self.stop,
            on_progress=lambda item: self.on_progress(run),
        )
        if (run.stop or self.stop).is_set() and not run.item.done:
            run.state = "pending"
            return run
        run.finished_at = self.clock()
        run.state = "done" if run.item.done else "failed"
        if run.item.done:
            self.mark_resident(task.region, task.version)
        else:
            self.mark_wont_hold(task.region, task.version, "its staging failed")
        self.on_progress(run)
        return run

    # ------------------------------------------------------------------- warm

    def warm(
        self,
        plan: Plan,
        schedule: Schedule,
        manifests: Mapping[str, pb.Manifest],
        *,
        reports: Sequence[NodeReport] | None = None,
    ) -> WarmOutcome:
        """Carry out the whole plan now: regions in parallel, each in the plan's order.

        Within a region, evictions come before the task that needs their room;
        an eviction the guard refuses defers the tasks after it (they need the
        room), which a later run or the controller carries out when the time
        comes. ``reports`` is the status to decide on (``warm --dry-run`` gives
        the one its plan was made on); without it the nodes are asked now.
        """
        outcome = WarmOutcome()
        if reports is None:
            reports = gather_status(self.topology, token=self.token)
        for region, version, problem in self._pin(plan, self._see(reports)):
            outcome.pin_failures.append(problem)
            outcome.pins_failed.add((region, version))
        held = complete_versions(list(reports), dict(manifests))
        for region, versions in held.items():  # what regions hold can serve as a peer source
            for version in versions:
                self.mark_resident(region, version)
        ends = {job.name: job.end for job in schedule.jobs}
        # Each region records into its own outcome, merged in the plan's order at the end:
        # regions run in parallel, and a report in finishing order matched no plan row.
        done = {region: WarmOutcome() for region in plan.regions}
        # Each task's run, set once it has ended (done, failed or deferred): a region
        # evicts a version another region copies from it only after that copy (see
        # copies_before). warm runs everything now; c evicted v@1 at once, and a's copy
        # from c, planned before that eviction, found nothing there and took every
        # shard from origin.
        ended = {id(t): threading.Event() for r in plan.regions.values() for t in r.tasks}

        def await_copies(eviction: Eviction) -> None:
            """Until the copies from here planned before ``eviction`` have ended.

            Within a region steps go in the plan's time order, and the plan puts a
            copy before the lender's eviction, so these waits never close a circle.
            """
            for task in copies_before(plan, eviction):
                while not ended[id(task)].wait(0.2) and not self.stop.is_set():
                    pass

        def one_region(region: str) -> None:
            try:
                steps_of(region)
            finally:  # stopped or failed: nothing waits on this region's copies
                for task in plan.regions[region].tasks:
                    ended[id(task)].set()

        def steps_of(region: str) -> None:
            region_plan, mine = plan.regions[region], done[region]
            mine.held = {(region, version) for version in held.get(region, set())}
            steps: list[tuple[datetime, int, Eviction | StageTask]] = [
                (e.at, 0, e) for e in region_plan.evictions
            ] + [(t.start, 1, t) for t in region_plan.tasks]
            blocked: str | None = None
            evict_failed = False  # blocked by a node's failure, not by the guard
            for _, _, step in sorted(steps, key=lambda s: (s[0], s[1])):
                if self.stop.is_set():
                    return
                if isinstance(step, Eviction):
                    spec = f"{step.version[0]}@{step.version[1]}"
                    await_copies(step)
                    if self.stop.is_set():
                        return
                    evicted = self.evict(
                        step, schedule, manifests, planned_pin=region_plan.pins.get(step.version)
                    )
                    if evicted.problem is None:
                        mine.evicted.append((step, evicted.freed))
                        mine.held.discard((region, step.version))
                        # An eviction drops the version's pin with it. A later job here
                        # still reads it (the plan stages it again for that job): pin
                        # it again, so the pin warm reports is the pin the node holds.
                        # A pin only for copies from here ends before the eviction.
                        until = region_plan.pins.get(step.version)
                        if until is not None and until > step.at:
                            problem = self._pin_region(region, step.version, until)
                            if problem is not None:
                                mine.pin_failures.append(problem)
                                mine.pins_failed.add((region, step.version))
                    else:
                        blocked, evict_failed = evicted.problem, bool(evicted.errors)
                        if evict_failed:  # a node failed it: no waiting fixes that
                            mine.evict_failures.extend(evicted.errors)
                        else:
                            mine.deferred.append(Deferred(region, f"evict {spec}", blocked))
                    continue
                pin_until = max(ends[j] for j in step.jobs if j in ends)
                run = self.make_run(step, manifests, pin_until)
                mine.runs.append(run)
                note = None
                if step.waits and step.start > self.clock():
                    # A node's share fits only once a pin there runs out: staged now it
                    # failed RESOURCE_EXHAUSTED on that node and left the rest pinned.
                    note = _deferred_note(step, step.waits)
                elif blocked is not None:
                    note = _deferred_note(step, f"needs room: {blocked}", failed=evict_failed)
                if note is not None:
                    run.state, run.note = "deferred", note
                    self.mark_wont_hold(region, step.version, f"deferred, {run.note}")
                    mine.deferred.append(Deferred(region, f"stage {step.spec}", run.note))
                    ended[id(step)].set()
                    continue
                try:
                    if self.run(run).staged:
                        mine.held.add((region, step.version))
                finally:
                    ended[id(step)].set()

        with ThreadPoolExecutor(max(len(plan.regions), 1)) as pool:
            futures = [pool.submit(one_region, region) for region in plan.regions]
            try:
                while not all(f.done() for f in futures):
                    time.sleep(0.1)  # stay interruptible: Ctrl-C lands here
            except KeyboardInterrupt:
                self.stop.set()
                raise
            for future in futures:
                future.result()
        for region_outcome in done.values():
            outcome.runs += region_outcome.runs
            outcome.evicted += region_outcome.evicted
            outcome.deferred += region_outcome.deferred
            outcome.pin_failures += region_outcome.pin_failures
            outcome.evict_failures += region_outcome.evict_failures
            outcome.pins_failed |= region_outcome.pins_failed
            outcome.held |= region_outcome.held
        return outcome
