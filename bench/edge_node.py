"""Edge node serve and staging speed against bare baselines, in one run.

    python -m bench.edge_node [--read-mib 512] [--stage-mib 256] [--repeat 3] [--json]

(a) ReadShard from a warm cache, with 1 and 4 concurrent client streams,
    against a bare grpcio server-streaming server (bench/grpc_baseline.py)
    sending the same wire bytes from memory. Both servers are separate
    processes; the client code is the same. Target: >= 0.7x.
(b) Staging from moto's S3 server on loopback, including preprocessing
    (Parquet decode, zstd-1 encode, LMDB commit), against raw aiobotocore GETs
    of the same objects at the same concurrency. Target: >= 0.6x. The node's
    own metrics split its time between origin fetches and preprocessing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from bench import report
from bench.arguments import positive_int
from bench.report import ratio_table
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

TESTS = Path(__file__).resolve().parent.parent / "tests"
SHARD_MIB = 32
TOKENS = 2048


SHARD_ROWS = (SHARD_MIB << 20) // (TOKENS * 4)


def write_parquet_shards(root: Path, tables: Iterable[pa.Table]) -> int:
    """Each table as one zstd Parquet shard under ``root``, in order; how many."""
    root.mkdir(parents=True, exist_ok=True)
    count = 0
    for count, table in enumerate(tables, 1):
        pq.write_table(table, root / f"part-{count - 1:05d}.parquet", compression="zstd")
    return count


def shard_count(total_mib: int) -> int:
    """Whole shards of SHARD_MIB for ``total_mib``, at least one (a size rounds down to them)."""
    return max(total_mib // SHARD_MIB, 1)


WHOLE_SHARDS = f"whole {SHARD_MIB} MiB shards, at least one"  # the size flags' help says so


def shards_written(total_mib: int, flag: str) -> str:
    """What a size flag writes, said as it is: ``64 MiB (2 shards of 32 MiB; --mib 70 …)``."""
    count = shard_count(total_mib)
    return (
        f"{count * SHARD_MIB} MiB ({count} shard{'s' * (count != 1)} of {SHARD_MIB} MiB; "
        f"{flag} {total_mib} rounds to them)"
    )


def write_shards(root: Path, total_mib: int) -> int:
    """Parquet token shards (2048 int32 per sample, Zipf ids) of ~SHARD_MIB raw each."""
    rng = np.random.default_rng(0)

    def shard(i: int) -> pa.Table:
        ids = (rng.zipf(1.2, size=SHARD_ROWS * TOKENS) % 50_000).astype(np.int32)
        return pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), TOKENS),
                "label": pa.array(np.arange(i * SHARD_ROWS, (i + 1) * SHARD_ROWS, dtype=np.int64)),
            }
        )

    return write_parquet_shards(root, (shard(i) for i in range(shard_count(total_mib))))


def spawn(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving on"):
        proc.kill()
        raise RuntimeError(f"{args[:4]} did not start: {line!r}")
    return proc, line.split()[-1]


def start_node(
    workdir: Path, name: str, registry: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, str]:
    """An `edgecache serve` subprocess: (process, gRPC address, metrics address)."""
    proc, address = spawn(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "serve",
            "--region",
            "bench",
            "--cache-dir",
            str(workdir / name),
            "--registry",
            registry,
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            "8GiB",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
        ],
        env={**(env or {}), "EDGECACHE_SYNC": "false"},
    )
    assert proc.stdout is not None
    metrics_line = proc.stdout.readline()
    return proc, address, metrics_line.split()[-1]


def publish(registry: str, source: str, dataset: str, compression: str = "zstd") -> int:
    spec = preprocess_spec(
        compression=pb.COMPRESSION_NONE if compression == "none" else pb.COMPRESSION_ZSTD
    )

    manifest = Registry.run(registry, lambda reg: reg.publish(source, dataset, spec=spec))
    return len(manifest.shards)


def read_all(address: str, shards: int, streams: int) -> tuple[int, float]:
    """Read every shard once over ``streams`` concurrent streams; bytes and seconds."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = edge_pb2_grpc.EdgeCacheStub(channel)
    totals = [0] * streams

    def worker(k: int) -> None:
        for shard in range(k, shards, streams):
            for chunk in stub.ReadShard(
                edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=shard)
            ):
                totals[k] += len(chunk.frame)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    channel.close()
    return sum(totals), elapsed


def best(fn: Callable[[], tuple[int, float]], repeat: int) -> tuple[int, float]:
    runs = [fn() for _ in range(repeat)]
    return min(runs, key=lambda r: r[1])


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics").read().decode()
    match = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def bench_read(workdir: Path, read_mib: int, repeat: int, console: Console) -> list[dict]:
    console.log(f"writing {shards_written(read_mib, '--read-mib')} of Parquet token shards")
    write_shards(workdir / "origin", read_mib)
    registry = f"file://{workdir}/registry"
    shards = publish(registry, f"file://{workdir}/origin", "tokens")
    node, address, _ = start_node(workdir, "cache-read", registry)
    baseline = None
    try:
        client = edge_pb2_grpc.EdgeCacheStub(
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        )
        console.log("staging (warming the cache)")
        list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        frames = {
            s: [
                m.SerializeToString()
                for m in client.ReadShard(
                    edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=s)
                )
            ]
            for s in range(shards)
        }
        with open(workdir / "frames.pkl", "wb") as f:
            pickle.dump(frames, f)
        del frames
        baseline, base_address = spawn(
            [sys.executable, "-m", "bench.grpc_baseline", str(workdir / "frames.pkl")]
        )
        results = []
        for streams in (1, 4):
            console.log(f"ReadShard, {streams} stream(s)")
            ours_runs, base_runs = [], []
            for _ in range(repeat):  # interleaved, so drift hits both
                base_runs.append(read_all(base_address, shards, streams))
                ours_runs.append(read_all(address, shards, streams))
            ours, base = min(ours_runs, key=lambda r: r[1]), min(base_runs, key=lambda r: r[1])
            results.append(
                {
                    "measure": f"ReadShard, warm cache, {streams} stream(s)",
                    "baseline": "bare grpcio stream from memory",
                    "mbytes": round(ours[0] / 1e6, 1),
                    "ours_mb_s": round(ours[0] / ours[1] / 1e6),
                    "baseline_mb_s": round(base[0] / base[1] / 1e6),
                    "ratio": round((ours[0] / ours[1]) / (base[0] / base[1]), 3),
                    "target": 0.7,
                }
            )
        return results
    finally:
        for proc in (node, baseline):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def bench_stage(workdir: Path, stage_mib: int, repeat: int, console: Console) -> list[dict]:
    sys.path.insert(0, str(TESTS))
    from s3server import make_bucket, moto_server, s3_env, upload_dir

    with moto_server() as endpoint:
        env = s3_env(endpoint)
        os.environ.update(env)
        console.log(
            f"writing and uploading {shards_written(stage_mib, '--stage-mib')} of Parquet "
            "shards to moto's S3"
        )
        write_shards(workdir / "stage-origin", stage_mib)
        make_bucket(endpoint, "bench-origin")
        upload_dir(endpoint, "bench-origin", "tokens", workdir / "stage-origin")
        registry = "s3://bench-origin/_edgecache"
        codecs = ("zstd", "none")
        for codec in codecs:
            publish(registry, "s3://bench-origin/tokens", f"tokens-{codec}", codec)
        source_bytes = sum(p.stat().st_size for p in (workdir / "stage-origin").iterdir())
        node, address, metrics_address = start_node(workdir, "cache-stage", registry, env=env)
        runs: dict[str, list[tuple[int, float]]] = {c: [] for c in ("raw", *codecs)}
        split: dict[str, float] = {}
        try:
            client = edge_pb2_grpc.EdgeCacheStub(
                grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            )
            for _ in range(repeat):  # interleaved, so drift hits all alike
                runs["raw"].append(asyncio.run(s3_gets("bench-origin", "tokens/", concurrency=4)))
                for codec in codecs:
                    dataset = f"tokens-{codec}"
                    client.Evict(edge_pb2.EvictRequest(dataset=dataset, version=1))
                    before = {
                        n: metric(metrics_address, f"edgecache_{n}_seconds_sum")
                        for n in ("origin_fetch", "preprocess")
                    }
                    started = time.perf_counter()
                    last = list(client.Stage(edge_pb2.StageRequest(dataset=dataset, version=1)))[-1]
                    runs[codec].append((last.bytes_done, time.perf_counter() - started))
                    assert last.finished and not last.failures, last
                    for n, value in before.items():
                        key = f"{codec}_{n}_s"
                        split[key] = (
                            split.get(key, 0.0)
                            + metric(metrics_address, f"edgecache_{n}_seconds_sum")
                            - value
                        )
        finally:
            node.terminate()
            node.wait(timeout=30)
    base = min(runs["raw"], key=lambda r: r[1])
    results = []
    for codec in codecs:
        ours = min(runs[codec], key=lambda r: r[1])
        results.append(
            {
                "measure": f"Stage from S3 (moto), preprocessing to {codec}",
                "baseline": "raw aiobotocore GETs, same objects",
                "mbytes": round(source_bytes / 1e6, 1),
                "ours_mb_s": round(ours[0] / ours[1] / 1e6),
                "baseline_mb_s": round(base[0] / base[1] / 1e6),
                "ratio": round((ours[0] / ours[1]) / (base[0] / base[1]), 3),
                "target": 0.6,
                "seconds_per_run": {
                    "wall": round(ours[1], 2),
                    "origin_fetch_total": round(split[f"{codec}_origin_fetch_s"] / repeat, 2),
                    "preprocess_total": round(split[f"{codec}_preprocess_s"] / repeat, 2),
                },
            }
        )
    return results


async def s3_gets(
    bucket: str, prefix: str, concurrency: int, *, decode: bool = False
) -> tuple[int, float]:
    """GET every Parquet object under ``prefix`` at ``concurrency``: (bytes, seconds).

    The baselines staging is measured against: raw GETs, and (``decode``) GETs
    whose objects pyarrow then decodes to Arrow on every usable core, doing
    nothing else (``bench.staging``'s bare pipeline).
    """
    from concurrent.futures import ThreadPoolExecutor

    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    from edgecache.edge.config import usable_cores

    loop = asyncio.get_running_loop()
    config = AioConfig(max_pool_connections=32)
    with ThreadPoolExecutor(usable_cores()) as pool:
        async with get_session().create_client("s3", config=config) as s3:
            listed = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
            keys = [o["Key"] for o in listed["Contents"] if o["Key"].endswith(".parquet")]
            limit = asyncio.Semaphore(concurrency)
            total = 0

            async def get(key: str) -> None:
                nonlocal total
                async with limit:
                    response = await s3.get_object(Bucket=bucket, Key=key)
                    async with response["Body"] as body:
                        data = await body.read()
                if decode:
                    await loop.run_in_executor(
                        pool, lambda: pq.read_table(pa.BufferReader(data), use_threads=False)
                    )
                total += len(data)  # after the await: `total += len(await …)` loses updates

            started = time.perf_counter()
            await asyncio.gather(*(get(k) for k in keys))
            return total, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--read-mib",
        type=positive_int,
        default=512,
        help=f"raw MiB for the ReadShard part ({WHOLE_SHARDS})",
    )
    parser.add_argument(
        "--stage-mib",
        type=positive_int,
        default=256,
        help=f"raw MiB for the staging part ({WHOLE_SHARDS})",
    )
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console(stderr=args.json, width=150)
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-edge-"))
    try:
        results = bench_read(workdir, args.read_mib, args.repeat, console)
        results += bench_stage(workdir, args.stage_mib, args.repeat, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    versions = report.versions(
        "grpcio", "pyarrow", "zstandard", "lmdb", "aiobotocore", "moto", "edgecache"
    )
    if args.json:
        print(json.dumps({"versions": versions, "results": results}, indent=2))
        return
    title = f"edgecache edge node vs bare baselines (same run, best of {args.repeat})"
    table = ratio_table(title, results, ("measure", "baseline"))
    console.print(table)
    for r in results:
        if "seconds_per_run" in r:
            t = r["seconds_per_run"]
            console.print(
                f"{r['measure']}: {t['wall']} s wall per run; summed over shards in flight: "
                f"origin fetch {t['origin_fetch_total']} s, preprocess {t['preprocess_total']} s"
            )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


if __name__ == "__main__":
    main()
