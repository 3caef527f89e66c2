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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.wan import report
from bench.wan.link import Link, LinkSpec, open_link
from bench.wan.origin import s3_env, write_tokens
from bench.wan.workload import Settings

REPO = Path(__file__).resolve().parents[2]
BUCKET = "wan-origin"
MOTO_PORT = 5000
PROBE_PORT = 9100


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One benchmark run: the processes it started, so they can all be ended."""

    def __init__(self, link: Link, workdir: Path, console: Console) -> None:
        self.link, self.workdir, self.console = link, workdir, console
        self.procs: list[subprocess.Popen[Any]] = []
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.origin_local = ""  # moto's URL on the origin side (uploads never cross the link)

    def spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process that :meth:`close` will end."""
        proc = subprocess.Popen(argv, cwd=REPO, env=kwargs.pop("env", self.env), **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """SIGTERM every process started, then SIGKILL what is left after 10 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def start_origin(self) -> str:
        """moto's S3 server on the origin side; its URL as the edge side reaches it."""
        port = MOTO_PORT if self.link.kind == "netns" else _free_port()
        log = self.workdir / "moto.log"
        exe = str(Path(sys.executable).with_name("moto_server"))
        with open(log, "w") as out:
            proc = self.spawn(
                # At nice 10: the origin stands in for another machine, so on this small
                # host it must not take CPU from the edge side's node and training job.
                self.link.origin_command(
                    ["nice", "-n", "10", exe, "-H", self.link.origin_host, "-p", str(port)]
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while "Running on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start: {log.read_text()[-1000:]}")
            time.sleep(0.1)
        self.origin_local = f"http://{self.link.origin_host}:{port}"
        host, edge_port = self.link.expose(port)
        return f"http://{host}:{edge_port}"

    def probe(self, streams: list[int], seconds: float, warmup: float) -> dict[str, Any]:
        """RTT and bulk rates across the link, and the link's drop counters meanwhile."""
        port = PROBE_PORT if self.link.kind == "netns" else _free_port()
        server = self.spawn(
            self.link.origin_command(
                [sys.executable, "-m", "bench.wan.probe", "serve", self.link.origin_host, str(port)]
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the probe server did not start")
        host, edge_port = self.link.expose(port)
        before = self.link.counters()
        out = subprocess.run(
            self.link.edge_command(
                [sys.executable, "-m", "bench.wan.probe", "measure", host, str(edge_port)]
                + ["--streams", ",".join(map(str, streams)), "--seconds", f"{seconds:g}"]
                + ["--warmup", f"{warmup:g}"]
            ),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = self.link.counters()
        server.terminate()
        server.wait(timeout=10)
        figures = json.loads(out.stdout)
        figures["counters"] = {k: after[k] - before.get(k, 0) for k in after}
        return figures

    def prepare(self, origin: str, raw_mib: int, shard_mib: int) -> dict[str, Any]:
        """Parquet shards on disk, uploaded and published on the origin side."""
        source = self.workdir / "source"
        sizes = write_tokens(source, raw_mib, shard_mib)
        out = subprocess.run(
            self.link.origin_command(
                [
                    sys.executable,
                    "-m",
                    "bench.wan.origin",
                    "prepare",
                    "--endpoint",
                    self.origin_local,
                ]
                + ["--bucket", BUCKET, "--source", str(source), "--datasets", "tokens,tokens-next"]
            ),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise RuntimeError(f"preparing the origin failed: {out.stderr[-2000:]}")
        return {**sizes, "source": str(source), "published": json.loads(out.stdout)}

    def workload(self, settings: Settings) -> dict[str, Any]:
        """The edge side's measurements, run across the link."""
        spec = self.workdir / "settings.json"
        spec.write_text(json.dumps(settings.__dict__))
        results = self.workdir / "results.json"
        proc = self.spawn(
            self.link.edge_command(
                [sys.executable, "-m", "bench.wan.workload", str(spec), str(results)]
            )
        )
        if proc.wait():
            raise RuntimeError(f"the workload failed (exit {proc.returncode}); see the log above")
        return json.loads(results.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results that ``--json`` writes."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--raw-mib", type=int, default=1024, help="raw token MiB (default 1024)")
    parser.add_argument("--shard-mib", type=int, default=32, help="raw MiB per Parquet shard")
    parser.add_argument(
        "--repeat", type=int, default=4, help="epochs per warm measure (median kept) and per job"
    )
    parser.add_argument("--link", choices=("auto", "netns", "proxy"), default="auto")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--loss", type=float, default=0.001, help="per direction, e.g. 0.001")
    parser.add_argument("--probe-seconds", type=float, default=5.0)
    parser.add_argument("--probe-warmup", type=float, default=2.0, help="slow start, not counted")
    parser.add_argument("--probe-streams", default="1,32")
    parser.add_argument(
        "--staging-concurrency", type=int, default=16, help="the node's staging_concurrency"
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
    if args.smoke:
        args.raw_mib, args.shard_mib, args.repeat, args.rtt_ms = 8, 2, 1, 20.0
        args.probe_seconds, args.probe_warmup, args.probe_streams = 0.5, 0.3, "1,4"
        args.settle_seconds = 0.5

    console = Console(width=150)
    spec = LinkSpec(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit, loss=args.loss)
    started = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - started - sum(phases.values()), 1)

    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-wan-"))
    link: Link | None = None
    run: Run | None = None
    try:
        link, why = open_link(spec, args.link)
        console.log(f"link: {why}; {spec}")
        run = Run(link, workdir, console)
        origin = run.start_origin()
        console.log(f"origin: moto's S3 server, reached from the edge at {origin}")
        phase("link and origin set up")
        console.log("measuring the link itself")
        streams = [int(s) for s in args.probe_streams.split(",")]
        probe = run.probe(streams, args.probe_seconds, args.probe_warmup)
        report.print_link(console, link.describe(), probe)
        phase("link measured")
        console.log(f"writing {args.raw_mib} MiB of token Parquet and publishing it at origin")
        data = run.prepare(origin, args.raw_mib, args.shard_mib)
        phase("data written, uploaded, published")
        settings = Settings(
            workdir=str(workdir),
            source=data["source"],
            endpoint=origin,
            bucket=BUCKET,
            dataset="tokens",
            next_dataset="tokens-next",
            parquet_bytes=data["parquet_bytes"],
            shards=data["shards"],
            node_env={
                **s3_env(origin),
                "EDGECACHE_STAGING_CONCURRENCY": str(args.staging_concurrency),
            },
            repeat=args.repeat,
            settle_seconds=args.settle_seconds,
            parts=tuple(sorted({1, *(int(p) for p in args.parts.split(","))})),
        )
        measured = run.workload(settings)
        phase("workload (parts " + ",".join(map(str, settings.parts)) + ")")
        results = report.assemble(
            link=link.describe(),
            why=why,
            probe=probe,
            data=data,
            node_settings={"staging_concurrency": args.staging_concurrency},
            measured=measured,
            wall_s=time.monotonic() - started,
            machine={"kernel": platform.release(), "cpus": os.cpu_count()},
        )
    finally:
        if run is not None:
            run.close()
        if link is not None:
            link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    phase("teardown")
    results["wall_s"] = round(time.monotonic() - started, 1)
    results["phases_s"] = phases
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
