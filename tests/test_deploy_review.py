"""What a platform engineer's review of deploy/ found, checked on real parts.

cgroup v1 hosts (the node's memory and CPU defaults read only v2 files), a
``cached_only`` miss counted as a failing read, the image's extras, and the
manifests (kustomize, rendered by the real ``kubectl kustomize``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

import grpc
import pytest
import yaml
from edgeutil import node_settings, publish, stub, write_parquet_shards
from test_deploy import validate

from edgecache.cache.units import parse_size
from edgecache.edge.config import cgroup_cpu_limit, usable_cores
from edgecache.edge.fetch_memory import cgroup_memory_limit, default_budget
from edgecache.edge.server import NodeServer, running_node
from edgecache.v1 import edge_pb2

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
GiB = 1 << 30


# ---------------------------------------------------------------- cgroups


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_cgroup_v1_memory_limit_is_read(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"memory/memory.limit_in_bytes": str(2 * GiB)})
    assert cgroup_memory_limit(root) == 2 * GiB
    assert default_budget(root) == GiB  # half the pod's limit, not half the host's RAM


def test_cgroup_v1_unlimited_memory_is_the_machines(tmp_path: Path) -> None:
    """v1 writes "no limit" as ~8 EiB: the budget is then half the RAM, not 4 EiB."""
    unlimited = _tree(tmp_path / "v1", {"memory/memory.limit_in_bytes": "9223372036854771712"})
    nothing = tmp_path / "none"
    nothing.mkdir()
    assert default_budget(unlimited) == default_budget(nothing) < 1 << 50


def test_cgroup_v2_memory_still_wins(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"memory.max": str(3 * GiB)})
    assert default_budget(root) == 3 * GiB // 2
    assert cgroup_memory_limit(_tree(tmp_path / "max", {"memory.max": "max"})) is None


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_cpu_quota_caps_the_cores(tmp_path: Path, folder: str) -> None:
    root = _tree(
        tmp_path, {f"{folder}/cpu.cfs_quota_us": "150000", f"{folder}/cpu.cfs_period_us": "100000"}
    )
    assert cgroup_cpu_limit(root) == 2  # 1.5 CPUs: rounded up
    assert usable_cores(root) == min(2, len(__import__("os").sched_getaffinity(0)))


def test_cgroup_v1_no_quota_and_v2(tmp_path: Path) -> None:
    none = _tree(tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(none) is None
    assert cgroup_cpu_limit(_tree(tmp_path / "v2", {"cpu.max": "300000 100000"})) == 3
    assert cgroup_cpu_limit(_tree(tmp_path / "v2max", {"cpu.max": "max 100000"})) is None


def _heap_bound(env: dict[str, str | None]) -> int:
    """deploy/README.md's bound on a node's heap (Sizing): fetch memory, two chunks per
    stream, ~200 MiB, and what each malloc arena may keep free that the others cannot use."""
    from edgecache.cache.row_grid import DEFAULT_CHUNK_BYTES
    from edgecache.edge.allocator import TRIM_THRESHOLD
    from edgecache.edge.config import NodeConfig

    streams = int(
        env.get("EDGECACHE_MAX_STREAMS") or NodeConfig.model_fields["max_streams"].default
    )
    arenas = int(env["MALLOC_ARENA_MAX"] or 0)
    assert arenas >= 1, "MALLOC_ARENA_MAX unset: glibc makes 8 arenas per host CPU"
    return (
        parse_size(env["EDGECACHE_FETCH_MEMORY"])
        + streams * 2 * DEFAULT_CHUNK_BYTES
        + (200 << 20)
        + arenas * TRIM_THRESHOLD
    )


def test_statefulset_sets_memory_and_threads_to_match_its_limits() -> None:
    """The memory limit holds the LMDB page cache too (file pages the map faults in are
    charged to the pod's cgroup): the request covers the heap the node keeps resident, the
    limit that heap plus room for hot chunks, and fetch memory is set, not half the limit."""
    sts = yaml.safe_load((K8S / "base" / "statefulset.yaml").read_text())
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    limit = parse_size(limits["memory"] + "B")
    request = parse_size(requests["memory"] + "B")
    heap = _heap_bound(env)
    assert request >= heap, (request, heap)  # else a busy node sits above its request
    assert limit - heap >= 4 * GiB, (limit, heap)  # page cache for hot chunks
    assert parse_size(env["EDGECACHE_FETCH_MEMORY"]) < limit // 2  # not the default's half
    # The image sets the same arena cap, and the README states what the manifest holds.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"MALLOC_ARENA_MAX={env['MALLOC_ARENA_MAX']} " in dockerfile
    readme = (DEPLOY / "README.md").read_text().split("## Sizing", 1)[1].split("\n## ", 1)[0]
    readme = " ".join(readme.split())
    assert f"`MALLOC_ARENA_MAX={env['MALLOC_ARENA_MAX']}`" in readme
    assert f"the base asks {request // GiB} GiB" in readme
    assert f"the base: {limit // GiB} GiB" in readme
    assert f"(the base: {parse_size(env['EDGECACHE_FETCH_MEMORY']) // GiB} GiB)" in readme
    assert "charged to the pod's memory cgroup" in readme and "not in the container's" not in readme
    cpu = limits["cpu"]
    cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    assert int(env["EDGECACHE_PREPROCESS_THREADS"]) == max(1, round(cores))


# ---------------------------------------------------------------- a cached_only miss


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeServer]:
    write_parquet_shards(tmp_path / "origin", 2, rows=100)
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "tokens")
    config = node_settings(tmp_path, registry, metrics_listen="127.0.0.1:0")
    with running_node(config) as server:
        yield server


def _first_chunk_counts(server: NodeServer) -> dict[str, float]:
    text = urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    pattern = r'^edgecache_read_first_chunk_seconds_count\{[^}]*result="([^"]+)"[^}]*\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


def test_cached_only_miss_is_recorded_as_not_cached(node: NodeServer) -> None:
    """A peer copy asks the shard's owner first: a miss there is no failing read."""
    request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0, cached_only=True)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub(node.address).ReadShard(request, timeout=10))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # the caller's answer
    counts = _first_chunk_counts(node)
    assert counts.get("not_cached") == 1, counts
    assert "FAILED_PRECONDITION" not in counts, counts
    # A training read of the same shard fetches it and is an ordinary ok.
    request = edge_pb2.ReadShardRequest(dataset="tokens", version=1, shard=0)
    assert list(stub(node.address).ReadShard(request, timeout=30))
    assert _first_chunk_counts(node).get("ok") == 1


# ---------------------------------------------------------------- the alert


def test_reads_failing_ignores_not_cached_and_caller_deadlines(tmp_path: Path) -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus)")
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    node = 'region="eu-west", node="n1"'

    def count(result: str) -> dict:
        name = f'edgecache_reads_total{{{node}, result="{result}"}}'
        return {"series": name, "values": "0+10x30"}

    quiet = [{"eval_time": "25m", "alertname": "EdgecacheReadsFailing", "exp_alerts": []}]
    fires = [
        {
            "eval_time": "25m",
            "alertname": "EdgecacheReadsFailing",
            "exp_alerts": [{"exp_labels": {"severity": "critical", "region": "eu-west"}}],
        }
    ]
    tests = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [count("ok"), count("not_cached")],
                "alert_rule_test": quiet,
            },
            {
                "interval": "1m",
                "input_series": [count("ok"), count("DEADLINE_EXCEEDED")],
                "alert_rule_test": quiet,
            },
            {
                "interval": "1m",
                "input_series": [count("ok"), count("UNAVAILABLE")],
                "alert_rule_test": fires,
            },
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run(
        [exe, "test", "rules", "tests.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- the image


def test_image_installs_the_images_and_text_extras() -> None:
    """Nodes stage --transform images / tokens versions: Pillow and tokenizers, pinned."""
    from importlib.metadata import version

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert '"${wheel}[images,text]"' in dockerfile
    check = dockerfile.split('python3 -c "import edgecache.edge.server', 1)[1]
    assert "PIL.Image" in check and "tokenizers" in check  # the build's import check
    pins = dict(
        line.split("==", 1)
        for line in (DEPLOY / "constraints.txt").read_text().lower().splitlines()
        if "==" in line
    )
    assert "tokenizers" in pins
    # The images transform records decoder=pillow-X.Y.Z: the node's must be the publisher's.
    assert pins["pillow"] == version("pillow")
    assert "pip install -q '.[images,text]'" in (ROOT / "Makefile").read_text()


# ---------------------------------------------------------------- kustomize


def kubectl() -> str:
    exe = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "kubectl"
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl")
    return found


def render(kustomization: Path) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(kustomization)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _uncommented(tmp_path: Path, target: str, *components: str) -> list[dict]:
    """``deploy/k8s/TARGET`` rendered as a user gets it after uncommenting ``components``."""
    shutil.copytree(K8S, tmp_path / "k8s")
    path = tmp_path / "k8s" / target / "kustomization.yaml"
    text = path.read_text().replace("# components:", "components:")
    for component in components:
        text, found = re.subn(rf"(?m)^#(\s+- {re.escape(component)})\b", r" \1", text)
        assert found == 1, component
    path.write_text(text)
    return render(path.parent)


def test_operator_kinds_are_opt_in_components(tmp_path: Path) -> None:
    operator = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    for target in (K8S / "overlays" / "eu-west", K8S / "controller"):
        assert not operator & {o["kind"] for o in render(target)}, target
    nodes = _uncommented(tmp_path / "nodes", "overlays/eu-west", "../../base/monitoring")
    assert validate(nodes) == {"ServiceMonitor"}  # the CRD has no upstream schema
    (monitor,) = [o for o in nodes if o["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["namespace"] == "edgecache-eu-west"
    controller = _uncommented(tmp_path / "controller", "controller", "monitoring")
    assert validate(controller) == operator
    kinds = {o["kind"]: o for o in controller}
    assert operator <= set(kinds)
    assert kinds["PrometheusRule"]["spec"] == yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    assert kinds["PrometheusRule"]["metadata"]["namespace"] == "edgecache-control"


def test_tuned_hosts_pairs_the_statefulset_with_the_tuning_daemonset(tmp_path: Path) -> None:
    (daemonset,) = yaml.safe_load_all((K8S / "optional" / "node-tuning-daemonset.yaml").read_text())
    tuned = daemonset["spec"]["template"]["spec"]["nodeSelector"]
    objects = _uncommented(tmp_path, "overlays/us-east", "../../base/tuned-hosts")
    assert validate(objects) == set()
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == tuned
    (plain,) = [o for o in render(K8S / "overlays" / "us-east") if o["kind"] == "StatefulSet"]
    assert "nodeSelector" not in plain["spec"]["template"]["spec"]


def test_schedule_configmap_keeps_its_name_and_the_topology_is_hashed() -> None:
    objects = render(K8S / "controller")
    maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    assert "edgecache-schedule" in maps  # edited in place: re-read, the last good one kept
    assert any(re.fullmatch(r"edgecache-config-[a-z0-9]{10}", m) for m in maps), maps
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    flags = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert float(flags[flags.index("--lease-ttl") + 1]) >= 3 * float(
        flags[flags.index("--interval") + 1]
    )


def test_images_are_set_by_kustomize_and_the_region_patched_by_name() -> None:
    for target in (K8S / "controller", K8S / "overlays" / "eu-west", K8S / "overlays" / "us-east"):
        kustomization = yaml.safe_load((target / "kustomization.yaml").read_text())
        assert [i["name"] for i in kustomization["images"]] == ["edgecache-node"], target
        assert "/env/0" not in (target / "kustomization.yaml").read_text()
    # The region lands on EDGECACHE_REGION wherever the variable sits in the list.
    for region in ("eu-west", "us-east"):
        (sts,) = [o for o in render(K8S / "overlays" / region) if o["kind"] == "StatefulSet"]
        env = {
            e["name"]: e.get("value")
            for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["EDGECACHE_REGION"] == region


def test_tls_secret_is_optional_so_pods_start_without_tls() -> None:
    """The nodes' certificate and key (edgecache-tls) and the controller's CA alone
    (edgecache-ca): both optional, so pods start where TLS is not set up."""
    for path, volume in (
        (K8S / "base" / "statefulset.yaml", "tls"),
        (K8S / "controller" / "deployment.yaml", "ca"),
    ):
        spec = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
        (tls,) = [v for v in spec["volumes"] if v["name"] == volume]
        assert tls["secret"]["optional"] is True, path


def test_example_schedule_job_has_not_ended() -> None:
    from datetime import UTC, datetime

    from edgecache.clients.topology import load_schedule

    schedule = load_schedule(K8S / "controller" / "schedule.yaml")
    assert schedule.jobs and all(job.end > datetime.now(UTC) for job in schedule.jobs)


# ---------------------------------------------------------------- compose


def test_compose_nodes_drain_and_run_read_only() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    for name in ("eu-west-1", "eu-west-2", "us-east-1"):
        node = services[name]
        grace = float(node["environment"].get("EDGECACHE_GRACE_SECONDS", 10))
        assert float(node["stop_grace_period"].rstrip("s")) > grace, name
        assert node["read_only"] is True and "/tmp" in node["tmpfs"], name
    assert services["seed"]["healthcheck"] == {"disable": True}
    # seed.py writes the same bytes on every `up`: without --if-changed each restart
    # published a copy as the next version, which warm @latest fetched again.
    seed = " ".join(services["seed"]["command"])
    assert "edgecache publish" in seed and "--if-changed" in seed, seed
    assert "prometheus:/prometheus" in services["prometheus"]["volumes"]
    assert "prometheus" in compose["volumes"]


def test_the_dashboard_has_a_query_for_every_training_reader_metric() -> None:
    """docs/dataset.md says the dashboard has a panel per metric; batches_total had none."""
    declared = set(
        re.findall(
            r'"(edgecache_client_[a-z_]+)"', (ROOT / "clients" / "dataset_metrics.py").read_text()
        )
    )
    dashboard = (DEPLOY / "grafana" / "edgecache.json").read_text()
    assert declared, "no metric found: the pattern no longer matches the metrics module"
    missing = sorted(
        m for m in declared if not re.search(rf"{m.removesuffix('_total')}(_total)?\b", dashboard)
    )
    assert not missing, missing


def test_every_metric_an_alert_watches_has_a_dashboard_query() -> None:
    """deploy/README.md: the dashboard has a row per alert with what it watches; the
    jobs-cannot-be-met alert's gauge was on no panel (a helper's hunt)."""
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    watched = {
        name
        for group in rules["groups"]
        for rule in group["rules"]
        for name in re.findall(r"\b(edgecache_[a-z_]+)", rule["expr"])
    }
    assert watched, "no metric found in the alerts: the pattern no longer matches"
    dashboard = (DEPLOY / "grafana" / "edgecache.json").read_text()
    base = {re.sub(r"_(bucket|sum|count)$", "", m) for m in watched}
    missing = sorted(m for m in base if not re.search(rf"\b{m}(_bucket|_sum|_count)?\b", dashboard))
    assert not missing, missing
