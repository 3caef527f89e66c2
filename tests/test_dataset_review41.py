"""Passes with and without DataLoader workers in any order, and order settings across ranks.

* Without ``set_epoch``, a pass without workers (``num_workers=0`` or ``for b in
  ds``) after an epoch read to its end with workers read that epoch again: the
  training process only learnt where workers had gone when a later pass with
  workers began. Loaders of 2, 3, then 0 workers read epochs 0, 1, 1. Now every
  sequence of passes reads epochs 0, 1, 2, … as ``num_workers=0`` throughout
  would, and ``ds.epoch``, ``len(ds)`` and ``state_dict()`` say the next one.
* Under torch.distributed, ranks built with ``seed=5 + rank`` ran without a word
  and read an epoch with hundreds of samples twice and as many never: the order
  settings are now checked across ranks where the versions are broadcast.

Every check reads a real node's LMDB cache (``lmdb://``) and compares the samples
read, batch by batch, with a reference read at ``num_workers=0``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import rank_order_child
import torch
import torch.multiprocessing as torch_mp
from edgeutil import publish, stub, write_parquet_shards
from s3server import free_port

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS  # labels 0..4199
# Rank 0 of 2, batches of 50: 42 batches an epoch, 21 per worker at 2 workers, 14 at 3.
SMALL = {"window_bytes": 24 << 10, "batch_size": 50, "rank": 0, "world_size": 2, "seed": 5}
BATCHES = 42


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``lmdb://`` of a node's cache holding tokens@1 (the node is stopped once it is staged)."""
    root = tmp_path_factory.mktemp("review41")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    node = start_local_node("eu", root / "cache", registry)
    try:
        for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)):
            pass
    finally:
        node.stop()
    return f"lmdb://{root}/cache"


def make(cache: str, **kwargs: object) -> EdgeDataset:
    return EdgeDataset("tokens@1", endpoints=[cache], **{**SMALL, **kwargs})  # type: ignore[arg-type]


def labels(batch: dict) -> list[int]:
    return [int(x) for x in batch["label"]]


@pytest.fixture(scope="module")
def reference(cache: str) -> dict[int, list[list[int]]]:
    """Each epoch's batches read at num_workers=0 after set_epoch: what every pass must read."""
    out = {}
    for epoch in range(12):
        ds = make(cache)
        ds.set_epoch(epoch)
        out[epoch] = [labels(b) for b in ds]
        assert len(out[epoch]) == BATCHES
    return out


def which(reference: dict[int, list[list[int]]], got: list[list[int]]) -> object:
    return next((e for e, batches in reference.items() if batches == got), "?")


def loader(ds: EdgeDataset, workers: int, persistent: bool = False) -> torch.utils.data.DataLoader:
    more = {"persistent_workers": True} if persistent else {}
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **more)


def read(source: object, steps: int | None = None) -> list[list[int]]:
    """The batches of one pass over ``source`` (the dataset or a loader), ``steps`` at most."""
    out: list[list[int]] = []
    for batch in source:  # type: ignore[attr-defined]
        out.append(labels(batch))
        if steps is not None and len(out) == steps:
            break
    return out


# ------------------------------------------------ a pass without workers after one with


@pytest.mark.parametrize(
    ("workers", "persistent"), [(2, False), (2, True), (3, False)], ids=["2", "2p", "3"]
)
@pytest.mark.parametrize("then", ["loader0", "direct"])
def test_a_pass_without_workers_after_an_epoch_with_workers_reads_the_next(
    cache, reference, workers: int, persistent: bool, then: str
) -> None:
    ds = make(cache)
    assert read(loader(ds, workers, persistent)) == reference[0]
    # The training process follows the workers at once: the epoch, its length, a
    # checkpoint without a step count, and with the pass's step count.
    assert ds.epoch == 1 and len(ds) == BATCHES
    assert (ds.state_dict()["epoch"], ds.state_dict()["batches"]) == (1, 0)
    assert (ds.state_dict(batches=BATCHES)["epoch"], ds.state_dict(batches=BATCHES)["batches"]) == (
        1,
        0,
    )
    second = read(loader(ds, 0) if then == "loader0" else ds)
    assert which(reference, second) == 1
    assert ds.epoch == 2 and ds.state_dict()["epoch"] == 2
    ds.close()


@pytest.mark.parametrize(
    "sequence",
    [
        ["direct", 2, "direct"],
        [2, "direct", 2],
        [2, 3, 0],
        [0, 2, 3],
        [3, 0, 2, "direct"],
        [(2, True), "direct", (2, True)],
        [(2, True), (3, True), 0],
        ["direct", (3, True), 2, (2, True)],
    ],
    ids=str,
)
def test_any_sequence_of_loaders_reads_the_epochs_in_turn(cache, reference, sequence) -> None:
    ds = make(cache)
    epochs, states = [], []
    for step in sequence:
        workers, persistent = step if isinstance(step, tuple) else (step, False)
        assert len(ds) == BATCHES
        source = ds if workers == "direct" else loader(ds, workers, persistent)
        epochs.append(which(reference, read(source)))
        states.append((ds.epoch, ds.state_dict(batches=BATCHES)["epoch"]))
    n = len(sequence)
    assert epochs == list(range(n))
    assert states == [(e + 1, e + 1) for e in range(n)]
    ds.close()


def test_one_persistent_loader_used_again_after_other_passes_goes_on(cache, reference) -> None:
    # A persistent loader's workers keep their own copy: after another loader's passes
    # they went by their own last pass, not by where the passes since had left the epochs.
    ds = make(cache)
    kept = loader(ds, 2, persistent=True)
    got = [read(kept), read(loader(ds, 3)), read(kept), read(ds), read(kept)]
    assert [which(reference, g) for g in got] == [0, 1, 2, 3, 4]
    # Broken off in another loader (no worker read its share to the end): read again whole.
    assert read(loader(ds, 3), steps=4) == reference[5][:4]
    assert read(kept) == reference[5]
    assert read(ds, steps=3) == reference[6][:3]
    assert read(kept) == reference[6]
    assert ds.epoch == 7
    ds.close()


def test_random_sequences_of_passes_and_breaks_read_as_without_workers(cache, reference) -> None:
    # A model of num_workers=0: a pass read to its end moves to the next epoch, a pass
    # broken off (early: no worker had read its share to the end) leaves the dataset
    # where it was, set_epoch puts it anywhere. Each step also checks what the training
    # process says (epoch, len, state_dict with and without the step count).
    for seed in (1, 2):
        rng = random.Random(seed)
        ds = make(cache)
        persistent = {n: loader(ds, n, persistent=True) for n in (2, 3)}
        epoch = 0
        for _ in range(14):
            kind = rng.choice(["direct", "0", "2", "3", "p2", "p3", "set_epoch"])
            if kind == "set_epoch":
                epoch = rng.randrange(0, 6)
                ds.set_epoch(epoch)
                assert (ds.epoch, len(ds)) == (epoch, BATCHES)
                continue
            if kind == "direct":
                source: object = ds
            elif kind.startswith("p"):
                source = persistent[int(kind[1:])]
            else:
                source = loader(ds, int(kind))
            steps = rng.choice([None, None, 1, 5])
            got = read(source, steps)
            where = f"seed {seed}, {kind}, steps {steps}, epoch {epoch}"
            if steps is None:
                assert got == reference[epoch], where
                epoch += 1
                state = ds.state_dict(batches=BATCHES)
                assert (state["epoch"], state["batches"]) == (epoch, 0), where
            else:
                assert got == reference[epoch][:steps], where
                state = ds.state_dict(batches=steps)
                assert (state["epoch"], state["batches"]) == (epoch, steps), where
                resumed = make(cache)
                resumed.load_state_dict(state)
                assert read(resumed) == reference[epoch][steps:], where
            assert (ds.epoch, len(ds)) == (epoch, BATCHES), where
        ds.close()


def test_a_checkpoint_while_the_loop_takes_what_workers_read_ahead(cache, reference) -> None:
    # The workers have read the epoch to its end while the loop still takes the last
    # batches: a checkpoint at step 40 of 42 is step 40 of this epoch, not of the next.
    ds = make(cache)
    it = iter(loader(ds, 2))
    got = [labels(next(it)) for _ in range(40)]
    time.sleep(0.5)  # the workers answer the requests read ahead: both reach their end
    state = ds.state_dict(batches=40)
    assert (state["epoch"], state["batches"]) == (0, 40)
    resumed = make(cache)
    resumed.load_state_dict(state)
    assert read(resumed) == reference[0][40:]
    got += [labels(b) for b in it]
    assert got == reference[0]
    state = ds.state_dict(batches=BATCHES)
    assert (state["epoch"], state["batches"], ds.epoch) == (1, 0, 1)
    # A break there counts as the epoch's end (the workers read it all), for the next
    # pass with workers or without, but the checkpoint at the break still resumes it.
    ds = make(cache)
    part = read(loader(ds, 2), steps=BATCHES - 1)
    assert part == reference[0][:-1]
    assert ds.state_dict(batches=BATCHES - 1)["epoch"] == 0
    assert read(ds) in (reference[0], reference[1])
    ds.close()


# ------------------------------------------------ order settings across ranks


def test_order_settings_that_differ_across_ranks_raise_on_every_rank(cache, tmp_path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    out = str(tmp_path / "rank{rank}.json")
    torch_mp.spawn(rank_order_child.run, args=(init, cache, out), nprocs=2, join=True)
    reports = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(2)]
    values = {
        "seed": "rank 0: 5, rank 1: 6",
        "shuffle_windows": "rank 0: 4, rank 1: 8",
        "rows": "rank 0: [0.0, 0.5], rank 1: [0.0, 0.6]",
        "lanes": "rank 0: 4, rank 1: 2",
        "window_bytes": f"rank 0: {24 << 10}, rank 1: {48 << 10}",
        "samples_per_epoch": "rank 0: None, rank 1: 1000",
    }
    for name, said in values.items():
        messages = [r[name].get("raised") for r in reports]
        assert messages[0] == messages[1], name  # every rank raises, with the same words
        assert messages[0] is not None and f"{name} differ" in messages[0], messages[0]
        assert f"({said})" in messages[0], messages[0]
        assert "every rank must build EdgeDataset with the same" in messages[0]
    assert "seed per-rank augmentation elsewhere" in reports[0]["seed"]["raised"]
    for name, rows in (("same", TOTAL), ("same windows", TOTAL), ("same rows", TOTAL // 2)):
        # The same order on both ranks: the epoch read exactly once between them.
        read_by = [r[name]["labels"] for r in reports]
        assert sorted(read_by[0] + read_by[1]) == list(range(rows)), name
    # Unshuffled, per-rank seeds: the ranks share one order, each reading its own share.
    read_by = [r["unshuffled"]["labels"] for r in reports]
    assert sorted(read_by[0] + read_by[1]) == list(range(TOTAL))


def test_settings_spelled_differently_for_the_same_order_are_the_same(cache) -> None:
    # What the ranks compare: the order each asks for, not how the settings are spelled.
    from edgecache.clients.dataset import _differing_order

    manifests = make(cache).manifests
    chunk = 64 << 10  # edgeutil.publish's chunk size: the default window
    base = {
        "spec": ["tokens@1"],
        "weights": None,
        "seed": 5,
        "shuffle": True,
        "shuffle_windows": 16,
        "lanes": 4,
        "window_bytes": None,
        "rows": None,
        "samples_per_epoch": None,
    }
    same = [base, {**base, "window_bytes": chunk, "samples_per_epoch": TOTAL}]
    assert _differing_order(same, manifests) == ""
    mixed = {**base, "spec": ["tokens@1", "tokens@1"], "weights": [0.7, 0.3]}
    pair = [mixed, {**mixed, "weights": [7, 3]}]
    assert _differing_order(pair, manifests * 2) == ""
    said = _differing_order([mixed, {**mixed, "weights": [0.5, 0.5]}], manifests * 2)
    assert said.startswith("weights differ across ranks (rank 0: [0.7, 0.3], rank 1: [0.5, 0.5])")
    # Many ranks: each value once, with the ranks that hold it (a few named).
    ranks = [base] * 6 + [{**base, "seed": 6, "spec": ["tokens@2"]}]
    said = _differing_order(ranks, manifests).splitlines()
    assert said[0].startswith(
        "spec differs across ranks (ranks 0, 1, 2, 3 and 2 more: ['tokens@1']; rank 6: "
        "['tokens@2']): every rank must build EdgeDataset with the same dataset spec"
    )
    assert said[1].startswith(
        "seed differs across ranks (ranks 0, 1, 2, 3 and 2 more: 5; rank 6: 6)"
    )
