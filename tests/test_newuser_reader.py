"""What a new user met reading data: one-sample mode with ragged columns, partial lmdb:// caches.

Real nodes on loopback (``edgecache serve`` subprocesses) stage from a
``file://`` origin; EdgeDataset reads through a real DataLoader.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from edgeutil import publish, stub, write_parquet_shards

from edgecache.cache.errors import ConfigFileError, EdgeCacheError, ShardNotCached, VersionNotFound
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.clients.topology import load_schedule
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 4, 200


def ragged_shard(index: int) -> pa.Table:
    """Rows whose ``toks`` list holds ``row % 5`` numbers (empty ones too)."""
    rows = np.arange(index * ROWS, (index + 1) * ROWS, dtype=np.int64)
    return pa.table(
        {
            "toks": pa.array([list(range(r % 5)) for r in rows.tolist()], pa.list_(pa.int32())),
            "row": pa.array(rows),
        }
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    root = tmp_path_factory.mktemp("newuser")
    (root / "origin").mkdir()
    for i in range(SHARDS):
        pq.write_table(ragged_shard(i), root / "origin" / f"part-{i:05d}.parquet")
    url = f"file://{root}/registry"
    publish(url, f"file://{root}/origin", "ragged")
    local = start_local_node("eu", root / "cache", url, capacity="256MiB")
    yield local
    local.stop()


def test_one_sample_mode_batches_ragged_columns_in_a_dataloader(node: LocalNode) -> None:
    """batch_size=None in DataLoader(batch_size=8) raised "stack expects each tensor to be
    equal size": default_collate cannot stack a list column's per-sample tensors. The
    samples now collate as EdgeDataset(batch_size=8) batches: padded plus lengths."""
    for ragged in ("padded", "packed"):
        ds = EdgeDataset(
            "ragged@1", endpoints=[node.address], batch_size=None, shuffle=False, ragged=ragged
        )
        for workers in (0, 2):
            rows = []
            for batch in torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers):
                want = [list(range(r % 5)) for r in batch["row"].tolist()]
                if ragged == "padded":
                    lengths = batch["toks_lengths"].tolist()
                    assert lengths == [len(w) for w in want]
                    assert batch["toks"].shape == (len(want), max(lengths))
                    got = [t[:n].tolist() for t, n in zip(batch["toks"], lengths, strict=True)]
                else:
                    got = batch["toks"].tolist()
                assert got == want
                rows += batch["row"].tolist()
            assert sorted(rows) == list(range(SHARDS * ROWS))
        ds.close()


def test_one_sample_mode_packs_bytes_and_strings_again_in_a_dataloader(tmp_path: Path) -> None:
    """batch_size=None in DataLoader(batch_size=8): bytes and string columns came out as
    lists (each sample pickled from a worker), where EdgeDataset(batch_size=8) gives the
    documented default, a Packed; binary='list' keeps lists."""
    from edgecache.clients.packed import Packed

    (tmp_path / "origin").mkdir()
    rows = np.arange(60)
    blobs = [bytes([r % 251]) * (r % 7) for r in rows.tolist()]  # empty ones too
    texts = [f"doc {r} é" * (r % 3) for r in rows.tolist()]
    pq.write_table(
        pa.table({"blob": pa.array(blobs, pa.binary()), "text": texts, "row": rows}),
        tmp_path / "origin" / "part-0.parquet",
    )
    url = f"file://{tmp_path}/registry"
    publish(url, f"file://{tmp_path}/origin", "docs")
    node = start_local_node("eu", tmp_path / "cache", url)
    try:
        for binary in ("packed", "list"):
            ds = EdgeDataset("docs@1", endpoints=[node.address], batch_size=None, binary=binary)
            for workers in (0, 2):
                seen = []
                for batch in torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers):
                    for name in ("blob", "text"):
                        column = batch[name]
                        assert isinstance(column, Packed if binary == "packed" else list), column
                    want = [(blobs[r], texts[r]) for r in batch["row"].tolist()]
                    assert list(zip(batch["blob"], batch["text"], strict=True)) == want
                    seen += batch["row"].tolist()
                assert sorted(seen) == rows.tolist()
            ds.close()
    finally:
        node.stop()


@pytest.mark.parametrize(
    "start", ["2026-12-02T25:00:00Z", "2026-02-30T01:00:00Z", "2026-12-02T10:00:00+25:00"]
)
def test_an_impossible_unquoted_start_names_line_and_field(tmp_path: Path, start: str) -> None:
    """YAML's timestamp constructor raised on these ("hour must be in 0..23"): the error
    said "not valid YAML" with no line or field, where the quoted form named both."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"jobs:\n  - name: a\n    region: eu\n    start: {start}\n    datasets: [t@1]\n"
    )
    with pytest.raises(ConfigFileError) as caught:
        load_schedule(path)
    assert f"{path}:4: jobs.0.start: '{start}' is not a time: write ISO 8601" in str(caught.value)
    path.write_text(
        "jobs:\n  - name: a\n    region: eu\n    start: 2026-12-02T10:00:00Z\n    datasets: [t@1]\n"
    )
    assert load_schedule(path).jobs[0].start == datetime(2026, 12, 2, 10, tzinfo=UTC)


@pytest.mark.parametrize("start", ["0001-01-01T00:00:00+23:59", "'0001-01-01T00:00:00+01:00'"])
def test_a_start_before_the_first_utc_instant_is_refused_at_its_line(
    tmp_path: Path, start: str
) -> None:
    """Found by the schedule fuzzer: converted to UTC it overflowed (OverflowError, a crash)."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"jobs:\n  - name: a\n    region: eu\n    start: {start}\n    datasets: [t@1]\n"
    )
    with pytest.raises(ConfigFileError, match=r"bad.yaml:4: jobs.0.start: .*out of the range"):
        load_schedule(path)


def test_every_node_refusing_logs_that_the_read_fails_not_a_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With FAILED_PRECONDITION from every node the log said "retrying them all from row
    0 for up to 30 s", and the refusal was raised at once: it now says the read fails."""
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "gone")
    nodes = [start_local_node("eu", tmp_path / f"cache-{i}", registry) for i in range(2)]
    try:
        shutil.rmtree(tmp_path / "origin")  # nothing staged: each node's origin refuses
        for endpoints in ([n.address for n in nodes], [nodes[0].address]):
            caplog.clear()
            ds = EdgeDataset("gone@1", endpoints=endpoints, batch_size=10, retry_timeout=30)
            started = time.monotonic()
            with caplog.at_level(logging.DEBUG, logger="edgecache.clients.node_pool"):
                with pytest.raises(EdgeCacheError) as refused:
                    list(ds)
            ds.close()
            assert time.monotonic() - started < 10 and refused.value.code == "FAILED_PRECONDITION"
            said = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
            assert said and "the read fails now" in said[-1], said
            assert not [m for m in said if "retrying" in m], said
    finally:
        for n in nodes:
            n.stop()


def test_lmdb_alone_over_a_partial_cache_fails_when_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """3 of 8 shards staged, lmdb:// alone: the dataset was built with a warning and the
    epoch ended in AllNodesFailed at the first missing shard. It is refused when built,
    naming the count and the warm command; a split of staged shards only still reads, and
    with the node's gRPC endpoint after it the whole version reads as before. The warning
    that the other shards are read elsewhere is said only where something reads them."""
    write_parquet_shards(tmp_path / "origin", 8, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "part")
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        request = edge_pb2.StageRequest(dataset="part", version=1, shards=[0, 1, 2])
        assert list(stub(node.address).Stage(request))[-1].finished
        local = f"lmdb://{tmp_path / 'cache'}"
        caplog.set_level(logging.WARNING, logger="edgecache.clients.local_stores")
        with pytest.raises(ShardNotCached) as caught:
            EdgeDataset("part@1", endpoints=[local], batch_size=50)
        assert not [r for r in caplog.records if "the others are read" in r.getMessage()]
        said = str(caught.value)
        assert "holds 3 of the 8 shards of part@1" in said and "other 5" in said, said
        assert "edgecache warm part@1" in said, said
        # A version the cache never staged is not found there at all (docs' errors table).
        with pytest.raises(VersionNotFound, match="is in none of the local caches"):
            EdgeDataset("other@1", endpoints=[local], batch_size=50)
        # rows 0-299 are shards 0-2: all there.
        split = EdgeDataset("part@1", endpoints=[local], batch_size=50, rows=(0, 300))
        labels = [
            int(x) for b in torch.utils.data.DataLoader(split, batch_size=None) for x in b["label"]
        ]
        split.close()
        assert sorted(labels) == list(range(300))
        assert not [r for r in caplog.records if "the others are read" in r.getMessage()]
        both = EdgeDataset("part@1", endpoints=[local, node.address], batch_size=50)
        (said_once,) = [r for r in caplog.records if "the others are read" in r.getMessage()]
        assert "holds 3 of the 8 shards" in said_once.getMessage()
        assert "from the other endpoints" in said_once.getMessage()
        labels = [
            int(x) for b in torch.utils.data.DataLoader(both, batch_size=None) for x in b["label"]
        ]
        both.close()
        assert sorted(labels) == list(range(800))
    finally:
        node.stop()
