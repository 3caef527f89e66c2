"""Plan against reality, per job: when its data was planned to be ready, when it was, or why not.

Built from three sources: the current plan (planned ready times and what
cannot be met), the nodes' live status (what is there now, shard by shard),
and the controller's record (when it saw each job's data complete, and
whether it was complete when the job started). Without a controller the
record is empty and the view says what is there now, that nothing is
staging the rest, and which command would.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from edgecache.cache.planner import Plan, StageTask
from edgecache.clients.controller import ControllerState, infeasible_reason
from edgecache.clients.ops import NodeReport, holdings, region_outages
from edgecache.clients.ops.planning import DAMAGED_RECORD
from edgecache.clients.topology import Schedule, ScheduledJob
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["JobView", "job_views"]


@dataclass(frozen=True)
class JobView:
    """One job's data, planned against actual."""

    job: str
    region: str
    start: datetime
    planned_ready: datetime | None  # None: nothing to stage (or cannot be met)
    # When the controller saw it complete, if it did and it still is: a job whose data
    # is missing now (evicted since, or its region does not answer) is not ready at
    # any time, whatever was seen before; ``missing`` and ``why`` say what is wrong.
    ready_at: datetime | None
    # "name@N: 3/8 shards" now, "name@N: not seen, …" when unreachable, and for a spec
    # the registry does not resolve, the registry's own reason (it names the registry).
    missing: list[str]
    complete_at_start: bool | None  # None until the job starts (or without a controller)
    why: str  # why it is late or cannot be met; "" when on time
    # What is being done about what is missing: "staging" (a controller's task runs),
    # "waiting to retry" (its stage failed; a running controller tries again at the time
    # the hint gives), "planned" (a running controller starts it at its planned start),
    # "not started" (nothing runs the schedule) or "over" (the job has ended); "" when
    # nothing is missing.
    progress: str = ""
    hint: str = ""  # what happens next, or what to run; for a job that has ended, what it had
    # The job has ended: nothing is planned or staged for it, so nothing is said of what
    # is missing now; ``hint`` says when it ended and what the record says it had.
    ended: bool = False
    # Why whether its data was there at its start is unknown (no controller round saw
    # the job before it started); "" when known, or not started yet.
    unknown_at_start: str = ""

    @property
    def state(self) -> str:
        """ready, missed (started without its data), unknown, over, infeasible, late, or progress.

        Only a task a controller is running counts as staging: a plan nobody
        carries out is "not started", however soon it was planned to be ready.
        A started job no controller saw before its start is "unknown": its
        start is counted neither ready nor missed. A failed stage the
        controller retries is "waiting to retry" (its progress), not late.
        """
        if self.complete_at_start is False:
            return "missed"
        if self.ended:
            return "over"
        if self.unknown_at_start:
            return "unknown"
        if not self.missing:
            return "ready"
        if self.why.startswith("cannot be met"):
            return "infeasible"
        return "late" if self.why else self.progress or "not started"


def job_views(
    schedule: Schedule,
    plan: Plan,
    manifests: dict[str, pb.Manifest],
    reports: list[NodeReport],
    state: ControllerState | None,
    now: datetime,
    *,
    controller_running: bool = False,
    schedule_path: str = "SCHEDULE",
) -> list[JobView]:
    """A view of every scheduled job, in start order.

    ``controller_running`` says whether a controller holds the lease now: only
    then will the plan's tasks start on their own, and only then is a task its
    record calls running really running (a killed controller leaves "running"
    behind). ``schedule_path`` goes into the commands a hint suggests.
    """
    held = holdings(reports, manifests)
    unseen = {r for r, outage in region_outages(reports).items() if outage.unreachable}
    infeasible: dict[str, list[str]] = {}
    unresolved: dict[tuple[str, str], str] = {}  # (job, spec) → the registry's reason
    absent = {spec for job in schedule.jobs for spec in job.datasets if spec not in manifests}
    for item in plan.infeasible:
        reason = infeasible_reason(item)
        if item.version in absent and not item.unreachable:
            # Said in full on the spec's `missing` line; the why refers to it.
            unresolved[(item.job, item.version)] = reason
            reason = (
                f"{item.version}'s registry record is damaged"
                if DAMAGED_RECORD in reason
                else f"{item.version} is not in the registry"
            )
        infeasible.setdefault(item.job, []).append(reason)
    views = []
    for job in sorted(schedule.jobs, key=lambda j: (j.start, j.name)):
        if job.end <= now:
            views.append(_ended_view(job, state))
            continue
        missing = []
        for spec in job.datasets:
            manifest = manifests.get(spec)
            if manifest is None:
                missing.append(unresolved.get((job.name, spec), f"{spec}: not in the registry"))
                continue
            total = len(manifest.shards)
            holding = held.get(job.region, {}).get((manifest.dataset, manifest.version))
            have = holding.shards if holding else 0
            if job.region in unseen:  # nothing is known there: not "0/N shards"
                missing.append(
                    f"{manifest.dataset}@{manifest.version}: not seen, no node of "
                    f"{job.region} answers"
                )
            elif have < total:
                missing.append(f"{manifest.dataset}@{manifest.version}: {have}/{total} shards")
        region_plan = plan.regions.get(job.region)
        tasks = [t for t in region_plan.tasks if job.name in t.jobs] if region_plan else []
        planned = max((t.finish for t in tasks), default=None)
        record = state.jobs.get(job.name) if state else None
        if record is not None and record.start != job.start.astimezone(UTC).isoformat():
            record = None  # another job of the same name (moved since): not this one's record
        reads = [f"{m.dataset}@{m.version}" for s in job.datasets if (m := manifests.get(s))]
        # Seen complete once is not ready now: the record's time stands only while nothing
        # is missing (else a job of an unreachable region read "ready" at the very time
        # it showed its shards missing), and only for the versions the job reads now (a
        # job switched from a@1 to b@1 kept a@1's ready time).
        ready_at = (
            _time(record.ready_at) if record and not missing and record.versions == reads else None
        )
        if record is not None and record.complete_at_start is not None:
            # The time planned before the start, not one re-planned after it (a plan made
            # now puts what is still missing at now, which says nothing of the plan).
            planned = _time(record.planned_ready)
        elif record and record.planned_ready and planned is None and job.name not in infeasible:
            planned = _time(record.planned_ready)  # the record's, unless it cannot be met
        why = ""
        unknown = record.unknown_at_start if record is not None else ""
        if record is not None and record.complete_at_start is False:
            # Why it missed, as the controller knew it at the start: still said once the
            # data is there, and after the task records it came from are gone.
            why = record.why_missed or "started before its data was complete"
        elif unknown:
            why = f"{unknown}: whether its data was there at its start is unknown"
        elif job.name in infeasible:
            why = "cannot be met: " + "; ".join(infeasible[job.name])
        elif missing and planned is not None and planned > job.start:
            why = f"planned ready {planned:%Y-%m-%d %H:%M} is after the start"
        elif missing and job.start <= now:
            why = "started before its data was complete"
        elif missing and state is not None and not controller_running:
            # Nothing retries it: the failure is why the data is not coming. (A running
            # controller retries it: "waiting to retry", below, with its time.)
            failed = [
                f"{t.version}: {t.error}"
                for t in state.tasks.values()
                if t.region == job.region and job.name in t.jobs and t.state == "failed"
            ]
            if failed:
                why = "staging failed: " + "; ".join(failed)
        progress, hint = _progress(
            job.region, tasks, state if controller_running else None, schedule_path, now
        )
        views.append(
            JobView(
                job=job.name,
                region=job.region,
                start=job.start,
                planned_ready=planned,
                ready_at=ready_at,
                missing=missing,
                complete_at_start=record.complete_at_start if record else None,
                why=why,
                progress=progress if missing else "",
                hint=hint if missing and job.name not in infeasible else "",
                unknown_at_start=unknown,
            )
        )
    return views


def _ended_view(job: ScheduledJob, state: ControllerState | None) -> JobView:
    """A job that has ended, as it was: the controller's record of its start, or no claim.

    The plan leaves an ended job out (nothing is staged for it), so its specs
    are not resolved and what its region holds now says nothing of what it
    read: judged like a current job, it showed its dataset "not in the
    registry" and "started before its data was complete" with no record of
    either. Only the record (kept ``--keep-records`` hours after the end)
    knows whether its data was there at its start, and which versions it read.
    """
    record = state.jobs.get(job.name) if state else None
    if record is not None and record.start != job.start.astimezone(UTC).isoformat():
        record = None  # another job of the same name (moved since): not this one's record
    ended = f"ended {job.end:%Y-%m-%d %H:%M}"
    if record is not None and record.unknown_at_start:
        hint = f"{ended}; {record.unknown_at_start}: whether its data was there is unknown"
    elif record is None or record.complete_at_start is None:
        hint = (
            f"{ended}; no record of whether its data was there at its start (a running "
            "controller records it)"
        )
    elif record.complete_at_start:
        hint = f"{ended}; it had {', '.join(record.versions) or 'its data'} from its start"
    else:
        hint = ended
    return JobView(
        job=job.name,
        region=job.region,
        start=job.start,
        planned_ready=_time(record.planned_ready) if record else None,
        ready_at=_time(record.ready_at) if record and record.complete_at_start else None,
        missing=[],
        complete_at_start=record.complete_at_start if record else None,
        why=(record.why_missed or "started before its data was complete")
        if record and record.complete_at_start is False
        else "",
        progress="over",
        hint=hint,
        ended=True,
    )


def _progress(
    region: str,
    tasks: list[StageTask],
    state: ControllerState | None,
    schedule_path: str,
    now: datetime,
) -> tuple[str, str]:
    """What is being done about a job's missing data, and what comes next.

    ``state`` is the record of a controller running now (None when none runs).
    A stage that failed and waits out its backoff is "waiting to retry", with
    the time of the retry: not late (its job may be hours away), and not
    "starts staging at" a planned start that has already passed.
    """
    if state is None:
        return "not started", (
            f"nothing is staging it: `edgecache controller --schedule {schedule_path}` "
            f"stages it on time; `edgecache warm {schedule_path}` does now what can be "
            "done now"
        )
    specs = {t.spec for t in tasks}
    running = sorted(
        t.version
        for t in state.tasks.values()
        if t.region == region and t.version in specs and t.state == "running"
    )
    if running:
        return "staging", f"the controller is staging {', '.join(running)}"
    retries = sorted(
        (
            t
            for t in state.tasks.values()
            if t.region == region and t.version in specs and t.state == "failed"
        ),
        key=lambda t: t.version,
    )
    if retries:
        said = []
        for t in retries:
            retry = _time(t.retry_at)
            when = (
                f"at {retry:%Y-%m-%d %H:%M:%S}"
                if retry is not None and retry > now
                else "at its next round"
            )
            said.append(
                f"staging {t.version} failed (attempt {t.attempts}: {t.error}); the "
                f"controller tries again {when}"
            )
        return "waiting to retry", "; ".join(said)
    if tasks:
        first = min(t.start for t in tasks)
        if first <= now:
            return "planned", "the controller starts staging at its next round"
        return "planned", f"the controller starts staging at {first:%Y-%m-%d %H:%M}"
    return "planned", ""


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None
