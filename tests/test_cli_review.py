"""What a new operator met on the command line: typos that read as a dead node, flags named
twice, a cache directory that cannot be used reported as a node failure, a mistyped
registry that a node served from without a word, and rich turning ``:name:`` into emoji."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from edgeutil import serve_args
from typer.testing import CliRunner

from edgecache.clients.cli import app
from edgecache.edge.config import NodeConfig, load_node_config
from edgecache.edge.server import missing_registry, running_node


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:abc", "127.0.0.1:99999", "h:0"])
def test_healthcheck_refuses_an_address_that_is_not_host_port_as_bad_input(address: str) -> None:
    """Exit 1 with UNAVAILABLE said "the node is down" for a typo; the module said exit 2."""
    result = CliRunner().invoke(app, ["healthcheck", address, "--timeout", "0.5"])
    assert result.exit_code == 2, result.output
    assert "is not HOST:PORT" in result.output and "UNAVAILABLE" not in result.output


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n"])
def test_healthcheck_refuses_a_settings_file_that_is_no_mapping(tmp_path: Path, text: str) -> None:
    """A list or a bare string raised AttributeError, exit 1: a bad file read as a node down."""
    config = tmp_path / "node.yaml"
    config.write_text(text)
    result = CliRunner().invoke(app, ["healthcheck", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "must hold a mapping of settings" in result.output, result.output


def test_cli_output_keeps_colons_as_text_not_emoji() -> None:
    """``127.0.0.1:abc:`` printed as ``127.0.0.1🔤``: rich's emoji codes were on."""
    result = CliRunner().invoke(app, ["healthcheck", "127.0.0.1:smile:", "--timeout", "0.5"])
    assert result.exit_code == 2, result.output
    assert "127.0.0.1:smile:" in result.output and "😄" not in result.output


def test_a_bad_flag_is_named_once(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [*serve_args(tmp_path), "--capacity", "1XB"])
    assert result.exit_code == 2, result.output
    assert "--capacity: invalid size '1XB'" in result.output, result.output
    assert "(--capacity)" not in result.output


def test_a_cache_dir_that_cannot_be_used_is_a_bad_setting(tmp_path: Path) -> None:
    """A file as --cache-dir exited 1 ("the node failed"); serve documents 2 for bad settings."""
    (tmp_path / "cache").write_text("not a directory")
    result = CliRunner().invoke(app, serve_args(tmp_path), env={"EDGECACHE_SYNC": "false"})
    assert result.exit_code == 2, result.output
    assert "--cache-dir" in result.output and "readonly=True" not in result.output


def _config(tmp_path: Path, **more: str) -> NodeConfig:
    """A node of region eu on any port, its cache and registry under ``tmp_path``."""
    fields = {
        "region": "eu",
        "cache_dir": str(tmp_path / "cache"),
        "registry": f"file://{tmp_path}/registry",
        "listen": "127.0.0.1:0",
        "probe_listen": "127.0.0.1:0",
        "sync": False,
        **more,
    }
    return load_node_config(None, fields, {})


def _topology(tmp_path: Path, address: str) -> Path:
    path = tmp_path / "edgecache.yaml"
    path.write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n    nodes: ['{address}']\n"
    )
    return path


def test_a_second_node_on_one_cache_dir_is_told_what_to_do_in_its_own_terms(
    tmp_path: Path,
) -> None:
    """The refusal suggested ``readonly=True``, a Python argument, to a node operator."""
    with running_node(_config(tmp_path)):
        result = CliRunner().invoke(app, serve_args(tmp_path), env={"EDGECACHE_SYNC": "false"})
    assert result.exit_code == 2, result.output
    assert "is the writer of" in result.output and "another --cache-dir" in result.output
    assert "readonly=True" not in result.output


def test_a_node_on_a_registry_that_does_not_exist_says_so_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped --registry started a node that answered every read NOT_FOUND, silently."""
    typo = f"file://{tmp_path}/regsitry"
    with caplog.at_level(logging.WARNING, "edgecache.edge.server"):
        with running_node(_config(tmp_path, registry=typo)):
            pass
    said = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert said and typo in said[0] and "--registry" in said[0], caplog.text
    (tmp_path / "registry").mkdir()
    assert missing_registry(f"file://{tmp_path}/registry") is None
    assert missing_registry(str(tmp_path / "registry")) is None
    assert missing_registry(str(tmp_path / "nope")) is not None
    assert missing_registry("s3://bucket/_edgecache") is None  # not ours to check here


def test_status_without_the_token_says_the_node_refused_it_not_that_it_is_down(
    tmp_path: Path,
) -> None:
    """A serving node that wanted a token was listed "down: UNAUTHENTICATED", exit 1 (retry)."""
    (tmp_path / "admin").write_text("s3cret\n")
    (tmp_path / "read").write_text("r3ad\n")
    (tmp_path / "registry").mkdir()
    admin, read = str(tmp_path / "admin"), str(tmp_path / "read")
    with running_node(_config(tmp_path, token_file=admin, read_token_file=read)) as node:
        topology = _topology(tmp_path, node.address)
        env = {"COLUMNS": "200"}
        result = CliRunner().invoke(app, ["status", "--config", str(topology)], env=env)
        assert result.exit_code == 2, result.output
        assert "down" not in result.output and "refused" in result.output, result.output
        assert "--token-file" in result.output, result.output
        result = CliRunner().invoke(app, ["status", "--config", str(topology), "--json"], env=env)
        assert result.exit_code == 2, result.output
        (row,) = json.loads(result.stdout)
        assert row["healthy"] is True and row["refused"] is True, row
        token = ["--token-file", str(tmp_path / "admin")]
        result = CliRunner().invoke(app, ["status", "--config", str(topology), *token], env=env)
        assert result.exit_code == 0, result.output


def test_plan_against_nodes_that_refuse_the_token_asks_for_the_token(tmp_path: Path) -> None:
    """plan said "region eu is unreachable … check that the node runs", exit 1, for a token."""
    (tmp_path / "read").write_text("r3ad\n")
    (tmp_path / "registry").mkdir()
    (tmp_path / "schedule.yaml").write_text(
        "jobs:\n  - name: j\n    region: eu\n    start: '2099-01-01T00:00:00Z'\n"
        "    duration: 1h\n    datasets: [tokens@1]\n"
    )
    with running_node(_config(tmp_path, read_token_file=str(tmp_path / "read"))) as node:
        topology = _topology(tmp_path, node.address)
        args = ["plan", str(tmp_path / "schedule.yaml"), "--config", str(topology)]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "refused this command's credentials" in result.output, result.output
    assert "--token-file" in result.output and "check that the node runs" not in result.output


def test_nodes_on_picked_ports_with_caches_of_one_name_get_ids_of_their_own(
    tmp_path: Path,
) -> None:
    """``hostname:cache`` for both /a/cache and /b/cache: one name for two nodes in metrics."""
    one, two = _config(tmp_path / "a"), _config(tmp_path / "b")
    assert one.default_node_id() != two.default_node_id()
    assert one.default_node_id().endswith(str(tmp_path / "a" / "cache"))


def _refusing_node_and_a_dead_region(tmp_path: Path) -> tuple[Path, Path]:
    """A schedule for region eu, and a topology whose other region's only node is down."""
    (tmp_path / "read").write_text("r3ad\n")
    (tmp_path / "registry").mkdir()
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "jobs:\n  - name: j\n    region: eu\n    start: '2099-01-01T00:00:00Z'\n"
        "    duration: 1h\n    datasets: [tokens@1]\n"
    )
    return schedule, tmp_path / "edgecache.yaml"


@pytest.mark.parametrize("command", ["plan", "warm"])
def test_a_refused_token_is_bad_input_whatever_a_region_no_job_uses_says(
    tmp_path: Path, command: str
) -> None:
    """warm exited 1 (retry) where plan exited 2 for nodes that refused the token, and plan
    exited 1 too once any node of a region no job used was down: the exit code asked every
    silent node of the topology, where the messages named only the schedule's regions."""
    schedule, topology = _refusing_node_and_a_dead_region(tmp_path)
    with running_node(_config(tmp_path, read_token_file=str(tmp_path / "read"))) as node:
        topology.write_text(
            f"registry: file://{tmp_path}/registry\nregions:\n"
            f"  eu:\n    nodes: ['{node.address}']\n  us:\n    nodes: ['127.0.0.1:1']\n"
        )
        args = [command, str(schedule), "--config", str(topology)]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "refused this command's credentials" in result.output, result.output
    assert "region us is" not in result.output, result.output  # no job there: no error
    if command == "plan":  # nor the plan's "(see below)" for an error that is not printed
        assert "region us: not planned: no node answers (no job" in result.output, result.output


def test_warm_one_version_refused_its_token_is_bad_input_and_a_folder_is_no_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warm NAME@N --region R`` without the admin token exited 1 (retry) where the schedule
    form exits 2; and ``warm tokens`` beside a folder named tokens (the one just published
    from) read the folder as a schedule ("cannot read schedule tokens: Is a directory")."""
    from edgeutil import publish, write_parquet_shards

    write_parquet_shards(tmp_path / "tokens", 1, rows=50)
    publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/tokens", "tokens")
    (tmp_path / "admin").write_text("adm1n\n")
    monkeypatch.chdir(tmp_path)  # ./tokens is a folder here
    with running_node(_config(tmp_path, token_file=str(tmp_path / "admin"))) as node:
        config = ["--config", str(_topology(tmp_path, node.address))]
        refused = CliRunner().invoke(app, ["warm", "tokens@1", "--region", "eu", *config])
        assert refused.exit_code == 2, refused.output
        assert "UNAUTHENTICATED" in refused.output, refused.output
        token = ["--token-file", str(tmp_path / "admin")]
        dry = CliRunner().invoke(
            app, ["warm", "tokens", "--region", "eu", "--dry-run", *config, *token]
        )
        assert dry.exit_code == 0, dry.output
        assert "tokens@1" in dry.output and "schedule" not in dry.output, dry.output


def test_ready_without_the_token_is_bad_input_at_once_not_a_wait(tmp_path: Path) -> None:
    """ready called a node refusing its token "unreachable", exit 1, and --wait polled it
    to the timeout (an hour by default): a credentials error no wait mends."""
    from edgeutil import publish, write_parquet_shards

    (tmp_path / "read").write_text("r3ad\n")
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/origin", "tokens")
    with running_node(_config(tmp_path, read_token_file=str(tmp_path / "read"))) as node:
        topology = _topology(tmp_path, node.address)
        for wait in ([], ["--wait", "--timeout", "60"]):
            began = time.monotonic()
            args = ["ready", "tokens@1", "--region", "eu", "--config", str(topology), *wait]
            result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
            said = " ".join(result.output.split())
            assert result.exit_code == 2, result.output
            assert "refused this command's credentials" in said and "unreachable" not in said
            assert time.monotonic() - began < 20, wait  # not the wait's 60 s
        # With a node of the region down beside it: a failure, as status exits (it said 2).
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))  # bound, not listening: nothing answers there
            topology.write_text(
                f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n"
                f"    nodes: ['{node.address}', '127.0.0.1:{dead.getsockname()[1]}']\n"
            )
            for command in (["ready", "tokens@1", "--region", "eu"], ["status"]):
                result = CliRunner().invoke(
                    app, [*command, "--config", str(topology)], env={"COLUMNS": "200"}
                )
                assert result.exit_code == 1, (command, result.output)


def test_debug_logs_mask_the_credentials_botocore_prints() -> None:
    """At DEBUG a node logged botocore's request headers: a pod role's session token and the
    access key id went to log collection."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "from edgecache.clients.cli.context import LogLevel, configure_logging\n"
        "configure_logging(LogLevel.DEBUG)\n"
        "log = logging.getLogger('botocore.endpoint')\n"
        "log.debug('headers=%s', {'X-Amz-Security-Token': b'SESSION-SECRET', 'Authorization':"
        " b'AWS4-HMAC-SHA256 Credential=AKIADEBUGKEYID000001/20261205/us-east-1/s3'})\n"
        "log.debug('https://b/x?X-Amz-Security-Token=QUERY-SECRET&X-Amz-Date=1')\n"
        "logging.getLogger('edgecache.clients.controller').warning("
        "'cannot read https://ops:URL-SECRET@reg.example:8443/reg: HTTP 503')\n"
        "try:\n"
        "    raise RuntimeError('registry https://ops:TRACE-SECRET@reg.example/reg failed')\n"
        "except RuntimeError:\n"
        "    logging.getLogger('edgecache').exception('staging failed')\n"
        "logging.getLogger('edgecache').warning('https://ops:p@ss-AT-SECRET@reg.example/x')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SESSION-SECRET" not in out.stderr and "QUERY-SECRET" not in out.stderr, out.stderr
    assert "AKIADEBUGKEYID000001" not in out.stderr, out.stderr
    assert "X-Amz-Security-Token': b'***'" in out.stderr, out.stderr  # said, masked
    # A URL's password, in any line at any level (a registry the controller cannot read).
    assert "URL-SECRET" not in out.stderr, out.stderr
    # In a traceback too (log.exception), and a password holding an unencoded "@".
    assert "TRACE-SECRET" not in out.stderr and "AT-SECRET" not in out.stderr, out.stderr
    assert "RuntimeError: registry https://ops:***@reg.example/reg failed" in out.stderr
    assert "https://ops:***@reg.example:8443/reg" in out.stderr, out.stderr


def test_a_dry_run_with_the_read_token_fails_its_pins_as_the_real_run(tmp_path: Path) -> None:
    """warm --dry-run with a read token said it would pin and exited 0; the real run's
    pins were refused (PERMISSION_DENIED) and it exited 2 (a helper's hunt)."""
    from datetime import UTC, datetime, timedelta

    from edgeutil import publish, write_parquet_shards

    (tmp_path / "admin").write_text("s3cret\n")
    (tmp_path / "read").write_text("r3ad\n")
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(f"file://{tmp_path}/registry", f"file://{tmp_path}/origin", "tokens")
    start = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: train\n    region: eu\n    start: '{start}'\n    duration: 1h\n"
        "    datasets: [tokens@1]\n"
    )
    admin, read = str(tmp_path / "admin"), str(tmp_path / "read")
    with running_node(_config(tmp_path, token_file=admin, read_token_file=read)) as node:
        config = ["--config", str(_topology(tmp_path, node.address))]
        said = {}
        for dry in (["--dry-run"], []):
            args = ["warm", str(schedule), *config, "--token-file", read, *dry]
            result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
            said[bool(dry)] = (result.exit_code, " ".join(result.output.split()))
        pinned = CliRunner().invoke(
            app, ["warm", str(schedule), *config, "--token-file", admin, "--dry-run"]
        )
        # Once pinned (with the admin token), the real run asks for no pin: nor does the
        # rehearsal, and the read token then passes both (the first probe asked anyway).
        assert (
            CliRunner()
            .invoke(app, ["warm", str(schedule), *config, "--token-file", admin])
            .exit_code
            == 0
        )
        again = {}
        for dry in (["--dry-run"], []):
            args = ["warm", str(schedule), *config, "--token-file", read, *dry]
            again[bool(dry)] = CliRunner().invoke(app, args, env={"COLUMNS": "200"}).exit_code
    assert again == {True: 0, False: 0}, again
    assert said[True][0] == said[False][0] == 2, said
    assert "pin would fail:" in said[True][1] and "PERMISSION_DENIED" in said[True][1], said
    assert pinned.exit_code == 0, pinned.output  # the admin token: nothing refused
