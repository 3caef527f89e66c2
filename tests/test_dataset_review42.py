"""Review 42: resuming, mixtures' errors and component_column, as an ML engineer met them.

1. A state saved with ``rows=(0.5, 1.0)`` was refused by a dataset with
   ``rows=(2100, 4200)`` of the same 4,200 rows (the same epoch order), though
   the ranks' check already took them as one split.
2. A state saved at another ``window_bytes`` named ``window_rows``, which the
   user never set.
3. A null in one component of a mixture was said without the component.
4. ``component_column`` named after a column one component has (left out of the
   mixture) read as that data; ``x_lengths`` beside a fixed-size ``x`` (no such
   column) was refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import ShardNotCached, StateMismatch
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``lmdb://`` of a cache holding tokens@1, and extra@1 (label with a null, and kind)."""
    root = tmp_path_factory.mktemp("review42")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    (root / "extra").mkdir()
    label = pa.array([*range(99), None, *range(100, 300)], type=pa.int64())
    ids = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(300 * 32, dtype=np.int32)), 32)
    kind = pa.array(["x"] * 300)
    pq.write_table(
        pa.table({"input_ids": ids, "label": label, "kind": kind}), root / "extra" / "a.parquet"
    )
    publish(registry, f"file://{root}/extra", "extra")
    node = start_local_node("eu", root / "cache", registry)
    try:
        for name in ("tokens", "extra"):
            for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)):
                pass
    finally:
        node.stop()
    return f"lmdb://{root}/cache"


def make(cache: str, spec: object = "tokens@1", **kwargs: object) -> EdgeDataset:
    options = {"window_bytes": 24 << 10, "batch_size": 50, "seed": 5, **kwargs}
    return EdgeDataset(spec, endpoints=[cache], **options)  # type: ignore[arg-type]


def labels(ds: EdgeDataset) -> list[list[int]]:
    return [[int(x) for x in b["label"]] for b in ds]


def test_a_state_resumes_under_the_same_split_written_another_way(cache: str) -> None:
    for saved, loaded in (((0.5, 1.0), (TOTAL // 2, TOTAL)), ((0.0, 1.0), None)):
        first = make(cache, rows=saved)
        batches = iter(first)
        read = [[int(x) for x in next(batches)["label"]] for _ in range(3)]
        state = first.state_dict()
        first.close()
        whole = labels(make(cache, rows=saved))
        second = make(cache, rows=loaded)
        second.load_state_dict(state)
        assert read + labels(second) == whole, (saved, loaded)
        second.close()
    # Another split is still refused, naming the knob.
    with pytest.raises(StateMismatch, match=r"rows=\[0\.0, 0\.5\].*use the same value"):
        make(cache, rows=(0.0, 0.6)).load_state_dict(make(cache, rows=(0.0, 0.5)).state_dict())


def test_a_state_of_another_window_size_names_window_bytes(cache: str) -> None:
    state = make(cache).state_dict()
    with pytest.raises(StateMismatch) as info:
        make(cache, window_bytes=48 << 10).load_state_dict(state)
    said = str(info.value)
    assert f"this dataset's window_bytes={48 << 10} gives" in said, said
    assert "create EdgeDataset with the window_bytes the run was saved with" in said, said
    with pytest.raises(StateMismatch, match=r"window_bytes=None \(the chunk size\) gives"):
        make(cache, window_bytes=None).load_state_dict(state)


def test_a_null_in_a_mixture_names_the_component_that_holds_it(cache: str) -> None:
    ds = make(cache, {"tokens@1": 0.5, "extra@1": 0.5}, columns=["label"])
    with pytest.raises(ValueError, match=r"extra@1 shard 0: column 'label' has nulls"):
        labels(ds)


def test_component_column_may_not_name_a_column_a_component_has(cache: str) -> None:
    mixture = {"tokens@1": 0.5, "extra@1": 0.5}
    # kind is left out of the mixture's columns: tokens@1 lacks it
    with pytest.raises(ValueError, match=r"'kind' names a column of extra@1 that the batches"):
        make(cache, mixture, component_column="kind")
    with pytest.raises(ValueError, match=r"'label' names a column of the batches"):
        make(cache, mixture, columns=["input_ids", "label"], component_column="label")
    # input_ids is fixed-size: no input_ids_lengths column, so the name is free.
    ds = make(cache, "tokens@1", columns=["input_ids"], component_column="input_ids_lengths")
    batch = next(iter(ds))
    assert set(batch) == {"input_ids", "input_ids_lengths"}
    assert batch["input_ids_lengths"].tolist() == [0] * 50
    ds.close()


def test_latest_over_local_caches_is_the_newest_any_of_them_keeps(tmp_path) -> None:
    """lmdb:// endpoints only: @latest was the newest version of the first cache that kept
    the dataset, d@1 here, though the second keeps d@2."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=200)
    for _ in range(2):
        publish(registry, f"file://{tmp_path}/origin", "d")
    for version in (1, 2):
        node = start_local_node("eu", tmp_path / f"cache{version}", registry)
        try:
            for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset="d", version=version)):
                pass
        finally:
            node.stop()
    caches = [f"lmdb://{tmp_path}/cache1", f"lmdb://{tmp_path}/cache2"]
    ds = EdgeDataset("d", endpoints=caches, batch_size=50)
    assert ds.components == ["d@2"]
    assert sum(len(b["label"]) for b in ds) == 200  # read from the second cache
    ds.close()
    # Named, a version comes from the first cache that keeps it, as before.
    one = EdgeDataset("d@1", endpoints=caches, batch_size=50)
    assert one.components == ["d@1"]
    one.close()


@pytest.mark.parametrize(
    "saved",
    [[0, TOTAL // 2, 7], {"lo": 0, "hi": TOTAL // 2}, ["0", str(TOTAL // 2)], [True, TOTAL]],
)
def test_a_malformed_rows_in_a_state_is_a_mismatch(cache: str, saved: object) -> None:
    """Three values, a mapping, text or a bool where rows= has two numbers: refused as a
    mismatch (three values were cut to two and resumed, a mapping raised KeyError)."""
    state = make(cache, rows=(0, TOTAL // 2)).state_dict()
    state["order"]["rows"] = saved
    with pytest.raises(StateMismatch, match=r"the state was saved with rows="):
        make(cache, rows=(0, TOTAL // 2)).load_state_dict(state)


def test_every_component_a_local_cache_lacks_is_named_at_once(tmp_path) -> None:
    """lmdb:// alone, a mixture whose two components were evicted: the error named the first
    only, and the second came up once the first was staged again."""
    registry = f"file://{tmp_path}/registry"
    for name in ("web", "code"):
        write_parquet_shards(tmp_path / name, 1, rows=200)
        publish(registry, f"file://{tmp_path}/{name}", name)
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        for name in ("web", "code"):
            for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)):
                pass
            stub(node.address).Evict(edge_pb2.EvictRequest(dataset=name, version=1), timeout=30)
    finally:
        node.stop()
    with pytest.raises(ShardNotCached) as raised:
        make(f"lmdb://{tmp_path}/cache", {"web@1": 0.5, "code@1": 0.5})
    message = str(raised.value)
    assert "holds no shard of web@1, code@1, only their manifests" in message, message
    assert "edgecache warm web@1 --region" in message and "the same for code@1" in message
