"""Defects a hunt over the ops commands found (plan, warm, the controller), on real nodes."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, guarded_node, publish, write_parquet_shards

from edgecache.clients.cli.staging import grouped_shard_notes
from edgecache.clients.controller import Controller
from edgecache.clients.node_client import start_local_node


def _schedule(tmp_path: Path, *jobs: tuple[str, str, str]) -> Path:
    start = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    path = tmp_path / "schedule.yaml"
    path.write_text(
        "jobs:\n"
        + "".join(
            f"  - name: {name}\n    region: {region}\n    start: '{start}'\n"
            f"    datasets: [{spec}]\n"
            for name, region, spec in jobs
        )
    )
    return path


def test_a_version_no_node_split_holds_is_neither_staged_nor_pinned(tmp_path: Path) -> None:
    """plan said "cannot be met" for a version whose share on one node was larger than that
    node's cache, yet kept its task and its pin: warm staged it, failed RESOURCE_EXHAUSTED on
    that node (exit 1, "retrying may help") and left the other shards pinned until the job's
    end, holding room for a version the region could never hold."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 6, rows=6000)
    publish(registry, f"file://{tmp_path}/origin", "big", chunk_bytes=64 << 10)
    nodes = [
        start_local_node("sp", tmp_path / f"cache-{i}", registry, capacity=capacity)
        for i, capacity in enumerate(["700KiB", "8MiB"])
    ]
    try:
        topology = tmp_path / "edgecache.yaml"
        addresses = ", ".join(f"'{n.address}'" for n in nodes)
        topology.write_text(f"registry: {registry}\nregions:\n  sp:\n    nodes: [{addresses}]\n")
        schedule = _schedule(tmp_path, ("j", "sp", "big@1"))
        config = ["--config", str(topology)]
        code, out, err = edgecache("plan", str(schedule), "--json", *config)
        planned = json.loads(out)
        assert code == 3, (out, err)
        assert planned["regions"]["sp"]["tasks"] == [] and planned["regions"]["sp"]["pins"] == []
        assert "share of big@1" in planned["infeasible"][0]["reason"]
        code, out, err = edgecache("warm", str(schedule), *config)
        assert code == 3 and "cannot be met: j big@1 in sp" in " ".join(err.split()), (out, err)
        code, out, err = edgecache("status", "--json", *config)
        assert code == 0 and all(not node["versions"] for node in json.loads(out)), out
    finally:
        for node in nodes:
            node.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_warm_with_a_node_down_and_another_region_refusing_the_token_exits_1_as_plan(
    tmp_path: Path,
) -> None:
    """A refused token outranked a dead node: warm (and its dry run) exited 2, "bad input,
    retrying will not help", where plan exits 1 for the same schedule and nodes."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=200)
    publish(registry, f"file://{tmp_path}/origin", "a")
    open_node = start_local_node("r1", tmp_path / "cache-r1", registry)
    guarded = guarded_node(tmp_path, "tk", registry)
    try:
        dead = f"127.0.0.1:{_free_port()}"
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n"
            f"  r1:\n    nodes: ['{open_node.address}', '{dead}']\n"
            f"  tk:\n    nodes: ['{guarded.address}']\n"
        )
        schedule = _schedule(tmp_path, ("j-r1", "r1", "a@1"), ("j-tk", "tk", "a@1"))
        config = ["--config", str(topology), "--token-file", str(tmp_path / "read.token")]
        code, out, err = edgecache("plan", str(schedule), *config)
        assert code == 1, (out, err)
        for dry in (["--dry-run"], []):
            code, out, err = edgecache("warm", str(schedule), *dry, *config)
            assert code == 1 and dead in err, (dry, out, err)
        # With the dead node gone from the topology the refusal alone is bad input, as before.
        topology.write_text(
            f"registry: {registry}\nregions:\n  r1:\n    nodes: ['{open_node.address}']\n"
            f"  tk:\n    nodes: ['{guarded.address}']\n"
        )
        code, out, err = edgecache("warm", str(schedule), *config)
        assert code == 2, (out, err)
    finally:
        guarded.stop()
        open_node.stop()


def test_a_regions_tasks_count_in_the_gauges_with_one_of_its_nodes_down(tmp_path: Path) -> None:
    """The controller stages in a region with a node down, on the nodes that answer, but
    froze its task records as if nothing were known there: none ever became live, so the
    `edgecache_controller_tasks` gauges left them out (done, failed and late alike) and
    EdgecacheStagingLate could not fire for them."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=200)
    publish(registry, f"file://{tmp_path}/origin", "a")
    r1 = start_local_node("r1", tmp_path / "cache-r1", registry)
    r2 = start_local_node("r2", tmp_path / "cache-r2", registry)
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n"
            f"  r1:\n    nodes: ['{r1.address}', '127.0.0.1:{_free_port()}']\n"
            f"  r2:\n    nodes: ['{r2.address}']\n"
        )
        _schedule(tmp_path, ("j-r1", "r1", "a@1"), ("j-r2", "r2", "a@1"))
        controller = Controller(tmp_path / "edgecache.yaml", tmp_path / "schedule.yaml")
        try:
            for _ in range(2):  # a round stages both; the next sees them done
                controller.tick()
                controller.wait_idle()
            gauge = controller.metrics.tasks
            counts = {s: gauge.labels(state=s)._value.get() for s in ("done", "failed", "late")}
            assert counts == {"done": 2, "failed": 0, "late": 0}, counts
        finally:
            controller.close()
    finally:
        r2.stop()
        r1.stop()


def test_warm_says_a_peer_refused_the_staging_node_and_exits_2(tmp_path: Path) -> None:
    """The plan copied a@1 from eu; eu refused us's node (no peer token), so us took every
    shard from origin: warm said "staged … from origin" among per-shard notes and exited 0,
    as it would on every run, paying origin's egress, until someone read the notes."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 3, rows=2000)
    publish(registry, f"file://{tmp_path}/origin", "a")
    eu = guarded_node(tmp_path, "eu", registry)
    us = start_local_node("us", tmp_path / "cache-us", registry)  # no peer_token_file
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n"
            f"  eu:\n    nodes: ['{eu.address}']\n    peers: {{us: 1GB/s}}\n"
            f"  us:\n    nodes: ['{us.address}']\n    origin_bandwidth: 1kB/s\n"
            f"    peers: {{eu: 1GB/s}}\n"
        )
        config = ["--config", str(topology), "--token-file", str(tmp_path / "admin.token")]
        code, out, err = edgecache("warm", "a@1", "--region", "eu", *config)
        assert code == 0, (out, err)
        schedule = _schedule(tmp_path, ("j", "us", "a@1"))
        code, out, err = edgecache("plan", str(schedule), "--json", *config)
        assert code == 0 and json.loads(out)["regions"]["us"]["tasks"][0]["source"] == "eu"
        # controller --once exited 0, the refusal a WARNING line alone (a review).
        code, out, err = edgecache("controller", "--schedule", str(schedule), "--once", *config)
        said = " ".join(err.split())
        assert code == 2, (out, err)
        assert (
            f"peer refused: a@1 in us came from origin, not from its peers as planned: {eu.address}"
            in said
        )
        code, out, err = edgecache("evict", "a@1", "--region", "us", "--force", *config)
        assert code == 0, (out, err)
        code, out, err = edgecache("warm", str(schedule), "--json", *config)
        said = " ".join(err.split())
        assert code == 2, (out, err)
        assert (
            f"peer refused: a@1 in us came from origin, not from its peers as planned: {eu.address}"
            in said
        )
        (row,) = json.loads(out)["items"]
        assert row["peers_refused"] == [eu.address] and row["source"] == "origin", row
    finally:
        us.stop()
        eu.stop()


def test_notes_of_many_shards_in_the_same_words_are_said_once() -> None:
    assert grouped_shard_notes(["shard 10: x", "shard 2: x", "shard 1: x"]) == [
        "shards 1, 2, 10: x"
    ]
    notes = [f"shard {i}: no peer could give it (refused); took it from origin" for i in range(12)]
    notes[3:3] = ["a note of the version", "shard 40: its copy failed mid-way"]
    assert grouped_shard_notes(notes) == [
        "shards 0, 1, 2, 3, 4, 5, 6, 7 and 4 more: no peer could give it (refused); took it "
        "from origin",
        "a note of the version",
        "shard 40: its copy failed mid-way",
    ]
