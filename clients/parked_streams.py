"""ReadShard streams left open at a window's end, for the read of the next window to go on with.

A forward stream of the epoch's order reads neighbouring windows of a shard
one after the other (:mod:`edgecache.clients.shuffle`). One ``ReadShard`` per
window costs a request, a new HTTP/2 stream, the node's lookup of the shard
and a first chunk that nothing was sent ahead of: per window, about as long
again as receiving the window (~10 ms for 4 MiB here), where a stream that
goes on is pipelined by the node and the kernel. So the read of a window
whose next window the same pipeline reads next asks for both windows' rows,
takes its own, and parks the stream here, with the chunk across the edge the
next read needs too. That read takes it (:meth:`ParkedStreams.take`) instead
of opening a stream. A parked stream is exempt from the stall watchdog (it
delivers nothing because nobody reads it); streams parked by a pipeline that
stops are closed with it (:meth:`ParkedStreams.drop`), and at most ``limit``
are kept (the oldest is closed: its next window opens a stream of its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Generator, Iterator
from typing import Any

import pyarrow as pa

__all__ = ["Parked", "ParkedStreams", "StreamKey"]

StreamKey = tuple[str, int, int, int]  # dataset, version, shard, the row the next read starts at
Rows = Generator[tuple[int, pa.RecordBatch], None, None]


class Parked:
    """A stream stopped at a window's end: the chunk read past it, and the rest to come."""

    __slots__ = ("endpoint", "pending", "source", "stop", "stream")

    def __init__(
        self,
        source: Rows,
        pending: list[tuple[int, pa.RecordBatch]],
        stream: Any,
        endpoint: str,
        stop: threading.Event | None,
    ) -> None:
        self.source, self.pending, self.stream = source, pending, stream
        self.endpoint, self.stop = endpoint, stop
        stream.parked = True

    def resume(self) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The rows from where the stream stopped: the chunk already read, then the stream."""
        self.stream.parked = False
        self.stream.touch()
        yield from self.pending
        yield from self.source

    def close(self) -> None:
        """End the stream (the generator's own cleanup cancels the call)."""
        self.source.close()


class ParkedStreams:
    """Parked streams of one node pool, by where the next read starts."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._parked: OrderedDict[StreamKey, Parked] = OrderedDict()
        self._lock = threading.Lock()
        self.resumed = 0  # reads that went on with a parked stream (for tests and stats)

    def park(self, key: StreamKey, parked: Parked) -> None:
        """Keep ``parked`` for the read that starts at ``key``."""
        closing = []
        with self._lock:
            old = self._parked.pop(key, None)
            if old is not None:
                closing.append(old)
            self._parked[key] = parked
            while len(self._parked) > self.limit:
                closing.append(self._parked.popitem(last=False)[1])
        for p in closing:
            p.close()

    def take(self, key: StreamKey, endpoint: str) -> Parked | None:
        """The stream parked for a read starting at ``key`` on ``endpoint``, if any."""
        with self._lock:
            parked = self._parked.get(key)
            if parked is None or parked.endpoint != endpoint:
                return None
            del self._parked[key]
            self.resumed += 1
            return parked

    def drop(self, stop: threading.Event | None = None) -> None:
        """Close the streams parked by reads given ``stop`` (all of them: None)."""
        with self._lock:
            keys = [k for k, p in self._parked.items() if stop is None or p.stop is stop]
            closing = [self._parked.pop(k) for k in keys]
        for p in closing:
            p.close()

    def __len__(self) -> int:
        return len(self._parked)
