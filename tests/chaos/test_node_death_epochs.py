"""The node being read is SIGKILLed at a random moment in each epoch, with DataLoader workers."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import torch
from chaosutil import count
from edgeutil import publish, write_parquet_shards

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node

SHARDS, ROWS = 6, 800


def test_every_epoch_completes_exact_once(tmp_path: Path, figure) -> None:  # noqa: ANN001
    epochs = count(2, 10)
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=ROWS)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    nodes = {r: start_local_node(r, tmp_path / f"cache-{r}", registry) for r in ("a", "b")}
    rng = random.Random(8)
    exact = 0
    try:
        for epoch in range(epochs):
            ds = EdgeDataset(
                "tokens@1",
                endpoints=[n.address for n in nodes.values()],
                batch_size=40,
                window_bytes=16 << 10,
                prefetch_bytes=1,
                threads=1,
                retry_timeout=10,
            )
            ds.set_epoch(epoch)
            victim_region = rng.choice(sorted(nodes))
            victim = nodes[victim_region]
            timer = threading.Timer(rng.uniform(0.05, 0.4), victim.process.kill)
            timer.start()
            labels = [
                int(x)
                for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
                for x in b["label"]
            ]
            timer.join()
            exact += sorted(labels) == list(range(SHARDS * ROWS))
            victim.stop()
            nodes[victim_region] = start_local_node(
                victim_region, tmp_path / f"cache-{victim_region}", registry
            )
    finally:
        for node in nodes.values():
            node.stop()
    figure("epochs with a node killed", epochs)
    figure("epochs completed exact-once", exact)
    assert exact == epochs
