"""The controller's per-node series join the nodes' own: ``node`` is the node id, not the address.

A node's metrics (``edgecache_cache_*``, ``edgecache_read_*``) label it by the
node id it reports in its Status; the controller's ``edgecache_controller_node_up``
and ``edgecache_controller_node_rtt_seconds`` must say the same ``node``, with
the topology's address beside it, so the NodeDown alert and the "Nodes up"
panel line up with the node panels. Real nodes on loopback (``edgecache
serve`` subprocesses), a file:// registry, the controller in-process.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import pytest
from edgeutil import publish, write_parquet_shards
from prometheus_client.parser import text_string_to_metric_families
from test_controller import Clock, job, one_region

from edgecache.clients.controller import Controller
from edgecache.clients.node_client import LocalNode, start_local_node

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
UP = "edgecache_controller_node_up"
RTT = "edgecache_controller_node_rtt_seconds"


@pytest.fixture
def eu(tmp_path: Path) -> Iterator[tuple[Path, str, LocalNode]]:
    """Version b@1 published, and region eu of one node that serves its own metrics."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "b")
    node = start_local_node(
        "eu", tmp_path / "cache-eu", registry, extra_args=["--metrics-listen", "127.0.0.1:0"]
    )
    try:
        one_region(tmp_path, registry, node, job("j", "eu", T0 + timedelta(hours=10), 1, "b@1"))
        yield tmp_path, registry, node
    finally:
        node.stop()


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples in a /metrics page: sorted label pairs → value."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def controller_page(controller: Controller) -> str:
    from prometheus_client import generate_latest

    return generate_latest(controller.metrics.registry).decode()


def labels(region: str, node: str, address: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"region": region, "node": node, "address": address}.items()))


def test_node_is_the_node_id_of_the_nodes_own_metrics_and_address_stays_beside_it(eu) -> None:
    root, _, node = eu
    own = urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
    (node_id,) = {dict(k)["node"] for k in series(own, "edgecache_cache_capacity_bytes")}
    assert node_id != node.address  # hostname:<cache dir>, not where the controller calls it
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        controller.tick()
        page = controller_page(controller)
        assert series(page, UP) == {labels("eu", node_id, node.address): 1.0}
        (rtt,) = series(page, RTT).items()
        assert rtt[0] == labels("eu", node_id, node.address) and rtt[1] > 0
        node.stop()  # down: still named by the id it reported, so the alert names it
        controller.tick()
        assert series(controller_page(controller), UP) == {labels("eu", node_id, node.address): 0.0}
    finally:
        controller.close()
    # A controller started while the node is down names it as the last one did.
    restarted = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        restarted.tick()
        assert series(controller_page(restarted), UP) == {labels("eu", node_id, node.address): 0.0}
    finally:
        restarted.close()


def test_a_node_never_heard_from_is_named_by_its_address(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"  # nothing listens once closed
    registry = f"file://{tmp_path}/registry"
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{address}']\n"
    )
    (tmp_path / "schedule.yaml").write_text("jobs: []\n")
    (tmp_path / "registry").mkdir()  # a controller refuses a local registry that is not there
    controller = Controller(tmp_path / "edgecache.yaml", tmp_path / "schedule.yaml")
    try:
        controller.tick()
        page = controller_page(controller)
        assert series(page, UP) == {labels("eu", address, address): 0.0}
        assert series(page, RTT) == {}
    finally:
        controller.close()


def test_a_down_nodes_rtt_series_goes_instead_of_holding_its_last_value(eu) -> None:
    root, _, node = eu
    controller = Controller(root / "edgecache.yaml", root / "schedule.yaml", clock=Clock(T0))
    try:
        controller.tick()
        rtts = series(controller_page(controller), RTT)
        assert len(rtts) == 1 and next(iter(rtts.values())) > 0
        node.stop()
        for _ in range(2):  # and it does not come back while the node stays down
            controller.tick()
            page = controller_page(controller)
            assert series(page, RTT) == {}, "a dead node's RTT is drawn as a flat line"
            assert list(series(page, UP).values()) == [0.0]
    finally:
        controller.close()
