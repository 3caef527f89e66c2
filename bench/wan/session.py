"""One run of a link benchmark: the link, moto at origin, the processes, the phases.

Shared by ``python -m bench.wan`` and ``python -m bench.schedule``: both build
a slow link (:mod:`bench.wan.link`), start moto's S3 server on its origin
side, run an origin-side step (write, upload, publish) and an edge-side step
(the measurements) as subprocesses across it, time each phase, and must leave
nothing behind when interrupted: every process ended, every namespace gone,
the work directory removed unless kept.

    with session("edgecache-bench-wan-", spec, "auto", console) as s:
        origin = s.run.start_origin()
        s.phase("link and origin set up")
        results = s.run.edge_step("bench.wan.workload", settings)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.wan.link import Link, LinkSpec, open_link
from bench.wan.origin import s3_env

__all__ = ["Run", "Session", "edge_side", "raise_interrupt", "s3_node_env", "session"]

REPO = Path(__file__).resolve().parents[2]
MOTO_PORT = 5000
PROBE_PORT = 9100


def raise_interrupt(signum: int, frame: object) -> None:
    """A signal handler that unwinds like Ctrl-C, so ``finally`` blocks stop every process."""
    raise KeyboardInterrupt(f"signal {signum}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """The processes one benchmark run started across the link, so they can all be ended."""

    def __init__(self, link: Link, workdir: Path, console: Console) -> None:
        self.link, self.workdir, self.console = link, workdir, console
        self.procs: list[subprocess.Popen[Any]] = []
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.origin_local = ""  # moto's URL on the origin side (uploads never cross the link)

    def spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process that :meth:`close` will end."""
        proc = subprocess.Popen(argv, cwd=REPO, env=kwargs.pop("env", self.env), **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """SIGTERM every process started, then SIGKILL what is left after 10 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def start_origin(self) -> str:
        """moto's S3 server on the origin side; its URL as the edge side reaches it."""
        port = MOTO_PORT if self.link.kind == "netns" else _free_port()
        log = self.workdir / "moto.log"
        exe = str(Path(sys.executable).with_name("moto_server"))
        with open(log, "w") as out:
            proc = self.spawn(
                # At nice 10: the origin stands in for another machine, so on this small
                # host it must not take CPU from the edge side's node and training job.
                self.link.origin_command(
                    ["nice", "-n", "10", exe, "-H", self.link.origin_host, "-p", str(port)]
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while "Running on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start: {log.read_text()[-1000:]}")
            time.sleep(0.1)
        self.origin_local = f"http://{self.link.origin_host}:{port}"
        host, edge_port = self.link.expose(port)
        return f"http://{host}:{edge_port}"

    def probe(self, streams: list[int], seconds: float, warmup: float) -> dict[str, Any]:
        """RTT and bulk rates across the link, and the link's drop counters meanwhile."""
        port = PROBE_PORT if self.link.kind == "netns" else _free_port()
        server = self.spawn(
            self.link.origin_command(
                [sys.executable, "-m", "bench.wan.probe", "serve", self.link.origin_host, str(port)]
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the probe server did not start")
        host, edge_port = self.link.expose(port)
        before = self.link.counters()
        out = subprocess.run(
            self.link.edge_command(
                [sys.executable, "-m", "bench.wan.probe", "measure", host, str(edge_port)]
                + ["--streams", ",".join(map(str, streams)), "--seconds", f"{seconds:g}"]
                + ["--warmup", f"{warmup:g}"]
            ),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = self.link.counters()
        server.terminate()
        server.wait(timeout=10)
        figures = json.loads(out.stdout)
        figures["counters"] = {k: after[k] - before.get(k, 0) for k in after}
        return figures

    def origin_step(self, module: str, args: list[str]) -> Any:
        """Run ``python -m module args`` on the origin side; the JSON its last line prints."""
        out = subprocess.run(
            self.link.origin_command([sys.executable, "-m", module, *args]),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise RuntimeError(f"{module} failed on the origin side: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def edge_step(self, module: str, settings: Any) -> dict[str, Any]:
        """Run ``module`` (an :func:`edge_side` entry) on the edge side with ``settings``.

        The settings dataclass travels as a JSON file and the results come back
        as one; the process's stderr is the benchmark's live log.
        """
        path = self.workdir / "settings.json"
        path.write_text(json.dumps(asdict(settings)))
        results = self.workdir / "results.json"
        proc = self.spawn(
            self.link.edge_command([sys.executable, "-m", module, str(path), str(results)])
        )
        if proc.wait():
            raise RuntimeError(f"{module} failed (exit {proc.returncode}); see the log above")
        return dict(json.loads(results.read_text()))


@dataclass
class Session:
    """What :func:`session` hands its body: the run, the link and why it was chosen, the phases."""

    run: Run
    link: Link
    why: str
    workdir: Path
    started: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)

    def phase(self, name: str) -> None:
        """Close the phase ``name``: the seconds since the previous one closed."""
        self.phases[name] = round(time.monotonic() - self.started - sum(self.phases.values()), 1)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 1)


@contextmanager
def session(
    prefix: str, spec: LinkSpec, link_kind: str, console: Console, *, keep: bool = False
) -> Iterator[Session]:
    """A link of ``spec``, a work directory and a :class:`Run`, all torn down on the way out.

    SIGTERM and SIGHUP unwind like Ctrl-C while inside, so the teardown runs
    whichever way the benchmark ends; the ``"teardown"`` phase is recorded last.
    """
    previous = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    link: Link | None = None
    run: Run | None = None
    current: Session | None = None
    try:
        link, why = open_link(spec, link_kind)
        console.log(f"link: {why}; {spec}")
        run = Run(link, workdir, console)
        current = Session(run, link, why, workdir)
        yield current
    finally:
        if run is not None:
            run.close()
        if link is not None:
            link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if current is not None:
            current.phase("teardown")


def edge_side(
    settings_type: Callable[..., Any],
    run: Callable[[Any, Console], dict[str, Any]],
    log_file: Callable[[Any], Path | None] = lambda settings: None,
) -> None:
    """The ``main`` of an edge-side module: settings in, ``run(settings, console)``, results out.

    The settings' ``node_env`` goes into the environment first (the CLI, the
    nodes and EdgeDataset reach origin through it), and SIGTERM (the
    orchestrator ending us) unwinds like Ctrl-C so every node is stopped.
    Where ``log_file`` names a file, edgecache's INFO log goes there (stderr
    keeps warnings only).
    """
    parser = argparse.ArgumentParser(description="one benchmark's edge side")
    parser.add_argument("settings", type=Path)
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    settings = settings_type(**json.loads(args.settings.read_text()))
    os.environ.update(settings.node_env)
    signal.signal(signal.SIGTERM, raise_interrupt)
    detail = log_file(settings)
    if detail is not None:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)
        to_file = logging.FileHandler(detail)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        to_file.setLevel(logging.INFO)
        ours = logging.getLogger("edgecache.clients")
        ours.setLevel(logging.INFO)
        ours.addHandler(to_file)
    results = run(settings, Console(stderr=True, width=150))
    args.results.write_text(json.dumps(results))


def s3_node_env(origin: str, staging_concurrency: int) -> dict[str, str]:
    """The environment a node needs to stage from moto at ``origin``."""
    return {**s3_env(origin), "EDGECACHE_STAGING_CONCURRENCY": str(staging_concurrency)}
