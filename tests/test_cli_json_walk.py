"""The CLI as a script meets it: JSON on stdout alone, errors on stderr, exit codes, UTC times.

Every command runs as a real process (``python -m edgecache.clients.cli``) with
stdout and stderr apart, against a real node on loopback and a file:// origin.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from edgeutil import publish, write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node

ENV = {**os.environ, "COLUMNS": "80"}


def edgecache(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )
    return out.returncode, out.stdout, out.stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalNode]]:
    root = tmp_path_factory.mktemp("json-walk")
    write_parquet_shards(root / "origin", 2, rows=200)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tok")
    node = start_local_node("eu-west", root / "cache", registry, capacity="256MiB")
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu-west:\n    nodes: ['{node.address}']\n"
    )
    yield root, node
    node.stop()


def cfg(root: Path) -> list[str]:
    return ["--config", str(root / "edgecache.yaml")]


def schedule(root: Path, name: str, *jobs: tuple[str, datetime, str]) -> str:
    path = root / f"{name}.yaml"
    path.write_text(
        "jobs:\n"
        + "".join(
            f"  - name: {job}\n    region: eu-west\n    start: {start.isoformat()}\n"
            f"    datasets: [{spec}]\n"
            for job, start, spec in jobs
        )
    )
    return str(path)


def test_at_with_an_offset_is_shown_and_written_in_utc(site) -> None:
    """``--at 09:30+05:00`` is 04:30 UTC: every time plan shows or prints is UTC."""
    root, _ = site
    at = datetime(2027, 1, 5, 4, 30, tzinfo=UTC)
    start = at + timedelta(hours=3)
    path = schedule(root, "tz", ("tz-job", start, "tok@1"))
    local = at.astimezone(timezone(timedelta(hours=5))).isoformat()  # 09:30+05:00
    code, out, err = edgecache("plan", path, "--at", local, "--json", *cfg(root))
    assert code == 0, err
    (task,) = json.loads(out)["regions"]["eu-west"]["tasks"]
    assert datetime.fromisoformat(task["start"]) == at
    assert task["start"].startswith(f"{at:%Y-%m-%dT%H:%M}"), task  # written in UTC
    assert task["finish"].startswith(f"{at:%Y-%m-%dT%H:}"), task
    code, out, err = edgecache("plan", path, "--at", local, "--status", "--json", *cfg(root))
    assert code == 0, err
    (view,) = json.loads(out)
    assert view["planned_ready"].startswith(f"{at:%Y-%m-%dT%H:}"), view
    code, out, err = edgecache("plan", path, "--at", local, *cfg(root))
    assert code == 0 and f"start: {at:%Y-%m-%d %H:%M}" in out, out  # the UTC time, not 09:30


def test_controller_metrics_listen_that_cannot_be_served_is_bad_input_naming_it(site) -> None:
    """Not a traceback and exit 1: one line naming --metrics-listen, exit 2, as serve does."""
    root, _ = site
    path = schedule(root, "metrics", ("m-job", datetime.now(UTC) + timedelta(days=1), "tok@1"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for listen, says in (("nowhere", "HOST:PORT"), (f"127.0.0.1:{port}", "in use")):
            code, out, err = edgecache(
                "controller", "--schedule", path, "--once", "--metrics-listen", listen, *cfg(root)
            )
            assert code == 2, (listen, code, err)
            assert "Traceback" not in err and len(err.splitlines()) == 1, err
            assert err.startswith("error: --metrics-listen") and says in err, err


@pytest.mark.parametrize("command", ["controller", "serve"])
def test_an_unknown_log_level_is_bad_input_naming_it(site, command: str) -> None:
    root, _ = site
    args = (
        ["--schedule", schedule(root, "log", ("l-job", datetime.now(UTC), "tok@1")), *cfg(root)]
        if command == "controller"
        else ["--region", "x", "--cache-dir", str(root / "c"), "--registry", str(root)]
    )
    code, out, err = edgecache(command, *args, "--log-level", "verbose")
    assert code == 2, (code, err)
    assert "Traceback" not in err and "--log-level" in err, err
    assert "DEBUG" in err or "debug" in err, err  # the levels it takes
    code, out, err = edgecache(command, "--help")
    assert "--log-level" in out


def test_nothing_to_say_is_null_in_every_commands_json(site) -> None:
    """An absent error or reason is null, as evict's is: "" is true for jq's select(.error)."""
    root, _ = site
    code, out, err = edgecache("status", "--json", *cfg(root))
    assert code == 0, err
    (node,) = json.loads(out)
    assert node["healthy"] is True and node["error"] is None, node
    path = schedule(root, "quiet", ("q-job", datetime.now(UTC) + timedelta(days=2), "tok@1"))
    code, out, err = edgecache("plan", path, "--status", "--json", *cfg(root))
    assert code == 0, err
    (view,) = json.loads(out)
    assert view["why"] is None, view  # on time: nothing makes it late


def test_controller_once_says_a_job_that_cannot_be_met_and_exits_3_as_plan_does(site) -> None:
    """It exited 0 and said nothing: a cron job running a round saw a clean run."""
    root, _ = site
    path = schedule(root, "typo", ("typo-job", datetime.now(UTC) + timedelta(days=3), "nope@1"))
    code, out, err = edgecache("plan", path, *cfg(root))
    assert code == 3, (out, err)
    code, out, err = edgecache("controller", "--schedule", path, "--once", *cfg(root))
    assert code == 3, (code, out, err)
    assert "cannot be met: typo-job nope@1 in eu-west" in err, err
    assert "cannot be met" not in out, out


def test_demo_json_keep_nodes_prints_one_json_document_while_the_nodes_run(tmp_path) -> None:
    """Its tables and the commands to try were on stdout before the JSON, which came
    only after Ctrl-C: a script could neither parse it nor learn the nodes' addresses.

    Started as a shell starts a background job (SIGINT ignored), SIGINT still stops it:
    Python left SIGINT ignored there and the demo waited forever."""
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "edgecache.clients.cli", "demo", "--size-mib", "1",
             "--shards", "1", "--json", "--keep-nodes", "--workdir", str(tmp_path / "demo")],
            stdout=out, stderr=err, env=ENV, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "Ctrl-C stops the nodes" not in out_path.read_text() + err_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        running = json.loads(out_path.read_text())  # the document, while the nodes run
        assert [n["region"] for n in running["nodes"]] == ["eu-west", "us-east"], running
        assert "edgecache status --config" in err_path.read_text()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.terminate()  # the demo's SIGTERM handler stops its nodes too
                process.wait(timeout=60)
    assert code == 0, err_path.read_text()
    assert json.loads(out_path.read_text()) == running  # and only it


def test_every_commands_json_writes_a_time_in_one_form(site) -> None:
    """status and versions wrote protobuf's ``…Z`` (0-9 digits), plan and warm ``+00:00``:
    a script comparing status's pinned_until with plan's pins[].until as text found them
    different for one instant."""
    root, _ = site
    start = (datetime.now(UTC) + timedelta(days=4)).replace(microsecond=123456)
    path = schedule(root, "same-time", ("pin-job", start, "tok@1"))
    code, out, err = edgecache("plan", path, "--json", *cfg(root))
    assert code == 0, err
    (pin,) = json.loads(out)["regions"]["eu-west"]["pins"]
    code, out, err = edgecache("warm", path, "--json", *cfg(root))
    assert code == 0, err
    (warmed,) = json.loads(out)["pins"]
    code, out, err = edgecache("status", "--json", *cfg(root))
    assert code == 0, err
    (node,) = json.loads(out)
    (held,) = [v for v in node["versions"] if v["version"] == "tok@1"]
    assert held["pinned_until"] == pin["until"] == warmed["until"], (held, pin, warmed)
    assert pin["until"].endswith(".123456+00:00"), pin
    code, out, err = edgecache("versions", "tok", "--json", *cfg(root))
    assert code == 0, err
    created = json.loads(out)[0]["created_at"]
    assert created.endswith("+00:00") and created == datetime.fromisoformat(created).isoformat()
    assert isinstance(json.loads(out)[0]["version"], int)  # scripts depend on it


def test_json_time_is_utc_with_an_offset_and_microseconds_only_when_there_are_some() -> None:
    from google.protobuf.timestamp_pb2 import Timestamp

    from edgecache.clients.cli.render import json_time

    stamp = Timestamp(seconds=1_800_000_000, nanos=500_000_999)  # protobuf's nanoseconds
    assert json_time(stamp.ToDatetime(tzinfo=UTC)) == "2027-01-15T08:00:00.500000+00:00"
    assert json_time(stamp.ToDatetime()) == "2027-01-15T08:00:00.500000+00:00"  # naive: UTC
    plus2 = datetime(2027, 1, 15, 10, 0, tzinfo=timezone(timedelta(hours=2)))
    assert json_time(plus2) == "2027-01-15T08:00:00+00:00"


def test_doctor_writes_milliseconds_as_status_does(site) -> None:
    """doctor's rtt_ms was 0.4412345 where status's is 0.44 for the same node."""
    root, _ = site
    code, out, err = edgecache("status", "--json", *cfg(root))
    assert code == 0, err
    (node,) = json.loads(out)
    assert node["rtt_ms"] == round(node["rtt_ms"], 2), node
    code, out, err = edgecache(
        "doctor", "--json", "--pings", "5", "--seconds", "0.1", "--streams", "1", *cfg(root)
    )
    assert code in (0, 1), err  # a loopback node may still say a host setting is low
    (path,) = json.loads(out)["paths"]
    for key in ("rtt_ms", "jitter_ms"):
        assert isinstance(path[key], float) and path[key] == round(path[key], 2), path
    from edgecache.clients.cli.nodes import _ms_rounded

    figures = {"rtt_ms": 12.3456, "mb_s": 1.23456, "segments_sent": 3, "jitter_ms": None}
    assert _ms_rounded(figures) == {**figures, "rtt_ms": 12.35}  # node paths' too
