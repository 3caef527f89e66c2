"""Decoded chunks shared by two reads that meet inside one chunk (a shuffle window's edge)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import pyarrow as pa

__all__ = ["ChunkKey", "EdgeChunks", "EdgeKey"]


ChunkKey = tuple[str, int, int, int, int, int]  # dataset, version, shard, first row, rows, checksum
EdgeKey = tuple[str, int, int, int]  # dataset, version, shard, edge row
ShardId = tuple[str, int, int]  # dataset, version, shard


class _Decoded:
    """One chunk's decode, shared by the reads on either side of a window edge."""

    __slots__ = ("batch", "claimed", "done", "rows")

    def __init__(self, rows: int) -> None:
        self.rows, self.claimed = rows, 0
        self.batch: pa.RecordBatch | None = None
        self.done = threading.Event()


class EdgeChunks:
    """Decoded chunks that straddle the edge of a read, kept for the read beside it.

    Shuffle windows need not end on chunk boundaries, so the chunk across an
    edge is read by both windows; a stream reads adjacent windows one after the
    other (:mod:`edgecache.clients.shuffle`). The first read to reach such a
    chunk decodes it, the other waits for that and takes the same batch (its
    own copy of the frame still verified when it came over the network). A
    read that starts after the chunk was decoded does not fetch it at all
    (:meth:`take`). Keys are ``(dataset, version, shard, first row, rows,
    checksum)``, so only identical bytes are shared. ``shared`` names, per
    ``(dataset, version, shard)``, the rows where two reads of the caller meet
    (the caller adds them with :meth:`share` before either read starts); only
    chunks across those are kept, until their rows were all taken, and at most
    ``limit`` (the oldest are dropped: the other read then fetches and decodes
    its own copy, as without this).
    """

    def __init__(self, shared: dict[ShardId, set[int]] | None = None, limit: int = 8) -> None:
        self.shared: dict[ShardId, set[int]] = shared if shared is not None else {}
        self.limit = limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, _Decoded] = OrderedDict()

    def _across(self, dataset: str, version: int, shard: int, edge: int) -> list[ChunkKey]:
        """Kept chunks of the shard whose rows cross row ``edge`` (under the lock).

        Found by the chunk's rows, not by the edges known when it was decoded: a
        read beside it may be planned (its edge shared) only after the decode.
        """
        return [
            key
            for key in self._entries
            if key[:3] == (dataset, version, shard) and key[3] < edge < key[3] + key[4]
        ]

    def take(
        self, dataset: str, version: int, shard: int, edge: int, row_start: int, row_end: int
    ) -> tuple[int, pa.RecordBatch] | None:
        """(first row, batch) of a decoded chunk across row ``edge``, if there is one.

        The read of rows ``[row_start, row_end)`` takes its rows of it, so it
        need not fetch that chunk.
        """
        with self._lock:
            keys = self._across(dataset, version, shard, edge)
            key = keys[0] if keys else None
            entry = None if key is None else self._entries.get(key)
            if key is None or entry is None or entry.batch is None:
                return None
            first = key[3]
            entry.claimed += min(first + entry.rows, row_end) - max(first, row_start)
            if entry.claimed >= entry.rows:
                self._forget_locked(key, entry)
            return first, entry.batch

    def share(self, shard: ShardId, row: int) -> None:
        """Two reads of the caller will meet at row ``row`` of ``shard``."""
        with self._lock:
            self.shared.setdefault(shard, set()).add(row)

    def forget(self, shard: ShardId, rows: tuple[int, ...]) -> None:
        """Drop decoded chunks across rows ``rows`` of ``shard`` that no read took yet.

        Called when the read that decoded them is no longer needed: the read on
        the other side, if it comes at all, decodes its own copy. So a chunk kept
        here never outlives the window that decoded it.
        """
        dataset, version, number = shard
        with self._lock:
            for row in rows:
                for key in self._across(dataset, version, number, row):
                    entry = self._entries.get(key)
                    if entry is not None and entry.done.is_set():  # not one being decoded
                        self._forget_locked(key, entry)

    def across(self, shard: ShardId, first: int, end: int, row_start: int, row_end: int) -> bool:
        """Whether chunk rows ``[first, end)`` cross an edge this read shares with another."""
        with self._lock:
            edges = set(self.shared.get(shard, ()))
        return (first < row_start < end and row_start in edges) or (
            first < row_end < end and row_end in edges
        )

    def decode(
        self, key: ChunkKey, rows: int, taken: int, decode: Callable[[], pa.RecordBatch]
    ) -> pa.RecordBatch:
        """``decode()`` once for both reads of chunk ``key``; this read takes ``taken`` rows."""
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if entry is None:
                entry = self._entries[key] = _Decoded(rows)
                while len(self._entries) > self.limit:
                    oldest, dropped = next(iter(self._entries.items()))
                    self._forget_locked(oldest, dropped)
        if owner:
            try:
                entry.batch = decode()
            finally:
                entry.done.set()
                if entry.batch is None:  # failed: nothing to share
                    self._forget(key, entry)
        else:
            entry.done.wait()
        batch = entry.batch
        if batch is None:
            return decode()  # the other read's decode failed; ours may not
        with self._lock:
            entry.claimed += taken
            if entry.claimed >= entry.rows:
                self._forget_locked(key, entry)
        return batch

    def _forget(self, key: ChunkKey, entry: _Decoded) -> None:
        with self._lock:
            self._forget_locked(key, entry)

    def _forget_locked(self, key: ChunkKey, entry: _Decoded) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
