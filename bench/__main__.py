"""Every benchmark in one run: ``make bench`` = ``python -m bench``.

    python -m bench [--scale 1.0] [--only store,edge,...] [--out build/bench] [--no-docs]

Each suite runs as its own process (a fresh interpreter, its own node and
S3 subprocesses, nothing shared between suites but the machine), writes its
results as JSON under ``--out``, and prints its progress as it goes. At the
end a summary table of every ratio this run measured against its target is
printed and ``docs/benchmarks.md`` is rewritten from the results, with PNG
charts in ``docs/img/`` (see ``bench/render.py``): the sections and summary
rows of the suites this run measured; the others (``--only`` leaves them out,
or one failed) keep theirs as the page had them (a section says when it was
measured).

``--scale`` multiplies every data size (0.25 for a quick look; the figures
in the docs come from 1.0). At 1.0 the peers and the WAN get their
1 GiB datasets; the older suites run at half their standalone defaults, and
the whole run takes about 25-30 minutes on a 2-core machine (peers ~11,
schedule ~8, wan ~4). Suites whose results already exist under ``--out`` can
be re-rendered without running: ``--render-only``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bench import render
from bench.arguments import positive_float

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Suite:
    """One benchmark module and how to size it."""

    name: str
    module: str
    args: Callable[[float], list[str]]
    json_to_file: bool = False  # `--json PATH` rather than JSON on stdout


def _mib(value: float, scale: float, least: int = 8) -> str:
    return str(max(int(value * scale), least))


SUITES = [
    Suite(
        "store",
        "bench.codec_store",
        lambda s: ["--mib", _mib(128, s), "--repeat", "3"],
    ),
    Suite(
        "edge",
        "bench.edge_node",
        lambda s: ["--read-mib", _mib(256, s), "--stage-mib", _mib(128, s), "--repeat", "2"],
    ),
    Suite(
        "dataset",
        "bench.dataset",
        lambda s: ["--tokens-mib", _mib(512, s), "--images-mib", _mib(256, s), "--repeat", "2"],
    ),
    Suite("planner", "bench.planner", lambda s: ["--repeat", "3"]),
    Suite(
        "peers",
        "bench.peers",
        lambda s: ["--tokens-mib", _mib(1024, s), "--images-mib", _mib(1024, s)],
        json_to_file=True,
    ),
    Suite("wan", "bench.wan", lambda s: ["--raw-mib", _mib(1024, s)], json_to_file=True),
    Suite(
        "training",
        "bench.training",
        lambda s: ["--mib", _mib(256, s, 32), "--code-mib", _mib(64, s), "--repeat", "5"],
    ),
    Suite(
        "schedule",
        "bench.schedule",
        lambda s: ["--version-mib", _mib(48, s, 8), "--shard-mib", _mib(8, s, 2)],
        json_to_file=True,
    ),
    Suite("staging", "bench.staging", lambda s: ["--mib", _mib(256, s, 64), "--repeat", "2"]),
    Suite(
        "images",
        "bench.images",
        lambda s: ["--images", str(max(int(2000 * s), 200)), "--repeat", "2"],
    ),
    Suite("text", "bench.text", lambda s: ["--mib", _mib(16, s, 4), "--repeat", "3"]),
    # Skips (and says so on the page) without CUDA; on a GPU host it adds the H2D table.
    Suite(
        "gpu",
        "bench.gpu",
        lambda s: ["--tokens-mib", _mib(512, s), "--images-mib", _mib(512, s)],
        json_to_file=True,
    ),
]


def run_suite(suite: Suite, scale: float, out: Path, console: Console) -> dict | None:
    """Run one suite; its JSON, or None (with the reason printed) if it failed."""
    target = out / f"{suite.name}.json"
    command = [sys.executable, "-m", suite.module, *suite.args(scale)]
    command += ["--json", str(target)] if suite.json_to_file else ["--json"]
    console.rule(f"[bold]{suite.name}[/bold]: {' '.join(command[2:])}")
    started = time.monotonic()
    proc = subprocess.run(
        command,
        cwd=ROOT,
        stdout=None if suite.json_to_file else subprocess.PIPE,  # their tables go to the terminal
        text=True,
        check=False,
    )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        console.print(f"[red]{suite.name} failed (exit {proc.returncode}) after {seconds:.0f} s")
        return None
    if not suite.json_to_file:
        target.write_text(proc.stdout)
    data = json.loads(target.read_text())
    data["_wall_seconds"] = round(seconds, 1)
    data["_scale"] = scale
    # Sections of docs/benchmarks.md come from runs of different days (one suite can be
    # run again alone): each says when its figures were measured.
    data["_date"] = time.strftime("%Y-%m-%d")
    target.write_text(json.dumps(data, indent=2))
    console.print(f"{suite.name}: done in {seconds:.0f} s")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scale", type=positive_float, default=1.0, help="multiply every data size"
    )
    parser.add_argument(
        "--only", default="", help=f"comma-separated suites of {[s.name for s in SUITES]}"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs")
    parser.add_argument(
        "--render-only", action="store_true", help="re-render the docs from --out, run nothing"
    )
    args = parser.parse_args()
    console = Console(width=150)
    wanted = {s for s in args.only.split(",") if s}
    unknown = wanted - {s.name for s in SUITES}
    if unknown:
        parser.error(f"unknown suite(s) {sorted(unknown)}; choose from {[s.name for s in SUITES]}")
    if not args.no_docs and not args.docs.parent.is_dir():
        # Said before the suites run, not in a traceback once they all have.
        parser.error(f"--docs {args.docs}: its folder {args.docs.parent} does not exist")
    if args.render_only and not any((args.out / f"{s.name}.json").exists() for s in SUITES):
        parser.error(f"--render-only: no results under {args.out} (run the suites first)")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    failed = []
    ran = []
    if not args.render_only:
        for suite in SUITES:
            if wanted and suite.name not in wanted:
                continue
            if run_suite(suite, args.scale, args.out, console) is None:
                failed.append(suite.name)
            else:
                ran.append(suite.name)
    # This run's results (every one under --out when only rendering): a suite that failed,
    # or was not asked for, is not shown as measured now from an earlier run's file; the
    # page keeps its section as it was (render.write_docs).
    results = {
        s.name: json.loads((args.out / f"{s.name}.json").read_text())
        for s in SUITES
        if (args.out / f"{s.name}.json").exists() and (args.render_only or s.name in ran)
    }
    console.rule("[bold]summary")
    console.print(render.summary_table(results))
    if not args.no_docs:
        render.write_docs(results, args.docs)
        console.print(f"wrote {args.docs} and its charts")
    console.print(f"all suites: {time.monotonic() - started:.0f} s")
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
