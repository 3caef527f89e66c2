"""The ops CLI through its real entry point, against edge nodes on loopback."""

from __future__ import annotations

import builtins
import inspect
import json
import re
import shlex
import symtable
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import write_parquet_shards
from typer.testing import CliRunner

from edgecache.clients.cli import app
from edgecache.clients.node_client import LocalNode, start_local_node

runner = CliRunner()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, LocalNode]]]:
    root = tmp_path_factory.mktemp("site")
    write_parquet_shards(root / "origin", 3, rows=500)
    registry = f"file://{root}/registry"
    nodes = {r: start_local_node(r, root / f"cache-{r}", registry) for r in ("eu-west", "us-east")}
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\n"
        "regions:\n"
        f"  eu-west:\n    nodes: ['{nodes['eu-west'].address}']\n    origin_bandwidth: 1Gbit/s\n"
        f"  us-east:\n    nodes: ['{nodes['us-east'].address}']\n"
    )
    yield root, nodes
    for node in nodes.values():
        node.stop()


def cli(root: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, [*args, "--config", str(root / "edgecache.yaml")])
    return result.exit_code, result.output


def test_publish_plan_warm_status_ready_evict(site) -> None:
    root, nodes = site
    code, out = cli(root, "publish", f"file://{root}/origin", "--dataset", "tokens", "--json")
    assert code == 0, out
    assert json.loads(out)["version"] == "tokens@1" and json.loads(out)["number"] == 1
    code, out = cli(root, "versions", "tokens", "--json")
    assert code == 0 and json.loads(out)[0]["shards"] == 3
    start = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    schedule = root / "schedule.yaml"
    schedule.write_text(
        "jobs:\n"
        f"  - name: train-eu\n    region: eu-west\n    start: '{start}'\n    datasets: [tokens]\n"
        f"  - name: train-missing\n    region: us-east\n    start: '{start}'\n"
        "    datasets: [nope@4]\n"
    )
    code, out = cli(root, "plan", str(schedule), "--json")
    assert code == 3, out  # a job cannot be met: its own exit code
    planned = json.loads(out)
    assert [t["version"] for t in planned["regions"]["eu-west"]["tasks"]] == ["tokens@1"]
    assert [p["version"] for p in planned["regions"]["eu-west"]["pins"]] == ["tokens@1"]
    assert planned["infeasible"][0]["job"] == "train-missing"
    code, out = cli(root, "plan", str(schedule), "--explain")
    assert code == 3 and "cannot be met" in out and "tokens@1" in out
    assert "eu-west: tokens@1 from origin: origin: no peer region holds it in time" in out, out
    # --explain was accepted beside --json and said nothing there (a helper's hunt)
    code, out = cli(root, "plan", str(schedule), "--explain", "--json")
    assert code == 3, out
    (task,) = json.loads(out)["regions"]["eu-west"]["tasks"]
    assert task["source_reason"] == "origin: no peer region holds it in time", task
    assert (
        "source_reason"
        not in json.loads(cli(root, "plan", str(schedule), "--json")[1])["regions"]["eu-west"][
            "tasks"
        ][0]
    )
    code, out = cli(root, "plan", str(schedule), "--explain", "--status")
    assert code == 2 and "drop one of them" in out, out
    code, out = cli(root, "ready", "tokens@1", "--region", "eu-west")
    assert code == 1 and "0/3 shards" in out
    code, out = cli(root, "warm", str(schedule))
    assert code == 3, out  # eu-west staged; the missing version is reported
    assert "train-missing" in out and "warm: 1 of 1 item(s) staged" in out
    code, out = cli(root, "ready", "tokens@1", "--region", "eu-west")
    assert code == 0, out
    code, out = cli(root, "warm", str(schedule))  # again: resumes, nothing left to fetch
    assert code == 3, out
    code, out = cli(root, "status", "--json")
    assert code == 0, out
    eu = next(n for n in json.loads(out) if n["region"] == "eu-west")
    assert eu["versions"][0]["version"] == "tokens@1" and eu["versions"][0]["pinned_until"]
    # held / total, as the table shows it, so a partly staged version can be spotted
    assert eu["versions"][0]["shards"] == eu["versions"][0]["total_shards"] == 3
    code, out = cli(root, "warm", "tokens@1", "--region", "us-east", "--dry-run")
    assert code == 0 and "us-east: would stage tokens@1 (" in out and ") from origin" in out
    code, out = cli(root, "evict", "tokens@1", "--region", "eu-west")
    assert code == 2 and "pinned" in out and "--force" in out  # train-eu still needs it
    code, out = cli(root, "evict", "tokens@1", "--region", "us-east", "--json")
    assert code == 0 and json.loads(out) == [
        {
            "region": "us-east",
            "node": nodes["us-east"].address,
            "bytes_freed": 0,
            "error": None,
            "refused": False,
            "pinned": False,
        }
    ]
    code, out = cli(root, "evict", "tokens@1", "--region", "eu-west", "--force", "--json")
    assert code == 0, out
    (freed,) = json.loads(out)
    assert freed["region"] == "eu-west" and freed["bytes_freed"] > 0 and freed["error"] is None
    code, out = cli(root, "ready", "tokens@1", "--region", "eu-west")
    assert code == 1


def test_bad_files_give_clear_errors(site, tmp_path: Path) -> None:
    root, _ = site
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "jobs:\n  - name: a\n    region: eu-west\n    start: 2026-12-01T08:00:00\n"
        "    datasets: [x]\n"
    )
    code, out = cli(root, "plan", str(bad))
    assert code == 2 and "bad.yaml:4: jobs.0.start" in out and "timezone" in out
    bad.write_text(
        "jobs:\n  - name: a\n    region: mars\n    start: 2026-12-01T08:00:00Z\n    datasets: [x]\n"
    )
    code, out = cli(root, "plan", str(bad))
    assert code == 2 and "region 'mars'" in out
    bad.write_text("jobs: [\n")
    code, out = cli(root, "plan", str(bad))
    assert code == 2 and "not valid YAML" in out
    dup = "  - name: a\n    region: eu-west\n    start: 2026-12-01T08:00:00Z\n    datasets: [x]\n"
    bad.write_text("jobs:\n" + dup + dup)
    code, out = cli(root, "plan", str(bad))
    assert code == 2 and "appears twice" in out
    code, out = cli(root, "doctor", "--region", "mars")
    assert code == 2 and "--region 'mars' is not in the topology" in out and "eu-west" in out
    code, out = cli(root, "doctor", "--seconds", "-1")
    assert code == 2 and "--seconds" in out
    topology = tmp_path / "typo.yaml"
    topology.write_text("registry: file:///x\nregions:\n  eu-west:\n    nodes: [nothostport]\n")
    result = runner.invoke(app, ["status", "--config", str(topology)])
    assert result.exit_code == 2
    assert "typo.yaml:4: regions.eu-west.nodes.0: 'nothostport' is not host:port" in result.output
    code, out = cli(root, "publish", f"file://{tmp_path}/empty", "--dataset", "e")
    assert code == 2 and "no objects under" in out
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.csv").write_text("x\n1\n")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"x": 1}\n')
    code, out = cli(root, "publish", f"file://{tmp_path}/mixed", "--dataset", "m")
    # Two formats, each known: which objects are which, and that --format cannot help.
    assert code == 2 and "several formats (CSV: a.csv (1); JSON Lines: b.jsonl (1))" in out, out
    assert "a prefix of their own" in out
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "a.xyz").write_text("x\n1\n")
    code, out = cli(root, "publish", f"file://{tmp_path}/odd", "--dataset", "o")
    assert code == 2 and "cannot tell the format" in out and "--format" in out, out


def test_doctor_measures_paths_and_host(site) -> None:
    root, _ = site
    result = runner.invoke(
        app,
        [
            "doctor",
            "--config",
            str(root / "edgecache.yaml"),
            "--region",
            "eu-west",
            "--pings",
            "5",
            "--seconds",
            "0.5",
            "--json",
        ],
    )
    report = json.loads(result.output)
    assert {p["region"] for p in report["paths"]} == {"eu-west", "us-east"}
    assert all(p["rtt_ms"] is not None and p["rtt_ms"] > 0 for p in report["paths"])
    assert report["host"]["congestion_control"] and report["host"]["bdp_bytes"] > 0
    assert result.exit_code == (0 if report["ok"] else 1)
    # Loopback paths are a clean bill of health: no socket-buffer floor is mistaken for a
    # bandwidth-delay product, only a missing BBR can be a problem here.
    assert all("BDP" not in p for p in report["host"]["problems"]), report["host"]
    for path in report["paths"]:  # loss is TCP's, from the multi-stream upload
        assert path["streams"] == 4 and path["upload_mb_s"] > 0, path
        assert not [p for p in path["problems"] if "refused" in p], path
        # A loaded host retransmits on loopback too (a full socket buffer): a loss the
        # doctor measured is a measurement, not a false report (as tests/test_doctor.py's
        # assert_sound). A loss said without a retransmission counted is a defect.
        measured = path["segments_retransmitted"] > 0
        assert all(measured for p in path["problems"] if p.startswith("loss ")), path
    if report["host"]["problems"]:
        assert any(f.startswith("sysctl -w ") for f in report["host"]["fixes"])


def test_unreachable_node_is_reported_and_others_go_on(site, tmp_path: Path) -> None:
    root, nodes = site
    topology = tmp_path / "edgecache.yaml"
    topology.write_text(
        (root / "edgecache.yaml").read_text() + "  ap-south:\n    nodes: ['127.0.0.1:9']\n"
    )
    result = runner.invoke(app, ["status", "--config", str(topology)])
    assert result.exit_code == 1
    assert "down" in result.output and "eu-west" in result.output


def test_demo_completes_and_prints_its_summary() -> None:
    result = runner.invoke(app, ["demo", "--size-mib", "8", "--shards", "2"])
    assert result.exit_code == 0, result.output
    for text in ("plan: eu-west: stage demo-tokens@1", "training epoch via EdgeDataset", "yes"):
        assert text in result.output


def test_warm_interrupted_then_resumed(site, tmp_path: Path) -> None:
    """Ctrl-C at warm's first progress event leaves the version not ready; warm again finishes.

    The node has a staging rate cap of its own (4 s for the version), so it
    cannot have staged every shard before the client reads that first event, however
    loaded the machine (40 uncapped shards on the shared node were staged before it once).
    """
    import threading

    from edgeutil import publish

    from edgecache.clients.ops import WarmItem, gather_status, ready, warm
    from edgecache.clients.topology import load_topology

    root, _ = site
    write_parquet_shards(tmp_path / "more", 8, rows=3000)
    manifest = publish(f"file://{root}/registry", f"file://{tmp_path}/more", "more")
    source = sum(s.source_size for s in manifest.shards)
    # half a second a shard at the cap, 4 s the version: one shard takes far longer
    # than the client takes to read an event and cancel
    node = start_local_node(
        "us-east",
        tmp_path / "cache",
        f"file://{root}/registry",
        extra_args=["--staging-rate", f"{max(source // 4, 1)}B/s"],
        env={"EDGECACHE_STAGING_CONCURRENCY": "1"},
    )
    try:
        (tmp_path / "edgecache.yaml").write_text(
            f"registry: file://{root}/registry\n"
            f"regions:\n  us-east:\n    nodes: ['{node.address}']\n"
        )
        topology = load_topology(tmp_path / "edgecache.yaml")
        nodes = topology.regions["us-east"].nodes
        stop = threading.Event()
        first = WarmItem("us-east", "more@1", nodes, 1)
        warm([first], on_progress=lambda item: stop.set(), stop=stop)  # "Ctrl-C" at once
        assert not first.done
        ok, _ = ready(gather_status(topology), "us-east", manifest)
        assert not ok
        again = WarmItem("us-east", "more@1", nodes, 1)
        warm([again])
        assert again.done and not again.failures, again.failures
        assert ready(gather_status(topology), "us-east", manifest)[0]
    finally:
        node.stop()


def test_publish_and_versions_against_s3(s3_endpoint: str, tmp_path: Path) -> None:
    import uuid

    from s3server import make_bucket, upload_dir

    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    write_parquet_shards(tmp_path / "raw", 2, rows=100)
    upload_dir(s3_endpoint, bucket, "raw", tmp_path / "raw")
    registry = f"s3://{bucket}/_edgecache"
    for expected in ("tokens@1", "tokens@2"):
        result = runner.invoke(
            app,
            [
                "publish",
                f"s3://{bucket}/raw",
                "--dataset",
                "tokens",
                "--registry",
                registry,
                "--json",
            ],
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["version"] == expected  # name@N, as warm takes it
    result = runner.invoke(app, ["versions", "tokens", "--registry", registry, "--json"])
    listed = json.loads(result.output)
    assert [v["version"] for v in listed] == [1, 2] and listed[0]["digest"] == listed[1]["digest"]
    result = runner.invoke(app, ["versions", "nope", "--registry", registry])
    assert result.exit_code == 2, result.output  # a typo is not an empty answer
    assert "'nope' has no versions" in result.output and "which holds tokens" in result.output


def test_replicas_split_shards_by_rendezvous_hashing(tmp_path: Path) -> None:
    import torch
    from edgeutil import node_ids, publish

    from edgecache.clients import EdgeDataset
    from edgecache.clients.ops import gather_status, ready
    from edgecache.clients.rendezvous import owned_shards
    from edgecache.clients.topology import load_topology

    write_parquet_shards(tmp_path / "origin", 8, rows=300)
    registry = f"file://{tmp_path}/registry"
    manifest = publish(registry, f"file://{tmp_path}/origin", "split")
    replicas = [start_local_node("eu-west", tmp_path / f"cache-{i}", registry) for i in range(2)]
    try:
        addresses = [n.address for n in replicas]
        config = tmp_path / "edgecache.yaml"
        config.write_text(f"registry: {registry}\nregions:\n  eu-west:\n    nodes: {addresses}\n")
        result = runner.invoke(
            app, ["warm", "split@1", "--region", "eu-west", "--config", str(config)]
        )
        assert result.exit_code == 0, result.output
        reports = gather_status(load_topology(config))
        held = {r.address: r.status.versions[0].shard_count for r in reports if r.status.versions}
        for address in addresses:  # each replica holds exactly the shards it owns
            owned = owned_shards(addresses, address, "split", 1, 8, names=node_ids(*addresses))
            assert held.get(address, 0) == len(owned)
        assert ready(reports, "eu-west", manifest)[0]
        ds = EdgeDataset("split@1", config=config, region="eu-west", batch_size=64)
        labels = [
            int(x) for b in torch.utils.data.DataLoader(ds, batch_size=None) for x in b["label"]
        ]
        assert sorted(labels) == list(range(8 * 300))
    finally:
        for node in replicas:
            node.stop()


# What a person copies from the docs.
ROOT = Path(__file__).parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _code_blocks(path: Path, language: str = "") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def _documented_command_lines() -> list[tuple[str, str]]:
    found = []
    for path in DOC_FILES:
        for block in _code_blocks(path, r"\w*"):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.strip().removeprefix("$ ")
                if command.startswith("edgecache "):
                    found.append((path.name, command))
    return found


def test_documented_command_lines_reach_edgecache_whole() -> None:
    """No `<`, `>`, `|`, `;` or `&` left unquoted: the shell would redirect or split there."""
    lines = _documented_command_lines()
    assert any("--param" in line for _, line in lines)
    for name, line in lines:
        shell = shlex.shlex(line, posix=True, punctuation_chars=True)
        operators = [t for t in shell if t and set(t) <= set(shell.punctuation_chars)]
        assert not operators, f"{name}: quote {operators} in: {line}"


def test_readme_python_examples_import_or_define_every_name() -> None:
    for block in _code_blocks(ROOT / "README.md", "python"):
        table = symtable.symtable(block, "README.md", "exec")
        bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
        used = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
        free = used - bound - set(dir(builtins))
        assert not free, f"README.md example uses {sorted(free)} without defining them:\n{block}"


def test_dataset_md_documents_every_edgedataset_parameter() -> None:
    from edgecache.clients import EdgeDataset

    text = (ROOT / "docs" / "dataset.md").read_text()
    keywords = [
        p.name
        for p in inspect.signature(EdgeDataset.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert "token" in keywords
    missing = [k for k in keywords if f"{k}=" not in text and f"`{k}`" not in text]
    assert not missing, f"docs/dataset.md does not mention EdgeDataset's {missing}"


@pytest.mark.parametrize("spelled", ["registry", "file://registry"])
def test_a_relative_registry_path_is_relative_to_the_topology_file(
    tmp_path: Path, spelled: str
) -> None:
    # Commands run from anywhere: the registry named in ./conf/edgecache.yaml as
    # "registry" is conf/registry, not ./registry of the current directory.
    import os

    write_parquet_shards(tmp_path / "origin", 1, rows=50)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "edgecache.yaml").write_text(
        f"registry: {spelled}\nregions:\n  eu:\n    nodes: ['127.0.0.1:1']\n"
    )
    config = str(tmp_path / "conf" / "edgecache.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = os.getcwd()
    os.chdir(elsewhere)
    try:
        result = runner.invoke(
            app, ["publish", str(tmp_path / "origin"), "--dataset", "t", "--config", config]
        )
        assert result.exit_code == 0, result.output
        result = runner.invoke(app, ["versions", "t", "--config", config])
    finally:
        os.chdir(before)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "conf" / "registry" / "t").is_dir()
    assert not (elsewhere / "registry").exists()
    assert f"file://{tmp_path}/conf/registry" in result.output


def test_no_help_text_is_eaten_as_rich_markup() -> None:
    """Typer renders help with rich: '[hostname]' or '[from names]' is read as a markup tag
    and vanishes ('Node name .'), so defaults are said in parentheses instead."""
    import re

    import typer.main

    command = typer.main.get_command(app)
    eaten = []
    for name, sub in command.commands.items():  # type: ignore[attr-defined]
        for param in sub.params:
            text = getattr(param, "help", None) or ""
            if re.search(r"\[[a-z/]", text):
                eaten.append(f"{name} {param.name}: {text}")
    assert not eaten, eaten


def test_status_says_a_pin_that_has_run_out_is_expired() -> None:
    """status printed 'pinned until 2020-01-01' for a pin that protected nothing any more
    (the LRU evicts such a version)."""
    from datetime import UTC, datetime, timedelta

    from edgecache.clients.cli.nodes import _resident
    from edgecache.v1 import edge_pb2

    past = edge_pb2.ResidentVersion(dataset="b", version=1, shard_count=1, total_shards=6)
    past.pinned_until.FromDatetime(datetime(2020, 1, 1))
    assert _resident(past) == "b@1 (1/6, pin expired 2020-01-01 00:00)"
    future = edge_pb2.ResidentVersion(dataset="b", version=1, shard_count=6, total_shards=6)
    until = datetime.now(UTC) + timedelta(days=1)
    future.pinned_until.FromDatetime(until.replace(tzinfo=None))
    assert _resident(future) == f"b@1 (6/6, pinned until {until:%Y-%m-%d %H:%M})"
