"""A warning when a process forks DataLoader workers while gRPC is busy in it.

gRPC's fork handlers run only when no thread is inside gRPC core. gRPC aio's
poller thread always is, for as long as any aio server or channel of the process
lives (even one stopped but not yet garbage-collected). A fork then skips the
handlers ("Other threads are currently calling into gRPC, skipping fork()
handlers" in gRPC's log), and a DataLoader worker that reads over gRPC may crash
or hang on its first call. EdgeDataset cannot fix that from inside the worker; it
can say so, once, in the process that forks, with the way out.

The same holds for a sync call in flight: a stream of an EdgeDataset iterator
left open in the forking process (``next(iter(ds))`` to look at a batch, a loop
that neither finished nor was closed) keeps gRPC busy, and the fork skips the
handlers too. The node pools registered here (:func:`watch_calls`) say how many
calls they hold open; finishing or closing the iterator ends them.

The poller is recognised by its thread's name (grpcio's ``_poll_wrapper``), which
is grpcio's implementation, not its API: if a release renames it, the warning
stays silent and nothing else changes.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Protocol

__all__ = ["grpc_aio_running", "watch", "watch_calls"]

log = logging.getLogger(__name__)

_READING_GRPC: weakref.WeakSet[object] = weakref.WeakSet()  # datasets with gRPC endpoints
_WARNED: list[int] = []  # the pid that warned (a forked child warns for itself)


class _HoldsCalls(Protocol):
    def calls_in_flight(self) -> int: ...


_POOLS: weakref.WeakSet[_HoldsCalls] = weakref.WeakSet()  # node pools of this process


def watch(dataset: object) -> None:
    """Warn at this process's forks while ``dataset`` (which reads over gRPC) lives."""
    _READING_GRPC.add(dataset)


def watch_calls(pool: _HoldsCalls) -> None:
    """Warn at this process's forks while ``pool`` holds gRPC calls open."""
    _POOLS.add(pool)


def grpc_aio_running() -> bool:
    """Whether gRPC aio's poller thread runs in this process."""
    return any("_poll_wrapper" in thread.name for thread in threading.enumerate())


def _before_fork() -> None:
    if os.getpid() in _WARNED:
        return
    calls = sum(pool.calls_in_flight() for pool in list(_POOLS))
    if calls:
        _WARNED.append(os.getpid())
        log.warning(
            "this process forks while %d EdgeDataset stream(s) are open over gRPC in it "
            "(an iterator of the dataset that neither finished nor was closed, e.g. from "
            "next(iter(ds))): gRPC skips its fork handlers while a call is in flight, and "
            "a DataLoader worker may crash or hang. Finish or close that iterator "
            "(it.close(), or del it) before the DataLoader starts its workers, or pass "
            "multiprocessing_context='forkserver' to the DataLoader (docs/dataset.md, "
            "'gRPC and fork')",
            calls,
        )
        return
    if not _READING_GRPC or not grpc_aio_running():
        return
    _WARNED.append(os.getpid())
    log.warning(
        "this process forks while it uses gRPC aio (a grpc.aio server or channel is "
        "alive): gRPC skips its fork handlers, and a DataLoader worker that reads over "
        "gRPC may crash or hang. Close those servers and channels and run gc.collect() "
        "before the DataLoader starts its workers, or pass "
        "multiprocessing_context='forkserver' to the DataLoader (docs/dataset.md, "
        "'gRPC and fork')"
    )


os.register_at_fork(before=_before_fork)
