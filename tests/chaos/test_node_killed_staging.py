"""An edge node SIGKILLed at random moments while it stages from moto's S3."""

from __future__ import annotations

import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

from chaosutil import count
from edgeutil import publish, write_parquet_shards
from s3server import make_bucket, s3_env, upload_dir

from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore
from edgecache.clients.node_client import connect, start_local_node
from edgecache.v1 import edge_pb2

SHARDS = 12


def start(
    cache: Path, registry: str, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen, str]:
    # one fetch at a time: a kill can lose at most the one shard in flight
    node = start_local_node(
        "eu",
        cache,
        registry,
        capacity="1GiB",
        log_file=log,
        env={**env, "EDGECACHE_STAGING_CONCURRENCY": "1"},
    )
    return node.process, node.address


def test_node_killed_during_staging_never_shows_partial_shards(
    s3_endpoint: str,
    tmp_path: Path,
    figure,  # noqa: ANN001
) -> None:
    kills = count(5, 20)
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", SHARDS, rows=20_000)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"s3://{bucket}/_edgecache"
    manifest = publish(registry, f"s3://{bucket}/raw", "tokens")
    cache, log = tmp_path / "cache", tmp_path / "node.log"
    env = s3_env(s3_endpoint)
    rng = random.Random(11)
    bad = 0
    for _ in range(kills):
        proc, address = start(cache, registry, env, log)
        stream = connect(address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
        deadline = time.monotonic() + rng.uniform(0.05, 0.8)
        try:
            for _event in stream:
                if time.monotonic() > deadline:
                    break
        except Exception:  # noqa: BLE001 - the stream dies with the node
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with CacheStore(cache, readonly=True) as store:  # what a restart would serve
            for info in store.shards("tokens", 1):
                try:
                    rows = sum(1 for _ in store.iter_chunks(info.key))
                    bad += (
                        rows != info.chunk_count
                        or info.row_count != manifest.shards[info.key.shard].row_count
                    )
                except Exception:  # noqa: BLE001 - a damaged shard counts as bad
                    bad += 1
    proc, address = start(cache, registry, env, log)
    try:
        last = list(connect(address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    fetches = log.read_text().count("fetching s3://")
    refetched = fetches - SHARDS
    figure("kills", kills)
    figure("shards visible but incomplete or corrupt", bad)
    figure("re-fetched shards (whole shards whose fetch had started)", refetched)
    assert bad == 0
    assert last.finished and last.shards_done == SHARDS and not last.failures
    with CacheStore(cache, readonly=True) as store:
        assert len(store.shards("tokens", 1)) == SHARDS
        assert all(store.get_chunk(ShardKey("tokens", 1, s), 0) for s in range(SHARDS))
    # At most the one shard in flight per kill. Counted in whole shards (a fetch that
    # started counts as re-fetched even if the kill landed a few bytes into it), so a run
    # where every kill lands mid-shard reaches the bound exactly.
    assert refetched <= kills
