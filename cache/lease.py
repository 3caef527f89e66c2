"""A lease in object storage, so that only one controller acts at a time.

The lease is a sequence of create-only objects, ``<prefix>/<generation>``,
each a small JSON record ``{"holder", "expires", "generation"}``. The holder
is whoever wrote the highest generation, until its ``expires`` passes.
Acquiring, renewing and releasing all write the next generation with a
create-only put (``If-None-Match: *`` on S3, an atomic link on a filesystem),
so of two contenders for one generation exactly one wins, and a holder that
was paused past its expiry finds its renewal refused instead of acting on
next to a new holder. Nothing needs a compare-and-swap that only some stores
offer, so the same lease works in compose (a local or S3 registry) and in
Kubernetes (S3) alike. Old generations are deleted as new ones are written.

A holder that takes the lease anew, rather than renewing the generation it
already held, is told so (:attr:`Lease.gained`): others may have held it in
between, and whatever the lease guards may have changed under it.

Expiry uses the wall clock of each contender; clocks within a few seconds of
each other are enough, since the time to live is tens of seconds.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from edgecache.cache.errors import ObjectExists, ObjectNotFound
from edgecache.cache.storage import ObjectStore

__all__ = ["UNLISTED_HOLDER", "Lease", "LeaseRecord"]

log = logging.getLogger(__name__)

_KEEP = 4  # generations kept behind the newest (for a reader listing mid-write)
# Who holds a generation written by another that the store does not list yet.
UNLISTED_HOLDER = "another controller (its lease record is not listed yet)"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One generation of the lease."""

    holder: str
    expires: float  # unix seconds; 0 for a released lease
    generation: int

    def live(self, now: float) -> bool:
        """Whether this record still holds the lease at ``now``."""
        return self.expires > now


class Lease:
    """The lease under ``prefix`` (a URL), held as ``holder`` for ``ttl`` seconds at a time."""

    def __init__(self, store: ObjectStore, prefix: str, holder: str, ttl: float = 30.0) -> None:
        if ttl <= 0:
            raise ValueError(f"the lease time to live must be positive, got {ttl}")
        self.store, self.prefix, self.holder, self.ttl = store, prefix.rstrip("/"), holder, ttl
        self.generation: int | None = None  # the generation we hold, if any
        # Whether the last acquire that succeeded took the lease anew rather than renewing
        # the newest generation, ours: only then can another holder have acted in between.
        self.gained = False

    def _url(self, generation: int) -> str:
        return f"{self.prefix}/{generation:020d}"

    async def current(self) -> LeaseRecord | None:
        """The newest record, or None if the lease was never taken."""
        listed = await self.store.list(self.prefix + "/")
        generations = sorted(
            int(name) for o in listed if (name := o.url.rsplit("/", 1)[-1]).isdigit()
        )
        for generation in reversed(generations):  # the newest readable one
            try:
                raw = await self.store.get(self._url(generation))
                data = json.loads(raw)
                return LeaseRecord(str(data["holder"]), float(data["expires"]), generation)
            except ObjectNotFound:
                continue  # deleted between list and get
            except (ValueError, KeyError, TypeError):
                log.warning("lease record %s is unreadable; skipping it", self._url(generation))
                continue
        return None

    async def _write(self, generation: int, expires: float) -> bool:
        record = {"holder": self.holder, "expires": expires, "generation": generation}
        try:
            await self.store.put(self._url(generation), json.dumps(record).encode(), if_absent=True)
        except ObjectExists:
            return False
        for old in range(max(generation - _KEEP - 8, 0), generation - _KEEP):
            try:
                await self.store.delete(self._url(old))
            except Exception:  # noqa: BLE001 - garbage collection never fails the lease
                log.debug("could not delete old lease generation %d", old, exc_info=True)
        return True

    async def acquire(self, now: float | None = None) -> LeaseRecord | None:
        """Take (or renew) the lease; the record now in force if someone else holds it.

        Returns None when this holder holds the lease afterwards; :attr:`gained`
        then says whether it was taken anew (first taken, taken over, or taken
        again after another held it) rather than renewed: a renewal writes the
        generation after our own newest one, so nobody held it in between, even
        when ours had expired.
        """
        now = time.time() if now is None else now
        record = await self.current()
        mine = record is not None and (record.holder, record.generation) == (
            self.holder,
            self.generation,
        )
        if record is not None and record.live(now) and not mine:
            self.generation = None
            return record
        generation = (record.generation if record else 0) + 1
        if await self._write(generation, now + self.ttl):
            self.generation, self.gained = generation, not mine
            return None
        self.generation = None
        # Someone else wrote that generation first: theirs is in force. A store whose
        # listing lags its writes (or does not list them) may not show it yet; read as
        # "nobody", that made every contender that lost the write a holder too.
        winner = await self.current()
        if winner is None or winner.generation < generation:
            log.warning(
                "the controller's lease generation %d under %s was written by another, but "
                "the store does not list it (yet): standing by; a store whose listings lag "
                "its writes for long cannot hold the lease (use S3 or a filesystem)",
                generation,
                self.prefix,
            )
            return LeaseRecord(UNLISTED_HOLDER, now + self.ttl, generation)
        return winner

    async def release(self) -> None:
        """Give the lease up at once (a released record has expired)."""
        if self.generation is None:
            return
        record = await self.current()
        if record is not None and record.generation == self.generation:
            await self._write(record.generation + 1, 0.0)
        self.generation = None
