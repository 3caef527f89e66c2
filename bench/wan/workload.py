"""The edge side of the WAN benchmark: nodes, `edgecache warm`, training epochs.

Runs on the edge side of the link (inside the edge namespace), where the
node subprocesses and the training job run; the origin (moto's S3 server
holding the Parquet shards and the registry) is across the link. Takes its
settings from a JSON file and writes its results to another; progress goes
to stderr.

1. **Staging into a region.** ``edgecache warm SCHEDULE --config TOPOLOGY``,
   the CLI an operator runs, stages the version a scheduled job will read into
   the region's node. Figure: origin bytes per second while staging, against
   the link's nominal rate and against a plain bulk transfer over the same
   link (what TCP can carry there).
2. **Epochs.** One ``EdgeDataset`` epoch through a torch ``DataLoader``
   (``num_workers=0``, batches of 256, shuffled) from: a cold node, which reads
   every shard through from origin across the link; the node ``warm`` filled;
   and a node whose origin and registry are on local disk (nothing crosses the
   link: the fully local read). Also, for context, the local ``lmdb://`` fast
   path on the pre-staged cache. Figures: time to first batch, epoch time.
3. **Staging beside training.** Epochs from the pre-staged node while nothing
   else happens, then while the node stages another version across the link
   (started a few seconds before, so staging runs at full speed when the
   epoch begins). Figure: the job's read throughput with / without.

Every timeline (bytes over the link, batches over time) is kept for charts.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import yaml
from rich.console import Console

from bench.wan.link import DEVICE
from bench.wan.origin import publish
from bench.wan.session import edge_side
from edgecache.clients.node_client import LocalNode, connect, start_local_node
from edgecache.v1 import edge_pb2

__all__ = ["Epoch", "Settings", "run"]

REGION = "wan"
BATCH = 256


@dataclass
class Settings:
    """What the orchestrator hands over (as JSON)."""

    workdir: str
    source: str  # the Parquet shards on local disk (for the fully local node)
    endpoint: str  # S3 endpoint as seen from the edge side, across the link
    bucket: str
    dataset: str  # the version staged and read: f"{dataset}@1"
    next_dataset: str  # staged while training reads (part 3)
    parquet_bytes: int
    shards: int
    node_env: dict[str, str]  # node settings, e.g. EDGECACHE_STAGING_CONCURRENCY
    repeat: int = 4
    settle_seconds: float = 4.0  # staging runs this long before a contended epoch starts
    parts: tuple[int, ...] = (1, 2, 3)  # 2 and 3 read what 1 staged


@dataclass
class Epoch:
    """One epoch: samples, seconds, time to first batch, and batches over time."""

    label: str
    samples: int
    batches: int
    seconds: float
    first_batch_s: float
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s since start, batches)
    started_at: float = 0.0  # seconds since the workload began

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


class Sampler:
    """Every ``interval``: bytes received over the link and a node's own counters.

    Link bytes come from the link device in this namespace (``/proc/net/dev``);
    without one (the proxy link) the node's origin byte counter stands in.
    """

    def __init__(self, origin: float, node: LocalNode | None, interval: float = 0.1) -> None:
        self.origin = origin
        self.node = node
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def link_rx_bytes() -> int | None:
        """Bytes received on the link device in this namespace (None: no such device)."""
        for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == DEVICE:
                return int(rest.split()[0])
        return None

    def sample(self) -> None:
        """Take one sample now."""
        try:
            counters = scrape(self.node.metrics_address) if self.node else {}
        except OSError:  # the node is gone (stopping): no sample
            return
        link = self.link_rx_bytes()
        self.samples.append(
            {
                "t": round(time.monotonic() - self.origin, 3),
                "link": link if link is not None else counters.get("origin_bytes", 0),
                **counters,
            }
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def series(self, key: str, since: float = 0.0) -> list[tuple[float, float]]:
        """``(seconds after since, value - first value)`` for one sampled quantity."""
        first = self.samples[0][key]
        return [(round(x["t"] - since, 3), x[key] - first) for x in self.samples]

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


_METRICS = {
    "origin_bytes": re.compile(r"^edgecache_origin_bytes_total\{[^}]*\} (\S+)$", re.M),
    "staging_active": re.compile(r"^edgecache_staging_active\{[^}]*\} (\S+)$", re.M),
    "staged_shards": re.compile(
        r'^edgecache_staged_shards_total\{[^}]*result="staged"[^}]*\} (\S+)$', re.M
    ),
}


def scrape(address: str) -> dict[str, float]:
    """The node counters the benchmark follows, from its Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for key, pattern in _METRICS.items():
        match = pattern.search(text)
        out[key] = float(match.group(1)) if match else 0.0
    return out


class Workload:
    """Runs the three measurements; owns, and stops, every node it starts."""

    def __init__(self, settings: Settings, console: Console) -> None:
        self.s = settings
        self.console = console
        self.work = Path(settings.workdir)
        self.t0 = time.monotonic()
        self.nodes: list[LocalNode] = []

    def now(self) -> float:
        """Seconds since the workload began (every timeline's clock)."""
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        self.console.log(f"[{self.now():6.1f} s] {text}")

    def node(self, name: str, registry: str, env: dict[str, str]) -> LocalNode:
        """An ``edgecache serve`` subprocess with metrics, its cache in the work directory."""
        node = start_local_node(
            REGION,
            self.work / f"cache-{name}",
            registry,
            capacity="16GiB",
            log_file=self.work / f"node-{name}.log",
            extra_args=["--metrics-listen", "127.0.0.1:0", "--log-level", "WARNING"],
            env={**env, **self.s.node_env},
        )
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.stop(timeout=15)

    # ----------------------------------------------------------------- epochs

    def epoch(self, label: str, endpoint: str, spec: str) -> Epoch:
        """One shuffled EdgeDataset epoch through a DataLoader, timed from construction."""
        # Imported here: the orchestrator imports this module for Settings and needs no torch.
        from torch.utils.data import DataLoader

        from edgecache.clients.dataset import EdgeDataset

        gc.collect()
        begun = self.now()
        started = time.perf_counter()
        timeline: list[tuple[float, int]] = []
        samples = batches = 0
        first = 0.0
        with EdgeDataset(spec, endpoints=[endpoint], batch_size=BATCH, shuffle=True, seed=0) as ds:
            for batch in DataLoader(ds, batch_size=None, num_workers=0):
                elapsed = time.perf_counter() - started
                if not batches:
                    first = elapsed
                samples += len(batch["label"])
                batches += 1
                timeline.append((round(elapsed, 4), batches))
        seconds = time.perf_counter() - started
        run = Epoch(label, samples, batches, seconds, first, timeline, round(begun, 3))
        self.log(
            f"epoch {label}: {seconds:.2f} s, {run.samples_per_s:,.0f} samples/s, "
            f"first batch {first:.3f} s"
        )
        return run

    # ------------------------------------------------------------ 1. staging

    def warm(self, node: LocalNode) -> dict[str, Any]:
        """Stage ``dataset@1`` into the region with ``edgecache warm`` from a schedule."""
        topology = self.work / "edgecache.yaml"
        topology.write_text(
            yaml.safe_dump(
                {
                    "registry": f"s3://{self.s.bucket}/_edgecache",
                    "regions": {REGION: {"nodes": [node.address]}},
                }
            )
        )
        schedule = self.work / "schedule.yaml"
        start = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
        schedule.write_text(
            yaml.safe_dump(
                {
                    "jobs": [
                        {
                            "name": "train-wan",
                            "region": REGION,
                            "start": start.isoformat().replace("+00:00", "Z"),
                            "datasets": [f"{self.s.dataset}@1"],
                            "duration": "6h",
                        }
                    ]
                }
            )
        )
        argv = [sys.executable, "-m", "edgecache.clients.cli", "warm", str(schedule)]
        argv += ["--config", str(topology), "--json"]
        self.log(f"edgecache warm {schedule.name} --config {topology.name}")
        shards = self.s.shards
        with Sampler(self.t0, node) as sampler:
            begun = self.now()
            done = subprocess.run(argv, capture_output=True, text=True, env=self._env())
            ended = self.now()
        if done.returncode:
            raise RuntimeError(f"edgecache warm failed ({done.returncode}): {done.stderr[-2000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])["items"]
        if not all(item["done"] for item in report):
            raise RuntimeError(f"edgecache warm did not stage everything: {report}")
        # Staging runs from the node's Stage call (planning, before it, is the CLI's) to
        # its last shard committed; sampled every 0.1 s, both ends rounded outwards.
        points = sampler.samples
        start_at = max(
            (x["t"] for x in points if x["staging_active"] < 1 and x["staged_shards"] < shards),
            default=begun,
        )
        end_at = min((x["t"] for x in points if x["staged_shards"] >= shards), default=ended)
        result: dict[str, Any] = {
            "command": "edgecache warm schedule.yaml --config edgecache.yaml",
            "parquet_bytes": self.s.parquet_bytes,
            "link_bytes": int(points[-1]["link"] - points[0]["link"]),
            "wall_s": round(ended - begun, 3),
            "staging_s": round(end_at - start_at, 3),
            "planning_s": round(start_at - begun, 3),
            "bytes_per_s": round(self.s.parquet_bytes / (end_at - start_at)),
            "wall_bytes_per_s": round(self.s.parquet_bytes / (ended - begun)),
            "timeline": sampler.series("link", begun),  # link bytes received
            "shards_timeline": sampler.series("staged_shards", begun),
            "staging_window": (round(start_at - begun, 3), round(end_at - begun, 3)),
        }
        self.log(
            f"warm: {self.s.parquet_bytes / 1e6:,.1f} MB staged in {result['staging_s']} s "
            f"({result['wall_s']} s for the command): {result['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s"
        )
        return result

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.s.node_env}

    # ----------------------------------------------------------- 2. epochs

    def epochs(self, warm: LocalNode) -> dict[str, Any]:
        """Cold read-through, then pre-staged, fully local and lmdb:// epochs, interleaved."""
        spec = f"{self.s.dataset}@1"
        self.log("cold node: the epoch reads every shard through from origin, across the link")
        cold = self.node("cold", f"s3://{self.s.bucket}/_edgecache", {})
        with Sampler(self.t0, cold, interval=0.2) as sampler:
            cold_run = self.epoch("cold", cold.address, spec)
        cold_link = sampler.series("link", cold_run.started_at)
        cold.stop(timeout=15)

        self.log("local node: origin and registry on local disk, staged before reading")
        registry = f"file://{self.work}/local-registry"
        publish(registry, f"file://{self.s.source}/", self.s.dataset)
        local = self.node("local", registry, {})
        progress = list(
            connect(local.address).Stage(edge_pb2.StageRequest(dataset=self.s.dataset, version=1))
        )
        if not progress[-1].finished or progress[-1].failures:
            raise RuntimeError(f"staging the local node failed: {progress[-1]}")

        runs: dict[str, list[Epoch]] = {"prestaged": [], "local": [], "lmdb": []}
        endpoints = {
            "prestaged": warm.address,
            "local": local.address,
            "lmdb": f"lmdb://{self.work / 'cache-warm'}",
        }
        for _ in range(self.s.repeat):  # interleaved: drift hits all alike
            for key, endpoint in endpoints.items():
                runs[key].append(self.epoch(key, endpoint, spec))
        local.stop(timeout=15)
        return {
            "cold": asdict(cold_run) | {"link_timeline": cold_link},
            **{key: _median(rs) for key, rs in runs.items()},
        }

    # ------------------------------------------------- 3. staging beside reads

    def contention(self, warm: LocalNode) -> dict[str, Any]:
        """A job of back-to-back epochs alone, one with staging running, one alone again.

        The two jobs alone bracket the one beside staging, so drift on this shared
        machine hits both sides alike; staging starts ``settle_seconds`` before its
        job, so it runs at full speed when the job's first epoch begins.
        """
        spec = f"{self.s.dataset}@1"
        stub = connect(warm.address)
        events: list[edge_pb2.StageProgress] = []

        def job(label: str) -> list[Epoch]:
            return [self.epoch(label, warm.address, spec) for _ in range(self.s.repeat)]

        with Sampler(self.t0, warm, interval=0.2) as sampler:
            before = job("alone")
            self.log(f"staging {self.s.next_dataset}@1 into the same node, across the link")
            staged_from = self.now()
            call = stub.Stage(edge_pb2.StageRequest(dataset=self.s.next_dataset, version=1))

            def consume() -> None:
                with contextlib.suppress(grpc.RpcError):
                    events.extend(call)

            reader = threading.Thread(target=consume, daemon=True)
            reader.start()
            time.sleep(self.s.settle_seconds)
            contended = job("with staging")
            staging_ran = reader.is_alive()
            call.cancel()
            reader.join(timeout=30)
            staged_until = self.now()
            after = job("alone")
        if not staging_ran:
            self.log("warning: staging finished before the job did; use more data")
        since = before[0].started_at
        link = sampler.series("link", since)

        def window(r: Epoch) -> tuple[float, float]:
            return round(r.started_at - since, 3), round(r.started_at - since + r.seconds, 3)

        return {
            "alone": _job(before + after),
            "with_staging": _job(contended),
            # After the first epoch, in which staging's in-flight requests finish:
            "alone_after_first": _job(before[1:] + after[1:]),
            "with_staging_after_first": _job(contended[1:]),
            "alone_runs": [asdict(r) for r in before + after],
            "with_runs": [asdict(r) for r in contended],
            "staging_window": (round(staged_from - since, 3), round(staged_until - since, 3)),
            "staging_still_running_at_end": staging_ran,
            "staged_shards_meanwhile": max((e.shards_done for e in events), default=0),
            "link_timeline": link,  # bytes received over the link since the first epoch began
            "epoch_windows": {
                "alone": [window(r) for r in before + after],
                "with": [window(r) for r in contended],
            },
            "link_bytes_per_s_during_epochs": [_rate_within(link, *window(r)) for r in contended],
            "link_bytes_per_s_before_epochs": _rate_within(
                link, staged_from - since + 0.5, window(contended[0])[0]
            ),
        }


def _job(runs: list[Epoch]) -> dict[str, Any]:
    """A training job of back-to-back epochs: its read throughput over all of them."""
    samples = sum(r.samples for r in runs)
    seconds = sum(r.seconds for r in runs)
    return {
        "epochs": len(runs),
        "samples": samples,
        "seconds": round(seconds, 3),
        "samples_per_s": round(samples / seconds) if seconds else 0,
        "epoch_seconds": [round(r.seconds, 3) for r in runs],
    }


def _median(runs: list[Epoch]) -> dict[str, Any]:
    """The median epoch (with its timeline), the median time to first batch, and all times.

    Medians, not bests: the measures compared here differ little or not at all in
    what they do, and on a shared machine one lucky or unlucky epoch is noise.
    """
    middle = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    firsts = sorted(r.first_batch_s for r in runs)
    return asdict(middle) | {
        "first_batch_s": firsts[len(firsts) // 2],
        "samples_per_s": round(middle.samples_per_s),
        "all_seconds": [round(r.seconds, 3) for r in runs],
        "best_seconds": round(min(r.seconds for r in runs), 3),
    }


def _rate_within(timeline: list[tuple[float, float]], start: float, end: float) -> float:
    """Bytes per second of a cumulative timeline between ``start`` and ``end``."""
    inside = [(t, b) for t, b in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return 0.0
    return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))


def run(settings: Settings, console: Console) -> dict[str, Any]:
    """All three measurements; every node started is stopped, whatever happens."""
    work = Workload(settings, console)
    results: dict[str, Any] = {}
    try:
        warm = work.node("warm", f"s3://{settings.bucket}/_edgecache", {})
        results["staging"] = work.warm(warm)
        if 2 in settings.parts:
            results["epochs"] = work.epochs(warm)
        if 3 in settings.parts:
            results["contention"] = work.contention(warm)
    finally:
        work.close()
    return results


def main() -> None:
    edge_side(Settings, run)


if __name__ == "__main__":
    main()
