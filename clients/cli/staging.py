"""Commands that move data ahead of jobs: ``plan`` a schedule, ``warm`` regions, check ``ready``."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

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
from edgecache.clients.cli.render import console, err_console, format_bytes


@app.command()
def plan(
    schedule: Annotated[Path, typer.Argument(help="Schedule file (YAML).")],
    config: ConfigOption = None,
    at: Annotated[
        str | None, typer.Option(help="Plan as of this time (ISO 8601, with zone).")
    ] = None,
    explain: Annotated[bool, typer.Option(help="Say why each eviction and source.")] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show what to stage where, by when, what to evict, and what cannot be met."""
    from edgecache.clients.ops import make_plan
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        jobs = load_schedule(schedule, options.topology)
        now = datetime.fromisoformat(at) if at else None
        if now is not None and now.tzinfo is None:
            raise ValueError(f"--at {at!r} needs a time zone, e.g. {at}Z")
        result, _ = make_plan(options.topology, jobs, now=now, token=options.token)
    if as_json:
        print(json.dumps(_plan_json(result), indent=2))
    else:
        _print_plan(result, explain)


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
        table = Table(title=f"region {name}")
        for column in ("stage", "size", "from", "start", "ready by", "deadline", "for jobs"):
            table.add_column(column)
        for t in rp.tasks:
            table.add_row(
                t.spec,
                format_bytes(t.bytes),
                t.source,
                f"{t.start:%Y-%m-%d %H:%M}",
                f"{t.finish:%Y-%m-%d %H:%M:%S}",
                f"{t.deadline:%Y-%m-%d %H:%M}",
                ", ".join(t.jobs),
            )
        for e in rp.evictions:
            table.add_row(
                f"[yellow]evict {e.version[0]}@{e.version[1]}[/yellow]",
                format_bytes(e.bytes),
                "",
                f"{e.at:%Y-%m-%d %H:%M}",
                "",
                "",
                e.reason if explain else "",
            )
        if rp.tasks or rp.evictions:
            console.print(table)
        else:
            console.print(f"region {name}: nothing to do")
    if explain:
        for name, rp in result.regions.items():
            for t in rp.tasks:
                why = (
                    "faster than its origin link"
                    if t.source != "origin"
                    else "origin (no faster peer holds it in time)"
                )
                console.print(f"{name}: {t.spec} from {t.source}: {why}")
    for (job, link), size in sorted(result.transfers.items()):
        cost = f", egress ${result.cost[job]:.2f}" if job in result.cost else ""
        console.print(f"{job}: {format_bytes(size)} over {link}{cost}")
    if result.infeasible:
        table = Table(title="[red]cannot be met[/red]")
        for column in ("job", "region", "version", "why"):
            table.add_column(column)
        for i in result.infeasible:
            table.add_row(i.job, i.region, i.version, f"[red]{i.reason}[/red]")
        console.print(table)


@app.command()
def warm(
    target: Annotated[str, typer.Argument(help="A schedule file, or NAME@N with --region.")],
    region: Annotated[str | None, typer.Option(help="Region to warm NAME@N in.")] = None,
    config: ConfigOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be staged.")] = False,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Stage data into regions now (a schedule's plan, or one version), with progress."""
    import threading

    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from edgecache.cache.registry import Registry
    from edgecache.clients import ops
    from edgecache.clients.topology import load_schedule

    options = Options(config, token_file)
    with reporting():
        topology, token = options.topology, options.token
        if Path(target).exists():
            schedule = load_schedule(target, topology)
            result, manifests = ops.make_plan(topology, schedule, token=token)
            items = ops.warm_items_for_plan(topology, schedule, result, manifests)
            for i in result.infeasible:
                err_console.print(
                    f"[yellow]cannot be met:[/yellow] {i.job} {i.version} in {i.region}: {i.reason}"
                )
        else:
            if region is None:
                raise ValueError(f"warm {target} needs --region, one of {sorted(topology.regions)}")
            ops.region_nodes(topology, region)  # an unknown region fails before the registry
            manifest = Registry.run(topology.registry, lambda reg: reg.resolve(target))
            items = [ops.warm_item_for_version(topology, region, manifest)]
    if dry_run:
        for item in items:
            console.print(
                f"would stage {item.spec} into {item.region} "
                f"({format_bytes(item.bytes_total)}) on {', '.join(item.nodes)}"
            )
        return
    stop = threading.Event()
    progress = Progress(
        TextColumn("{task.description:<32}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        disable=as_json,
    )
    tasks = {id(i): progress.add_task(f"{i.region} {i.spec}", total=i.bytes_total) for i in items}
    try:
        with progress:
            ops.warm(
                items,
                on_progress=lambda i: progress.update(tasks[id(i)], completed=i.bytes_done),
                stop=stop,
                token=token,
            )
    except KeyboardInterrupt:
        stop.set()
        err_console.print("stopped; run the same command again to resume")
        raise typer.Exit(130) from None
    failed = [i for i in items if i.failures]
    if as_json:
        print(
            json.dumps(
                [
                    {"region": i.region, "version": i.spec, "done": i.done, "failures": i.failures}
                    for i in items
                ]
            )
        )
    for item in failed:
        err_console.print(
            f"[red]failed:[/red] {item.spec} in {item.region}: " + "; ".join(item.failures)
        )
    if failed:
        raise exit_with(ExitCode.FAILED)
    if not as_json:
        console.print(f"warm: {len(items)} item(s) staged")


@app.command()
def ready(
    spec: Annotated[str, typer.Argument(help="NAME@N")],
    region: Annotated[str, typer.Option(help="Region the job runs in.")],
    config: ConfigOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until ready.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait at most.")] = 3600.0,
    token_file: TokenOption = None,
) -> None:
    """Exit 0 only when every shard of the version is staged in the region."""
    from edgecache.cache.registry import Registry
    from edgecache.clients.ops import wait_ready

    options = Options(config, token_file)
    with reporting():
        topology = options.topology
        manifest = Registry.run(topology.registry, lambda reg: reg.resolve(spec))
        readiness = wait_ready(
            topology, manifest, region, token=options.token, timeout=timeout if wait else None
        )
    (console if readiness.ok else err_console).print(readiness.message)
    raise exit_with(ExitCode.OK if readiness.ok else ExitCode.FAILED)
