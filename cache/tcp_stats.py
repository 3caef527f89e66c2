"""TCP's own counters for the connections to one peer: segments sent and retransmitted.

Loss on a path is what TCP retransmits, not what an RPC fails at: twenty
health checks cannot resolve 0.1 %, but the segments of a bulk transfer can.
The sender's kernel knows them (``tcp_info``: ``segs_out``, ``retrans``), so
whoever *sends* measures: the doctor for its upload to a node, a node for its
upload to a peer or to origin. Neither gRPC nor aiobotocore hands out their
sockets, so the counters are read from ``ss -ti`` (iproute2) for every
established connection to the peer, before and after a test; the difference
is the test's. Shared by nodes and clients, so it lives here.

Not every retransmission is a loss. A sender whose ACKs are late (a busy
receiver, a CPU-starved loopback peer) fires tail-loss probes and early
retransmits for segments that had arrived; the receiver answers each with a
D-SACK, which the kernel counts per connection (``dsack_dups``). Those are
subtracted: a loaded 2-core host showed 0.5 % "loss" on loopback, all of it
D-SACKed. A dropped segment is never D-SACKed, so real loss is kept whole.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

__all__ = ["SocketCounters", "TcpDelta", "available", "counters_to", "delta", "parse_ss"]

_SEGS_OUT = re.compile(r"\bsegs_out:(\d+)")
_RETRANS = re.compile(r"\bretrans:\d+/(\d+)")
_DSACK_DUPS = re.compile(r"\bdsack_dups:(\d+)")


@dataclass(frozen=True, slots=True)
class SocketCounters:
    """One connection's counters so far."""

    segments_out: int
    retransmitted: int
    spurious: int = 0  # retransmissions the receiver D-SACKed: they had arrived


@dataclass(frozen=True, slots=True)
class TcpDelta:
    """What the connections to a peer sent and lost between two readings.

    ``retransmitted`` counts only retransmissions of segments that had not
    arrived (D-SACKed ones are taken off).
    """

    segments_out: int
    retransmitted: int

    @property
    def loss(self) -> float | None:
        """Retransmitted / sent, or None when too little was sent to tell."""
        return self.retransmitted / self.segments_out if self.segments_out else None


def available() -> bool:
    """Whether ``ss`` (iproute2) is here to read TCP's counters."""
    return shutil.which("ss") is not None


def _normal(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        host = str(ip)
    except ValueError:
        pass
    return host, int(port)


def _addresses(target: str) -> set[tuple[str, int]]:
    """``host:port`` as the IP addresses its connections show (a name is resolved)."""
    host, port = _normal(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return {(host, port)}
    return {_normal(f"[{info[4][0]}]:{port}") for info in infos} | {(host, port)}


def counters_to(target: str) -> dict[tuple[str, str], SocketCounters]:
    """Per established connection to ``target`` (``host:port``): its counters now."""
    if not available():
        return {}
    wanted = _addresses(target)
    out = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10
    ).stdout
    return parse_ss(out, wanted)


def parse_ss(out: str, wanted: set[tuple[str, int]]) -> dict[tuple[str, str], SocketCounters]:
    """``ss -tinH`` output → the counters of each connection whose peer is in ``wanted``."""
    found: dict[tuple[str, str], SocketCounters] = {}
    lines = out.splitlines()
    for head, detail in zip(lines[::2], lines[1::2], strict=False):
        fields = head.split()
        if len(fields) < 4:
            continue
        local, peer = fields[-2], fields[-1]
        try:
            if _normal(peer) not in wanted:
                continue
        except ValueError:
            continue
        found[(local, peer)] = SocketCounters(
            _count(_SEGS_OUT, detail), _count(_RETRANS, detail), _count(_DSACK_DUPS, detail)
        )
    return found


def _count(pattern: re.Pattern[str], detail: str) -> int:
    found = pattern.search(detail)
    return int(found.group(1)) if found else 0


def delta(
    before: dict[tuple[str, str], SocketCounters], after: dict[tuple[str, str], SocketCounters]
) -> TcpDelta:
    """What happened between two readings (connections opened since count whole)."""
    sent = retrans = 0
    for key, now in after.items():
        then = before.get(key, SocketCounters(0, 0))
        sent += max(now.segments_out - then.segments_out, 0)
        lost = (now.retransmitted - then.retransmitted) - (now.spurious - then.spurious)
        retrans += max(lost, 0)
    return TcpDelta(sent, retrans)
