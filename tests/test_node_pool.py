"""NodePool against real edge nodes: closing it, and the errors its callers see."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from edgeutil import publish, write_parquet_shards

from edgecache.cache.errors import NodeUnavailable
from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.node_pool import NodePool
from edgecache.v1 import edge_pb2


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    root = tmp_path_factory.mktemp("pool")
    write_parquet_shards(root / "origin", 2, rows=500)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    node = start_local_node("eu", root / "cache", f"file://{root}/registry")
    yield node
    node.stop()


def test_close_joins_background_threads_and_never_reopens_a_channel(node) -> None:
    endpoint = parse_endpoint(node.address)
    for _ in range(5):
        # Probing without pause, so a probe is in flight whenever close() comes.
        pool = NodePool([endpoint], probe_interval=0.001)
        time.sleep(0.05)
        pool.close()
        assert not [t.name for t in pool._threads if t.is_alive()]  # joined, not just told
        assert not pool._channels
        with pytest.raises(NodeUnavailable, match="closed"):
            pool.stub(endpoint)
        with pytest.raises(NodeUnavailable, match="closed"):
            pool.call("Status", edge_pb2.StatusRequest())
        time.sleep(0.05)
        assert not pool._channels  # nothing in flight reopened one after close
        pool.close()  # twice is fine
    assert not [t for t in threading.enumerate() if t.name.startswith("edgecache-")]
