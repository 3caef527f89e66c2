"""TLS and tokens as an operator meets them: every wrong setting is refused, and said plainly.

Walks docs/security.md's controls with real certificates, real
``edgecache serve`` processes and real gRPC on loopback: a setting that
would be ignored (a certificate without its key, a client CA without a
certificate) stops the node; a file that cannot be used names its flag and
what to do; a client that cannot get through TLS says why (which CA, which
certificate, which scheme) instead of "not connected".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from edgeutil import publish, write_parquet_shards
from tlsutil import DAY, make_pki

from edgecache.cache.errors import ConfigError
from edgecache.edge.config import NodeConfig, load_node_config
from edgecache.edge.server import running_node

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
    return {
        "region": "eu",
        "cache_dir": tmp_path / "cache",
        "registry": f"file://{tmp_path}/registry",
        "listen": "127.0.0.1:0",
        "sync": False,
        **flags,
    }


def _serve(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``edgecache serve`` with ``args``, expected to refuse to start."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "serve",
            "--region",
            "eu",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--registry",
            f"file://{tmp_path}/registry",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
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
