"""A node's NOT_FOUND to Evict is "nothing of it held here", and a missing registry is named.

Since a node answers Evict of a version it holds nothing of, and that the
registry does not publish, with NOT_FOUND, evicting an unpublished version
from a region of two nodes, one of which held it, showed the other node as a
failure (exit 1) although the version was gone; the executor (warm, the
controller) counted it as a failed eviction. The error's advice also came
twice: the node's words name `edgecache versions`, and the client added its
own hint for NOT_FOUND. And a plan against a registry URL that points
nowhere said only "b@1 does not exist in the registry". Real nodes on
loopback, file:// registries, the CLI as a process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import edgecache, publish, stub, write_parquet_shards

from edgecache.cache.planner import Eviction
from edgecache.clients.channels import describe, explain, node_error
from edgecache.clients.executor import PlanExecutor
from edgecache.clients.topology import Schedule, load_topology
from edgecache.edge.config import NodeConfig
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2


def _config(root: Path, name: str) -> NodeConfig:
    return NodeConfig(
        region="pair",
        cache_dir=root / f"cache-{name}",
        registry=f"file://{root}/registry",
        listen="127.0.0.1:0",
        sync=False,
    )  # type: ignore[call-arg]


@dataclass
class Pair:
    """Region ``pair``: node ``holder`` holds pq@1, ``other`` nothing; pq@1 is unpublished."""

    root: Path
    holder: str
    other: str
    topology: Path


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 1, rows=300)
    publish(registry, f"file://{tmp_path}/origin", "pq")
    publish(registry, f"file://{tmp_path}/origin", "pq")  # pq@2 stays published
    with running_node(_config(tmp_path, "a")) as a, running_node(_config(tmp_path, "b")) as b:
        list(stub(a.address).Stage(edge_pb2.StageRequest(dataset="pq", version=1)))
        (tmp_path / "registry" / "pq" / "versions" / "1.json").unlink()
        topology = tmp_path / "pair.yaml"
        topology.write_text(
            f"registry: {registry}\nregions:\n  pair:\n    nodes: ['{a.address}', '{b.address}']\n"
        )
        yield Pair(tmp_path, a.address, b.address, topology)


def _held(address: str) -> list[tuple[str, int]]:
    versions = stub(address).Status(edge_pb2.StatusRequest()).versions
    return [(v.dataset, v.version) for v in versions if v.shard_count]


def test_evict_counts_a_node_that_holds_nothing_of_it_as_zero_bytes(pair: Pair) -> None:
    """The node without the version answers NOT_FOUND: 0 bytes freed there, not a failure."""
    assert _held(pair.holder) == [("pq", 1)] and _held(pair.other) == []
    config = ["--config", str(pair.topology)]
    code, out, err = edgecache("evict", "pq@1", "--json", *config)
    assert code == 0, (out, err)
    rows = {row["node"]: row for row in json.loads(out)}
    assert rows[pair.holder]["bytes_freed"] > 0 and rows[pair.holder]["error"] is None, rows
    assert rows[pair.other] == {
        "region": "pair",
        "node": pair.other,
        "bytes_freed": 0,
        "error": None,
        "refused": False,
        "pinned": False,
    }
    assert _held(pair.holder) == []
    # Gone everywhere now, and not published: bad input, said once with what to run.
    code, out, err = edgecache("evict", "pq@1", *config)
    assert code == 2, (code, out, err)
    assert "pq@1" in err and err.count("edgecache versions pq") == 1, err
    # The registry as a file:// URL, and the command pasted lists it (a helper's hunt).
    said = " ".join(err.split())
    command = said.split("list versions with: edgecache ")[1].split(";")[0].rstrip(". ")
    assert "published in file://" in said and "--registry file://" in command, said
    code, out, err = edgecache(*command.split())
    assert code == 0 and "pq@1" not in out, (code, out, err)


def test_evict_prints_the_empty_node_as_freeing_nothing(pair: Pair) -> None:
    code, out, err = edgecache("evict", "pq@1", "--config", str(pair.topology))
    assert code == 0, (out, err)
    assert (
        f"pair {pair.other}: freed nothing (no shard of pq@1 there)" in out
        and "freed 0 B" not in out
    ), out
    assert "NOT_FOUND" not in out + err and pair.other not in err, err


def test_the_executor_counts_not_found_as_nothing_held(pair: Pair) -> None:
    """warm's and the controller's evictions: the empty node is no failed eviction."""
    stored = sum(
        v.stored_bytes for v in stub(pair.holder).Status(edge_pb2.StatusRequest()).versions
    )
    now = datetime.now(UTC)
    eviction = Eviction("pair", ("pq", 1), stored, now, None, "not needed again")
    executor = PlanExecutor(load_topology(pair.topology))
    done = executor.evict(eviction, Schedule(jobs=[]), {})
    assert done.problem is None, done
    assert done.freed == stored > 0
    assert _held(pair.holder) == []
    assert pair.other not in executor.calls.down


def test_a_nodes_not_found_advice_is_given_once(pair: Pair) -> None:
    """The node names `edgecache versions pq`; the client's NOT_FOUND hint said it again."""
    with pytest.raises(grpc.RpcError) as missing:
        stub(pair.other).Evict(edge_pb2.EvictRequest(dataset="pq", version=1))
    error = missing.value
    assert error.code() == grpc.StatusCode.NOT_FOUND, error
    for text in (
        explain(error),
        str(node_error(error, endpoint=pair.other, what="evicting pq@1")),
    ):
        assert text.count("edgecache versions") == 1, text
    # A NOT_FOUND whose words give no advice still gets the client's.
    with pytest.raises(grpc.RpcError) as unknown:
        stub(pair.other).ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="nope"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, unknown.value
    said = explain(unknown.value)
    assert "edgecache versions" in said, said
    assert said.count("edgecache versions") == 1, said
    assert describe(unknown.value).startswith("NOT_FOUND: "), describe(unknown.value)


def test_plan_names_a_registry_that_does_not_exist(pair: Pair) -> None:
    """The topology's registry URL points nowhere: plan says so, naming the URL."""
    nowhere = f"file://{pair.root}/nowhere/registry"
    topology = pair.root / "nowhere.yaml"
    topology.write_text(
        f"registry: {nowhere}\nregions:\n  pair:\n    nodes: ['{pair.holder}', '{pair.other}']\n"
    )
    schedule = pair.root / "schedule.yaml"
    start = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    schedule.write_text(
        f"jobs:\n  - name: job-b\n    region: pair\n    start: '{start}'\n"
        "    duration: 1h\n    datasets: [b@1]\n"
    )
    config = ["--config", str(topology)]
    code, out, err = edgecache("plan", str(schedule), "--json", *config)
    assert code == 3, (code, out, err)
    (row,) = json.loads(out)["infeasible"]
    assert row["version"] == "b@1", row
    assert f"the registry {nowhere} does not exist" in row["reason"], row
    assert "b@1" in row["reason"] and "check the registry URL" in row["reason"], row
    code, out, err = edgecache("plan", str(schedule), *config)
    assert code == 3, (code, out, err)
    said = " ".join("".join(c for c in out if c not in "│┃").split())
    assert "does not exist" in said and "check the registry URL" in said, out
    code, out, err = edgecache("controller", "--schedule", str(schedule), "--once", *config)
    said = " ".join((out + err).split())
    # The controller refuses a local registry that does not exist (its lease used to
    # create the directory, and the registry then "held no datasets").
    assert code == 2, (code, out, err)
    assert nowhere in said and "does not exist" in said, (code, out, err)
    assert not (pair.root / "nowhere").exists()
    # Nor does warm create it (its record of the jobs it pinned for went there).
    code, out, err = edgecache("warm", str(schedule), *config)
    assert code != 0 and "does not exist" in " ".join((out + err).split()), (code, out, err)
    assert not (pair.root / "nowhere").exists()


def test_the_listing_of_a_registry_with_credentials_reads_the_topology() -> None:
    """``--registry URL`` printed without the URL's credentials (as every tool shows it)
    would not read the registry; the topology given, which names it whole, does."""
    from edgecache.clients.ops.eviction import listing_command

    assert listing_command("https://ops:s3cret@reg.example/r", "pq", " --config t.yaml") == (
        "edgecache versions pq --config t.yaml"
    )
    assert "s3cret" not in listing_command("https://ops:s3cret@reg.example/r", "pq")
    assert listing_command("/srv/reg", "pq", " --config t.yaml") == (
        "edgecache versions pq --registry file:///srv/reg"
    )


def test_a_bad_version_is_not_told_to_evict_latest(tmp_path: Path) -> None:
    """``evict b@x`` advised ``b@latest``, which evict then refused (a helper's hunt)."""
    topology = tmp_path / "t.yaml"
    topology.write_text(
        f"registry: file://{tmp_path}/registry\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    for spec in ("b@x", "b@0"):
        code, out, err = edgecache("evict", spec, "--config", str(topology))
        said = " ".join(err.split())
        assert code == 2 and "b@N with N a positive integer" in said, (out, err)
        assert "latest" not in said, said


def test_an_unpublished_version_with_a_node_down_is_a_failure_to_retry_not_unknown(
    pair: Pair, closed_port: int
) -> None:
    """A helper's hunt: with the node that held it down, evicting an unpublished version said
    it was "neither published … nor held by any node" (exit 2, bad input) though that node
    held it: only the nodes that answered said so. Now the down node is a failure (exit 1)."""
    down = f"127.0.0.1:{closed_port}"
    topology = pair.root / "down.yaml"
    topology.write_text(
        f"registry: file://{pair.root}/registry\n"
        f"regions:\n  pair:\n    nodes: ['{pair.other}', '{down}']\n"
    )
    code, out, err = edgecache("evict", "pq@1", "--json", "--config", str(topology))
    assert code == 1, (code, out, err)
    assert "neither published" not in err, err
    rows = {row["node"]: row for row in json.loads(out)}
    assert rows[pair.other]["error"] is None and rows[pair.other]["bytes_freed"] == 0, rows
    assert rows[down]["error"] and down in rows[down]["error"], rows
