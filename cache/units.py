"""Sizes and rates as people write them: ``100GiB``, ``500MB``, ``10Gbit/s``, ``200MB/s``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_rate", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``"64GiB"``, ``"500MB"``, ``"1.5TB"``, ``1024``)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _NUMBER.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_rate(text: str | int) -> int:
    """Bytes per second in ``text`` (``"200MB/s"``, ``"10Gbit/s"``, ``"1GiB/s"``)."""
    if isinstance(text, int):
        return parse_size(text)
    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2]
    match = _NUMBER.fullmatch(body)
    if match and match.group(2).lower() in _BITS:
        return int(float(match.group(1)) * _BITS[match.group(2).lower()] / 8)
    try:
        return parse_size(body)
    except ValueError:
        raise ValueError(f"invalid rate {text!r}: use e.g. 200MB/s, 1GiB/s or 10Gbit/s") from None


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
