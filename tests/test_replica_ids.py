"""Replicas split shards by the ids their nodes report, whatever address each side dials.

Shard ownership hashed the address as dialled: warm inside a compose network
(``eu-west-2:7070``) and a reader on the host (``localhost:7072``) split the
shards differently, and every shard the reader looked for on a non-owner was
read through from origin and cached twice; ``ready`` through the host's names
said a staged version was not. And a reader given ``endpoints=[...]`` (the
README's example) knew of no replicas at all: every read went to the nearest
node, half of a two-replica region's shards through to origin. Real nodes on
loopback, warm through one set of names, reads and ``ready`` through another.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import torch
from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.cache.errors import InvalidEndpoint, ShardNotCached
from edgecache.cache.rendezvous import unique_names
from edgecache.clients import EdgeDataset
from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.node_client import start_local_node
from edgecache.clients.node_pool import NodePool
from edgecache.v1 import edge_pb2

SHARDS = 8
ROWS = 300


def _misses(addresses: list[str]) -> int:
    return sum(stub(a).Status(edge_pb2.StatusRequest()).misses for a in addresses)


@pytest.fixture
def staged(tmp_path: Path):  # noqa: ANN201
    """Two replicas of eu-west, split@1 warmed through 127.0.0.1 addresses."""
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=ROWS)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "split")
    nodes = [
        start_local_node(
            "eu-west", tmp_path / f"cache-{i}", registry, extra_args=["--node-id", f"eu-west-{i}"]
        )
        for i in range(2)
    ]
    try:
        addresses = [n.address for n in nodes]
        config = tmp_path / "edgecache.yaml"
        config.write_text(f"registry: {registry}\nregions:\n  eu-west:\n    nodes: {addresses}\n")
        code, out, err = edgecache(
            "warm", "split@1", "--region", "eu-west", "--config", str(config)
        )
        assert code == 0, (out, err)
        held = [stub(a).Status(edge_pb2.StatusRequest()).versions[0].shard_count for a in addresses]
        assert sum(held) == SHARDS and all(held), held  # split between them
        # The same nodes as the host would name them: other strings, the same nodes.
        others = [a.replace("127.0.0.1", "localhost") for a in addresses]
        yield tmp_path, registry, addresses, others
    finally:
        for node in nodes:
            node.stop()


def _labels(ds: EdgeDataset) -> list[int]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    return sorted(int(x) for batch in loader for x in batch["label"])


def test_a_reader_dialling_other_names_reads_every_shard_from_its_owner(staged) -> None:  # noqa: ANN001
    root, registry, addresses, others = staged
    config = root / "host.yaml"
    config.write_text(f"registry: {registry}\nregions:\n  eu-west:\n    nodes: {others}\n")
    before = _misses(addresses)
    ds = EdgeDataset("split@1", config=config, region="eu-west", batch_size=64)
    assert _labels(ds) == list(range(SHARDS * ROWS))
    assert _misses(addresses) == before  # no shard read through to origin
    code, out, err = edgecache("ready", "split@1", "--region", "eu-west", "--config", str(config))
    assert code == 0, (out, err)


def test_endpoints_given_as_a_list_are_told_apart_by_the_region_their_nodes_report(
    staged,  # noqa: ANN001
) -> None:
    """EdgeDataset(endpoints=[...]), as the README reads from a region of two replicas."""
    _, _, addresses, others = staged
    before = _misses(addresses)
    ds = EdgeDataset("split@1", endpoints=others, batch_size=64)
    assert _labels(ds) == list(range(SHARDS * ROWS))
    assert _misses(addresses) == before  # each shard from the replica that holds it


def test_a_replicas_local_cache_beside_the_topology_reads_the_rest_from_their_owners(
    staged,  # noqa: ANN001
) -> None:
    """lmdb:// beside config=/region=: the host's node's cache first, the region's routing
    for the shards it lacks (the other replica's), nothing read through to origin."""
    root, registry, addresses, _ = staged
    config = root / "edgecache.yaml"
    before = _misses(addresses)
    local = f"lmdb://{root / 'cache-0'}"
    ds = EdgeDataset("split@1", endpoints=[local], config=config, region="eu-west", batch_size=64)
    assert _labels(ds) == list(range(SHARDS * ROWS))
    assert _misses(addresses) == before
    served = {text: s["bytes"] for text, s in ds.stats()["endpoints"].items()}
    assert served[local] > 0 and served[addresses[1]] > 0, served  # its own, then the other's
    with pytest.raises(InvalidEndpoint, match="lmdb:// caches alone may be given"):
        EdgeDataset("split@1", endpoints=[local, addresses[0]], config=config, region="eu-west")
    with pytest.raises(InvalidEndpoint, match="pass config= with it"):
        EdgeDataset("split@1", endpoints=[local], region="eu-west")


def test_nodes_reporting_one_id_split_by_address_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        names = unique_names({"a:1": "n", "b:1": "n", "c:1": "m"})
    assert names == {"c:1": "m"}
    assert "nodes a:1, b:1 all report node id 'n'" in caplog.text
    assert "--node-id" in caplog.text


def test_a_replicas_local_cache_lacking_the_others_shards_says_so_not_evicted(
    staged,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica's cache read as lmdb:// lacks the other replica's shards by design; the
    warning said its node "evicted it … Stage it on that node again", which did nothing."""
    root, _, addresses, _ = staged
    ds = EdgeDataset("split@1", endpoints=[f"lmdb://{root / 'cache-0'}", *addresses], batch_size=64)
    with caplog.at_level(logging.WARNING):
        assert _labels(ds) == list(range(SHARDS * ROWS))
    said = [r.getMessage() for r in caplog.records if str(root / "cache-0") in r.getMessage()]
    # Said when the dataset is built ("the others are read from the other endpoints") and,
    # when a read meets a missing shard first, for that shard: never as an eviction alone.
    assert said, [r.getMessage() for r in caplog.records]
    for message in said:
        if "but not shard" in message:
            assert "another replica of its node's region owns that shard" in message, message
        else:
            assert "the others are read from the other endpoints" in message, message


def test_one_replicas_cache_alone_is_told_to_list_every_replicas(staged) -> None:  # noqa: ANN001
    """One replica's cache read alone lacks the other's shards; the advice was to warm the
    version again, which stages each shard on its owner only: followed, it changed nothing
    (a helper's hunt). It names the replicas, and the way it gives works."""
    root = staged[0]
    with pytest.raises(ShardNotCached) as raised:
        EdgeDataset("split@1", endpoints=[f"lmdb://{root / 'cache-0'}"], batch_size=64)
    said = " ".join(str(raised.value).split())
    assert "each stages only the shards it owns" in said, said
    assert "list every replica's cache directory" in said, said
    caches = [f"lmdb://{root / f'cache-{i}'}" for i in range(2)]
    assert _labels(EdgeDataset("split@1", endpoints=caches, batch_size=64)) == list(
        range(SHARDS * ROWS)
    )


def test_a_node_restarted_under_another_id_is_asked_again(tmp_path: Path) -> None:
    """A long-running reader learnt a node's id once and kept it across the node's restart."""
    registry = f"file://{tmp_path}/registry"
    first = start_local_node("eu-west", tmp_path / "c0", registry, extra_args=["--node-id", "old"])
    address = first.address
    pool = NodePool([parse_endpoint(address)], probe_interval=3600)
    try:
        pool.probe(pings=1)
        assert pool.stats[address].node_id == "old"
        first.stop()
        pool.probe(pings=1)  # down: known to be asked again
        again = start_local_node(
            "eu-west", tmp_path / "c1", registry,
            extra_args=["--node-id", "new", "--listen", address],
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while pool.stats[address].rtt_ms == math.inf and time.monotonic() < deadline:
                time.sleep(0.2)  # the channel's reconnect backoff, as between reprobes
                pool.probe(pings=1)
            assert pool.stats[address].node_id == "new"
        finally:
            again.stop()
    finally:
        pool.close()
        first.stop()
