"""Commands that move data ahead of jobs: ``plan`` a schedule, ``warm`` regions, check ``ready``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from edgecache.cache.planner import Plan
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
    format_bytes,
    line,
    progress,
    table,
    warning,
)
from edgecache.clients.plan_status import JobView


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
    2 bad input; 1 failed (registry or nodes unreachable).
    """
    from edgecache.clients.ops import gather_status, make_plan
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        jobs = load_schedule(schedule, options.topology)
        now = _parse_at(at)
        reports = gather_status(options.topology, token=options.token)
        result, manifests = make_plan(options.topology, jobs, now=now, reports=reports)
        if show_status:
            from edgecache.clients.controller import read_state
            from edgecache.clients.plan_status import job_views

            views = job_views(
                jobs,
                result,
                manifests,
                reports,
                read_state(options.topology.registry),
                now or datetime.now(UTC),
            )
    if show_status:
        _print_status(views, as_json)
    elif as_json:
        print(json.dumps(_plan_json(result), indent=2))
    else:
        _print_plan(result, explain)
    if result.infeasible:
        raise exit_with(ExitCode.CANNOT_BE_MET)


def _parse_at(at: str | None) -> datetime | None:
    if at is None:
        return None
    now = datetime.fromisoformat(at)
    if now.tzinfo is None:
        raise ValueError(f"--at {at!r} needs a time zone, e.g. {at}Z")
    return now


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
                    }
                    for v in views
                ],
                indent=2,
            )
        )
        return
    colour = {"ready": "green", "staging": "cyan", "late": "yellow", "missed": "red"}
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
                "\n".join([*v.missing, *([v.why] if v.why else [])]),
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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be done.")] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Carry out a schedule's plan now (pins, evictions, staging), or stage one version.

    With a schedule, every task of the plan runs now rather than at its planned
    start, from the source the plan chose, after the evictions that make its
    room; an eviction that would take data a job reads before the plan's
    eviction time is refused, and the tasks that need its room are deferred
    (run warm again later, or let the controller run the schedule). Exit codes:
    0 done; 3 a job cannot be met (the rest is done); 1 a transfer or node
    failed; 2 bad input; 130 interrupted (run it again to resume).
    """
    import threading

    from edgecache.cache.registry import Registry
    from edgecache.clients import ops
    from edgecache.clients.executor import PlanExecutor, TaskRun
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        topology, token = options.topology, options.token
        if Path(target).exists():
            from edgecache.clients.controller import lease_holder

            schedule = load_schedule(target, topology)
            result, manifests = ops.make_plan(topology, schedule, token=token)
            single = None
            holder = lease_holder(topology.registry)
            if holder is not None:
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
    if single is None:
        for i in result.infeasible:
            err_console.print(
                f"[yellow]cannot be met:[/yellow] {i.job} {i.version} in {i.region}: {i.reason}",
                soft_wrap=True,
            )
    if dry_run:
        if single is not None:
            console.print(
                f"would stage {single.spec} into {single.region} "
                f"({format_bytes(single.bytes_total)}) on {', '.join(single.nodes)}"
            )
            return
        for name, rp in result.regions.items():
            for e in rp.evictions:
                console.print(f"would evict {e.version[0]}@{e.version[1]} from {name}: {e.reason}")
            for t in rp.tasks:
                console.print(
                    f"would stage {t.spec} into {name} ({format_bytes(t.bytes)}) from {t.source}"
                )
            for version, until in sorted(rp.pins.items()):
                console.print(
                    f"would pin {version[0]}@{version[1]} in {name} until {until:%Y-%m-%d %H:%M}"
                )
        if result.infeasible:
            raise exit_with(ExitCode.CANNOT_BE_MET)
        return
    stop = threading.Event()
    bar_set = progress(disable=as_json)
    bars: dict[int, TaskID] = {}

    def show(run: TaskRun) -> None:
        bar = bars.get(id(run.item))
        if bar is None:
            source = "" if run.task.source == "origin" else f" ← {run.task.source}"
            bar = bars[id(run.item)] = bar_set.add_task(
                f"{run.task.region} {run.task.spec}{source}", total=run.item.bytes_total
            )
        bar_set.update(bar, completed=run.item.bytes_done)

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
                items = [single]
            else:
                executor = PlanExecutor(topology, token=token, stop=stop, on_progress=show)
                with reporting():
                    outcome = executor.warm(result, schedule, manifests)
                items = [run.item for run in outcome.runs]
                failed = [run.item for run in outcome.failed]
    except KeyboardInterrupt:
        stop.set()
        err_console.print("stopped; run the same command again to resume")
        raise typer.Exit(130) from None
    if as_json:
        out: dict[str, object] = {
            "items": [
                {
                    "region": i.region,
                    "version": i.spec,
                    "source": "peer" if i.peers else "origin",
                    "done": i.done,
                    "failures": i.failures,
                    "notes": i.notes,
                }
                for i in items
            ]
        }
        if single is None:
            out["evicted"] = [
                {"region": e.region, "version": f"{e.version[0]}@{e.version[1]}", "bytes": b}
                for e, b in outcome.evicted
            ]
            out["deferred"] = [
                {"region": d.region, "what": d.what, "reason": d.reason} for d in outcome.deferred
            ]
            out["infeasible"] = [
                {"job": i.job, "region": i.region, "version": i.version, "reason": i.reason}
                for i in result.infeasible
            ]
        print(json.dumps(out))
    else:
        if single is None:
            for e, freed in outcome.evicted:
                console.print(
                    f"{e.region}: evicted {e.version[0]}@{e.version[1]} "
                    f"({format_bytes(freed)}): {e.reason}"
                )
            for d in outcome.deferred:
                err_console.print(
                    f"[yellow]deferred:[/yellow] {d.region} {d.what}: {d.reason}", soft_wrap=True
                )
            for failure in outcome.pin_failures:
                err_console.print(f"[red]pin failed:[/red] {failure}", soft_wrap=True)
        for item in items:
            for note in item.notes:
                err_console.print(f"note: {item.region} {item.spec}: {note}", soft_wrap=True)
        done = sum(1 for i in items if i.done)
        console.print(f"warm: {done} of {len(items)} item(s) staged")
    for item in failed:
        err_console.print(
            f"[red]failed:[/red] {item.spec} in {item.region}: " + "; ".join(item.failures),
            soft_wrap=True,
        )
    if failed or (single is None and outcome.pin_failures):
        raise exit_with(ExitCode.FAILED)
    if single is None and result.infeasible:
        raise exit_with(ExitCode.CANNOT_BE_MET)


@app.command()
def ready(
    spec: Annotated[str, typer.Argument(help="NAME@N")],
    region: Annotated[str, typer.Option(help="Region the job runs in.")],
    config: ConfigOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until ready.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait at most.")] = 3600.0,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Exit 0 only when every shard of the version is staged in the region.

    Gate a job's launch on it. Exit codes: 0 ready; 1 not ready (or --wait timed
    out, which it says); 2 bad input.
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
