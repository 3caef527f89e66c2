"""Arrow's freed memory handed back to the system once a node's shard fetches stop.

``edgecache`` runs nodes with ``MIMALLOC_PURGE_DELAY=10000`` (see
``edgecache.clients.cli``): Arrow's allocator keeps what a shard's decode
freed for ten seconds, so the next shard reuses those pages instead of
faulting in and zeroing fresh huge pages (a fifth of a 2-core node's CPU).
But mimalloc purges only from inside its own calls: a node that staged a
version and then served it from LMDB, or sat idle, kept that memory for good
(148 MiB of anonymous memory after a 30 MB Stage, still 146 fourteen seconds
later; 89 once given back). So when the last fetch ends and none begins within the purge delay,
the node asks Arrow's pool to give back what it holds unused, as mimalloc
would have had it been called.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import pyarrow as pa

__all__ = ["IdleRelease", "purge_delay", "release_in_threads"]

log = logging.getLogger(__name__)

MIMALLOC_DEFAULT_MS = 10.0  # mimalloc's own purge delay, where nothing set one


def purge_delay(environ: Mapping[str, str] = os.environ) -> float | None:
    """How long the allocator may keep freed memory, in seconds (``None``: for ever).

    Read from ``MIMALLOC_PURGE_DELAY`` (milliseconds; negative: never purge),
    which mimalloc itself read when pyarrow loaded.
    """
    raw = environ.get("MIMALLOC_PURGE_DELAY", "").strip()
    try:
        ms = float(raw) if raw else MIMALLOC_DEFAULT_MS
    except ValueError:
        ms = MIMALLOC_DEFAULT_MS  # mimalloc ignores what it cannot read, too
    return None if ms < 0 else ms / 1e3


def release_in_threads(pools: Sequence[ThreadPoolExecutor], timeout: float = 0.5) -> None:
    """Ask Arrow's pool to give back its unused memory from every thread of ``pools``.

    mimalloc keeps freed pages in the heap of the thread that allocated them,
    and ``release_unused`` collects the calling thread's heap only (from
    another thread it gave back nothing of a 300 MiB decode; from the
    decoding thread, all of it). So each pool runs one call on each of its
    threads: every call waits at a barrier until all of that pool's have
    started, which no thread can then take twice.
    """
    release = pa.default_memory_pool().release_unused
    for pool in pools:
        threads = int(getattr(pool, "_max_workers", 1))
        barrier = threading.Barrier(threads)

        def one(barrier: threading.Barrier = barrier) -> None:
            release()
            try:
                barrier.wait(timeout)
            except threading.BrokenBarrierError:
                pass  # a thread busy with a fetch begun since: the others do not wait for it

        try:
            futures = [pool.submit(one) for _ in range(threads)]
        except RuntimeError:  # shut down: the node is closing, and its memory goes with it
            return
        # Not waiting for a call queued behind a fetch begun since: it runs after that.
        wait(futures, timeout=timeout + 1.0)
    release()  # and this thread's own


class IdleRelease:
    """Gives Arrow's unused memory back ``delay`` seconds after the last fetch ended.

    Runs on the node's event loop: :meth:`busy` when a fetch starts, :meth:`idle`
    when the last one in flight ends. A fetch that starts within the delay
    keeps the memory for its own decode (what the delay is for).
    """

    def __init__(self, release: Callable[[], None], delay: float | None) -> None:
        self.delay = delay  # None: never (see purge_delay)
        self._release = release
        self._timer: asyncio.TimerHandle | None = None  # the release to come, if any
        self.releases = 0

    def busy(self) -> None:
        """A fetch started: a release still to come would take pages it is about to use."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def idle(self) -> None:
        """The last fetch in flight ended: release after ``delay`` unless another starts."""
        self.busy()
        if self.delay is None:
            return  # MIMALLOC_PURGE_DELAY < 0: the operator asked for memory to be kept
        self._timer = asyncio.get_running_loop().call_later(self.delay, self._due)

    def _due(self) -> None:
        self._timer = None  # a cancelled timer never gets here: no fetch began since
        self.releases += 1
        # Off the event loop: giving back a few hundred MiB is page-table work (madvise).
        future = asyncio.get_running_loop().run_in_executor(None, self._release)
        future.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("giving Arrow's unused memory back failed: %s", exc)
