"""Defects users met in the CLI (stop 43): each test fails without its fix.

Real nodes on loopback, a real S3 endpoint (moto's server) where S3 is involved,
the CLI in a subprocess where its process-wide settings (logging) matter.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, publish, write_parquet_shards
from typer.testing import CliRunner

from edgecache.clients.cli.app import app
from edgecache.clients.node_client import start_local_node

runner = CliRunner()


def test_a_controller_at_info_does_not_log_the_s3_librarys_credential_lookup(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """Every round logged aiobotocore's "Found credentials in environment variables" and
    botocore's "Found endpoint for s3 via: environment_global" at INFO: thousands of lines
    a day saying nothing new. Its own INFO lines stay; --log-level debug shows the others."""
    from s3server import make_bucket, upload_dir

    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 1, rows=100)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"s3://{bucket}/_edgecache"
    published = runner.invoke(
        app, ["publish", f"s3://{bucket}/raw", "--dataset", "t", "--registry", registry]
    )
    assert published.exit_code == 0, published.output
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            f"jobs:\n  - name: j\n    region: eu\n    start: '{start}'\n    datasets: [t@1]\n"
        )
        args = ["controller", "--schedule", str(schedule), "--config", str(topology), "--once"]
        code, out, err = edgecache(*args, "--log-level", "info")
        assert code == 0, err
        assert "edgecache.clients.controller" in err, err  # its own INFO lines are there
        assert "Found credentials" not in err and "botocore" not in err, err
    finally:
        node.stop()


def test_evict_with_a_token_the_nodes_refuse_exits_2_as_status_and_warm_do(
    tmp_path: Path,
) -> None:
    """A read token on Evict (an admin call) exited 1, "a node failed: retrying may help";
    status, plan and warm exit 2 for credentials the nodes refuse."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "t")
    (tmp_path / "admin.token").write_text("admin-secret\n")
    (tmp_path / "read.token").write_text("read-secret\n")
    node = start_local_node(
        "eu",
        tmp_path / "cache",
        registry,
        extra_args=[
            "--token-file",
            str(tmp_path / "admin.token"),
            "--read-token-file",
            str(tmp_path / "read.token"),
        ],
    )
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        config = ["--config", str(topology), "--token-file", str(tmp_path / "read.token")]
        code, out, err = edgecache("evict", "t@1", "--force", *config)
        assert code == 2, (out, err)
        assert "PERMISSION_DENIED" in err, err
        code, out, err = edgecache("evict", "t@1", "--force", "--json", *config)
        assert code == 2 and json.loads(out)[0]["refused"] is True, (out, err)
        admin = ["--config", str(topology), "--token-file", str(tmp_path / "admin.token")]
        code, out, err = edgecache("evict", "t@1", "--force", *admin)
        assert code == 0, (out, err)
    finally:
        node.stop()


def test_warm_one_version_sizes_it_by_what_another_region_holds_as_plan_does(
    tmp_path: Path,
) -> None:
    """A version too large for a region: plan sized it by the stored bytes another region
    holds whole, ``warm NAME@N --region`` by an estimate from the region's own nodes alone
    (the source bytes when they held nothing), and each asked for another capacity."""
    from edgeutil import stub

    from edgecache.v1 import edge_pb2

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 3, rows=20000)
    publish(registry, f"file://{tmp_path}/origin", "t")
    eu = start_local_node("eu", tmp_path / "cache-eu", registry)
    us = start_local_node("us", tmp_path / "cache-us", registry, capacity="1MiB")
    try:
        list(stub(eu.address).Stage(edge_pb2.StageRequest(dataset="t", version=1)))
        (held,) = stub(eu.address).Status(edge_pb2.StatusRequest()).versions
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{eu.address}']\n"
            f"  us:\n    nodes: ['{us.address}']\n    peers: {{eu: 1Gbit/s}}\n"
        )
        from edgecache.cache.units import format_bytes

        stored = format_bytes(held.stored_bytes)
        code, out, err = edgecache("warm", "t@1", "--region", "us", "--config", str(topology))
        assert code == 2, (out, err)
        assert f"t@1 ({stored} once stored) is larger than region us's" in err, err
        start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            f"jobs:\n  - name: j\n    region: us\n    start: '{start}'\n    datasets: [t@1]\n"
        )
        code, out, err = edgecache("plan", str(schedule), "--config", str(topology))
        assert code == 3 and f"t@1 ({stored} once stored)" in out + err, (out, err)
    finally:
        eu.stop()
        us.stop()


def test_warm_names_a_job_that_has_ended_as_plan_does(tmp_path: Path) -> None:
    """A start a year off (the usual typo): plan warned, warm said "0 of 0 item(s) staged"
    and exited 0 without a word about the job."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "t")
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        start = (datetime.now(UTC) - timedelta(days=365)).replace(microsecond=0)
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            f"jobs:\n  - name: old\n    region: eu\n    start: '{start.isoformat()}'\n"
            "    datasets: [t@1]\n"
        )
        for command in ("plan", "warm"):
            code, out, err = edgecache(command, str(schedule), "--config", str(topology))
            assert code == 0, (command, out, err)
            assert "old ended at" in err and "check its start" in err, (command, err)
    finally:
        node.stop()
