"""The container stack of deploy/compose.host.yaml, built and run on a real Docker engine.

Collected by a plain ``pytest`` too, but skipped there: ``make test-deploy`` makes sure an
engine runs (deploy/base-image/docker-engine.sh), builds the local Debian base and sets
``EDGECACHE_DEPLOY_TESTS=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose.host.yaml"
TOPOLOGY = ROOT / "deploy" / "compose" / "edgecache.host.yaml"
PROJECT = "edgecache-deploy-test"
NODE_IMAGE = "edgecache-node:0.1.0"
S3_PORT = 17000
NODES = {  # compose service → (gRPC, probe, metrics) ports, as deploy/compose.host.yaml says
    "eu-west-1": (17070, 17071, 17072),
    "eu-west-2": (17080, 17081, 17082),
    "us-east-1": (17090, 17091, 17092),
}
# The stack waits for the controller to turn healthy, and test_stack.py checks it runs
# as uid 10001 with a read-only root and a tmpfs /tmp, and carries out its schedule.
CONTROLLER_SERVICE: str | None = "controller"
CONTROLLER_METRICS = 17060
REPORT: list[str] = []  # lines for the terminal summary (image sizes, timings)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("EDGECACHE_DEPLOY_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="containers on a real Docker engine: run `make test-deploy`")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    started = os.environ.get("EDGECACHE_DEPLOY_STARTED")  # set by make test-deploy
    if started:
        REPORT.append(
            f"make test-deploy wall time: {time.time() - int(started):.0f} s "
            "(engine, base image, builds, stack, tests)"
        )
    if REPORT:
        terminalreporter.section("test-deploy")
        for line in REPORT:
            terminalreporter.write_line(line)


def run(*args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        )
    return out


def compose_command() -> list[str]:
    """`docker compose` (the plugin) where it works, else Debian's `docker-compose`."""
    if run("docker", "compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("neither `docker compose` nor `docker-compose`: run make test-deploy")


def inspect(container: str) -> dict:
    return json.loads(run("docker", "inspect", container).stdout)[0]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class Stack:
    """The running compose project: container ids by service, and how to drive them.

    The test modules get everything through this object (with --import-mode=importlib a
    test module cannot import this conftest)."""

    compose: list[str]
    env: dict[str, str]
    containers: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, tuple[int, int, int]] = field(default_factory=lambda: dict(NODES))
    controller: str | None = CONTROLLER_SERVICE
    topology: Path = TOPOLOGY
    s3_endpoint: str = f"http://127.0.0.1:{S3_PORT}"
    node_image: str = NODE_IMAGE
    report: list[str] = field(default_factory=lambda: REPORT)
    run = staticmethod(run)
    inspect = staticmethod(inspect)

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        return run(
            *self.compose,
            "-f",
            str(COMPOSE_FILE),
            "-p",
            PROJECT,
            *args,
            check=check,
            timeout=timeout,
            env=self.env,
        )

    def refresh(self) -> None:
        for service in self("config", "--services").stdout.split():
            cid = self("ps", "-q", service).stdout.strip()
            if cid:
                self.containers[service] = cid

    def health(self, service: str) -> str | None:
        state = inspect(self.containers[service])["State"]
        return (state.get("Health") or {}).get("Status")

    def wait_healthy(self, *services: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        pending = set(services)
        while pending:
            for service in list(pending):
                state = inspect(self.containers[service])["State"]
                health = (state.get("Health") or {}).get("Status")
                if state["Running"] and health in (None, "healthy"):
                    pending.discard(service)
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout:.0f} s: {sorted(pending)}")
            time.sleep(0.5)

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "40", check=False).stdout


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """Build the images and bring up deploy/compose.host.yaml; torn down (volumes too) after."""
    env = {
        **os.environ,
        "EDGECACHE_BASE_IMAGE": os.environ.get("EDGECACHE_BASE_IMAGE", "edgecache-base:bookworm"),
    }
    s = Stack(compose_command(), env)
    s("down", "-v", "--remove-orphans", check=False)  # a stack left by an interrupted run
    ports = [(S3_PORT, CONTROLLER_METRICS), *NODES.values()]
    busy = [p for group in ports for p in group if not port_free(p)]
    assert not busy, f"loopback ports in use, stop what holds them first: {busy}"
    started = time.monotonic()
    s("build")
    built = time.monotonic()
    # Superseded builds of a changing tree pile up untagged; keep a day's for the cache.
    run("docker", "image", "prune", "-f", "--filter", "until=24h", check=False)
    s("up", "-d")
    s.refresh()
    failed = True
    try:
        s.wait_healthy(*NODES, "s3-origin", *([CONTROLLER_SERVICE] if CONTROLLER_SERVICE else []))
        REPORT.append(
            f"compose ({' '.join(s.compose)}): build {built - started:.0f} s, "
            f"up to healthy {time.monotonic() - built:.0f} s"
        )
        yield s
        failed = False
    except BaseException:
        print(s.logs())
        raise
    finally:
        down = s("down", "-v", "--remove-orphans", "-t", "30", check=False)
        # Checked when the tests passed (a failure's own error comes first otherwise): a
        # stack that does not come down holds the loopback ports the next run needs.
        if not failed:
            left = s("ps", "-a", "-q", check=False).stdout.split()
            label = f"label=com.docker.compose.project={PROJECT}"
            volumes = run("docker", "volume", "ls", "-q", "--filter", label, check=False)
            left += volumes.stdout.split()
            assert down.returncode == 0 and not left, (
                f"`down -v` failed (exit {down.returncode}) or left containers/volumes {left}: "
                f"{down.stderr[-2000:]}"
            )
