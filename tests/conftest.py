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
