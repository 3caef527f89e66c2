"""A node that kept a version from before its registry was reset or moved.

The registry the topology names now holds other content under ``tok@1``; a
node cached the old ``tok@1`` and was restarted on the new registry, and another
node still reads the old one. ``ready`` said the version was staged on the first
node (which refuses to serve it), and a reader pinned the old content's digest
from that node's ``GetManifest`` (served unchecked), then, refused by it, read
the old rows from the other node: 2,000 rows of the wrong content, no error.
Real nodes on loopback, real registries on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from edgeutil import edgecache, publish, write_parquet_shards

from edgecache.cache.errors import EdgeCacheError
from edgecache.clients import EdgeDataset
from edgecache.clients.node_client import start_local_node


def test_a_copy_of_other_content_is_not_staged_and_never_read(tmp_path: Path) -> None:
    old, new = f"file://{tmp_path}/registry-old", f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-old", 2, rows=300)
    write_parquet_shards(tmp_path / "origin-new", 2, rows=400)
    publish(old, f"file://{tmp_path}/origin-old", "tok")
    publish(new, f"file://{tmp_path}/origin-new", "tok")  # tok@1 again, other content
    cache = tmp_path / "cache-ap"
    ap = start_local_node("ap", cache, old, extra_args=["--node-id", "ap-1"])
    eu = start_local_node("eu", tmp_path / "cache-eu", old, extra_args=["--node-id", "eu-1"])
    try:
        both = tmp_path / "old.yaml"
        both.write_text(
            f"registry: {old}\nregions:\n  ap:\n    nodes: ['{ap.address}']\n"
            f"  eu:\n    nodes: ['{eu.address}']\n"
        )
        for region in ("ap", "eu"):
            code, out, err = edgecache("warm", "tok@1", "--region", region, "--config", str(both))
            assert code == 0, (out, err)
        ap.stop()
        ap = start_local_node("ap", cache, new, extra_args=["--node-id", "ap-1"])  # moved
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {new}\nregions:\n  ap:\n    nodes: ['{ap.address}']\n"
            f"  eu:\n    nodes: ['{eu.address}']\n"
        )
        code, out, err = edgecache("ready", "tok@1", "--region", "ap", "--config", str(topology))
        said = " ".join((out + err).split())
        assert code == 1, (out, err)
        assert f"{ap.address} keeps other content under tok@1" in said, said
        # warm stages it there, or says why not: it said "held already" of the old content.
        code, out, err = edgecache("warm", "tok@1", "--region", "ap", "--config", str(topology))
        said = " ".join((out + err).split())
        assert code == 1 and "was changed in the registry" in said, (out, err)
        assert "held already" not in said, said
        with pytest.raises(EdgeCacheError, match="was changed in the registry"):
            ds = EdgeDataset("tok@1", config=topology, region="ap", batch_size=100)
            rows = sum(len(batch["label"]) for batch in ds)
            raise AssertionError(f"read {rows} rows of the old content")
    finally:
        ap.stop()
        eu.stop()


def test_a_slow_registry_delays_a_pinned_manifest_at_most_a_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetManifest checks a kept copy against the registry; one that does not answer made
    every call wait for it (S3's retries: half a minute, past a reader's deadline), and
    each of several readers starting at once read it again."""
    import asyncio
    import threading
    import time

    from edgeutil import node_settings, stub

    from edgecache.cache.registry import Registry
    from edgecache.edge import versions as versions_module
    from edgecache.edge.server import running_node
    from edgecache.v1 import edge_pb2

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=100)
    publish(registry, f"file://{tmp_path}/origin", "tok")
    read = Registry.manifest
    reads: list[float] = []
    # The registry hangs for 30 s, well past the three calls below (each PIN_CHECK_WAIT and
    # a loaded host's slack), so one check stays in flight through all of them; released
    # at the end so the node's stop does not wait it out.
    answer = threading.Event()

    async def slow(self: Registry, dataset: str, version: int) -> object:
        reads.append(time.monotonic())
        if len(reads) > 1:  # the first read keeps the copy; the registry then hangs
            hung = time.monotonic()
            while not answer.is_set() and time.monotonic() - hung < 30:
                await asyncio.sleep(0.05)
        return await read(self, dataset, version)

    monkeypatch.setattr(Registry, "manifest", slow)
    monkeypatch.setattr(versions_module, "DIGEST_RECHECK_SECONDS", 0.0)  # every call checks
    with running_node(node_settings(tmp_path, registry)) as node:
        try:
            client = stub(node.address)
            request = edge_pb2.GetManifestRequest(dataset="tok", version=1)
            client.GetManifest(request, timeout=10)  # read from the registry: kept
            for _ in range(3):
                began = time.monotonic()
                client.GetManifest(request, timeout=10)  # the kept copy, after PIN_CHECK_WAIT
                # A moment, not the registry's 30 s: PIN_CHECK_WAIT and 4 s for a loaded host.
                assert time.monotonic() - began < versions_module.PIN_CHECK_WAIT + 4
            assert len(reads) == 2, reads  # one check in flight, shared by the later calls
        finally:
            answer.set()


def test_a_registry_that_refuses_is_not_called_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry that answered 403 (wrong credentials, a missing bucket) was "unreachable"."""
    import grpc
    from edgeutil import node_settings, stub

    from edgecache.cache.errors import OriginError
    from edgecache.cache.registry import Registry
    from edgecache.edge.server import running_node
    from edgecache.v1 import edge_pb2

    async def refused(self: Registry, dataset: str, version: int) -> object:
        raise OriginError(f"origin refused access to {self.url}/{dataset} (InvalidAccessKeyId)")

    monkeypatch.setattr(Registry, "manifest", refused)
    with running_node(node_settings(tmp_path, f"file://{tmp_path}/registry")) as node:
        with pytest.raises(grpc.RpcError) as failed:
            stub(node.address).GetManifest(edge_pb2.GetManifestRequest(dataset="t", version=1))
    details = failed.value.details() or ""
    assert "could not be read" in details and "unreachable" not in details, details


def test_an_evict_before_the_node_noticed_the_change_is_enough(tmp_path: Path) -> None:
    """The registry reset under a node that had not read the version since: the docs'
    advice (evict, then warm again) left it refusing the version, holding none of it,
    until a second evict; it serves the registry's content after the first."""
    import shutil

    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin-old", 2, rows=300)
    write_parquet_shards(tmp_path / "origin-new", 2, rows=400)
    publish(registry, f"file://{tmp_path}/origin-old", "tok")
    node = start_local_node("eu", tmp_path / "cache", registry)
    try:
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{node.address}']\n"
        )
        code, out, err = edgecache("warm", "tok@1", "--region", "eu", "--config", str(topology))
        assert code == 0, (out, err)
        shutil.rmtree(tmp_path / "registry")
        publish(registry, f"file://{tmp_path}/origin-new", "tok")  # tok@1 again, other content
        code, out, err = edgecache("evict", "tok@1", "--config", str(topology))
        assert code == 0, (out, err)
        code, out, err = edgecache("warm", "tok@1", "--region", "eu", "--config", str(topology))
        assert code == 0, (out, err)
        ds = EdgeDataset("tok@1", config=topology, region="eu", batch_size=100)
        assert sum(len(batch["label"]) for batch in ds) == 800  # the new content's rows
    finally:
        node.stop()
