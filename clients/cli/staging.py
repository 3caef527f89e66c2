"""Commands that move data ahead of jobs: ``plan`` a schedule, ``warm`` regions, check ``ready``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import TaskID

from edgecache.cache.errors import EdgeCacheError
from edgecache.cache.planner import Eviction, Plan
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
    line,
    progress,
    table,
    warning,
)
from edgecache.clients.executor import Evicted, PlanExecutor, TaskRun
from edgecache.clients.ops import WarmItem
from edgecache.clients.plan_status import JobView
from edgecache.clients.topology import Schedule, Topology
from edgecache.v1 import manifest_pb2 as pb


@app.command()
def plan(
    schedule: Annotated[Path, typer.Argument(help="Schedule file (YAML).")],
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

    Exit codes: 0 every job can be met; 3 some cannot (listed, with the reason);
    2 bad input; 1 failed: the registry, or a node of a region the schedule
    uses, is unreachable (named; this wins over 3, since that region's plan
    is built without knowing what it holds).
    """
    from edgecache.clients.ops import gather_status, make_plan, unreachable_regions
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        jobs = load_schedule(schedule, options.topology)
        now = parse_at(at) or datetime.now(UTC)
        reports = gather_status(options.topology, token=options.token)
        result, manifests = make_plan(options.topology, jobs, now=now, reports=reports)
        if show_status:
            from edgecache.clients.controller import lease_holder, read_state
            from edgecache.clients.plan_status import job_views

            views = job_views(
                jobs,
                result,
                manifests,
                reports,
                read_state(options.topology.registry),
                now,
                controller_running=lease_holder(options.topology.registry) is not None,
                schedule_path=str(schedule),
            )
    if show_status:
        _print_status(views, as_json)
    elif as_json:
        print(json.dumps(_plan_json(result), indent=2))
    else:
        _print_plan(result, explain)
    down = unreachable_regions(reports, jobs, now)
    for message in down.values():
        error(message)
    if down:
        raise exit_with(ExitCode.FAILED)
    if result.infeasible:
        raise exit_with(ExitCode.CANNOT_BE_MET)


def parse_at(at: str | None, option: str = "--at") -> datetime | None:
    """``--at``'s time; a malformed or zone-less one is bad input that names the option."""
    if at is None:
        return None
    example = "2026-12-01T08:00:00Z"
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        raise ValueError(
            f"{option} {at!r} is not a time: give ISO 8601 with a time zone, e.g. {example}"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"{option} {at!r} needs a time zone, e.g. {at}Z")
    return when


def _print_status(views: list[JobView], as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "job": v.job,
                        "region": v.region,
                        "start": v.start.isoformat(),
                        "state": v.state,
                        "planned_ready": v.planned_ready.isoformat() if v.planned_ready else None,
                        "ready_at": v.ready_at.isoformat() if v.ready_at else None,
                        "complete_at_start": v.complete_at_start,
                        "missing": v.missing,
                        "why": v.why,
                        "hint": v.hint,
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
        "missed": "red",
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


def _plan_json(result: Plan) -> dict[str, object]:
    return {
        "regions": {
            name: {
                "tasks": [
                    {
                        "version": t.spec,
                        "bytes": t.bytes,
                        "source": t.source,
                        "start": t.start.isoformat(),
                        "finish": t.finish.isoformat(),
                        "deadline": t.deadline.isoformat(),
                        "jobs": list(t.jobs),
                    }
                    for t in rp.tasks
                ],
                "evictions": [
                    {
                        "version": f"{e.version[0]}@{e.version[1]}",
                        "bytes": e.bytes,
                        "at": e.at.isoformat(),
                        "reason": e.reason,
                    }
                    for e in rp.evictions
                ],
                "pins": [
                    {"version": f"{v[0]}@{v[1]}", "until": until.isoformat()}
                    for v, until in sorted(rp.pins.items())
                ],
            }
            for name, rp in result.regions.items()
        },
        "infeasible": [
            {"job": i.job, "region": i.region, "version": i.version, "reason": i.reason}
            for i in result.infeasible
        ],
        "transfers": [
            {"job": j, "link": link, "bytes": b}
            for (j, link), b in sorted(result.transfers.items())
        ],
        "cost": result.cost,
    }


def _print_plan(result: Plan, explain: bool) -> None:
    for name, rp in result.regions.items():
        if not (rp.tasks or rp.evictions):
            line(f"region {name}: nothing to do")
            continue
        rows = [
            [
                t.spec,
                format_bytes(t.bytes),
                t.source,
                f"{t.start:%Y-%m-%d %H:%M}",
                f"{t.finish:%Y-%m-%d %H:%M:%S}",
                f"{t.deadline:%Y-%m-%d %H:%M}",
                ", ".join(t.jobs),
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
    if explain:
        for name, rp in result.regions.items():
            for t in rp.tasks:
                why = (
                    "faster than its origin link"
                    if t.source != "origin"
                    else "origin (no faster peer holds it in time)"
                )
                line(f"{name}: {t.spec} from {t.source}: {why}")
            for version, until in sorted(rp.pins.items()):
                line(f"{name}: pin {version[0]}@{version[1]} until {until:%Y-%m-%d %H:%M}")
    for (job, link), size in sorted(result.transfers.items()):
        cost = f", egress ${result.cost[job]:.2f}" if job in result.cost else ""
        line(f"{job}: {format_bytes(size)} over {link}{cost}")
    if result.infeasible:
        table(
            "[red]cannot be met[/red]",
            [
                Column("job", ident=True),
                Column("region", ident=True),
                Column("version", ident=True),
                Column("why", wrap=True),
            ],
            [[i.job, i.region, i.version, f"[red]{i.reason}[/red]"] for i in result.infeasible],
        )


@app.command()
def warm(
    target: Annotated[str, typer.Argument(help="A schedule file, or NAME@N with --region.")],
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
    eviction time is refused, and the tasks that need its room are deferred
    (run warm again later, or let the controller run the schedule). --dry-run
    goes through the same steps without touching a node, so it shows the same
    evictions, stages and deferrals. Exit codes: 0 done; 3 a job cannot be met
    (the rest is done); 1 a transfer or node failed, or a node of a region the
    schedule uses is unreachable; 2 bad input; 130 interrupted (run it again to
    resume). --dry-run exits as the real run would before it moves data: 3, 1
    for an unreachable node, else 0.
    """
    import threading

    from edgecache.cache.registry import Registry
    from edgecache.clients import ops
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        topology, token = options.topology, options.token
        if Path(target).exists():
            from edgecache.clients.controller import lease_holder

            schedule = load_schedule(target, topology)
            now = datetime.now(UTC)
            reports = ops.gather_status(topology, token=token)
            result, manifests = ops.make_plan(topology, schedule, now=now, reports=reports)
            down = ops.unreachable_regions(reports, schedule, now)
            single = None
            holder = lease_holder(topology.registry)
            if holder is not None and not dry_run:
                warning(
                    f"controller {holder.holder} runs a schedule on this registry; warm acts "
                    "now as well (pins, evictions and staging are idempotent, so nothing is "
                    "done twice, but its timing is not the controller's)"
                )
        else:
            if region is None:
                raise ValueError(f"warm {target} needs --region, one of {sorted(topology.regions)}")
            ops.region_nodes(topology, region)  # an unknown region fails before the registry
            manifest = Registry.run(topology.registry, lambda reg: reg.resolve(target))
            single = ops.warm_item_for_version(topology, region, manifest)
            down = {}
    if single is None:
        for i in result.infeasible:
            if i.reason == down.get(i.region):
                continue  # said once, below, as the node failure it is
            err_console.print(
                f"[yellow]cannot be met:[/yellow] {i.job} {i.version} in {i.region}: {i.reason}",
                soft_wrap=True,
            )
    if dry_run and single is not None:
        if as_json:
            print(json.dumps({"dry_run": True, "items": [_single_row(single, dry_run)]}))
        else:
            console.print(
                f"would stage {single.spec} into {single.region} "
                f"({format_bytes(single.bytes_total)}) on {', '.join(single.nodes)}"
            )
        return
    stop = threading.Event()
    bar_set = progress(disable=as_json or dry_run)
    bars: dict[int, TaskID] = {}

    def show(run: TaskRun) -> None:
        # The source as it stands: a peer that will not hold the version turns the
        # run into one from origin after its bar was made.
        source = f" ← {run.task.source}" if run.item.peers else ""
        label = f"{run.task.region} {run.task.spec}{source}"
        bar = bars.get(id(run.item))
        if bar is None:
            bar = bars[id(run.item)] = bar_set.add_task(label, total=run.item.bytes_total)
        bar_set.update(bar, completed=run.item.bytes_done, description=label)

    try:
        with bar_set:
            if single is not None:
                bar = bar_set.add_task(f"{single.region} {single.spec}", total=single.bytes_total)
                ops.stage_item(
                    single,
                    token=token,
                    stop=stop,
                    on_progress=lambda i: bar_set.update(bar, completed=i.bytes_done),
                )
                failed = [single] if single.failures else []
                rows = [_single_row(single, dry_run)]
            else:
                kind = Rehearsal if dry_run else PlanExecutor
                executor = kind(topology, token=token, stop=stop, on_progress=show)
                if not dry_run:
                    _record_warmed_jobs(topology, schedule, manifests, now)
                with reporting():
                    outcome = executor.warm(result, schedule, manifests)
                rows = [_run_row(run) for run in outcome.runs]
                failed = [run.item for run in outcome.failed]
    except KeyboardInterrupt:
        stop.set()
        err_console.print("stopped; run the same command again to resume")
        raise typer.Exit(130) from None
    if as_json:
        out: dict[str, object] = {"dry_run": True} if dry_run else {}
        out["items"] = rows
        if single is None:
            out["evicted"] = [
                {"region": e.region, "version": f"{e.version[0]}@{e.version[1]}", "bytes": b}
                for e, b in outcome.evicted
            ]
            out["deferred"] = [
                {"region": d.region, "what": d.what, "reason": d.reason} for d in outcome.deferred
            ]
            out["pins"] = [
                {"region": name, "version": f"{v[0]}@{v[1]}", "until": until.isoformat()}
                for name, rp in result.regions.items()
                for v, until in sorted(rp.pins.items())
            ]
            out["pin_failures"] = outcome.pin_failures
            out["infeasible"] = [
                {"job": i.job, "region": i.region, "version": i.version, "reason": i.reason}
                for i in result.infeasible
            ]
            out["unreachable"] = [{"region": r, "reason": why} for r, why in down.items()]
        print(json.dumps(out))
    else:
        if single is None:
            evicted = "would evict" if dry_run else "evicted"
            for e, freed in outcome.evicted:
                console.print(
                    f"{e.region}: {evicted} {e.version[0]}@{e.version[1]} "
                    f"({format_bytes(freed)}): {e.reason}"
                )
            if dry_run:
                for row in rows:
                    if row["state"] != "deferred":
                        console.print(
                            f"{row['region']}: would stage {row['version']} "
                            f"({format_bytes(int(row['bytes']))}) from {row['from']}"
                        )
                for name, rp in result.regions.items():
                    for v, until in sorted(rp.pins.items()):
                        console.print(
                            f"{name}: would pin {v[0]}@{v[1]} until {until:%Y-%m-%d %H:%M}"
                        )
            deferred = "would defer" if dry_run else "deferred"
            for d in outcome.deferred:
                err_console.print(
                    f"[yellow]{deferred}:[/yellow] {d.region} {d.what}: {d.reason}", soft_wrap=True
                )
            for failure in outcome.pin_failures:
                err_console.print(f"[red]pin failed:[/red] {failure}", soft_wrap=True)
        for row in rows:
            for note in row["notes"]:
                err_console.print(f"note: {row['region']} {row['version']}: {note}", soft_wrap=True)
        if dry_run:
            staged = sum(1 for row in rows if row["state"] != "deferred")
            console.print(f"warm --dry-run: {staged} of {len(rows)} item(s) would be staged")
        else:
            staged = sum(1 for row in rows if row["done"])
            console.print(f"warm: {staged} of {len(rows)} item(s) staged")
    for item in failed:
        err_console.print(
            f"[red]failed:[/red] {item.spec} in {item.region}: " + "; ".join(item.failures),
            soft_wrap=True,
        )
    for message in down.values():
        error(message)
    if failed or down or (single is None and outcome.pin_failures):
        raise exit_with(ExitCode.FAILED)
    if single is None and result.infeasible:
        raise exit_with(ExitCode.CANNOT_BE_MET)


def _record_warmed_jobs(
    topology: Topology, schedule: Schedule, manifests: dict[str, pb.Manifest], now: datetime
) -> None:
    """Record the jobs warm pins for (so evict can name them); failing that only warns."""
    from edgecache.clients import ops

    try:
        ops.record_warmed_jobs(topology, schedule, manifests, now)
    except (EdgeCacheError, OSError) as exc:
        warning(
            f"could not record the jobs warm pins versions for ({exc}); evict will not be "
            "able to name them"
        )


# A rehearsal's source regions answer at once (they would stage, or are deferred):
# only a source with no task at all waits this long, to be reported as failing.
REHEARSED_PEER_WAIT = 10.0


class Rehearsal(PlanExecutor):
    """The executor ``warm --dry-run`` uses: the real one's decisions, no node touched.

    :meth:`PlanExecutor.warm`, ``evict`` and ``run`` decide (the steps' order,
    the eviction guard, waiting on a peer source or falling back to origin,
    what is deferred); only the actions on nodes are replaced: an eviction
    "frees" the planned bytes, a task is marked as one that would be staged,
    and pins are listed from the plan instead of set.
    """

    def pin(self, plan: Plan, reports: Sequence[object] | None = None) -> list[str]:
        """Set nothing; a pin cannot fail in a rehearsal."""
        return []

    def _evict_nodes(self, eviction: Eviction) -> Evicted:
        """Ask no node; the plan's bytes are what the eviction would free."""
        return Evicted(eviction.bytes)

    def run(self, run: TaskRun, *, peer_wait: float = REHEARSED_PEER_WAIT) -> TaskRun:
        """The real run's decisions, with a wait on sources that suits a rehearsal."""
        return super().run(run, peer_wait=peer_wait)

    def _stage(self, run: TaskRun) -> TaskRun:
        """Stage nothing: the run is one that would be staged, and its region holds it."""
        run.state = "would stage"
        self.mark_resident(run.task.region, run.task.version)
        return run


def _run_row(run: TaskRun) -> dict[str, Any]:
    """One staging task as warm reports it (and --json prints it)."""
    return {
        "region": run.item.region,
        "version": run.item.spec,
        "source": "peer" if run.item.peers else "origin",
        "from": run.task.source if run.item.peers else "origin",
        "bytes": run.item.bytes_total,
        "state": run.state,
        "done": run.item.done,
        "failures": run.item.failures,
        "notes": run.item.notes,
    }


def _single_row(item: WarmItem, dry_run: bool) -> dict[str, Any]:
    """``warm NAME@N --region R``'s one item, as :func:`_run_row` reports a task."""
    state = "would stage" if dry_run else "done" if item.done else "failed"
    return {
        "region": item.region,
        "version": item.spec,
        "source": "origin",
        "from": "origin",
        "bytes": item.bytes_total,
        "state": state,
        "done": item.done,
        "failures": item.failures,
        "notes": item.notes,
    }


@app.command()
def ready(
    spec: Annotated[str, typer.Argument(help="NAME@N")],
    region: Annotated[str, typer.Option(help="Region the job runs in.")],
    config: ConfigOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until ready.")] = False,
    timeout: Annotated[
        float, typer.Option(min=0.0, help="Seconds to wait at most (with --wait).")
    ] = 3600.0,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Exit 0 only when every shard of the version is staged in the region.

    Gate a job's launch on it. The nodes are always asked at least once (so
    --timeout 0 checks once); with --wait each round's calls end by the
    deadline, so the wait does not overrun --timeout. Exit codes: 0 ready; 1 not
    ready (or --wait timed out, which it says); 2 bad input (a negative
    --timeout among them).
    """
    from edgecache.cache.registry import Registry
    from edgecache.clients.ops import wait_ready

    options = Options(config, token_file)
    with reporting():
        topology = options.topology
        manifest = Registry.run(topology.registry, lambda reg: reg.resolve(spec))
        readiness = wait_ready(
            topology, manifest, region, token=options.token, timeout=timeout if wait else None
        )
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
    raise exit_with(ExitCode.OK if readiness.ok else ExitCode.FAILED)
