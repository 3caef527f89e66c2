"""The CLI as an operator and a script meet it: exit codes, safety, and output at 80 columns.

Every command runs as a real process (``python -m edgecache.clients.cli``) in a
pipe with ``COLUMNS=80``, against real nodes on loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from edgeutil import write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node

NARROW = {**os.environ, "COLUMNS": "80"}


def edgecache(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", *args],
        capture_output=True,
        text=True,
        env=env or NARROW,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr


def assert_narrow(text: str) -> None:
    """Tables fit 80 columns and no identifier was cut short with an ellipsis (a line of
    the list layout may be longer than 80: an identifier is never broken)."""
    assert "…" not in text, text
    boxed = [line for line in text.splitlines() if set(line) & set("│┃━─┏┗┡└")]
    assert all(len(line) <= 80 for line in boxed), text


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, LocalNode]]]:
    root = tmp_path_factory.mktemp("operator")
    write_parquet_shards(root / "origin", 3, rows=500)
    registry = f"file://{root}/registry"
    nodes = {
        r: start_local_node(r, root / f"cache-{r}", registry, capacity="1GiB")
        for r in ("eu-west", "us-east")
    }
    (root / "edgecache.yaml").write_text(
        f"registry: {registry}\nregions:\n"
        f"  eu-west:\n    nodes: ['{nodes['eu-west'].address}']\n"
        f"  us-east:\n    nodes: ['{nodes['us-east'].address}']\n"
    )
    yield root, nodes
    for node in nodes.values():
        node.stop()


def cfg(root: Path) -> list[str]:
    return ["--config", str(root / "edgecache.yaml")]


def test_publish_says_when_nothing_changed_and_can_reuse_the_version(site) -> None:
    root, _ = site
    code, out, err = edgecache(
        "publish", f"file://{root}/origin", "--dataset", "digits", *cfg(root)
    )
    first = out.splitlines()[0]  # the result on one line (the schema follows it)
    assert code == 0 and first.startswith("digits@1  sha256:") and "shards" in first, out
    code, out, err = edgecache(
        "publish", f"file://{root}/origin", "--dataset", "digits", *cfg(root)
    )
    assert code == 0 and out.startswith("digits@2")
    assert "same content as digits@1" in err and "--if-changed" in err
    code, out, err = edgecache(
        "publish", f"file://{root}/origin", "--dataset", "digits", "--if-changed", "--json",
        *cfg(root),
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0 and (result["version"], result["number"]) == ("digits@2", 2)
    assert result["reused"] is True
    code, out, err = edgecache("versions", "digits", *cfg(root))
    assert code == 0 and "digits@3" not in out
    assert_narrow(out)
    digest = json.loads(edgecache("versions", "digits", "--json", *cfg(root))[1])[0]["digest"]
    assert digest in out  # whole, never cut


def test_publish_without_a_topology_names_the_registry_option(tmp_path: Path) -> None:
    env = {k: v for k, v in NARROW.items() if k != "EDGECACHE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "publish", "file:///x", "--dataset", "x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "--registry" in out.stderr, out.stderr


def test_a_mistyped_edgecache_config_is_an_error_not_the_folders_own_topology(
    tmp_path: Path,
) -> None:
    # It fell back to ./edgecache.yaml (another site's, here) and acted on it, exit 0.
    (tmp_path / "edgecache.yaml").write_text(
        f"registry: file://{tmp_path}/other-site\nregions:\n  eu:\n    nodes: ['127.0.0.1:9']\n"
    )
    env = {**NARROW, "EDGECACHE_CONFIG": str(tmp_path / "edgecach.yaml")}
    out = subprocess.run(
        [sys.executable, "-m", "edgecache.clients.cli", "versions", "tok"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    said = " ".join(out.stderr.split())
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"EDGECACHE_CONFIG names {tmp_path / 'edgecach.yaml'}, which does not exist" in said
    assert "other-site" not in out.stdout + out.stderr


def test_plan_status_and_exit_codes_at_80_columns(site, tmp_path: Path) -> None:
    root, nodes = site
    edgecache("publish", f"file://{root}/origin", "--dataset", "tokens", *cfg(root))
    start = (datetime.now(UTC) + timedelta(hours=2)).isoformat(timespec="seconds")
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "jobs:\n"
        f"  - name: digits_baseline_training\n    region: eu-west\n    start: '{start}'\n"
        "    datasets: [tokens@1]\n"
        f"  - name: missing-data\n    region: us-east\n    start: '{start}'\n"
        "    datasets: [nosuch@1]\n"
    )
    code, out, err = edgecache("plan", str(schedule), *cfg(root))
    assert code == 3, (out, err)  # a job cannot be met
    assert_narrow(out)
    for identifier in ("digits_baseline_training", "tokens@1", start[:16].replace("T", " ")):
        assert identifier in out, (identifier, out)
    code, out, err = edgecache("warm", str(schedule), *cfg(root))
    assert code == 3 and "nosuch@1" in err, (out, err)  # the rest is done
    code, out, err = edgecache("status", *cfg(root))
    assert code == 0, err
    assert_narrow(out)
    assert "tokens@1 (3/3, pinned until" in out and nodes["eu-west"].address in out
    code, out, err = edgecache("plan", str(schedule), "--status", *cfg(root))
    assert code == 3 and "digits_baseline_training" in out and "ready" in out
    assert_narrow(out)
    # Evicting what a scheduled job reads is refused (bad input) and says so; --force works.
    code, out, err = edgecache("evict", "tokens@1", "--region", "eu-west", *cfg(root))
    assert code == 2 and "pinned" in err and "--force" in err, err
    code, out, err = edgecache("evict", "nosuch@7", *cfg(root))
    assert code == 2 and "neither published" in err, err
    code, out, err = edgecache("evict", "tokens@1", "--region", "mars", *cfg(root))
    assert code == 2 and "unknown region 'mars'" in err and "eu-west" in err, err
    code, out, err = edgecache("evict", "tokens@1", "--region", "us-east", *cfg(root))
    assert code == 0 and "nothing to evict" in out, (out, err)
    code, out, err = edgecache("evict", "tokens@1", "--region", "eu-west", "--force", *cfg(root))
    assert code == 0 and "freed" in out, (out, err)


def test_ready_wait_stops_at_its_timeout_and_says_so(site) -> None:
    root, _ = site
    edgecache("publish", f"file://{root}/origin", "--dataset", "never", *cfg(root))
    started = time.monotonic()
    code, out, err = edgecache(
        "ready", "never@1", "--region", "us-east", "--wait", "--timeout", "2", *cfg(root)
    )
    elapsed = time.monotonic() - started
    assert code == 1 and "timed out after" in err and "0/3 shards" in err, err
    # The wait itself, as it says it: stopped at its timeout, not a round more.
    said = re.search(r"timed out after (\d+\.\d) s", err)
    assert said and 2.0 <= float(said.group(1)) < 3.5, err  # a loaded host adds a little
    # The whole process (Python start-up and imports included, slow on a loaded machine):
    # only a bound on a hang.
    assert elapsed < 60
    code, out, err = edgecache("ready", "never@1", "--region", "us-east", *cfg(root))
    assert code == 1 and "timed out" not in err


def test_schedule_with_an_unknown_region_names_file_and_line(site, tmp_path: Path) -> None:
    root, _ = site
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "jobs:\n  - name: a\n    region: eu-west\n    start: 2030-01-01T00:00:00Z\n"
        "    datasets: [x]\n  - name: b\n    region: mars\n    start: 2030-01-01T00:00:00Z\n"
        "    datasets: [x]\n"
    )
    code, out, err = edgecache("plan", str(bad), *cfg(root))
    assert code == 2 and f"{bad}:7: jobs.1.region" in err and "mars" in err, err


def test_nodes_on_one_host_have_their_own_ids_and_keep_totals_after_a_restart(site) -> None:
    root, nodes = site
    code, out, _ = edgecache("status", "--json", *cfg(root))
    ids = [n["node_id"] for n in json.loads(out)]
    assert len(set(ids)) == 2, ids
    # A restarted node still knows a version's size (its kept manifest), so it says 3/3.
    # tokens@1 as the module's other tests publish it (xdist may run this one elsewhere).
    code, out, err = edgecache(
        "publish", f"file://{root}/origin", "--dataset", "tokens", "--if-changed", *cfg(root)
    )
    assert code == 0, (out, err)
    eu = nodes["eu-west"]
    code, out, err = edgecache("warm", "tokens@1", "--region", "eu-west", *cfg(root))
    assert code == 0, (out, err)
    eu.stop()
    nodes["eu-west"] = restarted = start_local_node(
        "eu-west", root / "cache-eu-west", f"file://{root}/registry", capacity="1GiB"
    )
    (root / "edgecache.yaml").write_text(
        re.sub(re.escape(eu.address), restarted.address, (root / "edgecache.yaml").read_text())
    )
    code, out, _ = edgecache("status", "--json", *cfg(root))
    versions = next(n for n in json.loads(out) if n["region"] == "eu-west")["versions"]
    assert any(v["version"] == "tokens@1" and v["shards"] == 3 for v in versions), versions
    code, out, _ = edgecache("status", *cfg(root))
    assert "tokens@1 (3/3" in out, out
