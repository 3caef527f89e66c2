"""The scenario benchmark: a day of jobs in three regions, with the controller and without.

    python -m bench.schedule [--speed 360] [--json PATH] [--render PNG] [--link auto|netns|proxy]
    python -m bench.schedule --smoke       # toy sizes, a short day: checks that it all works

Three regions on loopback, one ``edgecache serve`` node each. Origin is
moto's S3 server behind the slow link of :mod:`bench.wan` (network
namespaces, tbf, loss and NFQUEUE delay where this machine permits them, as
root; otherwise the delaying TCP proxy, and the results say which). The three
regions share that one origin link (they run in one edge namespace); between
regions the nodes talk over loopback directly, unshaped: the faster
inter-region link. The registry (manifests, the controller's lease and
record) is a directory on local disk; only data crosses the link.

The same simulated day (:mod:`bench.schedule_parts.scenario`: ~20 jobs over
24 h, six versions of four datasets, every version read in at least two
regions, capacities that force evictions) runs twice on fresh caches:

* **controller**: an in-process ``Controller`` on a ``SimulatedClock``
  running ``--speed`` times real time; it plans from live node status every
  tick, pins, evicts and stages from origin or a peer region at the planned
  times. Link speeds in the topology are simulated bytes/s (real ÷ speed),
  the real figures measured by a calibration step over the same link first;
* **naive**: a cron-like loop stages each job's versions from origin with
  ``clients.ops.stage_item`` ``--naive-lead-hours`` before the job; the
  nodes' LRU makes room; no pins, no planned evictions.

Transfers are real, over the real link; only the schedule's clock is
simulated. Reported side by side: jobs complete at their start, origin bytes,
cross-region staging time, evictions of versions an upcoming job needed,
and per task the predicted against the actual ready time. ``--json`` writes
everything, per-job planned and actual timelines included; ``--render`` draws
the timeline chart (also :func:`draw` for the docs renderer).
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

from bench.arguments import positive_float, positive_int
from bench.report import cpu_model, versions
from bench.schedule_parts import chart, report
from bench.schedule_parts.edge import Settings
from bench.schedule_parts.scenario import FULL, SMOKE, Scenario
from bench.wan.link import LinkSpec
from bench.wan.session import Run, s3_node_env, session

__all__ = ["draw", "main"]

BUCKET = "schedule-origin"


def draw(results: dict[str, Any], path: Path) -> Path:
    """The timeline chart (planned vs actual ready per job, starts marked) as a PNG."""
    return chart.draw(results, path)


def _prepare(run: Run, registry: str, args: argparse.Namespace, specs: list[str]) -> Any:
    """Write, upload and publish every version on the origin side (nothing crosses the link)."""
    return run.origin_step(
        "bench.schedule_parts.origin",
        ["--endpoint", run.origin_local, "--bucket", BUCKET, "--registry", registry]
        + ["--source", str(run.workdir / "source"), "--versions", ",".join(specs)]
        + ["--version-mib", str(args.version_mib), "--shard-mib", str(args.shard_mib)],
    )


def _replay(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Analyse, print and draw saved results again, measuring nothing."""
    results = json.loads(args.from_json.read_text())
    scenario = Scenario.from_dict(results["scenario"])
    results["figures"] = report.analyse(results, scenario, results["settings"]["speed"])
    report.print_results(console, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.render:
        draw(results, args.render)
        console.log(f"drew {args.render}")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results that ``--json`` writes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--speed", type=positive_float, default=360.0, help="simulated seconds per real second"
    )
    parser.add_argument("--interval", type=positive_float, default=0.2, help="real s between ticks")
    parser.add_argument(
        "--version-mib", type=positive_int, default=48, help="raw token MiB per version"
    )
    parser.add_argument(
        "--shard-mib", type=positive_int, default=8, help="raw MiB per Parquet shard"
    )
    parser.add_argument(
        "--capacity-versions", type=float, default=2.5, help="region capacity, in stored versions"
    )
    parser.add_argument("--naive-lead-hours", type=float, default=2.0)
    parser.add_argument("--staging-concurrency", type=positive_int, default=8)
    parser.add_argument("--touch-seconds", type=float, default=2.0)
    parser.add_argument("--link", choices=("auto", "netns", "proxy"), default="auto")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--loss", type=float, default=0.001)
    parser.add_argument("--modes", default="controller,naive")
    parser.add_argument("--json", type=Path, help="write every figure and timeline here")
    parser.add_argument("--render", type=Path, help="draw the timeline chart to this PNG")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: analyse, print and draw the results a previous --json wrote",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes and a short day (no figure means much)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modes.split(",")) - {"controller", "naive"})
    if unknown:  # any other name ran the naive day under it, and compared nothing
        parser.error(f"--modes: unknown {unknown}; choose from controller, naive")
    console = Console(width=160)
    if args.from_json:
        return _replay(args, console)
    scenario = FULL
    if args.smoke:
        scenario = SMOKE
        # Two 1 MiB shards per version at 8000x: the day takes 3 s of wall time, and the
        # controller still stages from origin and from a peer region and evicts.
        args.version_mib, args.shard_mib, args.rtt_ms = 2, 1, 20.0
        args.speed, args.interval, args.touch_seconds, args.loss = 8000.0, 0.1, 0.25, 0.0

    spec = LinkSpec(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit, loss=args.loss)
    with session("edgecache-bench-schedule-", spec, args.link, console, keep=args.keep) as s:
        origin = s.run.start_origin()
        registry = f"file://{s.workdir}/registry"
        console.log(f"origin: moto's S3 server, reached from the edge at {origin}")
        s.phase("link and origin set up")
        console.log(f"writing {len(scenario.versions)} versions × {args.version_mib} MiB raw")
        published = _prepare(s.run, registry, args, list(scenario.versions))
        s.phase("data written, uploaded, published")
        settings = Settings(
            workdir=str(s.workdir),
            registry=registry,
            node_env=s3_node_env(origin, args.staging_concurrency),
            scenario=scenario.as_dict(),
            speed=args.speed,
            interval=args.interval,
            naive_lead_hours=args.naive_lead_hours,
            capacity_versions=args.capacity_versions,
            touch_seconds=args.touch_seconds,
            modes=args.modes.split(","),
        )
        measured = s.run.edge_step("bench.schedule_parts.edge", settings)
        s.phase("calibration and both days")
        link_info = s.link.describe() | {"chosen_because": s.why, "counters": s.link.counters()}

    parquet = sum(p["parquet_bytes"] for p in published.values())
    stored = measured["calibration"]["max_stored_bytes"]
    first_day = next(iter(measured["days"].values()))
    results: dict[str, Any] = {
        "command": "python -m bench.schedule" + (" --smoke" if args.smoke else ""),
        "link": link_info,
        "inter_region": "loopback between the nodes, unshaped (one edge namespace)",
        "origin_shared": "the three regions share the one origin link",
        "registry": "local disk (file://): only data crosses the link",
        "scenario": scenario.as_dict(),
        "scenario_summary": (
            f"{len(scenario.jobs)} jobs in 3 regions over {scenario.day_hours:g} simulated h, "
            f"{len(scenario.versions)} versions"
        ),
        "published": published,
        "data_summary": (
            f"{len(published)} versions, {parquet / 1e6:,.1f} MB of zstd Parquet at origin in all "
            f"({parquet / len(published) / 1e6:.1f} MB each, "
            f"{next(iter(published.values()))['shards']} shards), about "
            f"{stored / 1e6:.1f} MB once stored"
        ),
        "settings": {
            k: getattr(args, k)
            for k in (
                "speed",
                "interval",
                "version_mib",
                "shard_mib",
                "capacity_versions",
                "naive_lead_hours",
                "staging_concurrency",
                "touch_seconds",
            )
        },
        "capacity_bytes": first_day["capacity_bytes"],
        "topology": first_day["topology"],
        "calibration": measured["calibration"],
        "days": measured["days"],
        "manifests": measured["manifests"],
        "versions": versions(
            "edgecache", "pyarrow", "grpcio", "zstandard", "lmdb", "aiobotocore", "moto"
        ),
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu": cpu_model()},
    }
    results["figures"] = report.analyse(measured, scenario, args.speed)
    results["wall_s"] = s.elapsed()
    results["phases_s"] = s.phases
    report.print_results(console, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        console.log(f"wrote {args.json}")
    if args.render:
        draw(results, args.render)
        console.log(f"drew {args.render}")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; the link and every process it started are gone", file=sys.stderr)
        sys.exit(130)
