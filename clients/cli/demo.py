"""``edgecache demo``: the local multi-region demo, from origin to a training loop."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from edgecache.clients.cli.app import app
from edgecache.clients.cli.publishing import Compression

if TYPE_CHECKING:
    from edgecache.clients.demo import DemoResult
from edgecache.clients.cli.context import ExitCode, exit_with, reporting
from edgecache.clients.cli.render import Column, error, format_bytes, line, progress, table


@app.command()
def demo(
    size_mib: Annotated[
        int, typer.Option("--size-mib", min=1, help="Dataset size to generate.")
    ] = 256,
    shards: Annotated[int, typer.Option(min=1, help="Number of shards.")] = 8,
    compression: Annotated[
        Compression, typer.Option(help="Chunk codec, as `publish --compression`.")
    ] = Compression.BYTE_SPLIT_ZSTD,
    threads: Annotated[int, typer.Option(min=1, help="EdgeDataset read-ahead threads.")] = 2,
    workdir: Annotated[
        Path | None, typer.Option(help="Directory to keep (default: a temporary one).")
    ] = None,
    keep_nodes: Annotated[
        bool,
        typer.Option(
            "--keep-nodes",
            help="Keep the two nodes running after the demo, with the commands to try on "
            "them, until Ctrl-C.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Run the local multi-region demo: origin, registry, two edge nodes, a training job.

    Tells the story as it goes (what is written where, the plan, what staging
    achieved, the first chunk from a warm and a cold region, a training epoch),
    then the figures. Exit codes: 0 every sample read exactly once and every
    chunk verified; 1 otherwise or a node failed; 130 Ctrl-C while it runs, 143
    SIGTERM, 129 SIGHUP (its nodes stopped and its temporary files removed
    first). With --keep-nodes, Ctrl-C once the nodes are left up is how they
    are stopped: the exit is then the demo's own (0, or 1).
    """
    from edgecache.clients.demo import run_demo

    root = workdir or Path(tempfile.mkdtemp(prefix="edgecache-demo-"))
    kept = workdir is not None  # a temporary directory goes with the nodes it served

    def say(text: str) -> None:
        if not as_json:
            line(text)

    printed: list[bool] = []  # with --json --keep-nodes, the figures went out while it ran

    def hold(result: DemoResult, where: Path) -> None:
        """Keep the nodes up until Ctrl-C, after saying where they are and what to try.

        With --json the figures (the nodes' addresses among them) are the one
        document on stdout, printed now, while the nodes run; the rest is on stderr.
        """
        if not keep_nodes:
            return
        if as_json:
            print(json.dumps(result.as_dict(), indent=2), flush=True)
            printed.append(True)
        else:
            _summary(result)
        config = where / "edgecache.yaml"
        removed = "" if kept else " (removed when the nodes stop; --workdir keeps them)"
        tell = functools.partial(line, to_stderr=as_json)
        tell(f"\nThe nodes keep running; the demo's files are in {where}{removed}. Try:")
        for command in (
            f"edgecache status --config {config}",
            f"edgecache plan {where / 'schedule.yaml'} --config {config} --explain",
            f"edgecache warm {result.dataset} --region us-east --config {config}",
            f"edgecache ready {result.dataset} --region us-east --config {config}",
            f"edgecache doctor --config {config} --region eu-west",
            f"edgecache versions demo-tokens --config {config}",
        ):
            tell(f"  {command}")
        tell("Ctrl-C stops the nodes.")
        try:
            _wait_for_ctrl_c()
        except KeyboardInterrupt:
            tell("stopping the nodes")

    try:
        with reporting(), _stopped_by_signals():
            result = run_demo(
                root,
                total_mib=size_mib,
                shards=shards,
                compression=compression.value,
                threads=threads,
                progress=progress(disable=as_json, label_width=36, speed=False),
                say=say,
                while_running=hold,
            )
    except typer.Exit:  # reporting() said it already, with its exit code (a RuntimeError too)
        raise
    except RuntimeError as exc:  # torch missing, a node that did not start
        error(str(exc))
        raise exit_with(ExitCode.FAILED) from exc
    except KeyboardInterrupt:  # the nodes are stopped by now; SIGTERM's line says as much
        gone = "its files stay in " + str(root) if kept else "removing its temporary files"
        error(f"stopped by Ctrl-C: the demo's nodes are stopped; {gone}")
        raise
    finally:
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        if not printed:  # with --keep-nodes it went out while the nodes ran
            figures = result.as_dict()
            if not kept:  # removed above: a path to nothing would send a script looking for it
                figures["workdir"] = None
            print(json.dumps(figures, indent=2))
    elif not keep_nodes:
        _summary(result)
        if kept:
            line(f"the demo's files (origin, registry, caches, node logs) are in {root}")
        line(
            "to try the commands on the running nodes: edgecache demo --keep-nodes "
            "(see docs/operations.md)"
        )
    if not result.verified:
        raise exit_with(ExitCode.FAILED)


def _wait_for_ctrl_c() -> None:
    """Block until SIGINT (Ctrl-C) raises KeyboardInterrupt, whatever the parent set.

    The prompt says Ctrl-C stops the nodes, so SIGINT is made to: a process started
    in the background by a shell or a supervisor inherits SIGINT ignored, and
    Python then never raises KeyboardInterrupt (`kill -INT` did nothing). Short
    sleeps, not ``signal.pause()``: a signal that lands between the last check and
    the ``pause`` syscall was lost and the demo waited forever.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM or SIGHUP (`kill`, `timeout`, a closed terminal) end the demo like Ctrl-C does.

    Python's default for them kills the process at once, skipping every
    ``finally``: the two ``edgecache serve`` nodes ran on, orphaned, and the
    temporary directory stayed. Raising ``SystemExit(128 + signal)`` instead
    stops the nodes and removes the files on the way out; further signals
    are ignored meanwhile, so that cleanup (at most a node's drain) finishes.
    """
    stops = (signal.SIGTERM, signal.SIGHUP)

    def stop(signum: int, _frame: object) -> None:
        for each in stops:
            signal.signal(each, signal.SIG_IGN)
        name = signal.Signals(signum).name
        error(f"stopped by {name}: stopping the demo's nodes and removing its temporary files")
        raise SystemExit(128 + signum)

    before = {each: signal.signal(each, stop) for each in stops}
    try:
        yield
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)


def _summary(result: DemoResult) -> None:
    table(
        f"edgecache demo: {result.dataset}, two regions on this machine",
        [Column("figure", wrap=True), Column("value", right=True)],
        [
            ["shards / samples", f"{result.shards} / {result.samples:,}"],
            [
                "origin Parquet / cached in eu-west",
                f"{format_bytes(result.source_bytes)} / {format_bytes(result.stored_bytes)}",
            ],
            [
                "stage eu-west from origin (fetch, preprocess, compress, commit)",
                f"{format_bytes(result.stage_bytes_per_s)}/s",
            ],
            [
                "stage us-east from eu-west (copy verified chunks)"
                + (f": {result.peer_copy_why}" if result.peer_copy_why else ""),
                "—"
                if result.peer_copy_bytes_per_s is None
                else f"{format_bytes(result.peer_copy_bytes_per_s)}/s",
            ],
            [
                f"training epoch via EdgeDataset ({result.device}, {result.read_threads} threads)",
                f"{result.read_samples_s:,.0f} samples/s, "
                f"{format_bytes(result.read_bytes_per_s)}/s",
            ],
            ["time to first batch", f"{result.first_batch_s * 1e3:,.0f} ms"],
            [
                "loss, first → last tenth of the epoch",
                f"{result.loss_first:.3f} → {result.loss_last:.3f}",
            ],
            [
                "first chunk: warm eu-west / us-east before staging (read-through)",
                f"{result.warm_first_chunk_s * 1e3:,.1f} ms / "
                f"{result.cold_first_chunk_s * 1e3:,.1f} ms",
            ],
            [
                "every sample once, every chunk verified",
                "yes" if result.verified else "[red]NO[/red]",
            ],
        ],
    )
    table(
        "edge nodes",
        [
            Column("region", ident=True),
            Column("node", ident=True),
            Column("shards", right=True),
            Column("used", right=True),
            Column("hits", right=True),
            Column("misses", right=True),
            Column("served", right=True),
        ],
        [
            [
                str(n["region"]),
                str(n["node"]),
                str(_shards_held(n)),
                format_bytes(int(n["used_bytes"])),  # type: ignore[call-overload]
                str(n["hits"]),
                str(n["misses"]),
                format_bytes(int(n["bytes_served"])),  # type: ignore[call-overload]
            ]
            for n in result.nodes
        ],
    )


def _shards_held(node: dict[str, object]) -> int:
    """The shards a node of the figures holds, of every version (``status`` lists each)."""
    return sum(v["shards"] for v in cast(list[dict[str, int]], node["versions"]))
