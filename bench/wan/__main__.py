"""Run the WAN benchmark: build the link, measure it, run the workload, tear everything down.

    python -m bench.wan [--raw-mib 1024] [--repeat 4] [--json PATH] [--link auto|netns|proxy]
    python -m bench.wan --smoke          # toy sizes, a 20 ms link: checks that it all works

Needs root for the namespace link (it falls back to a loopback proxy
otherwise, and says so). Prints the link's own figures first, then a table of
ratios against the targets; ``--json`` writes everything, timelines
included, for tables and charts.

The default is 1 GiB of raw tokens: 374 MB of zstd Parquet at
origin, about 33 s per pass over a 100 Mbit/s link. A run moves it across
twice (staging; the cold epoch, which reads through at about half the link
rate) and part of it a third time (the version staged beside the training
job, cancelled when the job ends); with data generation (~15 s), the link
check (~16 s) and the warm epochs it takes 3 to 3.7 minutes here, inside
the 5-minute budget. ``--raw-mib`` scales it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.arguments import positive_int
from bench.wan import report
from bench.wan.link import LinkSpec
from bench.wan.origin import write_tokens
from bench.wan.session import Run, s3_node_env, session
from bench.wan.workload import Settings

BUCKET = "wan-origin"


def _prepare(run: Run, raw_mib: int, shard_mib: int) -> dict[str, Any]:
    """Parquet shards on disk, uploaded and published on the origin side."""
    source = run.workdir / "source"
    sizes = write_tokens(source, raw_mib, shard_mib)
    published = run.origin_step(
        "bench.wan.origin",
        ["prepare", "--endpoint", run.origin_local, "--bucket", BUCKET]
        + ["--source", str(source), "--datasets", "tokens,tokens-next"],
    )
    return {**sizes, "source": str(source), "published": published}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results that ``--json`` writes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--raw-mib", type=positive_int, default=1024, help="raw token MiB (default 1024)"
    )
    parser.add_argument(
        "--shard-mib", type=positive_int, default=32, help="raw MiB per Parquet shard"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=4,
        help="epochs per warm measure (median kept) and per job",
    )
    parser.add_argument("--link", choices=("auto", "netns", "proxy"), default="auto")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--loss", type=float, default=0.001, help="per direction, e.g. 0.001")
    parser.add_argument("--probe-seconds", type=float, default=5.0)
    parser.add_argument("--probe-warmup", type=float, default=2.0, help="slow start, not counted")
    parser.add_argument("--probe-streams", default="1,32")
    parser.add_argument(
        "--staging-concurrency",
        type=positive_int,
        default=16,
        help="the node's staging_concurrency",
    )
    parser.add_argument("--settle-seconds", type=float, default=4.0)
    parser.add_argument(
        "--parts", default="1,2,3", help="which measurements (2 and 3 include 1's staging)"
    )
    parser.add_argument("--json", type=Path, help="write every figure and timeline here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes and a short link, to check it all still works (no figure means much)",
    )
    args = parser.parse_args(argv)
    if not set(args.parts.split(",")) <= {"1", "2", "3"}:
        parser.error(f"--parts {args.parts!r}: choose among 1, 2 and 3, e.g. 1,2,3")
    if args.smoke:
        # Four 1 MiB shards; staging the next version still outlasts the contended epoch.
        args.raw_mib, args.shard_mib, args.repeat, args.rtt_ms = 4, 1, 1, 20.0
        args.probe_seconds, args.probe_warmup, args.probe_streams = 0.3, 0.1, "1,4"
        args.settle_seconds = 0.2
    try:  # before the link and origin are set up, not after
        streams = [int(n) for n in args.probe_streams.split(",")]
    except ValueError:
        parser.error(f"--probe-streams {args.probe_streams!r}: give stream counts, e.g. 1,32")
    if min(streams) < 1:
        parser.error(f"--probe-streams {args.probe_streams!r}: each count is at least 1")

    console = Console(width=150)
    spec = LinkSpec(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit, loss=args.loss)
    with session("edgecache-bench-wan-", spec, args.link, console, keep=args.keep) as s:
        origin = s.run.start_origin()
        console.log(f"origin: moto's S3 server, reached from the edge at {origin}")
        s.phase("link and origin set up")
        console.log("measuring the link itself")
        probe = s.run.probe(streams, args.probe_seconds, args.probe_warmup)
        report.print_link(console, s.link.describe(), probe)
        s.phase("link measured")
        console.log(f"writing {args.raw_mib} MiB of token Parquet and publishing it at origin")
        data = _prepare(s.run, args.raw_mib, args.shard_mib)
        s.phase("data written, uploaded, published")
        settings = Settings(
            workdir=str(s.workdir),
            source=data["source"],
            endpoint=origin,
            bucket=BUCKET,
            dataset="tokens",
            next_dataset="tokens-next",
            parquet_bytes=data["parquet_bytes"],
            shards=data["shards"],
            node_env=s3_node_env(origin, args.staging_concurrency),
            repeat=args.repeat,
            settle_seconds=args.settle_seconds,
            parts=tuple(sorted({1, *(int(p) for p in args.parts.split(","))})),
        )
        measured = s.run.edge_step("bench.wan.workload", settings)
        s.phase("workload (parts " + ",".join(map(str, settings.parts)) + ")")
        results = report.assemble(
            link=s.link.describe(),
            why=s.why,
            probe=probe,
            data=data,
            node_settings={"staging_concurrency": args.staging_concurrency},
            measured=measured,
            wall_s=s.elapsed(),
            machine={"kernel": platform.release(), "cpus": os.cpu_count()},
        )
    results["wall_s"] = s.elapsed()
    results["phases_s"] = s.phases
    report.print_results(console, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        console.log(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; the link and every process it started are gone", file=sys.stderr)
        sys.exit(130)
