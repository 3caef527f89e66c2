"""NodePool against real edge nodes: closing it, and the errors its callers see."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, write_parquet_shards

from edgecache.cache.errors import AccessDenied, NodeUnavailable, VersionNotFound
from edgecache.clients.endpoints import parse_endpoint
from edgecache.clients.node_client import LocalNode, connect, start_local_node
from edgecache.clients.node_pool import NodePool
from edgecache.clients.read_target import ReadTarget
from edgecache.v1 import edge_pb2

TOKEN = "read-secret"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    write_parquet_shards(root / "origin", 2, rows=500)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    (root / "token").write_text(TOKEN)
    return root


@pytest.fixture(scope="module")
def node(registry: Path) -> Iterator[LocalNode]:
    node = start_local_node("eu", registry / "cache", f"file://{registry}/registry")
    yield node
    node.stop()


@pytest.fixture(scope="module")
def guarded(registry: Path) -> Iterator[LocalNode]:
    """A node that requires a read token."""
    node = start_local_node(
        "us",
        registry / "cache-guarded",
        f"file://{registry}/registry",
        extra_args=["--read-token-file", str(registry / "token")],
    )
    yield node
    node.stop()


def test_close_joins_background_threads_and_never_reopens_a_channel(node) -> None:
    endpoint = parse_endpoint(node.address)
    before = set(threading.enumerate())  # other tests' datasets may still hold pools
    for _ in range(5):
        # Probing without pause, so a probe is in flight whenever close() comes.
        pool = NodePool([endpoint], probe_interval=0.001)
        pool._last_read = float("inf")  # probing as a reading pool does (an idle one is quiet)
        time.sleep(0.05)
        pool.close()
        assert not [t.name for t in pool._threads if t.is_alive()]  # joined, not just told
        assert not pool._channels
        with pytest.raises(NodeUnavailable, match="closed"):
            pool.stub(endpoint)
        with pytest.raises(NodeUnavailable, match="closed"):
            pool.call("Status", edge_pb2.StatusRequest())
        time.sleep(0.05)
        assert not pool._channels  # nothing in flight reopened one after close
        pool.close()  # twice is fine
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("edgecache-")]


def test_node_errors_reach_callers_as_edgecache_errors(guarded) -> None:
    # Status codes become the EdgeCacheError tree at the client boundary, naming the
    # node, the version and what to do; no grpc.RpcError reaches EdgeDataset's user.
    from edgecache.clients import EdgeDataset

    address = guarded.address
    with pytest.raises(AccessDenied) as denied:
        EdgeDataset("tokens@1", endpoints=[address])
    assert not isinstance(denied.value, grpc.RpcError)
    assert denied.value.endpoint == address and denied.value.code == "UNAUTHENTICATED"
    assert address in str(denied.value) and "tokens@1" in str(denied.value)
    assert "token" in str(denied.value)  # what to do: pass the token
    with pytest.raises(VersionNotFound) as missing:
        EdgeDataset("tokens@9", endpoints=[address], token=TOKEN)
    assert address in str(missing.value) and "tokens@9" in str(missing.value)
    with pytest.raises(VersionNotFound, match=f"nothing@latest on {address}"):
        EdgeDataset("nothing", endpoints=[address], token=TOKEN)

    # The streaming path: a shard read without the token.
    ds = EdgeDataset("tokens@1", endpoints=[address], token=TOKEN)
    pool = NodePool([parse_endpoint(address)])
    try:
        target = ReadTarget("tokens", 1, ds.manifest.digest, ds.schema)
        with pytest.raises(AccessDenied) as denied:
            list(pool.read_rows(target.rows(0, 0, 100)))
        assert denied.value.endpoint == address and "tokens@1 shard 0" in str(denied.value)
        assert pool.failovers == 0  # refused credentials are not a node failure
    finally:
        pool.close()
        ds.close()


def test_errors_during_iteration_keep_their_class_and_attributes(guarded) -> None:
    # The dataset adds the version to an error as a note and re-raises the same
    # object: rebuilding it as type(exc)(message) dropped endpoint and code.
    from edgecache.clients import EdgeDataset

    ds = EdgeDataset("tokens@1", endpoints=[guarded.address], token=TOKEN, batch_size=50)
    ds.close()
    ds._pool_args["token"] = None  # reads from here on go without it, as after a rotation
    with pytest.raises(AccessDenied) as denied:
        list(ds)
    ds.close()
    error = denied.value
    assert error.endpoint == guarded.address and error.code == "UNAUTHENTICATED"
    assert any("tokens@1" in note for note in getattr(error, "__notes__", []))


def test_a_node_that_cannot_fetch_from_origin_hands_the_read_to_one_that_holds_it(
    tmp_path: Path,
) -> None:
    # The origin loses the objects after one region staged them: the cold node refuses
    # (FAILED_PRECONDITION, the node is fine), the warm one serves from its cache. A
    # reader with the cold node first still gets every row; with only the cold node it
    # gets the refusal at once, not at the retry deadline.
    import shutil

    from edgecache.cache.errors import EdgeCacheError
    from edgecache.clients import EdgeDataset

    write_parquet_shards(tmp_path / "origin", 2, rows=300)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    warm = start_local_node("warm", tmp_path / "cache-warm", registry)
    cold = start_local_node("cold", tmp_path / "cache-cold", registry)
    try:
        stage = edge_pb2.StageRequest(dataset="tokens", version=1)
        last = list(connect(warm.address).Stage(stage))[-1]
        assert last.finished and not last.failures
        shutil.rmtree(tmp_path / "origin")

        ds = EdgeDataset("tokens@1", endpoints=[cold.address, warm.address], batch_size=100)
        # Both on loopback: a tie in RTT, so the order given (cold first) is the order tried.
        labels = [int(x) for batch in ds for x in batch["label"]]
        ds.close()
        assert sorted(labels) == list(range(600))

        # The refusal is remembered per shard: the next read of it asks the warm node first.
        pool = NodePool([parse_endpoint(cold.address), parse_endpoint(warm.address)])
        try:
            # Loopback RTTs tie only on a quiet machine (a busy CI host measured the cold
            # node slower and asked the warm one first: no failover). Tie them here.
            for stats in pool.stats.values():
                stats.rtt_ms = 0.2
            target = ReadTarget("tokens", 1, ds.manifest.digest, ds.schema)
            for _ in range(3):
                assert sum(b.num_rows for _, b in pool.read_rows(target.rows(0, 0, 300))) == 300
            assert pool.failovers == 1  # the first read only
        finally:
            pool.close()

        alone = EdgeDataset("tokens@1", endpoints=[cold.address], batch_size=100)
        started = time.monotonic()
        with pytest.raises(EdgeCacheError) as refused:
            list(alone)
        alone.close()
        assert time.monotonic() - started < 10
        assert refused.value.code == "FAILED_PRECONDITION" and cold.address in str(refused.value)
    finally:
        warm.stop()
        cold.stop()


def test_an_idle_pool_does_not_probe_and_a_reading_one_does(node) -> None:
    """A DataLoader's parent holds a pool that fetched the manifest and reads nothing.

    Its probes (every probe_interval, for good) only put gRPC to work when workers
    may be forked; CI's leaked pools probed through 92 of the first 300 tests.
    """
    import threading

    from edgecache.clients import EdgeDataset

    class LateWakeups(threading.Event):
        """A loaded CI host: the prober wakes well after its interval (CI failed so)."""

        def wait(self, timeout: float | None = None) -> bool:
            return super().wait(None if timeout is None else timeout * 4)

    pool = NodePool([parse_endpoint(node.address)], probe_interval=0.05)
    pool._stop = LateWakeups()  # the prober's next look takes it
    probes: list[int] = []
    probe = pool.probe
    pool.probe = lambda pings=3: probes.append(pings) or probe(pings)  # type: ignore[method-assign]
    try:
        time.sleep(0.5)
        assert probes == []  # idle: several (late) wake-ups, no probe
        with EdgeDataset("tokens@1", endpoints=[node.address]) as ds:
            target = ReadTarget("tokens", 1, ds.manifest.digest, ds.schema)
        assert sum(b.num_rows for _, b in pool.read_rows(target.rows(0, 0, 10))) >= 10
        deadline = time.monotonic() + 10  # the prober's next wake-up; late on a busy host
        while not probes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probes  # a read started since the last look: the pool probes again
    finally:
        pool.close()


def test_a_fork_waits_for_the_pools_background_calls(node) -> None:
    """A DataLoader forks its workers while the training process's pool probes its nodes.

    Forked with a thread inside a gRPC call, gRPC skipped its fork handlers (half of
    200 forks against a busy probe) and a worker could crash in its own channel (a
    segfault in the chaos suite). The pool's calls now hold a lock fork waits for.
    """
    import os
    import subprocess
    import sys

    child = Path(__file__).with_name("fork_child.py")
    done = subprocess.run(
        [sys.executable, str(child), node.address, "60"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GRPC_VERBOSITY": "INFO"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed 0" in done.stdout, done.stdout
    assert "skipping fork() handlers" not in done.stderr, done.stderr[-2000:]


def test_a_noisy_probe_does_not_take_a_replica_out_of_its_shards(node) -> None:
    """Replicas of one region split shards by rendezvous hashing; a probe that measured
    one at 5.1 ms against 1.34 (a busy 2-core host) left it out of the group, so every
    shard went to the other replica, which read through from origin and cached them all."""
    from edgecache.clients.rendezvous import rank

    other = "127.0.0.1:1"  # nothing listens: only its ranking is looked at
    endpoints = [parse_endpoint(node.address), parse_endpoint(other)]
    pool = NodePool(endpoints, replicas=[node.address, other], probe_interval=3600)
    try:
        pool.probe()
        replicas = [node.address, other]
        # Shards are split by the id the node reports (the other one says none: its address).
        names = {node.address: connect(node.address).Status(edge_pb2.StatusRequest()).node_id}
        assert pool.stats[node.address].node_id == names[node.address] != node.address
        for noisy in (5.1, 1.34 + 9.9):
            pool.stats[node.address].rtt_ms, pool.stats[other].rtt_ms = 1.34, noisy
            for shard in range(8):
                key = ("tokens", 1, shard)
                owner = rank(replicas, *key, names=names)[0]
                assert pool.ranked(key)[0].text == owner, (noisy, shard)
        # Far slower than a replica of the same region can be: read from the near one.
        pool.stats[other].rtt_ms = 1.34 + 30
        assert all(pool.ranked(("tokens", 1, s))[0].text == node.address for s in range(8))
    finally:
        pool.close()


def test_a_replica_slow_for_one_probe_keeps_its_shards(node) -> None:
    """CI (a loaded 2-core host) measured one replica 12 ms over its sibling in one probe
    (the median of its three pings) and sent every shard to the sibling, which read them
    through from origin. A node's RTT is its fastest ping over its last probes: a slow
    probe after good ones changes nothing, a failed one ranks it last until it answers."""
    from edgecache.clients.node_pool import RTT_PROBES
    from edgecache.clients.rendezvous import rank

    other = "127.0.0.1:1"  # nothing listens: only its ranking is looked at
    pool = NodePool(
        [parse_endpoint(node.address), parse_endpoint(other)],
        replicas=[node.address, other],
        probe_interval=3600,
    )
    try:
        pool.probe()
        real = pool.stats[node.address].rtt_ms
        assert 0 < real < 1000, real
        names = {node.address: pool.stats[node.address].node_id}
        keys = [("tokens", 1, shard) for shard in range(16)]
        owners = [rank([node.address, other], *key, names=names)[0] for key in keys]
        assert set(owners) == {node.address, other}  # both own shards
        stats = pool.stats[other]
        for rtt in (1.2, 1.3):
            stats.measured(rtt)
        stats.measured(1.2 + 25)  # one loaded probe
        assert stats.rtt_ms == 1.2
        pool.stats[node.address].rtt_ms = 1.2
        assert [pool.ranked(key)[0].text for key in keys] == owners
        for _ in range(RTT_PROBES):  # slow probe after probe: it is slow now
            stats.measured(1.2 + 25)
        assert stats.rtt_ms == 1.2 + 25
        assert all(pool.ranked(key)[0].text == node.address for key in keys)
        stats.measured(1.1)
        stats.measured(math.inf)  # a failed probe or read: last, whatever it measured before
        assert stats.rtt_ms == math.inf and not stats.recent_rtts
        stats.measured(1.4)
        assert stats.rtt_ms == 1.4
    finally:
        pool.close()


def test_retries_with_every_node_down_are_not_failovers(node) -> None:
    """failovers counts reads that went on at another node; with both nodes dead it
    counted every retry (16 in an epoch that read nothing)."""
    from edgecache.cache.errors import AllNodesFailed

    dead = [parse_endpoint("127.0.0.1:1"), parse_endpoint("127.0.0.1:2")]
    pool = NodePool(dead, retry_timeout=1.5, probe_interval=3600)
    try:
        manifest = connect(node.address).GetManifest(
            edge_pb2.GetManifestRequest(dataset="tokens", version=1)
        )
        from edgecache.cache.manifest import manifest_schema

        target = ReadTarget("tokens", 1, manifest.digest, manifest_schema(manifest))
        with pytest.raises(AllNodesFailed):
            list(pool.read_rows(target.rows(0, 0, 100)))
        assert pool.failovers == 0
    finally:
        pool.close()


def test_a_regions_only_node_keeps_its_reads_against_a_noisy_probe(node) -> None:
    """With one node per region on a busy host, ``region=eu-west`` read from us-east 5 times
    in 12 runs: the 10 ms slack held only for regions of several replicas, so a probe of
    1.1 ms against 0.4 sent the reads (and the read-through from origin) to the other region."""
    other = "127.0.0.1:1"  # another region's node; nothing listens: only the ranking is looked at
    endpoints = [parse_endpoint(node.address), parse_endpoint(other)]
    pool = NodePool(endpoints, replicas=[node.address], probe_interval=3600)
    try:
        for noisy in (1.1, 0.4 + 9.9):
            pool.stats[node.address].rtt_ms, pool.stats[other].rtt_ms = noisy, 0.4
            assert all(pool.ranked(("tokens", 1, s))[0].text == node.address for s in range(4))
            assert pool.ranked()[0].text == node.address, noisy
        pool.stats[node.address].rtt_ms = 0.4 + 30  # far slower than jitter: the other is nearer
        assert pool.ranked(("tokens", 1, 0))[0].text == other
    finally:
        pool.close()


def test_a_local_cache_given_first_does_not_hide_the_nodes_replicas(node, registry) -> None:
    """``[lmdb://cache, node-a, node-b]`` (the docs' advice for a partial cache): the
    cache's 0 ms made "near" 0.5 ms, no node within it, so no replicas were learned and
    every shard went to the nearest node, which read the other's through from origin."""
    from edgecache.clients.rendezvous import rank

    other = "127.0.0.1:1"  # nothing listens: only its ranking is looked at
    local = f"lmdb://{registry / 'cache'}"
    endpoints = [parse_endpoint(local), parse_endpoint(node.address), parse_endpoint(other)]
    pool = NodePool(endpoints, probe_interval=3600)
    try:
        pool.probe()
        # Two nodes of one region a LAN apart (1 and 2 ms), as a probe finds them.
        pool.stats[other].region, pool.stats[other].node_id = "eu", "eu-other"
        pool.stats[other].identified = True
        pool.stats[node.address].rtt_ms, pool.stats[other].rtt_ms = 1.0, 2.0
        pool._learn_names()
        replicas = [node.address, other]
        names = {node.address: pool.stats[node.address].node_id, other: "eu-other"}
        owners = set()
        # 64 shards: with 8, both replicas owning some failed by chance in about 1 run of
        # 128 (the node's id, and so the hashing, differs from run to run).
        for shard in range(64):
            key = ("tokens", 1, shard)
            ranked = [e.text for e in pool.ranked(key)]
            assert ranked[0] == local  # the cache first: what it holds costs no call
            owners.add(ranked[1])
            assert ranked[1] == rank(replicas, *key, names=names)[0], shard
        assert owners == set(replicas)
    finally:
        pool.close()
