"""What a read asks a node for: a pinned version, and a range of rows of one of its shards.

One object instead of the same eight arguments passed from the read-ahead
pipeline through the node pool to each kind of endpoint: a version is read
whole or not at all (the digest pins it), and a range is resumed on another
node by moving its start, so both are values that are cheap to copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa

from edgecache.v1 import edge_pb2

__all__ = ["ReadTarget", "ShardRange"]


@dataclass(frozen=True, slots=True)
class ReadTarget:
    """A pinned dataset version: its identity (name, number, digest) and the schema to decode."""

    dataset: str
    version: int
    digest: str
    schema: pa.Schema | None = None
    # Whether its chunks are stored compressed: decoding them is then real work that
    # drops the GIL (zstd), worth a thread of its own (Pipeline._submit).
    compressed: bool = True

    def rows(self, shard: int, row_start: int, row_end: int) -> ShardRange:
        """Rows ``[row_start, row_end)`` of shard ``shard`` of this version."""
        return ShardRange(self, shard, row_start, row_end)

    def __str__(self) -> str:
        return f"{self.dataset}@{self.version}"


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Rows ``[row_start, row_end)`` of one shard of a pinned version."""

    target: ReadTarget
    shard: int
    row_start: int
    row_end: int

    @property
    def shard_id(self) -> tuple[str, int, int]:
        """``(dataset, version, shard)``: what replicas split by rendezvous hashing."""
        return (self.target.dataset, self.target.version, self.shard)

    @property
    def empty(self) -> bool:
        """Whether no rows are left to read."""
        return self.row_start >= self.row_end

    def starting_at(self, row: int) -> ShardRange:
        """The same range from ``row`` on (a read resumed after the rows it already has)."""
        return dataclasses.replace(self, row_start=row)

    def ending_at(self, row: int) -> ShardRange:
        """The same range up to ``row`` (the rows after it come from elsewhere)."""
        return dataclasses.replace(self, row_end=row)

    def request(self) -> edge_pb2.ReadShardRequest:
        """The ``ReadShard`` request for these rows."""
        t = self.target
        return edge_pb2.ReadShardRequest(
            dataset=t.dataset,
            version=t.version,
            shard=self.shard,
            digest=t.digest,
            start_row=self.row_start,
            end_row=self.row_end,
        )

    def __str__(self) -> str:
        return f"{self.target} shard {self.shard} rows {self.row_start}-{self.row_end}"
