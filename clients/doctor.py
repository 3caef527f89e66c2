"""``edgecache doctor``: the network path from this host to every node, and its TCP settings.

Measured against the baselines operators use: RTT (in-region < 5 ms,
cross-region < 50 ms), jitter < 2 ms, loss < 0.1 %, a short bounded
throughput test per node, and this host's congestion control and socket
buffer limits against the bandwidth-delay product of the slowest link.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from edgecache.clients.channels import bearer, health_pings, open_channel
from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.topology import Topology
from edgecache.v1 import edge_pb2, edge_pb2_grpc

__all__ = ["HostCheck", "PathCheck", "check_host", "check_paths"]

RTT_IN_REGION_MS, RTT_CROSS_REGION_MS, JITTER_MS, LOSS = 5.0, 50.0, 2.0, 0.001


@dataclass
class PathCheck:
    """What this host sees of one node."""

    region: str
    node: str
    rtt_ms: float | None
    jitter_ms: float | None
    loss: float
    throughput_mb_s: float | None
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        return asdict(self)


def check_paths(
    topology: Topology,
    *,
    home_region: str | None,
    pings: int = 20,
    throughput_seconds: float = 2.0,
    token: str | None = None,
) -> list[PathCheck]:
    """Ping every node (gRPC health checks) and read from it for a bounded time."""
    out = []
    for region, config in topology.regions.items():
        for node in config.nodes:
            channel = open_channel(parse_endpoint(node))
            result = health_pings(channel, pings=pings, timeout=1.0)
            rtt, jitter = result.rtt_ms, result.jitter_ms
            check = PathCheck(region, node, rtt, jitter, result.lost / pings, None)
            if result.samples_ms:
                check.throughput_mb_s = _throughput(channel, throughput_seconds, bearer(token))
            channel.close()
            limit = RTT_IN_REGION_MS if region == home_region else RTT_CROSS_REGION_MS
            if rtt is None:
                check.problems.append("unreachable")
            elif rtt > limit:
                check.problems.append(f"RTT {rtt:.1f} ms > {limit:.0f} ms")
            if jitter is not None and jitter > JITTER_MS:
                check.problems.append(f"jitter {jitter:.1f} ms > {JITTER_MS:.0f} ms")
            if check.loss > LOSS:
                check.problems.append(f"loss {check.loss:.1%} > {LOSS:.1%}")
            out.append(check)
    return out


def _throughput(
    channel: grpc.Channel, seconds: float, metadata: tuple[tuple[str, str], ...] | None
) -> float | None:
    """MB/s reading the node's own cached shards for at most ``seconds`` (None if none).

    Only shards the node holds are asked for (``cached_only``): a read test
    must neither fetch from origin nor ask for shards that do not exist.
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
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED):
                break  # a replica holds only its own shards: the others are skipped
    elapsed = time.perf_counter() - started
    return received / elapsed / 1e6 if received else None


@dataclass
class HostCheck:
    """The host's TCP settings against the slowest link's bandwidth-delay product."""

    congestion_control: str
    rmem_max: int
    wmem_max: int
    bdp_bytes: int
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


def check_host(paths: list[PathCheck], topology: Topology) -> HostCheck:
    """Congestion control and buffer limits, with the sysctl lines that would fix them."""
    rtts = [p.rtt_ms for p in paths if p.rtt_ms is not None]
    rates = [c.origin_bandwidth for c in topology.regions.values() if c.origin_bandwidth] + [
        p.throughput_mb_s * 1e6 for p in paths if p.throughput_mb_s
    ]
    bandwidth = max(rates, default=1.25e9)  # bytes/s; 10 Gbit/s when nothing is known
    bdp = int(bandwidth * (max(rtts, default=1.0) / 1e3))
    check = HostCheck(
        congestion_control=_sysctl("net.ipv4.tcp_congestion_control") or "unknown",
        rmem_max=int(_sysctl("net.core.rmem_max") or 0),
        wmem_max=int(_sysctl("net.core.wmem_max") or 0),
        bdp_bytes=bdp,
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
