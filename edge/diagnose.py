"""A node measuring its own paths: to origin (the registry's object store) and to peer nodes.

``edgecache doctor`` runs on a training host and sees the paths from there;
a slow link between a node and origin, or between two regions' nodes, is
found only from the node itself. For each path: the round trip, the
throughput of several parallel streams (one TCP stream rarely fills a long
path), and loss as TCP's retransmissions of what the node *sent* during the
test (:mod:`edgecache.cache.tcp_stats`): an upload of scratch objects to
origin (deleted after; skipped with a note where the node may not write) or
into a peer's ``Sink``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache import tcp_stats
from edgecache.cache.errors import EdgeCacheError
from edgecache.cache.storage import ObjectStore
from edgecache.edge.peers import Peers
from edgecache.v1 import edge_pb2

__all__ = ["diagnose_origin", "diagnose_peer"]

log = logging.getLogger(__name__)
_PART = 4 << 20  # bytes per request or message of the tests


async def _for(seconds: float, streams: int, one: object) -> tuple[int, float]:
    """Run ``one()`` (returning bytes moved) on ``streams`` tasks for ``seconds``."""
    deadline = time.monotonic() + seconds
    moved = 0

    async def loop() -> None:
        nonlocal moved
        while time.monotonic() < deadline:
            moved += await one()  # type: ignore[operator]

    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(streams)))
    return moved, time.monotonic() - started


def _endpoint(store: ObjectStore, url: str) -> str | None:
    """``host:port`` an object store's requests go to, or None for a local filesystem."""
    if not url.startswith("s3://"):
        return None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return f"s3.{region}.amazonaws.com:443"
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


async def diagnose_origin(
    store: ObjectStore, registry: str, sample_url: str | None, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """The path to the registry's object store: RTT, download rate, loss of an upload."""
    report = edge_pb2.PathReport(target="origin", streams=streams)
    endpoint = _endpoint(store, registry)
    if endpoint is None:
        report.note = f"{registry} is on a local filesystem: no network path to measure"
        return report
    if sample_url is None:
        report.note = "no object known to read: stage a version first"
    else:
        head = []
        for _ in range(3):
            started = time.perf_counter()
            info = await store.head(sample_url)
            head.append((time.perf_counter() - started) * 1e3)
        report.rtt_ms = min(head)  # a request's round trip, the server's work included
        size = info.size
        offsets = iter(range(0, 1 << 62, _PART))

        async def read() -> int:
            start = next(offsets) % max(size - 1, 1)
            end = min(start + _PART, size)
            return len(await store.get_range(sample_url, start, end))

        moved, elapsed = await _for(seconds / 2, streams, read)
        report.bytes_per_second = moved / elapsed if elapsed else 0.0
    scratch = f"{registry.rstrip('/')}/_diagnostics/{uuid.uuid4().hex}"
    payload = os.urandom(_PART)
    written: list[str] = []

    async def write() -> int:
        url = f"{scratch}/{len(written)}"
        written.append(url)
        await store.put(url, payload)
        return len(payload)

    before = tcp_stats.counters_to(endpoint)
    try:
        await _for(seconds / 2, streams, write)
    except EdgeCacheError as exc:
        report.note = (report.note + "; " if report.note else "") + (
            f"no loss figure: this node cannot write scratch objects to {registry} ({exc})"
        )
        return report
    finally:
        for url in written:
            try:
                await store.delete(url)
            except EdgeCacheError:
                log.warning("could not delete diagnostic object %s", url)
    change = tcp_stats.delta(before, tcp_stats.counters_to(endpoint))
    report.segments_sent, report.segments_retransmitted = change.segments_out, change.retransmitted
    if not tcp_stats.available():
        report.note = "no loss figure: `ss` (iproute2) is not installed on the node"
    return report


async def diagnose_peer(
    peers: Peers, peer: str, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """The path to another node: RTT of health checks, and an upload into its ``Sink``."""
    report = edge_pb2.PathReport(target=peer, streams=streams)
    channel = peers._channel(peer)  # noqa: SLF001 - the node's own channels and credentials
    health = health_pb2_grpc.HealthStub(channel)
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        samples.append((time.perf_counter() - started) * 1e3)
    samples.sort()
    report.rtt_ms = samples[len(samples) // 2]
    sink = channel.stream_unary(
        "/edgecache.v1.EdgeCache/Sink",
        request_serializer=edge_pb2.SinkChunk.SerializeToString,
        response_deserializer=edge_pb2.SinkReport.FromString,
    )
    chunk = edge_pb2.SinkChunk(data=os.urandom(512 << 10))  # under max_request_bytes
    deadline = time.monotonic() + seconds

    async def stream() -> int:
        async def chunks() -> AsyncIterator[edge_pb2.SinkChunk]:
            while time.monotonic() < deadline:
                yield chunk

        reply = await sink(chunks(), metadata=peers._metadata)  # noqa: SLF001
        return int(reply.bytes)

    target = peer.split("://", 1)[-1]
    before = tcp_stats.counters_to(target)
    started = time.monotonic()
    moved = sum(await asyncio.gather(*(stream() for _ in range(streams))))
    elapsed = time.monotonic() - started
    change = tcp_stats.delta(before, tcp_stats.counters_to(target))
    report.bytes_per_second = moved / elapsed if elapsed else 0.0
    report.segments_sent, report.segments_retransmitted = change.segments_out, change.retransmitted
    if not tcp_stats.available():
        report.note = "no loss figure: `ss` (iproute2) is not installed on the node"
    return report
