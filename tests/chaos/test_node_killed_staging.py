"""An edge node SIGKILLed at random moments while it stages from moto's S3."""

from __future__ import annotations

import random
import signal
import time
import uuid
from pathlib import Path
from urllib.request import urlopen

from chaosutil import count
from edgeutil import publish, write_parquet_shards
from prometheus_client.parser import text_string_to_metric_families
from s3server import make_bucket, s3_env, upload_dir

from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore
from edgecache.clients.node_client import LocalNode, connect, start_local_node
from edgecache.v1 import edge_pb2

SHARDS = 12


def start(cache: Path, registry: str, env: dict[str, str]) -> LocalNode:
    # one fetch at a time: a kill can lose at most the one shard in flight
    return start_local_node(
        "eu",
        cache,
        registry,
        capacity="1GiB",
        extra_args=["--metrics-listen", "127.0.0.1:0"],
        env={**env, "EDGECACHE_STAGING_CONCURRENCY": "1"},
    )


def scrape(node: LocalNode, name: str) -> float:
    """One sample of the node's /metrics."""
    text = urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def fetches_started(node: LocalNode) -> int:
    """Origin fetches the node started, once its Stage was cancelled and started no more.

    A cancelled Stage lets the fetch in flight finish but starts none after it, and
    ``edgecache_staging_active`` drops to 0 when the node has seen the cancel.
    """
    deadline = time.monotonic() + 30
    while scrape(node, "edgecache_staging_active") and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(scrape(node, "edgecache_origin_fetches_total"))


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
    cache = tmp_path / "cache"
    env = s3_env(s3_endpoint)
    rng = random.Random(11)
    bad = fetches = 0
    for _ in range(kills):
        node = start(cache, registry, env)
        stream = connect(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
        deadline = time.monotonic() + rng.uniform(0.05, 0.8)
        try:
            for _event in stream:
                if time.monotonic() > deadline:
                    break
        except Exception:  # noqa: BLE001 - the stream dies with the node
            pass
        stream.cancel()  # the fetch in flight goes on: the kill lands in it or after it
        fetches += fetches_started(node)
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
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
    node = start(cache, registry, env)
    try:
        last = list(
            connect(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
        )[-1]
        fetches += fetches_started(node)
    finally:
        node.stop()
    refetched = fetches - SHARDS
    figure("kills", kills)
    figure("shards visible but incomplete or corrupt", bad)
    figure("re-fetched shards (whole shards whose fetch had started)", refetched)
    assert bad == 0
    assert last.finished and last.shards_done == SHARDS and not last.failures
    with CacheStore(cache, readonly=True) as store:
        assert len(store.shards("tokens", 1)) == SHARDS
        assert all(store.get_chunk(ShardKey("tokens", 1, s), 0) for s in range(SHARDS))
    # At most the one shard in flight per kill. Counted in whole shards from each node's
    # edgecache_origin_fetches_total (a fetch that started counts as re-fetched even if
    # the kill landed a few bytes into it), so a run where every kill lands mid-shard
    # reaches the bound exactly.
    assert refetched <= kills
