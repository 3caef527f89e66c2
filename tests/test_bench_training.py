"""bench.training at toy size: it runs end to end, and its JSON renders into docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_training_benchmark_runs_and_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.training", "--mib", "8", "--code-mib", "4", "--repeat", "1"]
        + ["--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    measures = [r["measure"] for r in data["results"]]
    assert measures[0].startswith("shuffle quality") and len(measures) == 6
    assert all(r["ratio"] > 0 and r["target"] for r in data["results"])
    assert [s["shuffle_windows"] for s in data["sweep"]] == [1, 2, 4, 8, 16]
    assert data["data"]["sorted"]["samples"] > 0 and data["versions"]["edgecache"]
    # The permutation baseline is measured, and the closed form printed beside it.
    assert abs(data["permutation"] - data["closed_form"]) < 0.3
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is not installed: import it from the checkout
    from bench import render
    from bench.training import section

    text = section({**data, "_scale": 0.03, "_wall_seconds": 1.0})
    assert "## EdgeDataset training features" in text and "shuffle_windows" in text
    rows = render.summary_rows({"training": data})
    assert {r["suite"] for r in rows} == {"training"} and len(rows) == 6
