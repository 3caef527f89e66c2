"""The edge node's work, independent of gRPC: fetch, preprocess, cache, serve, stage.

One :class:`EdgeNode` per process, living on the server's event loop. Blocking
work runs off the loop: parsing and encoding on a CPU pool, LMDB writes on a
single writer thread (LMDB write transactions are thread-bound and one at a
time anyway). Reads of cached chunks are short zero-copy transactions done on
the loop, one per chunk, so a slow client never holds a read transaction
open (which would pin old pages and let the file grow).

Concurrent requests for the same missing shard share one origin fetch
(single-flight). Staging is background traffic: it goes through a
:class:`~edgecache.edge.staging_gate.StagingGate` that limits its byte rate
and drops it to one shard at a time while training reads are streaming.

Preprocessing (:mod:`edgecache.edge.preprocessing`) uses every core the node
may run on: shards are parsed on one pool (one shard per thread), and the
parts of each shard — its chunks' compression, a batch's images, slices of
text — run on a second pool, so a single shard (a read-through miss) spreads
over the cores too. Staging's two
pools run at nice +10, so training reads and read-through misses come first.
Threads, not processes: zstd, Arrow, Pillow and tokenizers release the GIL,
and a process pool would pickle every raw shard and frame across. The CPU time
each shard takes is measured, giving the node's staging rate (source bytes/s
on all its threads) that the planner uses.

Which content each ``name@N`` is — its manifest, kept here and checked against
the registry — is :mod:`edgecache.edge.versions`' (``EdgeNode.versions``).

Results are domain values and exceptions from :mod:`edgecache.cache.errors`;
turning them into gRPC messages and status codes is the service's job.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version as package_version
from typing import Any, TypeVar

from edgecache.cache.errors import (
    CacheFull,
    ChunkCorrupt,
    DiskFull,
    EdgeCacheError,
    MalformedShard,
    OriginChanged,
    ShardNotCached,
    StoreError,
)
from edgecache.cache.frame import Buffer
from edgecache.cache.keys import ShardKey
from edgecache.cache.preprocess import Transform, load_transform
from edgecache.cache.registry import Registry, fetch_resources
from edgecache.cache.registry_match import registry_key
from edgecache.cache.storage import ObjectInfo, Stores
from edgecache.cache.store import CacheStore, ShardInfo
from edgecache.cache.units import format_bytes
from edgecache.cache.wire import encode_chunk
from edgecache.edge.config import NodeConfig, usable_cores
from edgecache.edge.fetch_memory import FetchMemory, Kept, default_budget
from edgecache.edge.idle_memory import IdleRelease, purge_delay, release_in_threads
from edgecache.edge.metrics import NodeMetrics
from edgecache.edge.peers import PeerCopyFailed, Peers
from edgecache.edge.preprocessing import Encoded, StagingRate, encode_raw_shard, lower_priority
from edgecache.edge.staging_gate import StagingGate
from edgecache.edge.versions import Versions
from edgecache.v1 import edge_pb2, manifest_pb2

__all__ = ["EdgeNode", "Fetched", "NodeDraining", "StagedShard", "StagingGate"]

log = logging.getLogger(__name__)
T = TypeVar("T")
LMDB_PAGE = 4096  # the most a stored chunk's last overflow page leaves unused


@dataclass(frozen=True, slots=True)
class Fetched:
    """How a missing shard came into the cache: from origin or copied from peers."""

    info: ShardInfo
    source: str  # "origin" or "peer"
    bytes: int  # source bytes from origin, stored bytes from peers
    notes: tuple[str, ...] = ()  # e.g. peers that failed before origin gave it
    # A read-through miss the cache could not take (pinned data fills it, or the shard
    # is larger than the cache): its frames, served from memory and then dropped, and
    # why it was not stored (what a Stage joining this fetch fails with).
    passed: tuple[Buffer, ...] = ()
    refused: CacheFull | None = None
    share: _Share | None = None  # the readers of those frames (set for each reader)
    # Peers that refused this node for its configuration before origin gave it.
    peers_refused: tuple[str, ...] = ()


class _Share:
    """The readers of one in-flight fetch, and the fetch memory its passed frames keep.

    A shard served without caching it lives in memory as long as a stream serves
    it, past the fetch that brought it: its bytes stay counted against
    ``fetch_memory`` (see :meth:`FetchMemory.keep`) until the fetch is over and
    the last reader that joined it has left, so readers missing many such shards
    at once wait for memory instead of growing the node without limit.
    """

    __slots__ = ("done", "kept", "readers", "stagers", "started", "staging", "wanted")

    def __init__(self, *, staging: bool) -> None:
        self.staging = staging  # started by a Stage (see ensure_shard)
        self.readers = 0
        # Stages waiting for the fetch, and whether it has left the staging gate (its GET
        # begun): one no Stage waits for any more is given up before it starts.
        self.stagers = 0
        self.started = False
        self.done = False
        self.kept: Kept | None = None
        # Set once a training read waits for a Stage's fetch: from then on the fetch
        # is that read's miss (see EdgeNode.ensure_shard).
        self.wanted = asyncio.Event()

    def join(self) -> bool:
        """One more reader waits for the fetch; True if it is the first of a Stage's."""
        self.readers += 1
        first = self.staging and not self.wanted.is_set()
        self.wanted.set()
        return first

    def leave(self) -> None:
        """One reader is done with the fetch's frames (or failed before it had them)."""
        self.readers -= 1
        self._settle()

    def finish(self) -> None:
        """The fetch is over: no reader joins it any more."""
        self.done = True
        self._settle()

    def _settle(self) -> None:
        if self.done and self.readers <= 0 and self.kept is not None:
            self.kept.release()


class NodeDraining(EdgeCacheError):
    """The node is shutting down (SIGTERM): staging starts no more shards.

    Raised by :meth:`EdgeNode.stage` once the shards it had started are done
    (committed whole or failed), so its caller learns which were staged and
    stages the rest elsewhere, or here after the restart; and by a staging
    fetch still waiting for its turn at the staging gate, which never starts.
    """


@dataclass(frozen=True, slots=True)
class StagedShard:
    """What staging did with one shard: fetched it, found it cached, or failed."""

    shard: int
    source_bytes: int  # the raw object's size in origin
    fetched: bool = False  # False with no error: it was cached already (skipped)
    error: Exception | None = None  # why it failed; the shard stays absent
    source: str = ""  # where a fetched shard came from: "origin" or "peer"
    peer_bytes: int = 0  # stored bytes copied from peers
    notes: tuple[str, ...] = ()
    peers_refused: tuple[str, ...] = ()  # refused this node's configuration: origin gave it
    revoked: bool = False  # reported staged earlier in this stage, evicted since
    joined: bool = False  # fetched by another request's fetch this stage waited on


class EdgeNode:
    """One region's edge node: a cache store, a registry view, staging and metrics."""

    def __init__(self, config: NodeConfig, *, store: CacheStore | None = None) -> None:
        self.config = config
        self.node_id = config.node_id or config.default_node_id()
        # Origin (shard data, a transform's files) and the registry (manifests, version
        # lists) through stores of their own, so each one's retries are counted apart:
        # edgecache_origin_retries_total against edgecache_origin_fetches_total says how
        # origin fetches fare, and registry reads (often another bucket) must not add to it.
        self.stores = Stores()
        self.registry_stores = Stores()
        self._retries_counted = 0  # origin retries already in edgecache_origin_retries_total
        self._registry_retries_counted = 0  # and registry ones in edgecache_registry_retries_total
        # Before the store: a registry URL no store serves fails with nothing to close.
        self.registry = Registry(config.registry, self.registry_stores)
        self.store = store or CacheStore(
            config.cache_dir, capacity_bytes=config.capacity, sync=config.sync
        )
        self.store.drop_corrupt = False  # dropped off the event loop (_drop_damaged)
        self.metrics = NodeMetrics(config.region, self.node_id)
        self.store.on_damage = self._record_damaged
        self.metrics.capacity_bytes.set(self.store.capacity_bytes)
        # Read at scrape time: a restart on a full cache, a corrupt shard dropped or an LRU
        # eviction all change it, and a value set on writes read 0 until the first one.
        self._last_used = 0.0  # what the gauge last read (a scrape after close gets it)
        self.metrics.used_bytes.set_function(self._used_bytes)
        # A busy LRU cache sits near its capacity by design; what leaves no room for the
        # next version is pinned data, so that is what the cache-full alert watches.
        self._last_pinned = 0.0
        self.metrics.pinned_bytes.set_function(self._pinned_bytes)
        self._evicted_counted = (0, 0)  # the store's (shards, bytes) evicted already counted
        self._fit_capacity()
        self.gate = StagingGate(config.staging_rate, config.staging_concurrency)
        self.started = time.monotonic()
        # Set by drain() (SIGTERM): staging starts no new shard fetches from then on.
        self._draining = asyncio.Event()
        # Why LMDB's own structure was found damaged, once it was (see cache_damaged); the
        # server sets on_cache_damaged to turn its health NOT_SERVING.
        self.damaged = ""
        self.on_cache_damaged: Callable[[], Awaitable[None]] | None = None
        # Set as the node closes: shard work still on the pools' threads stops at its next
        # batch (cancelling its task does not stop the thread, and close() waits for it).
        self._closing = threading.Event()
        # Which content each version served here is, checked against the registry.
        self.versions = Versions(
            config, self.registry, self.store, write=self._write, count_retries=self.count_retries
        )
        # Stored bytes a shard needed when the cache refused it for room (_still_no_room).
        self._refused_size: dict[ShardKey, int] = {}
        self.peers = Peers(config)
        self._inflight: dict[ShardKey, asyncio.Task[Fetched]] = {}
        # Arrow's freed pages given back once fetches stop, from the threads that decode.
        self.idle_memory = IdleRelease(self._release_memory, purge_delay())
        self._shares: dict[ShardKey, _Share] = {}  # each in-flight fetch's readers
        self._fetch_slots = asyncio.Semaphore(config.fetch_concurrency)
        # The slots bound how many fetches run, this how much memory they hold (whole shards).
        self.fetch_memory = FetchMemory(config.fetch_memory or default_budget())
        self.metrics.fetch_memory_bytes.set(self.fetch_memory.budget)
        self.metrics.fetch_memory_reserved_bytes.set_function(lambda: self.fetch_memory.reserved)
        self._staging_order = itertools.count()
        threads = config.cpu_threads()
        self.staging_rate = StagingRate(min(threads, usable_cores()))
        # Shards on one pool, their parts (chunk compression, images, text slices) on
        # another: a shard waiting on its parts never holds a thread its parts need.
        self._cpu = ThreadPoolExecutor(threads, thread_name_prefix="preprocess")
        self._parts = ThreadPoolExecutor(threads, thread_name_prefix="preprocess-part")
        # Staging's preprocessing runs at a lower CPU priority than everything else here
        # (serving reads, the event loop's network I/O, read-through misses).
        self._cpu_staging = ThreadPoolExecutor(
            threads, thread_name_prefix="preprocess-staging", initializer=lower_priority
        )
        self._parts_staging = ThreadPoolExecutor(
            threads, thread_name_prefix="preprocess-staging-part", initializer=lower_priority
        )
        self._preprocess_pools = (self._cpu, self._parts, self._cpu_staging, self._parts_staging)
        self._transforms: dict[str, Transform] = {}  # by manifest digest
        # One per version (by digest): a version whose files (a tokenizer) come slowly from
        # its origin held up, behind one node-wide lock, the first fetch of every other.
        self._transform_locks: dict[str, asyncio.Lock] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lmdb-writer")
        self._disk_full = False  # the last write found the cache's disk full
        self._free_when_full = 0  # the room the cache had on its disk then (see _still_full)
        # The bytes each shard the full disk refused needs (its frames, each rounded up to
        # LMDB's pages), and those per source byte of the last one (see _still_full).
        self._full_need: dict[ShardKey, int] = {}
        self._full_ratio = 1.0
        # Asked at each scrape: an operator who frees room sees the gauge (and the alert
        # on it) clear at once, not at the next shard write, which a node whose reads
        # all hit its cache may never make.
        self.metrics.disk_full.set_function(lambda: float(self.disk_full_now()))
        self._pid = os.getpid()

    def _fit_capacity(self) -> None:
        """Bring a cache opened with less capacity than it holds within it, at startup.

        A node restarted with a lower ``--capacity`` would otherwise serve over it
        until its next write made room (:meth:`CacheStore.fit_capacity`; counted in
        ``edgecache_cache_evicted_*``); the warning says what went, and when pinned
        shards alone keep the cache over capacity.
        """
        capacity = self.store.capacity_bytes
        if self.store.stats.used_bytes <= capacity:
            return
        try:
            fitted = self.store.fit_capacity()
        except EdgeCacheError as exc:  # e.g. a full disk: serve; writes make room later
            log.warning("evicting to fit the capacity of %s failed: %s", self.store.path, exc)
            return
        self._count_evictions()
        message = (
            f"the cache under {self.store.path} holds {format_bytes(fitted.used_bytes)}, more "
            f"than its capacity of {format_bytes(capacity)} (--capacity was lowered): evicted "
            f"{fitted.evicted_shards} least recently used unpinned shards "
            f"({format_bytes(fitted.evicted_bytes)})"
        )
        if fitted.held_after > capacity:
            held = ", ".join(
                f"{v.dataset}@{v.version} ({format_bytes(v.stored_bytes)})" for v in fitted.pinned
            )
            message += (
                f"; still {format_bytes(fitted.held_after)}: the pinned versions alone ({held}) "
                "exceed the capacity, so new shards are refused until they are unpinned or "
                "evicted (edgecache evict), or --capacity is raised"
            )
        log.warning("%s", message)

    def _count_evictions(self) -> None:
        """Add the store's evictions for space since the last call to the counters."""
        stats = self.store.stats
        shards, evicted = self._evicted_counted
        self.metrics.evicted_shards.inc(max(stats.evicted_shards - shards, 0))
        self.metrics.evicted_bytes.inc(max(stats.evicted_bytes - evicted, 0))
        self._evicted_counted = (stats.evicted_shards, stats.evicted_bytes)

    def _used_bytes(self) -> float:
        try:
            self._last_used = float(self.store.stats.used_bytes)
        except Exception:  # noqa: BLE001 - closed while scraped: the last value read
            pass
        return self._last_used

    def _pinned_bytes(self) -> float:
        try:
            self._last_pinned = float(
                sum(v.stored_bytes for v in self.store.versions() if v.pinned())
            )
        except Exception:  # noqa: BLE001 - closed while scraped: the last value read
            pass
        return self._last_pinned

    def drain(self) -> None:
        """Start no new staging fetches: the node is shutting down (SIGTERM).

        Called as the drain begins, before the grace period: shards a Stage has not
        started would otherwise keep starting until the deadline and be dropped
        there half fetched, and the grace time is the running fetches' to commit in.
        Stages end once their running shards are done (:class:`NodeDraining`).
        Read-through misses are not stopped: a reader waits for each.
        """
        if not self._draining.is_set():
            self._draining.set()
            log.info("draining: staging starts no new shards; the ones under way may commit")

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called: the node is shutting down."""
        return self._draining.is_set()

    async def finish_fetches(self, timeout: float) -> int:
        """Give the shard fetches under way up to ``timeout`` seconds to commit whole.

        A drain (SIGTERM) lets them finish rather than throwing away a shard that
        is nearly encoded: a rolling restart would otherwise lose every shard that
        takes longer than the grace period, over and over. Returns how many were
        still running when the time ran out (:meth:`close` cancels those; nothing
        partial is ever visible).
        """
        running = [task for task in self._inflight.values() if not task.done()]
        if not running or timeout <= 0:
            return len(running)
        log.info("letting %d shard fetches finish (up to %g s)", len(running), timeout)
        _, pending = await asyncio.wait(running, timeout=timeout)
        return len(pending)

    def _release_memory(self) -> None:
        if not self._closing.is_set():
            release_in_threads((*self._preprocess_pools, self._writer))

    async def close(self) -> None:
        """Stop background work and close the cache; committed shards stay."""
        self._closing.set()
        self.idle_memory.busy()  # no release after the pools are gone
        for task in list(self._inflight.values()) + self.versions.checks():
            task.cancel()
        for pool in self._preprocess_pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True, cancel_futures=True)
        await self.peers.close()
        await self.stores.close()
        await self.registry_stores.close()
        self.store.close()

    # ------------------------------------------------------------------ shards

    async def _write(self, fn: Callable[..., T], *args: object) -> T:
        """Run a store write on the single writer thread (LMDB writes are thread-bound).

        A full disk is told to the operator once, when it starts (every shard and
        reader after it fails the same way), and shown as ``edgecache_cache_disk_full``.
        """
        try:
            return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)
        except DiskFull as exc:
            self.metrics.disk_full_errors.inc()
            self._free_when_full = self.store.room_on_disk()
            if not self._disk_full:
                self._disk_full = True
                log.warning(
                    "cache disk full: %s. Staging and read-through misses of shards larger "
                    "than the room left fail with RESOURCE_EXHAUSTED until there is more; "
                    "cached shards are still served",
                    exc,
                )
            raise

    def disk_full_now(self) -> bool:
        """Whether the disk is as full as when a write last failed for room.

        Clears without a write: once the volume has more free space than then,
        or an eviction freed pages LMDB reuses, there is room to try again.
        Thread-safe (the metrics server's scrape thread asks it).
        """
        return self._disk_full and self.store.room_on_disk() <= self._free_when_full

    def _still_full(self, key: ShardKey, source_size: int) -> DiskFull | None:
        """The error for a shard not worth fetching: it would not fit where a write failed.

        Fetching and preprocessing a shard only to have its commit refused wastes
        origin bandwidth and CPU on every shard of a Stage. A shard the disk refused
        is refused before fetching until the room it needed is there (a smaller
        shard stored meanwhile does not make it fit); while the disk is as full as
        when a write failed, any other shard is refused only if it would not fit the
        room there is, estimated from its source size and the last refused shard's
        stored bytes per source byte: the room a large shard lacked is still room
        for smaller ones (a failed write leaves the pages it wrote to the next), and
        refusing them all turned every miss on the node, of any version, away until
        a restart.
        """
        need = self._full_need.get(key)
        if need is None and not self._disk_full:
            return None
        room = self.store.room_on_disk()
        if need is None:
            if room > self._free_when_full:  # as disk_full_now(), with the figure said below
                return None
            need = int(source_size * self._full_ratio)
        if need + need // 4 + (64 << 10) < room:  # with room for LMDB's own pages
            return None
        self.metrics.disk_full_errors.inc()
        return self.store.disk_full(
            f"{key}: not fetched, the disk under {self.store.path} is still full",
            room,
            f", as when the last write failed; the shard needs about {format_bytes(need)}",
        )

    def _still_no_room(self, key: ShardKey) -> CacheFull | None:
        """The error for a shard refused for room before, while pins still leave too little.

        A cache full of pinned data refused each shard only after fetching and
        preprocessing it, on every read and Stage that asked (six refusals pulled
        six shards from origin). The size a refused shard needed is remembered;
        until unpinned room (capacity less pinned bytes) reaches it, it is refused
        before anything is fetched. Room from an unpin, an evict or a larger
        capacity is seen at the next call.
        """
        need = self._refused_size.get(key)
        if need is None:
            return None
        room = self.store.capacity_bytes - int(self._pinned_bytes())
        if room >= need:
            return None
        return CacheFull(
            f"{key}: not fetched, it needs {format_bytes(need)} and pinned versions leave "
            f"{format_bytes(max(room, 0))} of the {format_bytes(self.store.capacity_bytes)} "
            "capacity, as when it was last refused; unpin or evict a version (edgecache evict), "
            "or raise --capacity"
        )

    async def _put_shard(
        self, manifest: manifest_pb2.Manifest, key: ShardKey, frames: Sequence[Buffer]
    ) -> ShardInfo:
        """Commit a whole shard; one that fits after a full disk says there is room again.

        A shard made from a manifest this node no longer serves (the registry's
        version changed, or it was evicted and the registry's adopted, while the
        shard was fetched) is not stored: it would be served under the other.
        """
        if not self.versions.serves(manifest):
            raise OriginChanged(
                f"{key} was fetched for a manifest of {manifest.dataset}@{manifest.version} "
                f"(digest {manifest.digest}) that this node no longer serves: the registry's "
                "version changed meanwhile; nothing was stored"
            )
        try:
            info = await self._write(self.store.put_shard, key, frames)
        except DiskFull:  # before CacheFull, which it is a kind of
            # Each chunk takes whole overflow pages: a shard of many small chunks needs more.
            need = sum(len(f) for f in frames) + len(frames) * LMDB_PAGE
            self._full_need[key] = need
            source = manifest.shards[key.shard].source_size
            self._full_ratio = need / source if source > 0 else 1.0
            raise
        except CacheFull:
            self._refused_size[key] = sum(len(f) for f in frames)  # see _still_no_room
            raise
        self._refused_size.pop(key, None)
        self._full_need.pop(key, None)
        self._count_evictions()
        if self._disk_full:
            self._disk_full = False
            log.warning("cache disk under %s has room again: %s was stored", self.store.path, key)
        return info

    def shard_ref(self, manifest: manifest_pb2.Manifest, shard: int) -> ShardKey:
        """Validate a shard index against its manifest."""
        if not 0 <= shard < len(manifest.shards):
            raise IndexError(
                f"{manifest.dataset}@{manifest.version} has shards 0..{len(manifest.shards) - 1}; "
                f"shard {shard} does not exist"
            )
        return ShardKey(manifest.dataset, manifest.version, shard)

    async def ensure_shard(
        self,
        manifest: manifest_pb2.Manifest,
        shard: int,
        *,
        staging: bool = False,
        peers: Sequence[str] = (),
        peers_only: bool = False,
    ) -> tuple[ShardInfo, Fetched | None]:
        """The shard's record, fetching it first if needed (then also how: a miss).

        Callers for the same missing shard share one fetch, which runs as its
        own task: a reader that disconnects does not cancel it for the others,
        and what was fetched is cached anyway. With ``peers`` the shard is
        copied from them (see :mod:`edgecache.edge.peers`), from origin if none
        can give it (unless ``peers_only``).
        """
        key = self.shard_ref(manifest, shard)
        while True:
            info = self.store.shard_info(key)
            if info is not None:
                return info, None
            task = self._inflight.get(key)
            if task is None:
                share = _Share(staging=staging)
                fetch = self._fetch(
                    manifest,
                    key,
                    staging=staging,
                    peers=peers,
                    peers_only=peers_only,
                    wanted=share.wanted,
                )
                if not staging:  # staging is bounded by its own workers and gate
                    fetch = self._bounded(fetch)
                task = asyncio.create_task(fetch)
                self._inflight[key] = task
                self.idle_memory.busy()
                self._shares[key] = share
                task.add_done_callback(functools.partial(self._fetch_done, key))
            share = self._shares[key]
            if staging:
                share.stagers += 1
                try:
                    fetched = await asyncio.shield(task)
                except asyncio.CancelledError:
                    share.stagers -= 1
                    self._give_up_unstarted(key, task, share)
                    raise
                if fetched.refused is not None:  # the cache cannot keep it: a Stage fails
                    raise fetched.refused
                return fetched.info, fetched
            if share.join():
                # A job reads what a Stage is still bringing in (a warm that ran late): the
                # read must not queue behind staging's rate and slots (StagingGate).
                log.info("a read waits for %s: its staging fetch goes ahead as a read's", key)
                self.metrics.staging_taken_over.inc()
            try:
                fetched = await asyncio.shield(task)
            except CacheFull as exc:
                share.leave()
                if isinstance(exc, DiskFull) or not share.staging:
                    raise
                # A Stage's fetch, refused before fetching while pins leave too little
                # room: a reader's miss is fetched anyway (served without caching it).
                continue
            except NodeDraining:
                # A Stage's fetch given up at the staging gate for a drain before this
                # reader joined it: a read is served through the drain, so fetch it.
                share.leave()
                continue
            except BaseException:
                share.leave()
                raise
            if not fetched.passed:
                share.leave()  # cached: nothing of the fetch's is held for this reader
                return fetched.info, fetched
            self.metrics.uncached_reads.inc()  # this reader leaves the share when done
            return fetched.info, dataclasses.replace(fetched, share=share)

    async def _bounded(self, fetch: Coroutine[Any, Any, Fetched]) -> Fetched:
        """Run a read-through fetch in one of ``fetch_concurrency`` slots.

        A fetch holds its raw shard, Arrow batches and encoded chunks in memory
        at once; without a bound, readers missing many shards at the same time
        would grow the node without limit.
        """
        async with self._fetch_slots:
            return await fetch

    def _give_up_unstarted(self, key: ShardKey, task: asyncio.Task[Fetched], share: _Share) -> None:
        """Cancel a Stage's fetch that no Stage or read waits for and that has not begun.

        A cancelled Stage (warm interrupted, the controller stopped) finishes the
        shards it started and starts no more: its fetches still queued at the
        staging gate went on, fetching and caching shards nobody asked for any
        more, after an ``evict`` too. Taken out of the in-flight table at once, so
        a read that misses the shard now starts a fetch of its own.
        """
        if share.stagers or share.started or share.wanted.is_set() or task.done():
            return
        log.info("%s: no Stage waits for it any more; not fetched", key)
        if self._inflight.get(key) is task:
            del self._inflight[key]
            self._shares.pop(key, None)
            share.finish()
        task.cancel()

    def _fetch_done(self, key: ShardKey, task: asyncio.Task[Fetched]) -> None:
        # Runs before any waiter resumes: every reader that joined has counted itself.
        if self._inflight.get(key) is task:  # not a fetch given up, then started again
            del self._inflight[key]
            if (share := self._shares.pop(key, None)) is not None:
                share.finish()
        if not self._inflight and not self._closing.is_set():
            self.idle_memory.idle()
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter re-raises it itself

    async def _fetch(
        self,
        manifest: manifest_pb2.Manifest,
        key: ShardKey,
        *,
        staging: bool,
        peers: Sequence[str] = (),
        peers_only: bool = False,
        wanted: asyncio.Event | None = None,
    ) -> Fetched:
        if (full := self._still_full(key, manifest.shards[key.shard].source_size)) is not None:
            raise full
        if staging and (no_room := self._still_no_room(key)) is not None:
            raise no_room  # a reader's miss is fetched anyway: served without caching it
        notes: tuple[str, ...] = ()
        refused_by: tuple[str, ...] = ()
        if peers:
            if (share := self._shares.get(key)) is not None:
                share.started = True  # a peer copy is not gated: it begins now
            try:
                copy = await self.peers.copy_shard(manifest, key.shard, peers)
            except PeerCopyFailed as exc:
                if peers_only:
                    spec = f"{manifest.dataset}@{manifest.version}"
                    if exc.none_held:  # each peer answered: asking again cannot help
                        advice = (
                            f"none of the peers asked ({', '.join(exc.asked)}) holds it; "
                            f"origin was not tried (peers_only): stage {spec} on one of "
                            "them first, or stage without peers_only"
                        )
                    elif exc.final:  # refused this node's settings (or lack it): the same
                        others = [p for p in exc.asked if p not in exc.refused]
                        lacking = f" ({', '.join(others)} do not hold it)" if others else ""
                        advice = (
                            f"{', '.join(exc.refused)} refused this node for its "
                            f"configuration{lacking}: retrying cannot help until the setting "
                            "named above for each is fixed on this node; origin was not "
                            "tried (peers_only)"
                        )
                    else:
                        advice = (
                            "origin was not tried (peers_only): stage the version on one "
                            "of the peers first, or stage without peers_only"
                        )
                    raise PeerCopyFailed(
                        f"{exc}; {advice}",
                        exc.reasons,
                        asked=exc.asked,
                        none_held=exc.none_held,
                        refused=exc.refused,
                        final=exc.final,
                    ) from exc
                why = "; ".join(exc.reasons) or "no peer was asked"
                notes = (f"shard {key.shard}: no peer could give it ({why}); took it from origin",)
                refused_by = tuple(exc.refused)
                log.warning("%s %s", key, notes[0])
                if (share := self._shares.get(key)) is not None:
                    share.started = False  # from origin: through the staging gate, as any
            else:
                info, passed, refused = await self._keep(manifest, key, copy.frames)
                self.metrics.staged_bytes["peer"].inc(copy.stored_bytes)
                if not passed:
                    log.info(
                        "cached %s from peers %s (%d chunks)",
                        key,
                        ", ".join(copy.peers),
                        len(copy.frames),
                    )
                return self._keep_memory(
                    key,
                    Fetched(info, "peer", copy.stored_bytes, tuple(copy.notes), passed, refused),
                )
        fetched = await self._fetch_origin(manifest, key, staging=staging, wanted=wanted)
        return self._keep_memory(
            key, dataclasses.replace(fetched, notes=notes, peers_refused=refused_by)
        )

    def _keep_memory(self, key: ShardKey, fetched: Fetched) -> Fetched:
        """Count passed-through frames against ``fetch_memory`` until their readers are done.

        Taken as the fetch ends, just after it released its own reservation (nothing
        awaits in between; a fetch from origin reserved enough for its frames, a peer
        copy nothing); the next fetches wait for these bytes while another fetch is in
        flight, until the last stream serving the frames has ended (see :class:`_Share`
        and :meth:`FetchMemory.hold`).
        """
        share = self._shares.get(key)
        if fetched.passed and share is not None:
            share.kept = self.fetch_memory.keep(fetched.info.stored_bytes)
        return fetched

    async def _keep(
        self,
        manifest: manifest_pb2.Manifest,
        key: ShardKey,
        frames: Sequence[Buffer],
    ) -> tuple[ShardInfo, tuple[Buffer, ...], CacheFull | None]:
        """Store a fetched shard; a miss the cache cannot take is passed through.

        A read-through miss refused for room (pinned versions fill the cache, or
        the shard is larger than its whole capacity) failed the read with
        RESOURCE_EXHAUSTED, and a reader retried it until it gave up, while origin
        could give the rows all along. Such a shard is served from the fetched
        frames and then dropped: read through to origin, slowly, on every read
        (logged, and counted as a miss). A Stage still fails: it is asked to keep
        the shard (:meth:`ensure_shard` raises the refusal returned here for it),
        while readers that joined its fetch are served. The frames stay counted
        against ``fetch_memory`` until their last reader is done (:class:`_Share`).
        A full disk still fails either way (see :meth:`_write`).
        """
        try:
            return await self._put_shard(manifest, key, frames), (), None
        except DiskFull:
            raise
        except CacheFull as exc:
            # Verifies every frame (a whole shard's hashing): off the event loop.
            info = await asyncio.get_running_loop().run_in_executor(
                self._cpu, self.store.passing_info, key, frames
            )
            log.warning(
                "%s not cached (%d chunks): served to the reads joined to its fetch, if any; "
                "a Stage asking for it fails: %s",
                key,
                len(frames),
                exc,
            )
            return info, tuple(frames), exc

    async def cache_damaged(self, why: str) -> None:
        """LMDB's own pages are damaged (a read, an eviction or a write said so): stop serving.

        No entry can be dropped or fetched again through a damaged tree (``mdb_del``
        fails as ``mdb_get`` does), so the node cannot mend it and every LRU
        eviction that reaches it fails. It went on answering INTERNAL while health
        said SERVING: now health turns NOT_SERVING (probes and readers go to other
        nodes), the log says what to do once, and the calls that meet the damage
        answer DATA_LOSS saying it too.
        """
        if self.damaged:
            return
        self.damaged = why
        self.metrics.cache_damaged.set(1)
        log.critical("%s (cache %s); health is NOT_SERVING from now on", why, self.config.cache_dir)
        if self.on_cache_damaged is not None:
            await self.on_cache_damaged()

    def _record_damaged(self, key: ShardKey) -> None:
        """A shard record that no longer parses, found by the store: counted and said.

        Not served (the store calls it not resident): the read is a miss, and the
        fetch writes over it.
        """
        self.metrics.corrupt_chunks.inc()
        log.warning("%s: its record here is damaged (it does not parse); fetching it again", key)

    async def _fetch_origin(
        self,
        manifest: manifest_pb2.Manifest,
        key: ShardKey,
        *,
        staging: bool,
        wanted: asyncio.Event | None = None,
    ) -> Fetched:
        shard = manifest.shards[key.shard]
        async with self.fetch_memory.hold(shard.source_size):
            return await self._fetch_origin_held(manifest, key, staging=staging, wanted=wanted)

    async def _fetch_origin_held(
        self,
        manifest: manifest_pb2.Manifest,
        key: ShardKey,
        *,
        staging: bool,
        wanted: asyncio.Event | None = None,
    ) -> Fetched:
        """:meth:`_fetch_origin` once its memory is reserved: fetch, encode, commit.

        A staging fetch goes through the staging gate until ``wanted`` is set (a
        training read joined it): then its remaining origin requests skip the
        gate's queue and it preprocesses at a read's priority.
        """
        shard = manifest.shards[key.shard]
        url = manifest.source_url + shard.source_key
        expect = ObjectInfo(url=url, size=shard.source_size, etag=shard.source_etag)
        held = await self._staging_turn(shard.source_size, wanted) if staging else False
        if staging and (share := self._shares.get(key)) is not None:
            share.started = True  # a cancelled Stage lets it finish: a whole shard
        try:
            log.info("fetching %s for %s", url, key)
            self.metrics.origin_fetches.inc()
            started = time.monotonic()
            store = self.stores.for_url(url)
            # Staging's parts go to origin oldest fetch first (see StagingGate).
            slot = (
                functools.partial(self.gate.request, order=next(self._staging_order), unless=wanted)
                if staging
                else None
            )
            try:
                data = await store.get(url, expect=expect, slot=slot)
            finally:  # a fetch that failed after its retries made them too
                self.count_retries()
            elapsed = time.monotonic() - started
            self.metrics.origin_seconds.observe(elapsed)
            self.metrics.origin_bytes.inc(len(data))
            if staging:
                self.metrics.staged_bytes["origin"].inc(len(data))
        finally:
            if held:
                await self.gate.release()
        transform = await self._transform(manifest)
        loop = asyncio.get_running_loop()
        background = staging and not (wanted is not None and wanted.is_set())
        with self.metrics.preprocess_seconds.time():
            encoded = await loop.run_in_executor(
                self._cpu_staging if background else self._cpu,
                encode_raw_shard,
                data,
                manifest,
                shard,
                url,
                transform,
                self._parts_staging if background else self._parts,
                self._closing,
            )
        size = len(data)
        del data
        self._preprocessed(size, encoded)
        info, passed, refused = await self._keep(manifest, key, encoded.frames)
        if not passed:
            log.info("cached %s from %s (%d chunks)", key, url, info.chunk_count)
        return Fetched(info, "origin", size, (), passed, refused)

    async def _staging_turn(self, nbytes: int, wanted: asyncio.Event | None) -> bool:
        """The staging gate's :meth:`~StagingGate.acquire`, given up when the node drains.

        A staging fetch may wait here for long (its rate budget, other shards'
        slots): once the node drains it never starts (:class:`NodeDraining`), so
        the grace period goes to the fetches already running. A fetch a training
        read waits for (``wanted``) is a read's, and goes on.
        """
        if self._draining.is_set() and not (wanted is not None and wanted.is_set()):
            raise NodeDraining("the node is shutting down: this staging fetch was not started")
        acquiring = asyncio.ensure_future(self.gate.acquire(nbytes, unless=wanted))
        draining = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({acquiring, draining}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (close): the gate takes back what it gave
            acquiring.cancel()
            if acquiring.done() and not acquiring.cancelled():
                if acquiring.exception() is None and acquiring.result():
                    # It took a slot in the same turn as the cancel: give it back.
                    asyncio.ensure_future(self.gate.release())
            raise
        finally:
            draining.cancel()
        if acquiring.done() and (not self._draining.is_set() or (wanted and wanted.is_set())):
            return acquiring.result()
        acquiring.cancel()  # StagingGate.acquire gives back a slot it took when cancelled
        await asyncio.wait({acquiring})
        if not acquiring.cancelled() and acquiring.exception() is None and acquiring.result():
            await self.gate.release()
        raise NodeDraining("the node is shutting down: this staging fetch was not started")

    def count_retries(self) -> None:
        """Add the retries made since the last count to the retry counters.

        Origin's (``self.stores``: shard data and a transform's files) go to
        ``edgecache_origin_retries_total``, the registry's (``registry_stores``:
        manifests and version lists) to ``edgecache_registry_retries_total``.
        Each store's counter is shared by every request in flight, so a difference
        taken around one fetch also held the retries of those beside it (the
        same faults counted 17 to 27 times); counting from the last total
        counts each retry once, whichever fetch made it.
        """
        total = self.stores.stats().retries
        self.metrics.origin_retries.inc(max(total - self._retries_counted, 0))
        self._retries_counted = total
        total = self.registry_stores.stats().retries
        self.metrics.registry_retries.inc(max(total - self._registry_retries_counted, 0))
        self._registry_retries_counted = total

    async def _transform(self, manifest: manifest_pb2.Manifest) -> Transform:
        """The version's transform, built once (with its files from origin, e.g. a tokenizer)."""
        found = self._transforms.get(manifest.digest)
        if found is not None:
            return found
        async with self._transform_locks.setdefault(manifest.digest, asyncio.Lock()):
            found = self._transforms.get(manifest.digest)
            if found is None:
                spec = manifest.preprocess
                try:
                    resources: Mapping[str, bytes] = await fetch_resources(
                        self.stores, manifest.source_url, spec
                    )
                finally:
                    self.count_retries()
                try:
                    # Off the event loop: a tokenizer of megabytes is hashed and parsed.
                    found = await asyncio.get_running_loop().run_in_executor(
                        self._cpu,
                        load_transform,
                        spec.transform or "identity",
                        spec.params,
                        resources,
                    )
                except ValueError as exc:  # e.g. another Pillow than the version was made with
                    raise MalformedShard(
                        f"{manifest.dataset}@{manifest.version}: transform "
                        f"{spec.transform!r} cannot run on this node: {exc}"
                    ) from exc
                self._transforms[manifest.digest] = found
            return found

    def _preprocessed(self, source_bytes: int, encoded: Encoded) -> None:
        """Count one preprocessed shard: CPU, bytes, skips; update the staging rate."""
        self.metrics.preprocess_cpu_seconds.inc(encoded.cpu_seconds)
        self.metrics.preprocessed_bytes.inc(source_bytes)
        self.staging_rate.add(source_bytes, encoded.cpu_seconds)
        self.metrics.staging_capacity.set(self.staging_rate.bytes_per_second())
        if encoded.skipped:
            self.metrics.skipped_samples.inc(encoded.skipped)
            log.warning(
                "skipped %d samples under the transform's skip policy: %s",
                encoded.skipped,
                "; ".join(encoded.notes[:3]),
            )

    async def _drop_damaged(self, key: ShardKey, why: str) -> None:
        """Drop a damaged shard on the writer thread, so the next read fetches it again.

        Not on the event loop: the drop waits on the writer lock, which a shard's put
        (every chunk, its evictions, an fsync) holds for a while.
        """
        try:
            freed = await self._write(self.store.drop_shard, key)
        except StoreError as exc:  # a full disk, say: reads still refetch it through
            log.warning("%s is damaged (%s) and could not be dropped: %s", key, why, exc)
            return
        log.warning(
            "%s is damaged (%s): dropped it (%d bytes); it will be refetched", key, why, freed
        )
        if freed:
            self._room_freed()

    def encoded_chunk(self, key: ShardKey, index: int, first_row: int) -> bytes:
        """One chunk as wire bytes, in its own short read transaction (verified)."""
        with self.store.read_shard(key) as reader:
            info = reader.info
            view = reader.chunk(index)
            return encode_chunk(
                index=index,
                chunk_count=info.chunk_count,
                rows=info.chunk_rows[index],
                checksum=info.checksums[index],
                frame=view,
                first_row=first_row,
            )

    async def read_chunks(
        self,
        manifest: manifest_pb2.Manifest,
        shard: int,
        start_chunk: int = 0,
        start_row: int = 0,
        end_row: int = 0,
        *,
        cached_only: bool = False,
    ) -> AsyncIterator[bytes]:
        """Wire-encoded chunks of a shard, fetching it on a miss.

        From ``start_chunk``, or from the chunk holding ``start_row`` when that
        is set; up to the chunk holding ``end_row - 1`` (0: to the end). With
        ``cached_only`` (a peer copying from this node) nothing is fetched: not
        on a miss, and not when a chunk turns out damaged or evicted mid-stream
        either (the caller takes the shard from another peer or its own origin,
        never across this node's origin link).
        """
        key = self.shard_ref(manifest, shard)
        rows = manifest.shards[shard].row_count
        if start_row > rows or end_row > rows or (end_row and end_row <= start_row):
            raise IndexError(
                f"{key} has rows 0..{rows}; the range {start_row}..{end_row or rows} is invalid"
            )
        shares: list[_Share] = []  # the passed-through fetches this stream reads from
        try:
            if cached_only:
                held = self.store.shard_info(key)
                if held is None:
                    raise ShardNotCached(f"{key} is not cached on {self.node_id} (cached_only)")
                info, fetched = held, None
            else:
                try:
                    info, fetched = await self.ensure_shard(manifest, shard)
                    shares.extend(_shared(fetched))
                except BaseException:
                    # Not resident, and the read ended before a chunk: its reader left (or its
                    # deadline passed) while the shard was fetched, or the fetch failed. Still
                    # a miss, and the slowest kind: uncounted, it went missing from the hit
                    # ratio and Status while the fetch went on for the next reader.
                    self.metrics.misses.inc()
                    raise
            # A hit or a miss, counted once when the stream ends: a resident shard found
            # damaged (its record here, or a chunk mid-stream) is dropped and fetched again,
            # which makes the read a miss, not a hit and a miss.
            refetched = fetched is not None
            passed = fetched.passed if fetched is not None else ()  # served, not cached
            if damage := _record_damage(info, rows):
                # The record itself is damaged: the stream is planned from it (how many chunks,
                # where each starts), so a short count would end the stream early with OK.
                self.metrics.corrupt_chunks.inc()
                await self._drop_damaged(key, f"the shard's record is damaged ({damage})")
                if cached_only:
                    raise ChunkCorrupt(
                        f"{key}'s record here is damaged ({damage}); not fetched again for a "
                        "cached_only read: take the shard from another node"
                    )
                info, again_fetched = await self.ensure_shard(manifest, shard)
                shares.extend(_shared(again_fetched))
                passed = again_fetched.passed if again_fetched is not None else ()
                refetched = True
                if damage := _record_damage(info, rows):
                    raise ChunkCorrupt(
                        f"{key}'s record was damaged again after fetching the shard anew "
                        f"({damage}); read it from another node"
                    )
            if start_chunk > info.chunk_count:
                raise IndexError(
                    f"{key} has {info.chunk_count} chunks; "
                    f"start_chunk {start_chunk} is past the end"
                )
            # the first row of each chunk
            firsts = list(itertools.accumulate(info.chunk_rows, initial=0))
            if start_row:
                start_chunk = bisect.bisect_right(firsts, start_row) - 1
            stop = bisect.bisect_left(firsts, end_row) if end_row else info.chunk_count
            if not start_row and end_row and start_chunk >= stop:
                # start_chunk begins at or past end_row: the stream would end OK having
                # sent nothing, and a reader would take the shard's rows for none.
                raise IndexError(
                    f"{key}: start_chunk {start_chunk} begins at row "
                    f"{firsts[min(start_chunk, info.chunk_count)]}, at or past end_row "
                    f"{end_row}: no row to send; ask for start_row instead of start_chunk, or "
                    "an end_row past the chunk's first row"
                )
            try:
                index = start_chunk
                damaged = 0  # damaged chunks found since the last chunk served
                while index < stop:
                    try:
                        encoded = (
                            _passed_chunk(info, passed, index, firsts[index])
                            if passed
                            else self.encoded_chunk(key, index, firsts[index])
                        )
                    except (ShardNotCached, ChunkCorrupt) as exc:
                        # Evicted, or damaged and dropped, mid-stream: fetch it again. Encoding
                        # is deterministic, so the stream can go on only if the chunks came out
                        # the same.
                        if isinstance(exc, ChunkCorrupt):
                            self.metrics.corrupt_chunks.inc()
                            damaged += 1
                            await self._drop_damaged(key, f"chunk {index}: {exc}")
                        if cached_only:
                            raise type(exc)(
                                f"{key} chunk {index} is no longer here ({exc}); not fetched again "
                                "for a cached_only read: take the shard from another node"
                            ) from exc
                        if damaged > 1:  # damaged again straight after a re-fetch: not here
                            raise ChunkCorrupt(
                                f"{key} chunk {index} was damaged again after fetching the shard "
                                f"anew ({exc}); read it from another node"
                            ) from exc
                        log.warning(
                            "%s chunk %d unavailable mid-stream (%s); refetching", key, index, exc
                        )
                        again, again_fetched = await self.ensure_shard(manifest, shard)
                        shares.extend(_shared(again_fetched))
                        passed = again_fetched.passed if again_fetched is not None else ()
                        refetched = True
                        # The stream goes on from the new copy if the chunks it has sent are
                        # the new copy's too. Not the whole record: a damaged checksum in the
                        # old record (the chunk it describes then fails its check) made the
                        # copies differ there, and such a read ended, before it sent anything,
                        # saying the shard was "re-encoded differently".
                        if (again.chunk_rows, again.checksums[:index]) != (
                            info.chunk_rows,
                            info.checksums[:index],
                        ):
                            raise ChunkCorrupt(
                                f"{key} was re-encoded differently mid-stream; read it again "
                                "from chunk 0"
                            ) from exc
                        info = again
                        continue
                    damaged = 0
                    self.metrics.bytes_served.inc(len(encoded))
                    self.metrics.chunks_served.inc()
                    yield encoded
                    index += 1
            finally:
                (self.metrics.misses if refetched else self.metrics.hits).inc()
        finally:
            for share in shares:  # their frames stop counting once no stream serves them
                share.leave()

    # ----------------------------------------------------------------- staging

    def staging_targets(self, manifest: manifest_pb2.Manifest, shards: Sequence[int]) -> list[int]:
        """The shards a stage of ``shards`` covers (all when empty), validated, in key order."""
        wanted = sorted(set(shards)) if shards else list(range(len(manifest.shards)))
        for shard in wanted:
            self.shard_ref(manifest, shard)
        return wanted

    async def stage(
        self,
        manifest: manifest_pb2.Manifest,
        shards: Sequence[int],
        pin_until: datetime | None,
        *,
        peers: Sequence[str] = (),
        peers_only: bool = False,
    ) -> AsyncIterator[StagedShard]:
        """Fetch the shards not yet cached, yielding what became of each as it completes.

        ``shards`` as for :meth:`staging_targets`; from ``peers`` when given (see
        :meth:`ensure_shard`). A shard that fails is reported with its exception
        and does not stop the others. Once the node drains (:meth:`drain`) no
        shard starts; those running finish and are yielded, and then
        :class:`NodeDraining` ends the stage (the caller counts what was staged).
        """
        wanted = self.staging_targets(manifest, shards)
        if pin_until is not None:  # at least until then: a longer pin already placed stays
            await self._write(self.store.extend_pin, manifest.dataset, manifest.version, pin_until)
        todo: asyncio.Queue[int] = asyncio.Queue()
        for shard in wanted:  # key order: sequential LMDB writes, predictable progress
            todo.put_nowait(shard)
        # Each worker's outcomes, then None as it ends: a drain leaves shards unstarted.
        results: asyncio.Queue[StagedShard | None] = asyncio.Queue()

        async def worker() -> None:
            try:
                await work()
            finally:
                results.put_nowait(None)

        async def work() -> None:
            while not todo.empty() and not self._draining.is_set():
                shard = todo.get_nowait()
                size = manifest.shards[shard].source_size
                # Another Stage (or a read) already fetching it: that one stores it, and
                # counts it. Nothing awaits between this check and ensure_shard's own.
                joined = self.shard_ref(manifest, shard) in self._inflight
                try:
                    _, fetched = await self.ensure_shard(
                        manifest, shard, staging=True, peers=peers, peers_only=peers_only
                    )
                except NodeDraining:
                    return  # never started: reported as not started when the stage ends
                except EdgeCacheError as exc:
                    await results.put(StagedShard(shard, size, error=exc))
                except Exception as exc:  # noqa: BLE001 - reported per shard, never crashes the node
                    log.exception("staging %s shard %d failed", manifest.dataset, shard)
                    await results.put(StagedShard(shard, size, error=exc))
                else:
                    await results.put(
                        StagedShard(
                            shard,
                            size,
                            fetched=fetched is not None,
                            source=fetched.source if fetched else "",
                            # A joined fetch's bytes are the other request's to report.
                            peer_bytes=(
                                fetched.bytes
                                if fetched and fetched.source == "peer" and not joined
                                else 0
                            ),
                            notes=fetched.notes if fetched else (),
                            peers_refused=fetched.peers_refused if fetched else (),
                            joined=joined,
                        )
                    )

        self.metrics.staging_active.inc()
        # A cancelled Stage stops its workers; fetches already running finish and commit
        # whole shards (never partial ones), the rest never start.
        workers = [
            asyncio.create_task(worker())
            for _ in range(min(self.config.staging_concurrency, len(wanted)))
        ]
        try:
            done: list[int] = []
            received, running = 0, len(workers)
            while received < len(wanted):
                outcome = await results.get()
                if outcome is None:  # a worker ended: all its outcomes came before this
                    running -= 1
                    if running:
                        continue
                    break  # every worker stopped for a drain: the rest never started
                received += 1
                # "staged" once per shard stored: a stage that joined another's fetch of
                # it did not store it (it reports it fetched all the same).
                stored = outcome.fetched and not outcome.joined
                result = "failed" if outcome.error else "staged" if stored else "skipped"
                self.metrics.staged[result].inc()
                if outcome.error is None:
                    done.append(outcome.shard)
                yield outcome
            # A version that does not fit (and is not pinned) may have had its own earlier
            # shards evicted for its later ones: those are not staged after all.
            for shard in sorted(done):
                key = self.shard_ref(manifest, shard)
                if not self.store.contains(key):
                    self.metrics.staged["failed"].inc()
                    yield StagedShard(
                        shard,
                        manifest.shards[shard].source_size,
                        error=CacheFull(
                            f"{key} was evicted by this stage's later shards: "
                            f"{manifest.dataset}@{manifest.version} does not fit in this "
                            "node's capacity; raise --capacity, split the version over more "
                            "replicas, or pin it (edgecache warm and the controller do) so a "
                            "shard that does not fit is refused instead"
                        ),
                        revoked=True,
                    )
            if received < len(wanted):
                if not self._draining.is_set():  # workers gone for another reason: a bug
                    raise RuntimeError(
                        f"staging {manifest.dataset}@{manifest.version} ended with "
                        f"{len(wanted) - received} shards unaccounted for"
                    )
                raise NodeDraining(
                    f"node {self.node_id} is shutting down (SIGTERM) and starts no more shards"
                )
        finally:
            self.metrics.staging_active.dec()
            for task in workers:
                task.cancel()

    # -------------------------------------------------------------- admin

    async def pin(
        self,
        dataset: str,
        version: int,
        until: datetime | None,
        if_until: datetime | None = None,
    ) -> None:
        """Keep a version from the LRU until ``until`` (None: unpin), resident or not yet.

        ``if_until``: only if it is pinned until then (``CacheStore.pin_version``).
        """
        await self._write(
            functools.partial(self.store.pin_version, if_until=if_until), dataset, version, until
        )

    async def extend_pin(self, dataset: str, version: int, until: datetime) -> None:
        """Pin a version until at least ``until``: a later pin it holds stays."""
        await self._write(self.store.extend_pin, dataset, version, until)

    async def evict(
        self, dataset: str, version: int, unless_pinned_after: datetime | None = None
    ) -> int:
        """Remove a version's shards and pin; returns the bytes freed.

        A version this node knows nothing of and the registry does not publish
        is :class:`VersionNotFound` (most often a typo), not "0 bytes freed";
        a published version that is simply not held here frees 0 bytes.
        ``unless_pinned_after``: see ``CacheStore.evict_version``.
        """
        if not self.versions.knows(dataset, version):
            await self.versions.check_published(dataset, version, self.node_id)
        freed = await self._write(
            functools.partial(self.store.evict_version, unless_pinned_after=unless_pinned_after),
            dataset,
            version,
        )
        if freed:
            self._room_freed()
        await self.versions.evicted(dataset, version)
        return freed

    def _room_freed(self) -> None:
        """Pages an eviction or a drop freed are room LMDB reuses: try every shard again.

        The volume's free space does not show them (the file keeps its size), so a
        shard the full disk refused stayed refused by its recorded need, before any
        fetch, until a restart, though the alert and the docs say an evict is enough.
        A shard that still does not fit fails its write and is recorded again.
        """
        self._free_when_full = -1
        self._full_need.clear()

    def status(self) -> edge_pb2.NodeStatus:
        """What the node holds and has done (its counts as its metrics keep them)."""
        stats = self.store.stats
        value = self.metrics.value
        origin_bytes = value("edgecache_origin_bytes_total")
        origin_seconds = value("edgecache_origin_fetch_seconds_sum")
        status = edge_pb2.NodeStatus(
            region=self.config.region,
            node_id=self.node_id,
            capacity_bytes=stats.capacity_bytes,
            used_bytes=stats.used_bytes,
            hits=int(value("edgecache_cache_hits_total")),
            misses=int(value("edgecache_cache_misses_total")),
            bytes_served=int(value("edgecache_served_bytes_total")),
            chunks_served=int(value("edgecache_served_chunks_total")),
            origin_bytes=int(origin_bytes),
            origin_bytes_per_second=origin_bytes / origin_seconds if origin_seconds else 0.0,
            active_streams=int(value("edgecache_active_streams")),
            staged_origin_bytes=int(value("edgecache_staged_bytes_total", source="origin")),
            staged_peer_bytes=int(value("edgecache_staged_bytes_total", source="peer")),
            staging_bytes_per_second=self.staging_rate.bytes_per_second(),
            staging_cpu_seconds_per_gb=self.staging_rate.cpu_seconds_per_gb(),
            disk_full=self.disk_full_now(),
            disk_free_bytes=self.store.room_on_disk(),
            uptime_seconds=time.monotonic() - self.started,
            version=package_version("edgecache"),
            # Which registry this node reads, so clients can tell a node set up with another
            # one; without credentials (any client that may call Status reads it).
            registry=registry_key(self.registry.url),
        )
        for v in self.store.versions():
            known = self.versions.held(v)
            entry = status.versions.add(
                dataset=v.dataset,
                version=v.version,
                shard_count=v.shard_count,
                total_shards=len(known.shards) if known else 0,
                stored_bytes=v.stored_bytes,
                digest=known.digest if known else "",
            )
            if v.pinned_until is not None:  # as stored, also when it has run out (see status)
                entry.pinned_until.FromDatetime(v.pinned_until.astimezone(UTC))
        return status


def _shared(fetched: Fetched | None) -> tuple[_Share, ...]:
    """The share a reader leaves when its stream ends: one for frames passed through."""
    return (fetched.share,) if fetched is not None and fetched.share is not None else ()


def _passed_chunk(info: ShardInfo, frames: Sequence[Buffer], index: int, first_row: int) -> bytes:
    """One chunk of a shard served without caching it, as wire bytes (verified when fetched)."""
    return encode_chunk(
        index=index,
        chunk_count=info.chunk_count,
        rows=info.chunk_rows[index],
        checksum=info.checksums[index],
        frame=frames[index],
        first_row=first_row,
    )


def _record_damage(info: ShardInfo, rows: int) -> str:
    """What is wrong with a resident shard's record for a shard of ``rows`` rows ("": sound).

    Chunk frames carry their own checksums, but the record that lists them is
    the plan of every stream of the shard (how many chunks, each one's rows):
    checked against itself and the manifest before anything is served from it.
    """
    if damage := info.damage():
        return damage
    if sum(info.chunk_rows) != rows or info.row_count != rows:
        return (
            f"its chunks hold {sum(info.chunk_rows)} rows and it records {info.row_count}, "
            f"the version {rows}"
        )
    return ""
