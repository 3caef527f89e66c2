"""Plan against reality, per job: when its data was planned to be ready, when it was, or why not.

Built from three sources: the current plan (planned ready times and what
cannot be met), the nodes' live status (what is there now, shard by shard),
and the controller's record (when it saw each job's data complete, and
whether it was complete when the job started). Without a controller the
record is empty and the view says what is there now.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from edgecache.cache.planner import Plan
from edgecache.clients.controller import ControllerState
from edgecache.clients.ops import NodeReport, holdings
from edgecache.clients.topology import Schedule
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["JobView", "job_views"]


@dataclass(frozen=True)
class JobView:
    """One job's data, planned against actual."""

    job: str
    region: str
    start: datetime
    planned_ready: datetime | None  # None: nothing to stage (or cannot be met)
    ready_at: datetime | None  # when the controller saw it complete, if it did
    missing: list[str]  # "name@N: 3/8 shards" now
    complete_at_start: bool | None  # None until the job starts (or without a controller)
    why: str  # why it is late or cannot be met; "" when on time

    @property
    def state(self) -> str:
        """ready, staging, late, missed (started without its data) or infeasible."""
        if self.complete_at_start is False:
            return "missed"
        if not self.missing:
            return "ready"
        if self.why.startswith("cannot be met"):
            return "infeasible"
        return "late" if self.why else "staging"


def job_views(
    schedule: Schedule,
    plan: Plan,
    manifests: dict[str, pb.Manifest],
    reports: list[NodeReport],
    state: ControllerState | None,
    now: datetime,
) -> list[JobView]:
    """A view of every scheduled job, in start order."""
    held = holdings(reports, manifests)
    infeasible: dict[str, list[str]] = {}
    for item in plan.infeasible:
        infeasible.setdefault(item.job, []).append(f"{item.version}: {item.reason}")
    views = []
    for job in sorted(schedule.jobs, key=lambda j: (j.start, j.name)):
        missing = []
        for spec in job.datasets:
            manifest = manifests.get(spec)
            if manifest is None:
                missing.append(f"{spec}: not in the registry")
                continue
            total = len(manifest.shards)
            holding = held.get(job.region, {}).get((manifest.dataset, manifest.version))
            have = holding.shards if holding else 0
            if have < total:
                missing.append(f"{manifest.dataset}@{manifest.version}: {have}/{total} shards")
        region_plan = plan.regions.get(job.region)
        tasks = [t for t in region_plan.tasks if job.name in t.jobs] if region_plan else []
        planned = max((t.finish for t in tasks), default=None)
        record = state.jobs.get(job.name) if state else None
        ready_at = _time(record.ready_at) if record else None
        if record and record.planned_ready and planned is None:
            planned = _time(record.planned_ready)
        why = ""
        if job.name in infeasible:
            why = "cannot be met: " + "; ".join(infeasible[job.name])
        elif missing and planned is not None and planned > job.start:
            why = f"planned ready {planned:%Y-%m-%d %H:%M} is after the start"
        elif missing and job.start <= now:
            why = "started before its data was complete"
        elif missing and state is not None:
            failed = [
                f"{t.version}: {t.error}"
                for t in state.tasks.values()
                if t.region == job.region and job.name in t.jobs and t.state == "failed"
            ]
            if failed:
                why = "staging failed: " + "; ".join(failed)
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
            )
        )
    return views


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None
