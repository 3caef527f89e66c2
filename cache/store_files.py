"""Opening a cache directory: the LMDB environment, its format, and the single writer's lock.

The map is sized at twice the capacity plus headroom, so MVCC copies and
B-tree pages never hit ``MapFullError``; a writer holds ``writer.lock``
(flock, released by the kernel if the process dies); readers open the same
file read-only next to it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import lmdb

from edgecache.cache.errors import CacheDirError, WriterLocked

__all__ = ["DBS", "MAP_HEADROOM", "STORE_FORMAT", "WriterLock", "open_reader", "open_writer"]

log = logging.getLogger(__name__)

STORE_FORMAT = b"edgecache-store/1"
DBS = (b"chunks", b"shards", b"versions", b"access", b"manifests", b"meta")
MAP_HEADROOM = 256 << 20
LOCK_FILE = "writer.lock"


def open_reader(path: Path, max_readers: int) -> lmdb.Environment:
    """The store at ``path``, read-only (many processes may, next to the writer)."""
    if not (path / "data.mdb").is_file():
        raise CacheDirError(
            f"no edgecache store at {path}: check the path, or start a node "
            f"with --cache-dir {path} to create one"
        )
    try:
        env = lmdb.open(
            str(path),
            readonly=True,
            max_dbs=len(DBS),
            max_readers=max_readers,
            map_size=1 << 20,  # LMDB takes the larger size recorded in the file
        )
    except lmdb.Error as exc:
        raise CacheDirError(f"cannot open the cache at {path} read-only: {exc}") from exc
    _check_format(env, path)
    return env


def open_writer(
    path: Path, capacity_bytes: int | None, *, sync: bool, max_readers: int
) -> tuple[lmdb.Environment, int]:
    """The store at ``path`` for writing (created if new) and its capacity.

    The caller holds the :class:`WriterLock`. Without a capacity the last
    writer's is kept, else 80% of the filesystem's free space.
    """
    try:
        existing = _existing_capacity(path)
        if capacity_bytes is None:
            capacity_bytes = existing or int(shutil.disk_usage(path).free * 0.8)
        data_file = path / "data.mdb"
        current = data_file.stat().st_size if data_file.exists() else 0
        map_size = max(2 * capacity_bytes + MAP_HEADROOM, current + MAP_HEADROOM)
        env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=len(DBS),
            max_readers=max_readers,
            sync=sync,
            metasync=sync,
            meminit=False,
            readahead=True,
        )
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            found = txn.get(b"format", db=meta)
            if found is not None and found != STORE_FORMAT:
                raise CacheDirError(
                    f"{path} holds an LMDB database that is not an edgecache store "
                    f"(format {found!r}); point --cache-dir at an empty directory"
                )
            for name in DBS:
                env.open_db(name, txn=txn)
            txn.put(b"format", STORE_FORMAT, db=meta)
            txn.put(b"capacity", capacity_bytes.to_bytes(8, "big"), db=meta)
        stale = env.reader_check()  # slots of readers killed with SIGKILL
        if stale:
            log.info("reclaimed %d stale LMDB reader slots in %s", stale, path)
        return env, capacity_bytes
    except lmdb.Error as exc:
        raise CacheDirError(f"cannot open the cache at {path}: {exc}") from exc


def _existing_capacity(path: Path) -> int | None:
    if not (path / "data.mdb").is_file():
        return None
    env = lmdb.open(str(path), readonly=True, max_dbs=len(DBS), lock=False)
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(b"capacity", db=meta)
            return int.from_bytes(raw, "big") if raw else None
    except lmdb.Error:
        return None
    finally:
        env.close()


def _check_format(env: lmdb.Environment, path: Path) -> None:
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            found = txn.get(b"format", db=meta)
    except lmdb.Error as exc:
        env.close()
        raise CacheDirError(f"{path} is not an edgecache store: {exc}") from exc
    if found != STORE_FORMAT:
        env.close()
        raise CacheDirError(
            f"{path} is not an edgecache store (format {found!r}); check --cache-dir"
        )


class WriterLock:
    """The store's single-writer lock (``writer.lock``, flock): one writer per directory."""

    def __init__(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheDirError(
                f"cannot create cache directory {path}: {exc.strerror}; "
                "create it with the right owner or choose another --cache-dir"
            ) from exc
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CacheDirError(
                f"cache directory {path} is not writable ({exc.strerror}): fix its "
                "permissions, mount it read-write, or open the store with readonly=True"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WriterLocked(
                f"another process (pid {holder}) is the writer of {path}; stop it, "
                "use another --cache-dir, or open this store with readonly=True"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:  # read-only filesystems can still grant the flock
            os.close(fd)
            raise CacheDirError(
                f"cache directory {path} is not writable ({exc.strerror}): fix its "
                "permissions, mount it read-write, or open the store with readonly=True"
            ) from exc
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock); safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
