"""EdgeDataset feeding a GPU: host-to-device bandwidth, epochs with every batch on the device.

    python -m bench.gpu [--tokens-mib 512] [--images-mib 512] [--workers 0,4,8]
                        [--repeat 2] [--json PATH]

Without CUDA it says so and exits 0 (a CPU-only machine has nothing to
measure here); on a CUDA host, in one run:

* plain host-to-device copies of a 256 MiB buffer, pinned and pageable
  (``non_blocking=True``, synchronised): the ceiling of any loader;
* full epochs of EdgeDataset over gRPC (a warm edge node on this host) and
  over ``lmdb://`` (its cache directory), with ``num_workers`` 0, 4 and 8,
  every batch moved to the GPU with ``non_blocking=True`` as a training loop
  does (``DataLoader(pin_memory=True)`` with workers: the batches come from
  worker processes unpinned, the DataLoader pins them; with ``num_workers=0``
  EdgeDataset assembles them in pinned memory itself);
* for each: samples/s, GB/s, whether every batch arrived pinned, the
  bandwidth of the copies of EdgeDataset's own batches against the plain
  pinned buffer, and CPU seconds per GB in the client (the process and its
  workers) and in the node.

Data: the tokens and images of bench.peers (same generators, same staging).
The ratios printed are against the plain pinned copy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import report
from bench.arguments import non_negative_int, positive_float, positive_int, some_data, workers_list

__all__ = ["copy_bandwidth", "main"]

PACKAGES = ("torch", "numpy", "pyarrow", "grpcio", "lmdb", "zstandard", "edgecache")
COPY_BYTES = 256 << 20


def skip_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return (
            f"no CUDA device here (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}): bench.gpu measures host-to-device copies and "
            "needs a GPU; run it on a CUDA host"
        )
    return None


def copy_bandwidth(pinned: bool, nbytes: int = COPY_BYTES, repeat: int = 10) -> float:
    """GB/s of ``non_blocking`` host-to-device copies of one ``nbytes`` buffer (best of runs)."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    source.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def _tensors(batch: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif hasattr(value, "offsets"):  # Packed: values and offsets
            out += [value.values, value.offsets]
    return out


def _cpu_self_and_children() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def epoch_on_gpu(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch of EdgeDataset with every batch moved to the GPU (run in its own process)."""
    from torch.utils.data import DataLoader

    from edgecache.clients import EdgeDataset

    workers = spec["workers"]
    cpu, started = _cpu_self_and_children(), time.perf_counter()
    ds = EdgeDataset(
        spec["version"], endpoints=[spec["endpoint"]], batch_size=spec["batch_size"], seed=1
    )
    loader = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=workers > 0)
    samples = batches = pinned = 0
    copy_seconds, copy_bytes = 0.0, 0
    first = 0.0
    for batch in loader:
        if not batches:
            first = time.perf_counter() - started
        tensors = _tensors(batch)
        pinned += all(t.is_pinned() for t in tensors)
        timed = batches % 16 == 8  # now and then, the copy alone, synchronised
        if timed:
            torch.cuda.synchronize()
            copy_started = time.perf_counter()
        on_gpu = {
            k: v.to("cuda", non_blocking=True)
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) or hasattr(v, "offsets")
        }
        if timed:
            torch.cuda.synchronize()
            copy_seconds += time.perf_counter() - copy_started
            copy_bytes += sum(t.numel() * t.element_size() for t in tensors)
        samples += len(batch["label"])
        batches += 1
        del on_gpu
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    ds.close()
    return {
        **spec,
        "samples": samples,
        "batches": batches,
        "seconds": round(seconds, 4),
        "first_batch_s": round(first, 4),
        "samples_s": round(samples / seconds, 1),
        "gb_s": round(spec["raw_bytes"] / seconds / 1e9, 3),
        "pinned_batches": pinned,
        "all_pinned": pinned == batches,
        "batch_copy_gb_s": round(copy_bytes / copy_seconds / 1e9, 2) if copy_seconds else None,
        "cpu_s": round(_cpu_self_and_children() - cpu, 2),
    }


def _run_epoch_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--epoch", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"bench.gpu epoch {spec} failed:\n{proc.stderr[-3000:]}")


def run(args: argparse.Namespace, workdir: Path, console: Any) -> dict[str, Any]:
    """Everything but the printing: the JSON document."""
    import psutil

    from bench.peers.data import generate
    from bench.peers.runner import stage_edgecache

    started = time.perf_counter()
    pinned = copy_bandwidth(True)
    pageable = copy_bandwidth(False)
    console.log(f"host → device: pinned {pinned:.1f} GB/s, pageable {pageable:.1f} GB/s")
    sources = [  # 0 MiB leaves that dataset out
        generate(workdir, name, mib)
        for name, mib in (("tokens", args.tokens_mib), ("images", args.images_mib))
        if mib
    ]
    node, published, _ = stage_edgecache(workdir, sources, console)
    epochs = []
    try:
        process = psutil.Process(node.process.pid)
        for source in sources:
            for transport, endpoint in (
                ("grpc", node.address),
                ("lmdb", f"lmdb://{workdir / 'cache'}"),
            ):
                for workers in args.workers:
                    spec = {
                        "dataset": source.name,
                        "transport": transport,
                        "workers": workers,
                        "endpoint": endpoint,
                        "version": f"{source.name}@{published[source.name].version}",
                        "batch_size": source.batch_size,
                        "raw_bytes": source.raw_bytes,
                    }
                    runs = []
                    for _ in range(args.repeat):
                        before = sum(process.cpu_times()[:2])
                        result = _run_epoch_process(spec, args.timeout)
                        result["node_cpu_s"] = round(sum(process.cpu_times()[:2]) - before, 2)
                        runs.append(result)
                    best = min(runs, key=lambda r: r["seconds"])
                    gb = source.raw_bytes / 1e9
                    best["cpu_s_per_gb"] = round(best["cpu_s"] / gb, 2)
                    best["node_cpu_s_per_gb"] = (
                        round(best["node_cpu_s"] / gb, 2) if transport == "grpc" else 0.0
                    )
                    if best["batch_copy_gb_s"]:
                        best["batch_copy_vs_pinned"] = round(best["batch_copy_gb_s"] / pinned, 3)
                    epochs.append(best)
                    console.log(
                        f"{source.name} {transport} workers={workers}: "
                        f"{best['samples_s']:,.0f} samples/s, {best['gb_s']:.2f} GB/s, "
                        f"pinned {best['pinned_batches']}/{best['batches']}, "
                        f"client {best['cpu_s_per_gb']:.2f} CPU-s/GB, "
                        f"node {best['node_cpu_s_per_gb']:.2f} CPU-s/GB"
                    )
    finally:
        node.stop()
    return {
        "benchmark": "bench.gpu",
        "command": "python -m bench.gpu " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0),
        "versions": report.versions(*PACKAGES),
        "copy": {"pinned_gb_s": round(pinned, 2), "pageable_gb_s": round(pageable, 2)},
        "data": {
            s.name: {"samples": s.rows, "raw_mb": round(s.raw_bytes / 1e6, 1)} for s in sources
        },
        "epochs": epochs,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_report(out: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    copy = out["copy"]
    console.print(
        f"{out['device']}: host → device {copy['pinned_gb_s']:.1f} GB/s pinned, "
        f"{copy['pageable_gb_s']:.1f} GB/s pageable "
        f"({copy['pageable_gb_s'] / copy['pinned_gb_s']:.2f}x)"
    )
    table = Table(title="EdgeDataset epochs, every batch moved to the GPU (non_blocking=True)")
    for column in (
        "data",
        "transport",
        "workers",
        "samples/s",
        "GB/s",
        "pinned",
        "batch copy GB/s",
        "vs pinned buffer",
        "client CPU-s/GB",
        "node CPU-s/GB",
    ):
        table.add_column(column)
    for e in out["epochs"]:
        table.add_row(
            e["dataset"],
            e["transport"],
            str(e["workers"]),
            f"{e['samples_s']:,.0f}",
            f"{e['gb_s']:.2f}",
            f"{e['pinned_batches']}/{e['batches']}",
            f"{e['batch_copy_gb_s'] or 0:.1f}",
            f"{e.get('batch_copy_vs_pinned', 0):.2f}x",
            f"{e['cpu_s_per_gb']:.2f}",
            f"{e['node_cpu_s_per_gb']:.2f}",
        )
    console.print(table)
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokens-mib", type=non_negative_int, default=512, help="raw MiB of token data"
    )
    parser.add_argument(
        "--images-mib", type=non_negative_int, default=512, help="raw MiB of image data"
    )
    parser.add_argument("--workers", default="0,4,8", help="DataLoader num_workers values")
    parser.add_argument("--repeat", type=positive_int, default=2, help="epochs per configuration")
    parser.add_argument(
        "--timeout", type=positive_float, default=600, help="seconds per epoch process"
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--epoch", help=argparse.SUPPRESS)  # one epoch, in its own process
    args = parser.parse_args(argv)
    some_data(parser, args.tokens_mib, args.images_mib)
    args.workers = workers_list(parser, args.workers)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (or say why it cannot run here); print; write ``--json``."""
    from rich.console import Console

    args = parse(argv)
    if args.epoch:
        print("RESULT " + json.dumps(epoch_on_gpu(json.loads(args.epoch))), flush=True)
        return {}
    console = Console(width=150)
    reason = skip_reason()
    if reason is not None:
        console.print(f"bench.gpu skipped: {reason}")
        out: dict[str, Any] = {"benchmark": "bench.gpu", "skipped": reason}
    else:
        workdir = Path(tempfile.mkdtemp(prefix="edgecache-bench-gpu-"))
        try:
            out = run(args, workdir, console)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print_report(out, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
