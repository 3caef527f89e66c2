"""The ceiling of a Python gRPC reader here: a bare grpcio stream of the same bytes, same run.

    python -m bench.peers.bare ADDRESS DATASET VERSION SHARDS STREAMS REPEAT

Why: edgecache's gRPC figure against the peers is bounded by what grpcio
itself moves on this machine. The orchestrator takes every ``ReadShard``
message the edge node sends for a version (its stored chunks, exactly as
they go on the wire), serves them from memory with ``bench.grpc_baseline``
(grpc.aio, no cache, no checksums, no bookkeeping), and this process reads
every shard once over ``STREAMS`` concurrent streams with the plainest
client there is: synchronous grpcio, responses kept as raw ``bytes``
(``response_deserializer=None``), nothing decoded, nothing copied out. The
fastest of ``REPEAT`` passes is printed as one ``RESULT`` line (bytes,
seconds, CPU seconds of this process), like bench.peers.epoch.

Where that stream is slower than the best peer (this 2-core machine: grpcio
moves ~1 GB/s of 4 MiB messages, LitData copies ~2–3 GB/s out of the page
cache), edgecache's gRPC target is set against it (>= 0.85x) instead of the
peer (>= 1.0x); the report says which applied.
"""

from __future__ import annotations

import json
import pickle
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench.peers.epoch import RESULT
from edgecache.cache.wire import READ_SHARD_METHOD
from edgecache.clients.channels import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2

__all__ = ["dump_messages", "read_all", "start_server"]


def _raw_call(channel: grpc.Channel) -> Any:
    return channel.unary_stream(
        READ_SHARD_METHOD,
        request_serializer=edge_pb2.ReadShardRequest.SerializeToString,
        response_deserializer=None,  # the message bytes as grpcio hands them over
    )


def dump_messages(node_address: str, dataset: str, version: int, shards: int, path: Path) -> int:
    """Every ReadShard message of the version, as the node sends it, pickled for the server."""
    channel = grpc.insecure_channel(node_address, options=CHANNEL_OPTIONS)
    try:
        call = _raw_call(channel)
        messages = {
            s: list(call(edge_pb2.ReadShardRequest(dataset=dataset, version=version, shard=s)))
            for s in range(shards)
        }
    finally:
        channel.close()
    with open(path, "wb") as f:
        pickle.dump(messages, f, protocol=pickle.HIGHEST_PROTOCOL)
    return sum(len(m) for ms in messages.values() for m in ms)


def start_server(messages: Path) -> tuple[subprocess.Popen[str], str]:
    """``bench.grpc_baseline`` serving ``messages`` from memory: (process, address)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_baseline", str(messages)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving on"):
        proc.kill()
        raise RuntimeError(f"bench.grpc_baseline did not start: {line!r}")
    return proc, line.split()[-1]


def read_all(address: str, dataset: str, version: int, shards: int, streams: int) -> int:
    """Read every shard once over ``streams`` concurrent streams; the bytes received."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    call = _raw_call(channel)
    totals = [0] * streams

    def worker(k: int) -> None:
        for shard in range(k, shards, streams):
            request = edge_pb2.ReadShardRequest(dataset=dataset, version=version, shard=shard)
            for message in call(request):
                totals[k] += len(message)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    return sum(totals)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    address, dataset, version, shards, streams, repeat = sys.argv[1:7]
    runs = []
    read_all(address, dataset, int(version), min(int(shards), 1), 1)  # connect, warm up
    for _ in range(int(repeat)):
        cpu, started = _cpu(), time.perf_counter()
        received = read_all(address, dataset, int(version), int(shards), int(streams))
        runs.append(
            {"bytes": received, "seconds": time.perf_counter() - started, "cpu_s": _cpu() - cpu}
        )
    best = min(runs, key=lambda r: r["seconds"])
    print(RESULT + json.dumps({**best, "streams": int(streams), "passes": len(runs)}), flush=True)


if __name__ == "__main__":
    main()
