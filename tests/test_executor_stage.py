"""The executor and a node that answers ``Stage`` with an error retrying cannot fix.

A node that answered (FAILED_PRECONDITION: origin lost an object of the version)
is not down: the task fails with the node's own message for the operator, and
the executor keeps calling the node (a later Pin reaches it). Nodes on loopback,
real LMDB, a file:// origin and registry.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import node_settings, publish, stub, write_parquet_shards

from edgecache.cache.planner import Plan, RegionPlan, StageTask
from edgecache.clients.executor import PlanExecutor
from edgecache.clients.topology import load_topology
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


def test_a_stage_refused_by_a_node_fails_the_task_and_leaves_the_node_up(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=500)
    manifest = publish(registry, f"file://{tmp_path}/origin", "pq")
    (tmp_path / "origin" / "part-00001.parquet").unlink()  # origin lost a published object
    with running_node(node_settings(tmp_path, registry)) as node:
        path = tmp_path / "topology.yaml"
        path.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n")
        executor = PlanExecutor(load_topology(path))
        now = datetime.now(UTC)
        task = StageTask("eu", ("pq", 1), 1000, "origin", now, now, now, ("job",))
        run = executor.run(executor.make_run(task, {"pq@1": manifest}, now + timedelta(hours=1)))
        assert run.state == "failed", run
        (failure,) = run.item.failures
        # The node's message: which node, what it said, and that a retry will not help.
        assert node.address in failure and "FAILED_PRECONDITION" in failure, failure
        assert "part-00001.parquet" in failure and "origin lost an object" in failure, failure
        assert "retrying will not help" in failure, failure
        assert not executor.calls.down  # it answered: not down
        until = now + timedelta(hours=2)
        plan = Plan(
            regions={"eu": RegionPlan(pins={("pq", 1): until})},
            infeasible=[],
            transfers={},
            cost={},
        )
        assert executor.pin(plan) == []  # the node is still called
        (held,) = stub(node.address).Status(edge_pb2.StatusRequest()).versions
        assert held.HasField("pinned_until") and held.shard_count == 1, held


def test_a_copy_from_a_region_that_evicts_the_version_stages_from_origin(tmp_path: Path) -> None:
    """A plan that evicts a version in one region while another copies it from there: the
    executor dropped its record of the source and the copy waited an hour on it."""
    from edgecache.cache.planner import Eviction
    from edgecache.clients.topology import Schedule

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=500)
    manifest = publish(registry, f"file://{tmp_path}/origin", "pq")
    with (
        running_node(node_settings(tmp_path, registry, cache_dir=tmp_path / "a")) as src,
        running_node(node_settings(tmp_path, registry, cache_dir=tmp_path / "b")) as dst,
    ):
        list(stub(src.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        path = tmp_path / "topology.yaml"
        path.write_text(
            f"registry: {registry}\nregions:\n  src:\n    nodes: ['{src.address}']\n"
            f"  dst:\n    nodes: ['{dst.address}']\n"
        )
        executor = PlanExecutor(load_topology(path))
        now = datetime.now(UTC)
        executor.mark_resident("src", ("pq", 1))  # as warm records what regions hold
        eviction = Eviction("src", ("pq", 1), 1000, now, None, "not needed again")
        assert executor.evict(eviction, Schedule(jobs=[]), {"pq@1": manifest}).problem is None
        task = StageTask("dst", ("pq", 1), 1000, "src", now, now, now, ("job",))
        run = executor.make_run(task, {"pq@1": manifest}, now + timedelta(hours=1))
        started = datetime.now(UTC)
        run = executor.run(run, peer_wait=20)
        assert run.state == "done", run
        assert (datetime.now(UTC) - started).total_seconds() < 15
        assert "from origin: src will not hold pq@1" in (run.note or ""), run.note
        (held,) = stub(dst.address).Status(edge_pb2.StatusRequest()).versions
        assert held.shard_count == 2


def test_a_version_evicted_and_read_again_later_keeps_the_pin_warm_reports(
    tmp_path: Path,
) -> None:
    """warm pinned every planned version first, then carried out the evictions, which drop
    a version's pin with its shards: it reported 'pinned b@1 until …' for a version the
    node no longer pinned (the plan evicts it now and stages it again for a later job)."""
    from edgecache.cache.planner import Eviction
    from edgecache.clients.topology import Schedule

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=500)
    manifest = publish(registry, f"file://{tmp_path}/origin", "pq")
    with running_node(node_settings(tmp_path, registry)) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        path = tmp_path / "topology.yaml"
        path.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n")
        executor = PlanExecutor(load_topology(path))
        now = datetime.now(UTC)
        later = now + timedelta(hours=30)
        plan = Plan(
            regions={
                "eu": RegionPlan(
                    evictions=[Eviction("eu", ("pq", 1), 1000, now, later, "furthest ahead")],
                    pins={("pq", 1): later + timedelta(hours=1)},
                )
            },
            infeasible=[],
            transfers={},
            cost={},
        )
        outcome = executor.warm(plan, Schedule(jobs=[]), {"pq@1": manifest})
        assert [freed > 0 for _, freed in outcome.evicted] == [True]
        assert not outcome.pin_failures
        (held,) = stub(node.address).Status(edge_pb2.StatusRequest()).versions
        assert held.shard_count == 0 and held.HasField("pinned_until"), held
