"""Commands that move data ahead of jobs: ``plan`` a schedule, ``warm`` regions, check ``ready``."""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress, TaskID

from edgecache.cache.errors import EdgeCacheError
from edgecache.cache.names import parse_spec
from edgecache.cache.planner import (
    Eviction,
    Infeasible,
    Plan,
    RegionPlan,
    StageTask,
    VersionKey,
)
from edgecache.cache.wording import first_of
from edgecache.clients import ops
from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import (
    ConfigOption,
    ExitCode,
    JsonOption,
    Options,
    TokenOption,
    exit_with,
    reporting,
)
from edgecache.clients.cli.render import (
    Column,
    console,
    err_console,
    error,
    format_bytes,
    json_time,
    line,
    progress,
    table,
    warning,
)
from edgecache.clients.executor import (
    Evicted,
    PlanExecutor,
    Released,
    TaskRun,
    WarmOutcome,
    release_line,
)
from edgecache.clients.ops import WarmItem
from edgecache.clients.plan_status import JobView
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import grpc

    from edgecache.clients.controller import ControllerState


@app.command()
def plan(
    schedule: Annotated[Path, typer.Argument(help="Schedule file (YAML).", metavar="SCHEDULE")],
    config: ConfigOption = None,
    at: Annotated[
        str | None, typer.Option(help="Plan as of this time (ISO 8601, with zone).")
    ] = None,
    explain: Annotated[bool, typer.Option(help="Say why each eviction and source.")] = False,
    show_status: Annotated[
        bool,
        typer.Option(
            "--status",
            help="Per job: planned and actual ready time, what is missing, why it is late.",
        ),
    ] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show what to stage where, by when, what to evict, and what cannot be met.

    Exit codes: 0 every job can be met; 3 some cannot (listed, with the reason;
    with --status also a job that is late or started without its data: state
    late or missed);
    2 bad input (with --status or a job running, also a registry on a local
    path that does not exist; nodes that serve but refused the token:
    --token-file); 1 failed:
    the registry, or a node of a region the schedule uses, is unreachable
    (named; this wins over 3, since that region's plan is built without
    knowing what it holds).

    A job that has started reads the versions resolved at its start (the
    controller's record), not a version published since, as the controller
    and warm carry it out.

    Times are UTC. --json gives regions.R.tasks (version, bytes, source,
    start, finish, deadline, jobs, and waits: why it begins no sooner, where a
    node's share fits only once a pin there runs out), regions.R.evictions (version, bytes, at,
    next_use, reason), regions.R.pins (version, until, lent_to: the regions
    that copy it from here, for whose copies it is kept), infeasible (job,
    region, version, reason, unreachable), transfers (job, link, bytes) and
    cost (job → egress price), released (region, node, version, until,
    shortened_to: the pins an earlier warm of this schedule placed that warm
    lets go of, or shortens, before it acts; the plan is made as if it had),
    release_failures and release_notes (what warm would say of those pins);
    with --explain each task's source_reason too; with --status, one object
    per job instead (--explain is refused there: the status has no sources).
    """
    from edgecache.clients.ops import gather_status, unreachable_regions
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        if explain and show_status:
            raise ValueError(
                "--explain says why the plan takes each source and evicts each version; "
                "--status shows each job's state, which has neither: drop one of them"
            )
        jobs = load_schedule(schedule, options.topology)
        now = parse_at(at) or datetime.now(UTC)
        reports = gather_status(options.topology, token=options.token)
        jobs, state = started_as_recorded(
            options.topology, jobs, now, always=show_status, owner=ops.schedule_owner(schedule)
        )
        # Planned as warm carries it out: on the pins as warm leaves them once it has let
        # go of those its earlier run placed for jobs since moved or removed.
        owner = ops.schedule_owner(schedule)
        result, manifests, released, reports, _ = _plan_releasing_own_pins(
            options.topology, options.token, jobs, owner, now, reports, dry_run=True
        )
        views: list[JobView] = []
        if show_status:
            from edgecache.clients.controller import lease_holder
            from edgecache.clients.plan_status import job_views

            views = job_views(
                jobs,
                result,
                manifests,
                reports,
                state,
                now,
                controller_running=lease_holder(options.topology.registry) is not None,
                # The topology warm and the controller must read: a read token is not theirs.
                schedule_path=shlex.quote(str(schedule)) + options.flags(token=False),
            )
    if not show_status:
        _say_ended(jobs, now)
    down = unreachable_regions(reports, jobs, now)
    if show_status:
        _print_status(views, as_json)
    elif as_json:
        shown = {
            **_plan_json(result, explain=explain),
            "released": _released_json(released),
            "release_failures": released.problems,
            "release_notes": released.notes,
        }
        print(json.dumps(shown, indent=2))
    else:
        for pin in released.released:
            console.print(
                release_line(pin, result, dry_run=True, who="warm")
                + " (an earlier warm of this schedule placed it; planned as warm leaves it)"
            )
        _print_plan(result, explain, unseen=_unseen_regions(reports), reported=set(down))
    if not show_status and not as_json:
        # What warm would say of those pins (a release that would fail, a pin kept on a
        # node the topology does not list): the plan is of warm's run, so is this.
        for problem in released.problems:
            err_console.print(f"[red]release would fail:[/red] {problem}", soft_wrap=True)
        for note in released.notes:
            err_console.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    for outage in down.values():
        error(outage.message())
    if down:
        raise exit_with(_outage_exit(down))
    if result.infeasible or (
        show_status and any(v.state in _NOT_MET and not v.ended for v in views)
    ):
        raise exit_with(ExitCode.CANNOT_BE_MET)


# The states of ``plan --status`` that exit 3: a job that cannot be met, one whose data is
# not coming on time (late: planned after its start, or a failed stage nothing retries),
# and one that started without it, while it runs (an ended one stays "missed" in the
# record for --keep-records hours, with nothing left to do). A stage a running controller
# retries is not among them: it may still be on time (the hint says when it is tried again).
_NOT_MET = frozenset({"infeasible", "late", "missed"})


def _outage_exit(down: dict[str, ops.Outage]) -> ExitCode:
    """The exit code of ``plan`` and ``warm`` for the schedule's regions with an outage.

    Nodes that serve but refused the token want --token-file (bad input), not a retry.
    """
    return ExitCode.BAD_INPUT if all(o.refused for o in down.values()) else ExitCode.FAILED


def started_as_recorded(
    topology: Topology,
    schedule: Schedule,
    now: datetime,
    *,
    always: bool = False,
    owner: str = "",
) -> tuple[Schedule, ControllerState | None]:
    """The schedule with its started jobs reading the versions resolved at their start.

    ``name`` and ``name@latest`` are resolved once, when a job starts: the
    controller records what it resolved then, and carries the job out on that
    version to its end; warm's record (of jobs it pinned for) serves for the
    jobs the controller's does not hold (warm run alone). ``plan``, ``plan
    --status`` and ``warm`` all read the schedule through this one function, so
    none of them stages, pins or calls
    "cannot be met" a version published after the job started. The
    controller's record is read only when a job is running (or ``always``, for
    ``--status``, which shows it): a schedule of jobs still to come resolves
    as before, whatever the registry's record. ``owner``: the schedule file's
    (:func:`ops.schedule_owner`), whose own warm record is read.
    """
    from edgecache.clients.controller import read_state, started_schedule

    if not always and not any(job.start <= now < job.end for job in schedule.jobs):
        return schedule, None
    state = read_state(topology.registry)
    return started_schedule(schedule, state, topology.registry, now, owner), state


def parse_at(at: str | None, option: str = "--at") -> datetime | None:
    """``--at``'s time, in UTC; a malformed or zone-less one is bad input that names the option.

    Given with an offset (``09:30+05:00``) it is converted: the plan's times, shown and
    in ``--json``, are UTC whatever zone the option was written in, as the schedule's are.
    A suggestion in the error is one this function accepts: ``2026-12-06`` used to be
    told to add ``Z``, and ``2026-12-06Z`` was then "not a time" (a date takes no zone).
    """
    if at is None:
        return None
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        bare = _naive(at.removesuffix("Z").removesuffix("z"))
        example = f"{bare.isoformat()}Z" if bare else "2026-12-01T08:00:00Z"
        raise ValueError(
            f"{option} {at!r} is not a time: give ISO 8601 with a time zone, e.g. {example}"
        ) from None
    if when.tzinfo is None:
        raise ValueError(
            f"{option} {at!r} needs a time zone: {when.isoformat()}Z for UTC, or an offset, "
            f"e.g. {when.isoformat()}+02:00"
        )
    return when.astimezone(UTC)


def _naive(text: str) -> datetime | None:
    """``text`` as a time without a zone (a date alone is its midnight), or None if it is not."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is None else None


def _print_status(views: list[JobView], as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "job": v.job,
                        "region": v.region,
                        "start": json_time(v.start),
                        "state": v.state,
                        "planned_ready": json_time(v.planned_ready) if v.planned_ready else None,
                        "ready_at": json_time(v.ready_at) if v.ready_at else None,
                        "complete_at_start": v.complete_at_start,
                        # why no verdict: no controller round saw the job before its start
                        "unknown_at_start": v.unknown_at_start or None,
                        "missing": v.missing,
                        "why": v.why or None,  # null when nothing is wrong
                        "hint": v.hint or None,
                    }
                    for v in views
                ],
                indent=2,
            )
        )
        return
    colour = {
        "ready": "green",
        "staging": "cyan",
        "planned": "cyan",
        "not started": "yellow",
        "late": "yellow",
        "waiting to retry": "yellow",
        "missed": "red",
        "unknown": "dim",  # no round saw the job before its start: neither ready nor missed
        "over": "dim",
    }
    table(
        "jobs: plan against reality",
        [
            Column("job", ident=True),
            Column("region", ident=True),
            Column("start", ident=True),
            Column("planned ready", ident=True),
            Column("ready", ident=True),
            Column("state"),
            Column("missing / why", wrap=True),
        ],
        [
            [
                v.job,
                v.region,
                f"{v.start:%Y-%m-%d %H:%M}",
                f"{v.planned_ready:%Y-%m-%d %H:%M:%S}" if v.planned_ready else "—",
                f"{v.ready_at:%Y-%m-%d %H:%M:%S}" if v.ready_at else "—",
                f"[{colour.get(v.state, 'red')}]{v.state}[/]",
                "\n".join([*v.missing, *(text for text in (v.why, v.hint) if text)]),
            ]
            for v in views
        ],
    )


def _source_reason(t: StageTask) -> str:
    """Why the plan takes ``t`` from its source (``--explain``)."""
    # The planner's rule (cache/planner.py): a peer that holds the version in time costs
    # no origin egress and wins whenever it makes the deadline, however slow its link;
    # when no source makes it, the earliest finish.
    if t.finish > t.deadline:
        return "late from any source: the one that finishes first"
    if t.source != "origin":
        return "a peer region holds it in time: no origin egress"
    return "origin: no peer region holds it in time"


def _plan_json(result: Plan, *, explain: bool = False) -> dict[str, object]:
    return {
        "regions": {
            name: {
                "tasks": [
                    {
                        "version": t.spec,
                        "bytes": t.bytes,
                        "source": t.source,
                        "start": json_time(t.start),
                        "finish": json_time(t.finish),
                        "deadline": json_time(t.deadline),
                        "jobs": list(t.jobs),
                        **({"waits": t.waits} if t.waits else {}),
                        **({"source_reason": _source_reason(t)} if explain else {}),
                    }
                    for t in rp.tasks
                ],
                "evictions": [
                    {
                        "version": f"{e.version[0]}@{e.version[1]}",
                        "bytes": e.bytes,
                        "at": json_time(e.at),
                        "next_use": json_time(e.next_use) if e.next_use else None,
                        "reason": e.reason,
                    }
                    for e in rp.evictions
                ],
                "pins": [
                    {
                        "version": f"{v[0]}@{v[1]}",
                        "until": json_time(until),
                        "lent_to": list(rp.lends.get(v, ())),
                    }
                    for v, until in sorted(rp.pins.items())
                ],
            }
            for name, rp in result.regions.items()
        },
        "infeasible": [_infeasible_json(i) for i in result.infeasible],
        "transfers": [
            {"job": j, "link": link, "bytes": b}
            for (j, link), b in sorted(result.transfers.items())
        ],
        "cost": result.cost,
    }


def _infeasible_json(i: Infeasible) -> dict[str, object]:
    """One job's version that cannot be met; ``unreachable`` when the reason is an outage."""
    return {
        "job": i.job,
        "region": i.region,
        "version": i.version,
        "reason": i.reason,
        "unreachable": i.unreachable,
    }


def _plan_reasons(result: Plan) -> list[Infeasible]:
    """What cannot be met for a reason of the plan's own, for a person to read.

    A job whose region is unreachable is left out: the command says that
    outage once, as the node failure it is (an error, exit 1), beside the
    other regions' outages. Scripts get every row, with ``unreachable`` set.
    """
    return [i for i in result.infeasible if not i.unreachable]


def _some(names: Sequence[str], shown: int = 3) -> str:
    """A few names and how many more: a version a thousand jobs read is one line, not 1,000.

    ``--json`` lists every name.
    """
    if len(names) <= shown + 1:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more (--json lists all)"


def _say_ended(schedule: Schedule, now: datetime) -> None:
    """Name the jobs that have ended: the plan leaves them out, which looks like nothing to do.

    A start a year off (2025 for 2026) is the usual cause, so the end is given.
    """
    ended = [job for job in schedule.jobs if job.end <= now]
    if ended:
        when = ", ".join(f"{job.name} ended at {job.end:%Y-%m-%d %H:%M}" for job in ended[:3])
        more = f" and {len(ended) - 3} more" if len(ended) > 3 else ""
        warning(f"{when}{more}: nothing is planned for a job that has ended; check its start")


def _unseen_regions(reports: list[ops.NodeReport]) -> set[str]:
    """The regions none of whose nodes answered: what they hold, and so their plan, is unknown."""
    return {region for region, outage in ops.region_outages(reports).items() if outage.unreachable}


def _print_plan(result: Plan, explain: bool, *, unseen: set[str], reported: set[str]) -> None:
    """Each region's stages and evictions (a table), then its pins, a line each.

    The pins are shown without --explain: warm and the controller place them,
    so they are as much the plan as the stages. A region in ``unseen`` (no node
    answers) is not said to have nothing to do: nothing is known of it; the
    command's error names the outage of the regions in ``reported`` (those a
    job not yet over runs in), and a silent region no job needs is said so here.
    """
    for name, rp in result.regions.items():
        if name in unseen and not (rp.tasks or rp.evictions or rp.pins):
            why = (
                "its nodes' state is unknown (see below)"
                if name in reported
                else "no node answers (no job of the schedule runs there)"
            )
            line(f"region {name}: not planned: {why}")
            continue
        if not (rp.tasks or rp.evictions):
            line(
                f"region {name}: nothing to stage or evict"
                if rp.pins
                else f"region {name}: nothing to do"
            )
            _print_pins(name, rp)
            continue
        rows = [
            [
                t.spec,
                format_bytes(t.bytes),
                t.source,
                f"{t.start:%Y-%m-%d %H:%M}",
                f"{t.finish:%Y-%m-%d %H:%M:%S}",
                f"{t.deadline:%Y-%m-%d %H:%M}",
                _some(t.jobs),
            ]
            for t in rp.tasks
        ]
        rows += [
            [
                f"[yellow]evict {e.version[0]}@{e.version[1]}[/yellow]",
                format_bytes(e.bytes),
                "",
                f"{e.at:%Y-%m-%d %H:%M}",
                "",
                "",
                e.reason if explain else "",
            ]
            for e in rp.evictions
        ]
        table(
            f"region {name}",
            [
                Column("stage", ident=True),
                Column("size", right=True),
                Column("from", ident=True),
                Column("start", ident=True),
                Column("ready by", ident=True),
                Column("deadline", ident=True),
                Column("for jobs", wrap=True),
            ],
            rows,
        )
        for t in rp.tasks:
            if t.waits:  # not the link or the region's room: said, or the start looks odd
                line(f"{name}: {t.spec} starts at {t.start:%Y-%m-%d %H:%M}: {t.waits}")
        _print_pins(name, rp)
    if explain:
        for name, rp in result.regions.items():
            for t in rp.tasks:
                line(f"{name}: {t.spec} from {t.source}: {_source_reason(t)}")
    for (job, link), size in sorted(result.transfers.items()):
        cost = f", egress ${result.cost[job]:.2f}" if job in result.cost else ""
        line(f"{job}: {format_bytes(size)} over {link}{cost}")
    if reasons := _plan_reasons(result):
        table(
            "[red]cannot be met[/red]",
            [
                Column("job", ident=True),
                Column("region", ident=True),
                Column("version", ident=True),
                Column("why", wrap=True),
            ],
            [[i.job, i.region, i.version, f"[red]{i.reason}[/red]"] for i in reasons],
        )


def _print_pins(region: str, rp: RegionPlan) -> None:
    """``region: pin NAME@N until TIME``, a line per pin the plan places.

    To its last job's end there, or to the end of the last copy another region
    makes from it, whichever is later (a pin some copy needs says for whom).
    """
    for version, until in sorted(rp.pins.items()):
        lent = rp.lends.get(version)
        why = f" (kept for {', '.join(lent)}'s copy from here)" if lent else ""
        line(f"{region}: pin {version[0]}@{version[1]} until {until:%Y-%m-%d %H:%M}{why}")


@app.command()
def warm(
    target: Annotated[
        str,
        typer.Argument(help="A schedule file, or NAME@N with --region.", metavar="SCHEDULE|NAME@N"),
    ],
    region: Annotated[str | None, typer.Option(help="Region to warm NAME@N in.")] = None,
    config: ConfigOption = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print what warm would do now, deferrals included, and do nothing.",
        ),
    ] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Carry out a schedule's plan now (pins, evictions, staging), or stage one version.

    With a schedule, every task of the plan runs now rather than at its planned
    start, from the source the plan chose, after the evictions that make its
    room; an eviction that would take data a job reads before the plan's
    eviction time is refused, and the tasks that need its room are deferred,
    as is a task the plan starts when a pin on one of the region's nodes runs
    out (that node's share fits only then) (run warm again later, or let the
    controller run the schedule). --dry-run
    goes through the same steps without touching a node, so it shows the same
    evictions, stages and deferrals. Exit codes: 0 done (a version the plan
    called late that this run staged whole is said as "there now"); 3 a job
    cannot be met (the rest is done); 1 a transfer, an eviction, a pin or a pin's release
    failed on a node, or a node of a region the schedule uses (or of NAME@N's
    --region) does not answer, even when the others staged its share; 2 bad
    input, or a peer the plan copies from refused the staging node for its
    configuration ("peer refused:"; the version came from origin); 130
    interrupted (run it again to resume). --dry-run exits as the
    real run would before it moves data: 3, 1 for an unreachable node, 2 where
    a pin would be refused ("pin would fail:", a read token), else 0.
    """
    options = Options(config, token_file)
    with reporting():
        topology, token = options.topology, options.token
        work: _ScheduleWork | tuple[WarmItem, pb.Manifest]
        # A file only: a folder named as the dataset (the one just published from,
        # `publish ./mine --dataset mine`) made `warm mine` read a folder as a schedule.
        if Path(target).is_file():
            if region is not None:
                raise ValueError(
                    f"--region is for warm NAME@N; a schedule names its own regions "
                    f"(drop --region {region} to warm {target})"
                )
            work = _plan_schedule(topology, token, target, dry_run=dry_run)
        elif _looks_like_file(target):
            raise FileNotFoundError(f"no such schedule file: {target}")
        else:
            work = _single_item(topology, target, region, token)
    if isinstance(work, _ScheduleWork):
        report_infeasible(work.plan)
        warmed = _carry_out(work, topology, token, dry_run=dry_run, quiet=as_json)
    else:
        item, manifest = work
        # ``warm NAME@N --region R`` with a node of R down staged the silent node's share
        # on the others and exited 0, where the schedule form exits 1 ("region R is
        # degraded"): readers look for that share on the silent node. The same rule holds
        # here: staged on the nodes that answer, failing naming the others.
        reports = ops.gather_status(topology, token=token, regions={item.region})
        # The registry each node reads, from the same round: one reading another is
        # refused before staging (ops.stage_item), not asked again.
        item.registries.update({r.address: r.status.registry for r in reports if r.status})
        warmed = (
            _rehearse_single(item, manifest, reports)
            if dry_run
            else _carry_out(item, topology, token, dry_run=False, quiet=as_json)
        )
        down = ops.region_outages(reports)
        warmed = replace(warmed, down=ops.lost_outages([item], topology, down))
    if as_json:
        _report_json(warmed, dry_run)
    else:
        _report_text(warmed, dry_run)
    _report_failures(warmed, dry_run)
    code = _exit_code(warmed, dry_run)
    if code is not ExitCode.OK:
        raise exit_with(code)


def _looks_like_file(target: str) -> bool:
    """Whether a missing ``target`` was meant as a schedule file rather than NAME@N.

    A dataset name has no path separator and no such suffix, so a mistyped
    path is said to be missing instead of asked for --region.
    """
    return target.lower().endswith((".yaml", ".yml", ".json")) or "/" in target or os.sep in target


@dataclass(frozen=True)
class _ScheduleWork:
    """A schedule's plan and what warm needs beside it to carry it out and report it.

    ``down`` is kept with it because an unreachable region's plan is built
    without knowing what the region holds: the outage is reported once, as the
    node failure it is, and decides the exit code.
    """

    schedule: Schedule
    plan: Plan
    manifests: dict[str, pb.Manifest]
    now: datetime
    down: dict[str, ops.Outage]
    owner: str = ""  # the schedule file, as warm's record names it
    # Pins an earlier warm of this schedule placed for jobs it no longer has: released
    # before planning (or, in a dry run, would be).
    released: Released = field(default_factory=Released)
    # The status the plan was made on: a rehearsal decides on it (the pins a dry run
    # would release are gone from it); a real run asks the nodes again.
    reports: list[ops.NodeReport] = field(default_factory=list)
    # (region, name@N) → the end of the last job another schedule's warm or the controller
    # recorded reading it there (ops.other_readers): who a longer pin on a node is for.
    readers: dict[tuple[str, str], datetime] = field(default_factory=dict)


@dataclass(frozen=True)
class _Warmed:
    """What warm did (or would do), in the one shape the reports and the exit code read.

    ``work`` is None for a single version: it has no plan, so its ``outcome``
    stays empty (nothing evicted, deferred or pinned) and the plan's parts of
    the reports are left out.
    """

    rows: list[dict[str, Any]]
    failed: list[WarmItem]
    work: _ScheduleWork | None = None
    outcome: WarmOutcome = field(default_factory=WarmOutcome)
    # Regions some of whose nodes did not answer, before warm began (a schedule's
    # work.down, or a single version's region) or while it staged (ops.lost_outages).
    down: dict[str, ops.Outage] = field(default_factory=dict)
    # A rehearsal's "REGION NAME@N" → the source bytes its stage would fetch: those of the
    # shards the region's nodes do not hold yet (:func:`_unheld_sizes`).
    sizes: dict[str, int] = field(default_factory=dict)


def _plan_schedule(
    topology: Topology, token: str | None, path: str, *, dry_run: bool
) -> _ScheduleWork:
    """Plan the schedule against what the nodes hold now, since warm acts now.

    A controller on the same registry is worth a warning before a real run
    (not a rehearsal): warm does not break it, but acts on its own timing.
    """
    from edgecache.clients.controller import lease_holder
    from edgecache.clients.topology import load_schedule

    now = datetime.now(UTC)
    schedule, _ = started_as_recorded(
        topology, load_schedule(path, topology), now, owner=ops.schedule_owner(path)
    )
    _say_ended(schedule, now)  # as plan: "0 of 0 item(s) staged" alone said nothing of why
    owner = ops.schedule_owner(path)
    reports = ops.gather_status(topology, token=token)
    mine = _plan_releasing_own_pins(topology, token, schedule, owner, now, reports, dry_run=dry_run)
    plan, manifests, released, reports, readers = mine
    down = ops.unreachable_regions(reports, schedule, now)
    holder = lease_holder(topology.registry)
    if holder is not None and not dry_run:
        warning(
            f"controller {holder.holder} runs a schedule on this registry; warm acts "
            "now as well (pins, evictions and staging are idempotent, so nothing is "
            "done twice, but its timing is not the controller's)"
        )
    return _ScheduleWork(schedule, plan, manifests, now, down, owner, released, reports, readers)


def _plan_releasing_own_pins(
    topology: Topology,
    token: str | None,
    schedule: Schedule,
    owner: str,
    now: datetime,
    reports: list[ops.NodeReport],
    *,
    dry_run: bool,
) -> tuple[
    Plan, dict[str, pb.Manifest], Released, list[ops.NodeReport], dict[tuple[str, str], datetime]
]:
    """The schedule's plan once the pins its earlier warm placed and no longer needs are let go.

    Warm releases (or shortens) them before it carries the plan out, so their room
    is the plan's: planned again on what the nodes pin once they are gone. A dry
    run, and ``plan``, release nothing and plan on the pins as the release would
    leave them, so they show what the real warm then does; planned on the pins as
    they stand, ``plan`` called the schedule's own stale longer pin another's and
    planned around it. Returns the plan, its manifests, what was (or would be)
    released, the reports planned on, and :func:`ops.other_readers` for ``owner``.
    """
    plan, manifests = ops.make_plan(topology, schedule, now=now, reports=reports)
    released = Released()
    readers = ops.other_readers(topology, owner, now)
    if dropped := ops.dropped_warm_pins(topology, owner, plan, now, readers=readers):
        released = PlanExecutor(topology, token=token).release(dropped, reports, dry_run=dry_run)
        if released.released:
            reports = (
                ops.without_pins(reports, released.released)
                if dry_run
                else ops.gather_status(topology, token=token)
            )
            plan, manifests = ops.make_plan(topology, schedule, now=now, reports=reports)
    return plan, manifests, released, reports, readers


def _single_item(
    topology: Topology, spec: str, region: str | None, token: str | None
) -> tuple[WarmItem, pb.Manifest]:
    """``NAME@N --region R`` as one item to stage, all of it from origin, and its manifest.

    The region is checked before the registry is asked, so a typo in it is
    reported as such rather than hidden behind a registry error; a version
    larger than the region's whole capacity is refused (bad input, exit 2), one
    the room other versions' pins keep leaves no room for fails (exit 1), its
    dry run too.
    """
    from edgecache.cache.registry import Registry

    if region is None:
        raise ValueError(
            f"warm {spec} needs --region, one of {', '.join(sorted(topology.regions))}"
        )
    ops.region_nodes(topology, region)  # an unknown region fails before the registry
    manifest = Registry.run(topology.registry, lambda reg: reg.resolve(spec))
    # Refused up front, as plan refuses it: staging it would have each node evict its
    # cache to make room, then fail.
    unfit = ops.version_unfit(topology, region, manifest, token=token)
    if unfit is not None and unfit.for_now:  # pins hold the room: a failure, retried later
        error(unfit.text)
        raise exit_with(ExitCode.FAILED)
    if unfit is not None:
        raise ValueError(unfit.text)
    return ops.warm_item_for_version(topology, region, manifest), manifest


def report_infeasible(plan: Plan, met: Sequence[Infeasible] = ()) -> list[Infeasible]:
    """Say on stderr which jobs of ``plan`` cannot be met, and return them.

    ``warm`` says it up front, since it carries out the rest anyway, and
    ``controller --once`` after its round, leaving out the rows its round
    staged whole after all (``met``: :func:`there_now`). An unreachable
    region's jobs are left out (:func:`_plan_reasons`): the outage is said
    once, at the end, as the node failure it is.
    """
    reasons = [i for i in _plan_reasons(plan) if i not in met]
    for i in reasons:
        err_console.print(
            "[yellow]cannot be met:[/yellow] "
            + escape(f"{i.job} {i.version} in {i.region}: {i.reason}"),
            soft_wrap=True,
            highlight=False,
        )
    return reasons


def _rehearse_single(
    item: WarmItem, manifest: pb.Manifest, reports: list[ops.NodeReport]
) -> _Warmed:
    """A single version's dry run: staged, or ``held`` when the region holds it already.

    It has no plan to rehearse; what the region's nodes that answer hold decides,
    as it decides for the real run, whose nodes skip the shards they hold (and then
    say nothing moved). The dry run said "would stage" a version held whole.
    """
    held, _ = ops.ready(reports, item.region, manifest)
    if refused := ops.other_registries(item):  # the real run refuses it, held or not
        item.failures.extend(refused.values())  # as the real run refuses it, uncalled
        return _Warmed(rows=[_row(item, "failed")], failed=[item])
    if not any(r.status is not None for r in reports if r.region == item.region):
        # The real run stages nothing there: "1 of 1 item(s) would be staged" said
        # otherwise, beside the outage (a helper's hunt).
        item.failures.append(
            f"no node of region {item.region} answers: the real run would stage nothing there"
        )
        return _Warmed(rows=[_row(item, "failed")], failed=[item])
    return _Warmed(
        rows=[_row(item, "held" if held else "would stage")],
        failed=[],
        sizes=_unheld_sizes(reports, [manifest]),
    )


def _carry_out(
    work: _ScheduleWork | WarmItem,
    topology: Topology,
    token: str | None,
    *,
    dry_run: bool,
    quiet: bool,
) -> _Warmed:
    """Stage (or rehearse) under progress bars, turning Ctrl-C into exit 130.

    Every step is idempotent, so an interrupted warm is resumed by running it
    again; the stop event lets the transfers in flight end cleanly. Bars are
    left out for --json (they would mix with it) and for a dry run (nothing moves).
    """
    stop = threading.Event()
    bars = progress(disable=quiet or dry_run)
    try:
        with bars:
            if isinstance(work, WarmItem):
                return _stage_single(work, token, bars, stop)
            return _run_plan(work, topology, token, bars, stop, dry_run=dry_run)
    except KeyboardInterrupt:
        stop.set()
        err_console.print("stopped; run the same command again to resume")
        raise typer.Exit(ExitCode.INTERRUPTED) from None


def _stage_single(
    item: WarmItem, token: str | None, bars: Progress, stop: threading.Event
) -> _Warmed:
    """Stage one version from origin; its failures are collected, never raised."""
    bar = bars.add_task(f"{item.region} {item.spec}", total=item.bytes_total)
    ops.stage_item(
        item,
        token=token,
        stop=stop,
        on_progress=lambda i: bars.update(bar, completed=i.bytes_done),
    )
    return _Warmed(
        rows=[_row(item, "done" if item.done else "failed")],
        failed=[item] if item.failures else [],
    )


def _run_plan(
    work: _ScheduleWork,
    topology: Topology,
    token: str | None,
    bars: Progress,
    stop: threading.Event,
    *,
    dry_run: bool,
) -> _Warmed:
    """Carry out the plan with the real executor, or rehearse it with :class:`Rehearsal`.

    Both make the same decisions, which is what lets --dry-run show the real
    run's evictions, stages and deferrals. Only a real run records the jobs it
    pins for, since only it pins.
    """
    executor_type = Rehearsal if dry_run else PlanExecutor
    executor = executor_type(topology, token=token, stop=stop, on_progress=_plan_bars(bars))
    if not dry_run:
        _record_warmed_jobs(topology, work)
    with reporting():
        outcome = executor.warm(
            work.plan, work.schedule, work.manifests, reports=work.reports if dry_run else None
        )
    return _Warmed(
        rows=[_row(run.item, run.state, run.task.source, run.task) for run in outcome.runs],
        failed=[run.item for run in outcome.failed],
        work=work,
        outcome=outcome,
        down=ops.lost_outages([run.item for run in outcome.runs], topology, work.down),
        sizes=_unheld_sizes(work.reports, work.manifests.values()) if dry_run else {},
    )


def _unheld_sizes(
    reports: list[ops.NodeReport], manifests: Iterable[pb.Manifest]
) -> dict[str, int]:
    """``"REGION NAME@N"`` → the source bytes of the shards its nodes do not hold yet.

    A real run's nodes skip the shards they hold: a version held 3 of 4 moved a quarter
    of its bytes, where its dry run said the whole. Counted as ``ready`` counts the
    shards held (each node's share), at the version's mean source bytes per shard.
    """
    out = {}
    by_spec = {f"{m.dataset}@{m.version}": m for m in manifests}
    held = ops.holdings(reports, by_spec)
    for spec, m in by_spec.items():
        total, source = len(m.shards), sum(s.source_size for s in m.shards)
        for region, versions in held.items():
            holding = versions.get((m.dataset, m.version))
            if holding is not None and total and 0 < holding.shards < total:
                out[f"{region} {spec}"] = source * (total - holding.shards) // total
    return out


def _plan_bars(bars: Progress) -> Callable[[TaskRun], None]:
    """A progress callback that gives each run its own bar, made on its first report.

    The label is rebuilt on every report: a peer that will not hold the
    version turns the run into one from origin after its bar was made.
    """
    made: dict[int, TaskID] = {}

    def show(run: TaskRun) -> None:
        source = f" ← {run.task.source}" if run.item.peers else ""
        label = f"{run.task.region} {run.task.spec}{source}"
        bar = made.get(id(run.item))
        if bar is None:
            bar = made[id(run.item)] = bars.add_task(label, total=run.item.bytes_total)
        bars.update(bar, completed=run.item.bytes_done, description=label)

    return show


def _report_json(warmed: _Warmed, dry_run: bool) -> None:
    """One JSON object for scripts; the plan's keys only when there was a plan."""
    out: dict[str, object] = {"dry_run": True} if dry_run else {}
    out["items"] = warmed.rows
    work, outcome = warmed.work, warmed.outcome
    if work is not None:
        out["evicted"] = [
            {"region": e.region, "version": f"{e.version[0]}@{e.version[1]}", "bytes": b}
            for e, b in outcome.evicted
        ]
        out["deferred"] = [
            {"region": d.region, "what": d.what, "reason": d.reason} for d in outcome.deferred
        ]
        longer = _pinned_longer(work)
        out["pins"] = [
            {
                "region": name,
                "version": f"{v[0]}@{v[1]}",
                "until": json_time(until),
                # False: pinned, but the region holds none of it (its staging deferred or
                # failed); the pin keeps room for it, not data.
                "staged": (name, v) in outcome.held,
                # Set when the nodes keep it longer (for a job another schedule or the
                # controller recorded, or a pin no record explains): warm sends no Pin that
                # would shorten it. Its own longer pins it shortens (`released`).
                "held_until": json_time(longer[(name, v)][0]) if (name, v) in longer else None,
                "lent_to": list(rp.lends.get(v, ())),  # regions copying it from here
            }
            for name, rp in work.plan.regions.items()
            for v, until in sorted(rp.pins.items())
            if (name, v) not in outcome.pins_failed
        ]
        out["pin_failures"] = outcome.pin_failures
        out["evict_failures"] = outcome.evict_failures
        out["release_failures"] = work.released.problems
        out["release_notes"] = work.released.notes
        out["released"] = _released_json(work.released)
        there = _there_now(warmed, dry_run)
        # there_now: staged whole by this run after all (not counted for exit 3).
        out["infeasible"] = [
            {**_infeasible_json(i), "there_now": i in there} for i in work.plan.infeasible
        ]
    # A single version's degraded region too: its items read "done" for the nodes that
    # answered, and only this says which did not (and why the exit is 1).
    out["unreachable"] = _unreachable(_down(warmed))
    print(json.dumps(out))


def _released_json(released: Released) -> list[dict[str, object]]:
    """The pins of an earlier warm of the schedule let go (or that would be), for ``--json``."""
    return [
        {
            "region": pin.region,
            "node": pin.node,
            "version": pin.version,
            "until": json_time(pin.until),
            # Set when the pin was shortened to this time, not released (the schedule's job
            # now ends then, or a job another record holds still reads the version there).
            "shortened_to": json_time(pin.shorten_to) if pin.shorten_to else None,
        }
        for pin in released.released
    ]


def _unreachable(down: dict[str, ops.Outage]) -> list[dict[str, str]]:
    """``--json``'s unreachable regions, each with what its outage message says."""
    return [{"region": r, "reason": outage.message()} for r, outage in down.items()]


def _report_text(warmed: _Warmed, dry_run: bool) -> None:
    """What was done (or would be), the items' notes, then a count a person can check.

    A single version has no plan, but its stage is said in the same line as a
    plan's: the region, the version ``NAME`` resolved to, and what moved.
    """
    work = warmed.work
    sizes = _source_sizes(work.manifests.values()) if work is not None else {}
    sizes.update(warmed.sizes)  # a rehearsal's stages of versions held in part
    if work is not None:
        _print_plan_steps(
            work.plan, warmed.outcome, warmed.rows, dry_run, work.released, sizes,
            _pinned_longer(work),
        )  # fmt: skip
    else:
        _print_stages(warmed.rows, dry_run, sizes)
    for row in warmed.rows:
        for note in grouped_shard_notes(row["notes"]):
            err_console.print(f"note: {row['region']} {row['version']}: {note}", soft_wrap=True)
    said = _sizes_said(_staged_rows(warmed.rows, dry_run))
    if dry_run:
        # Failed ones too are not staged (a node reading another registry, a region down).
        staged = sum(1 for row in warmed.rows if row["state"] == "would stage")
        held = sum(1 for row in warmed.rows if row["state"] == "held")
        kept = f" ({held} held already)" if held else ""  # "1 of 1 would be staged" said it moves
        console.print(
            f"warm --dry-run: {staged} of {len(warmed.rows)} item(s) would be staged{kept}{said}"
        )
    else:
        # A stage that moved nothing found the version held whole: counted as the dry run
        # counts it ("1 of 1 staged" there against "0 of 1 would be staged (1 held)").
        held = sum(1 for row in warmed.rows if row["done"] and not row["bytes"])
        staged = sum(1 for row in warmed.rows if row["done"]) - held
        kept = f" ({held} held already)" if held else ""
        console.print(f"warm: {staged} of {len(warmed.rows)} item(s) staged{kept}{said}")


def _pinned_longer(work: _ScheduleWork) -> dict[tuple[str, VersionKey], tuple[datetime, str]]:
    """(region, version) → the pin its nodes keep and whose, of the plan's pins they keep longer.

    A node keeps one pin time per version, the longest asked for: warm sends no
    Pin that would shorten another schedule's, and said "pinned until" its own
    job's end all the same, which is not what the node keeps. The longer pin is
    said to be for another schedule's or the controller's job only when their
    records have one that ends then (``work.readers``); this schedule's own
    earlier pin is shortened by the release before (``dropped_warm_pins``), and
    one left longer is said as such.
    """
    out: dict[tuple[str, VersionKey], tuple[datetime, str]] = {}
    for name, rp in work.plan.regions.items():
        for v, until in rp.pins.items():
            kept = [
                version.pinned_until.ToDatetime(tzinfo=UTC)
                for report in work.reports
                if report.region == name and report.status is not None
                for version in report.status.versions
                if (version.dataset, version.version) == v and version.HasField("pinned_until")
            ]
            if not kept or max(kept) - until <= timedelta(seconds=1):
                continue
            held = max(kept)
            other = work.readers.get((name, f"{v[0]}@{v[1]}"))
            if other is not None and other >= held - timedelta(seconds=1):
                whose = "already, for a job another schedule or the controller recorded"
            elif any(pin.region == name and pin.key == v for pin in work.released.kept):
                whose = (
                    "still, this schedule's earlier pin, not shortened (the release failure "
                    "says why; the next warm shortens it)"
                )
            else:
                whose = "already, a pin no job of warm's or the controller's records needs"
            out[(name, v)] = (held, whose)
    return out


def _print_plan_steps(
    plan: Plan,
    outcome: WarmOutcome,
    rows: list[dict[str, Any]],
    dry_run: bool,
    released: Released | None = None,
    sizes: dict[str, int] | None = None,
    longer: dict[tuple[str, VersionKey], tuple[datetime, str]] | None = None,
) -> None:
    """A plan's evictions, stages, pins and deferrals, in the words of a real run or a rehearsal.

    The real run says the same lines as its rehearsal, in the past tense: plan
    shows each task's source and the pins, so warm says what it staged from
    where and what it pinned (progress bars are gone from a pipe or a log). A
    failed stage is said on stderr instead; a pin that failed is not claimed.
    """
    evicted, pinned = ("would evict", "would pin") if dry_run else ("evicted", "pinned")
    released = released or Released()
    for pin in released.released:
        console.print(release_line(pin, plan, dry_run=dry_run))
    for e, freed in outcome.evicted:
        console.print(
            f"{e.region}: {evicted} {e.version[0]}@{e.version[1]} "
            f"({format_bytes(freed)}): {e.reason}"
        )
    _print_stages(rows, dry_run, sizes or {})
    for name, rp in plan.regions.items():
        for v, until in sorted(rp.pins.items()):
            if (name, v) not in outcome.pins_failed:
                held = (longer or {}).get((name, v))
                console.print(
                    f"{name}: {pinned} {v[0]}@{v[1]} until {until:%Y-%m-%d %H:%M}"
                    + (
                        f" (its nodes keep it until {held[0]:%Y-%m-%d %H:%M} {held[1]})"
                        if held is not None
                        else ""
                    )
                    + (f" (for {', '.join(lent)}'s copy)" if (lent := rp.lends.get(v)) else "")
                    + _not_staged(outcome, name, v)
                )
    deferred = "would defer" if dry_run else "deferred"
    for d in outcome.deferred:
        err_console.print(
            f"[yellow]{deferred}:[/yellow] {d.region} {d.what}: {d.reason}", soft_wrap=True
        )
    pin_failed = "pin would fail" if dry_run else "pin failed"
    for failure in outcome.pin_failures:
        err_console.print(f"[red]{pin_failed}:[/red] {failure}", soft_wrap=True)


def _print_stages(rows: list[dict[str, Any]], dry_run: bool, sizes: dict[str, int]) -> None:
    """``REGION: staged NAME@N (SIZE) from SOURCE``, a line per item staged (or that would be)."""
    staged = "would stage" if dry_run else "staged"
    for row in _staged_rows(rows, dry_run):
        # A version held whole came from nowhere: "(nothing moved …) from origin" said
        # otherwise (a helper's hunt). The line stays, for what the run covered.
        source = "" if _held_whole(row, dry_run) else f" from {row['from']}"
        console.print(
            f"{row['region']}: {staged} {row['version']} ({_moved(row, dry_run, sizes)}){source}"
        )


def _held_whole(row: dict[str, Any], dry_run: bool) -> bool:
    """Whether a stage line's version was (or would be) held whole: nothing moves for it."""
    return row["state"] == "held" if dry_run else not row["bytes"]


def _staged_rows(rows: list[dict[str, Any]], dry_run: bool) -> list[dict[str, Any]]:
    """The items a stage line is said for: staged (or that would be, held ones included)."""
    return [
        row
        for row in rows
        if (row["state"] in ("would stage", "held") if dry_run else row["state"] == "done")
    ]


def _source_sizes(manifests: Iterable[pb.Manifest]) -> dict[str, int]:
    """``name@N`` → the version's source bytes (what origin stages fetch), from its manifest."""
    return {f"{m.dataset}@{m.version}": sum(s.source_size for s in m.shards) for m in manifests}


def _moved(row: dict[str, Any], dry_run: bool, sizes: dict[str, int]) -> str:
    """A stage's size as warm says it: what the nodes move, the same in a dry run as after.

    The nodes count (their ``staged_*_bytes``) a stage from origin in source
    bytes (before preprocessing) and a copy from a peer in the stored chunks'
    bytes. A real run says what they moved; its dry run what they would: the
    version's source bytes from origin (``sizes``: its manifest's; a single
    version's planned bytes are those already), the plan's stored estimate
    from a peer. The dry run used to give the plan's stored estimate for an
    origin stage too: 4.8 KiB where the real run then said 7.2 KiB.
    """
    if dry_run:
        if _held_whole(row, dry_run):
            return "nothing to move: its shards are held already"
        if row["source"] == "peer":
            return format_bytes(int(row["planned_bytes"]))
        part = sizes.get(f"{row['region']} {row['version']}")
        if part is not None:  # held in part: only the rest moves
            return f"about {format_bytes(part)}: the shards not held yet"
        return format_bytes(sizes.get(row["version"], int(row["planned_bytes"])))
    if _held_whole(row, dry_run):
        return "nothing moved: its shards were held already"
    return format_bytes(int(row["bytes"]))


# What a stage line's size counts, by where the stage fetches from (see _moved).
_SIZES = {
    "origin": "source bytes from origin",
    "peer": "stored bytes from a peer",
    "mixed": "source bytes from origin plus stored bytes from a peer",
}


def _sizes_said(rows: list[dict[str, Any]]) -> str:
    """``; sizes are …``: which bytes the sized stage lines of ``rows`` count, said once."""
    kinds = {row["source"] for row in rows if row["state"] == "would stage" or row["bytes"]}
    said = [text for kind, text in _SIZES.items() if kind in kinds]
    return f"; sizes are {' and '.join(said)}" if said else ""


def _not_staged(outcome: WarmOutcome, region: str, version: VersionKey) -> str:
    """``, not staged: …`` for a pin on a version the region does not hold (or would not)."""
    if (region, version) in outcome.held:
        return ""
    states = {r.state for r in outcome.runs if r.key == (region, version)}
    why = (
        "its staging deferred"
        if "deferred" in states
        else "its staging failed"
        if "failed" in states
        else "nothing of it held"
    )
    # The same words in a dry run: its lines are the real run's, in another tense. A stage
    # that failed may have left some shards (a node of two held one of two shards).
    holds = "only what of it was staged" if why == "its staging failed" else "no data yet"
    return f", not staged: {why} (the pin holds {holds})"


def _report_failures(warmed: _Warmed, dry_run: bool = False) -> None:
    """Failed items and unreachable regions, on stderr whatever the format, next to the exit."""
    for item in warmed.failed:
        err_console.print(
            f"[red]failed:[/red] {item.spec} in {item.region}: " + "; ".join(item.failures),
            soft_wrap=True,
        )
    for failure in warmed.outcome.evict_failures:
        err_console.print(f"[red]evict failed:[/red] {failure}", soft_wrap=True)
    for row in warmed.rows:
        if row.get("peers_refused"):
            said = ops.peers_refused_text(row["version"], row["region"], row["peers_refused"])
            err_console.print(f"[red]peer refused:[/red] {said}", soft_wrap=True)
    # Each problem says itself what becomes of the pin (a failed call, a node down).
    label = "release would fail" if dry_run else "release failed"
    for problem in _release_failures(warmed):
        err_console.print(f"[red]{label}:[/red] {problem}", soft_wrap=True)
    if warmed.work is not None:
        for note in warmed.work.released.notes:
            err_console.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
        report_there_now(_there_now(warmed, dry_run), warmed.work.schedule)
    for outage in _down(warmed).values():
        error(outage.message())


_SHARD_NOTE = re.compile(r"shard (\d+): (.*)", re.DOTALL)
_SHARDS_LISTED = 8  # shard numbers a grouped note lists before "and N more"


def grouped_shard_notes(notes: Sequence[str]) -> list[str]:
    """Notes that differ only in their ``shard N:`` said once, naming the shards.

    A node notes each shard a peer did not give it: a peer that refuses the node's
    token gave a thousand-shard version a thousand lines of the same words.
    """
    # (whether of shards, its words after "shard N: ") → its shards
    shards: dict[tuple[bool, str], list[str]] = {}
    for note in notes:
        match = _SHARD_NOTE.fullmatch(note)
        number, words = match.groups() if match else ("", note)
        shards.setdefault((match is not None, words), []).append(number)
    said = []
    for (of_shards, words), numbers in shards.items():
        if not of_shards:
            said.append(words)
            continue
        numbers.sort(key=int)
        listed = first_of(numbers, _SHARDS_LISTED)
        said.append(f"shard{'s' if len(numbers) > 1 else ''} {listed}: {words}")
    return said


def _exit_code(warmed: _Warmed, dry_run: bool = False) -> ExitCode:
    """A failure (1) outranks a job that cannot be met (3): retrying may fix the former.

    An unreachable region counts as a failure even in a dry run, since its
    plan was built without knowing what the region holds; nodes that serve but
    refused the credentials are bad input (2), as for ``plan`` and ``status``.
    """
    down = _down(warmed)
    outcome = warmed.outcome
    # As the schedule form, whose status check finds it first; unless a node is down too
    # (1 outranks 2, as for plan: a script reading 2 would not retry past a dead node).
    if _credentials_refused(warmed) and (not down or _outage_exit(down) is ExitCode.BAD_INPUT):
        return ExitCode.BAD_INPUT
    if warmed.failed or outcome.pin_failures or outcome.evict_failures or _release_failures(warmed):
        return ExitCode.FAILED
    if down:
        return _outage_exit(down)
    if any(row.get("peers_refused") for row in warmed.rows):
        return ExitCode.BAD_INPUT  # a setting to fix, as a refused token: retrying cannot
    if warmed.work is not None:
        there = _there_now(warmed, dry_run)
        if any(i not in there for i in warmed.work.plan.infeasible):
            return ExitCode.CANNOT_BE_MET
    return ExitCode.OK


def _there_now(warmed: _Warmed, dry_run: bool) -> list[Infeasible]:
    """:func:`there_now` of warm's run; none for a rehearsal, which moves nothing.

    A dry run exits as the real run would before it moves data.
    """
    if dry_run or warmed.work is None:
        return []
    return there_now(warmed.work.plan, warmed.outcome.held)


def there_now(plan: Plan, held: Set[tuple[str, VersionKey]]) -> list[Infeasible]:
    """The plan's unmet rows whose version the row's region holds whole after the run.

    ``warm`` stages every task now, not at the plan's time, and ``controller
    --once`` starts what is due and waits for it: a version the plan called late
    (a slow link, or a job that started without it) is there once the run ends,
    and the job reads it from the cache from then on. Both said "cannot be met"
    of it after staging it, and exited 3. ``held``: (region, version) pairs the
    regions' nodes hold whole, between them, once the run ended.
    """
    there = []
    for row in plan.infeasible:
        wanted = parse_spec(row.version)
        if not row.unreachable and (row.region, (wanted.dataset, wanted.version)) in held:
            there.append(row)
    return there


def report_there_now(rows: Sequence[Infeasible], schedule: Schedule) -> None:
    """Say on stderr each unmet row a run staged whole after all (:func:`there_now`)."""
    starts = {job.name: job.start for job in schedule.jobs}
    for row in rows:
        start = starts.get(row.job)
        when = (
            f"{row.job} started at {start:%Y-%m-%d %H:%M} UTC without it, and reads it "
            "from the cache from now on"
            if start is not None and start <= datetime.now(UTC)
            else f"before {row.job} starts"
        )
        said = f"{row.job} {row.version} in {row.region}: staged whole by this run, {when}"
        err_console.print("[green]there now:[/green] " + escape(said), soft_wrap=True)


def _credentials_refused(warmed: _Warmed) -> bool:
    """Every failure is a node refusing this command's token (none given, or the read one), or TLS.

    ``warm NAME@N --region R`` goes straight to the stage, so a node that wants the admin
    token fails the stage itself, where the schedule form's status check had found it
    and exited 2: the same bad input, the same code. The executor keeps failures as
    text, which carries the node's status code.
    """
    from edgecache.clients.channels import credentials_refused_in, tls_setting_in

    outcome = warmed.outcome
    failures = [
        *(f for item in warmed.failed for f in item.failures),
        *map(str, [*outcome.pin_failures, *outcome.evict_failures, *_release_failures(warmed)]),
    ]
    # A TLS setting (a CA not trusted, grpcs:// to a node without TLS) refuses as a token
    # does: exit 2, as status, ready and the schedule form say it.
    return bool(failures) and all(credentials_refused_in(f) or tls_setting_in(f) for f in failures)


def _release_failures(warmed: _Warmed) -> list[str]:
    """Why releases of pins the schedule no longer needs failed (a single version has none)."""
    return warmed.work.released.problems if warmed.work is not None else []


def _down(warmed: _Warmed) -> dict[str, ops.Outage]:
    """Unreachable or degraded regions: before warm began, or found so while it staged."""
    return warmed.down


def _record_warmed_jobs(topology: Topology, work: _ScheduleWork) -> None:
    """Record the jobs and pins of a warm run before it pins; failing that, it does nothing.

    ``evict`` names the jobs, and a later warm of the same schedule releases
    the pins of jobs it no longer has. Without the record neither can: warm
    used to warn, pin anyway and exit 0, and a pin whose job then left the
    schedule held its room to its end, released by nothing short of ``evict
    --force``. So a record that cannot be written stops the run before any
    node is touched (exit 1).
    """
    try:
        ops.record_warmed_jobs(
            topology,
            work.schedule,
            work.manifests,
            work.now,
            owner=work.owner,
            plan=work.plan,
            unreleased=work.released.kept,
        )
    except (EdgeCacheError, OSError) as exc:
        error(
            f"could not record the jobs warm pins versions for ({exc}): nothing was pinned "
            "or staged, since pins without that record could not be released by a later "
            "warm nor named by evict; make the registry writable and run warm again"
        )
        raise exit_with(ExitCode.FAILED) from None


# A rehearsal's source regions answer at once (they would stage, or are deferred):
# only a source with no task at all waits this long, to be reported as failing.
REHEARSED_PEER_WAIT = 10.0


# A pin time no node holds (pins in the past are gone): a conditional Pin on it changes nothing.
_NO_PIN = datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)


class Rehearsal(PlanExecutor):
    """The executor ``warm --dry-run`` uses: the real one's decisions, no node touched.

    :meth:`PlanExecutor.warm`, ``evict`` and ``run`` decide (the steps' order,
    the eviction guard, waiting on a peer source or falling back to origin,
    what is deferred); only the actions on nodes are replaced: an eviction
    "frees" the planned bytes, a task is marked as one that would be staged,
    and pins are listed from the plan instead of set.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refusals: dict[str, grpc.RpcError | None] = {}  # node → its answer to the probe

    def _pin_node(self, node: str, version: VersionKey, until: datetime) -> str | None:
        """Set nothing; but a node that refuses this command's token a Pin fails it here too.

        The real run's loop (:meth:`PlanExecutor._pin`, and the re-pin after an
        eviction) decides which pins to ask for; this answers each. The status
        round a dry run plans on passes with the read token, and the real run then
        failed every pin, exit 2, where the rehearsal said it would pin and exited
        0. Each node is asked once, with a Pin that changes nothing (unpin only if
        pinned until 1970, which no pin is): a refusal of the token is the real
        run's failure, word for word; any other answer says the token may pin.
        """
        from edgecache.clients.channels import node_error

        refusals = self._refusals
        if node not in refusals:
            refusals[node] = self._token_refused(node, version)
        if (exc := refusals[node]) is None:
            return None
        return str(node_error(exc, endpoint=node, what=f"pinning {version[0]}@{version[1]}"))

    def _token_refused(self, node: str, version: VersionKey) -> grpc.RpcError | None:
        """The node's refusal of this command's token for Pin, or None (a Pin changing nothing)."""
        import grpc

        from edgecache.clients.channels import bearer, edge_stub
        from edgecache.v1 import edge_pb2

        request = edge_pb2.PinRequest(dataset=version[0], version=version[1])
        request.if_until.FromDatetime(_NO_PIN)  # unpin only if pinned until 1970: none is
        try:
            with edge_stub(node) as stub:
                stub.Pin(request, timeout=5.0, metadata=bearer(self.token))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return exc
        return None

    def _evict_nodes(self, eviction: Eviction, *, unless_pinned_after: datetime) -> Evicted:
        """Ask no node; the plan's bytes are what the eviction would free."""
        return Evicted(eviction.bytes)

    def run(self, run: TaskRun, *, peer_wait: float = REHEARSED_PEER_WAIT) -> TaskRun:
        """The real run's decisions, with a wait on sources that suits a rehearsal."""
        return super().run(run, peer_wait=peer_wait)

    def _stage(self, run: TaskRun) -> TaskRun:
        """Stage nothing: the run is one that would be staged, and its region holds it.

        Unless a node of the region reads another registry: the real run refuses
        it before any Stage call (:func:`ops.other_registries`), so the rehearsal
        fails it too, from the registries the plan's status round reported.
        """
        if refused := ops.other_registries(run.item):
            run.item.failures.extend(refused.values())
            run.state = "failed"
            self.mark_wont_hold(run.task.region, run.task.version, "a node reads another registry")
            return run
        run.state = "would stage"
        self.mark_resident(run.task.region, run.task.version)
        return run


def _row(
    item: WarmItem, state: str, source: str = "origin", task: StageTask | None = None
) -> dict[str, Any]:
    """One item as warm reports it (and --json prints it): a plan's task or a single version.

    ``bytes`` is what the nodes said they moved (origin bytes fetched and peer
    bytes copied), ``planned_bytes`` the plan's estimate (all a dry run has).
    ``source`` is the region the plan chose to copy from; the row names it only
    while the item still copies from a peer, since a run whose peer will not
    hold the version falls back to origin. A plan's task also gives its planned
    ``start`` and ``jobs``, which tell apart two tasks of one version in a region
    (staged, evicted for another, staged again) as plan --json lists them.
    """
    kind = _moved_from(item)
    return {
        "region": item.region,
        "version": item.spec,
        "source": kind,
        "from": {"peer": source, "mixed": f"{source} and origin"}.get(kind, "origin"),
        # What the nodes' Stage progress said they moved (origin and peer bytes); the
        # plan's estimate apart: a shard already held moves nothing, and a copy from a
        # peer moves stored bytes, not the plan's size.
        "bytes": item.moved_bytes,
        "planned_bytes": item.bytes_total,
        "state": state,
        "done": item.done,
        "failures": item.failures,
        "notes": item.notes,
        "peers_refused": item.peers_refused,
        "start": json_time(task.start) if task else None,
        "jobs": list(task.jobs) if task else [],
    }


def _moved_from(item: WarmItem) -> str:
    """``peer``, ``origin`` or ``mixed``: where the nodes said the bytes came from.

    Before anything moved (a dry run, held shards), where the plan copies from.
    A node whose peers do not give it a shard (a token they refuse, a copy
    gone) takes it from origin: the row said "from pa" and "stored bytes from
    a peer" while every byte had crossed the origin link the plan had avoided.
    """
    if item.peer_bytes and item.origin_bytes:
        return "mixed"
    if item.peer_bytes or (item.peers and not item.origin_bytes):
        return "peer"
    return "origin"


READY_WAIT = 3600.0  # seconds ready --wait waits without --timeout


@app.command()
def ready(
    spec: Annotated[str, typer.Argument(help="NAME@N", metavar="NAME@N")],
    region: Annotated[str, typer.Option(help="Region the job runs in.")],
    config: ConfigOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until ready.")] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Seconds to wait at most (default 3600); needs --wait: refused without it.",
            show_default=False,
        ),
    ] = None,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Exit 0 only when every shard of the version is staged in the region.

    Gate a job's launch on it. The nodes are always asked at least once (so
    --wait --timeout 0 checks once); with --wait each round's calls end by the
    deadline, so the wait does not overrun --timeout. --timeout without --wait
    is refused: a single check has no wait to bound. Exit codes: 0 ready; 1 not
    ready (or --wait timed out, which it says); 2 bad input (a negative
    --timeout, or --timeout without --wait, among them; a node that refused
    this command's credentials, at once, without waiting: pass --token-file;
    or one it cannot reach in TLS as it is set up, which the error names;
    with a node of the region down too, 1, as status exits).
    """
    from edgecache.cache.registry import Registry
    from edgecache.clients.ops import wait_ready

    options = Options(config, token_file)
    with reporting():
        if timeout is not None and not wait:
            # It used to be taken and ignored: the check ran once, whatever it said.
            raise ValueError(
                f"--timeout needs --wait: add --wait to wait up to {timeout:g} s for the "
                "version, or drop --timeout to check once"
            )
        if wait and timeout is None:
            timeout = READY_WAIT
        topology = options.topology
        manifest = Registry.run(topology.registry, lambda reg: reg.resolve(spec))
        readiness = wait_ready(topology, manifest, region, token=options.token, timeout=timeout)
    if as_json:
        print(
            json.dumps(
                {
                    "version": f"{manifest.dataset}@{manifest.version}",
                    "region": region,
                    "ready": readiness.ok,
                    "timed_out": readiness.timed_out,
                    "waited_seconds": round(readiness.waited_seconds, 3),
                    "message": readiness.message,
                }
            )
        )
    else:
        (console if readiness.ok else err_console).print(readiness.message)
    if readiness.refused and not readiness.silent:
        # A token or TLS to set, not a wait; with a node down too, a failure as status says.
        raise exit_with(ExitCode.BAD_INPUT)
    raise exit_with(ExitCode.OK if readiness.ok else ExitCode.FAILED)
