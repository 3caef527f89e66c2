"""Helpers for edge node tests: raw shards in origin, a published version, a client stub."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from edgecache.cache.codec import decode_chunk
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.registry import Registry
from edgecache.edge.config import NodeConfig
from edgecache.edge.server import CHANNEL_OPTIONS
from edgecache.v1 import edge_pb2, edge_pb2_grpc
from edgecache.v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    from edgecache.clients.node_client import LocalNode
    from edgecache.clients.topology import ScheduledJob

ROWS_PER_SHARD = 3000


def shard_table(index: int, rows: int = ROWS_PER_SHARD) -> pa.Table:
    rng = np.random.default_rng(index)
    ids = rng.integers(0, 50_000, size=rows * 32, dtype=np.int32)
    return pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), 32),
            "label": pa.array(np.arange(index * rows, (index + 1) * rows, dtype=np.int64)),
        }
    )


def write_parquet_shards(root: Path, count: int, rows: int = ROWS_PER_SHARD) -> list[pa.Table]:
    root.mkdir(parents=True, exist_ok=True)
    tables = [shard_table(i, rows) for i in range(count)]
    for i, table in enumerate(tables):
        pq.write_table(table, root / f"part-{i:05d}.parquet", row_group_size=1000)
    return tables


def publish(registry_url: str, source_url: str, dataset: str, **spec: object) -> pb.Manifest:
    preprocess = preprocess_spec(**{"chunk_bytes": 64 << 10, **spec})  # type: ignore[arg-type]
    return Registry.run(registry_url, lambda reg: reg.publish(source_url, dataset, spec=preprocess))


def staged_by_a_node(
    root: Path, count: int, rows: int = ROWS_PER_SHARD
) -> tuple[str, Path, list[pa.Table]]:
    """tokens@1 of ``count`` shards published and staged by a node, now stopped.

    (registry URL, the node's cache directory, the shards' tables): a cache to
    damage on disk, as bit rot would, before a node or a reader opens it again.
    """
    from edgecache.clients.node_client import start_local_node

    tables = write_parquet_shards(root / "origin", count, rows=rows)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tokens")
    cache = root / "cache"
    node = start_local_node("eu", cache, registry)
    list(stub(node.address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)))
    node.stop()
    return registry, cache, tables


def stub(address: str) -> edge_pb2_grpc.EdgeCacheStub:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return edge_pb2_grpc.EdgeCacheStub(channel)


def node_ids(*addresses: str) -> dict[str, str]:
    """Address → the id each live node reports: what replicas split shards by."""
    return {a: stub(a).Status(edge_pb2.StatusRequest()).node_id for a in addresses}


def read_shard_table(
    client: edge_pb2_grpc.EdgeCacheStub, dataset: str, version: int, shard: int, start: int = 0
) -> pa.Table:
    batches = []
    for chunk in client.ReadShard(
        edge_pb2.ReadShardRequest(dataset=dataset, version=version, shard=shard, start_chunk=start)
    ):
        batches.append(decode_chunk(chunk.frame))
    return pa.Table.from_batches(batches)


def node_settings(tmp_path: Path, registry: str, **overrides: object) -> NodeConfig:
    """A node of its own on loopback (a free port) caching under ``tmp_path``."""
    settings: dict = {
        "region": "eu",
        "cache_dir": tmp_path / "cache",
        "registry": registry,
        "listen": "127.0.0.1:0",
        "capacity": "256MiB",
        "sync": False,
    }
    return NodeConfig(**(settings | overrides))


def edgecache(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run the CLI in a subprocess at 80 columns: (exit code, stdout, stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
        timeout=timeout,
    )
    return out.returncode, out.stdout, out.stderr


def serve_args(root: Path) -> list[str]:
    """``edgecache serve`` with a region, a cache and registry under ``root`` and any port."""
    return [
        "serve",
        "--region",
        "eu",
        "--cache-dir",
        str(root / "cache"),
        "--registry",
        f"file://{root}/registry",
        "--listen",
        "127.0.0.1:0",
    ]


def serve_process(
    args: list[str], env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[str], str]:
    """``edgecache serve ARGS`` as a subprocess, once it says where it serves: (process, address).

    Its stderr goes to ``log``, whose text a node that did not start is reported with.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgecache.clients.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving on "):
        proc.kill()
        proc.wait()
        raise AssertionError(f"node did not start: {line!r} {log.read_text()}")
    return proc, line.split()[-1]


def stop_process(proc: subprocess.Popen[str], timeout: float = 60) -> int:
    """SIGTERM (the way Kubernetes stops a pod) and its exit code; killed if it hangs."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def node_fields(root: Path, **flags: object) -> dict[str, object]:
    """NodeConfig's fields for a node with its cache and registry under ``root``, any port."""
    return {
        "region": "eu",
        "cache_dir": root / "cache",
        "registry": f"file://{root}/registry",
        "listen": "127.0.0.1:0",
        "sync": False,
        **flags,
    }


def pins_on(node: object) -> dict[str, datetime]:
    """name@N → the time the node (anything with an ``address``) pins it until."""
    status = stub(node.address).Status(edge_pb2.StatusRequest())  # type: ignore[attr-defined]
    return {
        f"{v.dataset}@{v.version}": v.pinned_until.ToDatetime(tzinfo=UTC)
        for v in status.versions
        if v.HasField("pinned_until")
    }


def streaming_module() -> ModuleType:
    """``import streaming`` (mosaicml-streaming), skipping the test where it is not installed.

    It imports torchvision, which cannot be installed beside the CPU torch: bench/peers'
    stand-in for it is loaded by path first.
    """
    import pytest

    if importlib.util.find_spec("streaming") is None:
        pytest.skip("mosaicml-streaming is not installed (make test installs it)")
    stub = Path(__file__).resolve().parent.parent / "bench" / "peers" / "torchvision_stub.py"
    spec = importlib.util.spec_from_file_location("edgecache_tv_stub", stub)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.import_streaming()
    import streaming

    return streaming


def publish_cli(tmp_path: Path, source: Path, *args: str) -> tuple[int, str]:
    """``edgecache publish SOURCE ARGS`` into a registry under ``tmp_path``: (exit code, output)."""
    from typer.testing import CliRunner

    from edgecache.clients.cli import app

    result = CliRunner().invoke(
        app,
        ["publish", str(source), "--registry", str(tmp_path / "reg"), *args],
        env={"COLUMNS": "400"},
    )
    return result.exit_code, result.output


def guarded_node(root: Path, region: str, registry: str) -> LocalNode:
    """A node that wants tokens: ``root/admin.token`` for admin calls, ``root/read.token``
    for reads (both written here, the same for every node under ``root``)."""
    from edgecache.clients.node_client import start_local_node

    (root / "admin.token").write_text("admin-token-0123456789\n")
    (root / "read.token").write_text("read-token-0123456789\n")
    return start_local_node(
        region,
        root / f"cache-{region}",
        registry,
        extra_args=[
            "--token-file",
            str(root / "admin.token"),
            "--read-token-file",
            str(root / "read.token"),
        ],
    )


def write_manifests(
    registry: Path, versions: dict[str, list[int]], created_at: datetime
) -> dict[str, pb.Manifest]:
    """Version 1 of each dataset, of shards of these sizes (KiB), as a file:// registry holds it.

    No data behind them: for the planner, which reads only manifests (the property tests).
    """
    from edgecache.cache.manifest import build_manifest, manifest_to_json

    manifests = {}
    for name, sizes in versions.items():
        manifest = build_manifest(
            dataset=name,
            version=1,
            source_url=f"file://{registry.parent}/src/{name}",
            source_format=pb.SOURCE_FORMAT_PARQUET,
            schema=pa.schema([("x", pa.int64())]),
            preprocess=preprocess_spec(),
            shards=[
                pb.Shard(index=i, source_key=f"s{i}.parquet", source_size=s * 1024, row_count=1)
                for i, s in enumerate(sizes)
            ],
            created_at=created_at,
        )
        path = registry / name / "versions" / "1.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(manifest_to_json(manifest))
        manifests[name] = manifest
    return manifests


def property_settings(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """hypothesis settings of the planner's property tests: the same sites on every run.

    CI runs the same sites each time (a failure is a defect to fix, not luck);
    PROPERTY_RANDOM=1 hunts new ones, PROPERTY_SHRINK=1 shrinks what it finds.
    """
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=examples,
        deadline=None,
        phases=[p for p in Phase if p is not Phase.shrink or os.environ.get("PROPERTY_SHRINK")],
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=not os.environ.get("PROPERTY_RANDOM"),
        database=None,
    )


def in_scratch(prefix: str, check: Callable[[Path], None]) -> None:
    """``check`` given a fresh directory, removed after it (hypothesis runs many per test)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        check(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class TaggedChecks:
    """A property test's checks, each tagged with the defect that breaks it.

    PROPERTY_SKIP (else ``skip``) names tags not checked on the random sites;
    a shrunk example checks its own tags alone, skipped or not.
    """

    def __init__(self, skip: str = "") -> None:
        self.skip = set(filter(None, os.environ.get("PROPERTY_SKIP", skip).split(",")))
        self.only: set[str] = set()

    def expect(self, ok: object, tag: str, *why: object) -> None:
        """An invariant; ``tag`` names the defect that breaks it (the report's numbering)."""
        if tag in self.only if self.only else tag not in self.skip:
            assert ok, (tag, *why)

    def example(self, tags: set[str], prefix: str, check: Callable[[Path], None]) -> None:
        """``check`` of a shrunk example in a fresh directory, its own ``tags`` alone."""
        self.only |= tags
        try:
            in_scratch(prefix, check)
        finally:
            self.only.clear()


def scheduled_jobs(jobs: list[dict], now: datetime, step: timedelta) -> list[ScheduledJob]:
    """A property test's jobs (start and duration in ``step``s from ``now``, reading NAME@1)."""
    from edgecache.clients.topology import ScheduledJob

    return [
        ScheduledJob(
            name=j["name"],
            region=j["region"],
            start=now + j["start"] * step,
            duration=j["duration"] * step,
            datasets=[f"{d}@1" for d in j["datasets"]],
            priority=j["priority"],
        )
        for j in jobs
    ]
