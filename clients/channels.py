"""Channels to edge nodes, and what their error statuses mean to a caller.

Every client of a node (EdgeDataset, the ops commands, doctor, the demo, a
controller) opens its channels through :func:`open_channel`, so keepalive,
message limits, TLS and the retry policy are the same everywhere, and turns
a failed call into an :class:`~edgecache.cache.errors.EdgeCacheError` with
:func:`node_error`, so no raw ``grpc.RpcError`` reaches a user.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache import wire
from edgecache.cache.errors import (
    AccessDenied,
    EdgeCacheError,
    InvalidEndpoint,
    InvalidRequest,
    NodeError,
    NodeUnavailable,
    VersionNotFound,
)
from edgecache.cache.sink_sizing import at_max_streams
from edgecache.clients.endpoints import Endpoint, parse_endpoint
from edgecache.v1 import edge_pb2_grpc

__all__ = [
    "CHANNEL_OPTIONS",
    "Pings",
    "health_pings",
    "MAX_MESSAGE_BYTES",
    "bearer",
    "client_credentials",
    "connection_hint",
    "credentials_refused_in",
    "tls_refused",
    "tls_setting_in",
    "describe",
    "edge_stub",
    "explain",
    "node_error",
    "open_channel",
]

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
                    # RESOURCE_EXHAUSTED: a node's pool of manifest calls is full
                    # (edge/call_limits.py), which frees in milliseconds.
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
)
# A chunk is a few MiB, the largest a node stores 1 GiB (cache.wire). A message over this
# limit comes from a broken or hostile node: refuse it (RESOURCE_EXHAUSTED, and read
# elsewhere) instead of allocating it.
MAX_MESSAGE_BYTES = wire.MAX_MESSAGE_BYTES
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

    The files are read and checked once per set of files as they are on disk
    (see :func:`_tls_files`), not for every channel.
    """
    root, cert, key = _tls_files(root)
    return grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=cert
    )


_TlsPems = tuple[bytes | None, bytes | None, bytes | None]  # CA bundle, certificate, key
# What was read and checked, by the files it came from as they were on disk. Small:
# a client uses one set of files; a rotated one adds an entry, so it is cleared when full.
# No lock: a dict's get and set are atomic, and a lock held across a DataLoader fork
# would deadlock the worker.
_CHECKED_PEMS: dict[tuple[object, ...], _TlsPems] = {}
_CHECKED_SETS = 8


def _tls_files(root: bytes | None) -> _TlsPems:
    """The CA bundle, certificate and key for :func:`client_credentials`, checked.

    All are read again only when a variable names another file or a file on disk
    changed (replaced, rewritten: its inode, size or times differ), so a
    rotated certificate is picked up by the next channel. A file that cannot
    be read, or fails its check, raises every time: only what passed is kept.
    """
    state = _tls_state(root)
    if state is not None and (pems := _CHECKED_PEMS.get(state)) is not None:
        return pems
    pems = _read_tls_files(root)
    if state is not None:
        if len(_CHECKED_PEMS) >= _CHECKED_SETS:
            _CHECKED_PEMS.clear()
        _CHECKED_PEMS[state] = pems
    return pems


def _tls_state(root: bytes | None) -> tuple[object, ...] | None:
    """The TLS variables' files as they are on disk now; None if one cannot be looked at.

    Taken before the files are read, so a file changed in between is read again next time.
    """
    variables = ["EDGECACHE_TLS_CERT", "EDGECACHE_TLS_KEY"]
    if root is None:
        variables.append("EDGECACHE_TLS_CA")
    state: list[object] = [root]
    for variable in variables:
        path = os.environ.get(variable)
        if not path:
            state.append(None)
            continue
        try:
            found = os.stat(path)
        except OSError:
            return None  # reading it says why, naming the variable
        state.append(
            (path, found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)
        )
    return tuple(state)


def _read_tls_files(root: bytes | None) -> _TlsPems:
    cert, key = _read_pem("EDGECACHE_TLS_CERT"), _read_pem("EDGECACHE_TLS_KEY")
    if (cert is None) != (key is None):
        raise InvalidEndpoint(
            "mutual TLS needs both $EDGECACHE_TLS_CERT and $EDGECACHE_TLS_KEY; only one is set"
        )
    if root is None:
        root = _read_pem("EDGECACHE_TLS_CA")
        _check_ca(root)
    if cert is not None:
        _check_pair()
    return root, cert, key


def _check_ca(root: bytes | None) -> None:
    """Refuse a $EDGECACHE_TLS_CA that is not PEM, naming it.

    gRPC says only "Failed to create security handshaker", at every node, as
    if each were down.
    """
    if root is None:
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
            cadata=root.decode("ascii", "replace")
        )
    except (ssl.SSLError, ValueError):
        raise InvalidEndpoint(
            f"$EDGECACHE_TLS_CA ({os.environ.get('EDGECACHE_TLS_CA')}) holds no PEM "
            "certificate: point it at the CA file that signed the nodes' certificates"
        ) from None


def _check_pair() -> None:
    """Refuse a client certificate and key that are not a PEM pair, naming the variables."""
    cert, key = os.environ["EDGECACHE_TLS_CERT"], os.environ["EDGECACHE_TLS_KEY"]
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as exc:
        why = (
            "the key is not the certificate's"
            if exc.reason == "KEY_VALUES_MISMATCH"
            else "one does not parse, or the key is encrypted"
        )
        raise InvalidEndpoint(
            f"$EDGECACHE_TLS_CERT ({cert}) and $EDGECACHE_TLS_KEY ({key}) must be this "
            f"client's PEM certificate and unencrypted key ({why}): point them at those files"
        ) from None


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying ``token``, for nodes started with a token file."""
    return (("authorization", f"Bearer {token}"),) if token else None


def open_channel(endpoint: Endpoint | str, *, tls_root: bytes | None = None) -> grpc.Channel:
    """A channel to a gRPC endpoint: TLS for ``grpcs://`` (see `client_credentials`).

    The one place clients open channels (EdgeDataset, the ops commands, doctor,
    the demo), so keepalive, message limits and retries are the same everywhere.
    """
    if isinstance(endpoint, str):
        endpoint = parse_endpoint(endpoint)
    if endpoint.local:
        raise InvalidEndpoint(f"{endpoint.text} is a local cache directory, not a gRPC node")
    if endpoint.kind == "grpcs":
        credentials = client_credentials(tls_root)
        return grpc.secure_channel(endpoint.target, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(endpoint.target, options=CHANNEL_OPTIONS)


@contextlib.contextmanager
def edge_stub(endpoint: Endpoint | str) -> Iterator[edge_pb2_grpc.EdgeCacheStub]:
    """An ``EdgeCache`` stub on a channel of its own, closed when the block ends."""
    channel = open_channel(endpoint)
    try:
        yield edge_pb2_grpc.EdgeCacheStub(channel)
    finally:
        channel.close()


_CONNECT_FAILED = re.compile(
    r"^failed to connect to all addresses; last error: \w+: \S+: "
    r"(?:Failed to connect to remote host: )?(?P<reason>.+)$"
)


def _plain(details: str) -> str:
    """A connection failure from gRPC said as its cause (``Connection refused``).

    Its own text repeats the address the message around it names already
    (``failed to connect to all addresses; last error: UNKNOWN:
    ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused``).
    """
    match = _CONNECT_FAILED.match(details)
    return match.group("reason") if match else details


def _with_hint(text: str, hint: str | None) -> str:
    """``text; hint``, unless the text already gives that advice (names its setting or command).

    Nodes word their own refusals with the fix ("pass the node's token
    (--token-file …)", "list the published versions with `edgecache versions
    tokens`"): the client's hint for the same code said it twice.
    """
    if not hint:
        return text
    settings = re.findall(r"(?:--|\$)[A-Za-z][\w-]*", hint)
    if settings and any(setting in text for setting in settings):
        return text
    commands = re.findall(r"\bedgecache [a-z][\w-]*", hint)
    if commands and any(re.search(rf"{command}\b", text) for command in commands):
        return text
    return f"{text}; {hint}"


def describe(exc: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call, for messages and logs.

    When the cause is one the caller fixes on its side (a TLS setting, the
    token), what to do follows: status and doctor show this text alone.
    """
    raw = exc.details() or ""
    details = _plain(raw)
    hint = _own_connection_hint(exc.code(), raw)
    if hint is None and exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        hint = _HINTS[grpc.StatusCode.UNAUTHENTICATED]
    return _with_hint(f"{exc.code().name}: {details}", hint)


def explain(exc: grpc.RpcError) -> str:
    """``CODE: details; what to do`` of a failed call, with the advice for every code.

    :func:`describe` adds advice only where the fix is on the caller's side;
    this is :func:`node_error`'s text without the node and call, for reports
    that name them already (doctor's rows).
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    raw = (exc.details() if callable(getattr(exc, "details", None)) else str(exc)) or ""
    busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and at_max_streams(raw)  # not full
    hint = _own_connection_hint(code, raw) or (_BUSY_HINT if busy else _HINTS.get(code))
    return _with_hint(f"{code.name}: {_plain(raw)}", hint)


# How the node words a peer's failure (edge/peers.py, Peers.copy_shard): "<peer> failed
# after <n> chunks (<CODE>: <gRPC's details of the node's own call to the peer>)".
_PEER_FAILURE = re.compile(r"\bfailed after \d+ chunks \((?:[A-Z_]+|ERROR): ")
# gRPC's own words for a connection this client could not make (refused, TLS handshake,
# closed during the handshake), or one that broke before any status came back.
_OWN_CONNECTION = re.compile(
    r"^(?:failed to connect to all addresses\b|Socket closed|Connection reset)"
)


def _own_connection_hint(code: grpc.StatusCode, details: str) -> str | None:
    """:func:`connection_hint` for a failure of this client's own connection; else None.

    Only gRPC itself fails a call for the channel's connection, always with
    UNAVAILABLE and in its own words, which start the details. A status the
    node sent (FAILED_PRECONDITION, or UNAVAILABLE) starts with the node's
    message, which may quote a failure of the node's own connection to a peer
    ("… grpcs://peer failed after 0 chunks (UNAVAILABLE: failed to connect to
    all addresses; … Tls handshake failed …); this node does not trust the
    peer's certificate: set peer_tls_ca …"): that is the node's setting, and
    the node's advice says so. Telling this client to set $EDGECACHE_TLS_CA
    there sends the operator to the wrong host.
    """
    if code != grpc.StatusCode.UNAVAILABLE or _PEER_FAILURE.search(details):
        return None
    if not _OWN_CONNECTION.match(details):
        return None
    return connection_hint(_plain(details))


def tls_refused(exc: grpc.RpcError) -> bool:
    """Whether this client's own connection failed in TLS for a setting, not for a node away.

    A certificate this client does not trust, one out of date or naming another
    host, TLS to a node that does not speak it: each fails every try the same
    way until a setting changes, so a command says so at once (bad input, exit
    2) instead of calling the node down and waiting for it (``ready --wait``
    polled it for its whole hour). A connection closed during the handshake
    ("Socket closed": a node that wants a client certificate, or one that
    plaintext reached) is not among them: a node stopping or restarting closes
    it the same way.
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    raw = (exc.details() if callable(getattr(exc, "details", None)) else "") or ""
    if code != grpc.StatusCode.UNAVAILABLE or _PEER_FAILURE.search(raw):
        return False
    return bool(_OWN_CONNECTION.match(raw)) and _tls_setting_hint(_plain(raw)) is not None


# gRPC's words for a handshake that failed for a setting, and what to do about each.
_TLS_SETTINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("WRONG_VERSION_NUMBER",),
        "the node does not speak TLS: use host:port instead of grpcs://, or start the node "
        "with --tls-cert/--tls-key",
    ),
    (
        ("certificate has expired", "not yet valid"),
        "the node's certificate is out of date (expired or not valid yet): renew it on the "
        "node, and check both hosts' clocks",
    ),
    (
        ("CERTIFICATE_VERIFY_FAILED",),
        "this client does not trust the node's certificate: set $EDGECACHE_TLS_CA to the "
        "CA file that signed it",
    ),
    (
        ("Hostname Verification",),
        "the node's certificate does not name the host in this endpoint: connect by a name "
        "or address among its subject alternative names, or reissue it for this one",
    ),
)


# Any other failed handshake: most often the same distrust, said less precisely; but a
# TLS proxy that fails may say it too, so it is advice only, never "a setting" (tls_refused).
_TLS_OTHER = (
    "Tls handshake failed",
    "the TLS handshake failed: most often this client does not trust the node's "
    "certificate (set $EDGECACHE_TLS_CA to the CA file that signed it); if it does, check "
    "what stands between them (a TLS proxy)",
)


def credentials_refused_in(text: str) -> bool:
    """Whether a failure's text carries a node's refusal of this caller's token.

    Callers that keep failures as text (warm's items, the controller's round, doctor's
    checks) tell a setting to fix (exit 2) from a failure to retry (exit 1) by it: the
    text carries the status code, as :func:`node_error` writes it.
    """
    return "UNAUTHENTICATED" in text or "PERMISSION_DENIED" in text


def tls_setting_in(text: str) -> bool:
    """Whether a failure's text says a TLS setting refused it (:func:`tls_refused`'s causes)."""
    return _tls_setting_hint(text) is not None


def _tls_setting_hint(details: str) -> str | None:
    return next(
        (hint for marks, hint in _TLS_SETTINGS if any(mark in details for mark in marks)), None
    )


def connection_hint(details: str) -> str | None:
    """What to do about a connection that failed in TLS, from gRPC's last error; else None.

    gRPC reports a failed handshake only as UNAVAILABLE with the reason in
    the details, where "retry" is the wrong advice: each of these fails the
    same way until a setting on this side (or the node's certificate) changes.
    """
    if hint := _tls_setting_hint(details):
        return hint
    if _TLS_OTHER[0] in details:
        return _TLS_OTHER[1]
    if ("Socket closed" in details or "Connection reset" in details) and (
        "Stream removed" not in details  # a stream that was running: the node went away
    ):
        # Most often the node stopped or restarted (a failover log line after a kill says
        # this); the TLS causes come second, for a node that is running.
        return (
            "the node closed the connection: it may have stopped or restarted (edgecache "
            "status); if it runs, over grpcs:// a node with --tls-client-ca refuses "
            "clients without a certificate from that CA (set $EDGECACHE_TLS_CERT and "
            "$EDGECACHE_TLS_KEY), and over host:port a node that serves TLS needs "
            "grpcs://host:port"
        )
    return None


_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "retry; if it persists, check that the node runs "
    "(edgecache status) and is reachable from this host (edgecache doctor), and the origin "
    "or peer the message names",
    # The node works but will not do this as things are (origin refuses or lost an
    # object, a version it cannot encode, a digest that disagrees): the message says what.
    grpc.StatusCode.FAILED_PRECONDITION: "retrying will not help until what the message "
    "names is fixed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the node did not answer in time; check its load "
    "and the path to it (edgecache doctor)",
    grpc.StatusCode.CANCELLED: "the call was cancelled; run it again",
    # A Pin or Evict conditioned on the status read earlier (if_until, unless_pinned_after).
    grpc.StatusCode.ABORTED: "it changed on the node since this command read its status; run "
    "the command again to decide on what the node holds now",
    grpc.StatusCode.UNAUTHENTICATED: "pass the node's bearer token with --token-file "
    "(or $EDGECACHE_TOKEN_FILE; token= for EdgeDataset)",
    grpc.StatusCode.PERMISSION_DENIED: "the node knows this caller but does not allow the "
    "call: use its admin token for admin calls (--token-file or $EDGECACHE_TOKEN_FILE)",
    # With --registry: on a training host there is often no edgecache.yaml, and the bare
    # command only said "no registry" (a helper's hunt). The message names the registry.
    grpc.StatusCode.NOT_FOUND: "list what is published with: edgecache versions NAME "
    "--registry URL (the registry the message names)",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the node is full: free room (edgecache evict), "
    "raise --capacity, or retry later",
    grpc.StatusCode.INTERNAL: "the node failed; see its log",
    grpc.StatusCode.UNKNOWN: "the node failed; see its log",
    # The message says it: the node's cache file is damaged beyond its own mending.
    grpc.StatusCode.DATA_LOSS: "restart that node on a new cache directory, as the message "
    "says; other nodes of the region serve meanwhile",
}


_BUSY_HINT = "the node is busy: retry later, or raise its max_streams"


def node_error(exc: grpc.RpcError, *, endpoint: str, what: str) -> EdgeCacheError:
    """The edgecache error for a failed call of ``what`` on ``endpoint``.

    The message names the node, the call and what to do; the class says the
    cause (unreachable, refused credentials, bad arguments, not found), so
    callers catch edgecache's tree, never ``grpc.RpcError``. Raise it ``from``
    the original so the status stays in the traceback.
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    message = f"{what} on {endpoint}: {explain(exc)}"
    if code == grpc.StatusCode.NOT_FOUND:
        return VersionNotFound(message)
    kind: type[NodeError] = NodeError
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ):
        kind = NodeUnavailable
    elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        kind = AccessDenied
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        kind = InvalidRequest
    return kind(message, endpoint=endpoint, code=code.name)


@dataclass
class Pings:
    """Round trips of standard health checks on a connected channel."""

    samples_ms: list[float] = field(default_factory=list)
    lost: int = 0
    error: str = ""  # the last failure, or why the node is not serving
    serving: bool = True
    # The connection failed in TLS for a setting of this client or the node's certificate
    # (:func:`tls_refused`): not a node away, and no retry mends it.
    tls_refused: bool = False

    @property
    def rtt_ms(self) -> float | None:
        """The median round trip, or None without one."""
        return statistics.median(self.samples_ms) if self.samples_ms else None

    @property
    def min_rtt_ms(self) -> float | None:
        """The least round trip (the one least delayed by a busy host), or None."""
        return min(self.samples_ms) if self.samples_ms else None

    @property
    def jitter_ms(self) -> float | None:
        """Mean difference of consecutive round trips (RFC 3550's idea), or None."""
        pairs = list(zip(self.samples_ms, self.samples_ms[1:], strict=False))
        return statistics.mean(abs(a - b) for a, b in pairs) if pairs else None


def health_pings(channel: grpc.Channel, pings: int = 5, timeout: float = 2.0) -> Pings:
    """``pings`` health checks, timed once the channel is connected.

    The one RTT method of edgecache (status, doctor and the node pool agree):
    the connection's setup (TCP, TLS, HTTP/2) is not a round trip, so it is
    done first and not counted; the median of what follows is the RTT.
    """
    result = Pings()
    health = health_pb2_grpc.HealthStub(channel)
    try:
        # Connects (not timed). A refused port or a failed TLS handshake fails this call
        # at once with the reason; waiting for the channel to be ready instead took the
        # whole timeout for them (3 s for every down node in status, plan and warm).
        health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            result.lost = pings
            result.error = (
                describe(exc)
                if code == grpc.StatusCode.UNAVAILABLE
                else f"not connected within {timeout:g} s"
            )
            result.tls_refused = tls_refused(exc)
            return result
    for _ in range(pings):
        started = time.perf_counter()
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            result.lost += 1
            result.error = describe(exc)
            continue
        result.samples_ms.append((time.perf_counter() - started) * 1e3)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            result.serving = False
            result.error = "not serving (draining?)"
    return result
