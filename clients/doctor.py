"""``edgecache doctor``: the network paths to every node, from here and from the nodes.

Measured against the baselines operators use: RTT (in-region < 5 ms,
cross-region < 50 ms), jitter < 2 ms, loss < 0.1 %, throughput, and this
host's congestion control and socket buffer limits against the
largest bandwidth-delay product of a path. Loss is TCP's: the share of
segments retransmitted during a multi-stream upload into each node's
``Sink`` (this host is the sender, so its kernel knows;
:mod:`edgecache.cache.tcp_stats`); twenty pings could never resolve 0.1 %.
With ``node_paths`` the nodes measure their own paths to origin (where shard
data is), to the registry (where manifests are) and to their peer regions'
nodes (``Diagnose``), so a slow origin link is found where it is. Each
node's registry (its ``Status``) is checked against the topology's: a node
that reads another answers everything else normally.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.cache import tcp_stats
from edgecache.cache.registry_match import RegistryMatch, check_registry
from edgecache.cache.sink_sizing import SINK_PART, smaller_part, too_large, too_many_streams
from edgecache.clients.channels import bearer, describe, explain, health_pings, open_channel
from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.ops import (
    NodeReport,
    copies_not_checked,
    registry_digests,
    state_problems,
)
from edgecache.clients.topology import Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = [
    "TLS_REFUSED",
    "UNREACHABLE",
    "HostCheck",
    "NodePath",
    "PathCheck",
    "check_host",
    "check_node_paths",
    "check_paths",
]

RTT_IN_REGION_MS, RTT_CROSS_REGION_MS, JITTER_MS, LOSS = 5.0, 50.0, 2.0, 0.001
# How a path's problem starts when no health check got through: the CLI's exit code
# tells a node away (1) from a TLS setting of this command (2) by them.
UNREACHABLE, TLS_REFUSED = "unreachable", "TLS refused"
UNKNOWN_RATE = 1.25e9  # bytes/s a path is taken to carry when nothing says: 10 Gbit/s


@dataclass
class PathCheck:
    """What this host sees of one node."""

    region: str
    node: str
    rtt_ms: float | None
    jitter_ms: float | None
    ping_loss: float  # health checks that failed
    throughput_mb_s: float | None  # reading cached shards, one stream
    upload_mb_s: float | None = None  # several streams into the node's Sink
    streams: int = 0
    segments_sent: int = 0
    segments_retransmitted: int = 0
    loss: float | None = None  # retransmitted / sent during the upload (None: unknown)
    # The registry the node says it reads (None: it did not say, or did not answer), and
    # how it compares with the topology's (RegistryMatch's value; None: not asked).
    registry: str | None = None
    registry_match: str | None = None
    node_id: str | None = None  # as the node reports it (None: it did not say)
    # The path's propagation delay for its bandwidth-delay product: TCP's own least
    # round trip on the upload's connections (``ss``'s minrtt), else the least health
    # check's. The median RTT above holds a busy host's scheduling and gRPC's work.
    min_rtt_ms: float | None = None
    problems: list[str] = field(default_factory=list)
    # What may be wrong but need not be (a registry's local path that differs): no failure.
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        return asdict(self)


def check_paths(
    topology: Topology,
    *,
    home_region: str | None,
    pings: int = 20,
    throughput_seconds: float = 2.0,
    streams: int = 4,
    token: str | None = None,
) -> list[PathCheck]:
    """Ping every node, read from it, and upload into it on ``streams`` streams."""
    out = []
    reports: list[NodeReport] = []  # what the nodes that answered Status said
    for region, config in topology.regions.items():
        for node in config.nodes:
            channel = open_channel(parse_endpoint(node))
            result = health_pings(channel, pings=pings, timeout=1.0)
            rtt, jitter = result.rtt_ms, result.jitter_ms
            check = PathCheck(region, node, rtt, jitter, result.lost / pings, None)
            check.min_rtt_ms = result.min_rtt_ms
            if result.samples_ms:
                if report := _check_status(check, channel, topology.registry, bearer(token)):
                    reports.append(report)
                check.throughput_mb_s = _throughput(
                    check, channel, throughput_seconds / 2, bearer(token)
                )
                _upload(check, channel, throughput_seconds / 2, streams, bearer(token))
            channel.close()
            limit = RTT_IN_REGION_MS if region == home_region else RTT_CROSS_REGION_MS
            if rtt is None and result.tls_refused:
                # A CA, a certificate or the scheme to set (the error says which), not a node
                # away: as status says it, and bad input, not a failure (the CLI's exit 2).
                check.problems.append(f"{TLS_REFUSED}: {result.error}")
            elif rtt is None:
                check.problems.append(UNREACHABLE + (f": {result.error}" if result.error else ""))
            elif rtt > limit:
                check.problems.append(f"RTT {rtt:.1f} ms > {limit:.0f} ms")
            if jitter is not None and jitter > JITTER_MS:
                check.problems.append(f"jitter {jitter:.1f} ms > {JITTER_MS:.0f} ms")
            if check.loss is not None and _surely_above(check, LOSS):
                check.problems.append(f"loss {check.loss:.2%} > {LOSS:.1%} (TCP retransmissions)")
            elif check.ping_loss > LOSS:
                check.problems.append(f"{check.ping_loss:.0%} of health checks failed")
            out.append(check)
    # Over every node at once: two nodes of a region reporting one id is a problem of both.
    digests = registry_digests(topology.registry, reports)
    problems = state_problems(reports, digests, topology.registry)
    answered = {r.address for r in reports}
    for check in out:
        check.problems += problems.get(check.node, [])
        if digests is None and check.node in answered:
            check.warnings.append(copies_not_checked(topology.registry, "the node's"))
    return out


def _check_status(
    check: PathCheck,
    channel: grpc.Channel,
    registry: str,
    metadata: tuple[tuple[str, str], ...] | None,
) -> NodeReport | None:
    """Check the node's registry against the topology's; its report, for :func:`state_problems`.

    Another object-store URL is a problem: the node answers everything but
    finds none of the versions published where this topology looks. A
    ``file://`` path that differs is a warning (the same folder may be mounted
    at another path where the node runs: :func:`check_registry`). A node that
    does not say (older than ``NodeStatus.registry``), or refuses ``Status``,
    is not judged.
    """
    try:
        status = edge_pb2_grpc.EdgeCacheStub(channel).Status(
            edge_pb2.StatusRequest(), timeout=3, metadata=metadata
        )
    except grpc.RpcError as exc:
        if exc.code() in _NODE_FAILED:  # no other test says it: it failed inside
            check.problems.append(f"Status failed: {_failed_inside(exc)}")
        return None  # a node that refuses Status (its token): its other tests say why
    check.node_id = status.node_id or None
    found = check_registry(check.node, registry, status.registry)
    check.registry = found.theirs or None
    check.registry_match = found.match.value
    if found.match is RegistryMatch.DIFFERS:
        check.problems.append(f"another registry: {found.message()}")
    elif found.match is RegistryMatch.PATH_DIFFERS:
        check.warnings.append(f"the registry's path differs: {found.message()}")
    return NodeReport(check.region, check.node, True, status=status)


def _surely_above(check: PathCheck | NodePath, limit: float) -> bool:
    """Whether the retransmission rate is above ``limit`` beyond its counting noise.

    Retransmissions are rare events (a tail-loss probe counts as one, even on
    loopback): ``k`` of ``n`` segments is taken as above the limit only when
    ``k`` minus two standard deviations (Poisson, √k) still is.
    """
    sent = check.segments_sent
    retransmitted = check.segments_retransmitted
    return sent > 0 and (retransmitted - 2 * retransmitted**0.5) / sent > limit


def _sink_part(
    sink: grpc.StreamUnaryMultiCallable, metadata: tuple[tuple[str, str], ...] | None
) -> tuple[int, grpc.RpcError | None]:
    """The upload message size the node accepts: ``SINK_PART``, or less under its limit.

    One message is sent first; a node whose ``max_request_bytes`` is lower
    refuses it naming its limit, and the upload is then sized to fit it.
    Returns 0 and the refusal when no size is accepted (or the call failed
    for another reason).
    """
    part = SINK_PART
    while True:
        try:
            sink(iter([edge_pb2.SinkChunk(data=bytes(part))]), timeout=10, metadata=metadata)
            return part, None
        except grpc.RpcError as exc:
            if (smaller := smaller_part(part, exc)) is None:
                return 0, exc
            part = smaller


def _limit_named(exc: grpc.RpcError) -> str:
    """``describe(exc)``, with the node's setting that refused the upload when one did."""
    text = describe(exc)
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return text
    if too_large(exc):
        return f"{text} (the node's max_request_bytes is too low for an upload test)"
    if too_many_streams(exc):
        return (
            f"{text} (the node's max_streams, its limit on concurrent calls, was reached: "
            "run the doctor with fewer --streams or when the node is less busy, or raise "
            "the node's max_streams)"
        )
    return text


def _upload(
    check: PathCheck,
    channel: grpc.Channel,
    seconds: float,
    streams: int,
    metadata: tuple[tuple[str, str], ...] | None,
) -> None:
    """Upload into the node's Sink on ``streams`` streams; TCP's loss on the way.

    Messages are sized to what the node accepts (its ``max_request_bytes``);
    streams its ``max_streams`` refuses are left out, and the check says on
    how many of them the upload was measured.
    """
    sink = edge_pb2_grpc.EdgeCacheStub(channel).Sink
    part, refusal = _sink_part(sink, metadata)
    if refusal is not None:
        check.problems.append(f"upload test refused: {_limit_named(refusal)}")
        return
    chunk = edge_pb2.SinkChunk(data=os.urandom(part))
    deadline = time.monotonic() + seconds
    moved: list[int] = []
    errors: list[grpc.RpcError] = []

    def one() -> None:
        def chunks():  # noqa: ANN202 - a generator for grpc
            while time.monotonic() < deadline:
                yield chunk

        try:
            moved.append(sink(chunks(), timeout=seconds + 30, metadata=metadata).bytes)
        except grpc.RpcError as exc:
            errors.append(exc)

    target = parse_endpoint(check.node).target
    with tcp_stats.Watch(target) as watch:
        started = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
    if errors and not moved:
        check.problems.append(f"upload test refused: {_limit_named(errors[0])}")
        return
    if errors:
        # A call over max_streams is refused at once; racing the stream's first message,
        # the refusal can arrive as INTERNAL: the limit is named either way.
        telling = next((e for e in errors if too_many_streams(e)), errors[0])
        why = _limit_named(telling)
        if not too_many_streams(telling):
            why += " (a node refuses the calls beyond its max_streams)"
        check.problems.append(
            f"{len(moved)} of {streams} upload streams were accepted, and the upload "
            f"measured on them; the others were refused: {why}"
        )
    change = watch.delta()
    check.streams = len(moved)
    check.upload_mb_s = sum(moved) / elapsed / 1e6 if elapsed else None
    check.segments_sent, check.segments_retransmitted = change.segments_out, change.retransmitted
    # Below a few thousand segments one retransmission is more than 0.1 %: no verdict.
    check.loss = change.loss if change.segments_out >= 2000 else None
    if change.min_rtt_ms is not None:
        check.min_rtt_ms = change.min_rtt_ms


@dataclass
class NodePath:
    """What a node measured of its own path to origin, the registry or a peer node."""

    region: str
    node: str
    target: str  # "origin", "registry", or the peer node's address
    rtt_ms: float | None
    mb_s: float | None
    loss: float | None
    segments_sent: int
    segments_retransmitted: int = 0
    note: str = ""
    problems: list[str] = field(default_factory=list)
    kind: str = "peer"  # "origin" (shard data), "registry" (manifests) or "peer"
    code: str | None = None  # the status code when the node could not measure

    @property
    def label(self) -> str:
        """What the path leads to, as the text table says it."""
        return _LABELS.get(self.kind, f"peer {self.target}")

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        return asdict(self)


# Origin and the registry are separate paths, often other schemes, endpoints or
# accounts (edge/diagnose.py): the table says which is which.
_LABELS = {"origin": "origin (shard data)", "registry": "registry (manifests)"}


def check_node_paths(
    topology: Topology, *, seconds: float = 4.0, streams: int = 4, token: str | None = None
) -> list[NodePath]:
    """Each region's first node measures its path to origin, the registry and each peer region.

    Origin (a held version's shard data) and the registry (manifests) are
    measured apart, each through the node's own store for it. ``Diagnose`` is
    an admin call: the node uploads scratch objects to origin, the registry
    and into peers, so it needs the admin token.
    """
    out = []
    for region, config in topology.regions.items():
        node = config.nodes[0]
        targets = [("origin", "origin"), ("registry", "registry")] + [
            (topology.regions[peer].nodes[0], "peer")
            for peer in config.peers
            if peer in topology.regions
        ]
        channel = open_channel(node)
        stub = edge_pb2_grpc.EdgeCacheStub(channel)
        unreachable = _unreachable(channel)
        for target, kind in targets:
            if unreachable is not None:  # no node to ask: each path says so, none waits
                path = NodePath(region, node, target, None, None, None, 0, kind=kind)
                path.code = unreachable.code().name
                path.problems.append(
                    f"could not measure: this host cannot reach the node ({describe(unreachable)})"
                    ": see its row in the paths from this host, and check that it runs "
                    "(edgecache status)"
                )
                out.append(path)
                continue
            request = edge_pb2.DiagnoseRequest(target=target, seconds=seconds, streams=streams)
            try:
                reply = stub.Diagnose(request, timeout=seconds * 3 + 30, metadata=bearer(token))
            except grpc.RpcError as exc:
                path = NodePath(region, node, target, None, None, None, 0, kind=kind)
                path.code = exc.code().name
                path.problems.append(_not_measured(exc, target, kind))
                out.append(path)
                continue
            loss = (
                reply.segments_retransmitted / reply.segments_sent
                if reply.segments_sent >= 2000
                else None
            )
            path = NodePath(
                region,
                node,
                target,
                reply.rtt_ms or None,
                reply.bytes_per_second / 1e6 if reply.bytes_per_second else None,
                loss,
                reply.segments_sent,
                reply.segments_retransmitted,
                reply.note,
                kind=kind,
            )
            if loss is not None and _surely_above(path, LOSS):
                path.problems.append(f"loss {loss:.2%} > {LOSS:.1%} (TCP retransmissions)")
            out.append(path)
        channel.close()
    return out


def _unreachable(channel: grpc.Channel) -> grpc.RpcError | None:
    """The failure of a health check when this host cannot reach the node; else None.

    Asked before the node's tests: a node that cannot be reached fails each of
    them the same way, and one that does not answer would take each Diagnose's
    whole deadline (3 × --seconds + 30 s per path).
    """
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return exc
    return None


def _not_measured(exc: grpc.RpcError, target: str, kind: str) -> str:
    """Why a node could not measure a path: the status, the node's message, what to do.

    The admin token is the cause only when the node said so (UNAUTHENTICATED,
    PERMISSION_DENIED); a test that hung or failed on the node is said as
    itself, with the action for it.
    """
    code = exc.code()
    said = f"{code.name}: {exc.details() or ''}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            "could not measure: the node's admin token is needed (Diagnose is an admin call): "
            f"pass it with --token-file or $EDGECACHE_TOKEN_FILE; the node said {said}"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return (
            "could not measure: the node takes this token for reads only; Diagnose needs its "
            f"admin token (--token-file or $EDGECACHE_TOKEN_FILE); the node said {said}"
        )
    what = f"the peer node {target}" if kind == "peer" else _LABELS[kind]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"could not measure: {said}; no answer in time: the node's test of its path to "
            f"{what} may hang (its log says where), or the node is overloaded"
        )
    if code == grpc.StatusCode.UNAVAILABLE and kind == "peer":
        # The node's own connection to the peer failed (this host reached the node: see
        # _unreachable); the node's message names the peer and gRPC's reason.
        return (
            f"could not measure: {said}; the node could not reach {what} or lost it during "
            f"the test: check that the peer runs (its row in the paths from this host) and "
            "that the node can reach it, then run the doctor again"
        )
    if code == grpc.StatusCode.INTERNAL and kind == "registry":
        # A node from before the "registry" target (bc17492) takes it for a peer's address,
        # fails dialling it and answers INTERNAL; a node that knows it catches the
        # registry's errors into its note, so INTERNAL there is a bug (its log has it).
        return (
            f"could not measure: {said}; the node probably does not know this target (a node "
            "older than this doctor measures origin and peers only, and takes 'registry' for "
            "a peer's address): upgrade it to measure its path to the registry; if it is up "
            "to date, its log says why"
        )
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and kind == "peer":
        # Nodes before the peer failure's own status answered every one this way.
        return (
            f"could not measure: {said}; the node failed testing its path to {what}: its "
            "log says why (the peer down or unreachable from the node, or refusing it: the "
            "node's peer_tls_ca, peer_token_file)"
        )
    return f"could not measure: {explain(exc)}"


# Codes of a call that failed inside the node (a bug, damage it could not handle): not the
# caller's doing and not a refusal, so no other test names them.
_NODE_FAILED = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS)


def _failed_inside(exc: grpc.RpcError) -> str:
    """A node's own failure, with where to look: its log holds the traceback."""
    return f"{exc.code().name}: {exc.details()}; the node's log says why"


def _throughput(
    check: PathCheck,
    channel: grpc.Channel,
    seconds: float,
    metadata: tuple[tuple[str, str], ...] | None,
) -> float | None:
    """MB/s reading the node's own cached shards for at most ``seconds`` (None if none).

    Only shards the node holds are asked for (``cached_only``): a read test
    must neither fetch from origin nor ask for shards that do not exist. A
    read that fails inside the node is one of ``check``'s problems: it ended
    the test without a word, and doctor gave the node a clean bill.
    """
    stub = edge_pb2_grpc.EdgeCacheStub(channel)
    try:
        status = stub.Status(edge_pb2.StatusRequest(), timeout=3, metadata=metadata)
    except grpc.RpcError:
        return None
    resident = [v for v in status.versions if v.shard_count]
    if not resident:
        return None
    version = max(resident, key=lambda v: v.stored_bytes)
    try:
        manifest = stub.GetManifest(
            edge_pb2.GetManifestRequest(dataset=version.dataset, version=version.version),
            timeout=3,
            metadata=metadata,
        )
    except grpc.RpcError:
        return None
    received, started = 0, time.perf_counter()
    for shard in range(len(manifest.shards)):
        if time.perf_counter() - started >= seconds:
            break
        request = edge_pb2.ReadShardRequest(
            dataset=version.dataset, version=version.version, shard=shard, cached_only=True
        )
        call = stub.ReadShard(request, timeout=seconds * 2, metadata=metadata)
        try:
            for chunk in call:
                received += len(chunk.frame)
                if time.perf_counter() - started > seconds:
                    call.cancel()
                    break
        except grpc.RpcError as exc:
            if exc.code() in _NODE_FAILED:
                check.problems.append(f"reading shard {shard} failed: {_failed_inside(exc)}")
                break
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED):
                break  # a replica holds only its own shards: the others are skipped
    elapsed = time.perf_counter() - started
    return received / elapsed / 1e6 if received else None


@dataclass
class HostCheck:
    """The host's TCP settings against the largest bandwidth-delay product of a path."""

    congestion_control: str
    rmem_max: int
    wmem_max: int
    bdp_bytes: int
    bdp_node: str | None = None  # the path it is of (None: no path answered)
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        return asdict(self)


def _sysctl(name: str) -> str:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return ""


def path_bdp(path: PathCheck, topology: Topology) -> int | None:
    """Bytes in flight that keep ``path`` full: its rate × its propagation delay.

    The rate is the fastest this host moved on the path (read or upload), else
    its region's configured origin bandwidth, else 10 Gbit/s; the delay is the
    path's least round trip (:attr:`PathCheck.min_rtt_ms`), as BBR estimates a
    BDP. Each path's own rate and delay: one path's bandwidth against another's
    RTT is no path's product.
    """
    if path.min_rtt_ms is None:
        return None
    measured = [r * 1e6 for r in (path.throughput_mb_s, path.upload_mb_s) if r]
    config = topology.regions.get(path.region)
    configured = config.origin_bandwidth if config is not None else None
    rate = max(measured) if measured else (configured or UNKNOWN_RATE)  # bytes/s
    return int(rate * path.min_rtt_ms / 1e3)


def check_host(paths: list[PathCheck], topology: Topology) -> HostCheck:
    """Congestion control and buffer limits, with the sysctl lines that would fix them."""
    products = [(b, p.node) for p in paths if (b := path_bdp(p, topology)) is not None]
    bdp, node = max(products, default=(int(UNKNOWN_RATE * 1e-3), None))  # × 1 ms: no path
    check = HostCheck(
        congestion_control=_sysctl("net.ipv4.tcp_congestion_control") or "unknown",
        rmem_max=int(_sysctl("net.core.rmem_max") or 0),
        wmem_max=int(_sysctl("net.core.wmem_max") or 0),
        bdp_bytes=bdp,
        bdp_node=node,
    )
    if check.congestion_control != "bbr":
        check.problems.append(
            f"congestion control is {check.congestion_control}; BBR keeps long fat links full"
        )
        check.fixes += [
            "sysctl -w net.core.default_qdisc=fq",
            "sysctl -w net.ipv4.tcp_congestion_control=bbr",
        ]
    # A socket buffer below twice the bandwidth-delay product caps a stream below the
    # link; the fix leaves room for faster links too (at least 16 MiB).
    needed = 2 * bdp
    wanted = max(needed, 16 << 20)
    for name, value in (
        ("net.core.rmem_max", check.rmem_max),
        ("net.core.wmem_max", check.wmem_max),
    ):
        if value < needed:
            check.problems.append(f"{name} = {value:,} B < 2 × BDP ({needed:,} B)")
            check.fixes.append(f"sysctl -w {name}={wanted}")
    if any(f.startswith("sysctl -w net.core.rmem_max") for f in check.fixes):
        check.fixes.append(f"sysctl -w net.ipv4.tcp_rmem='4096 131072 {wanted}'")
    if any(f.startswith("sysctl -w net.core.wmem_max") for f in check.fixes):
        check.fixes.append(f"sysctl -w net.ipv4.tcp_wmem='4096 16384 {wanted}'")
    return check
