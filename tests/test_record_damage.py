"""Bit rot in a cache's records (not its chunks): never served, dropped, and never a crash.

A chunk carries its own checksum; the shard and version records beside it do not.
A flipped byte that left a record unparseable used to raise protobuf's
``DecodeError`` out of every read, listing and eviction of its version: the node
answered INTERNAL for good, ``evict`` could not remove it, ``Status`` failed (so
``status``, ``plan`` and ``warm`` took the node for down) and an ``lmdb://``
reader crashed instead of reading the shard from the next endpoint.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import grpc
import lmdb
import pytest
from edgeutil import ROWS_PER_SHARD, staged_by_a_node, stub
from storeutil import shard_frames

from edgecache.cache.errors import ChunkCorrupt, ShardNotCached
from edgecache.cache.keys import ShardKey, version_key
from edgecache.cache.store import CacheStore
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

K0, K1 = ShardKey("tokens", 1, 0), ShardKey("tokens", 1, 1)


def _rot_record(cache: Path, db: bytes, key: bytes) -> None:
    """Flip the bit that turns the record's first tag into wire type 4: it no longer parses.

    Through LMDB (the way test_store damages a record): copy-on-write leaves older
    copies of a small record in free pages, so a flip found by searching the file
    may land on one no transaction reads.
    """
    env = lmdb.open(str(cache), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            table = env.open_db(db, txn=txn, create=False)
            value = bytearray(txn.get(key, db=table))
            value[0] ^= 1 << 2
            txn.put(key, bytes(value), db=table)
    finally:
        env.close()


def _rot_record_open(store: CacheStore, key: ShardKey) -> None:
    """:func:`_rot_record` of a shard's record, through a store that has the cache open."""
    env, shards = store._env, store._dbs[b"shards"]
    assert env is not None
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key.encode(), db=shards))
        value[0] ^= 1 << 2
        txn.put(key.encode(), bytes(value), db=shards)


def _second_shard_rotten(tmp_path: Path) -> tuple[Path, list[bytes], int]:
    """:func:`_two_shards` with the second shard's record damaged: (cache, frames, a shard's
    stored bytes)."""
    cache = tmp_path / "c"
    frames = _two_shards(cache)
    _rot_record(cache, b"shards", K1.encode())
    return cache, frames, sum(len(f) for f in frames)


def _two_shards(path: Path, pin: bool = False) -> list[bytes]:
    frames = shard_frames()
    with CacheStore(path, capacity_bytes=64 << 20, sync=False) as s:
        s.put_shard(K0, frames)
        s.put_shard(K1, frames)
        if pin:
            s.pin_version("tokens", 1, datetime.now(UTC) + timedelta(hours=1))
    return frames


def test_a_shard_record_that_does_not_parse_is_dropped_and_its_room_freed(tmp_path: Path) -> None:
    cache, frames, size = _second_shard_rotten(tmp_path)
    with CacheStore(cache, sync=False) as s:
        assert s.stats.used_bytes == 2 * size
        with pytest.raises(ChunkCorrupt, match=r"record of tokens@1/shard-1 .* damaged"):
            s.get_chunk(K1, 0)
        # Dropped with the chunks found under its key: the used bytes are right again.
        assert s.shard_info(K1) is None and s.stats.corrupt_chunks == 1
        assert s.stats.used_bytes == size
        assert [i.key for i in s.shards("tokens", 1)] == [K0]
        assert [(v.shard_count, v.stored_bytes) for v in s.versions()] == [(1, size)]
        s.put_shard(K1, frames)  # fetched again
        assert s.get_chunk(K1, 0) == frames[0]
        assert s.stats.used_bytes == 2 * size


def test_a_damaged_shard_record_is_evicted_and_written_over(tmp_path: Path) -> None:
    cache, frames, size = _second_shard_rotten(tmp_path)
    with CacheStore(cache, sync=False) as s:
        s.put_shard(K1, frames)  # over the damaged record: its chunks replaced, counted once
        assert s.stats.used_bytes == 2 * size and s.get_chunk(K1, 2) == frames[2]
    _rot_record(cache, b"shards", K1.encode())
    with CacheStore(cache, sync=False) as s:
        assert s.evict_version("tokens", 1) == 2 * size
        assert s.stats.used_bytes == 0 and s.versions() == []


def test_a_damaged_shard_record_is_never_read_from_a_read_only_cache(tmp_path: Path) -> None:
    cache = tmp_path / "c"
    _two_shards(cache)
    _rot_record(cache, b"shards", K1.encode())
    with CacheStore(cache, readonly=True) as r:
        assert r.shard_info(K1) is None
        assert [i.key for i in r.shards("tokens", 1)] == [K0]
        with pytest.raises(ChunkCorrupt, match="damaged .*not served$"):
            r.get_chunk(K1, 0)
    with CacheStore(cache, sync=False) as s:  # still there for its node to drop
        assert s.stats.used_bytes > 0


def test_a_good_copy_written_after_the_damage_was_seen_is_kept(tmp_path: Path) -> None:
    """The damage is seen in a read's snapshot and dropped in a write after it: a copy
    fetched again in between was deleted with it (a review)."""
    cache = tmp_path / "c"
    frames = _two_shards(cache)
    _rot_record(cache, b"shards", K1.encode())
    with CacheStore(cache, sync=False) as s:
        s.put_shard(K1, frames)  # a good copy, after a snapshot that saw the damaged one
        s._record_damaged(K1)  # what that read does next
        assert s.get_chunk(K1, 1) == frames[1]


def test_a_damaged_record_a_read_only_reader_meets_again_is_counted_once(tmp_path: Path) -> None:
    cache = tmp_path / "c"
    _two_shards(cache)
    _rot_record(cache, b"shards", K1.encode())
    with CacheStore(cache, readonly=True) as r:
        for _ in range(3):
            assert r.shard_info(K1) is None and len(r.shards("tokens", 1)) == 1
        assert r.stats.corrupt_chunks == 1


def test_a_node_counts_a_new_copy_damaged_again(tmp_path: Path) -> None:
    """A review: a node's store (which leaves the drop to the next fetch) counted a record's
    damage once per process: the copy fetched over it, damaged again, went unseen."""
    cache = tmp_path / "c"
    frames = _two_shards(cache)
    seen: list[ShardKey] = []
    with CacheStore(cache, sync=False) as s:
        s.drop_corrupt, s.on_damage = False, seen.append  # as a node runs it
        for _ in range(2):
            _rot_record_open(s, K1)
            assert s.shard_info(K1) is None and s.shard_info(K1) is None
            s.put_shard(K1, frames)  # the fetch that writes over it
        assert seen == [K1, K1] and s.stats.corrupt_chunks == 2


def test_a_version_record_that_does_not_parse_is_counted_again_from_its_shards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "c"
    frames = _two_shards(cache, pin=True)
    size = sum(len(f) for f in frames)
    _rot_record(cache, b"versions", version_key("tokens", 1))
    with CacheStore(cache, sync=False) as s:
        (listed,) = s.versions()
        # Its sums come back; its pin cannot, and the log says until when it is gone.
        assert (listed.shard_count, listed.stored_bytes, listed.pinned_until) == (2, 2 * size, None)
        assert "record of tokens@1" in caplog.text and "pin" in caplog.text
        s.drop_shard(K0)  # a commit of the version rewrites the record whole
        assert [(v.shard_count, v.stored_bytes) for v in s.versions()] == [(1, size)]
        s.put_shard(K0, frames)
        assert [(v.shard_count, v.stored_bytes) for v in s.versions()] == [(2, 2 * size)]
    _rot_record(cache, b"versions", version_key("tokens", 1))
    with CacheStore(cache, sync=False) as s:
        s.pin_version("tokens", 1, datetime.now(UTC) + timedelta(hours=1))
        (listed,) = s.versions()
        assert listed.shard_count == 2 and listed.pinned_until is not None
    _rot_record(cache, b"versions", version_key("tokens", 1))
    with CacheStore(cache, sync=False) as s:
        assert s.evict_version("tokens", 1) == 2 * size
        assert s.versions() == [] and s.stats.used_bytes == 0


def test_a_node_with_damaged_records_answers_status_and_serves_every_shard(
    tmp_path: Path,
) -> None:
    registry, cache, _ = staged_by_a_node(tmp_path, 2)
    _rot_record(cache, b"shards", K1.encode())
    _rot_record(cache, b"versions", version_key("tokens", 1))

    node = start_local_node("eu", cache, registry, extra_args=["--metrics-listen", "127.0.0.1:0"])
    try:
        client = stub(node.address)
        status = client.Status(edge_pb2.StatusRequest(), timeout=10)
        assert [(v.dataset, v.version) for v in status.versions] == [("tokens", 1)]
        first = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=1)
        try:  # the damaged record: dropped at once (a miss, fetched) or on this read
            frames = list(client.ReadShard(first, timeout=30))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            frames = list(client.ReadShard(first, timeout=30))
        assert frames and all(f.frame for f in frames)
        page = urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
        (corrupt,) = re.findall(r"^edgecache_corrupt_chunks_total\{.*\} (\S+)", page, re.M)
        assert float(corrupt) == 1, page  # counted by the node, as damaged chunks are
        rows = sum(
            len(batch["label"]) for batch in EdgeDataset("tokens@1", endpoints=[node.address])
        )
        assert rows == 2 * ROWS_PER_SHARD
        client.Evict(edge_pb2.EvictRequest(dataset="tokens", version=1), timeout=10)
    finally:
        node.stop()


def test_an_lmdb_reader_reads_a_damaged_shard_from_the_next_endpoint(tmp_path: Path) -> None:
    registry, cache, _ = staged_by_a_node(tmp_path, 2)
    _rot_record(cache, b"shards", K1.encode())

    # Alone, the cache is told to be staged again when the dataset is built.
    with pytest.raises(ShardNotCached, match="1 of the 2 shards of tokens@1"):
        EdgeDataset("tokens@1", endpoints=[f"lmdb://{cache}"])
    other = start_local_node("eu", tmp_path / "other", registry)
    try:
        ds = EdgeDataset("tokens@1", endpoints=[f"lmdb://{cache}", other.address], shuffle=False)
        labels = [int(v) for batch in ds for v in batch["label"]]
        assert len(labels) == 2 * ROWS_PER_SHARD and len(set(labels)) == len(labels)
    finally:
        other.stop()
