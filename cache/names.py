"""Dataset names and ``name@N`` version specs.

Names become LMDB key prefixes, URL path segments and file names in origin,
so they are held to a strict, path-safe alphabet: nothing a name can spell
may climb out of a directory or collide with a separator.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from edgecache.cache.errors import InvalidName

__all__ = ["LATEST", "MAX_NAME_LENGTH", "VersionSpec", "parse_spec", "validate_name"]

MAX_NAME_LENGTH = 128
LATEST = "latest"
# Lower-case ASCII letters and digits, with '.', '_' and '-' inside; must start
# with a letter or digit, so '.', '..' and '-flag' are impossible.
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def validate_name(name: str) -> str:
    """Return ``name`` unchanged if it is a valid dataset name, else raise :class:`InvalidName`."""
    if not isinstance(name, str):
        raise InvalidName(f"dataset name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidName("dataset name is empty; use e.g. 'tokens-en'")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(
            f"dataset name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid dataset name {name!r}: use lower-case ASCII letters, digits, '.', '_' "
            "and '-', starting with a letter or digit, with no '..'"
        )
    return name


class VersionSpec(NamedTuple):
    """A parsed ``name``, ``name@latest`` or ``name@N``; ``version`` is None for latest."""

    dataset: str
    version: int | None

    def __str__(self) -> str:
        return f"{self.dataset}@{LATEST if self.version is None else self.version}"


def parse_spec(spec: str, *, latest: bool = True) -> VersionSpec:
    """Parse ``name``, ``name@latest`` or ``name@N`` (N ≥ 1).

    ``latest=False`` for a caller that needs N (``evict``): its refusal of a bad
    version then does not suggest ``name@latest``, which that caller refuses next.
    """
    if not isinstance(spec, str):
        raise InvalidName(f"dataset spec must be a string, got {type(spec).__name__}")
    name, sep, version = spec.partition("@")
    validate_name(name)
    if not sep or version == LATEST:
        return VersionSpec(name, None)
    if not version.isdigit() or not version.isascii() or int(version) < 1:
        either = f", or {name}@latest" if latest else ""
        raise InvalidName(
            f"invalid version in {spec!r}: use {name}@N with N a positive integer{either}"
        )
    return VersionSpec(name, int(version))
