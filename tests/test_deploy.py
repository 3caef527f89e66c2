"""Container, compose and Kubernetes files, checked statically (no Docker engine or cluster
here), and the image's entrypoint and health check run outside a container."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from edgecache.clients.topology import load_schedule, load_topology
from edgecache.edge.config import NodeConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CLIENT_ONLY_ENV = {"EDGECACHE_TLS_CA", "EDGECACHE_CONFIG"}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def env_names(text: str) -> set[str]:
    return set(re.findall(r"\bEDGECACHE_[A-Z_]+", text))


def test_every_edgecache_variable_is_a_node_setting() -> None:
    fields = {f"EDGECACHE_{name.upper()}" for name in NodeConfig.model_fields}
    for path in [DEPLOY / "Dockerfile", DEPLOY / "compose.yaml", *DEPLOY.glob("k8s/**/*.yaml")]:
        unknown = env_names(path.read_text()) - fields - CLIENT_ONLY_ENV
        assert not unknown, f"{path}: {unknown}"


def test_dockerfile_shape() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM python:3\.11-slim", text, re.M)) == 2  # multi-stage, slim
    assert re.search(r"^USER 10001", text, re.M)
    assert 'ENTRYPOINT ["edgecache", "serve"]' in text
    assert re.search(r'^HEALTHCHECK .*\n\s+CMD \["edgecache", "healthcheck"', text, re.M)
    assert "torch" not in re.sub(r"#.*", "", text).lower()  # comments may say "no torch"
    assert "-c deploy/constraints.txt" in text
    constraints = (DEPLOY / "constraints.txt").read_text()
    assert "grpcio==" in constraints and "torch" not in constraints
    ignored = (ROOT / ".dockerignore").read_text()
    assert ".venv" in ignored and "tests" in ignored


def test_kubernetes_manifests() -> None:
    base = DEPLOY / "k8s" / "base"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (base / resource).exists(), resource
    objects = {d["kind"]: d for r in kustomization["resources"] for d in docs(base / r)}
    for obj in objects.values():
        assert obj["apiVersion"] and obj["metadata"]["name"]
    sts = objects["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    probe_port = int(env["EDGECACHE_PROBE_LISTEN"].rsplit(":", 1)[1])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == probe_port
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["limits"]["memory"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "cache"
    assert {m["name"] for m in container["volumeMounts"]} >= {"cache", "tokens", "tls"}
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert (
        objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    )
    cron = objects["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert cron["command"][:2] == ["edgecache", "warm"]
    for overlay in ("eu-west", "us-east"):
        custom = yaml.safe_load(
            (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
        )
        assert "../../base" in custom["resources"] and custom["namespace"] == f"edgecache-{overlay}"
    tuning = docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml")[0]
    assert tuning["kind"] == "DaemonSet" and "bbr" in json.dumps(tuning)


def test_topology_and_schedule_files_are_valid() -> None:
    for path in (DEPLOY / "compose" / "edgecache.yaml", DEPLOY / "k8s" / "base" / "edgecache.yaml"):
        topology = load_topology(path)
        assert set(topology.regions) == {"eu-west", "us-east"}
    load_schedule(
        DEPLOY / "k8s" / "base" / "schedule.yaml",
        load_topology(DEPLOY / "k8s" / "base" / "edgecache.yaml"),
    )


def test_compose_stack_and_dashboards() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"minio", "eu-west-1", "eu-west-2", "us-east-1", "prometheus", "grafana", "seed"} <= set(
        services
    )
    for name in ("eu-west-1", "eu-west-2", "us-east-1"):
        env = services[name]["environment"]
        assert env["EDGECACHE_REGION"] in ("eu-west", "us-east")
        assert f"{name}:/var/cache/edgecache" in services[name]["volumes"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert {t.split(":")[0] for t in targets} == {"eu-west-1", "eu-west-2", "us-east-1"}
    dependencies = {d for svc in services.values() for d in svc.get("depends_on", [])}
    assert dependencies <= set(services)
    named = set(compose["volumes"])
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source
            else:
                assert source in named, source


def test_dashboard_metrics_exist_on_a_live_node(tmp_path: Path) -> None:
    from urllib.request import urlopen

    from edgecache.edge.server import running_node

    settings = NodeConfig(
        region="eu-west",
        cache_dir=tmp_path / "c",
        registry=f"file://{tmp_path}/r",
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        capacity="64MiB",
        sync=False,
    )
    with running_node(settings) as node:
        text = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
    exported = set(re.findall(r"^(edgecache_[a-z_]+)", text, re.M))
    dashboard = json.loads((DEPLOY / "grafana" / "edgecache.json").read_text())
    used = set(re.findall(r"edgecache_[a-z_]+", json.dumps(dashboard)))
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "hit ratio",
        "bytes served",
        "staging",
        "origin",
        "capacity",
        "active streams",
        "rtt",
    ):
        assert topic in titles, topic


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    out = subprocess.run(
        [str(hadolint), str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def render_overlay(overlay: str) -> list[dict]:
    """What `kubectl kustomize` would produce for our overlays (namespace, replicas,
    JSON-patch replaces, ConfigMaps from files), merged by hand: no kustomize binary here."""
    base_dir, over_dir = DEPLOY / "k8s" / "base", DEPLOY / "k8s" / "overlays" / overlay
    base = yaml.safe_load((base_dir / "kustomization.yaml").read_text())
    custom = yaml.safe_load((over_dir / "kustomization.yaml").read_text())
    objects = [d for r in base["resources"] for d in docs(base_dir / r)]
    objects += [d for r in custom["resources"] if r.endswith(".yaml") for d in docs(over_dir / r)]
    generators = {g["name"]: g for g in base.get("configMapGenerator", [])}
    generators.update({g["name"]: g for g in custom.get("configMapGenerator", [])})
    for name, gen in generators.items():
        data = {}
        for entry in gen["files"]:
            key, _, path = entry.partition("=")
            source = (over_dir / path) if path else (base_dir / key)
            data[Path(key).name] = source.read_text()
        objects.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
        )
    for obj in objects:
        if obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = custom["namespace"]
        for rep in custom.get("replicas", []):
            if obj["metadata"]["name"] == rep["name"] and obj["kind"] == "StatefulSet":
                obj["spec"]["replicas"] = rep["count"]
        for patch in custom.get("patches", []):
            target = patch["target"]
            if obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]:
                for op in yaml.safe_load(patch["patch"]):
                    node, *path = [p for p in op["path"].split("/") if p]
                    holder = obj[node]
                    for part in path[:-1]:
                        holder = holder[int(part)] if part.isdigit() else holder[part]
                    last = path[-1]
                    holder[int(last) if last.isdigit() else last] = op["value"]
    return objects


def test_rendered_overlays_validate_against_kubernetes_schemas() -> None:
    import kubernetes_validate

    version = "1.30.0"
    for overlay in ("eu-west", "us-east"):
        objects = render_overlay(overlay)
        sts = next(o for o in objects if o["kind"] == "StatefulSet")
        assert sts["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"] == overlay
        unvalidated = set()
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unvalidated.add(obj["kind"])  # CRDs are not in the upstream schemas
        assert unvalidated == {"ServiceMonitor"}
    for obj in docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml"):
        kubernetes_validate.validate(obj, version, strict=True)


def test_image_entrypoint_and_healthcheck_run_outside_a_container(tmp_path: Path) -> None:
    """The StatefulSet's settings, with local paths and free ports, through `edgecache serve`."""
    from tlsutil import make_pki

    pki = make_pki(tmp_path)
    (tmp_path / "admin").write_text("admin-token")
    (tmp_path / "read").write_text("read-token")
    sts = docs(DEPLOY / "k8s" / "base" / "statefulset.yaml")[0]
    env = {
        e["name"]: e["value"]
        for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    env.update(
        EDGECACHE_REGION="eu-west",
        EDGECACHE_REGISTRY=f"file://{tmp_path}/registry",
        EDGECACHE_CACHE_DIR=str(tmp_path / "cache"),
        EDGECACHE_CAPACITY="1GiB",
        EDGECACHE_LISTEN="127.0.0.1:0",
        EDGECACHE_PROBE_LISTEN="127.0.0.1:0",
        EDGECACHE_METRICS_LISTEN="127.0.0.1:0",
        EDGECACHE_TOKEN_FILE=str(tmp_path / "admin"),
        EDGECACHE_READ_TOKEN_FILE=str(tmp_path / "read"),
        EDGECACHE_TLS_CERT=str(pki["server"]),
        EDGECACHE_TLS_KEY=str(pki["server_key"]),
    )
    import os

    from edgecache.edge.config import load_node_config

    settings = load_node_config(None, {}, env)
    assert settings.probe_listen and settings.token_file and settings.tls_cert
    from edgecache.edge.server import running_node

    with running_node(settings) as node:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgecache.clients.cli",
                "healthcheck",
                f"127.0.0.1:{node.probe_port}",
            ],
            capture_output=True,
            text=True,
            env={**os.environ},
        )
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgecache.clients.cli",
            "healthcheck",
            "127.0.0.1:9",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1
