"""Decode buffers handed out again once nothing points into them.

A reader decodes each chunk it reads into a buffer of a few MiB that the
decoded batch then points into (zero-copy); the batch lives while its window
is read, and the next chunk needs a buffer of about the same size. Left to
Arrow's pool (mimalloc), freed windows were kept beside new ones: at a
loader's peak (1 GiB of tokens, ``num_workers=0``) its anonymous memory was
~80 MB above the process's own and what the pool had allocated (440-455 MB,
161-183 MB of them allocated). Returning freed memory to the system at once
(``MIMALLOC_PURGE_DELAY=0``) cut that but cost 15-20 % of the speed: every
buffer was faulted in page by page again; numpy's buffers (glibc's heap)
were worse, 130 MB of the heap free at the peak.

So decode buffers are anonymous private mappings of their own, outside any
heap, handed out again by size class: a buffer comes back to the free list
the moment the last Arrow object over it is garbage (the ``base`` object's
finaliser), and the next decode of its class takes it, pages already in
memory. Live and idle buffers together stay within the most the process
held at once (or :data:`KEEP_BYTES` if that is more): a buffer given back
beyond that is unmapped, and one mapped anew first unmaps idle ones of other
sizes. So the next epoch reuses the last one's buffers, and the process never
holds more than its peak; :meth:`RecycledBuffers.release` unmaps the idle ones
(a dataset's ``close``). Buffers under :data:`SMALL` come from Arrow's pool as before.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pyarrow as pa

__all__ = ["KEEP_BYTES", "SMALL", "RecycledBuffers", "buffers"]

KEEP_BYTES = 64 << 20  # idle buffers a process may always keep for its next decodes
SMALL = 256 << 10  # smaller buffers come from Arrow's pool: reuse would save little
# A fresh mapping filled in one go: populating it with the mapping is a third faster
# than faulting 4 KiB pages in one by one as zstd writes them (measured, 4 MiB).
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of eight steps per power of two (at most 12.5 % more)."""
    step = max(1 << max(nbytes.bit_length() - 4, 0), 64)
    return -(-nbytes // step) * step


def _fresh(size: int) -> np.ndarray:
    """``size`` bytes of memory of their own: a private anonymous mapping where there is one."""
    if _FLAGS:
        return np.frombuffer(mmap.mmap(-1, size, flags=_FLAGS | _POPULATE), dtype=np.uint8)
    return np.empty(size, dtype=np.uint8)  # pragma: no cover - platforms without MAP_PRIVATE


class _Lease:
    """The ``base`` of one handed-out buffer: gives its memory back when Arrow lets go of it."""

    __slots__ = ("array", "owner")

    def __init__(self, owner: RecycledBuffers, array: np.ndarray) -> None:
        self.owner, self.array = owner, array

    def __del__(self) -> None:
        self.owner.give_back(self.array)


class RecycledBuffers:
    """A free list of decode buffers by size class, shared by a process's decoding threads."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._reset()

    def _reset(self) -> None:
        # Also a forked child's first step: the parent's lock may have been held by
        # one of its threads, which the child does not have.
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle = 0  # bytes on the free list
        self.live = self.live_peak = 0  # bytes handed out and not given back; their peak
        self.reused = self.fresh = 0  # buffers handed out again / mapped anew

    def allocate(self, nbytes: int) -> tuple[np.ndarray, pa.Buffer]:
        """A writable array of ``nbytes`` and the Arrow buffer over the same memory.

        Fill the array, then drop it and hand the buffer on: the memory comes back
        here once neither the buffer nor anything made from it (slices, arrays,
        numpy views) is referenced, so the array must not outlive them.
        """
        if nbytes < SMALL:
            buffer = pa.allocate_buffer(nbytes)
            return np.frombuffer(buffer, dtype=np.uint8), buffer
        size = size_class(nbytes)
        dropped = []  # idle buffers of other classes making room; unmapped outside the lock
        with self._lock:
            free = self._free.get(size)
            array = free.pop() if free else None
            if array is not None:
                self._idle -= size
                self.reused += 1
            else:
                budget = max(self.keep_bytes, self.live_peak)
                while self._idle and self._idle + self.live + size > budget:
                    largest = max(k for k, v in self._free.items() if v)
                    dropped.append(self._free[largest].pop())
                    self._idle -= largest
            self.live += size
            self.live_peak = max(self.live_peak, self.live)
        del dropped
        if array is None:
            try:
                array = _fresh(size)
            except BaseException:
                with self._lock:
                    self.live -= size
                raise
            self.fresh += 1
        lease = _Lease(self, array)
        return array[:nbytes], pa.foreign_buffer(array.ctypes.data, nbytes, base=lease)

    def give_back(self, array: np.ndarray) -> None:
        """Keep ``array`` for the next decode of its class, unless enough are idle."""
        size = len(array)
        with self._lock:
            self.live = max(self.live - size, 0)  # a forked child's leases from its parent
            if self._idle + size <= max(self.keep_bytes, self.live_peak - self.live):
                self._free.setdefault(size, []).append(array)
                self._idle += size

    def release(self) -> int:
        """Drop every idle buffer (their memory goes back to the system); the bytes dropped."""
        with self._lock:
            dropped, self._free, self._idle = self._idle, {}, 0
            self.live_peak = self.live
        return dropped

    def idle_bytes(self) -> int:
        """Bytes on the free list now."""
        with self._lock:
            return self._idle


buffers = RecycledBuffers()  # the process's decode buffers (cache/codec.py, cache/byte_split.py)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=buffers._reset)
