"""A local source file rewritten after publishing is refused, its mtime restored or not.

On file:// (and any store without ETags) an object's tag was ``size-mtime``: a file
rewritten with the same size and its mtime set back (``cp -p``, ``rsync -a``,
``tar x`` restore mtimes) kept its tag, and the node served the new bytes as the
published version. The tag now names the inode's change time too, which a
rewrite and a restored mtime both move; a version recorded with the old tag is
still read (the old tag is a prefix of the new).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from edgeutil import publish, stub

from edgecache.cache.storage.base import ObjectInfo
from edgecache.cache.storage.filesystem import FsspecStore
from edgecache.clients.node_client import start_local_node
from edgecache.v1 import edge_pb2


def _rewrite_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    stat = path.stat()
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    path.write_bytes(data.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_a_rewrite_with_its_mtime_restored_is_refused_by_the_node(tmp_path: Path) -> None:
    (tmp_path / "origin").mkdir()
    source = tmp_path / "origin" / "part-0.csv"
    source.write_bytes(b"id,v\n1,10\n2,20\n")
    registry = f"file://{tmp_path}/registry"
    publish(registry, f"file://{tmp_path}/origin", "c")
    _rewrite_keeping_size_and_mtime(source, b"2,20", b"2,77")
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        with pytest.raises(grpc.RpcError) as failed:
            list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="c", version=1)))
        status = stub(node.address).Status(edge_pb2.StatusRequest())
    finally:
        node.stop()
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "changed after the version was published" in (failed.value.details() or "")
    assert not [v for v in status.versions if v.shard_count], status  # nothing served


def test_a_tag_recorded_before_the_change_time_was_in_it_still_matches(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"0123456789")
    found = asyncio.run(FsspecStore().head(f"file://{path}"))
    size, mtime, ctime = found.etag.split("-")
    legacy = ObjectInfo(found.url, found.size, f"{size}-{mtime}")
    assert legacy.same_content(found) and found.same_content(legacy)
    assert not ObjectInfo(found.url, found.size, f"{size}-{int(mtime) + 1}").same_content(found)
    assert not ObjectInfo(found.url, found.size, f"{size}-{mtime}-{ctime}1").same_content(found)
