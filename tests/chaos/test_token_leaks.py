"""Tokens never appear in logs, error messages or metrics."""

from __future__ import annotations

from pathlib import Path
from urllib.request import urlopen

import grpc
from edgeutil import publish, stub, write_parquet_shards

from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2

ADMIN, READ = "adm1n-s3cret-Zq9", "r3ad-s3cret-Xw7"


def test_tokens_never_leak(tmp_path: Path, figure) -> None:  # noqa: ANN001
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    (tmp_path / "admin").write_text(ADMIN)
    (tmp_path / "read").write_text(READ)
    log = tmp_path / "node.log"
    node = start_local_node(
        "eu",
        tmp_path / "cache",
        registry,
        log_file=log,
        extra_args=[
            "--metrics-listen",
            "127.0.0.1:0",
            "--token-file",
            str(tmp_path / "admin"),
            "--read-token-file",
            str(tmp_path / "read"),
            "--log-level",
            "DEBUG",
        ],
        env={"GRPC_VERBOSITY": "debug"},
    )
    proc, address, metrics_address = node.process, node.address, node.metrics_address
    try:
        client = stub(address)
        details = []
        attempts = [
            None,
            (("authorization", f"Bearer {READ}x"),),
            (("authorization", ADMIN),),
            (("authorization", f"Bearer {READ}"),),
        ]
        for metadata in attempts:
            for call in (
                lambda md=metadata: client.Stage(
                    edge_pb2.StageRequest(dataset="tokens", version=1), metadata=md
                ),
                lambda md=metadata: client.ReadShard(
                    edge_pb2.ReadShardRequest(dataset="tokens", version=1), metadata=md
                ),
                lambda md=metadata: client.Evict(
                    edge_pb2.EvictRequest(dataset="tokens", version=1), metadata=md
                ),
            ):
                try:
                    result = call()
                    if hasattr(result, "__iter__"):
                        list(result)
                except grpc.RpcError as exc:
                    details.append(exc.details() or "")
        metrics = urlopen(f"http://{metrics_address}/metrics").read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    leaks = sum(t in blob for t in (ADMIN, READ) for blob in (text, metrics, *details))
    figure("unauthenticated or wrong-token calls", len(details))
    figure("token occurrences in logs, errors and metrics", leaks)
    assert details and leaks == 0
    assert "UNAUTHENTICATED" in text or "refused" in text  # refusals are logged, without tokens
