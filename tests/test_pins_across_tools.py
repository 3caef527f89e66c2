"""Pins placed by more than one tool (warm, the controller, the demo), and the files they read.

A pin warm and the controller both placed must outlive the controller's
schedule while warm's record still needs it; an eviction refusal must name
a command that really releases the pin; the demo records its jobs as warm
does; a topology or schedule with several problems says them all, each at
its line. Real nodes on loopback where pins are involved.
"""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import edgecache, stub

from edgecache.cache.errors import ConfigFileError, VersionPinned
from edgecache.clients import ops
from edgecache.clients.controller import Controller
from edgecache.clients.demo import run_demo
from edgecache.clients.node_client import LocalNode
from edgecache.clients.topology import load_schedule, load_topology
from edgecache.v1 import edge_pb2


def _job(name: str, start: datetime, *datasets: str) -> str:
    return (
        f"  - name: {name}\n    region: eu\n    start: '{start.isoformat()}'\n"
        f"    duration: 2h\n    datasets: [{', '.join(datasets)}]\n"
    )


def _pinned(node: LocalNode) -> set[str]:
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    return {f"{v.dataset}@{v.version}" for v in status.versions if v.HasField("pinned_until")}


def _run_controller(root: Path, schedule: str) -> dict[str, str]:
    """One round of a controller on ``schedule``; the pins it then counts as its own."""
    controller = Controller(root / "edgecache.yaml", root / schedule)
    try:
        assert controller.tick() is not None
        controller.wait_idle()
        return dict(controller.state.pins)
    finally:
        controller.close()


def test_the_controller_keeps_a_pin_warms_record_still_needs(eu) -> None:
    root, registry, node = eu
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    config = ["--config", str(root / "edgecache.yaml")]
    start = datetime.now(UTC) + timedelta(hours=1)
    (root / "good.yaml").write_text("jobs:\n" + _job("j1", start, "b@1"))
    (root / "both.yaml").write_text("jobs:\n" + _job("j1", start, "b@1") + _job("j2", start, "c@1"))
    (root / "other.yaml").write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(root / "good.yaml"), *config)  # pins b@1 for j1
    assert code == 0, (out, err)
    # The controller pins what both.yaml reads: b@1 is warm's pin too, counted as its own.
    claimed = _run_controller(root, "both.yaml")
    assert {key.split()[1] for key in claimed} == {"b@1", "c@1"}
    assert _pinned(node) == {"b@1", "c@1"}
    # Another schedule: c@1 was the controller's alone and goes; b@1 stays for warm's j1.
    claimed = _run_controller(root, "other.yaml")
    assert _pinned(node) == {"b@1"}
    assert [key.split()[1] for key in claimed] == ["b@1"]  # released once neither needs it
    topology = load_topology(root / "edgecache.yaml")
    with pytest.raises(VersionPinned, match="read by j1") as refused:
        ops.evict(topology, "b@1", region="eu")
    assert f"run `edgecache warm {root / 'good.yaml'}` again" in str(refused.value)
    # The refusal's advice: j1 out of good.yaml, warm again. Warm releases its pin, and the
    # controller lets its claim go; the eviction goes through.
    (root / "good.yaml").write_text("jobs: []\n")
    code, out, err = edgecache("warm", str(root / "good.yaml"), *config)
    assert code == 0 and "released the pin of b@1" in out, (out, err)
    assert _run_controller(root, "other.yaml") == {}
    assert _pinned(node) == set()
    assert ops.evict(topology, "b@1", region="eu")[0].bytes_freed > 0


def test_an_evict_refusal_for_a_pin_no_record_names_says_force(eu) -> None:
    root, registry, node = eu
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    topology = load_topology(root / "edgecache.yaml")
    until = datetime.now(UTC) + timedelta(hours=3)
    client = stub(node.address)
    list(client.Stage(edge_pb2.StageRequest(dataset="b", version=1)))
    pin = edge_pb2.PinRequest(dataset="b", version=1)
    pin.until.FromDatetime(until.replace(tzinfo=None))
    client.Pin(pin)
    with pytest.raises(VersionPinned) as refused:
        ops.evict(topology, "b@1", region="eu")
    message = str(refused.value)
    # No record: no warm run or controller round releases it, so warm is not the advice.
    assert "neither warm nor the controller recorded" in message, message
    assert "pass --force" in message and "edgecache warm" not in message, message
    # A job an older warm recorded (a bare list: no schedule file, no pins): no warm run
    # releases its pin either.
    record = Path(registry.removeprefix("file://")) / "_warm" / "jobs.json"
    record.parent.mkdir(parents=True)
    job = {"name": "old", "region": "eu", "versions": ["b@1"]}
    job |= {"start": datetime.now(UTC).isoformat(), "end": until.isoformat()}
    record.write_text(json.dumps([job]))
    with pytest.raises(VersionPinned) as refused:
        ops.evict(topology, "b@1", region="eu")
    message = str(refused.value)
    assert "read by old" in message and "older warm" in message, message
    assert "pass --force" in message and "edgecache warm" not in message, message
    assert ops.evict(topology, "b@1", region="eu", force=True)[0].bytes_freed > 0


def test_the_demo_records_its_jobs_so_the_evict_advice_works(tmp_path: Path) -> None:
    seen: dict[str, tuple[int, str, str]] = {}

    def follow_the_advice(_result: object, workdir: Path) -> None:
        config = ["--config", str(workdir / "edgecache.yaml")]
        evict = ("evict", "demo-tokens@1", "--region", "us-east", *config)
        seen["refused"] = edgecache(*evict)
        (workdir / "schedule.yaml").write_text("jobs: []\n")
        # The command as printed, pasted: it names the topology the evict was given (run
        # without it, warm read ./edgecache.yaml, another topology, and released nothing).
        printed = " ".join(seen["refused"][2].split()).split("run `edgecache ")[1].split("`")[0]
        seen["warm"] = edgecache(*shlex.split(printed))
        seen["evicted"] = edgecache(*evict)

    run_demo(tmp_path, total_mib=2, shards=2, while_running=follow_the_advice)
    code, _, err = seen["refused"]
    assert code == 2 and "read by eval-us" in err, err
    said = " ".join(err.split())
    config = tmp_path / "edgecache.yaml"
    assert f"run `edgecache warm {tmp_path / 'schedule.yaml'} --config {config}` again" in said, err
    code, out, err = seen["warm"]
    assert code == 0 and "released the pin of demo-tokens@1" in out, (out, err)
    code, out, err = seen["evicted"]
    assert code == 0, (out, err)


def _topology_error(tmp_path: Path, regions: str) -> str:
    config = tmp_path / "edgecache.yaml"
    config.write_text(f"registry: file://{tmp_path}/registry\nregions:\n{regions}")
    with pytest.raises(ConfigFileError) as caught:
        load_topology(config)
    return str(caught.value)


def test_a_node_listed_twice_is_refused_at_its_line(tmp_path: Path) -> None:
    message = _topology_error(
        tmp_path,
        "  eu:\n    nodes: ['127.0.0.1:34431', '127.0.0.1:34431']\n"
        "  us:\n    nodes:\n      - grpc://127.0.0.1:34431\n",
    )
    config = tmp_path / "edgecache.yaml"
    problems = message.split("\n  ")
    assert len(problems) == 2, message
    assert problems[0].startswith(f"{config}:4: regions.eu.nodes.1: node '127.0.0.1:34431'")
    assert problems[1].startswith(f"{config}:7: regions.us.nodes.0: node 'grpc://127.0.0.1")
    assert all("listed twice (first as regions.eu.nodes.0, line 4)" in p for p in problems)


def test_a_self_peer_and_an_unknown_peer_are_refused_at_their_lines(tmp_path: Path) -> None:
    message = _topology_error(
        tmp_path,
        "  eu-west:\n    nodes: ['127.0.0.1:1']\n"
        "  us-east:\n    nodes: ['127.0.0.1:2']\n"
        "    peers:\n      us-east: 1Gbit/s\n      eu-wst: 1Gbit/s\n",
    )
    config = tmp_path / "edgecache.yaml"
    own, unknown = message.split("\n  ")
    assert own.startswith(f"{config}:8: regions.us-east.peers.us-east: "), own
    assert "its own peer" in own
    assert unknown.startswith(f"{config}:9: regions.us-east.peers.eu-wst: "), unknown
    assert "not a region of the file" in unknown and "did you mean 'eu-west'?" in unknown


def test_a_node_address_with_a_bracketed_non_ip_is_refused_not_a_crash(tmp_path: Path) -> None:
    # The fuzzer's "127.0.0.1:7070 &a [*a]": urlsplit's own ValueError escaped the
    # duplicate-node check as a traceback.
    message = _topology_error(tmp_path, "  local:\n    nodes: ['127.0.0.1:7070 &a [*a]']\n")
    assert "is not host:port" in message, message


def test_every_problem_of_a_schedule_is_said_at_once(tmp_path: Path) -> None:
    config = tmp_path / "edgecache.yaml"
    config.write_text(f"registry: file://{tmp_path}\nregions:\n  eu:\n    nodes: ['127.0.0.1:1']\n")
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "jobs:\n"
        "  - name: a\n    region: mars\n    start: 2026-12-01T08:00:00\n    datasets: [x]\n"
        "  - name: a\n    region: eu\n    start: 2026-12-01T08:00:00Z\n    datasets: [x]\n"
        "    strat: 2026-12-01T08:00:00Z\n"
    )
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(schedule, load_topology(config))
    problems = str(caught.value).split("\n  ")
    assert [p.split(": ")[0] for p in problems] == [
        f"{schedule}:{line}" for line in (3, 4, 6, 10)
    ], problems
    assert "jobs.0.region: job 'a' runs in region 'mars'" in problems[0]
    assert "jobs.0.start" in problems[1] and "timezone" in problems[1]
    assert "appears twice" in problems[2] and "the first is jobs.0, line 2" in problems[2]
    assert "did you mean 'start'?" in problems[3]


def test_controller_once_refuses_a_bad_schedule_before_announcing_a_run(tmp_path: Path) -> None:
    (tmp_path / "registry").mkdir()
    config = tmp_path / "edgecache.yaml"
    config.write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n    nodes: ['127.0.0.1:1']\n"
    )
    schedule = tmp_path / "bad.yaml"
    schedule.write_text("jobs:\n  - name: a\n    region: mars\n    start: x\n    datasets: [b]\n")
    code, out, err = edgecache(
        "controller", "--schedule", str(schedule), "--once", "--config", str(config)
    )
    assert code == 2 and out == "", (out, err)
    assert f"{schedule}:3: jobs.0.region" in err and f"{schedule}:4: jobs.0.start" in err, err


def test_warm_and_the_demo_say_a_shortened_pin_as_shortened_not_released() -> None:
    """The demo said "released" of every pin it let go, a shortened one too (the node kept it)."""
    from edgecache.cache.planner import Plan, RegionPlan
    from edgecache.clients.executor import release_line

    until = datetime(2026, 12, 5, 12, tzinfo=UTC)
    pin = ops.WarmPin("/s.yaml", "10.0.0.1:7070", "eu", "b@1", until)
    pins = {("b", 1): until - timedelta(hours=2)}
    plan = Plan(regions={"eu": RegionPlan(pins=pins)}, infeasible=[], transfers={}, cost={})
    assert release_line(pin, plan) == (
        "eu: released the pin of b@1 on 10.0.0.1:7070 (until 2026-12-05 12:00): no job of the "
        "schedule reads it there any more"
    )
    assert release_line(pin, plan, dry_run=True).startswith("eu: would release the pin of b@1")
    moved = ops.WarmPin(**{**pin.__dict__, "shorten_to": until - timedelta(hours=2)})
    line = release_line(moved, plan)
    assert "released" not in line, line
    assert line == (
        "eu: shortened the pin of b@1 on 10.0.0.1:7070 from 2026-12-05 12:00 to 2026-12-05 "
        "10:00: the schedule's last job that reads it there now ends then (moved earlier)"
    )
    other = ops.WarmPin(**{**pin.__dict__, "shorten_to": until - timedelta(hours=1)})
    assert "now ends at 2026-12-05 10:00, and a job another schedule" in release_line(other, plan)
    assert "no job of the schedule reads it there any more, and a job another" in release_line(
        other, Plan(regions={}, infeasible=[], transfers={}, cost={})
    )


def test_an_eviction_refusal_names_every_record_that_holds_the_job(eu) -> None:
    """The same job in warm's record and the controller's was one entry, the controller's:
    the refusal said to remove it from the controller's schedule; done, the pin stayed
    (warm's record still held the job), and only the next refusal named warm's file."""
    root, registry, node = eu
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    start = datetime.now(UTC) + timedelta(hours=1)
    (root / "good.yaml").write_text("jobs:\n" + _job("j1", start, "b@1"))
    code, out, err = edgecache(
        "warm", str(root / "good.yaml"), "--config", str(root / "edgecache.yaml")
    )
    assert code == 0, (out, err)
    _run_controller(root, "good.yaml")  # the controller records the same job
    with pytest.raises(VersionPinned) as refused:
        ops.evict(load_topology(root / "edgecache.yaml"), "b@1", region="eu")
    said = " ".join(str(refused.value).split())
    assert said.count("read by j1 (") == 1 and said.count("j1 (eu,") == 1, said
    assert f"run `edgecache warm {root / 'good.yaml'}` again" in said, said
    assert "and remove the job from the controller's schedule" in said, said
