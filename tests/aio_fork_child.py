"""Build an EdgeDataset over gRPC and fork twice, with or without gRPC aio in this process.

Run by tests/test_fork_safety.py in a fresh process: ``in-process`` serves the
node from a grpc.aio server in this process (the poller thread runs at the
forks), ``subprocess`` from ``edgecache serve`` (no aio here). A third argument,
``open`` or ``closed``, first takes one batch from an iterator of the dataset and
leaves it open (its streams are gRPC calls in flight at the forks) or closes it.
The children exit at once; what is checked is what this process logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from edgeutil import publish, write_parquet_shards

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node
from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node


@contextlib.contextmanager
def node(root: Path, registry: str, where: str) -> Iterator[str]:
    if where == "in-process":
        config = NodeConfig(
            region="eu", cache_dir=root / "cache", registry=registry, listen="127.0.0.1:0"
        )
        with running_node(config) as server:
            yield server.address
    else:
        local = start_local_node("eu", root / "cache", registry)
        try:
            yield local.address
        finally:
            local.stop()


def main(root: Path, where: str, iterator: str = "none") -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    # A look at the first batch leaves streams open only where the epoch outlasts it:
    # a version of many windows, and a read-ahead of one batch.
    looks = iterator != "none"
    write_parquet_shards(root / "origin", 4 if looks else 1, rows=1500 if looks else 100)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tokens")
    with node(root, registry, where) as address:
        small = {"window_bytes": 16 << 10, "prefetch_bytes": 1} if looks else {}
        dataset = EdgeDataset("tokens@1", endpoints=[address], batch_size=10, **small)
        if iterator != "none":  # a look at the first batch, before the loader forks
            batches = iter(dataset)
            next(batches)
            if iterator == "closed":
                batches.close()
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        dataset.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
