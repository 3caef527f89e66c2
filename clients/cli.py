"""The ``edgecache`` command line: operate caches and run the demo.

Commands are added here as the parts they drive land (serve, publish, plan,
warm, status, doctor); each prints rich tables for people and ``--json`` for
scripts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgecache.cache.errors import EdgeCacheError

app = typer.Typer(
    name="edgecache",
    help="Stage training data into regional caches next to the GPUs.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Stage training data into regional caches next to the GPUs."""


@app.command()
def demo(
    size_mib: Annotated[
        int, typer.Option("--size-mib", min=1, help="Dataset size to generate.")
    ] = 256,
    shards: Annotated[int, typer.Option(min=1, help="Number of shards.")] = 8,
    compression: Annotated[str, typer.Option(help="zstd or none.")] = "zstd",
    threads: Annotated[int, typer.Option(min=1, help="EdgeDataset read-ahead threads.")] = 2,
    workdir: Annotated[
        Path | None, typer.Option(help="Directory to keep (default: a temporary one).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Run the local multi-region demo: origin, registry, two edge nodes, a reading job."""
    from edgecache.clients.demo import run_demo

    if compression not in ("zstd", "none"):
        raise typer.BadParameter("use 'zstd' or 'none'", param_hint="--compression")
    root = workdir or Path(tempfile.mkdtemp(prefix="edgecache-demo-"))
    try:
        result = run_demo(
            root, total_mib=size_mib, shards=shards, compression=compression, threads=threads
        )
    except (EdgeCacheError, RuntimeError) as exc:
        raise _fail(exc, 1) from exc
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
    for line in result.plan:
        console.print(f"plan: {line}")
    table = Table(title=f"edgecache demo: {result.dataset}, two regions on this machine")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("shards / samples", f"{result.shards} / {result.samples:,}")
    table.add_row(
        "origin Parquet / cached in eu-west",
        f"{result.source_bytes / 1e6:,.0f} MB / {result.stored_bytes / 1e6:,.0f} MB",
    )
    table.add_row("stage eu-west (fetch + preprocess + cache)", f"{result.stage_mb_s:,.0f} MB/s")
    table.add_row(
        f"training epoch via EdgeDataset ({result.device}, {result.read_threads} threads)",
        f"{result.read_samples_s:,.0f} samples/s, {result.read_mb_s:,.0f} MB/s",
    )
    table.add_row("time to first batch", f"{result.first_batch_s * 1e3:,.0f} ms")
    table.add_row(
        "loss, first → last tenth of the epoch", f"{result.loss_first:.3f} → {result.loss_last:.3f}"
    )
    table.add_row(
        "first chunk: warm eu-west / cold us-east",
        f"{result.warm_first_chunk_s * 1e3:,.1f} ms / {result.cold_first_chunk_s * 1e3:,.1f} ms",
    )
    table.add_row(
        "every sample once, every chunk verified", "yes" if result.verified else "[red]NO[/red]"
    )
    console.print(table)
    nodes = Table(title="edge nodes")
    for column in ("region", "shards resident", "used", "hits", "misses", "served"):
        nodes.add_column(column, justify="left" if column == "region" else "right")
    for n in result.nodes:
        nodes.add_row(
            str(n["region"]),
            str(n["shards_resident"]),
            f"{int(n['used_bytes']) / 1e6:,.0f} MB",  # type: ignore[call-overload]
            str(n["hits"]),
            str(n["misses"]),
            f"{int(n['bytes_served']) / 1e6:,.0f} MB",  # type: ignore[call-overload]
        )
    console.print(nodes)
    if not result.verified:
        raise typer.Exit(1)


@app.command()
def serve(
    region: Annotated[str | None, typer.Option(help="Region this node serves.")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="LMDB cache directory.")] = None,
    listen: Annotated[str | None, typer.Option(help="gRPC HOST:PORT [127.0.0.1:7070].")] = None,
    registry: Annotated[str | None, typer.Option(help="Registry URL (s3://…, file://…).")] = None,
    capacity: Annotated[str | None, typer.Option(help="Cache capacity, e.g. 500GiB.")] = None,
    metrics_listen: Annotated[str | None, typer.Option(help="Prometheus HOST:PORT.")] = None,
    probe_listen: Annotated[
        str | None, typer.Option(help="Plaintext health-only HOST:PORT for probes.")
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Server certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server key (PEM).")] = None,
    tls_client_ca: Annotated[
        Path | None, typer.Option(help="CA for client certificates (mutual TLS).")
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="Bearer token required for Stage/Evict.")
    ] = None,
    read_token_file: Annotated[
        Path | None, typer.Option(help="Bearer token required for reads.")
    ] = None,
    staging_rate: Annotated[
        str | None, typer.Option(help="Cap on staging's origin rate, e.g. 200MB/s.")
    ] = None,
    node_id: Annotated[str | None, typer.Option(help="Node name [hostname].")] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML file of settings (flags and EDGECACHE_* win).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING.")] = "INFO",
) -> None:
    """Run an edge node: serve, fetch, preprocess and cache shards for one region."""
    import asyncio
    import logging

    from edgecache.edge.config import load_node_config
    from edgecache.edge.server import serve_forever

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    flags = {
        "region": region,
        "cache_dir": cache_dir,
        "listen": listen,
        "registry": registry,
        "capacity": capacity,
        "metrics_listen": metrics_listen,
        "probe_listen": probe_listen,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
        "token_file": token_file,
        "read_token_file": read_token_file,
        "staging_rate": staging_rate,
        "node_id": node_id,
    }
    try:
        settings = load_node_config(config, flags)
        asyncio.run(serve_forever(settings))
    except EdgeCacheError as exc:
        raise _fail(exc, 2) from exc


ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="Topology file [$EDGECACHE_CONFIG, ./edgecache.yaml]."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
TokenOption = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="EDGECACHE_TOKEN_FILE",
        help="File holding the bearer token of nodes that require one "
        "(the admin token for warm/evict; the read token is enough otherwise).",
    ),
]


def _token(path: Path | None) -> str | None:
    """The token in ``path``; an unreadable file is a usage error, not a refused call."""
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError as exc:
        raise ValueError(f"--token-file {path}: {exc.strerror}") from None


def _fail(exc: Exception, code: int = 2) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
    return typer.Exit(code)


def _registry_url(registry: str | None, config: Path | None) -> str:
    from edgecache.clients.topology import load_topology

    return registry or load_topology(config).registry


@app.command()
def publish(
    source_url: Annotated[str, typer.Argument(help="Prefix of raw shards (s3://…, file://…).")],
    dataset: Annotated[str, typer.Option(help="Dataset name.")],
    fmt: Annotated[
        str | None, typer.Option("--format", help="parquet, jsonl, csv or arrow [from names].")
    ] = None,
    transform: Annotated[str, typer.Option(help="Transform name.")] = "identity",
    param: Annotated[
        list[str] | None, typer.Option(help="Transform parameter KEY=VALUE (repeatable).")
    ] = None,
    compression: Annotated[str, typer.Option(help="zstd or none.")] = "zstd",
    level: Annotated[int, typer.Option(help="zstd level.")] = 1,
    registry: Annotated[str | None, typer.Option(help="Registry URL [from --config].")] = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Snapshot a prefix as the next immutable version of a dataset."""
    from edgecache.cache.manifest import preprocess_spec
    from edgecache.cache.preprocess import format_from_name
    from edgecache.cache.registry import Registry
    from edgecache.v1 import manifest_pb2 as pb

    try:
        params = dict(p.split("=", 1) for p in (param or []) if "=" in p)
        if len(params) != len(param or []):
            raise ValueError("--param takes KEY=VALUE")
        spec = preprocess_spec(
            transform=transform,
            params=params,
            compression=pb.COMPRESSION_NONE if compression == "none" else pb.COMPRESSION_ZSTD,
            compression_level=level,
        )
        source_format = format_from_name(fmt) if fmt else None
        manifest = Registry.run(
            _registry_url(registry, config),
            lambda reg: reg.publish(source_url, dataset, fmt=source_format, spec=spec),
        )
    except (EdgeCacheError, ValueError, OSError) as exc:
        raise _fail(exc) from exc
    if as_json:
        print(
            json.dumps(
                {
                    "version": f"{manifest.dataset}@{manifest.version}",
                    "digest": manifest.digest,
                    "shards": len(manifest.shards),
                }
            )
        )
    else:
        console.print(
            f"{manifest.dataset}@{manifest.version}  {manifest.digest}  "
            f"({len(manifest.shards)} shards)"
        )


@app.command()
def versions(
    dataset: Annotated[str, typer.Argument(help="Dataset name.")],
    registry: Annotated[str | None, typer.Option(help="Registry URL [from --config].")] = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """List a dataset's published versions."""
    from edgecache.cache.manifest import summarize
    from edgecache.cache.registry import Registry

    try:
        url = _registry_url(registry, config)

        async def listing(reg: Registry) -> list:  # type: ignore[type-arg]
            return [summarize(await reg.manifest(dataset, n)) for n in await reg.versions(dataset)]

        rows = Registry.run(url, listing)
    except (EdgeCacheError, ValueError, OSError) as exc:
        raise _fail(exc) from exc
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "version": v.version,
                        "digest": v.digest,
                        "shards": v.shard_count,
                        "rows": v.row_count,
                        "source_bytes": v.source_bytes,
                        "created_at": v.created_at.ToJsonString(),
                    }
                    for v in rows
                ]
            )
        )
        return
    table = Table(title=f"{dataset} in {url}")
    for column in ("version", "digest", "shards", "rows", "source", "created"):
        table.add_column(
            column, justify="right" if column in ("version", "shards", "rows", "source") else "left"
        )
    for v in rows:
        table.add_row(
            str(v.version),
            v.digest[:19] + "…",
            str(v.shard_count),
            f"{v.row_count:,}",
            f"{v.source_bytes / 1e6:,.1f} MB",
            v.created_at.ToJsonString(),
        )
    console.print(table if rows else f"{dataset} has no versions in {url}")


@app.command()
def status(
    config: ConfigOption = None, token_file: TokenOption = None, as_json: JsonOption = False
) -> None:
    """Regions × nodes: health, RTT from here, capacity, used, versions, hit ratio."""
    from edgecache.clients.ops import gather_status
    from edgecache.clients.topology import load_topology

    try:
        reports = gather_status(load_topology(config), token=_token(token_file))
    except (EdgeCacheError, ValueError) as exc:
        raise _fail(exc) from exc
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "region": r.region,
                        "node": r.address,
                        "healthy": r.healthy,
                        "rtt_ms": None if r.status is None else round(r.rtt_ms, 2),
                        "error": r.error,
                        "capacity_bytes": r.status.capacity_bytes if r.status else None,
                        "used_bytes": r.status.used_bytes if r.status else None,
                        "hits": r.status.hits if r.status else None,
                        "misses": r.status.misses if r.status else None,
                        "bytes_served": r.status.bytes_served if r.status else None,
                        "versions": [
                            {
                                "version": f"{v.dataset}@{v.version}",
                                "shards": v.shard_count,
                                "pinned_until": v.pinned_until.ToJsonString()
                                if v.HasField("pinned_until")
                                else None,
                            }
                            for v in (r.status.versions if r.status else [])
                        ],
                    }
                    for r in reports
                ]
            )
        )
    else:
        table = Table(title="edge nodes")
        for column in (
            "region",
            "node",
            "health",
            "RTT",
            "used / capacity",
            "versions (shards, pin)",
            "hit ratio",
            "served",
        ):
            table.add_column(column)
        for r in reports:
            if r.status is None:
                table.add_row(
                    r.region, r.address, "[red]down[/red]", "", "", f"[red]{r.error}[/red]", "", ""
                )
                continue
            s = r.status
            versions_text = (
                ", ".join(
                    f"{v.dataset}@{v.version} ({v.shard_count}"
                    f"{'/' + str(v.total_shards) if v.total_shards else ''}"
                    f"{', pinned' if v.HasField('pinned_until') else ''})"
                    for v in s.versions
                )
                or "—"
            )
            lookups = s.hits + s.misses
            table.add_row(
                r.region,
                r.address,
                "[green]serving[/green]" if r.healthy else "[yellow]draining[/yellow]",
                f"{r.rtt_ms:.1f} ms",
                f"{s.used_bytes / 1e9:,.2f} / {s.capacity_bytes / 1e9:,.1f} GB",
                versions_text,
                f"{s.hits / lookups:.0%}" if lookups else "—",
                f"{s.bytes_served / 1e6:,.0f} MB",
            )
        console.print(table)
    if any(r.status is None for r in reports):
        raise typer.Exit(1)


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
    from datetime import datetime

    from edgecache.clients.ops import make_plan
    from edgecache.clients.topology import load_schedule, load_topology

    try:
        topology = load_topology(config)
        jobs = load_schedule(schedule, topology)
        now = datetime.fromisoformat(at) if at else None
        if now is not None and now.tzinfo is None:
            raise ValueError(f"--at {at!r} needs a time zone, e.g. {at}Z")
        result, _ = make_plan(topology, jobs, now=now, token=_token(token_file))
    except (EdgeCacheError, ValueError) as exc:
        raise _fail(exc) from exc
    _print_plan(result, explain, as_json)


def _print_plan(result, explain: bool, as_json: bool) -> None:  # noqa: ANN001
    if as_json:
        print(
            json.dumps(
                {
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
                },
                indent=2,
            )
        )
        return
    for name, rp in result.regions.items():
        table = Table(title=f"region {name}")
        for column in ("stage", "size", "from", "start", "ready by", "deadline", "for jobs"):
            table.add_column(column)
        for t in rp.tasks:
            table.add_row(
                t.spec,
                f"{t.bytes / 1e9:,.2f} GB",
                t.source,
                f"{t.start:%Y-%m-%d %H:%M}",
                f"{t.finish:%Y-%m-%d %H:%M:%S}",
                f"{t.deadline:%Y-%m-%d %H:%M}",
                ", ".join(t.jobs),
            )
        for e in rp.evictions:
            table.add_row(
                f"[yellow]evict {e.version[0]}@{e.version[1]}[/yellow]",
                f"{e.bytes / 1e9:,.2f} GB",
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
        console.print(f"{job}: {size / 1e9:,.2f} GB over {link}{cost}")
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
    from edgecache.clients.ops import WarmItem, make_plan
    from edgecache.clients.ops import warm as run_warm
    from edgecache.clients.topology import load_schedule, load_topology

    try:
        topology = load_topology(config)
        token = _token(token_file)
        items: list[WarmItem] = []
        if Path(target).exists():
            schedule = load_schedule(target, topology)
            result, manifests = make_plan(topology, schedule, token=token)
            ends = {job.name: job.end for job in schedule.jobs}
            shard_counts = {f"{m.dataset}@{m.version}": len(m.shards) for m in manifests.values()}
            for name, rp in result.regions.items():
                for t in rp.tasks:
                    items.append(
                        WarmItem(
                            name,
                            t.spec,
                            topology.regions[name].nodes,
                            t.bytes,
                            pin_until=max(ends[j] for j in t.jobs),
                            shard_count=shard_counts[t.spec],
                        )
                    )
            for i in result.infeasible:
                err_console.print(
                    f"[yellow]cannot be met:[/yellow] {i.job} {i.version} in {i.region}: {i.reason}"
                )
        else:
            if region is None or region not in topology.regions:
                raise ValueError(f"warm {target} needs --region, one of {sorted(topology.regions)}")

            manifest = Registry.run(topology.registry, lambda reg: reg.resolve(target))
            items.append(
                WarmItem(
                    region,
                    f"{manifest.dataset}@{manifest.version}",
                    topology.regions[region].nodes,
                    sum(s.source_size for s in manifest.shards),
                    shard_count=len(manifest.shards),
                )
            )
    except (EdgeCacheError, ValueError, OSError) as exc:
        raise _fail(exc) from exc
    if dry_run:
        for item in items:
            console.print(
                f"would stage {item.spec} into {item.region} "
                f"({item.bytes_total / 1e9:,.2f} GB) on {', '.join(item.nodes)}"
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
            run_warm(
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
        raise typer.Exit(1)
    if not as_json:
        console.print(f"warm: {len(items)} item(s) staged")


@app.command()
def evict(
    spec: Annotated[str, typer.Argument(help="NAME@N")],
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
    config: ConfigOption = None,
    token_file: TokenOption = None,
) -> None:
    """Drop a version from the nodes of a region (or all regions)."""
    import grpc

    from edgecache.cache.names import parse_spec
    from edgecache.clients.channels import bearer
    from edgecache.clients.ops import node_stub
    from edgecache.clients.topology import load_topology
    from edgecache.v1 import edge_pb2

    try:
        topology = load_topology(config)
        parsed = parse_spec(spec)
        if parsed.version is None:
            raise ValueError(f"evict needs an explicit version: {parsed.dataset}@N")
        if region is not None and region not in topology.regions:
            raise ValueError(
                f"unknown region {region!r}; the topology has {sorted(topology.regions)}"
            )
        metadata = bearer(_token(token_file))
    except (EdgeCacheError, ValueError) as exc:
        raise _fail(exc) from exc
    failed = False
    for name, cfg in topology.regions.items():
        if region and name != region:
            continue
        for node in cfg.nodes:
            channel, stub = node_stub(node)
            try:
                freed = stub.Evict(
                    edge_pb2.EvictRequest(dataset=parsed.dataset, version=parsed.version),
                    timeout=30,
                    metadata=metadata,
                )
                console.print(f"{name} {node}: freed {freed.bytes_freed / 1e9:,.2f} GB")
            except grpc.RpcError as exc:
                failed = True
                err_console.print(f"[red]{name} {node}: {exc.code().name}: {exc.details()}[/red]")
            finally:
                channel.close()
    if failed:
        raise typer.Exit(1)


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
    import time

    from edgecache.cache.registry import Registry
    from edgecache.clients.ops import gather_status
    from edgecache.clients.ops import ready as check
    from edgecache.clients.topology import load_topology

    try:
        topology = load_topology(config)
        token = _token(token_file)
        manifest = Registry.run(topology.registry, lambda reg: reg.resolve(spec))
    except (EdgeCacheError, ValueError) as exc:
        raise _fail(exc) from exc
    deadline = time.monotonic() + timeout
    while True:
        ok, message = check(gather_status(topology, token=token), region, manifest)
        if ok or not wait or time.monotonic() > deadline:
            (console if ok else err_console).print(message)
            raise typer.Exit(0 if ok else 1)
        time.sleep(2)


@app.command()
def doctor(
    config: ConfigOption = None,
    region: Annotated[str | None, typer.Option(help="The region this host is in.")] = None,
    pings: Annotated[int, typer.Option(min=2, max=200, help="Health pings per node.")] = 20,
    seconds: Annotated[float, typer.Option(help="Throughput test per node, seconds.")] = 2.0,
    token_file: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check the network path to every node and this host's TCP settings."""
    from edgecache.clients.doctor import check_host, check_paths
    from edgecache.clients.topology import load_topology

    try:
        topology = load_topology(config)
        token = _token(token_file)
    except (EdgeCacheError, ValueError) as exc:
        raise _fail(exc) from exc
    paths = check_paths(
        topology, home_region=region, pings=pings, throughput_seconds=seconds, token=token
    )
    host = check_host(paths, topology)
    bad = any(p.problems for p in paths) or bool(host.problems)
    if as_json:
        print(
            json.dumps(
                {"paths": [p.as_dict() for p in paths], "host": host.as_dict(), "ok": not bad}
            )
        )
        raise typer.Exit(1 if bad else 0)
    table = Table(title="network paths from this host")
    for column in ("region", "node", "RTT", "jitter", "loss", "read", "verdict"):
        table.add_column(column)
    for p in paths:
        table.add_row(
            p.region,
            p.node,
            "—" if p.rtt_ms is None else f"{p.rtt_ms:.2f} ms",
            "—" if p.jitter_ms is None else f"{p.jitter_ms:.2f} ms",
            f"{p.loss:.1%}",
            "—" if p.throughput_mb_s is None else f"{p.throughput_mb_s:,.0f} MB/s",
            "[red]" + "; ".join(p.problems) + "[/red]" if p.problems else "[green]ok[/green]",
        )
    console.print(table)
    console.print(
        f"host: congestion control {host.congestion_control}, rmem_max {host.rmem_max}, "
        f"wmem_max {host.wmem_max}, bandwidth-delay product of the slowest path "
        f"{host.bdp_bytes:,} B"
    )
    for problem in host.problems:
        console.print(f"[red]✗[/red] {problem}")
    if host.fixes:
        console.print("to fix (as root; persist them in /etc/sysctl.d/):")
        for line in host.fixes:
            console.print(f"  {line}", soft_wrap=True)
    if bad:
        raise typer.Exit(1)


@app.command()
def healthcheck(
    address: Annotated[str, typer.Argument(help="HOST:PORT of a node (its probe port).")] = (
        "127.0.0.1:7071"
    ),
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3.0,
) -> None:
    """Exit 0 when the node answers the standard gRPC health check with SERVING (for Docker)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
    except grpc.RpcError as exc:
        err_console.print(f"{address}: {exc.code().name}: {exc.details()}", soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        channel.close()
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    console.print(f"{address}: {name}")
    raise typer.Exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
