"""Object storage: origin data and the version registry, addressed by full URLs.

:mod:`.s3` serves ``s3://`` through one pooled aiobotocore client (ranged
parallel GETs, ``If-Match``, create-only PUTs, checksums checked, retries);
:mod:`.filesystem` serves every other scheme through fsspec; :mod:`.base`
holds what every store offers and the checks they share; :class:`Stores`
picks one per URL.
"""

from __future__ import annotations

from edgecache.cache.storage.base import ObjectInfo, ObjectStore, RetryStats, Slot
from edgecache.cache.storage.filesystem import FsspecStore
from edgecache.cache.storage.s3 import S3Store

__all__ = ["FsspecStore", "ObjectInfo", "ObjectStore", "RetryStats", "S3Store", "Slot", "Stores"]


class Stores:
    """The object stores one component uses, one per kind, opened lazily.

    S3 clients are bound to the event loop that opened them, so a ``Stores``
    belongs to one loop; ``close()`` it before the loop ends.
    """

    def __init__(self) -> None:
        self._s3: S3Store | None = None
        self._fsspec: FsspecStore | None = None

    def for_url(self, url: str) -> ObjectStore:
        """The store that serves ``url``."""
        if url.startswith("s3://"):
            if self._s3 is None:
                self._s3 = S3Store()
            return self._s3
        if self._fsspec is None:
            self._fsspec = FsspecStore()
        return self._fsspec

    def stats(self) -> RetryStats:
        """Requests, retries and bytes read, summed over the stores opened."""
        total = RetryStats()
        for store in (self._s3, self._fsspec):
            if store is not None:
                total.retries += store.stats.retries
                total.requests += store.stats.requests
                total.bytes_read += store.stats.bytes_read
        return total

    async def close(self) -> None:
        """Close every store opened."""
        if self._s3 is not None:
            await self._s3.close()
        self._s3 = self._fsspec = None
