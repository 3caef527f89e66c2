"""A version the plan cannot stage keeps its pin where the region already holds part of it:
dropped, the shards a running job already has became evictable mid-job."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import edgecache, node_settings, pins_on, publish, stub, write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """Region small: one node with room for two of big@1's three shards, holding one."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "big", 3, rows=3000)
    publish(registry, f"file://{tmp_path}/origin/big", "big")
    with running_node(node_settings(tmp_path / "measure", registry)) as measure:
        list(stub(measure.address).Stage(edge_pb2.StageRequest(dataset="big", version=1)))
        assert measure.node is not None
        manifest = measure.node.versions._manifests[("big", 1)]
        shard = max(
            measure.node.store.shard_info(measure.node.shard_ref(manifest, i)).stored_bytes  # type: ignore[union-attr]
            for i in range(3)
        )
    node = start_local_node("small", tmp_path / "cache-small", registry, capacity=str(shard * 2))
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  small:\n    nodes: ['{node.address}']\n"
    )
    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="big", version=1, shards=[0])))
        yield tmp_path, node
    finally:
        node.stop()


def _warm(root: Path) -> tuple[int, str, str]:
    start = (datetime.now(UTC) + timedelta(minutes=30)).isoformat(timespec="seconds")
    schedule = root / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: j\n    region: small\n    start: '{start}'\n    datasets: [big@1]\n"
    )
    return edgecache("warm", str(schedule), "--config", str(root / "edgecache.yaml"))


def test_a_partly_held_version_the_plan_cannot_stage_keeps_its_pin(small) -> None:
    root, node = small
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    assert {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions} == {"big@1": 1}
    code, out, err = _warm(root)
    assert code == 3 and "big@1" in out + err, (out, err)  # the rest cannot fit
    assert "big@1" in pins_on(node), (out, err)  # its staged shard stays pinned
