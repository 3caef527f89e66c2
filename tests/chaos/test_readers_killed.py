"""SIGKILLed reader processes holding read transactions: their slots are reclaimed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from chaosutil import count
from storeutil import shard_frames

from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore

READER = """
import sys, time
from edgecache.cache.store import CacheStore
from edgecache.cache.keys import ShardKey
store = CacheStore(sys.argv[1], readonly=True, max_readers=int(sys.argv[2]))
reader = store.read_shard(ShardKey("t", 1, 0))  # a read transaction, held open
reader.chunk(0)
print("holding", flush=True)
time.sleep(600)
"""


def test_killed_readers_do_not_lock_out_new_ones(tmp_path: Path, figure) -> None:  # noqa: ANN001
    readers = count(16, 64)
    slots = readers + 2  # without reclaiming stale slots, new readers would find none free
    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False, max_readers=slots) as s:
        s.put_shard(ShardKey("t", 1, 0), shard_frames())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(tmp_path / "c"), str(slots)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(readers)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    started = time.monotonic()
    opened = 0
    for _ in range(4):  # more than the free slots: only works if stale ones are reclaimed
        with CacheStore(tmp_path / "c", readonly=True, max_readers=slots) as store:
            held = [store.read_shard(ShardKey("t", 1, 0)) for _ in range(3)]
            assert all(r.chunk(0) for r in held)
            opened += len(held)
            for r in held:
                r.close()
    elapsed = time.monotonic() - started
    figure("killed readers", readers)
    figure("seconds until new readers succeed", round(elapsed, 3))  # shown, not asserted
    assert opened == 4 * 3  # 3 at once, with 2 slots free: the killed ones' were reclaimed
