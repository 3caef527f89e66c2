"""Stop EdgeDataset reads early, over and over, then print what the process still holds.

Usage: python early_stop_child.py ENDPOINTS_JSON CACHE_DIR ROUNDS

Run as a subprocess by tests/test_dataset_close.py, so that a crash (SIGSEGV
when an LMDB map is closed under a decoding thread) fails a test instead of
killing pytest. Each round stops a training loop early in one of the ways a
user does: ``break`` then ``close()``, an abandoned iterator, ``close()`` while
an iterator is live, garbage collection of a dataset and its iterator in a
reference cycle, and a DataLoader with workers left after a ``break``.

Prints one JSON line: threads, file descriptors and LMDB reader slots before
and after, the failover count of every pool seen, and worker exit codes.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import sys
import threading
import time

import lmdb
import torch

from edgecache.clients import EdgeDataset

faulthandler.enable()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

endpoints, cache_dir, rounds = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
pools = []  # every pool a round used, to read its failover count after close
exit_codes: list[int | None] = []


def reader_slots() -> int:
    """Live reader slots in the cache's LMDB lock file (every process, not just ours)."""
    env = lmdb.open(cache_dir, readonly=True, max_dbs=16, lock=True)
    try:
        lines = env.readers().strip().splitlines()[1:]  # first line: column names
        return sum(1 for line in lines if line.split() and line.split()[0] != "0")
    finally:
        env.close()


def held() -> dict[str, object]:
    # multiprocessing's queue feeder threads (the DataLoader's) end shortly after shutdown
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        t.name == "QueueFeederThread" for t in threading.enumerate()
    ):
        time.sleep(0.05)
    return {
        "threads": threading.active_count(),
        "names": sorted(t.name for t in threading.enumerate()),
        "fds": len(os.listdir("/proc/self/fd")),
        "readers": reader_slots(),
    }


def dataset(seed: int, *, in_workers: bool = False) -> EdgeDataset:
    ds = EdgeDataset(
        "tokens@1",
        endpoints=endpoints,
        batch_size=50,
        window_bytes=24 << 10,
        threads=2,
        seed=seed,
        retry_timeout=5,
    )
    if not in_workers:  # a forked worker cannot reopen an LMDB environment its parent has open
        pools.append(ds.pool())
    return ds


def break_then_close(seed: int) -> None:
    ds = dataset(seed)
    for i, _batch in enumerate(ds):
        if i == 2:
            break
    ds.close()


def abandoned_iterator(seed: int) -> None:
    ds = dataset(seed)
    it = iter(ds)
    next(it)
    next(it)
    del it, ds  # no close(): dropping them must stop the reads first


def close_while_iterating(seed: int) -> None:
    ds = dataset(seed)
    it = iter(ds)
    next(it)
    ds.close()  # the iterator is still live
    try:
        next(it)
    except ValueError:
        pass  # reading a closed dataset's iterator is refused, never a hang
    else:
        raise AssertionError("a closed dataset's iterator went on yielding")


def collected_in_a_cycle(seed: int) -> None:
    ds = dataset(seed)
    it = iter(ds)
    next(it)
    ds.cycle = (ds, it)  # only the garbage collector can free these
    del ds, it
    gc.collect()


def workers_shut_down(seed: int) -> None:
    ds = dataset(seed, in_workers=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    workers = list(it._workers)
    it._shutdown_workers()  # what the DataLoader does when its iterator goes away
    exit_codes.extend(w.exitcode for w in workers)
    ds.close()


ways = [
    break_then_close,
    abandoned_iterator,
    close_while_iterating,
    collected_in_a_cycle,
    workers_shut_down,
]
# One round of each first: torch, gRPC and the DataLoader start process-wide threads
# and descriptors once, on first use. Later rounds must not add any.
for n, way in enumerate(ways):
    way(n)
gc.collect()
before = held()
for n in range(rounds):
    ways[n % len(ways)](n)
gc.collect()
after = held()
print(
    json.dumps(
        {
            "before": before,
            "after": after,
            "failovers": sum(p.failovers for p in pools),
            "failures": sum(s.failures for p in pools for s in p.stats.values()),
            "exit_codes": exit_codes,
        }
    ),
    flush=True,
)
