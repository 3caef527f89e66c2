"""The local multi-region demo: origin → registry → two regional edge nodes → tensors.

Everything real, on one machine: token shards are written as Parquet to a
``file://`` origin, published as an immutable version to a registry, and two
edge nodes (``edgecache serve`` subprocesses, regions ``eu-west`` and
``us-east``) serve them. ``eu-west`` is warmed with ``Stage`` ahead of the
"job"; the job then streams every shard from it over gRPC, verifies every
chunk's checksum, decodes on several threads and turns the columns into
tensors. ``us-east`` was not warmed: its first read goes through to origin
(read-through), which is what the planner exists to avoid.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from edgecache.cache.codec import COMPRESSIONS
from edgecache.cache.manifest import manifest_schema, preprocess_spec
from edgecache.cache.planner import Plan, RegionPlan, VersionKey
from edgecache.cache.registry import Registry
from edgecache.cache.units import format_bytes
from edgecache.clients.channels import node_error, open_channel
from edgecache.clients.executor import PlanExecutor, TaskRun, WarmOutcome, release_line
from edgecache.clients.node_client import LocalNode, read_shard, start_local_node
from edgecache.clients.ops import (
    NodeReport,
    dropped_warm_pins,
    gather_status,
    make_plan,
    record_warmed_jobs,
    schedule_owner,
)
from edgecache.clients.topology import Schedule, Topology, load_schedule, load_topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["DemoResult", "run_demo"]

TOKENS = 2048
DATASET = "demo-tokens"
REGIONS = ("eu-west", "us-east")


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    dataset: str
    shards: int
    samples: int
    source_bytes: int
    stored_bytes: int
    stage_bytes_per_s: float  # source bytes staged per second (fetch + preprocess + commit)
    # Stored bytes us-east copied from eu-west per second; None when nothing was copied
    # (us-east already held the version) or too fast to time, and peer_copy_why says which.
    peer_copy_bytes_per_s: float | None
    read_samples_s: float
    read_bytes_per_s: float
    read_threads: int
    cold_first_chunk_s: float
    warm_first_chunk_s: float
    loss_first: float
    loss_last: float
    first_batch_s: float
    device: str
    verified: bool
    peer_copy_why: str | None = None
    workdir: str = ""
    # Each node as `status --json` has it: region, node (its address), used_bytes, hits,
    # misses, bytes_served, versions [{version, shards, total_shards}].
    nodes: list[dict[str, object]] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """Plain dict for ``--json``."""
        return asdict(self)


def _write_origin(root: Path, total_mib: int, shards: int, progress: Progress) -> int:
    """Generate the token shards; the longest quiet step of ``make demo``, hence its bar.

    An earlier run's shards in a reused ``--workdir`` go first: publish takes
    the whole folder, so four old shards beside two new ones became a version
    of six that the story, which counted two, then failed to verify.
    """
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("part-*.parquet"):
        stale.unlink()
    rows = max((total_mib << 20) // (TOKENS * 4) // shards, 1)
    bar = progress.add_task("write origin (Parquet)", total=rows * shards * (TOKENS * 4 + 8))
    for index in range(shards):
        rng = np.random.default_rng(index)
        ids = (rng.zipf(1.2, size=rows * TOKENS) % 50_000).astype(np.int32)
        table = pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), TOKENS),
                "label": pa.array(np.arange(index * rows, (index + 1) * rows, dtype=np.int64)),
            }
        )
        pq.write_table(table, root / f"part-{index:05d}.parquet", compression="zstd")
        progress.advance(bar, rows * (TOKENS * 4 + 8))
    return rows * shards


@dataclass(frozen=True)
class Training:
    """What one epoch of the demo's training loop saw."""

    samples: int
    seconds: float
    first_batch_seconds: float
    loss_first: float
    loss_last: float
    exact_once: bool


def train(
    spec: str,
    topology: Path,
    *,
    threads: int,
    progress: Progress,
    total: int,
    say: Callable[[str], None] = lambda line: None,
) -> Training:
    """One epoch of a tiny classifier (predict a sample's first token's parity)."""
    import torch

    from edgecache.clients import EdgeDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50_000, 16), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)  # imports torch._dynamo: ~1 s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    started = time.perf_counter()  # from here on: the data path
    with warnings.catch_warnings(record=True) as caught:  # said as a note, not a traceback line
        warnings.simplefilter("always", UserWarning)
        dataset = EdgeDataset(
            spec, config=topology, region="eu-west", batch_size=256, seed=17, threads=threads
        )
    for said in caught:  # e.g. a small --size-mib: fewer shuffle windows than asked
        say(f"note: {said.message}")
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
    task = progress.add_task("train 1 epoch via EdgeDataset", total=total * (TOKENS * 4 + 8))
    losses, labels, first_batch = [], [], 0.0
    for batch in loader:
        if not first_batch:
            first_batch = time.perf_counter() - started
        ids = batch["input_ids"].to(device, non_blocking=True)
        first = ids[:, 0].long()
        loss = torch.nn.functional.cross_entropy(model(first), first % 2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        labels.append(batch["label"])
        progress.advance(task, len(first) * (TOKENS * 4 + 8))
    seconds = time.perf_counter() - started
    dataset.close()
    seen = torch.cat(labels)
    exact = len(seen) == total and bool((torch.sort(seen).values == torch.arange(total)).all())
    window = max(len(losses) // 10, 1)
    return Training(
        samples=len(seen),
        seconds=seconds,
        first_batch_seconds=first_batch,
        loss_first=sum(losses[:window]) / window,
        loss_last=sum(losses[-window:]) / window,
        exact_once=exact,
    )


# The demo's 256 MiB version in 4 MiB chunks would be 72 shuffle windows, and its
# batches would draw from 2 of them, not 16 (EdgeDataset says so in a warning). A
# user publishes such a small version with smaller chunks (publish --chunk-size):
# so does the demo, for 512+ windows.
CHUNK_BYTES = 512 << 10


def _publish(registry_url: str, origin: str, compression: str) -> pb.Manifest:
    spec = preprocess_spec(compression=COMPRESSIONS[compression], chunk_bytes=CHUNK_BYTES)
    return Registry.run(registry_url, lambda reg: reg.publish(origin, DATASET, spec=spec))


# The demo's links, as a topology states them: us-east reaches origin slowly and eu-west
# fast, so the planner stages us-east from eu-west's copy (as across real regions).
LINKS = {
    "eu-west": "    origin_bandwidth: 10Gbit/s",
    "us-east": "    origin_bandwidth: 200Mbit/s\n    peers: {eu-west: 10Gbit/s}",
}


def _sample_files(workdir: Path, nodes: dict[str, LocalNode]) -> tuple[Topology, Schedule]:
    """The demo's topology file and a schedule: a job in eu-west in an hour, us-east in two."""
    lines = [f"registry: file://{workdir}/registry", "regions:"]
    for region, node in nodes.items():
        lines += [f"  {region}:", f"    nodes: ['{node.address}']", LINKS[region]]
    (workdir / "edgecache.yaml").write_text("\n".join(lines) + "\n")
    now = datetime.now(UTC)
    jobs = [
        ("train-eu", "eu-west", now + timedelta(hours=1)),
        ("eval-us", "us-east", now + timedelta(hours=2)),
    ]
    (workdir / "schedule.yaml").write_text(
        "jobs:\n"
        + "".join(
            f"  - name: {name}\n    region: {region}\n    start: '{start.isoformat()}'\n"
            f"    datasets: [{DATASET}]\n    duration: 6h\n"
            for name, region, start in jobs
        )
    )
    topology = load_topology(workdir / "edgecache.yaml")
    return topology, load_schedule(workdir / "schedule.yaml", topology)


def _record_as_warm(
    executor: PlanExecutor,
    workdir: Path,
    schedule: Schedule,
    plan: Plan,
    manifests: dict[str, pb.Manifest],
    reports: list[NodeReport],
    now: datetime,
    say: Callable[[str], None],
) -> None:
    """Record the sample schedule's jobs and pins as ``edgecache warm`` does, and release its own.

    ``evict`` then names the job a pin is for, and its advice works: remove
    the job from the demo's schedule.yaml and run ``edgecache warm`` on it, and
    warm releases the pin. Unrecorded, the pins were nobody's to release but
    ``evict --force``'s. The pins an earlier demo in the same ``--workdir``
    placed for a version no longer planned are released first, as warm would.
    """
    owner = schedule_owner(workdir / "schedule.yaml")
    released = executor.release(dropped_warm_pins(executor.topology, owner, plan, now), reports)
    for pin in released.released:  # an earlier demo's, in this --workdir
        say(f"warm: {release_line(pin, plan)}")
    record_warmed_jobs(
        executor.topology,
        schedule,
        manifests,
        now,
        owner=owner,
        plan=plan,
        unreleased=released.kept,
    )


def _utc(moment: datetime, fmt: str = "%H:%M:%S") -> str:
    """A plan time said with its zone, so it reads right on a machine in any time zone."""
    return f"{moment.astimezone(UTC):{fmt}} UTC"


def _plan_lines(plan: Plan) -> list[str]:
    """The plan as `edgecache plan` tells it: stagings, evictions, then pins, per region."""
    lines = []
    for region, rp in plan.regions.items():
        lines += [
            f"{region}: stage {t.spec} (~{format_bytes(t.bytes)}) from {t.source}, ready by "
            f"{_utc(t.finish)} for {', '.join(t.jobs)} (starts {_utc(t.deadline, '%H:%M')})"
            for t in rp.tasks
        ]
        lines += [
            f"{region}: evict {e.version[0]}@{e.version[1]} ({format_bytes(e.bytes)}) at "
            f"{_utc(e.at)}: {e.reason}"
            for e in rp.evictions
        ]
        lines += [
            f"{region}: pin {name}@{version} until {_utc(until, '%Y-%m-%d %H:%M')} "
            f"({_pin_reason(rp, (name, version))}; no eviction takes it before)"
            for (name, version), until in rp.pins.items()
        ]
    return lines


def _pin_reason(rp: RegionPlan, version: VersionKey) -> str:
    """Why the plan pins ``version`` until its time.

    The region's last job reading it ends then, or another region's copy from
    here runs until then (the later of the two).
    """
    lent = rp.lends.get(version)
    if not lent:
        return "its last job here ends then"
    return f"read here, or copied from here by {', '.join(lent)}, until then"


# Under a millisecond the clock's granularity and the call's own overhead are most of
# the interval: a rate from it would be noise (or a division by nearly nothing).
MIN_TIMED_SECONDS = 1e-3


def _rate(moved: int, seconds: float) -> float | None:
    """Bytes per second over ``seconds``; None when the interval is too short to measure."""
    return moved / seconds if seconds >= MIN_TIMED_SECONDS else None


def _warm_rates(
    outcome: WarmOutcome, source_bytes: int, stage_seconds: float, say: Callable[[str], None]
) -> tuple[float, float | None, str | None]:
    """eu-west's staging rate, us-east's copy rate from eu-west, and why that has none.

    Each run is said as it went. us-east has no copy rate when nothing was
    copied: the timed cold read caches what it reads, with one shard the whole
    version, so the plan has nothing to stage there (a rate of 0 B/s said that
    the copy was slow); nor when the copy was too quick to time.
    """
    rates: dict[str, float | None] = {}
    unmeasured: dict[str, str] = {}  # why a region has no rate
    for run in outcome.runs:
        seconds = (
            (run.finished_at - run.started_at).total_seconds()
            if run.started_at and run.finished_at
            else stage_seconds
        )
        from_peer = run.task.source != "origin" and bool(run.item.peers)
        moved = run.item.peer_bytes if from_peer else source_bytes
        rate = rates[run.task.region] = _rate(moved, seconds)
        if rate is None:
            unmeasured[run.task.region] = f"{seconds * 1e3:.2f} ms, too short to measure a rate"
        what = (
            f"copied {format_bytes(moved)} of stored chunks from {run.task.source} (verified, "
            "no second preprocessing)"
            if from_peer
            else f"staged {format_bytes(source_bytes)} of Parquet from origin (fetch, "
            "preprocess, compress, commit)"
        )
        shown = "too short to measure" if rate is None else f"{format_bytes(rate)}/s"
        say(f"warm: {run.task.region} {what} in {seconds:.2f} s ({shown}) and pinned it as planned")
    us_east = [r for r in outcome.runs if r.task.region == "us-east"]
    if not us_east:
        held = (
            "held every shard when the plan was made (read through from origin when its "
            "first chunk was timed)"
        )
        unmeasured["us-east"] = f"nothing to copy, us-east {held}"
        say(f"warm: us-east copied nothing from eu-west: it {held}; pinned it as planned")
    elif not any(r.task.source != "origin" and r.item.peers for r in us_east):
        rates.pop("us-east", None)
        unmeasured["us-east"] = "staged from origin, not copied from eu-west"
    stage_rate = rates.get("eu-west") or source_bytes / stage_seconds
    return stage_rate, rates.get("us-east"), unmeasured.get("us-east")


def _version_bytes(status: edge_pb2.NodeStatus, version: int) -> int:
    """The demo version's bytes in a node's cache (a reused --workdir holds older ones too)."""
    return sum(
        v.stored_bytes for v in status.versions if (v.dataset, v.version) == (DATASET, version)
    )


def _node_figures(status: edge_pb2.NodeStatus, address: str) -> dict[str, object]:
    """A node as ``status --json`` names it: ``node`` its address, ``versions`` what it holds."""
    return {
        "region": status.region,
        "node": address,
        "used_bytes": status.used_bytes,
        "hits": status.hits,
        "misses": status.misses,
        "bytes_served": status.bytes_served,
        "versions": [
            {
                "version": f"{v.dataset}@{v.version}",
                "shards": v.shard_count,
                "total_shards": v.total_shards or None,
            }
            for v in status.versions
        ],
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_demo(
    workdir: Path,
    *,
    total_mib: int = 256,
    shards: int = 8,
    compression: str = "byte-split-zstd",
    threads: int = 2,
    progress: Progress | None = None,
    say: Callable[[str], None] = lambda line: None,
    while_running: Callable[[DemoResult, Path], None] | None = None,
) -> DemoResult:
    """Run the whole flow in ``workdir`` and return its figures (needs torch).

    ``say`` hears each step as it happens (what was written where, the plan,
    what staging achieved), so a reader follows the story in order.
    ``while_running`` is called with the result while the nodes still run
    (the CLI's ``--keep-nodes`` waits there for Ctrl-C).
    """
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "the demo trains a model through EdgeDataset and needs torch: "
            "pip install 'edgecache[torch]' (make demo does this)"
        ) from exc
    workdir = Path(workdir)
    progress = progress or Progress(
        TextColumn("{task.description:<28}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()
    )
    # Every node started is stopped whatever happens next: a failed step, Ctrl-C, a closed
    # pipe (`edgecache demo | head`) or the CLI's SIGTERM, as well as the end of the demo.
    nodes: dict[str, LocalNode] = {}
    try:
        with progress:
            samples = _write_origin(workdir / "origin", total_mib, shards, progress)
            source_bytes = sum(f.stat().st_size for f in (workdir / "origin").iterdir())
            say(
                f"origin: {shards} Parquet shards, {samples:,} samples of {TOKENS} tokens "
                f"({format_bytes(source_bytes)}) in {workdir / 'origin'}"
            )
            registry_url, origin_url = f"file://{workdir}/registry", f"file://{workdir}/origin"
            manifest = _publish(registry_url, origin_url, compression)
            say(
                f"publish: {DATASET}@{manifest.version} {manifest.digest[:19]}… "
                f"in file://{workdir}/registry"
            )
            schema = manifest_schema(manifest)
            stack = contextlib.ExitStack()
            try:
                for region in REGIONS:
                    nodes[region] = start_local_node(
                        region,
                        workdir / f"cache-{region}",
                        f"file://{workdir}/registry",
                        log_file=workdir / f"node-{region}.log",
                    )
                say(
                    "nodes: "
                    + ", ".join(f"{r} on {n.address}" for r, n in nodes.items())
                    + f" (logs {workdir}/node-*.log)"
                )
                eu, us = (
                    edge_pb2_grpc.EdgeCacheStub(stack.enter_context(open_channel(nodes[r].address)))
                    for r in REGIONS
                )

                # Time to the first chunk from a region nothing was staged to: the node reads
                # the shard through from origin (measured before the plan warms us-east too).
                def first_chunk_seconds(stub: object, shard: int) -> float:
                    begin = time.perf_counter()
                    next(read_shard(stub, DATASET, manifest.version, shard, schema=schema))  # type: ignore[arg-type]
                    return time.perf_counter() - begin

                cold_first = first_chunk_seconds(us, 0)

                # The warm-up: plan a sample schedule and carry it out, as `edgecache plan`
                # and `edgecache warm` do: eu-west from origin, then us-east from eu-west's
                # copy (its link to origin is the slow one), each pinned for its job.
                topology, schedule = _sample_files(workdir, nodes)
                # Its own two nodes, on this host: a longer health-check budget than
                # status's 3 s, which a busy 2-core CI host once exceeded for an idle node.
                reports = gather_status(topology, timeout=15.0)
                now = datetime.now(UTC)
                plan_result, manifests = make_plan(topology, schedule, now=now, reports=reports)
                plan_lines = _plan_lines(plan_result)
                for line in plan_lines:
                    say(f"plan: {line}")
                bars: dict[int, TaskID] = {}

                def show(run: TaskRun) -> None:
                    bar = bars.get(id(run.item))
                    if bar is None:
                        bar = bars[id(run.item)] = progress.add_task(
                            f"warm {run.task.region} {run.task.spec}", total=run.item.bytes_total
                        )
                    progress.update(bar, completed=run.item.bytes_done)

                executor = PlanExecutor(topology, on_progress=show)
                _record_as_warm(
                    executor, workdir, schedule, plan_result, manifests, reports, now, say
                )
                started = time.perf_counter()
                outcome = executor.warm(plan_result, schedule, manifests)
                stage_seconds = time.perf_counter() - started
                failures = (
                    [f for r in outcome.failed for f in r.item.failures]
                    + [d.reason for d in outcome.deferred]
                    + [i.reason for i in plan_result.infeasible]
                    + outcome.pin_failures
                )
                if failures:
                    raise RuntimeError(
                        "warming the sample schedule failed: "
                        + "; ".join(failures)
                        + f" (the nodes' logs are {workdir}/node-*.log)"
                    )
                stage_rate, peer_rate, peer_why = _warm_rates(
                    outcome, source_bytes, stage_seconds, say
                )

                warm_first = first_chunk_seconds(eu, 0)
                say(
                    f"first chunk: {warm_first * 1e3:,.1f} ms from warm eu-west, "
                    f"{cold_first * 1e3:,.1f} ms from us-east before it was staged (read "
                    "through to origin)"
                )

                # The job: train a small model for one epoch through EdgeDataset, in eu-west:
                # its own region's node first, us-east only as a fallback.
                training = train(
                    f"{DATASET}@{manifest.version}",
                    workdir / "edgecache.yaml",
                    threads=threads,
                    progress=progress,
                    total=samples,
                    say=say,
                )
                got, read_seconds = training.samples, training.seconds
                verified = training.exact_once
                statuses = [stub.Status(edge_pb2.StatusRequest()) for stub in (eu, us)]
                result = DemoResult(
                    dataset=f"{DATASET}@{manifest.version}",
                    shards=len(manifest.shards),
                    samples=got,
                    source_bytes=source_bytes,
                    stored_bytes=_version_bytes(statuses[0], manifest.version),
                    stage_bytes_per_s=stage_rate,
                    peer_copy_bytes_per_s=peer_rate,
                    peer_copy_why=peer_why,
                    read_samples_s=got / read_seconds,
                    read_bytes_per_s=got * (TOKENS * 4 + 8) / read_seconds,
                    loss_first=training.loss_first,
                    loss_last=training.loss_last,
                    first_batch_s=training.first_batch_seconds,
                    read_threads=threads,
                    cold_first_chunk_s=cold_first,
                    warm_first_chunk_s=warm_first,
                    device="cuda" if _cuda() else "cpu",
                    verified=verified,
                    workdir=str(workdir),
                    plan=plan_lines,
                    nodes=[_node_figures(s, nodes[s.region].address) for s in statuses],
                )
            except grpc.RpcError as exc:  # a demo node failed: say which, not a raw status
                down = (r for r, n in nodes.items() if n.process.poll() is not None)
                failed = next(down, "a node")
                raise node_error(exc, endpoint=failed, what="the demo") from exc
            finally:
                stack.close()
        if while_running is not None:
            while_running(result, workdir)
    finally:
        for node in nodes.values():
            node.stop()
    return result
