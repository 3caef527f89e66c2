"""A node reads versions only from the origins it trusts, and caps what a reader can make it keep.

A version's source URL comes from the registry: whoever can write a manifest there
could otherwise have the node read any file or URL it can reach (its tokens,
``/proc/self/environ``, a metadata service) and serve the bytes back as rows. Real
nodes on loopback, file:// registries and origins.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from edgeutil import node_settings, publish, read_shard_table, stub, write_parquet_shards
from hypothesis import given
from hypothesis import strategies as st

from edgecache.edge.config import ConfigError, load_node_config, origin_allowed
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


def test_the_default_is_every_s3_bucket_and_the_registrys_own_scheme(tmp_path: Path) -> None:
    s3 = node_settings(tmp_path, "s3://bucket/_edgecache")
    assert s3.origin_prefixes() == ("s3://",)
    local = node_settings(tmp_path, f"file://{tmp_path}/registry")
    assert local.origin_prefixes() == ("s3://", "file://")
    given_ = node_settings(tmp_path, "s3://b/r", origins=" s3://data/train/ , file:///mnt/x")
    assert given_.origin_prefixes() == ("s3://data/train/", "file:///mnt/x")


def test_origins_match_whole_segments_after_dot_dot_is_resolved() -> None:
    prefixes = ("s3://data/train", "file:///mnt/data/")
    assert origin_allowed("s3://data/train/part-0.parquet", prefixes)
    assert origin_allowed("S3://data/train", prefixes)  # schemes in any case
    assert not origin_allowed("s3://data/training/part-0.parquet", prefixes)  # not a segment
    assert origin_allowed("file:///mnt/data/a/b.csv", prefixes)
    assert not origin_allowed("file:///mnt/data/../../etc/passwd", prefixes)
    assert not origin_allowed("http://169.254.169.254/latest/", prefixes)
    assert not origin_allowed("/mnt/data/a", prefixes)  # no scheme: no origin


@given(st.lists(st.sampled_from(["a", "b", "..", "."]), max_size=8))
def test_a_file_url_is_allowed_only_where_its_resolved_path_lies(parts: list[str]) -> None:
    url = "file:///mnt/data/" + "/".join(parts)
    resolved = Path("/mnt/data", *parts).resolve(strict=False)  # no symlinks under /mnt/data
    inside = resolved == Path("/mnt/data") or Path("/mnt/data") in resolved.parents
    assert origin_allowed(url, ("file:///mnt/data",)) == inside


@pytest.mark.parametrize(
    ("value", "says"),
    [(" , ", "no origin given"), ("bucket/data", "an origin is a URL prefix with its scheme")],
)
def test_origins_that_name_no_url_are_refused_naming_the_setting(value: str, says: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"origins / \$EDGECACHE_ORIGINS \(\$EDGECACHE_ORIGINS\): .*{says}"
    ):
        load_node_config(
            None,
            {"region": "eu", "cache_dir": Path("/tmp/c"), "registry": "s3://b/r"},
            {"EDGECACHE_ORIGINS": value},
        )


def test_a_version_outside_the_origins_is_refused_and_one_inside_is_served(
    tmp_path: Path,
) -> None:
    registry = f"file://{tmp_path}/registry"
    for name in ("trusted", "elsewhere"):
        write_parquet_shards(tmp_path / name, 1, rows=100)
        publish(registry, f"file://{tmp_path}/{name}", name)
    settings = node_settings(tmp_path, registry, origins=f"file://{tmp_path}/trusted")
    with running_node(settings) as node:
        client = stub(node.address)
        assert read_shard_table(client, "trusted", 1, 0).num_rows == 100
        with pytest.raises(grpc.RpcError) as refused:
            read_shard_table(client, "elsewhere", 1, 0)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = refused.value.details()
        assert f"file://{tmp_path}/elsewhere" in message and "EDGECACHE_ORIGINS" in message
        with pytest.raises(grpc.RpcError) as staged:  # nor staged: nothing read from it
            list(client.Stage(edge_pb2.StageRequest(dataset="elsewhere", version=1)))
        assert staged.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert node.node is not None and node.node.store.get_manifest("elsewhere", 1) is None


def test_a_made_up_digest_is_refused_before_it_is_kept_or_echoed(tmp_path: Path) -> None:
    """Each distinct digest a reader sent was kept (up to 4096) and echoed into the log:
    a reader could hold ~4 GiB of the node's memory with 1 MiB digests."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(node_settings(tmp_path, registry)) as node:
        request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, digest="x" * 500_000)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub(node.address).ReadShard(request))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "64 hex digits" in refused.value.details()
        assert len(refused.value.details()) < 400  # the digest is clipped, not echoed whole
        assert node.node is not None and not node.node.versions._digests_asked  # noqa: SLF001
        with pytest.raises(grpc.RpcError) as bad_version:
            stub(node.address).ResolveVersion(
                edge_pb2.ResolveVersionRequest(dataset="tokens", version="9" * 9 + "x" * 9000)
            )
        assert bad_version.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(bad_version.value.details()) < 400
