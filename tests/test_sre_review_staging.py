"""An SRE's review of staging across regions: what warm, plan, ready and the executor do.

Real nodes on loopback (in-process, real LMDB), a file:// origin and
registry; commands run as real processes. A node "down" is an address
nothing listens on, chosen so that it owns shards by rendezvous hashing.

* A region with a node down: the nodes that answer stage the whole version
  between them, split as readers look for the shards while it is down; the
  down node is never called (warm, the executor the controller uses, and a
  node found down while staging).
* ``ready`` with a node down: ready when the nodes that answer hold every
  shard between them, with a note naming the silent node.
* A started job keeps the version resolved at its start in ``plan`` and
  ``warm``, as in ``plan --status`` and the controller.
* ``warm --dry-run`` after a job was removed plans on the pins as the real
  run leaves them once it released the job's pins.
* warm reports the bytes the nodes moved, and says which pins hold no data.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import edgecache, node_ids, node_settings, publish, stub, write_parquet_shards

from edgecache.cache import rendezvous
from edgecache.cache.planner import StageTask
from edgecache.clients.executor import PlanExecutor
from edgecache.clients.ops import WarmItem, stage_item
from edgecache.clients.topology import load_topology
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

SHARDS = 4


def silent(host: str, port: int) -> bool:
    """Whether nothing listens on loopback ``host:port``."""
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def _candidates() -> Iterator[tuple[str, int]]:
    # Privileged ports first: nothing of this machine's tests binds them (the live nodes
    # have fixed ids, so which addresses qualify is the same every run). Then every port of
    # 127.0.0.2 (loopback too; nodes listen on 127.0.0.1): a live node whose rendezvous
    # score is low on some shard leaves few addresses owning none (1,023 ports found none
    # for 7 % of live ports, a CI failure).
    yield from (("127.0.0.1", port) for port in range(1, 1024))
    yield from (("127.0.0.2", port) for port in range(1, 65536))


def dead_owner(live: list[str], *, owns: bool = True) -> str:
    """A silent address owning some (``owns=False``: none) of a@1's shards beside ``live``."""
    names = node_ids(*live)  # the live nodes are hashed by their ids, the silent one by address
    for host, port in _candidates():
        dead = f"{host}:{port}"
        mine = rendezvous.owned_shards([*live, dead], dead, "a", 1, SHARDS, names=names)
        if bool(mine) == owns and len(mine) < SHARDS and silent(host, port):
            return dead
    raise AssertionError("no silent address with the wanted share")


def held(address: str, spec: str = "a@1") -> int:
    """How many shards of ``spec`` the node at ``address`` holds."""
    versions = stub(address).Status(edge_pb2.StatusRequest()).versions
    return next((v.shard_count for v in versions if f"{v.dataset}@{v.version}" == spec), 0)


def write_topology(root: Path, registry: str, **regions: list[str]) -> Path:
    path = root / "topology.yaml"
    path.write_text(
        f"registry: {registry}\nregions:\n"
        + "".join(f"  {name}:\n    nodes: {nodes!r}\n" for name, nodes in regions.items())
    )
    return path


def write_schedule(root: Path, name: str, *jobs: tuple[str, str, datetime, str, str]) -> Path:
    """(job, region, start, duration, dataset) jobs."""
    path = root / f"{name}.yaml"
    path.write_text(
        "jobs:\n"
        + "".join(
            f"  - name: {job}\n    region: {region}\n    start: '{start.isoformat()}'\n"
            f"    duration: {duration}\n    datasets: [{spec}]\n"
            for job, region, start, duration, spec in jobs
        )
    )
    return path


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, pb.Manifest]:
    """A registry with a@1, four Parquet shards."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-a", SHARDS, rows=300)
    return registry, publish(registry, f"file://{tmp_path}/origin-a", "a")


@pytest.fixture
def two_live(tmp_path: Path, published: tuple[str, pb.Manifest]) -> Iterator[list[str]]:
    """Two nodes of region eu that answer."""
    registry, _ = published
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_node(
                    node_settings(
                        tmp_path, registry, cache_dir=tmp_path / f"c{i}", node_id=f"eu-{i}"
                    )
                )
            ).address
            for i in range(2)
        ]


def assert_split_over(live: list[str]) -> None:
    """Every shard of a@1 sits on its owner among ``live``: where readers ask first."""
    names = node_ids(*live)
    for address in live:
        owned = rendezvous.owned_shards(live, address, "a", 1, SHARDS, names=names)
        assert held(address) == len(owned), address
    assert sum(held(address) for address in live) == SHARDS


def test_warm_stages_a_down_nodes_share_on_the_nodes_that_answer(
    tmp_path: Path, published: tuple[str, pb.Manifest], two_live: list[str]
) -> None:
    """The down node's share was staged nowhere and warm called it (UNAVAILABLE, a failed item)."""
    registry, _ = published
    dead = dead_owner(two_live)
    config = write_topology(tmp_path, registry, eu=[*two_live, dead])
    start = datetime.now(UTC) + timedelta(hours=1)
    path = write_schedule(tmp_path, "s", ("train", "eu", start, "1h", "a@1"))
    code, out, err = edgecache("warm", str(path), "--json", "--config", str(config))
    assert code == 1, (out, err)  # the region is degraded: said, and exit 1
    assert "degraded" in err and dead in err, err
    (item,) = json.loads(out)["items"]
    assert item["done"] and item["state"] == "done" and not item["failures"], item
    (note,) = [n for n in item["notes"] if dead in n]
    # Not a count worked out from its address: back, it reports an id, which splits anew.
    assert f"its share was staged on {', '.join(two_live)}" in note, note
    assert f"how many of the {SHARDS} shards it owns depends on its node id" in note, note
    assert_split_over(two_live)
    # Now the region is ready as ``ready`` sees it: the nodes that answer hold it all.
    code, out, err = edgecache("ready", "a@1", "--region", "eu", "--config", str(config))
    assert code == 0, (out, err)
    assert "hold every shard between them" in out and dead in out, out


def test_the_executor_never_calls_a_node_the_round_found_down(
    tmp_path: Path, published: tuple[str, pb.Manifest], two_live: list[str]
) -> None:
    """The controller's path: ``make_run`` passed every node, and staging called the dead one."""
    registry, manifest = published
    dead = dead_owner(two_live)
    executor = PlanExecutor(load_topology(write_topology(tmp_path, registry, eu=[*two_live, dead])))
    executor.calls.down.add(dead)  # as a controller round starts: its status found it down
    now = datetime.now(UTC)
    task = StageTask("eu", ("a", 1), 1000, "origin", now, now, now, ("job",))
    run = executor.make_run(task, {"a@1": manifest}, now + timedelta(hours=1))
    run = executor.run(run)
    assert run.state == "done" and not run.item.failures, run.item
    assert run.item.down == [dead]
    assert any(dead in n and "its share" in n for n in run.item.notes), run.item.notes
    assert_split_over(two_live)


def test_a_node_found_down_while_staging_leaves_its_share_to_the_others(
    published: tuple[str, pb.Manifest], two_live: list[str]
) -> None:
    """``warm NAME@N`` and a node that died after the status: its share is staged elsewhere."""
    dead = dead_owner(two_live)
    item = WarmItem("eu", "a@1", [*two_live, dead], 1000, shard_count=SHARDS)
    stage_item(item)
    assert item.done and not item.failures, item
    assert any(dead in n and "its share" in n for n in item.notes), item.notes
    assert_split_over(two_live)


def test_ready_counts_the_shards_the_nodes_that_answer_hold(
    tmp_path: Path, published: tuple[str, pb.Manifest]
) -> None:
    """Ready said "unreachable" (exit 1) though the live node held every shard."""
    registry, _ = published
    # A fixed node id: the silent addresses are searched against the live node's, and
    # for about 1 in 150 ids (hostname:port, the port free at random) none of 66,558 owns
    # no shard (a CI failure): with one id the search finds the same address every run.
    with running_node(node_settings(tmp_path, registry, node_id="eu-live")) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="a", version=1)))
        dead = dead_owner([node.address], owns=False)  # it owns none of a@1's shards
        config = write_topology(tmp_path, registry, eu=[node.address, dead])
        code, out, err = edgecache("ready", "a@1", "--region", "eu", "--config", str(config))
        assert code == 0, (out, err)
        assert "a@1 is staged in eu" in out and f"{dead} unreachable" in out, out
        # One that owns shards the live node lacks: not ready, and both are named.
        other = dead_owner([node.address])
        mine = rendezvous.owned_shards(
            [node.address, other], node.address, "a", 1, SHARDS, names=node_ids(node.address)
        )
        write_topology(tmp_path, registry, eu=[node.address, other])
        evicted = stub(node.address).Evict(edge_pb2.EvictRequest(dataset="a", version=1))
        assert evicted.bytes_freed > 0
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="a", version=1, shards=mine)))
        code, out, err = edgecache("ready", "a@1", "--region", "eu", "--config", str(config))
        assert code == 1, (out, err)
        assert f"has {len(mine)}/{SHARDS} shards" in err and other in err, err


def test_a_started_job_keeps_the_version_resolved_at_its_start_in_plan_and_warm(
    tmp_path: Path,
) -> None:
    """After b@2 was published, plan staged and pinned b@2 for a running job (exit 3), warm did."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-b", 2, rows=300)
    publish(registry, f"file://{tmp_path}/origin-b", "b")
    with running_node(node_settings(tmp_path, registry)) as node:
        config = ["--config", str(write_topology(tmp_path, registry, us=[node.address]))]
        start = datetime.now(UTC) - timedelta(minutes=10)
        path = str(write_schedule(tmp_path, "s", ("running", "us", start, "3h", "b")))
        code, out, err = edgecache("warm", "b@1", "--region", "us", *config)
        assert code == 0, (out, err)
        # The controller's round records what the job reads: b@1, resolved now.
        code, out, err = edgecache("controller", "--schedule", path, "--once", *config)
        assert code == 0, (out, err)
        publish(registry, f"file://{tmp_path}/origin-b", "b")  # b@2, after the start
        code, out, err = edgecache("plan", path, "--json", *config)
        assert code == 0, (out, err)
        planned = json.loads(out)
        assert planned["regions"]["us"]["tasks"] == [] and not planned["infeasible"], planned
        assert [p["version"] for p in planned["regions"]["us"]["pins"]] == ["b@1"], planned
        code, out, err = edgecache("plan", path, *config)
        assert code == 0 and "b@2" not in out + err, (out, err)
        code, out, err = edgecache("warm", path, "--json", *config)
        assert code == 0, (out, err)
        warmed = json.loads(out)
        assert warmed["items"] == [] and [p["version"] for p in warmed["pins"]] == ["b@1"]
        assert held(node.address, "b@2") == 0 and "b@2" not in [
            f"{v.dataset}@{v.version}"
            for v in stub(node.address).Status(edge_pb2.StatusRequest()).versions
        ]


@pytest.fixture
def one_room(tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    """Region ``small``: one node holding pq@1, with room for one of pq@1 and pq@2."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-pq", 1, rows=500)
    publish(registry, f"file://{tmp_path}/origin-pq", "pq")
    publish(registry, f"file://{tmp_path}/origin-pq", "pq")  # pq@2, the same content
    with running_node(node_settings(tmp_path, registry, capacity="50KiB")) as node:
        # Held, so the plan knows the stored size (the source's would not fit at all).
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        yield (
            ["--config", str(write_topology(tmp_path, registry, small=[node.address]))],
            (node.address),
        )


def both_jobs(root: Path) -> tuple[Path, tuple[tuple[str, str, datetime, str, str], ...]]:
    """j1 reads pq@1 from +1 h, j2 pq@2 from +3 h: pq@2's room is pq@1's, not free before."""
    now = datetime.now(UTC)
    both = (
        ("j1", "small", now + timedelta(hours=1), "1h", "pq@1"),
        ("j2", "small", now + timedelta(hours=3), "1h", "pq@2"),
    )
    return write_schedule(root, "s", *both), both


def test_warm_says_which_pins_hold_no_data(tmp_path: Path, one_room: tuple[list[str], str]) -> None:
    """pq@2's staging is deferred (j1 reads pq@1 first): warm said "pinned pq@2" as if held,
    and listed it among the pins that held, with nothing to tell it apart."""
    config, _ = one_room
    path, _ = both_jobs(tmp_path)
    code, out, err = edgecache("warm", str(path), "--json", *config)
    assert code == 0, (out, err)
    warmed = json.loads(out)
    assert [(i["version"], i["state"]) for i in warmed["items"]] == [("pq@2", "deferred")]
    assert {p["version"]: p["staged"] for p in warmed["pins"]} == {"pq@1": True, "pq@2": False}
    code, out, err = edgecache("warm", str(path), *config)  # the same, as a person reads it
    assert code == 0, (out, err)
    (line,) = [line for line in out.splitlines() if "pinned pq@2 until" in line]
    assert "not staged: its staging deferred (the pin holds no data yet)" in line, out
    (line,) = [line for line in out.splitlines() if "pinned pq@1 until" in line]
    assert "not staged" not in line, out


def test_the_dry_run_after_a_job_was_removed_plans_on_the_pins_the_release_leaves(
    tmp_path: Path, one_room: tuple[list[str], str]
) -> None:
    """j1 removed: the dry run said it would release pq@1's pin, then deferred evicting pq@1
    behind that very pin, and pq@2's staging with it; the real run did both."""
    config, node = one_room
    path, both = both_jobs(tmp_path)
    code, out, err = edgecache("warm", str(path), *config)
    assert code == 0, (out, err)
    path = write_schedule(tmp_path, "s", both[1])
    code, out, err = edgecache("warm", str(path), "--dry-run", "--json", *config)
    assert code == 0, (out, err)
    rehearsed = json.loads(out)
    assert [p["version"] for p in rehearsed["released"]] == ["pq@1"], rehearsed
    assert [e["version"] for e in rehearsed["evicted"]] == ["pq@1"], rehearsed
    assert [(i["version"], i["state"]) for i in rehearsed["items"]] == [("pq@2", "would stage")]
    assert rehearsed["deferred"] == [], rehearsed["deferred"]
    assert held(node, "pq@1") == 1 and held(node, "pq@2") == 0  # a rehearsal: nothing touched
    code, out, err = edgecache("warm", str(path), "--json", *config)
    assert code == 0, (out, err)
    real = json.loads(out)
    assert [e["version"] for e in real["evicted"]] == ["pq@1"], real
    assert [(i["version"], i["state"]) for i in real["items"]] == [("pq@2", "done")], real
    assert real["deferred"] == [] and held(node, "pq@2") == 1, real


def test_warm_reports_the_bytes_the_nodes_moved(tmp_path: Path) -> None:
    """warm said the plan's estimate (stored bytes, from pq@1's ratio), not what was fetched."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-pq", 2, rows=500)
    publish(registry, f"file://{tmp_path}/origin-pq", "pq")
    publish(registry, f"file://{tmp_path}/origin-pq", "pq")  # pq@2, the same content
    with running_node(node_settings(tmp_path, registry)) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        config = ["--config", str(write_topology(tmp_path, registry, eu=[node.address]))]
        before = stub(node.address).Status(edge_pb2.StatusRequest()).staged_origin_bytes
        start = datetime.now(UTC) + timedelta(hours=1)
        path = str(write_schedule(tmp_path, "s", ("train", "eu", start, "1h", "pq@2")))
        code, out, err = edgecache("plan", path, "--json", *config)
        assert code == 0, (out, err)
        (task,) = json.loads(out)["regions"]["eu"]["tasks"]
        code, out, err = edgecache("warm", path, "--json", *config)
        assert code == 0, (out, err)
        (item,) = json.loads(out)["items"]
        moved = stub(node.address).Status(edge_pb2.StatusRequest()).staged_origin_bytes - before
        assert moved > 0 and moved != task["bytes"]  # the premise: the estimate is not it
        assert item["bytes"] == moved and item["planned_bytes"] == task["bytes"], item


@pytest.mark.parametrize("form", ["single", "schedule"])
def test_a_node_that_dies_during_warm_leaves_the_region_degraded_and_warm_exits_1(
    tmp_path: Path,
    published: tuple[str, pb.Manifest],
    two_live: list[str],
    monkeypatch: pytest.MonkeyPatch,
    form: str,
) -> None:
    """A node down when warm began made it exit 1 ("region eu is degraded"); one that died
    while warm staged had its share staged on the others and warm exited 0 with a note,
    though readers then look for that share on it once it is back, where it is not."""
    from typer.testing import CliRunner

    from edgecache.clients.cli.app import app
    from edgecache.clients.node_client import start_local_node
    from edgecache.clients.ops import staging  # stage_item looks _stage_node up there

    registry, _ = published
    names = node_ids(*two_live)
    doomed_id = next(  # one that owns some of a@1's shards: its Stage call is made
        f"d{i}"
        for i in range(100)
        if rendezvous.owned_shards(
            [*two_live, "x:1"], "x:1", "a", 1, SHARDS, names={**names, "x:1": f"d{i}"}
        )
    )
    doomed = start_local_node(
        "eu", tmp_path / "doomed", registry, extra_args=["--node-id", doomed_id]
    )
    try:
        config = write_topology(tmp_path, registry, eu=[*two_live, doomed.address])
        stage = staging._stage_node

        def first_kills(*args: object, **kwargs: object) -> object:
            if doomed.process.poll() is None:  # it answered the status round: dies now
                doomed.process.kill()
                doomed.process.wait()
            return stage(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(staging, "_stage_node", first_kills)
        if form == "single":
            args = ["warm", "a@1", "--region", "eu"]
        else:
            start = datetime.now(UTC) + timedelta(hours=1)
            args = ["warm", str(write_schedule(tmp_path, "s", ("t", "eu", start, "1h", "a@1")))]
        result = CliRunner().invoke(
            app, [*args, "--json", "--config", str(config)], env={"COLUMNS": "200"}
        )
        assert result.exit_code == 1, result.output
        said = " ".join(result.stderr.split())
        assert "region eu is degraded" in said and doomed.address in said, said
        (item,) = json.loads(result.stdout)["items"]
        assert item["done"] and not item["failures"], item  # staged on the other two
        assert_split_over(two_live)
    finally:
        doomed.stop()
