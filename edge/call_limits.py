"""How many calls a node runs at once: ``max_streams``, and the share token-free streams may hold.

Each running call holds a chunk or a request in gRPC's buffers, so a cap on
calls is a cap on that memory: beyond ``max_streams`` a call is refused with
RESOURCE_EXHAUSTED, and readers fail over or retry. The cap is counted here,
not with gRPC's ``maximum_concurrent_rpcs``, for two reasons. gRPC's counts
every call, health ``Check`` and ``Status`` too: a node busy serving
``max_streams`` reads failed its health checks and its status, so readers
probing it, ``edgecache status``, ``plan`` and the controller called a busy
node down, and a job starting beside busy ones failed to fetch its manifest.
And gRPC refuses in its own words ("Concurrent RPC limit exceeded!"), which
say nothing of the setting to change. Health ``Check`` and ``Status`` are
never counted (UNCOUNTED_METHODS); the manifest calls (MANIFEST_METHODS) are
counted in a pool of their own.

Health ``Watch`` and reflection streams need no token and stay open as long as
their caller likes, so they get a small share of their own
(:class:`OpenStreamLimit`): anyone who reaches the port could otherwise hold
every slot and leave readers with RESOURCE_EXHAUSTED.

Counts are kept where the call runs (one event loop: no lock), not when it
arrives, so a slot is given back however the call ends.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from edgecache.cache.sink_sizing import AT_MAX_STREAMS
from edgecache.v1 import edge_pb2

__all__ = [
    "HEALTH_CHECK",
    "LOG_EVERY",
    "MANIFEST_METHODS",
    "OPEN_STREAM_METHODS",
    "UNCOUNTED_METHODS",
    "CallLimit",
    "OpenStreamLimit",
    "open_stream_limit",
]

log = logging.getLogger(__name__)

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_EDGE = "/" + edge_pb2.DESCRIPTOR.services_by_name["EdgeCache"].full_name
# Calls no limit counts: unary answers from memory and the cache's index, holding no
# chunk. A node busy with reads still says it is up (health) and what it holds (Status:
# edgecache status, plan, the controller), instead of being taken for a node that is down.
UNCOUNTED_METHODS = frozenset({HEALTH_CHECK, f"{_EDGE}/Status"})
# What a version is: a job starting beside busy ones must get it, so these have a pool of
# max_streams of their own instead of the streams'; a pool all the same, since a version
# the node has not seen (or "latest") is a round trip to the registry.
MANIFEST_METHODS = frozenset({f"{_EDGE}/ResolveVersion", f"{_EDGE}/GetManifest"})
LOG_EVERY = 10.0  # seconds between warnings of refusals, per limit
# The long-lived streams anyone may open without a token: health Watch and reflection.
OPEN_STREAM_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
# Where a call's behaviour sits in a handler, and how to build one, by
# (request_streaming, response_streaming).
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def open_stream_limit(max_streams: int) -> int:
    """How many token-free streams (OPEN_STREAM_METHODS) may be open at once.

    An eighth of ``max_streams``, between 1 and 16: a load balancer or two
    watching health, and a grpcurl session, fit; the rest of ``max_streams``
    always stays for callers with a token. None where ``max_streams`` is 1: one
    Watch held the only stream, and every read was refused until it closed.
    """
    return min(16, max(max_streams // 8, 1 if max_streams >= 2 else 0))


class _Counted(aio.ServerInterceptor):
    """Runs the calls it counts only while fewer than ``limit`` of them run.

    ``refused`` is told of each refusal (the node's counter of them). The log
    says so at most every LOG_EVERY seconds, with how many went unsaid: a node
    at its limit refuses calls as fast as readers retry them.
    """

    def __init__(self, limit: int, refused: Callable[[], object] | None = None) -> None:
        self.limit = limit
        self.open = 0  # counted calls running now
        self._on_refusal = refused
        self._logged_at = -math.inf
        self._unlogged = 0  # refusals since the last one logged

    def _refuse(self, message: str) -> None:
        if self._on_refusal is not None:
            self._on_refusal()
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last such warning)"
        log.warning("%s%s", message, more if self._unlogged else "")
        self._logged_at, self._unlogged = now, 0

    def _counts(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        """Whether calls of ``method`` count against the limit."""
        raise NotImplementedError

    def _refusal(self, method: str) -> str:
        """What a refused caller reads: what is full, and what to do."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The handler, its behaviour counted while it runs (refused beyond the limit)."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._counts(method, handler):
            return handler
        attribute, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        # grpc's stubs type behaviours as synchronous; on an aio server they are async.
        behavior: Callable[..., Any] | None = getattr(handler, attribute)
        if behavior is None:
            return handler

        async def admit(context: aio.ServicerContext) -> None:
            if self.open >= self.limit:
                message = self._refusal(method)
                self._refuse(message)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            self.open += 1

        # gRPC iterates an async generator and awaits a coroutine (health Watch writes
        # with context.write): keep the behaviour's own kind.
        if inspect.isasyncgenfunction(behavior):

            async def counted(request: Any, context: aio.ServicerContext) -> Any:
                await admit(context)
                try:
                    # Closed with this one: a reader that leaves ends the behaviour's own
                    # cleanup now (ReadShard's gate and gauges), not when it is collected.
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response
                finally:
                    self.open -= 1

        else:

            async def counted(request: Any, context: aio.ServicerContext) -> Any:  # type: ignore[misc]
                await admit(context)
                try:
                    return await behavior(request, context)
                finally:
                    self.open -= 1

        return make(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class CallLimit(_Counted):
    """``max_streams`` calls at once, refused beyond it.

    Counts ``methods``, or without them every call but UNCOUNTED_METHODS and
    MANIFEST_METHODS (which a second CallLimit counts, with those methods).
    The refusal names the setting, so that a person reading a reader's error
    (or a peer's ``doctor`` report) knows what to raise.
    """

    def __init__(
        self,
        limit: int,
        refused: Callable[[], object] | None = None,
        methods: frozenset[str] | None = None,
    ) -> None:
        super().__init__(limit, refused)
        self._methods = methods

    def _counts(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        if self._methods is not None:
            return method in self._methods
        return method not in UNCOUNTED_METHODS and method not in MANIFEST_METHODS

    def _refusal(self, method: str) -> str:
        return (
            f"{method.rsplit('/', 1)[-1]} refused: this node is {AT_MAX_STREAMS}, "
            f"{self.open} of {self.limit} running. Readers retry and fail over to other nodes; "
            "if this node has memory to spare, raise max_streams ($EDGECACHE_MAX_STREAMS or "
            "its config file), or add a replica to the region"
        )


class OpenStreamLimit(_Counted):
    """Token-free long-lived streams (OPEN_STREAM_METHODS), refused beyond ``limit``."""

    def __init__(
        self,
        limit: int,
        refused: Callable[[], object] | None = None,
        methods: frozenset[str] = OPEN_STREAM_METHODS,
    ) -> None:
        super().__init__(limit, refused)
        self._methods = methods

    def _counts(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return method in self._methods and handler.response_streaming

    def _refusal(self, method: str) -> str:
        return (
            f"{method.rsplit('/', 1)[-1]} refused: {self.open} token-free health Watch and "
            f"reflection streams are open on this port, its limit of {self.limit} (they share "
            "max_streams with reads); poll grpc.health.v1.Health/Check instead, or watch "
            "health on the node's probe port (--probe-listen), which has no such limit"
        )
