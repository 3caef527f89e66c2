"""deploy/compose.host.yaml as an operator runs it: images built from deploy/, containers on
the host's loopback, driven from the host with the edgecache CLI and EdgeDataset.

Run by ``make test-deploy`` (skipped in a plain ``pytest``); the tests share one stack and
run in file order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

SHARDS, ROWS = 8, 3000
TOTAL = SHARDS * ROWS
DATASET = "tokens"
GRACE_SECONDS = 10  # EDGECACHE_GRACE_SECONDS in deploy/compose.host.yaml
STOP_TIMEOUT = 30  # its stop_grace_period
MAX_IMAGE_MB = 450  # the node image on the local Debian base measured 402 MB


def cli(stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:  # noqa: ANN001
    """The edgecache CLI of this checkout's venv, pointed at the stack's S3 origin."""
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": stack.s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "COLUMNS": "200",
    }
    exe = Path(sys.executable).with_name("edgecache")
    return stack.run(str(exe), *args, check=check, timeout=300, env=env)


def served_services(stack) -> list[str]:  # noqa: ANN001
    return [*stack.nodes, "s3-origin", *([stack.controller] if stack.controller else [])]


def test_node_image_is_lean(stack) -> None:  # noqa: ANN001
    image = stack.inspect(stack.node_image)
    size_mb = image["Size"] / 1e6
    base = stack.env["EDGECACHE_BASE_IMAGE"]
    stack.report.append(f"image {stack.node_image}: {size_mb:.0f} MB (on {base})")
    origin = stack.inspect("edgecache-s3-origin:5.2.5")["Size"] / 1e6
    stack.report.append(f"image edgecache-s3-origin:5.2.5: {origin:.0f} MB (test origin)")
    assert size_mb < MAX_IMAGE_MB, f"{size_mb:.0f} MB"
    # No torch, no compilers, no installer, no pip cache, no bytecode written at run time.
    probe = (
        "import importlib.util as u, os, shutil;"
        "assert u.find_spec('torch') is None, 'torch';"
        "assert not any(shutil.which(c) for c in ('gcc', 'cc', 'c++', 'pip', 'pip3')), 'tools';"
        "assert not os.path.exists('/root/.cache/pip'), 'pip cache';"
        "import edgecache.edge.server, pyarrow.parquet, zstandard"
    )
    stack.run(
        "docker", "run", "--rm", "--network", "none", "--read-only",
        "--entrypoint", "python3", stack.node_image, "-c", probe,
    )  # fmt: skip


def test_containers_run_as_10001_with_a_read_only_root(stack) -> None:  # noqa: ANN001
    for service in served_services(stack):
        cid = stack.containers[service]
        info = stack.inspect(cid)
        assert info["HostConfig"]["ReadonlyRootfs"] is True, service
        assert info["HostConfig"]["NetworkMode"] == "host", service
        assert "/tmp" in (info["HostConfig"].get("Tmpfs") or {}), service
        ids = stack.run("docker", "exec", cid, "id", "-u").stdout.split()
        assert ids == ["10001"], (service, ids)
        root = stack.run("docker", "exec", cid, "touch", "/opt/probe", check=False)
        assert root.returncode != 0 and "Read-only file system" in root.stderr, (service, root)
        stack.run("docker", "exec", cid, "touch", "/tmp/probe")
    for service in stack.nodes:  # the cache volume is the one writable place a node has
        stack.run("docker", "exec", stack.containers[service], "touch", "/var/cache/edgecache/p")


def test_no_container_gets_an_anonymous_volume(stack) -> None:  # noqa: ANN001
    """Every mount is a named volume of the compose file, a bind or a tmpfs. The images
    declared VOLUMEs, so the controller and s3-setup (which mount nothing there) got
    anonymous volumes: `down` left them behind, two more on every down/up cycle."""
    labels = stack.inspect(stack.containers[next(iter(stack.nodes))])["Config"]["Labels"]
    project = labels["com.docker.compose.project"]
    named = {f"{project}_{v}" for v in stack("config", "--volumes").stdout.split()}
    ids = stack.run(
        "docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"
    ).stdout.split()
    mounts = {}
    for cid in ids:
        info = stack.inspect(cid)
        service = info["Config"]["Labels"]["com.docker.compose.service"]
        mounts[service] = [(m["Type"], m.get("Name"), m["Destination"]) for m in info["Mounts"]]
    assert {"controller", "s3-setup", *stack.nodes} <= set(mounts), mounts
    anonymous = {
        s: [m for m in ms if m[0] == "volume" and m[1] not in named] for s, ms in mounts.items()
    }
    assert not any(anonymous.values()), {s: m for s, m in anonymous.items() if m}
    for service in stack.nodes:  # the cache is on the service's named volume
        assert ("volume", f"{project}_{service}", "/var/cache/edgecache") in mounts[service]
    assert ("volume", f"{project}_s3-origin", "/var/lib/s3-origin") in mounts["s3-origin"]
    for image in (stack.node_image, "edgecache-s3-origin:5.2.5"):
        assert not stack.inspect(image)["Config"].get("Volumes"), image


def test_healthcheck_follows_the_configured_probe_address(stack) -> None:  # noqa: ANN001
    for service, (_, probe_port, _) in stack.nodes.items():
        info = stack.inspect(stack.containers[service])
        health = info["State"]["Health"]
        assert health["Status"] == "healthy", (service, health["Log"][-1:])
        # The image's default is 0.0.0.0:7071; the check asked the port this node was given.
        assert f"127.0.0.1:{probe_port}: SERVING" in health["Log"][-1]["Output"], health["Log"]


def test_publish_plan_warm_and_an_epoch_that_survives_a_killed_node(
    stack,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    import torch
    from edgeutil import write_parquet_shards
    from s3server import upload_dir

    from edgecache.clients import EdgeDataset
    from edgecache.clients.channels import open_channel
    from edgecache.v1 import edge_pb2, edge_pb2_grpc

    config = str(stack.topology)
    write_parquet_shards(tmp_path / "raw", SHARDS, rows=ROWS)
    upload_dir(stack.s3_endpoint, "edgecache", f"raw/{DATASET}", tmp_path / "raw")
    published = json.loads(
        cli(stack, "publish", f"s3://edgecache/raw/{DATASET}", "--dataset", DATASET,
            "--config", config, "--json").stdout
    )  # fmt: skip
    assert published["shards"] == SHARDS, published
    spec = published["version"]
    assert spec == f"{DATASET}@1", published

    start = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: train-eu\n    region: eu-west\n    start: {start}\n"
        f"    datasets: [{spec}]\n"
    )
    plan = json.loads(cli(stack, "plan", str(schedule), "--config", config, "--json").stdout)
    assert plan["infeasible"] == [], plan
    assert [t["version"] for t in plan["regions"]["eu-west"]["tasks"]] == [spec], plan
    cli(stack, "warm", str(schedule), "--config", config)
    cli(stack, "ready", spec, "--region", "eu-west", "--config", config)

    address = {f"127.0.0.1:{ports[0]}": service for service, ports in stack.nodes.items()}
    eu_west = [a for a, s in address.items() if s.startswith("eu-west")]

    def reading_node() -> str:
        served = {}
        for a in eu_west:
            channel = open_channel(a)
            try:
                status = edge_pb2_grpc.EdgeCacheStub(channel).Status(
                    edge_pb2.StatusRequest(), timeout=5
                )
                served[a] = status.bytes_served
            finally:
                channel.close()
        return max(served, key=served.__getitem__)

    ds = EdgeDataset(
        spec,
        endpoints=eu_west,
        batch_size=50,
        window_bytes=24 << 10,
        prefetch_bytes=1,  # read as it goes, so the kill lands mid-epoch
        threads=1,
        retry_timeout=10,
    )
    got: list[int] = []
    killed, restarter = None, None
    for i, batch in enumerate(torch.utils.data.DataLoader(ds, batch_size=None)):
        got.extend(int(x) for x in batch["label"])
        if i == 5:
            killed = address[reading_node()]
            cid = stack.containers[killed]
            before = stack.inspect(cid)["State"]["StartedAt"]
            stack.run("docker", "kill", cid)

            def restart(cid: str = cid, before: str = before) -> None:
                time.sleep(2)  # the restart policy may bring it back itself
                state = stack.inspect(cid)["State"]
                if not state["Running"] or state["StartedAt"] == before:
                    stack.run("docker", "start", cid)

            restarter = threading.Thread(target=restart)
            restarter.start()
    assert restarter is not None and killed is not None
    restarter.join()
    assert len(got) == TOTAL and sorted(got) == list(range(TOTAL)), "not every sample exactly once"
    assert ds.stats()["failovers"] >= 1, ds.stats()
    stack.report.append(f"epoch of {TOTAL} samples: {killed} killed after batch 5, restarted")

    # The restarted node comes back healthy with the shards it had committed (its volume).
    stack.wait_healthy(killed)
    cli(stack, "ready", spec, "--region", "eu-west", "--config", config)
    only = next(a for a, s in address.items() if s == killed)
    again = EdgeDataset(spec, endpoints=[only], batch_size=500, shuffle=False)
    labels = [
        int(x) for b in torch.utils.data.DataLoader(again, batch_size=None) for x in b["label"]
    ]
    assert sorted(labels) == list(range(TOTAL))


def test_the_controller_copies_the_version_into_us_east_from_eu_west(stack) -> None:  # noqa: ANN001
    """deploy/compose/schedule.host.yaml wants tokens@1 in both regions; eu-west holds it
    (the test above warmed it) and us-east's origin link is slow, so the plan's source
    for us-east is eu-west: the controller has us-east copy it from there."""
    import urllib.request

    from edgecache.clients.channels import open_channel
    from edgecache.v1 import edge_pb2, edge_pb2_grpc

    us_east = f"127.0.0.1:{stack.nodes['us-east-1'][0]}"

    def call(method: str, request: object) -> object:
        channel = open_channel(us_east)
        try:
            return getattr(edge_pb2_grpc.EdgeCacheStub(channel), method)(request)
        finally:
            channel.close()

    def held_whole() -> edge_pb2.NodeStatus:
        deadline = time.monotonic() + 120
        while True:
            status = call("Status", edge_pb2.StatusRequest())
            held = {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions}
            if held.get(f"{DATASET}@1") == SHARDS:
                return status
            assert time.monotonic() < deadline, (held, stack.logs())
            time.sleep(1)

    status = held_whole()
    if status.staged_origin_bytes:
        # The controller runs all along: a round while the test above had an eu-west node
        # killed found eu-west without that node's shards and staged us-east from origin
        # (a fair fallback). With eu-west whole again, the plan's source is eu-west: drop
        # us-east's copy and see the controller copy it back from there.
        before = status
        call("Evict", edge_pb2.EvictRequest(dataset=DATASET, version=1))
        status = held_whole()
        peer = status.staged_peer_bytes - before.staged_peer_bytes
        origin = status.staged_origin_bytes - before.staged_origin_bytes
    else:
        peer, origin = status.staged_peer_bytes, 0
    assert peer > 0 and origin == 0, (peer, origin, status)
    pinned = next(v for v in status.versions if v.dataset == DATASET)
    assert pinned.HasField("pinned_until")  # until train-us ends
    with urllib.request.urlopen("http://127.0.0.1:17060/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert "edgecache_controller_leader 1.0" in metrics, metrics
    assert 'edgecache_controller_tasks{state="done"}' in metrics, metrics
    with urllib.request.urlopen("http://127.0.0.1:17060/healthz", timeout=5) as reply:
        assert reply.status == 200
    stack.report.append(
        f"controller: us-east copied {DATASET}@1 from eu-west "
        f"({peer / 1e6:.1f} MB stored bytes, 0 from origin)"
    )


def test_docker_stop_drains_within_the_grace_period(stack) -> None:  # noqa: ANN001
    """SIGTERM with a stream open: the node lets it finish (drains), then exits 0 by itself
    within its grace, well before docker's SIGKILL at the stop timeout (exit 137)."""
    from edgecache.clients.channels import open_channel
    from edgecache.v1 import edge_pb2, edge_pb2_grpc

    service = "us-east-1"
    cid = stack.containers[service]
    channel = open_channel(f"127.0.0.1:{stack.nodes[service][0]}")
    result: dict[str, object] = {}
    try:
        # A read-through of the version the epoch test published, its first chunk read
        # before the stop and the rest read slowly while the node drains.
        stream = edge_pb2_grpc.EdgeCacheStub(channel).ReadShard(
            edge_pb2.ReadShardRequest(dataset=DATASET, version=1, shard=0), timeout=120
        )
        next(stream)

        def finish() -> None:
            time.sleep(1)  # the stop is under way
            try:
                result["chunks"] = 1 + sum(1 for _ in stream)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        reader = threading.Thread(target=finish)
        reader.start()
        started = time.monotonic()
        stack.run("docker", "stop", "-t", str(STOP_TIMEOUT), cid, timeout=STOP_TIMEOUT + 30)
        elapsed = time.monotonic() - started
        reader.join(timeout=60)
    finally:
        channel.close()
    state = stack.inspect(cid)["State"]
    out = stack.run("docker", "logs", "--tail", "20", cid)
    logs = out.stdout + out.stderr
    stack.report.append(
        f"docker stop {service} (a stream open): exit {state['ExitCode']} after {elapsed:.1f} s"
        f" (grace {GRACE_SECONDS} s, stop timeout {STOP_TIMEOUT} s)"
    )
    assert "error" not in result and result.get("chunks"), result  # drained, not cut
    assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, logs)
    assert elapsed < GRACE_SECONDS + 5, (elapsed, logs)
    assert "draining" in logs, logs
    stack.run("docker", "start", cid)
    stack.wait_healthy(service)
