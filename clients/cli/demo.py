"""``edgecache demo``: the local multi-region demo, from origin to a training loop."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from edgecache.clients.cli.app import app
from edgecache.clients.cli.context import ExitCode, exit_with, reporting
from edgecache.clients.cli.render import console, error, format_bytes


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
        with reporting():
            result = run_demo(
                root, total_mib=size_mib, shards=shards, compression=compression, threads=threads
            )
    except RuntimeError as exc:  # torch missing, a node that did not start
        error(str(exc))
        raise exit_with(ExitCode.FAILED) from exc
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
        f"{format_bytes(result.source_bytes)} / {format_bytes(result.stored_bytes)}",
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
            format_bytes(int(n["used_bytes"])),  # type: ignore[call-overload]
            str(n["hits"]),
            str(n["misses"]),
            format_bytes(int(n["bytes_served"])),  # type: ignore[call-overload]
        )
    console.print(nodes)
    if not result.verified:
        raise exit_with(ExitCode.FAILED)
