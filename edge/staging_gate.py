"""The staging gate: shapes background staging so it never starves training reads.

Staging fetches raw shards from origin ahead of the jobs that will read them;
training reads (``ReadShard`` streams) come first. Every staging fetch and
every origin request it sends (a whole object or one ranged part) passes
through one :class:`StagingGate` per node, which holds a byte-rate budget and
slot counts, and lets waiting requests in oldest fetch first.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["StagingGate", "TokenBucket"]


class TokenBucket:
    """A byte-rate budget: how long to wait before sending ``nbytes`` at ``rate`` bytes/s.

    It starts empty (no initial burst: a warm-up starts at the configured rate)
    and holds at most one second of budget, or one request if that is larger.
    ``clock`` is the time source, in seconds (monotonic).
    """

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:  # 0 would divide by zero; NaN and negatives make no budget
            raise ValueError(f"a token bucket's rate must be above 0 bytes/s, got {rate}")
        self.rate = rate
        self._clock = clock
        self._tokens = 0.0
        self._stamp = clock()

    def debit(self, nbytes: int) -> float:
        """Take ``nbytes`` of budget; the seconds to wait before using it (0: none)."""
        now = self._clock()
        self._tokens = min(
            self._tokens + (now - self._stamp) * self.rate, float(max(self.rate, nbytes))
        )
        self._stamp = now
        self._tokens -= nbytes
        return -self._tokens / self.rate if self._tokens < 0 else 0.0


class StagingGate:
    """Shapes staging so it never starves training reads.

    A :class:`TokenBucket` caps staging's origin bytes per second (``rate=None``: no
    cap; a rate below 1 byte/s, 0 included, is a ValueError, never taken for no
    cap). While training reads stream, and for ``hold`` seconds after the last
    one ends (readers pause between windows and epochs), staging is background
    work: one staging fetch may start at a time, and all staging fetches
    together send one origin request (a ranged part) at a time, so fetches
    already running slow down within one part. Otherwise staging keeps at
    most ``requests`` origin requests in flight, enough to fill a long path
    and few enough that none waits for a connection it would then hold.

    Waiting requests are let in by ``order``, lowest first: staging numbers
    its fetches as they start, so the parts of the oldest shard go first and
    shards complete one after another, each preprocessed while later ones
    download, instead of all together at the end. Hundreds of parts may wait
    here at once, on the event loop that serves reads, so a freed slot wakes
    one waiter, never all of them.
    """

    def __init__(
        self, rate: int | None, concurrency: int, *, hold: float = 2.0, requests: int = 24
    ) -> None:
        self.rate = rate
        self.concurrency = concurrency
        self.hold = hold
        self.max_requests = requests
        self.reads_active = 0
        self._quiet_from = 0.0  # monotonic time the hold after the last read ends
        self._running = 0  # staging fetches in flight
        self._requests = 0  # staging origin requests in flight
        if rate is not None and rate < 1:
            # 0 (what 7bit/s parses to) was once taken for no limit, the opposite of
            # what it asks for: refused, so that only rate=None means unlimited.
            raise ValueError(
                f"staging rate {rate} is below 1 byte/s; give at least 1, or None for no limit"
            )
        self._bucket = TokenBucket(rate) if rate is not None else None
        self._fetch_free = asyncio.Condition()
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._arrivals = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._wakers: set[asyncio.Future[None]] = set()

    def reading(self) -> bool:
        """Whether training reads are streaming (or stopped less than ``hold`` ago)."""
        return self.reads_active > 0 or time.monotonic() < self._quiet_from

    def _limit(self) -> int:
        return 1 if self.reading() else self.concurrency

    async def read_started(self) -> None:
        """A training read began: staging drops to one fetch and one request at a time."""
        self.reads_active += 1

    async def read_finished(self) -> None:
        """A training read ended; staging speeds up again ``hold`` seconds after the last."""
        self.reads_active -= 1
        if not self.reads_active:
            self._quiet_from = time.monotonic() + self.hold
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.hold, self._hold_over)

    def _hold_over(self) -> None:
        self._timer = None
        if self.reads_active:
            return  # reading again: the read that ends last arms a new timer
        left = self._quiet_from - time.monotonic()
        if left > 0:  # a later read ended meanwhile
            self._timer = asyncio.get_running_loop().call_later(left, self._hold_over)
            return
        self._grant()

        async def open_up() -> None:
            async with self._fetch_free:
                self._fetch_free.notify(self.concurrency)

        task = asyncio.ensure_future(open_up())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    async def acquire(self, nbytes: int, *, unless: asyncio.Event | None = None) -> bool:
        """Wait for a staging slot and for ``nbytes`` of rate budget; True once held.

        ``unless`` set first (a training read now waits for this fetch: see
        ``EdgeNode.ensure_shard``) ends the wait with False and nothing held: the
        fetch is a read's from then on, and a read's miss does not queue behind
        staging's limits. Only a True asks for :meth:`release`.
        """
        if unless is None:
            await self._acquire(nbytes)
            return True
        if unless.is_set():
            return False
        acquiring = asyncio.ensure_future(self._acquire(nbytes))
        wanted = asyncio.ensure_future(unless.wait())
        try:
            await asyncio.wait({acquiring, wanted}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: whatever was acquired meanwhile goes back
            await asyncio.shield(self._abandon(acquiring))
            raise
        finally:
            wanted.cancel()
        if not unless.is_set():
            acquiring.result()  # an error of the wait is the caller's
            return True
        await self._abandon(acquiring)
        return False

    async def _abandon(self, acquiring: asyncio.Future[None]) -> None:
        """Stop an :meth:`_acquire` no one waits for; a slot it got meanwhile goes back."""
        acquiring.cancel()
        await asyncio.wait({acquiring})
        if not acquiring.cancelled() and acquiring.exception() is None:
            await self.release()

    async def _acquire(self, nbytes: int) -> None:
        async with self._fetch_free:
            await self._fetch_free.wait_for(lambda: self._running < self._limit())
            self._running += 1
        wait = self._bucket.debit(nbytes) if self._bucket else 0.0
        if wait:
            try:
                await asyncio.sleep(wait)
            except BaseException:  # cancelled while waiting: the caller will not release
                await asyncio.shield(self.release())
                raise

    async def release(self) -> None:
        """Give a staging slot back."""
        async with self._fetch_free:
            self._running -= 1
            self._fetch_free.notify(1)

    def _request_limit(self) -> int:
        return 1 if self.reading() else self.max_requests

    def _grant(self) -> None:
        """Let waiting requests in, lowest order first, while the limit allows."""
        while self._waiting and self._requests < self._request_limit():
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():  # else its waiter was cancelled
                self._requests += 1
                granted.set_result(None)

    @contextlib.asynccontextmanager
    async def request(
        self, order: int = 0, *, unless: asyncio.Event | None = None
    ) -> AsyncIterator[None]:
        """Hold one of staging's origin-request slots (a store's ``slot``), by ``order``.

        ``unless`` set (a training read now waits for the fetch these requests
        are part of) lets the request go at once, holding no slot, as a read's
        miss would: the parts still queued stop waiting, those not yet asked for
        never wait.
        """
        held = await self._request_slot(order, unless)
        try:
            yield
        finally:
            if held:
                self._requests -= 1
                self._grant()

    async def _request_slot(self, order: int, unless: asyncio.Event | None) -> bool:
        """Wait for a request slot: True once held, False if ``unless`` was set first."""
        if unless is not None and unless.is_set():
            return False
        if not self._waiting and self._requests < self._request_limit():
            self._requests += 1
            return True
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (order, next(self._arrivals), granted))
        self._grant()  # room may be free: then the lowest order goes, maybe this one
        wanted = asyncio.ensure_future(unless.wait()) if unless is not None else None
        waits: set[asyncio.Future[Any]] = {granted} if wanted is None else {granted, wanted}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then cancelled
                self._requests -= 1
                self._grant()
            granted.cancel()  # still queued: _grant passes it over
            raise
        finally:
            if wanted is not None:
                wanted.cancel()
        if granted.done():  # granted (if a read wanted it at the same time, held all the same)
            return True
        granted.cancel()  # still queued: _grant passes it over
        return False
