"""Recycled decode buffers: handed out again only once nothing points into them.

A buffer given to a second decode while a batch of the first still pointed into
it would change that batch under the reader: the worst kind of corruption, one no
checksum sees. These tests hold views of every kind and check the bytes under them.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgecache.cache import recycled
from edgecache.cache.codec import CodecOptions, decode_chunk, encode_shard
from edgecache.cache.recycled import LARGE, SMALL, RecycledBuffers, size_class

MIB = 1 << 20


def filled(pool: RecycledBuffers, nbytes: int, value: int) -> pa.Buffer:
    array, buffer = pool.allocate(nbytes)
    array[:] = value
    return buffer


def test_a_buffer_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = RecycledBuffers()
    first = filled(pool, 3 * MIB, 7)
    address = first.address
    column = pa.Array.from_buffers(pa.uint8(), 3 * MIB, [None, first])
    view = column.to_numpy(zero_copy_only=True)[100:200]  # a numpy view, as batches hand out
    del first, column
    gc.collect()
    second = filled(pool, 3 * MIB, 9)  # the first is still seen through ``view``
    assert second.address != address and pool.reused == 0
    assert (view == 7).all()
    addresses = {address, second.address}
    del view, second
    gc.collect()
    third = filled(pool, 3 * MIB, 1)
    assert third.address in addresses and pool.reused == 1
    assert pool.live == size_class(3 * MIB)


def test_small_buffers_come_from_arrows_pool() -> None:
    pool = RecycledBuffers()
    array, buffer = pool.allocate(SMALL - 1)
    array[:] = 3
    assert buffer.to_pybytes() == b"\x03" * (SMALL - 1)
    assert pool.live == 0 and pool.fresh == 0


@given(sizes=st.lists(st.integers(SMALL, 6 * MIB), min_size=1, max_size=40), data=st.data())
@settings(max_examples=40, deadline=None)
def test_live_buffers_never_share_memory_and_keep_their_bytes(sizes: list[int], data) -> None:
    """Random allocations and drops: every live buffer keeps the bytes written into it,
    none overlaps another, and idle and live together stay within the most held at
    once (or the keep floor)."""
    pool = RecycledBuffers(keep_bytes=8 * MIB)
    live: dict[int, tuple[pa.Buffer, int]] = {}
    for i, size in enumerate(sizes):
        live[i] = (filled(pool, size, i % 251), i % 251)
        for key in data.draw(st.lists(st.sampled_from(sorted(live)), max_size=3, unique=True)):
            del live[key]

        spans = sorted((b.address, b.address + b.size) for b, _ in live.values())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        for buffer, value in live.values():
            assert (
                np.frombuffer(buffer, np.uint8).min()
                == value
                == np.frombuffer(buffer, np.uint8).max()
            )
        assert pool.idle_bytes() + pool.live <= max(8 * MIB, pool.live_peak)


def test_a_decoded_batch_kept_is_never_overwritten_by_later_decodes() -> None:
    """The real path: byte-split chunks decoded into recycled buffers, one batch kept
    while hundreds of others are decoded and dropped."""
    rng = np.random.default_rng(0)

    def chunk(seed: int) -> bytes:
        ids = np.random.default_rng(seed).integers(0, 50_000, 2048 * 256, dtype=np.int32)
        table = pa.table({"ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 2048)})
        (frame,) = encode_shard(table.to_batches(), table.schema, CodecOptions())
        return frame

    frames = [chunk(seed) for seed in range(4)]
    kept = decode_chunk(frames[0])
    expected = kept.column(0).flatten().to_numpy().copy()
    views = kept.column(0).flatten().to_numpy()
    for _ in range(200):
        decode_chunk(frames[int(rng.integers(1, 4))])
    assert recycled.buffers.reused > 0
    assert np.array_equal(views, expected)
    assert np.array_equal(kept.column(0).flatten().to_numpy(), expected)


def test_release_gives_idle_buffers_back() -> None:
    pool = RecycledBuffers()
    buffers = [filled(pool, 2 * MIB, 1) for _ in range(4)]
    del buffers
    gc.collect()
    assert pool.idle_bytes() == 4 * size_class(2 * MIB)
    assert pool.release() == 4 * size_class(2 * MIB) and pool.idle_bytes() == 0


def test_buffers_freed_by_the_cycle_collector_inside_the_pool_do_not_hang_it() -> None:
    """Buffers held by reference cycles (a batch in a traceback, a Future) are freed by
    the cycle collector, which runs at any allocation, the pool's own under its lock
    too: a finaliser that took the lock waited for its own thread (found in review)."""
    pool = RecycledBuffers(keep_bytes=8 * MIB)
    gc.set_threshold(10)  # collect often, as a busy process does
    try:
        for i in range(3000):
            _, buffer = pool.allocate((1 + i % 4) * MIB // 2 + 4096)
            holder = {"buffer": buffer}
            holder["self"] = holder  # cyclic garbage holding the buffer
            del buffer, holder
    finally:
        gc.set_threshold(700, 10, 10)
    gc.collect()
    assert pool.idle_bytes() <= max(8 * MIB, pool.live_peak) and pool.live == 0


def test_a_script_that_exits_while_threads_decode_exits_cleanly(tmp_path) -> None:
    """A daemon thread freeing buffers as the interpreter exits: code run from Arrow's
    destructor then was cut short inside C++, an abort (exit 134) in 4 of 10 runs."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import threading, time\n"
        "from edgecache.cache import recycled\n"
        "def work():\n"
        "    while True:\n"
        "        a, b = recycled.buffers.allocate(3 << 20); del a, b\n"
        "threading.Thread(target=work, daemon=True).start()\n"
        "time.sleep(0.2)\n"
    )
    for _ in range(6):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()[-2000:]


def _allocate_in_child(queue: multiprocessing.Queue) -> None:
    array, buffer = recycled.buffers.allocate(2 * MIB)
    array[:] = 5
    queue.put(buffer.to_pybytes()[:4])


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="fork only")
def test_a_child_forked_while_the_lock_is_held_can_still_allocate() -> None:
    """A DataLoader worker forked while a read thread of the parent held the pool's lock
    would wait for it forever: the child has no such thread to release it."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with recycled.buffers._lock:
        child = context.Process(target=_allocate_in_child, args=(queue,))
        child.start()
    child.join(timeout=20)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == b"\x05" * 4


def _count_in_child(inherited: list, queue: multiprocessing.Queue) -> None:
    _, mine = recycled.buffers.allocate(8 * MIB)
    inherited.clear()  # the parent's buffer, dropped in the child
    queue.put(recycled.buffers.idle_bytes() + recycled.buffers.live)


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="fork only")
def test_a_forked_child_counts_only_its_own_buffers() -> None:
    """A buffer inherited from the parent and dropped in the child was subtracted from
    the child's own count (found in review): its live buffer read as 0."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    inherited = [recycled.buffers.allocate(8 * MIB)[1]]
    child = context.Process(target=_count_in_child, args=(inherited, queue))
    child.start()
    child.join(timeout=20)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == size_class(8 * MIB)


def test_buffers_larger_than_any_chunk_are_not_kept() -> None:
    """A damaged header claiming a huge chunk must not become the process's peak."""
    pool = RecycledBuffers()
    array, buffer = pool.allocate(LARGE + 1)
    assert len(buffer) == LARGE + 1 and pool.live == 0 == pool.live_peak
