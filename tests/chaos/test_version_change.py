"""A new version published and staged into the node while a job reads the pinned one.

Each version's labels start at ``version * 1_000_000``, so a sample tells
which version it came from. The job asks for ``@latest`` and is pinned to
what that was when it started; mid-epoch, ``@N+1`` is published and staged
into the same node the job reads. Nothing of ``@N+1`` may reach the job.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from chaosutil import count
from edgeutil import publish

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import connect, start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 4, 600
OFFSET = 1_000_000


def write_version(root: Path, version: int) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(version)
    for shard in range(SHARDS):
        first = version * OFFSET + shard * ROWS
        table = pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.integers(0, 50_000, ROWS * 32, dtype=np.int32)), 32
                ),
                "label": pa.array(np.arange(first, first + ROWS, dtype=np.int64)),
            }
        )
        pq.write_table(table, root / f"part-{shard:05d}.parquet", row_group_size=200)


def test_pinned_reader_never_sees_the_next_version(tmp_path: Path, figure) -> None:  # noqa: ANN001
    runs = count(2, 10)
    registry = f"file://{tmp_path}/registry"
    write_version(tmp_path / "v1", 1)
    publish(registry, f"file://{tmp_path}/v1", "tokens")
    node = start_local_node("eu", tmp_path / "cache", registry)
    stub = connect(node.address)
    list(stub.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
    rng = random.Random(5)
    foreign = inexact = overlapped = 0
    staged_at: list[float] = []
    try:
        for run in range(runs):
            pinned, following = run + 1, run + 2
            ds = EdgeDataset(
                "tokens@latest",
                endpoints=[node.address],
                batch_size=30,
                window_bytes=16 << 10,
                prefetch_bytes=1,  # read as it goes, so the new version lands mid-epoch
                threads=1,
            )
            assert ds.version == f"tokens@{pinned}"

            def publish_and_stage(version: int = following) -> None:
                write_version(tmp_path / f"v{version}", version)
                publish(registry, f"file://{tmp_path}/v{version}", "tokens")
                request = edge_pb2.StageRequest(dataset="tokens", version=version)
                assert list(connect(node.address).Stage(request))[-1].finished
                staged_at.append(time.monotonic())

            change = threading.Thread(target=publish_and_stage)
            at = rng.randrange(1, SHARDS * ROWS // 30 - 1)  # a random batch, never the last
            labels: list[int] = []
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
            for i, batch in enumerate(loader):
                labels.extend(int(x) for x in batch["label"])
                if i == at:
                    change.start()
                    change.join()  # the rest of the epoch reads with @N+1 in the same cache
            ended = time.monotonic()
            overlapped += bool(staged_at) and staged_at[-1] < ended and len(staged_at) == run + 1
            first = pinned * OFFSET
            foreign += sum(not first <= x < first + SHARDS * ROWS for x in labels)
            inexact += sorted(labels) != list(range(first, first + SHARDS * ROWS))
        status = stub.Status(edge_pb2.StatusRequest())
    finally:
        node.stop()
    figure("runs, each with the next version published and staged mid-epoch", runs)
    figure("runs where the new version was fully staged before the epoch ended", overlapped)
    figure("samples from a version other than the pinned one", foreign)
    figure("epochs not exact-once", inexact)
    assert foreign == 0 and inexact == 0 and overlapped == runs
    assert {v.version for v in status.versions} == set(range(1, runs + 2))
