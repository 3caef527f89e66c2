"""Shared fixtures (real LMDB directories in tmp, moto's S3 server), a hang backstop, and
a fork guard for the in-process gRPC aio nodes some tests run."""

from __future__ import annotations

import faulthandler
import gc
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# Imported before this module registers its fork hook: "before" hooks run last-registered
# first, so _before_fork's gc.collect() runs before node_pool's hook takes the pools' fork
# lock (collecting a dataset closes its pool, which joins a prober that may wait on it).
import edgecache.clients.node_pool  # noqa: F401  # isort: skip
from edgecache.cache.store import CacheStore
from edgecache.clients.fork_safety import grpc_aio_running, wait_for_grpc_calls
from edgecache.clients.node_client import LocalNode

# Hypothesis's 200 ms deadline per example and its too_slow health check time the host,
# not the code: on CI's loaded 2-core machine (two xdist workers) an example that is fine
# can take longer. Loaded here, before any test module is imported, so every @given test
# has neither; those that pass their own settings keep what they set.
settings.register_profile("edgecache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("edgecache")

# pytest-timeout's alarm (timeout in pyproject.toml) raises in the main thread, so it
# cannot end a test stuck in C: a fork waiting in gRPC's atfork handler for gRPC's
# threads, a lock taken with the GIL held. CI then hung until its own limit with
# nothing printed. BACKSTOP seconds after that alarm, faulthandler (a C thread,
# no GIL needed) prints every thread's stack to the real stderr and ends the run.
BACKSTOP = 120.0
_STDERR: list[int] = []
_CRASH: list[int] = []  # where fatal errors and the backstop write (see _crash_file)


_RUNNING: list[str] = []  # the test running now, for the fork guard's message


# DataLoader iterators with worker processes, made while a test runs (see _shut_down_loaders).
_LOADER_ITERATORS: weakref.WeakSet[object] = weakref.WeakSet()


# Where each xdist worker's fatal-error and hang reports go (a folder the controller makes
# and hands to its workers): a worker's own stderr reaches CI's log only in the middle of
# the progress dots, which a shortened log cuts, and "worker 'gw1' crashed" then says
# nothing. Handed over in the worker's input, not the environment, so a pytest run inside
# a test (tests/test_crash_report.py) keeps its own.
CRASH_DIR_KEY = "edgecache_crash_dir"
_CRASH_DIR: list[str] = []  # the controller's folder, made when its first worker starts
_CRASHED: list[str] = []  # worker ids the controller saw die


def _crash_file(config: pytest.Config) -> int:
    """The file descriptor this process's crash and hang stacks are written to.

    An xdist worker writes to a file of its own, which the controller prints after the
    summary (:func:`pytest_unconfigure`); a run without workers writes to the terminal.
    """
    workerinput = getattr(config, "workerinput", None) or {}
    folder = workerinput.get(CRASH_DIR_KEY)
    if not folder:
        return _STDERR[0]
    name = f"crash-{workerinput['workerid']}-{os.getpid()}.txt"
    return os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Give each xdist worker the folder its crash stacks go to (made for the first one)."""
    if not _CRASH_DIR:
        _CRASH_DIR.append(tempfile.mkdtemp(prefix="edgecache-test-crash-"))
    node.workerinput[CRASH_DIR_KEY] = _CRASH_DIR[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A worker that died, also outside a test (collection, teardown), is reported."""
    worker = node.workerinput.get("workerid") if error else None
    if worker and worker not in _CRASHED:
        _CRASHED.append(worker)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's workers run with COLUMNS=80 in their environment. rich's consoles fix
    # their width from COLUMNS when they are made (when the CLI is imported, after this), so
    # a test that gives the CLI another width (CliRunner's env=) would get it in a plain run
    # and 80 under xdist.
    os.environ.pop("COLUMNS", None)
    # Capture is suspended while plugins configure: this is the terminal's stderr.
    _STDERR.append(os.dup(sys.stderr.fileno()))
    # A segfault or abort prints every thread's stack there (pytest's own faulthandler
    # plugin is off in pyproject.toml: it would write to the worker's stderr instead).
    _CRASH.append(_crash_file(config))
    faulthandler.enable(file=_CRASH[0], all_threads=True)
    from torch.utils.data import dataloader

    workers_iter = dataloader._MultiProcessingDataLoaderIter
    made = workers_iter.__init__

    def __init__(self: object, loader: object) -> None:
        made(self, loader)
        _LOADER_ITERATORS.add(self)

    workers_iter.__init__ = __init__  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _LOADER_ITERATORS.clear()
    try:
        return (yield)
    finally:
        _shut_down_loaders()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note the workers the controller saw die (xdist reports them as a test's failure)."""
    found = re.search(r"worker '(\w+)' crashed", str(report.longrepr or ""))
    if found and found.group(1) not in _CRASHED:
        _CRASHED.append(found.group(1))


def pytest_unconfigure(config: pytest.Config) -> None:
    """After the summary, print what each dead worker wrote as it died (or that it wrote nothing).

    Printed last so that a log that keeps only its tail still shows it.
    """
    if getattr(config, "workerinput", None) is not None or not _CRASH_DIR:
        return
    folder = _CRASH_DIR[0]
    if not _CRASHED:
        shutil.rmtree(folder, ignore_errors=True)
        return
    out = [f"\n{len(_CRASHED)} test worker(s) died: {', '.join(_CRASHED)}"]
    for worker in _CRASHED:
        files = sorted(Path(folder).glob(f"crash-{worker}-*.txt"))
        text = "\n".join(_stacks(f.read_text(errors="replace")) for f in files).strip()
        if text:
            out.append(f"--- what {worker} wrote as it died ({', '.join(map(str, files))}):")
            out.append(text)
        else:
            out.append(
                f"--- {worker} wrote nothing as it died: killed by a signal faulthandler cannot "
                "catch (SIGKILL: the OOM killer, a timeout's kill -9?)"
            )
    os.write(_STDERR[0] if _STDERR else 2, ("\n".join(out) + "\n").encode())


# Frames of the test harness (pytest, pluggy, xdist, execnet): the same in every stack.
_HARNESS = re.compile(r"site-packages/(_pytest|pluggy|xdist|execnet)/|File \"<string>\"")


def _stacks(dump: str) -> str:
    """A faulthandler dump shortened for a log: harness frames left out, the thread that
    died (or the main thread, for a hang) last, where a log's tail keeps it."""
    blocks = [b for b in re.split(r"\n\s*\n", dump.strip()) if b.strip()]
    kept: list[tuple[int, str]] = []
    for block in blocks:
        lines = [line for line in block.splitlines() if not _HARNESS.search(line)]
        if len(lines) > 1 or (lines and "Fatal Python error" in lines[0]):
            # Last: the thread that died; before it, the main thread (all a hang's dump has).
            rank = 2 if "Current thread" in lines[0] else 1 if "<module>" in block else 0
            kept.append((rank, "\n".join(lines)))
    return "\n\n".join(text for _, text in sorted(kept, key=lambda k: k[0]))


def _shut_down_loaders() -> None:
    """Stop the workers of DataLoader iterators a test left to the garbage collector.

    A loop that raised (``pytest.raises`` around ``for batch in loader``) leaves its
    iterator in a reference cycle through the traceback. Collected later, in some other
    test, torch's ``__del__`` finds the cycle's queues already finalized: each worker
    waits out its 5 s status interval and is terminated, 10 s of a later test's time
    (test_all_nodes_dying_mid_epoch... took 13 s in the suite, 3 s alone). Stopped
    here, while the iterator is whole, they exit at once.
    """
    for iterator in list(_LOADER_ITERATORS):
        iterator._shutdown_workers()  # type: ignore[attr-defined]
    _LOADER_ITERATORS.clear()


def _before_fork() -> None:
    """Free gRPC aio objects an earlier test left in reference cycles before a fork.

    Tests run edge nodes in this process (grpc.aio servers). gRPC aio's poller thread
    lives until the last aio object is freed, and it always sits inside gRPC core, so
    gRPC skips its fork handlers ("Other threads are currently calling into gRPC") and a
    DataLoader worker forked then inherits a broken gRPC: CI saw workers segfault. A
    training process holds no such server; the test process must not either when it forks.
    """
    _report_calls_in_flight()
    if not grpc_aio_running():
        return
    gc.collect()
    if grpc_aio_running() and _STDERR:
        where = _RUNNING[-1] if _RUNNING else "outside a test"
        os.write(
            _STDERR[0],
            f"\nfork guard: gRPC aio is still in use at a fork ({where}); a forked "
            "worker may inherit a broken gRPC. Stop in-process nodes before forking.\n".encode(),
        )


def _report_calls_in_flight() -> None:
    """Name the threads still inside a sync gRPC call when this process forks.

    gRPC core skips its fork handlers while any thread is in a call (a stream a
    test left open, a probe), and a DataLoader worker forked then may abort in
    its first call (ev_epoll1 "Check failed"), or this process in the fork. The
    product's fork hook waits for short calls to end
    (:func:`~edgecache.clients.fork_safety.wait_for_grpc_calls`, run here first
    so that only what it could not wait out is named).
    """
    if not _STDERR:
        return
    for ident, names in wait_for_grpc_calls().items():
        where = _RUNNING[-1] if _RUNNING else "outside a test"
        os.write(
            _STDERR[0],
            f"\nfork guard: thread {_thread_name(ident)!r} is inside a gRPC call at a "
            f"fork ({where}): {' < '.join(names)}\n".encode(),
        )


def _thread_name(ident: int) -> str:
    thread = threading._active.get(ident)  # type: ignore[attr-defined]
    return thread.name if thread is not None else "?"


os.register_at_fork(before=_before_fork)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _RUNNING[:] = [item.nodeid]
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    if not limit or not _STDERR:
        try:
            return (yield)
        finally:
            _stop_controllers_left_running(item.nodeid)
    faulthandler.dump_traceback_later(float(limit) + BACKSTOP, exit=True, file=_CRASH[0])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        _stop_controllers_left_running(item.nodeid)


def _stop_controllers_left_running(nodeid: str) -> None:
    """Close the in-process controllers whose staging threads outlived the test that ran them.

    A controller's task thread sits in a node's Stage stream until its controller is
    closed. Left running, it kept gRPC busy at every later fork in this worker process:
    the fork guard named it at each DataLoader in the tests after, and one of their
    workers aborted in its first gRPC call. The controller is found through the thread's
    target (its bound ``_run_task``), closed, and the test that left it named.
    """
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        controller = getattr(target, "__self__", None)
        if getattr(target, "__name__", "") != "_run_task" or controller is None:
            continue
        controller.close()
        thread.join(timeout=10)
        if _STDERR:
            os.write(
                _STDERR[0],
                f"\ncontroller left running by {nodeid}: its task thread {thread.name!r} "
                f"was {'still alive after closing it' if thread.is_alive() else 'stopped'}; "
                "close every Controller a test makes (try/finally)\n".encode(),
            )


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CacheStore]:
    with CacheStore(tmp_path / "cache", capacity_bytes=64 << 20, sync=False) as s:
        yield s


@pytest.fixture
def eu(tmp_path: Path) -> Iterator[tuple[Path, str, LocalNode]]:
    """Versions b@1 and c@1 published from a file:// origin, and region eu of one node.

    The controller's tests share it (a module may define an ``eu`` of its own).
    """
    from edgeutil import publish, write_parquet_shards

    from edgecache.clients.node_client import start_local_node

    registry = f"file://{tmp_path}/registry"
    for name in ("b", "c"):
        write_parquet_shards(tmp_path / "origin" / name, 2, rows=300)
        publish(registry, f"file://{tmp_path}/origin/{name}", name)
    node = start_local_node("eu", tmp_path / "cache-eu", registry)
    try:
        yield tmp_path, registry, node
    finally:
        node.stop()


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Path, LocalNode]]:
    """Region ``small`` of one test alone: pq@2 staged, room for one version, no pins.

    The plan, pin and warm tests share it (``test_plan_defects`` has the registry
    and topology helpers; each test gets its own registry, so any order passes).
    """
    from edgeutil import stub
    from test_plan_defects import published, topology_file

    from edgecache.clients.node_client import start_local_node
    from edgecache.v1 import edge_pb2

    registry = published(tmp_path)
    node = start_local_node("small", tmp_path / "cache-small", registry, capacity="50KiB")
    try:
        list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="pq", version=2)))
        topology_file(tmp_path / "small.yaml", registry, small=node.address)
        yield tmp_path, node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on loopback, with this process's AWS settings pointed at it."""
    import os

    from s3server import apply_env, moto_server

    with moto_server() as endpoint:
        saved = apply_env(endpoint)
        try:
            yield endpoint
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
