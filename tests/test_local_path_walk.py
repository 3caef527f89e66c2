"""The local fast path (``lmdb://``) walked as a training host uses it, while its node acts.

A real ``edgecache serve`` subprocess on loopback stages versions from a
``file://`` origin; EdgeDataset reads its cache directory straight from LMDB
through a real ``torch.utils.data.DataLoader`` (0 and 2 workers) while the
node evicts, re-stages, is killed and restarted, or grows its cache. The
reads that could crash the process run in a child process (this file, run as
a script), so a crash fails one test instead of ending the run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import AllNodesFailed, CacheDirError, ShardNotCached
from edgecache.cache.store import CacheStore
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2
from edgecache.v1 import manifest_pb2 as pb

SHARDS, ROWS = 4, 1500
TOTAL = SHARDS * ROWS
# Small windows read one at a time, so the node acts while most of the epoch is unread.
SMALL = {
    "window_bytes": 16 << 10,
    "batch_size": 50,
    "threads": 2,
    "prefetch_bytes": 1,
    "lanes": 2,
    "shuffle_windows": 1,
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("local-path")
    write_parquet_shards(root / "origin", SHARDS, rows=ROWS)
    write_parquet_shards(root / "origin-big", 6, rows=3000)
    url = f"file://{root}/registry"
    # Uncompressed: windows decode zero-copy, as views into the reader's LMDB map.
    publish(url, f"file://{root}/origin", "tokens", compression=pb.COMPRESSION_NONE)
    publish(url, f"file://{root}/origin-big", "big")  # what grows the cache
    return url


def stage(node: LocalNode, dataset: str) -> None:
    for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset=dataset, version=1)):
        pass


def evict(node: LocalNode, dataset: str) -> None:
    stub(node.address).Evict(edge_pb2.EvictRequest(dataset=dataset, version=1), timeout=30)


class Node:
    """One node on ``cache``, restartable; stopped by the fixture whatever a test did."""

    def __init__(self, cache: Path, registry: str) -> None:
        self.cache, self.registry = cache, registry
        self.node = start_local_node("eu", cache, registry, capacity="256MiB")

    def restart(self, *, kill: bool, capacity: str = "256MiB") -> None:
        if kill:
            self.node.process.send_signal(signal.SIGKILL)
            self.node.process.wait()
        else:
            self.node.stop()
        self.node = start_local_node("eu", self.cache, self.registry, capacity=capacity)


@pytest.fixture
def node(tmp_path: Path, registry: str) -> Iterator[Node]:
    started = Node(tmp_path / "cache", registry)
    stage(started.node, "tokens")
    yield started
    started.node.stop()


def labels(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(x) for x in batch["label"]]


def clean_batches(address: str) -> list[list[int]]:
    """Epoch 0 read over gRPC with no fault and no workers: what every read must equal."""
    ds = EdgeDataset("tokens@1", endpoints=[address], **SMALL)  # type: ignore[arg-type]
    try:
        return [labels(b) for b in torch.utils.data.DataLoader(ds, batch_size=None)]
    finally:
        ds.close()


# ------------------------------------------------------------- the child's side


def child_epoch(endpoints: list[str], workers: int, pause_at: int) -> None:
    """Read epoch 0, pausing at batch ``pause_at`` for the parent; print the batches."""
    ds = EdgeDataset("tokens@1", endpoints=endpoints, retry_timeout=20, **SMALL)  # type: ignore[arg-type]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    got = []
    for i, batch in enumerate(loader):
        got.append(labels(batch))
        if i == pause_at:
            print("pause", flush=True)
            sys.stdin.readline()
    ds.close()
    print(json.dumps(got), flush=True)


def child_map_growth(cache: str) -> None:
    """A reader whose map is smaller than the cache grows: remapping must wait for its views."""
    from edgecache.cache import store_files
    from edgecache.cache.keys import ShardKey

    store_files.reader_map_size = lambda path: 1 << 20  # type: ignore[assignment]  # as if the volume grew
    store = CacheStore(cache, readonly=True)
    first = ShardKey("tokens", 1, 0)
    reader = store.read_shard(first)
    view = reader.chunk(0)
    before = bytes(view)
    print("pause", flush=True)
    sys.stdin.readline()  # the parent's node staged more: the data outgrew our map
    try:
        store.read_shard(ShardKey("big", 1, 5)).close()
        refused = ""
    except CacheDirError as exc:
        refused = str(exc)
    still = bytes(view) == before  # a remap under the view would crash or read garbage here
    reader.close()
    with store.read_shard(ShardKey("big", 1, 5)) as later:  # no view open: remapped now
        read_later = len(bytes(later.chunk(0))) > 0
    store.close()
    print(json.dumps({"refused": refused, "still": still, "read_later": read_later}), flush=True)


def run_child(args: list[str], at_pause: object) -> tuple[int, str, str]:
    """Run this file as a child, calling ``at_pause()`` when it pauses.

    Returns its exit code, its last line of output and its stderr.
    """
    child = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        line = child.stdout.readline()
        if line.strip() == "pause":
            at_pause()  # type: ignore[operator]
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, line, err


# ------------------------------------------------------------------- the tests


@pytest.mark.parametrize("workers", [0, 2])
def test_node_killed_restarted_bigger_and_staging_while_lmdb_epoch_reads(
    node: Node, workers: int
) -> None:
    """SIGKILL the node mid-epoch, restart it with a larger map, stage another version.

    The cache grows past what the reader had mapped when it opened it, while
    its windows are views into that map: the reader adopted the new size by
    remapping under them, which crashed the training process (or the worker).
    The epoch must go on, batch for batch as a clean read.
    """
    expected = clean_batches(node.node.address)

    def act() -> None:
        node.restart(kill=True, capacity="1GiB")
        stage(node.node, "big")

    code, last, err = run_child(["epoch", f"lmdb://{node.cache}", str(workers), "5"], act)
    assert code == 0, f"the reading process died ({code}):\n{err[-3000:]}"
    assert json.loads(last) == expected


def test_reader_never_remaps_under_its_views(node: Node) -> None:
    """When the cache outgrows a reader's map, views it handed out stay valid.

    The remap waits until no read of the process is open; the read asking
    for it meanwhile is refused (the pool reads elsewhere or retries) with
    a message naming the cache.
    """
    code, last, err = run_child(["map", str(node.cache)], lambda: stage(node.node, "big"))
    assert code == 0, f"the reading process died ({code}):\n{err[-3000:]}"
    result = json.loads(last)
    assert result["still"] and result["read_later"]
    assert (
        str(node.cache) in result["refused"] and "reads of it are still open" in result["refused"]
    )


def test_zero_copy_batch_outlives_its_reader_and_the_eviction(node: Node) -> None:
    """An uncompressed chunk decoded from the map keeps its snapshot while the batch lives.

    The reader closed its ShardReader with the batch still in use (as the
    read-ahead does: windows outlive the read that decoded them); the node
    then evicted the version and wrote another into the freed pages. The
    batch must still hold its own rows, never the pages' new bytes.
    """
    from edgecache.cache.codec import decode_chunk
    from edgecache.cache.keys import ShardKey

    store = CacheStore(node.cache, readonly=True)
    try:
        with store.read_shard(ShardKey("tokens", 1, 1)) as reader:
            batch = decode_chunk(reader.chunk(0), verify=False)  # zero-copy: no compression
        before = batch.column("label").to_pylist()
        assert before[0] == ROWS  # shard 1's first row
        evict(node.node, "tokens")
        stage(node.node, "big")
        assert batch.column("label").to_pylist() == before
        del batch
    finally:
        store.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_evicted_mid_epoch_lmdb_only_says_so_and_reads_clean_once_restaged(
    node: Node, workers: int
) -> None:
    """Evicted mid-epoch, the lmdb:// reader stops with what happened and what to do.

    It stops at once (a cache read directly gets nothing back by waiting), after
    exactly the clean read's batches; once the node stages the version again, a
    new pass reads the clean epoch exactly. Read-ahead is one window of many, so
    a read always comes after the eviction: one outcome, not a race of two.
    """
    expected = clean_batches(node.node.address)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[f"lmdb://{node.cache}"],
        retry_timeout=20,
        **SMALL,  # type: ignore[arg-type]
    )
    got: list[list[int]] = []
    evicted = 0.0
    try:
        with pytest.raises(AllNodesFailed) as raised:
            for i, batch in enumerate(
                torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
            ):
                got.append(labels(batch))
                if i == 3:
                    evict(node.node, "tokens")
                    evicted = time.monotonic()
        message = str(raised.value)
        assert "holds no shard of tokens@1" in message and str(node.cache) in message
        assert "edgecache warm tokens@1" in message and "gRPC endpoint" in message
        assert time.monotonic() - evicted < 10  # not retry_timeout
        assert 4 <= len(got) < len(expected) and got == expected[: len(got)]
        stage(node.node, "tokens")
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        assert [labels(b) for b in loader] == expected
    finally:
        ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_evicted_mid_epoch_fails_over_to_grpc_exactly(node: Node, workers: int) -> None:
    """With the node's gRPC endpoint listed after lmdb://, the epoch goes on there, exact."""
    expected = clean_batches(node.node.address)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[f"lmdb://{node.cache}", node.node.address],
        **SMALL,  # type: ignore[arg-type]
    )
    got = []
    for i, batch in enumerate(
        torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    ):
        got.append(labels(batch))
        if i == 3:
            evict(node.node, "tokens")
    ds.close()
    assert got == expected


def test_a_local_caches_windows_are_read_by_the_thread_that_builds_batches(node: Node) -> None:
    """lmdb:// windows are read on the assembling thread when a batch needs them (nothing
    to wait for there; Pipeline._submit says why); shards the cache does not hold go to
    the node listed after it, read ahead on fetch threads, and the epoch is the same."""
    expected = clean_batches(node.node.address)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[f"lmdb://{node.cache}", node.node.address],
        **SMALL,  # type: ignore[arg-type]
    )
    try:
        assert [labels(b) for b in torch.utils.data.DataLoader(ds, batch_size=None)] == expected
        pipeline = ds.stats()["last_pipeline"]
        assert pipeline["windows_inline"] == pipeline["windows_read"] > SHARDS
        evict(node.node, "tokens")
        ds.set_epoch(0)
        assert [labels(b) for b in torch.utils.data.DataLoader(ds, batch_size=None)] == expected
        pipeline = ds.stats()["last_pipeline"]
        # The first windows went to the node, which fetched their shards into the cache on
        # the miss: windows after that one may find their shard local again.
        assert pipeline["windows_inline"] < pipeline["windows_read"]
    finally:
        ds.close()


def make_store_of_format(path: Path, found: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", found, db=meta)
    env.close()


def test_lmdb_paths_that_are_not_a_readable_cache(tmp_path: Path) -> None:
    """A missing path, a file that is not LMDB, another LMDB, a newer store: each said plainly."""
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"x" * 8192)
    make_store_of_format(tmp_path / "newer", b"edgecache-store/2")
    env = lmdb.open(str(tmp_path / "plain"))
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    cases = {
        "missing": "no edgecache store at",
        "junk": "is not an edgecache store",
        "plain": "is not an edgecache store",
        "newer": "written by a newer edgecache",
    }
    for name, says in cases.items():
        path = tmp_path / name
        with pytest.raises(CacheDirError) as raised:
            EdgeDataset("tokens@1", endpoints=[f"lmdb://{path}"])
        assert says in str(raised.value) and str(path) in str(raised.value), name
    newer = str(raised.value)
    assert "store format 2" in newer and "reads format 1" in newer
    assert "Upgrade edgecache" in newer and "gRPC endpoint" in newer
    with pytest.raises(CacheDirError) as raised:
        CacheStore(tmp_path / "newer")  # an older node started on a newer node's cache
    assert "written by a newer edgecache" in str(raised.value)
    assert "Run the edgecache that wrote it" in str(raised.value)


# ------------------------------------------------ the walk's findings, checked


def test_evicted_mid_epoch_lmdb_only_ends_at_once(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """At the default retry_timeout, an lmdb://-only read of an evicted version ends at once.

    Nothing fetches into a cache read directly: the read used to retry for
    retry_timeout (30 s), then blame unreachable nodes, after warning that it
    went on "on the next node" when there was none.
    """
    ds = EdgeDataset("tokens@1", endpoints=[f"lmdb://{node.cache}"], **SMALL)  # type: ignore[arg-type]
    seen: list[int] = []
    evicted = 0.0
    with pytest.raises(AllNodesFailed) as raised:
        for i, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
            seen += labels(batch)
            if i == 3:
                evict(node.node, "tokens")
                evicted = time.monotonic()
    took = time.monotonic() - evicted
    ds.close()
    message = str(raised.value)
    assert took < 10, f"the read went on for {took:.1f} s after the eviction"
    assert "holds no shard of tokens@1" in message and "edgecache warm tokens@1" in message
    assert "Check that the nodes run" not in message
    assert len(seen) == len(set(seen)) < TOTAL
    assert "on the next node" not in caplog.text


def test_single_grpc_endpoint_down_warns_it_retries_that_one(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """With one endpoint, the warning says the read retries it, not that it goes elsewhere."""
    ds = EdgeDataset("tokens@1", endpoints=[node.node.address], retry_timeout=2, **SMALL)  # type: ignore[arg-type]
    with pytest.raises(AllNodesFailed) as raised:
        for i, _ in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
            if i == 3:
                node.node.stop()
    ds.close()
    assert node.node.address in str(raised.value)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("no other endpoint: retrying it from row" in w for w in warned), warned
    assert not any("on the next node" in w for w in warned), warned


def test_bad_lmdb_path_beside_grpc_fails_the_constructor(node: Node, tmp_path: Path) -> None:
    """A typo in an lmdb:// path next to a gRPC endpoint is said once, when the dataset is built.

    It used to be tried by every window read: a warning and a failover each
    (33 in this epoch), the epoch served by gRPC all the same.
    """
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"x" * 8192)
    cases = {"missing": "no edgecache store at", "junk": "is not an edgecache store"}
    for bad, says in cases.items():
        path = tmp_path / bad
        with pytest.raises(CacheDirError) as raised:
            EdgeDataset("tokens@1", endpoints=[f"lmdb://{path}", node.node.address], **SMALL)  # type: ignore[arg-type]
        message = str(raised.value)
        assert says in message and f"lmdb://{path}" in message, message
        assert "leave the lmdb:// endpoint out" in message


def test_cache_without_the_version_beside_grpc_reads_through_grpc(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache without the version is no error beside gRPC (its node may stage it): a warning.

    Each window read then tried the cache first: a warning and a failover every time
    (one per window), where one warning says it and routing past the cache is no failure.
    """
    evict(node.node, "tokens")
    ds = EdgeDataset("tokens@1", endpoints=[f"lmdb://{node.cache}", node.node.address], **SMALL)  # type: ignore[arg-type]
    assert "holds 0 of the 4 shards of tokens@1" in caplog.text
    caplog.clear()
    got = [x for b in torch.utils.data.DataLoader(ds, batch_size=None) for x in labels(b)]
    failovers = ds.pool().failovers
    ds.close()
    assert sorted(got) == list(range(TOTAL))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "read from" in warned[0] and node.node.address in warned[0], warned
    assert failovers == 0


def test_evicted_version_lmdb_only_fails_the_constructor(node: Node) -> None:
    """After edgecache evict the manifest stays in the cache: the constructor says no shard is."""
    evict(node.node, "tokens")
    with pytest.raises(ShardNotCached) as raised:
        EdgeDataset("tokens@1", endpoints=[f"lmdb://{node.cache}"], **SMALL)  # type: ignore[arg-type]
    message = str(raised.value)
    assert str(node.cache) in message and "holds no shard of tokens@1" in message
    assert "edgecache warm tokens@1 --region" in message and "gRPC endpoint" in message
    # By name alone the same: "tokens@latest is in none of the local caches" said the
    # version was unknown, though the cache keeps its manifest.
    for spec in ("tokens", "tokens@latest"):
        with pytest.raises(ShardNotCached, match="holds no shard of tokens@1"):
            EdgeDataset(spec, endpoints=[f"lmdb://{node.cache}"], **SMALL)  # type: ignore[arg-type]


if __name__ == "__main__":  # the child of run_child
    if sys.argv[1] == "epoch":
        child_epoch([sys.argv[2]], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "map":
        child_map_growth(sys.argv[2])


def test_a_local_cache_holding_another_copy_of_the_version_is_not_read(tmp_path: Path) -> None:
    """Another copy of ``tokens@1`` (other rows) in the lmdb:// cache than the one the
    dataset's manifest names: its rows were read as this version's, silently wrong. Now the
    cache's kept digest is compared, and the reads go on at the next endpoint, exactly."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from edgeutil import node_settings

    from edgecache.edge.server import running_node

    tables = write_parquet_shards(tmp_path / "a", 2, rows=500)
    (tmp_path / "b").mkdir()
    for i, table in enumerate(tables):  # the same shape, other labels
        moved = pa.compute.add(table.column("label"), 1_000_000)
        other = table.set_column(table.schema.get_field_index("label"), "label", moved)
        pq.write_table(other, tmp_path / "b" / f"part-{i:05d}.parquet", row_group_size=1000)
    expected = sorted(int(x) + 1_000_000 for t in tables for x in t.column("label"))
    mine, theirs = f"file://{tmp_path}/reg-a", f"file://{tmp_path}/reg-b"
    publish(mine, f"file://{tmp_path}/a", "tokens")
    publish(theirs, f"file://{tmp_path}/b", "tokens")
    with running_node(node_settings(tmp_path / "na", mine)) as node:
        stage(node, "tokens")  # type: ignore[arg-type]
    with running_node(node_settings(tmp_path / "nb", theirs)) as other:
        ds = EdgeDataset(
            "tokens@1",
            endpoints=[f"lmdb://{tmp_path / 'na' / 'cache'}", other.address],
            batch_size=100,
        )
        try:
            got = sorted(x for batch in ds for x in labels(batch))
            assert got == expected  # the registry-b copy's rows, each once
            assert ds.stats()["endpoints"][other.address]["bytes"] > 0
        finally:
            ds.close()
