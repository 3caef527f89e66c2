"""A node measuring its own paths: to origin, to the registry and to peer nodes.

``edgecache doctor`` runs on a training host and sees the paths from there;
a slow link between a node and origin, or between two regions' nodes, is
found only from the node itself. For each path: the round trip, the
throughput of several parallel streams (one TCP stream rarely fills a long
path), and loss as TCP's retransmissions of what the node *sent* during the
test (:mod:`edgecache.cache.tcp_stats`): an upload of scratch objects to
origin or the registry (deleted after; skipped with a note where the node may
not write) or into a peer's ``Sink``.

Origin (where a version's shard data is, the manifests' ``source_url``) and
the registry (where its manifests are) are separate paths, often on other
schemes, endpoints or accounts (a ``file://`` registry beside an ``s3://``
origin): each is measured through the node's own store for it, so the
requests carry the credentials the node's fetches carry, and their retries
count in that path's metric.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache import tcp_stats
from edgecache.cache.errors import EdgeCacheError, ManifestError, ObjectNotFound
from edgecache.cache.sink_sizing import SINK_PART, smaller_part, too_large, too_many_streams
from edgecache.cache.storage import ObjectStore, Stores
from edgecache.edge.peers import Peers, check_peer, refuses_configuration, rpc_status
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = [
    "DIAGNOSE_SECONDS",
    "SINK_BYTES",
    "SINK_SECONDS",
    "PeerPathFailed",
    "diagnose_origin",
    "diagnose_peer",
    "diagnose_registry",
    "diagnose_seconds",
]

log = logging.getLogger(__name__)
_PART = 4 << 20  # bytes per request or message of the tests
# A node's Sink cuts a stream longer than SINK_SECONDS or larger than SINK_BYTES (a
# test is short; an endless one would tie up the node). A test of a peer runs at most
# DIAGNOSE_SECONDS, within SINK_SECONDS, and each stream stops short of SINK_BYTES.
SINK_SECONDS = 60.0
SINK_BYTES = 8 << 30
DIAGNOSE_SECONDS = 30.0


def diagnose_seconds(asked: float) -> float:
    """How long a Diagnose runs when ``asked`` (0: the default 4 s), within 0.5-30 s.

    ``ValueError`` for NaN, infinities and negative values: NaN passed every
    comparison as false, so a test of a peer never ended; infinity was clamped to
    the longest test, which the caller did not knowingly ask for.
    """
    if not math.isfinite(asked) or asked < 0:
        raise ValueError(
            f"seconds={asked} is not a test's length: give a number of seconds from 0.5 to "
            f"{DIAGNOSE_SECONDS:.0f} (0 or unset: 4)"
        )
    return min(max(asked or 4.0, 0.5), DIAGNOSE_SECONDS)


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


def _endpoint(url: str) -> str | None:
    """``host:port`` an S3 URL's requests go to, or None for any other store (no endpoint)."""
    if not url.startswith("s3://"):
        return None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return f"s3.{region}.amazonaws.com:443"
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def _no_path(url: str) -> str:
    """Why there is no network path to measure to a store at ``url``."""
    if url.startswith("file://") or "://" not in url:
        return f"{url} is on a local filesystem: no network path to measure"
    return f"{url} is not on S3: this node measures the network path to S3 endpoints only"


class PeerPathFailed(EdgeCacheError):
    """A test of this node's path to a peer failed; the message says where, why, what to do.

    ``final`` as in :class:`~edgecache.edge.peers.PeerCopyFailed`: the peer refused
    this node for its configuration (a token it does not accept, a TLS handshake
    that failed on certificates; ``peers.refuses_configuration``), so the test
    fails the same way until the setting the message names is fixed on this node.
    False for a peer that could not be reached, timed out or broke off.
    """

    def __init__(self, message: str, *, peer: str, code: str, final: bool) -> None:
        super().__init__(message)
        self.peer, self.code, self.final = peer, code, final


def _peer_failed(
    peers: Peers, peer: str, what: str, exc: grpc.RpcError, connected: bool
) -> PeerPathFailed:
    """The failure of ``what`` (a health check, the upload) in a test of the path to ``peer``.

    Worded as a Stage's note on the same peer is (``Peers.copy_shard``): gRPC's code
    and details of this node's own call to the peer, then what to set on this node
    (``Peers.hint``: peer_token_file, peer_tls_ca, a grpcs:// name). ``connected``:
    calls went through before (the connection, TLS or not, was right).
    """
    name, details = rpc_status(exc)
    hint = peers.hint(peer, name, details, int(connected))
    final = refuses_configuration(peer, name, details)
    message = (
        f"the path from this node to peer {peer} could not be tested: {what} failed "
        f"({name}: {details})"
    )
    if hint:
        message += f"; {hint}"
    if final:
        message += (
            f"; {peer} refused this node for its configuration: retrying cannot help until "
            "that setting is fixed on this node"
        )
    return PeerPathFailed(message, peer=peer, code=name, final=final)


def _too_many(exc: grpc.RpcError) -> bool:
    """Whether a call was refused for the peer's ``max_streams`` (concurrent calls)."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and too_many_streams(exc)


async def _sink_part(
    sink: grpc.aio.StreamUnaryMultiCallable, metadata: tuple[tuple[str, str], ...] | None
) -> int:
    """The message size a peer's Sink accepts: ``SINK_PART``, or less under its limit.

    One message is sent first; a peer whose ``max_request_bytes`` is lower
    refuses it naming its limit, and the upload is sized to fit. Raises the
    refusal when no size fits (or the call failed for another reason).
    """
    part = SINK_PART
    while True:
        try:
            await sink(_one(edge_pb2.SinkChunk(data=bytes(part))), metadata=metadata, timeout=10)
            return part
        except grpc.RpcError as exc:
            if (smaller := smaller_part(part, exc)) is None:
                raise
            part = smaller


async def _one(chunk: edge_pb2.SinkChunk) -> AsyncIterator[edge_pb2.SinkChunk]:
    yield chunk


def _with_limit(failed: PeerPathFailed, exc: grpc.RpcError) -> PeerPathFailed:
    """``failed``, naming the peer's setting that refused the upload when one did."""
    if too_large(exc):
        limit = "the peer's max_request_bytes is too low for an upload test"
    elif _too_many(exc):
        limit = (
            "the peer's max_streams (its limit on concurrent calls) was reached: test with "
            "fewer streams or when it is less busy, or raise its max_streams"
        )
    else:
        return failed
    return PeerPathFailed(
        f"{failed}; {limit}", peer=failed.peer, code=failed.code, final=failed.final
    )


def _add_note(report: edge_pb2.PathReport, note: str) -> None:
    report.note = (report.note + "; " if report.note else "") + note


async def _rtt(store: ObjectStore, url: str) -> tuple[float, int]:
    """The fastest of three HEADs of ``url`` in ms (the server's work included), and its size."""
    head = []
    for _ in range(3):
        started = time.perf_counter()
        info = await store.head(url)
        head.append((time.perf_counter() - started) * 1e3)
    return min(head), info.size


async def _upload(
    report: edge_pb2.PathReport,
    store: ObjectStore,
    base: str,
    endpoint: str,
    seconds: float,
    streams: int,
) -> float | None:
    """Upload scratch objects under ``base``/_diagnostics (deleted after): loss and rate.

    Sets the report's segments (TCP's loss of the upload) and returns the upload's
    bytes per second, or None when the node may not write there (a note says so).

    A key part starting with ``_`` is never a shard to a publisher
    (:meth:`~edgecache.cache.registry.Registry.list_sources`), so an object left
    behind by a failed delete is not published with a dataset under ``base``.
    """
    scratch = f"{base.rstrip('/')}/_diagnostics/{uuid.uuid4().hex}"
    payload = os.urandom(_PART)
    written: list[str] = []

    async def write() -> int:
        url = f"{scratch}/{len(written)}"
        written.append(url)
        await store.put(url, payload)
        return len(payload)

    watch = tcp_stats.Watch(endpoint)
    try:
        with watch:
            moved, elapsed = await _for(seconds, streams, write)
    except EdgeCacheError as exc:
        why = f"this node cannot write scratch objects to {base} ({exc})"
        _add_note(report, f"no loss figure: {why}")
        return None
    finally:
        for url in written:
            try:
                await store.delete(url)
            except EdgeCacheError:
                log.warning("could not delete diagnostic object %s", url)
    change = watch.delta()  # the upload's alone: the deletes are small requests
    report.segments_sent, report.segments_retransmitted = change.segments_out, change.retransmitted
    if not tcp_stats.available():
        _add_note(report, "no loss figure: `ss` (iproute2) is not installed on the node")
    return moved / elapsed if elapsed else None


async def diagnose_origin(
    stores: Stores, sample: tuple[str, str] | None, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """The path to origin, where shard data comes from: RTT, download rate, loss of an upload.

    ``stores`` are the ones this node fetches shard data through (``EdgeNode.stores``:
    origin's clients and credentials, their retries counted as origin's); ``sample``
    is (the source prefix of a version this node holds, the URL of an object
    under it), or None when the node holds no version: origin is known only from
    a version's manifest. Scratch objects go under the prefix's ``_diagnostics/``.
    """
    report = edge_pb2.PathReport(target="origin", streams=streams)
    if sample is None:
        report.note = "no object known to read: stage a version first"
        return report
    origin, sample_url = sample
    endpoint = _endpoint(sample_url)
    if endpoint is None:
        report.note = _no_path(origin)
        return report
    store = stores.for_url(sample_url)
    report.rtt_ms, size = await _rtt(store, sample_url)
    offsets = iter(range(0, 1 << 62, _PART))

    async def read() -> int:
        start = next(offsets) % max(size - 1, 1)
        end = min(start + _PART, size)
        return len(await store.get_range(sample_url, start, end))

    moved, elapsed = await _for(seconds / 2, streams, read)
    report.bytes_per_second = moved / elapsed if elapsed else 0.0
    await _upload(report, store, origin, endpoint, seconds / 2, streams)  # its loss; the rate: read
    return report


async def diagnose_registry(
    stores: Stores, registry: str, manifest_url: str | None, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """The path to the registry (manifests, version lists): RTT, an upload's rate and loss.

    ``stores`` are the registry's own (``EdgeNode.registry_stores``, their retries
    counted as the registry's); ``manifest_url`` a manifest of a version this
    node holds, for the round trip. The rate (``bytes_per_second``) is the
    upload's: scratch objects of ``_PART`` bytes on ``streams`` streams, large
    enough to measure the path, as a peer's is its upload. No read rate: the
    registry holds small objects, whose reads measure request round trips, not
    the path's rate.
    """
    report = edge_pb2.PathReport(target="registry", streams=streams)
    endpoint = _endpoint(registry)
    if endpoint is None:
        report.note = _no_path(registry)
        return report
    store = stores.for_url(registry)
    if manifest_url is None:
        report.note = "no manifest known to time a request with: stage a version first"
    else:
        try:
            report.rtt_ms, _ = await _rtt(store, manifest_url)
        except ObjectNotFound as exc:
            # Said as a note, the path read "ok" in the doctor's table with exit 0, though
            # the node cannot find in its registry a version it holds.
            raise ManifestError(
                f"this node's registry {registry} has no {manifest_url}, the manifest of a "
                "version the node holds: its registry setting names another registry than "
                "the one it staged from (moved?), or the version was removed from it; check "
                f"the node's registry setting ({exc})"
            ) from exc
    if (rate := await _upload(report, store, registry, endpoint, seconds, streams)) is not None:
        report.bytes_per_second = rate
    return report


async def diagnose_peer(
    peers: Peers, peer: str, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """The path to another node: RTT of health checks, and an upload into its ``Sink``.

    :class:`PeerPathFailed` when the peer cannot be reached or refuses this node;
    ``ValueError`` for a target that is no address (see :func:`~edgecache.edge.peers.check_peer`).
    The channel is closed after the test unless a Stage uses it too: a node asked to
    test many targets kept one open for each until it stopped.
    """
    if ":" not in peer:
        # A word, not an address: a target this node does not know (one a newer doctor
        # asks for, or a typo). Dialling it as a host only said "internal error".
        raise ValueError(
            f"{peer!r} is not a Diagnose target this node knows: 'origin', 'registry' or a "
            "peer node's address (host:port, grpcs://host:port)"
        )
    check_peer(peer)  # before anything is dialled: ValueError naming what is wrong
    async with peers.channel(peer, keep=False) as channel:
        return await _test_peer(peers, peer, channel, seconds, streams)


async def _test_peer(
    peers: Peers, peer: str, channel: grpc.aio.Channel, seconds: float, streams: int
) -> edge_pb2.PathReport:
    """:func:`diagnose_peer` over ``channel``."""
    report = edge_pb2.PathReport(target=peer, streams=streams)
    health = health_pb2_grpc.HealthStub(channel)
    samples: list[float] = []
    for _ in range(5):
        started = time.perf_counter()
        try:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise _peer_failed(peers, peer, "a health check", exc, bool(samples)) from exc
        samples.append((time.perf_counter() - started) * 1e3)
    samples.sort()
    report.rtt_ms = samples[len(samples) // 2]
    # A peer refusing this node's token aborts the Sink while this side still streams,
    # and the call then ended INTERNAL ("Internal error from Core") about as often as
    # with the peer's UNAUTHENTICATED: a refusal read as an outage. One unary call with
    # the same metadata first hears the refusal as the peer words it.
    try:
        await edge_pb2_grpc.EdgeCacheStub(channel).Status(
            edge_pb2.StatusRequest(),
            metadata=peers._metadata,  # noqa: SLF001 - the node's own token for peers
            timeout=5,
        )
    except grpc.RpcError as exc:
        raise _peer_failed(peers, peer, "a call with this node's token", exc, True) from exc
    sink = channel.stream_unary(
        "/edgecache.v1.EdgeCache/Sink",
        request_serializer=edge_pb2.SinkChunk.SerializeToString,
        response_deserializer=edge_pb2.SinkReport.FromString,
    )
    try:
        part = await _sink_part(sink, peers._metadata)  # noqa: SLF001
    except grpc.RpcError as exc:
        raise _with_limit(
            _peer_failed(peers, peer, "the upload into its Sink", exc, True), exc
        ) from exc
    chunk = edge_pb2.SinkChunk(data=os.urandom(part))
    deadline = time.monotonic() + seconds
    capped = 0  # streams that stopped at SINK_BYTES before the time was up

    async def stream() -> int:
        async def chunks() -> AsyncIterator[edge_pb2.SinkChunk]:
            nonlocal capped
            sent = 0
            while time.monotonic() < deadline:
                if sent + part > SINK_BYTES:
                    # The peer cuts a Sink past SINK_BYTES (RESOURCE_EXHAUSTED, or INTERNAL
                    # when the cut races this side's sending): a fast link filled it in
                    # under the test's time, and its rate is measured on what was sent.
                    capped += 1
                    return
                sent += part
                yield chunk

        reply = await sink(chunks(), metadata=peers._metadata, timeout=seconds + 30)  # noqa: SLF001
        return int(reply.bytes)

    target = peer.split("://", 1)[-1]
    with tcp_stats.Watch(target) as watch:
        started = time.monotonic()
        results = await asyncio.gather(*(stream() for _ in range(streams)), return_exceptions=True)
        elapsed = time.monotonic() - started
    accepted = sum(isinstance(r, int) for r in results)
    refused: tuple[str, str] | None = None  # a refused stream's status: (code name, details)
    for result in results:
        if isinstance(result, grpc.RpcError):
            # A call over the peer's max_streams is refused at once; racing this side's
            # first message, the refusal can arrive as INTERNAL. Measured on the others.
            if accepted and (_too_many(result) or result.code() == grpc.StatusCode.INTERNAL):
                refused = refused or rpc_status(result)
                continue
            raise _with_limit(
                _peer_failed(peers, peer, "the upload into its Sink", result, True), result
            ) from result
        if isinstance(result, BaseException):
            raise result
    if refused is not None:
        report.streams = accepted
        _add_note(
            report,
            f"{accepted} of {streams} upload streams were accepted by {peer}, and the upload "
            f"measured on them; the others were refused ({': '.join(refused)}): a node "
            "refuses the calls beyond its max_streams",
        )
    if capped:
        _add_note(
            report,
            f"{capped} upload streams stopped at {SINK_BYTES >> 30} GiB, the most a node's "
            "Sink takes in one call, before the time was up: measured on what they sent",
        )
    moved = sum(r for r in results if isinstance(r, int))
    change = watch.delta()
    report.bytes_per_second = moved / elapsed if elapsed else 0.0
    report.segments_sent, report.segments_retransmitted = change.segments_out, change.retransmitted
    if not tcp_stats.available():
        report.note = "no loss figure: `ss` (iproute2) is not installed on the node"
    return report
