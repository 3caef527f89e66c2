"""The scenario's timeline chart: per job, planned vs actual ready, and the job's start.

:func:`draw` takes the results ``python -m bench.schedule --json`` writes and
draws one panel per run (controller, naive) with one row per job, in
simulated hours of the day: the job's run as a grey bar, its start as a black
tick, staging as a line up to the actual ready time (a dot: green when it was
ready by the start, red when not), and for the controller the plan's
predicted ready time as an open circle. A red cross marks a job that started
with data missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.lines import Line2D  # noqa: E402

__all__ = ["draw"]

_PLAN = "#1f77b4"
_OK = "#2ca02c"
_LATE = "#d62728"


def draw(results: dict[str, Any], path: Path) -> Path:
    """Write the timeline chart of ``results`` to ``path`` (PNG); returns the path."""
    figures = results["figures"]
    jobs = sorted(figures["jobs"], key=lambda j: (j["region"], j["start_h"]))
    modes = [m for m in ("controller", "naive") if m in figures["modes"]]
    tasks = figures.get("tasks", [])
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(12, 0.32 * len(jobs) * len(modes) + 2), sharex=True, squeeze=False
    )
    day_hours = results["scenario"]["day_hours"]
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        for y, job in enumerate(jobs):
            entry = job.get(mode, {})
            ax.barh(
                y, job["end_h"] - job["start_h"], left=job["start_h"], color="#dddddd", height=0.6
            )
            ax.plot([job["start_h"]] * 2, [y - 0.35, y + 0.35], color="black", linewidth=1.5)
            if mode == "controller":
                began = min(
                    (t["started_h"] for t in tasks if job["job"] in t["jobs"]), default=None
                )
                planned = entry.get("planned_ready_h")
                if planned is not None:
                    ax.plot(planned, y, "o", mfc="none", mec=_PLAN, markersize=7)
            else:
                began = entry.get("warm_started_h")
            ready = entry.get("ready_h")
            ok = entry.get("complete_at_start")
            colour = _OK if ok else _LATE
            if began is not None and ready is not None and ready >= began:
                ax.plot([began, ready], [y, y], color=colour, linewidth=1.2)
            elif began is not None and ready is not None:  # warmed what was already there
                ax.plot(began, y, "|", color=colour, markersize=7)
            elif began is not None:  # staged, but the version was not whole at the start
                ax.plot([began, job["start_h"]], [y, y], "--", color=_LATE, linewidth=1)
            if ready is not None:
                ax.plot(ready, y, "o", color=colour, markersize=4)
            if ok is False:
                ax.plot(job["start_h"], y, "x", color=_LATE, markersize=9, mew=2)
        done = figures["modes"][mode]
        ax.set_title(
            f"{mode}: {done['complete_at_start']}/{done['jobs']} jobs complete at start, "
            f"origin {done['origin_bytes'] / 1e6:,.0f} MB, "
            f"peers {done['peer_bytes'] / 1e6:,.0f} MB",
            fontsize=10,
        )
        ax.set_yticks(range(len(jobs)), [j["job"] for j in jobs], fontsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, day_hours)
    axes[-1, 0].set_xlabel("simulated hours since the day began")
    legend = [
        Line2D([], [], color="black", label="job start"),
        Line2D([], [], color="#dddddd", linewidth=6, label="job running"),
        Line2D([], [], marker="o", mfc="none", mec=_PLAN, ls="none", label="planned ready"),
        Line2D([], [], marker="o", color=_OK, label="staging → actual ready (in time)"),
        Line2D([], [], marker="|", color=_OK, ls="none", label="naive warm of data already there"),
        Line2D([], [], ls="--", color=_LATE, label="staged, yet incomplete at the start"),
        Line2D([], [], marker="o", color=_LATE, label="actual ready (late)"),
        Line2D(
            [], [], marker="x", color=_LATE, ls="none", mew=2, label="started with data missing"
        ),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"Schedule of {len(jobs)} jobs, {results['link']['kind']} link: "
        "planned vs actual ready per job"
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
