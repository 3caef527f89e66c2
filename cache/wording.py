"""Wording shared by messages: a long list said by its first few items."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_of"]


def first_of(items: Sequence[str], most: int) -> str:
    """``a, b, c and 7 more``: the first ``most`` items, and how many are left unsaid.

    A message naming every missing shard of a large version would be pages long; the
    first few say what kind of problem it is, the count how big.
    """
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
