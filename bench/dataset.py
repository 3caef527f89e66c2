"""EdgeDataset epochs against a hand-written LMDB → tensor loop, in one run.

    python -m bench.dataset [--tokens-mib 1024] [--images-mib 512] [--repeat 2] [--json]

Two datasets are written as Parquet shards (~64 MiB raw each) to a file://
origin, published to a file:// registry and staged (Stage RPC) into one edge
node subprocess:

* tokens: 2048 int32 ids per sample (FixedSizeList<int32>[2048]) and an int64
  label, cached as zstd-1 chunks; batches of 256;
* images: ~100 KiB of binary per sample (half noise, half gradient; a
  stand-in for encoded images, not decoded here) and an int64 label, cached
  uncompressed; batches of 32.

For each, one full epoch of:

(a) ``EdgeDataset`` over gRPC from the warm node, through a ``DataLoader``
    (``batch_size=None, num_workers=0``), shuffled;
(b) the same with the local fast path, ``lmdb://<the node's cache dir>``;
(c) the ceiling: a hand-written loop over the same cache, in shard and chunk
    order: ``CacheStore.read_shard`` (verified zero-copy views), ``decode_chunk``
    and per-batch copies into fresh tensors (tokens), or of each batch's image bytes
    into one tensor plus offsets (images, EdgeDataset's default ``Packed`` form).
    Batches are cut per chunk, so a chunk's last batch may be short.

(c) is the ceiling because it does the least work any reader of this cache
must do to hand out owned batches: read and verify each chunk once, decompress
it, copy each row once. It has no network, no shuffle (it copies contiguous
slices, never gathers), no read-ahead threads, no DataLoader and no failover
machinery, and it runs on one thread (EdgeDataset decodes on two, so on
zstd data it can beat it). EdgeDataset adds shuffling, gRPC and its
guarantees on top; the ratios say what they cost. Targets: (a) >= 0.6x (c), (b) >= 0.85x (c).

Each measurement runs ``--repeat`` times, interleaved, with a fresh dataset
per run; the best epoch and the best time to first batch are kept. MB counts
raw sample bytes (2048*4+8 per token sample; binary length + 8 per image).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from bench import datasets, report
from bench.arguments import non_negative_int, positive_int, some_data
from bench.report import ratio_table
from edgecache.cache.codec import decode_chunk
from edgecache.cache.keys import ShardKey
from edgecache.cache.manifest import manifest_from_bytes, manifest_schema, preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.cache.store import CacheStore
from edgecache.clients.dataset import EdgeDataset
from edgecache.clients.node_client import connect, start_local_node
from edgecache.clients.packed import Packed
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

SHARD_MIB = 64
TOKENS = datasets.TOKENS_PER_SAMPLE


@dataclass
class Data:
    """One published, staged dataset version."""

    name: str
    version: int
    batch_size: int
    rows: int
    raw_bytes: int  # raw sample bytes, as counted for MB/s
    parquet_bytes: int
    cached_bytes: int = 0
    shards: int = 0


@dataclass
class Run:
    """One epoch: samples, batches, epoch seconds, seconds to the first batch."""

    samples: int
    batches: int
    seconds: float
    first_batch: float


# ------------------------------------------------------------------ data


def write_parquet(
    root: Path, total_mib: int, make: Callable[..., list[pa.RecordBatch]], compression: str
) -> tuple[int, int, int]:
    """Parquet shards of ~SHARD_MIB raw each; (rows, raw sample bytes, file bytes)."""
    root.mkdir(parents=True)
    count = max(total_mib // SHARD_MIB, 1)
    shard_bytes = (total_mib << 20) // count
    rows = raw = 0
    for i in range(count):
        table = pa.Table.from_batches(make(shard_bytes, seed=i))
        rows += table.num_rows
        for column in table.columns:  # binary: its lengths; fixed width: its buffers
            if pa.types.is_binary(column.type):
                raw += pc.sum(pc.binary_length(column)).as_py()
            else:
                raw += column.nbytes
        pq.write_table(table, root / f"part-{i:05d}.parquet", compression=compression)
    return rows, raw, sum(p.stat().st_size for p in root.iterdir())


def publish(registry: str, source: str, dataset: str, spec: pb.PreprocessSpec) -> pb.Manifest:
    return Registry.run(registry, lambda reg: reg.publish(source, dataset, spec=spec))


# ------------------------------------------------------------ measures


def edge_epoch(data: Data, endpoint: str) -> Run:
    """(a)/(b): one shuffled EdgeDataset epoch through a DataLoader, from construction."""
    started = time.perf_counter()
    with EdgeDataset(
        f"{data.name}@{data.version}",
        endpoints=[endpoint],
        batch_size=data.batch_size,
        shuffle=True,
        seed=0,
    ) as ds:
        first = 0.0
        samples = batches = 0
        for batch in DataLoader(ds, batch_size=None, num_workers=0):
            if not batches:
                first = time.perf_counter() - started
            samples += len(batch["label"])
            batches += 1
        elapsed = time.perf_counter() - started
    return Run(samples, batches, elapsed, first)


def _split_tokens(batch: pa.RecordBatch, size: int) -> list[dict[str, object]]:
    ids = torch.from_numpy(batch.column("input_ids").values.to_numpy().reshape(-1, TOKENS))
    labels = torch.from_numpy(batch.column("label").to_numpy())
    return [
        {"input_ids": ids[i : i + size].clone(), "label": labels[i : i + size].clone()}
        for i in range(0, batch.num_rows, size)
    ]


def _split_images(batch: pa.RecordBatch, size: int) -> list[dict[str, object]]:
    """B-row batches of images as EdgeDataset yields them by default (values + offsets).

    Rows are contiguous here (no shuffle), so each batch's bytes are one slice
    of the chunk's data buffer, copied once; the offsets are rebased to 0.
    """
    labels = torch.from_numpy(batch.column("label").to_numpy())
    images = batch.column("image")
    offsets = np.frombuffer(images.buffers()[1], dtype=np.int32)[
        images.offset : images.offset + len(images) + 1
    ].astype(np.int64)
    data = np.frombuffer(images.buffers()[2], dtype=np.uint8)
    out: list[dict[str, object]] = []
    for i in range(0, batch.num_rows, size):
        bounds = offsets[i : i + size + 1]
        values = torch.from_numpy(data[bounds[0] : bounds[-1]].copy())
        image = Packed(values, torch.from_numpy(bounds - bounds[0]), "binary")
        out.append({"image": image, "label": labels[i : i + size].clone()})
    return out


def ceiling_batches(cache_dir: Path, data: Data) -> Iterator[dict[str, object]]:
    """(c): every chunk of every shard in order, decoded, copied out as B-row batches."""
    split = _split_tokens if data.name == "tokens" else _split_images
    with CacheStore(cache_dir, readonly=True) as store:
        raw = store.get_manifest(data.name, data.version)
        assert raw is not None, f"{data.name}@{data.version} is not cached"
        manifest = manifest_from_bytes(raw)
        schema = manifest_schema(manifest)
        for shard in range(len(manifest.shards)):
            with store.read_shard(ShardKey(data.name, data.version, shard)) as reader:
                for index in range(reader.info.chunk_count):
                    # The decoded batch (which may point into LMDB) dies inside split();
                    # only owned copies leave it, before the read transaction ends.
                    yield from split(
                        decode_chunk(reader.chunk(index), schema, verify=False), data.batch_size
                    )


def ceiling_epoch(data: Data, cache_dir: Path) -> Run:
    started = time.perf_counter()
    first = 0.0
    samples = batches = 0
    with warnings.catch_warnings():  # Arrow's buffers are read-only; we only clone from them
        warnings.simplefilter("ignore", UserWarning)
        for batch in ceiling_batches(cache_dir, data):
            if not batches:
                first = time.perf_counter() - started
            samples += len(batch["label"])  # type: ignore[arg-type]
            batches += 1
    return Run(samples, batches, time.perf_counter() - started, first)


def measure(data: Data, address: str, cache_dir: Path, repeat: int, console: Console) -> dict:
    runners: dict[str, Callable[[], Run]] = {
        "c": lambda: ceiling_epoch(data, cache_dir),
        "a": lambda: edge_epoch(data, address),
        "b": lambda: edge_epoch(data, f"lmdb://{cache_dir}"),
    }
    runs: dict[str, list[Run]] = {k: [] for k in runners}
    for r in range(repeat):  # interleaved, so drift hits all alike
        for key, fn in runners.items():
            gc.collect()
            run = fn()
            if run.samples != data.rows:
                raise AssertionError(f"{key} {data.name}: {run.samples} samples of {data.rows}")
            runs[key].append(run)
            console.log(
                f"{data.name} ({key}) run {r + 1}: {run.seconds:.2f} s, "
                f"{run.samples / run.seconds:,.0f} samples/s, first batch {run.first_batch:.3f} s"
            )
    return {
        key: {
            "seconds": round(min(x.seconds for x in rs), 3),
            "first_batch_s": round(min(x.first_batch for x in rs), 4),
            "samples_s": round(data.rows / min(x.seconds for x in rs)),
            "mb_s": round(data.raw_bytes / min(x.seconds for x in rs) / 1e6),
            "batches": rs[0].batches,
        }
        for key, rs in runs.items()
    }


LABELS = {
    "a": "EdgeDataset, gRPC from the warm node",
    "b": "EdgeDataset, local lmdb:// fast path",
    "c": "hand-written store → tensor loop",
}
TARGETS = {"a": 0.6, "b": 0.85}


def rows_for(data: Data, figures: dict) -> list[dict]:
    base = figures["c"]
    return [
        {
            "measure": f"{data.name}: {LABELS[key]}",
            "baseline": LABELS["c"],
            "mbytes": round(data.raw_bytes / 1e6, 1),
            "ours_mb_s": figures[key]["mb_s"],
            "baseline_mb_s": base["mb_s"],
            "ratio": round(base["seconds"] / figures[key]["seconds"], 3),
            "target": TARGETS[key],
        }
        for key in ("a", "b")
    ]


# ------------------------------------------------------------------ main


def run(workdir: Path, args: argparse.Namespace, console: Console) -> tuple[list[Data], dict]:
    registry = f"file://{workdir}/registry"
    cache_dir = workdir / "cache"
    all_data: list[Data] = []
    for name, mib, make, parquet_codec, codec, size in (
        ("tokens", args.tokens_mib, datasets.tokens, "zstd", pb.COMPRESSION_ZSTD, 256),
        ("images", args.images_mib, datasets.images, "none", pb.COMPRESSION_NONE, 32),
    ):
        if not mib:
            continue  # 0 MiB: that dataset is left out (a 1-sample one was measured)
        console.log(f"writing {mib} MiB of {name} as Parquet ({parquet_codec})")
        origin = workdir / f"{name}-origin"
        rows, raw, parquet = write_parquet(origin, mib, make, parquet_codec)
        manifest = publish(registry, f"file://{origin}", name, preprocess_spec(compression=codec))
        all_data.append(Data(name, manifest.version, size, rows, raw, parquet))
    node = start_local_node("bench", cache_dir, registry, capacity="8GiB")
    try:
        stub = connect(node.address)
        for data in all_data:
            console.log(f"staging {data.name}@{data.version} into the node")
            started = time.perf_counter()
            progress = list(
                stub.Stage(edge_pb2.StageRequest(dataset=data.name, version=data.version))
            )
            last = progress[-1]
            assert last.finished and not last.failures, last
            console.log(f"staged in {time.perf_counter() - started:.1f} s")
        with CacheStore(cache_dir, readonly=True) as store:
            for data in all_data:
                shards = store.shards(data.name, data.version)
                data.shards = len(shards)
                data.cached_bytes = sum(s.stored_bytes for s in shards)
        figures = {}
        for data in all_data:
            console.log(f"measuring {data.name} epochs, {args.repeat} run(s) each")
            figures[data.name] = measure(data, node.address, cache_dir, args.repeat, console)
        return all_data, figures
    finally:
        node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens-mib", type=non_negative_int, default=1024, help="raw MiB of token data"
    )
    parser.add_argument(
        "--images-mib", type=non_negative_int, default=512, help="raw MiB of image data"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=2, help="epochs per measure; best is kept"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    some_data(parser, args.tokens_mib, args.images_mib)
    console = Console(stderr=args.json, width=150)
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-dataset-"))
    try:
        all_data, figures = run(workdir, args, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = [r for data in all_data for r in rows_for(data, figures[data.name])]
    versions = report.versions("torch", "pyarrow", "zstandard", "grpcio", "lmdb", "edgecache")
    sizes = {
        d.name: {
            "version": f"{d.name}@{d.version}",
            "samples": d.rows,
            "raw_mb": round(d.raw_bytes / 1e6, 1),
            "parquet_mb": round(d.parquet_bytes / 1e6, 1),
            "cached_mb": round(d.cached_bytes / 1e6, 1),
            "shards": d.shards,
            "batch_size": d.batch_size,
        }
        for d in all_data
    }
    if args.json:
        out = {"versions": versions, "data": sizes, "epochs": figures, "results": results}
        print(json.dumps(out, indent=2))
        return
    title = f"EdgeDataset epochs vs the hand-written ceiling (same run, best of {args.repeat})"
    console.print(ratio_table(title, results, ("measure", "baseline")))
    for data in all_data:
        for key in ("a", "b", "c"):
            f = figures[data.name][key]
            console.print(
                f"{data.name} ({key}) {LABELS[key]}: {f['samples_s']:,} samples/s, "
                f"epoch {f['seconds']} s, first batch {f['first_batch_s']} s, "
                f"{f['batches']} batches"
            )
    for s in sizes.values():
        console.print(
            f"{s['version']}: {s['samples']:,} samples in {s['shards']} shards, raw "
            f"{s['raw_mb']} MB, Parquet {s['parquet_mb']} MB, cached {s['cached_mb']} MB, "
            f"batch size {s['batch_size']}"
        )
    console.print(
        "images: ~100 KiB binary per sample (half noise, half gradient), cached "
        "uncompressed; yielded as Packed (one uint8 tensor plus offsets), not decoded as images"
    )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


if __name__ == "__main__":
    main()
