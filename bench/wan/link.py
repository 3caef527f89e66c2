"""The simulated wide-area link between origin and edge, set up and torn down here.

Two ways to build it, the first preferred:

* :class:`NamespaceLink`: two network namespaces, ``<prefix>o`` (origin)
  and ``<prefix>e`` (edge), joined by one veth pair with RFC 2544
  benchmarking addresses (198.18.0.1 origin, 198.18.0.2 edge). This kernel
  has no netem, so each property comes from its own tool, all inside the two
  namespaces:

  - rate: ``tc qdisc tbf`` on both veth ends (the bottleneck buffer is
    ``buffer_bytes``); GSO is off on both (``gso_max_segs 1``) so every
    packet is one segment, as on a real path: loss then hits segments, not
    64 KiB super-packets;
  - loss: iptables' ``statistic --mode random`` DROP on each side's INPUT
    (the xtables twin of nftables' ``numgen random``; iptables is needed
    anyway for the delay);
  - delay: every packet the edge sends across (requests and ACKs) goes to
    NFQUEUE and is held for the whole round trip by :mod:`bench.wan.delay`.
    TCP only ever sees round trips, and this way the data packets (twice as
    many) never pass through userspace;
  - congestion control: cubic on the link's routes (``congctl``), the
    Linux default and what most origins run; this host defaults to BBR,
    which shrugs off random loss and would flatter the link.

  Nothing on the host's own interfaces, routes or rules is touched; deleting
  the namespaces removes everything, and every process the benchmark starts
  runs inside one of them, so a teardown can find and end them all.

* :class:`ProxyLink`, when namespaces are not permitted (not root, no
  ``ip``/``iptables``): an asyncio TCP proxy on loopback in front of each
  origin port (:mod:`bench.wan.proxy`) that delays and rate-limits. It cannot
  drop packets, so TCP's loss recovery is not exercised: its figures are a
  stand-in, and the results say which link was used.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Link", "LinkSpec", "NamespaceLink", "ProxyLink", "open_link"]

REPO = Path(__file__).resolve().parents[2]
PREFIX = "ecwan"
ORIGIN_ADDRESS = "198.18.0.1"  # RFC 2544: reserved for benchmarking, never routed
EDGE_ADDRESS = "198.18.0.2"
DEVICE = "wan0"
QUEUE = 0


@dataclass(frozen=True)
class LinkSpec:
    """What the link should behave like."""

    rtt_ms: float = 80.0
    rate_mbit: float = 100.0
    loss: float = 0.001
    buffer_bytes: int = 500_000  # the bottleneck's queue: ~40 ms at 100 Mbit/s
    congestion_control: str = "cubic"

    @property
    def bytes_per_s(self) -> float:
        """The nominal rate in bytes per second (on the wire, headers included)."""
        return self.rate_mbit * 1e6 / 8


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


class Link(ABC):
    """A link between an origin side and an edge side, and how to run things on each."""

    kind: str
    spec: LinkSpec
    origin_host: str  # where origin-side servers listen

    @abstractmethod
    def origin_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on the origin side."""

    @abstractmethod
    def edge_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on the edge side."""

    @abstractmethod
    def expose(self, port: int) -> tuple[str, int]:
        """Where the edge side reaches an origin-side server on ``port``, across the link."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Link counters so far: packets and bytes each way, and packets dropped."""

    @abstractmethod
    def close(self) -> None:
        """End every process on the link and remove it; safe to call twice."""

    def describe(self) -> dict[str, object]:
        """The link as configured, for the results."""
        return {"kind": self.kind, **asdict(self.spec)}

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamespaceLink(Link):
    """Two network namespaces and a veth pair shaped with tbf, iptables and NFQUEUE."""

    kind = "netns"

    def __init__(self, spec: LinkSpec, *, name: str | None = None) -> None:
        self.spec = spec
        self.name = name or f"{PREFIX}{os.getpid()}"
        self.origin_ns, self.edge_ns = f"{self.name}o", f"{self.name}e"
        self.origin_host = ORIGIN_ADDRESS
        self._delay: subprocess.Popen[str] | None = None
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup

    def _ns(self, ns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", ns, *argv])

    def _build(self) -> None:
        spec = self.spec
        for ns in (self.origin_ns, self.edge_ns):
            _run(["ip", "netns", "add", ns])
        # Created straight into the namespaces: the pair never exists on the host.
        _run(
            ["ip", "link", "add", DEVICE, "netns", self.origin_ns, "type", "veth"]
            + ["peer", "name", DEVICE, "netns", self.edge_ns]
        )
        rate = f"{spec.rate_mbit:g}mbit"
        for ns, me in ((self.origin_ns, ORIGIN_ADDRESS), (self.edge_ns, EDGE_ADDRESS)):
            self._ns(ns, "ip", "link", "set", "lo", "up")
            self._ns(ns, "ip", "link", "set", DEVICE, "gso_max_segs", "1", "up")
            self._ns(ns, "ip", "addr", "add", f"{me}/30", "dev", DEVICE)
            self._ns(
                ns, "ip", "route", "replace", "198.18.0.0/30", "dev", DEVICE, "src", me,
                "congctl", spec.congestion_control,
            )  # fmt: skip
            self._ns(
                ns, "tc", "qdisc", "add", "dev", DEVICE, "root", "tbf", "rate", rate,
                "burst", "32kb", "limit", str(spec.buffer_bytes),
            )  # fmt: skip
            if spec.loss > 0:
                self._ns(
                    ns, "iptables", "-A", "INPUT", "-i", DEVICE, "-m", "statistic",
                    "--mode", "random", "--probability", f"{spec.loss:g}", "-j", "DROP",
                )  # fmt: skip
            self._ns(ns, "iptables", "-A", "INPUT", "-i", DEVICE)  # counts what got through
        self._ns(
            self.edge_ns, "iptables", "-A", "OUTPUT", "-o", DEVICE, "-j", "NFQUEUE",
            "--queue-num", str(QUEUE),
        )  # fmt: skip
        self._delay = subprocess.Popen(
            self.edge_command(
                [sys.executable, "-m", "bench.wan.delay", "--queue", str(QUEUE)]
                + ["--delay-ms", f"{spec.rtt_ms:g}"]
            ),
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self._delay.stdout is not None
        if self._delay.stdout.readline().strip() != "ready":
            raise RuntimeError("the NFQUEUE delay process did not start")

    # -------------------------------------------------------------- using it

    def origin_command(self, argv: Sequence[str]) -> list[str]:
        # ip netns exec execs the command: the process started is the command itself.
        return ["ip", "netns", "exec", self.origin_ns, *argv]

    def edge_command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.edge_ns, *argv]

    def expose(self, port: int) -> tuple[str, int]:
        return ORIGIN_ADDRESS, port

    def counters(self) -> dict[str, int]:
        # Each side's INPUT chain holds the DROP rule and, after it, a rule with no
        # target that only counts: together, every packet that arrived from the link.
        out: dict[str, int] = {}
        for ns, way in ((self.edge_ns, "to_edge"), (self.origin_ns, "to_origin")):
            listing = _run(["ip", "netns", "exec", ns, "iptables", "-L", "INPUT", "-v", "-x", "-n"])
            rows = [line.split() for line in listing.stdout.splitlines()[2:] if line.strip()]
            dropped = sum(int(r[0]) for r in rows if r[2] == "DROP")
            passed = [r for r in rows if r[2] != "DROP"]
            out[f"{way}_packets"] = sum(int(r[0]) for r in passed) + dropped
            out[f"{way}_bytes"] = sum(int(r[1]) for r in passed)
            out[f"{way}_dropped"] = dropped
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _end_namespaces([self.origin_ns, self.edge_ns])


def _end_namespaces(names: Sequence[str]) -> None:
    """SIGTERM, then SIGKILL, every process in the namespaces; then delete them."""
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    names = [n for n in names if n in existing]

    def pids() -> list[int]:
        found = []
        for ns in names:
            out = _run(["ip", "netns", "pids", ns], check=False).stdout
            found += [int(p) for p in out.split() if int(p) != os.getpid()]
        return found

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        targets = pids()
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while targets and time.monotonic() < deadline:
            time.sleep(0.05)
            targets = pids()
        if not targets:
            break
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> list[str]:
    """Remove this benchmark's namespaces left by runs that died (their pid is gone)."""
    listing = _run(["ip", "netns", "list"], check=False).stdout
    stale = []
    for ns in re.findall(rf"^({PREFIX}(\d+)[oe])\b", listing, re.M):
        name, pid = ns
        if not os.path.exists(f"/proc/{pid}"):
            stale.append(name)
    _end_namespaces(stale)
    return stale


class ProxyLink(Link):
    """Loopback only: one delaying, rate-limiting TCP proxy per exposed origin port."""

    kind = "proxy"

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.origin_host = "127.0.0.1"
        self._proxies: dict[int, tuple[subprocess.Popen[str], int]] = {}

    def origin_command(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def edge_command(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def expose(self, port: int) -> tuple[str, int]:
        if port not in self._proxies:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.wan.proxy",
                    "--target",
                    f"127.0.0.1:{port}",
                    "--rtt-ms",
                    f"{self.spec.rtt_ms:g}",
                    "--rate-mbit",
                    f"{self.spec.rate_mbit:g}",
                ],  # fmt: skip
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("listening on"):
                proc.kill()
                raise RuntimeError(f"the link proxy for port {port} did not start: {line!r}")
            self._proxies[port] = (proc, int(line.rsplit(":", 1)[1]))
        return "127.0.0.1", self._proxies[port][1]

    def counters(self) -> dict[str, int]:
        return {}  # the proxy's rate is set by its token bucket; it keeps no counters

    def close(self) -> None:
        for proc, _ in self._proxies.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._proxies.clear()


def namespaces_available() -> str | None:
    """None when namespaces can be used here; otherwise why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode:
        return f"ip netns add failed: {result.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def open_link(spec: LinkSpec, mode: str = "auto") -> tuple[Link, str]:
    """The link to measure over, and a note on why that kind was chosen."""
    if mode in ("auto", "netns"):
        why = namespaces_available()
        if why is None:
            sweep_stale()
            return NamespaceLink(spec), "network namespaces"
        if mode == "netns":
            raise RuntimeError(f"network namespaces are not available: {why}")
        return ProxyLink(spec), f"TCP proxy fallback ({why})"
    return ProxyLink(spec), "TCP proxy (asked for)"
