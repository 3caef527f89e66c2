"""Start DataLoader workers over ``lmdb://`` while another thread makes gRPC calls.

Run by tests/test_fork_safety.py in a fresh process (it may abort). Arguments: a
work directory, how many loader passes (each forks two workers), and ``wait`` or
``nowait``: with ``nowait`` the fork hook's wait for calls to end is switched off,
as it was before it existed. A thread calls the node's health check every 20 ms,
like a user's own gRPC client beside the training loop. Prints ``passes N`` at
the end; a crash of this process or of a worker ends it sooner.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc
import torch
from edgeutil import publish, stub, write_parquet_shards
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.clients import EdgeDataset, fork_safety
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2


def main(root: Path, passes: int, mode: str) -> None:
    registry = f"file://{root}/registry"
    write_parquet_shards(root / "origin", 2, rows=200)
    publish(registry, f"file://{root}/origin", "tokens")
    node = start_local_node("eu", root / "cache", registry)
    stop = threading.Event()

    def calls() -> None:
        while not stop.is_set():
            with grpc.insecure_channel(node.address) as channel:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            time.sleep(0.02)

    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        if mode == "nowait":
            fork_safety.wait_for_grpc_calls = lambda *args, **kwargs: {}  # type: ignore[assignment]
        caller = threading.Thread(target=calls, daemon=True)
        caller.start()
        ds = EdgeDataset("tokens@1", endpoints=[f"lmdb://{root}/cache"], batch_size=64)
        done = 0
        for _ in range(passes):
            # A worker forked in the race's window hangs: its batch times out here in
            # seconds, not at the test's 120 s process timeout (the test runs again).
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=20)
            assert sum(len(b["label"]) for b in loader) == 400
            done += 1
        print(f"passes {done}", flush=True)
    finally:
        stop.set()
        node.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
