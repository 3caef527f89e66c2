"""Measured epochs: ``python -m bench.peers.epoch '<Spec as JSON>' [REPEAT BUDGET_S]``.

The orchestrator runs every epoch in a fresh process of its own, so that no
epoch inherits another's heap, threads, shared memory or imports, and the
peak memory of "this loader and its DataLoader workers" is exactly that
process tree. The package is imported before the clock starts; the clock
covers constructing the dataset and the DataLoader, then the whole epoch.
CPU seconds (user + system of the process and its DataLoader workers, which
have exited by then) are taken over the same span: on 2 cores, a loader that
is fast because it burns both is not the same as one that is fast on one.
In-process (``--in-process``), the CPU figure also counts the edge node if it
exits meanwhile (it does not) and the memory tree leaves out processes that
were already running.

A configuration whose epochs are short is read again in the same process
(up to REPEAT epochs while their total stays under BUDGET_S seconds) and the
fastest epoch is kept: on a machine shared with other work, a one-second epoch
is at the mercy of whatever else ran in that second, a one-minute epoch much
less so.

Every batch is checked (types, dtype, shape), labels are summed, and an epoch
fails unless it delivered every sample (count and label sum, so a sample seen
twice and another never cannot pass).
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
import warnings
from typing import Any

import torch

from bench.peers.loaders import Spec, open_loader, preload, prepare
from bench.peers.memory import TreeMemory

__all__ = ["run_epoch"]

RESULT = "RESULT "  # prefix of the one stdout line the orchestrator reads


def _check(batch: Any, spec: Spec) -> int:
    """The batch's sample count, after checking it is shaped as every system must yield it."""
    labels = batch["label"]
    if not (isinstance(labels, torch.Tensor) and labels.dtype == torch.int64):
        raise TypeError(f"{spec.system}: labels are {type(labels)} {getattr(labels, 'dtype', '')}")
    n = len(labels)
    if spec.dataset == "tokens":
        ids = batch["input_ids"]
        if not (
            isinstance(ids, torch.Tensor) and ids.dtype == torch.int32 and ids.shape == (n, 2048)
        ):
            raise TypeError(f"{spec.system}: input_ids {type(ids)} {getattr(ids, 'shape', '')}")
    else:
        images = batch["image"]
        packed = (  # edgecache's default: one uint8 tensor of the images plus offsets
            type(images).__name__ == "Packed"
            and len(images) == n
            and images.values.dtype == torch.uint8
            and int(images.offsets[-1] - images.offsets[0]) == images.values.numel()
        )
        listed = isinstance(images, list) and len(images) == n and isinstance(images[0], bytes)
        if not (packed or listed):
            raise TypeError(f"{spec.system}: images are {type(images)}")
    return n


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the DataLoader workers)."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _one_epoch(spec: Spec) -> dict[str, Any]:
    """Read one full epoch of ``spec``; its figures."""
    prepare(spec)
    gc.collect()
    with TreeMemory() as memory:
        cpu = _cpu_seconds()
        started = time.perf_counter()
        loader, close = open_loader(spec)
        first = 0.0
        samples = batches = label_sum = 0
        try:
            for batch in loader:
                if not batches:
                    first = time.perf_counter() - started
                samples += _check(batch, spec)
                label_sum += int(batch["label"].sum())
                batches += 1
            seconds = time.perf_counter() - started
        finally:
            close()
            del loader
        cpu = _cpu_seconds() - cpu
    if samples != spec.rows or label_sum != spec.label_sum:
        raise AssertionError(
            f"{spec.system} {spec.dataset} workers={spec.workers}: {samples} samples of "
            f"{spec.rows}, label sum {label_sum} (expected {spec.label_sum})"
        )
    return {
        "samples": samples,
        "batches": batches,
        "seconds": seconds,
        "first_batch_s": first,
        "cpu_s": cpu,
        **memory.figures(),
    }


def run_epoch(spec: Spec, *, repeat: int = 1, budget: float = 0.0) -> dict[str, Any]:
    """Epochs of ``spec``: one, then more while fewer than ``repeat`` and under ``budget`` s.

    The fastest epoch gives the time and CPU figures, the fastest first batch
    its own figure, and the first epoch (a fresh process) the memory figures.
    """
    preload(spec.system)
    runs: list[dict[str, Any]] = []
    with warnings.catch_warnings():
        # Every system hands torch read-only buffers that it copies from; say so once, not here.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        warnings.filterwarnings("ignore", message=".*non-writable.*")
        while not runs or (len(runs) < repeat and sum(r["seconds"] for r in runs) < budget):
            runs.append(_one_epoch(spec))
    best = min(runs, key=lambda r: r["seconds"])
    memory = {k: v for k, v in runs[0].items() if k.endswith("_mb") or k == "memory_samples"}
    return {
        "dataset": spec.dataset,
        "system": spec.system,
        "workers": spec.workers,
        "batch_size": spec.batch_size,
        "samples": best["samples"],
        "batches": best["batches"],
        "seconds": round(best["seconds"], 4),
        "first_batch_s": round(min(r["first_batch_s"] for r in runs), 4),
        "samples_s": round(best["samples"] / best["seconds"], 1),
        "mb_s": round(spec.raw_bytes / best["seconds"] / 1e6, 1),
        "cpu_s": round(best["cpu_s"], 2),
        **memory,
        "epochs": len(runs),
        "all_seconds": [round(r["seconds"], 4) for r in runs],
    }


def main() -> None:
    spec = Spec(**json.loads(sys.argv[1]))
    repeat, budget = (int(sys.argv[2]), float(sys.argv[3])) if len(sys.argv) > 3 else (1, 0.0)
    result = run_epoch(spec, repeat=repeat, budget=budget)
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
