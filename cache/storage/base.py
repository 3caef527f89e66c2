"""What every object store offers, and the checks all of them share."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import socket
import zlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from edgecache.cache.errors import ObjectNotFound, OriginChanged, OriginError

__all__ = [
    "UNANSWERED",
    "ObjectInfo",
    "ObjectStore",
    "RetryStats",
    "Slot",
    "changed",
    "no_slot",
    "unreachable",
    "verify",
]

Slot = Callable[[], AbstractAsyncContextManager[object]]
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
_LOCAL_TAG = re.compile(r"\d+-\d+")  # size-mtime: a local file's tag before its ctime was in it
# The socket's errors when nothing answered: refused or reset, no such host, timed out.
UNANSWERED = (ConnectionError, socket.gaierror, TimeoutError)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a version records about a source object, and what a fetch checks again."""

    url: str
    size: int
    etag: str
    sha256: str | None = None  # base64 full-object SHA-256, when the store reports one
    crc32: str | None = None  # base64 full-object CRC32 (what SDKs upload with by default)

    def same_content(self, other: ObjectInfo) -> bool:
        """Whether ``other`` describes the same bytes (ETag and size agree).

        A version published before local files' tags named their change time
        recorded ``size-mtime``: the ``size-mtime-ctime`` of the same file now
        agrees with it (its content is checked as far as that version can be).
        """
        if self.size != other.size:
            return False
        if self.etag == other.etag:
            return True
        short, long = sorted((self.etag, other.etag), key=len)
        return _LOCAL_TAG.fullmatch(short) is not None and long.startswith(short + "-")


@dataclass
class RetryStats:
    """Counters a node exports as metrics."""

    retries: int = 0
    bytes_read: int = 0
    requests: int = 0


class ObjectStore(ABC):
    """Async access to one kind of object storage, addressed by full URLs."""

    stats: RetryStats

    @abstractmethod
    async def head(self, url: str) -> ObjectInfo:
        """Size, ETag and checksum of one object; :class:`ObjectNotFound` if absent."""

    @abstractmethod
    async def list(self, prefix_url: str) -> list[ObjectInfo]:
        """Every object under a prefix, sorted by URL."""

    @abstractmethod
    async def get(
        self, url: str, *, expect: ObjectInfo | None = None, slot: Slot | None = None
    ) -> bytes:
        """The whole object, verified; :class:`OriginChanged` if it no longer matches ``expect``.

        With ``slot``, every request to origin runs inside ``slot()``: a caller
        shapes its traffic per request (a ranged part), not per object.
        """

    @abstractmethod
    async def get_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of an object."""

    @abstractmethod
    async def put(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write an object; with ``if_absent``, raise :class:`ObjectExists` rather than replace."""

    async def update(self, url: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """Read-modify-write one small object: ``change(current)`` gives the new bytes.

        ``current`` is None when the object is absent; ``change`` returning None
        leaves the object as it is. Stores that can (S3's conditional writes, a
        lock on local disks) make this atomic against other ``update`` calls,
        calling ``change`` again on what another writer left; this fallback
        reads, then writes, and two writers at once can lose one's change.
        """
        try:
            current: bytes | None = await self.get(url)
        except ObjectNotFound:
            current = None
        new = change(current)
        if new is not None:
            await self.put(url, new)

    @abstractmethod
    async def delete(self, url: str) -> None:
        """Remove an object; removing one that is not there is not an error."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def unreachable(exc: OriginError) -> bool:
    """Whether a store's error says nothing answered at the URL, not that something refused.

    Stores raise such an :class:`OriginError` from the socket's own error (see
    :data:`UNANSWERED`), so a caller that knows where the URL came from can say
    which setting to check (``--registry``) and that the network is suspect,
    where "not found" or "refused" would send a person to the data instead.
    """
    return isinstance(exc.__cause__, UNANSWERED)


@contextlib.asynccontextmanager
async def no_slot() -> AsyncIterator[None]:
    """A slot that admits every request at once."""
    yield


def changed(url: str, expect: ObjectInfo, found: ObjectInfo) -> OriginChanged:
    """The error for an object that no longer matches what its version recorded."""
    return OriginChanged(
        f"{url} changed after the version was published (ETag {expect.etag}, size "
        f"{expect.size} recorded; origin now has ETag {found.etag}, size {found.size}). "
        "A version is immutable: publish a new version to pick up the change"
    )


def verify(data: bytes, info: ObjectInfo) -> str | None:
    """Check bytes against the checksum origin reports; a problem description or None.

    The cheapest full-object checksum origin gave is used: CRC32 (zlib, several
    GB/s) where the object has one, as S3 SDKs upload with by default; else
    SHA-256; else the MD5 that a single-part upload's ETag is (about 0.6 GB/s
    here: a tenth of a staging node's CPU per token shard went to it).
    """
    if len(data) != info.size:
        return f"got {len(data)} bytes, expected {info.size}"
    if info.crc32 and "-" not in info.crc32:  # "-N" marks a composite multipart checksum
        actual = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        if actual != info.crc32:
            return f"CRC32 {actual} does not match origin's {info.crc32}"
    elif info.sha256 and "-" not in info.sha256:
        actual = base64.b64encode(hashlib.sha256(data).digest()).decode()
        if actual != info.sha256:
            return f"SHA-256 {actual} does not match origin's {info.sha256}"
    elif _MD5_ETAG.fullmatch(info.etag):  # single-part uploads: the ETag is the MD5
        actual = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if actual != info.etag:
            return f"MD5 {actual} does not match the ETag {info.etag}"
    return None
