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
heap, handed out again by size class: once the last Arrow object over a buffer
is garbage (a weak reference to its ``base`` says so; no Python code runs when
Arrow frees it), the pool's next call takes it back, and the next decode of
its class gets it, pages already in memory. Live and idle buffers together
stay within the most the process held at once (or :data:`KEEP_BYTES` if that
is more): a buffer given back beyond that is unmapped, and one mapped anew
first unmaps idle ones of other sizes. So the next epoch reuses the last one's
buffers, and the process never holds more than its peak;
:meth:`RecycledBuffers.release` unmaps the idle ones (a dataset's ``close``).
Buffers under :data:`SMALL` or over :data:`LARGE` come from Arrow's pool as before.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np
import pyarrow as pa

__all__ = ["KEEP_BYTES", "LARGE", "SMALL", "RecycledBuffers", "buffers"]

KEEP_BYTES = 64 << 20  # idle buffers a process may always keep for its next decodes
SMALL = 256 << 10  # smaller buffers come from Arrow's pool: reuse would save little
# Larger ones too: no chunk the codec writes is that large, and a damaged header that
# claims so must not be mapped, filled and then kept as the process's peak.
LARGE = 64 << 20
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
    """The ``base`` of one handed-out buffer: keeps its memory mapped while Arrow uses it.

    No ``__del__``: code run from Arrow's destructor could wait on the pool's lock
    held by its own thread (the cycle collector frees buffers at any allocation) or
    be cut short by interpreter exit inside C++ (an abort). The pool watches a weak
    reference instead and takes the memory back at its next call.
    """

    __slots__ = ("__weakref__", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class RecycledBuffers:
    """A free list of decode buffers by size class, shared by a process's decoding threads."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._reset()

    def _reset(self) -> None:
        # Also a forked child's first step: the parent's lock may have been held by one
        # of its threads, which the child does not have, and the parent's buffers are
        # the parent's to count (in the child their leases keep them until Arrow is done).
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._out: list[tuple[weakref.ref[_Lease], np.ndarray]] = []  # handed out
        self._idle = 0  # bytes on the free list
        self.live = self.live_peak = 0  # bytes handed out and not yet taken back; their peak
        self.reused = self.fresh = 0  # buffers handed out again / mapped anew

    def allocate(self, nbytes: int) -> tuple[np.ndarray, pa.Buffer]:
        """A writable array of ``nbytes`` and the Arrow buffer over the same memory.

        Fill the array, then drop it and hand the buffer on: the memory is taken
        back once neither the buffer nor anything made from it (slices, arrays,
        numpy views) is referenced, and the array does not keep it (it is for
        filling, in the caller's own frame).
        """
        if nbytes < SMALL or nbytes > LARGE:
            buffer = pa.allocate_buffer(nbytes)
            return np.frombuffer(buffer, dtype=np.uint8), buffer
        size = size_class(nbytes)
        dropped: list[np.ndarray] = []  # unmapped outside the lock
        with self._lock:
            self._collect(dropped)
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
        fresh = array is None
        if array is None:
            try:
                array = _fresh(size)
            except BaseException:
                with self._lock:
                    self.live -= size
                raise
        lease = _Lease(array)
        with self._lock:
            self.fresh += fresh
            self._out.append((weakref.ref(lease), array))
        return array[:nbytes], pa.foreign_buffer(array.ctypes.data, nbytes, base=lease)

    def _collect(self, dropped: list[np.ndarray]) -> None:
        """Take back the buffers nothing uses any more (the lock held)."""
        still = []
        for ref, array in self._out:
            if ref() is not None:
                still.append((ref, array))
                continue
            size = len(array)
            self.live -= size
            if self._idle + size <= max(self.keep_bytes, self.live_peak - self.live):
                self._free.setdefault(size, []).append(array)
                self._idle += size
            else:
                dropped.append(array)
        self._out = still

    def release(self) -> int:
        """Unmap every idle buffer; the bytes unmapped. The process's next decodes map anew."""
        dropped: list[np.ndarray] = []
        with self._lock:
            self._collect(dropped)
            freed, self._idle = self._idle, 0
            dropped += [a for arrays in self._free.values() for a in arrays]
            self._free = {}
            self.live_peak = self.live
        del dropped
        return freed

    def idle_bytes(self) -> int:
        """Bytes on the free list, once the buffers nothing uses are taken back."""
        dropped: list[np.ndarray] = []
        with self._lock:
            self._collect(dropped)
            idle = self._idle
        del dropped
        return idle


buffers = RecycledBuffers()  # the process's decode buffers (cache/codec.py, cache/byte_split.py)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=buffers._reset)
