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
import uuid
from pathlib import Path
from urllib.request import urlopen

import boto3
import pytest
from edgeutil import node_settings, publish, stub, write_parquet_shards
from faultproxy import OriginFaults
from s3server import _boto_kwargs, make_bucket, upload_dir

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
    settings = node_settings(tmp_path, registry_url, metrics_listen="127.0.0.1:0")
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
        port = node.metrics_port
        assert _metric(port, "edgecache_origin_retries_total") == 0
    assert not [k for k in _keys(s3_endpoint, bucket) if "_diagnostics" in k]
