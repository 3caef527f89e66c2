"""Object storage: S3 through aiobotocore, every other URL scheme through fsspec.

Origin data and the version registry both live in object storage. S3 gets a
direct aiobotocore client because staging speed depends on it: a bounded
connection pool, concurrent ranged GETs for large objects, ``If-Match`` on
every part so an object replaced mid-download is noticed, create-only PUTs
(``If-None-Match: *``) for the registry, and verification of the bytes
against the checksum S3 reports (a full-object SHA-256, or the MD5 ETag of a
single-part object): S3-compatible stores have served flipped bytes silently.
Endpoint, region and credentials come from the standard AWS environment and
config files (``AWS_ENDPOINT_URL`` etc.), so any S3-compatible store works.

Request-level retries (503 SlowDown, 5xx, connection errors) are botocore's
"standard" mode: exponential backoff with jitter. A connection reset while
reading a body is retried here, the same way.

Everything else (``file://``, ``memory://``, ``gs://``, …) goes through
fsspec; where a backend has no ETag, ``size-mtime`` stands in for one.

:mod:`.base` holds what every store offers and the checks they share,
:mod:`.s3` and :mod:`.filesystem` the two backends, and :class:`Stores`
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
