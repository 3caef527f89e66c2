"""Figures, targets and tables of the WAN benchmark.

The results dict is the contract with whoever renders tables and charts: it
holds the link as specified and as measured, the dataset's sizes, each
measurement with its timeline, one row per target (``rows``), and the
package versions.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from bench.report import versions

__all__ = ["assemble", "print_link", "print_results"]

TARGETS = {
    "staging": 0.9,  # fraction of the link rate
    "prestaged_vs_local": 1.2,  # at most this many times the fully local epoch
    "saved_vs_cold": 0.7,  # at least this much less wall time than reading through
    "reads_with_staging": 0.9,  # read throughput with staging / without
}


def _mbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:.1f} Mbit/s"


def link_figures(link: dict[str, Any], probe: dict[str, Any]) -> dict[str, Any]:
    """The link as measured: RTT, bulk rates, loss per direction."""
    counters = probe.get("counters", {})
    loss = {}
    for way in ("to_edge", "to_origin"):
        packets = counters.get(f"{way}_packets", 0)
        if packets:
            loss[way] = round(counters[f"{way}_dropped"] / packets, 5)
    best = max(probe["bulk"], key=lambda b: b["bytes_per_s"])
    return {
        "rtt_median_ms": probe["rtt_median_ms"],
        "rtt_min_ms": probe["rtt_min_ms"],
        "connect_ms": probe["connect_ms"],
        "bulk": [
            {k: v for k, v in b.items() if k != "timeline"} | {"timeline": b["timeline"]}
            for b in probe["bulk"]
        ],
        "best_bulk_bytes_per_s": best["bytes_per_s"],
        "best_bulk_streams": best["streams"],
        "loss": loss,
        "counters": counters,
        "nominal_bytes_per_s": link["rate_mbit"] * 1e6 / 8,
    }


def print_link(console: Console, link: dict[str, Any], probe: dict[str, Any]) -> None:
    """The link against its specification, before any edgecache figure."""
    figures = link_figures(link, probe)
    table = Table(title=f"the link ({link['kind']}), measured before the benchmark")
    for column in ("property", "specified", "measured"):
        table.add_column(column, justify="left" if column == "property" else "right")
    table.add_row(
        "round trip (1-byte echo, median)",
        f"{link['rtt_ms']:g} ms",
        f"{figures['rtt_median_ms']:.1f} ms (min {figures['rtt_min_ms']:.1f})",
    )
    for b in figures["bulk"]:
        table.add_row(
            f"bulk TCP payload rate, {b['streams']} stream(s), {b['seconds']:g} s",
            f"{link['rate_mbit']:g} Mbit/s on the wire",
            f"{b['mbit_s']:.1f} Mbit/s",
        )
    for way, value in figures["loss"].items():
        c = figures["counters"]
        table.add_row(
            f"packet loss {way.replace('_', ' ')} (drop-rule counters)",
            f"{link['loss'] * 100:g} %",
            f"{value * 100:.3f} % ({c[f'{way}_dropped']:,} of {c[f'{way}_packets']:,})",
        )
    if not figures["loss"]:
        table.add_row("packet loss", f"{link['loss'] * 100:g} %", "not simulated (proxy)")
    table.add_row("congestion control (both ends)", link["congestion_control"], "")
    table.add_row("bottleneck buffer (tbf limit)", f"{link['buffer_bytes']:,} B", "")
    console.print(table)


def assemble(
    *,
    link: dict[str, Any],
    why: str,
    probe: dict[str, Any],
    data: dict[str, Any],
    node_settings: dict[str, Any],
    measured: dict[str, Any],
    wall_s: float,
    machine: dict[str, Any],
) -> dict[str, Any]:
    """Everything measured, the ratios against their targets, and versions."""
    figures = link_figures(link, probe)
    staging = measured["staging"]
    nominal = figures["nominal_bytes_per_s"]
    bulk = figures["best_bulk_bytes_per_s"]
    ratio_staging = staging["bytes_per_s"] / nominal
    rows = [
        _row(
            "staging",
            "staging over the link (edgecache warm), origin bytes/s",
            _mbit(staging["bytes_per_s"]),
            f"link rate {link['rate_mbit']:g} Mbit/s",
            ratio_staging,
            f"{ratio_staging:.3f}×",
            f"≥ {TARGETS['staging']:g}",
            ratio_staging >= TARGETS["staging"],
        ),
        _row(
            "staging_vs_bulk",
            "  same, against a plain bulk transfer over the link",
            _mbit(staging["bytes_per_s"]),
            f"bulk TCP, {figures['best_bulk_streams']} stream(s): {_mbit(bulk)}",
            staging["bytes_per_s"] / bulk,
            f"{staging['bytes_per_s'] / bulk:.3f}×",
        ),
    ]
    epochs = measured.get("epochs")
    if epochs:
        ratio_local = epochs["prestaged"]["seconds"] / epochs["local"]["seconds"]
        saved = 1 - epochs["prestaged"]["seconds"] / epochs["cold"]["seconds"]
        rows += [
            _row(
                "prestaged_vs_local",
                "epoch from the pre-staged region / fully local read",
                f"{epochs['prestaged']['seconds']:.2f} s",
                f"{epochs['local']['seconds']:.2f} s",
                ratio_local,
                f"{ratio_local:.3f}×",
                f"≤ {TARGETS['prestaged_vs_local']:g}",
                ratio_local <= TARGETS["prestaged_vs_local"],
            ),
            _row(
                "saved_vs_cold",
                "epoch wall time saved: pre-staged vs reading through the link",
                f"{epochs['prestaged']['seconds']:.2f} s",
                f"{epochs['cold']['seconds']:.2f} s",
                saved,
                f"{saved * 100:.1f} % less",
                f"≥ {TARGETS['saved_vs_cold'] * 100:g} % less",
                saved >= TARGETS["saved_vs_cold"],
            ),
            _row(
                "first_batch_prestaged_vs_cold",
                "  time to first batch, pre-staged vs reading through the link",
                f"{epochs['prestaged']['first_batch_s'] * 1e3:,.0f} ms",
                f"{epochs['cold']['first_batch_s'] * 1e3:,.0f} ms",
                epochs["prestaged"]["first_batch_s"] / epochs["cold"]["first_batch_s"],
                f"{epochs['prestaged']['first_batch_s'] / epochs['cold']['first_batch_s']:.3f}×",
            ),
        ]
    contention = measured.get("contention")
    if contention:
        alone, busy = contention["alone"], contention["with_staging"]
        ratio_reads = busy["samples_per_s"] / alone["samples_per_s"]
        rows.append(
            _row(
                "reads_with_staging",
                "training job's read throughput with staging running / without",
                f"{busy['samples_per_s']:,} samples/s",
                f"{alone['samples_per_s']:,} samples/s",
                ratio_reads,
                f"{ratio_reads:.3f}×",
                f"≥ {TARGETS['reads_with_staging']:g}",
                ratio_reads >= TARGETS["reads_with_staging"],
            )
        )
        later, later_alone = (
            contention["with_staging_after_first"],
            contention["alone_after_first"],
        )
        if later["epochs"]:
            steady = later["samples_per_s"] / later_alone["samples_per_s"]
            rows.append(
                _row(
                    "reads_with_staging_steady",
                    "  same, leaving out each job's first epoch (staging still yielding)",
                    f"{contention['with_staging_after_first']['samples_per_s']:,} samples/s",
                    f"{contention['alone_after_first']['samples_per_s']:,} samples/s",
                    steady,
                    f"{steady:.3f}×",
                )
            )
    return {
        "link": {**link, "chosen_because": why, "measured": figures},
        "data": {k: v for k, v in data.items() if k != "source"},
        "node_settings": node_settings,
        **measured,
        "rows": rows,
        "targets": TARGETS,
        "machine": machine,
        "versions": versions(
            "edgecache", "torch", "grpcio", "pyarrow", "zstandard", "lmdb", "aiobotocore", "moto"
        ),
        "setup_and_measure_s": round(wall_s, 1),
    }


def _row(
    key: str,
    measure: str,
    ours: str,
    baseline: str,
    value: float,
    shown: str,
    target: str = "",
    met: bool | None = None,
) -> dict[str, Any]:
    return {
        "key": key,
        "measure": measure,
        "ours": ours,
        "baseline": baseline,
        "value": round(value, 4),
        "shown": shown,
        "target": target,
        "met": met,
    }


def print_results(console: Console, results: dict[str, Any]) -> None:
    """The table of ratios against targets, then epochs, staging, sizes and versions."""
    link = results["link"]
    # The proxy link (no netem) simulates no loss: the title said the loss it was given.
    simulated = "to_edge" in ((link.get("measured") or {}).get("loss") or {})
    loss = f", {link['loss'] * 100:g} % loss" if simulated else ", no loss simulated"
    table = Table(
        title=f"edgecache over a simulated WAN ({link['rtt_ms']:g} ms, {link['rate_mbit']:g} "
        f"Mbit/s{loss}; {link['kind']})"
    )
    for column in ("measure", "ours", "baseline", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for row in results["rows"]:
        mark = "" if row["met"] is None else ("✓" if row["met"] else "✗")
        table.add_row(
            row["measure"], row["ours"], row["baseline"], row["shown"], row["target"], mark
        )
    console.print(table)
    labels = {
        "cold": "cold node, read through across the link",
        "prestaged": "pre-staged region (edgecache warm)",
        "local": "fully local (origin and registry on local disk)",
        "lmdb": "local lmdb:// fast path on the pre-staged cache",
    }
    for key, label in labels.items():
        e = results.get("epochs", {}).get(key)
        if e is not None:
            console.print(
                f"epoch, {label}: {e['seconds']:.2f} s, first batch "
                f"{e['first_batch_s'] * 1e3:,.0f} ms, {e['samples'] / e['seconds']:,.0f} samples/s"
            )
    staging = results["staging"]
    console.print(
        f"staging: {staging['parquet_bytes'] / 1e6:,.1f} MB of Parquet in {staging['staging_s']} s "
        "from the node's Stage call to its last shard committed; the whole `edgecache warm` took "
        f"{staging['wall_s']} s ({staging['planning_s']} s of it before staging began)"
    )
    contention = results.get("contention")
    if contention:
        alone, busy = contention["alone"], contention["with_staging"]
        during = ", ".join(_mbit(r) for r in contention["link_bytes_per_s_during_epochs"])
        console.print(
            f"job of {busy['epochs']} epochs beside staging: {busy['epoch_seconds']} s; alone "
            f"(before and after): {alone['epoch_seconds']} s. Staging's link rate: "
            f"{_mbit(contention['link_bytes_per_s_before_epochs'])} before the job, {during} "
            "during its epochs"
        )
    data = results["data"]
    console.print(
        f"data: {data['raw_bytes'] / 2**20:,.0f} MiB raw tokens ({data['rows']:,} samples of "
        f"2048 int32), {data['shards']} Parquet shards, {data['parquet_bytes'] / 1e6:,.1f} MB "
        f"at origin; node settings {results['node_settings']}"
    )
    machine = results["machine"]
    console.print(
        "versions: "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
        + f"; kernel {machine['kernel']}, {machine['cpus']} CPUs"
    )
    console.print(
        f"wall time: {results['wall_s']} s ("
        + ", ".join(f"{k} {v} s" for k, v in results.get("phases_s", {}).items())
        + ")"
    )
