"""A new user's staging findings: pins of what will not fit, read-through past a full
cache, warm NAME@N with a node down, and ready --wait's last round."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import (
    edgecache,
    node_settings,
    pins_on,
    publish,
    read_shard_table,
    stub,
    write_parquet_shards,
)

from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2, edge_pb2_grpc


@pytest.fixture
def registry(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin" / "big", 3, rows=3000)
    publish(url, f"file://{tmp_path}/origin/big", "big")
    write_parquet_shards(tmp_path / "origin" / "tok", 1, rows=100)
    publish(url, f"file://{tmp_path}/origin/tok", "tok")
    return url


def _shard_bytes(tmp_path: Path, registry: str) -> int:
    """The stored size of big@1's largest shard, measured on a node of its own."""
    with running_node(node_settings(tmp_path / "measure", registry)) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="big", version=1)))
        assert node.node is not None
        return max(
            node.node.store.shard_info(node.node.shard_ref(m, i)).stored_bytes  # type: ignore[union-attr]
            for m in [node.node.versions._manifests[("big", 1)]]
            for i in range(3)
        )


# ------------------------------------------- 1b: a read the cache cannot take still reads


def test_a_read_through_past_its_own_pin_is_served_not_refused(
    tmp_path: Path, registry: str
) -> None:
    """big@1 pinned but not staged, on a node with room for about one of its shards:
    the first shard read was cached (and pinned), the next was refused RESOURCE_EXHAUSTED
    ("pinned: big@1") and a reader failed after its retries. It is served from origin
    now without being cached."""
    shard = _shard_bytes(tmp_path, registry)
    settings = node_settings(tmp_path, registry, capacity=str(shard * 3 // 2))
    with running_node(settings) as node:
        client = stub(node.address)
        until = datetime.now(UTC) + timedelta(hours=1)
        request = edge_pb2.PinRequest(dataset="big", version=1)
        request.until.FromDatetime(until.replace(tzinfo=None))
        client.Pin(request)
        for _ in range(2):  # the second pass is refused before fetching in the old code
            rows = [read_shard_table(client, "big", 1, i).num_rows for i in range(3)]
            assert rows == [3000, 3000, 3000]
        status = client.Status(edge_pb2.StatusRequest())
        held = {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions}
        assert held["big@1"] == 1  # the rest passed through, not cached
        assert node.node is not None
        assert node.node.metrics.value("edgecache_uncached_reads_total") == 4  # 2 reads x 2


def test_a_shard_larger_than_the_cache_is_read_through(tmp_path: Path, registry: str) -> None:
    """A shard larger than the node's whole capacity failed every read (ShardTooLarge →
    RESOURCE_EXHAUSTED); its rows are served, and a Stage still reports it cannot keep it."""
    shard = _shard_bytes(tmp_path, registry)
    with running_node(node_settings(tmp_path, registry, capacity=str(shard // 2))) as node:
        client = stub(node.address)
        table = read_shard_table(client, "big", 1, 2)
        assert table.num_rows == 3000
        assert table.column("label").to_pylist()[0] == 6000
        with pytest.raises(grpc.RpcError) as refused:
            list(client.Stage(edge_pb2.StageRequest(dataset="big", version=1, shards=[2])))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------ 1a: no pin for what the plan cannot fit


@pytest.fixture
def small(tmp_path: Path, registry: str) -> Iterator[tuple[Path, LocalNode]]:
    """Region small: one node with room for tok@1 but not big@1."""
    shard = _shard_bytes(tmp_path, registry)
    node = start_local_node("small", tmp_path / "cache-small", registry, capacity=str(shard * 2))
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  small:\n    nodes: ['{node.address}']\n"
    )
    try:
        yield tmp_path, node
    finally:
        node.stop()


def test_warm_does_not_pin_a_version_the_plan_says_will_not_fit(small) -> None:
    root, node = small
    start = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")
    schedule = root / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: j\n    region: small\n    start: '{start}'\n"
        "    datasets: [big@1, tok@1]\n"
    )
    config = ["--config", str(root / "edgecache.yaml")]
    code, out, err = edgecache("plan", str(schedule), *config)
    assert code == 3 and "big@1" in out, (out, err)
    code, out, err = edgecache("warm", str(schedule), *config)
    assert code == 3, (out, err)
    assert "pinned big@1" not in out + err, (out, err)
    pins = pins_on(node)
    assert "big@1" not in pins, pins
    assert "tok@1" in pins, pins  # what fits is still pinned and staged


# --------------------------------------------- 2: warm NAME@N with a node of R down fails


def test_warm_one_version_with_a_node_down_fails_as_the_schedule_form_does(
    tmp_path: Path, registry: str
) -> None:
    """A node of r1 down: the schedule form exits 1 ("r1 is degraded"); warm NAME@N
    --region r1 staged the silent node's share on the other and exited 0."""
    nodes = [start_local_node("r1", tmp_path / f"cache-{i}", registry) for i in (1, 2)]
    try:
        config = tmp_path / "edgecache.yaml"
        config.write_text(
            f"registry: {registry}\nregions:\n  r1:\n    nodes: "
            f"['{nodes[0].address}', '{nodes[1].address}']\n"
        )
        nodes[1].stop()
        for extra in (["--dry-run"], []):
            code, out, err = edgecache(
                "warm", "big@1", "--region", "r1", *extra, "--config", str(config)
            )
            assert code == 1, (extra, out, err)
            assert nodes[1].address in err and "r1" in err, (extra, err)
        assert "1 of 1 item(s) staged" in out, out  # staged on the node that answers
        # --json says which region was degraded too: its item reads "done" for the nodes
        # that answered, and the unreachable list was left out for a single version.
        for extra in (["--dry-run"], []):
            code, out, err = edgecache(
                "warm", "big@1", "--region", "r1", *extra, "--json", "--config", str(config)
            )
            assert code == 1, (extra, out, err)
            (down,) = json.loads(out)["unreachable"]
            assert down["region"] == "r1" and nodes[1].address in down["reason"], (extra, down)
    finally:
        for node in nodes:
            node.stop()


# ------------------------------- 3: ready --wait never blames a node for its own deadline


def test_ready_wait_does_not_call_a_healthy_node_unreachable(tmp_path: Path, registry: str) -> None:
    """The last round of a wait is asked with what is left of the timeout, split among
    its calls: a sliver (0.0096 s) in which a healthy node was "unreachable (not
    connected …)" or "(DEADLINE_EXCEEDED)" where the truth was "has 0/3 shards". Many
    short waits, each ending on such a round; none may blame the node."""
    from edgecache.cache.registry import Registry
    from edgecache.clients.ops import wait_ready
    from edgecache.clients.topology import load_topology

    node = start_local_node("eu", tmp_path / "cache-eu", registry)
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        topology = load_topology(tmp_path / "edgecache.yaml")
        manifest = Registry.run(registry, lambda reg: reg.manifest("big", 1))
        # Timeouts a little longer than a round, in small steps: those that end the first
        # round with a sliver left ask a last round with that sliver, whatever a round takes.
        said = [
            wait_ready(topology, manifest, "eu", timeout=0.002 * i, poll_seconds=0.01).message
            for i in range(1, 76)
        ]
    finally:
        node.stop()
    blamed = [m for m in said if "unreachable" in m]
    assert not blamed, blamed
    assert all("has 0/3 shards" in m and "timed out" in m for m in said), said


# ------------------------- 1b, review: a read joining a Stage's fetch; memory of passed reads


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_read_joining_a_stage_of_a_shard_the_cache_cannot_keep_is_served(
    tmp_path: Path, registry: str
) -> None:
    """A read of a shard larger than the cache, asked while a Stage of the same shard was
    fetching it, joined that fetch and failed RESOURCE_EXHAUSTED ("larger than the whole
    cache capacity"), where the same read alone is served. The read is served; the Stage
    still fails."""
    settings = node_settings(tmp_path, registry, capacity="1KiB", staging_rate="4KB/s")
    with running_node(settings) as node:
        assert node.node is not None
        edge = node.node
        client = stub(node.address)
        staged: list[object] = []
        stager = threading.Thread(
            target=lambda: staged.append(_stage_outcome(client, "tok")), daemon=True
        )
        stager.start()
        _wait_for(lambda: bool(edge._inflight), "the Stage's fetch to start")
        table = read_shard_table(client, "tok", 1, 0)  # joins the Stage's fetch
        assert table.num_rows == 100
        stager.join(timeout=60)
        assert staged == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert edge.fetch_memory.reserved == 0  # nothing kept once the read ended


def _stage_outcome(client: object, dataset: str) -> object:
    try:
        list(client.Stage(edge_pb2.StageRequest(dataset=dataset, version=1)))  # type: ignore[attr-defined]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_read_served_without_caching_keeps_its_frames_counted_until_it_ends(
    tmp_path: Path, registry: str
) -> None:
    """A shard passed through to its reader is held in memory for the whole stream, but its
    fetch-memory reservation ended with the fetch: readers missing many such shards at once
    grew the node past fetch_memory. Its bytes stay counted until the stream ends."""
    write_parquet_shards(tmp_path / "origin" / "wide", 1, rows=30000)
    publish(registry, f"file://{tmp_path}/origin/wide", "wide")
    with running_node(node_settings(tmp_path, registry, capacity="1KiB")) as node:
        assert node.node is not None
        memory = node.node.fetch_memory
        # No BDP probing: the stream's window stays small, so the node cannot send the
        # whole shard ahead of a reader that stopped reading (its stream stays open).
        channel = grpc.insecure_channel(node.address, options=[("grpc.http2.bdp_probe", 0)])
        stream = edge_pb2_grpc.EdgeCacheStub(channel).ReadShard(
            edge_pb2.ReadShardRequest(dataset="wide", version=1, shard=0)
        )
        first = next(stream)
        assert first.frame
        time.sleep(0.2)  # the fetch is over: its own reservation was released
        assert memory.reserved > 0  # the frames this open stream serves
        stream.cancel()
        _wait_for(lambda: memory.reserved == 0, "the stream's frames to be released")
        channel.close()
        assert node.node.metrics.value("edgecache_uncached_reads_total") == 1
