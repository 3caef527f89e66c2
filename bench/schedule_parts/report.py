"""Figures and targets of the scenario benchmark, from what the edge side observed.

:func:`analyse` turns the raw observations (node status samples, the checks at
each job's start, the controller's task records, the naive warm items, node
metrics) into the figures both runs are compared on; :func:`print_results`
prints them. A target that is missed is printed as missed, with the reason
the observations give.

Definitions, the same for both runs:

* a job's data is **complete at its start** when, at the instant the job
  starts, its region's node holds every shard of every version it reads;
* **origin bytes**: the sum over the nodes of ``edgecache_origin_bytes_total``;
* an **eviction an upcoming job needed**: a version that had been complete in
  a region, was then evicted (wholly or some shards), and was not complete at
  the start of a later job there that reads it;
* a job's **actual ready** time: when its region last became complete for all
  its versions before the job started (or first after, if it was late).
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.schedule_parts.scenario import Scenario

__all__ = ["TARGETS", "analyse", "print_results"]

TARGETS: dict[str, Any] = {
    "complete_at_start": "every job the plan calls feasible",
    "origin_reduction": 0.5,  # at least this much less origin bytes than naive
    "needed_evicted": 0,
}


# ------------------------------------------------------------ timelines


def _held_series(samples: list[dict[str, Any]], region: str) -> list[tuple[float, dict[str, int]]]:
    return [(s["t_h"], s["held"]) for s in samples if s["region"] == region]


def _complete(held: dict[str, int], specs: list[str], totals: dict[str, int]) -> bool:
    return all(held.get(v, 0) >= totals[v] for v in specs)


def _ready_h(
    series: list[tuple[float, dict[str, int]]],
    specs: list[str],
    totals: dict[str, int],
    start: float,
    end: float,
    complete_at_start: bool,
) -> float | None:
    """When the region became complete for ``specs``: last before the start, else first after."""
    states = [(t, _complete(held, specs, totals)) for t, held in series]
    before = [(t, ok) for t, ok in states if t <= start]
    if complete_at_start:
        if not before or not before[-1][1]:
            return start  # the check at the start saw it a moment before the watcher did
        i = len(before) - 1
        while i > 0 and before[i - 1][1]:
            i -= 1
        return before[i][0]
    first = next((t for t, ok in states if t > start and ok), None)
    return first if first is not None and first < end else None


def _needed_evicted(
    day: dict[str, Any], scenario: Scenario, totals: dict[str, int]
) -> list[dict[str, Any]]:
    """Versions complete in a region earlier, missing at a later job's start there."""
    out = []
    for check in day["checks"]:
        series = _held_series(day["samples"], check["region"])
        for spec in check["missing"]:
            before = [
                t
                for t, held in series
                if t < check["start_h"] and held.get(spec, 0) >= totals[spec]
            ]
            if not before:
                continue
            lost = next(
                (t for t, held in series if before[-1] < t and held.get(spec, 0) < totals[spec]),
                None,
            )
            out.append(
                {
                    "job": check["job"],
                    "region": check["region"],
                    "version": spec,
                    "complete_until_h": lost,
                    "job_start_h": check["start_h"],
                    "held_at_start": check["missing"][spec],
                }
            )
    return out


def _others_holding(
    samples: list[dict[str, Any]], region: str, spec: str, at: float, totals: dict[str, int]
) -> list[str]:
    """Regions other than ``region`` that held ``spec`` complete at time ``at``."""
    last: dict[str, dict[str, int]] = {}
    for s in samples:
        if s["t_h"] > at:
            break
        last[s["region"]] = s["held"]
    return sorted(
        r for r, held in last.items() if r != region and held.get(spec, 0) >= totals[spec]
    )


def _ever_held(
    samples: list[dict[str, Any]], spec: str, before: float, totals: dict[str, int]
) -> bool:
    return any(s["t_h"] < before and s["held"].get(spec, 0) >= totals[spec] for s in samples)


# ------------------------------------------------------------- analysis


def _fmt_h(hours: float | None) -> str:
    if hours is None:
        return "—"
    minutes = round(hours * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def analyse(measured: dict[str, Any], scenario: Scenario, speed: float) -> dict[str, Any]:
    """Per-job and per-task timelines, the four targets, and why any was missed."""
    totals = {spec: m["shards"] for spec, m in measured["manifests"].items()}
    days = measured["days"]
    jobs_out: dict[str, dict[str, Any]] = {
        j.name: {
            "job": j.name,
            "region": j.region,
            "start_h": j.start_h,
            "end_h": j.end_h,
            "versions": list(j.versions),
        }
        for j in scenario.jobs
    }
    per_mode: dict[str, dict[str, Any]] = {}
    for mode, day in days.items():
        checks = {c["job"]: c for c in day["checks"]}
        for job in scenario.jobs:
            check = checks.get(job.name)
            complete = bool(check and check["complete"])
            series = _held_series(day["samples"], job.region)
            entry = {
                "complete_at_start": complete if check else None,
                "missing_at_start": check["missing"] if check else {},
                "ready_h": _ready_h(
                    series, list(job.versions), totals, job.start_h, job.end_h, complete
                ),
            }
            if mode == "controller":
                plan = day.get("first_plan") or {"tasks": [], "infeasible": []}
                finishes = [t["finish_h"] for t in plan["tasks"] if job.name in t["jobs"]]
                record = day.get("controller_jobs", {}).get(job.name, {})
                entry |= {
                    "planned_ready_h": max(finishes) if finishes else None,
                    "planned_ready_last_h": record.get("planned_ready_h"),
                    "feasible": not any(i["job"] == job.name for i in plan["infeasible"]),
                    "infeasible": [
                        f"{i['version']}: {i['reason']}"
                        for i in plan["infeasible"]
                        if i["job"] == job.name
                    ],
                    "controller_saw_complete_at_start": record.get("complete_at_start"),
                    "staged_from": sorted(
                        {
                            t["source"]
                            for t in day["tasks"]
                            if job.name in t["jobs"] and t["started_h"] <= job.start_h
                        }
                    ),
                }
            else:
                items = [i for i in day["items"] if i["job"] == job.name]
                entry |= {
                    "warm_started_h": min((i["started_h"] for i in items), default=None),
                    "warm_finished_h": max((i["finished_h"] for i in items), default=None),
                }
            jobs_out[job.name][mode] = entry
        per_mode[mode] = {
            "complete_at_start": sum(1 for c in day["checks"] if c["complete"]),
            "jobs": len(day["checks"]),
            "origin_bytes": day["origin_bytes"],
            "peer_bytes": day["peer_bytes"],
            "link_rx_bytes": day.get("link_rx_bytes"),
            "needed_evicted": _needed_evicted(day, scenario, totals),
            "wall_s": day["wall_s"],
        }

    figures: dict[str, Any] = {"modes": per_mode, "jobs": list(jobs_out.values())}
    ctrl, naive = days.get("controller"), days.get("naive")
    if ctrl is not None:
        figures["tasks"] = _tasks(ctrl, totals, speed)
        figures["peer_staging"] = _peer_staging(figures["tasks"])
        figures["prediction"] = _prediction(figures["tasks"])
        figures["controller_record"] = _record_findings(ctrl, figures["tasks"], speed, scenario)
    if ctrl is not None and naive is not None:
        figures["targets"] = _targets(figures, scenario, ctrl, naive)
    return figures


def _tasks(ctrl: dict[str, Any], totals: dict[str, int], speed: float) -> list[dict[str, Any]]:
    """Per controller task: planned and actual start and ready, the error, the real rate."""
    out = []
    for t in ctrl["tasks"]:
        ready, started = t.get("ready_h"), t["started_h"]
        real_s = (ready - started) * 3600 / speed if ready is not None else None
        others = _others_holding(ctrl["samples"], t["region"], t["version"], started, totals)
        origin_why = ""
        if t["source"] == "origin":
            # Other regions' runs for this version under way when this one began: started
            # earlier, or in the same tick and listed first (the tick started both).
            staging = sorted(
                o["region"]
                for o in ctrl["tasks"]
                if o["version"] == t["version"]
                and o["region"] != t["region"]
                and (o["started_h"], o["region"]) < (started, t["region"])
                and (o.get("ready_h") or float("inf")) > started
            )
            if others:
                origin_why = f"a peer held it ({', '.join(others)}): the planner chose origin"
            elif staging:
                origin_why = (
                    f"a peer was staging it ({', '.join(staging)}): the planner did not wait "
                    "for the peer"
                )
            elif _ever_held(ctrl["samples"], t["version"], started, totals):
                origin_why = "no region held it then (earlier copies were evicted)"
            else:
                origin_why = "first copy (no region held or was staging it)"
        out.append(
            {
                "region": t["region"],
                "version": t["version"],
                "source": t["source"],
                "jobs": t["jobs"],
                "state": t["state"],
                "planned_start_h": t["planned_start_h"],
                "started_h": started,
                "predicted_ready_h": t["predicted_ready_h"],
                "ready_h": ready,
                "deadline_h": t["deadline_h"],
                "error_min": (
                    round((ready - t["predicted_ready_h"]) * 60, 1)
                    if ready is not None and t["predicted_ready_h"] is not None
                    else None
                ),
                "late": ready is None or ready > t["deadline_h"],
                "real_s": round(real_s, 2) if real_s is not None else None,
                "origin_why": origin_why,
                "notes": t.get("notes", []),
                "error": t.get("error", ""),
                "in_controller_state": t.get("in_final_state", True),
            }
        )
    return out


def _prediction(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted against actual ready time, per kind of source (simulated minutes)."""
    out = {}
    for kind in ("origin", "peer"):
        errors = [
            t["error_min"]
            for t in tasks
            if t["error_min"] is not None and (t["source"] == "origin") == (kind == "origin")
        ]
        out[kind] = {
            "tasks": len(errors),
            "median_error_min": round(statistics.median(errors), 1) if errors else None,
            "max_error_min": max(errors) if errors else None,
            "late_vs_deadline": sum(
                1 for t in tasks if t["late"] and (t["source"] == "origin") == (kind == "origin")
            ),
        }
    return out


def _record_findings(
    ctrl: dict[str, Any], tasks: list[dict[str, Any]], speed: float, scenario: Scenario
) -> dict[str, Any]:
    """What the controller's own record (state.json) lost, and runs it started twice.

    A run's record leaves the controller's state when a later task for the same
    region and version replaces it; a run that began within a tick of the previous
    run of the same region and version becoming ready re-staged what was there.
    """
    tick_h = (ctrl["ticks"]["interval_s"] + (ctrl["ticks"]["median_s"] or 0)) * speed / 3600
    lost = [t for t in tasks if t["state"] == "done" and not t["in_controller_state"]]
    rerun = []
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in sorted(tasks, key=lambda t: t["started_h"]):
        previous = by_key.setdefault((t["region"], t["version"]), [])
        if previous and previous[-1]["ready_h"] is not None:
            if t["started_h"] <= previous[-1]["ready_h"] + tick_h:
                rerun.append(t)
        previous.append(t)
    return {
        "runs": len(tasks),
        "done_runs_missing_from_state": [f"{t['region']} {t['version']}" for t in lost],
        "reruns_right_after_ready": [f"{t['region']} {t['version']}" for t in rerun],
        "infeasible_in_later_plans": [
            i | {"job_was": _job_was(scenario, i["job"], i["first_seen_h"])}
            for i in ctrl.get("infeasible_seen", [])
            if i["first_seen_h"] > 0.01
        ],
    }


def _job_was(scenario: Scenario, name: str, at: float) -> str:
    job = next((j for j in scenario.jobs if j.name == name), None)
    if job is None:
        return "unknown"
    return "ended" if job.end_h <= at else "running" if job.start_h <= at else "upcoming"


def _peer_staging(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    peer = [t for t in tasks if t["source"] != "origin" and t["real_s"] is not None]
    origin = [t for t in tasks if t["source"] == "origin" and t["real_s"] is not None]
    return {
        "tasks": len(peer),
        "real_s_total": round(sum(t["real_s"] for t in peer), 2),
        "real_s_median": round(statistics.median(t["real_s"] for t in peer), 2) if peer else None,
        "origin_tasks": len(origin),
        "origin_real_s_median": (
            round(statistics.median(t["real_s"] for t in origin), 2) if origin else None
        ),
        "fell_back_to_origin": [t for t in peer if t["notes"]],
    }


def _targets(
    figures: dict[str, Any], scenario: Scenario, ctrl: dict[str, Any], naive: dict[str, Any]
) -> list[dict[str, Any]]:
    modes = figures["modes"]
    jobs = figures["jobs"]
    rows = []

    feasible = [j for j in jobs if j["controller"]["feasible"]]
    unmet = [j for j in feasible if not j["controller"]["complete_at_start"]]
    reason = ""
    if unmet:
        parts = []
        for j in unmet:
            c = j["controller"]
            missing = ", ".join(f"{v} ({n})" for v, n in c["missing_at_start"].items())
            late = [
                t
                for t in figures["tasks"]
                if j["job"] in t["jobs"] and (t["ready_h"] is None or t["ready_h"] > j["start_h"])
            ]
            why = "; ".join(
                f"{t['version']} from {t['source']} planned {_fmt_h(t['planned_start_h'])}→"
                f"{_fmt_h(t['predicted_ready_h'])}, ran {_fmt_h(t['started_h'])}→"
                f"{_fmt_h(t['ready_h'])}"
                for t in late
            )
            parts.append(
                f"{j['job']} (start {_fmt_h(j['start_h'])}) lacked {missing}: "
                f"{why or 'no task ran for it'}"
            )
        reason = " | ".join(parts)
    naive_feasible_complete = sum(1 for j in feasible if j["naive"]["complete_at_start"])
    rows.append(
        {
            "measure": "jobs complete at their start (of those the plan calls feasible)",
            "controller": f"{len(feasible) - len(unmet)}/{len(feasible)}",
            "naive": f"{naive_feasible_complete}/{len(feasible)}",
            "all_jobs": f"controller {modes['controller']['complete_at_start']}/{len(jobs)}, "
            f"naive {modes['naive']['complete_at_start']}/{len(jobs)}",
            "target": "all",
            "met": not unmet,
            "reason": reason,
        }
    )

    c_bytes, n_bytes = modes["controller"]["origin_bytes"], modes["naive"]["origin_bytes"]
    reduction = 1 - c_bytes / n_bytes if n_bytes else 0.0
    single = [v for v in scenario.versions if len(scenario.regions_reading(v)) < 2]
    tasks = [t for t in figures["tasks"] if t["source"] == "origin"]
    kinds: dict[str, int] = {}
    for t in tasks:
        key = t["origin_why"].split(" (")[0].split(":")[0]
        kinds[key] = kinds.get(key, 0) + 1
    breakdown = f"{len(tasks)} controller tasks from origin: " + ", ".join(
        f"{n} × {k}" for k, n in sorted(kinds.items())
    )
    reason = breakdown if reduction < TARGETS["origin_reduction"] else ""
    rows.append(
        {
            "measure": "origin bytes (sum of edgecache_origin_bytes_total)",
            "controller": c_bytes,
            "naive": n_bytes,
            "reduction": round(reduction, 4),
            "target": f"≥ {TARGETS['origin_reduction']:.0%} fewer",
            "met": reduction >= TARGETS["origin_reduction"],
            "reason": reason,
            "breakdown": breakdown,
            "scope": (
                "every version is read in at least two regions"
                if not single
                else f"read in one region only: {', '.join(single)}"
            ),
        }
    )

    peer = figures["peer_staging"]
    rows.append(
        {
            "measure": "cross-region staging (peer copies over loopback), real seconds",
            "controller": f"{peer['tasks']} tasks, {peer['real_s_total']} s in all "
            f"(median {peer['real_s_median']} s; "
            f"origin tasks median {peer['origin_real_s_median']} s)",
            "naive": "none (everything from origin)",
            "target": None,
            "met": None,
            "reason": "",
        }
    )

    c_lost, n_lost = modes["controller"]["needed_evicted"], modes["naive"]["needed_evicted"]
    rows.append(
        {
            "measure": "evictions of versions an upcoming job needed",
            "controller": len(c_lost),
            "naive": len(n_lost),
            "target": "0 (controller)",
            "met": not c_lost,
            "reason": "; ".join(
                f"{x['version']} in {x['region']} complete until {_fmt_h(x['complete_until_h'])}, "
                f"missing at {x['job']}'s start {_fmt_h(x['job_start_h'])}"
                for x in c_lost
            ),
        }
    )
    return rows


# -------------------------------------------------------------- printing


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:,.1f} MB"


def print_results(console: Console, results: dict[str, Any]) -> None:
    """Settings, the targets side by side, per job and per task."""
    fig = results["figures"]
    cal = results["calibration"]
    console.print(
        f"[bold]scenario benchmark[/bold]: {results['scenario_summary']}; link: "
        f"{results['link']['kind']} ({results['link']['chosen_because']}); "
        f"{results['link']['rtt_ms']:g} ms, {results['link']['rate_mbit']:g} Mbit/s, "
        f"loss {results['link']['loss']:g}; inter-region: {results['inter_region']}"
    )
    console.print(
        f"data: {results['data_summary']}; clock ×{results['settings']['speed']:g} "
        f"(1 real s = {results['settings']['speed'] / 60:.1f} simulated min); capacity "
        f"{_mb(results['capacity_bytes'])} per region "
        f"({results['settings']['capacity_versions']:g} stored versions)"
    )
    console.print(
        f"calibration: origin {cal['origin_bytes_per_s_per_region'] * 8 / 1e6:.1f} Mbit/s per "
        "region with three staging at once; "
        f"peer copy {cal['peer']['bytes_per_s'] / 1e6:.0f} MB/s; "
        f"stored/source {cal['stored_per_source']:.2f}. Topology (simulated bytes/s = real ÷ "
        f"speed): origin_bandwidth {results['topology']['origin_bandwidth_sim']:,} B/s, peers "
        f"{results['topology']['peer_bandwidth_sim']:,} B/s"
    )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()))

    table = Table(title="controller vs naive warming, same run")
    for column in ("measure", "controller", "naive", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for row in fig.get("targets", []):
        ratio = ""
        controller, naive = row["controller"], row["naive"]
        if "reduction" in row:
            ratio = f"{row['reduction']:.1%} fewer"
            controller, naive = _mb(controller), _mb(naive)
        mark = "" if row["met"] is None else ("met" if row["met"] else "[red]MISSED[/red]")
        table.add_row(
            row["measure"], str(controller), str(naive), ratio, str(row["target"] or ""), mark
        )
    console.print(table)
    for row in fig.get("targets", []):
        if row.get("scope"):
            console.print(f"  origin bytes: {row['scope']}; {row['breakdown']}")
        if row["met"] is False:
            console.print(f"  [red]missed[/red] — {row['measure']}: {row['reason']}")
        if row["measure"].startswith("jobs complete"):
            console.print(f"  all jobs: {row['all_jobs']}")

    jobs = Table(title="per job (simulated time of day): planned vs actual ready")
    for column in (
        "job",
        "start",
        "versions",
        "ctrl planned",
        "ctrl actual",
        "ctrl ok",
        "from",
        "naive warm",
        "naive ready",
        "naive ok",
    ):
        jobs.add_column(column)
    for j in fig["jobs"]:
        c, n = j.get("controller", {}), j.get("naive", {})
        jobs.add_row(
            j["job"],
            _fmt_h(j["start_h"]),
            ", ".join(j["versions"]),
            _fmt_h(c.get("planned_ready_h")) + ("" if c.get("feasible", True) else " (infeasible)"),
            _fmt_h(c.get("ready_h")),
            _ok(c.get("complete_at_start")),
            ",".join(c.get("staged_from", [])),
            _fmt_h(n.get("warm_started_h")),
            _fmt_h(n.get("ready_h")),
            _ok(n.get("complete_at_start")),
        )
    console.print(jobs)

    if fig.get("tasks"):
        tasks = Table(title="controller tasks: predicted vs actual ready (simulated), real seconds")
        for column in (
            "region",
            "version",
            "from",
            "planned start",
            "started",
            "predicted",
            "ready",
            "deadline",
            "error min",
            "real s",
            "in state",
            "why origin",
        ):
            tasks.add_column(column)
        for t in fig["tasks"]:
            tasks.add_row(
                t["region"],
                t["version"],
                t["source"],
                _fmt_h(t["planned_start_h"]),
                _fmt_h(t["started_h"]),
                _fmt_h(t["predicted_ready_h"]),
                _fmt_h(t["ready_h"]) + (" [red]late[/red]" if t["late"] else ""),
                _fmt_h(t["deadline_h"]),
                "—" if t["error_min"] is None else f"{t['error_min']:+.1f}",
                "—" if t["real_s"] is None else f"{t['real_s']:.1f}",
                "yes" if t["in_controller_state"] else "[red]no[/red]",
                t["origin_why"],
            )
        console.print(tasks)
    if fig.get("prediction"):
        p = fig["prediction"]
        console.print(
            "predicted vs actual ready (simulated min, negative = early): origin tasks median "
            f"{p['origin']['median_error_min']}, max {p['origin']['max_error_min']}; peer tasks "
            f"median {p['peer']['median_error_min']}, max {p['peer']['max_error_min']}"
        )
    record = fig.get("controller_record")
    if record:
        if record["done_runs_missing_from_state"]:
            console.print(
                f"controller record: {len(record['done_runs_missing_from_state'])} of "
                f"{record['runs']} finished runs are missing from its state.json (replaced by the "
                "next task for the same region and version): "
                + ", ".join(record["done_runs_missing_from_state"])
            )
        if record["reruns_right_after_ready"]:
            console.print(
                "controller re-staged right after a run finished (status read before it did): "
                + ", ".join(record["reruns_right_after_ready"])
            )
        later = record["infeasible_in_later_plans"]
        for item in later:
            if item["job_was"] != "ended":
                console.print(
                    f"a later plan at {_fmt_h(item['first_seen_h'])} said {item['job']} "
                    f"({item['job_was']}) {item['version']} cannot be met: {item['reason']}"
                )
        ended = [i for i in later if i["job_was"] == "ended"]
        if ended:
            console.print(
                f"later plans also called {len(ended)} versions of jobs that had already ended "
                "infeasible (the planner plans for ended jobs whose data was evicted after them)"
            )
    for mode, m in fig["modes"].items():
        lost = m["needed_evicted"]
        if lost:
            console.print(
                f"{mode}: needed versions evicted: "
                + "; ".join(f"{x['version']}@{x['region']} before {x['job']}" for x in lost)
            )
    console.print(f"wall time {results['wall_s']:.0f} s: {results['phases_s']}")


def _ok(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "[red]no[/red]")
