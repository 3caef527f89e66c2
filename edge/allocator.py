"""glibc's allocator told to keep a node's message-sized buffers instead of unmapping them.

Why: every chunk a node serves passes through buffers of the chunk's size (a few
MiB): the message ``encode_chunk`` builds, gRPC's copy of it for the socket, the
bytes a fetch reads from the origin. Left at its defaults, glibc hands each such
buffer out as a fresh ``mmap`` (above its mmap threshold) or from a heap top it
trims again at 128 KiB of free space, and gives it back to the kernel when it is
freed, so the next message's pages were faulted in and zeroed by the kernel once
more. On this project's 2-core machine that was half the node's CPU when it served
images (``python -m bench.peers``, 512 MiB of ~100 KiB rows over gRPC): 1.86 CPU-s
per GB served with glibc's defaults, 0.88 with these settings.

The settings raise the mmap threshold to glibc's maximum (32 MiB on 64-bit: every
chunk-sized buffer comes from the heap) and let a heap keep up to
:data:`TRIM_THRESHOLD` free at its top before returning it: the node's memory then
stays at its peak working set (bounded by its fetch-memory budget and the streams it
serves) instead of following each message's life. ``malloc_trim`` is not called:
the node's working set comes back with the next read.

Applied by ``edgecache serve`` (a process of the node's own), never by a library
import: a training process's allocator is its owner's to tune.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_message_buffers"]

log = logging.getLogger(__name__)

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: the largest it accepts
TRIM_THRESHOLD = 256 * 1024 * 1024


def keep_message_buffers() -> bool:
    """Tune glibc for a node's buffers; False where the C library is not glibc.

    A refusal by ``mallopt`` (an older glibc with a lower maximum) is logged and
    the defaults stay: the node serves the same, with more page faults.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = True
    for param, value, name in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
    ):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("glibc refused mallopt(%s, %d): its default stays", name, value)
            ok = False
    return ok
