"""A node-wide bound on the memory its shard fetches hold at once.

A fetch holds a whole shard while it preprocesses it: the source object, its
decoded Arrow batches and the encoded frames. ``fetch_concurrency`` and
``staging_concurrency`` bound how many run, not how large they are: eight
fetches of 1 GiB Parquet shards hold tens of GiB, past a pod's memory limit.
Each fetch reserves its estimate here first (:data:`EXPANSION` times its source
size, at most the whole budget) and waits while the reservations in flight
would pass the budget; a shard larger than the budget runs alone. A shard
served to its readers without caching it stays counted (:meth:`FetchMemory.keep`)
until the last stream serving its frames ends; such kept bytes delay fetches
but never block them: a fetch with no other fetch in flight goes ahead (a
stream's end depends on its client, which may wait for the very fetch that
would wait for it: a parked stream, a pipeline's next window).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from edgecache.edge.config import CGROUP_ROOT

__all__ = ["EXPANSION", "FetchMemory", "Kept", "cgroup_memory_limit", "default_budget"]

# A fetch's peak over its source's size: the object itself, ~3x of decoded Arrow for
# compressed Parquet (the common source), the frames, and the codec's working copies.
EXPANSION = 6
_FLOOR = 256 << 20  # a budget below this would run even small shards one at a time


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file, or None where it is absent, "max" or not a number."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup, in bytes, or None where it has none.

    cgroup v2 (``memory.max``: "max" or bytes), else cgroup v1
    (``memory/memory.limit_in_bytes``), whose "no limit" is a huge number
    (9223372036854771712): the caller caps it by the machine's RAM.
    """
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit is not None and limit > 0:
            return limit
    return None


def _memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The memory this process may use: its cgroup's limit (v2 or v1), at most the machine's."""
    try:
        physical: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = None
    limits = [x for x in (cgroup_memory_limit(root), physical) if x]
    return min(limits) if limits else None


def default_budget(root: Path = CGROUP_ROOT) -> int:
    """Half the memory this process may use (the rest: serving, the store's pages, Python)."""
    limit = _memory_limit(root)
    return max(_FLOOR, limit // 2) if limit else 4 << 30


class FetchMemory:
    """Reservations of fetch memory against a budget, in bytes (one event loop)."""

    def __init__(self, budget: int) -> None:
        self.budget = max(1, budget)
        self.reserved = 0
        self.fetching = 0  # the part of ``reserved`` that fetches in flight hold (not kept)
        self.peak = 0  # the most reserved at once (tests, and a gauge's story)
        self._waiters: list[asyncio.Future[None]] = []

    def estimate(self, source_bytes: int) -> int:
        """What a fetch of a ``source_bytes`` object reserves: at most the whole budget."""
        return min(self.budget, max(1, EXPANSION * source_bytes))

    @contextlib.asynccontextmanager
    async def hold(self, source_bytes: int) -> AsyncIterator[int]:
        """Reserve a fetch's estimate for the block, waiting while it would not fit."""
        need = self.estimate(source_bytes)
        # Kept bytes alone never hold a fetch back (see the module's docstring): over the
        # budget by at most what is kept, instead of waiting on a client that waits on us.
        while self.fetching and self.reserved + need > self.budget:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        self._add(need)
        self.fetching += need
        try:
            yield need
        finally:
            self.fetching -= need
            self._release(need)

    def keep(self, nbytes: int) -> Kept:
        """Count ``nbytes`` already in memory against the budget until :meth:`Kept.release`.

        For a shard's frames that outlive their fetch (a read-through miss served
        without caching it, held for the streams serving it). Taken without
        waiting (the frames are in memory already), as the fetch's own reservation
        is released (a fetch from origin reserved enough for them; a peer copy
        reserves nothing, so its kept frames may pass the budget): later fetches
        wait for them while another fetch is in flight, and go ahead past them
        when none is.
        """
        kept = Kept(self, min(self.budget, max(1, nbytes)))
        self._add(kept.nbytes)
        return kept

    def _add(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)

    def _release(self, nbytes: int) -> None:
        """Return ``nbytes`` (synchronous: a cancelled caller cannot leak it) and wake waiters."""
        self.reserved -= nbytes
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class Kept:
    """Bytes counted against a :class:`FetchMemory` until released (once)."""

    def __init__(self, memory: FetchMemory, nbytes: int) -> None:
        self.nbytes = nbytes
        self._memory: FetchMemory | None = memory

    def release(self) -> None:
        """Stop counting the bytes; later calls do nothing."""
        memory, self._memory = self._memory, None
        if memory is not None:
            memory._release(self.nbytes)
