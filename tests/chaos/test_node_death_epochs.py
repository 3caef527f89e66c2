"""The node being read is SIGKILLed at a random moment in each epoch, with DataLoader workers."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import torch
from chaosutil import count
from edgeutil import publish, write_parquet_shards

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, connect, start_local_node
from edgecache.v1 import edge_pb2

SHARDS, ROWS = 6, 3000


def kill_the_read_one(nodes: dict[str, LocalNode], killed: list[str]) -> None:
    """SIGKILL the node being read: one with a stream open, or serving chunks right now.

    Streams are short (one window each) and may be parked between windows, so a
    node whose chunks-served count grew since the last look counts as read too.
    """
    served: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for region, node in nodes.items():
            status = connect(node.address).Status(edge_pb2.StatusRequest(), timeout=5)
            growing = region in served and status.chunks_served > served[region]
            served[region] = status.chunks_served
            if status.active_streams or growing:
                node.process.kill()
                killed.append(region)
                return


def test_every_epoch_completes_exact_once(tmp_path: Path, figure) -> None:  # noqa: ANN001
    epochs = count(2, 10)
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=ROWS)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    nodes = {r: start_local_node(r, tmp_path / f"cache-{r}", registry) for r in ("a", "b")}
    rng = random.Random(8)
    exact = victims = 0
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
            killed: list[str] = []
            # The killer starts at a random batch of the epoch, from the loop itself: a timer
            # could fire after a fast epoch had ended (then no node was killed mid-stream).
            # A short step per batch keeps the reads paced by the loop while it looks.
            kill_at = rng.randrange(2, 100)
            killer = threading.Thread(target=kill_the_read_one, args=(nodes, killed))
            labels: list[int] = []
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
            for i, batch in enumerate(loader):
                if i == kill_at:
                    killer.start()
                labels += [int(x) for x in batch["label"]]
                time.sleep(0.005)
            if killer.ident is not None:
                killer.join()
            exact += sorted(labels) == list(range(SHARDS * ROWS))
            victims += bool(killed)
            for region in killed:
                nodes[region].stop()
                nodes[region] = start_local_node(region, tmp_path / f"cache-{region}", registry)
    finally:
        for node in nodes.values():
            node.stop()
    figure("epochs", epochs)
    figure("epochs where the node being read was killed mid-stream", victims)
    figure("epochs completed exact-once", exact)
    assert exact == epochs and victims == epochs
