"""Smoke test of ``python -m bench.schedule``: the scenario benchmark at toy size, so it cannot rot.

The whole benchmark runs once (``--smoke``: three 2 MiB versions, six jobs
over eight simulated hours at 8000×, a 20 ms link) over network namespaces
where this machine permits them, else over the loopback proxy, and must
produce every figure, timeline and the chart. No figure is asserted against
its target: at toy sizes on a shared 2-core machine they mean nothing. Every
namespace and process the benchmark starts must be gone after. The analysis
is checked on its own on hand-made observations.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from benchproc import left_behind, marked, namespaces, run_marked

ROOT = Path(__file__).resolve().parents[1]


def test_schedule_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "schedule.json", tmp_path / "timeline.png"
    marker = f"schedule-smoke-{uuid.uuid4().hex}"
    before = namespaces()
    code, log = run_marked(
        [sys.executable, "-m", "bench.schedule", "--smoke", "--json", str(out)]
        + ["--render", str(png)],
        "BENCH_SCHEDULE_TEST",
        marker,
        100,
    )
    assert code == 0, log[-4000:]
    assert not left_behind(before), f"namespaces left behind: {left_behind(before)}"
    assert not marked(marker), "processes of the benchmark outlived it"

    doc = json.loads(out.read_text())
    assert doc["link"]["kind"] in ("netns", "proxy") and doc["link"]["chosen_because"]
    assert doc["inter_region"].startswith("loopback")
    assert {"edgecache", "pyarrow", "grpcio"} <= set(doc["versions"])
    assert len(doc["published"]) == 3
    cal = doc["calibration"]
    assert cal["origin_bytes_per_s_per_region"] > 0 and cal["peer"]["bytes_per_s"] > 0
    assert doc["topology"]["origin_bandwidth_sim"] >= 1

    jobs = {j["name"] for j in doc["scenario"]["jobs"]}
    for mode in ("controller", "naive"):
        day = doc["days"][mode]
        assert {c["job"] for c in day["checks"]} == jobs, mode
        assert day["origin_bytes"] > 0 and day["samples"]
    ctrl = doc["days"]["controller"]
    assert ctrl["first_plan"]["tasks"] and ctrl["tasks"] and ctrl["ticks"]["count"] > 0
    assert not ctrl["errors"], ctrl["errors"]
    assert doc["days"]["naive"]["items"]

    figures = doc["figures"]
    assert [r["measure"].split(" ")[0] for r in figures["targets"]] == [
        "jobs",
        "origin",
        "cross-region",
        "evictions",
    ]
    for row in figures["targets"]:
        assert row["met"] in (True, False, None)
        if row["met"] is False:
            assert row["reason"], row  # a missed target says why
    for job in figures["jobs"]:
        assert "planned_ready_h" in job["controller"] and "ready_h" in job["naive"]
    assert all("predicted_ready_h" in t and "ready_h" in t for t in figures["tasks"])
    assert png.stat().st_size > 10_000
    assert "controller vs naive warming" in log


def _scenario(scenario: Any) -> Any:
    return scenario.Scenario(
        versions=("a@1", "b@1"),
        jobs=(
            scenario.ScheduledJob("first", "eu", 1.0, 1.0, ("a@1",)),
            scenario.ScheduledJob("second", "eu", 3.0, 1.0, ("a@1", "b@1")),
            scenario.ScheduledJob("us", "us", 2.0, 1.0, ("b@1",)),
        ),
        day_hours=4.0,
    )


def _day(samples: list[dict], checks: list[dict]) -> dict:
    return {
        "samples": samples,
        "checks": checks,
        "origin_bytes": 100,
        "peer_bytes": 0,
        "wall_s": 1.0,
        "items": [],
        "tasks": [],
    }


def test_ready_times_and_needed_evictions_from_observations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a@1 complete at 0.5 h, evicted at 2.5 h, so missing when 'second' starts at 3 h."""
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is not installed: import it from the checkout
    from bench.schedule_parts import report, scenario

    samples = [
        {"t_h": 0.5, "region": "eu", "held": {"a@1": 2}},
        {"t_h": 2.0, "region": "eu", "held": {"a@1": 2, "b@1": 2}},
        {"t_h": 2.5, "region": "eu", "held": {"a@1": 1, "b@1": 2}},
        {"t_h": 3.2, "region": "eu", "held": {"a@1": 2, "b@1": 2}},
        {"t_h": 1.5, "region": "us", "held": {"b@1": 2}},
    ]
    samples.sort(key=lambda s: s["t_h"])
    checks = [
        {"job": "first", "region": "eu", "start_h": 1.0, "complete": True, "missing": {}},
        {"job": "us", "region": "us", "start_h": 2.0, "complete": True, "missing": {}},
        {
            "job": "second",
            "region": "eu",
            "start_h": 3.0,
            "complete": False,
            "missing": {"a@1": "1/2 shards"},
        },
    ]
    measured = {
        "manifests": {"a@1": {"shards": 2}, "b@1": {"shards": 2}},
        "days": {"naive": _day(samples, checks)},
    }
    figures = report.analyse(measured, _scenario(scenario), speed=100.0)
    jobs = {j["job"]: j["naive"] for j in figures["jobs"]}
    assert jobs["first"]["ready_h"] == 0.5 and jobs["first"]["complete_at_start"]
    assert jobs["us"]["ready_h"] == 1.5
    assert jobs["second"]["ready_h"] == 3.2 and not jobs["second"]["complete_at_start"]
    (lost,) = figures["modes"]["naive"]["needed_evicted"]
    assert lost["version"] == "a@1" and lost["complete_until_h"] == 2.5
    assert lost["job"] == "second"
