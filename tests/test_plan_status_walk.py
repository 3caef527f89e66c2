"""plan --status as an operator reads it when a region goes quiet: no ready time it does not have.

A real node on loopback and a file:// origin; the controller's record is
written by a real ``controller --once``; then the node is stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import publish, write_parquet_shards

from edgecache.clients.node_client import start_local_node

ENV = {**os.environ, "COLUMNS": "80"}


def edgecache(root: Path, *args: str) -> tuple[int, str, str]:
    config = ["--config", str(root / "edgecache.yaml")]
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args, *config],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    return out.returncode, out.stdout, out.stderr


def test_a_job_seen_ready_whose_region_does_not_answer_has_no_ready_time(tmp_path: Path) -> None:
    """With eu-west down, the job read "ready" at the controller's old time (equal to its
    planned ready) while its state was infeasible and it showed "tok@1: 0/3 shards"."""
    write_parquet_shards(tmp_path / "origin", 3, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tok")
    node = start_local_node("eu-west", tmp_path / "cache", registry, capacity="256MiB")
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu-west:\n    nodes: ['{node.address}']\n"
    )
    start = datetime.now(UTC) + timedelta(days=1)
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: j\n    region: eu-west\n    start: {start.isoformat()}\n"
        "    datasets: [tok@1]\n"
    )
    try:
        assert edgecache(tmp_path, "warm", str(schedule))[0] == 0
        code, out, err = edgecache(tmp_path, "controller", "--schedule", str(schedule), "--once")
        assert code == 0, err
        code, out, err = edgecache(tmp_path, "plan", str(schedule), "--status", "--json")
        assert code == 0, err
        (view,) = json.loads(out)
        assert view["state"] == "ready" and view["ready_at"] is not None, view  # seen ready
    finally:
        node.stop()
    code, out, err = edgecache(tmp_path, "plan", str(schedule), "--status", "--json")
    assert code == 1, (out, err)  # the outage, as every planning command says it
    (view,) = json.loads(out)
    assert view["state"] == "infeasible", view
    assert view["ready_at"] is None and view["planned_ready"] is None, view
    assert view["missing"] == ["tok@1: not seen, no node of eu-west answers"], view
    assert view["why"].startswith("cannot be met: tok@1: region eu-west is unreachable"), view
    code, out, err = edgecache(tmp_path, "plan", str(schedule), "--status")
    assert code == 1, (out, err)
    assert "ready: —" in out and "planned ready: —" in out, out  # the text says the same
    assert "not seen, no node of eu-west answers" in out and "unreachable" in out, out


def test_a_version_the_registry_lacks_is_missing_with_the_registrys_own_reason(
    tmp_path: Path,
) -> None:
    """The missing line said only "tokens-fr: not in the registry", and the why named the
    spec twice; plan says where it looked and what the registry holds."""
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens-en")
    node = start_local_node("eu-west", tmp_path / "cache", registry, capacity="256MiB")
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n  eu-west:\n    nodes: ['{node.address}']\n"
    )
    start = datetime.now(UTC) + timedelta(days=1)
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: typo\n    region: eu-west\n    start: {start.isoformat()}\n"
        "    datasets: [tokens-fr]\n"
    )
    reason = (
        f"tokens-fr: dataset 'tokens-fr' has no versions in {registry}, which holds "
        "tokens-en; check the name, or publish it (edgecache publish)"
    )
    try:
        code, out, err = edgecache(tmp_path, "plan", str(schedule), "--status", "--json")
        assert code == 3, (out, err)  # cannot be met, as plan says
        (view,) = json.loads(out)
        assert view["state"] == "infeasible", view
        assert view["missing"] == [reason], view
        assert view["why"] == "cannot be met: tokens-fr is not in the registry", view
        code, out, err = edgecache(tmp_path, "plan", str(schedule), "--status")
        assert code == 3, (out, err)
        said = " ".join(out.split())
        assert reason in said and "tokens-fr: not in the registry" not in said, out
        assert "tokens-fr: tokens-fr" not in said, out
    finally:
        node.stop()
