"""Where a reader gets shards: nearest healthy node first, failover mid-stream, local fast path.

Endpoints are ``host:port`` (``grpc://`` optional), ``grpcs://host:port`` (TLS)
or ``lmdb:///path/to/cache`` (a node's cache directory on this host: read
directly, no gRPC). gRPC endpoints are ranked by round-trip time (median of
health-check pings) and re-probed in the background.

A stream that breaks is resumed on the next-best node at the first row not
yet received (``start_row``), so nothing is lost or duplicated; gRPC never
retries a stream that has started answering, so this is done here. Dead
peers are noticed by HTTP/2 keepalive pings (a blackholed node within a few
seconds, where default keepalive took a minute) and by a watchdog that
cancels a stream that delivers nothing for ``stall_timeout`` seconds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import (
    AllNodesFailed,
    CacheDirError,
    ChunkCorrupt,
    InvalidEndpoint,
    ShardNotCached,
)
from edgecache.cache.frame import Buffer, read_header, verify_frame
from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore
from edgecache.clients import rendezvous
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = [
    "EdgeChunks",
    "Endpoint",
    "NodePool",
    "bearer",
    "client_credentials",
    "open_channel",
    "parse_endpoint",
]

log = logging.getLogger(__name__)

_RETRY_POLICY = json.dumps(
    {
        "methodConfig": [
            {
                # Unary calls only: a stream is resumed by read_rows from the right row.
                "name": [
                    {"service": "edgecache.v1.EdgeCache", "method": m}
                    for m in ("ResolveVersion", "GetManifest", "Status")
                ],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
# A chunk is a few MiB. A message over this limit comes from a broken or hostile node:
# refuse it (RESOURCE_EXHAUSTED, and read elsewhere) instead of allocating it.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", -1),
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    # Without this a dropped route goes unnoticed for a minute (the ping timeout
    # defaults to 60 s, whatever the keepalive timeout says).
    ("grpc.http2.ping_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", _RETRY_POLICY),
]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One place to read from."""

    text: str
    kind: str  # "grpc", "grpcs" or "lmdb"
    target: str  # host:port, or a directory

    @property
    def local(self) -> bool:
        """Whether this is a cache directory on this host."""
        return self.kind == "lmdb"


def parse_endpoint(text: str) -> Endpoint:
    """``host:port``, ``grpc://host:port``, ``grpcs://host:port`` or ``lmdb:///dir``."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidEndpoint(f"endpoint must be a non-empty string, got {text!r}")
    raw = text.strip()
    if raw.startswith("lmdb://"):
        path = raw[len("lmdb://") :]
        if not path.startswith("/"):
            raise InvalidEndpoint(f"{text!r}: use lmdb:///absolute/path/to/cache")
        return Endpoint(raw, "lmdb", path)
    scheme, _, rest = raw.rpartition("://") if "://" in raw else ("grpc", "", raw)
    if scheme not in ("grpc", "grpcs"):
        raise InvalidEndpoint(
            f"{text!r}: unknown scheme {scheme!r}; use host:port, grpcs://host:port or lmdb:///path"
        )
    parts = urlsplit(f"//{rest}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise InvalidEndpoint(f"{text!r} is not host:port (e.g. eu-1.internal:7070)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return Endpoint(raw, scheme, f"{host}:{port}")


def _read_pem(variable: str) -> bytes | None:
    path = os.environ.get(variable)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidEndpoint(
            f"${variable} names {path}, which cannot be read ({exc.strerror}); "
            "point it at a PEM file or unset it"
        ) from None


def client_credentials(root: bytes | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for ``grpcs://`` endpoints, from the ``EDGECACHE_TLS_*`` environment.

    ``EDGECACHE_TLS_CA`` is the CA bundle that signed the nodes' certificates
    (default: the system's roots); ``EDGECACHE_TLS_CERT`` and
    ``EDGECACHE_TLS_KEY`` are this client's certificate and key, for nodes
    that require mutual TLS (``--tls-client-ca``). The environment, not
    arguments, because DataLoader workers, the CLI and the warm CronJob all
    inherit it without code.
    """
    cert, key = _read_pem("EDGECACHE_TLS_CERT"), _read_pem("EDGECACHE_TLS_KEY")
    if (cert is None) != (key is None):
        raise InvalidEndpoint(
            "mutual TLS needs both $EDGECACHE_TLS_CERT and $EDGECACHE_TLS_KEY; only one is set"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=root if root is not None else _read_pem("EDGECACHE_TLS_CA"),
        private_key=key,
        certificate_chain=cert,
    )


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying ``token``, for nodes started with a token file."""
    return (("authorization", f"Bearer {token}"),) if token else None


def open_channel(endpoint: Endpoint, *, tls_root: bytes | None = None) -> grpc.Channel:
    """A channel to a gRPC endpoint: TLS for ``grpcs://`` (see `client_credentials`)."""
    if endpoint.kind == "grpcs":
        credentials = client_credentials(tls_root)
        return grpc.secure_channel(endpoint.target, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(endpoint.target, options=CHANNEL_OPTIONS)


@dataclass
class EndpointStats:
    """What a reader saw of one endpoint."""

    rtt_ms: float = math.inf
    bytes: int = 0
    failures: int = 0
    last_error: str = ""


@dataclass
class _Stream:
    call: grpc.Call | None
    last: float = field(default_factory=time.monotonic)
    started: bool = False


# ReadShard responses, parsed without protobuf's copy of the frame ------------------------

_READ_SHARD = "/edgecache.v1.EdgeCache/ReadShard"
# Fields of edgecache.v1.Chunk the fast path accepts: tag → (name, wire type, largest value).
# (edge/wire.py writes these; protobuf serializers write the same bytes, in field order.)
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_CHUNK_FIELDS = {
    0x08: ("index", 0, _U32),
    0x10: ("chunk_count", 0, _U32),
    0x18: ("rows", 0, _U32),
    0x21: ("checksum", 1, _U64),
    0x2A: ("frame", 2, 0),
    0x30: ("first_row", 0, _U64),
}


class WireChunk:
    """A ``Chunk`` whose ``frame`` is a memoryview into the received message (no copy)."""

    __slots__ = ("index", "chunk_count", "rows", "checksum", "frame", "first_row")

    def __init__(self) -> None:
        self.index = self.chunk_count = self.rows = self.checksum = self.first_row = 0
        self.frame: memoryview | bytes = b""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A varint of at most 10 bytes at ``pos``; ``(-1, pos)`` if it is longer or truncated."""
    value = shift = 0
    limit = min(end, pos + 10)
    while pos < limit:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def parse_chunk(data: bytes) -> WireChunk | edge_pb2.Chunk:
    """ReadShard's response deserializer: the ``Chunk`` in ``data``, its frame not copied.

    The generated parser copies each multi-MiB frame out of the message; this
    one returns a memoryview into ``data`` instead. It accepts only the plain
    encoding (known fields, each at most once, values in range); anything else,
    valid or not, is handed to protobuf, so results and errors are exactly
    protobuf's (a malformed message raises, which gRPC turns into INTERNAL, and
    the stream fails over as before).
    """
    out = WireChunk()
    seen = 0
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag = data[pos]
            field = _CHUNK_FIELDS.get(tag)
            if field is None or seen & (1 << (tag >> 3)):
                return edge_pb2.Chunk.FromString(data)  # unknown or repeated field
            seen |= 1 << (tag >> 3)
            name, wire, top = field
            pos += 1
            if wire == 0:
                value, pos = _varint(data, pos, end)
                if not 0 <= value <= top:
                    return edge_pb2.Chunk.FromString(data)  # overlong, truncated or wrapped
                setattr(out, name, value)
            elif wire == 1:
                if pos + 8 > end:
                    return edge_pb2.Chunk.FromString(data)
                out.checksum = int.from_bytes(data[pos : pos + 8], "little")
                pos += 8
            else:
                size, pos = _varint(data, pos, end)
                if size < 0 or pos + size > end:
                    return edge_pb2.Chunk.FromString(data)
                out.frame = memoryview(data)[pos : pos + size]
                pos += size
    except Exception:  # noqa: BLE001 - whatever went wrong, protobuf decides
        return edge_pb2.Chunk.FromString(data)
    return out


ChunkKey = tuple[str, int, int, int, int, int]  # dataset, version, shard, first row, rows, checksum
EdgeKey = tuple[str, int, int, int]  # dataset, version, shard, edge row


class _Decoded:
    """One chunk's decode, shared by the reads on either side of a window edge."""

    __slots__ = ("batch", "claimed", "done", "rows")

    def __init__(self, rows: int) -> None:
        self.rows, self.claimed = rows, 0
        self.batch: pa.RecordBatch | None = None
        self.done = threading.Event()


class EdgeChunks:
    """Decoded chunks that straddle the edge of a read, kept for the read beside it.

    Shuffle windows rarely end on chunk boundaries, so the chunk across an edge
    is read by both windows; adjacent windows are read at about the same time
    (adjacent lanes). The first read to reach such a chunk decodes it, the other
    waits for that and takes the same batch (its own copy of the frame still
    verified when it came over the network). A read that starts after the chunk
    was decoded does not fetch it at all (:meth:`take`). Keys are ``(dataset,
    version, shard, first row, rows, checksum)``, so only identical bytes are
    shared. ``shared`` names, per shard, the rows where two reads of the caller
    meet; only chunks across those are kept, until their rows were all taken,
    and at most ``limit`` (the oldest are dropped: the other read then fetches
    and decodes its own copy, as without this).
    """

    def __init__(self, shared: dict[int, set[int]], limit: int = 8) -> None:
        self.shared, self.limit = shared, limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, _Decoded] = OrderedDict()
        self._ready: dict[EdgeKey, ChunkKey] = {}  # edge → the decoded chunk across it

    def take(
        self, dataset: str, version: int, shard: int, edge: int, row_start: int, row_end: int
    ) -> tuple[int, pa.RecordBatch] | None:
        """(first row, batch) of a decoded chunk across row ``edge``, if there is one.

        The read of rows ``[row_start, row_end)`` takes its rows of it, so it
        need not fetch that chunk.
        """
        with self._lock:
            key = self._ready.get((dataset, version, shard, edge))
            entry = None if key is None else self._entries.get(key)
            if key is None or entry is None or entry.batch is None:
                return None
            first = key[3]
            entry.claimed += min(first + entry.rows, row_end) - max(first, row_start)
            if entry.claimed >= entry.rows:
                self._forget_locked(key, entry)
            return first, entry.batch

    def across(self, shard: int, first: int, end: int, row_start: int, row_end: int) -> bool:
        """Whether chunk rows ``[first, end)`` cross an edge this read shares with another."""
        edges = self.shared.get(shard, ())
        return (first < row_start < end and row_start in edges) or (
            first < row_end < end and row_end in edges
        )

    def decode(
        self, key: ChunkKey, rows: int, taken: int, decode: Callable[[], pa.RecordBatch]
    ) -> pa.RecordBatch:
        """``decode()`` once for both reads of chunk ``key``; this read takes ``taken`` rows."""
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if entry is None:
                entry = self._entries[key] = _Decoded(rows)
                while len(self._entries) > self.limit:
                    oldest, dropped = next(iter(self._entries.items()))
                    self._forget_locked(oldest, dropped)
        if owner:
            try:
                entry.batch = decode()
            finally:
                entry.done.set()
                if entry.batch is None:  # failed: nothing to share
                    self._forget(key, entry)
            dataset, version, shard, first = key[:4]
            with self._lock:
                if self._entries.get(key) is entry:
                    for edge in self.shared.get(shard, ()):
                        if first < edge < first + rows:
                            self._ready[(dataset, version, shard, edge)] = key
        else:
            entry.done.wait()
        batch = entry.batch
        if batch is None:
            return decode()  # the other read's decode failed; ours may not
        with self._lock:
            entry.claimed += taken
            if entry.claimed >= entry.rows:
                self._forget_locked(key, entry)
        return batch

    def _forget(self, key: ChunkKey, entry: _Decoded) -> None:
        with self._lock:
            self._forget_locked(key, entry)

    def _forget_locked(self, key: ChunkKey, entry: _Decoded) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
            for edge in [e for e, k in self._ready.items() if k == key]:
                del self._ready[edge]


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
        self.failovers = 0
        self.stall_timeout = stall_timeout
        self.first_chunk_timeout = first_chunk_timeout
        self.retry_timeout = retry_timeout
        self._metadata = bearer(token)
        self._tls_root = tls_root
        self._stubs: dict[str, edge_pb2_grpc.EdgeCacheStub] = {}
        self._readers: dict[str, grpc.UnaryStreamMultiCallable] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._stores: dict[str, CacheStore] = {}
        self._active: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
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
        channel = self._channels.get(endpoint.text)
        if channel is None:
            channel = open_channel(endpoint, tls_root=self._tls_root)
            self._channels[endpoint.text] = channel
        return channel

    def stub(self, endpoint: Endpoint) -> edge_pb2_grpc.EdgeCacheStub:
        """The EdgeCache stub of a gRPC endpoint."""
        stub = self._stubs.get(endpoint.text)
        if stub is None:
            stub = self._stubs[endpoint.text] = edge_pb2_grpc.EdgeCacheStub(self._channel(endpoint))
        return stub

    def read_shard_call(self, endpoint: Endpoint) -> grpc.UnaryStreamMultiCallable:
        """ReadShard of a gRPC endpoint, its responses parsed by :func:`parse_chunk`."""
        reader = self._readers.get(endpoint.text)
        if reader is None:
            reader = self._readers[endpoint.text] = self._channel(endpoint).unary_stream(
                _READ_SHARD,
                request_serializer=edge_pb2.ReadShardRequest.SerializeToString,
                response_deserializer=parse_chunk,
            )
        return reader

    def store(self, endpoint: Endpoint) -> CacheStore:
        """The read-only store of a local endpoint, opened once per process.

        Under the lock: LMDB must not open one environment twice in a process.
        """
        with self._lock:
            store = self._stores.get(endpoint.text)
            if store is None:
                store = self._stores[endpoint.text] = CacheStore(endpoint.target, readonly=True)
            return store

    def close(self) -> None:
        """Stop background threads, close channels and stores (safe to call twice)."""
        self._stop.set()
        for channel in self._channels.values():
            channel.close()
        for store in self._stores.values():
            store.close()
        self._channels.clear()
        self._stubs.clear()
        self._readers.clear()
        self._stores.clear()

    # ----------------------------------------------------------------- ranking

    def probe(self, pings: int = 3) -> None:
        """Measure each gRPC endpoint's RTT (median of health checks)."""
        for endpoint in self.endpoints:
            if endpoint.local:
                self.stats[endpoint.text].rtt_ms = 0.0
                continue
            health = health_pb2_grpc.HealthStub(self._channel(endpoint))
            samples = []
            for _ in range(pings):
                started = time.perf_counter()
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                except grpc.RpcError as exc:
                    self.stats[endpoint.text].last_error = _describe(exc)
                    break
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    self.stats[endpoint.text].last_error = "not serving (draining?)"
                    break
                samples.append((time.perf_counter() - started) * 1e3)
            self.stats[endpoint.text].rtt_ms = (
                statistics.median(samples) if len(samples) == pings else math.inf
            )

    def _reprobe(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - probing must never kill the reader
                log.debug("background probe failed", exc_info=True)

    def ranked(self, shard: tuple[str, int, int] | None = None) -> list[Endpoint]:
        """Endpoints, nearest first (unreachable ones last).

        RTTs within 25% (+0.5 ms) of the best count as a tie: jitter must not
        bounce readers between nodes, and ties go to the order given (own region
        first). Among the own region's replicas, which split shards by rendezvous
        hashing, a ``(dataset, version, shard)`` goes to the shard's owner first.
        """
        order = {e.text: i for i, e in enumerate(self.endpoints)}
        best = min(self.stats[e.text].rtt_ms for e in self.endpoints)
        near = best * 1.25 + 0.5
        if shard is not None and len(self.replicas) > 1:
            group = [
                e.text
                for e in self.endpoints
                if e.text in self.replicas and self.stats[e.text].rtt_ms <= near
            ]
            order = {text: i for i, text in enumerate(rendezvous.rank(group, *shard))} | {
                e.text: len(group) + i for i, e in enumerate(self.endpoints) if e.text not in group
            }

        def key(endpoint: Endpoint) -> tuple[bool, float, int]:
            rtt = self.stats[endpoint.text].rtt_ms
            return (rtt > near, rtt if rtt > near else 0.0, order[endpoint.text])

        return sorted(self.endpoints, key=key)

    # ---------------------------------------------------------------- unary

    def call(self, method: str, request: object) -> object:
        """A unary call on the best gRPC endpoint, failing over to the others."""
        errors: dict[str, str] = {}
        for endpoint in [e for e in self.ranked() if not e.local]:
            try:
                return getattr(self.stub(endpoint), method)(
                    request, timeout=30, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    errors[endpoint.text] = _describe(exc)
                    self.stats[endpoint.text].last_error = errors[endpoint.text]
                    continue
                raise
        raise AllNodesFailed(_all_failed(f"{method}", errors or {"(none)": "no gRPC endpoint"}))

    # ------------------------------------------------------------ streaming

    def _watchdog(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                streams = list(self._active.values())
            for stream in streams:
                limit = self.stall_timeout if stream.started else self.first_chunk_timeout
                if stream.call is not None and now - stream.last > limit:
                    stream.call.cancel()

    def read_rows(
        self,
        dataset: str,
        version: int,
        digest: str,
        shard: int,
        row_start: int,
        row_end: int,
        schema: pa.Schema | None,
        edges: EdgeChunks | None = None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(first row, batch) of the chunks covering rows ``[row_start, row_end)``.

        Batches are verified and decoded; a broken stream resumes on the next
        node from the first row not yet received. Raises :class:`AllNodesFailed`
        after ``retry_timeout`` seconds without progress on any node. Reads
        given the same ``edges`` decode a chunk across their shared edge once.
        """
        tail = None
        if edges is not None:  # chunks across our edges that a read beside us decoded
            head = edges.take(dataset, version, shard, row_start, row_start, row_end)
            if head is not None:
                yield head
                row_start = head[0] + head[1].num_rows
                if row_start >= row_end:
                    return
            tail = edges.take(dataset, version, shard, row_end, row_start, row_end)
            if tail is not None:
                row_end = tail[0]
        if row_start < row_end:
            yield from self._read_range(
                dataset, version, digest, shard, row_start, row_end, schema, edges
            )
        if tail is not None:
            yield tail

    def _read_range(
        self,
        dataset: str,
        version: int,
        digest: str,
        shard: int,
        row_start: int,
        row_end: int,
        schema: pa.Schema | None,
        edges: EdgeChunks | None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        next_row = row_start
        deadline = time.monotonic() + self.retry_timeout
        errors: dict[str, str] = {}
        corrupt_retries = 1
        attempt = 0
        while next_row < row_end:
            progressed = False
            for endpoint in self.ranked((dataset, version, shard)):
                if next_row >= row_end:
                    return  # the stream broke after the last row we needed arrived
                try:
                    source = (
                        self._local_rows(
                            endpoint, dataset, version, shard, next_row, row_end, schema, edges
                        )
                        if endpoint.local
                        else self._grpc_rows(
                            endpoint,
                            dataset,
                            version,
                            digest,
                            shard,
                            next_row,
                            row_end,
                            schema,
                            edges,
                        )
                    )
                    for first, batch in source:
                        end = first + batch.num_rows
                        if end <= next_row:
                            continue  # already have these rows (resumed mid-chunk)
                        yield first, batch
                        next_row = end
                        progressed = True
                    if next_row >= row_end:
                        return
                except (ShardNotCached, CacheDirError) as exc:  # not here: try the others
                    errors[endpoint.text] = str(exc)
                except ChunkCorrupt as exc:
                    errors[endpoint.text] = str(exc)
                    self.stats[endpoint.text].failures += 1
                    if corrupt_retries == 0:
                        raise
                    corrupt_retries -= 1
                except grpc.RpcError as exc:
                    if exc.code() not in _FAILOVER_CODES:
                        raise
                    errors[endpoint.text] = _describe(exc)
                    self.stats[endpoint.text].failures += 1
                    self.stats[endpoint.text].last_error = errors[endpoint.text]
                    self.stats[
                        endpoint.text
                    ].rtt_ms = math.inf  # until the next probe says otherwise
                if next_row < row_end:
                    self.failovers += 1
                    (log.warning if attempt == 0 else log.debug)(
                        "%s@%s shard %d: %s failed (%s); continuing from row %d on the next node",
                        dataset,
                        version,
                        shard,
                        endpoint.text,
                        errors.get(endpoint.text),
                        next_row,
                    )
            if progressed:
                deadline = time.monotonic() + self.retry_timeout
            if time.monotonic() > deadline:
                raise AllNodesFailed(
                    _all_failed(f"reading {dataset}@{version} shard {shard}", errors)
                )
            time.sleep(min(0.1 * 2**attempt, 2.0))
            attempt += 1
            self.probe(pings=1)

    def _grpc_rows(
        self,
        endpoint: Endpoint,
        dataset: str,
        version: int,
        digest: str,
        shard: int,
        row_start: int,
        row_end: int,
        schema: pa.Schema | None,
        edges: EdgeChunks | None = None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        request = edge_pb2.ReadShardRequest(
            dataset=dataset,
            version=version,
            shard=shard,
            digest=digest,
            start_row=row_start,
            end_row=row_end,
        )
        call = self.read_shard_call(endpoint)(request, metadata=self._metadata)
        stream = _Stream(call)
        key = id(stream)
        with self._lock:
            self._active[key] = stream
        stats = self.stats[endpoint.text]
        expected: int | None = None  # where the next chunk must start
        try:
            for chunk in call:
                stream.last, stream.started = time.monotonic(), True
                stats.bytes += len(chunk.frame)
                header = read_header(chunk.frame)
                # The checksum covers the frame; the row numbers beside it are checked
                # for consistency, so a damaged first_row cannot misplace rows either.
                placed = (
                    chunk.first_row <= row_start < chunk.first_row + header.rows
                    if expected is None
                    else chunk.first_row == expected
                )
                if header.checksum != chunk.checksum or header.rows != chunk.rows or not placed:
                    raise ChunkCorrupt(
                        f"{dataset}@{version} shard {shard} chunk {chunk.index} from "
                        f"{endpoint.text}: checksum or row numbers differ from the frame's"
                    )
                first, frame = chunk.first_row, chunk.frame
                expected = end = first + header.rows
                if edges is None or not edges.across(shard, first, end, row_start, row_end):
                    yield first, decode_chunk(frame, schema)
                else:  # across an edge of this read: the read beside it needs it too
                    # Our own copy is verified once, here, whichever read decodes it.
                    verify_frame(frame)

                    def decode(frame: Buffer = frame) -> pa.RecordBatch:
                        return decode_chunk(frame, schema, verify=False)

                    batch = edges.decode(
                        (dataset, version, shard, first, header.rows, header.checksum),
                        header.rows,
                        min(end, row_end) - max(first, row_start),
                        decode,
                    )
                    yield first, batch
        finally:
            with self._lock:
                self._active.pop(key, None)
            call.cancel()

    def _local_rows(
        self,
        endpoint: Endpoint,
        dataset: str,
        version: int,
        shard: int,
        row_start: int,
        row_end: int,
        schema: pa.Schema | None,
        edges: EdgeChunks | None = None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        store = self.store(endpoint)
        with store.read_shard(ShardKey(dataset, version, shard)) as reader:
            first = 0
            for index, rows in enumerate(reader.info.chunk_rows):
                if first + rows > row_start and first < row_end:
                    view = reader.chunk(index)
                    self.stats[endpoint.text].bytes += len(view)
                    # Copy-free decode points into LMDB; the store keeps the snapshot alive
                    # while any of these batches are referenced.
                    if edges is None or not edges.across(
                        shard, first, first + rows, row_start, row_end
                    ):
                        yield first, decode_chunk(view, schema, verify=False)
                    else:  # across an edge of this read: the read beside it needs it too

                        def decode(view: Buffer = view) -> pa.RecordBatch:
                            return decode_chunk(view, schema, verify=False)

                        key = (dataset, version, shard, first, rows, reader.info.checksums[index])
                        taken = min(first + rows, row_end) - max(first, row_start)
                        yield first, edges.decode(key, rows, taken, decode)
                first += rows
                if first >= row_end:
                    break


_FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,  # our watchdog
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)


def _describe(exc: grpc.RpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


def _all_failed(what: str, errors: dict[str, str]) -> str:
    lines = "\n  ".join(f"{name}: {error}" for name, error in errors.items())
    return (
        f"{what} failed on every endpoint:\n  {lines}\n"
        "Check that the nodes run (edgecache status) and are reachable from this host."
    )
