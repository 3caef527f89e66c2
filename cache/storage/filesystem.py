"""Every URL scheme but ``s3://`` (``file://``, ``memory://``, ``gs://``, …), through fsspec.

Where a backend has no ETag, ``size-mtime`` stands in for one.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import fsspec

from edgecache.cache.errors import ObjectExists, ObjectNotFound, OriginError
from edgecache.cache.storage.base import ObjectInfo, ObjectStore, RetryStats, Slot, changed, no_slot

__all__ = ["FsspecStore"]

T = TypeVar("T")


class FsspecStore(ObjectStore):
    """Any fsspec filesystem; blocking calls run in worker threads."""

    def __init__(self) -> None:
        self.stats = RetryStats()

    @staticmethod
    def _fs(url: str) -> tuple[Any, str]:
        try:
            return fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise OriginError(f"cannot open {url}: {exc}") from exc

    @staticmethod
    def _info(url: str, raw: dict[str, Any]) -> ObjectInfo:
        etag = raw.get("ETag") or raw.get("etag") or raw.get("md5Hash")
        if not etag:
            mtime = raw.get("mtime") or raw.get("LastModified") or raw.get("created") or 0
            if isinstance(mtime, datetime):
                mtime = mtime.timestamp()
            etag = f"{raw['size']}-{int(float(mtime) * 1e9)}"
        return ObjectInfo(url=url, size=int(raw["size"]), etag=str(etag).strip('"'))

    async def _run(self, url: str, fn: Callable[[], T]) -> T:
        self.stats.requests += 1
        try:
            return await asyncio.to_thread(fn)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object at {url}") from exc
        except FileExistsError as exc:
            raise ObjectExists(f"{url} already exists") from exc
        except OSError as exc:
            raise OriginError(f"origin request for {url} failed: {exc}") from exc

    async def head(self, url: str) -> ObjectInfo:
        """The object's info; a directory counts as absent."""
        fs, path = self._fs(url)

        def info() -> dict[str, Any]:
            raw = fs.info(path)
            if raw.get("type") == "directory":
                raise FileNotFoundError(path)
            return raw

        return self._info(url, await self._run(url, info))

    async def list(self, prefix_url: str) -> list[ObjectInfo]:
        """Every file under the prefix (none if it does not exist)."""
        fs, path = self._fs(prefix_url)
        protocol = prefix_url.split("://", 1)[0] if "://" in prefix_url else "file"

        def find() -> dict[str, dict[str, Any]]:
            if not fs.exists(path):
                return {}
            return fs.find(path, detail=True)

        found = await self._run(prefix_url, find)
        return sorted(
            (self._info(f"{protocol}://{name}", raw) for name, raw in found.items()),
            key=lambda o: o.url,
        )

    async def get(
        self, url: str, *, expect: ObjectInfo | None = None, slot: Slot | None = None
    ) -> bytes:
        """The object, after checking its size and ETag still match ``expect``."""
        fs, path = self._fs(url)
        if expect is not None:
            found = await self.head(url)
            if not expect.same_content(found):
                raise changed(url, expect, found)
        async with (slot or no_slot)():
            data = await self._run(url, lambda: fs.cat_file(path))
        self.stats.bytes_read += len(data)
        if expect is not None and len(data) != expect.size:
            raise changed(url, expect, ObjectInfo(url, len(data), "?"))
        return bytes(data)

    async def get_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive)."""
        fs, path = self._fs(url)
        data = await self._run(url, lambda: fs.cat_file(path, start=start, end=end))
        self.stats.bytes_read += len(data)
        return bytes(data)

    async def put(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write; on local disks whole or not at all, elsewhere as the filesystem writes.

        ``if_absent`` is atomic on local disks, check-then-write elsewhere.
        """
        fs, path = self._fs(url)

        def write() -> None:
            fs.makedirs(fs._parent(path), exist_ok=True)
            local = _is_local(fs)
            if not if_absent:
                (_replace_file if local else fs.pipe_file)(path, data)
            elif local:
                _link_new_file(path, data)
            else:
                # No create-only primitive in generic fsspec: check, then write. Racy;
                # publishers on such stores must be serialised (see cache/registry.py).
                if fs.exists(path):
                    raise FileExistsError(path)
                fs.pipe_file(path, data)

        await self._run(url, write)

    async def update(self, url: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """Read-modify-write; on local disks under a lock, so writers take turns.

        The lock is ``flock`` on ``.<name>.lock`` beside the file (the file itself
        is replaced whole, a new inode each time, so it cannot carry the lock):
        atomic against other ``update`` calls on this host and across hosts on
        filesystems whose locks span them. Elsewhere: read, then write.
        """
        fs, path = self._fs(url)
        if not _is_local(fs):
            await super().update(url, change)
            return

        def locked() -> None:
            directory, name = os.path.split(path)
            os.makedirs(directory or ".", exist_ok=True)
            lock_path = os.path.join(directory, f".{name}.lock")
            try:
                lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except PermissionError:  # another user's lock file: flock needs no write access
                lock = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    with open(path, "rb") as f:
                        current: bytes | None = f.read()
                except FileNotFoundError:
                    current = None
                new = change(current)
                if new is not None:
                    _replace_file(path, new)
            finally:
                os.close(lock)  # releases the lock

        await self._run(url, locked)

    async def delete(self, url: str) -> None:
        """Remove the file, if it is there."""
        fs, path = self._fs(url)

        def remove() -> None:
            if fs.exists(path):
                fs.rm_file(path)

        await self._run(url, remove)


def _is_local(fs: Any) -> bool:
    """Whether an fsspec filesystem is this machine's own (file://)."""
    return fs.protocol in ("file", "local") or "file" in fs.protocol


def _written_temporary(directory: str, data: bytes) -> str:
    """A new temporary file in ``directory`` holding ``data``, on disk (fsync'd).

    It is created with mode 0666 minus the umask, like any file this process
    writes (``mkstemp`` would make it 0600 whatever the umask): registry files
    are read by nodes running as other users.
    """
    for _ in range(100):
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 64 random bits
        raise FileExistsError(f"cannot create a temporary file in {directory}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _link_new_file(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` atomically, failing if it exists (no torn files)."""
    tmp = _written_temporary(os.path.dirname(path) or ".", data)
    try:
        os.link(tmp, path)  # atomic, and fails with FileExistsError if taken
    finally:
        os.unlink(tmp)


def _replace_file(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it).

    Written in place, a reader, a crash or a full disk could leave it truncated.
    """
    tmp = _written_temporary(os.path.dirname(path) or ".", data)
    try:
        os.replace(tmp, path)  # atomic on one filesystem
    except BaseException:
        os.unlink(tmp)
        raise
