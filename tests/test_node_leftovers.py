"""Edge node defects a review found: metrics that counted twice or not at all, an Evict
of nothing answered OK, a restart below the stored size, doctor's upload against a
node's limits. Real nodes on loopback, real LMDB files, a file:// origin."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from edgeutil import node_settings, publish, read_shard_table, stub, write_parquet_shards

from edgecache.cache.store import CacheStore
from edgecache.cache.units import format_bytes
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


@pytest.fixture
def registry(tmp_path: Path) -> str:
    """A published version ``tokens@1`` of two 1000-row shards in a file:// origin."""
    write_parquet_shards(tmp_path / "origin", 2, rows=1000)
    url = f"file://{tmp_path}/registry"
    publish(url, f"file://{tmp_path}/origin", "tokens")
    return url


def _stage(address: str, dataset: str = "tokens", version: int = 1) -> edge_pb2.StageProgress:
    return list(stub(address).Stage(edge_pb2.StageRequest(dataset=dataset, version=version)))[-1]


# ------------------------------------------------- 1: a damaged entry is one miss


def test_a_damaged_chunk_found_mid_read_is_one_miss_not_a_hit_too(
    tmp_path: Path, registry: str
) -> None:
    """The read began as a hit (the shard was resident), found a damaged chunk, dropped
    the shard and fetched it from origin again: it was counted as a hit and a miss."""
    from storeutil import flip_on_disk

    with running_node(node_settings(tmp_path, registry)) as node:
        assert _stage(node.address).shards_done == 2
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        [info, _] = store.shards("tokens", 1)
        frame = store.get_chunk(info.key, 1)
    assert info.chunk_count > 2
    flip_on_disk(tmp_path / "cache", frame, 24)  # a checksum bit of a middle chunk
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        assert read_shard_table(client, "tokens", 1, 0).num_rows == 1000
        assert node.node is not None
        m = node.node.metrics
        assert m.value("edgecache_corrupt_chunks_total") == 1
        assert m.value("edgecache_origin_fetches_total") == 1
        damaged = (m.value("edgecache_cache_hits_total"), m.value("edgecache_cache_misses_total"))
        read_shard_table(client, "tokens", 1, 0)  # re-fetched whole: a plain hit now
        status = client.Status(edge_pb2.StatusRequest())
    assert damaged == (0, 1)
    assert (status.hits, status.misses) == (1, 1)


def test_a_damaged_shard_record_is_one_miss(tmp_path: Path, registry: str) -> None:
    """A record damaged before the read began (its chunk count) is a miss, once."""
    import lmdb

    from edgecache.cache.keys import ShardKey
    from edgecache.v1 import store_pb2

    with running_node(node_settings(tmp_path, registry)) as node:
        _stage(node.address)
    env = lmdb.open(str(tmp_path / "cache"), max_dbs=8)
    raw_key = ShardKey("tokens", 1, 0).encode()
    with env.begin(write=True) as txn:
        shards = env.open_db(b"shards", txn=txn, create=False)
        record = store_pb2.StoredShard.FromString(txn.get(raw_key, db=shards))
        record.chunk_count -= 1
        txn.put(raw_key, record.SerializeToString(), db=shards)
    env.close()
    with running_node(node_settings(tmp_path, registry)) as node:
        assert read_shard_table(stub(node.address), "tokens", 1, 0).num_rows == 1000
        assert node.node is not None
        m = node.node.metrics
        counts = (m.value("edgecache_cache_hits_total"), m.value("edgecache_cache_misses_total"))
    assert counts == (0, 1)


# ------------------------------------------- 2: a cancelled Stage is in the histogram


def _wait_for(predicate: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cancelled_stage_is_recorded_as_cancelled(
    tmp_path: Path, registry: str, how: str
) -> None:
    """A Stage its caller cancelled, or whose deadline passed, ended in CancelledError (a
    BaseException) and was missing from edgecache_stage_seconds: long stages cut short by
    their callers were invisible on the dashboard."""
    # 2 KB/s of origin: the stage is still on its first shard when it is cut short.
    with running_node(node_settings(tmp_path, registry, staging_rate=2048)) as node:
        assert node.node is not None
        m = node.node.metrics
        request = edge_pb2.StageRequest(dataset="tokens", version=1)
        if how == "cancel":
            call = stub(node.address).Stage(request)
            assert _wait_for(lambda: m.value("edgecache_staging_active") == 1)
            call.cancel()
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            assert error.value.code() == grpc.StatusCode.CANCELLED
        else:
            # 0.5 s could pass under a loaded parallel suite before the node had even
            # started the call (then nothing is cut short, and nothing counted); at
            # 2 KB/s the stage is still on its first 160 KB shard after 3 s.
            with pytest.raises(grpc.RpcError) as error:
                list(stub(node.address).Stage(request, timeout=3.0))
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The handler hears of it after the caller: wait for its count.
        result = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"
        assert _wait_for(lambda: m.value("edgecache_stage_seconds_count", result=result))
        assert m.value("edgecache_stage_seconds_count", result=result) == 1
        assert m.value("edgecache_stage_seconds_count", result="ok") == 0


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_read_abandoned_before_its_first_chunk_is_a_miss_and_timed(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A reader that left while its miss was fetched from origin (the slowest reads, the
    ones EdgeDataset gives up on) was counted nowhere: neither a miss nor a first-chunk
    time, so the hit ratio, Status and the data-stall alert never saw it."""
    from faultproxy import OriginFaults
    from s3server import make_bucket, upload_dir

    bucket = f"abandon-{how}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 1, rows=1000)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"s3://{bucket}/raw/", "tokens")
    # 6 s before answering: the deadline below passes during it even when a loaded parallel
    # suite delays the node's start of the call by seconds.
    proxy = OriginFaults(s3_endpoint, {r"\.parquet$": ["stall"]}, stall_seconds=6.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with running_node(node_settings(tmp_path, registry)) as node:
            assert node.node is not None
            m = node.node.metrics
            request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
            if how == "cancel":
                call = stub(node.address).ReadShard(request)
                assert _wait_for(lambda: proxy.injected)  # the fetch is under way
                call.cancel()
            else:
                # Passes during the proxy's stall; 0.5 s, then 1.5 s, could pass under a
                # loaded parallel suite before the node had even started the call (then
                # nothing on the node is abandoned, and nothing counted).
                call = stub(node.address).ReadShard(request, timeout=3.0)
            with pytest.raises(grpc.RpcError):
                list(call)
            result = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"
            first = "edgecache_read_first_chunk_seconds_count"
            assert _wait_for(lambda: m.value(first, result=result)), {  # what was counted
                r: m.value(first, result=r) for r in ("CANCELLED", "DEADLINE_EXCEEDED", "ok")
            }
            assert m.value("edgecache_cache_misses_total") == 1
            assert m.value("edgecache_cache_hits_total") == 0
            # The fetch went on for the next reader: it is a hit once stored.
            assert read_shard_table(stub(node.address), "tokens", 1, 0).num_rows == 1000
            assert (
                m.value("edgecache_cache_misses_total") + m.value("edgecache_cache_hits_total") == 2
            )
            assert m.value(first, result="ok") == 1
    finally:
        proxy.close()


# ------------------------------------------------- 3: Evict of an unknown version


def test_evicting_a_version_nobody_knows_is_not_found(tmp_path: Path, registry: str) -> None:
    """Evict of a version the node never heard of (a typo) answered OK, 0 bytes freed; one
    the registry publishes but this node does not hold is still OK with 0 bytes."""
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        for name, version in (("tokns", 1), ("tokens", 7)):
            with pytest.raises(grpc.RpcError) as error:
                client.Evict(edge_pb2.EvictRequest(dataset=name, version=version))
            assert error.value.code() == grpc.StatusCode.NOT_FOUND, error.value
            details = error.value.details() or ""
            assert f"{name}@{version}" in details and "edgecache versions" in details, details
        # Published, not cached here: nothing to free, and nothing wrong.
        assert client.Evict(edge_pb2.EvictRequest(dataset="tokens", version=1)).bytes_freed == 0
        _stage(node.address)
    # The registry is gone (another URL): a version this node holds is still evicted.
    gone = f"file://{tmp_path}/elsewhere"
    with running_node(node_settings(tmp_path, gone)) as node:
        freed = stub(node.address).Evict(edge_pb2.EvictRequest(dataset="tokens", version=1))
        assert freed.bytes_freed > 0
        assert node.node is not None and not node.node.store.versions()


# ---------------------------------- 4: a restart below what is stored fits at once


def test_a_node_restarted_with_less_capacity_than_it_holds_evicts_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Restarted with --capacity below what the cache held, the node served over capacity,
    silently, until a write made room. It warns with both sizes and evicts the least
    recently used unpinned shards at startup, never a pinned one."""
    from datetime import UTC, datetime, timedelta

    write_parquet_shards(tmp_path / "origin", 4, rows=1000)
    url = f"file://{tmp_path}/registry"
    publish(url, f"file://{tmp_path}/origin", "tokens")
    publish(url, f"file://{tmp_path}/origin", "pinned")
    with running_node(node_settings(tmp_path, url)) as node:
        client = stub(node.address)
        for dataset in ("tokens", "pinned"):
            _stage(node.address, dataset)
        pin = edge_pb2.PinRequest(dataset="pinned", version=1)
        pin.until.FromDatetime(datetime.now(UTC) + timedelta(days=1))
        client.Pin(pin)
        read_shard_table(client, "tokens", 1, 3)  # the most recently used of tokens
        versions = {v.dataset: v for v in client.Status(edge_pb2.StatusRequest()).versions}
    pinned, tokens = versions["pinned"].stored_bytes, versions["tokens"].stored_bytes
    capacity = pinned + tokens // 3  # room for the pinned version and one shard of tokens
    with (
        caplog.at_level("WARNING"),
        running_node(node_settings(tmp_path, url, capacity=capacity)) as node,
    ):
        assert node.node is not None
        stats = node.node.store.stats
        held = {v.dataset: v for v in node.node.store.versions()}
        evicted = node.node.metrics.value("edgecache_cache_evicted_bytes_total")
    assert stats.used_bytes <= capacity
    assert held["pinned"].stored_bytes == pinned  # never evicted
    assert [s.key.shard for s in _shards(tmp_path, "tokens")] == [3]  # the last one read stays
    assert evicted == pinned + tokens - stats.used_bytes
    [warning] = [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]
    assert format_bytes(pinned + tokens) in warning and format_bytes(capacity) in warning
    assert "evicted 3 " in warning and "pinned versions" not in warning, warning


def test_pinned_data_over_a_lowered_capacity_is_kept_and_said(
    tmp_path: Path, registry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Pinned shards alone over the new capacity: none is evicted, and the warning says the
    pins are why the cache stays over its capacity."""
    from datetime import UTC, datetime, timedelta

    with running_node(node_settings(tmp_path, registry)) as node:
        request = edge_pb2.StageRequest(dataset="tokens", version=1)
        request.pin_until.FromDatetime(datetime.now(UTC) + timedelta(days=1))
        list(stub(node.address).Stage(request))
        held = stub(node.address).Status(edge_pb2.StatusRequest()).used_bytes
    with (
        caplog.at_level("WARNING"),
        running_node(node_settings(tmp_path, registry, capacity=held // 2)) as node,
    ):
        assert node.node is not None
        assert node.node.store.stats.used_bytes == held
    [warning] = [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]
    assert format_bytes(held) in warning and format_bytes(held // 2) in warning, warning
    assert "pinned versions alone (tokens@1" in warning, warning


def _shards(tmp_path: Path, dataset: str) -> list:
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        return store.shards(dataset, 1)


# ------------------------------- 5: concurrent stages of one shard count it once


def test_concurrent_stages_of_a_shard_count_it_staged_once(tmp_path: Path, registry: str) -> None:
    """Two Stage calls racing for the same shards share one fetch of each; both counted it in
    edgecache_staged_shards_total{result="staged"}, twice the shards stored."""
    from concurrent.futures import ThreadPoolExecutor

    # ~0.5 s a shard: the second stage arrives while the first one's fetches run.
    with running_node(node_settings(tmp_path, registry, staging_rate=300_000)) as node:
        assert node.node is not None
        edge = node.node
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_stage, node.address)
            assert _wait_for(lambda: len(edge._inflight) == 2)
            second = pool.submit(_stage, node.address)
            outcomes = [first.result(timeout=30), second.result(timeout=30)]
        assert not edge._inflight
        staged = edge.metrics.value("edgecache_staged_shards_total", result="staged")
        skipped = edge.metrics.value("edgecache_staged_shards_total", result="skipped")
        fetches = edge.metrics.value("edgecache_origin_fetches_total")
    assert [o.shards_done for o in outcomes] == [2, 2]
    assert fetches == 2  # the premise: one fetch of each shard, shared
    assert (staged, skipped) == (2, 2)


# ------------------------- 6: doctor's upload fits the node's request and stream limits


def _doctor_paths(tmp_path: Path, registry: str, **limits: object) -> list:
    from edgecache.clients.doctor import check_paths
    from edgecache.clients.topology import RegionConfig, Topology

    with running_node(node_settings(tmp_path, registry, **limits)) as node:
        topology = Topology(registry=registry, regions={"eu": RegionConfig(nodes=[node.address])})
        return check_paths(topology, home_region="eu", pings=3, throughput_seconds=1.0)


def test_doctor_uploads_in_messages_a_small_max_request_bytes_accepts(
    tmp_path: Path, registry: str
) -> None:
    """Each upload message was 512 KiB; a node with max_request_bytes below that refused
    every one, and the doctor reported the upload test refused (RESOURCE_EXHAUSTED)."""
    [check] = _doctor_paths(tmp_path, registry, max_request_bytes=16 << 10)
    assert check.upload_mb_s and check.upload_mb_s > 0, check
    assert check.streams == 4
    assert not [p for p in check.problems if "upload" in p], check.problems


def test_doctor_uploads_on_the_streams_a_small_max_streams_allows(
    tmp_path: Path, registry: str
) -> None:
    """With max_streams below the doctor's four upload streams, the streams beyond it were
    refused and the rate measured on the others was reported as four streams' rate."""
    [check] = _doctor_paths(tmp_path, registry, max_streams=2)
    assert check.upload_mb_s and check.upload_mb_s > 0, check
    assert 1 <= check.streams < 4, check
    [note] = [p for p in check.problems if "max_streams" in p]
    assert f"{check.streams} of 4 upload streams" in note, note


@pytest.mark.parametrize("limits", [{"max_request_bytes": 16 << 10}, {"max_streams": 2}])
def test_a_nodes_upload_into_a_peer_fits_the_peers_limits(
    tmp_path: Path, registry: str, limits: dict
) -> None:
    """Diagnose of a peer (doctor --node-paths) uploads into the peer's Sink: 512 KiB
    messages failed the whole test against a peer with a lower max_request_bytes, and the
    streams a peer's max_streams refused failed it too."""
    peer_dir, node_dir = tmp_path / "peer", tmp_path / "node"
    with (
        running_node(node_settings(peer_dir, registry, region="us", **limits)) as peer,
        running_node(node_settings(node_dir, registry)) as node,
    ):
        request = edge_pb2.DiagnoseRequest(target=peer.address, seconds=1, streams=4)
        report = stub(node.address).Diagnose(request, timeout=60)
    assert report.bytes_per_second > 0, report
    if "max_streams" in limits:
        assert 1 <= report.streams < 4, report
        assert f"{report.streams} of 4 upload streams" in report.note, report.note
        assert "max_streams" in report.note, report.note
    else:
        assert report.streams == 4, report


# ------------------------------------- a damaged copy of a manifest kept by the node


def _damage_kept_manifest(cache: Path, *, digest_too: bool) -> None:
    """One changed field in the node's own copy of tokens@1's manifest (the registry's is
    intact); with ``digest_too`` its recorded digest changes as well."""
    from edgecache.v1 import manifest_pb2

    with CacheStore(cache) as store:
        manifest = manifest_pb2.Manifest.FromString(store.get_manifest("tokens", 1) or b"")
        manifest.shards[0].source_key += ".x"
        if digest_too:
            manifest.digest = "sha256:" + "0" * 64
        store.put_manifest("tokens", 1, manifest.SerializeToString())


@pytest.mark.parametrize("digest_too", [False, True])
def test_a_damaged_kept_manifest_is_read_again_from_the_registry(
    tmp_path: Path, registry: str, digest_too: bool
) -> None:
    """A flipped byte in the node's copy of a manifest refused the version for good, after
    Evict and restarts too, with "republish it" for a registry copy that was intact. The
    registry's is read again; the cached shards stay when it carries the digest the copy
    still records, and are dropped (fetched again) when which version they are is unknown."""
    with running_node(node_settings(tmp_path, registry)) as node:
        _stage(node.address)
    _damage_kept_manifest(tmp_path / "cache", digest_too=digest_too)
    with running_node(node_settings(tmp_path, registry)) as node:
        for shard in (0, 1):
            assert read_shard_table(stub(node.address), "tokens", 1, shard).num_rows == 1000
        assert node.node is not None
        misses = node.node.metrics.value("edgecache_cache_misses_total")
    assert misses == (2 if digest_too else 0), misses
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        from edgecache.cache.manifest import manifest_from_bytes

        kept = manifest_from_bytes(store.get_manifest("tokens", 1) or b"")  # whole again
        assert not kept.shards[0].source_key.endswith(".x")


def test_a_shard_refused_for_pinned_room_is_not_fetched_again_until_there_is_room(
    tmp_path: Path, registry: str
) -> None:
    """A cache full of pinned data fetched and preprocessed each shard before refusing it,
    on every request that asked: six refusals pulled six shards from origin. The size a
    refused shard needed is remembered, and staging it is refused before fetching while
    pins still leave too little (a reader is served it uncached meanwhile); once they do
    not, it is staged as before."""
    from google.protobuf.timestamp_pb2 import Timestamp

    write_parquet_shards(tmp_path / "origin2", 2, rows=1000)
    publish(registry, f"file://{tmp_path}/origin2", "other")
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        _stage(node.address)
        assert node.node is not None
        held = node.node.store.stats.used_bytes
    # Restarted with room for tokens@1 alone, pinned: nothing of other@1 fits.
    with running_node(node_settings(tmp_path, registry, capacity=held + 1024)) as node:
        client = stub(node.address)
        until = Timestamp(seconds=int(time.time()) + 3600)
        client.Pin(edge_pb2.PinRequest(dataset="tokens", version=1, until=until))
        assert node.node is not None
        fetches = lambda: node.node.metrics.value("edgecache_origin_fetches_total")  # noqa: E731
        codes = []
        shard0 = edge_pb2.StageRequest(dataset="other", version=1, shards=[0])
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                list(client.Stage(shard0))
            codes.append(refused.value.code())
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
        assert fetches() == 1, fetches()  # the first refusal fetched; the others did not
        assert "not fetched" in (refused.value.details() or "")
        client.Pin(edge_pb2.PinRequest(dataset="tokens", version=1))  # unpinned: room again
        list(client.Stage(shard0))
        assert fetches() == 2
        assert read_shard_table(client, "other", 1, 0).num_rows == 1000
        assert fetches() == 2  # staged: read from the cache


def test_concurrent_stages_of_one_version_report_each_shard_fetched_once(
    tmp_path: Path,
) -> None:
    """Eight Stage calls of one version each reported every shard's bytes as fetched by it
    (bytes_done 8 × the version, shards_skipped 0) while the node fetched each once and its
    metrics counted the others skipped. A shard another request fetched while this one
    waited is skipped here, its bytes the other's."""
    from concurrent.futures import ThreadPoolExecutor

    write_parquet_shards(tmp_path / "origin", 6, rows=4000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(node_settings(tmp_path, registry)) as node:
        with ThreadPoolExecutor(8) as pool:
            last = list(pool.map(lambda _: _stage(node.address), range(8)))
        assert node.node is not None
        staged = node.node.metrics.value("edgecache_staged_shards_total", result="staged")
    total = last[0].bytes_total
    assert all(p.finished and p.shards_done == 6 and not p.shards_failed for p in last), last
    assert staged == 6
    assert sum(p.bytes_done for p in last) == total, [p.bytes_done for p in last]
    assert sum(6 - p.shards_skipped for p in last) == 6, [p.shards_skipped for p in last]


@pytest.mark.parametrize("chunk", [0, 1])
def test_a_damaged_checksum_in_a_shard_record_is_read_through_whole(
    tmp_path: Path, registry: str, chunk: int
) -> None:
    """One checksum of a shard's record flipped: its chunk fails its check, the shard is
    fetched anew, and the read ended UNAVAILABLE saying the shard "was re-encoded
    differently mid-stream" (the new record differs from the damaged one exactly there).
    The stream goes on from the new copy when the chunks it sent are the same."""
    import lmdb

    from edgecache.cache.keys import ShardKey
    from edgecache.v1 import store_pb2

    with running_node(node_settings(tmp_path, registry)) as node:
        _stage(node.address)
        expected = read_shard_table(stub(node.address), "tokens", 1, 0)
    env = lmdb.open(str(tmp_path / "cache"), max_dbs=8)
    raw_key = ShardKey("tokens", 1, 0).encode()
    with env.begin(write=True) as txn:
        shards = env.open_db(b"shards", txn=txn, create=False)
        record = store_pb2.StoredShard.FromString(txn.get(raw_key, db=shards))
        assert record.chunk_count > chunk
        record.checksums[chunk] ^= 1
        txn.put(raw_key, record.SerializeToString(), db=shards)
    env.close()
    with running_node(node_settings(tmp_path, registry)) as node:
        assert read_shard_table(stub(node.address), "tokens", 1, 0).equals(expected)


class _Left:
    """A call context's ``time_remaining``, as a gRPC aio server reports it."""

    def __init__(self, left: float | None) -> None:
        self.left = left

    def time_remaining(self) -> float | None:
        return self.left


@pytest.mark.parametrize(
    ("left", "result"),
    [
        (None, "CANCELLED"),
        (30.0, "CANCELLED"),
        (0.4, "DEADLINE_EXCEEDED"),
        (0.0, "DEADLINE_EXCEEDED"),
    ],
)
def test_a_cancel_at_the_clients_deadline_counts_as_the_deadline(
    left: float | None, result: str
) -> None:
    """The client's deadline fires before the node's (which starts when the request
    arrives): its cancel came with 0.4 s "left" and was counted CANCELLED, in a fresh-clone
    run under load."""
    from edgecache.edge.service import _abandoned

    assert _abandoned(_Left(left)) == result  # type: ignore[arg-type]


def test_a_damaged_chunk_in_a_read_only_lmdb_cache_says_how_to_mend_it(
    tmp_path: Path, registry: str
) -> None:
    """Read through lmdb:// (read-only in the training process) a damaged shard is never
    dropped, so every epoch met it: the error said only the checksum, and the log that it
    would retry for 30 s."""
    from storeutil import flip_on_disk

    from edgecache.cache.errors import ChunkCorrupt
    from edgecache.clients import EdgeDataset

    with running_node(node_settings(tmp_path, registry)) as node:
        assert _stage(node.address).shards_done == 2
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        [info, _] = store.shards("tokens", 1)
        frame = store.get_chunk(info.key, 1)
    flip_on_disk(tmp_path / "cache", frame, 24)  # a checksum bit of a middle chunk
    ds = EdgeDataset("tokens@1", endpoints=[f"lmdb://{tmp_path / 'cache'}"], batch_size=100)
    try:
        with pytest.raises(ChunkCorrupt) as damaged:
            for _ in ds:
                pass
    finally:
        ds.close()
    said = " ".join(str(damaged.value).split())
    assert "read-only" in said and "edgecache evict" in said and "warm" in said, said


def test_a_cancelled_stage_starts_no_more_shards(tmp_path: Path) -> None:
    """Its fetches still queued at the staging gate went on after the cancel: a warm
    interrupted, or a controller stopped, kept fetching and caching shards (and after an
    evict, brought them back), where a cancelled Stage starts no more (a helper's hunt)."""
    write_parquet_shards(tmp_path / "origin", 6, rows=1000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "six")
    # About a shard a second through the gate: queued shards start within seconds if let.
    settings = node_settings(tmp_path, registry, staging_rate=150_000)
    with running_node(settings) as node:
        assert node.node is not None
        m = node.node.metrics
        call = stub(node.address).Stage(edge_pb2.StageRequest(dataset="six", version=1))
        assert _wait_for(lambda: m.value("edgecache_origin_fetches_total") >= 1)
        call.cancel()
        started = m.value("edgecache_origin_fetches_total")
        assert _wait_for(lambda: m.value("edgecache_stage_seconds_count", result="CANCELLED"))
        time.sleep(5.0)  # long enough for the queued shards to pass the gate, were they let
        assert m.value("edgecache_origin_fetches_total") == started
        held = stub(node.address).Status(edge_pb2.StatusRequest()).versions
        assert sum(v.shard_count for v in held) <= started < 6
        # A read of a shard the Stage gave up is a miss fetched on its own.
        assert read_shard_table(stub(node.address), "six", 1, 5).num_rows == 1000
