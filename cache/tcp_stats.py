"""TCP's own counters for the connections to one peer: segments sent and retransmitted.

Also the least round trip TCP measured on them (``minrtt``): the path's
propagation delay, which a bandwidth-delay product needs. A health check's
round trip is not it: on a busy host it holds the scheduling of both
processes and gRPC's own work (a loopback ping read 1-2 ms on a loaded CI
host while TCP's ``minrtt`` there is tens of microseconds).

Loss on a path is what TCP retransmits, not what an RPC fails at: twenty
health checks cannot resolve 0.1 %, but the segments of a bulk transfer can.
The sender's kernel knows them (``tcp_info``: ``segs_out``, ``retrans``), so
whoever *sends* measures: the doctor for its upload to a node, a node for its
upload to a peer or to origin. Neither gRPC nor aiobotocore hands out their
sockets, so the counters are read from ``ss -ti`` (iproute2) for every
connection to the peer, before, during and after a test; the difference is
the test's. Shared by nodes and clients, so it lives here.

A connection's counters die with it (a socket in TIME-WAIT keeps none), and
some servers close the connection after every request (moto's does, sending
``Connection: close``; many proxies do when busy): read only before and after,
such an upload counted nothing, since none of its connections was open at the
end. :class:`Watch` therefore reads every ``WATCH_EVERY`` seconds while the
test runs and keeps each connection's last counters; a connection that opens
and closes between two readings is missed, and what one sent after its last
reading too, so on such a server the loss is measured on a sample of the
test's segments, which is what a ratio needs.

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
import threading
from dataclasses import dataclass
from types import TracebackType

__all__ = [
    "WATCH_EVERY",
    "SocketCounters",
    "TcpDelta",
    "Watch",
    "available",
    "counters_to",
    "delta",
    "parse_ss",
]

WATCH_EVERY = 0.1  # seconds between a Watch's readings: an ``ss`` costs a few ms of CPU

_SEGS_OUT = re.compile(r"\bsegs_out:(\d+)")
_RETRANS = re.compile(r"\bretrans:\d+/(\d+)")
_DSACK_DUPS = re.compile(r"\bdsack_dups:(\d+)")
_MIN_RTT = re.compile(r"\bminrtt:([0-9.]+)")


@dataclass(frozen=True, slots=True)
class SocketCounters:
    """One connection's counters so far."""

    segments_out: int
    retransmitted: int
    spurious: int = 0  # retransmissions the receiver D-SACKed: they had arrived
    min_rtt_ms: float | None = None  # the least round trip TCP saw (None: not shown)


@dataclass(frozen=True, slots=True)
class TcpDelta:
    """What the connections to a peer sent and lost between two readings.

    ``retransmitted`` counts only retransmissions of segments that had not
    arrived (D-SACKed ones are taken off).
    """

    segments_out: int
    retransmitted: int
    min_rtt_ms: float | None = None  # the least of the connections' own (None: none shown)

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
    """Per connection to ``target`` (``host:port``): its counters now."""
    return _counters(_addresses(target))


def _counters(wanted: set[tuple[str, int]]) -> dict[tuple[str, str], SocketCounters]:
    """Per connection to one of the ``wanted`` addresses: its counters now.

    Every state but listening is read: a connection closing (FIN-WAIT, CLOSE-WAIT,
    LAST-ACK) still has its counters, and an upload's last segments are in them.
    """
    if not available():
        return {}
    out = subprocess.run(
        ["ss", "-tinH", "state", "connected"], capture_output=True, text=True, timeout=10
    ).stdout
    return parse_ss(out, wanted)


def parse_ss(out: str, wanted: set[tuple[str, int]]) -> dict[tuple[str, str], SocketCounters]:
    """``ss -tinH`` output → the counters of each connection whose peer is in ``wanted``.

    Each socket is a line of addresses and, indented below it, a line of counters
    (blank for one in TIME-WAIT, which keeps none).
    """
    found: dict[tuple[str, str], SocketCounters] = {}
    pairs: list[tuple[str, str]] = []
    for line in out.splitlines():
        if line[:1].isspace():
            if pairs and not pairs[-1][1]:
                pairs[-1] = (pairs[-1][0], line)
        elif line.strip():
            pairs.append((line, ""))
    for head, detail in pairs:
        fields = head.split()
        if len(fields) < 4:
            continue
        local, peer = fields[-2], fields[-1]
        try:
            if _normal(peer) not in wanted:
                continue
        except ValueError:
            continue
        min_rtt = _MIN_RTT.search(detail)
        found[(local, peer)] = SocketCounters(
            _count(_SEGS_OUT, detail),
            _count(_RETRANS, detail),
            _count(_DSACK_DUPS, detail),
            float(min_rtt.group(1)) if min_rtt else None,
        )
    return found


def _count(pattern: re.Pattern[str], detail: str) -> int:
    found = pattern.search(detail)
    return int(found.group(1)) if found else 0


def delta(
    before: dict[tuple[str, str], SocketCounters], after: dict[tuple[str, str], SocketCounters]
) -> TcpDelta:
    """What happened between two readings (connections opened since count whole).

    The least round trip is over the connections that sent anything between them.
    """
    sent = retrans = 0
    rtts = []
    for key, now in after.items():
        then = before.get(key, SocketCounters(0, 0))
        moved = max(now.segments_out - then.segments_out, 0)
        sent += moved
        lost = (now.retransmitted - then.retransmitted) - (now.spurious - then.spurious)
        retrans += max(lost, 0)
        if moved and now.min_rtt_ms is not None:
            rtts.append(now.min_rtt_ms)
    return TcpDelta(sent, retrans, min(rtts, default=None))


def _latest(
    seen: dict[tuple[str, str], SocketCounters], reading: dict[tuple[str, str], SocketCounters]
) -> None:
    """Fold a reading into ``seen``: counters only grow, so each connection keeps its highest.

    A connection in TIME-WAIT reads as zeros, and must not undo what it was seen to send.
    """
    for key, now in reading.items():
        then = seen.get(key)
        if then is None:
            seen[key] = now
        else:
            rtts = [r for r in (then.min_rtt_ms, now.min_rtt_ms) if r is not None]
            seen[key] = SocketCounters(
                max(then.segments_out, now.segments_out),
                max(then.retransmitted, now.retransmitted),
                max(then.spurious, now.spurious),
                min(rtts, default=None),
            )


class Watch:
    """The counters of the connections to ``target`` over a test, closed ones included.

    Use as ``with Watch(target) as watch: ...`` around the test, then
    :meth:`delta`. Readings run on a thread of their own (``ss`` is a subprocess),
    so an event loop in the test goes on meanwhile.
    """

    def __init__(self, target: str, every: float = WATCH_EVERY) -> None:
        self._every = every
        self._wanted = _addresses(target)  # resolved once, not at every reading
        self._before: dict[tuple[str, str], SocketCounters] = {}
        self._seen: dict[tuple[str, str], SocketCounters] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[tuple[str, str], SocketCounters]:
        return _counters(self._wanted)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                reading = self._read()
            except (OSError, subprocess.SubprocessError):
                continue  # one missed reading loses nothing: the next keeps the highest
            _latest(self._seen, reading)

    def __enter__(self) -> Watch:
        self._before = self._read()
        if available():
            self._thread = threading.Thread(target=self._run, name="tcp-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _latest(self._seen, self._read())

    def delta(self) -> TcpDelta:
        """What the connections to ``target`` sent and lost while watched."""
        return delta(self._before, self._seen)
