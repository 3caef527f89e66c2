"""The local end-to-end demo: generate a dataset, publish its manifest, cache it, read it back.

Today it runs the foundation end to end on one machine: token shards are
encoded into zstd Arrow chunks, committed to a regional LMDB cache, and
streamed back through verified zero-copy reads into tensors on several
threads, with the figures a user cares about. It grows as edge nodes,
EdgeDataset and the planner land.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TransferSpeedColumn

from edgecache.cache.codec import CodecOptions, ShardEncoder
from edgecache.cache.keys import ShardKey
from edgecache.cache.manifest import build_manifest, manifest_schema, preprocess_spec
from edgecache.cache.store import CacheStore
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["DemoResult", "run_demo"]

TOKENS = 2048
DATASET = "demo-tokens"


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    dataset: str
    shards: int
    samples: int
    raw_bytes: int
    stored_bytes: int
    encode_mb_s: float
    read_samples_s: float
    read_mb_s: float
    read_threads: int
    tensor_backend: str
    verified: bool

    def as_dict(self) -> dict[str, object]:
        """Plain dict for ``--json``."""
        return asdict(self)


def _token_shard(index: int, rows: int) -> pa.RecordBatch:
    rng = np.random.default_rng(index)
    ids = (rng.zipf(1.2, size=rows * TOKENS) % 50_000).astype(np.int32)
    labels = np.arange(index * rows, (index + 1) * rows, dtype=np.int64)
    return pa.record_batch(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), TOKENS),
            "label": pa.array(labels),
        }
    )


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


def run_demo(
    cache_dir: Path,
    *,
    total_mib: int = 256,
    shards: int = 8,
    compression: str = "zstd",
    threads: int = 2,
    progress: Progress | None = None,
) -> DemoResult:
    """Encode, cache and read back a generated token dataset; return the figures."""
    rows_per_shard = max((total_mib << 20) // (TOKENS * 4) // shards, 1)
    options = CodecOptions(compression=compression)  # type: ignore[arg-type]
    schema = _token_shard(0, 1).schema
    spec = preprocess_spec(
        compression=pb.COMPRESSION_ZSTD if compression == "zstd" else pb.COMPRESSION_NONE,
        chunk_bytes=options.chunk_bytes,
    )
    backend, to_tensor = _tensor_factory()
    progress = progress or Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TransferSpeedColumn()
    )
    with progress, CacheStore(cache_dir, capacity_bytes=4 * (total_mib << 20), sync=False) as store:
        version = 1 + max((v.version for v in store.versions() if v.dataset == DATASET), default=0)
        raw_total = rows_per_shard * shards * (TOKENS * 4 + 8)
        task = progress.add_task("encode + cache", total=raw_total)
        shard_meta, encode_seconds = [], 0.0
        for index in range(shards):
            batch = _token_shard(index, rows_per_shard)
            t0 = time.perf_counter()
            encoder = ShardEncoder(schema, options)
            frames = encoder.add(batch) + encoder.finish()
            encode_seconds += time.perf_counter() - t0
            info = store.put_shard(ShardKey(DATASET, version, index), frames)
            shard_meta.append(
                pb.Shard(
                    index=index,
                    source_key=f"generated/shard-{index:05d}",
                    source_size=batch.nbytes,
                    row_count=batch.num_rows,
                    stored_size=info.stored_bytes,
                )
            )
            progress.advance(task, batch.nbytes)
        manifest = build_manifest(
            dataset=DATASET,
            version=version,
            source_url="generated://demo",
            source_format=pb.SOURCE_FORMAT_ARROW_IPC,
            schema=schema,
            preprocess=spec,
            shards=shard_meta,
        )
        expected_schema = manifest_schema(manifest)

        def read_shard(index: int) -> tuple[int, int, int]:
            rows = label_sum = 0
            with store.read_shard(ShardKey(DATASET, version, index)) as reader:
                for batch in reader.batches(expected_schema):
                    ids = batch.column("input_ids").values.to_numpy(zero_copy_only=True)
                    tensor = to_tensor(ids.reshape(-1, TOKENS))
                    labels = batch.column("label").to_numpy()
                    rows += len(tensor)  # type: ignore[arg-type]
                    label_sum += int(labels.sum())
                    del batch, ids, tensor, labels
            progress.advance(read_task, rows * (TOKENS * 4 + 8))
            return index, rows, label_sum

        read_task = progress.add_task(f"read back ({threads} threads)", total=raw_total)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(read_shard, range(shards)))
        read_seconds = time.perf_counter() - t0
        samples = sum(r[1] for r in results)
        n = rows_per_shard * shards
        verified = samples == n and sum(r[2] for r in results) == n * (n - 1) // 2
        stored = sum(s.stored_size for s in shard_meta)
    return DemoResult(
        dataset=f"{DATASET}@{version}",
        shards=shards,
        samples=samples,
        raw_bytes=raw_total,
        stored_bytes=stored,
        encode_mb_s=raw_total / encode_seconds / 1e6,
        read_samples_s=samples / read_seconds,
        read_mb_s=raw_total / read_seconds / 1e6,
        read_threads=threads,
        tensor_backend=backend,
        verified=verified,
    )
