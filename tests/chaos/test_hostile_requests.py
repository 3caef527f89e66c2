"""Hostile gRPC requests: every field fuzzed; clear status codes, never INTERNAL, node alive."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from edgeutil import publish, stub, write_parquet_shards
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
names = st.one_of(
    st.sampled_from(
        ["tokens", "", "..", "../etc", "a/b", "nul\x00", "x" * 1_000, "Tokens", "tokens@1"]
    ),
    st.text(max_size=50),
)
numbers = st.one_of(
    st.sampled_from([0, 1, 2, 2**31, 2**32 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)
)
small = st.one_of(st.sampled_from([0, 1, 99, 2**32 - 1]), st.integers(0, 2**32 - 1))


@pytest.fixture(scope="module")
def node_stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    root = tmp_path_factory.mktemp("hostile")
    write_parquet_shards(root / "origin", 2, rows=100)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    settings_ = NodeConfig(
        region="eu",
        cache_dir=root / "cache",
        registry=f"file://{root}/registry",
        listen="127.0.0.1:0",
        capacity="64MiB",
        sync=False,
    )
    with running_node(settings_) as node:
        _BEFORE.update(_files_outside_cache(root))
        _ROOT.append(root)
        yield stub(node.address)


_BEFORE: dict[str, int] = {}
_ROOT: list = []


def _files_outside_cache(root) -> dict[str, int]:  # noqa: ANN001
    """Every file the node could reach besides its cache: the origin, the registry, /tmp."""
    out = {}
    for path in [*root.parent.rglob("*"), *root.rglob("*")]:
        if path.is_file() and "cache" not in path.relative_to(root.parent).parts[1:2]:
            out[str(path)] = path.stat().st_mtime_ns
    return out


def call(fn) -> None:  # noqa: ANN001
    try:
        result = fn()
        if hasattr(result, "__iter__"):
            list(result)
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details())
        assert exc.details()  # a message a person can act on


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dataset=names, version=numbers, text=st.text(max_size=20), shard=small, chunk=small, row=numbers
)
def test_fuzzed_requests_get_clear_codes(
    node_stub, dataset, version, text, shard, chunk, row
) -> None:  # noqa: ANN001
    c = node_stub
    call(lambda: c.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset=dataset, version=text)))
    call(lambda: c.GetManifest(edge_pb2.GetManifestRequest(dataset=dataset, version=version)))
    call(
        lambda: c.ReadShard(
            edge_pb2.ReadShardRequest(
                dataset=dataset,
                version=version,
                shard=shard,
                start_chunk=chunk,
                start_row=row,
                end_row=row // 2,
            )
        )
    )
    call(
        lambda: c.ReadShard(
            edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=shard % 3, start_row=row)
        )
    )
    call(lambda: c.Stage(edge_pb2.StageRequest(dataset=dataset, version=version, shards=[shard])))
    call(lambda: c.Evict(edge_pb2.EvictRequest(dataset=dataset, version=version)))
    assert c.Status(edge_pb2.StatusRequest()).region == "eu"  # still serving


def test_oversized_requests_are_refused_by_the_limit(node_stub) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as info:
        node_stub.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="x" * (2 << 20)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert node_stub.Status(edge_pb2.StatusRequest()).region == "eu"


def test_a_configured_limit_refuses_smaller_requests(tmp_path) -> None:  # noqa: ANN001
    settings_ = NodeConfig(
        region="eu",
        cache_dir=tmp_path / "cache",
        registry=f"file://{tmp_path}/registry",
        listen="127.0.0.1:0",
        max_request_bytes=4096,
        sync=False,
    )
    with running_node(settings_) as node:
        client = stub(node.address)
        with pytest.raises(grpc.RpcError) as info:
            client.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="x" * 10_000))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            client.ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="x" * 200))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # parsed, then refused


def test_fuzzing_wrote_nothing_outside_the_cache(node_stub, figure) -> None:  # noqa: ANN001
    after = _files_outside_cache(_ROOT[0])
    changed = {p for p in after if _BEFORE.get(p) != after[p]} | (set(_BEFORE) - set(after))
    figure("files created or changed outside the cache directory", len(changed))
    assert not changed, sorted(changed)
