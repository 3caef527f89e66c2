"""``HOST:PORT`` addresses, as every listening or dialling setting spells them.

Here, below the node and the clients both, so that the controller's
``--metrics-listen`` and the container's health check parse an address the
way ``edgecache serve`` does without importing the node (``clients`` may not
import ``edge``).
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["address_problem", "split_hostport"]

_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def split_hostport(value: str) -> tuple[str, int]:
    """``"0.0.0.0:7070"`` → ``("0.0.0.0", 7070)``; ``"[::1]:7070"`` works too."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def address_problem(target: str) -> str | None:
    """What is wrong with ``host:port`` as an address to dial; None when nothing is.

    One check for a peer (edge/peers.py) and a health probe (clients/healthcheck.py).
    """
    if "://" in target:
        return f"the scheme {target.split('://', 1)[0]!r} is not one a peer is named with"
    host, sep, port = target.rpartition(":")
    if not sep or not host:
        return "no host:port"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"the port {port!r} is not a number from 1 to 65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if not _HOST.fullmatch(host):
        return f"the host {host!r} is not a host name or IP address (an IPv6 one in brackets)"
    return None
