"""What ``plan`` shows, ``warm`` does: decision by decision, on real nodes in three regions.

Five one-content datasets (a, c, x, y, old; 4 shards each, the same stored
size) and three regions of real ``edgecache serve`` nodes on loopback, with a
file:// origin:

* ``eu``: two replicas (they split shards), a fast origin link. Two jobs read
  a@1 with different ends: one task, pinned until the later end.
* ``us``: one node, a slow origin link and a fast peer link from ``eu``: a@1 is
  copied from ``eu`` (peer bytes, no origin fetch), c@1 comes from origin.
* ``ap``: one node with room for one version, holding old@1 that no job reads.
  x@1, then y@1, then x@1 again: old@1 is evicted now ("not needed again");
  x@1 and y@1 are evicted just in time, later, Belady's way, so the tasks
  behind those evictions start hours from now, and warm, acting now, must
  defer them rather than take data a job is about to read. The first x@1
  task stages for ap-1st, which ends hours before ap-3rd: its Stage asks for
  a shorter pin than the plan's (d4998a6: a Stage must not shorten a pin).

Commands run as real processes. The ``ran`` site is driven with ``--json``:
plan, warm --dry-run, warm, warm again, with every node's Status and metrics
read after each warm. The ``said`` site is the same scenario driven with the
text output, as a person reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

DATASETS = ("a", "c", "x", "y", "old")
NODES = {"eu-1": "eu", "eu-2": "eu", "us-1": "us", "ap-1": "ap"}
# (job, region, start in hours from now, duration in hours, version)
JOBS = (
    ("eu-train", "eu", 1.0, 2, "a@1"),
    ("eu-eval", "eu", 1.5, 6, "a@1"),  # same version, same region, a later end
    ("us-train", "us", 2.0, 3, "a@1"),  # from eu, a peer
    ("us-c", "us", 2.0, 1, "c@1"),  # from origin: no peer holds it
    ("ap-1st", "ap", 1.0, 1, "x@1"),
    ("ap-2nd", "ap", 3.0, 1, "y@1"),
    ("ap-3rd", "ap", 5.0, 1, "x@1"),
)


@dataclass
class NodeState:
    """One node as read after a step: its Status and its staged-bytes metrics."""

    status: edge_pb2.NodeStatus
    metrics: dict[str, float]  # source → edgecache_staged_bytes_total
    origin_fetches: float

    def version(self, spec: str) -> edge_pb2.ResidentVersion | None:
        found = [v for v in self.status.versions if f"{v.dataset}@{v.version}" == spec]
        return found[0] if found else None


@dataclass
class Site:
    """Three regions of real nodes, their files, and what each step showed."""

    root: Path
    nodes: dict[str, LocalNode]
    now: datetime
    ends: dict[str, datetime] = field(default_factory=dict)  # job → end
    source_bytes: dict[str, int] = field(default_factory=dict)  # NAME@N → bytes at origin
    out: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # step → result
    states: dict[str, dict[str, NodeState]] = field(default_factory=dict)  # step → node → state

    @property
    def config(self) -> list[str]:
        return ["--config", str(self.root / "edgecache.yaml")]

    @property
    def schedule(self) -> str:
        return str(self.root / "schedule.yaml")

    def run(self, step: str, *args: str) -> tuple[int, str, str]:
        self.out[step] = edgecache(*args, *self.config)
        return self.out[step]

    def json(self, step: str) -> Any:
        code, out, err = self.out[step]
        assert code == 0, (step, code, out, err)
        return json.loads(out)

    def read_nodes(self, step: str) -> None:
        self.states[step] = {name: read_node(node) for name, node in self.nodes.items()}


def read_node(node: LocalNode) -> NodeState:
    status = stub(node.address).Status(edge_pb2.StatusRequest())
    text = urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
    staged = {
        m["source"]: float(m["value"])
        for m in re.finditer(
            r'^edgecache_staged_bytes_total\{[^}]*source="(?P<source>\w+)"[^}]*\} (?P<value>\S+)$',
            text,
            re.M,
        )
    }
    fetches = re.search(r"^edgecache_origin_fetches_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return NodeState(status, staged, float(fetches.group(1)) if fetches else 0.0)


def build(root: Path) -> Site:
    """Publish, start the nodes, pre-stage old@1 in ap, write the topology and schedule."""
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin", 4, rows=200)
    site = Site(root, {}, datetime.now(UTC).replace(microsecond=0))
    for dataset in DATASETS:
        manifest = publish(registry, f"file://{root}/origin", dataset)
        site.source_bytes[f"{dataset}@1"] = sum(s.source_size for s in manifest.shards)
    metrics = ["--metrics-listen", "127.0.0.1:0"]
    try:
        for name, region in NODES.items():
            capacity = "80KiB" if region == "ap" else "4GiB"  # ap: room for one version
            site.nodes[name] = start_local_node(
                region, root / f"cache-{name}", registry, capacity=capacity, extra_args=metrics
            )
        last = list(
            stub(site.nodes["ap-1"].address).Stage(edge_pb2.StageRequest(dataset="old", version=1))
        )[-1]
        assert last.finished and last.shards_done == 4, last
    except BaseException:
        stop(site)
        raise
    address = {name: node.address for name, node in site.nodes.items()}
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n"
        f"  eu:\n    nodes: ['{address['eu-1']}', '{address['eu-2']}']\n"
        "    origin_bandwidth: 1Gbit/s\n"
        f"  us:\n    nodes: ['{address['us-1']}']\n    origin_bandwidth: 1Mbit/s\n"
        "    peers: {eu: 1Gbit/s}\n"
        f"  ap:\n    nodes: ['{address['ap-1']}']\n    origin_bandwidth: 100Mbit/s\n"
    )
    lines = ["jobs:"]
    for job, region, start_h, hours, spec in JOBS:
        start = site.now + timedelta(hours=start_h)
        site.ends[job] = start + timedelta(hours=hours)
        lines += [
            f"  - name: {job}",
            f"    region: {region}",
            f"    start: '{start.isoformat()}'",
            f"    duration: {hours}h",
            f"    datasets: [{spec}]",
        ]
    (root / "schedule.yaml").write_text("\n".join(lines) + "\n")
    return site


def stop(site: Site) -> None:
    for node in site.nodes.values():
        node.stop()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """plan --json, warm --dry-run --json, warm --json, warm --json again; nodes read between."""
    site = build(tmp_path_factory.mktemp("warm-json"))
    try:
        site.read_nodes("before")
        site.run("plan", "plan", site.schedule, "--json")
        site.run("dry", "warm", site.schedule, "--dry-run", "--json")
        site.read_nodes("after dry run")
        site.run("warm", "warm", site.schedule, "--json")
        site.read_nodes("after warm")
        site.run("status", "status", "--json")
        site.run("again", "warm", site.schedule, "--json")
        site.read_nodes("after again")
        yield site
    finally:
        stop(site)


# ------------------------------------------------------------------------ helpers


def tasks(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's tasks, each with its region."""
    return [
        {**task, "region": region} for region, rp in plan["regions"].items() for task in rp["tasks"]
    ]


def planned_pins(plan: dict[str, Any]) -> dict[tuple[str, str], datetime]:
    return {
        (region, pin["version"]): datetime.fromisoformat(pin["until"])
        for region, rp in plan["regions"].items()
        for pin in rp["pins"]
    }


def nodes_of(region: str) -> list[str]:
    return [name for name, r in NODES.items() if r == region]


def shards_held(states: dict[str, NodeState], region: str, spec: str) -> int:
    return sum(
        v.shard_count for name in nodes_of(region) if (v := states[name].version(spec)) is not None
    )


# -------------------------------------------------------------------------- tests


def test_the_scenario_is_what_it_claims(ran: Site) -> None:
    """The premises the other tests rest on: a peer source, evictions, pins of different ends."""
    plan = ran.json("plan")
    by = {(t["region"], t["version"], tuple(t["jobs"])): t for t in tasks(plan)}
    assert by[("us", "a@1", ("us-train",))]["source"] == "eu"
    assert by[("us", "c@1", ("us-c",))]["source"] == "origin"
    assert by[("eu", "a@1", ("eu-train", "eu-eval"))]["source"] == "origin"
    evictions = [(e["version"], e["reason"]) for e in plan["regions"]["ap"]["evictions"]]
    assert evictions[0] == ("old@1", "not needed again"), evictions
    assert [v for v, _ in evictions] == ["old@1", "x@1", "y@1"], evictions
    pins = planned_pins(plan)
    assert pins[("eu", "a@1")] == ran.ends["eu-eval"] > ran.ends["eu-train"]
    # The first x@1 task's own jobs end well before the plan's pin: its Stage asks for less.
    first_x = by[("ap", "x@1", ("ap-1st",))]
    assert ran.ends["ap-1st"] < pins[("ap", "x@1")] == ran.ends["ap-3rd"], first_x
    assert not plan["infeasible"], plan["infeasible"]


def test_every_task_is_staged_from_the_source_the_plan_named(ran: Site) -> None:
    plan, warmed = ran.json("plan"), ran.json("warm")
    now = datetime.fromisoformat(ran.json("plan")["regions"]["eu"]["tasks"][0]["start"])
    planned = tasks(plan)
    items = warmed["items"]
    assert [(i["region"], i["version"]) for i in items] == [
        (t["region"], t["version"]) for t in planned
    ], (items, planned)
    for task, item in zip(planned, items, strict=True):
        assert item["from"] == task["source"], (task, item)
        assert item["source"] == ("origin" if task["source"] == "origin" else "peer"), item
        assert item["planned_bytes"] == task["bytes"], (task, item)  # the plan's estimate
        starts_later = datetime.fromisoformat(task["start"]) - now > timedelta(minutes=1)
        # A task the plan starts hours from now needs room a job still reads: deferred.
        assert item["state"] == ("deferred" if starts_later else "done"), (task, item)
        assert item["done"] is (not starts_later) and not item["failures"], item
        assert not item["notes"], item  # no fallback from the plan's source


def test_a_peer_sourced_task_copied_from_the_peer_and_fetched_nothing_from_origin(
    ran: Site,
) -> None:
    before, after = ran.states["before"], ran.states["after warm"]
    us = after["us-1"]
    eu_stored = sum(v.stored_bytes for n in nodes_of("eu") if (v := after[n].version("a@1")))
    assert us.version("a@1").shard_count == 4  # type: ignore[union-attr]
    assert us.version("a@1").stored_bytes == eu_stored  # type: ignore[union-attr]
    # Peer bytes on the target are a@1's stored bytes; origin bytes are c@1's alone.
    assert us.status.staged_peer_bytes == eu_stored
    assert us.metrics["peer"] == eu_stored
    assert us.status.staged_origin_bytes == ran.source_bytes["c@1"]
    assert us.metrics["origin"] == ran.source_bytes["c@1"]
    assert us.origin_fetches == 4  # c@1's four shards, none of a@1's
    # eu fetched a@1 from origin, once, split over its replicas; nothing from a peer.
    eu_origin = sum(after[n].metrics["origin"] for n in nodes_of("eu"))
    assert eu_origin == ran.source_bytes["a@1"]
    assert all(after[n].metrics["peer"] == 0 for n in nodes_of("eu"))
    # ap staged x@1 from origin, nothing else (old@1 came before warm).
    ap_origin = after["ap-1"].metrics["origin"] - before["ap-1"].metrics["origin"]
    assert ap_origin == ran.source_bytes["x@1"]
    assert after["ap-1"].metrics["peer"] == 0


def test_every_pin_is_the_plans_end_on_every_node_of_its_region(ran: Site) -> None:
    """Exactly the plan's time: x@1's Stage for ap-1st asks for less and must not shorten it."""
    pins = planned_pins(ran.json("plan"))
    assert pins == planned_pins({"regions": _pins_by_region(ran.json("warm")["pins"])})
    for (region, spec), until in pins.items():
        for name in nodes_of(region):
            found = ran.states["after warm"][name].version(spec)
            assert found is not None and found.HasField("pinned_until"), (name, spec)
            assert found.pinned_until.ToDatetime(tzinfo=UTC) == until, (name, spec, until)
    status = {row["node"]: row for row in ran.json("status")}
    for name, node in ran.nodes.items():
        shown = {
            v["version"]: v["pinned_until"]
            for v in status[node.address]["versions"]
            if v["pinned_until"]
        }
        expected = {  # the plan's own text: every command writes a time one way
            spec: until.astimezone(UTC).isoformat()
            for (region, spec), until in pins.items()
            if region == NODES[name]
        }
        assert shown == expected, (name, shown, expected)
    assert ran.json("warm")["pin_failures"] == []


def _pins_by_region(rows: list[dict[str, str]]) -> dict[str, dict[str, list[dict[str, str]]]]:
    out: dict[str, dict[str, list[dict[str, str]]]] = {}
    for row in rows:
        out.setdefault(row["region"], {"pins": []})["pins"].append(row)
    return out


def test_every_eviction_warm_may_do_now_is_done_and_nothing_else_is_evicted(ran: Site) -> None:
    plan, warmed = ran.json("plan"), ran.json("warm")
    planned = plan["regions"]["ap"]["evictions"]
    done = [(e["region"], e["version"], e["bytes"]) for e in warmed["evicted"]]
    assert done == [("ap", "old@1", planned[0]["bytes"])], warmed["evicted"]
    # The later, Belady evictions would take what ap-1st and ap-2nd read: refused, deferred.
    deferred = [(d["region"], d["what"]) for d in warmed["deferred"]]
    assert deferred == [
        ("ap", "evict x@1"),
        ("ap", "stage y@1"),
        ("ap", "evict y@1"),
        ("ap", "stage x@1"),
    ], warmed["deferred"]
    after = ran.states["after warm"]
    assert after["ap-1"].version("old@1") is None
    # Nothing else went: every staged version whole, x@1 kept.
    assert shards_held(after, "ap", "x@1") == 4
    assert shards_held(after, "eu", "a@1") == 4
    assert shards_held(after, "us", "a@1") == 4 and shards_held(after, "us", "c@1") == 4
    assert shards_held(after, "ap", "y@1") == 0  # pinned ahead of its data, not staged


def test_a_dry_run_shows_what_warm_then_did(ran: Site) -> None:
    dry, warmed = ran.json("dry"), ran.json("warm")
    assert dry.pop("dry_run") is True
    states = {"would stage": "done", "deferred": "deferred"}

    def same(item: dict[str, Any]) -> dict[str, Any]:
        # A task the plan starts now starts at each run's own now; a later one is exact.
        # ``bytes`` is what the nodes moved: nothing in a rehearsal (``planned_bytes`` match).
        now = item["state"] != "deferred"
        state = states.get(item["state"], item["state"])
        return {**item, "state": state, "done": None, "bytes": None} | (
            {"start": None} if now else {}
        )

    assert [same(i) for i in dry["items"]] == [same(i) for i in warmed["items"]]
    for key in ("evicted", "deferred", "pins", "pin_failures", "infeasible", "unreachable"):
        assert dry[key] == warmed[key], key
    # And it touched nothing.
    before, rehearsed = ran.states["before"], ran.states["after dry run"]
    for name in ran.nodes:
        assert rehearsed[name].status.versions == before[name].status.versions, name
        assert rehearsed[name].metrics == before[name].metrics, name


def test_warm_again_fetches_nothing_and_keeps_the_same_pins(ran: Site) -> None:
    again = ran.json("again")
    first, second = ran.states["after warm"], ran.states["after again"]

    # The same pins; the first also kept eu's a@1 for us's copy from it, which the second
    # has no need of (us holds it now): said in lent_to, the pin the same (eu's own job).
    def kept(pins: list[dict]) -> list[dict]:
        return [{k: v for k, v in p.items() if k != "lent_to"} for p in pins]

    warmed = ran.json("warm")["pins"]
    assert again["evicted"] == [] and kept(again["pins"]) == kept(warmed)
    assert [p["lent_to"] for p in warmed if p["lent_to"]] == [["us"]], warmed
    assert not [p for p in again["pins"] if p["lent_to"]], again["pins"]
    assert [i["state"] for i in again["items"]] == ["deferred", "deferred"], again["items"]
    for name in ran.nodes:
        assert second[name].metrics == first[name].metrics, name
        assert second[name].origin_fetches == first[name].origin_fetches, name
        assert second[name].status.versions == first[name].status.versions, name


def test_warm_reports_its_rows_in_the_plans_order(ran: Site) -> None:
    """Regions run in parallel; the rows came in the order they finished, not the plan's."""
    planned = [(t["region"], t["version"]) for t in tasks(ran.json("plan"))]
    for step in ("dry", "warm"):
        items = ran.json(step)["items"]
        assert [(i["region"], i["version"]) for i in items] == planned, step


def test_a_deferred_task_names_its_planned_start_and_what_to_do(ran: Site) -> None:
    """warm acts now; a task the plan starts later, behind an eviction it may not do yet, waits."""
    plan, warmed = ran.json("plan"), ran.json("warm")
    rows = {(i["region"], i["version"], tuple(i["jobs"])): i for i in warmed["items"]}
    for task in tasks(plan):
        row = rows[(task["region"], task["version"], tuple(task["jobs"]))]
        if row["state"] != "deferred":
            continue
        start = datetime.fromisoformat(task["start"])
        assert row["start"] == task["start"], (row, task)  # tied to the job's start: exact
        (said,) = [
            d
            for d in warmed["deferred"]
            if (d["region"], d["what"]) == (task["region"], f"stage {task['version']}")
            and start.strftime("%Y-%m-%d %H:%M") in d["reason"]
        ]
        assert "UTC" in said["reason"] and "controller" in said["reason"], said


# ------------------------------------------------------------- as a person reads it


@pytest.fixture(scope="module")
def said(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The same scenario, driven as a person does: plan, warm --dry-run, warm, warm again."""
    site = build(tmp_path_factory.mktemp("warm-text"))
    try:
        site.run("plan", "plan", site.schedule)
        site.run("dry", "warm", site.schedule, "--dry-run")
        site.run("warm", "warm", site.schedule)
        site.run("again", "warm", site.schedule)
        yield site
    finally:
        stop(site)


PAST = {"would evict": "evicted", "would stage": "staged", "would pin": "pinned"}


def test_warm_says_what_it_staged_from_where_and_pinned_as_its_dry_run_said(said: Site) -> None:
    """The real run listed only evictions and a count: not the sources plan showed, nor pins."""
    code, dry, dry_err = said.out["dry"]
    assert code == 0, (dry, dry_err)
    code, out, err = said.out["warm"]
    assert code == 0, (out, err)

    # A stage's size is the plan's estimate in the dry run, what the nodes moved in the
    # real run (origin bytes are the source's): the lines match but for it.
    def sized(line: str) -> str:
        return re.sub(r"(staged \S+) \([^)]*\)", r"\1 (SIZE)", line)

    expected = [
        sized(re.sub("|".join(PAST), lambda m: PAST[m.group(0)], line))
        for line in dry.splitlines()
        if not line.startswith("warm --dry-run:")
    ]
    shown = [sized(line) for line in out.splitlines() if not line.startswith("warm:")]
    assert shown == expected, (shown, expected)
    assert "us: staged a@1 (52.7 KiB) from eu" in out, out  # the plan's peer source
    assert "warm: 4 of 6 item(s) staged" in out, out
    deferred = [line for line in err.splitlines() if line.startswith("deferred:")]
    assert deferred == [
        line.replace("would defer:", "deferred:")
        for line in dry_err.splitlines()
        if line.startswith("would defer:")
    ]
    assert len(deferred) == 4, err


def test_warm_again_stages_nothing_and_says_the_same_pins(said: Site) -> None:
    code, out, err = said.out["again"]
    assert code == 0, (out, err)
    assert "warm: 0 of 2 item(s) staged" in out and "staged " not in out.replace(
        "item(s) staged", ""
    ), out
    pins = [line for line in out.splitlines() if ": pinned " in line]
    first = [line for line in said.out["warm"][1].splitlines() if ": pinned " in line]
    # The first also kept one for us's copy from there (us holds it now): the same pin.
    assert [line for line in first if line.endswith(" (for us's copy)")], first
    assert pins == [line.removesuffix(" (for us's copy)") for line in first]
    assert len(pins) == 5, out


def test_warm_claims_every_pin_that_held_and_no_other(capsys) -> None:  # noqa: ANN001
    """Which pins failed is known as (region, version): told from the failure's text,
    a failed web@10 hid web@1's pin too, in every region."""
    from datetime import UTC, datetime

    from edgecache.cache.planner import Plan, RegionPlan
    from edgecache.clients.cli.staging import _print_plan_steps
    from edgecache.clients.executor import WarmOutcome

    until = datetime(2030, 1, 1, tzinfo=UTC)
    pins = {("web", 1): until, ("web", 10): until}
    plan = Plan({"eu": RegionPlan(pins=dict(pins)), "us": RegionPlan(pins=dict(pins))}, [], {}, {})
    outcome = WarmOutcome(
        pin_failures=["pinning web@10 on us-1: UNAVAILABLE: Connection refused"],
        pins_failed={("us", ("web", 10))},
    )
    _print_plan_steps(plan, outcome, [], dry_run=False)
    out = capsys.readouterr().out
    for line in ("eu: pinned web@1", "eu: pinned web@10", "us: pinned web@1 "):
        assert line in out, out
    assert "us: pinned web@10" not in out, out
