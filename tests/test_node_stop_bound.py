"""A node's exit is bounded by its grace period, not by the shard work on its threads.

After the grace period the node cancelled the fetches still running, but their
preprocessing ran on pool threads that cancelling does not stop, and close()
waited for each to finish: a 100 MB shard at zstd level 19 kept a node whose
grace was 2 s alive for 67 s, past a pod's termination period (SIGKILL).
Shard work now stops at its next batch once the node closes. Real node, real
Parquet, no timing: the encoding waits for the node to close (an event).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import grpc
import pytest
from edgeutil import node_fields, publish, write_parquet_shards

from edgecache.cache.preprocess import load_transform
from edgecache.cache.store import CacheStore
from edgecache.edge import node as node_module
from edgecache.edge.config import NodeConfig
from edgecache.edge.preprocessing import ShardAbandoned, encode_raw_shard
from edgecache.edge.server import NodeServer
from edgecache.v1 import edge_pb2, edge_pb2_grpc


def test_shard_work_still_running_when_the_node_closes_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_parquet_shards(tmp_path / "origin", 1, rows=500)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    entered, outcome = threading.Event(), []
    encode = node_module.encode_raw_shard

    def slow_encode(*args: object) -> object:
        """The real encoding, begun only once the node closes (as a long shard would be)."""
        entered.set()
        abandon = args[6] if len(args) > 6 else None
        if not isinstance(abandon, threading.Event) or not abandon.wait(60):
            outcome.append("not told the node closed")  # the node's exit waited 60 s
        try:
            return encode(*args)  # type: ignore[arg-type]
        except ShardAbandoned as exc:
            outcome.append(str(exc))
            raise

    monkeypatch.setattr(node_module, "encode_raw_shard", slow_encode)
    config = NodeConfig(**node_fields(tmp_path, grace_seconds=0.2))

    async def scenario() -> None:
        server = NodeServer(config)
        await server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = edge_pb2_grpc.EdgeCacheStub(channel).Stage(
                edge_pb2.StageRequest(dataset="tokens", version=1)
            )
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 60)
            await server.stop()
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in call:
                    pass

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert len(outcome) == 1 and "abandoned, the node is shutting down" in outcome[0], outcome
    assert "were dropped" in caplog.text
    # grpc's ERROR for the cancelled Stage call is not logged: the drop is said once.
    assert "Exception not handled" not in caplog.text
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        assert [v.shard_count for v in store.versions()] == []  # nothing partial kept


def test_an_abandoned_shard_gives_no_frames(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from edgecache.cache.registry import Registry

    write_parquet_shards(tmp_path / "origin", 1, rows=500)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    manifest = Registry.run(registry, lambda reg: reg.manifest("tokens", 1))
    (shard,) = manifest.shards
    data = (tmp_path / "origin" / shard.source_key).read_bytes()
    abandon = threading.Event()
    abandon.set()
    with ThreadPoolExecutor(2) as parts, pytest.raises(ShardAbandoned, match="tokens@1"):
        encode_raw_shard(data, manifest, shard, "s", load_transform("identity", {}), parts, abandon)
