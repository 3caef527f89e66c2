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
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
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
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
