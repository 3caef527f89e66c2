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
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.cache.planner import Job, Plan
from edgecache.cache.rendezvous import owner
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

IDS = ["eu-0", "eu-1"]


def _same_owner_names() -> tuple[str, str]:
    """Two dataset names whose one shard (version 1) hashes to the same node id."""
    first = "a0"
    wanted = owner(IDS, first, 1, 0)
    second = next(f"b{i}" for i in range(100) if owner(IDS, f"b{i}", 1, 0) == wanted)
    return first, second


def _two_nodes(tmp_path: Path, registry: str, capacity: int) -> tuple[list[LocalNode], Path]:
    """Region eu of two nodes named IDS, each of ``capacity`` bytes, and its topology file."""
    nodes = [
        start_local_node(
            "eu",
            tmp_path / f"cache-{i}",
            registry,
            capacity=str(capacity),
            extra_args=["--node-id", node_id],
        )
        for i, node_id in enumerate(IDS)
    ]
    topology = tmp_path / "edgecache.yaml"
    addresses = ", ".join(f"'{n.address}'" for n in nodes)
    topology.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: [{addresses}]\n")
    return nodes, topology


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
    nodes, topology = _two_nodes(tmp_path, registry, int(source * 1.5))
    try:
        config = ["--config", str(topology)]
        apart = _schedule(tmp_path / "apart.yaml", [("j1", first, 1), ("j2", second, 5)])
        code, out, err = edgecache("plan", str(apart), *config)
        assert code == 0, (out, err)  # one after the other: each fits the node alone
        together = _schedule(tmp_path / "together.yaml", [("j1", first, 1), ("j2", second, 2)])
        code, out, err = edgecache("plan", str(together), *config, "--json")
        assert code == 3, (out, err)
        planned = json.loads(out)
        why = {row["job"]: row["reason"] for row in planned["infeasible"]}
        # The first to start is met; the second, which would overflow the node beside it,
        # is not (both were said "cannot be met" before either was planned alone).
        assert list(why) == ["j2"], why
        # The versions sorted by name, whatever the schedule's order.
        assert f"share of {first}@1, {second}@1 (2 of 2 shards," in why["j2"], why
        assert "is more than its cache holds" in why["j2"], why
        tasks = planned["regions"]["eu"]["tasks"]
        assert [(t["version"], t["jobs"]) for t in tasks] == [(f"{first}@1", ["j1"])], tasks
    finally:
        for node in nodes:
            node.stop()


def test_warm_of_a_version_the_pins_leave_no_room_for_fails_before_staging(
    tmp_path: Path,
) -> None:
    """warm NAME@N --dry-run said "would stage" (exit 0) for a version the node's pinned ones
    left no room for; the real run evicted what was not pinned, then failed RESOURCE_EXHAUSTED.
    Both now fail up front, naming the pins and what to do; nothing is evicted."""
    registry = f"file://{tmp_path}/registry"
    # a and c of one size, b about 2.9 times it: a node of 1.4 times a's source holds a
    # and c (stored at about 0.4 of their source), and b alone, never a and b.
    for name, rows in (("a", 8000), ("b", 23000), ("c", 8000)):
        write_parquet_shards(tmp_path / name, 2, rows=rows)
        publish(registry, f"file://{tmp_path}/{name}", name)
    source = sum(f.stat().st_size for f in (tmp_path / "a").rglob("*") if f.is_file())
    node = start_local_node("eu", tmp_path / "cache", registry, capacity=str(int(source * 1.4)))
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        config = ["--config", str(topology)]
        holder = _schedule(tmp_path / "holder.yaml", [("holder", "a", 24)])
        code, out, err = edgecache("warm", str(holder), *config)  # stages and pins a@1
        assert code == 0, (out, err)
        code, out, err = edgecache("warm", "c@1", "--region", "eu", *config)  # not pinned
        assert code == 0, (out, err)
        for dry in (["--dry-run"], []):
            code, out, err = edgecache("warm", "b@1", "--region", "eu", *dry, *config)
            said = " ".join(err.split())
            assert code == 1, (dry, out, err)
            assert "a@1 (" in said and "a pinned version is never evicted" in said, said
            assert "run warm again once a pin ends" in said, said
        code, out, err = edgecache("status", "--json", *config)
        (status,) = json.loads(out)
        held = {v["version"] for v in status["versions"]}
        assert held == {"a@1", "c@1"}, status  # c@1 was not evicted for nothing
    finally:
        node.stop()


def test_a_version_the_plan_cannot_hold_is_not_counted_against_a_job_beside_it() -> None:
    """The per-node check of jobs running at once counted an overlapping job's version the
    plan had already found it cannot hold (800 MiB in a region of 200): the job beside it,
    which fits, was said "cannot be met" for it."""
    from edgecache.cache.planner import Infeasible, Job, Plan, VersionSize
    from edgecache.clients.ops import NodeReport
    from edgecache.clients.ops.planning import _share_rows
    from edgecache.clients.topology import RegionConfig, Topology
    from edgecache.v1 import edge_pb2

    mib = 1 << 20
    topology = Topology(registry="file:///r", regions={"eu": RegionConfig(nodes=["a:1", "b:1"])})
    reports = [
        NodeReport(
            "eu",
            n,
            True,
            status=edge_pb2.NodeStatus(region="eu", node_id=n, capacity_bytes=100 * mib),
        )
        for n in ("a:1", "b:1")
    ]
    manifests = {}
    for name, size in (("small", 10 * mib), ("huge", 200 * mib)):
        manifest = pb.Manifest(dataset=name, version=1)
        for _ in range(4):
            manifest.shards.add(source_size=size)
        manifests[f"{name}@1"] = manifest
    sizes = {
        ("small", 1): VersionSize(stored=40 * mib, source=40 * mib),
        ("huge", 1): VersionSize(stored=800 * mib, source=800 * mib),
    }
    now = datetime.now(UTC)
    jobs = [
        Job("a", "eu", now + timedelta(hours=1), now + timedelta(hours=3), (("small", 1),)),
        Job("b", "eu", now + timedelta(hours=2), now + timedelta(hours=4), (("huge", 1),)),
    ]
    unmet = Infeasible("b", "eu", "huge@1", "larger than the region's capacity")
    result = Plan(regions={}, infeasible=[unmet], transfers={}, cost={})
    assert _share_rows(topology, reports, jobs, manifests, sizes, {}, result).rows == []


def _one_node_holds_x_or_y(
    extra: dict[str, int] | None = None,
) -> Callable[[list[Job]], Plan]:
    """A region of nodes a:1 and b:1 where a:1 holds its share of x@1 or of y@1, never both.

    x and y: six 1 MiB shards each, split by hash; ``extra``: more versions of one 1 MiB
    shard each, by name → 0 (its shard on a:1) or 1 (on b:1), the first such name tried.
    What is returned plans jobs as make_plan does: the planner, then holdable_plan.
    """
    from edgecache.cache import rendezvous
    from edgecache.cache.planner import RegionState, VersionSize, plan
    from edgecache.clients.ops import NodeReport
    from edgecache.clients.ops.planning import _share_rows, holdable_plan, replica_names
    from edgecache.clients.topology import RegionConfig, Topology

    mib = 1 << 20
    nodes = ["a:1", "b:1"]
    topology = Topology(registry="file:///r", regions={"eu": RegionConfig(nodes=nodes)})

    def reports(capacity: dict[str, int]) -> list[NodeReport]:
        return [
            NodeReport(
                "eu",
                n,
                True,
                status=edge_pb2.NodeStatus(region="eu", node_id=n, capacity_bytes=capacity[n]),
            )
            for n in nodes
        ]

    names = replica_names(reports(dict.fromkeys(nodes, 0)))
    versions = {"x": 6, "y": 6}
    for name, on in (extra or {}).items():
        versions[name] = 1
        assert rendezvous.owner(nodes, name, 1, 0, names=names) == nodes[on], name
    manifests, sizes = {}, {}
    for name, count in versions.items():
        manifest = pb.Manifest(dataset=name, version=1)
        for _ in range(count):
            manifest.shards.add(source_size=mib)
        manifests[f"{name}@1"] = manifest
        sizes[(name, 1)] = VersionSize(stored=count * mib, source=count * mib)
    on_a = {  # a:1's share of each version, in bytes
        name: sum(
            mib for i in range(6) if rendezvous.owner(nodes, name, 1, i, names=names) == "a:1"
        )
        for name in ("x", "y")
    }
    # a:1 holds either share alone, never both (nor one with another MiB); b:1 anything.
    capacity = {"a:1": max(on_a.values()) + mib // 2, "b:1": 100 * mib}
    assert capacity["a:1"] < sum(on_a.values())
    region = RegionState("eu", capacity_bytes=sum(capacity.values()), origin_bandwidth=1e9)

    def planned(jobs: list[Job]) -> Plan:
        now = min(job.start for job in jobs) - timedelta(hours=1)

        def replan(kept: list[Job], waits: dict) -> Plan:
            not_before = {v: w for (_, v), w in waits.items()}
            return plan(kept, {"eu": replace(region, not_before=not_before)}, sizes, now=now)

        def unholdable(kept: list[Job], made: Plan) -> object:
            return _share_rows(topology, reports(capacity), kept, manifests, sizes, {}, made, now)

        return holdable_plan(jobs, replan, unholdable, replan(jobs, {}))

    return planned


def _named_on(node: int, prefix: str) -> str:
    """A dataset name whose one shard (version 1) hashes to a:1 (0) or b:1 (1)."""
    from edgecache.cache import rendezvous

    nodes, names = ["a:1", "b:1"], {"a:1": "a:1", "b:1": "b:1"}
    return next(
        f"{prefix}{i}"
        for i in range(1000)
        if rendezvous.owner(nodes, f"{prefix}{i}", 1, 0, names=names) == nodes[node]
    )


def _job(name: str, start: float, end: float, version: str) -> Job:
    """A job of region eu from ``start`` to ``end`` hours after a fixed time, reading NAME@1."""
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    return Job(name, "eu", t0 + timedelta(hours=start), t0 + timedelta(hours=end), ((version, 1),))


def test_of_two_overlapping_jobs_that_fit_alone_but_not_together_the_first_is_planned() -> None:
    """A review: the re-plan without versions no node split holds dropped both jobs' versions
    (each was in a row "share of a@1, b@1"), where the first job's alone fits."""
    result = _one_node_holds_x_or_y()([_job("first", 1, 3, "x"), _job("second", 2, 4, "y")])
    assert [(t.spec, t.jobs) for t in result.regions["eu"].tasks] == [("x@1", ("first",))]
    assert [(row.job, row.version) for row in result.infeasible] == [("second", "y@1")]


def test_a_job_whose_node_is_free_is_not_blamed_for_two_others_that_overflow_one() -> None:
    """A review: the check asked whether this job's versions and everything held meanwhile
    overflow a node, and the others' x and y overflowed a:1 without it: z, on b:1 alone,
    was made to wait (or called "cannot be met") for them."""
    z = _named_on(1, "z")
    planned = _one_node_holds_x_or_y({z: 1})
    jobs = [_job("jx", 1, 4, "x"), _job("jy", 2, 5, "y"), _job("jz", 2, 5, z)]
    result = planned(jobs)
    tasks = {t.spec: t for t in result.regions["eu"].tasks}
    assert not tasks[f"{z}@1"].waits, tasks[f"{z}@1"]
    assert [(row.job, row.version) for row in result.infeasible] == [("jy", "y@1")]


def test_a_wait_for_a_later_job_does_not_make_an_earlier_reader_of_the_version_late() -> None:
    """A review: two jobs read y, the first while x's job holds a:1, the second after it.
    The second's wait moved the one task of y past the first's start, which was then said
    late "from origin" (the link was not the cause). Now the first cannot be met (it
    overlaps x's job on a:1) and y waits for x's pin, for the second."""
    planned = _one_node_holds_x_or_y()
    result = planned([_job("jx", 0.5, 3, "x"), _job("j1", 1, 4, "y"), _job("j2", 6, 8, "y")])
    tasks = {t.spec: t for t in result.regions["eu"].tasks}
    assert [(row.job, row.version) for row in result.infeasible] == [("j1", "y@1")]
    assert tasks["y@1"].jobs == ("j2",) and tasks["y@1"].waits, tasks["y@1"]
    assert tasks["y@1"].start == _job("jx", 0.5, 3, "x").end


def test_a_version_a_node_holds_only_once_a_pin_there_ends_is_staged_then(
    tmp_path: Path,
) -> None:
    """Two jobs apart in time whose one-shard versions hash to one node: the plan staged the
    second at once, beside the first one's pin on that node (the region as a whole had the
    room), and every warm or controller round failed it RESOURCE_EXHAUSTED there until the
    pin ran out (a helper's hunt). It begins when the pin ends, and warm defers it."""
    from edgecache.clients.controller import Controller

    registry = f"file://{tmp_path}/registry"
    first, second = _same_owner_names()
    for name in (first, second):
        write_parquet_shards(tmp_path / name, 1, rows=20000)
        # Stored uncompressed, about as large as their source: plan and warm size a version
        # no node holds yet by its source bytes, and each must fit a node alone.
        publish(registry, f"file://{tmp_path}/{name}", name, compression=pb.COMPRESSION_NONE)
    source = sum(f.stat().st_size for f in (tmp_path / first).rglob("*") if f.is_file())
    # Each node holds 1.5 versions as stored: the region (3) holds both, the node both
    # hash to holds one at a time. Stored sizes, from a node that staged one.
    probe = start_local_node("probe", tmp_path / "probe", registry)
    try:
        list(stub(probe.address).Stage(edge_pb2.StageRequest(dataset=first, version=1)))
        (held,) = stub(probe.address).Status(edge_pb2.StatusRequest()).versions
    finally:
        probe.stop()
    nodes, topology = _two_nodes(tmp_path, registry, int(max(held.stored_bytes, source) * 1.5))
    try:
        config = ["--config", str(topology)]
        apart = _schedule(tmp_path / "apart.yaml", [("j1", first, 1), ("j2", second, 5)])
        # The first job's version staged and pinned (its own warm): the plan then knows
        # what a version of this data stores.
        alone = _schedule(tmp_path / "alone.yaml", [("j1", first, 1)])
        code, out, err = edgecache("warm", str(alone), *config)
        assert code == 0, (out, err)
        for _ in range(2):  # warm twice: the second finds the first's work done
            code, out, err = edgecache("plan", str(apart), *config, "--json")
            assert code == 0, (out, err)
            tasks = {t["version"]: t for t in json.loads(out)["regions"]["eu"]["tasks"]}
            j1_end = datetime.fromisoformat(json.loads(out)["regions"]["eu"]["pins"][0]["until"])
            later = tasks[f"{second}@1"]
            # At the first job's pin end (the node's copy of the pin: to the millisecond).
            assert abs(datetime.fromisoformat(later["start"]) - j1_end) < timedelta(seconds=1)
            assert f"until {first}@1 is no longer pinned" in later["waits"], later
            code, out, err = edgecache("warm", str(apart), *config, "--json")
            assert code == 0, (out, err)  # the first staged, the second deferred: no failure
            deferred = json.loads(out)["deferred"]
            assert [d["what"] for d in deferred] == [f"stage {second}@1"], out
            assert "run warm again then" in deferred[0]["reason"], deferred
        code, out, err = edgecache("plan", str(apart), *config)
        assert code == 0 and "starts at" in out and "waits for room on one node" in out, out
        # Before its start the controller leaves it be (it began at once, and failed).
        controller = Controller(topology, apart)
        try:
            controller.tick()
            controller.wait_idle()
            record = controller.state.tasks[f"eu {second}@1"]
            assert (record.state, record.attempts) == ("pending", 0), record
        finally:
            controller.close()
        # At its start the controller stages it: the first job is over, its pin gone (the
        # nodes keep real time: the pin is taken off as its end would).
        for node in nodes:
            stub(node.address).Pin(edge_pb2.PinRequest(dataset=first, version=1), timeout=10)
        controller = Controller(topology, apart, clock=lambda: j1_end + timedelta(minutes=1))
        try:
            controller.tick()
            controller.wait_idle()
            record = controller.state.tasks[f"eu {second}@1"]
            assert record.state == "done", record
        finally:
            controller.close()
    finally:
        for node in nodes:
            node.stop()


def test_a_version_a_wait_makes_late_is_said_late_for_the_wait_not_the_link() -> None:
    """A review: a task held back by a node's room and then too short of time was said
    late with the link's words ("needs N s at R from origin … make the link faster")."""
    from edgecache.cache.planner import RegionState, VersionSize, plan

    job = _job("j", 2, 4, "y")
    wait = "waits for room on one node until x@1 is no longer pinned: before then, …"
    region = RegionState(
        "eu",
        capacity_bytes=1 << 40,
        origin_bandwidth=1e6,  # 1 GiB in about 18 minutes
        not_before={("y", 1): (job.start - timedelta(minutes=6), wait)},
    )
    sizes = {("y", 1): VersionSize(stored=1 << 30, source=1 << 30)}
    result = plan([job], {"eu": region}, sizes, now=job.start - timedelta(hours=2))
    (task,) = result.regions["eu"].tasks
    assert task.start == job.start - timedelta(minutes=6) and task.waits == wait
    (row,) = result.infeasible
    assert wait in row.reason and "begins at" in row.reason, row.reason
    assert "make the link" not in row.reason, row.reason


def test_a_version_that_waits_is_not_held_back_by_one_that_serves_an_earlier_job() -> None:
    """A review: job J reads u (on node b:1, also read earlier by E) and w (on a:1, beside x
    pinned there until a time before J's start). The wait was refused for u's earlier task,
    though only w needed it: w was staged at once beside x, with no wait and no row."""
    from edgecache.cache.planner import RegionState, VersionSize, plan
    from edgecache.clients.ops import NodeReport
    from edgecache.clients.ops.planning import _share_rows, holdable_plan
    from edgecache.clients.ops.status import Holding
    from edgecache.clients.topology import RegionConfig, Topology

    mib, hour = 1 << 20, timedelta(hours=1)
    now = datetime(2030, 1, 1, tzinfo=UTC)
    x, w, u = _named_on(0, "x"), _named_on(0, "w"), _named_on(1, "u")
    x_end = now + 4.5 * hour
    topology = Topology(registry="file:///r", regions={"eu": RegionConfig(nodes=["a:1", "b:1"])})
    statuses = {n: edge_pb2.NodeStatus(node_id=n, capacity_bytes=10 * mib) for n in ("a:1", "b:1")}
    held_x = statuses["a:1"].versions.add(dataset=x, version=1, shard_count=1, stored_bytes=6 * mib)
    held_x.pinned_until.FromDatetime(x_end.replace(tzinfo=None))
    reports = [NodeReport("eu", n, True, status=s) for n, s in statuses.items()]
    manifests = {
        f"{d}@1": pb.Manifest(dataset=d, version=1, shards=[pb.Shard(source_size=size)])
        for d, size in ((u, 2 * mib), (w, 6 * mib))
    }
    sizes = {
        (d, 1): VersionSize(size, size) for d, size in ((u, 2 * mib), (w, 6 * mib), (x, 6 * mib))
    }
    held = {"eu": {(x, 1): Holding(1, 6 * mib, True, 6 * mib)}}
    jobs = [
        Job("E", "eu", now + 4 * hour, now + 6 * hour, ((u, 1),)),
        Job("J", "eu", now + 5 * hour, now + 7 * hour, ((u, 1), (w, 1))),
    ]

    def replan(kept: list[Job], waits: dict) -> Plan:
        region = RegionState(
            "eu",
            capacity_bytes=20 * mib,
            origin_bandwidth=100 * mib,
            resident={(x, 1): 6 * mib},
            pinned={(x, 1): x_end},
            not_before={v: wait for (_, v), wait in waits.items()},
        )
        return plan(kept, {"eu": region}, sizes, now=now)

    def shares(kept: list[Job], made: Plan) -> object:
        return _share_rows(topology, reports, kept, manifests, sizes, held, made, now)

    result = holdable_plan(jobs, replan, shares, replan(jobs, {}))
    tasks = {t.spec: t for t in result.regions["eu"].tasks}
    assert tasks[f"{w}@1"].start == x_end and tasks[f"{w}@1"].waits, tasks
    assert not tasks[f"{u}@1"].waits and result.infeasible == [], result
