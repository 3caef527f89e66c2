"""EdgeDataset used as an ML engineer would, from docs/dataset.md: each test a defect found so.

Real parts: an edge node on loopback, real DataLoader worker processes, a
real DDP job under torchrun (tests/ddp_child.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards
from s3server import free_port

from edgecache.clients import EdgeDataset, pipeline
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 3, 500
TOTAL = SHARDS * ROWS
DDP_CHILD = Path(__file__).with_name("ddp_child.py")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    """One node serving tokens@1 (1500 rows, labels 0..1499) and nullable@1 (nulls in score)."""
    root = tmp_path_factory.mktemp("walk")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    (root / "nullable").mkdir()
    score = pa.array([None if i % 7 == 0 else float(i) for i in range(100)], pa.float64())
    table = pa.table({"idx": pa.array(range(100), pa.int64()), "score": score})
    pq.write_table(table, root / "nullable" / "p.parquet")
    publish(registry, f"file://{root}/nullable", "nullable")
    started = start_local_node("eu", root / "cache", registry)
    yield started
    started.stop()


@pytest.mark.parametrize(("world", "batch"), [(2, 10), (2, 7), (3, 10), (4, 25), (2, 64)])
def test_ranks_get_equal_shares_so_ddp_steps_match(node: LocalNode, world: int, batch: int) -> None:
    # 1500 samples over 2 ranks in batches of 10 is 75 batches each; rank 0 had 74 + a
    # partial (748 samples) and rank 1 76 (752): each lane was split with the remainder
    # always on the last rank. Shares now differ by at most one sample.
    counts, seen = [], []
    for rank in range(world):
        ds = EdgeDataset(
            "tokens@1", endpoints=node.address, batch_size=batch, rank=rank, world_size=world
        )
        order = ds.epoch_order()
        counts.append(len(ds))
        seen.append(order.samples)
    assert max(seen) - min(seen) <= 1 and sum(seen) == TOTAL
    assert len(set(counts)) == 1, counts


def test_ddp_under_torchrun_default_drop_last(node: LocalNode, tmp_path: Path) -> None:
    # The README's loop under torchrun with DDP: rank and world size from torch.distributed,
    # drop_last=False (the default), 1500 samples in batches of 10. Every step all-reduces
    # gradients, so unequal batch counts fail the job (they did: 75 and 76).
    job = {
        "endpoints": [node.address],
        "spec": "tokens@1",
        "batch": 10,
        "epochs": 2,
        "workers": 0,
        "out": str(tmp_path / "rank-{rank}.json"),
        "kwargs": {"seed": 3},
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(DDP_CHILD),
            json.dumps(job),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a hung job's ranks are killed with torchrun
    )
    try:
        log = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        pytest.fail(f"the DDP job hung (ranks stepped out of lockstep):\n{log[-5000:]}")
    assert proc.returncode == 0, log[-5000:]
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    assert reports[0]["len"] == reports[1]["len"] == 75
    for epoch in range(2):
        a, b = (set(r["epochs"][epoch]) for r in reports)
        assert not a & b and a | b == set(range(TOTAL))
        assert len(reports[0]["epochs"][epoch]) == len(reports[1]["epochs"][epoch]) == 750


def test_a_state_saved_before_the_balanced_split_resumes_exactly(node: LocalNode) -> None:
    # States of format 3 were consumed by ranks that split each lane on its own: at the
    # same world size their batch cursor now means other samples. They resume
    # elastically from what those ranks read, every sample once.
    from edgecache.clients.partition import RankBatches

    def make(rank: int) -> EdgeDataset:
        return EdgeDataset(
            "tokens@1", endpoints=node.address, batch_size=10, rank=rank, world_size=2, seed=3
        )

    consumed = []
    for rank in range(2):
        old = make(rank)
        old._old_order = (old.seed, old.epoch, 4)  # format 3 also permuted blocks at random
        order = old.epoch_order()
        order.ranks = RankBatches(order.remaining, 2, rank, 10, False, per_lane=True)
        for n in range(5):
            consumed += [s * ROWS + r for _, s, r in order.sample_ids(order.batch(n))]
    state = {**make(0).state_dict(batches=5), "format": 3}
    rest = []
    for rank in range(2):
        ds = make(rank)
        ds.load_state_dict(state)
        rest += [x for b in torch.utils.data.DataLoader(ds, batch_size=None) for x in b["label"]]
    assert sorted(consumed + [int(x) for x in rest]) == list(range(TOTAL))


@pytest.mark.parametrize("form", [4, 5])
def test_a_state_of_an_older_order_resumes_exactly_in_it(node: LocalNode, form: int) -> None:
    # States of format 4 were saved by a dataset whose blocks were permuted at random:
    # the same batch cursor meant other samples within a block. Format 5 read a
    # component's two passes of an epoch side by side, format 6 reads them in turn
    # (here: samples_per_epoch twice the rows). Either epoch is read in its own order,
    # every sample as often as before, at the same and at another world size; a state
    # saved from it says its format again; the next epoch is in today's order.
    passes = 1 if form == 4 else 2

    def make(rank: int, world_size: int = 2) -> EdgeDataset:
        return EdgeDataset(
            "tokens@1",
            endpoints=node.address,
            batch_size=10,
            rank=rank,
            world_size=world_size,
            samples_per_epoch=passes * TOTAL,
        )

    consumed = []
    for rank in range(2):
        old = make(rank)
        old._old_order = (old.seed, old.epoch, form)
        order = old.epoch_order()
        for n in range(5):
            consumed += [s * ROWS + r for _, s, r in order.sample_ids(order.batch(n))]
    new = make(0).epoch_order()
    assert consumed[:10] != [s * ROWS + r for _, s, r in new.sample_ids(new.batch(0))]
    state = {**make(0).state_dict(batches=5), "format": form}
    for world_size in (2, 3):
        rest = []
        for rank in range(world_size):
            ds = make(rank, world_size)
            ds.load_state_dict(state)
            if rank == 0 and world_size == 2:
                assert ds.state_dict(batches=1)["format"] == form
            rest += [
                x for b in torch.utils.data.DataLoader(ds, batch_size=None) for x in b["label"]
            ]
        everything = sorted(list(range(TOTAL)) * passes)
        assert sorted(consumed + [int(x) for x in rest]) == everything, world_size
    ds = make(0)
    ds.load_state_dict(state)
    list(ds)
    assert ds.epoch == 1 and ds.state_dict(batches=0)["format"] == 6
    ds.set_epoch(0)  # epoch 0 again, from its start: today's order, as in a fresh process
    fresh = make(0).epoch_order(0)
    assert ds.epoch_order(0).sample_ids(ds.epoch_order(0).batch(0)) == fresh.sample_ids(
        fresh.batch(0)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 1}, "pass both"),  # said only 'got rank=1, world_size=1'
        ({"world_size": 2}, "pass both"),  # read rank 0's share in every process
        ({"batch_size": True}, "batch_size"),  # a bool is not a batch size (read as 1)
        ({"columns": []}, "columns"),  # yielded empty dicts
        ({"columns": ["label", "label"]}, "label"),  # one column, named twice
        # Its order is the process's hashing: ranks saw other orders (a helper's hunt).
        ({"columns": {"label"}}, r"got a set .*pass a list: \['label'\]"),
        ({"threads": 0}, "threads"),  # no fetch thread: nothing would ever be read
        ({"prefetch_bytes": -1}, "prefetch_bytes"),
        ({"seed": "17"}, "seed must be an integer"),  # shuffled by its hash per process
        ({"window_bytes": 0.5}, "window_bytes must be a positive integer"),  # was accepted
        ({"window_bytes": True}, "window_bytes"),  # a bool was one byte per window
        ({"lanes": 2.0}, "lanes must be a positive integer"),
        ({"lanes": 10**6}, "lanes must be at most 4096"),  # building the order never ended
        ({"columns": {"label": 1}}, r"got a mapping .*\['label'\]"),  # read its keys
        # Each accepted until the first iteration (a TypeError deep inside), or misread:
        ({"shuffle": "False"}, "shuffle must be True or False"),
        ({"drop_last": "no"}, "drop_last must be True or False"),  # read as True
        ({"retry_timeout": "5"}, "retry_timeout must be a positive number of seconds"),
        ({"stall_timeout": -1}, "stall_timeout must be a positive number of seconds"),
        ({"stall_timeout": 0}, "stall_timeout"),
        ({"metrics_port": "x"}, "metrics_port must be an integer >= 0"),  # socket.gaierror
    ],
)
def test_bad_arguments_fail_in_the_constructor_naming_the_fix(
    node: LocalNode, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EdgeDataset("tokens@1", endpoints=node.address, **kwargs)


def test_bad_epochs_and_state_positions_are_refused_naming_them(node: LocalNode) -> None:
    ds = EdgeDataset("tokens@1", endpoints=node.address, batch_size=10)
    for epoch in (None, "1", True, -1):
        with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
            ds.set_epoch(epoch)  # type: ignore[arg-type]
    total = len(ds)
    with pytest.raises(ValueError, match="batches must be an integer >= 0"):
        ds.state_dict(batches=-3)  # then refused by load_state_dict as an IndexError
    with pytest.raises(ValueError, match=f"has {total} batches on this rank"):
        ds.state_dict(batches=total + 10)  # accepted: an empty epoch on resume
    assert ds.state_dict(batches=total)["batches"] == total


def test_integers_computed_with_numpy_are_integers(node: LocalNode) -> None:
    # np.int64 (say from a version's row count) was refused as 'must be a positive integer'.
    ds = EdgeDataset(
        "tokens@1",
        endpoints=node.address,
        batch_size=np.int64(10),
        lanes=np.int32(2),
        seed=np.int64(3),
        prefetch_bytes=np.int64(1 << 20),
    )
    assert (ds.batch_size, ds.lanes, ds.seed) == (10, 2, 3)
    assert type(ds.batch_size) is int and len(next(iter(ds))["label"]) == 10


def test_one_column_given_as_a_string_is_that_column(node: LocalNode) -> None:
    # columns="label" was read as five columns 'l', 'a', 'b', 'e', 'l' (a KeyError).
    ds = EdgeDataset("tokens@1", endpoints=node.address, columns="label", batch_size=10)
    assert ds.columns == ["label"] and set(next(iter(ds))) == {"label"}


def test_rank_and_world_size_from_torchrun_environment(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under torchrun, a dataset made before init_process_group read the whole epoch in
    # every process (0 / 1): RANK and WORLD_SIZE are what torchrun sets for this.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = EdgeDataset("tokens@1", endpoints=node.address, batch_size=10)
    assert (ds.rank, ds.world_size) == (1, 2)
    assert len(ds) == 75


@pytest.mark.parametrize("workers", [0, 2])
def test_a_numeric_column_with_nulls_names_the_version_and_the_fix(
    node: LocalNode, workers: int
) -> None:
    # It said "read the column as a list", which no option does for numbers, and did
    # not name the version (a ValueError gets no note of it).
    ds = EdgeDataset("nullable@1", endpoints=node.address, batch_size=10)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    with pytest.raises(ValueError, match="columns=") as raised:
        list(loader)
    assert "score" in str(raised.value) and "list" not in str(raised.value).split(";")[-1]
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "nullable@1" in notes + str(raised.value)  # from a worker: in its message
    good = EdgeDataset("nullable@1", endpoints=node.address, batch_size=10, columns=["idx"])
    assert sorted(int(x) for b in good for x in b["idx"]) == list(range(100))


def small_windows(node: LocalNode, window_bytes: int, **options: int) -> EdgeDataset:
    """tokens@1 in windows of ``window_bytes``: 4 lanes of 4 streams, no read-ahead."""
    return EdgeDataset(
        "tokens@1",
        endpoints=node.address,
        batch_size=10,
        lanes=4,
        shuffle_windows=4,
        window_bytes=window_bytes,
        prefetch_bytes=0,
        **options,
    )


def test_streams_moving_to_their_next_windows_do_not_double_what_is_held(node: LocalNode) -> None:
    # Every stream of a version with windows of one size moves to its next window at
    # the same point of the epoch. With blocks permuted at random each held two
    # windows for the whole block, so the decoded windows held peaked at twice the
    # budget; interleaved, one lane's streams at most hold two at a time.
    ds = small_windows(node, 200)
    labels = [int(x) for b in ds for x in b["label"]]
    assert sorted(labels) == list(range(TOTAL))
    order, stats = ds.epoch_order(0), ds.stats()["last_pipeline"]
    windows = order.order.windows
    assert order.order.per_lane == 4 and len(windows) >= 128
    largest = (
        float(stats["window_budget_bytes"]) / (4 * 4) * windows.rows.max() / windows.rows.mean()
    )
    assert stats["held_peak_bytes"] <= stats["window_budget_bytes"] + 4 * largest


def reads_served(node: LocalNode) -> int:
    """ReadShard requests the node has answered (its hits and misses)."""
    status = stub(node.address).Status(edge_pb2.StatusRequest(), timeout=10)
    return int(status.hits + status.misses)


def test_a_forward_stream_reads_its_next_window_on_the_same_request(
    node: LocalNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gRPC read of a window that a forward stream goes on from asks for the next
    # window's rows too and parks the stream for it, saving that window's request.
    # (More windows on one request kept their bytes in HTTP/2 buffers long before
    # they were needed: 3 more held 30-70 MB more in bench.peers, no faster.)
    def epoch_requests() -> int:
        ds = small_windows(node, 2000)
        before = reads_served(node)
        assert sorted(int(x) for b in ds for x in b["label"]) == list(range(TOTAL))
        assert ds.stats()["last_pipeline"]["windows_read"] >= 100
        return reads_served(node) - before

    parked = epoch_requests()
    monkeypatch.setattr(pipeline, "CONTINUED_WINDOWS", 0)
    unparked = epoch_requests()
    assert parked <= unparked * 0.9, (parked, unparked)


def test_persistent_workers_read_a_format_4_state_loaded_after_they_started_in_its_order(
    node: LocalNode,
) -> None:
    # The state reaches persistent workers through shared memory, not the pickled
    # dataset: the order it was saved in must travel with it.
    def make() -> EdgeDataset:
        return EdgeDataset("tokens@1", endpoints=node.address, batch_size=10)

    old = make()
    old._old_order = (old.seed, 0, 4)
    order = old.epoch_order(0)
    expected = [
        sorted(s * ROWS + r for _, s, r in order.sample_ids(order.batch(n)))
        for n in range(5, order.batch_count)
    ]
    ds = make()
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True
    )
    assert sum(len(b["label"]) for b in loader) == TOTAL  # the workers run, then wait
    ds.load_state_dict({**make().state_dict(batches=5), "format": 4})
    assert [sorted(int(x) for x in b["label"]) for b in loader] == expected
    following = make().epoch_order(1)  # the next epoch is in today's order
    assert [sorted(int(x) for x in b["label"]) for b in loader] == [
        sorted(s * ROWS + r for _, s, r in following.sample_ids(following.batch(n)))
        for n in range(following.batch_count)
    ]
    assert ds.state_dict(batches=0)["format"] == 6


class _WithStats(torch.utils.data.IterableDataset):
    """Each DataLoader worker's batches, then its pipeline's stats (workers keep their own)."""

    def __init__(self, ds: EdgeDataset) -> None:
        self.ds = ds

    def __iter__(self):  # noqa: ANN204
        for batch in self.ds:
            yield {"label": batch["label"]}
        info = torch.utils.data.get_worker_info()
        yield {"worker": info.id, **self.ds.stats()["last_pipeline"]}


@pytest.mark.parametrize("window_bytes", [200, 1500])
@pytest.mark.parametrize("world_size", [1, 2])
def test_workers_drop_windows_no_later_batch_of_theirs_reads_and_read_none_twice(
    node: LocalNode, window_bytes: int, world_size: int
) -> None:
    # Where two streams meet, the window between them is read by the two workers
    # whose lanes they are; each kept it all epoch (the other lane's frontier never
    # moved there), so a worker held up to twice its budget (1500: 25,432 bytes of
    # windows against 11,968). Dropped once none of its later batches reads it, and
    # no window is read twice.
    ds = small_windows(node, window_bytes, rank=0, world_size=world_size)
    got = list(torch.utils.data.DataLoader(_WithStats(ds), batch_size=None, num_workers=2))
    order = ds.epoch_order(0)
    assert order.order.per_lane == 4
    labels = [int(x) for item in got if "label" in item for x in item["label"]]
    assert len(labels) == len(set(labels)) == order.samples
    stats = {item["worker"]: item for item in got if "worker" in item}
    windows = order.order.windows
    largest = stats[0]["window_budget_bytes"] / 8 * windows.rows.max() / windows.rows.mean()
    for worker in (0, 1):
        read = {p.window for n in order.batches_for(worker, 2) for p in order.batch(n).pieces}
        assert stats[worker]["windows_read"] == len(read), worker
        if world_size == 1:  # a rank's edge holds a window or two more
            held, budget = stats[worker]["held_peak_bytes"], stats[worker]["window_budget_bytes"]
            assert held <= budget + 4 * largest + 1, (worker, held, budget)


def labels(batches: Iterator[dict]) -> list[int]:
    return [int(x) for b in batches for x in b["label"]]


def test_an_iterator_left_open_across_load_state_dict_stops_and_moves_nothing(
    node: LocalNode,
) -> None:
    # A pass still open when load_state_dict put the dataset elsewhere kept reading its own
    # order, and each batch it gave moved the new position on: the resume skipped as many
    # batches of samples (3936 of 4000 in the walk that found it).
    def make() -> EdgeDataset:
        return EdgeDataset("tokens@1", endpoints=node.address, batch_size=10, seed=5)

    saved = make()
    first = iter(saved)
    taken = labels(next(first) for _ in range(5))
    state = saved.state_dict()
    first.close()
    ds = make()
    stale = iter(ds)
    next(stale)
    ds.load_state_dict(state)
    assert ds.state_dict()["batches"] == 5
    with pytest.raises(ValueError, match="began before set_epoch"):
        next(stale)  # the old order's next batch: stopped, not counted
    assert ds.state_dict()["batches"] == 5 and len(ds) == TOTAL // 10 - 5
    assert sorted(taken + labels(iter(ds))) == list(range(TOTAL))


def test_an_iterator_left_open_across_set_epoch_does_not_move_the_epoch(node: LocalNode) -> None:
    ds = EdgeDataset("tokens@1", endpoints=node.address, batch_size=10, seed=5)
    stale = iter(ds)
    next(stale)
    ds.set_epoch(5)
    with pytest.raises(ValueError, match="iterate the dataset again"):
        for _ in stale:  # read to its end, it set epoch 0 + 1 after the 5 just set
            pass
    assert ds.epoch == 5
    fresh = EdgeDataset("tokens@1", endpoints=node.address, batch_size=10, seed=5)
    fresh.set_epoch(5)
    assert labels(iter(ds)) == labels(iter(fresh))  # epoch 5's order, whole
    assert ds.epoch == 6


@pytest.mark.parametrize(
    ("key", "value"), [("dataset", "nullable"), ("version", 7), ("digest", "sha256:" + "0" * 64)]
)
def test_a_state_whose_summary_names_another_version_is_refused(
    node: LocalNode, key: str, value: object
) -> None:
    # The top-level dataset, version and digest a single version's state repeats were not
    # compared: a state saying another version loaded as its component's.
    from edgecache.cache.errors import StateMismatch

    ds = EdgeDataset("tokens@1", endpoints=node.address, batch_size=10)
    state = ds.state_dict()
    with pytest.raises(StateMismatch, match=f"'{key}' is {value!r} where its component's"):
        ds.load_state_dict({**state, key: value})
    ds.load_state_dict(state)  # unchanged, it loads
