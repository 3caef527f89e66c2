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


def _wan(data: dict, out: Path) -> Path:
    """Staging bytes against the link's rate; epochs cold, pre-staged and local; contention."""
    fig, (stage, epochs, contention) = plt.subplots(1, 3, figsize=(17, 4.3))
    staging = data["staging"]
    t0 = staging["staging_window"][0]
    ts = [t - t0 for t, _ in staging["timeline"]]
    stage.plot(
        ts, [b / 1e6 for _, b in staging["timeline"]], color=_OURS, label="staged (origin bytes)"
    )
    rate = data["link"]["measured"]["nominal_bytes_per_s"]
    end = staging["staging_window"][1] - t0
    stage.plot([0, end], [0, rate * end / 1e6], "--", color=_PEER, label="link rate")
    stage.set_xlim(left=0)
    stage.set_xlabel("seconds since staging started")
    stage.set_ylabel("MB over the link")
    stage.set_title(f"edgecache warm across {_link_name(data)}")
    stage.legend(fontsize=8)
    for name, style in (("cold", "-"), ("prestaged", "-"), ("local", "--"), ("lmdb", ":")):
        run = data["epochs"].get(name)
        if run:
            epochs.plot(
                [t for t, _ in run["timeline"]],
                [n for _, n in run["timeline"]],
                style,
                label=f"{name}: {run['seconds']:.1f} s",
            )
    epochs.set_xscale("symlog", linthresh=1.0)
    epochs.set_xlabel("seconds since the epoch started (symlog)")
    epochs.set_ylabel("batches delivered")
    epochs.set_title("one epoch: through the link vs pre-staged vs local")
    epochs.legend(fontsize=8)
    runs = data["contention"]
    alone = runs["alone"]["epoch_seconds"]
    beside = runs["with_staging"]["epoch_seconds"]
    contention.bar(range(len(alone)), alone, color=_PEER, label="alone")
    contention.bar(
        range(len(alone), len(alone) + len(beside)), beside, color=_OURS, label="staging running"
    )
    contention.set_xlabel("epoch")
    contention.set_ylabel("epoch seconds (warm node)")
    contention.set_title("training reads with and without staging on the node")
    contention.legend(fontsize=8)
    for ax in (stage, epochs, contention):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "wan-timelines.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _link_name(data: dict) -> str:
    link = data["link"]
    return f"{link['rtt_ms']:g} ms, {link['rate_mbit']:g} Mbit/s, {link['loss'] * 100:g} % loss"


def draw(results: dict[str, dict], out: Path) -> dict[str, Path]:
    """Every chart the results allow, by suite name."""
    drawn: dict[str, Path] = {}
    if "peers" in results:
        drawn["peers"] = _peers(results["peers"], out)
    if "wan" in results:
        drawn["wan"] = _wan(results["wan"], out)
    if "schedule" in results:
        from bench.schedule import draw as draw_schedule

        drawn["schedule"] = draw_schedule(results["schedule"], out / "schedule-timeline.png")
    return drawn
