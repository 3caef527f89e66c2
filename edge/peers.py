"""Copying a shard from a peer region's node: its stored chunk frames, verified, as they are.

A node staging a version from a peer asks each peer for the shard with
``ReadShard(cached_only=true)`` (a peer never pulls a shard across its own
origin link for someone else) and the version's digest (a peer with other
content for that version refuses). Every frame is verified against its own
checksum and the one sent beside it, and chunk numbers and rows must follow
on from each other and add up to the manifest's row count, so what is
committed is exactly what the peer stored: no second preprocessing.

Peers are asked in rendezvous order for the shard (the owner among a region's
replicas first). A peer that fails mid-shard is left for the next one, which
continues from the first chunk not yet received (encoding is deterministic,
so chunk *k* is the same on every node); a peer whose chunking differs is
asked from chunk 0. A peer is left for the next one too when it sends
nothing for ``STALL_SECONDS``, or gives the shard more slowly than
``MIN_PEER_RATE`` on average once ``RATE_GRACE_SECONDS`` have passed (a slow
drip; see :class:`_PeerTooSlow`). Peers authenticate this node like any client:
``peer_token_file`` or else the node's read token (never its admin token: a peer
needs read access only, and a token sent to a peer is one the peer may keep), and
its own certificate for mutual TLS. A peer that sends more than a shard can hold
(see :func:`copy_byte_limit`), more chunks than the shard has rows, or a chunk of
no rows is left for the next peer (or origin), with what it sent dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio

from edgecache.cache import rendezvous
from edgecache.cache.addresses import address_problem, split_hostport
from edgecache.cache.errors import ChunkCorrupt, EdgeCacheError
from edgecache.cache.frame import verify_frame
from edgecache.cache.preprocess import limits
from edgecache.cache.wire import MAX_MESSAGE_BYTES, READ_SHARD_METHOD, parse_chunk
from edgecache.edge.config import NodeConfig, read_pem
from edgecache.v1 import edge_pb2, edge_pb2_grpc, manifest_pb2

NAME_TIMEOUT = 5.0  # seconds a peer's Status may take when it is asked for its id
NAME_RETRY_SECONDS = 60.0  # a peer that could not say its id is asked again after this

__all__ = [
    "PeerCopy",
    "PeerCopyFailed",
    "Peers",
    "check_peer",
    "copy_byte_limit",
    "refuses_configuration",
    "rpc_status",
]

log = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),  # the largest chunk a node stores
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.ping_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
STALL_SECONDS = 30.0  # a peer that sends nothing for this long is abandoned
# A peer whose copy of a shard averages less than MIN_PEER_RATE (frame bytes/s, from
# the moment it was asked) once RATE_GRACE_SECONDS have passed is abandoned too: see
# _PeerTooSlow for why a floor on the average, and why these values.
MIN_PEER_RATE = 256 << 10  # 2 Mbit/s
RATE_GRACE_SECONDS = 30.0
# A peer's copy of one shard may total at most COPY_BYTES_PER_SOURCE_BYTE times the
# shard's size at origin (or stored size, when the manifest knows it), plus
# COPY_BYTES_FLOOR: see copy_byte_limit for why these values.
COPY_BYTES_PER_SOURCE_BYTE = 64
COPY_BYTES_FLOOR = 64 << 20
# Channels kept open to peers (and Diagnose targets) at most; the least recently used
# beyond it is closed. Each channel holds sockets, threads' work and (grpcs://) a TLS
# session that gRPC keeps reconnecting: kept until shutdown, a node asked for many
# distinct targets grew without bound.
MAX_CHANNELS = 64
_PEER_FORMS = "host:port, grpc://host:port or grpcs://host:port, port 1-65535"


def check_peer(peer: str) -> tuple[bool, str]:
    """(whether ``peer`` is dialled with TLS, its ``host:port``); ``ValueError`` naming it.

    A peer is ``host:port``, ``grpc://host:port`` (the same) or ``grpcs://host:port``
    (TLS), an IPv6 host in brackets. Checked before anything is dialled: gRPC takes
    other strings as targets of its own and fails each call UNAVAILABLE ("retrying
    may help", which it cannot), and wraps ports past 65535 around (``:99999`` dialled
    port 34463), so a typo could reach an unintended port.
    """
    secure, target = False, peer
    if peer.startswith("grpcs://"):
        secure, target = True, peer[len("grpcs://") :]
    elif peer.startswith("grpc://"):
        target = peer[len("grpc://") :]
    problem = address_problem(target)
    if problem is not None:
        raise ValueError(f"peer {peer!r} is not a peer address: {problem}; expected {_PEER_FORMS}")
    return secure, target


def copy_byte_limit(shard: manifest_pb2.Shard) -> int:
    """The most frame bytes a peer may send for ``shard`` before its copy is abandoned.

    A peer's frames are kept in memory until the shard is whole, so a peer
    that never stops (a bug, or a malicious one) would otherwise grow the node
    until it is killed. Stored frames are compressed Arrow, rarely larger than
    the raw object: tokenised text is about its size; decoded images, the
    largest expansion in practice, are some 5-20 times a JPEG or PNG (up to ~60
    times for small images upscaled, before zstd halves it). 64 times the source
    size covers these with room; the 64 MiB floor covers small objects that
    expand (a tiny gzip of repetitive rows) and chunks' headers. A shard is
    never more than the node itself would build from origin: preprocessing
    stops at limits.MAX_DECODED_BYTES decoded (zstd and frame headers add a
    little: an eighth is ample), so the bound never passes that either.
    """
    size = max(shard.source_size, shard.stored_size)
    built = limits.MAX_DECODED_BYTES + (limits.MAX_DECODED_BYTES >> 3)
    return min(COPY_BYTES_FLOOR + COPY_BYTES_PER_SOURCE_BYTE * size, built)


class PeerCopyFailed(EdgeCacheError):
    """No peer could give the shard; the message says what each one answered.

    ``reasons`` holds those answers alone, one a peer, so the node can word its own
    note (origin took the shard) or failure (``peers_only``) without repeating them.
    """

    def __init__(
        self,
        message: str,
        reasons: Sequence[str] = (),
        *,
        asked: Sequence[str] = (),
        none_held: bool = False,
        refused: Sequence[str] = (),
        final: bool = False,
    ) -> None:
        super().__init__(message)
        self.reasons = list(reasons)
        self.asked = list(asked)  # the peers asked, in the order asked
        # Every peer asked answered that it does not hold the shard (not cached there,
        # other content for the version, a version it does not know): asking again
        # cannot help until the version is staged on one of them. False when any peer
        # could not be reached, broke off or sent bad chunks (asking again may help).
        self.none_held = none_held
        # The peers that refused this node for its configuration (a token they do not
        # accept, a TLS handshake that failed on certificates or protocol; see
        # refuses_configuration; ``reasons`` names the setting to fix for each):
        # asking again fails the same way until that setting is fixed.
        self.refused = list(refused)
        # Every peer asked either does not hold the shard or refused this node for its
        # configuration: no retry helps until the version is staged on one of them or a
        # setting is fixed. False when any peer could not be reached, broke off, was too
        # slow or sent bad chunks (asking again may work).
        self.final = final or none_held


@dataclass
class PeerCopy:
    """A shard copied from peers: its frames, and who gave them."""

    frames: list[bytes | memoryview]
    peers: list[str]  # the peers that gave chunks, in order
    notes: list[str] = field(default_factory=list)  # "shard N: peer failed ...", one a failure

    @property
    def stored_bytes(self) -> int:
        """Bytes received (the stored size of the shard)."""
        return sum(len(f) for f in self.frames)


class Peers:
    """Channels to peer nodes, opened as needed, with this node's credentials.

    At most :data:`MAX_CHANNELS` stay open, the least recently used closed beyond
    that (once no call of this node is using it).
    """

    def __init__(self, config: NodeConfig, max_channels: int = MAX_CHANNELS) -> None:
        self.config = config
        self.max_channels = max_channels
        self._channels: OrderedDict[str, aio.Channel] = OrderedDict()  # most recent last
        # Plaintext peers the token's exposure was said for: once each, not at every new
        # channel (Diagnose closes its channel after each test; a warning a call).
        self._said_plaintext: set[str] = set()
        self._users: dict[aio.Channel, int] = {}  # calls of this node using a channel now
        self._retired: set[aio.Channel] = set()  # evicted, closed when their last user ends
        self._closing: set[asyncio.Task[None]] = set()  # evicted channels being closed
        token, self._token_from = None, ""  # the token, and the setting it came from
        # Never the admin token: a peer needs read access only, and whoever runs (or has
        # broken into) a peer would hold the power to Stage and Evict on this node.
        for setting, named in (
            ("peer_token_file", "peer_token_file ($EDGECACHE_PEER_TOKEN_FILE)"),
            ("read_token_file", "this node's read token (--read-token-file)"),
        ):
            if (token := config.read_token(setting)) is not None:
                self._token_from = named
                break
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        # Peer → the id it reports (Status), which its region's replicas split shards by;
        # and when a peer that could not say was last asked (asked again after a while).
        self._ids: dict[str, str] = {}
        self._unnamed: dict[str, float] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}  # one question a peer at a time
        # Read now, not at the first grpcs:// peer: a missing file stops the node at start
        # with its setting named, instead of failing a Stage later with a bare OSError.
        self._tls_files = (
            _optional_pem(config.peer_tls_ca, "peer_tls_ca ($EDGECACHE_PEER_TLS_CA)"),
            _optional_pem(config.tls_key, "--tls-key"),
            _optional_pem(config.tls_cert, "--tls-cert"),
        )

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(*self._tls_files)

    @property
    def open_channels(self) -> int:
        """Channels open now: kept for reuse, or evicted but still in use."""
        return len(self._channels) + len(self._retired)

    @contextlib.asynccontextmanager
    async def channel(self, peer: str, *, keep: bool = True) -> AsyncIterator[aio.Channel]:
        """The channel to ``peer`` for the calls made inside; ``ValueError`` for no address.

        ``keep=False`` (a Diagnose target, asked once): a channel opened for this use
        alone is closed after it, instead of staying among the peers' channels.
        """
        opened = peer not in self._channels
        channel = self._channel(peer)
        self._users[channel] = self._users.get(channel, 0) + 1
        try:
            yield channel
        finally:
            self._users[channel] -= 1
            if not keep and opened and self._channels.get(peer) is channel:
                del self._channels[peer]
                self._retired.add(channel)
            await self._close_unused()

    async def _close_unused(self) -> None:
        """Close the evicted channels no call uses any more."""
        for channel in [c for c in self._retired if not self._users.get(c)]:
            self._retired.discard(channel)
            self._users.pop(channel, None)
            await channel.close(None)

    def _channel(self, peer: str) -> aio.Channel:
        channel = self._channels.get(peer)
        if channel is not None:
            self._channels.move_to_end(peer)
            return channel
        secure, target = check_peer(peer)
        if secure:
            channel = aio.secure_channel(target, self._credentials(), options=_OPTIONS)
        else:
            if (
                self._metadata is not None
                and not _loopback(target)
                and peer not in self._said_plaintext
            ):
                self._said_plaintext.add(peer)
                log.warning(
                    "peer %s is plaintext: this node's token (from %s) crosses the "
                    "network readable to anyone on the path; name the peer "
                    "grpcs://%s if it serves TLS",
                    peer,
                    self._token_from,
                    target,
                )
            channel = aio.insecure_channel(target, options=_OPTIONS)
        self._channels[peer] = channel
        while len(self._channels) > self.max_channels:
            _, evicted = self._channels.popitem(last=False)
            self._retired.add(evicted)
            if not self._users.get(evicted):
                # No call uses it: close it now (from this synchronous path, as a task).
                self._retired.discard(evicted)
                self._users.pop(evicted, None)
                task = asyncio.get_running_loop().create_task(evicted.close(None))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return channel

    async def close(self) -> None:
        """Close every channel."""
        for task in list(self._asking.values()):
            task.cancel()
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close(None)
        self._channels.clear()
        self._retired.clear()
        self._users.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def copy_shard(
        self, manifest: manifest_pb2.Manifest, shard: int, peers: Sequence[str]
    ) -> PeerCopy:
        """The shard's frames from ``peers`` (owner first); :class:`PeerCopyFailed` if none can."""
        copy = _Copy(manifest, shard)
        reasons: list[str] = []  # what went wrong with each peer, in the order asked
        refused: list[str] = []  # the peers that refused this node's configuration
        names = await self._names(peers)
        asked = rendezvous.rank(list(peers), manifest.dataset, manifest.version, shard, names=names)
        # So far every peer asked answered that it lacks the shard; and every one either
        # lacks it or refused this node for its configuration (none failed in a way a
        # retry may get past: unreachable, broke off, too slow, bad chunks).
        none_held = final = True
        for peer in asked:
            for _attempt in range(2):  # a second time from chunk 0 if it chunks differently
                before = len(copy.frames)
                try:
                    await self._stream(peer, copy)
                except _ChunkedDifferently:
                    reasons.append(f"{peer} chunks the shard differently; copying it whole from it")
                    copy.reset()
                    none_held = final = False
                    continue
                except grpc.RpcError as exc:
                    got = len(copy.frames) - before
                    name, details = rpc_status(exc)
                    hint = self.hint(peer, name, details, got)
                    reason = f"{peer} failed after {got} chunks ({name}: {details})" + (
                        f"; {hint}" if hint else ""
                    )
                    reasons.append(reason)
                    # FAILED_PRECONDITION: not cached there (cached_only), or another digest;
                    # NOT_FOUND: a version the peer's registry does not know. The peer
                    # answered; it does not hold this shard.
                    lacks = got == 0 and name in ("FAILED_PRECONDITION", "NOT_FOUND")
                    refuses = got == 0 and refuses_configuration(peer, name, details)
                    if refuses:
                        refused.append(peer)
                    none_held &= lacks
                    final &= lacks or refuses
                except _PeerTooSlow as exc:
                    none_held = final = False
                    reasons.append(f"{peer} {exc}")
                except _PeerMisbehaved as exc:
                    # Nothing it sent is kept: its frames, though each is well formed, are
                    # not the shard; the next peer (or origin) gives it whole.
                    none_held = final = False
                    reasons.append(f"{peer} {exc}; what it sent is dropped")
                    copy.reset()
                except ChunkCorrupt as exc:
                    none_held = final = False
                    got = len(copy.frames) - before
                    reasons.append(f"{peer} failed after {got} chunks ({exc})")
                if len(copy.frames) > before:
                    copy.givers.append(peer)
                if copy.complete():
                    notes = [f"shard {shard}: {reason}" for reason in reasons]
                    return PeerCopy(copy.frames, copy.givers, notes)
                break
        spec = f"{manifest.dataset}@{manifest.version}"
        raise PeerCopyFailed(
            f"{spec} shard {shard}: no peer could give it: " + "; ".join(reasons),
            reasons,
            asked=asked,
            none_held=none_held and bool(asked),
            refused=refused,
            final=final and bool(asked),
        )

    def hint(self, peer: str, code: str, details: str, received: int) -> str | None:
        """What to change on this node when a peer refused it (retrying cannot help)."""
        if code == "UNAUTHENTICATED":
            presented = (
                "no token (neither peer_token_file nor --read-token-file is set; the admin "
                "token is never sent to peers)"
                if self._metadata is None
                else f"a token it does not accept, from {self._token_from}"
            )
            return (
                f"this node presented {presented}: set peer_token_file "
                "($EDGECACHE_PEER_TOKEN_FILE) on this node to the peer's read token"
            )
        if code == "PERMISSION_DENIED":
            return (
                f"the peer knows this node's token (from {self._token_from}) but does not let "
                "it read shards: set peer_token_file ($EDGECACHE_PEER_TOKEN_FILE) on this node "
                "to the peer's read token"
            )
        if received:  # it sent chunks: the connection itself (TLS or not) was right
            return None
        return _tls_hint(peer, details, has_cert=self.config.tls_cert is not None)

    async def _names(self, peers: Sequence[str]) -> dict[str, str]:
        """Peer → the id it reports: the owner of a shard is asked first, as staged there.

        Ranked by the addresses this node was given, half of a two-replica
        region's shards were asked of the replica that does not hold them first
        (a refused call each, and a note on every warm). Each peer is asked once;
        one that cannot say (down, an old node) keeps its address, and is asked
        again after :data:`NAME_RETRY_SECONDS`.
        """
        loop = asyncio.get_running_loop()

        async def ask(peer: str) -> None:
            try:
                async with self.channel(peer) as channel:
                    status = await edge_pb2_grpc.EdgeCacheStub(channel).Status(
                        edge_pb2.StatusRequest(), metadata=self._metadata, timeout=NAME_TIMEOUT
                    )
            except (grpc.RpcError, ValueError):
                status = None
            if status is not None and status.node_id:
                self._ids[peer] = status.node_id
            else:
                self._unnamed[peer] = loop.time()

        now = loop.time()
        unknown = [
            p
            for p in peers
            if p not in self._ids
            and now - self._unnamed.get(p, -NAME_RETRY_SECONDS) >= NAME_RETRY_SECONDS
        ]
        for peer in unknown:  # shards copied at once share the question
            if peer not in self._asking:
                task = asyncio.ensure_future(ask(peer))
                self._asking[peer] = task
                task.add_done_callback(functools.partial(self._asked, peer))
        waiting = [self._asking[p] for p in unknown if p in self._asking]
        if waiting:
            await asyncio.gather(*(asyncio.shield(t) for t in waiting))
        return rendezvous.unique_names({p: self._ids[p] for p in peers if p in self._ids})

    def _asked(self, peer: str, _: asyncio.Future[None]) -> None:
        self._asking.pop(peer, None)

    async def _stream(self, peer: str, copy: _Copy) -> None:
        """Append the peer's verified chunks to ``copy``, from the first one it lacks."""
        manifest = copy.manifest
        request = edge_pb2.ReadShardRequest(
            dataset=manifest.dataset,
            version=manifest.version,
            shard=copy.shard,
            digest=manifest.digest,
            start_chunk=len(copy.frames),
            cached_only=True,
        )
        async with self.channel(peer) as channel:
            call = channel.unary_stream(
                READ_SHARD_METHOD,
                request_serializer=edge_pb2.ReadShardRequest.SerializeToString,
                response_deserializer=parse_chunk,
            )(request, metadata=self._metadata)
            await self._receive(call, copy)

    async def _receive(self, call: aio.UnaryStreamCall, copy: _Copy) -> None:
        """Append ``call``'s verified chunks to ``copy`` (see :meth:`_stream`)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()  # when this peer was asked
        received = chunks = 0  # frame bytes and chunks it gave since
        try:
            stream = call.__aiter__()
            while True:
                # The next chunk must come within STALL_SECONDS, and soon enough that the
                # average since asking stays at MIN_PEER_RATE once the grace period is over.
                rate_bound = max(RATE_GRACE_SECONDS, received / MIN_PEER_RATE) - (
                    loop.time() - asked
                )
                too_slow = rate_bound < STALL_SECONDS
                try:
                    if rate_bound <= 0:
                        raise TimeoutError
                    chunk = await asyncio.wait_for(
                        stream.__anext__(), min(STALL_SECONDS, rate_bound)
                    )
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if too_slow:
                        raise _PeerTooSlow(received, loop.time() - asked, chunks) from None
                    raise ChunkCorrupt(f"no chunk for {STALL_SECONDS:.0f} s") from None
                copy.add(chunk)
                received += len(chunk.frame)  # type: ignore[attr-defined]
                chunks += 1
            if not copy.complete():
                raise ChunkCorrupt(
                    f"the stream ended after {len(copy.frames)} of {copy.chunk_count} chunks "
                    f"({copy.rows} of {copy.expected_rows} rows)"
                )
        finally:
            call.cancel()


def _loopback(target: str) -> bool:
    """Whether ``host:port`` names this host's loopback (a token sent there stays here)."""
    try:
        host, _ = split_hostport(target)
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is across the network


def _optional_pem(path: Path | None, setting: str) -> bytes | None:
    return None if path is None else read_pem(path, setting)


def rpc_status(exc: BaseException) -> tuple[str, str]:
    """(status code name, details) of a failed call to a peer; ``ERROR`` and the text if none."""
    name = exc.code().name if callable(getattr(exc, "code", None)) else "ERROR"  # type: ignore[attr-defined]
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)  # type: ignore[attr-defined]
    return name, details or ""


def refuses_configuration(peer: str, code: str, details: str) -> bool:
    """Whether a peer's failure (before any chunk) stands on this node's configuration.

    A token the peer does not take (UNAUTHENTICATED, PERMISSION_DENIED), or a TLS
    handshake that the TLS library failed on what was presented (``SSL_ERROR_SSL``:
    a certificate this node does not trust or that does not name the peer, TLS
    against a plaintext port) is refused the same way on every try until a
    setting changes. A connection closed during the handshake ("Socket closed":
    a peer with --tls-client-ca refusing this node's certificate, or TLS spoken
    to by plaintext) is not counted: a peer going away mid-connect looks the
    same, and retrying that one may work.
    """
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return True
    if code != "UNAVAILABLE" or not peer.startswith("grpcs://"):
        return False
    return "Hostname Verification" in details or (
        "Tls handshake failed" in details and "SSL_ERROR_SSL" in details
    )


def _tls_hint(peer: str, details: str, *, has_cert: bool = True) -> str | None:
    """What to set on this node when a peer's TLS refused it, from gRPC's last error.

    gRPC says only UNAVAILABLE; the cause is on this node's side (whom it
    trusts, which certificate it presents), so retrying cannot help. ``has_cert``:
    this node has a certificate (--tls-cert) to present to a peer that asks for one.
    """
    if not peer.startswith("grpcs://"):
        if "Socket closed" in details:
            return "if the peer serves TLS, name it grpcs://host:port"
        return None
    if ("Socket closed" in details or "Connection reset" in details) and not has_cert:
        return (
            "the peer closed the connection: a peer with --tls-client-ca asks for a client "
            "certificate, and this node presents none: set --tls-cert and --tls-key on this "
            "node (a certificate the peer's --tls-client-ca signed, allowing client "
            "authentication, extended key usage clientAuth)"
        )
    if "Socket closed" in details or "Connection reset" in details:
        return (
            "the peer closed the connection: a peer with --tls-client-ca refuses this node's "
            "certificate (--tls-cert, presented as a client certificate) unless the CA of "
            "that flag signed it and it allows client authentication (extended key usage "
            "clientAuth as well as serverAuth)"
        )
    if "WRONG_VERSION_NUMBER" in details:
        return "the peer does not speak TLS: name it host:port, not grpcs://"
    if "Hostname Verification" in details:
        return "the peer's certificate does not name the host this node dials it by"
    if "Tls handshake failed" in details:
        return (
            "this node does not trust the peer's certificate: set peer_tls_ca "
            "($EDGECACHE_PEER_TLS_CA) to the CA that signed it"
        )
    return None


class _PeerMisbehaved(ChunkCorrupt):
    """A peer sent what no shard can be: too many chunks, a chunk of no rows, too many bytes."""


class _ChunkedDifferently(Exception):
    """A peer's chunks do not continue the ones already received."""


class _PeerTooSlow(Exception):
    """A peer gave a shard more slowly than MIN_PEER_RATE on average, past the grace period.

    A stall bound alone (STALL_SECONDS without a chunk) lets a peer that sends
    one small chunk every 29 s hold a shard copy for hours, while origin or the
    next peer could have given it in seconds. Staging has a deadline, so what an
    operator expects of a peer copy is a bounded time for the shard's size.

    The bound is a floor on the average rate of the copy from one peer: bytes
    received from it over the time since it was asked, checked continuously
    (the wait for the next chunk ends when the average would drop below the
    floor). A floor rather than a fixed deadline, because shards differ in size
    (a deadline either cuts large shards on a healthy link or lets small ones
    drip); the average over the whole copy rather than over each gap, because
    gRPC delivers whole chunks (up to several MiB) at once, so a healthy but
    modest link looks bursty chunk by chunk. The grace period covers connecting
    and the first chunk. The floor, 2 Mbit/s, is far below what a peer link is
    worth using for (origin is the alternative, and staging runs several shards
    at once over the link), so a healthy but busy peer is not left; a peer
    dripping a small chunk every 29 s is left about 30 s after it was asked. A peer that stays
    just above the floor still finishes a shard within its size / 256 KiB/s.
    """

    def __init__(self, received: int, seconds: float, chunks: int) -> None:
        rate = received / seconds / 1024 if seconds > 0 else 0.0
        super().__init__(
            f"was too slow: {rate:.1f} KiB/s on average ({chunks} chunks, {received} bytes "
            f"in {seconds:.1f} s), below the floor of {MIN_PEER_RATE / 1024:.0f} KiB/s "
            f"after {RATE_GRACE_SECONDS:.0f} s"
        )


class _Copy:
    """The chunks of one shard received so far, each checked before it is kept."""

    def __init__(self, manifest: manifest_pb2.Manifest, shard: int) -> None:
        self.manifest, self.shard = manifest, shard
        self.expected_rows = manifest.shards[shard].row_count
        self.byte_limit = copy_byte_limit(manifest.shards[shard])
        self.givers: list[str] = []
        self.reset()

    def reset(self) -> None:
        """Forget what was received (a peer that chunks differently starts over)."""
        self.frames: list[bytes | memoryview] = []
        self.chunk_count: int | None = None
        self.rows = 0
        self.received = 0  # bytes of the frames kept
        self.givers = []

    def add(self, chunk: object) -> None:
        """Verify one received chunk and keep it; ChunkCorrupt if it is wrong."""
        index, count = chunk.index, chunk.chunk_count  # type: ignore[attr-defined]
        if count > self.expected_rows:  # every chunk holds at least one row
            raise _PeerMisbehaved(
                f"announced {count} chunks for a shard of {self.expected_rows} rows (every "
                "chunk holds at least one row)"
            )
        if self.chunk_count is None:
            self.chunk_count = count
        if count != self.chunk_count or index != len(self.frames):
            if self.frames and index == len(self.frames):
                raise _ChunkedDifferently
            raise ChunkCorrupt(
                f"chunk {index} of {count} does not follow chunk {len(self.frames) - 1} "
                f"of {self.chunk_count}"
            )
        frame = chunk.frame  # type: ignore[attr-defined]
        if self.received + len(frame) > self.byte_limit:
            raise _PeerMisbehaved(
                f"sent more than {self.byte_limit} bytes for a shard of {self.expected_rows} "
                f"rows at chunk {index} (the bound for a shard of this size: see "
                "edgecache.edge.peers.copy_byte_limit)"
            )
        try:
            header = verify_frame(frame)  # ChunkCorrupt (or ChunkTruncated) when damaged
        except ChunkCorrupt as exc:
            # verify_frame's advice ("drop the entry") is for whoever stored it; here the
            # chunk is dropped, and the shard taken from the next peer or origin.
            raise ChunkCorrupt(
                f"chunk {index} arrived damaged (on the peer or in transit): "
                f"{str(exc).split(';')[0]}"
            ) from exc
        if header.checksum != chunk.checksum or header.rows != chunk.rows:  # type: ignore[attr-defined]
            raise ChunkCorrupt(f"chunk {index}: checksum or rows differ from the frame's")
        if header.rows == 0:  # the encoder never writes one: it would never end
            raise _PeerMisbehaved(f"sent chunk {index} with no rows")
        if self.rows + header.rows > self.expected_rows:
            raise _PeerMisbehaved(
                f"sent chunk {index} ending at row {self.rows + header.rows}, past the "
                f"shard's {self.expected_rows} rows"
            )
        if chunk.first_row != self.rows:  # type: ignore[attr-defined]
            raise ChunkCorrupt(f"chunk {index} starts at row {chunk.first_row}, not {self.rows}")  # type: ignore[attr-defined]
        self.frames.append(frame)
        self.rows += header.rows
        self.received += len(frame)

    def complete(self) -> bool:
        """Whether every chunk and row is here."""
        return (
            self.chunk_count is not None
            and len(self.frames) == self.chunk_count
            and self.rows == self.expected_rows
        )
