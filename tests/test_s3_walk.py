"""Publishing from and staging from S3 as a new user meets it, against moto's server.

Each test walks one thing a person does or gets wrong: credentials, endpoints and
profiles, buckets and prefixes that are not there, keys S3 allows but URLs do not
like, directory markers, listings over a page, large objects read in ranged
parts, and objects replaced after publish. Errors must name what to do next and
never be a traceback.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgeutil import node_settings, publish, read_shard_table, stub
from s3server import CREDENTIALS, make_bucket, moto_server, put_object
from typer.testing import CliRunner

from edgecache.cache.storage import S3Store
from edgecache.clients.cli import app
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2

runner = CliRunner()


def jsonl(*values: int) -> bytes:
    return b"".join(b'{"a": %d}\n' % v for v in values)


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    name = f"walk-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, name)
    return name


def cli(*args: str) -> tuple[int, str]:
    """Run the CLI; a traceback (any exception but an exit) fails the test."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "400"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"not an error line but {result.exception!r}:\n{result.output}")
    return result.exit_code, result.output


def no_credentials(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """This process with no AWS credentials anywhere botocore looks (quickly)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1 s IMDS probe


# ---------------------------------------------------------------- keys and prefixes


def test_prefix_with_or_without_slash_never_takes_in_a_sibling_prefix(bucket: str) -> None:
    put_object_keys(bucket, {"ds/a.jsonl": jsonl(1), "ds2/b.jsonl": jsonl(2)})
    registry = f"s3://{bucket}/_reg"
    for source in (f"s3://{bucket}/ds", f"s3://{bucket}/ds/"):
        code, out = cli("publish", source, "--dataset", "d", "--registry", registry, "--json")
        assert code == 0, out
        assert json.loads(out)["rows"] == 1  # ds2/b.jsonl is not under ds/


def test_keys_with_spaces_unicode_plus_hash_and_question_mark(tmp_path: Path, bucket: str) -> None:
    keys = ["a b.jsonl", "ünï cödé.jsonl", "c+d.jsonl", "e#f.jsonl", "g?h=1.jsonl", "i%20j.jsonl"]
    put_object_keys(bucket, {f"ds/{k}": jsonl(i) for i, k in enumerate(keys)})
    registry = f"s3://{bucket}/_reg"
    manifest = publish(registry, f"s3://{bucket}/ds", "keys")
    assert sorted(s.source_key for s in manifest.shards) == sorted(keys)
    with running_node(node_settings(tmp_path, registry)) as node:
        client = stub(node.address)
        last = list(client.Stage(edge_pb2.StageRequest(dataset="keys", version=1)))[-1]
        assert last.finished and last.shards_done == len(keys) and not last.shards_failed
        by_key = {
            s.source_key: read_shard_table(client, "keys", 1, s.index)["a"].to_pylist()
            for s in manifest.shards
        }
    assert by_key == {k: [i] for i, k in enumerate(keys)}


def test_directory_markers_are_not_objects(bucket: str) -> None:
    # What the S3 console's "Create folder" and some sync tools leave behind.
    put_object_keys(
        bucket,
        {"ds/": b"", "ds/sub/": b"", "ds/a.jsonl": jsonl(1), "ds/sub/b.jsonl": jsonl(2)},
    )
    manifest = publish(f"s3://{bucket}/_reg", f"s3://{bucket}/ds", "markers")
    assert [s.source_key for s in manifest.shards] == ["a.jsonl", "sub/b.jsonl"]


def test_a_zero_byte_object_is_refused_naming_it(bucket: str) -> None:
    put_object_keys(bucket, {"ds/a.jsonl": jsonl(1), "ds/empty.jsonl": b""})
    registry = f"s3://{bucket}/_reg"
    code, out = cli("publish", f"s3://{bucket}/ds", "--dataset", "z", "--registry", registry)
    assert code == 2, out
    assert f"s3://{bucket}/ds/empty.jsonl is empty (0 bytes)" in out
    assert cli("versions", "z", "--registry", registry)[0] == 2  # nothing published


def test_more_than_a_page_of_objects_is_listed_whole(bucket: str) -> None:
    # ListObjectsV2 returns at most 1000 keys a page.
    import boto3

    client = boto3.client("s3")
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: client.put_object(Bucket=bucket, Key=f"ds/{i:05d}.bin", Body=b"x"),
                range(1100),
            )
        )
    put_object_keys(bucket, {"ds0/after.bin": b"x"})  # sorts after every ds/ key

    async def listing() -> list[str]:
        store = S3Store()
        try:
            return [o.url for o in await store.list(f"s3://{bucket}/ds/")]
        finally:
            await store.close()

    import asyncio

    urls = asyncio.run(listing())
    assert urls == [f"s3://{bucket}/ds/{i:05d}.bin" for i in range(1100)]


# --------------------------------------------------------------- where S3 is, who asks


def test_a_bucket_that_does_not_exist_is_named(bucket: str) -> None:
    missing = f"nope-{uuid.uuid4().hex[:12]}"
    code, out = cli(
        "publish", f"s3://{missing}/ds", "--dataset", "x", "--registry", f"s3://{bucket}/_reg"
    )
    assert code == 2, out
    assert f"bucket {missing!r} does not exist" in out and "AWS_ENDPOINT_URL" in out


def test_a_prefix_that_matches_nothing_is_named(bucket: str) -> None:
    code, out = cli(
        "publish", f"s3://{bucket}/nothing", "--dataset", "x", "--registry", f"s3://{bucket}/_r"
    )
    assert code == 2, out
    assert f"no objects under s3://{bucket}/nothing/" in out


def test_missing_credentials_say_what_to_set(
    tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_object_keys(bucket, {"ds/a.jsonl": jsonl(1)})
    registry = f"s3://{bucket}/_reg"
    publish(registry, f"s3://{bucket}/ds", "creds")
    no_credentials(monkeypatch, tmp_path)
    code, out = cli("publish", f"s3://{bucket}/ds", "--dataset", "creds", "--registry", registry)
    assert code != 0
    assert "no AWS credentials" in out and "AWS_ACCESS_KEY_ID" in out and "AWS_PROFILE" in out
    # A node without credentials refuses (retrying it will not help), naming what to set.
    with running_node(node_settings(tmp_path, registry)) as node:
        with pytest.raises(grpc.RpcError) as info:
            list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="creds", version=1)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no AWS credentials" in (info.value.details() or "")


def test_half_the_credentials_say_which_is_missing(
    bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    code, out = cli(
        "publish", f"s3://{bucket}/ds", "--dataset", "x", "--registry", f"s3://{bucket}/_r"
    )
    assert code != 0
    assert "missing: AWS_SECRET_ACCESS_KEY" in out
    assert "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in out


def test_aws_max_attempts_that_is_not_a_number_is_named(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "three")
    code, out = cli(
        "publish", f"s3://{bucket}/ds", "--dataset", "x", "--registry", f"s3://{bucket}/_r"
    )
    assert code == 2
    assert "AWS_MAX_ATTEMPTS='three'" in out and "a whole number" in out


def test_a_node_refuses_to_start_with_aws_max_attempts_not_a_number(
    tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start, naming the variable: not INVALID_ARGUMENT on the first Stage from S3."""
    from edgecache.cache.errors import ConfigError

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "three")
    with pytest.raises(ConfigError, match="AWS_MAX_ATTEMPTS='three'"):
        with running_node(node_settings(tmp_path, f"s3://{bucket}/_reg")):
            pass


def test_an_unknown_profile_is_named_not_a_traceback(
    bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "nope")
    code, out = cli(
        "publish", f"s3://{bucket}/ds", "--dataset", "x", "--registry", f"s3://{bucket}/_r"
    )
    assert code != 0
    assert "AWS profile 'nope'" in out and "AWS_PROFILE" in out


def test_an_endpoint_that_is_not_a_url_is_named(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    code, out = cli(
        "publish", f"s3://{bucket}/ds", "--dataset", "x", "--registry", f"s3://{bucket}/_r"
    )
    assert code != 0
    assert "localhost:9000" in out and "AWS_ENDPOINT_URL" in out and "http://" in out


def test_the_endpoint_from_aws_endpoint_url_s3_or_a_profile(
    s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    put_object_keys(bucket, {"ds/a.jsonl": jsonl(1)})
    registry = f"s3://{bucket}/_reg"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    assert cli("publish", f"s3://{bucket}/ds", "--dataset", "e", "--registry", registry)[0] == 0
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    no_credentials(monkeypatch, tmp_path)
    (tmp_path / "config").write_text(
        f"[profile walk]\nregion = us-east-1\nendpoint_url = {s3_endpoint}\n"
    )
    (tmp_path / "credentials").write_text(
        "[walk]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    monkeypatch.setenv("AWS_PROFILE", "walk")
    code, out = cli("publish", f"s3://{bucket}/ds", "--dataset", "e", "--registry", registry)
    assert code == 0, out


@pytest.fixture
def wrong_region_s3() -> Iterator[str]:
    """An endpoint that answers every request as S3 does a bucket of another region.

    moto serves every bucket from any region, so this is a stand-in: a 301
    PermanentRedirect naming eu-west-1 (x-amz-bucket-region), as S3 answers a
    client signing for the wrong region at a regional or S3-compatible endpoint,
    where botocore does not follow the redirect itself.
    """
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (
                b"<Error><Code>PermanentRedirect</Code><Message>The bucket you are "
                b"attempting to access must be addressed using the specified endpoint."
                b"</Message></Error>"
            )
            self.send_response(301)
            self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_bucket_in_another_region_names_the_region_to_set(
    wrong_region_s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", wrong_region_s3)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    code, out = cli("publish", "s3://far/ds", "--dataset", "x", "--registry", "s3://far/_r")
    assert code != 0
    assert "bucket 'far' is in region eu-west-1" in out and "AWS_REGION=eu-west-1" in out


@pytest.fixture(scope="module")
def strict_s3() -> Iterator[str]:
    """A moto server that checks credentials (IAM auth from the first request)."""
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        yield endpoint


def test_wrong_credentials_are_refused_naming_the_code(
    strict_s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", strict_s3)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    code, out = cli("publish", "s3://any/ds", "--dataset", "x", "--registry", "s3://any/_r")
    assert code == 1, out
    assert "InvalidAccessKeyId" in out and "check the AWS credentials" in out


# ---------------------------------------------------------- large and replaced objects


def test_a_multipart_object_is_staged_in_ranged_parts_and_a_replaced_one_refused(
    s3_endpoint: str, tmp_path: Path, bucket: str
) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    table = pa.table({"x": np.random.default_rng(0).random(1_200_000)})  # ~9.6 MB: > 8 MiB
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="none")
    data = buffer.getvalue()
    client = boto3.client("s3")
    multipart = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    client.upload_fileobj(io.BytesIO(data), bucket, "ds/big.parquet", Config=multipart)
    put_object(s3_endpoint, bucket, "ds/small.parquet", small_parquet())
    registry = f"s3://{bucket}/_reg"
    manifest = publish(registry, f"s3://{bucket}/ds", "big")
    assert manifest.shards[0].source_etag.endswith("-2")  # a multipart upload's ETag
    with running_node(node_settings(tmp_path / "a", registry)) as node:
        c = stub(node.address)
        last = list(c.Stage(edge_pb2.StageRequest(dataset="big", version=1)))[-1]
        assert last.finished and last.shards_done == 2 and not last.shards_failed
        assert read_shard_table(c, "big", 1, 0).equals(table)
        # ~10 ranged parts of 1 MiB for big.parquet, not one GET (plus a few for the rest)
        assert node.node is not None and node.node.stores.stats().requests >= 9
    changed = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    client.upload_fileobj(io.BytesIO(changed), bucket, "ds/big.parquet", Config=multipart)
    with running_node(node_settings(tmp_path / "b", registry)) as node:
        with pytest.raises(grpc.RpcError) as info:
            list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="big", version=1)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"s3://{bucket}/ds/big.parquet changed after the version was published" in (
        info.value.details() or ""
    )


# ------------------------------------------------------------------------- helpers


def small_parquet() -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"x": [0.5]}), buffer)
    return buffer.getvalue()


def put_object_keys(bucket: str, objects: dict[str, bytes]) -> None:
    import boto3

    client = boto3.client("s3")
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)


def test_a_node_that_finds_no_bucket_says_where_it_asked_not_that_origin_lost_it(
    tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    """NoSuchBucket at stage time: the publisher listed that bucket, so the advice is the
    node's endpoint and account first (the message had 'origin lost an object')."""
    import boto3
    from s3server import _boto_kwargs

    source = f"gone-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, source, versioned=False)
    put_object_keys(source, {"ds/a.jsonl": jsonl(1, 2)})
    registry = f"s3://{bucket}/_reg"
    publish(registry, f"s3://{source}/ds", "nobucket")
    client = boto3.client("s3", endpoint_url=s3_endpoint, **_boto_kwargs())
    client.delete_object(Bucket=source, Key="ds/a.jsonl")
    client.delete_bucket(Bucket=source)
    with running_node(node_settings(tmp_path, registry)) as node:
        with pytest.raises(grpc.RpcError) as info:
            list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="nobucket", version=1)))
    details = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
    assert f"bucket {source!r} does not exist" in details, details
    assert "AWS_ENDPOINT_URL" in details and "lost an object" not in details, details
