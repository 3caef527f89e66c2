"""A cache on a tiny filesystem: staging fails with RESOURCE_EXHAUSTED, serving goes on."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, read_shard_table, stub, write_parquet_shards

from edgecache.cache.store import CacheStore
from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


@pytest.fixture
def tiny_fs() -> Path:
    mount = Path(tempfile.mkdtemp(prefix="edgecache-tiny-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_fails_staging_cleanly_and_keeps_serving(
    tmp_path: Path, tiny_fs: Path, figure
) -> None:  # noqa: ANN001
    shards = 16  # ~3.2 MB of byte-split chunks (about 0.2 MB a shard): more than the disk
    tables = write_parquet_shards(tmp_path / "origin", shards, rows=3000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    settings = NodeConfig(
        region="eu",
        cache_dir=tiny_fs / "cache",
        registry=registry,
        listen="127.0.0.1:0",
        capacity="64MiB",  # more than the 3 MB filesystem: the disk fills first
        sync=False,
    )
    with running_node(settings) as node:
        client = stub(node.address)
        with pytest.raises(grpc.RpcError) as info:
            list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        assert (
            info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            or "full" in info.value.details()
        )
        status = client.Status(edge_pb2.StatusRequest())
        resident = status.versions[0].shard_count if status.versions else 0
        assert 0 < resident < shards
        held = [s.key.shard for s in node.node.store.shards("tokens", 1)]  # type: ignore[union-attr]
        assert read_shard_table(client, "tokens", 1, held[0]).equals(tables[held[0]])
        missing = next(s for s in range(shards) if s not in held)
        with pytest.raises(grpc.RpcError) as miss:
            list(
                client.ReadShard(
                    edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=missing)
                )
            )
        assert miss.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            "disk under" in miss.value.details()
            and "lower it or grow the volume" in miss.value.details()
        )
    with CacheStore(tiny_fs / "cache", readonly=True) as store:  # nothing partial
        for info in store.shards("tokens", 1):
            assert len(list(store.iter_chunks(info.key))) == info.chunk_count
    figure("shards staged before the disk filled", resident)
    figure("partial shards visible", 0)
