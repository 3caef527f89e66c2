"""CacheStore.close never unmaps the LMDB environment under an open ShardReader.

A reader's views point into the memory map: if the environment closed under
them, the next decode would read unmapped memory and the process would die.
The scenarios run in a subprocess so that such a crash fails the test instead
of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import faulthandler, sys, threading, time
    import lmdb
    from storeutil import shard_frames
    from edgecache.cache.codec import decode_chunk
    from edgecache.cache.errors import StoreError
    from edgecache.cache.keys import ShardKey
    from edgecache.cache.store import CacheStore

    faulthandler.enable()
    path = sys.argv[1]
    key = ShardKey("tokens", 1, 0)
    store = CacheStore(path, capacity_bytes=64 << 20, sync=False)
    store.put_shard(key, shard_frames(rows=6000, chunk_bytes=32 << 10))
    expected = [bytes(f) for f in store.iter_chunks(key)]

    # 1. A reader in another thread, decoding views, while the main thread closes.
    opened, decoded = threading.Event(), []
    def read() -> None:
        with store.read_shard(key) as reader:
            opened.set()
            for _ in range(20):
                for index in range(reader.info.chunk_count):
                    decoded.append(decode_chunk(reader.chunk(index)).num_rows)
    thread = threading.Thread(target=read)
    thread.start()
    opened.wait()
    store.close()  # waits for the reader instead of unmapping under it
    thread.join()
    assert store._env is None and len(decoded) == 20 * len(expected), len(decoded)

    # 2. A reader in the closing thread itself (a half-read generator): the close is
    #    deferred until it ends, and new reads are refused meanwhile.
    store = CacheStore(path, capacity_bytes=64 << 20, sync=False)
    chunks = store.iter_chunks(key)
    got = [next(chunks)]
    store.close()
    try:
        store.read_shard(key)
    except StoreError:
        pass
    else:
        raise AssertionError("a closing store opened a new reader")
    got += list(chunks)  # still the same snapshot, still mapped
    assert got == expected
    assert store._env is None  # the last reader closed it
    env = lmdb.open(path, readonly=True, max_dbs=16)  # not open in this process any more
    env.close()
    print("ok")
    """
)


def test_close_waits_for_or_defers_to_open_readers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"exit code {proc.returncode} (-11 is SIGSEGV)\n{proc.stderr[-4000:]}"
    )
