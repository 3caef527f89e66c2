"""A writer that stages shards forever; tests SIGKILL it at random moments.

Usage: python crash_writer.py CACHE_DIR CAPACITY_BYTES START_SHARD
Prints "ready" once the store is open, then puts shard after shard of
``crashy@1`` (content fixed by the shard number) and pins/evicts now and then.
"""

import sys
from datetime import UTC, datetime, timedelta

from storeutil import shard_frames

from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore

path, capacity, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
frames = {i: shard_frames(rows=6000, seed=i, chunk_bytes=32 << 10) for i in range(8)}
store = CacheStore(path, capacity_bytes=capacity, sync=False)
print("ready", flush=True)
shard = start
while True:
    store.put_shard(ShardKey("crashy", 1, shard), frames[shard % 8])
    if shard % 5 == 0:
        store.pin_version("crashy", 2, datetime.now(UTC) + timedelta(hours=1))
        store.put_shard(ShardKey("crashy", 2, shard), frames[(shard + 1) % 8])
    if shard % 7 == 0:
        store.evict_version("crashy", 2)
    shard += 1
