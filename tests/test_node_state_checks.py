"""status and doctor say what in a node's state makes staging there fail.

Found operating a site: a node restarted with a ``--capacity`` below the
versions pinned on it refused every new shard while ``status`` showed
``1.6 MiB / 1.0 MiB`` (exit 0, no note) and ``doctor`` said "ok"; two nodes of a
region started with one ``--node-id`` split shards by address where readers
dialling other names split them otherwise, and only ``warm`` said so (three
times). Real nodes on loopback, the CLI in a subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from edgeutil import edgecache, publish, write_parquet_shards
from test_node_shares import _schedule

from edgecache.clients.node_client import LocalNode, start_local_node


def _topology(root: Path, registry: str, addresses: list[str]) -> list[str]:
    path = root / "edgecache.yaml"
    nodes = ", ".join(f"'{a}'" for a in addresses)
    path.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: [{nodes}]\n")
    return ["--config", str(path)]


def test_a_node_over_its_capacity_by_pins_is_flagged(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "a", 2, rows=8000)
    publish(registry, f"file://{tmp_path}/a", "a")
    node = start_local_node("eu", tmp_path / "cache", registry, capacity="64MiB")
    try:
        config = _topology(tmp_path, registry, [node.address])
        holder = _schedule(tmp_path / "holder.yaml", [("holder", "a", 24)])
        code, out, err = edgecache("warm", str(holder), *config)  # stages and pins a@1
        assert code == 0, (out, err)
    finally:
        node.stop()
    node = start_local_node("eu", tmp_path / "cache", registry, capacity="512KiB")
    try:
        config = _topology(tmp_path, registry, [node.address])
        code, out, err = edgecache("status", *config)
        said = " ".join(err.split())
        assert code == 0, (out, err)  # the node is up: said, the exit code as before
        assert "over its capacity of 512.0 KiB by the pins of a@1" in said, said
        code, out, err = edgecache("status", "--json", *config)
        (shown,) = json.loads(out)
        assert any("over its capacity" in p for p in shown["problems"]), shown
        code, out, err = edgecache("doctor", "--pings", "2", "--seconds", "0.1", "--json", *config)
        (path,) = json.loads(out)["paths"]
        assert code == 1 and any("over its capacity" in p for p in path["problems"]), out
    finally:
        node.stop()


def test_nodes_of_a_region_reporting_one_id_are_flagged(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "a", 4, rows=300)
    publish(registry, f"file://{tmp_path}/a", "a")
    nodes = [
        start_local_node("eu", tmp_path / f"c{i}", registry, extra_args=["--node-id", "eu1"])
        for i in range(2)
    ]
    try:
        config = _topology(tmp_path, registry, [n.address for n in nodes])
        code, out, err = edgecache("status", *config)
        said = " ".join(err.split())
        assert code == 0, (out, err)
        assert said.count("all report node id 'eu1'") == 2, said  # a line for each node
        code, out, err = edgecache("doctor", "--pings", "2", "--seconds", "0.1", "--json", *config)
        assert code == 1, (out, err)
        flagged = [
            p for p in json.loads(out)["paths"] if any("node id" in x for x in p["problems"])
        ]
        assert len(flagged) == 2, out
        code, out, err = edgecache("warm", "a@1", "--region", "eu", *config)
        assert code == 0, (out, err)
        assert " ".join(err.split()).count("all report node id 'eu1'") == 1, err  # once
    finally:
        for node in nodes:
            node.stop()


def test_a_node_started_in_another_region_than_the_topologys_is_flagged(tmp_path: Path) -> None:
    registry = f"file://{tmp_path}/registry"
    node = start_local_node("us", tmp_path / "cache", registry)  # the topology says eu
    try:
        config = _topology(tmp_path, registry, [node.address])
        code, out, err = edgecache("status", *config)
        said = " ".join(err.split())
        assert code == 0 and "it says it is in region 'us', the topology puts it in 'eu'" in said
        code, out, err = edgecache("doctor", "--pings", "2", "--seconds", "0.1", "--json", *config)
        (path,) = json.loads(out)["paths"]
        assert code == 1 and any("--region eu" in p for p in path["problems"]), out
    finally:
        node.stop()


def _two_registries(root: Path) -> tuple[str, str]:
    """Two registries, each with its own tok@1 (other rows): a registry reset, or another."""
    first, second = f"file://{root}/registry-old", f"file://{root}/registry"
    for registry, origin, rows in ((first, "origin-old", 300), (second, "origin-new", 400)):
        write_parquet_shards(root / origin, 2, rows=rows)
        publish(registry, f"file://{root}/{origin}", "tok")
    return first, second


def _warmed_from(root: Path, registry: str) -> LocalNode:
    """A node of region eu reading ``registry``, with its tok@1 staged."""
    node = start_local_node("eu", root / "cache", registry)
    code, out, err = edgecache(
        "warm", "tok@1", "--region", "eu", *_topology(root, registry, [node.address])
    )
    assert code == 0, (out, err)
    return node


def test_a_copy_of_other_content_under_a_versions_name_is_flagged(tmp_path: Path) -> None:
    # The registry was reset (tok@1 published again with other rows) under a node that had
    # cached the old tok@1: the node refuses to serve it and ready calls it missing, while
    # status showed "tok@1 (2/2)" with no note and doctor said ok.
    old, new = _two_registries(tmp_path)
    node = _warmed_from(tmp_path, old)
    try:
        config = _topology(tmp_path, old, [node.address])
        code, out, err = edgecache("status", *config)  # the same content: nothing to say
        assert code == 0 and "other content" not in err, (out, err)
    finally:
        node.stop()
    node = start_local_node("eu", tmp_path / "cache", new)  # the registry moved under it
    try:
        config = _topology(tmp_path, new, [node.address])
        code, out, err = edgecache("status", *config)
        said = " ".join(err.split())
        assert code == 0, (out, err)  # the node is up: said, the exit code as before
        assert "keeps other content under tok@1" in said and "edgecache evict tok@1" in said
        code, out, err = edgecache("doctor", "--pings", "2", "--seconds", "0.1", "--json", *config)
        (path,) = json.loads(out)["paths"]
        assert code == 1 and any("other content" in p for p in path["problems"]), out
    finally:
        node.stop()


def test_a_node_of_another_registry_is_not_told_to_evict_its_copies(tmp_path: Path) -> None:
    # Its copy is its own registry's, which it serves: "keeps other content … evict it" sent
    # the operator to throw good data away; the registry mismatch is what is said.
    theirs, ours = _two_registries(tmp_path)
    node = _warmed_from(tmp_path, theirs)
    try:
        code, out, err = edgecache("status", *_topology(tmp_path, ours, [node.address]))
        said = " ".join(err.split())
        assert "registry's path differs" in said, said
        assert "other content" not in said and "evict" not in said, said
    finally:
        node.stop()


def test_a_registry_that_does_not_answer_holds_status_back_for_seconds_not_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiohttp's own timeout is 5 minutes: status printed nothing for 5 min 1 s.
    import socket
    import time

    from edgecache.cache.storage import filesystem
    from edgecache.clients.ops import NodeReport, registry_digests
    from edgecache.v1 import edge_pb2

    monkeypatch.setattr(filesystem, "HTTP_READ_TIMEOUT", 1.0)  # 30 s by default
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        registry = f"http://127.0.0.1:{silent.getsockname()[1]}/reg"
        held = edge_pb2.ResidentVersion(dataset="tok", version=1, shard_count=2, digest="d" * 64)
        status = edge_pb2.NodeStatus(registry=registry, versions=[held])
        started = time.monotonic()
        digests = registry_digests(registry, [NodeReport("eu", "n:1", True, 1.0, status)], 1.0)
        took = time.monotonic() - started
    assert digests is None, digests  # not read: said so, nothing judged
    assert took < 10, took


def test_a_registry_that_fails_at_once_leaves_the_copies_unchecked_not_judged() -> None:
    # A failure that came back before the timeout (here: each connection closed at once)
    # read as "read, nothing to flag" ({}), where a timeout said "not checked" (None).
    import socket
    import threading

    from edgecache.clients.ops import NodeReport, registry_digests
    from edgecache.v1 import edge_pb2

    with socket.create_server(("127.0.0.1", 0)) as closing:

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = closing.accept()
                except OSError:
                    return
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        registry = f"http://127.0.0.1:{closing.getsockname()[1]}/reg"
        held = edge_pb2.ResidentVersion(dataset="tok", version=1, shard_count=2, digest="d" * 64)
        status = edge_pb2.NodeStatus(registry=registry, versions=[held])
        digests = registry_digests(registry, [NodeReport("eu", "n:1", True, 1.0, status)], 60.0)
    assert digests is None, digests
