"""Weighted mixtures, ``rows=`` splits and their resume, used as an ML engineer would.

Each test is a defect found by walking docs/dataset.md ("Weighted mixtures",
"Splits", "Resuming") against a real edge node on loopback, with real
DataLoader worker processes. The datasets are small (hundreds of rows) and
windows a few rows each, so every path (several passes of a tiny component,
several windows per lane) is taken quickly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish

from edgecache.cache.errors import StateMismatch
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node

WEB, CODE, TINY = 0, 100_000, 200_000  # first label of each dataset
SMALL = {"window_bytes": 240, "batch_size": 8}  # windows of 20 rows (12 bytes a row)


def table(first: int, rows: int, label: str = "int64") -> pa.Table:
    labels = np.arange(first, first + rows)
    return pa.table(
        {"label": pa.array(labels, pa.type_for_alias(label)), "x": pa.array(labels, pa.float32())}
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    """web@1 (2 × 300 rows), web@2 (latest), code@1 (200), tiny@1 (10), narrow@1 (int32 label)."""
    root = tmp_path_factory.mktemp("mixture")
    registry = f"file://{root}/registry"

    def put(name: str, folder: str, tables: list[pa.Table]) -> None:
        (root / folder).mkdir()
        for i, t in enumerate(tables):
            pq.write_table(t, root / folder / f"part-{i:05d}.parquet")
        publish(registry, f"file://{root}/{folder}", name, chunk_bytes=4096)

    put("web", "web1", [table(WEB, 300), table(WEB + 300, 300)])
    put("web", "web2", [table(WEB, 700)])
    put("code", "code", [table(CODE, 200)])
    put("tiny", "tiny", [table(TINY, 10)])
    put("narrow", "narrow", [table(300_000, 200, "int32")])
    started = start_local_node("eu", root / "cache", registry)
    yield started
    started.stop()


def ids(batches: object, column: str = "src") -> list[tuple[int, int]]:
    """(component, label) of every sample, in order."""
    return [
        (int(c), int(x))
        for b in batches  # type: ignore[attr-defined]
        for c, x in zip(b[column], b["label"], strict=True)
    ]


def read(ds: EdgeDataset, workers: int = 0) -> list[tuple[int, int]]:
    return ids(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    "weight",
    [np.float32(0.3), np.int64(3), torch.tensor(0.3)],
    ids=["np.float32", "np.int64", "torch-scalar"],
)
def test_weights_computed_with_numpy_or_torch_are_numbers(node: LocalNode, weight: object) -> None:
    # Weights are often computed (token counts, np.array(sizes) / total): a np.float32,
    # np.int64 or a 0-d tensor was refused as "must be a positive number, got 0.3".
    ds = EdgeDataset({"web@1": 0.7, "code@1": weight}, endpoints=node.address, **SMALL)
    assert ds.weights is not None and all(type(w) is float for w in ds.weights)
    assert ds.state_dict()["components"][1]["weight"] == float(weight)  # plain JSON


@pytest.mark.parametrize(
    ("weight", "advice"),
    [(0, "leave it out of the mapping"), (-0.5, "leave it out"), ("0.3", "a number")],
)
def test_a_bad_weight_says_what_to_do(node: LocalNode, weight: object, advice: str) -> None:
    # A weight of 0 is how a config turns a source off: it said only "must be a
    # positive number", not that the component is left out of the mapping instead.
    with pytest.raises(ValueError, match="weight of 'code@1' must be a positive number") as err:
        EdgeDataset({"web@1": 1, "code@1": weight}, endpoints=node.address, **SMALL)
    assert advice in str(err.value)


@pytest.mark.parametrize(
    ("spec", "samples"),
    [({"web@1": 1, "code@1": 1e-6}, None), ({"web@1": 0.5, "code@1": 0.5}, 1)],
    ids=["tiny-weight", "one-sample-epochs"],
)
def test_a_component_that_would_never_be_read_is_refused(
    node: LocalNode, spec: dict, samples: int | None
) -> None:
    # round(w * samples_per_epoch) was 0: code@1 gave no sample in any epoch, silently,
    # though it was asked for (1e-6 of 800 samples; one sample shared by two components).
    with pytest.raises(ValueError, match="code@1 gets no sample") as err:
        EdgeDataset(spec, endpoints=node.address, samples_per_epoch=samples, **SMALL)
    assert "samples_per_epoch" in str(err.value)


def test_samples_per_epoch_is_an_integer_not_a_bool(node: LocalNode) -> None:
    # samples_per_epoch=True was taken as 1 (an epoch of one sample); an np.int64 (from
    # a computation over the versions' sizes) was refused as not an integer.
    mix = {"web@1": 0.5, "code@1": 0.5}
    with pytest.raises(ValueError, match="samples_per_epoch must be a positive integer"):
        EdgeDataset(mix, endpoints=node.address, samples_per_epoch=True, **SMALL)
    ds = EdgeDataset(mix, endpoints=node.address, samples_per_epoch=np.int64(100), **SMALL)
    assert (
        ds.samples_per_epoch == 100 and type(ds.state_dict()["order"]["samples_per_epoch"]) is int
    )
    assert (
        len(
            read(
                EdgeDataset(
                    mix,
                    endpoints=node.address,
                    samples_per_epoch=np.int64(100),
                    component_column="src",
                    **SMALL,
                )
            )
        )
        == 100
    )


@pytest.mark.parametrize(
    ("rows", "expected"),
    [((np.int64(100), np.int64(250)), 150), ((np.float32(0.5), np.float64(1.0)), 300)],
    ids=["numpy-row-numbers", "numpy-fractions"],
)
def test_rows_computed_with_numpy_are_row_numbers_or_fractions(
    node: LocalNode, rows: tuple, expected: int
) -> None:
    # rows=(np.int64(100), np.int64(250)) was refused as "two fractions or two row
    # numbers", which it is; np.float32 fractions likewise.
    ds = EdgeDataset("web@1", endpoints=node.address, rows=rows, **{**SMALL, "batch_size": None})
    assert len(ds) == expected
    saved = ds.state_dict()["order"]["rows"]
    assert all(type(x) in (int, float) for x in saved)  # plain JSON


# ------------------------------------------------------------------ resume


def consumed_then_rest(
    make: object, state_from: object, *, steps: int, workers: int
) -> tuple[Counter, Counter]:
    """Samples of ``steps`` batches of ``make()``, then all ``state_from(state)`` yields after."""
    first = make()  # type: ignore[operator]
    loader = torch.utils.data.DataLoader(first, batch_size=None, num_workers=workers)
    seen: Counter = Counter()
    for step, batch in enumerate(loader):
        if step == steps:
            break
        seen.update(ids([batch]))
    resumed = state_from(first.state_dict(batches=steps))  # type: ignore[operator]
    return seen, Counter(read(resumed, workers))


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ({"web@1": 0.7, "code@1": 0.3}, {"web@1": 7, "code@1": 3}),  # percentages
        ("web@1", {"web@1": 1.0}),  # one component, as a mapping
    ],
    ids=["0.7/0.3-as-7/3", "string-as-mapping"],
)
def test_a_state_resumes_with_the_same_mixture_written_otherwise(
    node: LocalNode, saved: object, resumed: object
) -> None:
    # Weights are normalised, so {0.7, 0.3} and {7, 3} are one mixture with one order;
    # its state was refused ("the state's mixture weights [0.7, 0.3] differ from this
    # dataset's [7.0, 3.0]"), and so was "web@1"'s by {"web@1": 1.0} ([None] vs [1.0]).
    def make(spec: object) -> EdgeDataset:
        return EdgeDataset(
            spec,
            endpoints=node.address,
            component_column="src",
            seed=4,
            **SMALL,  # type: ignore[arg-type]
        )

    whole = Counter(read(make(saved)))

    def resume(state: dict) -> EdgeDataset:
        ds = make(resumed)
        ds.load_state_dict(state)
        return ds

    seen, rest = consumed_then_rest(lambda: make(saved), resume, steps=5, workers=0)
    assert seen + rest == whole and sum(seen.values()) == 40


def test_a_state_of_the_components_in_another_order_says_so(node: LocalNode) -> None:
    # It said "the state is for web@1, code@1 but this dataset reads code@1, web@1;
    # create EdgeDataset with the state's versions", which it had: only the order
    # differed (a config whose keys were sorted, say).
    state = EdgeDataset({"web@1": 0.7, "code@1": 0.3}, endpoints=node.address, **SMALL).state_dict()
    other = EdgeDataset({"code@1": 0.3, "web@1": 0.7}, endpoints=node.address, **SMALL)
    with pytest.raises(StateMismatch, match="another order") as err:
        other.load_state_dict(state)
    assert "{'web@1': 0.7, 'code@1': 0.3}" in str(err.value)


# ------------------------------------------------------------------ schemas


def test_columns_left_out_of_a_mixture_are_named(
    node: LocalNode, caplog: pytest.LogCaptureFixture
) -> None:
    # narrow@1's label is int32, web@1's int64: the mixture silently yielded x alone,
    # and the training loop's batch["label"] raised a bare KeyError far from the cause.
    with caplog.at_level("WARNING", logger="edgecache.clients.mixture"):
        ds = EdgeDataset({"web@1": 1, "narrow@1": 1}, endpoints=node.address, **SMALL)
    assert ds.columns == ["x"]
    said = caplog.text
    assert "label" in said and "int32" in said and "int64" in said and "columns=" in said


# ------------------------------------------------------------------ the walk


def test_a_split_mixture_with_a_tiny_component_resumes_exactly_across_layouts(
    node: LocalNode,
) -> None:
    # The documented loop: {web@latest, code, tiny} on the train split, 2 ranks with
    # 2 DataLoader workers each, a break at step 4 of epoch 1, resumed from rank 0's
    # state by 3 ranks with batches of 5 and no workers. tiny@1 (9 rows in the split)
    # is over-weighted: it runs through passes (docs: "Weighted mixtures"), every
    # other row at most once. Together the two stretches are exactly epoch 1.
    spec = {"web@latest": 0.6, "code@1": 0.3, "tiny@1": 0.1}

    def make(rank: int, world: int, batch: int) -> EdgeDataset:
        ds = EdgeDataset(
            spec,
            endpoints=node.address,
            rows=(0.0, 0.9),
            samples_per_epoch=300,
            component_column="src",
            seed=11,
            rank=rank,
            world_size=world,
            **{**SMALL, "batch_size": batch},
        )
        ds.set_epoch(1)
        return ds

    assert make(0, 2, 8).components == ["web@2", "code@1", "tiny@1"]  # latest, pinned
    whole = Counter(x for r in range(2) for x in read(make(r, 2, 8)))
    assert sum(whole.values()) == 300
    by_source = Counter(c for c, _ in whole.elements())
    assert by_source == {0: 180, 1: 90, 2: 30}
    assert {x for c, x in whole if c == 2} == set(range(TINY, TINY + 9))  # the split's rows
    assert all(n == 1 for (c, _), n in whole.items() if c != 2)
    seen: Counter = Counter()
    for rank in range(2):
        loader = torch.utils.data.DataLoader(make(rank, 2, 8), batch_size=None, num_workers=2)
        for step, batch in enumerate(loader):
            if step == 4:
                break
            seen.update(ids([batch]))
    state = make(0, 2, 8).state_dict(batches=4)
    rest: Counter = Counter()
    for rank in range(3):
        ds = make(rank, 3, 5)
        ds.load_state_dict(state)
        rest.update(read(ds))
    assert sum(seen.values()) == 64 and seen + rest == whole
