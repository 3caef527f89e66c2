"""The node as a real subprocess (`edgecache serve`), its lifecycle, TLS, unreachable origin."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, read_shard_table, serve_process, stub, write_parquet_shards
from s3server import make_bucket, s3_env, upload_dir
from tlsutil import make_pki

from edgecache.edge.config import NodeConfig
from edgecache.edge.server import CHANNEL_OPTIONS, running_node
from edgecache.v1 import edge_pb2, edge_pb2_grpc


def start_node(
    tmp_path: Path, registry: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    environ = {
        **os.environ,
        **(env or {}),
        # settings through the environment, as in a container
        "EDGECACHE_REGION": "eu-west",
        "EDGECACHE_CACHE_DIR": str(tmp_path / "cache"),
        "EDGECACHE_REGISTRY": registry,
    }
    args = ["--listen", "127.0.0.1:0", "--capacity", "256MiB"]
    return serve_process(args, environ, tmp_path / f"node-{uuid.uuid4().hex[:8]}.log")


def test_sigterm_drains_streams_and_restart_serves_committed(tmp_path: Path) -> None:
    tables = write_parquet_shards(tmp_path / "origin", 2, rows=20_000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    proc, address = start_node(tmp_path, registry)
    try:
        client = stub(address)
        list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        stream = client.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=1))
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the in-flight stream finishes within the grace period
        assert 1 + len(rest) == first.chunk_count
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for path in (tmp_path / "origin").iterdir():
        path.unlink()  # from now on only the cache has the data
    proc, address = start_node(tmp_path, registry)
    try:
        client = stub(address)
        status = client.Status(edge_pb2.StatusRequest())
        assert status.versions[0].shard_count == 2
        for i, table in enumerate(tables):
            assert read_shard_table(client, "tokens", 1, i).equals(table)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_unreachable_origin_is_unavailable_naming_it(tmp_path: Path, s3_endpoint: str) -> None:
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"s3://{bucket}/raw", "tokens")
    dead = {**s3_env("http://127.0.0.1:9"), "AWS_MAX_ATTEMPTS": "2"}  # nothing listens there
    proc, address = start_node(tmp_path, registry, env=dead)
    try:
        client = stub(address)
        with pytest.raises(grpc.RpcError) as info:
            list(client.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"s3://{bucket}/raw/part-00000.parquet" in info.value.details()
        assert "unreachable" in info.value.details()
        assert client.Status(edge_pb2.StatusRequest()).region == "eu-west"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_bad_settings_exit_with_a_clear_message(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "serve",
            "--region",
            "eu",
            "--cache-dir",
            str(tmp_path),
            "--registry",
            "file:///x",
            "--capacity",
            "lots",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "--capacity: invalid size" in out.stderr and "invalid size 'lots'" in out.stderr


def test_a_port_another_node_serves_is_refused_and_a_freed_one_reused(tmp_path: Path) -> None:
    # gRPC shares ports by default (SO_REUSEPORT): a second node would "serve" beside the
    # first, each getting some of the connections. It must refuse, naming what to change.
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    proc, address = start_node(tmp_path, registry)
    port = address.rsplit(":", 1)[1]

    def second_node(listen: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *(sys.executable, "-m", "edgecache.clients.cli", "serve", "--region", "eu"),
                *("--registry", registry, "--capacity", "64MiB"),
                *("--cache-dir", str(tmp_path / "other"), "--listen", listen),
                *("--probe-listen", "127.0.0.1:0"),
            ],
            capture_output=True,
            text=True,
            timeout=30,  # before the fix it served: a timeout
        )

    try:
        second = second_node(address)
        assert second.returncode == 2, second.stderr
        assert f"{address} is in use: another process listens there" in second.stderr
        assert "choose another --listen" in second.stderr
        assert "serving on" not in second.stdout
        # localhost is both loopbacks to gRPC, which bound ::1 alone and served beside the
        # first node (exit 0, both saying the same node id): one taken address refuses it.
        by_name = second_node(f"localhost:{port}")
        assert by_name.returncode == 2, by_name.stderr
        assert f"localhost:{port} is in use: another process listens there" in by_name.stderr
        assert stub(address).Status(edge_pb2.StatusRequest()).region == "eu-west"
        settings = NodeConfig(
            region="eu",
            cache_dir=tmp_path / "probe",
            registry=registry,
            listen="127.0.0.1:0",
            probe_listen=address,  # the same for the health-only probe port
        )
        with (
            pytest.raises(ValueError, match="choose another --probe-listen"),
            running_node(settings),
        ):
            pass
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # The first node is gone: its port is free again at once, for the same node to restart.
    settings = NodeConfig(
        region="eu",
        cache_dir=tmp_path / "cache",
        registry=registry,
        listen=f"127.0.0.1:{port}",
    )
    with running_node(settings) as node:
        assert stub(node.address).Status(edge_pb2.StatusRequest()).region == "eu"


def test_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    tables = write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    settings = NodeConfig(
        region="eu",
        cache_dir=tmp_path / "cache",
        registry=registry,
        listen="127.0.0.1:0",
        sync=False,
        tls_cert=pki["server"],
        tls_key=pki["server_key"],
        tls_client_ca=pki["ca"],
    )
    with running_node(settings) as node:
        good = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"].read_bytes(),
            private_key=pki["client_key"].read_bytes(),
            certificate_chain=pki["client"].read_bytes(),
        )
        client = edge_pb2_grpc.EdgeCacheStub(
            grpc.secure_channel(node.address, good, options=CHANNEL_OPTIONS)
        )
        assert read_shard_table(client, "tokens", 1, 0).equals(tables[0])
        anonymous = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        refused = edge_pb2_grpc.EdgeCacheStub(grpc.secure_channel(node.address, anonymous))
        with pytest.raises(grpc.RpcError) as info:
            refused.Status(edge_pb2.StatusRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        plaintext = stub(node.address)
        with pytest.raises(grpc.RpcError):
            plaintext.Status(edge_pb2.StatusRequest(), timeout=5)


def test_a_stopped_in_process_node_leaves_no_grpc_aio_thread(tmp_path: Path) -> None:
    """After ``running_node`` ends, gRPC aio's poller thread is gone, so forks are safe.

    While that thread lives it sits inside gRPC core, gRPC skips its fork handlers,
    and DataLoader workers forked then inherit a broken gRPC (they segfaulted in CI).
    The node served a call first: served calls leave the cycles that kept it alive.
    """
    from edgecache.clients.fork_safety import grpc_aio_running

    registry = f"file://{tmp_path}/registry"
    settings = NodeConfig(
        region="eu", cache_dir=tmp_path / "cache", registry=registry, listen="127.0.0.1:0"
    )
    with running_node(settings) as node:
        assert stub(node.address).Status(edge_pb2.StatusRequest()).region == "eu"
        assert grpc_aio_running()  # so the check below cannot pass for a renamed thread
    assert not grpc_aio_running()


def test_a_probe_port_picked_at_bind_is_said(tmp_path: Path) -> None:
    """With --probe-listen HOST:0 the chosen port was printed nowhere (found only with ss)."""
    (tmp_path / "registry").mkdir()
    proc, address = start_node(
        tmp_path, f"file://{tmp_path}/registry", env={"EDGECACHE_PROBE_LISTEN": "127.0.0.1:0"}
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().split()
        assert said[:3] == ["health", "probe", "on"] and not said[-1].endswith(":0"), said
        from edgecache.clients.healthcheck import check

        assert check(said[-1], timeout=5)[0]  # the port said is the probe's
        assert address.startswith("127.0.0.1:")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_exposure_names_the_port_bound_not_the_0_asked_for(tmp_path: Path) -> None:
    from edgecache.edge.config import NodeConfig
    from edgecache.edge.server import exposure

    config = NodeConfig(region="eu", cache_dir=tmp_path, registry="file:///r", listen="10.0.0.5:0")
    said = exposure(config, port=41234)
    assert said and all("10.0.0.5:41234" in line for line in said), said
    fixed = NodeConfig(
        region="eu", cache_dir=tmp_path, registry="file:///r", listen="10.0.0.5:7070"
    )
    assert all("10.0.0.5:7070" in line for line in exposure(fixed, port=7070))
