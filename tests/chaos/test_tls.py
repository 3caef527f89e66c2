"""Mutual TLS and tokens end to end, with a node dying under an encrypted epoch.

Two nodes require client certificates from the test CA and a read token.
A training job reads through ``grpcs://`` with DataLoader workers, its
certificate given the way users give it (``EDGECACHE_TLS_*``), while the
node it reads is SIGKILLed. Then every wrong way in is tried: no client
certificate, one from another CA, a client that trusts another CA (a node
impersonated), plaintext, no token, a wrong token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from edgeutil import publish, write_parquet_shards
from tlsutil import make_pki

from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc

SHARDS, ROWS = 4, 3000
READ_TOKEN = "read-7c1d0d3a9b"
ADMIN_TOKEN = "admin-52f0e8c41a"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki")


def _start(tmp_path: Path, region: str, pki: dict[str, Path], registry: str) -> LocalNode:
    (tmp_path / "read.token").write_text(READ_TOKEN)
    (tmp_path / "admin.token").write_text(ADMIN_TOKEN)
    return start_local_node(
        region,
        tmp_path / f"cache-{region}",
        registry,
        extra_args=[
            "--tls-cert",
            str(pki["server"]),
            "--tls-key",
            str(pki["server_key"]),
            "--tls-client-ca",
            str(pki["ca"]),
            "--read-token-file",
            str(tmp_path / "read.token"),
            "--token-file",
            str(tmp_path / "admin.token"),
        ],
    )


@pytest.fixture
def nodes(tmp_path: Path, pki: dict[str, Path]) -> Iterator[list[LocalNode]]:
    write_parquet_shards(tmp_path / "origin", SHARDS, rows=ROWS)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    started = [_start(tmp_path, r, pki, registry) for r in ("a", "b")]
    yield started
    for node in started:
        node.stop()


@pytest.fixture
def client_env(pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {
        "EDGECACHE_TLS_CA": str(pki["ca"]),
        "EDGECACHE_TLS_CERT": str(pki["client"]),
        "EDGECACHE_TLS_KEY": str(pki["client_key"]),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _secure_stub(address: str, **credentials: bytes | None) -> edge_pb2_grpc.EdgeCacheStub:
    channel = grpc.secure_channel(
        address, grpc.ssl_channel_credentials(**credentials), options=CHANNEL_OPTIONS
    )
    return edge_pb2_grpc.EdgeCacheStub(channel)


def test_mtls_epoch_survives_a_node_death(
    nodes: list[LocalNode],
    client_env: dict[str, str],
    tmp_path: Path,
    figure,  # noqa: ANN001
) -> None:
    endpoints = [f"grpcs://{node.address}" for node in nodes]
    ds = EdgeDataset(
        "tokens@1",
        endpoints=endpoints,
        token=READ_TOKEN,
        batch_size=50,
        window_bytes=16 << 10,
        prefetch_bytes=1,
        threads=1,
    )
    reading = nodes[endpoints.index(ds.pool().ranked()[0].text)]
    survivor = endpoints[1 - nodes.index(reading)]
    started = time.monotonic()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    labels = []
    for i, batch in enumerate(loader):
        # Killed from the loop, a few batches in: a timer could fire after a fast epoch
        # had ended (then nothing died mid-epoch).
        if i == 3:
            reading.process.kill()
        labels += [int(x) for x in batch["label"]]
    labels.sort()
    figure(
        "mTLS epoch with the node being read SIGKILLed, exact-once",
        labels == list(range(SHARDS * ROWS)),
    )
    figure("epoch seconds", f"{time.monotonic() - started:.1f}")
    assert labels == list(range(SHARDS * ROWS))
    assert reading.process.poll() is not None  # the kill landed during the epoch
    # The ops CLI speaks mTLS from the same environment.
    topology = tmp_path / "edgecache.yaml"
    topology.write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  b:\n    nodes: ['{survivor}']\n"
    )
    status = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "status", "--config", str(topology)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            **client_env,
            "COLUMNS": "200",
            "EDGECACHE_TOKEN_FILE": str(tmp_path / "read.token"),
        },
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "serving" in status.stdout and "tokens@1" in status.stdout, status.stdout


def test_every_wrong_way_in_is_refused(
    nodes: list[LocalNode],
    pki: dict[str, Path],
    tmp_path: Path,
    figure,  # noqa: ANN001
) -> None:
    (tmp_path / "rogue").mkdir()
    rogue = make_pki(tmp_path / "rogue")
    address = nodes[0].address
    ca = pki["ca"].read_bytes()
    client = {
        "private_key": pki["client_key"].read_bytes(),
        "certificate_chain": pki["client"].read_bytes(),
    }
    request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
    reads = {"authorization": f"Bearer {READ_TOKEN}"}
    attempts = {
        "no client certificate": (_secure_stub(address, root_certificates=ca), reads),
        "client certificate from another CA": (
            _secure_stub(
                address,
                root_certificates=ca,
                private_key=rogue["client_key"].read_bytes(),
                certificate_chain=rogue["client"].read_bytes(),
            ),
            reads,
        ),
        "client trusting another CA (node impersonated)": (
            _secure_stub(address, root_certificates=rogue["ca"].read_bytes(), **client),
            reads,
        ),
        "plaintext": (
            edge_pb2_grpc.EdgeCacheStub(grpc.insecure_channel(address)),
            reads,
        ),
        "right certificate, no token": (_secure_stub(address, root_certificates=ca, **client), {}),
        "right certificate, wrong token": (
            _secure_stub(address, root_certificates=ca, **client),
            {"authorization": "Bearer not-the-token"},
        ),
        "right certificate, read token for Evict": (
            _secure_stub(address, root_certificates=ca, **client),
            reads,
        ),
    }
    refused = {}
    for name, (stub, metadata) in attempts.items():
        call = (
            (
                lambda s=stub, m=metadata: s.Evict(
                    edge_pb2.EvictRequest(dataset="tokens", version=1),
                    metadata=tuple(m.items()),
                    timeout=5,
                )
            )
            if "Evict" in name
            else (
                lambda s=stub, m=metadata: list(
                    s.ReadShard(request, metadata=tuple(m.items()), timeout=5)
                )
            )
        )
        with pytest.raises(grpc.RpcError) as info:
            call()
        refused[name] = info.value.code()
    good = _secure_stub(address, root_certificates=ca, **client)
    assert list(good.ReadShard(request, metadata=tuple(reads.items()), timeout=30))
    figure("wrong ways in tried", len(attempts))
    figure("refused", f"{len(refused)} ({', '.join(f'{k}: {v.name}' for k, v in refused.items())})")
    transport = [k for k in attempts if "token" not in k]
    assert all(refused[k] == grpc.StatusCode.UNAVAILABLE for k in transport)
    # gRPC's convention: an unknown caller is UNAUTHENTICATED, a known one that may not
    # make this call (the read token on an admin call) PERMISSION_DENIED.
    tokens = [k for k in attempts if "token" in k]
    assert all(
        refused[k]
        == (
            grpc.StatusCode.PERMISSION_DENIED
            if "read token" in k
            else grpc.StatusCode.UNAUTHENTICATED
        )
        for k in tokens
    ), refused
