"""What plan, warm, evict, ready and the controller show is what is true, against real nodes.

Two versions of one Parquet dataset (same content) and small regions on
loopback: ``tiny`` holds pq@1 with room for one more, ``small`` holds pq@2
and has room for one version only. Commands run as real processes, in a
pipe at 80 columns, as an operator or a script meets them.

The module's ``site`` (``tiny``, and a region ``down``) is only read: no test
stages, pins or evicts there. Tests that change a region (``warm`` pins,
stages, records its jobs) get ``small`` afresh, with a registry of its own,
so every test passes alone and in any order.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.cache.registry import Registry
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.ops import Readiness, make_plan, wait_ready
from edgecache.clients.topology import Topology, load_schedule, load_topology
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb


def status(node: LocalNode) -> edge_pb2.NodeStatus:
    return stub(node.address).Status(edge_pb2.StatusRequest())


def published(root: Path) -> str:
    """A registry in ``root`` with pq@1 and pq@2, the same one-shard Parquet content twice."""
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin", 1, rows=500)
    publish(registry, f"file://{root}/origin", "pq")
    publish(registry, f"file://{root}/origin", "pq")  # pq@2: the same content again
    return registry


def topology_file(path: Path, registry: str, **regions: str) -> Path:
    """A topology of one node per region."""
    path.write_text(
        f"registry: {registry}\nregions:\n"
        + "".join(f"  {name}:\n    nodes: ['{address}']\n" for name, address in regions.items())
    )
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, LocalNode]]]:
    root = tmp_path_factory.mktemp("defects")
    registry = published(root)
    tiny = start_local_node("tiny", root / "cache-tiny", registry, capacity="70KiB")
    list(stub(tiny.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
    topology_file(root / "tiny.yaml", registry, tiny=tiny.address)
    # A region whose one node is down (nothing listens on port 1), beside a live one.
    topology_file(root / "down.yaml", registry, down="127.0.0.1:1", tiny=tiny.address)
    yield root, {"tiny": tiny}
    tiny.stop()


def resident(node: LocalNode, dataset: str, version: int) -> edge_pb2.ResidentVersion:
    """What ``node`` says of one version, found by name (pins without data are listed too)."""
    (found,) = [v for v in status(node).versions if (v.dataset, v.version) == (dataset, version)]
    return found


def schedule(root: Path, name: str, *jobs: tuple[str, str, datetime, str]) -> Path:
    """A schedule of (job, region, start, NAME@N) jobs, an hour each."""
    path = root / f"{name}.schedule.yaml"
    path.write_text(
        "jobs:\n"
        + "".join(
            f"  - name: {job}\n    region: {region}\n    start: '{start.isoformat()}'\n"
            f"    duration: 1h\n    datasets: [{spec}]\n"
            for job, region, start, spec in jobs
        )
    )
    return path


def test_a_version_no_job_reads_sizes_the_one_it_does(site) -> None:
    """pq@2 is sized by the stored/source ratio of pq@1, held though the schedule skips it."""
    root, nodes = site
    tiny = status(nodes["tiny"])
    (held,) = [v for v in tiny.versions if v.shard_count]
    manifest = Registry.run(f"file://{root}/registry", lambda reg: reg.manifest("pq", 2))
    source = sum(s.source_size for s in manifest.shards)
    # The premise: pq@2 fits beside pq@1 once stored, but its source bytes would not fit at all.
    assert 2 * held.stored_bytes <= tiny.capacity_bytes < source
    later = datetime.now(UTC) + timedelta(days=1)
    path = schedule(root, "sizes", ("job-tiny", "tiny", later, "pq@2"))
    topology = load_topology(root / "tiny.yaml")
    result, _ = make_plan(topology, load_schedule(path, topology))
    assert not result.infeasible, result.infeasible
    (task,) = result.regions["tiny"].tasks
    assert task.bytes == held.stored_bytes  # same content, same ratio: the same stored size
    code, out, err = edgecache("plan", str(path), "--config", str(root / "tiny.yaml"))
    assert code == 0 and "pq@2" in out, (out, err)


def test_a_down_region_is_named_as_down_and_fails_plan_and_controller_once(site) -> None:
    root, _ = site
    later = datetime.now(UTC) + timedelta(days=1)
    path = schedule(root, "down", ("job-down", "down", later, "pq@1"))
    config = ["--config", str(root / "down.yaml")]
    code, out, err = edgecache("plan", str(path), *config)
    assert code == 1, (code, out, err)  # nodes unreachable, as plan --help says
    assert "capacity" not in out + err
    assert "region down is unreachable: 127.0.0.1:1" in err and "edgecache status" in err, err
    code, out, err = edgecache("plan", str(path), "--json", *config)
    assert code == 1 and "unreachable" in json.loads(out)["infeasible"][0]["reason"]
    code, out, err = edgecache("controller", "--schedule", str(path), "--once", *config)
    assert code == 1, (code, out, err)  # its actions failed: not a clean run
    assert "running" in out and "once" in out and "every" not in out, out
    assert "error: region down is unreachable: 127.0.0.1:1" in err, err
    code, out, err = edgecache("controller", "--help")
    assert "with --once, another controller holds" in " ".join(out.replace("│", " ").split())


def test_plan_and_warm_say_an_unreachable_region_once_beside_the_plans_own_reasons(
    site,
) -> None:
    """Region ``down``'s job fails for the outage alone; ``tiny``'s reads a version no one has.

    Each command says the outage once, as the node failure (an error), and the
    plan's own reason in its "cannot be met" list; plan used to give the outage
    there as well. Scripts get both rows, the outage's marked ``unreachable``.
    """
    root, _ = site
    later = datetime.now(UTC) + timedelta(days=1)
    path = schedule(
        root,
        "down-and-nope",
        ("job-down", "down", later, "pq@1"),
        ("job-nope", "tiny", later, "nope@9"),
    )
    config = ["--config", str(root / "down.yaml")]
    outage = "region down is unreachable: 127.0.0.1:1"
    code, out, err = edgecache("plan", str(path), *config)
    assert code == 1, (code, out, err)
    assert (out + err).count("127.0.0.1:1") == 1 and f"error: {outage}" in err, (out, err)
    assert "cannot be met" in out and "job-nope" in out and "job-down" not in out, out
    code, out, err = edgecache("plan", str(path), "--json", *config)
    assert code == 1, (code, out, err)
    rows = {i["job"]: i for i in json.loads(out)["infeasible"]}
    assert rows["job-down"]["unreachable"] is True and outage in rows["job-down"]["reason"]
    assert rows["job-nope"]["unreachable"] is False, rows
    assert set(rows["job-down"]) == {"job", "region", "version", "reason", "unreachable"}
    code, out, err = edgecache("warm", str(path), "--dry-run", *config)
    assert code == 1, (code, out, err)
    assert (out + err).count("127.0.0.1:1") == 1 and f"error: {outage}" in err, (out, err)
    assert "cannot be met: job-nope nope@9 in tiny" in err and "job-down" not in err, err
    code, out, err = edgecache("warm", str(path), "--dry-run", "--json", *config)
    rows = {i["job"]: i for i in json.loads(out)["infeasible"]}
    assert rows["job-down"]["unreachable"] and not rows["job-nope"]["unreachable"], rows


def test_a_region_with_one_node_of_two_down_is_degraded_planned_and_still_fails(site) -> None:
    """Replicas: one answers, one does not. Not 'unreachable' (its jobs are planned on the
    node that answers), but the plan cannot count the silent node, so plan still fails."""
    root, nodes = site
    half = root / "half.yaml"
    half.write_text(
        f"registry: file://{root}/registry\nregions:\n"
        f"  tiny:\n    nodes: ['{nodes['tiny'].address}', '127.0.0.1:1']\n"
    )
    later = datetime.now(UTC) + timedelta(days=1)
    path = schedule(root, "half", ("job-half", "tiny", later, "pq@2"))
    code, out, err = edgecache("plan", str(path), "--json", "--config", str(half))
    assert code == 1, (code, out, err)
    planned = json.loads(out)
    assert planned["infeasible"] == [], planned  # planned, on the node that answered
    assert [t["version"] for t in planned["regions"]["tiny"]["tasks"]] == ["pq@2"], planned
    assert "region tiny is degraded, 1 of its 2 nodes not answering: 127.0.0.1:1" in err, err
    assert "unreachable" not in err, err
    # warm says the node failure once, and still gives the plan's own reasons there.
    path = schedule(
        root,
        "half-missing",
        ("job-half", "tiny", later, "pq@2"),
        ("job-nope", "tiny", later, "nope@9"),
    )
    code, out, err = edgecache("warm", str(path), "--dry-run", "--config", str(half))
    assert code == 1, (code, out, err)
    assert "cannot be met: job-nope nope@9 in tiny" in err, err
    assert err.count("degraded") == 1, err


def test_warm_dry_run_shows_what_warm_does_deferrals_included_and_as_json(small) -> None:
    root, node = small
    held = resident(node, "pq", 2)
    capacity = status(node).capacity_bytes
    assert held.stored_bytes < capacity < 2 * held.stored_bytes  # room for one
    assert not held.HasField("pinned_until")
    now = datetime.now(UTC)
    path = schedule(
        root,
        "jit",
        ("job-first", "small", now + timedelta(hours=1), "pq@2"),
        ("job-second", "small", now + timedelta(hours=3), "pq@1"),
    )
    config = ["--config", str(root / "small.yaml")]
    code, out, err = edgecache("warm", str(path), "--dry-run", *config)
    assert code == 0, (out, err)
    # The plan evicts pq@2 just in time for pq@1; warm, running now, must wait for job-first.
    assert "would evict" not in out and "would stage" not in out, out
    assert "would defer: small evict pq@2: not evicting pq@2: job job-first starts" in err, err
    assert "would defer: small stage pq@1: needs room" in err, err
    assert "small: would pin pq@1 until" in out and "0 of 1 item(s) would be staged" in out
    code, dry, err = edgecache("warm", str(path), "--dry-run", "--json", *config)
    assert code == 0, err
    rehearsed = json.loads(dry)
    assert rehearsed["dry_run"] is True
    assert [(i["version"], i["state"]) for i in rehearsed["items"]] == [("pq@1", "deferred")]
    assert [d["what"] for d in rehearsed["deferred"]] == ["evict pq@2", "stage pq@1"]
    assert {p["version"] for p in rehearsed["pins"]} == {"pq@1", "pq@2"}
    assert [v.version for v in status(node).versions] == [2]  # untouched: no pin set, even
    assert not resident(node, "pq", 2).HasField("pinned_until")  # one without data
    code, real, err = edgecache("warm", str(path), "--json", *config)
    assert code == 0, err
    done = json.loads(real)
    for key in ("items", "evicted", "deferred", "pins", "infeasible"):
        assert done[key] == rehearsed[key], key  # the dry run said exactly this
    assert resident(node, "pq", 2).HasField("pinned_until")  # for job-first, for real now


def test_evict_names_the_job_a_pin_keeps_a_version_for_and_when_it_starts(small) -> None:
    root, _ = small
    now = datetime.now(UTC)
    path = schedule(
        root,
        "evict",
        ("job-first", "small", now + timedelta(hours=1), "pq@2"),
        ("job-second", "small", now + timedelta(hours=3), "pq@1"),
    )
    config = ["--config", str(root / "small.yaml")]
    code, out, err = edgecache("warm", str(path), *config)  # pins pq@2 for job-first
    assert code == 0, (out, err)
    code, out, err = edgecache("evict", "pq@2", "--region", "small", *config)
    assert code == 2, (out, err)
    start = f"{now + timedelta(hours=1):%Y-%m-%d %H:%M}"
    assert f"read by job-first (small, starts {start}" in err, err
    assert "job-second" not in err  # it reads pq@1, not this version
    # warm's record of the jobs unreadable (origin fails to give it): the names are
    # lost, with a warning saying why; the refusal stands.
    record = root / "registry" / "_warm" / "jobs.json"
    record.unlink()
    record.mkdir()
    code, out, err = edgecache("evict", "pq@2", "--region", "small", *config)
    assert code == 2, (out, err)
    assert "pq@2 is pinned on" in err and "neither warm nor the controller recorded" in err, err
    assert f"cannot read file://{root}/registry/_warm/jobs.json" in err, err


def test_warm_dry_run_of_one_version_is_json_too(site) -> None:
    root, nodes = site
    code, out, err = edgecache(
        "warm", "pq@2", "--region", "tiny", "--dry-run", "--json",
        "--config", str(root / "tiny.yaml"),
    )  # fmt: skip
    assert code == 0, err
    (item,) = json.loads(out)["items"]
    assert item["version"] == "pq@2" and item["region"] == "tiny" and item["state"] == "would stage"


def test_plan_status_without_a_controller_says_nothing_is_staging(site) -> None:
    root, _ = site
    later = datetime.now(UTC) + timedelta(days=1)
    path = schedule(root, "status", ("job-tiny", "tiny", later, "pq@2"))
    config = ["--config", str(root / "tiny.yaml")]
    code, out, err = edgecache("plan", str(path), "--status", "--json", *config)
    assert code == 0, err
    (view,) = json.loads(out)
    assert view["state"] == "not started", view
    assert "edgecache controller --schedule" in view["hint"] and "edgecache warm" in view["hint"]
    # The commands name the topology this plan read (a helper's hunt: without it, warm read
    # ./edgecache.yaml, which does not have the job's region, exit 2), not a read token.
    tiny = root / "tiny.yaml"
    assert f"`edgecache warm {path} --config {tiny}`" in view["hint"], view["hint"]
    assert f"--schedule {path} --config {tiny}`" in view["hint"], view["hint"]
    code, out, err = edgecache("plan", str(path), "--status", *config)
    assert "state: not started" in out and "staging" not in out.split("missing")[0], out


def test_plan_after_a_job_started_says_it_started(site) -> None:
    root, _ = site
    started = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
    path = schedule(root, "started", ("job-eu", "tiny", started, "pq@2"))
    code, out, err = edgecache(
        "plan", str(path), "--at", "2026-12-01T08:30:00Z", "--json",
        "--config", str(root / "tiny.yaml"),
    )  # fmt: skip
    assert code == 3, err
    (why,) = [i["reason"] for i in json.loads(out)["infeasible"]]
    assert why.startswith("job-eu already started at 2026-12-01 08:00 without pq@2"), why
    assert "needs" not in why


def test_bad_times_and_timeouts_name_the_option(site) -> None:
    root, _ = site
    config = ["--config", str(root / "tiny.yaml")]
    path = schedule(root, "bad", ("job", "tiny", datetime.now(UTC), "pq@1"))
    for command in (["plan", str(path)], ["controller", "--schedule", str(path), "--once"]):
        code, out, err = edgecache(*command, "--at", "garbage", *config)
        assert code == 2 and "--at 'garbage' is not a time" in err, err
        assert "2026-12-01T08:00:00Z" in err  # the expected form
    code, out, err = edgecache(
        "ready", "pq@2", "--region", "tiny", "--wait", "--timeout", "-5", *config
    )
    assert code == 2 and "--timeout" in err, err


def test_ready_wait_never_overruns_its_timeout(site) -> None:
    root, _ = site
    started = time.monotonic()
    code, out, err = edgecache(
        "ready", "pq@2", "--region", "tiny", "--wait", "--timeout", "2", "--json",
        "--config", str(root / "tiny.yaml"),
    )  # fmt: skip
    assert code == 1, err
    answer = json.loads(out)
    # Not a round more: that costs poll_seconds (2 s) more, 4 s; 3.5, not 2.5, leaves a loaded
    # host its slow scheduling.
    assert answer["timed_out"] and answer["waited_seconds"] < 3.5, answer
    assert re.match(r"timed out after [23]\.\d s", answer["message"]), answer
    # The whole process, Python start-up included (slow on a loaded machine): the wait is
    # held above by waited_seconds, this only bounds a hang.
    assert time.monotonic() - started < 60


def test_ready_wait_with_no_time_left_still_asks_once(site) -> None:
    root, _ = site
    config = ["--config", str(root / "tiny.yaml")]
    code, out, err = edgecache(
        "ready", "pq@1", "--region", "tiny", "--wait", "--timeout", "0", "--json", *config
    )
    assert code == 0, (out, err)
    answer = json.loads(out)
    assert answer["ready"] and not answer["timed_out"], answer
    assert answer["message"] == "pq@1 is staged in tiny", answer
    code, out, err = edgecache(
        "ready", "pq@2", "--region", "tiny", "--wait", "--timeout", "0", "--json", *config
    )
    assert code == 1, (out, err)
    answer = json.loads(out)
    assert answer["timed_out"] and "has 0/1 shards" in answer["message"], answer  # it asked


def test_ready_wait_leaves_no_status_round_behind(site) -> None:
    """A node that never answers: the wait ends at its timeout, and so do the calls it made.

    A round still out would hold the CLI's exit until its calls time out.
    """
    root, _ = site
    topology = load_topology(root / "down.yaml")
    manifest = Registry.run(f"file://{root}/registry", lambda reg: reg.manifest("pq", 1))
    before = set(threading.enumerate())
    # Rounds 5 s apart, not 2: a round more than the timeout then costs 5 s and more, far
    # from the timeout, and the bound leaves a loaded machine (threads slow to be
    # scheduled) 2.5 s of slack, not 0.9.
    readiness = wait_ready(topology, manifest, "down", timeout=1.0, poll_seconds=5.0)
    assert readiness.timed_out and 1.0 <= readiness.waited_seconds < 3.5, readiness
    assert "127.0.0.1:1 unreachable" in readiness.message, readiness
    # A closed channel's gRPC threads end soon after, not at once: give them that (10 s,
    # polled: on a loaded machine they are slow to be scheduled; a round still out would
    # hold its threads until its calls time out, and a leaked thread never ends).
    stop_by = time.monotonic() + 10.0
    while (left := [t for t in set(threading.enumerate()) - before if t.is_alive()]) and (
        time.monotonic() < stop_by
    ):
        time.sleep(0.05)
    assert [t.name for t in left] == []


class FakeRegion:
    """A region of one node for :func:`wait_ready`, on a clock of its own (nothing waits).

    ``round_seconds(began, bound)`` says how long a round begun at ``began``
    takes, ``bound`` being the longest its calls may run: ``(pings + 2)`` call
    timeouts, as gather_status documents. The node holds the version from
    ``ready_at`` on, as its Status at the end of a round says.
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        round_seconds: Callable[[float, float], float],
        ready_at: float,
    ) -> None:
        from edgecache.clients.ops import readiness  # wait_ready looks these up there

        self.now = 0.0
        self.rounds: list[tuple[float, float]] = []  # (began, ended)
        self.round_seconds = round_seconds
        self.ready_at = ready_at
        monkeypatch.setattr(
            readiness, "time", SimpleNamespace(monotonic=self.monotonic, sleep=self.sleep)
        )
        monkeypatch.setattr(readiness, "gather_status", self.gather_status)
        monkeypatch.setattr(readiness, "ready", self.ready)
        monkeypatch.setattr(readiness, "_refused_in", lambda reports, region: False)  # floats here

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds

    def gather_status(self, _topology: Topology, timeout: float, **options: Any) -> list[float]:
        began = self.now
        self.now += self.round_seconds(began, (options["pings"] + 2) * timeout)
        self.rounds.append((began, self.now))
        return [self.now]  # when the node answered Status

    def ready(self, reports: list[float], _region: str, _manifest: object) -> tuple[bool, str]:
        (answered,) = reports
        return answered >= self.ready_at, f"asked at {answered:.2f}"

    def wait(self, timeout: float) -> Readiness:
        topology = Topology.model_validate(
            {"registry": "file:///nowhere", "regions": {"eu": {"nodes": ["127.0.0.1:1"]}}}
        )
        return wait_ready(topology, pb.Manifest(), "eu", timeout=timeout)


@pytest.mark.parametrize("stalls_from", [0.0, 5.0])
def test_ready_wait_bounds_every_call_of_a_round_by_the_deadline(
    monkeypatch: pytest.MonkeyPatch, stalls_from: float
) -> None:
    """A node that answers connect and health just in time, then stalls on Status.

    Each of a round's three calls then runs to its timeout; the round must still end
    by the deadline (it overran by half the time left when the budget was split in two).
    From the start, or after rounds it answered at once.
    """

    def round_seconds(began: float, bound: float) -> float:
        return bound if began >= stalls_from else 0.1

    deadline = 10.0 if stalls_from else 4.0
    region = FakeRegion(monkeypatch, round_seconds, ready_at=float("inf"))
    readiness = region.wait(timeout=deadline)
    assert readiness.timed_out, readiness
    assert all(ended <= deadline + 1e-9 for _, ended in region.rounds), region.rounds
    assert readiness.waited_seconds == pytest.approx(deadline), readiness


def test_ready_wait_asks_again_when_too_little_time_is_left_for_its_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first round is slow (a cold connection), the rest quick; the data lands at 2 s.

    1.5 s of 3 left less than four slow rounds' room; the wait slept to the deadline
    and said it timed out, though the data was there a second before it.
    """
    region = FakeRegion(monkeypatch, lambda began, bound: 1.5 if began == 0 else 0.05, 2.0)
    readiness = region.wait(timeout=3.0)
    assert readiness.ok and not readiness.timed_out, (readiness, region.rounds)
    assert 2.0 <= readiness.waited_seconds <= 3.0, readiness


def test_ready_wait_gives_up_after_one_short_round_at_a_slow_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every round slow: one more is asked with what is left, then the wait times out."""
    region = FakeRegion(monkeypatch, lambda began, bound: min(bound, 0.6), float("inf"))
    readiness = region.wait(timeout=2.0)
    assert readiness.timed_out and readiness.waited_seconds == pytest.approx(2.0), readiness
    assert [began for began, _ in region.rounds] == pytest.approx([0.0, 0.6]), region.rounds


def test_a_held_version_whose_manifest_cannot_be_read_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node holds pq@1, whose manifest was damaged since; the schedule reads pq@2 only.

    pq@1 only lends its stored/source ratio to the size estimate: plan goes on
    without it and says so, instead of failing over a version no job reads.
    """
    registry = published(tmp_path)
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        (tmp_path / "registry" / "pq" / "versions" / "1.json").write_text('{"dataset": ')
        config = topology_file(tmp_path / "eu.yaml", registry, eu=node.address)
        later = datetime.now(UTC) + timedelta(days=1)
        path = schedule(tmp_path, "damaged", ("job-eu", "eu", later, "pq@2"))
        topology = load_topology(config)
        with caplog.at_level(logging.WARNING, logger="edgecache.clients.ops"):
            result, _ = make_plan(topology, load_schedule(path, topology))
        assert not result.infeasible, result.infeasible
        assert [task.spec for task in result.regions["eu"].tasks] == ["pq@2"]
        assert "pq@1, held or pinned by a node, is left out of the size estimates" in caplog.text
        code, out, err = edgecache("plan", str(path), "--config", str(config))
        assert code == 0 and "pq@2" in out, (out, err)
        assert "pq@1, held or pinned by a node, is left out" in err, err
    finally:
        node.stop()


def test_a_task_whose_peer_source_is_deferred_stages_from_origin_now(small) -> None:
    """``warm``: region fresh is to copy pq@1 from small, whose own pq@1 waits for room.

    The real run stages it from origin at once, saying why (it used to wait an hour
    for a peer that would not hold it, then fail); the dry run says the same.
    """
    from edgecache.cache.planner import Eviction, Plan, RegionPlan, StageTask
    from edgecache.clients.cli.staging import Rehearsal
    from edgecache.clients.executor import PlanExecutor

    root, node = small
    registry = f"file://{root}/registry"
    fresh = start_local_node("fresh", root / "cache-fresh", registry)
    try:
        two = topology_file(root / "two.yaml", registry, small=node.address, fresh=fresh.address)
        topology = load_topology(two)
        now = datetime.now(UTC)
        path = schedule(
            root,
            "peer",
            ("job-first", "small", now + timedelta(hours=1), "pq@2"),
            ("job-small", "small", now + timedelta(hours=3), "pq@1"),
            ("job-fresh", "fresh", now + timedelta(hours=4), "pq@1"),
        )
        jobs = load_schedule(path, topology)
        manifests = {
            f"pq@{n}": Registry.run(registry, lambda reg, n=n: reg.manifest("pq", n))
            for n in (1, 2)
        }

        def task(region: str, source: str, hours: float, job: str) -> StageTask:
            start = now + timedelta(hours=hours)
            return StageTask(region, ("pq", 1), 40_000, source, start, start, start, (job,))

        plan = Plan(
            regions={
                "small": RegionPlan(
                    tasks=[task("small", "origin", 1.5, "job-small")],
                    # job-first reads pq@2 from +1 h: this eviction is refused, so
                    # small's pq@1 is deferred (it needs the room).
                    evictions=[
                        Eviction("small", ("pq", 2), 40_000, now + timedelta(hours=1.5), None, "")
                    ],
                ),
                "fresh": RegionPlan(tasks=[task("fresh", "small", 2, "job-fresh")]),
            },
            infeasible=[],
            transfers={},
            cost={},
        )
        rehearsed = Rehearsal(topology).warm(plan, jobs, manifests)
        started = time.monotonic()
        done = PlanExecutor(topology).warm(plan, jobs, manifests)
        assert time.monotonic() - started < 60  # no hour-long wait for the peer
        for outcome, state in ((rehearsed, "would stage"), (done, "done")):
            runs = {run.task.region: run for run in outcome.runs}
            assert runs["small"].state == "deferred"
            assert runs["fresh"].state == state and not runs["fresh"].item.peers
            assert runs["fresh"].note.startswith("from origin: small will not hold pq@1"), runs
            assert "deferred, needs room: not evicting pq@2" in runs["fresh"].note
        (held,) = [v for v in status(fresh).versions if v.shard_count]
        assert (held.dataset, held.version) == ("pq", 1)
        held = status(node).versions
        assert not [v for v in held if v.version == 1 and v.shard_count]  # still deferred
    finally:
        fresh.stop()


def test_a_dry_run_of_one_version_in_a_region_all_down_says_nothing_would_be_staged(site) -> None:
    """warm NAME@N --region R --dry-run with every node of R down said "would stage … 1 of
    1 item(s) would be staged", where the real run stages nothing (a helper's hunt)."""
    root, _ = site
    config = ["--config", str(root / "down.yaml")]
    code, out, err = edgecache("warm", "pq@2", "--region", "down", "--dry-run", *config)
    assert code == 1, (code, out, err)
    assert "would stage pq@2" not in out and "0 of 1 item(s) would be staged" in out, out
    assert "no node of region down answers" in " ".join(err.split()), err


def test_a_damaged_manifest_is_its_jobs_row_not_the_whole_plans_failure(tmp_path: Path) -> None:
    """A helper's hunt: one version record that no longer parsed stopped `plan`, `warm` and
    every controller round (ManifestError, exit 2, nothing planned for the jobs that were
    fine). Now the job reading it cannot be met, saying what to do; the others are planned."""
    from edgecache.clients.ops import NodeReport
    from edgecache.clients.topology import RegionConfig, Schedule, ScheduledJob

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "good")
    publish(registry, f"file://{tmp_path}/origin", "bad")
    (tmp_path / "registry" / "bad" / "versions" / "1.json").write_text('{"broken')
    topology = Topology(registry=registry, regions={"eu": RegionConfig(nodes=["127.0.0.1:1"])})
    status = edge_pb2.NodeStatus(region="eu", node_id="eu-0", capacity_bytes=1 << 30)
    start = datetime.now(UTC) + timedelta(hours=2)
    schedule = Schedule(
        jobs=[
            ScheduledJob(name=n, region="eu", start=start, datasets=[f"{n}@1"])
            for n in ("good", "bad")
        ]
    )
    result, manifests = make_plan(
        topology, schedule, reports=[NodeReport("eu", "127.0.0.1:1", True, status=status)]
    )
    assert [t.spec for t in result.regions["eu"].tasks] == ["good@1"]
    (row,) = result.infeasible
    assert (row.job, row.version) == ("bad", "bad@1"), row
    assert "not a valid manifest" in row.reason and "publish the data again" in row.reason, row
    # plan --status: the row's why said "bad@1 is not in the registry" (a review)
    from edgecache.clients.plan_status import job_views

    reports = [NodeReport("eu", "127.0.0.1:1", True, status=status)]
    now = datetime.now(UTC)
    views = {v.job: v for v in job_views(schedule, result, manifests, reports, None, now)}
    assert views["bad"].why == "cannot be met: bad@1's registry record is damaged", views["bad"]
