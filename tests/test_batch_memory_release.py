"""Batch memory in DataLoader workers is released however the batch is used (stop 44).

1. A batch dropped inside a worker (a ``collate_fn`` or a wrapping dataset that
   makes new tensors of it, as docs/dataset.md suggests for per-batch CPU work)
   never reached the main process, whose finalizer alone freed its slot: each
   worker's ring grew by a slot a batch, and with two descriptors a slot the
   worker died of "Too many open files" in the second epoch.
2. A training loop that keeps a tensor of every batch (labels for an eval) holds
   every batch's slot: past the ring's bound the worker falls back to torch's
   transport and says why, instead of failing on EMFILE.
3. ``torch.save(batch)`` failed on any batch of columns of two dtypes ("Cannot
   save multiple tensors or storages that view the same data as different
   types"), and one saved column wrote the whole block.

Real DataLoader worker processes over a real node's LMDB cache (``lmdb://``).
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards
from torch.utils.data import DataLoader

from edgecache.clients import EdgeDataset
from edgecache.clients.batch_memory import SharedMemory
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 4, 2000


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """tokens@1 staged into a node's cache: read as ``lmdb://`` by the tests."""
    root = tmp_path_factory.mktemp("batch-memory")
    write_parquet_shards(root / "origin", SHARDS, rows=ROWS)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tokens")
    node = start_local_node("eu", root / "cache", registry)
    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
    finally:
        node.stop()
    yield f"lmdb://{root / 'cache'}"


def _worker_slots(loader_pid: int) -> list[int]:
    """Batch slots each worker of this process maps (one memfd descriptor a slot)."""
    counts = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != loader_pid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
            links = []
            for fd in fds:
                try:
                    links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
            counts.append(sum("edgecache-batch" in link for link in links))
        except (OSError, ValueError, IndexError):
            continue
    return counts


def _decode(batch: dict) -> dict:
    """New tensors made of the batch in the worker: EdgeDataset's batch is dropped there."""
    return {"sum": batch["input_ids"].sum(dim=1), "label": batch["label"].clone()}


def test_batches_a_collate_fn_drops_in_the_worker_free_their_slots(cache: str) -> None:
    ds = EdgeDataset("tokens@1", endpoints=[cache], batch_size=64)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, collate_fn=_decode
    )
    batches = 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        labels = []
        for batch in loader:
            labels.extend(batch["label"].tolist())
            batches += 1
        assert sorted(labels) == list(range(SHARDS * ROWS))
        # The DataLoader's two workers (other children of this process map no batch slot).
        slots = [count for count in _worker_slots(os.getpid()) if count]
        assert 1 <= len(slots) <= 2, slots
    # 375 batches went through; each worker's ring stays a few slots (it grew by one a batch).
    assert batches == 3 * -(-SHARDS * ROWS // 64) and max(slots) <= 8, (batches, slots)


def test_a_batch_dropped_in_the_ring_frees_its_slot_and_a_sent_one_waits_for_the_trainer() -> None:
    ring = SharedMemory()
    block = ring.allocate(4096)
    column = block.tensor(0, 64, torch.int64, (8,))
    assert ring.in_use() == 1
    del block, column  # made and dropped here: nothing will release it elsewhere
    assert ring.in_use() == 0
    block = ring.allocate(4096)
    column = block.tensor(0, 64, torch.int64, (8,))
    pickle.dumps(column)  # sent to the main process: its finalizer releases the slot
    del block, column
    assert ring.in_use() == 1


def test_a_ring_whose_batches_are_all_held_falls_back_and_says_why() -> None:
    ring = SharedMemory()
    ring.max_slots = 3
    held = [ring.allocate(1024).tensor(0, 8, torch.int64, (1,)) for _ in range(3)]
    with pytest.warns(RuntimeWarning, match=r"3 batches .* keeps the whole batch's memory"):
        extra = ring.allocate(1024)
    assert ring.slots == 3 and extra.tensor(0, 8, torch.int64, (1,)).shape == (1,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        ring.allocate(1024)
    del held


class _Reshaping(torch.utils.data.IterableDataset):
    """Batches in a worker's ring with one column a plain view (what a collate_fn makes)."""

    def __iter__(self):  # noqa: ANN204
        from edgecache.clients.batch_memory import shared_memory

        ring = shared_memory()
        assert ring is not None
        size = 1 << 16
        for i in range(40):
            block = ring.allocate(2 * size)
            block.array()[:] = i
            x = block.tensor(0, size, torch.uint8, (size,))
            y = block.tensor(size, size, torch.uint8, (size,))
            yield {"x": x.view(256, -1), "y": y, "i": i}


def test_a_batch_with_a_plain_view_of_a_column_keeps_its_slot_until_the_trainer_drops_it() -> None:
    """torch's transport sends a plain view by moving its storage to new shared memory while
    the batch is pickled: the batch's memory died mid-send, the worker freed the slot and
    put its next batch there, under the trainer's (review of 241d824: 40 of 40 corrupted)."""
    kept: list[dict] = []
    loader = DataLoader(_Reshaping(), batch_size=None, num_workers=1, prefetch_factor=2)
    for batch in loader:
        kept = [*kept[-2:], batch]
        for old in kept:  # the batches the trainer still holds keep their bytes
            assert old["y"].min() == old["y"].max() == old["i"], old["i"]
            assert old["x"].min() == old["x"].max() == old["i"], old["i"]


def test_a_process_ending_while_a_thread_reads_a_batch_exits_cleanly(tmp_path: Path) -> None:
    """The ring's memory was unmapped at interpreter exit, referenced or not: a thread still
    reading a batch then (a pin-memory thread) crashed the process as it ended (SIGSEGV)."""
    script = tmp_path / "reader.py"
    script.write_text(
        "import os, threading, torch\n"
        "from edgecache.clients.batch_memory import _mmap\n"
        "fd = os.memfd_create('x'); os.ftruncate(fd, 1 << 24)\n"
        "a = torch.from_numpy(_mmap(fd, 1 << 24)).numpy()\n"
        "started = threading.Event()\n"
        "def reader():\n"
        "    started.set()\n"
        "    while True:\n"
        "        a.sum()\n"
        "threading.Thread(target=reader, daemon=True).start()\n"
        "started.wait()\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_saves_with_torch_save_and_a_column_alone_saves_its_own_bytes(
    cache: str, workers: int
) -> None:
    ds = EdgeDataset("tokens@1", endpoints=[cache], batch_size=256)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    batch = next(iter(loader))
    assert batch["input_ids"].dtype == torch.int32 and batch["label"].dtype == torch.int64
    saved = io.BytesIO()
    torch.save(batch, saved)  # two dtypes in one batch
    saved.seek(0)
    again = torch.load(saved)
    assert torch.equal(again["input_ids"], batch["input_ids"])
    assert torch.equal(again["label"], batch["label"])
    label = io.BytesIO()
    torch.save(batch["label"], label)
    # 2 KiB of labels, not the 32 KiB of ids beside them in the batch's block.
    assert len(label.getvalue()) < 2 * batch["label"].nbytes + 2048, len(label.getvalue())
