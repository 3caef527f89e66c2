"""The regional cache store: whole shards of chunk frames in one LMDB environment.

One store per edge node. Guarantees:

* **All or nothing.** A shard's chunks, its record and the byte accounting are
  written in one LMDB transaction, so after a crash at any moment (kill -9
  included) a shard is either complete or absent.
* **One writer, many readers.** A process opens the store as the writer
  (holding ``writer.lock``) or ``readonly=True``; any number of threads and
  reader processes read concurrently from MVCC snapshots.
* **Never serve bad bytes.** Every chunk read is checked against the xxh3 in
  its frame and in the shard record; a mismatch raises :class:`ChunkCorrupt`
  and the writer drops the shard so the next read is a miss and refetches it.
* **Bounded.** A byte capacity over stored chunks; a new shard that does not
  fit evicts least-recently-used whole shards of unpinned versions, or raises
  :class:`CacheFull` naming the pins. The LMDB map is sized from the capacity
  with headroom, so ``MapFullError`` never reaches a caller.
* **A full disk is an answer, not a crash.** When the volume runs out before
  the capacity does, every write (a shard, a manifest, a pin) raises
  :class:`DiskFull` naming the path and what to free; the failed transaction
  leaves nothing behind and what is stored stays readable.

Zero-copy reads (``read_shard``) hand out views into LMDB's map that are valid
only inside the ``with`` block; they are released when it ends, so a late use
fails loudly instead of reading a recycled page. A view still exported (say,
wrapped by a pyarrow buffer) keeps its read transaction open until it is
dropped. LRU access times are kept in memory and persisted with the next
write; read-only processes do not affect eviction order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import lmdb
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as _Message

from edgecache.cache.errors import (
    CacheDirError,
    CacheFull,
    ChunkCorrupt,
    DiskFull,
    EmptyShard,
    PinChanged,
    ReadOnlyStore,
    ShardNotCached,
    ShardTooLarge,
    StoreError,
    StoreForked,
)
from edgecache.cache.frame import Buffer, verify_frame
from edgecache.cache.keys import (
    ShardKey,
    chunk_key,
    dataset_prefix,
    parse_shard_key,
    parse_version_key,
    version_key,
)
from edgecache.cache.shard_reader import ClosingContext, ShardReader, release_all
from edgecache.cache.store_files import DBS, MAP_HEADROOM, WriterLock, open_reader, open_writer
from edgecache.cache.store_records import (
    Fitted,
    ShardInfo,
    StoreStats,
    VersionInfo,
    ns_to_datetime,
)
from edgecache.cache.units import format_bytes
from edgecache.v1 import store_pb2

__all__ = ["PIN_LATEST", "CacheStore", "ShardInfo", "ShardReader", "StoreStats", "VersionInfo"]

log = logging.getLogger(__name__)
_Record = TypeVar("_Record", bound=_Message)

_CLOSE_WAIT_S = 10.0  # how long close() waits for readers in other threads to finish
# read_shard reaps lingering transactions once every REAP_EVERY reads: a transaction whose
# views are free stays open for at most that many more reads (an LMDB reader slot and its
# snapshot held a little longer), for one pass over the list per REAP_EVERY reads.
REAP_EVERY = 8


# A pin is kept as int64 Unix nanoseconds: from the epoch (0 is "no pin") to 2262-04-11.
PIN_LATEST = datetime.fromtimestamp((2**63 - 1) // 10**9, UTC)


# Pins this close are the same pin: callers keep the times they placed in records of
# their own (ISO text, a status report's Timestamp) and ask about them later.
_SAME_PIN_NS = 10**9


def _pin_ns(until: datetime) -> int:
    """``until`` as the store records a pin, or a ValueError naming the range it may take.

    Outside it the record's int64 overflowed ("Value out of range", naming nothing),
    or a time before 1970 was stored negative.
    """
    seconds = until.timestamp()
    if not 1 <= seconds <= PIN_LATEST.timestamp():  # 0 is "no pin": it would unpin
        raise ValueError(
            f"a pin until {until.isoformat()} is outside what the cache records: from "
            f"1970-01-01T00:00:01Z to {PIN_LATEST:%Y-%m-%dT%H:%M:%SZ}"
        )
    return min(int(seconds * 1e9), 2**63 - 1)


class CacheStore(ClosingContext):
    """A node's LMDB cache of shards. Open one per process; never share across ``fork()``.

    Args:
        path: cache directory (created for a writer if missing).
        capacity_bytes: bytes of chunk data the store may hold. A writer without one
            keeps the capacity recorded by the last writer, or takes 80% of the
            filesystem's free space. Ignored for ``readonly``.
        readonly: open for reading only; many processes may do so next to one writer.
        sync: fsync on commit (survives power loss). Without it a process crash is
            still safe; an OS crash may lose the last commits but never corrupts.
        max_readers: concurrent read transactions across all processes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        readonly: bool = False,
        sync: bool = True,
        max_readers: int = 512,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        # Drop a shard whose chunk fails its check as the chunk is read, so the next read
        # is a miss. An edge node turns this off and drops it on its writer thread: done
        # here, the write (waiting on the writer lock a put holds) ran on its event loop.
        self.drop_corrupt = True
        self._pid = os.getpid()
        self._write_lock = threading.Lock()
        self._counter_lock = threading.Lock()
        self._touched: dict[bytes, int] = {}
        self._lingering: list[tuple[lmdb.Transaction, list[memoryview]]] = []
        self._reads_to_reap = 0  # read_shard reaps when this reaches 0 (REAP_EVERY)
        # Open ShardReaders per thread: close() must not unmap the environment under a
        # reader in another thread (its views point into the map: using them would crash).
        self._reads: dict[int, int] = {}
        self._reads_changed = threading.Condition()
        self._snapshots = 0  # short read transactions open (``_snapshot``)
        self._closing = False
        self._hits = self._misses = 0
        # Bytes of data.mdb past its last committed page, measured by the writer after each
        # write (see room_on_disk): read from any thread without touching LMDB.
        self._tail = 0
        self._evicted_shards = self._evicted_bytes = self._corrupt = 0
        self._damage_said: set[bytes] = set()  # damaged records counted and said, not dropped
        # Called with a shard whose record is damaged, when first seen (the node counts it
        # in its metric and logs it; its store leaves the drop to the next fetch).
        self.on_damage: Callable[[ShardKey], None] | None = None
        self._lock: WriterLock | None = None
        self._env: lmdb.Environment | None = None
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if readonly:
            env = open_reader(self.path, max_readers)
        else:
            self._lock = WriterLock(self.path)
            try:
                env, self.capacity_bytes = open_writer(
                    self.path, capacity_bytes, sync=sync, max_readers=max_readers
                )
            except BaseException:
                self._lock.release()
                raise
        self._env = env
        self._dbs = {name: env.open_db(name, create=False) for name in DBS}
        if readonly:
            self.capacity_bytes = self._read_meta_int(b"capacity")

    def _read_meta_int(self, name: bytes) -> int:
        with self._snapshot() as txn:
            raw = txn.get(name, db=self._dbs[b"meta"])
        return int.from_bytes(raw, "big") if raw else 0

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the environment and release the writer lock.

        Readers open in other threads are waited for (up to ``_CLOSE_WAIT_S``
        seconds); if some are still open then, or open in this thread, new reads
        are refused and the environment closes when the last of them does:
        unmapping it under a reader's views would crash the process. If
        zero-copy views handed out by :meth:`read_shard` are still exported,
        the environment is left open (a leak, not a crash) and a warning logged.
        """
        env = getattr(self, "_env", None)
        if env is None or os.getpid() != self._pid:
            return
        me = threading.get_ident()
        with self._reads_changed:
            if self._closing:
                return  # closed, or closing when its last reader ends
            self._reads_changed.wait_for(lambda: set(self._reads) <= {me}, timeout=_CLOSE_WAIT_S)
            if self._reads:
                self._closing = True
                log.debug(
                    "%d readers of %s are still open; the last one closes the store",
                    sum(self._reads.values()),
                    self.path,
                )
                return
            self._closing = True
        self._finish_close(env)

    def _finish_close(self, env: lmdb.Environment) -> None:
        self._reap_lingering()
        if self._lingering:
            log.warning(
                "%d read views into %s are still in use; leaving the environment open",
                len(self._lingering),
                self.path,
            )
        else:
            try:
                if not self.readonly and self._touched:
                    with self._write_lock, env.begin(write=True) as txn:
                        self._flush_access(txn)
            except lmdb.Error as exc:
                # Access times only order the LRU: losing the last ones (say, to a full
                # disk) must not keep the map open and the writer lock held.
                log.warning("access times of %s not saved on close: %s", self.path, exc)
            finally:
                env.close()
        self._env = None
        if self._lock is not None:
            self._lock.release()

    def _read_started(self, thread: int) -> None:
        self._reads[thread] = self._reads.get(thread, 0) + 1

    def _read_ended(self, thread: int) -> None:
        """A ShardReader of ``thread`` closed; the last one finishes a deferred close."""
        with self._reads_changed:
            left = self._reads.get(thread, 0) - 1
            if left > 0:
                self._reads[thread] = left
            else:
                self._reads.pop(thread, None)
            self._reads_changed.notify_all()
            finish = self._closing and not self._reads and self._env is not None
        if finish and os.getpid() == self._pid:
            self._finish_close(self._env)  # type: ignore[arg-type]

    def _check(self, write: bool = False) -> lmdb.Environment:
        if os.getpid() != self._pid:
            raise StoreForked(
                f"this store of {self.path} was opened in process {self._pid} and used in "
                f"{os.getpid()} after fork(); open a new CacheStore in the child"
            )
        if self._env is None or self._closing:
            raise StoreError(f"the store at {self.path} is closed")
        if write and self.readonly:
            raise ReadOnlyStore(
                f"the store at {self.path} was opened read-only; writes go through the "
                "node that owns it"
            )
        return self._env

    def _read_txn(self) -> lmdb.Transaction:
        """A read transaction; the caller holds ``_reads_changed`` and counts it as a read."""
        env = self._check()
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:
            self._adopt_map_size(env)
            return env.begin(buffers=True)
        except lmdb.ReadersFullError:
            env.reader_check()
            return env.begin(buffers=True)

    def _adopt_map_size(self, env: lmdb.Environment) -> None:
        """Remap to the writer's grown map, when no read of this process is open.

        A remap unmaps the old map and ends every transaction of the
        environment: views still read from (a chunk being decoded in another
        thread, a window decoded zero-copy and still held) would read freed
        address space, which crashed the process. Readers map the whole volume
        up front (:func:`~edgecache.cache.store_files.reader_map_size`), so this
        only happens when that failed or the volume grew; while reads are open
        the read is refused as not possible here, for now.
        """
        self._reap_lingering()
        if self._reads or self._snapshots or self._lingering:
            mapped = format_bytes(env.info()["map_size"])
            raise CacheDirError(
                f"the cache at {self.path} grew beyond the {mapped} this process mapped of it, "
                "and reads of it are still open here (views into the map cannot move): "
                "read elsewhere until they end; if this repeats, let the reader map the "
                "whole volume (raise ulimit -v)"
            )
        env.set_mapsize(0)  # the writer grew the map; adopt its size

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[lmdb.Transaction]:
        """A short read transaction, counted so that no remap happens under it."""
        with self._reads_changed:
            txn = self._read_txn()
            self._snapshots += 1
        try:
            with txn:
                yield txn
        finally:
            with self._reads_changed:
                self._snapshots -= 1

    # ---------------------------------------------------------------- writes

    def put_shard(self, key: ShardKey, frames: Sequence[Buffer]) -> ShardInfo:
        """Store a whole shard atomically, evicting LRU unpinned shards if needed.

        Every frame is verified first, so a damaged frame never enters the cache.
        Replaces the shard if it is already resident.
        """
        env = self._check(write=True)
        key = key.validated()
        if not frames:
            raise EmptyShard(f"{key}: no chunks to store; an empty shard cannot be cached")
        now = time.time_ns()
        record = _shard_record_of(frames, now)
        size = record.stored_bytes
        if size > self.capacity_bytes:
            raise ShardTooLarge(
                f"{key} is {format_bytes(size)}, larger than the whole cache capacity "
                f"({format_bytes(self.capacity_bytes)}); raise --capacity or use smaller shards"
            )
        raw_key = key.encode()
        with self._write_lock:
            for attempt in (1, 2):
                touched: dict[bytes, int] = {}
                try:
                    with env.begin(write=True) as txn:
                        touched = self._flush_access(txn)
                        old = self._shard_record(txn, raw_key)
                        if old is not None:
                            self._delete_shard(txn, raw_key, old)
                        extra = 0 if attempt == 1 else size  # room for B-tree/freelist pages
                        evicted = self._make_room(txn, size + extra, key)
                        chunks = self._dbs[b"chunks"]
                        for index, frame in enumerate(frames):
                            txn.put(chunk_key(raw_key, index), frame, db=chunks)
                        txn.put(raw_key, record.SerializeToString(), db=self._dbs[b"shards"])
                        txn.put(raw_key, now.to_bytes(8, "big"), db=self._dbs[b"access"])
                        self._add_to_version(txn, key, size, +1)
                        self._add_used(txn, size)
                    self._count_evicted(evicted)  # committed: they happened
                    self._damage_said.discard(raw_key)  # a new copy: its damage is new
                    self._measure_tail(env)
                    break
                except lmdb.MapFullError as exc:
                    # Aborted whole: its evictions did not happen, its access times not saved.
                    self._touch_again(touched)
                    if attempt == 2:
                        raise CacheFull(
                            f"{key}: the LMDB map of {self.path} is full even after evicting; "
                            "a long-running reader may be holding old pages — restart stale "
                            "readers or raise --capacity"
                        ) from exc
                except lmdb.Error as exc:
                    # The transaction is gone whole: nothing of the shard is visible.
                    self._touch_again(touched)
                    raise self._write_failed(str(key), size, exc) from exc
                except BaseException:  # CacheFull from _make_room, an interrupt: aborted too
                    self._touch_again(touched)
                    raise
        return self._info(key, record, now)

    def passing_info(self, key: ShardKey, frames: Sequence[Buffer]) -> ShardInfo:
        """The record ``frames`` would have once stored, for serving them without storing.

        A read-through miss the cache cannot take (pinned data fills it, or the shard
        is larger than the whole cache) is still served to its reader straight from
        the fetched frames; they are verified as :meth:`put_shard` would.
        """
        key = key.validated()
        if not frames:
            raise EmptyShard(f"{key}: no chunks to serve; an empty shard cannot be read")
        now = time.time_ns()
        return self._info(key, _shard_record_of(frames, now), now)

    def _write_failed(self, what: str, need: int, exc: lmdb.Error) -> StoreError:
        """The error for a write transaction that failed: :class:`DiskFull` if the disk is.

        A full disk surfaces from ``mdb_txn_commit`` as ENOSPC (``lmdb.DiskError``),
        or as EIO from a short write; the free space left tells those apart. The
        room it names is :meth:`room_on_disk`'s: the volume's free space alone
        reads 0 once the failed write has grown the file into it.
        """
        free = shutil.disk_usage(self.path).free
        if isinstance(exc, lmdb.DiskError) or free < 2 * need + MAP_HEADROOM // 16:
            if self._env is not None:
                self._measure_tail(self._env)  # the pages the aborted write left
            needs = f", this needs {format_bytes(need)}" if need else ""
            return self.disk_full(
                f"{what}: the disk under {self.path} is full", self.room_on_disk(), needs
            )
        return StoreError(f"writing {what} to {self.path} failed: {exc}")

    def room_on_disk(self) -> int:
        """Bytes the cache can still write: the volume's free space and its file's unused end.

        A write that failed for room grew ``data.mdb`` before it was aborted; the
        next writes go into those pages (past the last one committed), so they are
        room for the cache though the volume no longer shows them free. The end is
        as the last write left it (:meth:`_measure_tail`, on the writer's thread),
        so any thread may ask, a metrics scrape during :meth:`close` too: it
        touches no LMDB state.
        """
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return 0
        return free + self._tail

    def _measure_tail(self, env: lmdb.Environment) -> None:
        """Record how far ``data.mdb`` runs past its last committed page (the writer lock held)."""
        try:
            end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            size = (self.path / "data.mdb").stat().st_size
        except (lmdb.Error, OSError):
            return
        self._tail = max(size - end, 0)

    def disk_full(self, what: str, free: int, detail: str = "") -> DiskFull:
        """A :class:`DiskFull` saying ``what`` and what an operator can do about it."""
        return DiskFull(
            f"{what} ({format_bytes(free)} free{detail}); free space on that volume (remove "
            "other files, or evict versions this node holds); if --capacity "
            f"({format_bytes(self.capacity_bytes)}) is more than the volume holds, lower it "
            "or grow the volume"
        )

    @contextlib.contextmanager
    def _writing(self, what: str, need: int = 0) -> Iterator[lmdb.Transaction]:
        """One write transaction under the writer lock; a failed commit becomes a StoreError."""
        env = self._check(write=True)
        with self._write_lock:
            try:
                with env.begin(write=True) as txn:
                    yield txn
            except lmdb.Error as exc:
                raise self._write_failed(what, need, exc) from exc
            self._measure_tail(env)

    def pin_version(
        self,
        dataset: str,
        version: int,
        until: datetime | None,
        *,
        if_until: datetime | None = None,
    ) -> None:
        """Keep a version from being evicted for space until ``until`` (None unpins).

        A version may be pinned before any of its shards arrive. With
        ``if_until``, only a pin held until that time (within a second) is
        changed; any other is :class:`PinChanged`, in the same transaction, so a
        tool releasing its own pin never cuts one that someone lengthened since.
        """
        self._pin(dataset, version, until, extend=False, if_until=if_until)

    def extend_pin(self, dataset: str, version: int, until: datetime) -> None:
        """Pin a version until at least ``until``: a later pin it has already stays.

        What staging for some jobs asks: a pin another plan or job placed for
        longer must not be cut short by it (``pin_version`` sets the time as given).
        """
        self._pin(dataset, version, until, extend=True)

    def _pin(
        self,
        dataset: str,
        version: int,
        until: datetime | None,
        *,
        extend: bool,
        if_until: datetime | None = None,
    ) -> None:
        ShardKey(dataset, version, 0).validated()
        vkey = version_key(dataset, version)
        for given in (until, if_until):
            if given is not None and given.tzinfo is None:
                name = "extend_pin" if extend else "pin_version"
                raise ValueError(f"{name} needs a timezone-aware datetime (e.g. UTC)")
        until_ns = 0 if until is None else _pin_ns(until)
        with self._writing(f"the pin of {dataset}@{version}") as txn:
            record = self._version_record(txn, vkey) or store_pb2.StoredVersion()
            if (
                if_until is not None
                and abs(record.pinned_until_ns - _pin_ns(if_until)) >= _SAME_PIN_NS
            ):
                held = ns_to_datetime(record.pinned_until_ns) if record.pinned_until_ns else None
                raise PinChanged(
                    f"the pin of {dataset}@{version} is "
                    + (f"until {held.isoformat()}" if held else "gone")
                    + f", not until {if_until.isoformat()}: someone pinned it since, "
                    "so it was left as it is",
                    held,
                )
            record.pinned_until_ns = max(record.pinned_until_ns, until_ns) if extend else until_ns
            if record.shard_count == 0 and record.pinned_until_ns == 0:
                txn.delete(vkey, db=self._dbs[b"versions"])
            else:
                txn.put(vkey, record.SerializeToString(), db=self._dbs[b"versions"])

    def evict_version(
        self, dataset: str, version: int, *, unless_pinned_after: datetime | None = None
    ) -> int:
        """Remove every shard of a version and its pin; return the bytes freed.

        With ``unless_pinned_after``, a version pinned past that time (by more
        than a second) is :class:`PinChanged` and nothing is removed: the
        caller's check that no one else's pin keeps it, made on an earlier
        read, is made again inside the eviction's transaction.
        """
        ShardKey(dataset, version, 0).validated()
        vkey = version_key(dataset, version)
        if unless_pinned_after is not None and unless_pinned_after.tzinfo is None:
            raise ValueError("evict_version needs a timezone-aware datetime (e.g. UTC)")
        freed = 0
        with self._writing(f"evicting {dataset}@{version}") as txn:
            pinned = self._version_record(txn, vkey)
            if (
                unless_pinned_after is not None
                and pinned is not None
                and pinned.pinned_until_ns > _pin_ns(unless_pinned_after) + _SAME_PIN_NS
            ):
                held = ns_to_datetime(pinned.pinned_until_ns)
                raise PinChanged(
                    f"{dataset}@{version} is pinned until {held.isoformat()}, past "
                    f"{unless_pinned_after.isoformat()}: someone pinned it since; not evicted",
                    held,
                )
            for raw_key, record in list(self._iter_shard_records(txn, vkey)):
                freed += self._delete_shard(txn, raw_key, record)
            txn.delete(vkey, db=self._dbs[b"versions"])
        if freed:
            self._release_freed_pages()
        return freed

    def drop_shard(self, key: ShardKey, *, only_damaged: bool = False) -> int:
        """Remove one shard (e.g. when corrupt) so the next read is a miss; return bytes freed.

        ``only_damaged``: only if its record is (still) a damaged one, decided in
        the write itself: a good copy written since the damage was seen stays.
        """
        raw_key = key.validated().encode()
        with self._writing(f"dropping {key}") as txn:
            record = self._shard_record(txn, raw_key)
            freed = 0
            if record is not None and not (only_damaged and _complete(record)):
                freed = self._delete_shard(txn, raw_key, record)
        if freed:
            self._release_freed_pages()
        return freed

    def _release_freed_pages(self) -> None:
        """Commit one small write after a removal, so its freed pages can hold the next write.

        LMDB hands a transaction's freed pages out again only after a later
        transaction has committed (readers of the previous snapshot may still
        use them), and a write that fails for room commits nothing. On a full
        disk every write after an eviction failed for room, with the room
        there, on a node that held nothing. Best effort: on a disk too full
        even for this, the next write tries as before.
        """
        with contextlib.suppress(StoreError), self._writing("counting removals") as txn:
            meta = self._dbs[b"meta"]
            count = int.from_bytes(txn.get(b"removals", b"\0" * 8, db=meta), "big") + 1
            txn.put(b"removals", count.to_bytes(8, "big"), db=meta)

    def fit_capacity(self) -> Fitted:
        """Evict until the cache is within its capacity, as a write short of room would.

        For a cache opened with less capacity than it holds (a node restarted with
        a lower ``--capacity``), which would otherwise stay over it until its next
        write. Least recently used shards of unpinned versions go first; pinned
        ones stay, and :attr:`Fitted.still_over` says by how much they keep the
        cache over.
        """
        with self._writing("fitting the cache to its capacity") as txn:
            used = int.from_bytes(txn.get(b"used", b"\0" * 8, db=self._dbs[b"meta"]), "big")
            candidates, pinned = self._eviction_candidates(txn)
            evicted = self._evict_lru(txn, candidates, used - self.capacity_bytes)
        self._count_evicted(evicted)  # committed: they happened
        shards, freed = len(evicted), sum(b for _, b in evicted)
        if freed:
            self._release_freed_pages()
        held = tuple(
            VersionInfo(d, v, r.shard_count, r.stored_bytes, ns_to_datetime(r.pinned_until_ns))
            for (d, v), r in ((parse_version_key(k), r) for k, r in sorted(pinned.items()))
        )
        return Fitted(used, shards, freed, held)

    def _eviction_candidates(
        self, txn: lmdb.Transaction
    ) -> tuple[
        list[tuple[int, bytes, store_pb2.StoredShard]], dict[bytes, store_pb2.StoredVersion]
    ]:
        """(last access, key, record) of every evictable shard, least recent first; the pins.

        Shards of versions pinned now are not evictable. The version being
        written may lose its own older shards too: reading a version larger than
        the cache through it is an LRU over its shards. (A stage that needs
        every shard resident checks that they still are when it ends.)
        """
        now = time.time_ns()
        pinned: dict[bytes, store_pb2.StoredVersion] = {}
        for vkey, raw in txn.cursor(db=self._dbs[b"versions"]):
            pin = self._parse_version(txn, bytes(vkey), raw)
            if pin.pinned_until_ns > now:
                pinned[bytes(vkey)] = pin
        access_db = self._dbs[b"access"]
        candidates: list[tuple[int, bytes, store_pb2.StoredShard]] = []
        for raw_key, record in self._iter_shard_records(txn, b""):
            if raw_key[:-4] in pinned:
                continue
            last = int.from_bytes(txn.get(raw_key, b"\0" * 8, db=access_db), "big")
            candidates.append((last, raw_key, record))
        candidates.sort(key=lambda c: (c[0], c[1]))
        return candidates, pinned

    def _evict_lru(
        self,
        txn: lmdb.Transaction,
        candidates: list[tuple[int, bytes, store_pb2.StoredShard]],
        shortfall: int,
    ) -> list[tuple[bytes, int]]:
        """Evict ``candidates`` in order until ``shortfall`` bytes are freed: (key, bytes) each.

        Counted and logged by the caller once the transaction commits
        (:meth:`_count_evicted`): an aborted one evicted nothing, and the shards it
        named are still cached.
        """
        evicted: list[tuple[bytes, int]] = []
        freed = 0
        for _, raw_key, record in candidates:
            if freed >= shortfall:
                break
            freed += self._delete_shard(txn, raw_key, record)
            evicted.append((raw_key, record.stored_bytes))
        return evicted

    def _count_evicted(self, evicted: list[tuple[bytes, int]]) -> None:
        """Count and log the evictions of a committed transaction."""
        for raw_key, stored in evicted:
            self._evicted_shards += 1
            self._evicted_bytes += stored
            log.info("evicted %s (%s) for space", parse_shard_key(raw_key), stored)

    def _make_room(
        self, txn: lmdb.Transaction, need: int, for_key: ShardKey
    ) -> list[tuple[bytes, int]]:
        """Evict for ``need`` bytes within ``txn``; the evictions, to count once it commits."""
        meta = self._dbs[b"meta"]
        used = int.from_bytes(txn.get(b"used", b"\0" * 8, db=meta), "big")
        shortfall = used + need - self.capacity_bytes
        if shortfall <= 0:
            return []
        candidates, pinned = self._eviction_candidates(txn)
        available = sum(c[2].stored_bytes for c in candidates)
        if available < shortfall:
            pins = ", ".join(
                "{}@{} ({}, until {:%Y-%m-%dT%H:%MZ})".format(
                    *parse_version_key(v),
                    format_bytes(r.stored_bytes),
                    ns_to_datetime(r.pinned_until_ns),
                )
                for v, r in sorted(pinned.items())
            )
            # The cache may hold more than its capacity (restarted with a lower --capacity,
            # its pinned data kept): "only -582.7 KiB is free" said it backwards.
            free = (
                f"only {format_bytes(self.capacity_bytes - used)} is free"
                if used <= self.capacity_bytes
                else f"the cache holds {format_bytes(used)}, over its capacity of "
                f"{format_bytes(self.capacity_bytes)},"
            )
            raise CacheFull(
                f"{for_key} needs {format_bytes(need)} but {free} and "
                f"{format_bytes(available)} can be evicted "
                f"(short by {format_bytes(shortfall - available)}); pinned: {pins or 'nothing'}. "
                "Unpin or evict a version, or raise --capacity"
            )
        return self._evict_lru(txn, candidates, shortfall)

    def _delete_shard(
        self, txn: lmdb.Transaction, raw_key: bytes, record: store_pb2.StoredShard
    ) -> int:
        chunks = self._dbs[b"chunks"]
        for index in range(record.chunk_count):
            txn.delete(chunk_key(raw_key, index), db=chunks)
        txn.delete(raw_key, db=self._dbs[b"shards"])
        txn.delete(raw_key, db=self._dbs[b"access"])
        self._touched.pop(raw_key, None)
        key = parse_shard_key(raw_key)
        self._add_to_version(txn, key, -record.stored_bytes, -1)
        self._add_used(txn, -record.stored_bytes)
        return record.stored_bytes

    def _add_to_version(self, txn: lmdb.Transaction, key: ShardKey, size: int, shards: int) -> None:
        vkey = version_key(key.dataset, key.version)
        raw = txn.get(vkey, db=self._dbs[b"versions"])
        record = store_pb2.StoredVersion() if raw is None else _parsed(store_pb2.StoredVersion, raw)
        if record is not None:
            record.stored_bytes += size
            record.shard_count += shards
        else:  # damaged: counted from the shards as they are, this one's change included
            assert raw is not None  # parsed as None only from bytes that were there
            record = self._parse_version(txn, vkey, raw)
        if record.shard_count == 0 and record.pinned_until_ns == 0:
            txn.delete(vkey, db=self._dbs[b"versions"])
        else:
            txn.put(vkey, record.SerializeToString(), db=self._dbs[b"versions"])

    def _add_used(self, txn: lmdb.Transaction, delta: int) -> None:
        meta = self._dbs[b"meta"]
        used = int.from_bytes(txn.get(b"used", b"\0" * 8, db=meta), "big") + delta
        txn.put(b"used", used.to_bytes(8, "big"), db=meta)

    def _flush_access(self, txn: lmdb.Transaction) -> dict[bytes, int]:
        """Write the reads' access times into ``txn``; those taken, for :meth:`_touch_again`."""
        touched, self._touched = self._touched, {}
        access_db, shards_db = self._dbs[b"access"], self._dbs[b"shards"]
        for raw_key, ns in touched.items():
            if txn.get(raw_key, db=shards_db) is not None:  # not evicted meanwhile
                txn.put(raw_key, ns.to_bytes(8, "big"), db=access_db)
        return touched

    def _touch_again(self, touched: dict[bytes, int]) -> None:
        """Keep access times a transaction that aborted took (a read since is newer: kept).

        Dropped, they left the LRU ordering recently read shards as if unread,
        and the next write evicted them first.
        """
        for raw_key, ns in touched.items():
            self._touched.setdefault(raw_key, ns)

    # ----------------------------------------------------------------- reads

    def _shard_record(self, txn: lmdb.Transaction, raw_key: bytes) -> store_pb2.StoredShard | None:
        """The shard's record, or None; a damaged one as :meth:`_parse_shard` gives it."""
        raw = txn.get(raw_key, db=self._dbs[b"shards"])
        return None if raw is None else self._parse_shard(txn, raw_key, raw)

    def _parse_shard(
        self, txn: lmdb.Transaction, raw_key: bytes, raw: Buffer
    ) -> store_pb2.StoredShard:
        """A shard record; one that no longer parses, as what removing it needs.

        A flipped byte in the record itself (not in a chunk, whose checksum
        catches it) made every read, listing and eviction of its version raise
        protobuf's ``DecodeError``: the node answered INTERNAL for good, and
        ``evict`` could not remove it. Such a record comes back not complete
        (:func:`_complete` is False: never served, dropped where the store
        writes), with the chunks found under its key, so that deleting it
        frees what it held and keeps the used bytes right.
        """
        record = _parsed(store_pb2.StoredShard, raw)
        if record is None:
            chunks, stored = 0, 0
            cursor = txn.cursor(db=self._dbs[b"chunks"])
            if cursor.set_range(raw_key):
                for chunk, frame in cursor:
                    if not bytes(chunk).startswith(raw_key):
                        break
                    index = int.from_bytes(bytes(chunk)[len(raw_key) :], "big")
                    chunks, stored = max(chunks, index + 1), stored + len(frame)
            record = store_pb2.StoredShard(
                state=store_pb2.SHARD_STATE_UNSPECIFIED, chunk_count=chunks, stored_bytes=stored
            )
        return record

    def _version_record(self, txn: lmdb.Transaction, vkey: bytes) -> store_pb2.StoredVersion | None:
        raw = txn.get(vkey, db=self._dbs[b"versions"])
        return None if raw is None else self._parse_version(txn, vkey, raw)

    def _parse_version(
        self, txn: lmdb.Transaction, vkey: bytes, raw: Buffer
    ) -> store_pb2.StoredVersion:
        """A version's record; one that no longer parses, rebuilt from its shards' records.

        The record holds sums of its shards' (their count and bytes) and the
        pin: the sums are counted again; the pin is lost, and logged, until the
        next ``warm`` or controller round sets it. Raised as ``DecodeError`` it
        failed ``Status``, every commit of a shard of the version and ``evict``.
        """
        record = _parsed(store_pb2.StoredVersion, raw)
        if record is None:
            rebuilt = store_pb2.StoredVersion()
            for _, shard in self._iter_shard_records(txn, vkey):
                rebuilt.shard_count += 1
                rebuilt.stored_bytes += shard.stored_bytes
            if vkey not in self._damage_said:
                self._damage_said.add(vkey)
                dataset, version = parse_version_key(vkey)
                log.warning(
                    "the record of %s@%d in the cache at %s is damaged (it does not parse): "
                    "counted again from its %d shards; its pin, if it had one, is lost until "
                    "the next warm or controller round pins it again",
                    dataset,
                    version,
                    self.path,
                    rebuilt.shard_count,
                )
            record = rebuilt
        return record

    def _iter_shard_records(
        self, txn: lmdb.Transaction, prefix: bytes
    ) -> Iterator[tuple[bytes, store_pb2.StoredShard]]:
        """Every shard record under ``prefix``, damaged ones too (see :meth:`_parse_shard`)."""
        cursor = txn.cursor(db=self._dbs[b"shards"])
        if not cursor.set_range(prefix):
            return
        for raw_key, raw in cursor:
            raw_key = bytes(raw_key)
            if not raw_key.startswith(prefix):
                return
            yield raw_key, self._parse_shard(txn, raw_key, raw)

    def _last_access(self, txn: lmdb.Transaction, raw_key: bytes) -> int:
        stored = txn.get(raw_key, db=self._dbs[b"access"])
        persisted = int.from_bytes(stored, "big") if stored is not None else 0
        return max(persisted, self._touched.get(raw_key, 0))

    def _info(self, key: ShardKey, record: store_pb2.StoredShard, last_access_ns: int) -> ShardInfo:
        return ShardInfo(
            key=key,
            chunk_count=record.chunk_count,
            stored_bytes=record.stored_bytes,
            row_count=record.row_count,
            checksums=tuple(record.checksums),
            chunk_rows=tuple(record.chunk_rows),
            committed_at=ns_to_datetime(record.committed_at_ns),
            last_access=ns_to_datetime(last_access_ns or record.committed_at_ns),
        )

    def shard_info(self, key: ShardKey) -> ShardInfo | None:
        """The record of a resident shard, or None; does not count as a hit or miss."""
        raw_key = key.validated().encode()
        with self._snapshot() as txn:
            record = self._shard_record(txn, raw_key)
            info = None
            if record is not None and _complete(record):
                info = self._info(key, record, self._last_access(txn, raw_key))
        if record is not None and info is None:
            self._record_damaged(key)
        return info

    def contains(self, key: ShardKey) -> bool:
        """Whether the shard is resident (complete); not counted as a hit or miss."""
        return self.shard_info(key) is not None

    def read_shard(self, key: ShardKey, *, verify: bool = True) -> ShardReader:
        """Open a resident shard for zero-copy reading; use as a context manager.

        Counts a hit, or a miss and raises :class:`ShardNotCached`.
        """
        # Unlocked: reads on two threads may lose a count or both reap, which only moves
        # the next reap by a read (the reap itself takes the lock).
        self._reads_to_reap -= 1
        if self._reads_to_reap <= 0:
            self._reap_lingering()
        key = key.validated()
        raw_key = key.encode()
        thread = threading.get_ident()
        with self._reads_changed:  # counted before close() can decide nobody reads
            txn = self._read_txn()
            self._read_started(thread)
        try:
            record = self._shard_record(txn, raw_key)
        except BaseException:
            txn.abort()
            self._read_ended(thread)
            raise
        if record is not None and not _complete(record):
            txn.abort()
            self._read_ended(thread)
            self._record_damaged(key)
            raise ChunkCorrupt(
                f"the record of {key} in the cache at {self.path} is damaged (it does not "
                "parse): not served"
                + (
                    "; dropped, so the next read fetches it again"
                    if not self.readonly and self.drop_corrupt
                    else ""
                )
            )
        with self._counter_lock:
            if record is None:
                self._misses += 1
            else:
                self._hits += 1
                self._touched[raw_key] = time.time_ns()
        if record is None:
            txn.abort()
            self._read_ended(thread)
            raise ShardNotCached(f"{key} is not in the cache at {self.path}")
        return ShardReader(self, txn, key, self._info(key, record, time.time_ns()), verify)

    def get_chunk(self, key: ShardKey, index: int) -> bytes:
        """One verified chunk frame, copied out of LMDB (safe to keep)."""
        with self.read_shard(key) as reader:
            return bytes(reader.chunk(index))

    def iter_chunks(self, key: ShardKey, start: int = 0) -> Iterator[bytes]:
        """Verified copies of a shard's frames from ``start`` on, all from one snapshot."""
        with self.read_shard(key) as reader:
            for index in range(start, reader.info.chunk_count):
                yield bytes(reader.chunk(index))

    def _record_damaged(self, key: ShardKey) -> None:
        """A shard whose record is damaged, seen in a snapshot: counted once, then dropped.

        Dropped only if it is still the damaged record (``drop_shard(only_damaged=True)``):
        a good copy written since the snapshot stays. A node's store
        (``drop_corrupt`` off) leaves it to the next fetch, which writes over it;
        ``on_damage`` tells the node (its metric and log). A read-only store
        (``lmdb://``) cannot drop it: it says so once, with the way out, and every
        read of it meanwhile goes to the next endpoint.
        """
        raw_key = key.encode()
        with self._counter_lock:  # reads on several threads may meet it at once
            if raw_key in self._damage_said:
                return  # counted and said when first seen; a new copy clears it
            self._damage_said.add(raw_key)
            self._corrupt += 1
        if self.on_damage is not None:
            self.on_damage(key)
        if self.readonly:
            log.warning(
                "the record of %s in the cache at %s is damaged (it does not parse): not read "
                "from it; have its node stage it again (edgecache evict %s@%d --region R, "
                "then edgecache warm %s@%d --region R)",
                key,
                self.path,
                key.dataset,
                key.version,
                key.dataset,
                key.version,
            )
        elif self.drop_corrupt:
            try:
                freed = self.drop_shard(key, only_damaged=True)
            except StoreError as exc:  # a read must not fail for the drop: the next one tries
                log.warning("could not drop the damaged record of %s: %s", key, exc)
            else:
                log.warning(
                    "dropped the damaged record of %s (%d bytes under it); it will be fetched "
                    "again",
                    key,
                    freed,
                )
            finally:  # dropped, or to be tried again: a later damage is counted again
                self._damage_said.discard(raw_key)

    def _corrupt_chunk(self, key: ShardKey) -> None:
        with self._counter_lock:
            self._corrupt += 1
        if not self.readonly and self.drop_corrupt:
            freed = self.drop_shard(key)
            log.warning("dropped corrupt shard %s (%d bytes); it will be refetched", key, freed)

    def _linger(self, txn: lmdb.Transaction, views: list[memoryview]) -> None:
        with self._counter_lock:
            self._lingering.append((txn, views))

    def _reap_lingering(self) -> None:
        """End the lingering transactions whose views are no longer exported.

        ``read_shard`` calls it once every :data:`REAP_EVERY` reads: a reader of a
        local cache keeps a transaction lingering per window it holds (its
        batches are views of the map), about fifty at once, and trying to
        release all of their views on every read was 3 % of an images epoch's
        CPU over ``lmdb://``.
        """
        with self._counter_lock:
            still: list[tuple[lmdb.Transaction, list[memoryview]]] = []
            for txn, views in self._lingering:
                if release_all(views):
                    txn.abort()
                else:
                    still.append((txn, views))
            self._lingering = still
            self._reads_to_reap = REAP_EVERY

    # ------------------------------------------------------------- manifests

    def put_manifest(self, dataset: str, version: int, manifest: bytes) -> None:
        """Keep a version's binary manifest, so the node can serve it without the registry."""
        ShardKey(dataset, version, 0).validated()
        with self._writing(f"the manifest of {dataset}@{version}", len(manifest)) as txn:
            txn.put(version_key(dataset, version), manifest, db=self._dbs[b"manifests"])

    def get_manifest(self, dataset: str, version: int) -> bytes | None:
        """A kept binary manifest, or None."""
        ShardKey(dataset, version, 0).validated()
        with self._snapshot() as txn:
            raw = txn.get(version_key(dataset, version), db=self._dbs[b"manifests"])
            return None if raw is None else bytes(raw)

    def manifest_versions(self, dataset: str) -> list[int]:
        """The versions of ``dataset`` whose manifest is kept, evicted ones too, ascending.

        A manifest outlives its shards' eviction (it is small, and the node
        serves it without the registry), so this is what the cache knows of a
        dataset's versions, not what it holds the data of (:meth:`versions`).
        """
        prefix = dataset_prefix(dataset)
        found = []
        with self._snapshot() as txn:
            cursor = txn.cursor(db=self._dbs[b"manifests"])
            if cursor.set_range(prefix):
                for raw_key in cursor.iternext(values=False):
                    raw_key = bytes(raw_key)
                    if not raw_key.startswith(prefix):
                        break
                    name, version = parse_version_key(raw_key)
                    if name == dataset:
                        found.append(version)
        return sorted(found)

    # --------------------------------------------------------------- listing

    def versions(self) -> list[VersionInfo]:
        """Every version with resident shards or a pin, in (dataset, version) order."""
        out = []
        with self._snapshot() as txn:
            for vkey, raw in txn.cursor(db=self._dbs[b"versions"]):
                vkey = bytes(vkey)
                record = self._parse_version(txn, vkey, raw)
                dataset, version = parse_version_key(vkey)
                out.append(
                    VersionInfo(
                        dataset=dataset,
                        version=version,
                        shard_count=record.shard_count,
                        stored_bytes=record.stored_bytes,
                        pinned_until=(
                            ns_to_datetime(record.pinned_until_ns)
                            if record.pinned_until_ns
                            else None
                        ),
                    )
                )
        return out

    def shards(self, dataset: str, version: int) -> list[ShardInfo]:
        """The resident shards of one version, in shard order."""
        ShardKey(dataset, version, 0).validated()
        found, damaged = [], []
        with self._snapshot() as txn:
            for raw_key, record in self._iter_shard_records(txn, version_key(dataset, version)):
                key = parse_shard_key(raw_key)
                if _complete(record):
                    found.append(self._info(key, record, self._last_access(txn, raw_key)))
                else:
                    damaged.append(key)
        for key in damaged:  # not resident: dropped (after the snapshot) where the store writes
            self._record_damaged(key)
        return found

    def datasets(self) -> list[str]:
        """Names of datasets with anything resident or pinned."""
        return sorted({v.dataset for v in self.versions()})

    @property
    def stats(self) -> StoreStats:
        """Capacity, bytes used and this process's counters."""
        with self._snapshot() as txn:
            raw = txn.get(b"used", db=self._dbs[b"meta"])
            shard_count = txn.stat(self._dbs[b"shards"])["entries"]
        return StoreStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=int.from_bytes(raw, "big") if raw else 0,
            shard_count=shard_count,
            hits=self._hits,
            misses=self._misses,
            evicted_shards=self._evicted_shards,
            evicted_bytes=self._evicted_bytes,
            corrupt_chunks=self._corrupt,
        )


def _parsed(message: type[_Record], raw: Buffer) -> _Record | None:
    """``raw`` parsed as ``message``, or None where it does not parse (a damaged record)."""
    try:
        return message.FromString(bytes(raw))
    except DecodeError:
        return None


def _complete(record: store_pb2.StoredShard) -> bool:
    """Whether a shard record may be served: written whole, not a damaged one's remains."""
    return record.state == store_pb2.SHARD_STATE_COMPLETE


def _shard_record_of(frames: Sequence[Buffer], committed_at_ns: int) -> store_pb2.StoredShard:
    """A complete shard's record for ``frames``, each verified first (a damaged one raises)."""
    headers = [verify_frame(frame) for frame in frames]
    return store_pb2.StoredShard(
        state=store_pb2.SHARD_STATE_COMPLETE,
        chunk_count=len(frames),
        stored_bytes=sum(len(frame) for frame in frames),
        row_count=sum(h.rows for h in headers),
        checksums=[h.checksum for h in headers],
        chunk_rows=[h.rows for h in headers],
        committed_at_ns=committed_at_ns,
    )
