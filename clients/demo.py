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

import asyncio
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from edgecache.cache.manifest import manifest_schema, preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.clients.node_client import LocalNode, connect, read_shard, start_local_node
from edgecache.v1 import edge_pb2
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
    stage_mb_s: float
    read_samples_s: float
    read_mb_s: float
    read_threads: int
    cold_first_chunk_s: float
    warm_first_chunk_s: float
    tensor_backend: str
    verified: bool
    nodes: list[dict[str, object]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """Plain dict for ``--json``."""
        return asdict(self)


def _write_origin(root: Path, total_mib: int, shards: int) -> int:
    root.mkdir(parents=True, exist_ok=True)
    rows = max((total_mib << 20) // (TOKENS * 4) // shards, 1)
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
    return rows * shards


def _tensor_factory() -> tuple[str, Callable[[np.ndarray], object]]:
    """torch.from_numpy when torch is installed; edge-only installs use numpy as is."""
    try:
        import torch
    except ImportError:
        return "numpy", lambda array: array
    # Decoded chunks are immutable buffers and the demo only reads them; torch warns
    # about non-writable arrays once, which says nothing useful here.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    return "torch", torch.from_numpy


async def _publish(registry_url: str, origin: str, compression: str) -> pb.Manifest:
    registry = Registry(registry_url)
    try:
        spec = preprocess_spec(
            compression=pb.COMPRESSION_NONE if compression == "none" else pb.COMPRESSION_ZSTD
        )
        return await registry.publish(origin, DATASET, spec=spec)
    finally:
        await registry.close()


def run_demo(
    workdir: Path,
    *,
    total_mib: int = 256,
    shards: int = 8,
    compression: str = "zstd",
    threads: int = 2,
    progress: Progress | None = None,
) -> DemoResult:
    """Run the whole flow in ``workdir`` and return its figures."""
    workdir = Path(workdir)
    backend, to_tensor = _tensor_factory()
    progress = progress or Progress(
        TextColumn("{task.description:<28}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()
    )
    with progress:
        task = progress.add_task("write Parquet origin", total=None)
        samples = _write_origin(workdir / "origin", total_mib, shards)
        progress.update(task, total=1, completed=1)
        manifest = asyncio.run(
            _publish(f"file://{workdir}/registry", f"file://{workdir}/origin", compression)
        )
        schema = manifest_schema(manifest)
        nodes: dict[str, LocalNode] = {}
        try:
            for region in REGIONS:
                nodes[region] = start_local_node(
                    region,
                    workdir / f"cache-{region}",
                    f"file://{workdir}/registry",
                    log_file=workdir / f"node-{region}.log",
                )
            eu, us = connect(nodes["eu-west"].address), connect(nodes["us-east"].address)

            # The warm-up: what `edgecache warm` does before a job starts.
            source_bytes = sum(s.source_size for s in manifest.shards)
            task = progress.add_task("stage eu-west from origin", total=source_bytes)
            started = time.perf_counter()
            for event in eu.Stage(edge_pb2.StageRequest(dataset=DATASET, version=manifest.version)):
                progress.update(task, completed=event.bytes_done)
            stage_seconds = time.perf_counter() - started

            # The job: every shard from the warm region, verified, decoded, as tensors.
            def first_chunk_seconds(stub: object, shard: int) -> float:
                begin = time.perf_counter()
                next(read_shard(stub, DATASET, manifest.version, shard, schema=schema))  # type: ignore[arg-type]
                return time.perf_counter() - begin

            warm_first = first_chunk_seconds(eu, 0)
            cold_first = first_chunk_seconds(us, 0)  # us-east was never warmed

            raw_bytes = samples * (TOKENS * 4 + 8)
            task = progress.add_task(f"read eu-west ({threads} threads)", total=raw_bytes)

            def consume(shard: int) -> tuple[int, int]:
                rows = label_sum = 0
                for batch in read_shard(
                    eu, DATASET, manifest.version, shard, schema=schema, digest=manifest.digest
                ):
                    ids = batch.column("input_ids").values.to_numpy(zero_copy_only=True)
                    tensor = to_tensor(ids.reshape(-1, TOKENS))
                    rows += len(tensor)  # type: ignore[arg-type]
                    label_sum += int(batch.column("label").to_numpy().sum())
                    progress.advance(task, batch.nbytes)
                return rows, label_sum

            started = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                results = list(pool.map(consume, range(len(manifest.shards))))
            read_seconds = time.perf_counter() - started
            got = sum(r[0] for r in results)
            verified = got == samples and sum(r[1] for r in results) == samples * (samples - 1) // 2
            statuses = [stub.Status(edge_pb2.StatusRequest()) for stub in (eu, us)]
        finally:
            for node in nodes.values():
                node.stop()
    return DemoResult(
        dataset=f"{DATASET}@{manifest.version}",
        shards=len(manifest.shards),
        samples=got,
        source_bytes=source_bytes,
        stored_bytes=statuses[0].used_bytes,
        stage_mb_s=source_bytes / stage_seconds / 1e6,
        read_samples_s=got / read_seconds,
        read_mb_s=raw_bytes / read_seconds / 1e6,
        read_threads=threads,
        cold_first_chunk_s=cold_first,
        warm_first_chunk_s=warm_first,
        tensor_backend=backend,
        verified=verified,
        nodes=[
            {
                "region": s.region,
                "shards_resident": sum(v.shard_count for v in s.versions),
                "used_bytes": s.used_bytes,
                "hits": s.hits,
                "misses": s.misses,
                "bytes_served": s.bytes_served,
            }
            for s in statuses
        ],
    )
