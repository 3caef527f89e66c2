"""A pin is shortened or released, and a version evicted, only if no one pinned it since.

warm and the controller read the nodes' pins, decide that a pin they placed
is theirs to shorten or remove, and then call Pin. Someone who lengthened the
pin in between (another schedule's warm, an operator) lost it: Pin set the
time as given. Pin's ``if_until`` makes the check and the change one LMDB
transaction on the node; a pin held until another time answers ABORTED and
stays as it is. An eviction the plan's guard allowed on the round's status
read (no one else's pin) wiped a pin placed after that read, and the data of
the job it was placed for: Evict's ``unless_pinned_after`` checks again in
the eviction's transaction. Real nodes on loopback, a real LMDB store.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import pins_on, publish, stub, write_parquet_shards

from edgecache.cache.errors import PinChanged
from edgecache.cache.planner import Eviction, Plan, RegionPlan
from edgecache.cache.store import CacheStore
from edgecache.clients import ops
from edgecache.clients.controller import Controller
from edgecache.clients.executor import PlanExecutor
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.ops import WarmPin
from edgecache.clients.topology import Schedule, load_topology
from edgecache.v1 import edge_pb2

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)


def _pin_request(until: datetime | None, if_until: datetime | None) -> edge_pb2.PinRequest:
    request = edge_pb2.PinRequest(dataset="a", version=1)
    if until is not None:
        request.until.FromDatetime(until.astimezone(UTC).replace(tzinfo=None))
    if if_until is not None:
        request.if_until.FromDatetime(if_until.astimezone(UTC).replace(tzinfo=None))
    return request


@pytest.fixture
def eu(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """Version a@1 in a file:// registry; one node in region eu, with a topology file."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "a", 2, rows=200)
    publish(registry, f"file://{tmp_path}/origin/a", "a")
    node = start_local_node("eu", tmp_path / "cache-eu", registry)
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
    )
    try:
        yield tmp_path, node
    finally:
        node.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CacheStore]:
    """A real LMDB store of its own (no node)."""
    opened = CacheStore(tmp_path / "cache", capacity_bytes=1 << 30)
    try:
        yield opened
    finally:
        opened.close()


def test_the_store_changes_a_pin_only_while_it_holds_the_expected_time(store: CacheStore) -> None:
    store.pin_version("a", 1, T0 + 2 * HOUR)
    with pytest.raises(PinChanged, match=r"is until 2026-12-01T10:00:00\+00:00") as caught:
        store.pin_version("a", 1, T0 + HOUR, if_until=T0 + 5 * HOUR)
    assert caught.value.held == T0 + 2 * HOUR
    assert [v.pinned_until for v in store.versions()] == [T0 + 2 * HOUR]  # unchanged
    # Within a second of the time held: the caller's record of it (ISO text) matches.
    store.pin_version("a", 1, T0 + HOUR, if_until=T0 + 2 * HOUR + timedelta(seconds=0.4))
    assert [v.pinned_until for v in store.versions()] == [T0 + HOUR]
    store.pin_version("a", 1, None, if_until=T0 + HOUR)
    assert store.versions() == []
    with pytest.raises(PinChanged, match="is gone") as caught:  # nothing to release
        store.pin_version("a", 1, None, if_until=T0 + HOUR)
    assert caught.value.held is None


def test_a_conditional_pin_of_another_time_is_aborted_and_says_the_time_held(eu) -> None:
    _, node = eu
    client = stub(node.address)
    client.Pin(_pin_request(T0 + 9 * HOUR, None))  # someone lengthened it to +9 h
    with pytest.raises(grpc.RpcError) as caught:
        client.Pin(_pin_request(None, T0 + 3 * HOUR))  # a tool that placed +3 h unpins
    assert caught.value.code() == grpc.StatusCode.ABORTED
    assert "until 2026-12-01T17:00:00+00:00, not until 2026-12-01T11:00:00+00:00" in str(
        caught.value.details()
    )
    assert pins_on(node) == {"a@1": T0 + 9 * HOUR}
    client.Pin(_pin_request(T0 + 4 * HOUR, T0 + 9 * HOUR))  # the time held: changed
    assert pins_on(node) == {"a@1": T0 + 4 * HOUR}


def test_warms_release_leaves_a_pin_lengthened_after_its_status_read(eu) -> None:
    """The status warm releases by says its pin is as placed; the pin is lengthened before the
    release's call. Before ``if_until`` the release cut the new pin (unpin, or shorten)."""
    root, node = eu
    executor = PlanExecutor(load_topology(root / "edgecache.yaml"))
    mine = WarmPin(str(root / "schedule.yaml"), node.address, "eu", "a@1", T0 + 3 * HOUR)
    for shorten_to in (None, T0 + 2 * HOUR):
        stub(node.address).Pin(_pin_request(T0 + 3 * HOUR, None))  # as warm placed it
        reports = ops.gather_status(executor.topology)  # warm reads: its pin, as placed
        stub(node.address).Pin(_pin_request(T0 + 9 * HOUR, None))  # another tool, meanwhile
        pin = WarmPin(mine.schedule, mine.node, mine.region, mine.version, mine.until, shorten_to)
        released = executor.release([pin], reports)
        assert pins_on(node) == {"a@1": T0 + 9 * HOUR}
        # Not warm's any more: neither released nor kept to try again; no failure either.
        assert (released.released, released.kept, released.problems) == ([], [], [])
    # Unchanged since its status read, the release goes through (the condition holds).
    stub(node.address).Pin(_pin_request(T0 + 3 * HOUR, None))
    released = executor.release([mine], ops.gather_status(executor.topology))
    assert released.released == [mine] and pins_on(node) == {}


def test_the_controller_leaves_a_pin_lengthened_during_its_round(eu, monkeypatch) -> None:
    """A job is cancelled; between the round's status read and the controller's unpin, another
    tool lengthens the pin. The pin stays, and the controller's record lets it go (it is
    someone else's now), so the next round does not try again."""
    root, node = eu
    (root / "schedule.yaml").write_text(
        "jobs:\n  - name: j\n    region: eu\n"
        f"    start: '{(T0 + HOUR).isoformat()}'\n    duration: 2h\n    datasets: [a@1]\n"
    )
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=lambda: T0)
    try:
        controller.tick()
        controller.wait_idle()
        assert pins_on(node) == {"a@1": T0 + 3 * HOUR}
        monkeypatch.setattr(controller, "_warm_reads", dict)  # no warm record here
        real_unpin = controller.executor.unpin

        def lengthened_first(node_address: str, version, *, placed: datetime):  # type: ignore[no-untyped-def]
            stub(node_address).Pin(_pin_request(T0 + 9 * HOUR, None))
            return real_unpin(node_address, version, placed=placed)

        monkeypatch.setattr(controller.executor, "unpin", lengthened_first)
        (root / "schedule.yaml").write_text("jobs: []\n")
        controller.tick()
        assert pins_on(node) == {"a@1": T0 + 9 * HOUR}
        assert controller.state.pins == {}
    finally:
        controller.close()


def test_the_store_evicts_only_a_version_not_pinned_past_the_time_given(store: CacheStore) -> None:
    store.pin_version("a", 1, T0 + 5 * HOUR)
    with pytest.raises(PinChanged, match=r"pinned until 2026-12-01T13:00:00\+00:00, past"):
        store.evict_version("a", 1, unless_pinned_after=T0 + 2 * HOUR)
    assert [v.pinned_until for v in store.versions()] == [T0 + 5 * HOUR]
    store.evict_version("a", 1, unless_pinned_after=T0 + 5 * HOUR)  # its own pin: evicted
    assert store.versions() == []


def test_a_planned_eviction_leaves_a_version_pinned_after_the_rounds_status_read(eu) -> None:
    root, node = eu
    client = stub(node.address)
    list(client.Stage(edge_pb2.StageRequest(dataset="a", version=1)))
    executor = PlanExecutor(load_topology(root / "edgecache.yaml"))
    now = executor.clock()
    eviction = Eviction("eu", ("a", 1), 1, now, None, "needed furthest ahead")
    executor._see(ops.gather_status(executor.topology))  # the round's read: a@1 unpinned
    client.Pin(_pin_request(now + 9 * HOUR, None))  # another schedule's warm, meanwhile
    evicted = executor.evict(eviction, Schedule(jobs=[]), {})
    # The guard's refusal, made by the node: not a node failure (warm defers, the
    # controller counts it refused, and the next plan sees the pin).
    assert evicted.freed == 0 and evicted.errors == (), evicted
    refused = evicted.refused or ""
    assert refused.startswith(f"not evicting a@1: evicting a@1 on {node.address}: ABORTED"), refused
    assert "someone pinned it since; not evicted" in refused, refused
    assert [v.shard_count for v in client.Status(edge_pb2.StatusRequest()).versions] == [2]
    client.Pin(_pin_request(None, None))  # unpinned: the same eviction goes through
    executor._see(ops.gather_status(executor.topology))
    assert executor.evict(eviction, Schedule(jobs=[]), {}).freed > 0
    assert list(client.Status(edge_pb2.StatusRequest()).versions) == []


def test_a_pin_placed_after_the_status_read_is_not_cut_back_by_the_plans_pin(eu) -> None:
    """warm and the controller pin what their plan keeps, after reading the nodes' status;
    Pin set the time as given, so a longer pin placed in between was cut to the plan's."""
    root, node = eu
    executor = PlanExecutor(load_topology(root / "edgecache.yaml"))
    seen = executor._see(ops.gather_status(executor.topology))  # a@1 unpinned
    stub(node.address).Pin(_pin_request(T0 + 9 * HOUR, None))  # another tool, meanwhile
    plan = Plan(
        regions={"eu": RegionPlan(pins={("a", 1): T0 + 3 * HOUR})},
        infeasible=[],
        transfers={},
        cost={},
    )
    assert executor.pin(plan, seen) == []
    assert pins_on(node) == {"a@1": T0 + 9 * HOUR}
    assert executor._pin_region("eu", ("a", 1), T0 + 2 * HOUR) is None  # re-pin after evicting
    assert pins_on(node) == {"a@1": T0 + 9 * HOUR}
    executor.pin(replace_pins(plan, T0 + 12 * HOUR), seen)  # longer: lengthened
    assert pins_on(node) == {"a@1": T0 + 12 * HOUR}


def replace_pins(plan: Plan, until: datetime) -> Plan:
    return Plan(
        regions={"eu": RegionPlan(pins={("a", 1): until})}, infeasible=[], transfers={}, cost={}
    )


def test_edgecache_evict_of_a_version_pinned_after_its_status_read_exits_2(eu, monkeypatch) -> None:
    """The node refuses (ABORTED) and the CLI said "a node failed" (exit 1): it is a pinned
    version, found by the node instead of by evict's own check, and retrying will not help."""
    root, node = eu
    topology = load_topology(root / "edgecache.yaml")
    list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="a", version=1)))
    stale = ops.gather_status(topology)  # what evict reads: a@1 unpinned
    stub(node.address).Pin(_pin_request(datetime.now(UTC) + 9 * HOUR, None))
    monkeypatch.setattr(ops.eviction, "gather_status", lambda *args, **kwargs: stale)  # evict's
    (result,) = ops.evict(topology, "a@1")
    assert result.pinned and not result.refused and result.bytes_freed == 0, result
    assert "ABORTED" in result.error and "run the command again" in result.error, result.error
    assert [v.shard_count for v in stub(node.address).Status(edge_pb2.StatusRequest()).versions]
