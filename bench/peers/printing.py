"""bench.peers' tables on the terminal: epochs, ratios, the bare stream, workers, memory."""

from __future__ import annotations

import os
import platform
from typing import Any

from bench import report

__all__ = [
    "MEMORY_COLUMNS",
    "SCALING_COLUMNS",
    "machine",
    "memory_rows",
    "print_report",
    "scaling_rows",
]

SCALING_COLUMNS = ("data", "system", "workers", "samples/s", "workers=0", "ratio", "target")
MEMORY_COLUMNS = ("data", "system", "workers", "anon MB", "LitData MB", "ratio", "speed", "target")


def _marks(markdown: bool) -> tuple[str, str, str, str]:
    """Times, at least, at most, and bold: as the terminal or the docs write them."""
    return ("×", "≥", "≤", "**") if markdown else ("x", ">=", "<=", "")


def scaling_rows(out: dict[str, Any], *, markdown: bool = False) -> list[list[str]]:
    """The worker-scaling table's rows (terminal, or docs/benchmarks.md with ``markdown``)."""
    times, ge, _, bold = _marks(markdown)
    return [
        [
            w["dataset"],
            w["system"],
            str(w["workers"]),
            f"{w['samples_s']:,.0f}",
            f"{w['workers0_samples_s']:,.0f}",
            f"{bold}{w['ratio']:.2f}{times}{bold}",
            f"{ge} {w['target']:g} " + ("✓" if w["met"] else "✗"),
        ]
        for w in out.get("worker_scaling", [])
    ]


def memory_rows(out: dict[str, Any], *, markdown: bool = False) -> list[list[str]]:
    """The memory table's rows: edgecache's peak anonymous memory / LitData's, beside speed."""
    times, ge, le, bold = _marks(markdown)
    return [
        [
            m["dataset"],
            m["system"],
            str(m["workers"]),
            f"{m['anon_mb']:,.0f}",
            f"{m['litdata_anon_mb']:,.0f}",
            f"{bold}{m['ratio']:.2f}{times}{bold}",
            f"{m['speed_ratio']:.2f}{times}",
            ""
            if m["target"] is None
            else f"{le} {m['target']:g} at {ge} 1{times} speed " + ("✓" if m["met"] else "✗"),
        ]
        for m in out.get("memory", [])
    ]


def machine() -> dict[str, Any]:
    import psutil

    model = report.cpu_model()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
    }


def print_report(out: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    settings = out["settings"]
    table = Table(
        title="Epochs through a torch DataLoader, every system in the same run "
        f"(fastest of up to {settings['repeat']} epochs per configuration while under "
        f"{settings['budget_s']:g} s, x {settings['rounds']} round(s))"
    )
    for column in (
        "data",
        "system",
        "workers",
        "samples/s",
        "MB/s",
        "first batch s",
        "epoch s",
        "CPU s",
        "CPU s/GB",
        "node CPU s/GB",
        "peak RSS MB",
        "anon MB",
        "on disk MB",
    ):
        table.add_column(column, justify="left" if column in ("data", "system") else "right")
    for e in out["epochs"]:
        fmt = out["formats"][e["dataset"]][e["system"]]
        table.add_row(
            e["dataset"],
            e["system"],
            str(e["workers"]),
            f"{e['samples_s']:,.0f}",
            f"{e['mb_s']:,.0f}",
            f"{e['first_batch_s']:.3f}",
            f"{e['seconds']:.2f}",
            f"{e['cpu_s']:.1f}",
            f"{e['cpu_s_per_gb']:.2f}",
            f"{e['node_cpu_s_per_gb']:.2f}" if "node_cpu_s_per_gb" in e else "",
            f"{e['peak_rss_mb']:,.0f}",
            f"{e['peak_anon_mb']:,.0f}",
            f"{fmt['disk_mb']:,.0f}",
        )
    console.print(table)
    results = [
        {
            "measure": f"{r['dataset']}: {r['system']} (workers={r['workers']})",
            "baseline": f"{r['best_peer']} (workers={r['best_peer_workers']})",
            "mbytes": out["data"][r["dataset"]]["raw_mb"],
            "ours_mb_s": r["ours_mb_s"],
            "baseline_mb_s": r["peer_mb_s"],
            "ratio": r["ratio"],
            "target": r["target"],
        }
        for r in out["ratios"]
        if r["scope"] == "best"
    ]
    title = "edgecache / best peer (each at its best worker count)"
    console.print(report.ratio_table(title, results, ("measure", "baseline")))
    for name, b in out.get("bare_stream", {}).items():
        console.print(
            f"{name}: bare grpcio stream of the same bytes (bench.peers.bare): "
            f"{b['samples_s']:,.0f} samples/s, {b['wire_mb_s']:,.0f} MB/s on the wire over "
            f"{b['streams']} stream(s), client {b['cpu_s_per_gb']:.2f} CPU-s/GB"
        )
    for r in out["ratios"]:
        if r["scope"] == "best" and "bare_ratio" in r:
            console.print(
                f"{r['dataset']} gRPC: {r['ratio']:.2f}x the best peer ({r['best_peer']}), "
                f"{r['bare_ratio']:.2f}x the bare stream; target applied: {r['criterion']} "
                f"({'met' if r['met'] else 'missed'})"
            )
    scaling = Table(title="DataLoader workers: edgecache with workers / with num_workers=0")
    for column in SCALING_COLUMNS:
        scaling.add_column(column)
    for row in scaling_rows(out):
        scaling.add_row(*row)
    console.print(scaling)
    mem = Table(title="Peak anonymous memory beside speed: edgecache / LitData, same workers")
    for column in MEMORY_COLUMNS:
        mem.add_column(column)
    for row in memory_rows(out):
        mem.add_row(*row)
    console.print(mem)
    for r in out["ratios"]:
        if r["scope"] != "best":
            console.print(
                f"{r['dataset']} {r['scope']}: {r['system']} / {r['best_peer']} = {r['ratio']:.2f}×"
            )
    for name, d in out["data"].items():
        console.print(
            f"{name}: {d['samples']:,} samples, raw {d['raw_mb']:,} MB, batch {d['batch_size']}; "
            + ", ".join(f"{s} {f['disk_mb']:,.0f} MB" for s, f in out["formats"][name].items())
        )
    console.print(
        "CPU s: user+system of the loader process and its DataLoader workers over the epoch; "
        "CPU s/GB: per GB of raw sample bytes delivered (node: the edge node's). Memory: peaks "
        "of the sums over the first epoch's process tree (the loader and its workers; not the "
        "node, whose peak is in the JSON), sampled from /proc every 50 ms; anon = RSS less "
        "file-backed and shared pages"
    )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()))
    m = out["machine"]
    console.print(
        f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB, {m['platform']}"
    )
    console.print(f"wall time: {out['wall_s']:.0f} s")
