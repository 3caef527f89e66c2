"""The demo's nodes listen on loopback only: nothing it starts is reachable from the network.

The demo runs tokenless, plaintext nodes (it is a local tour); binding them
to 0.0.0.0 would hand anyone on the network an unauthenticated admin API.
This test runs ``edgecache demo`` and inspects every listening socket of
every process it starts, through /proc.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    for child in list(out):
        out |= _children(child)
    return out


def _listening(pid: int) -> set[tuple[IPAddress, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on."""
    try:
        inodes = {
            os.readlink(fd)[len("socket:[") : -1]
            for fd in Path(f"/proc/{pid}/fd").iterdir()
            if os.readlink(fd).startswith("socket:[")
        }
    except OSError:
        return set()
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host, port = local.split(":")
                raw = bytes.fromhex(host)  # 32-bit words in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(words)
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                found.add((ip, int(port, 16)))
    return found


def test_demo_binds_loopback_only(figure) -> None:  # noqa: ANN001
    demo = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", "demo", "--size-mib", "8", "--shards", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: set[tuple[IPAddress, int]] = set()
    try:
        while demo.poll() is None:
            for pid in {demo.pid} | _children(demo.pid):
                seen |= _listening(pid)
            time.sleep(0.05)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.wait() == 0
    figure("listening sockets seen while the demo ran", sorted(f"{ip}:{port}" for ip, port in seen))
    assert seen, "the demo's nodes were never seen listening"
    assert all(ip.is_loopback for ip, _ in seen), seen
