"""A region of two replicas after one was down: plan, warm and ready agree on its share.

Replicas split a version's shards (rendezvous hashing among the nodes that
answer). While one is down, warm stages its share on the other; once it is
back, readers look for its shards on it again, so ``ready`` says it lacks
them. Plan and warm counted the union of the nodes' shards and said "nothing
to stage": a launch gated on ``ready`` never started, and the duplicates made
the version look larger than it is in every size estimate. Real nodes on
loopback, a file:// registry (review 41).
"""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, write_parquet_shards
from test_plan_defects import schedule

from edgecache.cache.registry import Registry
from edgecache.clients.node_client import start_local_node
from edgecache.clients.ops import gather_status, holdings, make_plan, ready
from edgecache.clients.topology import load_schedule, load_topology

SHARDS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_replica_back_from_an_outage_gets_its_share_staged(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=400)
    publish(registry, f"file://{tmp_path}/origin", "ds")
    manifest = Registry.run(registry, lambda reg: reg.manifest("ds", 1))
    first = start_local_node("ap", tmp_path / "cache-1", registry)
    port = _free_port()
    second_address = f"127.0.0.1:{port}"
    config = tmp_path / "edgecache.yaml"
    config.write_text(
        f"registry: {registry}\nregions:\n  ap:\n    nodes: ['{first.address}', "
        f"'{second_address}']\n"
    )
    path = schedule(tmp_path, "s", ("job", "ap", datetime.now(UTC) + timedelta(hours=1), "ds@1"))
    second = None
    try:
        # The second replica is down: the first stages every shard; warm says the region
        # is degraded.
        code, out, err = edgecache("warm", str(path), "--config", str(config))
        assert code == 1, (code, out, err)
        second = start_local_node(
            "ap", tmp_path / "cache-2", registry, extra_args=["--listen", second_address]
        )
        assert second.address == second_address
        topology = load_topology(config)
        reports = gather_status(topology)
        ok, why = ready(reports, "ap", manifest)
        assert not ok and f"{second_address} has 0/" in why, why
        held = holdings(reports, {"ds@1": manifest})["ap"][("ds", 1)]
        stored = {
            r.address: r.status.versions[0].stored_bytes
            for r in reports
            if r.status and r.status.versions
        }
        assert not held.complete and held.shards < SHARDS, held
        # Each shard counts once: the first node's copies of the second's share do not.
        assert held.stored_bytes < stored[first.address], (held, stored)
        result, _ = make_plan(topology, load_schedule(path, topology), reports=reports)
        (task,) = result.regions["ap"].tasks
        assert task.spec == "ds@1" and 0 < task.bytes, task
        assert not result.infeasible, result.infeasible
        # Plan and warm now stage the share; then ready agrees.
        code, out, err = edgecache("warm", str(path), "--json", "--config", str(config))
        assert code == 0, (code, out, err)
        done = json.loads(out)
        assert [item["version"] for item in done["items"]] == ["ds@1"], done
        ok, why = ready(gather_status(topology), "ap", manifest)
        assert ok, why
        code, out, err = edgecache("plan", str(path), "--json", "--config", str(config))
        assert code == 0 and json.loads(out)["regions"]["ap"]["tasks"] == [], (out, err)
    finally:
        first.stop()
        if second is not None:
            second.stop()
