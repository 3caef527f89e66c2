"""``HOST:PORT`` addresses, as every listening or dialling setting spells them.

Here, below the node and the clients both, so that the controller's
``--metrics-listen`` and the container's health check parse an address the
way ``edgecache serve`` does without importing the node (``clients`` may not
import ``edge``).
"""

from __future__ import annotations

__all__ = ["split_hostport"]


def split_hostport(value: str) -> tuple[str, int]:
    """``"0.0.0.0:7070"`` → ``("0.0.0.0", 7070)``; ``"[::1]:7070"`` works too."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
