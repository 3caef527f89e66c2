"""``edgecache serve``'s settings as a reviewer broke them: each is refused, exit 2, and named.

A DER file for a PEM flag crashed the node with a traceback; a number or a
list in the YAML file crashed it too; a staging rate under 1 byte/s (``0``,
``7bit/s``) started a node with no limit at all; ``--capacity 0`` was
reported as ``capacity_bytes``; settings without a flag were reported as
``--max-streams``, a flag that does not exist; ``serve --help`` did not list
those settings; and the drain log rounded ``grace_seconds: 0.5`` to ``0 s``.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from edgeutil import edgecache, node_fields, serve_args
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tlsutil import make_pki
from typer.main import get_command
from typer.testing import CliRunner

from edgecache.cache.errors import ConfigError
from edgecache.cache.units import parse_rate, parse_size
from edgecache.clients.cli import app
from edgecache.edge.config import FLAG_SETTINGS, NodeConfig, load_node_config
from edgecache.edge.server import running_node
from edgecache.edge.staging_gate import StagingGate

REQUIRED = {"region": "eu", "cache_dir": "/c", "registry": "file:///r"}


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki")


@pytest.fixture(autouse=True)
def _no_node_settings_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the settings a test gives: none from the environment the suite runs in."""
    for name in list(os.environ):
        if name.startswith("EDGECACHE_"):
            monkeypatch.delenv(name)


def _settings(tmp_path: Path, **flags: object) -> dict[str, object]:
    return node_fields(tmp_path, **flags)


def _serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``edgecache serve`` in this process, expected to refuse its settings: (code, output)."""
    result = CliRunner().invoke(
        app,
        [*serve_args(tmp_path), *args],
        env={"EDGECACHE_SYNC": "false", **(env or {})},
    )
    assert "serving on" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"serve crashed: {result.exception!r}\n{result.output}")
    return result.exit_code, result.output


def _invalid(config_file: Path | None = None, **values: object) -> str:
    """The ConfigError load_node_config raises for ``values`` (and ``config_file``)."""
    flags = {} if config_file is not None else {**REQUIRED, **values}
    with pytest.raises(ConfigError) as info:
        load_node_config(config_file, flags, {})
    return str(info.value)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("region: eu\ncache_dir: /c\nregistry: file:///r\n" + text)
    return path


# --- 1. TLS files that are not PEM ----------------------------------------------------------


def _der(pki: dict[str, Path], role: str, tmp_path: Path) -> Path:
    """``role``'s PEM file as DER (what `openssl x509 -outform DER` writes)."""
    from cryptography.hazmat.primitives import serialization

    pem = pki[role].read_bytes()
    if role.endswith("_key"):
        key = serialization.load_pem_private_key(pem, password=None)
        der = key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    else:
        der = ssl.PEM_cert_to_DER_cert(pem.decode())
    path = tmp_path / f"{role}.der"
    path.write_bytes(der)
    return path


@pytest.mark.parametrize(
    ("setting", "role", "named"),
    [
        ("tls_cert", "server", "--tls-cert"),
        ("tls_key", "server_key", "--tls-key"),
        ("tls_client_ca", "ca", "--tls-client-ca"),
        ("peer_tls_ca", "ca", "peer_tls_ca"),
    ],
)
def test_a_der_file_for_a_pem_setting_is_refused_naming_it(
    tmp_path: Path, pki: dict[str, Path], setting: str, role: str, named: str
) -> None:
    """--tls-cert and --tls-client-ca crashed (TypeError); peer_tls_ca was taken unchecked."""
    files = {"tls_cert": pki["server"], "tls_key": pki["server_key"], "tls_client_ca": pki["ca"]}
    files[setting] = _der(pki, role, tmp_path)
    with (
        pytest.raises(ConfigError) as info,
        running_node(NodeConfig(**_settings(tmp_path, **files))),
    ):
        pass
    message = str(info.value)
    assert named in message and f"{role}.der" in message, message
    assert "must be a PEM file" in message and "bind" not in message, message


@pytest.mark.parametrize(("flag", "role"), [("--tls-cert", "server"), ("--tls-client-ca", "ca")])
def test_serve_with_a_der_certificate_exits_2_naming_the_flag(
    tmp_path: Path, pki: dict[str, Path], flag: str, role: str
) -> None:
    files = {"--tls-cert": pki["server"], "--tls-key": pki["server_key"]}
    files[flag] = _der(pki, role, tmp_path)
    args = [str(a) for item in files.items() for a in item]
    code, out = _serve(tmp_path, *args)
    assert code == 2, out
    assert f"{flag} {tmp_path / f'{role}.der'} must be a PEM file" in out, out
    assert "Traceback" not in out and "TypeError" not in out, out


def test_a_pem_certificate_with_utf8_text_beside_it_serves(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    """`openssl x509 -text` writes the subject beside the PEM block, in UTF-8: that crashed."""
    cert = tmp_path / "server-text.pem"
    cert.write_bytes(
        "Certificate:\n    Subject: O = Société Générale, CN = localhost\n".encode()
        + pki["server"].read_bytes()
    )
    config = NodeConfig(**_settings(tmp_path, tls_cert=cert, tls_key=pki["server_key"]))
    with running_node(config) as node:
        credentials = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
        with grpc.secure_channel(node.address, credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- 2. numbers and other non-text values in the YAML file ---------------------------------


def test_numbers_in_the_yaml_file_are_bytes_and_bytes_per_second(tmp_path: Path) -> None:
    """staging_rate: 100.5 crashed ('float' object has no attribute 'strip')."""
    config = load_node_config(
        _yaml(tmp_path, "staging_rate: 100.5\ncapacity: 1073741824\n"), {}, {}
    )
    assert config.staging_rate == 100 and config.capacity == 1 << 30
    config = load_node_config(_yaml(tmp_path, "staging_rate: 5000\ncapacity: 2.5e+9\n"), {}, {})
    assert config.staging_rate == 5000 and config.capacity == 2_500_000_000


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("capacity: [1]", "--capacity"),
        ("capacity: {a: 1}", "--capacity"),
        ("capacity: true", "--capacity"),
        ("capacity: -5", "--capacity"),
        ("capacity: .nan", "--capacity"),
        ("staging_rate: [100]", "--staging-rate"),
        ("staging_rate: yes", "--staging-rate"),
        ("staging_rate: -1.5", "--staging-rate"),
    ],
)
def test_other_values_in_the_yaml_file_are_refused_naming_the_setting(
    tmp_path: Path, line: str, named: str
) -> None:
    """capacity: [1] crashed with a TypeError."""
    message = _invalid(_yaml(tmp_path, line + "\n"))
    assert f"{named} ({tmp_path / 'bad.yaml'}): " in message, message
    assert "must not be negative" in message or "use " in message, message


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("max_streams: true", "$EDGECACHE_MAX_STREAMS"),
        ("staging_concurrency: yes", "$EDGECACHE_STAGING_CONCURRENCY"),
        ("fetch_concurrency: true", "$EDGECACHE_FETCH_CONCURRENCY"),
        ("preprocess_threads: on", "$EDGECACHE_PREPROCESS_THREADS"),
    ],
)
def test_a_yes_for_a_count_is_refused_not_taken_as_1(tmp_path: Path, line: str, named: str) -> None:
    """max_streams: true started a node that refused every call past the first (a helper's
    hunt): pydantic's lax mode takes a bool for the int 1."""
    message = _invalid(_yaml(tmp_path, line + "\n"))
    assert named in message and str(tmp_path / "bad.yaml") in message, message
    assert "is not a count: give a whole number" in message, message


def test_serve_with_a_list_for_capacity_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("capacity: [1]\nstaging_rate: 100.5\n")
    code, out = _serve(tmp_path, "--config", str(config))
    assert code == 2, out
    assert "--capacity" in out and "invalid size [1]" in out and "staging" not in out, out


@pytest.mark.parametrize("value", [[1], None, True, {"a": 1}, float("inf")])
def test_parse_size_and_rate_refuse_what_is_no_amount_with_a_value_error(value: object) -> None:
    for parse in (parse_size, parse_rate):
        with pytest.raises(ValueError, match="invalid"):
            parse(value)  # type: ignore[arg-type]


def test_an_amount_too_large_to_count_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="too large"):
        parse_size("9" * 400 + "TB")


# --- 3. a staging rate under 1 byte/s --------------------------------------------------------


@pytest.mark.parametrize("rate", ["0", "7bit/s", "0.5B/s", "0B/s", "0.9"])
def test_a_staging_rate_under_1_byte_per_second_exits_2_and_says_how_to_ask_for_none(
    tmp_path: Path, rate: str
) -> None:
    """Each started a node with no rate limit at all."""
    code, out = _serve(tmp_path, "--staging-rate", rate)
    assert code == 2, out
    assert "--staging-rate: " in out and "below 1 byte/s" in out, out
    assert "without a limit, leave the staging rate unset" in out, out


def test_a_zero_staging_rate_from_the_environment_or_file_is_refused(tmp_path: Path) -> None:
    message = _invalid(_yaml(tmp_path, "staging_rate: 0\n"))
    assert f"--staging-rate ({tmp_path / 'bad.yaml'}): 0 is below 1 byte/s" in message, message
    with pytest.raises(ConfigError, match=r"--staging-rate \(\$EDGECACHE_STAGING_RATE\)"):
        load_node_config(None, REQUIRED, {"EDGECACHE_STAGING_RATE": "7bit/s"})


def test_one_byte_per_second_is_a_limit_and_unset_is_none() -> None:
    assert load_node_config(None, {**REQUIRED, "staging_rate": "8bit/s"}, {}).staging_rate == 1
    assert load_node_config(None, {**REQUIRED, "staging_rate": "1B/s"}, {}).staging_rate == 1
    assert load_node_config(None, REQUIRED, {"EDGECACHE_STAGING_RATE": ""}).staging_rate is None
    assert load_node_config(None, REQUIRED, {}).staging_rate is None


def test_the_staging_gate_takes_no_rate_under_1_for_none() -> None:
    with pytest.raises(ValueError, match="below 1 byte/s"):
        StagingGate(rate=0, concurrency=4)
    assert StagingGate(rate=1, concurrency=4)._bucket is not None
    assert StagingGate(rate=None, concurrency=4)._bucket is None


# --- 4. errors name the setting as it can be set --------------------------------------------


@pytest.mark.parametrize("capacity", ["0", "0.5", "0GiB"])
def test_capacity_0_is_refused_naming_the_flag(tmp_path: Path, capacity: str) -> None:
    """It said 'capacity_bytes must be positive', from the store, after opening the cache."""
    code, out = _serve(tmp_path, "--capacity", capacity)
    assert code == 2, out
    assert "--capacity: the cache's capacity must be at least 1 byte" in out, out
    assert "capacity_bytes" not in out and "leave it unset" in out, out
    assert not (tmp_path / "cache").exists()  # refused before anything was opened


def test_settings_without_a_flag_are_named_as_yaml_key_and_variable(tmp_path: Path) -> None:
    """They were named --max-streams, --grace-seconds, --foo: flags that do not exist."""
    bad = tmp_path / "bad.yaml"
    message = _invalid(
        _yaml(tmp_path, "max_streams: 0\ngrace_seconds: -1\nfoo: 1\nstaging_concurency: 8\n")
    )
    assert f"max_streams / $EDGECACHE_MAX_STREAMS ({bad}): " in message, message
    assert f"grace_seconds / $EDGECACHE_GRACE_SECONDS ({bad}): " in message, message
    assert f"foo ({bad}): there is no such setting; the settings are region, " in message, message
    assert f"staging_concurency ({bad}): there is no such setting; did you mean " in message
    assert "staging_concurrency?" in message, message
    for flag in ("--max-streams", "--grace-seconds", "--foo", "--staging-concur"):
        assert flag not in message, message
    with pytest.raises(ConfigError) as info:
        load_node_config(None, REQUIRED, {"EDGECACHE_FETCH_CONCURRENCY": "many"})
    message = str(info.value)
    assert "fetch_concurrency / $EDGECACHE_FETCH_CONCURRENCY ($EDGECACHE_FETCH_CONCURRENCY)" in (
        message
    ), message
    assert "--fetch-concurrency" not in message, message


def test_serve_names_a_setting_without_a_flag_without_a_flag(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("max_streams: 0\n")
    code, out = _serve(tmp_path, "--config", str(config))
    assert code == 2, out
    assert "max_streams / $EDGECACHE_MAX_STREAMS" in out and "--max-streams" not in out, out


def test_the_settings_with_flags_are_serves_options() -> None:
    """FLAG_SETTINGS decides which settings an error names as a flag: it must be serve's."""
    command = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options = {p.name for p in command.params} - {"config", "help"}
    assert options == set(FLAG_SETTINGS)
    assert FLAG_SETTINGS <= set(NodeConfig.model_fields)


# --- 5. serve --help lists every setting ----------------------------------------------------


def _default(name: str) -> str:
    default = NodeConfig.model_fields[name].default
    if isinstance(default, bool):
        return str(default).lower()
    if name == "max_request_bytes":
        assert default == 1 << 20
        return "1MiB"
    return f"{default:g}" if isinstance(default, float) else str(default)


def test_serve_help_lists_the_settings_without_a_flag_and_their_defaults() -> None:
    code, out, err = edgecache("serve", "--help", timeout=60)
    assert code == 0, err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "EDGECACHE_<NAME>" in out and "--config YAML file" in out, out
    command = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    helps = {p.name: getattr(p, "help", "") for p in command.params}
    capacity_default = "default: the size the cache had, else 80% of the disk's free space"
    assert capacity_default in helps["capacity"], helps
    assert "default: no cap" in helps["staging_rate"]
    assert "else 80%" in out, out
    epilog = out[out.index("These settings have no flag") :]
    items = {}  # setting → its text, its continuation lines joined
    for line in epilog.splitlines()[1:]:
        words = line.split()
        if line.startswith("   ") and words and words[0] in NodeConfig.model_fields:
            items[words[0]] = " ".join(words[1:])
        elif words and items:
            items[list(items)[-1]] += " " + " ".join(words)
    assert set(items) == set(NodeConfig.model_fields) - FLAG_SETTINGS, items
    for name, text in items.items():
        if NodeConfig.model_fields[name].default is not None:
            assert text.endswith(f"({_default(name)})"), (name, text)


# --- 6. the drain log -----------------------------------------------------------------------


def test_the_drain_log_gives_a_fractional_grace_period(tmp_path: Path) -> None:
    """grace_seconds: 0.5 was logged as 'draining for up to 0 s'."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", "serve", "--capacity", "64MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "EDGECACHE_REGION": "eu",
            "EDGECACHE_CACHE_DIR": str(tmp_path / "cache"),
            "EDGECACHE_REGISTRY": f"file://{tmp_path}/registry",
            "EDGECACHE_LISTEN": "127.0.0.1:0",
            "EDGECACHE_SYNC": "false",
            "EDGECACHE_GRACE_SECONDS": "0.5",
        },
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving on "), line + (proc.stderr.read() if proc.stderr else "")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "signal received: draining for up to 0.5 s" in err, err


def test_a_misspelt_variable_is_said_not_silently_ignored(caplog) -> None:
    # EDGECACHE_TLS_CERTIFICATE (for EDGECACHE_TLS_CERT) was dropped without a word,
    # leaving the node serving plaintext; variables other edgecache tools read are quiet.
    environ = {
        "EDGECACHE_TLS_CERTIFICATE": "/etc/tls/tls.crt",
        "EDGECACHE_PEER_TLSCA": "/etc/tls/ca.crt",
        "EDGECACHE_TLS_CA": "/etc/tls/ca.crt",
        "EDGECACHE_CONFIG": "/etc/edgecache.yaml",
        "EDGECACHE_CAPACITY": "2GiB",
    }
    with caplog.at_level("WARNING", logger="edgecache.edge.config"):
        config = load_node_config(None, dict(REQUIRED), environ)
    assert config.capacity == 2 << 30 and config.tls_cert is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert (
        "EDGECACHE_TLS_CERTIFICATE" in warned[0] and "did you mean EDGECACHE_TLS_CERT?" in warned[0]
    )
    assert "did you mean EDGECACHE_PEER_TLS_CA?" in warned[1]


def test_kubernetes_service_links_in_a_pod_are_not_warned_of(caplog) -> None:
    """Kubernetes gives every pod variables for the Service named edgecache (service links):
    each node start warned of eight, with hints such as "EDGECACHE_PORT … did you mean
    EDGECACHE_ORIGINS?". Outside a pod the same names are still said."""
    links = {
        "EDGECACHE_SERVICE_HOST": "10.96.0.7",
        "EDGECACHE_SERVICE_PORT": "7070",
        "EDGECACHE_SERVICE_PORT_GRPC": "7070",
        "EDGECACHE_PORT": "tcp://10.96.0.7:7070",
        "EDGECACHE_PORT_7070_TCP": "tcp://10.96.0.7:7070",
        "EDGECACHE_PORT_7070_TCP_PROTO": "tcp",
        "EDGECACHE_PORT_7070_TCP_PORT": "7070",
        "EDGECACHE_PORT_7070_TCP_ADDR": "10.96.0.7",
    }
    pod = {**links, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "EDGECACHE_CAPACTY": "2GiB"}
    with caplog.at_level("WARNING", logger="edgecache.edge.config"):
        load_node_config(None, dict(REQUIRED), pod)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "EDGECACHE_CAPACTY" in warned[0], warned  # a typo still is
    caplog.clear()
    with caplog.at_level("WARNING", logger="edgecache.edge.config"):
        load_node_config(None, dict(REQUIRED), links)
    assert len(caplog.records) == len(links), [r.getMessage() for r in caplog.records]


def test_a_capacity_without_a_unit_below_a_mebibyte_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--capacity 500` was 500 bytes, silently: every shard was then refused."""
    from edgecache.edge.config import NodeConfig

    with caplog.at_level(logging.WARNING, logger="edgecache.edge.config"):
        NodeConfig(**node_fields(tmp_path, capacity="500"))
    assert "capacity 500 is 500 bytes" in caplog.text and "500MiB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgecache.edge.config"):
        NodeConfig(**node_fields(tmp_path, capacity="512KiB"))  # a unit: meant
        NodeConfig(**node_fields(tmp_path, capacity=str(64 << 20)))  # bytes, large enough
    assert "without a unit" not in caplog.text


def test_a_setting_written_twice_in_the_config_file_is_refused(tmp_path: Path) -> None:
    # YAML keeps the last copy without a word: a second capacity: overrode the first.
    path = tmp_path / "node.yaml"
    path.write_text("capacity: 1GiB\nregion: eu\ncapacity: 2GiB\n")
    with pytest.raises(ConfigError) as info:
        load_node_config(path, {}, {})
    said = str(info.value)
    assert f"{path}:3: 'capacity' is set twice (first at line 1)" in said, said
    path.write_text("capacity: 2GiB\nregion: eu\ncache_dir: /c\nregistry: file:///r\n")
    assert load_node_config(path, {}, {}).capacity == 2 << 30  # once each: read as before


@pytest.mark.parametrize(
    ("text", "line", "advice"),
    [
        ("probe_listen: [1,2\n", 2, "check the indentation"),
        ("capacity: 1GiB\n\tregion: eu\n", 2, "indent with spaces, not tabs"),
        ("capacity: !!int 0x\n", None, "a value cannot be read"),
    ],
)
def test_a_settings_file_that_is_not_yaml_is_named_by_line_by_serve_and_healthcheck(
    tmp_path: Path, text: str, line: int | None, advice: str
) -> None:
    # serve and healthcheck gave PyYAML's own text, several lines naming "<unicode
    # string>" and no advice, where the topology's loader gave file:line and what to check.
    settings = tmp_path / "node.yaml"
    settings.write_text(text)
    for command in ("serve", "healthcheck"):
        code, out, err = edgecache(command, "--config", str(settings))
        where = f"{settings}:{line}: not valid YAML" if line else f"{settings}: not valid YAML"
        assert code == 2 and where in err and advice in err, (command, err)
        assert "<unicode string>" not in err and len(err.strip().splitlines()) == 1, err
