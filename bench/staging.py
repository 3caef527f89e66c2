"""Staging on many cores: CPU per GB, scaling from 1 to 2 cores, moto against a bare pipeline.

    python -m bench.staging [--mib 256] [--repeat 3] [--json]

Token Parquet shards (bench.edge_node.write_shards: 32 MiB of int32 ids each
as Arrow, ~11 MiB as zstd Parquet), published three times from the same
objects: with the default chunk codec (byte-split + zstd-1), with plain
zstd-1 (every version before byte-split) and uncompressed. All measured in
one run:

(a) CPU seconds per GB of source preprocessed, in process, by the pipeline
    before issue 17 (``ParquetFile.iter_batches`` + serial plain zstd-1
    chunks) and by the node's pipeline now (``edge.preprocessing.encode_raw_shard``:
    ``ParquetFile.read``, chunks encoded on a parts pool, the default codec); beside
    them the node's pipeline with no byte stream stored sparse (what sparse
    streams save), with plain zstd-1, and decoding the Parquet alone (the
    floor no chunk codec can go under). Process CPU time (every
    thread, Arrow's own included: ``iter_batches`` decodes on Arrow's
    threads, which a thread clock misses), best of ``--repeat``,
    interleaved. Target: halved. Then the same once more on the ids of real
    text (at most 64 MiB of them: the standard library's sources through a
    32,000-id BPE trained in the run, ``bench.datasets.text_tokens``), with no
    target: plain zstd-1 finds the phrases real text repeats, so the codec
    gains less there than on the Zipf ids, which repeat nothing.
(b) An ``edgecache serve`` subprocess pinned with ``taskset`` to 1 core and to
    2 cores, staging the default version from file:// (so origin costs no
    CPU), interleaved after two warm-up stages each (a fresh node's first
    stages zero its allocators' new huge pages), best of ``--repeat``:
    source MB/s. Target: 2 cores >= 1.7x. Each round starts once other
    processes leave the CPUs quiet, and is run again (at most 4 times) when
    they took more than a tenth of them meanwhile. The node's own Status
    figures (staging rate, CPU-s per GB) are printed, and this machine's own
    2-core scaling of the same work: the node's pipeline in two processes
    pinned to a core each against one.
(c) Staging from moto's S3 server over loopback (each codec) against a bare
    pipeline that GETs the same objects (aiobotocore, same concurrency) and
    decodes them into Arrow with pyarrow on as many threads, doing nothing
    else. Target: >= 0.8x. Beside it the old comparison with raw GETs (old
    target 0.6x, out of reach on 2 cores with the S3 server on one of them).
(d) What readers pay: ``decode_chunk`` on one thread over every chunk the
    node's pipeline made in (a), default codec against plain zstd-1 (GB/s of
    Arrow data, best of ``--repeat``), and the bytes each stores.
(e) The stages (b) leaves out: a fresh node's first Stage, and a Stage once the
    node has been idle past its purge delay (its idle release gave Arrow's pages
    back), as a node that stages a version now and then does. Each with
    transparent huge pages off (``edgecache``'s default, ``MIMALLOC_ALLOW_THP=0``)
    and allowed (mimalloc's own default), a fresh unpinned node each, alternating,
    the mean of ``--repeat`` (the cost comes in some such Stages and not in
    others): source MB/s and the node's CPU-s per GB. No target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from bench import datasets, report
from bench.arguments import positive_int
from bench.edge_node import (
    SHARD_ROWS,
    TESTS,
    WHOLE_SHARDS,
    s3_gets,
    shards_written,
    spawn,
    write_parquet_shards,
    write_shards,
)
from edgecache.cache import byte_split
from edgecache.cache.codec import COMPRESSIONS, CodecOptions, ShardEncoder, decode_chunk
from edgecache.cache.manifest import manifest_schema, preprocess_spec
from edgecache.cache.preprocess import load_transform
from edgecache.cache.registry import Registry
from edgecache.clients.arrow_pool import ARROW_POOL_OPTIONS
from edgecache.edge.config import usable_cores
from edgecache.edge.idle_memory import purge_delay
from edgecache.edge.preprocessing import encode_raw_shard
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = ["main"]

DEFAULT = CodecOptions().compression
# The dataset name each codec's version is published under, the default first.
DATASETS = {DEFAULT: "tokens", "zstd": "tokens-zstd", "none": "tokens-none"}
TEXT_MIB = 64  # real text's ids for (a) once more: a BPE trains on them in the run


def publish(registry: str, source: str, compression: str) -> None:
    """Publish ``source`` as the version :data:`DATASETS` names for ``compression``."""
    spec = preprocess_spec(compression=COMPRESSIONS[compression])
    Registry.run(registry, lambda reg: reg.publish(source, DATASETS[compression], spec=spec))


def _cpu(work: Callable[[], object]) -> float:
    """Process CPU seconds ``work`` took: every thread's, Arrow's own pools included."""
    started = time.process_time()
    work()
    return time.process_time() - started


def _before(data: bytes, schema: pa.Schema) -> None:
    """The pipeline before issue 17: ``iter_batches`` and serial plain zstd-1 chunks."""
    encoder = ShardEncoder(schema, CodecOptions(compression="zstd"))
    for batch in pq.ParquetFile(pa.BufferReader(data)).iter_batches(batch_size=65536):
        encoder.add(batch)
    encoder.finish()


def cpu_per_gb(
    origin: Path,
    registry: str,
    repeat: int,
    console: Console,
    *,
    source_label: str = "token Parquet",
) -> tuple[dict, dict]:
    """(a), and the frames the node's pipeline made with each codec, for (d)."""
    console.log("(a) CPU per GB: the pipeline before issue 17 and the node's, in process")
    manifests = {
        c: Registry.run(registry, lambda reg, n=name: reg.manifest(n, 1))  # type: ignore[misc]
        for c, name in DATASETS.items()
        if c != "none"
    }
    schema = manifest_schema(manifests[DEFAULT])
    shards = [(s, (origin / s.source_key).read_bytes()) for s in manifests[DEFAULT].shards]
    source = sum(len(d) for _, d in shards)
    transform = load_transform("identity", {})
    frames: dict[str, list[bytes]] = {}
    runs: dict[str, list[float]] = {
        "before": [],
        "after": [],
        "after_dense": [],
        "after_zstd": [],
        "parquet": [],
    }
    with ThreadPoolExecutor(usable_cores()) as parts:

        def node(compression: str) -> tuple[Callable[[], None], Callable[[], None]]:
            manifest = manifests[compression]

            def work() -> None:
                # Each shard's frames are dropped once made, as the node drops them once
                # committed and as "before" does: keeping all of them would charge this
                # side the page faults of ever-growing memory (costly on this VM).
                for shard, data in shards:
                    encode_raw_shard(data, manifest, shard, shard.source_key, transform, parts)

            def keep() -> None:  # the warm-up pass: the frames (d) decodes
                frames[compression] = [
                    f
                    for shard, data in shards
                    for f in encode_raw_shard(
                        data, manifest, shard, shard.source_key, transform, parts
                    ).frames
                ]

            return work, keep

        def parquet_alone() -> None:  # each table dropped once read, like the others
            for _, data in shards:
                pq.read_table(pa.BufferReader(data), use_threads=False)

        after, after_keep = node(DEFAULT)
        after_zstd, after_zstd_keep = node("zstd")
        work = {
            "before": lambda: [_before(data, schema) for _, data in shards],
            "after": after,
            "after_dense": lambda: _dense_streams(after),
            "after_zstd": after_zstd,
            "parquet": parquet_alone,
        }
        # Warm-up (imports, Arrow's pools, first allocations); the node's passes keep
        # their frames for (d).
        for warm_up in (work["before"], after_keep, after_zstd_keep, work["parquet"]):
            warm_up()
        for _ in range(repeat):  # interleaved, so drift hits all alike
            for name, fn in work.items():
                runs[name].append(_cpu(fn))
    per_gb = {name: min(r) / source * 1e9 for name, r in runs.items()}
    return {
        "measure": f"preprocess CPU-s per GB of source ({source_label} → {DEFAULT}-1 chunks)",
        "clock": "process CPU time (all threads)",
        "source_mb": round(source / 1e6, 1),
        "shards": len(shards),
        "before_cpu_s_per_gb": round(per_gb["before"], 2),
        "after_cpu_s_per_gb": round(per_gb["after"], 2),
        "after_dense_cpu_s_per_gb": round(per_gb["after_dense"], 2),
        "after_zstd_cpu_s_per_gb": round(per_gb["after_zstd"], 2),
        "parquet_decode_cpu_s_per_gb": round(per_gb["parquet"], 2),
        "before_cpu_s_per_shard": round(min(runs["before"]) / len(shards), 3),
        "after_cpu_s_per_shard": round(min(runs["after"]) / len(shards), 3),
        "reduction": round(per_gb["before"] / per_gb["after"], 2),
        "codec_reduction": round(
            (per_gb["after_zstd"] - per_gb["parquet"]) / (per_gb["after"] - per_gb["parquet"]), 2
        ),
        "ceiling": round(per_gb["before"] / per_gb["parquet"], 2),
        "target": 2.0,
    }, frames


def _dense_streams(work: Callable[[], None]) -> None:
    """``work`` with no byte stream stored sparse: what sparse streams save, in the same run."""
    share = byte_split.SPARSE_SHARE
    byte_split.SPARSE_SHARE = -1.0  # no stream has a negative share of non-zero bytes
    try:
        work()
    finally:
        byte_split.SPARSE_SHARE = share


def decode_speed(frames: dict[str, list[bytes]], repeat: int, console: Console) -> dict:
    """(d): one thread decoding every chunk, default codec against plain zstd-1."""
    console.log("(d) reader decode: decode_chunk on one thread, each codec's chunks")
    schema = decode_chunk(frames[DEFAULT][0]).schema
    arrow = sum(decode_chunk(f, schema).nbytes for f in frames[DEFAULT])
    best = {c: float("inf") for c in frames}
    for _ in range(repeat):
        for codec, chunks in frames.items():
            started = time.perf_counter()
            for frame in chunks:
                decode_chunk(frame, schema)
            best[codec] = min(best[codec], time.perf_counter() - started)
    stored = {c: sum(map(len, f)) for c, f in frames.items()}
    return {
        "measure": "decode_chunk, 1 thread, GB/s of Arrow data",
        "arrow_mb": round(arrow / 1e6, 1),
        "zstd_gb_s": round(arrow / best["zstd"] / 1e9, 2),
        f"{DEFAULT}_gb_s": round(arrow / best[DEFAULT] / 1e9, 2),
        "ratio": round(best["zstd"] / best[DEFAULT], 2),
        "zstd_stored_mb": round(stored["zstd"] / 1e6, 1),
        f"{DEFAULT}_stored_mb": round(stored[DEFAULT] / 1e6, 1),
        "zstd_compression": round(arrow / stored["zstd"], 2),
        f"{DEFAULT}_compression": round(arrow / stored[DEFAULT], 2),
        "target": 1.0,
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


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)  # minus idle and iowait


def _process_jiffies(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _stage_watched(client: edge_pb2_grpc.EdgeCacheStub, pid: int) -> tuple[int, float, float]:
    """:func:`_stage`, and the share of the machine's CPUs other processes used meanwhile.

    Staging runs at nice +10: whatever else this shared machine runs takes its
    CPUs first, so a run with others busy says little about the node.
    """
    busy0, total0 = _busy_jiffies()
    own0 = _process_jiffies(pid)
    nbytes, seconds = _stage(client)
    busy1, total1 = _busy_jiffies()
    others = (busy1 - busy0 - (_process_jiffies(pid) - own0)) / max(total1 - total0, 1)
    return nbytes, seconds, max(others, 0.0)


# A round with more of the CPUs taken by other processes than this is run again (at most
# QUIET_TRIES times): on this shared VM outside load of 0.5-1.9 cores came and went for
# minutes, invisible to ps, and at nice +10 a 2-core node gave its second core away to it
# while a 1-core node, pinned to the other core, lost nothing (helper 12's profile, stop
# 53: 76-114 MB/s on 2 cores against 94-132 on 1 with others at 0.4-0.6).
QUIET = 0.05
QUIET_TRIES = 4
WARM_UP_STAGES = 2  # stages of each node before the rounds (scaling() says why)


def _quiet(wait: float = 30.0) -> None:
    """Until other processes use under QUIET of the CPUs over a 0.3 s look (at most ``wait``)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        busy0, total0 = _busy_jiffies()
        time.sleep(0.3)
        busy1, total1 = _busy_jiffies()
        if (busy1 - busy0) / max(total1 - total0, 1) < QUIET:
            return


def _quiet_round(work: Callable[[], tuple[int, float, float]]) -> tuple[int, float, float, int]:
    """``work`` run when the machine is quiet, again while others took the CPUs; and the tries."""
    tries = 0
    while True:
        _quiet()
        nbytes, seconds, others = work()
        tries += 1
        if others <= 2 * QUIET or tries == QUIET_TRIES:
            return nbytes, seconds, others, tries


def _pipeline_pass(origin: str, registry: str) -> None:
    """One pass of the node's pipeline over every shard on one thread: prints bytes, seconds.

    Run in a process of its own pinned to one core, alone and two at once on two
    cores (:func:`ceiling`): what this machine gives the same work on its second
    core, with nothing shared between the two (no GIL, no allocator, no LMDB).
    """
    manifest = Registry.run(registry, lambda reg: reg.manifest(DATASETS[DEFAULT], 1))
    shards = [(s, (Path(origin) / s.source_key).read_bytes()) for s in manifest.shards]
    transform = load_transform("identity", {})
    with ThreadPoolExecutor(1) as parts:
        for shard, data in shards[:2]:  # warm-up: imports, Arrow's pools
            encode_raw_shard(data, manifest, shard, shard.source_key, transform, parts)
        started = time.perf_counter()
        for shard, data in shards:
            encode_raw_shard(data, manifest, shard, shard.source_key, transform, parts)
        seconds = time.perf_counter() - started
    print(json.dumps([sum(len(d) for _, d in shards), seconds]))


def ceiling(origin: Path, registry: str, cores: list[int], repeat: int) -> float:
    """This machine's own 2-core scaling for the node's work: two processes ÷ one, best rounds.

    The node cannot scale past what the second core gives the same work with
    nothing shared; on this VM that was 1.73-1.91x (each core 4-14 % slower with
    both busy), so a 2-core node at 1.6x had ~90 % of it.
    """

    def passes(on: list[int]) -> tuple[int, float, float]:
        code = (
            "from bench.staging import _pipeline_pass; "
            f"_pipeline_pass({str(origin)!r}, {registry!r})"
        )
        busy0, total0 = _busy_jiffies()
        procs = [
            subprocess.Popen(
                ["taskset", "-c", str(core), sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                cwd=Path(__file__).resolve().parents[1],
                env={"MIMALLOC_PURGE_DELAY": "10000", **os.environ},  # as the node runs it
            )
            for core in on
        ]
        try:
            outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
        finally:  # one that failed or hung: the other is not left running
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        busy1, total1 = _busy_jiffies()
        own = len(on) / len(cores)  # what the passes themselves used, at most
        others = max((busy1 - busy0) / max(total1 - total0, 1) - own, 0.0)
        return sum(b for b, _ in outs), max(s for _, s in outs), others

    best: dict[int, float] = {}
    for _ in range(repeat):
        for count in (1, 2):
            nbytes, seconds, _, _ = _quiet_round(lambda c=count: passes(cores[:c]))
            best[count] = max(best.get(count, 0.0), nbytes / seconds)
    return best[2] / best[1]


def scaling(workdir: Path, registry: str, repeat: int, console: Console) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return {"measure": "staging scaling", "skipped": "needs 2 cores and taskset"}
    console.log(f"(b) staging from file:// with the node pinned to 1 and 2 of cores {cores}")
    sets = {"1 core": str(cores[0]), "2 cores": f"{cores[0]},{cores[1]}"}
    nodes = {label: _node(workdir, label.replace(" ", "-"), registry, cpus, {})
             for label, cpus in sets.items()}  # fmt: skip
    runs: dict[str, list[tuple[int, float, float, int]]] = {label: [] for label in sets}
    status = {}
    try:
        for _, client in nodes.values():
            # Warm-up: imports, and the allocators' first pages. A fresh node's first stages
            # zero the huge pages its allocators take as they grow: perf on a 2-core node,
            # clear_page_erms under do_huge_pmd_anonymous_page was 29 % of its CPU in its
            # first stage (18.9 CPU-s/GB), 7.6 % in its second (11.9), none in its third
            # (10.7; a 1-core node in flight holds less and settles sooner). Huge pages are
            # off by default since (clients/cli), and a first Stage still faults its buffers
            # in: (e) measures first Stages. The rounds measure settled staging.
            for _ in range(WARM_UP_STAGES):
                _stage(client)
        for _ in range(repeat):
            for label, (proc, client) in nodes.items():
                runs[label].append(_quiet_round(lambda c=client, p=proc: _stage_watched(c, p.pid)))
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
    console.log("(b) the machine's own 2-core scaling: the node's pipeline in 1 and 2 processes")
    machine = ceiling(workdir / "origin", registry, cores, repeat)
    best = {label: min(r, key=lambda x: x[1]) for label, r in runs.items()}
    rate = {label: b / s for label, (b, s, _, _) in best.items()}
    ratio = rate["2 cores"] / rate["1 core"]
    return {
        "measure": "Stage from file://, node pinned with taskset",
        "source_mb": round(best["1 core"][0] / 1e6, 1),
        "one_core_mb_s": round(rate["1 core"] / 1e6, 1),
        "two_cores_mb_s": round(rate["2 cores"] / 1e6, 1),
        "ratio": round(ratio, 2),
        "target": 1.7,
        "others_cpu_share": {label: round(o, 2) for label, (_, _, o, _) in best.items()},
        "rounds_run_again": sum(t - 1 for r in runs.values() for *_, t in r),
        "machine_two_core_ratio": round(machine, 2),
        "of_machine": round(ratio / machine, 2),
        "node_status": status,
    }


IDLE_MARGIN = 1.0  # seconds past the node's purge delay: its idle release has run by then


def _stage_cpu(client: edge_pb2_grpc.EdgeCacheStub, pid: int) -> tuple[int, float, float]:
    """:func:`_stage` once the machine is quiet: (bytes, seconds, the node's CPU seconds)."""
    _quiet()
    own = _process_jiffies(pid)
    nbytes, seconds = _stage(client)
    return nbytes, seconds, (_process_jiffies(pid) - own) / os.sysconf("SC_CLK_TCK")


def unsettled(workdir: Path, registry: str, repeat: int, console: Console) -> dict:
    """(e) A fresh node's first Stage and a Stage after its idle release, huge pages off/allowed."""
    # The delay the nodes run with: the environment's, else what `edgecache` sets.
    delay = purge_delay({**ARROW_POOL_OPTIONS, **os.environ})
    if delay is None:
        return {"skipped": "MIMALLOC_PURGE_DELAY < 0: nodes never give Arrow's pages back"}
    idle = delay + IDLE_MARGIN
    console.log(
        "(e) a fresh node's first Stage and one after an idle release: huge pages off and allowed"
    )
    settings = {"off": {}, "allowed": {"MIMALLOC_ALLOW_THP": "1"}}
    runs: dict[str, dict[str, list[tuple[int, float, float]]]] = {
        label: {"first": [], "after_idle": []} for label in settings
    }
    for i in range(repeat):
        for label, env in settings.items():  # alternating, so drift hits both alike
            proc, client = _node(workdir, f"unsettled-{label}-{i}", registry, None, env)
            try:
                runs[label]["first"].append(_stage_cpu(client, proc.pid))
                time.sleep(idle)
                runs[label]["after_idle"].append(_stage_cpu(client, proc.pid))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    out: dict = {
        "measure": "Stage from file://, a fresh node's first and one after an idle release",
        "idle_s": idle,
        "stages": repeat,
    }
    nbytes = runs["off"]["first"][0][0]  # every Stage stages the same version
    out["source_mb"] = round(nbytes / 1e6, 1)
    for label, stages in runs.items():
        for stage, r in stages.items():
            # The mean, not the best: the cost measured here comes in some such stages and
            # not in others, and the best of a few would show only those that escaped it.
            out[f"{label}_{stage}_mb_s"] = round(nbytes * len(r) / sum(x[1] for x in r) / 1e6, 1)
            out[f"{label}_{stage}_cpu_s_per_gb"] = round(
                sum(x[2] for x in r) / len(r) / nbytes * 1e9, 2
            )
    for stage in ("first", "after_idle"):
        out[f"{stage}_ratio"] = round(out[f"off_{stage}_mb_s"] / out[f"allowed_{stage}_mb_s"], 2)
    return out


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
        for compression in DATASETS:
            publish(registry, "s3://bench-origin/tokens", compression)
        proc, client = _node(workdir, "cache-s3", registry, None, env)
        runs: dict[str, list[tuple[int, float]]] = {"bare": [], "raw": []}
        runs.update({c: [] for c in DATASETS})
        try:
            for name in DATASETS.values():
                _stage(client, name)  # warm-up; the node measures the link on it too
            for _ in range(repeat):
                runs["raw"].append(asyncio.run(s3_gets("bench-origin", "tokens/", 4)))
                runs["bare"].append(asyncio.run(s3_gets("bench-origin", "tokens/", 4, decode=True)))
                for compression, name in DATASETS.items():
                    runs[compression].append(_stage(client, name))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    rate = {k: (lambda b: b[0] / b[1])(min(v, key=lambda x: x[1])) for k, v in runs.items()}
    mb = round(min(runs[DEFAULT], key=lambda x: x[1])[0] / 1e6, 1)
    label = {DEFAULT: f"{DEFAULT}-1 (default)", "zstd": "zstd-1", "none": "uncompressed chunks"}
    rows = [
        {
            "measure": f"Stage from S3 (moto), {label[compression]}",
            "compression": compression,
            "baseline": "GET + pyarrow decode to Arrow, same concurrency",
            "mbytes": mb,
            "ours_mb_s": round(rate[compression] / 1e6),
            "baseline_mb_s": round(rate["bare"] / 1e6),
            "ratio": round(rate[compression] / rate["bare"], 3),
            "target": 0.8 if compression == DEFAULT else None,
        }
        for compression in DATASETS
    ]
    rows.append(
        {
            "measure": f"Stage from S3 (moto), {label[DEFAULT]}",
            "compression": DEFAULT,
            "baseline": "raw aiobotocore GETs (old comparison)",
            "mbytes": mb,
            "ours_mb_s": round(rate[DEFAULT] / 1e6),
            "baseline_mb_s": round(rate["raw"] / 1e6),
            "ratio": round(rate[DEFAULT] / rate["raw"], 3),
            "target": 0.6,
        }
    )
    return rows


def text_cpu_per_gb(workdir: Path, mib: int, repeat: int, console: Console) -> dict:
    """(a) once more on the ids of real text, reported beside the target's Zipf ids.

    Plain zstd-1, the pipeline before issue 17, finds the phrases real text repeats,
    so the codec gains less there than on ids drawn independently: the target is
    measured on the Zipf ids, and this says what a corpus of real text would see.
    """
    console.log(f"(a) on real text: {mib} MiB of the standard library's token ids")
    origin = workdir / "origin-text"
    table = pa.Table.from_batches(datasets.text_tokens(mib << 20))
    # Shards as large as the Zipf ones (write_shards), their rows in order.
    starts = range(0, table.num_rows, SHARD_ROWS)
    write_parquet_shards(origin, (table.slice(start, SHARD_ROWS) for start in starts))
    registry = f"file://{workdir}/registry-text"
    for compression in DATASETS:
        if compression != "none":
            publish(registry, f"file://{origin}", compression)
    cpu, _ = cpu_per_gb(origin, registry, repeat, console, source_label="real text's token Parquet")
    return cpu


def run(mib: int, repeat: int, console: Console) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-staging-"))
    try:
        origin = workdir / "origin"
        console.log(f"writing {shards_written(mib, '--mib')} (as Arrow) of Parquet token shards")
        write_shards(origin, mib)
        registry = f"file://{workdir}/registry"
        for compression in DATASETS:
            publish(registry, f"file://{origin}", compression)
        cpu, frames = cpu_per_gb(origin, registry, repeat, console)
        results = {
            "cpu": cpu,
            "cpu_text": text_cpu_per_gb(workdir, min(mib, TEXT_MIB), repeat, console),
            "decode": decode_speed(frames, repeat, console),
            "scaling": scaling(workdir, registry, repeat, console),
            "unsettled": unsettled(workdir, registry, repeat, console),
            "moto": moto(workdir, origin, repeat, console),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["cores"] = len(os.sched_getaffinity(0))
    results["cpu_model"] = report.cpu_model()
    results["versions"] = report.versions(
        "pyarrow", "zstandard", "numpy", "grpcio", "aiobotocore", "moto", "edgecache"
    )
    return results


def _met(value: float, target: float) -> str:
    return f"(target ≥{target}x {'✓' if value >= target else '✗'})"


def show(results: dict, console: Console) -> None:
    cpu = results["cpu"]
    console.print(
        f"(a) {cpu['measure']}, {cpu['source_mb']} MB in {cpu['shards']} shards, "
        f"{cpu['clock']}: before {cpu['before_cpu_s_per_gb']} CPU-s/GB "
        f"({cpu['before_cpu_s_per_shard']} per shard), after {cpu['after_cpu_s_per_gb']} "
        f"({cpu['after_cpu_s_per_shard']}): {cpu['reduction']}x less "
        f"{_met(cpu['reduction'], cpu['target'])}. Same pipeline with no stream sparse: "
        f"{cpu['after_dense_cpu_s_per_gb']}; with plain zstd-1: "
        f"{cpu['after_zstd_cpu_s_per_gb']}; Parquet decode alone: "
        f"{cpu['parquet_decode_cpu_s_per_gb']} (no codec can beat {cpu['ceiling']}x); "
        f"the chunk codec's own CPU {cpu['codec_reduction']}x less than plain zstd-1's"
    )
    text = results.get("cpu_text")
    if text:
        console.print(
            f"(a) on real text's ids (the standard library's sources through a 32,000-id BPE, "
            f"no target), {text['source_mb']} MB in {text['shards']} shards: before "
            f"{text['before_cpu_s_per_gb']} CPU-s/GB, after {text['after_cpu_s_per_gb']}: "
            f"{text['reduction']}x less; plain zstd-1 {text['after_zstd_cpu_s_per_gb']}; "
            f"Parquet decode alone {text['parquet_decode_cpu_s_per_gb']}"
        )
    d = results["decode"]
    console.print(
        f"(d) {d['measure']}, {d['arrow_mb']} MB: plain zstd-1 {d['zstd_gb_s']}, "
        f"{DEFAULT}-1 {d[f'{DEFAULT}_gb_s']}: {d['ratio']}x {_met(d['ratio'], d['target'])}; "
        f"stored {d['zstd_stored_mb']} MB ({d['zstd_compression']}x) vs "
        f"{d[f'{DEFAULT}_stored_mb']} MB ({d[f'{DEFAULT}_compression']}x)"
    )
    s = results["scaling"]
    if "skipped" in s:
        console.print(f"(b) staging scaling skipped: {s['skipped']}")
    else:
        console.print(
            f"(b) {s['measure']}, {s['source_mb']} MB: 1 core {s['one_core_mb_s']} MB/s, "
            f"2 cores {s['two_cores_mb_s']} MB/s: {s['ratio']}x {_met(s['ratio'], s['target'])}"
            f"; other processes used {s['others_cpu_share']} of the CPUs in those runs "
            f"({s['rounds_run_again']} rounds run again for others' load); this machine's own "
            f"2-core scaling of the same work (two processes ÷ one): "
            f"{s['machine_two_core_ratio']}x, the node {s['of_machine']} of it"
            f"; node status {s['node_status']}"
        )
    u = results.get("unsettled")
    if u and "skipped" in u:
        console.print(f"(e) first Stages skipped: {u['skipped']}")
    elif u:
        console.print(
            f"(e) {u['measure']} ({u['idle_s']:.0f} s idle), {u['source_mb']} MB, "
            "transparent huge pages off (the default) against allowed (mimalloc's default): "
            f"first {u['off_first_mb_s']} MB/s ({u['off_first_cpu_s_per_gb']} CPU-s/GB) vs "
            f"{u['allowed_first_mb_s']} ({u['allowed_first_cpu_s_per_gb']}): "
            f"{u['first_ratio']}x; after idle {u['off_after_idle_mb_s']} "
            f"({u['off_after_idle_cpu_s_per_gb']}) vs {u['allowed_after_idle_mb_s']} "
            f"({u['allowed_after_idle_cpu_s_per_gb']}): {u['after_idle_ratio']}x"
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
    parser.add_argument(
        "--mib",
        type=positive_int,
        default=256,
        help=f"Arrow MiB of token shards ({WHOLE_SHARDS})",
    )
    parser.add_argument("--repeat", type=positive_int, default=3)
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
