"""Shared fixtures: real LMDB directories in tmp."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edgecache.cache.store import CacheStore


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
