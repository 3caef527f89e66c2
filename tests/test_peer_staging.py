"""Staging a version from a peer region's node: stored chunks copied, verified, counted apart.

Real nodes (``edgecache serve`` subprocesses) on loopback; a TCP proxy in front of
one peer cuts its stream mid-shard, as a peer that dies would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from edgeutil import publish, read_shard_table, shard_table, stub, write_parquet_shards
from tcpproxy import FaultyProxy, ranked_first

from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

SHARDS = 4


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, LocalNode]]]:
    root = tmp_path_factory.mktemp("peers")
    write_parquet_shards(root / "origin", SHARDS)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tokens")
    # Named by id (what peers are ranked by): eu-1's ranks first for shards 1-3 against
    # eu-2's, so a proxy in front of eu-1 carries bytes of the first shard it is asked.
    nodes = {
        name: start_local_node(
            name.split("-")[0], root / f"cache-{name}", registry, extra_args=["--node-id", name]
        )
        for name in ("eu-1", "eu-2", "us-1", "us-2", "ap-1")
    }
    for name in ("eu-1", "eu-2"):  # two full copies in eu
        last = list(
            stub(nodes[name].address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
        )[-1]
        assert last.finished and last.shards_done == SHARDS
    yield root, nodes
    for node in nodes.values():
        node.stop()


def stage(address: str, peers: list[str], **fields: object) -> edge_pb2.StageProgress:
    request = edge_pb2.StageRequest(dataset="tokens", version=1, peers=peers, **fields)
    return list(stub(address).Stage(request))[-1]


def status(address: str) -> edge_pb2.NodeStatus:
    return stub(address).Status(edge_pb2.StatusRequest())


def assert_holds_the_version(address: str) -> None:
    client = stub(address)
    for shard in range(SHARDS):
        got = read_shard_table(client, "tokens", 1, shard)
        assert got.equals(pa.Table.from_batches(shard_table(shard).to_batches()).cast(got.schema))


def test_copy_from_a_peer_never_touches_origin(site) -> None:
    _, nodes = site
    last = stage(nodes["us-1"].address, [nodes["eu-1"].address, nodes["eu-2"].address])
    assert last.finished and last.shards_done == SHARDS and not last.failures
    assert last.bytes_done == 0 and last.peer_bytes_done > 0  # no origin bytes at all
    s = status(nodes["us-1"].address)
    assert s.origin_bytes == 0 and s.staged_origin_bytes == 0
    assert s.staged_peer_bytes == last.peer_bytes_done
    assert s.versions[0].stored_bytes == status(nodes["eu-1"].address).versions[0].stored_bytes
    assert_holds_the_version(nodes["us-1"].address)
    # Again: nothing left to copy.
    again = stage(nodes["us-1"].address, [nodes["eu-1"].address])
    assert again.shards_skipped == SHARDS and again.peer_bytes_done == 0


def test_a_peer_cut_mid_shard_is_resumed_on_the_next_peer(site) -> None:
    _, nodes = site
    # Peers are asked in rendezvous order per shard: otherwise one run in sixteen asked
    # eu-2 first for all four shards and the proxy never carried a byte.
    proxy = ranked_first(
        lambda port: FaultyProxy(nodes["eu-1"].address, port=port), nodes["eu-2"].address
    )
    (held,) = [v for v in status(nodes["eu-1"].address).versions if v.dataset == "tokens"]
    try:
        proxy.cut_after(held.stored_bytes // SHARDS // 2)  # inside the first shard it sends
        last = stage(nodes["us-2"].address, [proxy.address, nodes["eu-2"].address])
    finally:
        proxy.close()
    assert last.finished and last.shards_done == SHARDS and not last.failures
    assert any("failed after" in note for note in last.notes), last.notes
    assert status(nodes["us-2"].address).origin_bytes == 0  # eu-2 gave the rest
    assert_holds_the_version(nodes["us-2"].address)


def test_when_no_peer_can_give_a_shard_origin_does_and_says_so(site) -> None:
    _, nodes = site
    proxy = FaultyProxy(nodes["eu-1"].address)
    try:
        proxy.cut_after(150_000)
        last = stage(nodes["ap-1"].address, [proxy.address])
    finally:
        proxy.close()
    assert last.finished and last.shards_done == SHARDS and not last.failures
    assert any("took it from origin" in note for note in last.notes), last.notes
    s = status(nodes["ap-1"].address)
    # The cut broke every stream in flight (they share one connection): those shards
    # came from origin, whole; none was committed half from one source, half the other.
    assert s.staged_origin_bytes > 0 and s.origin_bytes == s.staged_origin_bytes
    assert_holds_the_version(nodes["ap-1"].address)


def test_peers_only_fails_what_no_peer_has_and_a_peer_never_fetches_for_others(
    site, tmp_path: Path
) -> None:
    root, nodes = site
    write_parquet_shards(tmp_path / "fresh", 2, rows=500)
    publish(f"file://{root}/registry", f"file://{tmp_path}/fresh", "fresh")
    request = edge_pb2.StageRequest(
        dataset="fresh", version=1, peers=[nodes["eu-1"].address], peers_only=True
    )
    import grpc

    with pytest.raises(grpc.RpcError) as failed:
        list(stub(nodes["us-1"].address).Stage(request))
    # eu-1 answered that it does not hold the shards: no retry helps until the version
    # is staged there (FAILED_PRECONDITION), and the message says so.
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no peer could give it" in failed.value.details()
    assert nodes["eu-1"].address in failed.value.details()
    assert "stage fresh@1 on one of them first" in failed.value.details()
    # eu-1 was asked for shards it lacks and did not fetch them from its origin.
    assert not [v for v in status(nodes["eu-1"].address).versions if v.dataset == "fresh"]


def stored_bytes(registry: str, dataset: str, cache_dir: Path) -> int:
    """Bytes version 1 of ``dataset`` takes in a cache, staged on a scratch node."""
    node = start_local_node("eu", cache_dir, registry)
    try:
        client = stub(node.address)
        list(client.Stage(edge_pb2.StageRequest(dataset=dataset, version=1)))
        (version,) = client.Status(edge_pb2.StatusRequest()).versions
        return version.stored_bytes
    finally:
        node.stop()


def test_a_pin_keeps_a_resident_version_from_the_lru(tmp_path: Path) -> None:
    # Room for two and a half versions; "kept" was staged first (least recently used),
    # "other" second. Staging a third evicts by LRU: without a pin that is "kept", exactly
    # what a later job needs; with the controller's pin "other" loses shards instead.
    from google.protobuf.timestamp_pb2 import Timestamp

    registry = f"file://{tmp_path}/registry"
    for name in ("kept", "other", "third"):
        write_parquet_shards(tmp_path / name, 2, rows=500)
        publish(registry, f"file://{tmp_path}/{name}", name)
    # Sized from what one version takes once stored (the chunk codec decides that).
    one = stored_bytes(registry, "kept", tmp_path / "scratch")
    node = start_local_node("eu", tmp_path / "cache", registry, capacity=str(one * 5 // 2))
    try:
        client = stub(node.address)
        for name in ("kept", "other"):
            list(client.Stage(edge_pb2.StageRequest(dataset=name, version=1)))
        until = Timestamp()
        until.FromSeconds(int(time.time()) + 3600)
        client.Pin(edge_pb2.PinRequest(dataset="kept", version=1, until=until))
        list(client.Stage(edge_pb2.StageRequest(dataset="third", version=1)))
        held = {
            v.dataset
            for v in client.Status(edge_pb2.StatusRequest()).versions
            if v.shard_count == v.total_shards
        }
        assert held == {"kept", "third"}
        client.Pin(edge_pb2.PinRequest(dataset="kept", version=1))  # unset: unpinned
        list(client.Stage(edge_pb2.StageRequest(dataset="other", version=1)))
        held = {
            v.dataset
            for v in client.Status(edge_pb2.StatusRequest()).versions
            if v.shard_count == v.total_shards
        }
        assert "kept" not in held  # the LRU takes it once nothing protects it
    finally:
        node.stop()


def _room_for_two_of_three(tmp_path: Path) -> LocalNode:
    """A node with room for two of the three shards of ``big@1``, unpinned."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "big", 3, rows=500)
    publish(registry, f"file://{tmp_path}/big", "big")
    shard = stored_bytes(registry, "big", tmp_path / "scratch") // 3
    return start_local_node("eu", tmp_path / "cache", registry, capacity=str(shard * 5 // 2))


def test_a_stage_that_does_not_fit_says_so_instead_of_reporting_success(tmp_path: Path) -> None:
    # Room for two of three shards and no pin: the LRU takes the stage's own first shard
    # for its third. The stage must not end "6/6 done"; it names the shard and the fix.
    import grpc

    node = _room_for_two_of_three(tmp_path)
    try:
        with pytest.raises(grpc.RpcError) as failed:
            list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="big", version=1)))
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "does not fit in this node's capacity" in failed.value.details()
    finally:
        node.stop()


def test_a_revoked_shard_that_was_skipped_leaves_skipped_a_part_of_done(tmp_path: Path) -> None:
    """A shard held already (skipped) and then evicted by the stage's later shards was taken
    out of shards_done but not of shards_skipped: skipped could exceed done."""
    import grpc

    node = _room_for_two_of_three(tmp_path)
    try:
        client = stub(node.address)
        request = edge_pb2.ReadShardRequest(dataset="big", version=1, shard=0)
        assert list(client.ReadShard(request))  # held before the stage: skipped by it
        seen = []
        with pytest.raises(grpc.RpcError) as failed:
            for progress in client.Stage(edge_pb2.StageRequest(dataset="big", version=1)):
                seen.append(progress)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        last = seen[-1]
        assert last.finished and [f.shard for f in last.failures] == [0], last
        assert (last.shards_done, last.shards_skipped, last.shards_failed) == (2, 0, 1), last
    finally:
        node.stop()
