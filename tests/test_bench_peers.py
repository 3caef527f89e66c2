"""Smoke test of ``python -m bench.peers``: a few MiB through every system, so it cannot rot.

It runs the real peers (MosaicML Streaming, LitData, WebDataset) and a real
edge node, with DataLoader workers 0 and 2, and checks that every system
produced a complete epoch with sane figures. No timing is asserted: on a
shared 2-core machine a few MiB measure nothing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = {"mds", "mds-zstd", "litdata", "webdataset"}
SYSTEMS = {
    "tokens": PEERS
    | {"edgecache-grpc", "edgecache-lmdb", "edgecache-lmdb-none", "edgecache-lmdb-lowmem"},
    "images": PEERS | {"edgecache-grpc", "edgecache-lmdb"},  # images are cached uncompressed
}
PEER_MODULES = ("streaming", "litdata", "webdataset", "psutil")

missing = [m for m in PEER_MODULES if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(missing),
    reason=f"benchmark peers not installed ({', '.join(missing)}): "
    "pip install --no-deps -r bench/requirements.txt",
)


def test_peers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "edgecache / best peer" in proc.stdout
    doc = json.loads(out.read_text())

    assert set(doc["data"]) == {"tokens", "images"}
    for name, data in doc["data"].items():
        assert data["samples"] > 0 and data["raw_mb"] > 0
        assert set(doc["formats"][name]) == SYSTEMS[name]
        assert all(f["disk_mb"] > 0 for f in doc["formats"][name].values())

    epochs = doc["epochs"]
    seen = {(e["dataset"], e["system"], e["workers"]) for e in epochs}
    assert seen == {
        (d, s, w)
        for d, systems in SYSTEMS.items()
        for s in systems
        for w in (0, 2)
        if not (s == "edgecache-lmdb-lowmem" and w)  # one process: one lane, no workers
    }
    for e in epochs:
        assert e["samples"] == doc["data"][e["dataset"]]["samples"], e
        assert e["batches"] >= 1
        assert e["seconds"] > 0 and e["samples_s"] > 0 and e["mb_s"] > 0, e
        assert 0 < e["first_batch_s"] <= e["seconds"], e
        assert e["peak_rss_mb"] >= e["peak_anon_mb"] > 0, e
        assert e["cpu_s"] >= 0 and e["epochs"] == 1, e
        if e["system"] == "edgecache-grpc":
            assert e["node_peak_rss_mb"] > 0, e

    ratios = [r for r in doc["ratios"] if r["scope"] == "best"]
    assert {(r["dataset"], r["system"]) for r in ratios} == {
        (d, s) for d, systems in SYSTEMS.items() for s in systems - PEERS
    }
    for r in ratios:
        assert r["ratio"] > 0 and r["best_peer"] in PEERS, r
        targeted = r["system"] in ("edgecache-grpc", "edgecache-lmdb")  # the defaults
        assert (r["target"] is None) == (not targeted), r
        if r["system"] == "edgecache-grpc":  # against the bare grpcio stream of the same bytes
            assert r["bare_ratio"] > 0 and r["criterion"] in ("best peer", "bare stream"), r
    assert doc["versions"]["mosaicml-streaming"] and doc["versions"]["litdata"]

    # The same bytes over a bare grpcio stream, CPU per GB everywhere, workers and memory.
    for name in SYSTEMS:
        bare = doc["bare_stream"][name]
        assert bare["samples_s"] > 0 and bare["wire_mb"] > 0 and bare["cpu_s_per_gb"] >= 0
    for e in epochs:
        assert e["cpu_s_per_gb"] >= 0 and ("node_cpu_s_per_gb" in e) == (
            e["system"] == "edgecache-grpc"
        ), e
    scaling = {(w["dataset"], w["system"]) for w in doc["worker_scaling"] if w["workers"] == 2}
    assert scaling == {
        (d, s)
        for d, systems in SYSTEMS.items()
        for s in systems - PEERS
        if s != "edgecache-lmdb-lowmem"
    }
    assert all(w["ratio"] > 0 and w["target"] == 0.8 for w in doc["worker_scaling"])
    memory = {(m["dataset"], m["system"], m["workers"]): m for m in doc["memory"]}
    assert memory[("tokens", "edgecache-lmdb", 0)]["target"] == 1.5
    assert memory[("images", "edgecache-lmdb", 0)]["target"] is None
    assert memory[("tokens", "edgecache-lmdb-lowmem", 0)]["target"] is None  # reported beside
    assert all(m["ratio"] > 0 and m["speed_ratio"] > 0 for m in memory.values())
    kinds = {c["kind"] for c in doc["checks"]}
    assert kinds == {">=", "<="} and all(c["value"] > 0 for c in doc["checks"])


def test_two_rounds_by_default_and_none_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.peers.runner import parse

    assert parse([]).rounds == 2
    assert parse(["--smoke"]).rounds == 1
    with pytest.raises(SystemExit) as exited:
        parse(["--rounds", "0"])
    assert exited.value.code == 2
