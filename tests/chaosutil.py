"""Chaos test scale: small in `make test`, full counts with `make chaos` (EDGECACHE_CHAOS=full)."""

from __future__ import annotations

import os

FULL = os.environ.get("EDGECACHE_CHAOS") == "full"


def count(small: int, full: int) -> int:
    """How many times to inject a fault in this run."""
    return full if FULL else small
