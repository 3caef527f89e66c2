"""A region's replicas hold every version of the jobs that run at once, node by node.

Replicas split each version's shards by hash and each keeps its own share. plan
checked that split a job at a time: two jobs in one region at the same time,
each reading a one-shard version whose shard hashes to the same node, were each
said to fit (a node holds either shard, the region both), and whichever was
staged second failed RESOURCE_EXHAUSTED on that node. Real nodes on loopback,
real Parquet, the CLI as an operator runs it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, write_parquet_shards

from edgecache.cache.rendezvous import owner
from edgecache.clients.node_client import start_local_node

IDS = ["eu-0", "eu-1"]


def _same_owner_names() -> tuple[str, str]:
    """Two dataset names whose one shard (version 1) hashes to the same node id."""
    first = "a0"
    wanted = owner(IDS, first, 1, 0)
    second = next(f"b{i}" for i in range(100) if owner(IDS, f"b{i}", 1, 0) == wanted)
    return first, second


def _schedule(path: Path, jobs: list[tuple[str, str, int]]) -> Path:
    """Jobs (name, dataset, hours from now to its start), each running 2 hours."""
    now = datetime.now(UTC)
    lines = ["jobs:"]
    for name, dataset, hours in jobs:
        start = (now + timedelta(hours=hours)).isoformat()
        lines += [
            f"  - name: {name}",
            "    region: eu",
            f"    start: '{start}'",
            "    duration: 2h",
            f"    datasets: [{dataset}@1]",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_jobs_at_once_whose_shards_hash_to_one_node_are_not_planned_as_fitting(
    tmp_path: Path,
) -> None:
    registry = f"file://{tmp_path}/registry"
    first, second = _same_owner_names()
    for name in (first, second):
        write_parquet_shards(tmp_path / name, 1, rows=20000)  # one shard each
        publish(registry, f"file://{tmp_path}/{name}", name)
    # Nothing held: the plan sizes each by its source bytes. Each node holds 1.5 shards:
    # the region (3) holds both, the node both hash to does not.
    source = sum(f.stat().st_size for f in (tmp_path / first).rglob("*") if f.is_file())
    nodes = [
        start_local_node(
            "eu",
            tmp_path / f"cache-{i}",
            registry,
            capacity=str(int(source * 1.5)),
            extra_args=["--node-id", node_id],
        )
        for i, node_id in enumerate(IDS)
    ]
    try:
        topology = tmp_path / "edgecache.yaml"
        addresses = ", ".join(f"'{n.address}'" for n in nodes)
        topology.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: [{addresses}]\n")
        config = ["--config", str(topology)]
        apart = _schedule(tmp_path / "apart.yaml", [("j1", first, 1), ("j2", second, 5)])
        code, out, err = edgecache("plan", str(apart), *config)
        assert code == 0, (out, err)  # one after the other: each fits the node alone
        together = _schedule(tmp_path / "together.yaml", [("j1", first, 1), ("j2", second, 2)])
        code, out, err = edgecache("plan", str(together), *config, "--json")
        assert code == 3, (out, err)
        why = {row["job"]: row["reason"] for row in json.loads(out)["infeasible"]}
        assert f"share of {first}@1, {second}@1 (2 of 2 shards," in why["j1"], why
        assert f"share of {second}@1, {first}@1 (2 of 2 shards," in why["j2"], why
        assert "is more than its cache holds" in why["j1"], why
    finally:
        for node in nodes:
            node.stop()
