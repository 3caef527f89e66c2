"""Upload tests sized to what the receiving node accepts: the doctor's, and a node's of a peer.

Both upload into a node's ``Sink`` in messages of :data:`SINK_PART` bytes.
A node whose ``max_request_bytes`` is lower refuses the first one, and gRPC's
refusal names the limit; a node at its ``max_streams`` refuses further calls.
The two senders (``clients/doctor.py``, sync grpc; ``edge/diagnose.py``,
grpc.aio) read those refusals the same way, so it lives here, shared by nodes
and clients as ``tcp_stats`` is.
"""

from __future__ import annotations

import re

import grpc

__all__ = [
    "AT_MAX_STREAMS",
    "SINK_PART",
    "at_max_streams",
    "smaller_part",
    "too_large",
    "too_many_streams",
]

SINK_PART = 512 << 10  # each upload message, unless the node's max_request_bytes is less
# gRPC's words when a node refuses a message over its max_request_bytes (the limit last).
_TOO_LARGE = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")
# A node's words when it refuses a call over its max_streams (edge/call_limits.py), and
# gRPC's, which nodes before it let refuse such calls.
AT_MAX_STREAMS = "at its max_streams (concurrent calls)"
_TOO_MANY = (AT_MAX_STREAMS, "Concurrent RPC limit")
_FRAMING = 6  # a SinkChunk's bytes beyond its data: the field's tag and length varint
_LEAST_PART = 256  # fits the least max_request_bytes (1 KiB) with room for framing


def too_large(exc: grpc.RpcError) -> bool:
    """Whether a message was refused for the node's ``max_request_bytes``."""
    return _TOO_LARGE.search(exc.details() or "") is not None


def too_many_streams(exc: grpc.RpcError) -> bool:
    """Whether a call was refused for the node's ``max_streams`` (concurrent calls)."""
    return at_max_streams(exc.details() or "")


def at_max_streams(details: str) -> bool:
    """Whether a refusal's text says the node is at its ``max_streams``."""
    return any(words in details for words in _TOO_MANY)


def smaller_part(part: int, exc: grpc.RpcError) -> int | None:
    """The next message size to try after ``part`` bytes were refused; None: give up.

    A refusal for size names the node's limit: just under it. The same refusal can
    reach the sender as INTERNAL ("Internal error from Core") when it lands while
    the message is still being sent: half the size then. Anything else, or sizes
    below the least max_request_bytes (1 KiB), is no size problem.
    """
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        found = _TOO_LARGE.search(exc.details() or "")
        smaller = min(int(found.group(2)) - _FRAMING, part - 1) if found else 0
    elif exc.code() == grpc.StatusCode.INTERNAL:
        smaller = part // 2
    else:
        smaller = 0
    return smaller if smaller >= _LEAST_PART else None
