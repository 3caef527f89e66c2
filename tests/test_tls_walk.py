"""TLS and tokens as an operator meets them: every wrong setting is refused, and said plainly.

Walks docs/security.md's controls with real certificates, real
``edgecache serve`` processes and real gRPC on loopback: a setting that
would be ignored (a certificate without its key, a client CA without a
certificate) stops the node; a file that cannot be used names its flag and
what to do; a client that cannot get through TLS says why (which CA, which
certificate, which scheme) instead of "not connected".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from edgeutil import node_fields, publish, serve_args, write_parquet_shards
from tlsutil import DAY, make_pki

from edgecache.cache.errors import ConfigError
from edgecache.edge.config import NodeConfig, load_node_config
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2, edge_pb2_grpc

READ_TOKEN = "read-0f1e2d3c"
ADMIN_TOKEN = "admin-9a8b7c6d"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki")


@pytest.fixture
def registry(tmp_path: Path) -> str:
    write_parquet_shards(tmp_path / "origin", 2, rows=200)
    url = f"file://{tmp_path}/registry"
    publish(url, f"file://{tmp_path}/origin", "tokens")
    return url


def _settings(tmp_path: Path, **flags: object) -> dict[str, object]:
    return node_fields(tmp_path, **flags)


def _serve(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``edgecache serve`` with ``args``, expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *serve_args(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "EDGECACHE_SYNC": "false"},
    )


# --- the node's own settings ---------------------------------------------------------------


def test_a_certificate_without_its_key_is_refused_not_served_plaintext(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    with pytest.raises(ConfigError, match="--tls-key"):
        load_node_config(flags=_settings(tmp_path, tls_cert=pki["server"]), environ={})
    with pytest.raises(ConfigError, match="--tls-cert"):
        load_node_config(flags=_settings(tmp_path, tls_key=pki["server_key"]), environ={})


def test_a_client_ca_without_a_certificate_is_refused(tmp_path: Path, pki: dict[str, Path]) -> None:
    """--tls-client-ca alone would serve plaintext to anyone: mutual TLS silently off."""
    with pytest.raises(ConfigError, match="--tls-client-ca.*--tls-cert"):
        load_node_config(flags=_settings(tmp_path, tls_client_ca=pki["ca"]), environ={})


def test_serve_with_a_certificate_and_no_key_exits_2(tmp_path: Path, pki: dict[str, Path]) -> None:
    result = _serve(tmp_path, "--tls-cert", str(pki["server"]))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "serving on" not in result.stdout
    assert "--tls-key" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "role"),
    [("tls_cert", "server"), ("tls_key", "server_key"), ("tls_client_ca", "ca")],
)
def test_a_missing_pem_file_names_its_flag(
    tmp_path: Path, pki: dict[str, Path], flag: str, role: str
) -> None:
    files = {"tls_cert": pki["server"], "tls_key": pki["server_key"], "tls_client_ca": pki["ca"]}
    files[flag] = tmp_path / "nowhere.pem"
    with (
        pytest.raises(ConfigError) as info,
        running_node(NodeConfig(**_settings(tmp_path, **files))),
    ):
        pass
    message = str(info.value)
    assert "--" + flag.replace("_", "-") in message and "nowhere.pem" in message, message
    assert "No such file" in message, message


def test_a_key_that_is_not_the_certificates_is_named(tmp_path: Path, pki: dict[str, Path]) -> None:
    """gRPC only said 'cannot bind 127.0.0.1:0', sending the operator after the port."""
    config = NodeConfig(**_settings(tmp_path, tls_cert=pki["server"], tls_key=pki["client_key"]))
    with pytest.raises(ConfigError) as info, running_node(config):
        pass
    message = str(info.value)
    assert "--tls-key" in message and "does not match" in message, message
    assert "bind" not in message, message


@pytest.mark.parametrize("flag", ["tls_cert", "tls_key", "tls_client_ca"])
def test_a_file_that_is_not_pem_is_named(tmp_path: Path, pki: dict[str, Path], flag: str) -> None:
    files = {"tls_cert": pki["server"], "tls_key": pki["server_key"], "tls_client_ca": pki["ca"]}
    files[flag] = tmp_path / "garbage.pem"
    files[flag].write_text("not a certificate\n")
    with (
        pytest.raises(ConfigError) as info,
        running_node(NodeConfig(**_settings(tmp_path, **files))),
    ):
        pass
    message = str(info.value)
    assert "--" + flag.replace("_", "-") in message and "garbage.pem" in message, message
    assert "PEM" in message and "bind" not in message, message


def test_an_expired_certificate_stops_the_node(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    expired = make_pki(tmp_path / "pki", server_valid=(-2 * DAY, -DAY))
    config = NodeConfig(
        **_settings(tmp_path, tls_cert=expired["server"], tls_key=expired["server_key"])
    )
    with pytest.raises(ConfigError) as info, running_node(config):
        pass
    message = str(info.value)
    assert "--tls-cert" in message and "expired" in message and "renew" in message, message


def test_a_certificate_not_valid_yet_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "pki").mkdir()
    future = make_pki(tmp_path / "pki", server_valid=(DAY, 2 * DAY))
    config = NodeConfig(
        **_settings(tmp_path, tls_cert=future["server"], tls_key=future["server_key"])
    )
    with running_node(config):
        pass
    assert any("not valid until" in r.getMessage() for r in caplog.records), caplog.text


# --- clients that cannot get through: why, and what to do ------------------------------------


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No EDGECACHE_TLS_* from the environment the tests run in."""
    for name in ("EDGECACHE_TLS_CA", "EDGECACHE_TLS_CERT", "EDGECACHE_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _topology(tmp_path: Path, endpoint: str) -> Path:
    path = tmp_path / "edgecache.yaml"
    path.write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n    nodes: ['{endpoint}']\n"
    )
    return path


def _status_error(tmp_path: Path, endpoint: str, token: str | None = None) -> str:
    from edgecache.clients.ops import gather_status
    from edgecache.clients.topology import load_topology

    (report,) = gather_status(load_topology(_topology(tmp_path, endpoint)), timeout=2, token=token)
    assert report.status is None, "the node answered"
    return report.error


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no CA", "$EDGECACHE_TLS_CA"),
        ("CA only, node requires a client certificate", "$EDGECACHE_TLS_CERT"),
        ("plaintext endpoint, TLS node", "grpcs://"),
        ("certificate for another host", "subject alternative names"),
    ],
)
def test_status_says_why_tls_failed(
    tmp_path: Path,
    pki: dict[str, Path],
    registry: str,
    tls_env: pytest.MonkeyPatch,
    case: str,
    expected: str,
) -> None:
    """It said 'not connected within 3 s', the reason only in gRPC's own log."""
    server = {"tls_cert": pki["server"], "tls_key": pki["server_key"], "tls_client_ca": pki["ca"]}
    if case == "certificate for another host":
        (tmp_path / "other").mkdir()
        other = make_pki(tmp_path / "other", server_names=("other.example",))
        server = {"tls_cert": other["server"], "tls_key": other["server_key"]}
        tls_env.setenv("EDGECACHE_TLS_CA", str(other["ca"]))
    elif case != "no CA":
        tls_env.setenv("EDGECACHE_TLS_CA", str(pki["ca"]))
    with running_node(NodeConfig(**_settings(tmp_path, **server))) as node:
        scheme = "" if case.startswith("plaintext") else "grpcs://"
        error = _status_error(tmp_path, scheme + node.address)
    assert expected in error and "not connected within" not in error, error


def _cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """An ``edgecache`` command against the topology ``_topology`` wrote, and its seconds."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}  # the default's
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args]
        + ["--config", str(tmp_path / "edgecache.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize("case", ["no CA", "grpcs:// to a node without TLS"])
def test_a_tls_setting_is_bad_input_at_once_not_a_node_to_wait_for(
    tmp_path: Path,
    pki: dict[str, Path],
    registry: str,
    tls_env: pytest.MonkeyPatch,
    case: str,
) -> None:
    """It was "down" (exit 1), and ``ready --wait``, the launch gate, polled it for an hour.

    Each of these fails every try the same way until a setting changes: exit 2 at once,
    saying what to set, without gRPC core's own log line of the handshake before it.
    """
    if case == "no CA":
        server = {"tls_cert": pki["server"], "tls_key": pki["server_key"]}
        advice = "$EDGECACHE_TLS_CA"
    else:
        server = {}
        tls_env.setenv("EDGECACHE_TLS_CA", str(pki["ca"]))
        advice = "does not speak TLS"
    with running_node(NodeConfig(**_settings(tmp_path, **server))) as node:
        _topology(tmp_path, f"grpcs://{node.address}")
        status, _ = _cli(tmp_path, "status")
        ready, took = _cli(tmp_path, "ready", "tokens@1", "--region", "eu", "--wait")
        as_json, _ = _cli(tmp_path, "status", "--json")
        warm, _ = _cli(tmp_path, "warm", "tokens@1", "--region", "eu")
        doctor, _ = _cli(tmp_path, "doctor", "--pings", "2", "--seconds", "0.1", "--json")
    assert status.returncode == 2, status
    assert "could not be reached in TLS" in status.stderr and advice in status.stderr, status
    assert "Handshake failed" not in status.stderr, status.stderr  # gRPC core's INFO line
    assert ready.returncode == 2 and took < 60, (ready, took)  # the wait is an hour
    assert advice in ready.stderr, ready.stderr
    (report,) = json.loads(as_json.stdout)
    assert report["refused"] and report["tls_refused"], report
    assert warm.returncode == 2 and advice in warm.stderr, warm  # it was 1: "retry"
    # doctor said "unreachable", exit 1, naming no cause (a helper's hunt).
    assert doctor.returncode == 2, doctor
    (path,) = json.loads(doctor.stdout)["paths"]
    assert any(p.startswith("TLS refused") and advice in p for p in path["problems"]), path


def test_a_connection_closed_in_the_handshake_is_still_a_node_to_wait_for(
    tmp_path: Path, pki: dict[str, Path], registry: str, tls_env: pytest.MonkeyPatch
) -> None:
    # Plaintext to a TLS node is closed as a node stopping is: gRPC says "Socket closed"
    # either way, so it stays "down" (exit 1), its advice naming both causes.
    server = {"tls_cert": pki["server"], "tls_key": pki["server_key"]}
    with running_node(NodeConfig(**_settings(tmp_path, **server))) as node:
        _topology(tmp_path, node.address)
        status, _ = _cli(tmp_path, "status")
    assert status.returncode == 1 and "is down" in status.stderr, status
    assert "grpcs://host:port" in status.stderr, status.stderr


def test_status_says_when_the_node_does_not_speak_tls(
    tmp_path: Path, registry: str, pki: dict[str, Path], tls_env: pytest.MonkeyPatch
) -> None:
    tls_env.setenv("EDGECACHE_TLS_CA", str(pki["ca"]))
    with running_node(NodeConfig(**_settings(tmp_path))) as node:
        error = _status_error(tmp_path, f"grpcs://{node.address}")
    assert "does not speak TLS" in error and "host:port" in error, error


def _read_token_node(tmp_path: Path) -> NodeConfig:
    """A plaintext node that takes reads with READ_TOKEN only (in ``tmp_path/read.token``)."""
    (tmp_path / "read.token").write_text(READ_TOKEN)
    return NodeConfig(**_settings(tmp_path, read_token_file=tmp_path / "read.token"))


def test_status_without_the_read_token_says_to_pass_it(
    tmp_path: Path, registry: str, tls_env: pytest.MonkeyPatch
) -> None:
    with running_node(_read_token_node(tmp_path)) as node:
        error = _status_error(tmp_path, node.address)
    assert "UNAUTHENTICATED" in error and "--token-file" in error, error


def test_doctor_refused_the_token_is_bad_input_as_for_every_command(
    tmp_path: Path, registry: str, tls_env: pytest.MonkeyPatch
) -> None:
    # It exited 1 ("retrying may help"), where status, ready, warm and evict exit 2.
    with running_node(_read_token_node(tmp_path)) as node:
        _topology(tmp_path, node.address)
        refused, _ = _cli(tmp_path, "doctor", "--pings", "2", "--seconds", "0.1", "--json")
        given, _ = _cli(
            tmp_path, "doctor", "--pings", "2", "--seconds", "0.1", "--json",
            "--token-file", str(tmp_path / "read.token"),
        )  # fmt: skip
    assert refused.returncode == 2, refused
    (path,) = json.loads(refused.stdout)["paths"]
    assert any("UNAUTHENTICATED" in p for p in path["problems"]), path
    assert given.returncode in (0, 1) and "UNAUTHENTICATED" not in given.stdout, given


def test_evict_through_the_wrong_ca_names_the_ca_setting(
    tmp_path: Path, pki: dict[str, Path], registry: str, tls_env: pytest.MonkeyPatch
) -> None:
    """node_error's hint for UNAVAILABLE ('retry; check the node runs') misled here."""
    from edgecache.clients import ops
    from edgecache.clients.topology import load_topology

    (tmp_path / "rogue").mkdir()
    tls_env.setenv("EDGECACHE_TLS_CA", str(make_pki(tmp_path / "rogue")["ca"]))
    config = NodeConfig(**_settings(tmp_path, tls_cert=pki["server"], tls_key=pki["server_key"]))
    with running_node(config) as node:
        topology = load_topology(_topology(tmp_path, f"grpcs://{node.address}"))
        (result,) = ops.evict(topology, "tokens@1")
    assert "$EDGECACHE_TLS_CA" in result.error and "retry" not in result.error, result.error


# --- node to node: copying from peers that require TLS -----------------------------------------


def _stage(address: str, pki: dict[str, Path], peer: str | None = None) -> str:
    """Stage tokens@1 on ``address`` (from ``peer`` only, if given); what the node answered."""
    credentials = grpc.ssl_channel_credentials(
        pki["ca"].read_bytes(), pki["client_key"].read_bytes(), pki["client"].read_bytes()
    )
    with grpc.secure_channel(address, credentials) as channel:
        stub = edge_pb2_grpc.EdgeCacheStub(channel)
        request = edge_pb2.StageRequest(dataset="tokens", version=1)
        if peer is not None:
            request = edge_pb2.StageRequest(
                dataset="tokens", version=1, peers=[peer], peers_only=True
            )
        metadata = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
        try:
            events = list(stub.Stage(request, metadata=metadata, timeout=30))
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return f"OK: {events[-1].shards_done} of {events[-1].shards_total} shards"


def _mtls_node(tmp_path: Path, name: str, pki: dict[str, Path], **more: object) -> NodeConfig:
    (tmp_path / "admin.token").write_text(ADMIN_TOKEN)
    settings = {
        "cache_dir": tmp_path / f"cache-{name}",
        "tls_cert": pki["server"],
        "tls_key": pki["server_key"],
        "tls_client_ca": pki["ca"],
        "token_file": tmp_path / "admin.token",
        "peer_tls_ca": pki["ca"],
        **more,
    }
    return NodeConfig(**_settings(tmp_path, **settings))


@pytest.mark.parametrize("client_auth", [True, False])
def test_a_node_copies_from_a_mutual_tls_peer_or_says_why_not(
    tmp_path: Path, registry: str, client_auth: bool
) -> None:
    """A node presents its own certificate to peers: it must allow client authentication."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", server_client_auth=client_auth)
    with running_node(_mtls_node(tmp_path, "a", pki)) as a:
        assert _stage(a.address, pki) == "OK: 2 of 2 shards"
        with running_node(_mtls_node(tmp_path, "b", pki)) as b:
            answer = _stage(b.address, pki, f"grpcs://{a.address}")
    if client_auth:
        assert answer == "OK: 2 of 2 shards", answer
    else:
        assert "clientAuth" in answer and "--tls-client-ca" in answer, answer


def test_an_unreadable_peer_ca_stops_the_node(
    tmp_path: Path, pki: dict[str, Path], registry: str
) -> None:
    """It was read at the first grpcs:// peer, failing a Stage with a bare OSError."""
    config = _mtls_node(tmp_path, "a", pki, peer_tls_ca=tmp_path / "nowhere.pem")
    with pytest.raises(ConfigError) as info, running_node(config):
        pass
    message = str(info.value)
    assert "peer_tls_ca" in message and "nowhere.pem" in message, message
    assert "EDGECACHE_PEER_TLS_CA" in message, message


@pytest.mark.parametrize(
    ("variable", "bad"), [("EDGECACHE_TLS_CA", "garbage"), ("EDGECACHE_TLS_KEY", "other key")]
)
def test_unusable_client_tls_files_are_named(
    tmp_path: Path, pki: dict[str, Path], tls_env: pytest.MonkeyPatch, variable: str, bad: str
) -> None:
    """gRPC said 'Failed to create security handshaker' at every node, as if each were down."""
    from edgecache.cache.errors import InvalidEndpoint
    from edgecache.clients.channels import open_channel

    tls_env.setenv("EDGECACHE_TLS_CA", str(pki["ca"]))
    tls_env.setenv("EDGECACHE_TLS_CERT", str(pki["client"]))
    tls_env.setenv("EDGECACHE_TLS_KEY", str(pki["client_key"]))
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    tls_env.setenv(
        variable, str(tmp_path / "garbage.pem" if bad == "garbage" else pki["server_key"])
    )
    with pytest.raises(InvalidEndpoint, match=f"\\${variable}"):
        open_channel("grpcs://127.0.0.1:7070")


def test_a_node_dying_mid_stream_gets_no_tls_advice() -> None:
    """A reset handshake may be TLS (an mTLS node refusing a client without a certificate);
    a stream that was running and is reset is the node going away: failover logs said
    'over grpcs://, a node with --tls-client-ca refuses clients…' for a SIGKILLed node."""
    from edgecache.clients.channels import connection_hint

    died = "Stream removed (recvmsg:Connection reset by peer (104))"
    assert connection_hint(died) is None
    assert "--tls-client-ca" in (connection_hint("Socket closed") or "")


def test_status_of_a_refused_port_is_said_at_once(tmp_path: Path) -> None:
    """Waiting for the channel to be ready took the whole timeout for a refused port
    (3 s for every down node in status, plan and warm); the first call says it at once.

    A 10 s timeout against a 5 s bound: slack for a loaded machine, while a wait for
    the whole timeout still fails."""
    import time

    from edgecache.clients.channels import health_pings, open_channel
    from edgecache.clients.endpoints import parse_endpoint

    started = time.monotonic()
    with open_channel(parse_endpoint("127.0.0.1:1")) as channel:
        pings = health_pings(channel, pings=3, timeout=10.0)
    assert time.monotonic() - started < 5
    assert pings.lost == 3 and "Connection refused" in (pings.error or ""), pings
