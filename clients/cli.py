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
    threads: Annotated[int, typer.Option(min=1, help="Decode threads for the read-back.")] = 2,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache directory to keep (default: a temporary one).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Run the local end-to-end demo on generated token data and print its figures."""
    from edgecache.clients.demo import run_demo

    if compression not in ("zstd", "none"):
        raise typer.BadParameter("use 'zstd' or 'none'", param_hint="--compression")
    workdir = cache_dir or Path(tempfile.mkdtemp(prefix="edgecache-demo-"))
    try:
        result = run_demo(
            workdir, total_mib=size_mib, shards=shards, compression=compression, threads=threads
        )
    except EdgeCacheError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        if cache_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
        return
    table = Table(title=f"edgecache demo: {result.dataset} through a local LMDB cache")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("shards / samples", f"{result.shards} / {result.samples:,}")
    table.add_row(
        "raw Arrow / stored",
        f"{result.raw_bytes / 1e6:,.0f} MB / {result.stored_bytes / 1e6:,.0f} MB",
    )
    table.add_row("compression ratio", f"{result.raw_bytes / result.stored_bytes:.2f}×")
    table.add_row("encode (1 thread)", f"{result.encode_mb_s:,.0f} MB/s")
    table.add_row(
        f"read back → {result.tensor_backend} ({result.read_threads} threads)",
        f"{result.read_samples_s:,.0f} samples/s, {result.read_mb_s:,.0f} MB/s",
    )
    table.add_row(
        "every sample back, checksums verified", "yes" if result.verified else "[red]NO[/red]"
    )
    console.print(table)
    if not result.verified:
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
