"""A node set up with another registry than the topology's: status, doctor and warm say so.

Such a node answered health checks and ``status`` like any other, and the
mismatch showed only when ``warm`` failed NOT_FOUND naming the node's
registry. Nodes now report their registry (``NodeStatus.registry``, without
credentials); ``status`` flags a node that reads another, ``doctor`` fails it
naming both and what to set, and ``warm`` refuses to stage on it before any
Stage call. Real nodes on loopback, a registry on moto's S3 server, a
``file://`` origin, the CLI in process.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from edgeutil import node_settings, publish, stub, write_parquet_shards
from s3server import make_bucket
from typer.testing import CliRunner

from edgecache.cache.registry_match import RegistryMatch, check_registry, registry_key, shown_url
from edgecache.clients.cli import app
from edgecache.edge.node import EdgeNode
from edgecache.edge.server import running_node
from edgecache.v1 import edge_pb2

runner = CliRunner()


def cli(topology: Path, *args: str):  # noqa: ANN201 - click's Result
    return runner.invoke(app, [*args, "--config", str(topology)], env={"COLUMNS": "200"})


def held(address: str) -> dict[str, int]:
    """name@N → shards the node holds."""
    status = stub(address).Status(edge_pb2.StatusRequest())
    return {f"{v.dataset}@{v.version}": v.shard_count for v in status.versions}


@pytest.fixture
def site(s3_endpoint: str, tmp_path: Path) -> Iterator[tuple[Path, str, dict[str, str]]]:
    """d@1 (2 shards) in s3://BUCKET/_edgecache, and a topology naming it with a trailing slash.

    Region eu: a node reading s3://BUCKET/other (the wrong one) and one reading the
    registry; region us: one node reading the registry. Returns (topology file, the
    registry, role → address).
    """
    bucket = f"reg-{uuid.uuid4().hex[:10]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "origin", 2, rows=300)
    registry = f"s3://{bucket}/_edgecache"
    publish(registry, f"file://{tmp_path}/origin", "d")
    origins = {"origins": f"file://{tmp_path}/origin/"}

    def settings(name: str, registry: str, region: str):  # noqa: ANN202
        return node_settings(
            tmp_path, registry, region=region, cache_dir=tmp_path / f"cache-{name}", **origins
        )

    with (
        running_node(settings("wrong", f"s3://{bucket}/other", "eu")) as wrong,
        running_node(settings("right", registry, "eu")) as right,
        running_node(settings("us", registry, "us")) as us,
    ):
        topology = tmp_path / "edgecache.yaml"
        topology.write_text(
            f"registry: {registry}/\nregions:\n"  # another spelling of the same registry
            f"  eu:\n    nodes: ['{wrong.address}', '{right.address}']\n"
            f"  us:\n    nodes: ['{us.address}']\n"
        )
        yield topology, registry, {"wrong": wrong.address, "right": right.address, "us": us.address}


def test_status_shows_a_node_reading_another_registry(site) -> None:
    topology, registry, nodes = site
    bucket = registry.split("/")[2]
    result = cli(topology, "status", "--json")
    assert result.exit_code == 0, result.output  # every node answers: the flag is no outage
    by_node = {n["node"]: n for n in json.loads(result.stdout)}
    wrong = by_node[nodes["wrong"]]
    assert wrong["registry"] == f"s3://{bucket}/other", wrong
    assert wrong["registry_match"] == "differs", wrong
    for role in ("right", "us"):  # the topology's trailing slash is the same registry
        assert by_node[nodes[role]]["registry"] == registry, by_node[nodes[role]]
        assert by_node[nodes[role]]["registry_match"] == "same", by_node[nodes[role]]

    result = cli(topology, "status")
    assert result.exit_code == 0, result.output
    assert "other registry" in result.stdout, result.stdout  # in the node's health cell
    (said,) = [line for line in result.stderr.splitlines() if "another registry" in line]
    assert said.startswith(f"eu: another registry: {nodes['wrong']} reads the registry "), said
    assert f"s3://{bucket}/other, not the one the topology names ({registry}/)" in said, said
    assert "EDGECACHE_REGISTRY" in said and "site.env" in said, said
    assert nodes["right"] not in result.stderr and nodes["us"] not in result.stderr


def test_doctor_fails_a_node_reading_another_registry(site) -> None:
    topology, registry, nodes = site
    bucket = registry.split("/")[2]
    result = cli(topology, "doctor", "--pings", "2", "--seconds", "0.1", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and not report["ok"], result.output
    paths = {p["node"]: p for p in report["paths"]}
    wrong = paths[nodes["wrong"]]
    assert wrong["registry"] == f"s3://{bucket}/other" and wrong["registry_match"] == "differs"
    (problem,) = [p for p in wrong["problems"] if "registry" in p]
    assert f"reads the registry s3://{bucket}/other" in problem, problem
    assert f"the topology names ({registry}/)" in problem, problem
    assert "EDGECACHE_REGISTRY" in problem and "deploy/k8s/base/site.env" in problem, problem
    for role in ("right", "us"):
        path = paths[nodes[role]]
        assert path["registry_match"] == "same", path
        assert not [p for p in path["problems"] if "registry" in p], path
        assert path["warnings"] == [], path


def test_warm_refuses_a_node_reading_another_registry_before_staging(site) -> None:
    topology, registry, nodes = site
    bucket = registry.split("/")[2]
    rehearsed = cli(topology, "warm", "d@1", "--region", "eu", "--dry-run", "--json")
    assert rehearsed.exit_code == 1, rehearsed.output  # as the real run will
    (row,) = json.loads(rehearsed.stdout)["items"]
    assert row["failures"][0].startswith(f"not staging d@1: {nodes['wrong']} reads"), row
    result = cli(topology, "warm", "d@1", "--region", "eu", "--json")
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)["items"]
    (failure,) = row["failures"]
    assert failure.startswith(f"not staging d@1: {nodes['wrong']} reads the registry "), failure
    assert f"s3://{bucket}/other, not the one the topology names ({registry}/)" in failure
    assert "NOT_FOUND" in failure and "EDGECACHE_REGISTRY" in failure, failure
    # Never asked to stage: no Stage call reached it (it would have failed NOT_FOUND, or
    # staged another registry's d@1); the node of the right registry staged its share.
    assert held(nodes["wrong"]) == {}
    wrong_status = stub(nodes["wrong"]).Status(edge_pb2.StatusRequest())
    assert wrong_status.staged_origin_bytes == 0 and wrong_status.misses == 0
    assert held(nodes["right"]) == {"d@1": 2}  # its share too: where readers look next
    # The same registry spelled with a trailing slash (the topology's) is no mismatch.
    result = cli(topology, "warm", "d@1", "--region", "us", "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["items"]
    assert row["done"] and row["failures"] == [] and row["notes"] == [], row
    assert held(nodes["us"]) == {"d@1": 2}


def test_warm_of_a_schedule_refuses_it_too(site) -> None:
    """The plan's executor (warm SCHEDULE, the controller) checks the round's status."""
    topology, registry, nodes = site
    start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    schedule = topology.parent / "schedule.yaml"
    schedule.write_text(
        f"jobs:\n  - name: train\n    region: eu\n    start: '{start}'\n    datasets: [d@1]\n"
    )
    rehearsed = cli(topology, "warm", str(schedule), "--dry-run", "--json")
    assert rehearsed.exit_code == 1, rehearsed.output  # as the real run will
    (row,) = json.loads(rehearsed.stdout)["items"]
    assert row["failures"][0].startswith(f"not staging d@1: {nodes['wrong']} reads"), row
    assert held(nodes["right"]) == {}  # a rehearsal: nothing staged
    result = cli(topology, "warm", str(schedule), "--json")
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)["items"]
    (failure,) = row["failures"]
    assert failure.startswith(f"not staging d@1: {nodes['wrong']} reads the registry "), failure
    assert f"not the one the topology names ({registry}/)" in failure, failure
    assert held(nodes["wrong"]) == {} and held(nodes["right"]) == {"d@1": 2}


def _one_node(root: Path, registry: str, address: str) -> Path:
    """A topology of region eu, one node, naming ``registry``."""
    topology = root / "edgecache.yaml"
    topology.write_text(f"registry: {registry}\nregions:\n  eu:\n    nodes: ['{address}']\n")
    return topology


def test_a_local_registry_at_another_path_is_a_warning_not_a_refusal(tmp_path: Path) -> None:
    """One folder, two paths (as a container's volume would mount it): a file:// path is
    read on each host, so a path that differs may be the same registry. Said, not refused."""
    registry = tmp_path / "registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=300)
    publish(f"file://{registry}", f"file://{tmp_path}/origin", "d")
    (tmp_path / "mounted").symlink_to(registry)  # the CLI's view of the same folder
    with running_node(node_settings(tmp_path, f"file://{registry}")) as node:
        topology = _one_node(tmp_path, f"file://{tmp_path}/mounted", node.address)
        result = cli(topology, "status", "--json")
        assert result.exit_code == 0, result.output
        (status,) = json.loads(result.stdout)
        assert status["registry"] == f"file://{registry}", status
        assert status["registry_match"] == "path_differs", status
        result = cli(topology, "status")
        assert "registry path differs" in result.stdout, result.stdout
        assert "the registry's path differs" in result.stderr, result.stderr
        result = cli(topology, "doctor", "--pings", "2", "--seconds", "0.1", "--json")
        (path,) = json.loads(result.stdout)["paths"]
        assert not [p for p in path["problems"] if "registry" in p], path
        (warning,) = path["warnings"]
        assert f"reads the registry file://{registry}" in warning, warning
        assert f"the topology names file://{tmp_path}/mounted" in warning, warning
        result = cli(topology, "warm", "d@1", "--region", "eu", "--json")
        assert result.exit_code == 0, result.output
        (row,) = json.loads(result.stdout)["items"]
        assert row["done"], row
        assert any("may be one folder mounted at different paths" in n for n in row["notes"])
        assert held(node.address) == {"d@1": 2}


def test_a_node_that_does_not_say_its_registry_is_unknown_not_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node built before NodeStatus.registry answers it empty: nothing is refused or failed."""
    registry = f"file://{tmp_path}/registry"
    write_parquet_shards(tmp_path / "origin", 2, rows=300)
    publish(registry, f"file://{tmp_path}/origin", "d")
    status = EdgeNode.status

    def older(self: EdgeNode) -> edge_pb2.NodeStatus:
        answer = status(self)
        answer.ClearField("registry")
        return answer

    monkeypatch.setattr(EdgeNode, "status", older)
    with running_node(node_settings(tmp_path, registry)) as node:
        # Another spelling than the node's, which it does not say anyway.
        topology = _one_node(tmp_path, f"{tmp_path}/registry/", node.address)
        result = cli(topology, "status", "--json")
        assert result.exit_code == 0, result.output
        (answer,) = json.loads(result.stdout)
        assert answer["registry"] is None and answer["registry_match"] == "unknown", answer
        assert "registry" not in cli(topology, "status").stderr
        result = cli(topology, "doctor", "--pings", "2", "--seconds", "0.1", "--json")
        (path,) = json.loads(result.stdout)["paths"]
        assert path["registry_match"] == "unknown" and path["registry"] is None, path
        assert not [p for p in path["problems"] + path["warnings"] if "registry" in p], path
        result = cli(topology, "warm", "d@1", "--region", "eu", "--json")
        assert result.exit_code == 0, result.output
        assert held(node.address) == {"d@1": 2}


def test_a_node_reports_its_registry_without_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry URL may carry a user:password or a signed query: Status (which any client
    allowed to read may call) shows neither, nor does the node's log."""
    url = "https://reader:s3cret@127.0.0.1:9/_edgecache/?X-Amz-Signature=abc#frag"
    with caplog.at_level(logging.INFO), running_node(node_settings(tmp_path, url)) as node:
        said = stub(node.address).Status(edge_pb2.StatusRequest()).registry
    # The registry's own errors, passed on to readers, named it as configured.
    hidden = "memory://reader:s3cret@host/reg"
    with running_node(node_settings(tmp_path / "m", hidden)) as node:
        with pytest.raises(grpc.RpcError) as refused:
            stub(node.address).ResolveVersion(edge_pb2.ResolveVersionRequest(dataset="nope"))
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, details
    assert "memory://host/reg" in details and "s3cret" not in details, details
    assert "serving on" in caplog.text and "https://127.0.0.1:9/_edgecache" in caplog.text
    assert "s3cret" not in caplog.text and "Signature" not in caplog.text, caplog.text
    assert said == "https://127.0.0.1:9/_edgecache", said
    assert "s3cret" not in said and "reader" not in said and "Signature" not in said


def test_registry_spellings_compare_as_one() -> None:
    assert registry_key("file:///srv/reg/") == registry_key("file:///srv/reg") == "file:///srv/reg"
    assert registry_key("/srv/reg") == "file:///srv/reg"
    assert registry_key("s3://b/p/") == registry_key("s3://b/p") == "s3://b/p"
    assert registry_key("S3://b/p") == "s3://b/p"
    # One store however fsspec is told to reach it: a cache chained in front, an alias of
    # the protocol, a default port (each refused every node as "another registry").
    assert registry_key("simplecache::s3://b/p") == registry_key("s3://b/p")
    assert registry_key("gcs://b/p/") == registry_key("gs://b/p") == "gs://b/p"
    assert registry_key("https://h:443/r") == registry_key("https://h/r") == "https://h/r"
    assert registry_key("https://h:8443/r") != registry_key("https://h/r")
    assert shown_url("s3://key:secret@b/p?x=1") == "s3://b/p"
    assert shown_url("simplecache::https://u:p@h/r?t=1") == "simplecache::https://h/r"
    assert shown_url("file:///data/a@b/c?d") == "file:///data/a@b/c?d"  # a path, kept whole
    assert check_registry("n", "s3://b/p/", "s3://b/p").match is RegistryMatch.SAME
    assert check_registry("n", "file:///x/", "file:///x").match is RegistryMatch.SAME
    assert check_registry("n", "s3://b/p", "").match is RegistryMatch.UNKNOWN
    differs = check_registry("n", "s3://b/p", "s3://b/q")
    assert differs.match is RegistryMatch.DIFFERS and differs.refuses
    # A local path on either side may be the same registry seen from another host.
    for ours, theirs in (("file:///x", "file:///y"), ("file:///mnt/b/p", "s3://b/p")):
        local = check_registry("n", ours, theirs)
        assert local.match is RegistryMatch.PATH_DIFFERS and not local.refuses
    assert check_registry("n", "s3://b/p", "s3://b/p").message() == ""
    # A topology's bare path is named as the URL it is read as (a helper's hunt).
    said = check_registry("n", "/srv/reg", "file:///mnt/reg").message()
    assert "the topology names file:///srv/reg:" in said, said
