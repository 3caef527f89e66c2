"""EdgeDataset as an ML engineer uses it: checkpoints with DataLoader workers, persistent
workers across epochs, DDP errors and argument checks (defects a review found).

Every check reads a real node's LMDB cache (``lmdb://``) or the node itself and
compares the sets of sample ids read, not only their counts.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards
from s3server import free_port

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 700
TOTAL = SHARDS * ROWS  # labels 0..4199
SMALL = {"window_bytes": 24 << 10, "batch_size": 50}  # 84 batches an epoch
CHILD = Path(__file__).with_name("dataset_review_child.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalNode]]:
    """One node; tokens@1 staged in its cache, nullable@1 (nulls in a number column)."""
    root = tmp_path_factory.mktemp("review")
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "tokens", SHARDS, rows=ROWS)
    publish(registry, f"file://{root}/tokens", "tokens")
    (root / "nullable").mkdir()
    score = pa.array([None if i % 7 == 0 else float(i) for i in range(100)], pa.float64())
    pq.write_table(
        pa.table({"idx": pa.array(range(100), pa.int64()), "score": score}),
        root / "nullable" / "p.parquet",
    )
    publish(registry, f"file://{root}/nullable", "nullable")
    node = start_local_node("eu", root / "cache", registry)
    for _ in stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)):
        pass
    yield root, node
    node.stop()


def lmdb(cluster: tuple[Path, LocalNode]) -> list[str]:
    return [f"lmdb://{cluster[0]}/cache"]


def make(cluster: tuple[Path, LocalNode], **kwargs: object) -> EdgeDataset:
    return EdgeDataset("tokens@1", endpoints=lmdb(cluster), **{**SMALL, **kwargs})  # type: ignore[arg-type]


def loader(ds: EdgeDataset, workers: int = 0, **kwargs: object) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **kwargs)


def labels(batch: dict) -> list[int]:
    return [int(x) for x in batch["label"]]


def take(ds: EdgeDataset, steps: int, workers: int = 2) -> list[int]:
    """The labels of the first ``steps`` batches of a pass (a max-steps loop's break)."""
    out: list[int] = []
    for i, batch in enumerate(loader(ds, workers)):
        out += labels(batch)
        if i + 1 == steps:
            break
    return out


def epoch_batches(cluster: tuple[Path, LocalNode], epoch: int) -> list[list[int]]:
    ds = make(cluster)
    ds.set_epoch(epoch)
    return [labels(b) for b in loader(ds)]


# ------------------------------------------------ state_dict(batches=steps) with workers


def test_steps_since_a_resume_count_from_it_at_the_same_layout_and_elastically(cluster) -> None:
    # docs: with workers pass state_dict(batches=steps) - "steps since the resume, after
    # one". After a resume at the same layout (cursor 5), 10 steps and batches=10 saved
    # cursor 10: the next run read batches 10..14 again (250 samples twice). After an
    # elastic resume the same count was right. Now both count from the resume.
    seen: Counter = Counter()
    first = make(cluster)
    seen.update(take(first, 5))
    second = make(cluster)
    second.load_state_dict(first.state_dict(batches=5))
    seen.update(take(second, 10))
    third = make(cluster)
    third.load_state_dict(second.state_dict(batches=10))
    assert len(third) == 84 - 15
    seen.update(x for b in loader(third, 2) for x in labels(b))
    assert seen == Counter(range(TOTAL))

    # Elastic: two ranks, then one rank with batches of 40, then three ranks of 30.
    seen = Counter()
    for rank in range(2):
        ds = make(cluster, rank=rank, world_size=2)
        seen.update(take(ds, 5))
        if rank == 0:
            state = ds.state_dict(batches=5)
    one = make(cluster, batch_size=40)
    one.load_state_dict(state)
    seen.update(take(one, 10))
    state = one.state_dict(batches=10)
    again = make(cluster, batch_size=40)  # the same layout as the save: not elastic
    again.load_state_dict(state)
    seen.update(take(again, 3))
    state = again.state_dict(batches=3)
    for rank in range(3):
        ds = make(cluster, batch_size=30, rank=rank, world_size=3)
        ds.load_state_dict(state)
        seen.update(x for b in loader(ds, 2) for x in labels(b))
    assert seen == Counter(range(TOTAL))


def test_a_state_saved_one_sample_at_a_time_resumes_at_any_layout(cluster) -> None:
    # batch_size=None: load_state_dict at another world size or batch size raised
    # TypeError ('<' between NoneType and int) in partition.py.
    seen: Counter = Counter()
    for rank in range(2):
        ds = make(cluster, batch_size=None, rank=rank, world_size=2)
        it = iter(loader(ds))
        seen.update(int(next(it)["label"]) for _ in range(10))
        if rank == 0:
            state = ds.state_dict()
        del it
    assert state["batch_size"] is None and state["batches"] == 10
    for kwargs in ({"batch_size": 50}, {"batch_size": None}):
        rest: Counter = Counter()
        for rank in range(3):
            ds = make(cluster, rank=rank, world_size=3, **kwargs)
            ds.load_state_dict(state)
            rest.update(x for b in loader(ds) for x in np.atleast_1d(b["label"].numpy()).tolist())
        assert seen + rest == Counter(range(TOTAL))


def test_a_checkpoint_after_an_epochs_last_step_resumes_the_next_epoch(cluster) -> None:
    # With workers, state_dict(batches=84) after the epoch's last step resumed an empty
    # epoch 0 (len 0, a pass of nothing), where num_workers=0's state said epoch 1.
    epoch1 = epoch_batches(cluster, 1)
    ds = make(cluster)
    steps = sum(1 for _ in loader(ds, 2))
    resumed = make(cluster)
    resumed.load_state_dict(ds.state_dict(batches=steps))
    assert len(resumed) == 84
    assert [labels(b) for b in loader(resumed)] == epoch1
    # At num_workers=0 the same step count after the epoch (the dataset moved on to
    # epoch 1 by itself) is the finished epoch: epoch 1 from its start, not epoch 2.
    ds = make(cluster)
    steps = sum(1 for _ in loader(ds))
    state = ds.state_dict(batches=steps)
    assert (state["epoch"], state["batches"]) == (1, 0)


def test_state_dict_without_a_step_count_after_workers_read_warns_once(cluster, caplog) -> None:
    # With workers the training process's own count stays 0: a checkpoint of it
    # silently resumed the epoch from its start.
    ds = make(cluster)
    ds.state_dict()  # nothing read yet: nothing to warn of
    with caplog.at_level(logging.WARNING, logger="edgecache.clients.dataset"):
        sum(1 for _ in loader(ds, 2))
        ds.state_dict(batches=84)
        assert "state_dict(batches=" not in caplog.text
        ds.state_dict()
        ds.state_dict()
    warned = [r for r in caplog.records if "cannot see what DataLoader workers" in r.message]
    assert len(warned) == 1 and "tokens@1" in warned[0].message


# ------------------------------------------------ persistent workers


def test_persistent_workers_after_a_break_near_the_end_read_one_epoch(cluster) -> None:
    # 2 workers, a break after 81 of 84 batches: one worker had read its share to the
    # end (and went on to epoch 1 by itself), the other not: the next pass was 42
    # batches of epoch 0 and 42 of epoch 1, 1,400 samples twice in one pass.
    reference = {e: epoch_batches(cluster, e) for e in (0, 1)}
    for stop in (79, 80, 81, 82, 83):
        ds = make(cluster)
        dl = loader(ds, 2, persistent_workers=True)
        for i, _ in enumerate(dl):
            if i + 1 == stop:
                break
        again = [labels(b) for b in dl]
        assert again in (reference[0], reference[1]), f"after {stop} of 84: a mix of epochs"
        ds.close()


def test_persistent_workers_moving_on_by_themselves_move_the_state(cluster) -> None:
    # Workers read epoch 1 in the second pass, but state_dict() said epoch 0: the
    # checkpoint resumed epoch 0's order.
    epoch1 = epoch_batches(cluster, 1)
    ds = make(cluster)
    dl = loader(ds, 2, persistent_workers=True)
    assert sum(1 for _ in dl) == 84
    it = iter(dl)
    got = [labels(next(it)) for _ in range(7)]
    assert got == epoch1[:7]
    state = ds.state_dict(batches=7)
    assert (state["epoch"], state["batches"]) == (1, 7) and len(ds) == 84
    del it
    resumed = make(cluster)
    resumed.load_state_dict(state)
    assert [labels(b) for b in loader(resumed)] == epoch1[7:]
    ds.close()


def test_workers_that_are_not_persistent_go_on_to_the_next_epoch(cluster) -> None:
    # Fresh workers (a new copy of the training process's dataset every pass) read
    # epoch 0's order again every pass when the loop did not call set_epoch, where
    # num_workers=0 and persistent workers went on to epoch 1, 2, ...
    reference = {e: epoch_batches(cluster, e) for e in range(4)}
    ds = make(cluster)
    dl = loader(ds, 2)
    assert [labels(b) for b in dl] == reference[0]
    it = iter(dl)
    got = [labels(next(it)) for _ in range(5)]
    assert got == reference[1][:5]
    assert (ds.state_dict(batches=5)["epoch"], len(ds)) == (1, 84)
    del it  # broken off: the next pass reads epoch 1 again, whole, where it began
    assert [labels(b) for b in dl] == reference[1]
    assert [labels(b) for b in loader(ds, 3)] == reference[2]  # another loader too
    # A break near the end (some workers read their share to its end, others not):
    # the next pass is that epoch whole, never half one epoch, half the next.
    for i, _ in enumerate(dl):
        if i + 1 == 81:
            break
    assert [labels(b) for b in dl] in (reference[3], epoch_batches(cluster, 4))
    # set_epoch still says which epoch a pass reads, whatever workers did before.
    ds.set_epoch(1)
    assert [labels(b) for b in dl] == reference[1]
    ds.set_epoch(1)
    assert [labels(b) for b in loader(ds)] == reference[1]
    ds.close()


# ------------------------------------------------ a local cache beside its node


def test_a_local_cache_serves_a_job_whose_node_listed_with_it_is_down(cluster, caplog) -> None:
    # lmdb:// first and its node after it, as docs/dataset.md recommends: with the node
    # down the dataset could not be built ("GetManifest failed on every endpoint"),
    # though every row was in the local cache.
    dead = f"127.0.0.1:{free_port()}"
    reference = epoch_batches(cluster, 0)
    for endpoints in ([*lmdb(cluster), dead], [dead, *lmdb(cluster)]):
        with caplog.at_level(logging.WARNING, logger="edgecache.clients.dataset"):
            ds = EdgeDataset("tokens@1", endpoints=endpoints, retry_timeout=5, **SMALL)  # type: ignore[arg-type]
        assert "its manifest came from a local cache" in caplog.text
        assert [labels(b) for b in loader(ds)] == reference
        ds.close()
    # What neither the nodes nor a local cache holds: the nodes' failure, and why the
    # local caches could not stand in.
    with pytest.raises(Exception, match="failed on every endpoint") as info:
        EdgeDataset("nope@1", endpoints=[*lmdb(cluster), dead], retry_timeout=5, **SMALL)  # type: ignore[arg-type]
    assert any("nor could a local cache give it" in n for n in info.value.__notes__)


def _damaged_copy(cluster, tmp_path: Path, db: bytes = b"manifests", key: bytes = b"") -> str:
    """A copy of the node's cache with one bit flipped in one record (tokens@1's manifest)."""
    import lmdb as lmdb_module

    from edgecache.cache.keys import version_key
    from edgecache.cache.store_files import DBS

    copy = tmp_path / f"damaged-{db.decode()}"
    copy.mkdir()
    # A consistent snapshot (the node may be writing), taken in another process: this
    # one may hold the cache open already, and LMDB refuses a second open.
    snapshot = (
        "import lmdb, sys; lmdb.open(sys.argv[1], readonly=True, max_dbs=16).copy(sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", snapshot, str(cluster[0] / "cache"), str(copy)], check=True
    )
    env = lmdb_module.open(str(copy), max_dbs=len(DBS) + 2)
    table = env.open_db(db)
    key = key or version_key("tokens", 1)
    with env.begin(write=True) as txn:
        record = bytearray(txn.get(key, db=table))
        record[len(record) // 2] ^= 0x01
        txn.put(key, bytes(record), db=table)
    env.close()
    return f"lmdb://{copy}"


def test_a_local_caches_damaged_manifest_sends_reads_to_the_next_endpoint(
    cluster, tmp_path: Path, caplog
) -> None:
    # A flipped bit in one cache's copy of the manifest ended the run ("republish it",
    # which the registry's intact copy does not need), though a node was listed after it.
    damaged = _damaged_copy(cluster, tmp_path)
    reference = epoch_batches(cluster, 0)
    with caplog.at_level(logging.WARNING):
        for endpoints in ([cluster[1].address, damaged], [damaged, *lmdb(cluster)]):
            ds = EdgeDataset("tokens@1", endpoints=endpoints, **SMALL)  # type: ignore[arg-type]
            assert [labels(b) for b in loader(ds)] == reference
            ds.close()
    assert "is damaged" in caplog.text and "edgecache evict tokens@1" in caplog.text
    assert "republish" not in caplog.text
    # Alone, it says what is wrong and how to mend it.
    from edgecache.cache.errors import ManifestError

    with pytest.raises(ManifestError, match="damaged.*edgecache warm tokens@1"):
        EdgeDataset("tokens@1", endpoints=[damaged], **SMALL)  # type: ignore[arg-type]


def test_a_damaged_chunk_in_a_local_cache_alone_fails_at_once_saying_so(
    cluster, tmp_path: Path, caplog
) -> None:
    # The log promised "no other endpoint: retrying it from row 312 for up to 30 s",
    # and ChunkCorrupt came 0.2 s later: a damaged chunk is read once more, no longer.
    from edgecache.cache.errors import ChunkCorrupt
    from edgecache.cache.keys import ShardKey, chunk_key

    damaged = _damaged_copy(
        cluster, tmp_path, b"chunks", chunk_key(ShardKey("tokens", 1, 2).encode(), 1)
    )
    with caplog.at_level(logging.WARNING), pytest.raises(ChunkCorrupt, match="read-only"):
        for _ in loader(EdgeDataset("tokens@1", endpoints=[damaged], **SMALL)):  # type: ignore[arg-type]
            pass
    assert "reading it once more" in caplog.text and "for up to" not in caplog.text
    # With the node after it, the epoch is whole: the damaged chunk's rows from the node.
    ds = EdgeDataset("tokens@1", endpoints=[damaged, cluster[1].address], **SMALL)  # type: ignore[arg-type]
    assert [labels(b) for b in loader(ds)] == epoch_batches(cluster, 0)
    ds.close()


def test_a_malformed_state_is_refused_when_loaded_naming_its_field(cluster) -> None:
    # Edited or truncated states loaded, then failed with a bare KeyError, TypeError or
    # IndexError (batches=-3: "batch -3 of 84") or resumed nonsense (rank 5 of 1).
    from edgecache.cache.errors import StateMismatch

    ds = make(cluster)
    good = ds.state_dict()
    cases = {
        "batches": -3,
        "epoch": -1,
        "rank": 5,
        "batch_size": "64",
        "drop_last": 1,
        "seed": 1.5,
    }
    for field, value in cases.items():
        with pytest.raises(StateMismatch, match=repr(field)):
            make(cluster).load_state_dict({**good, field: value})
    with pytest.raises(StateMismatch, match="no 'remaining'"):
        make(cluster).load_state_dict({k: v for k, v in good.items() if k != "remaining"})
    with pytest.raises(StateMismatch, match="more than the 84 batches"):
        make(cluster).load_state_dict({**good, "batches": 10**6})
    # The setting the user changed is named, not one worked out from it.
    split = make(cluster, rows=(0.0, 0.9)).state_dict()
    with pytest.raises(StateMismatch, match=r"saved with rows=\[0\.0, 0\.9\]"):
        make(cluster).load_state_dict(split)
    make(cluster).load_state_dict({**good, "batches": 84})  # the whole epoch: the next one
    # numpy integers (a state kept by numpy code) load as plain ones did.
    make(cluster).load_state_dict({**good, "epoch": np.int64(0), "batches": np.int64(3)})


# ------------------------------------------------ DDP, arguments and errors


def test_an_unknown_version_under_ddp_raises_on_every_rank(cluster, tmp_path: Path) -> None:
    # Rank 0 raised VersionNotFound before the broadcast; rank 1 waited in it for as
    # long as rank 0 lived, then failed with gloo's "Connection closed by peer".
    init = f"tcp://127.0.0.1:{free_port()}"
    out = str(tmp_path / "rank-{rank}.json")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                json.dumps(
                    {
                        "init": init,
                        "rank": rank,
                        "world": 2,
                        "spec": "nosuch@1",
                        "endpoints": [cluster[1].address],
                        "out": out,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    reports = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(2)]
    assert [r["raised"] for r in reports] == ["VersionNotFound"] * 2, reports
    assert reports[0]["message"] == reports[1]["message"] and "nosuch" in reports[1]["message"]
    assert reports[1]["seconds"] < 20, reports  # not held until rank 0 exits


def test_rank_and_world_size_take_any_integer_but_a_bool(cluster) -> None:
    ds = make(cluster, rank=np.int64(1), world_size=np.int64(2))
    assert (ds.rank, ds.world_size) == (1, 2) and type(ds.rank) is int
    assert len(ds) == 42
    for rank, world in ((True, 2), (0, True)):
        with pytest.raises(ValueError, match=r"(rank|world_size) must be (an|a positive) integer"):
            make(cluster, rank=rank, world_size=world)


@pytest.mark.parametrize(
    ("environment", "missing"), [({"WORLD_SIZE": "4"}, "RANK"), ({"RANK": "1"}, "WORLD_SIZE")]
)
def test_one_of_rank_and_world_size_in_the_environment_is_refused(
    cluster, monkeypatch: pytest.MonkeyPatch, environment: dict, missing: str
) -> None:
    # WORLD_SIZE=4 without RANK was read as rank 0 of 1: each process read the epoch.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{missing} is not"):
        make(cluster)


def test_row_numbers_past_the_last_row_are_refused(cluster) -> None:
    # rows=(0, 99999) on 4,200 rows was accepted and cut to the rows there are.
    with pytest.raises(ValueError, match="tokens@1 has 4200 rows"):
        make(cluster, rows=(0, 99_999))
    assert len(make(cluster, rows=(4000, 4200))) == 4


def test_an_error_while_reading_names_the_version_in_its_message(cluster) -> None:
    # At num_workers=0 the version was only in a note, which a logged str(e) leaves out.
    ds = EdgeDataset("nullable@1", endpoints=[cluster[1].address], batch_size=10)
    with pytest.raises(ValueError, match="score") as raised:
        list(loader(ds))
    assert "nullable@1" in str(raised.value)
    assert "columns=" in str(raised.value)
