"""``publish --chunk-size``: what EdgeDataset's small-version warning advises must exist.

A small version has few windows (a window is a chunk), so each batch drew from fewer
windows than ``shuffle_windows``; the warning advised publishing it with smaller chunks,
which only the Python spec could do."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from edgeutil import stub, write_parquet_shards
from typer.testing import CliRunner

from edgecache.cache.registry import Registry
from edgecache.clients import EdgeDataset
from edgecache.clients.cli import app
from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

runner = CliRunner()


def _publish(root: Path, name: str, *more: str) -> None:
    args = ["publish", f"file://{root}/src", "--dataset", name, "--registry", f"file://{root}/reg"]
    result = runner.invoke(app, [*args, *more], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output


def _staged_warnings(root: Path, node: LocalNode, name: str) -> list[str]:
    """The mixing warnings of ``name``@1 once ``node`` staged it (read through ``lmdb://``)."""
    list(stub(node.address).Stage(edge_pb2.StageRequest(dataset=name, version=1)))
    return _warnings(root, f"{name}@1")


def _warnings(root: Path, spec: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EdgeDataset(spec, endpoints=[f"lmdb://{root}/cache"], batch_size=32)
    return [str(w.message) for w in caught if "shuffle_windows" in str(w.message)]


def test_the_chunk_size_the_mixing_warning_names_publishes_a_version_that_mixes(
    tmp_path: Path,
) -> None:
    write_parquet_shards(tmp_path / "src", 6, rows=3000)
    _publish(tmp_path, "small")
    node = start_local_node("eu", tmp_path / "cache", f"file://{tmp_path}/reg")
    try:
        (said,) = _staged_warnings(tmp_path, node, "small")
        found = re.search(r"edgecache publish --chunk-size (\S+?)(B|KiB|MiB)\)", said)
        assert found, said
        size = found.group(1) + found.group(2)
        _publish(tmp_path, "fine", "--chunk-size", size)
        manifest = Registry.run(f"file://{tmp_path}/reg", lambda reg: reg.manifest("fine", 1))
        assert 4 << 10 <= manifest.preprocess.chunk_bytes < 4 << 20
        assert _staged_warnings(tmp_path, node, "fine") == []  # mixes, each chunk read once
    finally:
        node.stop()


def test_a_chunk_size_out_of_range_is_bad_input(tmp_path: Path) -> None:
    write_parquet_shards(tmp_path / "src", 1, rows=10)
    for size, said in (("1KiB", "give 4KiB..256MiB"), ("lots", "--chunk-size: invalid size")):
        args = ["publish", f"file://{tmp_path}/src", "--dataset", "x"]
        result = runner.invoke(
            app, [*args, "--registry", f"file://{tmp_path}/reg", "--chunk-size", size]
        )
        assert result.exit_code == 2, result.output
        assert said in result.output, result.output


def test_no_chunk_size_below_what_publish_takes_is_advised(tmp_path: Path) -> None:
    """A tiny version was told ``--chunk-size 1KiB, at least 4KiB``: advice it could not take."""
    write_parquet_shards(tmp_path / "src", 6, rows=200)
    _publish(tmp_path, "tiny")
    node = start_local_node("eu", tmp_path / "cache", f"file://{tmp_path}/reg")
    try:
        (said,) = _staged_warnings(tmp_path, node, "tiny")
    finally:
        node.stop()
    window = re.search(r"window_bytes=(\d+)", said)
    assert window and int(window.group(1)) < 4 << 10, said  # the case: below publish's least
    assert "--chunk-size" not in said and "lower lanes" in said, said
