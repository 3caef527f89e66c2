"""EdgeDataset's Prometheus metrics, scraped over HTTP from a real training loop.

A real edge node (subprocess), real DataLoader worker processes: what the
workers read reaches the main process with their batches and is served from
there, per rank. The data-wait counter is what the stall alert watches.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

import pytest
import torch
from edgeutil import publish, write_parquet_shards
from prometheus_client.parser import text_string_to_metric_families

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node

SHARDS, ROWS = 4, 300
TOTAL = SHARDS * ROWS
SMALL = {"window_bytes": 24 << 10, "batch_size": 50}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    root = tmp_path_factory.mktemp("metrics")
    write_parquet_shards(root / "origin", SHARDS, rows=ROWS)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    node = start_local_node("eu", root / "cache", f"file://{root}/registry")
    yield node
    node.stop()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, frozenset(labels.items()))]


def counted(after: dict, before: dict, name: str, **labels: str) -> float:
    """What a counter grew by: the counters are per process, and an earlier test in it
    (another module, reading tokens@1 as rank 0 too) counted into the same series."""
    return value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_scrape_counts_what_the_training_loop_got(node: LocalNode, workers: int) -> None:
    ds = EdgeDataset("tokens@1", endpoints=[node.address], metrics_port=0, seed=workers, **SMALL)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    before = scrape(ds.metrics_port)  # type: ignore[arg-type]
    got = batches = 0
    # With workers only the main process sees the loop wait: watch() times it.
    for batch in ds.watch(loader) if workers else loader:
        got += len(batch["label"])
        batches += 1
    metrics = scrape(ds.metrics_port)  # type: ignore[arg-type]
    rank = {"rank": "0", "dataset": "tokens@1"}
    assert got == TOTAL
    assert counted(metrics, before, "edgecache_client_samples_total", **rank) == TOTAL
    assert counted(metrics, before, "edgecache_client_batches_total", **rank) == batches
    assert counted(metrics, before, "edgecache_client_failovers_total", **rank) == 0
    assert counted(metrics, before, "edgecache_client_data_wait_seconds_total", **rank) > 0
    read = counted(
        metrics, before, "edgecache_client_read_bytes_total", endpoint=node.address, **rank
    )
    assert read >= TOTAL * 32 * 4 * 0.3  # int32 ids, compressed on the wire
    assert value(metrics, "edgecache_client_endpoint_in_use", endpoint=node.address, **rank) == 1
    ds.close()


def test_an_unmeasured_wait_is_left_out_not_reported_as_zero(node: LocalNode) -> None:
    """With workers and no watch(), nothing sees the loop wait: a series of 0 s would keep
    the training-waits-for-data alert silent however long the GPU waited. Rank 3 is this
    test's alone (the counters are per process)."""
    ds = EdgeDataset(
        "tokens@1", endpoints=[node.address], rank=3, world_size=4, metrics_port=0, **SMALL
    )
    rank = {"rank": "3", "dataset": "tokens@1"}
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sum(len(b["label"]) for b in loader) > 0
    metrics = scrape(ds.metrics_port)  # type: ignore[arg-type]
    assert value(metrics, "edgecache_client_samples_total", **rank) > 0
    wait = ("edgecache_client_data_wait_seconds_total", frozenset(rank.items()))
    assert wait not in metrics
    for _ in ds.watch(loader):  # measured from here on
        pass
    assert value(scrape(ds.metrics_port), *wait[:1], **rank) > 0  # type: ignore[arg-type]
    ds.close()


def test_ranks_are_labelled_and_an_unused_endpoint_is_not_in_use(node: LocalNode) -> None:
    with socket.socket() as s:  # a port nothing listens on: ranked last, never read from
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    datasets = [
        EdgeDataset(
            "tokens@1",
            endpoints=[node.address, dead],
            rank=rank,
            world_size=2,
            metrics_port=0,
            **SMALL,
        )
        for rank in (0, 1)
    ]
    before = scrape(datasets[0].metrics_port)  # type: ignore[arg-type]
    for ds in datasets:
        for _ in ds:
            pass
    metrics = scrape(datasets[0].metrics_port)  # type: ignore[arg-type]
    assert datasets[0].metrics_port == datasets[1].metrics_port  # one server per process
    samples = [
        counted(metrics, before, "edgecache_client_samples_total", rank=str(r), dataset="tokens@1")
        for r in (0, 1)
    ]
    assert sum(samples) == TOTAL and min(samples) > 0
    labels = {"rank": "0", "dataset": "tokens@1"}
    assert value(metrics, "edgecache_client_endpoint_in_use", endpoint=dead, **labels) == 0
    assert (
        counted(metrics, before, "edgecache_client_read_bytes_total", endpoint=dead, **labels) == 0
    )
    for ds in datasets:
        ds.close()


def test_counters_never_go_down_when_a_dataset_is_collected(node: LocalNode) -> None:
    """An evaluation dataset dropped after its pass took what it counted with it: every
    ``_total`` of its label set went down, which Prometheus reads as a counter reset."""
    import gc

    rank = {"rank": "0", "dataset": "tokens@1"}
    names = [
        "edgecache_client_samples_total",
        "edgecache_client_batches_total",
        "edgecache_client_data_wait_seconds_total",
    ]
    train = EdgeDataset("tokens@1", endpoints=[node.address], metrics_port=0, **SMALL)
    for _ in train:
        pass
    evaluation = EdgeDataset("tokens@1", endpoints=[node.address], metrics_port=0, **SMALL)
    for _ in evaluation:
        pass
    evaluation.close()
    port = train.metrics_port
    before = scrape(port)  # type: ignore[arg-type]
    del evaluation
    gc.collect()
    after = scrape(port)  # type: ignore[arg-type]
    for name in [*names, "edgecache_client_read_bytes_total"]:
        extra = {"endpoint": node.address} if name.endswith("read_bytes_total") else {}
        assert value(after, name, **rank, **extra) >= value(before, name, **rank, **extra), name
    assert value(after, "edgecache_client_samples_total", **rank) >= 2 * TOTAL
    train.close()


def test_the_port_comes_from_the_environment_per_local_rank(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("EDGECACHE_CLIENT_METRICS_PORT", str(free - 1))
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second process on this host
    ds = EdgeDataset("tokens@1", endpoints=[node.address], **SMALL)
    assert ds.metrics_port == free
    next(iter(ds))
    assert value(scrape(free), "edgecache_client_batches_total", rank="0", dataset="tokens@1") > 0
    ds.close()
    monkeypatch.setenv("EDGECACHE_CLIENT_METRICS_PORT", "not-a-port")
    with pytest.raises(ValueError, match="EDGECACHE_CLIENT_METRICS_PORT"):
        EdgeDataset("tokens@1", endpoints=[node.address], **SMALL)


def test_a_metrics_port_mistake_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port in use was a bare 'Errno 98' from the constructor (one metrics_port given to
    every rank of a host), 70000 an OverflowError, a bad $LOCAL_RANK a bare int() error."""

    from edgecache.clients.dataset_metrics import PORT_VARIABLE, port_from_environment, serve

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104 - where serve() binds
        taken.listen()
        with pytest.raises(ValueError, match=rf"port {taken.getsockname()[1]}.*\${PORT_VARIABLE}"):
            serve(taken.getsockname()[1])
    with pytest.raises(ValueError, match="0..65535"):
        serve(70000)
    monkeypatch.setenv(PORT_VARIABLE, "9400")
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match=r"\$LOCAL_RANK must be a number"):
        port_from_environment()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert port_from_environment() == 9403


def test_a_training_split_and_its_evaluation_split_are_series_of_their_own(
    node: LocalNode,
) -> None:
    """rows=(0.0, 0.9) and rows=(0.9, 1.0) of one version were one series: evaluation's
    samples and waits counted as the training loop's."""
    train = EdgeDataset(
        "tokens@1", endpoints=[node.address], metrics_port=0, rows=(0.0, 0.9), **SMALL
    )
    val = EdgeDataset("tokens@1", endpoints=[node.address], rows=(0.9, 1.0), **SMALL)
    before = scrape(train.metrics_port)  # type: ignore[arg-type]
    got = {name: sum(len(b["label"]) for b in ds) for name, ds in (("train", train), ("val", val))}
    metrics = scrape(train.metrics_port)  # type: ignore[arg-type]
    for name, label in (("train", "tokens@1 rows 0.0:0.9"), ("val", "tokens@1 rows 0.9:1.0")):
        samples = counted(
            metrics, before, "edgecache_client_samples_total", rank="0", dataset=label
        )
        assert samples == got[name], (name, samples, got)
    assert got["train"] + got["val"] == TOTAL
    train.close()
    val.close()


@pytest.mark.parametrize(
    ("rank", "dataset_batch", "loader_batch", "shared"),
    [
        (5, None, 50, "1"),  # samples, collated by the DataLoader in its workers
        (6, None, None, "1"),  # samples, one by one
        (7, 50, None, "0"),  # batches, EDGECACHE_SHARED_BATCHES=0
    ],
)
def test_workers_counts_reach_the_main_process_without_a_shared_tensor(
    node: LocalNode,
    monkeypatch: pytest.MonkeyPatch,
    rank: int,
    dataset_batch: int | None,
    loader_batch: int | None,
    shared: str,
) -> None:
    """A hunt: counts rode only on a batch's shared-memory tensor, so with none (samples,
    EDGECACHE_SHARED_BATCHES=0, a batch of Python lists) every client counter stayed at 0
    while the whole share was delivered. Each case is its own rank's series."""
    monkeypatch.setenv("EDGECACHE_SHARED_BATCHES", shared)
    ds = EdgeDataset(
        "tokens@1",
        endpoints=[node.address],
        rank=rank,
        world_size=8,
        metrics_port=0,
        window_bytes=24 << 10,
        batch_size=dataset_batch,
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=loader_batch, num_workers=2)
    got = sum(
        1 if loader_batch is None and dataset_batch is None else len(b["label"]) for b in loader
    )
    assert got > 0
    metrics = scrape(ds.metrics_port)  # type: ignore[arg-type]
    labels = {"rank": str(rank), "dataset": "tokens@1"}
    assert value(metrics, "edgecache_client_samples_total", **labels) == got
    read = value(metrics, "edgecache_client_read_bytes_total", endpoint=node.address, **labels)
    assert read > 0
    ds.close()


def test_a_batch_of_python_lists_alone_carries_its_counts_too(tmp_path: Path) -> None:
    """The third case the hunt found: a batch of text read as lists (binary="list") has no
    tensor at all, shared or not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "origin").mkdir()
    texts = [f"sample {i}" for i in range(400)]
    pq.write_table(pa.table({"txt": texts}), tmp_path / "origin" / "part-0.parquet")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "texts")
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        ds = EdgeDataset(
            "texts@1", endpoints=[node.address], binary="list", batch_size=50, metrics_port=0
        )
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        got = [text for batch in loader for text in batch["txt"]]
        assert sorted(got) == sorted(texts)
        metrics = scrape(ds.metrics_port)  # type: ignore[arg-type]
        labels = {"rank": "0", "dataset": "texts@1"}
        assert value(metrics, "edgecache_client_samples_total", **labels) == len(texts)
        ds.close()
    finally:
        node.stop()
