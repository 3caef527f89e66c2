"""LMDB key layout for the store.

Keys are ``<dataset>/`` followed by big-endian integers, so byte order is
(dataset, version, shard, chunk) order: a shard's chunks are adjacent and a
version's shards are one contiguous range. Staging and serving in key order
keeps LMDB reads sequential, which matters a lot for cold reads.
Dataset names cannot contain ``/`` (see :mod:`edgecache.cache.names`), so a
prefix never matches another dataset's keys.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from edgecache.cache.names import validate_name

__all__ = [
    "ShardKey",
    "chunk_key",
    "dataset_prefix",
    "parse_shard_key",
    "parse_version_key",
    "version_key",
]

_VERSION = struct.Struct(">Q")
_SHARD = struct.Struct(">QI")
_CHUNK = struct.Struct(">I")
MAX_VERSION = 2**63 - 1
MAX_SHARD = 2**32 - 1


class ShardKey(NamedTuple):
    """Names one shard of one dataset version."""

    dataset: str
    version: int
    shard: int

    def __str__(self) -> str:
        return f"{self.dataset}@{self.version}/shard-{self.shard}"

    def validated(self) -> ShardKey:
        """Return self, or raise ValueError if a field is out of range."""
        validate_name(self.dataset)
        if not 1 <= self.version <= MAX_VERSION:
            raise ValueError(f"version must be in 1..{MAX_VERSION}, got {self.version}")
        if not 0 <= self.shard <= MAX_SHARD:
            raise ValueError(f"shard must be in 0..{MAX_SHARD}, got {self.shard}")
        return self

    def encode(self) -> bytes:
        """The LMDB key of the shard's record."""
        return dataset_prefix(self.dataset) + _SHARD.pack(self.version, self.shard)


def dataset_prefix(dataset: str) -> bytes:
    """Key prefix shared by everything of one dataset."""
    return dataset.encode("ascii") + b"/"


def version_key(dataset: str, version: int) -> bytes:
    """The LMDB key of a version's record (also the prefix of its shards' keys)."""
    return dataset_prefix(dataset) + _VERSION.pack(version)


def chunk_key(shard_key: bytes, chunk: int) -> bytes:
    """The LMDB key of one chunk of the shard whose record key is ``shard_key``."""
    return shard_key + _CHUNK.pack(chunk)


def parse_shard_key(raw: bytes) -> ShardKey:
    """Inverse of :meth:`ShardKey.encode`."""
    raw = bytes(raw)
    # The integers are fixed-width and may contain b"/" bytes: split by length.
    dataset, tail = raw[: -_SHARD.size - 1], raw[-_SHARD.size :]
    version, shard = _SHARD.unpack(tail)
    return ShardKey(dataset.decode("ascii"), version, shard)


def parse_version_key(raw: bytes) -> tuple[str, int]:
    """Inverse of :func:`version_key`: ``(dataset, version)``."""
    raw = bytes(raw)
    (version,) = _VERSION.unpack(raw[-_VERSION.size :])
    return raw[: -_VERSION.size - 1].decode("ascii"), version
