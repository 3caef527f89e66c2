"""Every URL scheme but ``s3://`` (``file://``, ``memory://``, ``gs://``, …), through fsspec.

Where a backend has no ETag, ``size-mtime`` stands in for one. fsspec's own
errors do not tell a location that never answered from one that holds
nothing (its HTTP ``exists`` and ``info`` answer "not there" for a host they
could not reach; a filesystem that connects when opened, ``ftp://``, raises the
socket's error raw; an HTTP 5xx is aiohttp's, not an ``OSError``): every failure
leaves this store as :class:`ObjectNotFound` only when the location answered
that nothing is there, else as :class:`OriginError` naming the URL.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn, TypeVar

import fsspec

from edgecache.cache.errors import ObjectExists, ObjectNotFound, OriginError, causes
from edgecache.cache.storage.base import (
    UNANSWERED,
    ObjectInfo,
    ObjectStore,
    RetryStats,
    Slot,
    changed,
    no_slot,
)

__all__ = ["FsspecStore"]

T = TypeVar("T")


def _ns(stamp: object) -> int:
    """A time fsspec reports (seconds, or a datetime) in nanoseconds."""
    if isinstance(stamp, datetime):
        stamp = stamp.timestamp()
    return int(float(stamp or 0) * 1e9)  # type: ignore[arg-type]


# An HTTP server that accepts a connection and never answers (or stops sending) is given
# this long, per connect and per read, then the request fails as unreachable. aiohttp's
# default (fsspec's) was 5 minutes for the whole request: a silent registry held status
# for 5 min 1 s printing nothing, and any download longer than 5 minutes failed.
HTTP_CONNECT_TIMEOUT = 10.0
HTTP_READ_TIMEOUT = 30.0


def _options(url: str) -> dict[str, Any]:
    """The options fsspec is given for ``url``: HTTP's timeouts (``HTTP_READ_TIMEOUT``)."""
    if not url.lower().startswith(("http://", "https://")):
        return {}
    import aiohttp  # fsspec's HTTP filesystem's: always there (aiobotocore needs it too)

    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=HTTP_CONNECT_TIMEOUT, sock_read=HTTP_READ_TIMEOUT
    )
    return {"client_kwargs": {"timeout": timeout}}


class FsspecStore(ObjectStore):
    """Any fsspec filesystem; blocking calls run in worker threads."""

    def __init__(self) -> None:
        self.stats = RetryStats()

    @staticmethod
    def _fs(url: str) -> tuple[Any, str]:
        """The filesystem and path for ``url``; some filesystems connect here (``ftp://``)."""
        try:
            return fsspec.core.url_to_fs(url, **_options(url))
        except (ImportError, ValueError) as exc:
            raise OriginError(f"cannot open {url}: {exc}") from exc
        except OSError as exc:
            _raise_for(url, exc)

    @staticmethod
    def _info(url: str, raw: dict[str, Any]) -> ObjectInfo:
        etag = raw.get("ETag") or raw.get("etag") or raw.get("md5Hash")
        if not etag:
            mtime = raw.get("mtime") or raw.get("LastModified") or raw.get("created") or 0
            etag = f"{raw['size']}-{_ns(mtime)}"
            # A local file's inode change time (fsspec's "created"): rewritten with its
            # size and mtime kept (cp -p, rsync -a, tar x restore mtimes), a file kept
            # its size-mtime tag and was served as the published version. A rewrite, and
            # setting the mtime back, move the change time; nothing sets it back.
            if raw.get("mtime") and raw.get("created"):
                etag += f"-{_ns(raw['created'])}"
        return ObjectInfo(url=url, size=int(raw["size"]), etag=str(etag).strip('"'))

    async def _run(self, url: str, fn: Callable[[], T]) -> T:
        self.stats.requests += 1
        try:
            return await asyncio.to_thread(fn)
        except FileExistsError as exc:
            raise ObjectExists(f"{url} already exists") from exc
        except Exception as exc:
            _raise_for(url, exc)

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
        """Every file under the prefix: none if nothing is there, an error if it cannot be read.

        fsspec's ``find`` leaves out what it could not list and, like ``exists``,
        answers "nothing" for a host it could not reach: an unreachable registry
        was one that "holds no datasets" (exit 2, publish there). So when it finds
        nothing, the prefix is listed once more, and only an error that says
        nothing is there (see :func:`_raise_for`) makes the answer "none".
        """
        fs, path = self._fs(prefix_url)
        protocol = prefix_url.split("://", 1)[0] if "://" in prefix_url else "file"

        def find() -> dict[str, dict[str, Any]]:
            found: dict[str, dict[str, Any]] = fs.find(path, detail=True)
            if not found:
                try:
                    fs.ls(path, detail=False)
                except (FileNotFoundError, NotADirectoryError) as exc:  # under a file: none
                    if exc.__cause__ is not None and _status(exc.__cause__) not in _GONE:
                        raise
                return {}
            # HTTP listings are links: their sizes are None until each is asked (HEAD).
            return {
                name: raw if raw.get("size") is not None else fs.info(name)
                for name, raw in found.items()
            }

        found = await self._run(prefix_url, find)
        return sorted(
            # Most filesystems name paths without their protocol; HTTP's are whole URLs.
            (
                self._info(name if "://" in name else f"{protocol}://{name}", raw)
                for name, raw in found.items()
            ),
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


def _raise_for(url: str, exc: Exception) -> NoReturn:
    """Raise this store's error for what fsspec raised on ``url``; one no origin's as it is.

    Absent (:class:`ObjectNotFound`) only when the location answered so: a
    missing file, an HTTP 404 or 410. Nothing answering (a connection refused
    or reset, a name that does not resolve, a timeout) is :class:`OriginError`
    raised from the socket's own error, as :func:`.base.unreachable` reads it.
    An HTTP 401 or 403 is one raised from a ``PermissionError``: a refusal no
    retry changes, as a node's status mapping reads it; another HTTP status
    names itself. fsspec's HTTP ``info`` raises ``FileNotFoundError`` from
    whatever failed, so that is what is read.
    """
    import aiohttp  # fsspec's HTTP filesystem's: always there (aiobotocore needs it too)

    seen = exc.__cause__ if isinstance(exc, FileNotFoundError) and exc.__cause__ else exc
    if (status := _status(seen)) is not None:
        said = f"HTTP {status} {getattr(seen, 'message', '')}".strip()
        if status in _GONE:
            raise ObjectNotFound(f"no object at {url} ({said})") from exc
        if status in (401, 403):
            raise OriginError(
                f"origin refused access to {url} ({said}): check the credentials and that "
                "this URL may be read"
            ) from _refused(seen)
        advice = (
            "the server failed: try again later, or ask whoever runs it"
            if status >= 500
            else "check the URL"
        )
        raise OriginError(f"origin request for {url} failed ({said}): {advice}") from seen
    unanswered = next((c for c in causes(seen, itself=True) if isinstance(c, UNANSWERED)), None)
    if unanswered is not None or isinstance(seen, aiohttp.ClientConnectionError):
        why = unanswered or seen
        raise OriginError(
            f"cannot reach {url}: {str(why) or type(why).__name__}; check the URL and the network"
        ) from why
    if isinstance(exc, FileNotFoundError):
        raise ObjectNotFound(f"no object at {url}") from exc
    if isinstance(exc, OSError):
        raise OriginError(f"origin request for {url} failed: {exc}") from exc
    raise exc


_GONE = (404, 410)  # HTTP statuses that say nothing is there


def _status(exc: BaseException) -> int | None:
    """The HTTP status of aiohttp's error for a response (fsspec's HTTP one raises it)."""
    import aiohttp

    return exc.status if isinstance(exc, aiohttp.ClientResponseError) else None


def _refused(exc: BaseException) -> PermissionError:
    """A ``PermissionError`` caused by ``exc``, for an HTTP 401/403 read as a refusal."""
    refused = PermissionError(str(exc))
    refused.__cause__ = exc
    return refused


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
