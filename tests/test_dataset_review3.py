"""EdgeDataset as an ML engineer uses it (a third review): small versions' mixing, nulls in
list columns, column types, argument checks, a resume with another seed, ranks with no
sample.

Every check reads a real node's LMDB cache (``lmdb://``) after the node staged the
versions from Parquet published to a file registry.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import StateMismatch
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.packed import Packed
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS  # labels 0..4199, stored in order: class = label // 420
CLASSES = 10


def _types_table() -> pa.Table:
    """20 rows: a list column with a null at row 7, and the types a review found odd."""
    n = 20
    return pa.table(
        {
            "idx": pa.array(range(n), pa.int64()),
            "rag": pa.array([None if i == 7 else [i] * (i % 3) for i in range(n)]),
            "digest": pa.array([bytes([i, i + 1, i + 2]) for i in range(n)], pa.binary(3)),
            "flags": pa.array([[i % 2 == 0] * (i % 3) for i in range(n)], pa.list_(pa.bool_())),
            "when": pa.array([datetime(2026, 1, 1 + i) for i in range(n)], pa.timestamp("us")),
        }
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalNode]]:
    """One node with tokens@1 (6 shards of 700 rows, 64 KiB chunks: 12 windows) and types@1."""
    root = tmp_path_factory.mktemp("review3")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    publish(registry, f"file://{root}/tokens", "wide", chunk_bytes=4 << 20)  # a shard a window
    (root / "types").mkdir()
    pq.write_table(_types_table(), root / "types" / "p.parquet")
    publish(registry, f"file://{root}/types", "types")
    node = start_local_node("eu", root / "cache", registry)
    for dataset in ("tokens", "types", "wide"):
        for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset=dataset, version=1)):
            pass
    yield root, node
    node.stop()


def make(
    cluster: tuple[Path, LocalNode], spec: object = "tokens@1", **kwargs: object
) -> EdgeDataset:
    return EdgeDataset(spec, endpoints=[f"lmdb://{cluster[0]}/cache"], **kwargs)  # type: ignore[arg-type]


def quiet(
    cluster: tuple[Path, LocalNode], spec: object = "tokens@1", **kwargs: object
) -> EdgeDataset:
    """A dataset made without showing its construction warnings (checked elsewhere)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(cluster, spec, **kwargs)


def made_warnings(
    cluster: tuple[Path, LocalNode], spec: object = "tokens@1", **kwargs: object
) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make(cluster, spec, **kwargs)
    return [str(w.message) for w in caught]


def distinct_classes(ds: EdgeDataset) -> float:
    """Mean distinct classes in the full batches of an epoch (labels stored class by class)."""
    counts = [
        len({int(x) // (TOTAL // CLASSES) for x in b["label"]})
        for b in ds
        if len(b["label"]) == ds.batch_size
    ]
    return float(np.mean(counts))


# ------------------------------------------------ 1. shuffle_windows on small versions


def test_a_version_with_too_few_windows_warns_and_names_a_window_bytes_that_mixes(
    cluster,
) -> None:
    # 12 windows of 64 KiB with lanes=4, shuffle_windows=16: every batch came from one
    # window (one class of a class-sorted version), silently.
    said = [m for m in made_warnings(cluster, batch_size=32) if "shuffle_windows" in m]
    assert len(said) == 1, said
    text = said[0]
    assert "tokens@1" in text and "draws from 1 window" in text and "12 windows" in text
    found = re.search(r"window_bytes=(\d+)", text)
    assert found and "read and decoded about" in text
    suggested = int(found.group(1))
    assert suggested < 64 << 10

    plain = quiet(cluster, batch_size=32, seed=3)
    assert plain.epoch_order().order.per_lane == 1
    assert distinct_classes(plain) < 2.5
    # The window size it names restores the mixing asked for, and warns no more.
    assert [m for m in made_warnings(cluster, batch_size=32, window_bytes=suggested)] == []
    mixed = make(cluster, batch_size=32, seed=3, window_bytes=suggested)
    assert mixed.epoch_order().order.per_lane == 16
    assert distinct_classes(mixed) > 7


def test_the_window_bytes_named_fits_shards_smaller_than_a_chunk(cluster) -> None:
    # 4 MiB chunks over shards of 95 KB: each shard is one window. A size worked out
    # from the chunk size named 16 B windows (one row each, every chunk read 700 times).
    [text] = [m for m in made_warnings(cluster, "wide@1", batch_size=32) if "draws from" in m]
    assert "6 windows" in text
    suggested = int(re.search(r"window_bytes=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert 1 << 10 <= suggested < 4 << 10
    assert quiet(cluster, "wide@1", window_bytes=suggested).epoch_order().order.per_lane == 16


def test_no_mixing_warning_without_shuffle_or_with_one_window_per_batch(cluster) -> None:
    for kwargs in ({"shuffle": False}, {"shuffle_windows": 1}):
        assert made_warnings(cluster, batch_size=32, **kwargs) == []


# ------------------------------------------------ 3. a null in a variable-length list


@pytest.mark.parametrize("ragged", ["padded", "packed"])
def test_a_null_list_raises_like_a_null_number_instead_of_reading_as_empty(
    cluster, ragged: str
) -> None:
    ds = quiet(
        cluster, "types@1", columns=["idx", "rag"], ragged=ragged, batch_size=5, shuffle=False
    )
    with pytest.raises(ValueError, match=r"column 'rag' has nulls.*columns=") as err:
        list(ds)
    assert "types@1" in str(err.value)


# ------------------------------------------------ 4. column types


def test_fixed_size_binary_is_packed_and_a_list_of_bools_is_a_tensor(cluster) -> None:
    table = _types_table()
    for workers in (0, 2):
        ds = quiet(cluster, "types@1", columns=["idx", "digest", "flags"], batch_size=8)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        for batch in loader:
            idx = batch["idx"].tolist()
            assert isinstance(batch["digest"], Packed)
            assert batch["digest"].tolist() == [table["digest"][i].as_py() for i in idx]
            assert batch["flags"].dtype == torch.bool
            lengths = batch["flags_lengths"].tolist()
            got = [batch["flags"][r, : lengths[r]].tolist() for r in range(len(idx))]
            assert got == [table["flags"][i].as_py() for i in idx]
    listed = quiet(
        cluster, "types@1", columns=["idx", "digest", "flags"], binary="list", ragged="packed"
    )
    batch = next(iter(listed))
    idx = batch["idx"].tolist()
    assert batch["digest"] == [table["digest"][i].as_py() for i in idx]
    assert isinstance(batch["flags"], Packed) and batch["flags"].values.dtype == torch.bool
    assert [v.tolist() for v in batch["flags"]] == [table["flags"][i].as_py() for i in idx]


# ------------------------------------------------ 5. argument checks


@pytest.mark.parametrize("column", ["", 3])
def test_a_component_column_that_is_not_a_name_is_refused(cluster, column: object) -> None:
    with pytest.raises(ValueError, match="component_column must be a non-empty string"):
        make(cluster, {"tokens@1": 1, "types@1": 1}, columns=["idx"], component_column=column)


@pytest.mark.parametrize("columns", [3, [3], ["idx", ""]])
def test_columns_that_are_not_names_raise_a_value_error_naming_the_parameter(
    cluster, columns: object
) -> None:
    with pytest.raises(ValueError, match="columns must"):
        make(cluster, "types@1", columns=columns)


# ------------------------------------------------ 6. load_state_dict with another seed


def test_a_state_of_another_seed_is_refused(cluster) -> None:
    first = quiet(cluster, batch_size=40, seed=9)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    del iterator
    other = quiet(cluster, batch_size=40, seed=10)
    with pytest.raises(StateMismatch, match=r"seed=9.*seed=10"):
        other.load_state_dict(state)
    assert other.seed == 10
    same = quiet(cluster, batch_size=40, seed=9)
    same.load_state_dict(state)
    assert len(same) == len(first) - 3


# ------------------------------------------------ 7. a rank with no sample


def test_a_rank_with_no_sample_warns_at_construction(cluster) -> None:
    said = made_warnings(cluster, "types@1", batch_size=None, shuffle=False, rank=25, world_size=30)
    assert any("rank 25 of 30 gets no sample" in m and "DDP" in m for m in said), said
    ds = quiet(cluster, "types@1", batch_size=None, shuffle=False, rank=25, world_size=30)
    assert len(ds) == 0
    assert not [
        m
        for m in made_warnings(
            cluster, "types@1", batch_size=None, shuffle=False, rank=3, world_size=30
        )
        if "no sample" in m
    ]


def test_a_batch_larger_than_every_ranks_share_with_drop_last_names_the_batch(cluster) -> None:
    """drop_last with a batch larger than each rank's share: every rank yields nothing, and
    each was told it "gets no sample … use fewer ranks than samples", with fewer ranks
    than samples already (a helper's hunt). The warning names the batch and the size that
    works; followed, every rank yields a batch."""
    total = len(quiet(cluster, "types@1", batch_size=None, shuffle=False))
    share = total // 2
    said = made_warnings(
        cluster, "types@1", batch_size=share + 2, drop_last=True, rank=1, world_size=2
    )
    assert not any("gets no sample" in m for m in said), said
    (message,) = [m for m in said if "drop_last=True" in m]
    assert f"batch_size of at most {share}" in message, message
    for rank in (0, 1):
        ds = quiet(
            cluster, "types@1", columns=["idx"], batch_size=share, drop_last=True,
            rank=rank, world_size=2,
        )  # fmt: skip
        assert len(ds) == 1 and len(list(ds)) == 1


def test_the_mixing_advice_says_lower_lanes_only_where_there_are_lanes_to_lower(cluster) -> None:
    """At lanes=1 the small-version warning still advised "lower lanes", the least there
    is already (lanes=0 is refused; a helper's hunt)."""
    for lanes, said_lanes in ((1, False), (2, True)):
        said = [m for m in made_warnings(cluster, lanes=lanes, shuffle_windows=4) if "window" in m]
        assert said and all(("lower lanes" in m) is said_lanes for m in said), (lanes, said)
        assert all("window_bytes=" in m for m in said), said
