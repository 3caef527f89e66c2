"""Damage to LMDB's own pages, not to a chunk: the node says so and stops serving.

A flipped page-type byte (an overflow page read as a branch) makes every get of
the value under it fail with MDB_CORRUPTED, and its delete too: the node can
neither drop the entry nor fetch it again, so it cannot mend itself. It used to
answer INTERNAL ("see the node's log") on every read of that shard, refuse
every eviction that reached it, and say SERVING all along (a helper's walk).
Now the calls that meet it answer DATA_LOSS saying what to do, health turns
NOT_SERVING (probes and readers go elsewhere), and the metric says it.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path
from urllib.request import urlopen

import grpc
from edgeutil import staged_by_a_node, stub
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgecache.clients.channels import CHANNEL_OPTIONS
from edgecache.clients.node_client import start_local_node
from edgecache.edge.service import SERVICE_NAME
from edgecache.v1 import edge_pb2

PAGE = 4096
P_OVERFLOW, P_BRANCH = 0x04, 0x01


def damage_an_overflow_page(cache: Path) -> None:
    """Make the first overflow page that holds a chunk frame read as a branch page."""
    data = bytearray((cache / "data.mdb").read_bytes())
    for page in range(2, len(data) // PAGE):
        at = page * PAGE
        # mp_flags at byte 10 of the page header; a frame's magic where the value begins.
        if (
            struct.unpack_from("<H", data, at + 10)[0] == P_OVERFLOW
            and data[at + 16 : at + 18] == b"EC"
        ):
            data[at + 10] = P_BRANCH
            (cache / "data.mdb").write_bytes(data)
            return
    raise AssertionError("no overflow page holding a chunk frame")


def health(address: str) -> int:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
    finally:
        channel.close()


def test_damaged_lmdb_pages_answer_data_loss_and_turn_health_not_serving(tmp_path: Path) -> None:
    registry, cache, _ = staged_by_a_node(tmp_path, 4, rows=3000)
    damage_an_overflow_page(cache)
    node = start_local_node("eu", cache, registry, extra_args=["--metrics-listen", "127.0.0.1:0"])
    try:
        assert health(node.address) == health_pb2.HealthCheckResponse.SERVING
        codes = {}
        for shard in range(4):
            request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=shard)
            try:
                list(stub(node.address).ReadShard(request, timeout=30))
                codes[shard] = "OK"
            except grpc.RpcError as exc:
                codes[shard] = exc.code().name
                if exc.code() == grpc.StatusCode.DATA_LOSS:
                    said = exc.details()
        assert sorted(codes.values()).count("DATA_LOSS") == 1, codes
        assert "damaged in LMDB's own pages" in said and "move its cache directory aside" in said
        assert health(node.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        metrics = urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
        assert re.search(r"^edgecache_cache_damaged\{[^}]*\} 1\.0$", metrics, re.M), metrics
    finally:
        node.stop()


def test_a_cache_whose_file_is_not_lmdb_any_more_names_the_fix_at_start(tmp_path: Path) -> None:
    registry, cache, _ = staged_by_a_node(tmp_path, 1, rows=100)
    data = bytearray((cache / "data.mdb").read_bytes())
    data[16:20] = bytes(4)  # both meta pages' magic: LMDB no longer knows the file
    data[PAGE + 16 : PAGE + 20] = bytes(4)
    (cache / "data.mdb").write_bytes(data)
    serve = [sys.executable, "-m", "edgecache.clients.cli", "serve", "--region", "eu"]
    serve += ["--cache-dir", str(cache), "--registry", registry, "--listen", "127.0.0.1:0"]
    out = subprocess.run(serve, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "move its cache directory aside" in out.stderr, out.stderr
