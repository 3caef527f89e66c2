"""Staging on many cores: CPU per GB, scaling from 1 to 2 cores, moto against a bare pipeline.

    python -m bench.staging [--mib 256] [--repeat 3] [--json]

Token Parquet shards (bench.edge_node.write_shards: 32 MiB of int32 ids each
as Arrow, ~11 MiB as zstd Parquet), all measured in one run:

(a) CPU seconds per GB of source preprocessed, in process, by today's
    pipeline before issue 17 (``ParquetFile.iter_batches`` + serial zstd-1
    chunks, one thread per shard) and by the node's pipeline now
    (``edge.node._encode_raw_shard``: ``read_table``, chunks compressed on a
    parts pool); thread CPU time, best of ``--repeat``. Target: halved.
(b) An ``edgecache serve`` subprocess pinned with ``taskset`` to 1 core and to
    2 cores, staging the same version from file:// (so origin costs no CPU),
    interleaved, best of ``--repeat``: source MB/s. Target: 2 cores >= 1.7x.
    The node's own Status figures (staging rate, CPU-s per GB) are printed.
(c) Staging from moto's S3 server over loopback against a bare pipeline that
    GETs the same objects (aiobotocore, same concurrency) and decodes them
    into Arrow with pyarrow on as many threads, doing nothing else. Target:
    >= 0.8x. Beside it the old comparison with raw GETs (old target 0.6x,
    out of reach on 2 cores with the S3 server on one of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from bench import report
from bench.edge_node import TESTS, publish, spawn, write_shards
from edgecache.cache.codec import CodecOptions, ShardEncoder
from edgecache.cache.manifest import manifest_schema
from edgecache.cache.registry import Registry
from edgecache.edge.config import usable_cores
from edgecache.edge.node import _encode_raw_shard
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = ["main"]


def _before(data: bytes, schema: pa.Schema) -> float:
    """Today's pipeline before issue 17, on this thread: thread CPU seconds."""
    started = time.thread_time()
    encoder = ShardEncoder(schema, CodecOptions())
    for batch in pq.ParquetFile(pa.BufferReader(data)).iter_batches(batch_size=65536):
        encoder.add(batch)
    encoder.finish()
    return time.thread_time() - started


def cpu_per_gb(origin: Path, registry: str, repeat: int, console: Console) -> dict:
    console.log("(a) CPU per GB: today's pipeline and the node's, in process")
    manifest = Registry.run(registry, lambda reg: reg.manifest("tokens", 1))
    schema = manifest_schema(manifest)
    shards = [(s, (origin / s.source_key).read_bytes()) for s in manifest.shards]
    source = sum(len(d) for _, d in shards)
    before, after = [], []
    from edgecache.cache.preprocess import load_transform

    transform = load_transform("identity", {})
    with ThreadPoolExecutor(usable_cores()) as parts:
        for _ in range(repeat):  # interleaved, so drift hits both
            before.append(sum(_before(data, schema) for _, data in shards))
            after.append(
                sum(
                    _encode_raw_shard(data, manifest, s, s.source_key, transform, parts).cpu_seconds
                    for s, data in shards
                )
            )
    old, new = min(before) / source * 1e9, min(after) / source * 1e9
    return {
        "measure": "preprocess CPU-s per GB of source (token Parquet → zstd-1 chunks)",
        "source_mb": round(source / 1e6, 1),
        "before_cpu_s_per_gb": round(old, 2),
        "after_cpu_s_per_gb": round(new, 2),
        "before_cpu_s_per_shard": round(min(before) / len(shards), 3),
        "after_cpu_s_per_shard": round(min(after) / len(shards), 3),
        "reduction": round(old / new, 2),
        "target": 2.0,
    }


def _node(workdir: Path, name: str, registry: str, cpus: str | None, env: dict[str, str]):
    args = [sys.executable, "-m", "edgecache.clients.cli", "serve", "--region", "bench",
            "--cache-dir", str(workdir / name), "--registry", registry, "--listen",
            "127.0.0.1:0", "--capacity", "8GiB", "--log-level", "WARNING"]  # fmt: skip
    if cpus is not None:
        args = ["taskset", "-c", cpus, *args]
    proc, address = spawn(args, env={**env, "EDGECACHE_SYNC": "false"})
    return proc, edge_pb2_grpc.EdgeCacheStub(
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    )


def _stage(client: edge_pb2_grpc.EdgeCacheStub, dataset: str = "tokens") -> tuple[int, float]:
    client.Evict(edge_pb2.EvictRequest(dataset=dataset, version=1))
    started = time.perf_counter()
    last = list(client.Stage(edge_pb2.StageRequest(dataset=dataset, version=1)))[-1]
    elapsed = time.perf_counter() - started
    assert last.finished and not last.failures, last
    return last.bytes_done, elapsed


def scaling(workdir: Path, registry: str, repeat: int, console: Console) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return {"measure": "staging scaling", "skipped": "needs 2 cores and taskset"}
    console.log(f"(b) staging from file:// with the node pinned to 1 and 2 of cores {cores}")
    sets = {"1 core": str(cores[0]), "2 cores": f"{cores[0]},{cores[1]}"}
    nodes = {label: _node(workdir, label.replace(" ", "-"), registry, cpus, {})
             for label, cpus in sets.items()}  # fmt: skip
    runs: dict[str, list[tuple[int, float]]] = {label: [] for label in sets}
    status = {}
    try:
        for _, client in nodes.values():
            _stage(client)  # warm-up: imports, first allocations
        for _ in range(repeat):
            for label, (_, client) in nodes.items():
                runs[label].append(_stage(client))
        for label, (_, client) in nodes.items():
            st = client.Status(edge_pb2.StatusRequest())
            status[label] = {
                "node_staging_rate_mb_s": round(st.staging_bytes_per_second / 1e6),
                "node_cpu_s_per_gb": round(st.staging_cpu_seconds_per_gb, 2),
            }
    finally:
        for proc, _ in nodes.values():
            proc.terminate()
            proc.wait(timeout=30)
    best = {label: min(r, key=lambda x: x[1]) for label, r in runs.items()}
    rate = {label: b / s for label, (b, s) in best.items()}
    return {
        "measure": "Stage from file://, node pinned with taskset",
        "source_mb": round(best["1 core"][0] / 1e6, 1),
        "one_core_mb_s": round(rate["1 core"] / 1e6, 1),
        "two_cores_mb_s": round(rate["2 cores"] / 1e6, 1),
        "ratio": round(rate["2 cores"] / rate["1 core"], 2),
        "target": 1.7,
        "node_status": status,
    }


async def _bare(bucket: str, prefix: str, concurrency: int, decode: bool) -> tuple[int, float]:
    """GET every object at ``concurrency``; with ``decode``, pyarrow decodes each to Arrow."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    pool = ThreadPoolExecutor(usable_cores())
    loop = asyncio.get_running_loop()
    async with get_session().create_client("s3", config=AioConfig(max_pool_connections=32)) as s3:
        listed = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
        keys = [o["Key"] for o in listed["Contents"] if o["Key"].endswith(".parquet")]
        limit = asyncio.Semaphore(concurrency)
        total = 0

        async def one(key: str) -> None:
            nonlocal total
            async with limit:
                response = await s3.get_object(Bucket=bucket, Key=key)
                async with response["Body"] as body:
                    data = await body.read()
            if decode:
                await loop.run_in_executor(
                    pool, lambda: pq.read_table(pa.BufferReader(data), use_threads=False)
                )
            total += len(data)

        started = time.perf_counter()
        await asyncio.gather(*(one(k) for k in keys))
        elapsed = time.perf_counter() - started
    pool.shutdown()
    return total, elapsed


def moto(workdir: Path, origin: Path, repeat: int, console: Console) -> list[dict]:
    sys.path.insert(0, str(TESTS))
    from s3server import make_bucket, moto_server, s3_env, upload_dir

    with moto_server() as endpoint:
        env = s3_env(endpoint)
        os.environ.update(env)
        console.log("(c) staging from moto's S3 against a bare GET + decode pipeline")
        make_bucket(endpoint, "bench-origin")
        upload_dir(endpoint, "bench-origin", "tokens", origin)
        registry = "s3://bench-origin/_edgecache"
        publish(registry, "s3://bench-origin/tokens", "tokens")
        publish(registry, "s3://bench-origin/tokens", "tokens-none", "none")
        proc, client = _node(workdir, "cache-s3", registry, None, env)
        runs: dict[str, list[tuple[int, float]]] = {"node": [], "none": [], "bare": [], "raw": []}
        try:
            _stage(client)  # warm-up
            for _ in range(repeat):
                runs["raw"].append(asyncio.run(_bare("bench-origin", "tokens/", 4, False)))
                runs["bare"].append(asyncio.run(_bare("bench-origin", "tokens/", 4, True)))
                runs["node"].append(_stage(client))
                runs["none"].append(_stage(client, "tokens-none"))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    rate = {k: (lambda b: b[0] / b[1])(min(v, key=lambda x: x[1])) for k, v in runs.items()}
    mb = round(min(runs["node"], key=lambda x: x[1])[0] / 1e6, 1)
    return [
        {
            "measure": "Stage from S3 (moto), zstd-1",
            "baseline": "GET + pyarrow decode to Arrow, same concurrency",
            "mbytes": mb,
            "ours_mb_s": round(rate["node"] / 1e6),
            "baseline_mb_s": round(rate["bare"] / 1e6),
            "ratio": round(rate["node"] / rate["bare"], 3),
            "target": 0.8,
        },
        {
            "measure": "Stage from S3 (moto), uncompressed chunks",
            "baseline": "GET + pyarrow decode to Arrow, same concurrency",
            "mbytes": mb,
            "ours_mb_s": round(rate["none"] / 1e6),
            "baseline_mb_s": round(rate["bare"] / 1e6),
            "ratio": round(rate["none"] / rate["bare"], 3),
            "target": 0.8,
        },
        {
            "measure": "Stage from S3 (moto), zstd-1",
            "baseline": "raw aiobotocore GETs (old comparison)",
            "mbytes": mb,
            "ours_mb_s": round(rate["node"] / 1e6),
            "baseline_mb_s": round(rate["raw"] / 1e6),
            "ratio": round(rate["node"] / rate["raw"], 3),
            "target": 0.6,
        },
    ]


def run(mib: int, repeat: int, console: Console) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-staging-"))
    try:
        origin = workdir / "origin"
        console.log(f"writing {mib} MiB (as Arrow) of Parquet token shards")
        write_shards(origin, mib)
        registry = f"file://{workdir}/registry"
        publish(registry, f"file://{origin}", "tokens")
        results = {
            "cpu": cpu_per_gb(origin, registry, repeat, console),
            "scaling": scaling(workdir, registry, repeat, console),
            "moto": moto(workdir, origin, repeat, console),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["cores"] = len(os.sched_getaffinity(0))
    results["cpu_model"] = report.cpu_model()
    results["versions"] = report.versions(
        "pyarrow", "zstandard", "grpcio", "aiobotocore", "moto", "edgecache"
    )
    return results


def show(results: dict, console: Console) -> None:
    cpu = results["cpu"]
    console.print(
        f"(a) {cpu['measure']}, {cpu['source_mb']} MB: before {cpu['before_cpu_s_per_gb']} "
        f"CPU-s/GB ({cpu['before_cpu_s_per_shard']} per shard), after "
        f"{cpu['after_cpu_s_per_gb']} ({cpu['after_cpu_s_per_shard']}): "
        f"{cpu['reduction']}x less (target ≥{cpu['target']}x "
        f"{'✓' if cpu['reduction'] >= cpu['target'] else '✗'})"
    )
    s = results["scaling"]
    if "skipped" in s:
        console.print(f"(b) staging scaling skipped: {s['skipped']}")
    else:
        console.print(
            f"(b) {s['measure']}, {s['source_mb']} MB: 1 core {s['one_core_mb_s']} MB/s, "
            f"2 cores {s['two_cores_mb_s']} MB/s: {s['ratio']}x (target ≥{s['target']} "
            f"{'✓' if s['ratio'] >= s['target'] else '✗'}); node status {s['node_status']}"
        )
    console.print(
        report.ratio_table("(c) staging from moto", results["moto"], ("measure", "baseline"))
    )
    console.print(
        f"{results['cores']} cores ({results['cpu_model']}); versions: "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="Arrow MiB of token shards")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console(stderr=args.json, width=150)
    results = run(args.mib, args.repeat, console)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        show(results, console)


if __name__ == "__main__":
    main()
