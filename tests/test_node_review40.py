"""``edgecache serve`` as a reviewer found it: drain, empty values, tokens, sizes, pins, IPv6.

A SIGTERM during a ``Stage`` kept starting shard fetches until the grace period
ran out and dropped those then running; empty settings meant three different
things; a token file no client can present started the node; the request size
limit refused ``2MiB``; a pin past 2262 failed with a bare "Value out of range";
an IPv6 listen address was printed undialable; gRPC core logged whatever the
log level; and a few settings (the same address twice, an infinite grace, a
blank region) were accepted.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from edgeutil import (
    node_fields,
    publish,
    serve_process,
    stop_process,
    stub,
    write_parquet_shards,
)
from google.protobuf.timestamp_pb2 import Timestamp

from edgecache.cache.codec import decode_chunk
from edgecache.cache.errors import ConfigError
from edgecache.edge.config import NodeConfig, load_node_config
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2

REQUIRED = {"region": "eu", "cache_dir": "/c", "registry": "file:///r"}


@pytest.fixture(autouse=True)
def _no_node_settings_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the settings a test gives: none from the environment the suite runs in."""
    for name in list(os.environ):
        if name.startswith("EDGECACHE_"):
            monkeypatch.delenv(name)


def _node(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``edgecache serve`` as a subprocess on a free loopback port: (process, address)."""
    return serve_process(
        [
            *("--region", "eu", "--cache-dir", str(tmp_path / "cache")),
            *("--registry", f"file://{tmp_path}/registry"),
            *(() if "--listen" in args else ("--listen", "127.0.0.1:0")),  # given once
            *(() if "--capacity" in args else ("--capacity", "256MiB")),
            *args,
        ],
        {**os.environ, "EDGECACHE_SYNC": "false", **(env or {})},
        log or tmp_path / "node.log",
    )


_stop = stop_process


def _cached_rows(address: str, dataset: str, shard: int) -> int | None:
    """The rows a node holds of a shard (read ``cached_only``), None when it holds none."""
    try:
        chunks = list(
            stub(address).ReadShard(
                edge_pb2.ReadShardRequest(dataset=dataset, version=1, shard=shard, cached_only=True)
            )
        )
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
        return None
    return sum(decode_chunk(chunk.frame).num_rows for chunk in chunks)


# ----------------------------------------------------------------- 1. drain during Stage


def test_sigterm_during_stage_starts_no_shard_and_reports_what_was_staged(
    tmp_path: Path,
) -> None:
    rows = 1000  # about 100 kB of Parquet a shard: 2 s each at 50kB/s
    write_parquet_shards(tmp_path / "origin", 8, rows=rows)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    log = tmp_path / "first.log"
    proc, address = _node(
        tmp_path,
        "--staging-rate",
        "50kB/s",
        env={"EDGECACHE_STAGING_CONCURRENCY": "2", "EDGECACHE_GRACE_SECONDS": "60"},
        log=log,
    )
    progress: list[edge_pb2.StageProgress] = []
    try:
        stream = stub(address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1))
        with pytest.raises(grpc.RpcError) as info:
            for event in stream:
                progress.append(event)
                if len(progress) == 1:  # one shard committed: the rest are to come
                    proc.send_signal(signal.SIGTERM)
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    error = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    details = error.details()
    assert "is shutting down (SIGTERM)" in details
    staged = progress[-1].shards_done
    assert 1 <= staged < 8, details
    assert f"{staged} of 8 shards of tokens@1 are staged here" in details
    assert "stage tokens@1 again" in details
    text = log.read_text()
    drain = text.index("signal received: draining")
    assert "fetching" not in text[drain:], text[drain:]  # no fetch started once it drains
    assert "were dropped" not in text
    assert "staging starts no new shards" in text[drain:]

    for path in (tmp_path / "origin").iterdir():
        path.unlink()  # from now on only the cache has the data
    proc, address = _node(tmp_path, log=tmp_path / "second.log")
    try:
        status = stub(address).Status(edge_pb2.StatusRequest())
        held = {v.dataset: v.shard_count for v in status.versions}
        assert held.get("tokens", 0) == staged
        complete = [s for s in range(8) if _cached_rows(address, "tokens", s) == rows]
        absent = [s for s in range(8) if _cached_rows(address, "tokens", s) is None]
        assert len(complete) == staged and len(complete) + len(absent) == 8  # none partial
        assert f"shard{'s' if staged > 1 else ''} {', '.join(map(str, complete))}" in details
    finally:
        _stop(proc)


def test_a_shard_fetching_when_the_drain_begins_commits_and_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch under way when SIGTERM comes commits whole within the grace time.

    The first shard's encoding is held until the drain has begun (an event, no
    timing): the Stage then reports it staged, and no other shard starts.
    """
    import asyncio
    import threading

    from edgecache.cache.store import CacheStore
    from edgecache.edge import node as node_module
    from edgecache.edge.server import NodeServer
    from edgecache.v1 import edge_pb2_grpc

    write_parquet_shards(tmp_path / "origin", 3, rows=500)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    entered, release = threading.Event(), threading.Event()
    encode = node_module.encode_raw_shard

    def held_encode(*args: object) -> object:
        entered.set()
        assert release.wait(60)
        return encode(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(node_module, "encode_raw_shard", held_encode)
    config = NodeConfig(**node_fields(tmp_path, staging_concurrency=1, grace_seconds=60))

    async def scenario() -> tuple[list[edge_pb2.StageProgress], grpc.aio.AioRpcError]:
        server = NodeServer(config)
        await server.start()
        seen: list[edge_pb2.StageProgress] = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = edge_pb2_grpc.EdgeCacheStub(channel).Stage(
                edge_pb2.StageRequest(dataset="tokens", version=1)
            )
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 60)  # shard 0 is encoding
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0)  # stop() has begun: the node drains
            assert server.node is not None and server.node.draining
            release.set()
            try:
                async for event in call:
                    seen.append(event)
            except grpc.aio.AioRpcError as exc:
                await stopping
                return seen, exc
        raise AssertionError("the Stage ended without an error")

    seen, error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert "1 of 3 shards of tokens@1 are staged here (shard 0, committed whole)" in (
        error.details() or ""
    )
    assert [e.shards_done for e in seen] == [1]
    with CacheStore(tmp_path / "cache", readonly=True) as store:
        assert [v.shard_count for v in store.versions()] == [1]


# ------------------------------------------------------------------- 2. empty values


def _refusal(tmp_path: Path, env: dict[str, str], *args: str) -> str:
    """``edgecache serve`` refusing its settings at start: exit 2; its stderr."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    out = subprocess.run(
        [
            *(sys.executable, "-m", "edgecache.clients.cli", "serve", "--region", "eu"),
            *("--registry", f"file://{tmp_path}/registry"),
            *(() if "--listen" in args else ("--listen", "127.0.0.1:0")),  # given once
            *args,
        ],
        capture_output=True,
        text=True,
        env={**environ, "EDGECACHE_SYNC": "false", **env},
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "serving on" not in out.stdout
    return out.stderr


def test_an_empty_cache_dir_is_refused_not_the_current_directory(tmp_path: Path) -> None:
    err = _refusal(tmp_path, {"EDGECACHE_CACHE_DIR": ""})
    assert "--cache-dir ($EDGECACHE_CACHE_DIR): is empty, and the node needs it" in err
    assert not list(tmp_path.glob("*.mdb"))  # no cache was made where it ran


def test_an_empty_cache_dir_flag_is_refused_not_the_current_directory(tmp_path: Path) -> None:
    # typer made --cache-dir "" into Path('.'), which no check could tell from a real ".".
    err = _refusal(tmp_path, {}, "--cache-dir", "")
    assert "--cache-dir: is empty, and the node needs it" in err, err
    assert not list(tmp_path.glob("*.mdb"))


def test_an_empty_variable_or_flag_leaves_the_files_value_standing(tmp_path: Path) -> None:
    # Empty means "not set": EDGECACHE_TOKEN_FILE= beside the file's token_file dropped
    # it, and the node started without auth, saying nothing.
    token = tmp_path / "admin.token"
    token.write_text("s3cret\n")
    config = tmp_path / "node.yaml"
    config.write_text(f"token_file: {token}\ncapacity: 1GiB\ngrace_seconds: 30\n")
    empty = {"EDGECACHE_TOKEN_FILE": "", "EDGECACHE_CAPACITY": "", "EDGECACHE_GRACE_SECONDS": ""}
    for env, flags in ((empty, {}), ({}, {"token_file": ""})):
        settings = load_node_config(config, {**REQUIRED, **flags}, {**_env({}), **env})
        assert settings.token_file == token and settings.capacity == 1 << 30
        assert settings.grace_seconds == 30


@pytest.mark.parametrize("name", ["region", "registry"])
def test_an_empty_or_blank_required_setting_is_refused_naming_it(name: str) -> None:
    for value in ("", "  "):
        with pytest.raises(ConfigError, match=f"--{name} \\(\\$EDGECACHE_{name.upper()}\\): "):
            load_node_config(None, {}, {**_env(REQUIRED), f"EDGECACHE_{name.upper()}": value})


def _env(values: dict[str, str]) -> dict[str, str]:
    return {f"EDGECACHE_{k.upper()}": v for k, v in values.items()}


def test_an_empty_optional_setting_is_unset_whatever_its_kind(tmp_path: Path) -> None:
    """Paths became Path('.'), sizes were unset, an address was an error: one rule now."""
    empty = {
        name: ""
        for name in (
            "tls_cert",
            "token_file",
            "read_token_file",
            "peer_token_file",
            "peer_tls_ca",
            "capacity",
            "staging_rate",
            "fetch_memory",
            "metrics_listen",
            "probe_listen",
            "listen",
            "grace_seconds",
            "max_request_bytes",
            "origins",
            "node_id",
        )
    }
    config = load_node_config(None, {}, _env({**REQUIRED, **empty}))
    defaults = NodeConfig(**REQUIRED)
    assert config == defaults
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text(
        "region: eu\ncache_dir: /c\nregistry: file:///r\ncapacity:\ntls_cert: ''\n"
        "metrics_listen:\ngrace_seconds:\n"
    )
    assert load_node_config(yaml_file, {}, {}) == defaults


def test_an_empty_tls_cert_variable_starts_a_node(tmp_path: Path) -> None:
    """It said '--tls-cert is set without --tls-key' (Path('.') was a certificate)."""
    proc, address = _node(tmp_path, env={"EDGECACHE_TLS_CERT": "", "EDGECACHE_TOKEN_FILE": ""})
    try:
        assert stub(address).Status(edge_pb2.StatusRequest()).region == "eu"
    finally:
        assert _stop(proc) == 0


# ------------------------------------------------------------ 6. tokens no client can send


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("abc\ndef\n", "holds more than one line"),
        ("toké", "holds a non-ASCII character"),
        ("ab\x01c", "holds the control character 0x01"),
    ],
)
@pytest.mark.parametrize("flag", ["--token-file", "--read-token-file"])
def test_a_token_no_client_can_present_stops_the_node(
    tmp_path: Path, content: str, said: str, flag: str
) -> None:
    token = tmp_path / "token"
    token.write_bytes(content.encode())
    (tmp_path / "cache").mkdir()
    err = _refusal(tmp_path, {}, "--cache-dir", str(tmp_path / "cache"), flag, str(token))
    assert f"{flag} {token} {said}: a token is one line of printable ASCII" in err
    assert "Traceback" not in err


def test_one_token_for_admin_and_reads_stops_the_node(tmp_path: Path) -> None:
    """The admin token is accepted first: one file for both made every reader an admin."""
    token = tmp_path / "shared.token"
    token.write_text("s3cret\n")
    (tmp_path / "cache").mkdir()
    err = _refusal(
        tmp_path, {}, "--cache-dir", str(tmp_path / "cache"),
        "--token-file", str(token), "--read-token-file", str(token),
    )  # fmt: skip
    assert "hold the same token, so every reader would be an admin" in err, err
    assert f"--token-file ({token}) and --read-token-file ({token})" in err, err  # as set
    assert "s3cret" not in err


@pytest.mark.parametrize(
    ("content", "said"), [("abc\ndef\n", "more than one line"), ("toké", "a non-ASCII character")]
)
def test_a_cli_token_file_no_client_can_send_is_bad_input(
    tmp_path: Path, content: str, said: str
) -> None:
    """It was sent anyway: gRPC failed every call "INTERNAL: Invalid metadata", the node was
    said to be down (exit 1), and ready --wait polled it to its timeout."""
    from typer.testing import CliRunner

    from edgecache.clients.cli import app

    token = tmp_path / "token"
    token.write_bytes(content.encode())
    topology = tmp_path / "edgecache.yaml"
    topology.write_text("registry: file:///unused\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n")
    result = CliRunner().invoke(
        app, ["status", "--config", str(topology), "--token-file", str(token)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--token-file {token} holds {said}" in " ".join(result.output.split())


def test_a_token_with_a_trailing_newline_and_inner_space_is_fine(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret token\n")
    config = NodeConfig(**node_fields(tmp_path, token_file=token))
    assert config.read_token("token_file") == "s3cret token"
    with running_node(config) as node:
        channel = grpc.insecure_channel(node.address)
        try:
            status = channel.unary_unary(
                "/edgecache.v1.EdgeCache/Status",
                request_serializer=edge_pb2.StatusRequest.SerializeToString,
                response_deserializer=edge_pb2.NodeStatus.FromString,
            )(edge_pb2.StatusRequest(), metadata=(("authorization", "Bearer s3cret token"),))
        finally:
            channel.close()
        assert status.region == "eu"


# --------------------------------------------------------------- 5. max_request_bytes


def test_max_request_bytes_is_a_size_and_takes_effect(tmp_path: Path) -> None:
    assert (
        load_node_config(None, REQUIRED, {"EDGECACHE_MAX_REQUEST_BYTES": "1KiB"}).max_request_bytes
        == 1024
    )
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text(
        "region: eu\ncache_dir: /c\nregistry: file:///r\nmax_request_bytes: 2MiB\n"
    )
    assert load_node_config(yaml_file, {}, {}).max_request_bytes == 2 << 20
    for bad in ("512B", "65MiB", "lots"):
        with pytest.raises(ConfigError, match="max_request_bytes / \\$EDGECACHE_MAX_REQUEST_BYTES"):
            load_node_config(None, REQUIRED, {"EDGECACHE_MAX_REQUEST_BYTES": bad})
    config = NodeConfig(**node_fields(tmp_path, max_request_bytes="1KiB"))
    with running_node(config) as node:
        with pytest.raises(grpc.RpcError) as info:
            stub(node.address).Stage(
                edge_pb2.StageRequest(dataset="d", version=1, peers=["p" * 2000 + ":1"])
            ).next()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # gRPC refuses it before any handler or interceptor runs: its own words, documented.
        assert "larger than max" in (info.value.details() or "")
    docs = (Path(__file__).parent.parent / "docs" / "edge-node.md").read_text()
    assert "Received message larger than max" in docs


# ------------------------------------------------------------------- 4. pin times


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (9_300_000_000, "is later than 2262-04-11T23:47:16Z, the latest time a pin can hold"),
        (253_402_300_799, "until 9999-12-31T23:59:59+00:00 is later than 2262-04-11"),
        (-5, "(seconds=-5) is before 1970-01-01T00:00:01Z"),
        (0, "(seconds=0) is before 1970-01-01T00:00:01Z"),  # 0 would have unpinned it
    ],
)
def test_a_pin_time_the_cache_cannot_hold_is_refused_naming_field_and_limit(
    tmp_path: Path, seconds: int, said: str
) -> None:
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    with running_node(NodeConfig(**node_fields(tmp_path))) as node:
        client = stub(node.address)
        stamp = Timestamp(seconds=seconds)
        with pytest.raises(grpc.RpcError) as info:
            client.Pin(edge_pb2.PinRequest(dataset="tokens", version=1, until=stamp))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("until ")
        assert said in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            list(client.Stage(edge_pb2.StageRequest(dataset="tokens", version=1, pin_until=stamp)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("pin_until ")
        assert said in (info.value.details() or "")
        assert not client.Status(edge_pb2.StatusRequest()).versions  # nothing pinned or staged
        latest = Timestamp(seconds=(2**63 - 1) // 10**9)  # the limit itself is a pin
        client.Pin(edge_pb2.PinRequest(dataset="tokens", version=1, until=latest))
        (version,) = client.Status(edge_pb2.StatusRequest()).versions
        assert version.pinned_until == latest


def test_the_store_refuses_a_pin_outside_its_range(tmp_path: Path) -> None:
    from edgecache.cache.store import CacheStore

    with CacheStore(tmp_path / "c", capacity_bytes=64 << 20, sync=False) as store:
        for until in (datetime(1969, 12, 31, tzinfo=UTC), datetime(2263, 1, 1, tzinfo=UTC)):
            with pytest.raises(ValueError, match="outside what the cache records"):
                store.pin_version("d", 1, until)
        assert store.versions() == []


# ---------------------------------------------------------------------- 3. IPv6


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host cannot bind IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["[::1]", "[::]"])
def test_an_ipv6_listen_address_is_printed_as_one_to_dial(tmp_path: Path, host: str) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EDGECACHE_")}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "edgecache.clients.cli", "serve", "--region", "eu"),
            *("--cache-dir", str(tmp_path / "cache"), "--registry", f"file://{tmp_path}/r"),
            *("--listen", f"{host}:0", "--capacity", "64MiB"),
            *("--metrics-listen", "[::1]:0", "--probe-listen", "[::1]:0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**environ, "EDGECACHE_SYNC": "false"},
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        serving, metrics, probe = lines
        assert serving.startswith("serving on "), lines
        dial = serving.split()[-1]
        assert dial.startswith("[::1]:"), serving
        if host == "[::]":
            assert serving.startswith("serving on [::]:") and ", dial [::1]:" in serving
        assert stub(dial).Status(edge_pb2.StatusRequest(), timeout=30).region == "eu"
        assert metrics.startswith("metrics on [::1]:") and probe.startswith(
            "health probe on [::1]:"
        )
        channel = grpc.insecure_channel(probe.split()[-1])
        try:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()
    finally:
        _stop(proc)


def test_dial_address_brackets_ipv6_and_maps_wildcards() -> None:
    from edgecache.edge.server import dial_address, host_port

    assert dial_address("::", 7) == "[::1]:7"
    assert dial_address("0.0.0.0", 7) == "127.0.0.1:7"
    assert dial_address("fe80::1", 7) == "[fe80::1]:7"
    assert dial_address("node.example", 7) == "node.example:7"
    assert host_port("::", 7) == "[::]:7"


# ------------------------------------------------------------- 7. gRPC core's log lines


def test_grpc_core_lines_follow_grpc_verbosity_and_the_log_level_variable_sets_the_nodes(
    tmp_path: Path,
) -> None:
    """A port scanner against a TLS node: one gRPC core line per plaintext connection.

    --log-level cannot reach them (gRPC reads GRPC_VERBOSITY once, when it is
    first imported, before serve reads any flag); the docs say so. The node's
    own lines follow EDGECACHE_LOG_LEVEL, a setting like the others (it was
    warned of as ignored, though serve --help says every setting can be set
    as EDGECACHE_<NAME>).
    """
    from tlsutil import make_pki

    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    tls = ("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]))

    def handshake_lines(env: dict[str, str], name: str) -> tuple[int, str]:
        log = tmp_path / f"{name}.log"
        proc, address = _node(tmp_path / name, *tls, env=env, log=log)
        try:
            for _ in range(3):
                channel = grpc.insecure_channel(address)  # plaintext to a TLS port
                with pytest.raises(grpc.RpcError):
                    stub_call = channel.unary_unary("/edgecache.v1.EdgeCache/Status")
                    stub_call(b"", timeout=5)
                channel.close()
        finally:
            assert _stop(proc) == 0
        text = log.read_text()
        return text.count("Handshake failed"), text

    (tmp_path / "loud").mkdir()
    (tmp_path / "quiet").mkdir()
    loud, _ = handshake_lines({"GRPC_VERBOSITY": "INFO", "EDGECACHE_LOG_LEVEL": "error"}, "loud")
    quiet, text = handshake_lines({"GRPC_VERBOSITY": "ERROR"}, "quiet")
    assert loud >= 1 and quiet == 0
    loud_text = (tmp_path / "loud.log").read_text()
    assert "EDGECACHE_LOG_LEVEL" not in loud_text  # no "not a setting" warning
    assert " INFO edgecache" not in loud_text and " INFO edgecache" in text
    docs = (Path(__file__).parent.parent / "docs" / "edge-node.md").read_text()
    assert "follow `GRPC_VERBOSITY`" in docs and "`EDGECACHE_LOG_LEVEL=debug`" in docs


@pytest.mark.parametrize(
    ("where", "shown"),
    [("file", False), ("flag over file", True), ("variable over file", True)],
)
def test_log_level_is_a_setting_of_the_config_file_and_environment(
    tmp_path: Path, where: str, shown: bool
) -> None:
    """``log_level:`` in --config was refused as no such setting; flags and variables win."""
    (tmp_path / "node.yaml").write_text("log_level: error\n")
    args: list[str] = ["--config", str(tmp_path / "node.yaml")]
    env: dict[str, str] = {}
    if where == "flag over file":
        args += ["--log-level", "info"]
    if where == "variable over file":
        env["EDGECACHE_LOG_LEVEL"] = "Info"
    proc, _ = _node(tmp_path, *args, env=env)
    assert _stop(proc) == 0
    text = (tmp_path / "node.log").read_text()
    assert (" INFO edgecache" in text) is shown, text


def test_a_bad_log_level_variable_is_refused_naming_it(tmp_path: Path) -> None:
    """Exit 2 at serve (a ConfigError) naming the variable and the levels it takes."""
    flags = {"region": "eu", "cache_dir": str(tmp_path / "c"), "registry": "file:///r"}
    with pytest.raises(ConfigError, match=r"(?s)--log-level \(\$EDGECACHE_LOG_LEVEL\).*DEBUG"):
        load_node_config(flags=flags, environ={"EDGECACHE_LOG_LEVEL": "loud"})
    assert load_node_config(flags=flags, environ={"EDGECACHE_LOG_LEVEL": "debug"}).log_level == (
        "DEBUG"
    )


# --------------------------------------------------------------------- 8. smaller ones


@pytest.mark.parametrize(
    ("first", "second"),
    [("listen", "probe_listen"), ("listen", "metrics_listen"), ("metrics_listen", "probe_listen")],
)
def test_two_listen_settings_on_one_port_are_refused_naming_both(first: str, second: str) -> None:
    values = {**REQUIRED, "listen": "127.0.0.1:0", first: "127.0.0.1:17470"}
    values[second] = "0.0.0.0:17470"  # a wildcard takes the port on every address
    with pytest.raises(ConfigError) as info:
        load_node_config(None, values, {})
    names = [f"--{n.replace('_', '-')}" for n in (first, second)]
    assert f"{names[0]} 127.0.0.1:17470 and {names[1]} 0.0.0.0:17470 are the same port" in str(
        info.value
    )
    load_node_config(None, {**values, second: "127.0.0.2:17470"}, {})  # another address: fine


def test_a_name_and_an_address_it_binds_on_one_port_are_refused() -> None:
    """localhost is 127.0.0.1 (and ::1) to gRPC: --listen localhost:P beside --probe-listen
    127.0.0.1:P started, and the probe port answered Status as UNIMPLEMENTED."""
    values = {**REQUIRED, "listen": "localhost:17472", "probe_listen": "127.0.0.1:17472"}
    with pytest.raises(ConfigError, match="--listen localhost:17472 and --probe-listen "):
        load_node_config(None, values, {})
    values = {**REQUIRED, "listen": "127.0.0.1:17472", "metrics_listen": "localhost:17472"}
    with pytest.raises(ConfigError, match="are the same port"):
        load_node_config(None, values, {})
    load_node_config(None, {**values, "metrics_listen": "localhost:17473"}, {})


def test_the_same_address_twice_exits_2_before_binding(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    err = _refusal(
        tmp_path,
        {},
        *("--cache-dir", str(tmp_path / "cache"), "--listen", "127.0.0.1:17471"),
        *("--probe-listen", "127.0.0.1:17471"),
    )
    assert "--listen 127.0.0.1:17471 and --probe-listen 127.0.0.1:17471 are the same port" in err
    assert "another process listens there" not in err


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-1"])
def test_grace_seconds_must_be_a_finite_number_at_least_0(tmp_path: Path, value: str) -> None:
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text(
        f"region: eu\ncache_dir: /c\nregistry: file:///r\ngrace_seconds: {value}\n"
    )
    with pytest.raises(ConfigError, match="give a finite number of seconds, at least 0"):
        load_node_config(yaml_file, {}, {})
    for env in ("inf", "nan", "NaN"):
        with pytest.raises(ConfigError, match="is not a drain time"):
            load_node_config(None, REQUIRED, {"EDGECACHE_GRACE_SECONDS": env})
    assert load_node_config(None, REQUIRED, {"EDGECACHE_GRACE_SECONDS": "0"}).grace_seconds == 0


@pytest.mark.parametrize("name", ["region", "node_id"])
def test_a_region_or_node_id_of_spaces_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="holds only spaces"):
        load_node_config(None, {**REQUIRED, name: " \t "}, {})


def test_the_proto_says_an_out_of_range_shard_is_invalid_argument() -> None:
    proto = Path(__file__).parent.parent / "proto" / "edgecache" / "v1" / "edge.proto"
    header = " ".join(proto.read_text().split("syntax")[0].replace("//", " ").split())
    assert "NOT_FOUND for an unknown dataset or version;" in header
    assert "INVALID_ARGUMENT for malformed names and out-of-range indexes (a shard" in header


def test_the_log_says_a_wildcard_bind_as_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log said "serving on 127.0.0.1:PORT" of a node bound to every interface."""
    import logging

    from edgeutil import node_settings

    from edgecache.edge.server import running_node

    settings = node_settings(tmp_path, f"file://{tmp_path}/registry", listen="0.0.0.0:0")
    with caplog.at_level(logging.INFO, logger="edgecache.edge.server"), running_node(settings):
        pass
    assert re.search(r"serving on 0\.0\.0\.0:\d+, dial 127\.0\.0\.1:\d+", caplog.text), caplog.text
