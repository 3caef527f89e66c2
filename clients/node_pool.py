"""The node pool: nearest healthy node first, failover mid-stream, the local fast path.

Endpoints are ``host:port`` (``grpc://`` optional), ``grpcs://host:port`` (TLS)
or ``lmdb:///path/to/cache`` (a node's cache directory on this host: read
directly, no gRPC). gRPC endpoints are ranked by round-trip time (the fastest
health-check ping of the last few probes, see ``RTT_PROBES``) and re-probed in
the background.

A stream that breaks is resumed on the next-best node at the first row not
yet received (``start_row``), so nothing is lost or duplicated; gRPC never
retries a stream that has started answering, so this is done here. Dead
peers are noticed by HTTP/2 keepalive pings (a blackholed node within a few
seconds, where default keepalive took a minute) and by a watchdog that
cancels a stream that delivers nothing for ``stall_timeout`` seconds.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache.errors import (
    AllNodesFailed,
    CacheDirError,
    ChunkCorrupt,
    InvalidEndpoint,
    ManifestError,
    NodeUnavailable,
    ShardNotCached,
)
from edgecache.cache.keys import ShardKey
from edgecache.cache.manifest import manifest_from_bytes
from edgecache.cache.sink_sizing import too_many_streams
from edgecache.cache.store import CacheStore
from edgecache.cache.wire import READ_SHARD_METHOD, parse_chunk
from edgecache.clients import fork_safety, local_stores, rendezvous
from edgecache.clients.channels import bearer, describe, node_error, open_channel
from edgecache.clients.chunk_sources import Stream, chained, goes_past, grpc_rows, local_rows
from edgecache.clients.edge_chunks import EdgeChunks
from edgecache.clients.endpoints import Endpoint
from edgecache.clients.parked_streams import Parked, ParkedStreams
from edgecache.clients.read_target import ShardRange
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = ["EndpointStats", "NodePool"]

log = logging.getLogger(__name__)

# Held by the pools' background calls (health probes, stall cancels); os.fork waits
# for it. A DataLoader forks its workers while the training process's pool probes
# its nodes: forked while a thread is inside a gRPC call, gRPC skips its fork
# handlers ("Other threads are currently calling into gRPC, skipping fork()
# handlers") and the worker's own channels can crash it (a segfault, seen once in
# 200 forks against a busy probe).
_FORK_GUARD = threading.Lock()
# How much slower than the nearest node an own-region replica may measure and still read
# the shards it owns: replicas of one region differ by well under this, probes by jitter.
REPLICA_SLACK_MS = 10.0
# A node's RTT is its fastest health-check ping over this many probes (3 pings each):
# queueing on a busy host only ever adds delay, so the fastest is the path's own round
# trip. A median of one probe's pings measured a replica at 12 ms over its sibling on a
# loaded 2-core CI host, which left it out of its shards (REPLICA_SLACK_MS).
RTT_PROBES = 3
os.register_at_fork(
    before=_FORK_GUARD.acquire,
    after_in_parent=_FORK_GUARD.release,
    after_in_child=_FORK_GUARD.release,
)
# Registered after the guard, so it runs before it ("before" hooks run last-registered
# first): a fork waits for other threads' gRPC calls to end (fork_safety) while the
# watchdog can still cancel a stalled stream, which takes the guard.
os.register_at_fork(before=fork_safety.wait_for_grpc_calls)


@dataclass
class EndpointStats:
    """What a reader saw of one endpoint."""

    rtt_ms: float = math.inf
    bytes: int = 0
    failures: int = 0
    last_error: str = ""
    # What the node says it is (Status, asked once it answers a probe): its id, which
    # replicas split shards by, and its region, which tells replicas apart among
    # endpoints given as a plain list. Empty until known.
    node_id: str = ""
    region: str = ""
    identified: bool = False  # Status answered since the node was last seen down
    # Each recent probe's fastest ping (RTT_PROBES of them); emptied when the node fails.
    recent_rtts: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_PROBES))

    def measured(self, rtt_ms: float) -> None:
        """A probe's fastest ping (``inf``: it failed, and the node ranks last until back)."""
        if rtt_ms == math.inf:
            self.recent_rtts.clear()
            self.rtt_ms = math.inf
        else:
            self.recent_rtts.append(rtt_ms)
            self.rtt_ms = min(self.recent_rtts)


class NodePool:
    """Channels to every endpoint, ranked by RTT, with failover and a stall watchdog."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        token: str | None = None,
        tls_root: bytes | None = None,
        stall_timeout: float = 5.0,
        first_chunk_timeout: float = 120.0,
        retry_timeout: float = 30.0,
        probe_interval: float = 30.0,
        replicas: Sequence[str] = (),
    ) -> None:
        if not endpoints:
            raise InvalidEndpoint("no endpoints given; pass endpoints=[...] or config=/region=")
        self.endpoints = list(endpoints)
        self.replicas = set(replicas)  # the own region's nodes: they split shards
        self.stats = {e.text: EndpointStats() for e in self.endpoints}
        self._names: dict[str, str] = {}  # endpoint → its node's id (see _learn_names)
        # Per shard, the nodes that refused it (FAILED_PRECONDITION): healthy, so not
        # marked down, but asked after the others for that shard from then on.
        self._refused: dict[tuple[str, int, int], set[str]] = {}
        # (lmdb:// endpoint, name@N) whose missing shards were already said once: a cache
        # beside gRPC endpoints that lacks the version (evicted, not staged yet) is a
        # route, not a failure, and was a warning and a failover on every window read.
        self._said_missing: set[tuple[str, str]] = set()
        self.failovers = 0
        self.current: str | None = None  # the endpoint that served the last chunk
        self.stall_timeout = stall_timeout
        self.first_chunk_timeout = first_chunk_timeout
        self.retry_timeout = retry_timeout
        self._metadata = bearer(token)
        self._tls_root = tls_root
        self._stubs: dict[str, edge_pb2_grpc.EdgeCacheStub] = {}
        self._readers: dict[str, grpc.UnaryStreamMultiCallable] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._stores: dict[str, CacheStore] = {}
        # (endpoint, dataset, version) → the digest of the manifest that local cache keeps
        self._local_digests: dict[tuple[str, str, int], str | None] = {}
        self._active: dict[int, Stream] = {}
        self.parked = ParkedStreams()
        self._lock = threading.Lock()  # the active streams
        self._channel_lock = threading.RLock()  # channels, stubs, stores and the closed flag
        self._closed = False
        self._stop = threading.Event()
        self._last_read = -math.inf  # when a read last started (monotonic)
        fork_safety.watch_calls(self)
        self.probe()
        self._threads = [
            threading.Thread(target=self._watchdog, name="edgecache-watchdog", daemon=True),
            threading.Thread(
                target=self._reprobe, args=(probe_interval,), name="edgecache-probe", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------- plumbing

    def _channel(self, endpoint: Endpoint) -> grpc.Channel:
        """The endpoint's channel, opened once; never again after :meth:`close`.

        Under the channel lock: a probe or read in flight when the pool closes
        must not open a channel nobody will close.
        """
        with self._channel_lock:
            if self._closed:
                raise self._closed_error(endpoint)
            channel = self._channels.get(endpoint.text)
            if channel is None:
                channel = open_channel(endpoint, tls_root=self._tls_root)
                self._channels[endpoint.text] = channel
            return channel

    def _closed_error(self, endpoint: Endpoint) -> NodeUnavailable:
        return NodeUnavailable(
            f"{endpoint.text}: this NodePool is closed; open a new one "
            "(EdgeDataset opens one when it is iterated again)",
            endpoint=endpoint.text,
        )

    def stub(self, endpoint: Endpoint) -> edge_pb2_grpc.EdgeCacheStub:
        """The EdgeCache stub of a gRPC endpoint."""
        with self._channel_lock:
            stub = self._stubs.get(endpoint.text)
            if stub is None:
                stub = self._stubs[endpoint.text] = edge_pb2_grpc.EdgeCacheStub(
                    self._channel(endpoint)
                )
            return stub

    def read_shard_call(self, endpoint: Endpoint) -> grpc.UnaryStreamMultiCallable:
        """ReadShard of a gRPC endpoint, its responses parsed by :func:`parse_chunk`."""
        with self._channel_lock:
            reader = self._readers.get(endpoint.text)
            if reader is None:
                reader = self._readers[endpoint.text] = self._channel(endpoint).unary_stream(
                    READ_SHARD_METHOD,
                    request_serializer=edge_pb2.ReadShardRequest.SerializeToString,
                    response_deserializer=parse_chunk,
                )
            return reader

    def reads_locally(self, shard: tuple[str, int, int]) -> bool:
        """Whether a read of ``shard`` goes first to a local cache that holds it.

        Such a read has nothing to wait for: the pipeline does it on its
        assembling thread rather than on a fetch thread.
        """
        first = self.ranked(shard)[0]
        if not first.local:
            return False
        try:
            return self.store(first).contains(ShardKey(*shard))
        except Exception:  # noqa: BLE001 - the read itself says what is wrong, and fails over
            return False

    def local_digest(self, endpoint: Endpoint, dataset: str, version: int) -> str | None:
        """The digest of the manifest a local cache keeps for a version (None: it keeps none).

        Read once per pool: a version is immutable, and a node that finds the
        registry's copy changed refuses it until it is evicted.
        """
        key = (endpoint.text, dataset, version)
        with self._channel_lock:
            if key in self._local_digests:
                return self._local_digests[key]
        raw = self.store(endpoint).get_manifest(dataset, version)
        try:
            digest = None if raw is None else manifest_from_bytes(raw, source=endpoint.text).digest
        except ManifestError as exc:
            # Which rows the cache holds cannot be told: read them elsewhere, as for a
            # shard it lacks (the next endpoint; asked again next read, not remembered).
            name = f"{dataset}@{version}"
            raise ShardNotCached(local_stores.damaged_manifest(name, endpoint.target)) from exc
        with self._channel_lock:
            self._local_digests[key] = digest
        return digest

    def store(self, endpoint: Endpoint) -> CacheStore:
        """The read-only store of a local endpoint, shared by the process's readers.

        Under the lock: LMDB must not open one environment twice in a process
        (:mod:`~edgecache.clients.local_stores` hands every reader the same one).
        """
        with self._channel_lock:
            if self._closed:
                raise self._closed_error(endpoint)
            store = self._stores.get(endpoint.text)
            if store is None:
                store = self._stores[endpoint.text] = local_stores.acquire(endpoint.target)
            return store

    def close_stores(self) -> None:
        """Close the local endpoints' LMDB environments; the next read reopens them.

        Call it when no read of this pool is in flight (EdgeDataset does, when its
        last pipeline of this process has stopped).
        """
        with self._channel_lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            local_stores.release(store)

    def close(self) -> None:
        """Stop and join the background threads, then close channels and stores.

        Safe to call twice. Streams still open are cancelled; a read in flight
        ends with a "closed" error rather than failing over, and nothing reopens
        a channel afterwards. Stop the reads first (EdgeDataset does): a store
        still read from closes only when its last reader is done.
        """
        with self._channel_lock:
            if self._closed:
                return
            self._closed = True
            channels, stores = list(self._channels.values()), list(self._stores.values())
            self._channels.clear()
            self._stubs.clear()
            self._readers.clear()
            self._stores.clear()
        self._stop.set()  # wakes the watchdog's and the prober's waits
        with self._lock:
            calls = [s.call for s in self._active.values() if s.call is not None]
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()  # also ends a health check in flight
        me = threading.current_thread()
        for thread in self._threads:
            if thread is not me and thread.ident is not None:
                thread.join()
        for store in stores:
            local_stores.release(store)

    # ----------------------------------------------------------------- ranking

    def probe(self, pings: int = 3) -> None:
        """Measure each gRPC endpoint's RTT (its fastest health check, see RTT_PROBES)."""
        for endpoint in self.endpoints:
            if endpoint.local:
                self.stats[endpoint.text].rtt_ms = 0.0
                continue
            if self._closed:
                return  # closing: a probe now would only measure the channels going away
            try:
                health = health_pb2_grpc.HealthStub(self._channel(endpoint))
            except NodeUnavailable:
                return  # closed since the check above
            samples = []
            for _ in range(pings):
                started = time.perf_counter()
                try:
                    with _FORK_GUARD:  # a fork waits for this call to end (see above)
                        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                except grpc.RpcError as exc:
                    if self._closed:
                        return
                    self.stats[endpoint.text].last_error = describe(exc)
                    break
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    self.stats[endpoint.text].last_error = "not serving (draining?)"
                    break
                samples.append((time.perf_counter() - started) * 1e3)
            stats = self.stats[endpoint.text]
            stats.measured(min(samples) if len(samples) == pings else math.inf)
            if stats.rtt_ms == math.inf:
                stats.identified = False  # it may come back as another node: ask again then
            elif not stats.identified and self._identify(endpoint, stats):
                self._learn_names()

    def _identify(self, endpoint: Endpoint, stats: EndpointStats) -> bool:
        """Ask a node that answers what it is (its id and region), once per time up.

        Replicas split shards by the ids their nodes report, as warm stages
        them, not by the address each side dials (``localhost:7072`` from the
        host, ``eu-west-2:7070`` inside a compose network). A node that cannot
        say (an old node, a refused token) is ranked by its address. A node seen
        down (a probe or a read failed) is asked again once it answers: a
        long-running reader kept a restarted node's old id, and asked it second
        for the shards it owns under its new one.
        """
        try:
            stub = self.stub(endpoint)
            with _FORK_GUARD:  # a fork waits for this call to end (see above)
                status = stub.Status(edge_pb2.StatusRequest(), timeout=2.0, metadata=self._metadata)
        except (grpc.RpcError, NodeUnavailable):
            return False
        stats.node_id, stats.region, stats.identified = status.node_id, status.region, True
        return True

    def _learn_names(self) -> None:
        """Endpoint → the id its node splits shards by, per region (unknown or shared: none)."""
        self._names = rendezvous.region_names(
            (stats.region, text, stats.node_id) for text, stats in self.stats.items()
        )

    def _learned_replicas(self, near: float) -> set[str]:
        """Endpoints given as a list (no topology): the nearest node's region's nodes.

        Without a topology nothing said which endpoints split shards: every
        read went to the nearest node, and the shards it does not own it read
        through from origin and cached again. The nodes say their region.
        """
        nearest = [
            e.text for e in self.endpoints if not e.local and self.stats[e.text].rtt_ms <= near
        ]
        # Nodes of several regions equally near (one host): the first given, as RTT ties go.
        region = next((self.stats[t].region for t in nearest if self.stats[t].region), "")
        if not region:
            return set()
        same = {e.text for e in self.endpoints if self.stats[e.text].region == region}
        return same if len(same) > 1 else set()

    def _reprobe(self, interval: float) -> None:
        """Re-rank the nodes every ``interval`` while the pool reads; an idle one is quiet.

        A DataLoader's parent holds a pool that fetched the manifest and reads
        nothing (its workers read): probes there only put gRPC to work when a
        worker may be forked, and a fork during gRPC's work is what gRPC handles
        worst (see ``_FORK_GUARD``). Reads resume probing within ``interval``.
        """
        checked = time.monotonic()
        while not self._stop.wait(interval):
            with self._lock:
                reading = bool(self._active)
            # "a read started since the last look", not "within one interval": a
            # wake-up that comes late on a loaded host must not miss the read.
            read_since = self._last_read > checked
            checked = time.monotonic()
            if not (reading or read_since):
                continue
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - probing must never kill the reader
                log.debug("background probe failed", exc_info=True)

    def ranked(self, shard: tuple[str, int, int] | None = None) -> list[Endpoint]:
        """Endpoints, nearest first (unreachable ones last).

        RTTs within 25% (+0.5 ms) of the best count as a tie: jitter must not
        bounce readers between nodes, and ties go to the order given (own region
        first). The own region's nodes (one or several) come first, and among
        them, replicas that split shards by rendezvous hashing, a ``(dataset,
        version, shard)`` goes to the shard's owner first; a node stays in that
        group unless it is more than REPLICA_SLACK_MS slower than the best: one
        noisy probe (5 ms against 1.3 on a busy host) must not send every shard
        to a node that does not own it (another replica, or another region's
        node), which then reads it through from origin and caches it twice.
        """
        order = {e.text: i for i, e in enumerate(self.endpoints)}
        # The nearest node's, not a local cache's 0 ms: an lmdb:// directory given before
        # the nodes (as the docs advise for a partial cache) made "near" 0.5 ms, no node
        # within it, so no replicas were learned and every shard went to the nearest
        # node, which read the others' through from origin and cached them twice.
        # With no node answering, 0 (as before): the unreachable ones rank last, far.
        best = min(
            (
                rtt
                for e in self.endpoints
                if not e.local and (rtt := self.stats[e.text].rtt_ms) < math.inf
            ),
            default=0.0,
        )
        near = best * 1.25 + 0.5
        grouped: set[str] = set()  # own-region nodes: ranked by shard ownership, not by RTT
        replicas = self.replicas or self._learned_replicas(near)
        if replicas:
            same_region = max(near, best + REPLICA_SLACK_MS)
            group = [
                e.text
                for e in self.endpoints
                if e.text in replicas and self.stats[e.text].rtt_ms <= same_region
            ]
            if shard is not None:
                group = rendezvous.rank(group, *shard, names=self._names)
            # Local caches given before the replicas stay before them (a replica's own
            # lmdb:// directory beside the topology): the shards they hold cost no call,
            # and those they lack are passed over once (_said_missing).
            first = next((i for i, e in enumerate(self.endpoints) if e.text in group), 0)
            head = [e.text for e in self.endpoints[:first] if e.local] + group
            order = {text: i for i, text in enumerate(head)} | {
                e.text: len(head) + i for i, e in enumerate(self.endpoints) if e.text not in head
            }
            grouped = set(group)

        def key(endpoint: Endpoint) -> tuple[bool, float, int]:
            rtt = self.stats[endpoint.text].rtt_ms
            far = rtt > near and endpoint.text not in grouped
            return (far, rtt if far else 0.0, order[endpoint.text])

        ranked = sorted(self.endpoints, key=key)
        refused = self._refused.get(shard) if shard is not None else None
        if refused:
            ranked.sort(key=lambda e: e.text in refused)  # stable: the rest keep their order
        return ranked

    # ---------------------------------------------------------------- unary

    def call(self, method: str, request: object, *, what: str = "") -> object:
        """A unary call on the best gRPC endpoint, failing over to the others.

        ``what`` names the subject (``tokens@3``) in error messages. A node
        that is unreachable, too slow or at its ``max_streams`` (asked again by
        the channel's retry policy first) is skipped; any other refusal is the
        answer (another node would give the same) and is raised as the
        matching :class:`~edgecache.cache.errors.EdgeCacheError` by
        :func:`~edgecache.clients.channels.node_error`, never as ``grpc.RpcError``.
        """
        label = f"{method} {what}".strip()
        errors: dict[str, str] = {}
        for endpoint in [e for e in self.ranked() if not e.local]:
            try:
                return getattr(self.stub(endpoint), method)(
                    request, timeout=30, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and too_many_streams(exc)
                if busy or exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    errors[endpoint.text] = describe(exc)
                    self.stats[endpoint.text].last_error = errors[endpoint.text]
                    continue
                raise node_error(exc, endpoint=endpoint.text, what=label) from exc
        raise AllNodesFailed(_all_failed(label, errors or {"(none)": "no gRPC endpoint"}))

    # ------------------------------------------------------------ streaming

    def _watchdog(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                streams = list(self._active.values())
            for stream in streams:
                limit = self.stall_timeout if stream.started else self.first_chunk_timeout
                if stream.call is not None and not stream.parked and now - stream.last > limit:
                    with _FORK_GUARD:
                        stream.call.cancel()

    def track(self, stream: Stream) -> None:
        """Watch ``stream`` (the stall watchdog; :meth:`cancel` and :meth:`close` end it)."""
        with self._lock:
            self._active[id(stream)] = stream

    def untrack(self, stream: Stream) -> None:
        """Stop watching ``stream`` (it ended)."""
        with self._lock:
            self._active.pop(id(stream), None)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata for reads (the bearer token)."""
        return self._metadata

    def calls_in_flight(self) -> int:
        """The gRPC streams open now, parked ones included (a fork skips gRPC's handlers then)."""
        with self._lock:
            return sum(1 for s in self._active.values() if s.call is not None)

    def cancel(self, stop: threading.Event) -> None:
        """Cancel the gRPC streams of reads given ``stop`` (set it first).

        Their readers then end at once instead of at the next chunk, and say
        nothing: a read its caller stopped has not failed.
        """
        with self._lock:
            calls = [s.call for s in self._active.values() if s.stop is stop]
        for call in calls:
            if call is not None:
                call.cancel()
        self.parked.drop(stop)

    def read_rows(
        self,
        rows: ShardRange,
        edges: EdgeChunks | None = None,
        *,
        stop: threading.Event | None = None,
        extend_to: int | None = None,
    ) -> Generator[tuple[int, pa.RecordBatch], None, None]:
        """(first row, batch) of the chunks covering ``rows``.

        Batches are verified and decoded; a broken stream resumes on the next
        node from the first row not yet received. Raises :class:`AllNodesFailed`
        after ``retry_timeout`` seconds without progress on any node. Reads
        given the same ``edges`` decode a chunk across their shared edge once.
        Once ``stop`` is set (and :meth:`cancel` called with it) the read ends
        quietly, without failing over: its caller no longer wants the rows.
        With ``extend_to``, a gRPC read asks for rows up to there and parks the
        stream where ``rows`` end, for the read that starts there
        (:mod:`~edgecache.clients.parked_streams`).
        """
        self._last_read = time.monotonic()
        tail = None
        if edges is not None:  # chunks across our edges that a read beside us decoded
            t = rows.target
            head = edges.take(t.dataset, t.version, rows.shard, rows.row_start, *_span(rows))
            if head is not None:
                yield head
                rows = rows.starting_at(head[0] + head[1].num_rows)
                if rows.empty:
                    return
            tail = edges.take(t.dataset, t.version, rows.shard, rows.row_end, *_span(rows))
            if tail is not None:
                rows, extend_to = rows.ending_at(tail[0]), None
        if not rows.empty:
            yield from self._read_range(rows, edges, stop, extend_to)
        if tail is not None:
            yield tail

    def _read_range(
        self,
        rows: ShardRange,
        edges: EdgeChunks | None,
        stop: threading.Event | None,
        extend_to: int | None = None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        stop = stop or threading.Event()  # without one, the read runs until done or failed
        next_row, row_end = rows.row_start, rows.row_end
        deadline = time.monotonic() + self.retry_timeout
        errors: dict[str, str] = {}
        corrupt_retries = 1
        attempt = 0
        # A failed node counts as a failover once the read goes on at another one: with
        # every node down, retries are not failovers (stats and the metric said 16).
        failed_on: str | None = None
        while next_row < row_end:
            progressed = False
            # Nodes that answered for good this round: refused as things are
            # (FAILED_PRECONDITION: its origin refuses it, say its credentials) or not holding
            # the rows (a local cache). Another node may serve the rows; when none can,
            # the refusal is the answer, now rather than at the retry deadline.
            refusals: list[tuple[Endpoint, grpc.RpcError]] = []
            settled = 0
            missing = 0  # local caches that do not hold the rows: waiting will not bring them
            ranking = self.ranked(rows.shard_id)
            for place, endpoint in enumerate(ranking):
                passed_over = False  # a local cache without the rows, others after it
                corrupt = False  # it failed on a damaged chunk (read once more, no longer)
                if next_row >= row_end or stop.is_set():
                    return  # done (the stream broke after the last row we needed), or stopped
                try:
                    rest = rows.starting_at(next_row)
                    handle: list[Stream] = []
                    source = self._source(endpoint, rest, edges, stop, extend_to, handle)
                    for first, batch in source:
                        end = first + batch.num_rows
                        if end <= next_row:
                            continue  # already have these rows (resumed mid-chunk)
                        self.current = endpoint.text
                        if failed_on is not None:
                            self.failovers += failed_on != endpoint.text
                            failed_on = None
                        yield first, batch
                        next_row = end
                        progressed = True
                        if next_row >= row_end:
                            # Every row is here: do not wait for the end of the stream
                            # (a node that stops now would fail a read that is done).
                            if handle and goes_past(handle[0], row_end):
                                key = (*rows.shard_id, row_end)
                                past = [(first, batch)] if end > row_end else []
                                parked = Parked(source, past, handle[0], endpoint.text, stop)
                                self.parked.park(key, parked)  # type: ignore[arg-type]
                            return
                    if next_row >= row_end:
                        return
                except Exception as exc:
                    if stop.is_set():
                        return  # our caller cancelled the read: not this node's failure
                    if self._closed:
                        raise self._closed_error(endpoint) from exc
                    errors[endpoint.text] = self._failover_reason(endpoint, rest, exc)
                    # Not the exception itself: its traceback holds this frame, and the
                    # cycle kept a finished read's generator (and its LMDB reader) alive.
                    corrupt = isinstance(exc, ChunkCorrupt)
                    refused = isinstance(exc, grpc.RpcError) and exc.code() == _REFUSED
                    if refused:
                        refusals.append((endpoint, exc))  # type: ignore[arg-type]
                        with self._lock:
                            self._refused.setdefault(rows.shard_id, set()).add(endpoint.text)
                    settled += refused or isinstance(exc, (ShardNotCached, CacheDirError))
                    missing += isinstance(exc, ShardNotCached)
                    passed_over = (
                        isinstance(exc, ShardNotCached)
                        and place < len(ranking) - 1
                        and not progressed
                    )
                    if isinstance(exc, ChunkCorrupt):
                        if corrupt_retries == 0:
                            if endpoint.local:  # read-only here: the damaged shard stays
                                raise ChunkCorrupt(
                                    f"{exc}; this process reads {endpoint.text} read-only, "
                                    "so the damaged shard stays there and every epoch meets "
                                    "it: have the cache's node stage it again (edgecache "
                                    "evict NAME@N --region R, then edgecache warm NAME@N "
                                    "--region R), or list a node's host:port after it so "
                                    "reads fall back to the node"
                                ) from exc
                            raise
                        corrupt_retries -= 1
                if next_row < row_end:
                    last = place == len(ranking) - 1
                    if last and not progressed and missing == len(self.endpoints):
                        break  # no endpoint holds the rows: the read ends below, saying so
                    if passed_over:
                        said = (endpoint.text, str(rows.target))
                        (log.debug if said in self._said_missing else log.warning)(
                            "%s shard %d: %s (read from %s instead; the next shards this "
                            "cache lacks are logged at debug level)",
                            rows.target,
                            rows.shard,
                            errors.get(endpoint.text),
                            ranking[place + 1].text,
                        )
                        self._said_missing.add(said)
                        continue
                    failed_on = endpoint.text
                    # Every endpoint refused or lacks the rows: the read fails right
                    # below, so the log must not promise a retry that never comes.
                    final = (
                        last
                        and not progressed
                        and bool(refusals)
                        and settled == len(self.endpoints)
                    )
                    (log.warning if attempt == 0 else log.debug)(
                        "%s shard %d: %s failed (%s); %s",
                        rows.target,
                        rows.shard,
                        endpoint.text,
                        errors.get(endpoint.text),
                        _next_step(
                            ranking,
                            place,
                            next_row,
                            self.retry_timeout,
                            final=final,
                            corrupt=corrupt,
                        ),
                    )
            if refusals and not progressed and settled == len(self.endpoints):
                node, answer = refusals[0]
                raise node_error(answer, endpoint=node.text, what=f"ReadShard {rows}")
            if not progressed and missing == len(self.endpoints):
                # Only local caches, none holding the rows: nothing fetches into a cache
                # read directly, so waiting would only delay the answer (by retry_timeout).
                raise AllNodesFailed(_not_held(f"reading {rows.target} shard {rows.shard}", errors))
            if progressed:
                deadline = time.monotonic() + self.retry_timeout
            if time.monotonic() > deadline:
                raise AllNodesFailed(
                    _all_failed(f"reading {rows.target} shard {rows.shard}", errors)
                )
            if stop.wait(min(0.1 * 2**attempt, 2.0)):
                return
            attempt += 1
            self.probe(pings=1)

    def _source(
        self,
        endpoint: Endpoint,
        rows: ShardRange,
        edges: EdgeChunks | None,
        stop: threading.Event | None,
        extend_to: int | None,
        handle: list[Stream],
    ) -> Generator[tuple[int, pa.RecordBatch], None, None]:
        """Where ``rows`` come from: the local cache, a parked stream, or a new one."""
        if endpoint.local:
            return local_rows(self, endpoint, rows, edges)
        parked = self.parked.take((*rows.shard_id, rows.row_start), endpoint.text)
        if parked is not None:
            handle.append(parked.stream)
            return chained(parked)
        wanted = rows if extend_to is None else rows.ending_at(max(extend_to, rows.row_end))
        # The chunk across ``rows.row_end`` is then inside the read: decoded here, and
        # handed to the next read with the parked stream rather than through ``edges``.
        return grpc_rows(self, endpoint, wanted, edges, stop, handle)

    def _failover_reason(self, endpoint: Endpoint, rows: ShardRange, exc: Exception) -> str:
        """Why a read on ``endpoint`` failed, if another node may have the rows; else raise.

        Statuses that another node would answer the same way (refused
        credentials, an unknown version, bad arguments) end the read as an
        edgecache error naming the node and the rows. FAILED_PRECONDITION is
        this node's own state (what its origin lets it read): the others are
        asked, and the refusal ends the read only when none can serve it.
        """
        stats = self.stats[endpoint.text]
        if isinstance(exc, (ShardNotCached, CacheDirError)):  # not here: try the others
            return str(exc)
        if isinstance(exc, ChunkCorrupt):  # counted and said, as any failure (stats())
            stats.failures += 1
            stats.last_error = str(exc)
            return stats.last_error
        if isinstance(exc, grpc.RpcError) and exc.code() == _REFUSED:
            # The node is up and answered: it cannot serve these rows as things are
            # (its origin refuses it), which another node may.
            stats.last_error = describe(exc)
            return stats.last_error
        if isinstance(exc, grpc.RpcError) and exc.code() in _FAILOVER_CODES:
            stats.failures += 1
            stats.last_error = describe(exc)
            stats.measured(math.inf)  # until the next probe says otherwise
            stats.identified = False  # a node back up may be another one (_identify)
            return stats.last_error
        if isinstance(exc, grpc.RpcError):
            raise node_error(exc, endpoint=endpoint.text, what=f"ReadShard {rows}") from exc
        raise exc


_REFUSED = grpc.StatusCode.FAILED_PRECONDITION


def _span(rows: ShardRange) -> tuple[int, int]:
    return rows.row_start, rows.row_end


_FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,  # our watchdog
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,  # that node's cache is damaged; another serves the shard
    }
)


def _next_step(
    ranking: Sequence[Endpoint],
    place: int,
    row: int,
    retry_timeout: float,
    *,
    final: bool,
    corrupt: bool = False,
) -> str:
    """What a read does after ``ranking[place]`` failed at ``row`` (for the log).

    ``final``: every endpoint answered for good (refused the rows, or is a cache
    without them), so the read fails now instead of retrying. ``corrupt``: it
    failed on a damaged chunk, which is read once more, not for ``retry_timeout``.
    """
    if corrupt and place + 1 == len(ranking):
        return f"reading it once more from row {row}: a second damaged read ends it"
    if final:
        if len(ranking) == 1:
            return "no other endpoint, and a refusal is its answer: the read fails now"
        return "no endpoint can serve it (each refused or lacks it): the read fails now"
    if place + 1 < len(ranking):
        return f"continuing from row {row} on {ranking[place + 1].text}"
    if len(ranking) == 1:
        return f"no other endpoint: retrying it from row {row} for up to {retry_timeout:g} s"
    return f"the last endpoint: retrying them all from row {row} for up to {retry_timeout:g} s"


def _not_held(what: str, errors: dict[str, str]) -> str:
    """The message of a read no endpoint can serve: every one is a cache without the rows."""
    if len(errors) == 1:
        ((name, error),) = errors.items()
        return f"{what} from {name}: {error}"
    lines = "\n  ".join(f"{name}: {error}" for name, error in errors.items())
    return f"{what}: no endpoint holds it:\n  {lines}"


def _all_failed(what: str, errors: dict[str, str]) -> str:
    lines = "\n  ".join(f"{name}: {error}" for name, error in errors.items())
    return (
        f"{what} failed on every endpoint:\n  {lines}\n"
        "Check that the nodes run (edgecache status) and are reachable from this host."
    )
