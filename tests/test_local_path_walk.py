"""The local fast path (``lmdb://``) walked as a training host uses it, while its node acts.

A real ``edgecache serve`` subprocess on loopback stages versions from a
``file://`` origin; EdgeDataset reads its cache directory straight from LMDB
through a real ``torch.utils.data.DataLoader`` (0 and 2 workers) while the
node evicts, re-stages, is killed and restarted, or grows its cache. The
reads that could crash the process run in a child process (this file, run as
a script), so a crash fails one test instead of ending the run.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.store import CacheStore
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

SHARDS, ROWS = 4, 1500
TOTAL = SHARDS * ROWS
# Small windows read one at a time, so the node acts while most of the epoch is unread.
SMALL = {
    "window_bytes": 16 << 10,
    "batch_size": 50,
    "threads": 2,
    "prefetch_bytes": 1,
    "lanes": 2,
    "shuffle_windows": 1,
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("local-path")
    write_parquet_shards(root / "origin", SHARDS, rows=ROWS)
    write_parquet_shards(root / "origin-big", 6, rows=3000)
    url = f"file://{root}/registry"
    # Uncompressed: windows decode zero-copy, as views into the reader's LMDB map.
    publish(url, f"file://{root}/origin", "tokens", compression=pb.COMPRESSION_NONE)
    publish(url, f"file://{root}/origin-big", "big")  # what grows the cache
    return url


def stage(node: LocalNode, dataset: str) -> None:
    for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset=dataset, version=1)):
        pass


def evict(node: LocalNode, dataset: str) -> None:
    stub(node.address).Evict(edge_pb2.EvictRequest(dataset=dataset, version=1), timeout=30)


class Node:
    """One node on ``cache``, restartable; stopped by the fixture whatever a test did."""

    def __init__(self, cache: Path, registry: str) -> None:
        self.cache, self.registry = cache, registry
        self.node = start_local_node("eu", cache, registry, capacity="256MiB")

    def restart(self, *, kill: bool, capacity: str = "256MiB") -> None:
        if kill:
            self.node.process.send_signal(signal.SIGKILL)
            self.node.process.wait()
        else:
            self.node.stop()
        self.node = start_local_node("eu", self.cache, self.registry, capacity=capacity)


@pytest.fixture
def node(tmp_path: Path, registry: str) -> Iterator[Node]:
    started = Node(tmp_path / "cache", registry)
    stage(started.node, "tokens")
    yield started
    started.node.stop()


def labels(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(x) for x in batch["label"]]


def clean_batches(address: str) -> list[list[int]]:
    """Epoch 0 read over gRPC with no fault and no workers: what every read must equal."""
    ds = EdgeDataset("tokens@1", endpoints=[address], **SMALL)  # type: ignore[arg-type]
    try:
        return [labels(b) for b in torch.utils.data.DataLoader(ds, batch_size=None)]
    finally:
        ds.close()


# ------------------------------------------------------------------- the tests


def test_zero_copy_batch_outlives_its_reader_and_the_eviction(node: Node) -> None:
    """An uncompressed chunk decoded from the map keeps its snapshot while the batch lives.

    The reader closed its ShardReader with the batch still in use (as the
    read-ahead does: windows outlive the read that decoded them); the node
    then evicted the version and wrote another into the freed pages. The
    batch must still hold its own rows, never the pages' new bytes.
    """
    from edgecache.cache.codec import decode_chunk
    from edgecache.cache.keys import ShardKey

    store = CacheStore(node.cache, readonly=True)
    try:
        with store.read_shard(ShardKey("tokens", 1, 1)) as reader:
            batch = decode_chunk(reader.chunk(0), verify=False)  # zero-copy: no compression
        before = batch.column("label").to_pylist()
        assert before[0] == ROWS  # shard 1's first row
        evict(node.node, "tokens")
        stage(node.node, "big")
        assert batch.column("label").to_pylist() == before
        del batch
    finally:
        store.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_evicted_mid_epoch_fails_over_to_grpc_exactly(node: Node, workers: int) -> None:
    """With the node's gRPC endpoint listed after lmdb://, the epoch goes on there, exact."""
    expected = clean_batches(node.node.address)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[f"lmdb://{node.cache}", node.node.address],
        **SMALL,  # type: ignore[arg-type]
    )
    got = []
    for i, batch in enumerate(
        torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    ):
        got.append(labels(batch))
        if i == 3:
            evict(node.node, "tokens")
    ds.close()
    assert got == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_evicted_and_restaged_mid_epoch_lmdb_only_goes_on(node: Node, workers: int) -> None:
    """The node evicts the version and stages it again: the lmdb:// epoch waits and goes on."""
    expected = clean_batches(node.node.address)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[f"lmdb://{node.cache}"],
        retry_timeout=20,
        **SMALL,  # type: ignore[arg-type]
    )
    got = []
    for i, batch in enumerate(
        torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    ):
        got.append(labels(batch))
        if i == 3:
            evict(node.node, "tokens")
            stage(node.node, "tokens")
    ds.close()
    assert got == expected
