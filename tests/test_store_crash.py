"""A writer SIGKILLed mid-shard leaves whole shards or nothing, and the store reopens cleanly."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from storeutil import shard_frames

from edgecache.cache.store import CacheStore

TESTS = Path(__file__).parent
KILLS = 12


def test_writer_killed_mid_shard_leaves_no_partial_shard(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    expected = {i: shard_frames(rows=6000, seed=i, chunk_bytes=32 << 10) for i in range(8)}
    shard_size = sum(map(len, expected[0]))
    capacity = shard_size * 6  # small enough that eviction runs during the kills
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    rng = random.Random(7)
    next_shard = 0
    for _ in range(KILLS):
        proc = subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "crash_writer.py"),
                str(cache),
                str(capacity),
                str(next_shard),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with CacheStore(cache, sync=False) as store:  # opens cleanly, takes the writer lock
            total = 0
            for version in store.versions():
                shards = store.shards(version.dataset, version.version)
                assert version.shard_count == len(shards)
                assert version.stored_bytes == sum(s.stored_bytes for s in shards)
                total += version.stored_bytes
                for info in shards:
                    want = expected[(info.key.shard + version.version - 1) % 8]
                    assert list(store.iter_chunks(info.key)) == want, f"{info.key} differs"
                    next_shard = max(next_shard, info.key.shard + 1)
            assert store.stats.used_bytes == total <= capacity
    assert next_shard > KILLS  # the writer did make progress between kills
