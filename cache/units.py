"""Sizes and rates as people write them: ``100GiB``, ``500MB``, ``10Gbit/s``, ``200MB/s``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "format_bytes_at_least", "parse_rate", "parse_size"]

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


def _plain_number(value: object, what: str, example: str) -> float | None:
    """``value`` as a number when it is one (YAML's ``100`` or ``100.5``), ``None`` for text.

    Anything else (a list, a mapping, ``true``) is a ValueError saying what is expected,
    never an AttributeError or TypeError from treating it as text.
    """
    if isinstance(value, str):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ValueError(f"invalid {what} {shown}: use {example}")
    if value != value or value in (float("inf"), float("-inf")):  # NaN, infinity
        raise ValueError(f"invalid {what} {value!r}: use {example}")
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {value}")
    return float(value) if isinstance(value, float) else value


def _whole(amount: float, text: object, what: str) -> int:
    try:
        return int(amount)
    except OverflowError:
        raise ValueError(f"{what} {text!r} is too large") from None


_SIZE_EXAMPLE = "a number of bytes, or one with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
_RATE_EXAMPLE = "e.g. 200MB/s, 1GiB/s or 10Gbit/s, or a number of bytes per second"


def parse_size(text: str | float) -> int:
    """Bytes in ``text`` (``"64GiB"``, ``"500MB"``, ``"1.5TB"``, ``1024``).

    A number is a count of bytes (a fraction is dropped); anything that is
    neither a number nor text is a ValueError.
    """
    number = _plain_number(text, "size", _SIZE_EXAMPLE)
    if number is not None:
        return _whole(number, text, "size")
    assert isinstance(text, str)
    match = _NUMBER.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    return _whole(float(match.group(1)) * _UNITS[unit], text, "size")


def parse_rate(text: str | float) -> int:
    """Bytes per second in ``text`` (``"200MB/s"``, ``"10Gbit/s"``, ``"1GiB/s"``, ``1000``).

    A number is bytes per second. A fraction of a byte is dropped, so a rate
    under 1 byte/s (``"7bit/s"``) comes out 0: a caller that means a limit
    must refuse that rather than take it for none.
    """
    number = _plain_number(text, "rate", _RATE_EXAMPLE)
    if number is not None:
        return _whole(number, text, "rate")
    assert isinstance(text, str)
    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2]
    match = _NUMBER.fullmatch(body)
    if match and match.group(2).lower() in _BITS:
        return _whole(float(match.group(1)) * _BITS[match.group(2).lower()] / 8, text, "rate")
    try:
        return parse_size(body)
    except ValueError as exc:
        if "too large" in str(exc):  # a rate that is a rate, only past what a size holds
            raise ValueError(f"rate {text!r} is too large") from None
        raise ValueError(f"invalid rate {text!r}: use {_RATE_EXAMPLE}") from None


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_bytes_at_least(n: int) -> str:
    """``n`` bytes as :func:`format_bytes` writes them, but rounded up, never down.

    Advice to add "at least 614.4 KiB" must be enough when taken literally.
    """
    unit = 1
    while n >= unit * 1024 and unit < 1024**4:
        unit *= 1024
    if unit == 1:
        return format_bytes(n)
    tenths = -(-n * 10 // unit)  # ceil
    return format_bytes(tenths * unit / 10)
