"""The ``edgecache.v1.EdgeCache`` gRPC service: thin handlers over :class:`EdgeNode`.

Every handler validates its request, delegates, and lets :func:`status_for`
turn edgecache's exceptions into gRPC status codes in this one place, with a
message a person can act on. ``ReadShard`` yields pre-encoded wire bytes (see
:mod:`edgecache.cache.wire`), so its handler is registered with a pass-through
serializer instead of the generated one.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from edgecache.cache.errors import (
    CacheFull,
    ChunkCorrupt,
    ChunkTooLarge,
    CodecError,
    EdgeCacheError,
    EmptyShard,
    InvalidName,
    MalformedShard,
    ManifestError,
    ObjectNotFound,
    OriginChanged,
    OriginError,
    PinChanged,
    SchemaMismatch,
    ShardNotCached,
    StaleDigest,
    StoreError,
    UnknownTransform,
    VersionNotFound,
    causes,
)
from edgecache.cache.store import PIN_LATEST
from edgecache.cache.store_files import damaged_cache, lmdb_damage
from edgecache.edge.diagnose import (
    SINK_BYTES,
    SINK_SECONDS,
    PeerPathFailed,
    diagnose_origin,
    diagnose_peer,
    diagnose_registry,
    diagnose_seconds,
)
from edgecache.edge.node import EdgeNode, NodeDraining, StagedShard
from edgecache.edge.peers import PeerCopyFailed, check_peer
from edgecache.v1 import edge_pb2, manifest_pb2

__all__ = [
    "SERVICE_NAME",
    "EdgeCacheService",
    "TokenAuthInterceptor",
    "status_for",
]

log = logging.getLogger(__name__)
SERVICE_NAME = edge_pb2.DESCRIPTOR.services_by_name["EdgeCache"].full_name
ADMIN_METHODS = frozenset({"Stage", "Evict", "Pin", "Diagnose"})
DIAGNOSE_STREAMS = 16  # SINK_SECONDS, SINK_BYTES: a Sink's limits (see edge/diagnose.py)
Req = TypeVar("Req")


# A deadline reaches the node as the time left when the request arrives, so the client's
# own clock runs out first and its cancel arrives with that delay still "left" here: under
# load a second or more (a fresh-clone run counted such a read CANCELLED).
DEADLINE_SLACK_S = 1.0


def _abandoned(context: aio.ServicerContext) -> str:
    """The result of a call its client gave up on: its deadline passed, or it cancelled.

    A cancel with less than DEADLINE_SLACK_S of the deadline left is the deadline.
    """
    left = context.time_remaining()
    expired = left is not None and left <= DEADLINE_SLACK_S
    return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name


# The first-chunk result of a cached_only read of a shard this node does not hold. Peer
# copies ask the shard's rendezvous owner first and go on to the next node on this answer:
# a normal miss, not a failure of this node, so not a status code that alerts count.
NOT_CACHED = "not_cached"
STALE_DIGEST = "stale_digest"  # the reader's digest is not the version's here: its to fix


def _read_result(exc: BaseException, cached_only: bool) -> str:
    """A read's first-chunk result label for an error: its status code, or ``not_cached``."""
    if cached_only and isinstance(exc, _NotHere | ShardNotCached):
        return NOT_CACHED
    if isinstance(exc, StaleDigest):
        return STALE_DIGEST
    return status_for(exc)[0].name


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception raised while handling a request."""
    message = str(exc)
    if (damage := lmdb_damage(exc)) is not None:
        # Not INTERNAL ("see the node's log"): the cache file is damaged where the node
        # cannot drop and fetch the entry again, so retrying this node will not help.
        return grpc.StatusCode.DATA_LOSS, damaged_cache(damage)
    if isinstance(exc, _StageIncomplete):
        return exc.code, message
    match exc:
        case _NotHere():
            return grpc.StatusCode.FAILED_PRECONDITION, message
        case PeerCopyFailed() | PeerPathFailed() if exc.final:
            # Every peer asked answered that it does not hold the shard, or refused this
            # node for its configuration (its token, or a TLS handshake that failed on
            # certificates: see peers.refuses_configuration), with peers_only: no retry
            # helps until the version is staged on one of them or the setting the message
            # names is fixed. Not UNAUTHENTICATED for a refused token: that code says the
            # *caller's* credentials are wrong, and the caller's token was accepted;
            # clients would tell the operator to fix their --token-file. The state this
            # Stage needs (this node's settings toward its peers) is missing: that is
            # FAILED_PRECONDITION, which clients do not retry and readers do not take
            # for a node that is down. A Diagnose of a peer that refuses this node is the
            # same: its test fails until that setting is fixed.
            return grpc.StatusCode.FAILED_PRECONDITION, message
        case PeerCopyFailed() | PeerPathFailed():
            # A peer could not be reached, broke off, timed out or was too slow: this node
            # works and the message names the peer; asking again may work.
            return grpc.StatusCode.UNAVAILABLE, message
        case NodeDraining():
            # The node is going away (SIGTERM): another node, or this one once it is
            # back, does the work; retrying is right.
            return grpc.StatusCode.UNAVAILABLE, message
        case InvalidName() | IndexError():
            return grpc.StatusCode.INVALID_ARGUMENT, message
        case VersionNotFound():
            return grpc.StatusCode.NOT_FOUND, message
        case CacheFull():
            return grpc.StatusCode.RESOURCE_EXHAUSTED, message
        case OriginChanged() | MalformedShard() | UnknownTransform() | ManifestError():
            return grpc.StatusCode.FAILED_PRECONDITION, message
        case PinChanged():
            # A conditional Pin (if_until) or Evict (unless_pinned_after) found another
            # pin than the caller's status read: gRPC's code for a failed test-and-set,
            # after which the caller reads the state again.
            return grpc.StatusCode.ABORTED, message
        case ObjectNotFound() if _s3_code(exc) == "NoSuchBucket":
            # The publisher listed this bucket: most often this node asks another endpoint.
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{message}; give the node the S3 endpoint and account the version was "
                "published from (AWS_ENDPOINT_URL, credentials), or, if the bucket was "
                "deleted, restore it or publish a new version",
            )
        case ObjectNotFound():
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{message}; origin lost an object of a published version — restore it or "
                "publish a new version",
            )
        case OriginError() if (advice := _origin_refusal(exc)) is not None:
            # The node works; origin said no in a way retrying cannot change. UNAVAILABLE
            # would send the caller to check the node and retry it, in vain.
            return grpc.StatusCode.FAILED_PRECONDITION, f"{message}; {advice}"
        case OriginError():  # timeouts, connection refused, throttling, 5xx: worth retrying
            return grpc.StatusCode.UNAVAILABLE, message
        case ChunkCorrupt() | ShardNotCached():
            # Stored damage (any way a frame can be wrong, its length fields included):
            # the node dropped the entry and fetches it again; the client retries or
            # fails over meanwhile. Never FAILED_PRECONDITION, which clients do not retry.
            return grpc.StatusCode.UNAVAILABLE, message
        case SchemaMismatch() | EmptyShard() | ChunkTooLarge():
            # Origin's rows do not fit the version (found while encoding a fetched shard).
            return grpc.StatusCode.FAILED_PRECONDITION, message
        case CodecError():
            return grpc.StatusCode.UNAVAILABLE, message
        case StoreError():
            return grpc.StatusCode.INTERNAL, f"cache store error: {message}"
        case ValueError():
            return grpc.StatusCode.INVALID_ARGUMENT, message
    return grpc.StatusCode.INTERNAL, "internal error; see the node's log"


# What an origin store's error may stand on that no retry changes: no permission, a
# folder or file where the other was expected, a URL no filesystem serves (fsspec's
# ValueError "Protocol not known"), a filesystem whose package is not installed.
_REFUSALS = (PermissionError, IsADirectoryError, NotADirectoryError, ValueError, ImportError)
_ACCESS_ADVICE = (
    "the node cannot read this from origin as things are: fix access (permissions, the "
    "node's credentials) or publish the version again from a source URL the node can read"
)
# S3 error codes (botocore ``ClientError.response["Error"]["Code"]``) decide before the
# HTTP status does: S3 sends some transient errors with a 4xx status (RequestTimeout is
# a 400, OperationAborted a 409), which the status band alone would call refusals.
# Refused: the account, credentials, bucket or object say no until someone changes them.
_S3_REFUSED = {
    code: _ACCESS_ADVICE
    for code in (
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidBucketName",
        "InvalidObjectState",  # archived (Glacier): needs a restore first
        "InvalidToken",
        # The S3 store raises ObjectNotFound for this (and NoSuchKey) already, which is
        # FAILED_PRECONDITION too; listed so a wrapped one can never read as transient.
        "NoSuchBucket",
        "SignatureDoesNotMatch",
    )
} | {
    # This node's clock is off: every request it signs is refused until its clock is
    # fixed, while other nodes (with good clocks) read the same object fine.
    "RequestTimeTooSkewed": "this node's clock is too far from origin's for S3 to accept its "
    "signed requests: synchronise the node's clock (NTP); other nodes can serve meanwhile",
}
# Transient whatever their HTTP status: a timeout, a conflicting operation in flight,
# throttling, origin's own failures.
_S3_TRANSIENT = frozenset(
    {
        "RequestTimeout",
        "RequestTimeoutException",
        "OperationAborted",
        "PriorRequestNotComplete",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "BandwidthLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
    }
)


def _s3_error(exc: BaseException) -> tuple[str, dict[str, Any]] | None:
    """The S3 error code and response of a botocore ``ClientError``; ``None`` for any other."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return str(response.get("Error", {}).get("Code", "")), response


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code (``ClientError.response["Error"]["Code"]``) an error stands on."""
    for cause in causes(exc):
        if (error := _s3_error(cause)) is not None:
            return error[0]
    return None


def _origin_refusal(exc: OriginError) -> str | None:
    """What to do about an origin failure no retry can fix; ``None`` if it is transient.

    The stores raise :class:`OriginError` ``from`` what they saw. A refusal
    (FAILED_PRECONDITION) sends readers to the next node without retrying this
    one, so only what retrying cannot change may be one: a permission or path
    error, or an S3 ``ClientError`` whose error code says so (see
    ``_S3_REFUSED``/``_S3_TRANSIENT``). An S3 code named in neither falls back
    to the HTTP status: 4xx but a timeout (408) or throttling (429) is a
    refusal, 5xx is transient. Timeouts and refused connections stay
    UNAVAILABLE.
    """
    for cause in causes(exc):
        if isinstance(cause, _REFUSALS):
            return _ACCESS_ADVICE
        if (error := _s3_error(cause)) is None:
            continue
        code, response = error
        if code in _S3_REFUSED:
            return _S3_REFUSED[code]
        if code in _S3_TRANSIENT:
            return None
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            return _ACCESS_ADVICE
    return None


def _log_failure(method: str, exc: BaseException, code: grpc.StatusCode) -> None:
    if code == grpc.StatusCode.INTERNAL:
        log.exception("[EdgeCache.%s] failed", method, exc_info=exc)
    else:
        log.info("[EdgeCache.%s] %s: %s", method, code.name, exc)


class _Malformed:
    """A request body that is not the method's message: answered INVALID_ARGUMENT.

    gRPC's own handling of a deserializer's error is UNKNOWN, naming a Python
    class; the handler says what was wrong instead.
    """

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message = (
            f"the request is not a valid {message_type} message ({error}); send one built "
            "from proto/edgecache/v1 (grpcurl -proto, or reflection), or use the edgecache client"
        )


def _parser(message_type: Any) -> Callable[[bytes], Any]:
    """``message_type.FromString``, returning :class:`_Malformed` where it raises."""

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return _Malformed(message_type.DESCRIPTOR.full_name, exc)

    return parse


def _without_secrets(service: Any, message: str) -> str:
    """``message`` with the node's registry URL as ``Status`` shows it: no credentials.

    The registry's own errors (a version not found, the registry unreachable)
    name the URL as configured, ``user:password@`` and a signed query included,
    and a status's details go to any client allowed to call.
    """
    node = getattr(service, "node", None)
    return node.versions.without_secrets(message) if node is not None else message


def _unary(
    fn: Callable[[Any, Req, aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, Req, aio.ServicerContext], Awaitable[Any]]:
    """Map exceptions of a unary handler to a status (abort stays outside the try)."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: aio.ServicerContext) -> Any:
        try:
            if isinstance(request, _Malformed):
                raise ValueError(request.message)
            return await fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            code, message = status_for(exc)
            _log_failure(fn.__name__, exc, code)
        await _say_damage(self, code, message)
        await context.abort(code, _without_secrets(self, message))

    return handler


async def _say_damage(service: Any, code: grpc.StatusCode, message: str) -> None:
    """A DATA_LOSS answer means the node's cache is damaged: the node stops serving."""
    node = getattr(service, "node", None)
    if code == grpc.StatusCode.DATA_LOSS and node is not None:
        await node.cache_damaged(message)


def _streaming(
    fn: Callable[[Any, Req, aio.ServicerContext], AsyncIterator[Any]],
) -> Callable[[Any, Req, aio.ServicerContext], AsyncIterator[Any]]:
    """The same for server-streaming handlers: items already sent stay sent."""

    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if isinstance(request, _Malformed):
                raise ValueError(request.message)
            async for item in fn(self, request, context):
                yield item
            return
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            code, message = status_for(exc)
            _log_failure(fn.__name__, exc, code)
        await _say_damage(self, code, message)
        await context.abort(code, _without_secrets(self, message))

    return handler


class EdgeCacheService:
    """Handlers of ``edgecache.v1.EdgeCache``."""

    def __init__(self, node: EdgeNode) -> None:
        self.node = node

    @_unary
    async def ResolveVersion(  # noqa: N802 - gRPC method names are PascalCase
        self, request: edge_pb2.ResolveVersionRequest, context: aio.ServicerContext
    ) -> edge_pb2.ResolveVersionResponse:
        """Pin latest (or check N): version number, digest, shard count."""
        manifest = await self.node.versions.resolve(request.dataset, request.version)
        return edge_pb2.ResolveVersionResponse(
            dataset=manifest.dataset,
            version=manifest.version,
            digest=manifest.digest,
            shard_count=len(manifest.shards),
        )

    @_unary
    async def GetManifest(  # noqa: N802
        self, request: edge_pb2.GetManifestRequest, context: aio.ServicerContext
    ) -> manifest_pb2.Manifest:
        """The version's manifest, checked against the registry (this node's copy if it is away)."""
        return await self.node.versions.manifest_to_pin(request.dataset, request.version)

    @_streaming
    async def ReadShard(  # noqa: N802
        self, request: edge_pb2.ReadShardRequest, context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Stream a shard's stored chunks from start_chunk, fetching it on a miss."""
        node = self.node
        began = time.monotonic()
        try:
            manifest = await node.versions.manifest_as_read(
                request.dataset, request.version, request.digest
            )
            if request.cached_only:
                key = node.shard_ref(manifest, request.shard)
                if not node.store.contains(key):
                    raise _NotHere(
                        f"{key} is not cached on {node.node_id} and cached_only was asked"
                    )
        except Exception as exc:  # refused before a stream began: still a read's result
            node.metrics.read_ended(
                _read_result(exc, request.cached_only), before_first_chunk=time.monotonic() - began
            )
            raise
        except (asyncio.CancelledError, GeneratorExit):
            node.metrics.read_ended(
                _abandoned(context), before_first_chunk=time.monotonic() - began
            )
            raise
        node.metrics.active_streams.inc()
        # Staging yields to training reads. A cached_only read is another node's staging
        # (a peer copy) or a probe, not a training read: counting it slowed this node's
        # own staging to one shard at a time whenever a peer region copied from it.
        training = not request.cached_only
        if training:
            await node.gate.read_started()
        last, first = began, True  # the first chunk is timed from the request
        try:
            async for encoded in node.read_chunks(
                manifest,
                request.shard,
                request.start_chunk,
                request.start_row,
                request.end_row,
                cached_only=request.cached_only,
            ):
                now = time.monotonic()
                if first:
                    node.metrics.first_chunk(now - last, "ok")
                    first = False
                else:
                    node.metrics.next_chunk(now - last)
                yield encoded
                last = time.monotonic()
            node.metrics.read_ended("ok")
        except Exception as exc:
            # After the first chunk too: a stream that fails midway (its refetch failed, a
            # chunk was damaged again) is a failed read, which the first-chunk histogram,
            # recorded at the first chunk as ok, cannot say.
            unsent = time.monotonic() - began if first else None
            node.metrics.read_ended(
                _read_result(exc, request.cached_only), before_first_chunk=unsent
            )
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The reader left (or its deadline passed) before its first chunk, typically
            # while a miss was fetched: the slowest reads, which were missing from the
            # first-chunk histogram (BaseExceptions: ``except Exception`` let them by).
            unsent = time.monotonic() - began if first else None
            node.metrics.read_ended(_abandoned(context), before_first_chunk=unsent)
            raise
        finally:
            if training:
                await node.gate.read_finished()
            node.metrics.active_streams.dec()

    @_streaming
    async def Stage(  # noqa: N802
        self, request: edge_pb2.StageRequest, context: aio.ServicerContext
    ) -> AsyncIterator[edge_pb2.StageProgress]:
        """Fetch a version's missing shards in the background, streaming progress."""
        began = time.monotonic()
        try:
            async for progress in self._stage(request):
                yield progress
        except Exception as exc:
            self.node.metrics.stage_done(time.monotonic() - began, status_for(exc)[0].name)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The caller cancelled, or its deadline passed: gRPC cancels the handler
            # (BaseExceptions, which ``except Exception`` let by, unrecorded).
            self.node.metrics.stage_done(time.monotonic() - began, _abandoned(context))
            raise
        self.node.metrics.stage_done(time.monotonic() - began, "ok")

    async def _stage(self, request: edge_pb2.StageRequest) -> AsyncIterator[edge_pb2.StageProgress]:
        _check_peers(request)
        # Checked against the registry as a reader's pin is: a copy kept from before a
        # registry reset made Stage say "held already" of the old content.
        manifest = await self.node.versions.manifest_to_pin(request.dataset, request.version)
        pin = _pin_time(request, "pin_until")
        wanted = self.node.staging_targets(manifest, list(request.shards))
        progress = edge_pb2.StageProgress(
            shards_total=len(wanted),
            bytes_total=sum(manifest.shards[s].source_size for s in wanted),
        )
        started = time.monotonic()
        failures: list[tuple[int, str, grpc.StatusCode]] = []
        skipped: set[int] = set()  # shards counted skipped (done already), in case revoked
        staged: set[int] = set()  # shards this call reports staged (done), in case revoked
        try:
            async for outcome in self.node.stage(
                manifest, wanted, pin, peers=list(request.peers), peers_only=request.peers_only
            ):
                self._count(outcome, progress, failures, skipped, staged, started)
                if failures and failures[-1][2] == grpc.StatusCode.DATA_LOSS:
                    await self.node.cache_damaged(failures[-1][1])
                yield progress
        except NodeDraining as exc:
            raise _drained(exc, manifest, progress, failures, staged) from exc
        progress.finished = True
        yield progress
        if failures:
            # Progress went out; the status says the stage is incomplete and why.
            shard, error, code = stage_failure(failures)
            raise _StageIncomplete(
                f"{progress.shards_failed} of {progress.shards_total} shards of "
                f"{manifest.dataset}@{manifest.version} failed; shard {shard}: {error}",
                code=code,
            )

    @staticmethod
    def _count(
        outcome: StagedShard,
        progress: edge_pb2.StageProgress,
        failures: list[tuple[int, str, grpc.StatusCode]],
        skipped: set[int],
        staged: set[int],
        started: float,
    ) -> None:
        """Add one shard's outcome to a Stage's progress (and its failures)."""
        progress.notes.extend(outcome.notes)
        said = set(progress.peers_refused)
        progress.peers_refused.extend(p for p in outcome.peers_refused if p not in said)
        progress.peer_bytes_done += outcome.peer_bytes
        if outcome.error is not None:
            code, why = status_for(outcome.error)  # why: the error and what to do
            progress.shards_failed += 1
            if outcome.revoked:  # counted as done before it was evicted
                progress.shards_done -= 1
                staged.discard(outcome.shard)
                if outcome.shard in skipped:  # skipped counts a subset of done
                    progress.shards_skipped -= 1
            progress.failures.add(shard=outcome.shard, message=why, code=code.name)
            failures.append((outcome.shard, why, code))
        else:
            progress.shards_done += 1
            staged.add(outcome.shard)
            if outcome.fetched and not outcome.joined and outcome.source == "origin":
                progress.bytes_done += outcome.source_bytes
            elif outcome.fetched and not outcome.joined:
                pass  # copied from a peer: peer_bytes_done
            else:  # resident already, or fetched by another request this one waited on
                progress.shards_skipped += 1
                skipped.add(outcome.shard)
        progress.bytes_per_second = progress.bytes_done / max(time.monotonic() - started, 1e-9)

    @_unary
    async def Evict(  # noqa: N802
        self, request: edge_pb2.EvictRequest, context: aio.ServicerContext
    ) -> edge_pb2.EvictResponse:
        """Drop a version's shards and pin from this node (unless pinned past a time)."""
        unless = _pin_time(request, "unless_pinned_after")
        return edge_pb2.EvictResponse(
            bytes_freed=await self.node.evict(request.dataset, request.version, unless)
        )

    @_unary
    async def Pin(  # noqa: N802
        self, request: edge_pb2.PinRequest, context: aio.ServicerContext
    ) -> edge_pb2.PinResponse:
        """Keep a version from eviction until a time (unset: unpin), cached or not yet."""
        until, if_until = _pin_time(request, "until"), _pin_time(request, "if_until")
        if request.extend and (until is None or if_until is not None):
            raise ValueError("extend needs until, and does not go with if_until")
        self.node.shard_ref(await self.node.versions.manifest(request.dataset, request.version), 0)
        if request.extend and until is not None:
            await self.node.extend_pin(request.dataset, request.version, until)
        else:
            await self.node.pin(request.dataset, request.version, until, if_until)
        return edge_pb2.PinResponse()

    async def Sink(  # noqa: N802
        self, requests: AsyncIterator[edge_pb2.SinkChunk], context: aio.ServicerContext
    ) -> edge_pb2.SinkReport:
        """Receive and drop a client's upload test (the sender measures its own loss).

        Cut at SINK_SECONDS whether or not anything arrives: the limit was checked
        only when a message came, so an idle Sink held one of ``max_streams`` slots
        for as long as its caller liked (every slot, on a node without a read token).
        """
        received, started = 0, time.monotonic()
        limited = (
            f"a Sink test is limited to {SINK_SECONDS:.0f} s and "
            f"{SINK_BYTES >> 30} GiB; run shorter tests"
        )
        try:
            async with asyncio.timeout(SINK_SECONDS):
                async for chunk in requests:
                    if isinstance(chunk, _Malformed):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, chunk.message)
                    received += len(chunk.data)
                    if received > SINK_BYTES:
                        break
                else:
                    return edge_pb2.SinkReport(bytes=received, seconds=time.monotonic() - started)
        except TimeoutError:
            pass
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, limited)
        raise AssertionError("unreachable: abort raises")  # for type checkers

    @_unary
    async def Diagnose(  # noqa: N802
        self, request: edge_pb2.DiagnoseRequest, context: aio.ServicerContext
    ) -> edge_pb2.PathReport:
        """Measure this node's path to origin, the registry or a peer (see edge/diagnose.py).

        Origin through the stores shard data is fetched with, the registry through
        its own: each with its own client and credentials, and retries counted in
        its own metric (``edgecache_origin_retries_total``,
        ``edgecache_registry_retries_total``).
        """
        report = await self._path_report(request)
        # A note may name the registry: without the user:password@ its URL may hold, as
        # Status shows it (any caller reads a report), as the errors' details are.
        report.note = _without_secrets(self, report.note)
        return report

    async def _path_report(self, request: edge_pb2.DiagnoseRequest) -> edge_pb2.PathReport:
        seconds = diagnose_seconds(request.seconds)
        streams = min(max(request.streams or 4, 1), DIAGNOSE_STREAMS)
        node = self.node
        if request.target in ("", "origin", "registry"):
            held = _held_manifests(node)
            try:
                if request.target == "registry":
                    url = node.registry.url
                    first = held[0] if held else None
                    return await diagnose_registry(
                        node.registry_stores,
                        url,
                        node.registry.version_url(first.dataset, first.version) if first else None,
                        seconds,
                        streams,
                    )
                sample = _sample_object(held)
                return await diagnose_origin(node.stores, sample, seconds, streams)
            finally:
                node.count_retries()
        return await diagnose_peer(node.peers, request.target, seconds, streams)

    @_unary
    async def Status(  # noqa: N802
        self, request: edge_pb2.StatusRequest, context: aio.ServicerContext
    ) -> edge_pb2.NodeStatus:
        """Capacity, contents and counters of this node."""
        return self.node.status()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers for the server; ReadShard's responses are already bytes."""
        methods = edge_pb2.DESCRIPTOR.services_by_name["EdgeCache"].methods_by_name
        handlers = {}
        for name, method in methods.items():
            request_type = _message_class(method.input_type.full_name)
            response_type = _message_class(method.output_type.full_name)
            serializer = None if name == "ReadShard" else response_type.SerializeToString
            make = {
                (False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
            }[(method.client_streaming, method.server_streaming)]
            handlers[name] = make(
                getattr(self, name),
                request_deserializer=_parser(request_type),
                response_serializer=serializer,
            )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _pin_time(request: Message, field: str) -> datetime | None:
    """A request's pin time in ``field`` (None when unset), or ``ValueError`` naming the range.

    The cache keeps a pin as int64 nanoseconds since 1970: a later time failed
    with a bare "Value out of range: 9300000000000000000", and one before 1970
    was stored negative. Refused, not clamped to the limit: a caller that asked
    for the year 9999 meant "for ever", which no pin says, and should be told.
    A time in the past is accepted (the controller rehearses on a simulated clock).
    ``ValueError`` is INVALID_ARGUMENT.
    """
    if not request.HasField(field):
        return None
    stamp: Timestamp = getattr(request, field)
    latest = PIN_LATEST.timestamp()
    if stamp.seconds < 1:  # 0 is how the cache says "no pin": it would unpin, silently
        raise ValueError(
            f"{field} (seconds={stamp.seconds}) is before 1970-01-01T00:00:01Z, the earliest "
            f"time a pin can hold: pin until a later time"
            + (", or leave until unset to unpin" if field == "until" else "")
        )
    if stamp.seconds + stamp.nanos / 1e9 > latest:
        try:
            shown = stamp.ToDatetime(tzinfo=UTC).isoformat()
        except (ValueError, OverflowError):
            shown = f"seconds={stamp.seconds}"
        raise ValueError(
            f"{field} {shown} is later than {PIN_LATEST:%Y-%m-%dT%H:%M:%SZ}, the latest "
            "time a pin can hold (the cache keeps it in nanoseconds since 1970, as an int64): "
            "pin until an earlier time and renew the pin when it nears"
        )
    return stamp.ToDatetime(tzinfo=UTC)


def _check_peers(request: edge_pb2.StageRequest) -> None:
    """``ValueError`` (INVALID_ARGUMENT) for a Stage's peers no shard could come from.

    Before anything is fetched: ``peers_only`` without peers asks for no origin
    traffic and names nowhere else, and a peer that is no address failed every
    shard UNAVAILABLE (or, without ``peers_only``, sent each quietly to origin).
    """
    if request.peers_only and not request.peers:
        raise ValueError(
            "peers_only needs peers: name them in peers (host:port or grpcs://host:port), "
            "or stage without peers_only to fetch from origin"
        )
    for peer in request.peers:
        check_peer(peer)


def _held_manifests(node: EdgeNode) -> list[manifest_pb2.Manifest]:
    """The manifests of the versions this node holds (keeps a copy of)."""
    held = []
    for version in node.store.versions():
        raw = node.store.get_manifest(version.dataset, version.version)
        if raw is not None:
            held.append(manifest_pb2.Manifest.FromString(raw))
    return held


def _sample_object(held: list[manifest_pb2.Manifest]) -> tuple[str, str] | None:
    """The largest source object of a version held, for an origin read test.

    (its version's source prefix, its URL); None when no version is held: origin is
    where a manifest's ``source_url`` says, so it is not known without one.
    """
    best: tuple[int, str, str] | None = None
    for manifest in held:
        for shard in manifest.shards:
            if best is None or shard.source_size > best[0]:
                url = manifest.source_url + shard.source_key
                best = (shard.source_size, manifest.source_url, url)
    return best[1:] if best else None


class _NotHere(EdgeCacheError):
    """A cached_only read of a shard this node does not hold (it will not fetch it)."""


_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


def stage_failure(
    failures: Sequence[tuple[int, str, grpc.StatusCode]],
) -> tuple[int, str, grpc.StatusCode]:
    """The shard failure a Stage's status reports: the first that retrying cannot mend.

    Shards fail in the order they finish, so "the first failure" let timing pick the
    code: a stage with one shard origin lost (FAILED_PRECONDITION) and one that timed
    out (UNAVAILABLE) said either. A caller told UNAVAILABLE retries, and the shard
    that needs someone to act fails again every time; so a failure no retry can mend
    speaks for the stage, and UNAVAILABLE only when every failure may pass. Each
    shard's own code stays in the progress's ``failures``.
    """
    return next((f for f in failures if f[2] not in _RETRYABLE), failures[0])


def _drained(
    exc: NodeDraining,
    manifest: manifest_pb2.Manifest,
    progress: edge_pb2.StageProgress,
    failures: Sequence[tuple[int, str, grpc.StatusCode]],
    staged: set[int],
) -> _StageIncomplete:
    """A Stage cut short by the node's drain (SIGTERM): what is staged, what to do next.

    UNAVAILABLE, so callers retry (elsewhere, or here after the restart) and the
    shards staged are skipped then; unless a shard failed in a way no retry mends,
    whose code then speaks for the stage as :func:`stage_failure` says. The
    shards staged are named, since only committed shards are ever reported done.
    """
    spec = f"{manifest.dataset}@{manifest.version}"
    left = progress.shards_total - progress.shards_done - progress.shards_failed
    message = (
        f"{exc}; {progress.shards_done} of {progress.shards_total} shards of {spec} are "
        f"staged here ({_shard_list(staged)}, committed whole), {progress.shards_failed} "
        f"failed and {left} were not started: stage {spec} again, on another node of the "
        "region or on this one once it is back (the staged shards are skipped)"
    )
    code = grpc.StatusCode.UNAVAILABLE
    if failures:
        shard, error, failed = stage_failure(failures)
        message += f"; shard {shard} failed: {error}"
        if failed not in _RETRYABLE:
            code = failed
    return _StageIncomplete(message, code=code)


def _shard_list(shards: set[int], most: int = 20) -> str:
    """``shards 0, 1, 4`` (the first ``most``, then how many more), or ``none``."""
    if not shards:
        return "none"
    ordered = sorted(shards)
    shown = ", ".join(map(str, ordered[:most]))
    more = f" and {len(ordered) - most} more" if len(ordered) > most else ""
    return f"shard{'s' if len(ordered) > 1 else ''} {shown}{more}"


class _StageIncomplete(EdgeCacheError):
    """Some shards of a Stage failed: the status is :func:`stage_failure`'s, reasons in text."""

    def __init__(self, message: str, *, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


def _message_class(full_name: str) -> Any:
    for module in (edge_pb2, manifest_pb2):
        name = full_name.rsplit(".", 1)[-1]
        if full_name.startswith(module.DESCRIPTOR.package + ".") and hasattr(module, name):
            return getattr(module, name)
    raise LookupError(full_name)


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` for admin (and optionally read) methods.

    Tokens are compared in constant time and never logged. Health checks and
    reflection stay open so probes and grpcurl work.
    """

    def __init__(self, admin_token: str | None, read_token: str | None) -> None:
        self._admin = admin_token.encode() if admin_token else None
        self._read = read_token.encode() if read_token else None

    def _required(self, method: str) -> tuple[bytes, ...] | None:
        service, _, name = method.lstrip("/").partition("/")
        if service != SERVICE_NAME:
            return None
        if name in ADMIN_METHODS:
            if self._admin:
                return (self._admin,)
            # Reads need a token but no admin token is set: admin calls are refused
            # (an empty tuple accepts nothing), never left open to callers that may
            # not even read. Without any token the node is open, as its start warns.
            return () if self._read else None
        if self._read:
            # The admin token may read too.
            return tuple(t for t in (self._read, self._admin) if t)
        return None

    def _refusal(self, name: str, presented: bytes) -> tuple[grpc.StatusCode, str]:
        """The status and message for a refused call, by gRPC's convention.

        No token or an unknown one is UNAUTHENTICATED (who is calling is not
        known); the read token on an admin call is PERMISSION_DENIED (the caller
        is known and may read, but not do this), so the two need different fixes.
        """
        if name in ADMIN_METHODS and not self._admin:
            log.warning("[EdgeCache.%s] refused: this node has no admin token", name)
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{name} is an admin call, and this node reads with a read token but has no "
                "admin token to allow it: restart the node with --token-file (or "
                "$EDGECACHE_TOKEN_FILE) and call with that token"
            )
        if presented and self._read and hmac.compare_digest(presented, self._read):
            log.warning("[EdgeCache.%s] refused: the read token on an admin call", name)
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{name} is an admin call and the read token cannot make it; present the "
                "node's admin token (--token-file or $EDGECACHE_TOKEN_FILE)"
            )
        reason = "missing" if not presented else "wrong"
        log.warning("[EdgeCache.%s] refused: %s bearer token", name, reason)
        # Name the token the call needs, by the node's flag that holds it: a reader told
        # "--token-file" went looking for the admin token. Clients pass either one with
        # their own --token-file ($EDGECACHE_TOKEN_FILE, token= for EdgeDataset).
        if name in ADMIN_METHODS:
            needed = "the node's admin token (the file of the node's --token-file)"
        else:
            needed = (
                "the node's read token (the file of the node's --read-token-file; its admin "
                "token works too)"
            )
        return grpc.StatusCode.UNAUTHENTICATED, (
            f"{name} needs 'authorization: Bearer <token>' metadata; the token was {reason}: "
            f"pass {needed} to the client (--token-file or $EDGECACHE_TOKEN_FILE; token= "
            "for EdgeDataset)"
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Let the call through, or refuse it (see :meth:`_refusal`)."""
        method = handler_call_details.method
        accepted = self._required(method)
        if accepted is None:
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, credentials = text.partition(" ")
                if scheme.lower() == "bearer":  # the scheme is case-insensitive (RFC 9110)
                    presented = credentials.strip().encode()
        if any(hmac.compare_digest(presented, token) for token in accepted):
            return await continuation(handler_call_details)
        name = method.rsplit("/", 1)[-1]
        code, message = self._refusal(name, presented)
        handler = await continuation(handler_call_details)

        async def deny_unary(request: Any, context: aio.ServicerContext) -> Any:
            await context.abort(code, message)

        async def deny_stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, request_deserializer=handler.request_deserializer
            )
        if handler is not None and handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                deny_unary, request_deserializer=handler.request_deserializer
            )
        return grpc.unary_unary_rpc_method_handler(
            deny_unary,
            request_deserializer=handler.request_deserializer if handler else None,
        )
