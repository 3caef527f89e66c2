"""The orchestrator of ``python -m bench.peers``: data, conversions, the node, epochs, report.

It generates both datasets, converts them (see :mod:`bench.peers.formats`),
publishes and stages them into one edge node subprocess the way
``bench.dataset`` does, runs every (dataset, workers, system) configuration
in a process of its own (:mod:`bench.peers.epoch`), systems interleaved so
that drift on this shared machine hits all alike, then prints the tables and
writes the JSON. Everything it creates lives in one temporary folder, removed
at the end, and the node is stopped whatever happens.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import bench.peers
from bench import report
from bench.arguments import (
    non_negative_int,
    positive_float,
    positive_int,
    require_modules,
    some_data,
    workers_list,
)
from bench.dataset import Data, publish
from bench.peers.data import KINDS, Source, generate
from bench.peers.epoch import RESULT, run_epoch
from bench.peers.formats import CONVERTERS, Converted
from bench.peers.loaders import EDGECACHE, PEERS, SYSTEMS, Spec, preload
from bench.peers.memory import TreeMemory
from bench.peers.printing import machine, print_report
from bench.peers.targets import LABELS, TARGETS, checks, memory, ratios, worker_scaling

__all__ = ["TARGETS", "main", "ratios"]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "torch",
    "numpy",
    "pyarrow",
    "mosaicml-streaming",
    "litdata",
    "webdataset",
    "transformers",
    "grpcio",
    "lmdb",
    "zstandard",
    "edgecache",
)
SMOKE_MIB = 4
UNCOMPRESSED = "tokens-none"  # the tokens, published again with compression none


def systems_for(dataset: str, systems: Sequence[str], workers: int | None = None) -> list[str]:
    """The systems that read ``dataset`` (with ``workers``, when given).

    Images are always cached uncompressed. The low-memory settings are read for
    tokens (the memory target's data) in one process: with one lane, DataLoader
    workers would each read every window (lanes are what workers divide).
    """
    tokens_only = ("edgecache-lmdb-none", "edgecache-lmdb-lowmem")
    return [
        s
        for s in systems
        if not (dataset == "images" and s in tokens_only)
        and not (s == "edgecache-lmdb-lowmem" and workers not in (None, 0))
    ]


# ------------------------------------------------------------------ data


def _convert(system: str, source: Source, out: Path) -> Converted:
    """Top level, so that a process pool can run it."""
    return CONVERTERS[system](source, out)


class _Inline:
    """The part of ProcessPoolExecutor that prepare_data uses, run in this process."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def prepare_data(
    workdir: Path,
    tokens_mib: int,
    images_mib: int,
    peers: Sequence[str],
    console: Any,
    *,
    parallel: bool = True,
) -> tuple[list[Source], dict[str, dict[str, Converted]]]:
    """Generate the datasets and convert them, two processes at a time when ``parallel``.

    Generating tokens (Zipf ids) is the slowest step; the images are generated
    and converted on the other core meanwhile. Nothing here is measured. A
    dataset of 0 MiB is left out (measured was a 1-sample dataset, its rows
    reported as missed targets).
    """
    formats: dict[str, dict[str, Converted]] = {"tokens": {}, "images": {}}
    sources: dict[str, Source] = {}
    context = multiprocessing.get_context("fork")  # no threads or channels exist yet
    pool = ProcessPoolExecutor(2, mp_context=context) if parallel else _Inline()
    with pool:
        generating = {
            name: pool.submit(generate, workdir, name, mib)
            for name, mib in (("tokens", tokens_mib), ("images", images_mib))
            if mib > 0
        }
        converting: dict[tuple[str, str], Future[Converted]] = {}
        for name in [n for n in ("images", "tokens") if n in generating]:  # images first
            sources[name] = source = generating[name].result()
            console.log(
                f"generated {source.rows:,} {name} samples ({source.raw_bytes / 1e6:,.0f} MB)"
            )
            for system in peers:
                out = workdir / f"{name}-{system}"
                converting[(name, system)] = pool.submit(_convert, system, source, out)
        for (name, system), future in converting.items():
            formats[name][system] = converted = future.result()
            console.log(
                f"wrote {name} as {system}: {converted.disk_bytes / 1e6:,.0f} MB "
                f"in {converted.seconds:.1f} s"
            )
    return [sources[n] for n in ("tokens", "images") if n in sources], formats


# ------------------------------------------------------------------ edgecache


def stage_edgecache(
    workdir: Path, sources: Sequence[Source], console: Any, *, uncompressed_tokens: bool = False
) -> tuple[Any, dict[str, Data], dict[str, float]]:
    """Publish every source from its file:// Parquet origin and Stage it into a new node.

    Tokens are cached with the default chunk codec (byte-split + zstd-1) and
    images uncompressed; with ``uncompressed_tokens`` the tokens are also
    published a second time, uncompressed, as ``tokens-none``.
    """
    from edgecache.cache.codec import COMPRESSIONS
    from edgecache.cache.manifest import preprocess_spec
    from edgecache.cache.store import CacheStore
    from edgecache.clients.node_client import connect, start_local_node
    from edgecache.v1 import edge_pb2
    from edgecache.v1 import manifest_pb2 as pb

    registry = f"file://{workdir}/registry"
    entries = [(s.name, s, COMPRESSIONS[KINDS[s.name][2]]) for s in sources]
    if uncompressed_tokens:
        entries += [(UNCOMPRESSED, s, pb.COMPRESSION_NONE) for s in sources if s.name == "tokens"]
    published: dict[str, Data] = {}
    for name, s, codec in entries:
        manifest = publish(
            registry, f"file://{s.parquet}", name, preprocess_spec(compression=codec)
        )
        published[name] = Data(
            name, manifest.version, s.batch_size, s.rows, s.raw_bytes, s.parquet_bytes
        )
    total = sum(d.raw_bytes for d in published.values())
    capacity = f"{max(8, 2 * total // (1 << 30) + 1)}GiB"
    node = start_local_node("bench", workdir / "cache", registry, capacity=capacity)
    stage_seconds: dict[str, float] = {}
    try:
        stub = connect(node.address)
        for data in published.values():
            started = time.perf_counter()
            request = edge_pb2.StageRequest(dataset=data.name, version=data.version)
            last = list(stub.Stage(request))[-1]
            if not last.finished or last.failures:
                raise RuntimeError(f"staging {data.name}@{data.version} failed: {last}")
            stage_seconds[data.name] = time.perf_counter() - started
            console.log(f"staged {data.name}@{data.version} in {stage_seconds[data.name]:.1f} s")
        with CacheStore(workdir / "cache", readonly=True) as store:
            for data in published.values():
                shards = store.shards(data.name, data.version)
                data.shards = len(shards)
                data.cached_bytes = sum(s.stored_bytes for s in shards)
    except BaseException:
        node.stop()
        raise
    return node, published, stage_seconds


# ------------------------------------------------------------------ epochs


def _epoch_in_subprocess(spec: Spec, repeat: int, budget: float, timeout: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.peers.epoch",
            json.dumps(spec.to_dict()),
            str(repeat),
            str(budget),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(
        f"epoch {spec.system} {spec.dataset} workers={spec.workers} failed "
        f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    )


def run_one(
    spec: Spec,
    *,
    in_process: bool,
    node_pid: int | None,
    repeat: int = 1,
    budget: float = 0.0,
    timeout: float = 600,
) -> dict[str, Any]:
    """One configuration's epochs; when the node serves them, its memory and CPU too.

    The node's CPU seconds cover all the configuration's epochs; they are
    divided by their number to give a per-epoch figure.
    """
    serving = node_pid is not None and spec.system == "edgecache-grpc"
    watch = TreeMemory(node_pid) if serving else None
    cpu = _process_cpu(node_pid) if serving and node_pid else 0.0
    if watch:
        watch.__enter__()
    try:
        result = (
            run_epoch(spec, repeat=repeat, budget=budget)
            if in_process
            else _epoch_in_subprocess(spec, repeat, budget, timeout)
        )
    finally:
        if watch:
            watch.__exit__(None, None, None)
    if watch and node_pid:
        figures = watch.figures()
        result["node_peak_rss_mb"] = figures["peak_rss_mb"]
        result["node_peak_anon_mb"] = figures["peak_anon_mb"]
        result["node_cpu_s"] = round((_process_cpu(node_pid) - cpu) / result["epochs"], 2)
    return result


def bare_stream(
    workdir: Path,
    node: Any,
    data: Data,
    source: Source,
    *,
    repeat: int,
    timeout: float,
    streams: Sequence[int] = (1, 2),
) -> dict[str, Any]:
    """A bare grpcio stream of the version's wire bytes (bench.peers.bare), best over ``streams``.

    ``samples_s`` is the source's rows over the seconds it took to receive them all:
    the rate at which edgecache's gRPC reader would deliver samples if reading
    cost nothing beyond grpcio's own receiving.
    """
    from bench.peers import bare

    messages = workdir / f"{data.name}-messages.pkl"
    wire = bare.dump_messages(node.address, data.name, data.version, data.shards, messages)
    server, address = bare.start_server(messages)
    try:
        results = []
        for n in streams:
            cpu = _process_cpu(server.pid)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.peers.bare",
                    address,
                    data.name,
                    str(data.version),
                    str(data.shards),
                    str(n),
                    str(max(repeat, 1)),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
            if line is None:
                raise RuntimeError(f"bench.peers.bare failed:\n{proc.stderr[-3000:]}")
            result = json.loads(line[len(RESULT) :])
            result["server_cpu_s"] = round((_process_cpu(server.pid) - cpu) / result["passes"], 2)
            results.append(result)
    finally:
        server.terminate()
        server.wait(timeout=30)
        messages.unlink(missing_ok=True)
    best = min(results, key=lambda r: r["seconds"])
    gb = source.raw_bytes / 1e9
    return {
        "dataset": source.name,
        "streams": best["streams"],
        "wire_mb": round(wire / 1e6, 1),
        "seconds": round(best["seconds"], 4),
        "samples_s": round(source.rows / best["seconds"], 1),
        "mb_s": round(source.raw_bytes / best["seconds"] / 1e6, 1),
        "wire_mb_s": round(wire / best["seconds"] / 1e6, 1),
        "cpu_s": round(best["cpu_s"], 2),
        "cpu_s_per_gb": round(best["cpu_s"] / gb, 2),
        "server_cpu_s": best["server_cpu_s"],
        "all": results,
    }


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def best_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest round of each (dataset, system, workers), with how many rounds ran."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    counts: dict[tuple[str, str, int], int] = {}
    for r in runs:
        key = (r["dataset"], r["system"], r["workers"])
        counts[key] = counts.get(key, 0) + 1
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    return [{**r, "rounds": counts[k]} for k, r in best.items()]


# ------------------------------------------------------------------ report


# ------------------------------------------------------------------ main


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=bench.peers.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokens-mib", type=non_negative_int, default=1024, help="raw MiB of token data"
    )
    parser.add_argument(
        "--images-mib", type=non_negative_int, default=1024, help="raw MiB of image data"
    )
    parser.add_argument(
        "--workers", default="0,2", help="DataLoader num_workers values, comma-separated"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="systems to run, comma-separated"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="epochs per configuration in its process, while under --budget; fastest kept",
    )
    parser.add_argument(
        "--budget", type=float, default=8.0, help="seconds of epochs after which not to repeat"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved passes over every configuration; the fastest of each is kept",
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run epochs in this process (faster to start; memory figures then include leftovers)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=900, help="seconds allowed per process"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_MIB} MiB of each, one epoch each, in-process: proves it runs, no more",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens_mib = args.images_mib = SMOKE_MIB
        args.in_process = True
        args.repeat = args.rounds = 1
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    some_data(parser, args.tokens_mib, args.images_mib)
    args.workers = workers_list(parser, args.workers)
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    modules = ["psutil", *(m for s in args.systems for m in _NEEDS.get(s, ()))]
    require_modules(parser, modules, f"bench.peers --systems {','.join(args.systems)}")
    return args


# What each peer imports beyond edgecache's own (bench/requirements.txt installs them).
_NEEDS = {
    "mds": ("streaming", "transformers"),
    "mds-zstd": ("streaming", "transformers"),
    "litdata": ("litdata",),
    "webdataset": ("webdataset", "braceexpand"),
}


def _spec(
    system: str,
    source: Source,
    workers: int,
    workdir: Path,
    formats: dict[str, dict[str, Converted]],
    published: dict[str, Data],
    node: Any,
) -> Spec:
    name = UNCOMPRESSED if system == "edgecache-lmdb-none" else source.name
    if system == "edgecache-grpc":
        location = node.address
    elif system in EDGECACHE:
        location = f"lmdb://{workdir / 'cache'}"
    else:
        location = str(formats[source.name][system].path)
    return Spec(
        system=system,
        dataset=source.name,
        location=location,
        version=f"{name}@{published[name].version}" if name in published else "",
        batch_size=source.batch_size,
        workers=workers,
        rows=source.rows,
        raw_bytes=source.raw_bytes,
        label_sum=source.label_sum,
    )


def _streaming_locks() -> set[Path]:
    """The lock files MosaicML Streaming leaves in the temp folder, 16 for each run with MDS.

    Its datasets name their shared memory by a prefix and lock it with
    ``<prefix>_barrier_filelock`` and ``<prefix>_cache_filelock``, never removed:
    350 had piled up on this machine. A run removes the ones it made.
    """
    root = Path(tempfile.gettempdir())
    return {*root.glob("*_barrier_filelock"), *root.glob("*_cache_filelock")}


def run(args: argparse.Namespace, workdir: Path, console: Any) -> dict[str, Any]:
    """Everything but the printing; the JSON document."""
    started = time.perf_counter()
    locks_before = _streaming_locks()
    peers = [s for s in args.systems if s in PEERS]
    sources, formats = prepare_data(
        workdir, args.tokens_mib, args.images_mib, peers, console, parallel=not args.smoke
    )
    node = None
    published: dict[str, Data] = {}
    stage_seconds: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    bare: dict[str, dict[str, Any]] = {}
    try:
        if any(s in EDGECACHE for s in args.systems):
            node, published, stage_seconds = stage_edgecache(
                workdir,
                sources,
                console,
                uncompressed_tokens="edgecache-lmdb-none" in args.systems,
            )
        if args.smoke:
            # Every smoke epoch runs in this process, which by now holds torch, transformers
            # and the peers' packages: the gc.collect() before each epoch walked them all
            # (0.2 s each, 5 s of the smoke run). Imported and collected once, then frozen,
            # they are left out of it; what the epochs make is collected as before.
            for system in args.systems:
                preload(system)
            gc.collect()
            gc.freeze()
        for r in range(args.rounds):
            for source in sources:
                if "edgecache-grpc" in args.systems and node is not None:
                    stream = bare_stream(
                        workdir,
                        node,
                        published[source.name],
                        source,
                        repeat=args.repeat,
                        timeout=args.timeout,
                        # Smoke: 2 streams only; 1 runs the same reader in one thread, and
                        # each reader is a process that takes ~2 s to import torch.
                        streams=(2,) if args.smoke else (1, 2),
                    )
                    if source.name not in bare or stream["seconds"] < bare[source.name]["seconds"]:
                        bare[source.name] = stream
                    console.log(
                        f"{source.name} bare grpcio stream of the same bytes: "
                        f"{stream['samples_s']:,.0f} samples/s, {stream['wire_mb_s']:,.0f} MB/s on "
                        f"the wire ({stream['streams']} stream(s)), CPU {stream['cpu_s']:.1f} s"
                    )
                for workers in args.workers:
                    for system in systems_for(source.name, args.systems, workers):
                        spec = _spec(system, source, workers, workdir, formats, published, node)
                        result = run_one(
                            spec,
                            in_process=args.in_process,
                            node_pid=node.process.pid if node else None,
                            repeat=args.repeat,
                            budget=args.budget,
                            timeout=args.timeout,
                        )
                        result["round"] = r + 1
                        runs.append(result)
                        console.log(
                            f"{source.name} {system} workers={workers}: {result['seconds']:.2f} s "
                            f"(best of {result['epochs']}), {result['samples_s']:,.0f} samples/s, "
                            f"{result['mb_s']:,.0f} MB/s, first batch "
                            f"{result['first_batch_s']:.3f} s, CPU {result['cpu_s']:.1f} s, "
                            f"anon {result['peak_anon_mb']:,.0f} MB"
                        )
    finally:
        if node is not None:
            node.stop()
        for lock in _streaming_locks() - locks_before:
            lock.unlink(missing_ok=True)
    epochs = best_runs(runs)
    for e in epochs:  # CPU per GB of raw sample bytes delivered, in the loader and the node
        gb = next(s.raw_bytes for s in sources if s.name == e["dataset"]) / 1e9
        e["cpu_s_per_gb"] = round(e["cpu_s"] / gb, 2)
        if "node_cpu_s" in e:
            e["node_cpu_s_per_gb"] = round(e["node_cpu_s"] / gb, 2)
    disk: dict[str, dict[str, dict[str, float]]] = {}
    for s in sources:
        disk[s.name] = {
            system: {"disk_mb": round(c.disk_bytes / 1e6, 1), "convert_s": round(c.seconds, 1)}
            for system, c in formats[s.name].items()
        }
        for system in systems_for(s.name, args.systems):
            name = UNCOMPRESSED if system == "edgecache-lmdb-none" else s.name
            if system in EDGECACHE and name in published:
                disk[s.name][system] = {
                    "disk_mb": round(published[name].cached_bytes / 1e6, 1),
                    "convert_s": round(stage_seconds.get(name, 0.0), 1),
                }
    return {
        "benchmark": "bench.peers",
        "command": "python -m bench.peers " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "versions": report.versions(*PACKAGES),
        "targets": TARGETS,
        "labels": LABELS,
        "data": {
            s.name: {
                "samples": s.rows,
                "raw_mb": round(s.raw_bytes / 1e6, 1),
                "parquet_mb": round(s.parquet_bytes / 1e6, 1),
                "batch_size": s.batch_size,
                "edgecache_version": (
                    f"{s.name}@{published[s.name].version}" if s.name in published else None
                ),
                "edgecache_shards": published[s.name].shards if s.name in published else None,
                "edgecache_codec": KINDS[s.name][2],
            }
            for s in sources
        },
        "formats": disk,
        "settings": {
            "workers": args.workers,
            "repeat": args.repeat,
            "budget_s": args.budget,
            "rounds": args.rounds,
            "in_process": args.in_process,
        },
        "epochs": epochs,
        "runs": runs,
        "bare_stream": bare,
        "ratios": ratios(epochs, bare),
        "worker_scaling": worker_scaling(epochs),
        "memory": memory(epochs),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; write ``--json``; return the document."""
    from rich.console import Console

    args = parse(argv)
    console = Console(width=170)
    workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-peers-"))
    try:
        out = run(args, workdir, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["checks"] = checks(out)
    print_report(out, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return out
