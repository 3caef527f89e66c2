"""edge.allocator: a node's chunk-sized buffers come from glibc's heap, not fresh mappings.

Each case runs in a fresh interpreter: mallopt changes the whole process's
allocator, and the test process's must stay as pytest found it.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Bytes in mmap'd chunks (mallinfo2's hblkhd) while a 20 MiB buffer is alive: the
# allocation a node makes for each message of a chunk that size.
_PROBE = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    from edgecache.edge.allocator import keep_message_buffers
    assert keep_message_buffers() is True
before = libc.mallinfo2().hblkhd
buffer = bytearray(20 * 1024 * 1024)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_for_a_message(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def test_a_chunk_sized_buffer_is_mapped_afresh_by_default_and_from_the_heap_once_tuned() -> None:
    assert _mapped_for_a_message("default") >= 20 * 1024 * 1024  # the cost the module removes
    assert _mapped_for_a_message("tuned") == 0
