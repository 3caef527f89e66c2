"""Random bits flipped in a node's LMDB file: detected, dropped, re-fetched, never delivered.

Half the flips land in the 32-byte frame headers (magic, format, codec, rows, the two
length fields, the checksum): random offsets over frames of many KiB would almost never
reach them, and a damaged length field must be treated as damage like any other.
"""

from __future__ import annotations

import mmap
import random
from pathlib import Path
from urllib.request import urlopen

import pyarrow as pa
import torch
from chaosutil import count
from edgeutil import staged_by_a_node
from prometheus_client.parser import text_string_to_metric_families

from edgecache.cache.frame import HEADER_SIZE
from edgecache.cache.keys import ShardKey
from edgecache.cache.store import CacheStore
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import connect, start_local_node
from edgecache.v1 import edge_pb2


def scrape(address: str, name: str) -> float:
    """One sample of a node's /metrics (summed over labels)."""
    text = urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_flipped_bytes_are_never_delivered(tmp_path: Path, figure) -> None:  # noqa: ANN001
    flips = count(30, 100)
    registry, cache, tables = staged_by_a_node(tmp_path, 6, rows=3000)
    truth = pa.concat_tables(tables)

    with CacheStore(cache, readonly=True) as store:
        frames = [
            (info.key, i, store.get_chunk(info.key, i))
            for info in store.shards("tokens", 1)
            for i in range(info.chunk_count)
        ]
    rng = random.Random(5)
    damaged: set[tuple[ShardKey, int]] = set()
    in_header = 0
    with (cache / "data.mdb").open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        where = {(key, index): m.find(frame) for key, index, frame in frames}  # before any flip
        assert all(at >= 0 for at in where.values())
        for flip in range(flips):
            key, index, frame = rng.choice(frames)
            offset = rng.randrange(HEADER_SIZE if flip % 2 else len(frame))
            m[where[key, index] + offset] ^= 1 << rng.randrange(8)
            damaged.add((key, index))
            in_header += offset < HEADER_SIZE
        m.flush()

    node = start_local_node("eu", cache, registry, extra_args=["--metrics-listen", "127.0.0.1:0"])
    try:
        ds = EdgeDataset(
            "tokens@1", endpoints=[node.address], batch_size=100, window_bytes=64 << 10
        )
        wrong = seen = 0
        by_label = truth.column("input_ids").combine_chunks().values.to_numpy().reshape(-1, 32)
        for batch in torch.utils.data.DataLoader(ds, batch_size=None):
            labels = batch["label"].numpy()
            seen += len(labels)
            wrong += int((batch["input_ids"].numpy() != by_label[labels]).any(axis=1).sum())
        status = connect(node.address).Status(edge_pb2.StatusRequest())
        corrupt = scrape(node.metrics_address, "edgecache_corrupt_chunks_total")
    finally:
        node.stop()
    figure("bits flipped (in frame headers)", f"{flips} ({in_header})")
    figure("chunks damaged", len(damaged))
    figure("corrupted samples delivered", wrong)
    figure("damaged chunks found (edgecache_corrupt_chunks_total)", corrupt)
    figure("shards re-fetched from origin (misses)", status.misses)
    figure("origin bytes re-fetched", status.origin_bytes)
    assert seen == truth.num_rows and wrong == 0
    # Every damaged shard found and re-fetched (a shard's first damaged chunk drops it whole).
    assert corrupt >= len({key for key, _ in damaged}) and status.misses >= corrupt
