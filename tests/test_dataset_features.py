"""EdgeDataset features for real training runs, against real nodes and their LMDB caches.

Batch-level shuffle quality on data stored in label order, weighted mixtures,
elastic resume (another world size and batch size), ``rows=`` splits and
``len()``: over gRPC and ``lmdb://``, with DataLoader workers, checking the
sets of sample ids read, not only their counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import StateMismatch, VersionNotFound
from edgecache.clients import EdgeDataset
from edgecache.clients.mixture import parse_rows
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS
CODE_SHARDS, CODE_ROWS, CODE_BASE = 4, 300, 1_000_000
SMALL = {"window_bytes": 24 << 10, "batch_size": 50}


def write_code_shards(root: Path) -> None:
    """A second dataset with the tokens' schema and labels from CODE_BASE on."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for i in range(CODE_SHARDS):
        ids = rng.integers(0, 50_000, size=CODE_ROWS * 32, dtype=np.int32)
        first = CODE_BASE + i * CODE_ROWS
        table = pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 32),
                "label": pa.array(np.arange(first, first + CODE_ROWS, dtype=np.int64)),
            }
        )
        pq.write_table(table, root / f"part-{i:05d}.parquet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[LocalNode]]]:
    """Two nodes; tokens@1, code@1 and pixels@1, all staged in the first node's cache."""
    root = tmp_path_factory.mktemp("features")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    write_code_shards(root / "code")
    publish(registry, f"file://{root}/code", "code")
    (root / "pixels").mkdir()
    pq.write_table(pa.table({"pixels": pa.array([b"x"] * 10)}), root / "pixels" / "p.parquet")
    publish(registry, f"file://{root}/pixels", "pixels")
    nodes = [start_local_node(r, root / f"cache-{r}", registry) for r in ("eu", "us")]
    for name in ("tokens", "code"):
        for _ in stub(nodes[0].address).Stage(edge_pb2.StageRequest(dataset=name, version=1)):
            pass
    yield root, nodes
    for node in nodes:
        node.stop()


def endpoints(cluster: tuple[Path, list[LocalNode]], kind: str) -> list[str]:
    root, nodes = cluster
    return [f"lmdb://{root}/cache-eu"] if kind == "lmdb" else [n.address for n in nodes]


def ids(batches, column: str | None = None) -> list[tuple[int, int]]:  # noqa: ANN001
    """(component, label) of every sample, in order."""
    out = []
    for b in batches:
        source = b[column] if column else torch.zeros(len(b["label"]), dtype=torch.int64)
        out += [(int(c), int(x)) for c, x in zip(source, b["label"], strict=True)]
    return out


def read(ds: EdgeDataset, workers: int, column: str | None = None) -> list[tuple[int, int]]:
    return ids(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers), column)


@pytest.mark.parametrize("kind", ["grpc", "lmdb"])
def test_batches_mix_labels_of_data_stored_in_label_order(cluster, kind: str) -> None:
    # tokens@1 is stored in label order; call label * 10 // TOTAL its class (10 classes).
    def distinct(ds: EdgeDataset) -> float:
        batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
        return float(
            np.mean([len({int(x) * 10 // TOTAL for x in b["label"]}) for b in batches[:-1]])
        )

    # Windows of ~7 rows: 600 of them, enough for 4 lanes of 16 streams of 8 windows.
    random_permutation = 10 * (1 - 0.9**32)
    mixed = EdgeDataset(
        "tokens@1", endpoints=endpoints(cluster, kind), batch_size=32, window_bytes=1 << 10
    )
    windows = EdgeDataset(
        "tokens@1",
        endpoints=endpoints(cluster, kind),
        batch_size=32,
        window_bytes=1 << 10,
        shuffle_windows=1,
    )
    assert mixed.epoch_order().order.per_lane == 16
    assert distinct(mixed) >= 0.9 * random_permutation
    assert distinct(windows) < 2.5  # one window per batch: a class or two


@pytest.mark.parametrize(("kind", "workers"), [("grpc", 2), ("lmdb", 0), ("lmdb", 2)])
def test_mixture_shares_columns_and_exact_once_across_ranks(cluster, kind, workers) -> None:
    per_epoch = 3000
    seen: Counter = Counter()
    for rank in range(2):
        ds = EdgeDataset(
            {"tokens@1": 0.7, "code@1": 0.3},
            endpoints=endpoints(cluster, kind),
            samples_per_epoch=per_epoch,
            component_column="source",
            rank=rank,
            world_size=2,
            seed=3,
            **SMALL,
        )
        assert ds.components == ["tokens@1", "code@1"] and ds.columns == ["input_ids", "label"]
        got = read(ds, workers, "source")
        assert len(got) == len(set(got)) and len(ds) == -(-len(got) // 50)
        seen.update(got)
    assert set(seen.values()) == {1}
    tokens = {label for c, label in seen if c == 0}
    code = {label for c, label in seen if c == 1}
    assert len(tokens) == 2100 and len(code) == 900  # round(0.7 * 3000), round(0.3 * 3000)
    assert tokens <= set(range(TOTAL))
    assert code <= set(range(CODE_BASE, CODE_BASE + CODE_SHARDS * CODE_ROWS))


def test_mixture_components_continue_across_epochs_before_repeating(cluster) -> None:
    # code@1 has 1,200 rows and gets 900 a epoch: epoch 0 draws 900 of them, epoch 1
    # the other 300 before any repeats, then 600 of a new pass. tokens (4,200 rows,
    # 2,100 a epoch) is read once in two epochs.
    ds = EdgeDataset(
        {"tokens@1": 0.7, "code@1": 0.3},
        endpoints=endpoints(cluster, "grpc"),
        samples_per_epoch=3000,
        component_column="source",
        seed=9,
        **SMALL,
    )
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append(read(ds, 0, "source"))
    code = [[x for c, x in e if c == 1] for e in epochs]
    tokens = [[x for c, x in e if c == 0] for e in epochs]
    all_code = set(range(CODE_BASE, CODE_BASE + 1200))
    assert len(set(code[0])) == 900 and len(code[1]) == 900
    assert all_code - set(code[0]) <= set(code[1])  # the rest of the pass comes first
    both = Counter(code[0] + code[1])  # 1,800 draws of 1,200 rows: a pass and a half
    assert set(both) == all_code and sorted(Counter(both.values()).items()) == [(1, 600), (2, 600)]
    assert sorted(tokens[0] + tokens[1]) == list(range(TOTAL))  # one pass over two epochs


def test_mixture_errors_are_clear(cluster) -> None:
    eps = endpoints(cluster, "grpc")
    with pytest.raises(VersionNotFound, match="nope"):
        EdgeDataset({"tokens@1": 1, "nope@1": 1}, endpoints=eps)
    with pytest.raises(ValueError, match="weight of 'code@1' must be a positive number"):
        EdgeDataset({"tokens@1": 1, "code@1": 0}, endpoints=eps)
    with pytest.raises(ValueError, match="weight of 'code@1' must be a positive number"):
        EdgeDataset({"tokens@1": 1, "code@1": -0.5}, endpoints=eps)
    # Infinite is positive: said as what it is (a helper's hunt).
    with pytest.raises(ValueError, match="weight of 'code@1' must be a finite number"):
        EdgeDataset({"tokens@1": 1, "code@1": float("inf")}, endpoints=eps)
    with pytest.raises(ValueError, match="share no column"):
        EdgeDataset({"tokens@1": 1, "pixels@1": 1}, endpoints=eps)
    with pytest.raises(KeyError, match="not in pixels@1"):
        EdgeDataset({"tokens@1": 1, "pixels@1": 1}, endpoints=eps, columns=["label"])
    with pytest.raises(ValueError, match="non-empty mapping"):
        EdgeDataset({}, endpoints=eps)
    ds = EdgeDataset({"tokens@1": 0.7, "code@1": 0.3}, endpoints=eps, **SMALL)
    state = ds.state_dict()
    other = EdgeDataset({"tokens@1": 0.5, "code@1": 0.5}, endpoints=eps, **SMALL)
    with pytest.raises(StateMismatch, match="weights"):
        other.load_state_dict(state)


@pytest.mark.parametrize(("kind", "workers"), [("grpc", 0), ("lmdb", 2)])
def test_elastic_resume_at_another_world_size_and_batch_size(cluster, kind, workers) -> None:
    # Three ranks step 7 batches of 50 in lockstep; rank 0's state resumes two ranks
    # with batches of 64: together they read exactly the samples not yet read.
    eps = endpoints(cluster, kind)
    first: Counter = Counter()
    for rank in range(3):
        ds = EdgeDataset("tokens@1", endpoints=eps, rank=rank, world_size=3, seed=4, **SMALL)
        ds.set_epoch(1)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        for step, batch in enumerate(loader):
            first.update(int(x) for x in batch["label"])
            if step == 6:
                break
        if rank == 0:
            state = ds.state_dict(batches=7)
    assert sum(first.values()) == 3 * 7 * 50
    rest: Counter = Counter()
    for rank in range(2):
        ds = EdgeDataset(
            "tokens@1",
            endpoints=eps,
            rank=rank,
            world_size=2,
            batch_size=64,
            seed=4,  # the state's: another seed is refused (StateMismatch)
            window_bytes=24 << 10,
        )
        ds.load_state_dict(state)
        length = len(ds)  # after a resume: the batches of what is left of the epoch
        labels = [int(x) for _, x in read(ds, workers)]
        assert length == -(-len(labels) // 64)  # and at most one of them partial
        rest.update(labels)
    assert not set(first) & set(rest)
    assert first + rest == Counter(range(TOTAL))


def test_elastic_resume_with_drop_last_never_repeats(cluster) -> None:
    eps = endpoints(cluster, "grpc")
    ds = EdgeDataset("tokens@1", endpoints=eps, rank=0, world_size=2, drop_last=True, **SMALL)
    state = ds.state_dict(batches=10)
    seen: Counter = Counter()
    for rank in range(2):
        ds = EdgeDataset(
            "tokens@1", endpoints=eps, rank=rank, world_size=2, drop_last=True, **SMALL
        )
        it = iter(torch.utils.data.DataLoader(ds, batch_size=None))
        seen.update(int(x) for _ in range(10) for x in next(it)["label"])
    counts = set()
    for rank in range(3):
        ds = EdgeDataset(
            "tokens@1",
            endpoints=eps,
            rank=rank,
            world_size=3,
            drop_last=True,
            batch_size=40,
            window_bytes=24 << 10,
        )
        ds.load_state_dict(state)
        length = len(ds)
        batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
        assert all(len(b["label"]) == 40 for b in batches) and len(batches) == length
        counts.add(len(batches))
        seen.update(int(x) for b in batches for x in b["label"])
    assert len(counts) == 1 and set(seen.values()) == {1}
    assert TOTAL - len(seen) < 3 * 40 * (4 + 1)  # only what cannot fill a batch everywhere


@pytest.mark.parametrize(("kind", "workers"), [("grpc", 2), ("lmdb", 0)])
def test_row_splits_never_overlap_and_are_stable(cluster, kind: str, workers: int) -> None:
    eps = endpoints(cluster, kind)
    train = EdgeDataset("tokens@1", endpoints=eps, rows=(0.0, 0.95), seed=1, **SMALL)
    val = EdgeDataset("tokens@1", endpoints=eps, rows=(0.95, 1.0), seed=2, **SMALL)
    a, b = {x for _, x in read(train, workers)}, {x for _, x in read(val, workers)}
    assert not a & b and a | b == set(range(TOTAL))
    assert b == set(range(int(0.95 * TOTAL), TOTAL))  # the end of the canonical order
    again = EdgeDataset("tokens@1", endpoints=eps, rows=(0.95, 1.0), seed=8, **SMALL)
    again.set_epoch(3)
    assert {x for _, x in read(again, 0)} == b  # same rows: other seed, other epoch
    rows = EdgeDataset("tokens@1", endpoints=eps, rows=(100, 250), **SMALL)
    assert {x for _, x in read(rows, 0)} == set(range(100, 250))
    with pytest.raises(ValueError, match="fractions must satisfy"):
        EdgeDataset("tokens@1", endpoints=eps, rows=(0.5, 0.2))
    # A fraction beside a row number was read as two fractions: (0.0, 6000) was refused
    # as a bad fraction, without saying why 6000 was one.
    for mixed in ((0.0, 6000), (100, 0.5)):
        with pytest.raises(ValueError, match="mixes a fraction and a row number"):
            EdgeDataset("tokens@1", endpoints=eps, rows=mixed)
    assert parse_rows((0, 0.5)) == (0.0, 0.5) and parse_rows((0.5, 1)) == (0.5, 1.0)
    # The advice is the row numbers given, which read (a fixed (0, 10800) was past the end
    # of a smaller version: refused again when followed; a helper's hunt).
    with pytest.raises(ValueError, match=r"integer row numbers \(rows=\(0, 250\)\)"):
        EdgeDataset("tokens@1", endpoints=eps, rows=(0.0, 250))
    assert {x for _, x in read(EdgeDataset("tokens@1", endpoints=eps, rows=(0, 250), **SMALL), 0)}


@pytest.mark.parametrize(
    ("world", "batch", "drop"), [(1, 50, False), (3, 64, False), (2, 32, True), (4, 100, True)]
)
def test_len_is_the_batches_this_rank_yields(cluster, world: int, batch: int, drop: bool) -> None:
    eps = endpoints(cluster, "lmdb")
    total = 0
    for rank in range(world):
        ds = EdgeDataset(
            "tokens@1",
            endpoints=eps,
            rank=rank,
            world_size=world,
            batch_size=batch,
            drop_last=drop,
            window_bytes=24 << 10,
        )
        batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
        assert len(batches) == len(ds)
        sizes = [len(b["label"]) for b in batches]
        assert sum(1 for s in sizes if s < batch) <= (0 if drop else 1)
        total += sum(sizes)
    if not drop:
        assert total == TOTAL


def test_a_resumed_epoch_says_what_is_left_and_a_finished_one_is_not_read_again(cluster) -> None:
    # len() after a resume at the same world size is what the resumed pass yields (a
    # progress bar's total). An epoch read to its end moves the dataset on to the next:
    # a state saved then resumes with the next epoch, never the finished one again.
    eps = endpoints(cluster, "lmdb")
    ds = EdgeDataset("tokens@1", endpoints=eps, **SMALL)
    whole = len(ds)
    it = iter(ds)
    first = [int(x) for _ in range(3) for x in next(it)["label"]]
    state = ds.state_dict()
    ds.close()
    resumed = EdgeDataset("tokens@1", endpoints=eps, **SMALL)
    resumed.load_state_dict(state)
    assert len(resumed) == whole - 3
    rest = [int(x) for b in resumed for x in b["label"]]
    assert sorted(first + rest) == list(range(TOTAL))
    done = resumed.state_dict()
    assert (done["epoch"], done["batches"], len(resumed)) == (1, 0, whole)
    resumed.close()

    again = EdgeDataset("tokens@1", endpoints=eps, **SMALL)
    again.load_state_dict(done)
    again.set_epoch(done["epoch"])  # a loop resuming "from the saved epoch": epoch 1
    epoch1 = [int(x) for b in again for x in b["label"]]
    assert sorted(epoch1) == list(range(TOTAL)) and epoch1 != first + rest  # a new order
    again.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_state_saved_at_an_epochs_end_resumes_with_the_next_epoch(
    cluster, workers: int
) -> None:
    # torchdata's StatefulDataLoader, with no set_epoch: the resumed loader yields the
    # next epoch whole (not an empty pass, not the finished epoch again).
    from torchdata.stateful_dataloader import StatefulDataLoader

    eps = endpoints(cluster, "lmdb")
    loader = StatefulDataLoader(
        EdgeDataset("tokens@1", endpoints=eps, **SMALL), batch_size=None, num_workers=workers
    )
    assert sorted(x for _, x in ids(loader)) == list(range(TOTAL))
    resumed = StatefulDataLoader(
        EdgeDataset("tokens@1", endpoints=eps, **SMALL), batch_size=None, num_workers=workers
    )
    resumed.load_state_dict(loader.state_dict())
    assert sorted(x for _, x in ids(resumed)) == list(range(TOTAL))


def test_persistent_workers_read_every_epoch(cluster) -> None:
    # A persistent worker keeps its copy of the dataset between epochs: it used to stay
    # at the end of the first epoch and yield nothing after it.
    eps = endpoints(cluster, "lmdb")
    ds = EdgeDataset("tokens@1", endpoints=eps, **SMALL)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True
    )
    epochs = [ids(loader) for _ in range(2)]
    for labels in epochs:
        assert sorted(x for _, x in labels) == list(range(TOTAL))
    assert epochs[0] != epochs[1]  # each its own epoch's order
    ds.close()


def test_a_mixture_naming_one_version_twice_is_refused_however_spelled(cluster) -> None:
    # "tokens" is tokens@1 (its latest): as two components every row would come twice.
    eps = endpoints(cluster, "lmdb")
    for spec in ({"tokens@1": 1, "tokens@01": 1}, {"tokens@1": 1, "tokens": 1}):
        with pytest.raises(ValueError, match="give each version once"):
            EdgeDataset(spec, endpoints=eps, **SMALL)
    with pytest.raises(ValueError, match="tokens@1 is named twice"):
        EdgeDataset({"tokens@latest": 2, "tokens@1": 1}, endpoints=eps, **SMALL)


def test_workers_started_by_forkserver_read_grpc_endpoints_exactly_once(cluster) -> None:
    # docs/dataset.md ("gRPC and fork") advises forkserver workers with gRPC endpoints:
    # each opens its channels in a process where gRPC never ran.
    ds = EdgeDataset("tokens@1", endpoints=endpoints(cluster, "grpc"), seed=3, **SMALL)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    assert sorted(x for _, x in ids(loader)) == list(range(TOTAL))
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_categorical_strings_arrive_packed_over_grpc_and_through_workers(
    tmp_path: Path, workers: int
) -> None:
    """pandas categoricals written to Parquet are dictionary-encoded strings: they came back
    as Python lists even with binary="packed", pickled per sample from each worker."""
    from torch.utils.data import DataLoader

    from edgecache.clients.packed import Packed

    names = ["cat", "dog", "ému", "yak"]
    (tmp_path / "src").mkdir()
    for part in range(2):
        labels = pa.array([names[(part * 50 + i) % 4] for i in range(50)]).dictionary_encode()
        ids = pa.array(range(part * 50, part * 50 + 50), pa.int64())
        table = pa.table({"id": ids, "animal": labels})
        pq.write_table(table, tmp_path / "src" / f"part-{part}.parquet")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/src", "zoo")
    node = start_local_node("eu", tmp_path / "cache", registry)  # a process: workers fork
    try:
        ds = EdgeDataset("zoo@1", endpoints=[node.address], batch_size=10, shuffle=True)
        seen = {}
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        for batch in loader:
            assert isinstance(batch["animal"], Packed), type(batch["animal"])
            for i, row in enumerate(batch["id"].tolist()):
                seen[row] = batch["animal"][i]
        ds.close()
    finally:
        node.stop()
    assert seen == {i: names[i % 4] for i in range(100)}
