"""Shared output of the benchmarks: one row per measure, ours against its baseline."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib.metadata import version
from pathlib import Path

from rich.table import Table

__all__ = ["cpu_model", "ratio_table", "versions"]


def _mark(row: dict) -> str:
    target = row.get("target")
    if target is None:
        return ""
    return f"≥{target:g} " + ("✓" if row["ratio"] >= target else "✗")


def ratio_table(title: str, results: Iterable[dict], labels: Sequence[str]) -> Table:
    """A table of ``labels`` columns, then MB, ours, baseline, ratio and target."""
    table = Table(title=title)
    for column in (*labels, "MB", "ours MB/s", "base MB/s", "ratio", "target"):
        table.add_column(column, justify="left" if column in labels else "right")
    for r in results:
        table.add_row(
            *(str(r[label]) for label in labels),
            str(r["mbytes"]),
            str(r["ours_mb_s"]),
            str(r["baseline_mb_s"]),
            f"{r['ratio']:.2f}×",
            _mark(r),
        )
    return table


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of ``packages``, printed with every benchmark."""
    return {p: version(p) for p in packages}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none), for the reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
