"""Staging through origin faults: throttling, errors, resets, short bodies, stalls."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, read_shard_table, stub, write_parquet_shards
from faultproxy import OriginFaults
from s3server import make_bucket, upload_dir

from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's retry sleeps, a twentieth as long: the same retries, in less wall time.

    Standard mode sleeps rand(0, 1) x 2^n s before retry n+1, so the always-500
    object's retries (AWS_MAX_ATTEMPTS=5: six requests) slept 0-31 s (about 15 s on
    average) and made this test's time 8-25 s. Every request, fault and retry
    still happens, through botocore's own retry handler; only the waits shrink.
    """
    from botocore.retries.standard import ExponentialBackoff

    delay = ExponentialBackoff.delay_amount
    monkeypatch.setattr(
        ExponentialBackoff, "delay_amount", lambda self, context: delay(self, context) / 20
    )


def test_staging_rides_out_origin_faults_and_names_a_dead_object(
    s3_endpoint: str,
    tmp_path: Path,
    figure,  # noqa: ANN001
    short_backoff: None,
) -> None:
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    tables = write_parquet_shards(tmp_path / "raw", 6, rows=3000)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"s3://{bucket}/raw", "tokens")
    proxy = OriginFaults(
        s3_endpoint,
        {
            r"part-00000": ["503", "503", "503"],
            r"part-00001": ["500", "reset"],
            r"part-00002": ["truncate", "503"],
            r"part-00003": ["stall"],
            r"part-00005": ["always500"],
        },
    )
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS")}
    os.environ.update(AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="5")
    try:
        settings = NodeConfig(
            region="eu",
            cache_dir=tmp_path / "cache",
            registry=registry,
            listen="127.0.0.1:0",
            capacity="256MiB",
            sync=False,
            metrics_listen="127.0.0.1:0",
        )
        with running_node(settings) as node:
            client = stub(node.address)
            events = []
            with pytest.raises(grpc.RpcError) as info:
                for event in client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)):
                    events.append(event)
            last = events[-1]
            assert last.finished and last.shards_done == 5 and last.shards_failed == 1
            assert "part-00005.parquet" in last.failures[0].message
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            for shard in range(5):
                assert read_shard_table(client, "tokens", 1, shard).equals(tables[shard])
            from urllib.request import urlopen

            metrics = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
            retries = float(
                next(
                    line
                    for line in metrics.splitlines()
                    if line.startswith("edgecache_origin_retries_total{")
                ).split()[-1]
            )
    finally:
        proxy.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    figure("faults injected", dict(proxy.injected))
    figure("shards staged correctly", 5)
    figure("retries counted by the node (edgecache_origin_retries_total)", retries)
    # Each retry follows a fault (17-27 were counted for these when every fetch took
    # the difference of a counter shared with the fetches beside it). Every fault but
    # the stall (an answer 2 s late) and the dead object's last 500 is retried, and
    # counted: botocore's retries of a request it gave up on too (7 were counted when
    # only those of requests that succeeded in the end were).
    faults = sum(proxy.injected.values())
    assert faults - 2 <= retries <= faults
    # AWS_MAX_ATTEMPTS=5 is five requests in all for the object that always fails
    # (botocore's max_attempts counts retries: it made six).
    assert proxy.injected["500"] - 1 == 5  # one 500 went to part-00001


def _metric(port: int, name: str) -> float | None:
    """One of the node's samples, as ``/metrics`` shows it (None: not exported)."""
    from urllib.request import urlopen

    text = urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(found[0].split()[-1]) if found else None


def test_registry_retries_are_not_origin_retries(
    s3_endpoint: str,
    tmp_path: Path,
    figure,  # noqa: ANN001
    short_backoff: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Throttled manifest reads count in edgecache_registry_retries_total, not as origin's.

    edgecache_origin_retries_total against edgecache_origin_fetches_total says how
    origin fetches of shard data fare (an alert fires on their ratio); the registry,
    read through the same S3 client before, added its retries to it.
    """
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    tables = write_parquet_shards(tmp_path / "raw", 2, rows=1000)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    publish(f"s3://{bucket}/_reg", f"s3://{bucket}/raw", "tokens")
    # Shard data untouched; the version's manifest answered with SlowDown twice.
    proxy = OriginFaults(s3_endpoint, {r"/_reg/tokens/versions/1\.json$": ["503", "503"]})
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "5")
    settings = NodeConfig(
        region="eu",
        cache_dir=tmp_path / "cache",
        registry=f"s3://{bucket}/_reg",
        listen="127.0.0.1:0",
        sync=False,
        metrics_listen="127.0.0.1:0",
    )
    try:
        with running_node(settings) as node:
            client = stub(node.address)
            last = list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1]
            assert last.finished and last.shards_done == 2 and not last.failures, last
            for shard in range(2):
                assert read_shard_table(client, "tokens", 1, shard).equals(tables[shard])
            port = node.metrics_port
            origin = _metric(port, "edgecache_origin_retries_total")
            registry = _metric(port, "edgecache_registry_retries_total")
            fetches = _metric(port, "edgecache_origin_fetches_total")
    finally:
        proxy.close()
    figure("registry faults injected", dict(proxy.injected))
    figure("edgecache_registry_retries_total", registry)
    figure("edgecache_origin_retries_total", origin)
    assert proxy.injected == {"503": 2}  # both on the manifest, both retried by botocore
    assert fetches == 2 and origin == 0, f"{origin} registry retries counted as origin's"
    assert registry == 2


def test_a_publish_whose_answer_is_lost_is_one_version(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_backoff: None
) -> None:
    """The create-only PUT of versions/1.json lands, its answer does not: the retry met
    its own write (412) and the publish took it for another publisher's, publishing the
    same data again as tokens@2."""
    from edgecache.cache.registry import Registry

    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    proxy = OriginFaults(
        s3_endpoint, {r"/_reg/tokens/versions/1\.json$": ["lost"]}, methods=("PUT",)
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    try:
        manifest = publish(f"s3://{bucket}/_reg", f"s3://{bucket}/raw", "tokens")
        versions = Registry.run(f"s3://{bucket}/_reg", lambda reg: reg.versions("tokens"))
    finally:
        proxy.close()
    assert proxy.injected == {"lost": 1}
    assert manifest.version == 1 and versions == [1], versions
