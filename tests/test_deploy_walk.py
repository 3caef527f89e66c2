"""deploy/ walked as an operator runs it: what deploy/README.md says to do, and what an
operator would trip on. The S3 origin's persistence runs here in any ``pytest`` (moto from
the dev extra, outside a container); the restart of the whole compose stack needs a Docker
engine and runs under ``make test-deploy`` (skipped otherwise, as tests/deploy/ is)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from edgecache.cache.rendezvous import owned_shards

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ORIGIN_SCRIPT = DEPLOY / "compose" / "s3-origin.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_origin(port: int, state: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(ORIGIN_SCRIPT), "-p", str(port), "--state-dir", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "s3-origin did not listen"
        time.sleep(0.1)


def s3(port: int):  # noqa: ANN201
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def assert_kept(port: int, state: Path, key: str) -> None:
    """A restarted origin on ``state`` lists ``key``: the save before the kill held it."""
    proc = start_origin(port, state)
    try:
        keys = {o["Key"] for o in s3(port).list_objects_v2(Bucket="edgecache")["Contents"]}
        assert key in keys, keys
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_the_s3_origin_keeps_its_objects_across_a_restart(tmp_path: Path) -> None:
    """The compose stack's origin holds the registry; the nodes' caches survive a restart
    on their volumes, so the registry must too. moto alone forgot every object: a restarted
    stack had caches holding tokens@1 and a registry without it, and the next publish made
    a different tokens@1 (3 shards in the registry, 4 other shards served from the caches)."""
    port, state = free_port(), tmp_path / "state"
    proc = start_origin(port, state)
    try:
        client = s3(port)
        client.create_bucket(Bucket="edgecache")
        client.put_object(Bucket="edgecache", Key="_edgecache/tokens/versions/1.json", Body=b"{}")
        upload = client.create_multipart_upload(Bucket="edgecache", Key="raw/big")
        parts = [
            client.upload_part(
                Bucket="edgecache",
                Key="raw/big",
                UploadId=upload["UploadId"],
                PartNumber=n,
                Body=body,
            )["ETag"]
            for n, body in ((1, b"a" * (5 << 20)), (2, b"b" * 10))
        ]
        client.complete_multipart_upload(
            Bucket="edgecache",
            Key="raw/big",
            UploadId=upload["UploadId"],
            MultipartUpload={
                "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(parts)]
            },
        )
        before = {
            o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket="edgecache")["Contents"]
        }
        assert before["raw/big"].endswith('-2"'), before  # manifests record this ETag
    finally:
        proc.send_signal(signal.SIGTERM)  # docker stop
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out

    proc = start_origin(port, state)
    try:
        client = s3(port)
        after = {
            o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket="edgecache")["Contents"]
        }
        assert after == before
        body = client.get_object(Bucket="edgecache", Key="raw/big")["Body"].read()
        assert body == b"a" * (5 << 20) + b"b" * 10
        # A write is on disk soon after, without a clean stop (docker kill). Nothing was
        # written since the restart, so the first save after the put holds it: wait for
        # that save (a new state file) rather than a fixed time a loaded machine can
        # overrun. An origin that never saves fails here; one whose save lacks the key
        # fails in assert_kept.
        saved = state / "s3.pickle"
        before = (saved.stat().st_ino, saved.stat().st_mtime_ns)
        client.put_object(Bucket="edgecache", Key="_edgecache/tokens/versions/2.json", Body=b"{}")
        deadline = time.monotonic() + 10
        while (saved.stat().st_ino, saved.stat().st_mtime_ns) == before:
            assert time.monotonic() < deadline, "the write was not saved within 10 s"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert_kept(port, state, "_edgecache/tokens/versions/2.json")


def test_the_s3_origin_refuses_a_state_it_cannot_load(tmp_path: Path) -> None:
    """Starting empty beside full caches is the inconsistency the state file prevents."""
    (tmp_path / "s3.pickle").write_bytes(b"not a pickle")
    out = subprocess.run(
        [sys.executable, str(ORIGIN_SCRIPT), "-p", str(free_port()), "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "cannot load" in out.stderr, out  # exit 2, as documented


def test_the_s3_origin_retries_a_save_that_failed(tmp_path: Path) -> None:
    """A save that fails (a full or unwritable volume) is logged and retried. It ended the
    saver thread: the origin went on acknowledging writes that were never saved, and a kill
    lost them though the volume had room again."""
    port, state = free_port(), tmp_path / "state"
    (state / "s3.tmp").mkdir(parents=True)  # the temporary file cannot be written: saves fail
    proc = start_origin(port, state)
    try:
        client = s3(port)
        client.create_bucket(Bucket="edgecache")
        client.put_object(Bucket="edgecache", Key="_edgecache/tokens/versions/1.json", Body=b"{}")
        # Unhealthy once the saver has tried and failed (the compose healthcheck's URL):
        # it acknowledges writes a kill would lose. It answered healthy before, though
        # saves failed. Polled: on a loaded machine the first try can come late.
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_health", timeout=5)
            except urllib.error.HTTPError as unhealthy:
                assert unhealthy.code == 503
                assert "cannot save to" in unhealthy.read().decode()
                break
            assert time.monotonic() < deadline, "still healthy 10 s after a failed save"
            time.sleep(0.1)
        assert not (state / "s3.pickle").exists()
        (state / "s3.tmp").rmdir()  # room again
        deadline = time.monotonic() + 10
        while not (state / "s3.pickle").exists():
            assert time.monotonic() < deadline, "the failed save was never tried again"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while True:  # healthy again once a save went through
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_health", timeout=5)
                break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline, "still unhealthy after a save succeeded"
                time.sleep(0.1)
    finally:
        proc.kill()  # docker kill: no save at stop
        out = proc.communicate(timeout=30)[0]
    assert "cannot save" in out, out
    assert_kept(port, state, "_edgecache/tokens/versions/1.json")


def test_the_host_compose_keeps_the_registry_on_a_volume() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.host.yaml").read_text())
    origin = compose["services"]["s3-origin"]
    dockerfile = (DEPLOY / "compose" / "s3-origin.Dockerfile").read_text()
    entry = json.loads(dockerfile.split("\nENTRYPOINT ", 1)[1].splitlines()[0])
    assert entry[:2] == ["python3", "/opt/moto/s3-origin.py"], entry
    assert "COPY s3-origin.py /opt/moto/s3-origin.py" in dockerfile
    # No VOLUME: it gave compose's s3-setup (same image, nothing mounted) an anonymous volume
    # that every `down` left behind. The named volume below is where the objects live.
    assert not re.search(r"^VOLUME\b", dockerfile, re.M), dockerfile
    assert "chown 10001:10001 /var/lib/s3-origin" in dockerfile  # a fresh volume is writable
    assert "s3-origin:/var/lib/s3-origin" in origin["volumes"]
    assert "s3-origin" in compose["volumes"]


# --------------------------------------------------------------------- on Docker

deploy_only = pytest.mark.skipif(
    os.environ.get("EDGECACHE_DEPLOY_TESTS") != "1",
    reason="containers on a real Docker engine: run `make test-deploy`",
)
PROJECT = "edgecache-walk"
TOPOLOGY = DEPLOY / "compose" / "edgecache.host.yaml"
S3 = "http://127.0.0.1:17000"


def compose(*args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    base = ["docker", "compose"]
    if subprocess.run([*base, "version"], capture_output=True).returncode != 0:
        base = ["docker-compose"]
    env = {
        **os.environ,
        "EDGECACHE_BASE_IMAGE": os.environ.get("EDGECACHE_BASE_IMAGE", "edgecache-base:bookworm"),
    }
    out = subprocess.run(
        [*base, "-f", str(DEPLOY / "compose.host.yaml"), "-p", PROJECT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert not check or out.returncode == 0, (args, out.stdout, out.stderr)
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": S3,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "COLUMNS": "200",
    }
    exe = Path(sys.executable).with_name("edgecache")
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out


def wait_healthy(timeout: float = 180) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        ids = compose("ps", "-q").stdout.split()
        states = {}
        for cid in ids:
            info = json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True,
                                             text=True).stdout)[0]  # fmt: skip
            name = info["Config"]["Labels"]["com.docker.compose.service"]
            health = (info["State"].get("Health") or {}).get("Status")
            if name != "s3-setup":
                states[name] = "healthy" if info["State"]["Running"] and health in (
                    None, "healthy") else str(health)  # fmt: skip
        if len(states) == 5 and set(states.values()) == {"healthy"}:
            return states
        assert time.monotonic() < deadline, (states, compose("logs", "--tail", "30").stdout)
        time.sleep(1)


def volumes() -> set[str]:
    """Every volume on the engine, by name (an anonymous one's name is a random id)."""
    out = subprocess.run(["docker", "volume", "ls", "-q"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def mounted_volumes() -> set[str]:
    """The volumes this project's containers (running or not) mount: another stack may share
    the engine, so what `down` leaves is judged among these, not by the engine's count."""
    ids = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    if not ids:
        return set()
    infos = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True,
                                      text=True).stdout)  # fmt: skip
    return {m["Name"] for info in infos for m in info["Mounts"] if m["Type"] == "volume"}


def read_all(spec: str, region: str) -> list[int]:
    import torch

    from edgecache.clients import EdgeDataset

    ds = EdgeDataset(spec, config=str(TOPOLOGY), region=region, batch_size=500, shuffle=False)
    return [int(x) for b in torch.utils.data.DataLoader(ds, batch_size=None) for x in b["label"]]


@deploy_only
@pytest.mark.timeout(1200)
def test_the_whole_stack_restarts_with_its_caches_and_registry_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/README.md's host-network walk: up, publish, warm, read; `down` and `up` the whole
    stack; the caches and the registry come back together (the same tokens@1, digest and
    rows), and every container stops by itself on SIGTERM (exit 0), before docker's kill."""
    from edgeutil import write_parquet_shards
    from s3server import upload_dir

    for key, value in {"AWS_ENDPOINT_URL": S3, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    compose("down", "-v", "--remove-orphans", check=False)
    named = {f"{PROJECT}_{v}" for v in yaml.safe_load(
        (DEPLOY / "compose.host.yaml").read_text())["volumes"]}  # fmt: skip
    try:
        compose("build")
        compose("up", "-d")
        wait_healthy()
        write_parquet_shards(tmp_path / "raw", 4, rows=2000)
        upload_dir(S3, "edgecache", "raw/tokens", tmp_path / "raw")
        config = str(TOPOLOGY)
        first = json.loads(cli("publish", "s3://edgecache/raw/tokens", "--dataset", "tokens",
                               "--config", config, "--json").stdout)  # fmt: skip
        assert first["version"] == "tokens@1"
        cli("warm", "tokens@1", "--region", "eu-west", "--config", config)
        assert sorted(read_all("tokens@1", "eu-west")) == list(range(8000))

        mounted = mounted_volumes()
        compose("down")  # volumes kept: caches and registry
        # ... and nothing else: the images declared VOLUMEs, so the controller and s3-setup
        # (which mount nothing there) got anonymous volumes that each down left behind.
        kept = mounted & volumes()
        assert kept == named, f"left by down: {sorted(kept - named)}, missing: {named - kept}"
        compose("up", "-d")
        wait_healthy()
        versions = json.loads(cli("versions", "tokens", "--config", config, "--json").stdout)
        assert [(v["version"], v["digest"], v["rows"]) for v in versions] == [
            (1, first["digest"], 8000)
        ], (versions, first)
        # A second publish is tokens@2, never another tokens@1 beside the cached one.
        write_parquet_shards(tmp_path / "raw2", 3, rows=1000)
        upload_dir(S3, "edgecache", "raw/tokens2", tmp_path / "raw2")
        second = json.loads(cli("publish", "s3://edgecache/raw/tokens2", "--dataset", "tokens",
                                "--config", config, "--json").stdout)  # fmt: skip
        assert second["version"] == "tokens@2", second
        # eu-west's caches survived, split between its replicas by the ids they report
        # (EDGECACHE_NODE_ID in compose.host.yaml). Read from --json: the table's cells
        # wrap where a row runs past the terminal's width, which once split "tokens@1 (3/4".
        status = cli("status", "--config", config).stdout
        nodes = json.loads(cli("status", "--config", config, "--json").stdout)
        held = {
            n["node_id"]: {v["version"]: (v["shards"], v["total_shards"]) for v in n["versions"]}
            for n in nodes
        }
        for node_id in ("eu-west-1", "eu-west-2"):
            share = owned_shards(["eu-west-1", "eu-west-2"], node_id, "tokens", 1, 4)
            assert held[node_id]["tokens@1"] == (len(share), 4), (node_id, held, status)
        assert sorted(read_all("tokens@1", "eu-west")) == list(range(8000))
        assert sorted(read_all("tokens@2", "us-east")) == list(range(3000))

        stopped = {}
        for cid in compose("ps", "-q").stdout.split():
            info = json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True,
                                             text=True).stdout)[0]  # fmt: skip
            if not info["State"]["Running"]:
                continue
            started = time.monotonic()
            subprocess.run(["docker", "stop", "-t", "30", cid], capture_output=True, timeout=90)
            code = json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True,
                                             text=True).stdout)[0]["State"]["ExitCode"]  # fmt: skip
            name = info["Config"]["Labels"]["com.docker.compose.service"]
            stopped[name] = (code, round(time.monotonic() - started, 1))
        assert all(code == 0 and took < 15 for code, took in stopped.values()), stopped
        # A second down leaves exactly what the first did (2 more anonymous volumes a cycle
        # before), and down -v, the documented way to drop the data too, leaves nothing.
        mounted |= mounted_volumes()
        compose("down")
        assert mounted & volumes() == kept, sorted(mounted & volumes())
        compose("down", "-v")
        assert mounted & volumes() == set(), sorted(mounted & volumes())
    finally:
        compose("down", "-v", "--remove-orphans", "-t", "30", check=False)


# ------------------------------------------------------------- Kubernetes, offline


def readable_mounts(pod: dict, container: dict) -> dict[str, bool]:
    """Whether the container's user can read each mounted Secret or ConfigMap volume's files.

    What the kubelet does: the files are owned by root with the volume's mode (defaultMode,
    else 0644); with the pod's fsGroup they belong to that group, which also gets read
    (mode | 0440). A user that is not root reads them through "other" bits or fsGroup only.
    """
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    uid, fs_group = context.get("runAsUser", 0), context.get("fsGroup")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    found = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # none: a volumeClaimTemplate
        source = volume.get("secret") or volume.get("configMap")
        if source is None:
            continue
        mode = source.get("defaultMode", 0o644)
        found[mount["mountPath"]] = uid == 0 or bool(mode & 0o004) or fs_group is not None
    return found


def pods(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")
    ]


def test_every_pod_can_read_the_secrets_it_mounts() -> None:
    """The controller runs as uid 10001 and mounts its token and CA Secrets with mode 0400,
    owned by root: without an fsGroup it could read neither, and stopped at start on
    --token-file /etc/edgecache/tokens/admin (permission denied)."""
    from test_deploy import render

    for target in ("overlays/eu-west", "overlays/us-east", "controller"):
        for name, pod in pods(render(DEPLOY / "k8s" / target)):
            for container in pod["containers"]:
                unreadable = [p for p, ok in readable_mounts(pod, container).items() if not ok]
                assert not unreadable, (target, name, unreadable)


def test_the_compose_topology_for_the_host_lists_the_published_ports() -> None:
    """deploy/README.md ran `edgecache status --config deploy/compose/edgecache.yaml` from the
    host, a topology of container names (eu-west-1:7070) that resolve only inside the
    compose network: every node read as down. The host's file lists the published ports."""
    import re

    from edgecache.clients.topology import load_topology

    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("## One machine, several regions (Docker Compose)", 1)[1]
    section = section.split("### Host network only", 1)[0]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    published = {}
    for svc in compose["services"].values():
        if "EDGECACHE_REGION" in svc.get("environment", {}):
            (port,) = [p.split(":")[-2] for p in svc["ports"] if p.endswith(":7070")]
            published.setdefault(svc["environment"]["EDGECACHE_REGION"], set()).add(
                f"localhost:{port}"
            )
    used = re.findall(r"edgecache \w+ .*--config (\S+)", section)
    assert used, section
    for path in used:
        topology = load_topology(ROOT / path)
        nodes = {r: {str(n) for n in region.nodes} for r, region in topology.regions.items()}
        assert nodes == published, (path, nodes)
    minio = compose["services"]["minio"]
    assert "127.0.0.1:9000:9000" in minio["ports"]
    assert "AWS_ENDPOINT_URL=http://localhost:9000" in section
    env = minio["environment"]
    assert f"AWS_ACCESS_KEY_ID={env['MINIO_ROOT_USER']}" in section
    assert f"AWS_SECRET_ACCESS_KEY={env['MINIO_ROOT_PASSWORD']}" in section
