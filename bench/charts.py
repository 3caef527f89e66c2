"""PNG charts for docs/benchmarks.md, drawn with matplotlib's Agg backend (no screen)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

__all__ = ["draw"]

_OURS = "#1f77b4"
_PEER = "#9e9e9e"


def _peers(data: dict, out: Path) -> Path:
    """Samples/s per system, one panel per dataset, a bar per worker count (log scale)."""
    datasets = list(data["data"])
    workers = data["settings"]["workers"] if "settings" in data else data["workers"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.2), squeeze=False)
    for ax, name in zip(axes[0], datasets, strict=True):
        epochs = [e for e in data["epochs"] if e["dataset"] == name]
        systems = list(dict.fromkeys(e["system"] for e in epochs))
        width = 0.8 / len(workers)
        for i, w in enumerate(workers):
            rate = {e["system"]: e["samples_s"] for e in epochs if e["workers"] == w}
            xs = [k + (i - (len(workers) - 1) / 2) * width for k in range(len(systems))]
            colours = [_OURS if s.startswith("edgecache") else _PEER for s in systems]
            ax.bar(
                xs,
                [rate.get(s, 0) for s in systems],
                width,
                color=colours,
                alpha=1.0 if i == 0 else 0.55,
                label=f"num_workers={w}",
                edgecolor="black",
                linewidth=0.4,
            )
        ax.set_xticks(range(len(systems)), systems, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("samples/s (log)")
        d = data["data"][name]
        ax.set_title(
            f"{name}: {d['samples']:,} samples, {d['raw_mb']:,.0f} MB, batch {d['batch_size']}"
        )
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("One epoch through a DataLoader: edgecache (blue) and peers (grey, local disk)")
    fig.tight_layout()
    path = out / "peers-throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wan(data: dict, out: Path) -> Path | None:
    """Timelines over the simulated WAN: staging bytes and epoch batches against time."""
    timelines = data.get("timelines") or {}
    if not timelines:
        return None
    panels = [(k, v) for k, v in timelines.items() if v.get("t")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels, strict=True):
        for label, ys in series.items():
            if label in ("t", "unit", "title"):
                continue
            ts = series["t"] if not isinstance(ys, dict) else ys["t"]
            values = ys if not isinstance(ys, dict) else ys["y"]
            ax.plot(ts, values, label=label)
        ax.set_xlabel("seconds")
        ax.set_ylabel(series.get("unit", ""))
        ax.set_title(series.get("title", name))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "wan-timelines.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(results: dict[str, dict], out: Path) -> dict[str, Path]:
    """Every chart the results allow, by suite name."""
    drawn: dict[str, Path] = {}
    if "peers" in results:
        drawn["peers"] = _peers(results["peers"], out)
    if "wan" in results:
        path = _wan(results["wan"], out)
        if path is not None:
            drawn["wan"] = path
    return drawn
