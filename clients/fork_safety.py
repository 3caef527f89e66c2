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

Any other thread of the process inside a short gRPC call at the fork (a user's
own client, a channel being torn down) is worse: gRPC's fork handling in the
forking process itself can abort it (``ares_resolver.cc ... Check failed:
channel_ != nullptr``) and its workers segfault, with no EdgeDataset stream
open at all (tests/test_fork_safety.py reproduces it in a few seconds). Before
each fork the process waits, up to :data:`CALL_WAIT_S`, for such calls to end
(:func:`wait_for_grpc_calls`, registered by ``node_pool``, which imports this
module, so that it runs before that module's fork guard is taken); a thread
still inside then (a stream waiting for its next message) is not waited for at
the forks of the next ten seconds.

The poller is recognised by its thread's name (grpcio's ``_poll_wrapper``) and a
call by its frames in grpcio's ``grpc/_channel.py``: grpcio's implementation, not
its API. If a release renames them, the warning stays silent and forks are not
delayed; nothing else changes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Protocol

__all__ = [
    "grpc_aio_running",
    "threads_in_grpc_calls",
    "wait_for_grpc_calls",
    "watch",
    "watch_calls",
]

# How long a fork waits for other threads' gRPC calls to end. Unary calls and channel
# teardown take milliseconds; a thread still inside after this is in a stream.
CALL_WAIT_S = 1.0
_CHANNEL_CODE = os.path.join("grpc", "_channel.py")
# Threads a fork waited out (a stream waiting for its next message) → when: not waited
# for again at the forks of the next LONG_CALL_GRACE_S (a DataLoader starting its
# workers forks several times in a row), then waited for again (a short call the same
# thread, or a new thread given its id, makes later is not exempt for good).
LONG_CALL_GRACE_S = 10.0
_LONG_CALLS: dict[int, float] = {}

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


def threads_in_grpc_calls() -> dict[int, list[str]]:
    """Other threads now inside a call of gRPC's sync API: thread id → its frames, innermost first.

    Recognised by a frame in grpcio's ``grpc/_channel.py`` (a unary call, a stream's
    next message, a channel's close or ``__del__``).
    """
    inside: dict[int, list[str]] = {}
    frames = sys._current_frames()
    # This thread's frame must not stay referenced from here: held by a local of its own
    # it is a cycle that keeps every caller alive until a collection (a DataLoader
    # iterator forking its workers: ``del it`` then stopped none, and each join waited).
    del frames[threading.get_ident()]
    for ident, frame in frames.items():
        names: list[str] = []
        walked: FrameType | None = frame
        while walked is not None and len(names) < 40:
            names.append(f"{walked.f_code.co_name}@{os.path.basename(walked.f_code.co_filename)}")
            if walked.f_code.co_filename.endswith(_CHANNEL_CODE):
                inside[ident] = names
            walked = walked.f_back
    del frames
    return inside


def wait_for_grpc_calls(limit_s: float = CALL_WAIT_S) -> dict[int, list[str]]:
    """Wait up to ``limit_s`` for other threads to leave gRPC; those still inside.

    A thread a wait ran out on (a stream waiting for its next message) is not
    waited for at the forks of the next :data:`LONG_CALL_GRACE_S`: a DataLoader
    forking eight workers would otherwise wait eight times.
    """
    now = time.monotonic()
    for ident, since in list(_LONG_CALLS.items()):
        if now - since > LONG_CALL_GRACE_S:
            del _LONG_CALLS[ident]
    deadline = now + limit_s
    while True:
        inside = threads_in_grpc_calls()
        waiting = set(inside) - set(_LONG_CALLS)
        if not waiting:
            return inside
        if time.monotonic() >= deadline:
            _LONG_CALLS.update(dict.fromkeys(waiting, time.monotonic()))
            return inside
        time.sleep(0.002)  # without the GIL: the calls go on


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
