"""EdgeDataset against real edge nodes (subprocesses) and real DataLoader workers."""

from __future__ import annotations

import random
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, write_parquet_shards

from edgecache.cache.errors import (
    AllNodesFailed,
    ConfigFileError,
    InvalidEndpoint,
    InvalidName,
    StateMismatch,
    VersionNotFound,
)
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS
SMALL = {"window_bytes": 24 << 10, "batch_size": 50}  # several windows per shard


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[LocalNode]]]:
    root = tmp_path_factory.mktemp("cluster")
    write_parquet_shards(root / "origin", SHARDS, rows=ROWS)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    nodes = [
        start_local_node(r, root / f"cache-{r}", f"file://{root}/registry") for r in ("eu", "us")
    ]
    yield root, nodes
    for node in nodes:
        node.stop()


def labels(batches) -> list[int]:  # noqa: ANN001
    return [int(x) for b in batches for x in b["label"]]


def read_epoch(ds: EdgeDataset, workers: int) -> list[int]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return labels(loader)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_exact_once_across_ranks_and_workers(cluster, world_size: int, workers: int) -> None:
    _, nodes = cluster
    seen: Counter = Counter()
    for rank in range(world_size):
        ds = EdgeDataset(
            "tokens@1",
            endpoints=[n.address for n in nodes],
            rank=rank,
            world_size=world_size,
            seed=5,
            **SMALL,
        )
        seen.update(read_epoch(ds, workers))
    assert sorted(seen) == list(range(TOTAL)) and set(seen.values()) == {1}


def test_order_is_the_same_for_any_worker_count_and_changes_with_epoch(cluster) -> None:
    _, nodes = cluster
    ds = EdgeDataset("tokens@1", endpoints=[n.address for n in nodes], seed=11, **SMALL)
    zero = read_epoch(ds, 0)
    ds.set_epoch(0)  # read to its end in-process, the dataset moved on to epoch 1
    assert read_epoch(ds, 2) == zero
    ds.set_epoch(1)
    assert read_epoch(ds, 0) != zero
    other = EdgeDataset("tokens@1", endpoints=[nodes[1].address], seed=11, **SMALL)
    assert read_epoch(other, 0) == zero  # another node, same order


def test_drop_last_gives_every_rank_the_same_full_batches(cluster) -> None:
    _, nodes = cluster
    counts, seen = set(), Counter()
    for rank in range(3):
        ds = EdgeDataset(
            "tokens@1",
            endpoints=[nodes[0].address],
            rank=rank,
            world_size=3,
            drop_last=True,
            **SMALL,
        )
        batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
        assert all(len(b["label"]) == 50 for b in batches)
        counts.add(len(batches))
        seen.update(labels(batches))
    assert len(counts) == 1 and set(seen.values()) == {1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resume_at_a_random_point_with_other_workers_and_endpoints(cluster, seed: int) -> None:
    _, nodes = cluster
    rng = random.Random(seed)
    ds = EdgeDataset("tokens@1", endpoints=[nodes[0].address], seed=seed, **SMALL)
    ds.set_epoch(2)
    full = read_epoch(ds, 0)
    ds.set_epoch(2)  # read to its end, the dataset moved on to epoch 3: epoch 2 once more
    stop = rng.randrange(1, len(ds))
    first = []
    for i, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
        first.extend(int(x) for x in batch["label"])
        if i + 1 == stop:
            break
    state = ds.state_dict()
    assert state["batches"] == stop and state["epoch"] == 2 and state["version"] == 1
    resumed = EdgeDataset(
        "tokens@1", endpoints=[nodes[1].address, nodes[0].address], seed=seed, **SMALL
    )  # the state's seed: another one is refused (StateMismatch)
    resumed.load_state_dict(state)
    rest = read_epoch(resumed, rng.choice([0, 2]))
    assert first + rest == full


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_after_a_break_starts_where_the_dataset_was_put_for_any_workers(
    cluster, workers: int
) -> None:
    """A break (a peek at one batch, max steps) then a new pass: at num_workers=0 the pass
    went on from the break, skipping what it had read, while workers started over; the
    same loop must read the same data whatever num_workers is."""
    _, nodes = cluster
    ds = EdgeDataset("tokens@1", endpoints=[nodes[0].address], seed=4, **SMALL)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    full = labels(loader)  # epoch 0; the dataset moves on to epoch 1
    ds.set_epoch(0)
    batches = len(ds)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    assert ds.state_dict()["batches"] == (4 if workers == 0 else 0)  # progress, for a save
    assert len(ds) == batches  # the next pass is the whole epoch again
    ds.set_epoch(0)  # resuming epoch 0 means where it was put, not where the pass broke
    assert labels(loader) == full
    # Put mid-epoch by a state: a broken pass after it starts there again.
    ds.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    state = ds.state_dict(batches=3) if workers else ds.state_dict()
    ds.load_state_dict(state)
    rest = labels(loader)
    ds.load_state_dict(state)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert labels(loader) == rest
    assert full[-len(rest) :] == rest


def test_a_new_version_mid_epoch_does_not_change_a_pinned_reader(cluster) -> None:
    root, nodes = cluster
    ds = EdgeDataset("tokens@latest", endpoints=[nodes[0].address], **SMALL)
    iterator = iter(torch.utils.data.DataLoader(ds, batch_size=None))
    got = labels([next(iterator) for _ in range(3)])
    write_parquet_shards(root / "origin-v2", 2, rows=10)
    publish(f"file://{root}/registry", f"file://{root}/origin-v2", "tokens")
    got += labels(iterator)
    assert sorted(got) == list(range(TOTAL)) and ds.version == "tokens@1"


def test_local_fast_path_reads_lmdb_directly(cluster) -> None:
    root, nodes = cluster
    full = read_epoch(EdgeDataset("tokens@1", endpoints=[nodes[0].address], seed=4, **SMALL), 0)
    local = EdgeDataset("tokens@1", endpoints=[f"lmdb://{root}/cache-eu"], seed=4, **SMALL)
    assert read_epoch(local, 0) == full
    assert local.stats()["endpoints"][f"lmdb://{root}/cache-eu"]["bytes"] > 0


@pytest.mark.parametrize("local", [False, True])
def test_each_window_of_fixed_width_rows_is_one_chunk(cluster, local: bool) -> None:
    """The node chunked the Parquet rows on the grid the reader cuts windows by.

    Windows that straddle chunks decode and hold two chunks each (the old
    encoder cut by Arrow's nbytes, which counts validity bitmaps, so every
    window straddled); ``stats()["last_pipeline"]`` counts them.
    """
    root, nodes = cluster
    endpoint = f"lmdb://{root}/cache-eu" if local else nodes[0].address
    read_epoch(EdgeDataset("tokens@1", endpoints=[nodes[0].address], batch_size=64), 0)  # staged
    ds = EdgeDataset("tokens@1", endpoints=[endpoint], batch_size=64, seed=3)
    assert sorted(read_epoch(ds, 0)) == list(range(TOTAL))
    pipeline = ds.stats()["last_pipeline"]
    assert pipeline["windows_read"] > SHARDS  # several windows per shard
    assert pipeline["window_chunks"] == pipeline["windows_read"]
    assert pipeline["windows_inline"] == 0  # zstd chunks: decoded on fetch threads


def test_windows_of_variable_width_rows_are_chunks_too(cluster) -> None:
    """Binary rows: node and reader take the same row estimate from the manifest."""
    root, nodes = cluster
    rng = np.random.default_rng(5)
    origin = root / "origin-blobs"
    origin.mkdir()
    for shard in range(3):
        blobs = [rng.bytes(int(n)) for n in rng.integers(200, 1500, size=400)]
        labels_ = np.arange(shard * 400, (shard + 1) * 400, dtype=np.int64)
        table = pa.table({"blob": pa.array(blobs, pa.binary()), "label": labels_})
        pq.write_table(table, origin / f"part-{shard:05d}.parquet", row_group_size=100)
    publish(f"file://{root}/registry", f"file://{origin}", "blobs", chunk_bytes=32 << 10)
    ds = EdgeDataset("blobs@1", endpoints=[nodes[1].address], batch_size=32, seed=1)
    assert sorted(read_epoch(ds, 0)) == list(range(1200))
    pipeline = ds.stats()["last_pipeline"]
    assert pipeline["windows_read"] > 3 * 2
    assert pipeline["window_chunks"] == pipeline["windows_read"]


def test_stats_and_tensor_shapes(cluster) -> None:
    _, nodes = cluster
    ds = EdgeDataset(
        "tokens@1", endpoints=[n.address for n in nodes], columns=["input_ids"], **SMALL
    )
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=None)))
    assert set(batch) == {"input_ids"} and batch["input_ids"].shape == (50, 32)
    assert batch["input_ids"].dtype == torch.int32
    stats = ds.stats()
    assert stats["version"] == "tokens@1" and stats["samples"] == 50
    assert all(e["rtt_ms"] < 1000 for e in stats["endpoints"].values())
    single = EdgeDataset(
        "tokens@1", endpoints=[nodes[0].address], batch_size=None, window_bytes=24 << 10
    )
    sample = next(iter(single))
    assert sample["input_ids"].shape == (32,) and sample["label"].shape == ()


def test_bad_input_is_refused_clearly(cluster) -> None:
    _, nodes = cluster
    address = nodes[0].address
    with pytest.raises(VersionNotFound, match="nope"):
        EdgeDataset("nope", endpoints=[address])
    with pytest.raises(VersionNotFound):
        EdgeDataset("tokens@9", endpoints=[address])
    with pytest.raises(InvalidName):
        EdgeDataset("../etc", endpoints=[address])
    with pytest.raises(KeyError, match="not in the dataset"):
        EdgeDataset("tokens@1", endpoints=[address], columns=["pixels"])
    for bad in (["no-port"], ["host:99999"], ["ftp://x:1"], ["lmdb://relative"]):
        with pytest.raises(InvalidEndpoint):
            EdgeDataset("tokens@1", endpoints=bad)
    with pytest.raises(InvalidEndpoint, match="empty"):
        EdgeDataset("tokens@1", endpoints=[])
    with pytest.raises(ValueError, match="batch_size"):
        EdgeDataset("tokens@1", endpoints=[address], batch_size=0)
    with pytest.raises(ValueError, match="rank"):
        EdgeDataset("tokens@1", endpoints=[address], rank=2, world_size=2)
    ds = EdgeDataset("tokens@1", endpoints=[address], **SMALL)
    state = ds.state_dict()
    other = [{**state["components"][0], "version": 2}]
    with pytest.raises(StateMismatch, match="tokens@2 but this dataset reads tokens@1"):
        ds.load_state_dict({**state, "components": other})
    # The same name@N with other content (another registry's, or one rebuilt): it said
    # "the state is for tokens@1 but this dataset reads tokens@1".
    digest = state["components"][0]["digest"]
    elsewhere = [{**state["components"][0], "digest": "sha256:" + "0" * 64}]
    with pytest.raises(StateMismatch, match="other content under the same names") as refused:
        ds.load_state_dict({**state, "components": elsewhere})
    assert f"tokens@1: sha256:{'0' * 64} in the state, {digest} here" in str(refused.value)
    with pytest.raises(StateMismatch, match="shuffle_windows=3"):
        ds.load_state_dict({**state, "order": {**state["order"], "shuffle_windows": 3}})
    old = {"format": 1, "dataset": "tokens", "version": 1, "batches": 3, "lanes": 8}
    with pytest.raises(StateMismatch, match="format 1"):
        ds.load_state_dict(old)


def reading_node(nodes: list[LocalNode]) -> LocalNode:
    """The node that has served this test's reads so far (the most bytes served)."""
    from edgecache.clients.node_client import connect
    from edgecache.v1 import edge_pb2

    served = {
        n.address: connect(n.address).Status(edge_pb2.StatusRequest(), timeout=5).bytes_served
        for n in nodes
    }
    return max(nodes, key=lambda n: served[n.address])


def test_node_killed_mid_epoch_fails_over_exact_once(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=ROWS)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    nodes = [start_local_node(r, tmp_path / f"cache-{r}", registry) for r in ("a", "b")]
    try:
        ds = EdgeDataset(
            "tokens@1",
            endpoints=[n.address for n in nodes],
            retry_timeout=3,
            prefetch_bytes=1,  # read as it goes, one window at a time, so the kill lands
            shuffle_windows=1,  # mid-epoch
            lanes=1,
            threads=1,
            **SMALL,
        )
        got = []
        for i, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
            got.extend(int(x) for x in batch["label"])
            if i == 5:
                reading_node(nodes).process.send_signal(signal.SIGKILL)
        assert sorted(got) == list(range(TOTAL))
        assert ds.stats()["failovers"] >= 1
        for node in nodes:
            node.stop()
        with pytest.raises(AllNodesFailed) as info:
            list(torch.utils.data.DataLoader(ds, batch_size=None))
        for node in nodes:
            assert node.address in str(info.value)
    finally:
        for node in nodes:
            node.stop()


def test_blackholed_node_is_left_within_seconds(cluster) -> None:
    import time

    from tcpproxy import FaultyProxy

    _, nodes = cluster
    proxy, other = FaultyProxy(nodes[0].address), FaultyProxy(nodes[1].address)  # equal RTTs
    try:
        ds = EdgeDataset(
            "tokens@1",
            endpoints=[proxy.address, other.address],
            window_bytes=24 << 10,
            batch_size=50,
            prefetch_bytes=1,  # one window at a time, so the stream is live when it goes dark
            shuffle_windows=1,
            lanes=1,
            threads=1,
        )
        preferred = {proxy.address: proxy, other.address: other}[ds.pool().ranked()[0].text]
        got, gaps, last = [], [], time.monotonic()
        for i, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            got.extend(int(x) for x in batch["label"])
            if i == 3:
                preferred.blackhole()
        assert sorted(got) == list(range(TOTAL))
        assert ds.stats()["failovers"] >= 1, ds.stats()
        # Noticed within seconds, not at retry_timeout (30 s) or keepalive's minute; 20 s,
        # not 8, leaves a loaded host its slow seconds.
        assert max(gaps[4:]) < 20.0, gaps
        assert ds.stats()["endpoints"][preferred.address]["failures"] >= 1
    finally:
        proxy.close()
        other.close()


def test_corrupted_bytes_in_transit_are_never_delivered(cluster) -> None:
    from tcpproxy import FaultyProxy

    _, nodes = cluster
    full = read_epoch(EdgeDataset("tokens@1", endpoints=[nodes[1].address], seed=9, **SMALL), 0)
    proxy, other = FaultyProxy(nodes[0].address), FaultyProxy(nodes[1].address)
    try:
        ds = EdgeDataset("tokens@1", endpoints=[proxy.address, other.address], seed=9, **SMALL)
        # Replicas split shards by rendezvous hashing: damage one stream of each.
        proxy.corrupt_after(60_000)
        other.corrupt_after(60_000)
        assert read_epoch(ds, 0) == full
        endpoints = ds.stats()["endpoints"]
        assert endpoints[proxy.address]["failures"] + endpoints[other.address]["failures"] >= 1
        # Each failure is said too (a damaged chunk's was counted with last_error left '').
        assert all(e["last_error"] for e in endpoints.values() if e["failures"]), endpoints
    finally:
        proxy.close()
        other.close()


def test_topology_file_and_distributed_pinning(cluster, tmp_path: Path) -> None:
    import torch.distributed as dist
    from s3server import free_port

    _, nodes = cluster
    topology = tmp_path / "edgecache.yaml"
    topology.write_text(
        "registry: file:///unused\n"
        f"regions:\n  eu-west:\n    nodes: [{nodes[0].address}]\n"
        f"  us-east:\n    nodes: [{nodes[1].address}]\n"
    )
    ds = EdgeDataset("tokens@1", config=topology, region="us-east", **SMALL)
    assert [e.text for e in ds.endpoints] == [nodes[1].address, nodes[0].address]
    with pytest.raises(InvalidEndpoint, match="region 'mars'"):
        EdgeDataset("tokens@1", config=topology, region="mars")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:  # rank 0 resolves latest and broadcasts the manifest; the rank comes from torch
        pinned = EdgeDataset("tokens@1", endpoints=[nodes[0].address], **SMALL)
        assert (pinned.rank, pinned.world_size, pinned.version) == (0, 1, "tokens@1")
    finally:
        dist.destroy_process_group()


def test_topology_errors_come_from_the_one_loader(cluster, tmp_path: Path) -> None:
    # EdgeDataset reads edgecache.yaml with load_topology, like the CLI: a malformed
    # region is a ConfigFileError naming file, line and field, never an AttributeError,
    # and a string where a list belongs is refused, not read character by character.
    _, nodes = cluster
    head = "registry: file:///unused\nregions:\n"
    shorthand = tmp_path / "shorthand.yaml"
    shorthand.write_text(head + "  eu: [a:1, b:2]\n")
    with pytest.raises(ConfigFileError, match=r"shorthand.yaml:3: regions.eu: .*dictionary"):
        EdgeDataset("tokens@1", config=shorthand, region="eu")
    one = tmp_path / "one.yaml"
    one.write_text(head + '  eu:\n    nodes: "a:1"\n')
    with pytest.raises(ConfigFileError, match=r"one.yaml:4: regions.eu.nodes: .*list"):
        EdgeDataset("tokens@1", config=one)
    good = tmp_path / "good.yaml"
    good.write_text(
        head + f"  us-east:\n    nodes: [{nodes[1].address}]\n"
        f"  eu-west:\n    nodes: [{nodes[0].address}]\n"
    )
    with pytest.raises(InvalidEndpoint, match=r"region 'mars' is unknown.*eu-west, us-east"):
        EdgeDataset("tokens@1", config=good, region="mars")
    ds = EdgeDataset("tokens@1", config=good, **SMALL)  # no region: every node, file order
    assert [e.text for e in ds.endpoints] == [nodes[1].address, nodes[0].address]
    # One endpoint as a plain string is one endpoint, not a list of characters.
    single = EdgeDataset("tokens@1", endpoints=nodes[0].address, pin_memory=np.False_, **SMALL)
    assert [e.text for e in single.endpoints] == [nodes[0].address]
    assert single.pin_memory_setting is False  # numpy's False is False
    assert len(read_epoch(single, 0)) == TOTAL


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes(cluster, workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    _, nodes = cluster

    def dataset() -> EdgeDataset:
        return EdgeDataset("tokens@1", endpoints=[nodes[0].address], seed=3, **SMALL)

    full = labels(StatefulDataLoader(dataset(), batch_size=None, num_workers=workers))
    loader = StatefulDataLoader(dataset(), batch_size=None, num_workers=workers)
    first = []
    for i, batch in enumerate(loader):
        first.extend(int(x) for x in batch["label"])
        if i == 9:
            break
    again = StatefulDataLoader(dataset(), batch_size=None, num_workers=workers)
    again.load_state_dict(loader.state_dict())
    assert first + labels(again) == full


def test_readshard_parser_matches_protobuf_or_defers_to_it() -> None:
    # parse_chunk returns the frame as a view into the message instead of protobuf's copy;
    # on every input it must give protobuf's fields, or raise where protobuf raises.
    from google.protobuf.message import DecodeError

    from edgecache.cache.wire import WireChunk, encode_chunk, parse_chunk
    from edgecache.v1 import edge_pb2

    def fields(chunk: object) -> tuple:
        names = ("index", "chunk_count", "rows", "checksum", "first_row")
        return (*(getattr(chunk, n) for n in names), bytes(chunk.frame))  # type: ignore[attr-defined]

    rng = random.Random(3)
    samples = [
        encode_chunk(index=0, chunk_count=0, rows=0, checksum=0, frame=b""),
        encode_chunk(
            index=3, chunk_count=9, rows=500, checksum=2**64 - 1, frame=b"x" * 300, first_row=2**40
        ),
        edge_pb2.Chunk(index=1, rows=7, frame=b"abc", first_row=5).SerializeToString(),
        # valid, but not the plain layout: fields out of order, repeated, unknown, oversized
        bytes([0x30, 5, 0x08, 1, 0x08, 2]),
        bytes([0x18]) + b"\xff" * 9 + b"\x01",  # uint32 field given a 64-bit varint
        bytes([0x40, 7, 0x08, 1]),  # unknown field 8
    ]
    base = encode_chunk(
        index=2, chunk_count=4, rows=10, checksum=12345, frame=b"F" * 64, first_row=20
    )
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        samples.append(bytes(data[: rng.randint(0, len(data))] if rng.random() < 0.3 else data))
    fast = 0
    for data in samples:
        try:
            want = fields(edge_pb2.Chunk.FromString(data))
        except DecodeError:
            with pytest.raises(DecodeError):
                parse_chunk(data)
            continue
        got = parse_chunk(data)
        assert fields(got) == want, data
        if isinstance(got, WireChunk) and len(got.frame):
            fast += 1
            assert isinstance(got.frame, memoryview) and got.frame.obj is data  # no copy
    assert fast > 100


def test_edge_chunks_decode_once_for_both_reads() -> None:
    # The chunk across the edge of two windows is decoded once and shared; a failed
    # decode is never shared, and entries go once both reads took their rows.
    import threading

    import pyarrow as pa

    from edgecache.clients.edge_chunks import EdgeChunks

    edges = EdgeChunks(limit=2)
    edges.share(("d", 1, 0), 100)
    shard = ("d", 1, 0)
    assert edges.across(shard, 90, 110, 100, 200) and edges.across(shard, 90, 110, 0, 100)
    assert not edges.across(shard, 100, 110, 100, 200)  # starts on the edge: not shared
    assert not edges.across(("d", 1, 1), 90, 110, 100, 200)  # another shard
    assert not edges.across(("e", 1, 0), 90, 110, 100, 200)  # another version's shard 0
    batch = pa.record_batch([pa.array(range(20))], names=["x"])
    key = ("d", 1, 0, 90, 20, 0xC0FFEE)  # dataset, version, shard, first row, rows, checksum
    calls: list[int] = []
    gate = threading.Event()

    def slow() -> pa.RecordBatch:
        calls.append(1)
        gate.wait(5)
        return batch

    got: list[pa.RecordBatch] = []
    readers = [
        threading.Thread(target=lambda t=t: got.append(edges.decode(key, 20, t, slow)))
        for t in (10, 10)
    ]
    for r in readers:
        r.start()
    gate.set()
    for r in readers:
        r.join(5)
    assert len(calls) == 1 and len(got) == 2 and all(g is batch for g in got)
    assert not edges._entries  # both took their 10 rows: gone

    # A read that starts after the chunk was decoded takes it without fetching it.
    assert edges.take("d", 1, 0, 100, 100, 200) is None
    assert edges.decode(key, 20, 10, lambda: batch) is batch  # the window [0, 100)
    assert edges.take("d", 1, 0, 100, 100, 200) == (90, batch)  # the window [100, 200)
    assert not edges._entries

    # A window planned only after the chunk was decoded (its edge shared later) still
    # finds it: chunks are found by their rows, not by the edges known at decode time.
    assert edges.decode(key, 20, 5, lambda: batch) is batch  # rows 90..95 for the first read
    edges.share(("d", 1, 0), 95)
    assert edges.take("d", 1, 0, 95, 95, 100) == (90, batch)
    assert edges.take("d", 1, 0, 100, 100, 200) == (90, batch)  # the rest: all 20 taken
    assert not edges._entries

    def broken() -> pa.RecordBatch:
        raise ValueError("damaged")

    with pytest.raises(ValueError, match="damaged"):
        edges.decode(key, 20, 10, broken)
    assert edges.take("d", 1, 0, 100, 100, 200) is None  # nothing shared after a failure
    assert edges.decode(key, 20, 10, lambda: batch) is batch  # decoded anew
    for i in range(5):
        edges.decode(("d", 1, 0, 1000 + 20 * i, 20, i), 20, 10, lambda: batch)
    assert len(edges._entries) == 2  # at most ``limit`` kept
    assert edges.take("d", 1, 0, 100, 100, 200) is None  # dropped with its entry


def test_endpoints_beside_a_topology_are_refused(tmp_path: Path) -> None:
    """endpoints= with config= or region= read the endpoints as given and said nothing:
    the region's nodes did not come first nor serve as its replicas."""
    topology = tmp_path / "edgecache.yaml"
    topology.write_text("registry: file:///unused\nregions:\n  eu:\n    nodes: [a:1]\n")
    for extra, named in (
        # No config= to read the region from: "drop endpoints=" would not do (stop 51).
        ({"region": "eu"}, r"names a region of a topology file: pass config= with it, or drop"),
        ({"config": topology}, r"config would go unused.*or drop config="),
        ({"config": topology, "region": "eu"}, r"config and region would go unused"),
    ):
        with pytest.raises(InvalidEndpoint, match=named):
            EdgeDataset("tokens@1", endpoints=["127.0.0.1:1"], **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("pin_memory", [0, 1, "yes", None])
def test_pin_memory_takes_booleans_and_auto_only(pin_memory: object) -> None:
    """pin_memory=0 passed the check (0 == False), then failed every `is False` test after
    it: it pinned on a CUDA host, the opposite of what was asked."""
    with pytest.raises(ValueError, match="pin_memory must be True, False or 'auto'"):
        EdgeDataset("tokens@1", endpoints=["127.0.0.1:1"], pin_memory=pin_memory)  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [Path("read.token"), b"s3cret", "", " s3cret\n"])
def test_a_token_that_is_not_its_text_is_refused_without_echoing_it(token: object) -> None:
    """A Path or bytes token was sent as its printed form and refused by the node, whose
    hint said to pass token=, which the user had done."""
    with pytest.raises(ValueError, match="token must be the token's text") as refused:
        EdgeDataset("tokens@1", endpoints=["127.0.0.1:1"], token=token)  # type: ignore[arg-type]
    assert "s3cret" not in str(refused.value)


def test_one_sample_mode_resumes_exactly_from_samples_at_a_multiple_of_the_workers(
    cluster,
) -> None:
    """As docs/dataset.md says: with batch_size=None, state_dict(batches=) counts samples,
    steps × the loader's batch size, saved at a step count that is a multiple of the
    workers (every worker then gave an equal share: a prefix of the epoch's order)."""
    _, nodes = cluster
    kwargs = {"window_bytes": SMALL["window_bytes"], "batch_size": None, "seed": 5}
    ds = EdgeDataset("tokens@1", endpoints=[nodes[0].address], **kwargs)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    read = []
    for step, batch in enumerate(loader, 1):
        read += batch["label"].tolist()
        if step == 4:
            break
    state = ds.state_dict(batches=4 * 8)
    ds.close()
    resumed = EdgeDataset("tokens@1", endpoints=[nodes[0].address], **kwargs)
    resumed.load_state_dict(state)
    rest = labels(torch.utils.data.DataLoader(resumed, batch_size=8, num_workers=2))
    resumed.close()
    assert sorted(read + rest) == list(range(TOTAL))  # each sample once
