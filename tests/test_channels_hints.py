"""Whose TLS setting a failed call names: this client's, or the node's toward its peers.

A node that cannot copy from a grpcs:// peer it does not trust fails the Stage
with its own status (FAILED_PRECONDITION with peers_only, or UNAVAILABLE while
another peer may come back), quoting gRPC's words for its connection to the
peer ("Tls handshake failed … CERTIFICATE_VERIFY_FAILED") and naming its own
setting, peer_tls_ca. node_error and describe told the operator to set
$EDGECACHE_TLS_CA on their client as well, whose connection was fine. Real
nodes on loopback: a plaintext node, a TLS peer it does not trust, a port
nothing listens on.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, stub, write_parquet_shards
from tlsutil import make_pki

from edgecache.clients.channels import describe, explain, node_error, open_channel
from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2, edge_pb2_grpc


def _config(root: Path, name: str, **more: object) -> NodeConfig:
    settings: dict[str, object] = {
        "region": "eu",
        "cache_dir": root / f"cache-{name}",
        "registry": f"file://{root}/registry",
        "listen": "127.0.0.1:0",
        "sync": False,
        **more,
    }
    return NodeConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, Path]]]:
    """(a plaintext node's address, a TLS node's address, the PKI its certificate is from)."""
    root = tmp_path_factory.mktemp("channels-hints")
    write_parquet_shards(root / "origin", 2, rows=200)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    (root / "pki").mkdir()
    pki = make_pki(root / "pki")
    tls = _config(root, "tls", tls_cert=pki["server"], tls_key=pki["server_key"])
    with running_node(_config(root, "plain")) as plain, running_node(tls) as peer:
        yield plain.address, peer.address, pki


def _stage_error(address: str, peers: list[str]) -> grpc.RpcError:
    request = edge_pb2.StageRequest(dataset="tokens", version=1, peers=peers, peers_only=True)
    with pytest.raises(grpc.RpcError) as failed:
        list(stub(address).Stage(request, timeout=60))
    return failed.value


def _gone() -> str:
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("unreachable", "code"),
    [(False, grpc.StatusCode.FAILED_PRECONDITION), (True, grpc.StatusCode.UNAVAILABLE)],
)
def test_a_peers_tls_failure_quoted_by_the_node_names_the_nodes_setting_only(
    site: tuple[str, str, dict[str, Path]], unreachable: bool, code: grpc.StatusCode
) -> None:
    plain, tls, _ = site
    peers = [f"grpcs://{tls}"] + ([_gone()] if unreachable else [])
    error = _stage_error(plain, peers)
    assert error.code() == code, error
    assert "Tls handshake failed" in (error.details() or ""), error.details()
    for said in (
        str(node_error(error, endpoint=plain, what="staging tokens@1")),
        describe(error),
        explain(error),
    ):
        assert "peer_tls_ca" in said, said  # the node's advice is kept
        assert "EDGECACHE_TLS_CA" not in said.replace("EDGECACHE_PEER_TLS_CA", ""), said
        assert "this client does not trust" not in said, said
    # What node_error adds is the code's own advice: for FAILED_PRECONDITION, no retry.
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        assert "retrying will not help" in str(node_error(error, endpoint=plain, what="staging"))


def test_this_clients_own_untrusted_connection_still_names_its_ca_variable(
    site: tuple[str, str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tls, _ = site
    (tmp_path / "rogue").mkdir()
    monkeypatch.setenv("EDGECACHE_TLS_CA", str(make_pki(tmp_path / "rogue")["ca"]))
    for name in ("EDGECACHE_TLS_CERT", "EDGECACHE_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with open_channel(f"grpcs://{tls}") as channel:
        with pytest.raises(grpc.RpcError) as failed:
            edge_pb2_grpc.EdgeCacheStub(channel).Status(edge_pb2.StatusRequest(), timeout=10)
    error = failed.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    for said in (str(node_error(error, endpoint=tls, what="status")), describe(error)):
        assert "$EDGECACHE_TLS_CA" in said and "peer_tls_ca" not in said, said


def test_a_refused_token_is_advised_once(tmp_path: Path) -> None:
    """The node words its refusal with the fix ('pass the node's token (--token-file …)');
    the client added its own hint for the code, and the advice came twice."""
    (tmp_path / "read").write_text("s3cret")
    root = tmp_path
    (root / "origin").mkdir()
    write_parquet_shards(root / "origin", 1, rows=10)
    publish(f"file://{root}/registry", f"file://{root}/origin", "tokens")
    with running_node(_config(root, "guarded", read_token_file=root / "read")) as node:
        request = edge_pb2.ResolveVersionRequest(dataset="tokens")
        with pytest.raises(grpc.RpcError) as refused:
            stub(node.address).ResolveVersion(request)
    for text in (
        describe(refused.value),
        explain(refused.value),
        str(node_error(refused.value, endpoint=node.address, what="ResolveVersion")),
    ):
        assert text.count("--token-file") == 1, text


def test_a_closed_connection_says_first_that_the_node_may_have_stopped() -> None:
    """After a node was killed, the failover warning ended with advice about client
    certificates, on a plain host:port: the likeliest cause, a node that went away, came
    nowhere. The TLS causes stay, for a node that runs."""
    from edgecache.clients.channels import connection_hint

    for details in ("Socket closed", "Connection reset by peer"):
        hint = connection_hint(details) or ""
        assert hint.index("stopped or restarted") < hint.index("--tls-client-ca"), hint


def test_a_version_not_found_is_told_how_to_list_the_registry_it_names(site) -> None:
    """NOT_FOUND's hint was `edgecache versions NAME`: run on a training host without an
    edgecache.yaml, it said only "no registry" (a helper's hunt). It says --registry, and
    the message it rides on names the registry."""
    plain, _, _ = site
    with pytest.raises(grpc.RpcError) as failed:
        stub(plain).GetManifest(edge_pb2.GetManifestRequest(dataset="tokens", version=9))
    said = explain(failed.value)
    assert "edgecache versions NAME --registry URL" in said and "file://" in said, said
