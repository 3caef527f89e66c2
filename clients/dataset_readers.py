"""One process's reading machinery for an EdgeDataset: its node pool, batch memory, pipelines.

Kept per process (opened lazily where the dataset is iterated, again after
fork), closed by :meth:`EdgeDataset.close` or when the dataset is garbage.
Also where the process-wide rule lives that an idle LMDB environment is closed
before a fork (DataLoader starting workers), and how a worker's metrics that
could not ride on a batch are merged into the next one.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from edgecache.clients.batch_memory import ReusedMemory
from edgecache.clients.dataset_metrics import PoolTally
from edgecache.clients.node_pool import NodePool
from edgecache.clients.pipeline import Pipeline

__all__ = ["Readers", "merge"]


def merge(pending: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    """Two metric deltas as one (a worker's batch that could not carry its own)."""
    if pending is None:
        return delta
    out = dict(pending)
    for key in ("samples", "batches", "failovers"):
        out[key] = out.get(key, 0) + delta.get(key, 0)
    out["bytes"] = {**out.get("bytes", {})}
    for endpoint, count in delta.get("bytes", {}).items():
        out["bytes"][endpoint] = out["bytes"].get(endpoint, 0) + count
    out["endpoint"] = delta.get("endpoint") or out.get("endpoint")
    return out


class Readers:
    """One process's node pool and the pipelines reading through it.

    Closing it stops and joins the pipelines before the pool closes, whoever
    closes it: :meth:`EdgeDataset.close`, or the dataset's finalizer when it is
    garbage-collected (in a reference cycle the finalizer runs before the
    iterators are closed, so it must not assume they were).
    """

    def __init__(self, pool: NodePool) -> None:
        self.pool = pool
        self.memory = ReusedMemory()  # unpinned batches of this process, reused
        self.tally = PoolTally()  # what the pool read, for the client metrics
        self.pending: dict[str, Any] | None = None  # a worker's metrics not yet sent
        self._pipelines: set[Pipeline] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _ALL_READERS.add(self)

    def add(self, pipeline: Pipeline) -> None:
        """A pipeline of this process started reading."""
        with self._lock:
            self._pipelines.add(pipeline)

    def discard(self, pipeline: Pipeline) -> None:
        """A pipeline ended. Its LMDB environments stay open for the next epoch.

        Reopening them every epoch would map the cache afresh and fault every
        page in again; :func:`_before_fork` closes them instead when this process
        forks (a DataLoader starting workers) and none of its reads runs.
        """
        with self._lock:
            self._pipelines.discard(pipeline)

    def close_idle_stores(self) -> None:
        """Close the pool's LMDB environments if no pipeline of this process reads them.

        py-lmdb refuses to open an environment a second time in one process, and a
        forked DataLoader worker inherits its parent's: a parent that iterated
        (``num_workers=0``, an evaluation pass) must not hold them open when a
        loader with workers starts. The next iteration reopens them.
        """
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self._pipelines:
                return
            self.pool.close_stores()

    def close(self) -> None:
        """Stop and join every pipeline of this process, then close the pool."""
        if os.getpid() != self._pid:
            # A forked DataLoader worker inherits this (and the finalizer that calls it):
            # the parent's threads do not exist here, and a lock one of them held at the
            # fork would never be released. The worker's own readers are another object.
            return
        with self._lock:
            pipelines, self._pipelines = list(self._pipelines), set()
        for pipeline in pipelines:
            pipeline.close()
        self.pool.close()


_ALL_READERS: weakref.WeakSet[Readers] = weakref.WeakSet()


def _before_fork() -> None:
    """Close idle LMDB environments before this process forks (see ``close_idle_stores``)."""
    for readers in list(_ALL_READERS):
        readers.close_idle_stores()


os.register_at_fork(before=_before_fork)
