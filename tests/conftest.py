"""Shared fixtures (real LMDB directories in tmp, moto's S3 server), and a hang backstop."""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgecache.cache.store import CacheStore

# pytest-timeout's alarm (timeout in pyproject.toml) raises in the main thread, so it
# cannot end a test stuck in C: a fork waiting in gRPC's atfork handler for gRPC's
# threads, a lock taken with the GIL held. CI then hung until its own limit with
# nothing printed. BACKSTOP seconds after that alarm, faulthandler (a C thread,
# no GIL needed) prints every thread's stack to the real stderr and ends the run.
BACKSTOP = 120.0
_STDERR: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    # Capture is suspended while plugins configure: this is the terminal's stderr.
    _STDERR.append(os.dup(sys.stderr.fileno()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    if not limit or not _STDERR:
        return (yield)
    faulthandler.dump_traceback_later(float(limit) + BACKSTOP, exit=True, file=_STDERR[0])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CacheStore]:
    with CacheStore(tmp_path / "cache", capacity_bytes=64 << 20, sync=False) as s:
        yield s


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
