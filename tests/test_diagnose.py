"""A node's ``Diagnose`` of origin and of the registry, each through its own store.

Origin (where a version's shard data is) and the registry (its manifests) are
often on different schemes or endpoints: a ``file://`` registry beside an
``s3://`` origin, or the reverse. ``Diagnose("origin")`` measured the store of
the *registry's* scheme, so it reported "a local filesystem" for an S3 origin
(or timed the registry's bucket as origin), through the registry's client, and
counted none of origin's retries as origin's. Real parts: moto's S3 server
behind the fault proxy (SlowDown on the origin object's reads), nodes on
loopback, real LMDB.
"""

from __future__ import annotations

import re
import socket
import uuid
from pathlib import Path
from urllib.request import urlopen

import boto3
import grpc
import pytest
from edgeutil import node_settings, publish, stub, write_parquet_shards
from faultproxy import OriginFaults
from s3server import _boto_kwargs, make_bucket, upload_dir
from tlsutil import make_pki

from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


def _metric(port: int, name: str) -> float:
    text = urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(line.split()[-1])


def _keys(endpoint: str, bucket: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs())
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _diagnose(address: str, target: str) -> edge_pb2.PathReport:
    request = edge_pb2.DiagnoseRequest(target=target, seconds=1.0, streams=2)
    return stub(address).Diagnose(request, timeout=60)


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's retry sleeps, a twentieth as long (the same retries, less wall time)."""
    from botocore.retries.standard import ExponentialBackoff

    delay = ExponentialBackoff.delay_amount
    monkeypatch.setattr(
        ExponentialBackoff, "delay_amount", lambda self, context: delay(self, context) / 20
    )


def test_a_file_registry_and_an_s3_origin_each_measured_through_its_own_store(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_backoff: None
) -> None:
    bucket = f"diag-{uuid.uuid4().hex[:10]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 2, rows=1000)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    publish(f"file://{tmp_path}/registry", f"s3://{bucket}/raw/", "tokens")
    proxy = OriginFaults(s3_endpoint, {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "5")
    settings = node_settings(tmp_path, f"file://{tmp_path}/registry", metrics_listen="127.0.0.1:0")
    try:
        with running_node(settings) as node:
            last = list(
                stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
            )[-1]
            assert last.shards_done == 2 and not last.failures, last
            port = node.metrics_port
            assert _metric(port, "edgecache_origin_retries_total") == 0
            # Origin answers the read test's first two GETs with SlowDown (botocore retries).
            proxy.plan[re.compile(r"/raw/part-")] = ["503", "503"]
            origin = _diagnose(node.address, "origin")
            assert origin.target == "origin"
            # Measured through S3 (the old code said the registry's "local filesystem").
            assert origin.rtt_ms > 0 and origin.bytes_per_second > 0, origin
            assert origin.segments_sent > 0, origin
            assert "local filesystem" not in origin.note, origin.note
            assert proxy.injected == {"503": 2}
            # Origin's retries are origin's; the registry made none.
            assert _metric(port, "edgecache_origin_retries_total") == 2
            assert _metric(port, "edgecache_registry_retries_total") == 0
            registry = _diagnose(node.address, "registry")
            assert registry.target == "registry"
            assert "is on a local filesystem" in registry.note, registry.note
            assert registry.rtt_ms == 0 and registry.segments_sent == 0, registry
    finally:
        proxy.close()
    # The scratch objects went under origin's prefix, in a _ folder, and were deleted.
    assert sorted(_keys(s3_endpoint, bucket)) == [
        "raw/part-00000.parquet",
        "raw/part-00001.parquet",
    ]


def test_an_s3_registry_and_a_file_origin_each_measured_through_its_own_store(
    s3_endpoint: str, tmp_path: Path
) -> None:
    bucket = f"diag-{uuid.uuid4().hex[:10]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 1, rows=1000)
    registry_url = f"s3://{bucket}/_edgecache"
    publish(registry_url, f"file://{tmp_path}/raw", "tokens")
    # An s3:// registry's nodes read s3:// origins by default: the local one is named.
    settings = node_settings(
        tmp_path, registry_url, metrics_listen="127.0.0.1:0", origins=f"file://{tmp_path}/raw"
    )
    with running_node(settings) as node:
        unstaged = _diagnose(node.address, "origin")
        assert unstaged.note == "no object known to read: stage a version first", unstaged
        assert unstaged.segments_sent == 0  # origin is not known: nothing was uploaded
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        origin = _diagnose(node.address, "origin")
        # The old code timed the registry's bucket and called it origin.
        assert "is on a local filesystem" in origin.note and f"{tmp_path}/raw" in origin.note
        assert origin.rtt_ms == 0 and origin.segments_sent == 0, origin
        registry = _diagnose(node.address, "registry")
        assert registry.target == "registry"
        assert registry.rtt_ms > 0 and registry.segments_sent > 0, registry
        # Its rate is the upload's (it measured one; the doctor showed "—" for it).
        assert registry.bytes_per_second > 0, registry
        port = node.metrics_port
        assert _metric(port, "edgecache_origin_retries_total") == 0
        # A registry without the manifest of a version the node holds (the node pointed at
        # another registry, or the version removed): a note under an "ok" path before.
        client = boto3.client("s3", endpoint_url=s3_endpoint, **_boto_kwargs())
        client.delete_object(Bucket=bucket, Key="_edgecache/tokens/versions/1.json")
        with pytest.raises(grpc.RpcError) as lost:
            _diagnose(node.address, "registry")
        assert lost.value.code() == grpc.StatusCode.FAILED_PRECONDITION, lost.value
        assert "has no" in lost.value.details() and "registry setting" in lost.value.details()
    assert not [k for k in _keys(s3_endpoint, bucket) if "_diagnostics" in k]


def test_a_peer_path_that_fails_says_why_with_the_status_that_fits(tmp_path: Path) -> None:
    """A Diagnose of a peer that failed was INTERNAL "internal error; see the node's log",
    though the node knew why. Now as a Stage words the same peer: a peer that cannot be
    reached is UNAVAILABLE naming it; one that refuses this node's token or TLS settings
    FAILED_PRECONDITION naming the setting to fix on this node; a word that is no address,
    INVALID_ARGUMENT naming the targets the node knows. Real nodes on loopback."""
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "read").write_text("read-token")
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    registry = f"file://{tmp_path}/registry"
    guarded = node_settings(
        tmp_path, registry, cache_dir=tmp_path / "g", read_token_file=tmp_path / "read"
    )
    tls = node_settings(
        tmp_path,
        registry,
        cache_dir=tmp_path / "t",
        tls_cert=pki["server"],
        tls_key=pki["server_key"],
    )
    with (
        running_node(guarded) as token_peer,
        running_node(tls) as tls_peer,
        running_node(node_settings(tmp_path, registry)) as node,
    ):

        def failed(target: str) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as caught:
                _diagnose(node.address, target)
            return caught.value

        down = failed(gone)
        assert down.code() == grpc.StatusCode.UNAVAILABLE, down
        assert f"peer {gone}" in down.details() and "Connection refused" in down.details()
        assert "internal error" not in down.details(), down.details()

        refused = failed(token_peer.address)  # health checks pass, the upload is refused
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
        details = refused.details()
        assert f"peer {token_peer.address}" in details and "UNAUTHENTICATED" in details, details
        assert "set peer_token_file" in details and "refused this node" in details, details

        untrusted = failed(f"grpcs://{tls_peer.address}")  # no peer_tls_ca: the handshake fails
        assert untrusted.code() == grpc.StatusCode.FAILED_PRECONDITION, untrusted
        assert "set peer_tls_ca" in untrusted.details(), untrusted.details()
        assert f"grpcs://{tls_peer.address}" in untrusted.details(), untrusted.details()

        unknown = failed("registy")
        assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT, unknown
        assert "'origin', 'registry'" in unknown.details(), unknown.details()

    # With the settings named, the same peers accept a node and its paths are measured.
    fixed = node_settings(
        tmp_path,
        registry,
        cache_dir=tmp_path / "f",
        peer_token_file=tmp_path / "read",
        peer_tls_ca=pki["ca"],
    )
    with (
        running_node(guarded) as token_peer,
        running_node(tls) as tls_peer,
        running_node(fixed) as node,
    ):
        for target in (token_peer.address, f"grpcs://{tls_peer.address}"):
            report = _diagnose(node.address, target)
            assert report.rtt_ms > 0 and report.bytes_per_second > 0, (target, report)


def test_the_doctor_says_a_node_answering_registry_with_internal_is_probably_older(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node from before the "registry" target (bc17492) dials 'registry' as a peer's
    address and answers INTERNAL "internal error; see the node's log" (seen running
    bc17492^'s node): the doctor said only that, or "see its log". Here a current node
    whose registry test fails the way the old one's did (an error status_for does not
    map), which puts the same status and message on the wire; the doctor says the node
    probably does not know the target, and its origin row is measured as before."""
    from edgecache.clients.doctor import check_node_paths
    from edgecache.clients.topology import Topology
    from edgecache.edge import service

    async def as_a_peer(*args: object) -> edge_pb2.PathReport:
        raise RuntimeError("errors resolving registry: Domain name not found")

    monkeypatch.setattr(service, "diagnose_registry", as_a_peer)
    registry = f"file://{tmp_path}/registry"
    with running_node(node_settings(tmp_path, registry)) as node:
        with pytest.raises(grpc.RpcError) as old:
            _diagnose(node.address, "registry")
        assert old.value.code() == grpc.StatusCode.INTERNAL
        assert old.value.details() == "internal error; see the node's log"
        topology = Topology(registry=registry, regions={"eu": {"nodes": [node.address]}})
        paths = {p.target: p for p in check_node_paths(topology, seconds=0.5, streams=1)}
    (problem,) = paths["registry"].problems
    assert paths["registry"].code == "INTERNAL", problem
    assert "probably does not know this target" in problem and "upgrade it" in problem, problem
    assert not paths["origin"].problems, paths["origin"]


def test_the_registry_report_names_the_registry_without_its_password(tmp_path: Path) -> None:
    """Status shows the registry without user:password@, but Diagnose's note named it as
    configured, password included, to any caller (and `doctor --node-paths` printed it;
    a helper's hunt)."""
    import functools
    import http.server
    import threading

    write_parquet_shards(tmp_path / "origin", 1)
    publish(f"file://{tmp_path}/reg", f"file://{tmp_path}/origin", "tokens")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = f"http://alice:s3cr3t@127.0.0.1:{server.server_address[1]}/reg"
        with running_node(node_settings(tmp_path, registry)) as node:
            report = _diagnose(node.address, "registry")
            assert "s3cr3t" not in str(report) and "alice" not in str(report), report
            assert f"127.0.0.1:{server.server_address[1]}/reg" in report.note, report
    finally:
        server.shutdown()
