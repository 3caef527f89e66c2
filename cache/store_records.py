"""What the cache store reports about what it holds: shards, versions, counters."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from edgecache.cache.keys import ShardKey

__all__ = ["ShardInfo", "StoreStats", "VersionInfo", "ns_to_datetime"]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A resident shard, as recorded when it was committed."""

    key: ShardKey
    chunk_count: int
    stored_bytes: int
    row_count: int
    checksums: tuple[int, ...]
    chunk_rows: tuple[int, ...]
    committed_at: datetime
    last_access: datetime

    def damage(self) -> str:
        """What makes this record's chunk lists disagree with its count ("" when none).

        A record lists one checksum and one row count per chunk; readers plan
        from it (which chunks, where each starts), so lists of another length
        are damage.
        """
        if len(self.checksums) != self.chunk_count or len(self.chunk_rows) != self.chunk_count:
            return (
                f"the shard record lists {len(self.checksums)} checksums and "
                f"{len(self.chunk_rows)} row counts for {self.chunk_count} chunks"
            )
        return ""


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """A version with at least one resident shard, or a pin."""

    dataset: str
    version: int
    shard_count: int
    stored_bytes: int
    pinned_until: datetime | None

    def pinned(self, now_ns: int | None = None) -> bool:
        """Whether eviction must leave this version alone."""
        if self.pinned_until is None:
            return False
        now = time.time_ns() if now_ns is None else now_ns
        return int(self.pinned_until.timestamp() * 1e9) > now


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Capacity and traffic counters; hits and misses count this process's lookups."""

    capacity_bytes: int
    used_bytes: int
    shard_count: int
    hits: int
    misses: int
    evicted_shards: int
    evicted_bytes: int
    corrupt_chunks: int


@dataclass(frozen=True, slots=True)
class Fitted:
    """What :meth:`CacheStore.fit_capacity` did: the cache held ``used_bytes`` before."""

    used_bytes: int
    evicted_shards: int
    evicted_bytes: int
    pinned: tuple[VersionInfo, ...]  # the versions eviction had to leave alone

    @property
    def held_after(self) -> int:
        """Bytes the cache holds after the evictions (over the capacity if pins keep it so)."""
        return self.used_bytes - self.evicted_bytes


def ns_to_datetime(ns: int) -> datetime:
    """Unix nanoseconds (as the store records times) as an aware UTC datetime."""
    return datetime.fromtimestamp(ns / 1e9, UTC)
