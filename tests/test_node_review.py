"""The edge node's API as a client developer and an SRE used it: arguments and messages.

A review found requests the node took that it should have refused
(``peers_only`` with no peers, peers and Diagnose targets that are no address,
a Diagnose of NaN seconds that never ended), messages pointing readers at the
admin token, and peer channels kept open for every target ever named. Real
nodes on loopback (in-process, each on its own event loop), a real registry
and LMDB; the channel bound is checked on real gRPC channels.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from edgeutil import node_settings, publish, stub, write_parquet_shards

from edgecache.edge import diagnose, service
from edgecache.edge.peers import Peers
from edgecache.edge.server import NodeServer, running_node
from edgecache.v1 import edge_pb2

BAD_PEERS = [
    "not an address",
    "",
    "http://127.0.0.1:7070",
    "127.0.0.1:99999",
    "127.0.0.1:-1",
    "127.0.0.1:0",
    "127.0.0.1",
    ":7070",
    "[zz]:7070",
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("review")
    write_parquet_shards(root / "origin", 2, rows=200)
    url = f"file://{root}/registry"
    publish(url, f"file://{root}/origin", "tokens")
    return url


@pytest.fixture
def node(tmp_path: Path, registry: str) -> Iterator[NodeServer]:
    with running_node(node_settings(tmp_path, registry)) as server:
        yield server


def _refusal(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        call()  # type: ignore[operator]
    return failed.value


def _stage(address: str, **fields: object) -> list[edge_pb2.StageProgress]:
    request = edge_pb2.StageRequest(dataset="tokens", version=1, **fields)
    return list(stub(address).Stage(request, timeout=30))


def _not_cached(address: str, shard: int) -> bool:
    request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=shard, cached_only=True)
    error = _refusal(lambda: list(stub(address).ReadShard(request, timeout=10)))
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_peers_only_without_peers_is_refused_before_origin_is_asked(node: NodeServer) -> None:
    """The caller asked for no origin traffic and named no peer: the node fetched from
    origin and answered OK."""
    error = _refusal(lambda: _stage(node.address, shards=[0], peers_only=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "peers_only needs peers" in (error.details() or ""), error
    assert _not_cached(node.address, 0)


@pytest.mark.parametrize("peer", BAD_PEERS)
@pytest.mark.parametrize("peers_only", [False, True])
def test_a_peer_that_is_no_address_is_refused_naming_it(
    node: NodeServer, peer: str, peers_only: bool
) -> None:
    """Each shard failed UNAVAILABLE ("retrying may help"), or without peers_only went
    quietly to origin; :99999 dialled port 34463 (gRPC wraps ports around)."""
    good = f"127.0.0.1:{_closed_port()}"
    error = _refusal(
        lambda: _stage(node.address, shards=[1], peers=[good, peer], peers_only=peers_only)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert repr(peer) in (error.details() or ""), error
    assert _not_cached(node.address, 1)


@pytest.mark.parametrize(
    "target", ["127.0.0.1:99999", "127.0.0.1:-1", "http://127.0.0.1:7070", "[::1:7070"]
)
def test_a_diagnose_target_that_is_no_address_is_invalid_argument(
    node: NodeServer, target: str
) -> None:
    request = edge_pb2.DiagnoseRequest(target=target, seconds=0.5)
    error = _refusal(lambda: stub(node.address).Diagnose(request, timeout=20))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert repr(target) in (error.details() or ""), error


def test_well_formed_peers_are_taken() -> None:
    from edgecache.edge.peers import check_peer

    assert check_peer("127.0.0.1:7070") == (False, "127.0.0.1:7070")
    assert check_peer("grpc://localhost:1") == (False, "localhost:1")
    assert check_peer("grpcs://node-1.eu.example.com:443") == (True, "node-1.eu.example.com:443")
    assert check_peer("[::1]:65535") == (False, "[::1]:65535")


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_diagnose_seconds_that_are_no_length_are_refused_at_once(
    tmp_path: Path, registry: str, seconds: float
) -> None:
    """NaN never ended (the deadline compared false); inf was clamped to the longest test."""
    with (
        running_node(node_settings(tmp_path / "a", registry)) as node,
        running_node(node_settings(tmp_path / "b", registry)) as peer,
    ):
        request = edge_pb2.DiagnoseRequest(target=peer.address, seconds=seconds, streams=1)
        began = time.monotonic()
        error = _refusal(lambda: stub(node.address).Diagnose(request, timeout=20))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "seconds" in (error.details() or "") and time.monotonic() - began < 5


def test_a_fast_link_stops_short_of_the_peer_sinks_cap(
    tmp_path: Path, registry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that filled the peer's Sink cap before the time was up ended UNAVAILABLE
    (or INTERNAL), though retrying could not help. The cap is lowered (on both nodes:
    one process) so that loopback passes it within the test."""
    monkeypatch.setattr(service, "SINK_BYTES", 16 << 20)
    monkeypatch.setattr(diagnose, "SINK_BYTES", 16 << 20, raising=False)
    with (
        running_node(node_settings(tmp_path / "a", registry)) as node,
        running_node(node_settings(tmp_path / "b", registry)) as peer,
    ):
        request = edge_pb2.DiagnoseRequest(target=peer.address, seconds=3, streams=2)
        report = stub(node.address).Diagnose(request, timeout=60)
    assert report.bytes_per_second > 0, report
    assert "stopped at" in report.note, report


def test_a_diagnose_targets_channel_is_closed_after_it(node: NodeServer) -> None:
    """Every distinct target kept a channel until the node stopped (RSS grew; a grpcs://
    target's TLS handshake was retried every two minutes)."""
    for _ in range(4):
        request = edge_pb2.DiagnoseRequest(target=f"127.0.0.1:{_closed_port()}", seconds=0.5)
        error = _refusal(lambda r=request: stub(node.address).Diagnose(r, timeout=30))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert node.node is not None
    assert len(node.node.peers._channels) == 0  # noqa: SLF001


def test_peer_channels_are_bounded_and_the_evicted_closed(tmp_path: Path, registry: str) -> None:
    async def run() -> None:
        peers = Peers(node_settings(tmp_path, registry), max_channels=3)
        opened = []
        try:
            for _ in range(5):
                async with peers.channel(f"127.0.0.1:{_closed_port()}") as channel:
                    opened.append(channel)
            async with peers.channel("127.0.0.1:1") as busy:
                # In use while evicted: closed when its call ends, not under it.
                for _ in range(3):
                    async with peers.channel(f"127.0.0.1:{_closed_port()}"):
                        pass
                assert busy.get_state() != grpc.ChannelConnectivity.SHUTDOWN
            await asyncio.sleep(0.1)  # closes of evicted channels run as tasks
            assert peers.open_channels == 3
            for channel in [*opened[:2], busy]:
                assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        finally:
            await peers.close()

    asyncio.run(run())


def test_a_plaintext_peer_is_warned_of_once_not_at_every_diagnose(
    tmp_path: Path, registry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A token sent in plaintext to a peer off loopback is said once (the docs' claim), but
    Diagnose opens a channel for each test and closes it: a warning per call (a helper's
    hunt). A host name counts as off loopback, so no packet leaves this host here."""
    (tmp_path / "read").write_text("readtok")
    settings = node_settings(tmp_path, registry, read_token_file=tmp_path / "read")

    async def run() -> None:
        peers = Peers(settings)
        try:
            for peer in ("peer-a.invalid:7070", "peer-a.invalid:7070", "peer-b.invalid:7070"):
                async with peers.channel(peer, keep=False):
                    pass
        finally:
            await peers.close()

    with caplog.at_level("WARNING", logger="edgecache.edge.peers"):
        asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if "is plaintext" in r.getMessage()]
    assert [m.split()[1] for m in said] == ["peer-a.invalid:7070", "peer-b.invalid:7070"], said


def test_token_refusals_name_the_token_the_call_needs(tmp_path: Path, registry: str) -> None:
    """A read refused for its token was told to use --token-file (the admin token's flag)."""
    (tmp_path / "admin").write_text("admintok")
    (tmp_path / "read").write_text("readtok")
    settings = node_settings(
        tmp_path, registry, token_file=tmp_path / "admin", read_token_file=tmp_path / "read"
    )
    with running_node(settings) as node:
        request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
        read = _refusal(lambda: list(stub(node.address).ReadShard(request, timeout=10)))
        admin = _refusal(lambda: _stage(node.address, shards=[0]))
    assert read.code() == admin.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "read token" in (read.details() or "") and "--read-token-file" in (read.details() or "")
    assert "admin token" in (admin.details() or "") and "read token" not in (admin.details() or "")
