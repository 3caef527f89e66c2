"""Defects users met in the CLI (stop 43): each test fails without its fix.

Real nodes on loopback, a real S3 endpoint (moto's server) where S3 is involved,
the CLI in a subprocess where its process-wide settings (logging) matter.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from edgeutil import edgecache, guarded_node, publish, write_parquet_shards
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
    node = guarded_node(tmp_path, "eu", registry)
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
        # status without a token: refused, exit 2, the advice said once (it was said twice).
        code, out, err = edgecache("status", "--config", str(topology))
        assert code == 2 and "refused this command's credentials" in err, (out, err)
        assert " ".join(err.split()).count("--token-file") == 1, err
        admin = ["--config", str(topology), "--token-file", str(tmp_path / "admin.token")]
        code, out, err = edgecache("evict", "t@1", "--force", *admin)
        assert code == 0, (out, err)
        # controller --once with the read token: its Pin refused, exit 2 as the others (1).
        start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            f"jobs:\n  - name: j\n    region: eu\n    start: '{start}'\n    datasets: [t@1]\n"
        )
        code, out, err = edgecache("controller", "--schedule", str(schedule), "--once", *config)
        assert code == 2 and "PERMISSION_DENIED" in err, (out, err)
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


def _problems(path: Path, load: str) -> list[str]:
    """The lines of the ConfigFileError that loading ``path`` raises, one per problem."""
    import pytest

    from edgecache.cache.errors import ConfigFileError
    from edgecache.clients import topology

    with pytest.raises(ConfigFileError) as caught:
        if load == "topology":
            topology.load_topology(path)
        else:
            topology.load_schedule(path, topology.load_topology(path.parent / "edgecache.yaml"))
    return [line.strip() for line in str(caught.value).splitlines()]


def test_every_bad_address_and_spec_and_a_repeated_key_are_said_with_the_rest(
    tmp_path: Path,
) -> None:
    """A list's first bad entry hid the others, and a key written twice hid every other
    problem of the file; docs/operations.md says every problem is reported in one run."""
    (tmp_path / "edgecache.yaml").write_text(
        "registry: /tmp/r\nregions:\n"
        "  eu: {nodes: ['a:1', '127.0.0.1:99999', nohost]}\n"
        "  us: {nodes: ['b:1']}\n"
        "  us: {nodes: ['c:1'], peers: {mars: 1Gbit/s}}\n"
    )
    problems = _problems(tmp_path / "edgecache.yaml", "topology")
    assert len(problems) == 4, problems
    assert "edgecache.yaml:3: regions.eu.nodes.1: '127.0.0.1:99999'" in problems[0], problems
    assert "edgecache.yaml:3: regions.eu.nodes.2: 'nohost'" in problems[1], problems
    line5 = " ".join(problems[2:])  # both at line 5
    assert "edgecache.yaml:5: key 'us' appears twice in one mapping (first at line 4)" in line5
    assert "edgecache.yaml:5: regions.us.peers.mars: peer 'mars'" in line5, problems
    (tmp_path / "edgecache.yaml").write_text("registry: /tmp/r\nregions:\n  eu: {nodes: ['a:1']}\n")
    (tmp_path / "schedule.yaml").write_text(
        "jobs:\n  - name: a\n    region: eu\n    start: 2026-12-06T08:00:00Z\n"
        "    start: 2026-12-06T09:00:00Z\n    datasets: [t@0, 't@-1']\n    duration: 6\n"
    )
    problems = _problems(tmp_path / "schedule.yaml", "schedule")
    assert [p.split(": ")[0].rsplit(":", 1)[1] for p in problems] == ["5", "6", "6", "7"], problems
    assert "key 'start' appears twice" in problems[0], problems
    line6 = " ".join(problems[1:3])
    assert "jobs.0.datasets.0: invalid version in 't@0'" in line6, problems
    assert "jobs.0.datasets.1: invalid version in 't@-1'" in line6, problems
    assert "jobs.0.duration: 6 has no unit" in problems[3], problems


def test_publish_to_an_s3_registry_nobody_answers_names_the_registry(tmp_path: Path) -> None:
    """It said "origin for s3://…/versions/ is unreachable" of the registry: the registry
    it was given is what did not answer, and --registry the setting that names it."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_parquet_shards(tmp_path / "raw", 1, rows=10)
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "COLUMNS": "200",
    }
    args = ["publish", str(tmp_path / "raw"), "--dataset", "a", "--registry", "s3://b/_ec"]
    done = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: cannot reach registry s3://b/_ec: "), done.stderr
    assert "check --registry (or registry: in the topology file), AWS_ENDPOINT_URL" in " ".join(
        done.stderr.split()
    ), done.stderr


def test_an_evict_refusal_gives_each_nodes_own_pin_end(tmp_path: Path) -> None:
    """Two nodes of a region pinned a version to different times; the refusal said one time
    for both (the later), and the other node's pin ended hours sooner."""
    import pytest
    from edgeutil import stub

    from edgecache.cache.errors import VersionPinned
    from edgecache.clients import ops
    from edgecache.clients.topology import load_topology
    from edgecache.v1 import edge_pb2

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "t")
    nodes = [start_local_node("eu", tmp_path / f"cache-{i}", registry) for i in range(2)]
    try:
        soon = (datetime.now(UTC) + timedelta(hours=2)).replace(second=0, microsecond=0)
        for node, until in zip(nodes, (soon, soon + timedelta(hours=5)), strict=True):
            request = edge_pb2.PinRequest(dataset="t", version=1)
            request.until.FromDatetime(until.replace(tzinfo=None))
            stub(node.address).Pin(request)
        topology = tmp_path / "edgecache.yaml"
        addresses = ", ".join(f"'{n.address}'" for n in nodes)
        topology.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: [{addresses}]\n")
        with pytest.raises(VersionPinned) as caught:
            ops.evict(load_topology(topology), "t@1")
        said = str(caught.value)
        assert f"on {nodes[0].address} until {soon:%Y-%m-%d %H:%M} UTC; " in said, said
        later = soon + timedelta(hours=5)
        assert f"on {nodes[1].address} until {later:%Y-%m-%d %H:%M} UTC" in said, said
    finally:
        for node in nodes:
            node.stop()


def test_a_shard_larger_than_each_nodes_cache_is_not_planned_as_fitting_their_sum(
    tmp_path: Path,
) -> None:
    """Replicas split a version's shards and each keeps its share: a 1.3 MiB shard in a
    region of two 1 MiB nodes fits their sum, never a node. plan and warm's dry run said it
    would be staged; every warm then failed RESOURCE_EXHAUSTED on the node."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=20000)  # one shard
    publish(registry, f"file://{tmp_path}/origin", "t")
    # Nothing held anywhere: the plan sizes it by its source bytes. Each node gets 70 % of
    # that: the pair holds 140 %, a node never the whole shard.
    source = sum(f.stat().st_size for f in (tmp_path / "origin").rglob("*") if f.is_file())
    capacity = str(int(source * 0.7))
    nodes = [
        start_local_node("eu", tmp_path / f"cache-{i}", registry, capacity=capacity)
        for i in range(2)
    ]
    try:
        topology = tmp_path / "edgecache.yaml"
        addresses = ", ".join(f"'{n.address}'" for n in nodes)
        topology.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: [{addresses}]\n")
        start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        schedule = tmp_path / "schedule.yaml"
        schedule.write_text(
            f"jobs:\n  - name: j\n    region: eu\n    start: '{start}'\n    datasets: [t@1]\n"
        )
        config = ["--config", str(topology)]
        code, out, err = edgecache("plan", str(schedule), *config)
        said = " ".join((out + err).split())
        assert code == 3 and "share of t@1 (1 of 1 shards," in said, (out, err)
        assert "is more than its cache holds" in said and "add at least" not in said, said
        code, out, err = edgecache("warm", "t@1", "--region", "eu", "--dry-run", *config)
        assert code == 2 and "t@1 cannot be held in region eu:" in " ".join(err.split()), err
    finally:
        for node in nodes:
            node.stop()
