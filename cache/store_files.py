"""Opening a cache directory: the LMDB environment, its format, and the single writer's lock.

The map is sized at twice the capacity plus headroom, so MVCC copies and
B-tree pages never hit ``MapFullError``; a writer holds ``writer.lock``
(flock, released by the kernel if the process dies); readers open the same
file read-only next to it.

A reader maps as much of its address space as the volume under the store
holds, not only what the file holds when it opens: a reader whose map is
smaller than the writer's data must remap (``MDB_MAP_RESIZED``), and a remap
moves the map under every view still read from it, which crashed readers
that opened a cache while its node was still staging into it. The file
cannot outgrow its volume, so the reader never remaps.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.metadata
import logging
import os
import shutil
import struct
from pathlib import Path

import lmdb

from edgecache.cache.errors import CacheDirError, WriterLocked, causes
from edgecache.cache.units import format_bytes

__all__ = [
    "DBS",
    "LMDB_DAMAGE",
    "MAP_HEADROOM",
    "REBUILD",
    "STORE_FORMAT",
    "WriterLock",
    "damaged_cache",
    "lmdb_damage",
    "no_space_message",
    "open_reader",
    "open_writer",
    "reader_map_size",
]

log = logging.getLogger(__name__)

# LMDB's own structure found damaged: a page of the wrong type or one that is not there, a
# failed meta-page update, a file that is no LMDB file. No entry can then be dropped or
# fetched again through the tree (mdb_del fails as mdb_get does): only a new cache mends it.
LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)
REBUILD = (
    "stop the node, move its cache directory aside (or delete it) and start it again: it "
    "fetches what it serves anew, and readers use other nodes meanwhile"
)


def damaged_cache(damage: BaseException) -> str:
    """What a call that met LMDB damage answers: what it is, and what mends it."""
    return (
        f"this node's cache is damaged in LMDB's own pages ({damage}), where the node can "
        f"neither drop the entry nor fetch it again: {REBUILD}"
    )


def lmdb_damage(exc: BaseException) -> BaseException | None:
    """The error among ``exc`` and what it was raised from that says the LMDB file is damaged."""
    return next((c for c in causes(exc, itself=True) if isinstance(c, LMDB_DAMAGE)), None)


STORE_FORMAT = b"edgecache-store/1"
_FORMAT_PREFIX = b"edgecache-store/"
DBS = (b"chunks", b"shards", b"versions", b"access", b"manifests", b"meta")
MAP_HEADROOM = 256 << 20
LOCK_FILE = "writer.lock"
MIN_FREE_CAPACITY = 64 << 20  # a capacity taken from free space must be at least this
READER_MAP_LIMIT = 1 << 44  # 16 TiB: a reader maps at most this much address space up front
_MIB = 1 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


# LMDB's meta pages (lmdb.h, 64-bit): a 16-byte page header, then MDB_meta: magic and
# version (2 × u32), address and map size (2 × 8), two MDB_db of 48 bytes (the first's
# md_pad holds the page size), then the last page used and the transaction id (2 × u64).
_META = 16
_LMDB_MAGIC = 0xBEEFC0DE


def check_data_file(path: Path) -> None:
    """Refuse a cache whose ``data.mdb`` is shorter than its own meta pages say.

    LMDB maps the file and trusts it: a truncated one (a copy cut short, a disk
    that lost its tail) killed the node with SIGBUS at its first read, nothing
    logged, so it restarted into the same crash; an empty one failed with "Bad
    file descriptor". Both are told here, naming the file and what to do.
    """
    data_file = path / "data.mdb"
    try:
        size = data_file.stat().st_size
        with data_file.open("rb") as f:
            head = f.read(2 * 65536)
    except FileNotFoundError:
        return  # a new store
    except OSError as exc:
        raise CacheDirError(f"cannot read {data_file}: {exc.strerror}") from exc
    fix = (
        "move the directory aside (or delete it) and start the node on an empty --cache-dir: "
        "it fetches what it served again"
    )
    if size < 2 * _META + 128:
        raise CacheDirError(f"{data_file} is damaged: {size} bytes, no LMDB header; {fix}")
    (magic,) = struct.unpack_from("<I", head, _META)
    if magic != _LMDB_MAGIC:
        return  # not LMDB at all: lmdb.open says so (see open_reader)
    (page,) = struct.unpack_from("<I", head, _META + 24)
    if page < 512 or page > 65536 or page & (page - 1) or len(head) < page + _META + 136:
        raise CacheDirError(f"{data_file} is damaged: its LMDB header is not valid; {fix}")
    metas = [struct.unpack_from("<QQ", head, offset + _META + 120) for offset in (0, page)]
    last_page, _ = max(metas, key=lambda m: m[1])  # the meta of the newest transaction
    needed = (last_page + 1) * page
    if size < needed:
        raise CacheDirError(
            f"{data_file} is damaged: {format_bytes(size)}, but its last transaction wrote "
            f"{format_bytes(needed)} (the file was cut short); {fix}"
        )


def open_reader(path: Path, max_readers: int) -> lmdb.Environment:
    """The store at ``path``, read-only (many processes may, next to the writer)."""
    if not (path / "data.mdb").is_file():
        raise CacheDirError(
            f"no edgecache store at {path}: check the path, or start a node "
            f"with --cache-dir {path} to create one"
        )
    check_data_file(path)
    # Less where address space is limited (ulimit -v): the most that maps, down to
    # what the file holds (LMDB raises 1 MiB to that).
    sizes = [reader_map_size(path)]
    while sizes[-1] > 4 * MAP_HEADROOM:
        sizes.append(sizes[-1] // 4 // _MIB * _MIB)
    sizes.append(1 << 20)
    for attempt, map_size in enumerate(sizes):
        try:
            env = lmdb.open(
                str(path),
                readonly=True,
                max_dbs=len(DBS),
                max_readers=max_readers,
                map_size=map_size,
            )
            break
        except lmdb.InvalidError as exc:
            raise CacheDirError(
                f"{path} is not an edgecache store: its data.mdb is not an LMDB file ({exc}); "
                "check the path"
            ) from exc
        except (lmdb.MemoryError, lmdb.InvalidParameterError) as exc:
            if attempt + 1 < len(sizes):  # address space refused: try less
                if attempt == 0:
                    log.warning(
                        "cannot map %s of %s (%s): mapping less; a reader whose map the "
                        "cache outgrows waits for its reads to end to follow it",
                        format_bytes(map_size),
                        path,
                        exc,
                    )
                continue
            raise CacheDirError(f"cannot open the cache at {path} read-only: {exc}") from exc
        except lmdb.Error as exc:
            raise CacheDirError(f"cannot open the cache at {path} read-only: {exc}") from exc
    _check_format(env, path)
    return env


def reader_map_size(path: Path) -> int:
    """How much a reader maps: the volume under ``path`` (at most 16 TiB), or the file if larger.

    Read-only shared file mappings cost address space only, no memory: the
    pages are the page cache's, faulted in as they are read.
    """
    try:
        fs = os.statvfs(path)
        volume = fs.f_blocks * fs.f_frsize
    except OSError:
        volume = 0
    data = (path / "data.mdb").stat().st_size
    size = max(min(volume, READER_MAP_LIMIT), data) + MAP_HEADROOM
    return -(-size // _MIB) * _MIB


def open_writer(
    path: Path, capacity_bytes: int | None, *, sync: bool, max_readers: int
) -> tuple[lmdb.Environment, int]:
    """The store at ``path`` for writing (created if new) and its capacity.

    The caller holds the :class:`WriterLock`. Without a capacity the last
    writer's is kept, else 80% of the filesystem's free space. An existing
    store opens on a full disk (it writes nothing unless its capacity changes),
    so a node restarted there serves what it holds.
    """
    check_data_file(path)
    try:
        existing = _existing_capacity(path)
        if capacity_bytes is None:
            capacity_bytes = existing or _capacity_from_free_space(path)
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
        try:
            _write_meta(env, path, capacity_bytes)
        except lmdb.DiskError as exc:
            if existing is None:  # a new store: nothing to serve without room
                env.close()
                raise CacheDirError(no_space_message(path, "creating the cache")) from exc
            log.warning(
                "the disk under %s is full: the capacity %d is used but not recorded; "
                "free space on that volume",
                path,
                capacity_bytes,
            )
        stale = env.reader_check()  # slots of readers killed with SIGKILL
        if stale:
            log.info("reclaimed %d stale LMDB reader slots in %s", stale, path)
        return env, capacity_bytes
    except LMDB_DAMAGE as exc:
        raise CacheDirError(f"the cache at {path} is damaged ({exc}): {REBUILD}") from exc
    except lmdb.Error as exc:
        raise CacheDirError(f"cannot open the cache at {path}: {exc}") from exc


def _write_meta(env: lmdb.Environment, path: Path, capacity_bytes: int) -> None:
    """Create the databases and record format and capacity, writing only what changed.

    A commit with nothing changed writes no pages, so opening an unchanged
    store needs no free disk.
    """
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        found = txn.get(b"format", db=meta)
        if found is not None and found != STORE_FORMAT:
            raise CacheDirError(format_problem(path, found, reader=False))
        for name in DBS:
            env.open_db(name, txn=txn)
        if found is None:
            txn.put(b"format", STORE_FORMAT, db=meta)
        capacity = capacity_bytes.to_bytes(8, "big")
        if txn.get(b"capacity", db=meta) != capacity:
            txn.put(b"capacity", capacity, db=meta)


def _capacity_from_free_space(path: Path) -> int:
    """80% of the free space under ``path``; refused when that is too small to be of use.

    The capacity is remembered, so a node first started on a nearly full disk
    would otherwise keep a cache of a few KiB after the disk is cleared.
    """
    free = shutil.disk_usage(path).free
    capacity = int(free * 0.8)
    if capacity < MIN_FREE_CAPACITY:
        raise CacheDirError(
            f"the disk under {path} has only {format_bytes(free)} free: a cache sized from it "
            f"(80%, {format_bytes(capacity)}) would hold next to nothing, and that size is "
            "remembered. Free space on that volume, point --cache-dir at a larger one, or "
            "pass --capacity to set the size yourself"
        )
    return capacity


def no_space_message(path: Path, doing: str) -> str:
    """What to say when ``doing`` something in the cache at ``path`` found its disk full."""
    free = shutil.disk_usage(path).free if path.exists() else 0
    return (
        f"{doing} at {path} failed: the disk is full ({format_bytes(free)} free); free space "
        "on that volume or point --cache-dir at another one"
    )


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
        raise CacheDirError(format_problem(path, found, reader=True))


def format_problem(path: Path, found: bytes | None, *, reader: bool) -> str:
    """Why a store of another format cannot be opened here, and what to do about it.

    A store written by a newer edgecache is an edgecache store all the same:
    the fix is running a newer edgecache here, not pointing elsewhere.
    """
    number = found[len(_FORMAT_PREFIX) :] if found and found.startswith(_FORMAT_PREFIX) else b""
    ours = int(STORE_FORMAT[len(_FORMAT_PREFIX) :])
    if number.isdigit() and int(number) > ours:
        said = (
            f"the cache at {path} is in store format {int(number)}, written by a newer "
            f"edgecache; {_version()} reads format {ours} only. "
        )
        if reader:
            return said + (
                "Upgrade edgecache on this host (pip install -U edgecache) to the node's "
                "version, or read through the node's gRPC endpoint instead of lmdb://"
            )
        return said + (
            "Run the edgecache that wrote it (or newer), or point --cache-dir at another directory"
        )
    if reader:
        return f"{path} is not an edgecache store (format {found!r}); check the path"
    return (
        f"{path} holds an LMDB database that is not an edgecache store (format {found!r}); "
        "point --cache-dir at an empty directory"
    )


def _version() -> str:
    try:
        return "edgecache " + importlib.metadata.version("edgecache")
    except importlib.metadata.PackageNotFoundError:
        return "this edgecache"


class WriterLock:
    """The store's single-writer lock (``writer.lock``, flock): one writer per directory."""

    def __init__(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise CacheDirError(no_space_message(path.parent, "creating the cache")) from exc
            raise CacheDirError(
                f"cannot create cache directory {path}: {exc.strerror}; "
                "create it with the right owner or choose another --cache-dir"
            ) from exc
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CacheDirError(
                f"cache directory {path} is not writable ({exc.strerror}): fix its "
                "permissions or mount it read-write, or give the node another --cache-dir "
                "(readers need no write access: lmdb:// opens it read-only)"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WriterLocked(
                f"another process (pid {holder}) is the writer of {path} (an edge node "
                "serving it?); stop it or give this node another --cache-dir (readers need no "
                "lock: lmdb:// opens the directory read-only)"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:  # read-only filesystems can still grant the flock
            os.close(fd)
            if exc.errno in _NO_SPACE:
                raise CacheDirError(no_space_message(path, "taking the writer lock")) from exc
            raise CacheDirError(
                f"cache directory {path} is not writable ({exc.strerror}): fix its "
                "permissions or mount it read-write, or give the node another --cache-dir "
                "(readers need no write access: lmdb:// opens it read-only)"
            ) from exc
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock); safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
