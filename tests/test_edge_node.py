"""The edge node against real parts: gRPC on loopback, file:// and moto's S3 over HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import grpc
import numpy as np
import pyarrow as pa
import pytest
from edgeutil import publish, read_shard_table, stub, write_parquet_shards
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from s3server import make_bucket, put_object, upload_dir

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import MalformedShard
from edgecache.cache.registry import Registry
from edgecache.edge.config import NodeConfig
from edgecache.edge.node import EdgeNode
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


def config(tmp_path: Path, registry: str, **overrides: object) -> NodeConfig:
    settings: dict = dict(
        region="eu-west",
        cache_dir=tmp_path / "cache",
        registry=registry,
        listen="127.0.0.1:0",
        capacity="256MiB",
        sync=False,
    )
    settings.update(overrides)
    return NodeConfig(**settings)


@pytest.fixture
def file_setup(tmp_path: Path) -> tuple[str, list[pa.Table]]:
    tables = write_parquet_shards(tmp_path / "origin", 4)
    publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/origin", "tokens")
    return f"file://{tmp_path}/registry", tables


def metric(node: EdgeNode, name: str, **labels: str) -> float:
    """A node's metric value, read from its Prometheus registry."""
    return node.metrics.value(name, **labels)


def code_of(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return info.value


def test_file_origin_end_to_end(tmp_path: Path, file_setup) -> None:
    registry, tables = file_setup
    with running_node(config(tmp_path, registry, metrics_listen="127.0.0.1:0")) as node:
        client = stub(node.address)
        resolved = client.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="tokens"))
        assert (resolved.version, resolved.shard_count) == (1, 4)
        manifest = client.GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=1))
        assert manifest.digest == resolved.digest
        assert [s.row_count for s in manifest.shards] == [t.num_rows for t in tables]
        for shard in (2, 0):  # a miss (read-through), then more
            assert read_shard_table(client, "tokens", 1, shard).equals(tables[shard])
        assert read_shard_table(client, "tokens", 1, 2).equals(tables[2])  # a hit
        # resume from a later chunk: the tail of the shard, exactly
        chunks = list(
            client.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=2))
        )
        assert len(chunks) > 2 and all(c.chunk_count == len(chunks) for c in chunks)
        tail = read_shard_table(client, "tokens", 1, 2, start=2)
        skipped = sum(c.rows for c in chunks[:2])
        assert tail.equals(tables[2].slice(skipped))
        status = client.Status(edge_pb2.StatusRequest())
        assert (status.region, status.misses, status.hits) == ("eu-west", 2, 3)
        assert status.versions[0].shard_count == 2 and status.versions[0].total_shards == 4
        assert status.origin_bytes > 0 and status.bytes_served > 0
        metrics = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
        for name in (
            "edgecache_served_bytes_total",
            "edgecache_cache_hits_total",
            "edgecache_origin_fetch_seconds_bucket",
            "edgecache_cache_used_bytes",
            "edgecache_active_streams",
        ):
            assert name in metrics
        scraped = {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        }
        # Status and /metrics read the same counts: one place keeps them.
        assert (status.hits, status.misses) == (
            scraped["edgecache_cache_hits_total"],
            scraped["edgecache_cache_misses_total"],
        )
        assert status.bytes_served == scraped["edgecache_served_bytes_total"]
        assert status.chunks_served == scraped["edgecache_served_chunks_total"]
        assert status.origin_bytes == scraped["edgecache_origin_bytes_total"]
        assert scraped["edgecache_origin_fetches_total"] == 2


def test_stage_skips_what_is_cached_and_pins(tmp_path: Path, file_setup) -> None:
    registry, _ = file_setup
    with running_node(config(tmp_path, registry)) as node:
        client = stub(node.address)
        read_shard_table(client, "tokens", 1, 1)
        until = datetime.now(UTC) + timedelta(hours=2)
        request = edge_pb2.StageRequest(dataset="tokens", version=1)
        request.pin_until.FromDatetime(until)
        events = list(client.Stage(request))
        last = events[-1]
        assert last.finished and (last.shards_done, last.shards_skipped, last.shards_total) == (
            4,
            1,
            4,
        )
        assert [e.shards_done for e in events[:-1]] == [1, 2, 3, 4]
        again = list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1]
        assert again.shards_skipped == 4 and again.bytes_done == 0
        version = client.Status(edge_pb2.StatusRequest()).versions[0]
        assert version.shard_count == 4
        assert abs(version.pinned_until.ToDatetime(tzinfo=UTC) - until) < timedelta(seconds=1)

        def pinned() -> datetime:
            status = client.Status(edge_pb2.StatusRequest())
            return status.versions[0].pinned_until.ToDatetime(tzinfo=UTC)

        # A Stage's pin_until is "at least until": a shorter one (staging for an earlier
        # job) keeps the longer pin the plan placed; a longer one extends it.
        request.pin_until.FromDatetime(until - timedelta(hours=1))
        list(client.Stage(request))
        assert abs(pinned() - until) < timedelta(seconds=1)
        request.pin_until.FromDatetime(until + timedelta(hours=1))
        list(client.Stage(request))
        assert abs(pinned() - (until + timedelta(hours=1))) < timedelta(seconds=1)
        freed = client.Evict(edge_pb2.EvictRequest(dataset="tokens", version=1)).bytes_freed
        assert freed == version.stored_bytes
        assert not client.Status(edge_pb2.StatusRequest()).versions


def test_concurrent_readers_of_a_missing_shard_fetch_once(tmp_path: Path, file_setup) -> None:
    registry, tables = file_setup
    with running_node(config(tmp_path, registry)) as node:
        client = stub(node.address)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: read_shard_table(client, "tokens", 1, 3), range(8)))
        assert all(t.equals(tables[3]) for t in results)
        manifest = client.GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=1))
        status = client.Status(edge_pb2.StatusRequest())
        assert node.node is not None
        assert metric(node.node, "edgecache_origin_fetches_total") == 1  # exactly one fetch
        assert status.origin_bytes == manifest.shards[3].source_size
        # Readers that arrive once the shard is in are hits: on a loaded machine some may.
        assert status.misses >= 1 and status.misses + status.hits == 8


def test_bad_requests_get_the_right_codes(tmp_path: Path, file_setup) -> None:
    registry, _ = file_setup
    with running_node(config(tmp_path, registry, metrics_listen="127.0.0.1:0")) as node:
        c = stub(node.address)
        cases = [
            (
                lambda: c.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="nope")),
                "NOT_FOUND",
                "no versions",
            ),
            (
                lambda: c.GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=9)),
                "NOT_FOUND",
                "known versions: 1",
            ),
            (
                lambda: c.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="../x")),
                "INVALID_ARGUMENT",
                "invalid dataset name",
            ),
            (
                lambda: c.ResolveVersion(
                    edge_pb2.ResolveVersionRequest(dataset="tokens", version="-1")
                ),
                "INVALID_ARGUMENT",
                "latest",
            ),
            (
                lambda: c.ReadShard(
                    edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=99)
                ),
                "INVALID_ARGUMENT",
                "shard 99 does not exist",
            ),
            (
                lambda: c.ReadShard(
                    edge_pb2.ReadShardRequest(
                        dataset="tokens", version=1, shard=0, start_chunk=4_000_000_000
                    )
                ),
                "INVALID_ARGUMENT",
                "past the end",
            ),
            (  # a start chunk past the end row: the stream ended OK with no row
                lambda: c.ReadShard(
                    edge_pb2.ReadShardRequest(
                        dataset="tokens", version=1, shard=0, start_chunk=1, end_row=1
                    )
                ),
                "INVALID_ARGUMENT",
                "no row to send",
            ),
            (
                lambda: c.ReadShard(
                    edge_pb2.ReadShardRequest(dataset="tokens", version=0, shard=0)
                ),
                "INVALID_ARGUMENT",
                "version",
            ),
            (
                lambda: c.ReadShard(
                    edge_pb2.ReadShardRequest(
                        dataset="tokens", version=1, shard=0, digest="sha256:" + "0" * 64
                    )
                ),
                "FAILED_PRECONDITION",
                "resolve the version again",
            ),
            (
                lambda: c.Stage(edge_pb2.StageRequest(dataset="tokens", version=1, shards=[7])),
                "INVALID_ARGUMENT",
                "shard 7",
            ),
            (
                lambda: c.Evict(edge_pb2.EvictRequest(dataset="Bad Name", version=1)),
                "INVALID_ARGUMENT",
                "invalid dataset name",
            ),
        ]
        for call, code, text in cases:
            error = code_of(call)
            assert error.code().name == code, (code, error.details())
            assert text in error.details(), (text, error.details())
        assert c.Status(edge_pb2.StatusRequest()).region == "eu-west"  # still serving
        # A reader's stale digest is the reader's to fix: counted apart from the node's own
        # failures, which the failing-reads alert pages on (it read FAILED_PRECONDITION,
        # the code of origin losing an object, with "republish" as the advice).
        metrics = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
        results = re.findall(
            r'^edgecache_reads_total\{.*result="([A-Za-z_]+)".*\} (\S+)', metrics, re.M
        )
        assert ("stale_digest", "1.0") in results, results
        assert "FAILED_PRECONDITION" not in dict(results), results


def _republished(
    registry: str,
    *,
    source_url: str | None = None,
    keys: list[str] | None = None,
    level: int | None = None,
) -> int:
    """tokens@1 with a source URL, shard keys or zstd level no publish writes now, committed.

    What versions published before publish checked them may hold.
    """
    from edgecache.cache.manifest import build_manifest, manifest_schema

    async def go(reg: Registry) -> int:
        old = await reg.manifest("tokens", 1)
        spec = type(old.preprocess)()
        spec.CopyFrom(old.preprocess)
        spec.compression_level = spec.compression_level if level is None else level
        shards = list(old.shards)
        for shard, key in zip(shards, keys or [], strict=False):
            shard.source_key = key
        manifest = build_manifest(
            dataset="tokens",
            version=1,
            source_url=old.source_url if source_url is None else source_url,
            source_format=old.source_format,
            schema=manifest_schema(old),
            preprocess=spec,
            shards=shards,
        )
        return (await reg.commit(manifest)).version

    return Registry.run(registry, go)


def test_origin_refusals_fail_precondition_naming_the_object(tmp_path: Path, file_setup) -> None:
    # Not UNAVAILABLE: that tells the caller to check the node and retry, and the node is fine.
    from edgecache.clients.channels import node_error

    registry, _ = file_setup
    origin = f"file://{tmp_path}/origin/"
    # What `publish raw/pq` wrote before it made plain paths into file:// URLs.
    plain = _republished(
        registry, source_url="origin/", keys=[f"{origin}part-{i:05d}.parquet" for i in range(4)]
    )
    level = _republished(registry, level=30)  # before publish checked the level
    (tmp_path / "origin" / "part-00002.parquet").unlink()
    with running_node(config(tmp_path, registry)) as node:
        c = stub(node.address)
        # A source URL with no scheme lies in no origin the node reads: refused before any
        # shard is fetched (it was a path relative to wherever the node ran).
        stage = code_of(
            lambda: c.Stage(edge_pb2.StageRequest(dataset="tokens", version=plain, shards=[0]))
        )
        assert stage.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "reads origin/, outside the origins" in stage.details()
        cases = [
            (1, [2], f"no object at {origin}part-00002.parquet", "restore it or publish"),
            (level, [0], "zstd level must be in -7..22, got 30", "publish it again"),
        ]
        for version, shards, what, advice in cases:
            events = []
            request = edge_pb2.StageRequest(dataset="tokens", version=version, shards=shards)
            with pytest.raises(grpc.RpcError) as info:
                for event in c.Stage(request):
                    events.append(event)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
            assert what in info.value.details() and advice in info.value.details()
            failure = events[-1].failures[0]
            assert failure.code == "FAILED_PRECONDITION" and advice in failure.message
            hint = str(node_error(info.value, endpoint=node.address, what="staging"))
            assert "retrying will not help" in hint and "check that the node runs" not in hint
        read = code_of(
            lambda: c.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=plain, shard=1))
        )
        assert read.code() == grpc.StatusCode.FAILED_PRECONDITION  # read-through: the same


def test_origin_failures_are_transient_unless_origin_refused() -> None:
    from botocore.exceptions import ClientError

    from edgecache.cache.errors import OriginError
    from edgecache.edge.service import status_for

    def origin_error(cause: BaseException) -> OriginError:
        try:
            raise OriginError(f"origin request for s3://b/k failed: {cause}") from cause
        except OriginError as exc:
            return exc

    def s3(status: int, code: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    refused = [PermissionError(13, "Permission denied"), s3(403, "AccessDenied")]
    refused += [IsADirectoryError(21, "Is a directory"), ValueError("Protocol not known: x")]
    refused += [s3(403, "InvalidAccessKeyId"), s3(403, "SignatureDoesNotMatch")]
    refused += [s3(403, "AllAccessDisabled"), s3(403, "AccountProblem")]
    refused += [s3(400, "InvalidBucketName"), s3(404, "NoSuchBucket")]
    refused += [s3(403, "403"), s3(400, "SomeNewRefusal")]  # unknown codes: the 4xx band
    transient = [ConnectionRefusedError(111, "refused"), TimeoutError(), s3(503, "SlowDown")]
    transient += [s3(500, "InternalError"), s3(429, "TooManyRequests")]
    # S3 sends these transient errors with a 4xx status: the code decides, not the band.
    transient += [s3(400, "RequestTimeout"), s3(409, "OperationAborted")]
    transient += [s3(503, "ServiceUnavailable"), s3(408, "SomeNewTimeout"), s3(502, "BadGateway")]
    for cause in refused:
        code, message = status_for(origin_error(cause))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, cause
        assert "fix access" in message, message
    for cause in transient:
        assert status_for(origin_error(cause))[0] == grpc.StatusCode.UNAVAILABLE, cause
    # A node whose clock is off: not a retry's business, nor an access problem to chase.
    code, message = status_for(origin_error(s3(403, "RequestTimeTooSkewed")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "clock" in message and "fix access" not in message, message


def test_origin_object_changed_after_publish_is_refused(tmp_path: Path, file_setup) -> None:
    registry, _ = file_setup
    write_parquet_shards(tmp_path / "other", 1, rows=10)
    (tmp_path / "origin" / "part-00001.parquet").write_bytes(
        (tmp_path / "other" / "part-00000.parquet").read_bytes()
    )
    with running_node(config(tmp_path, registry)) as node:
        c = stub(node.address)
        error = code_of(
            lambda: c.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=1))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "part-00001.parquet changed after the version was published" in error.details()
        assert read_shard_table(c, "tokens", 1, 0).num_rows == 3000  # others still served
        assert [v.shard_count for v in c.Status(edge_pb2.StatusRequest()).versions] == [1]


def test_malformed_shard_fails_alone_during_stage(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    write_parquet_shards(origin, 3)
    bad = origin / "part-00001.parquet"
    data = bytearray(bad.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[4:footer] = b"\xff" * (footer - 4)  # pages garbled, footer intact: publish succeeds
    bad.write_bytes(bytes(data))
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{origin}", "tokens")
    with running_node(config(tmp_path, registry)) as node:
        c = stub(node.address)
        events = []
        with pytest.raises(grpc.RpcError) as info:
            for event in c.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)):
                events.append(event)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "part-00001.parquet" in info.value.details()
        last = events[-1]
        assert last.finished and last.shards_failed == 1 and last.shards_done == 2
        assert "part-00001.parquet" in last.failures[0].message
        assert last.failures[0].code == "FAILED_PRECONDITION"  # mapped by the service
        assert read_shard_table(c, "tokens", 1, 2).num_rows == 3000
        status = c.Status(edge_pb2.StatusRequest())
        assert status.versions[0].shard_count == 2  # nothing partial


@pytest.mark.parametrize(
    ("name", "body", "expected"),
    [
        ("bad.jsonl", b'{"a": 1}\n{"a": 2}\n{"a": 3,,}\n', "line 3"),
        ("bad.csv", b"a,b,c\n1,2,3\n4,5\n", "Row #3"),
    ],
)
def test_publish_names_the_bad_row(tmp_path: Path, name: str, body: bytes, expected: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / name).write_bytes(body)
    with pytest.raises(MalformedShard, match=expected) as info:
        publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/src", "bad")
    assert name in str(info.value)


def test_cache_full_of_pins_refuses_staging_and_serves_reads_uncached(
    tmp_path: Path, file_setup
) -> None:
    """Staging cannot make room (RESOURCE_EXHAUSTED); a reader still gets its rows.

    A read-through that the cache cannot keep is served from what was fetched and
    not cached: failing it left a job with no way to read its data at all.
    """
    registry, _ = file_setup
    tables = write_parquet_shards(tmp_path / "origin2", 1)
    publish(registry, f"file://{tmp_path}/origin2", "other")
    with running_node(config(tmp_path, registry, capacity="700KiB")) as node:
        c = stub(node.address)
        request = edge_pb2.StageRequest(dataset="tokens", version=1, shards=[0, 1, 2])
        request.pin_until.FromDatetime(datetime.now(UTC) + timedelta(hours=1))
        list(c.Stage(request))
        error = code_of(lambda: list(c.Stage(edge_pb2.StageRequest(dataset="other", version=1))))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "pinned: tokens@1" in error.details()
        assert read_shard_table(c, "other", 1, 0).equals(tables[0])
        held = c.Status(edge_pb2.StatusRequest())
        assert not [v for v in held.versions if v.dataset == "other" and v.shard_count], held


def test_manifest_kept_when_registry_is_gone(tmp_path: Path, file_setup) -> None:
    registry, tables = file_setup
    with running_node(config(tmp_path, registry)) as node:
        read_shard_table(stub(node.address), "tokens", 1, 0)
    os.rename(tmp_path / "registry", tmp_path / "registry-away")
    with running_node(config(tmp_path, registry)) as node:  # restarted node, registry away
        c = stub(node.address)
        assert read_shard_table(c, "tokens", 1, 0).equals(tables[0])
        assert c.GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=1)).version == 1
        error = code_of(lambda: c.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="tokens")))
        assert error.code() == grpc.StatusCode.NOT_FOUND


def test_tokens_guard_admin_and_reads(tmp_path: Path, file_setup) -> None:
    registry, _ = file_setup
    (tmp_path / "admin").write_text("s3cret-admin\n")
    (tmp_path / "reader").write_text("s3cret-read")
    settings = config(
        tmp_path, registry, token_file=tmp_path / "admin", read_token_file=tmp_path / "reader"
    )
    with running_node(settings) as node:
        c = stub(node.address)
        for metadata, ok in (
            (None, False),
            ((("authorization", "Bearer nope"),), False),
            ((("authorization", "Bearer s3cret-read"),), True),
        ):

            def call(md=metadata):  # noqa: ANN001, ANN202
                return c.ResolveVersion(
                    edge_pb2.ResolveVersionRequest(dataset="tokens"), metadata=md
                )

            if ok:
                assert call().version == 1
            else:
                assert code_of(call).code() == grpc.StatusCode.UNAUTHENTICATED
        stage = edge_pb2.StageRequest(dataset="tokens", version=1, shards=[0])
        error = code_of(lambda: c.Stage(stage, metadata=(("authorization", "Bearer s3cret-read"),)))
        # The read token is known but may not stage: PERMISSION_DENIED, naming the admin token.
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
        assert "Stage" in error.details() and "admin token" in error.details()
        assert "s3cret" not in error.details()
        events = list(c.Stage(stage, metadata=(("authorization", "Bearer s3cret-admin"),)))
        assert events[-1].finished
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(node.address))
        assert (
            health.Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_a_read_token_without_an_admin_token_refuses_admin_calls(
    tmp_path: Path, file_setup
) -> None:
    """With --read-token-file alone, Stage and Evict answered anyone, even callers with no
    token that could not read: a node guarding its reads left its cache open to emptying."""
    registry, _ = file_setup
    (tmp_path / "reader").write_text("s3cret-read")
    with running_node(config(tmp_path, registry, read_token_file=tmp_path / "reader")) as node:
        c = stub(node.address)
        evict = edge_pb2.EvictRequest(dataset="tokens", version=1)
        for metadata in (None, (("authorization", "Bearer s3cret-read"),)):
            error = code_of(lambda md=metadata: c.Evict(evict, metadata=md))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
            assert "no admin token" in error.details() and "--token-file" in error.details()
        stage = edge_pb2.StageRequest(dataset="tokens", version=1, shards=[0])
        assert code_of(lambda: list(c.Stage(stage))).code() == grpc.StatusCode.PERMISSION_DENIED
        reader = (("authorization", "Bearer s3cret-read"),)
        request = edge_pb2.ResolveVersionRequest(dataset="tokens")
        assert c.ResolveVersion(request, metadata=reader).version == 1  # reads still work


def test_health_and_reflection(tmp_path: Path, file_setup) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    registry, _ = file_setup
    with running_node(config(tmp_path, registry, probe_listen="127.0.0.1:0")) as node:
        channel = grpc.insecure_channel(node.address)
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="edgecache.v1.EdgeCache")
        assert health.Check(request).status == health_pb2.HealthCheckResponse.SERVING
        probe = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{node.probe_port}"))
        assert (
            probe.Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"edgecache.v1.EdgeCache", "grpc.health.v1.Health"} <= names


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("taken", ["probe_listen", "metrics_listen", "listen"])
def test_a_port_in_use_leaves_the_nodes_other_ports_free(
    tmp_path: Path, file_setup, taken: str
) -> None:
    """A node that cannot bind one of its ports releases those it bound: --listen above all.

    In-process nodes (tests, the demo) live on after a failed start, so a port
    kept bound would stay taken, and a second start on it would fail.
    """
    from edgecache.cache.errors import ConfigError
    from edgecache.edge.server import NodeServer

    registry, _ = file_setup
    ports = {flag: free_port() for flag in ("listen", "probe_listen", "metrics_listen")}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports[taken] = busy.getsockname()[1]
        addresses = {flag: f"127.0.0.1:{port}" for flag, port in ports.items()}
        node = NodeServer(config(tmp_path, registry, **addresses))

        async def start() -> None:
            flag = "--" + taken.replace("_", "-")
            with pytest.raises(ConfigError, match=f"{flag}: .* is in use") as failed:
                await node.start()
            assert node._probe is None and node._server is None
            for flag, port in ports.items():
                if flag != taken:  # the failure is still held: nothing was collected
                    with socket.socket() as again:
                        again.bind(("127.0.0.1", port))
            assert failed.value is not None

        asyncio.run(start())


def test_publishers_racing_for_a_version_never_both_win(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "origin", 1, rows=10)

    async def race() -> list[int]:
        registry = Registry(f"file://{tmp_path}/registry")
        try:
            from edgecache.cache.manifest import preprocess_spec

            results = await asyncio.gather(
                *(
                    registry.publish(f"file://{tmp_path}/origin", "raced", spec=preprocess_spec())
                    for _ in range(6)
                )
            )
            return sorted(m.version for m in results)
        finally:
            await registry.close()

    assert asyncio.run(race()) == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------- S3


@pytest.fixture
def s3_dataset(s3_endpoint: str, tmp_path: Path) -> tuple[str, str, list[pa.Table]]:
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    tables = write_parquet_shards(tmp_path / "raw", 3)
    upload_dir(s3_endpoint, bucket, "raw/tokens", tmp_path / "raw")
    registry = f"s3://{bucket}/_edgecache"
    publish(registry, f"s3://{bucket}/raw/tokens", "tokens")
    return bucket, registry, tables


def test_s3_origin_end_to_end(tmp_path: Path, s3_dataset) -> None:
    bucket, registry, tables = s3_dataset
    with running_node(config(tmp_path, registry)) as node:
        c = stub(node.address)
        assert (
            c.ResolveVersion(
                edge_pb2.ResolveVersionRequest(dataset="tokens", version="latest")
            ).version
            == 1
        )
        last = list(c.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))[-1]
        assert last.finished and last.shards_done == 3 and last.bytes_done == last.bytes_total
        for i, table in enumerate(tables):
            assert read_shard_table(c, "tokens", 1, i).equals(table)


def test_s3_conditional_publish_and_changed_object(
    s3_endpoint: str, tmp_path: Path, s3_dataset
) -> None:
    bucket, registry, _ = s3_dataset
    again = publish(registry, f"s3://{bucket}/raw/tokens", "tokens")
    assert again.version == 2
    put_object(s3_endpoint, bucket, "raw/tokens/part-00000.parquet", b"PAR1 not the same PAR1")
    with running_node(config(tmp_path, registry)) as node:
        c = stub(node.address)
        error = code_of(
            lambda: c.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"s3://{bucket}/raw/tokens/part-00000.parquet changed" in error.details()


# ------------------------------------------------------------ stored damage


def _header_flips(frame: bytes) -> dict[str, tuple[int, int]]:
    """One flipped bit per header field: field name -> (offset into the frame, bit)."""
    payload_len = int.from_bytes(frame[8:16], "little")
    top = payload_len.bit_length() - 1  # a set bit: clearing it makes the header claim less
    return {
        "magic": (0, 0),
        "format": (2, 1),
        "codec": (3, 2),  # 1 ^ 4 = 5: no such codec
        "rows": (4, 0),
        "payload_len claims more": (11, 7),  # + 2 GiB
        "payload_len claims less": (8 + top // 8, top % 8),
        "raw_len": (16, 0),
        "checksum": (24, 0),
    }


def test_damaged_frame_headers_are_dropped_and_refetched(tmp_path: Path) -> None:
    """A flipped bit in any header field of a stored chunk, or a chunk gone: dropped,
    re-fetched, never served.

    The client (EdgeDataset over a real node) sees the right rows and no error; the node
    counts each damaged chunk and fetches each damaged shard from origin once more.
    """
    import lmdb
    from storeutil import flip_on_disk

    from edgecache.cache.keys import chunk_key
    from edgecache.cache.store import CacheStore
    from edgecache.clients import EdgeDataset

    kinds = [*_header_flips(b"\0" * 32), "chunk missing"]
    tables = write_parquet_shards(tmp_path / "origin", len(kinds), rows=1000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(config(tmp_path, registry)) as node:
        last = list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        assert last[-1].shards_done == len(kinds)
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        infos = store.shards("tokens", 1)
        frames = [store.get_chunk(info.key, 1) for info in infos]  # a middle chunk of each
    assert all(info.chunk_count > 2 for info in infos)
    for info, kind, frame in zip(infos, kinds, frames, strict=True):
        if kind == "chunk missing":  # the shard record lists it, the chunks db lost it
            env = lmdb.open(str(tmp_path / "cache"), max_dbs=8)
            chunks = env.open_db(b"chunks", create=False)
            with env.begin(write=True) as txn:
                assert txn.delete(chunk_key(info.key.encode(), 1), db=chunks)
            env.close()
        else:
            offset, bit = _header_flips(frame)[kind]
            flip_on_disk(tmp_path / "cache", frame, offset, bit)

    with running_node(config(tmp_path, registry)) as node:
        ds = EdgeDataset("tokens@1", endpoints=[node.address], batch_size=500, shuffle=False)
        labels, ids = [], []
        try:
            for batch in ds:
                labels.append(batch["label"].numpy().copy())
                ids.append(batch["input_ids"].numpy().copy())
        finally:
            ds.close()
        assert node.node is not None
        corrupt = metric(node.node, "edgecache_corrupt_chunks_total")
        fetches = metric(node.node, "edgecache_origin_fetches_total")
        status = stub(node.address).Status(edge_pb2.StatusRequest())
    truth = pa.concat_tables(tables)
    want = truth.column("input_ids").combine_chunks().values.to_numpy().reshape(-1, 32)
    label = np.concatenate(labels)
    assert np.array_equal(np.sort(label), truth.column("label").to_numpy())  # each row once
    assert np.array_equal(np.concatenate(ids), want[label])  # with the bytes it was published with
    assert corrupt == len(kinds)  # every damaged chunk seen and counted
    assert fetches == len(kinds)  # every damaged shard fetched from origin once more
    # Every read that found its shard dropped is a miss; reads of one shard share its fetch.
    assert status.misses >= len(kinds)


def test_read_and_stage_latency_histograms_by_result(tmp_path: Path) -> None:

    write_parquet_shards(tmp_path / "origin", 2, rows=500)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(config(tmp_path, registry)) as node:
        client = stub(node.address)
        # Refused before a stream begins (a cached_only miss, an unknown version): counted.
        for request in (
            edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=1, cached_only=True),
            edge_pb2.ReadShardRequest(dataset="tokens", version=7, shard=0),
        ):
            with pytest.raises(grpc.RpcError):
                list(client.ReadShard(request))
        list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        read_shard_table(client, "tokens", 1, 0)
        with pytest.raises(grpc.RpcError):
            list(client.ReadShard(edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=9)))
        assert node.node is not None
        m = node.node.metrics
        assert m.value("edgecache_stage_seconds_count", result="ok") == 1
        assert m.value("edgecache_read_first_chunk_seconds_count", result="ok") == 1
        assert m.value("edgecache_read_first_chunk_seconds_count", result="INVALID_ARGUMENT") == 1
        assert m.value("edgecache_read_chunk_seconds_count") >= 1
        assert m.value("edgecache_read_first_chunk_seconds_count", result="NOT_FOUND") == 1
        # A cached_only miss (a peer copy asking the rendezvous owner first) is its own
        # result, so the read-failure alert does not take it for a node failing reads.
        assert m.value("edgecache_read_first_chunk_seconds_count", result="not_cached") == 1
        assert (
            m.value("edgecache_read_first_chunk_seconds_count", result="FAILED_PRECONDITION") == 0
        )
        # Every read counted once by how it ended, beside the first-chunk histogram.
        for result, count in (("ok", 1), ("INVALID_ARGUMENT", 1), ("NOT_FOUND", 1)):
            assert m.value("edgecache_reads_total", result=result) == count, result
        assert m.value("edgecache_reads_total", result="not_cached") == 1


def test_a_peer_copy_does_not_slow_this_nodes_staging(tmp_path: Path, file_setup) -> None:
    """Staging yields to training reads; a cached_only read (a peer region copying, a probe)
    is not one: it held this node's staging at one shard at a time while it lasted."""
    registry, tables = file_setup
    with running_node(config(tmp_path, registry)) as node:
        assert node.node is not None
        gate = node.node.gate
        client = stub(node.address)
        started = []
        real = gate.read_started

        async def counting() -> None:
            started.append(1)
            await real()

        gate.read_started = counting  # type: ignore[method-assign]
        assert read_shard_table(client, "tokens", 1, 0).equals(tables[0])  # a training read
        assert len(started) == 1
        request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0, cached_only=True)
        assert list(client.ReadShard(request))  # what a peer's copy asks
        assert len(started) == 1 and gate.reads_active == 0


def test_a_chunk_damaged_again_after_a_refetch_ends_the_read(tmp_path: Path, file_setup) -> None:
    """A chunk found damaged, fetched anew and damaged again is not here to be had: the read
    ends (UNAVAILABLE, the reader fails over) instead of re-fetching the shard forever."""
    from edgecache.cache.errors import ChunkCorrupt

    registry, tables = file_setup
    with running_node(config(tmp_path, registry)) as node:
        assert node.node is not None
        client = stub(node.address)
        assert read_shard_table(client, "tokens", 1, 0).equals(tables[0])

        def always_damaged(key: object, index: int, first_row: int) -> bytes:
            raise ChunkCorrupt("chunk checksum mismatch (a test)")

        node.node.encoded_chunk = always_damaged  # type: ignore[method-assign]
        request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
        error = code_of(lambda: list(client.ReadShard(request, timeout=10)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "damaged again" in (error.details() or ""), error.details()


def test_a_read_that_fails_after_its_first_chunk_is_counted_as_failed(
    tmp_path: Path, file_setup
) -> None:
    """Reads were counted by their first chunk alone: one that failed midway (a chunk
    damaged again after a refetch) stood as ok, and the failing-reads alert missed it."""
    from edgecache.cache.errors import ChunkCorrupt

    registry, tables = file_setup
    with running_node(config(tmp_path, registry)) as node:
        assert node.node is not None
        client = stub(node.address)
        assert read_shard_table(client, "tokens", 1, 0).equals(tables[0])
        (info,) = [i for i in node.node.store.shards("tokens", 1) if i.key.shard == 0]
        assert info.chunk_count >= 2, "a one-chunk shard cannot fail after its first chunk"
        real = node.node.encoded_chunk

        def damaged_after_the_first(key: object, index: int, first_row: int) -> bytes:
            if index == 0:
                return real(key, index, first_row)  # type: ignore[arg-type]
            raise ChunkCorrupt("chunk checksum mismatch (a test)")

        node.node.encoded_chunk = damaged_after_the_first  # type: ignore[method-assign]
        request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
        error = code_of(lambda: list(client.ReadShard(request, timeout=10)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        m = node.node.metrics
        assert m.value("edgecache_read_first_chunk_seconds_count", result="ok") == 2
        assert m.value("edgecache_reads_total", result="ok") == 1  # the first read only
        assert m.value("edgecache_reads_total", result="UNAVAILABLE") == 1


@pytest.mark.parametrize("field", ["chunk_count", "chunk_rows"])
def test_a_damaged_shard_record_never_ends_a_stream_early_with_ok(
    tmp_path: Path, field: str
) -> None:
    """The record lists how many chunks a shard has and each one's rows; a stream is
    planned from it. A count damaged from 4 to 3 ended a ReadShard after 3 chunks with
    status OK (the node dropped and re-fetched the shard, then kept the damaged plan)."""
    import lmdb

    from edgecache.cache.keys import ShardKey
    from edgecache.v1 import store_pb2

    tables = write_parquet_shards(tmp_path / "origin", 1, rows=1000)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(config(tmp_path, registry)) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
    env = lmdb.open(str(tmp_path / "cache"), max_dbs=8)
    shards = env.open_db(b"shards", create=False)
    raw_key = ShardKey("tokens", 1, 0).encode()
    with env.begin(write=True) as txn:
        record = store_pb2.StoredShard.FromString(txn.get(raw_key, db=shards))
        assert record.chunk_count > 2
        if field == "chunk_count":
            record.chunk_count -= 1
        else:
            record.chunk_rows[-1] -= 1
        txn.put(raw_key, record.SerializeToString(), db=shards)
    env.close()
    with running_node(config(tmp_path, registry)) as node:
        table = read_shard_table(stub(node.address), "tokens", 1, 0)
        assert node.node is not None
        corrupt = metric(node.node, "edgecache_corrupt_chunks_total")
    # Every row, as published (re-fetched from origin).
    assert table.column("label").to_pylist() == tables[0].column("label").to_pylist()
    assert table.column("input_ids").to_pylist() == tables[0].column("input_ids").to_pylist()
    assert corrupt == 1


def test_a_drain_lets_a_running_shard_fetch_commit_whole(tmp_path: Path) -> None:
    """SIGTERM promised running shard fetches would commit whole; close() cancelled them,
    so a shard slower than the drain (its reader gone, a stage in the background) was
    thrown away at every (rolling) restart."""
    import pyarrow.parquet as pq

    from edgecache.cache.store import CacheStore

    rng = np.random.default_rng(7)
    (tmp_path / "origin").mkdir()
    ids = rng.integers(0, 1 << 30, size=(40_000, 64), dtype=np.int64)  # slow at zstd-19
    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 64),
            "label": pa.array(np.arange(len(ids))),
        }
    )
    pq.write_table(table, tmp_path / "origin" / "part-0.parquet")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "slow", compression_level=19)
    # The drain the config sets (as SIGTERM), not running_node's short default: the
    # fetch takes a second or more at zstd-19, longer on a slow or busy machine.
    with running_node(config(tmp_path, registry, grace_seconds=60), grace=None) as node:
        # A read-through miss whose reader goes away: the fetch goes on without it.
        call = stub(node.address).ReadShard(
            edge_pb2.ReadShardRequest(dataset="slow", version=1, shard=0)
        )
        deadline = time.monotonic() + 10
        while not node.node._inflight and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert node.node._inflight, "the fetch never started"  # type: ignore[union-attr]
        call.cancel()
        time.sleep(0.1)
        held = node.node.store.shards("slow", 1)  # type: ignore[union-attr]
        assert not held, "committed before the drain: the test proves nothing"
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        held = store.shards("slow", 1)
    assert [s.key.shard for s in held] == [0]


def test_malformed_requests_and_the_bearer_scheme(tmp_path: Path, file_setup) -> None:
    """A body that is not the method's message was UNKNOWN naming a Python class; 'bearer'
    in lower case was read as no token."""
    registry, _ = file_setup
    (tmp_path / "admin").write_text("s3cret-admin")
    with running_node(config(tmp_path, registry, token_file=tmp_path / "admin")) as node:
        channel = grpc.insecure_channel(node.address)
        for method, body in (
            ("ResolveVersion", b"\\xff\\xff\\xff\\xff"),
            ("ReadShard", b"\\x0a\\x05ab"),
        ):
            call = channel.unary_unary(f"/edgecache.v1.EdgeCache/{method}")
            if method == "ReadShard":
                call = channel.unary_stream(f"/edgecache.v1.EdgeCache/{method}")
            error = code_of(lambda c=call, b=body: c(b))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
            assert "is not a valid edgecache.v1." in error.details()
            assert "class" not in error.details()
        c = stub(node.address)
        admin = (("authorization", "bearer s3cret-admin"),)  # lower case: still the scheme
        future = edge_pb2.PinRequest(dataset="tokens", version=1)
        future.until.FromDatetime(datetime.now(UTC) + timedelta(days=1))
        c.Pin(future, metadata=admin)
        pins = [
            v for v in c.Status(edge_pb2.StatusRequest()).versions if v.HasField("pinned_until")
        ]
        assert [(v.dataset, v.version) for v in pins] == [("tokens", 1)]


def test_a_restarted_node_reports_what_its_cache_holds(tmp_path: Path, file_setup) -> None:
    """edgecache_cache_used_bytes read 0 after a restart until the first write."""

    registry, _ = file_setup
    with running_node(config(tmp_path, registry)) as node:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
        held = stub(node.address).Status(edge_pb2.StatusRequest()).used_bytes
    assert held > 0
    with running_node(config(tmp_path, registry)) as node:
        assert node.node is not None
        assert metric(node.node, "edgecache_cache_used_bytes") == held


def test_evictions_for_space_are_counted_in_metrics(tmp_path: Path, file_setup) -> None:
    """The store counted LRU evictions, but neither /metrics nor Status showed them: a
    cache too small for its working set showed only as used_bytes going down."""
    registry, _ = file_setup
    with running_node(config(tmp_path, registry, capacity="450KiB")) as node:
        c = stub(node.address)
        for shard in range(3):  # each read-through miss makes room for itself
            read_shard_table(c, "tokens", 1, shard)
        assert node.node is not None
        stats = node.node.store.stats
        shards = metric(node.node, "edgecache_cache_evicted_shards_total")
        evicted = metric(node.node, "edgecache_cache_evicted_bytes_total")
    assert stats.evicted_shards > 0
    assert (shards, evicted) == (stats.evicted_shards, stats.evicted_bytes)


def test_a_read_of_a_shard_a_stage_is_fetching_goes_ahead_of_the_staging_limits(
    tmp_path: Path, file_setup
) -> None:
    """A job reading what a warm was still staging joined the Stage's fetch and waited out
    staging's rate budget with it (at --staging-rate 1B/s, for days)."""
    registry, tables = file_setup
    with running_node(config(tmp_path, registry, staging_rate=1)) as node:
        c = stub(node.address)
        stage = c.Stage(edge_pb2.StageRequest(dataset="tokens", version=1, shards=[0]))
        deadline = time.monotonic() + 10
        while not node.node._inflight and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert node.node._inflight, "the Stage's fetch never started"  # type: ignore[union-attr]
        assert node.node.gate._running == 1  # type: ignore[union-attr]  # it waits on the rate
        # The whole shard, within a deadline a rate-bound fetch of it could never meet.
        chunks = c.ReadShard(
            edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0), timeout=60
        )
        table = pa.Table.from_batches([decode_chunk(chunk.frame) for chunk in chunks])
        assert table.column("label").to_pylist() == tables[0].column("label").to_pylist()
        # The Stage's fetch was the one served: it ends with its shard done, and the
        # staging slot it waited for is back.
        events = list(stage)
        assert events[-1].finished and events[-1].shards_done == 1
        assert not events[-1].shards_failed
        assert node.node.gate._running == 0  # type: ignore[union-attr]
        assert metric(node.node, "edgecache_staging_taken_over_total") == 1  # type: ignore[arg-type]
