"""The edge side of the scenario benchmark: nodes, calibration, and the two runs of the day.

Runs on the edge side of the link (inside the edge namespace, or on the host
with the proxy link). Every region is one ``edgecache serve`` subprocess on
loopback; the nodes reach origin (moto's S3) across the slow link and each
other over loopback directly: the inter-region link is loopback, unshaped.

1. **Calibration.** Throwaway nodes, one per region, stage a different version
   from origin at the same time (the three regions share the one origin link,
   as in both runs); a fourth copies one of them from its peer. The slowest
   region's origin rate and the peer rate become the topology's
   ``origin_bandwidth`` and ``peers:`` figures, divided by the clock's speed
   (simulated bytes per second), so the planner plans with what this link and
   these nodes actually do.
2. **The controller's day.** Fresh nodes; an in-process
   :class:`~edgecache.clients.controller.Controller` on a
   :class:`~edgecache.clients.controller.SimulatedClock` ticks every
   ``interval`` real seconds until the last job has started.
3. **The naive day.** Fresh nodes; a cron-like loop warms each job's versions
   from origin with :func:`~edgecache.clients.ops.stage_item` a fixed lead time
   before the job starts. No pins, no planned evictions: the nodes' LRU makes
   room.

The same observers run in both: a watcher polls every node's ``Status``
(which versions are complete, when), a checker looks at each job's region at
the instant the job starts, and running jobs touch their shards (a one-chunk
``cached_only`` read per shard every few seconds) so the LRU sees them in use,
as a training job's reads would. Jobs read nothing else: a job that starts
with data missing would read it through from origin in real life; that
traffic is not generated, for either run.

    python -m bench.schedule_parts.edge SETTINGS.json RESULTS.json
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from bench.schedule_parts.scenario import (
    REGIONS,
    Scenario,
    ScheduledJob,
    write_schedule,
    write_topology,
)
from bench.wan.session import edge_side
from bench.wan.workload import Sampler
from edgecache.cache.names import parse_spec
from edgecache.cache.registry import Registry
from edgecache.clients.controller import Controller, SimulatedClock
from edgecache.clients.executor import Evicted
from edgecache.clients.node_client import LocalNode, connect, start_local_node
from edgecache.clients.ops import WarmItem, resolve_specs, stage_item
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["Settings", "run"]


@dataclass
class Settings:
    """What the orchestrator hands over (as JSON)."""

    workdir: str
    registry: str  # file://… : manifests, lease and controller record on local disk
    node_env: dict[str, str]  # S3 endpoint across the link, staging concurrency
    scenario: dict[str, Any]
    speed: float  # simulated seconds per real second
    interval: float = 0.2  # real seconds between controller ticks
    naive_lead_hours: float = 2.0
    capacity_versions: float = 2.5  # region capacity, in stored versions
    touch_seconds: float = 2.0
    poll_seconds: float = 0.1
    modes: list[str] = field(default_factory=lambda: ["controller", "naive"])


_METRICS = {
    "origin_bytes": r"edgecache_origin_bytes_total\{[^}]*\}",
    "origin_fetches": r"edgecache_origin_fetches_total\{[^}]*\}",
    "staged_origin_bytes": r'edgecache_staged_bytes_total\{[^}]*source="origin"[^}]*\}',
    "staged_peer_bytes": r'edgecache_staged_bytes_total\{[^}]*source="peer"[^}]*\}',
    "staged_shards": r'edgecache_staged_shards_total\{[^}]*result="staged"[^}]*\}',
    "hits": r"edgecache_cache_hits_total\{[^}]*\}",
    "misses": r"edgecache_cache_misses_total\{[^}]*\}",
}


def scrape(address: str) -> dict[str, float]:
    """The node's counters from its Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for key, pattern in _METRICS.items():
        match = re.search(rf"^{pattern} (\S+)$", text, re.M)
        out[key] = float(match.group(1)) if match else 0.0
    return out


class Day:
    """One simulated day's clock: simulated hours since its start, and waiting for a time."""

    def __init__(self, t0: datetime, speed: float) -> None:
        self.t0, self.speed = t0, speed
        self.clock = SimulatedClock(t0, speed)

    def hours(self, when: datetime | None = None) -> float:
        return ((when or self.clock()) - self.t0).total_seconds() / 3600

    def at(self, hours: float) -> datetime:
        return self.t0 + timedelta(hours=hours)

    def wait_until(self, hours: float, stop: threading.Event) -> bool:
        """Sleep until the simulated time ``hours``; False if stopped first."""
        while not stop.is_set():
            left = (hours - self.hours()) * 3600 / self.speed
            if left <= 0:
                return True
            stop.wait(min(left, 0.05))
        return False


def _held(status: edge_pb2.NodeStatus) -> dict[str, int]:
    return {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions if v.shard_count}


class Observers:
    """The watcher, the start checker and the job's touches, for one run."""

    def __init__(
        self,
        day: Day,
        nodes: dict[str, LocalNode],
        scenario: Scenario,
        manifests: dict[str, pb.Manifest],
        settings: Settings,
    ) -> None:
        self.day, self.scenario, self.manifests, self.settings = day, scenario, manifests, settings
        self.stubs = {region: connect(node.address) for region, node in nodes.items()}
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.touches = {"reads": 0, "not_cached": 0, "errors": 0}
        self._last: dict[str, dict[str, int]] = {}
        self._threads = [
            threading.Thread(target=self._watch, name="watch", daemon=True),
            threading.Thread(target=self._check_starts, name="check", daemon=True),
            threading.Thread(target=self._touch, name="touch", daemon=True),
        ]

    def total(self, spec: str) -> int:
        return len(self.manifests[spec].shards)

    def __enter__(self) -> Observers:
        self.sample()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.sample()

    def sample(self) -> None:
        """One look at every node; kept when what a region holds has changed."""
        for region, stub in self.stubs.items():
            try:
                status = stub.Status(edge_pb2.StatusRequest(), timeout=5)
            except grpc.RpcError:
                continue
            held = _held(status)
            if held != self._last.get(region):
                self._last[region] = held
                self.samples.append(
                    {
                        "t_h": round(self.day.hours(), 5),
                        "region": region,
                        "held": held,
                        "used_bytes": status.used_bytes,
                    }
                )

    def _watch(self) -> None:
        while not self.stop.wait(self.settings.poll_seconds):
            self.sample()

    def _check_starts(self) -> None:
        """At each job's start, is every shard of every version it reads in its region?"""
        for job in sorted(self.scenario.jobs, key=lambda j: j.start_h):
            if not self.day.wait_until(job.start_h, self.stop):
                return
            checked = self.day.hours()
            try:
                status = self.stubs[job.region].Status(edge_pb2.StatusRequest(), timeout=5)
                held = _held(status)
                error = ""
            except grpc.RpcError as exc:
                held, error = {}, f"{exc.code().name}: {exc.details()}"
            missing = {v: held.get(v, 0) for v in job.versions if held.get(v, 0) < self.total(v)}
            self.checks.append(
                {
                    "job": job.name,
                    "region": job.region,
                    "start_h": job.start_h,
                    "checked_h": round(checked, 5),
                    "complete": not missing and not error,
                    "missing": {v: f"{n}/{self.total(v)} shards" for v, n in missing.items()},
                    "error": error,
                }
            )

    def _touch(self) -> None:
        """Running jobs read one chunk of each of their shards, from the cache only."""
        while not self.stop.wait(self.settings.touch_seconds):
            now = self.day.hours()
            for job in self.scenario.jobs:
                if not job.start_h <= now < job.end_h:
                    continue
                for spec in job.versions:
                    parsed = parse_spec(spec)
                    for shard in range(self.total(spec)):
                        request = edge_pb2.ReadShardRequest(
                            dataset=parsed.dataset,
                            version=parsed.version or 0,
                            shard=shard,
                            end_row=1,
                            cached_only=True,
                        )
                        try:
                            for _ in self.stubs[job.region].ReadShard(request, timeout=10):
                                pass
                            self.touches["reads"] += 1
                        except grpc.RpcError as exc:
                            key = (
                                "not_cached"
                                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                                else "errors"
                            )
                            self.touches[key] += 1


class Bench:
    """Runs calibration and the two days; owns, and stops, every node it starts."""

    def __init__(self, settings: Settings, console: Console) -> None:
        self.s = settings
        self.console = console
        self.work = Path(settings.workdir)
        self.scenario = Scenario.from_dict(settings.scenario)
        self.nodes: list[LocalNode] = []
        self.t_start = time.monotonic()
        self.manifests: dict[str, pb.Manifest] = {}

    def log(self, text: str) -> None:
        self.console.log(f"[{time.monotonic() - self.t_start:6.1f} s] {text}")

    def node(self, name: str, region: str, capacity: int | str) -> LocalNode:
        node = start_local_node(
            region,
            self.work / f"cache-{name}",
            self.s.registry,
            capacity=str(capacity),
            log_file=self.work / f"node-{name}.log",
            extra_args=["--metrics-listen", "127.0.0.1:0", "--log-level", "WARNING"],
            env=self.s.node_env,
        )
        self.nodes.append(node)
        return node

    def stop_nodes(self, nodes: list[LocalNode]) -> None:
        for node in nodes:
            node.stop(timeout=15)
            if node in self.nodes:
                self.nodes.remove(node)

    def close(self) -> None:
        self.stop_nodes(list(self.nodes))

    def source_bytes(self, spec: str) -> int:
        return sum(s.source_size for s in self.manifests[spec].shards)

    # ----------------------------------------------------------- calibration

    def _stage(self, node: LocalNode, spec: str, peers: list[str] | None = None) -> float:
        """Stage ``spec`` on ``node`` (from ``peers`` or origin); real seconds taken."""
        parsed = parse_spec(spec)
        request = edge_pb2.StageRequest(
            dataset=parsed.dataset, version=parsed.version or 0, peers=peers or []
        )
        started = time.perf_counter()
        events = list(connect(node.address).Stage(request, timeout=600))
        seconds = time.perf_counter() - started
        if not events or not events[-1].finished or events[-1].failures:
            raise RuntimeError(f"calibration: staging {spec} failed: {events[-1:]}")
        return seconds

    def calibrate(self) -> dict[str, Any]:
        """Origin rate per region with all three staging at once; the peer copy rate."""
        versions = self.scenario.versions
        specs = [versions[i % len(versions)] for i in range(len(REGIONS))]
        if len(set(specs)) < len(specs):
            specs = [versions[0]] * len(REGIONS)  # toy scenarios: the same one three times
        nodes = [self.node(f"calibrate-{r}", r, "4GiB") for r in REGIONS]
        self.log(f"calibration: {len(nodes)} regions stage {', '.join(specs)} from origin at once")
        with ThreadPoolExecutor(len(nodes)) as pool:
            seconds = list(pool.map(self._stage, nodes, specs))
        origin: list[dict[str, Any]] = [
            {
                "region": r,
                "version": spec,
                "source_bytes": self.source_bytes(spec),
                "seconds": round(secs, 3),
                "bytes_per_s": round(self.source_bytes(spec) / secs),
            }
            for r, spec, secs in zip(REGIONS, specs, seconds, strict=True)
        ]
        stored: dict[str, int] = {}
        for node in nodes:
            status = connect(node.address).Status(edge_pb2.StatusRequest(), timeout=5)
            for v in status.versions:
                stored[f"{v.dataset}@{v.version}"] = v.stored_bytes
        peer_node = self.node("calibrate-peer", "peer", "4GiB")
        peer_seconds = self._stage(peer_node, specs[0], [nodes[0].address])
        peer: dict[str, Any] = {
            "version": specs[0],
            "stored_bytes": stored[specs[0]],
            "seconds": round(peer_seconds, 3),
            "bytes_per_s": round(stored[specs[0]] / peer_seconds),
        }
        link_bytes = sum(scrape(n.metrics_address)["origin_bytes"] for n in nodes)
        self.stop_nodes([*nodes, peer_node])
        ratios = [stored[o["version"]] / o["source_bytes"] for o in origin]
        result = {
            "origin": origin,
            "origin_bytes_per_s_per_region": min(o["bytes_per_s"] for o in origin),
            "peer": peer,
            "stored_bytes": stored,
            "stored_per_source": round(max(ratios), 4),
            "max_stored_bytes": max(stored.values()),
            "origin_bytes": int(link_bytes),
        }
        self.log(
            "calibration: origin "
            + ", ".join(f"{o['region']} {o['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s" for o in origin)
            + f" (three at once); peer copy {peer['bytes_per_s'] / 1e6:.0f} MB/s over loopback"
        )
        return result

    # ------------------------------------------------------------------ days

    def day(self, mode: str, calibration: dict[str, Any]) -> dict[str, Any]:
        """One simulated day on fresh nodes, with the controller or with naive warming."""
        scenario, speed = self.scenario, self.s.speed
        capacity = int(self.s.capacity_versions * calibration["max_stored_bytes"])
        nodes = {r: self.node(f"{mode}-{r}", r, capacity) for r in REGIONS}
        origin_sim = calibration["origin_bytes_per_s_per_region"] / speed
        peer_sim = calibration["peer"]["bytes_per_s"] / speed
        topology = self.work / f"{mode}-edgecache.yaml"
        write_topology(
            topology,
            self.s.registry,
            {r: n.address for r, n in nodes.items()},
            origin_sim,
            peer_sim,
        )
        t0 = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
        schedule = self.work / f"{mode}-schedule.yaml"
        write_schedule(schedule, scenario, t0)
        end_h = max(j.start_h for j in scenario.jobs) + 0.25
        day = Day(t0, speed)
        link_before = Sampler.link_rx_bytes()
        self.log(
            f"{mode}: fresh nodes ({capacity / 1e6:.1f} MB each); the day runs "
            f"{end_h:.2f} simulated hours = {end_h * 3600 / speed:.0f} s at {speed:g}×"
        )
        wall = time.monotonic()
        with Observers(day, nodes, scenario, self.manifests, self.s) as observers:
            if mode == "controller":
                detail = self._controller_day(day, topology, schedule, end_h)
            else:
                detail = self._naive_day(day, nodes, end_h)
        wall = time.monotonic() - wall
        link_after = Sampler.link_rx_bytes()
        metrics = {r: scrape(n.metrics_address) for r, n in nodes.items()}
        finals = {
            r: connect(n.address).Status(edge_pb2.StatusRequest(), timeout=5)
            for r, n in nodes.items()
        }
        self.stop_nodes(list(nodes.values()))
        result = {
            "mode": mode,
            "t0": t0.isoformat(),
            "end_h": end_h,
            "wall_s": round(wall, 2),
            "capacity_bytes": capacity,
            "topology": {
                "origin_bandwidth_sim": int(origin_sim),
                "peer_bandwidth_sim": int(peer_sim),
                "origin_bandwidth_real": calibration["origin_bytes_per_s_per_region"],
                "peer_bandwidth_real": calibration["peer"]["bytes_per_s"],
            },
            "metrics": metrics,
            "origin_bytes": int(sum(m["origin_bytes"] for m in metrics.values())),
            "peer_bytes": int(sum(m["staged_peer_bytes"] for m in metrics.values())),
            "link_rx_bytes": (
                link_after - link_before
                if link_after is not None and link_before is not None
                else None
            ),
            "final": {r: {"used_bytes": s.used_bytes, "held": _held(s)} for r, s in finals.items()},
            "samples": observers.samples,
            "checks": observers.checks,
            "touches": observers.touches,
            **detail,
        }
        complete = sum(c["complete"] for c in observers.checks)
        self.log(
            f"{mode}: {complete}/{len(observers.checks)} jobs complete at their start; "
            f"origin {result['origin_bytes'] / 1e6:.1f} MB, peers {result['peer_bytes'] / 1e6:.1f} "
            f"MB; {wall:.0f} s"
        )
        return result

    def _controller_day(
        self, day: Day, topology: Path, schedule: Path, end_h: float
    ) -> dict[str, Any]:
        controller = Controller(topology, schedule, clock=day.clock, lease_ttl=60)
        evictions: list[dict[str, Any]] = []
        evict = controller.executor.evict

        def observed_evict(eviction: Any, sched: Any, manifests: Any, **how: Any) -> Evicted:
            at = day.hours()
            evicted = evict(eviction, sched, manifests, **how)
            evictions.append(
                {
                    "at_h": round(at, 5),
                    "planned_at_h": round(day.hours(eviction.at), 5),
                    "region": eviction.region,
                    "version": f"{eviction.version[0]}@{eviction.version[1]}",
                    "freed": evicted.freed,
                    "refused": evicted.problem or "",
                    "reason": eviction.reason,
                }
            )
            return evicted

        controller.executor.evict = observed_evict  # type: ignore[method-assign]
        first_plan: dict[str, Any] | None = None
        infeasible: dict[tuple[str, str], dict[str, Any]] = {}
        ticks: list[float] = []
        errors: list[str] = []
        # Every task record the controller made, held here: a record leaves the controller's
        # state when a later task for the same region and version replaces it, but the thread
        # that ran it still writes its outcome into the object, so each run's end is seen.
        records: list[Any] = []
        seen: set[int] = set()

        def snapshot() -> None:
            for record in list(controller.state.tasks.values()):
                if id(record) not in seen:
                    seen.add(id(record))
                    records.append(record)

        try:
            while day.hours() < end_h:
                began = time.monotonic()
                try:
                    plan = controller.tick()
                except Exception as exc:  # noqa: BLE001 - recorded; the next tick tries again
                    errors.append(f"{day.hours():.3f} h: {type(exc).__name__}: {exc}")
                    plan = None
                ticks.append(time.monotonic() - began)
                if plan is not None:
                    if first_plan is None:
                        first_plan = _plan(plan, day)
                    for item in plan.infeasible:
                        infeasible.setdefault(
                            (item.job, item.version),
                            {
                                "job": item.job,
                                "version": item.version,
                                "reason": item.reason,
                                "first_seen_h": round(day.hours(), 4),
                            },
                        )
                snapshot()
                time.sleep(max(self.s.interval - (time.monotonic() - began), 0.0))
            controller.wait_idle(timeout=120)
            snapshot()
            jobs = {
                name: _job_record(asdict(record), day)
                for name, record in controller.state.jobs.items()
            }
            current = {id(r) for r in controller.state.tasks.values()}
            runs = [
                _task(asdict(r), day) | {"in_final_state": id(r) in current}
                for r in records
                if r.started_at
            ]
            pending = [_task(asdict(r), day) for r in records if not r.started_at]
        finally:
            controller.close()
        return {
            "first_plan": first_plan,
            "infeasible_seen": list(infeasible.values()),
            "tasks": sorted(runs, key=lambda t: t["started_h"]),
            "tasks_never_started": pending,
            "evictions": evictions,
            "controller_jobs": jobs,
            "ticks": {
                "count": len(ticks),
                "median_s": round(sorted(ticks)[len(ticks) // 2], 4) if ticks else None,
                "max_s": round(max(ticks), 4) if ticks else None,
                "interval_s": self.s.interval,
            },
            "errors": errors,
        }

    def _naive_day(self, day: Day, nodes: dict[str, LocalNode], end_h: float) -> dict[str, Any]:
        lead = self.s.naive_lead_hours
        due = sorted(self.scenario.jobs, key=lambda j: (max(j.start_h - lead, 0.0), j.name))
        items: list[dict[str, Any]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def warm(job: ScheduledJob) -> None:
            for spec in job.versions:
                manifest = self.manifests[spec]
                item = WarmItem(
                    job.region,
                    spec,
                    [nodes[job.region].address],
                    self.source_bytes(spec),
                    shard_count=len(manifest.shards),
                )
                started, real = day.hours(), time.monotonic()
                stage_item(item, stop=stop)
                record = {
                    "job": job.name,
                    "region": job.region,
                    "version": spec,
                    "started_h": round(started, 5),
                    "finished_h": round(day.hours(), 5),
                    "real_s": round(time.monotonic() - real, 3),
                    "done": item.done,
                    "failures": item.failures,
                }
                with lock:
                    items.append(record)

        threads: list[threading.Thread] = []
        try:
            for job in due:
                if not day.wait_until(max(job.start_h - lead, 0.0), stop):
                    break
                if day.hours() >= end_h:
                    break
                thread = threading.Thread(target=warm, args=(job,), daemon=True)
                thread.start()
                threads.append(thread)
            day.wait_until(end_h, stop)
        finally:
            for thread in threads:
                thread.join(timeout=120)
        return {"lead_hours": lead, "items": sorted(items, key=lambda i: i["started_h"])}


def _h(day: Day, iso: str | None) -> float | None:
    return None if not iso else round(day.hours(datetime.fromisoformat(iso)), 5)


def _task(record: dict[str, Any], day: Day) -> dict[str, Any]:
    """A controller task record with its times as simulated hours since the day began."""
    out = {k: v for k, v in record.items() if k not in ("planned_start", "started_at", "ready_at")}
    for key, name in (
        ("planned_start", "planned_start_h"),
        ("started_at", "started_h"),
        ("ready_at", "ready_h"),
        ("predicted_ready", "predicted_ready_h"),
        ("deadline", "deadline_h"),
    ):
        out[name] = _h(day, record.get(key))
    out.pop("predicted_ready", None)
    out.pop("deadline", None)
    return out


def _job_record(record: dict[str, Any], day: Day) -> dict[str, Any]:
    """The controller's record of a job, its times as simulated hours."""
    out = dict(record)
    for key in ("start", "end", "planned_ready", "ready_at"):
        out[f"{key}_h"] = _h(day, out.pop(key))
    return out


def _plan(plan: Any, day: Day) -> dict[str, Any]:
    """The plan as data: tasks, evictions and pins per region; what cannot be met."""
    return {
        "tasks": [
            {
                "region": t.region,
                "version": t.spec,
                "bytes": t.bytes,
                "source": t.source,
                "start_h": round(day.hours(t.start), 5),
                "finish_h": round(day.hours(t.finish), 5),
                "deadline_h": round(day.hours(t.deadline), 5),
                "jobs": list(t.jobs),
            }
            for rp in plan.regions.values()
            for t in rp.tasks
        ],
        "evictions": [
            {
                "region": e.region,
                "version": f"{e.version[0]}@{e.version[1]}",
                "at_h": round(day.hours(e.at), 5),
                "reason": e.reason,
            }
            for rp in plan.regions.values()
            for e in rp.evictions
        ],
        "infeasible": [asdict(i) for i in plan.infeasible],
    }


def run(settings: Settings, console: Console) -> dict[str, Any]:
    """Calibration, then each mode's day; every node started is stopped, whatever happens."""
    bench = Bench(settings, console)
    try:
        found, missing = Registry.run(
            settings.registry, lambda reg: resolve_specs(reg, set(bench.scenario.versions))
        )
        if missing:
            raise RuntimeError(f"not published: {sorted(missing)}")
        bench.manifests = found
        calibration = bench.calibrate()
        days = {mode: bench.day(mode, calibration) for mode in settings.modes}
    finally:
        bench.close()
    return {
        "calibration": calibration,
        "days": days,
        "manifests": {
            spec: {
                "shards": len(m.shards),
                "source_bytes": sum(s.source_size for s in m.shards),
                "digest": m.digest,
            }
            for spec, m in found.items()
        },
    }


def main() -> None:
    # The controller's own account (what it staged, from where, evicted) goes to a file.
    edge_side(Settings, run, log_file=lambda settings: Path(settings.workdir) / "controller.log")


if __name__ == "__main__":
    main()
