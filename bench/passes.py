"""How far apart a component's passes in one epoch are read: the order of today against
the order states before format 6 resume in, built in the same run.

    python -m bench.passes [--json]

An epoch that holds a component more than once (over-weighted in a mixture, or
``samples_per_epoch`` above its rows) reads each row that often. Read side by side
(format 5), two passes of the same windows came at the same time, so a batch held
rows twice; read in turn (format 6), a row's copies come a pass apart. For each
shape (a version alone at 2x; a 4:1 mixture with the small version at 2x and 4x;
an under-weighted version starting its next pass mid-epoch) this prints the
batches holding a repeated row, the most repeated rows in one batch, and the
median distance between a row's copies as a share of the epoch. No I/O: the
order alone (``EpochOrder``, what every reader follows).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import report
from bench.arguments import positive_int
from edgecache.clients.epoch_order import Component, EpochOrder, Extent

BATCH, LANES, SHUFFLE_WINDOWS, WINDOW_ROWS = 256, 4, 16, 32


def _version(key: str, shards: int, rows: int, samples: int) -> Component:
    extents = tuple(Extent(s, 0, rows) for s in range(shards))
    return Component(key, extents, WINDOW_ROWS, samples)


SHAPES: dict[str, list[Component]] = {
    "one version at 2x": [_version("a@1", 8, 2000, 2 * 16_000)],
    "mixture, small at 2x": [_version("big@1", 4, 4000, 16_000), _version("s@1", 4, 500, 4000)],
    "mixture, small at 4x": [_version("big@1", 4, 4000, 16_000), _version("s@1", 4, 500, 8000)],
    "at 1.7x, next pass mid-epoch": [_version("a@1", 8, 2000, 27_200)],
}


def measure(components: list[Component], in_turn: bool, seed: int, epoch: int) -> dict[str, Any]:
    """Batches with a repeated row, the most in one batch, and the median copy distance."""
    order = EpochOrder(
        components,
        seed=seed,
        epoch=epoch,
        batch_size=BATCH,
        lanes=LANES,
        shuffle_windows=SHUFFLE_WINDOWS,
        passes_in_turn=in_turn,
    )
    repeated, most, last, gaps, position = 0, 0, {}, [], 0
    for n in range(order.batch_count):
        batch = order.sample_ids(order.batch(n))
        twice = len(batch) - len(set(batch))
        repeated += twice > 0
        most = max(most, twice)
        for sample in batch:
            if sample in last:
                gaps.append(position - last[sample])
            last[sample] = position
            position += 1
    return {
        "batches": order.batch_count,
        "batches_with_a_repeat": repeated,
        "most_in_one_batch": most,
        "median_gap_share": float(np.median(gaps)) / position if gaps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--epochs", type=positive_int, default=3, help="epochs per shape (seed 7)")
    args = parser.parse_args()
    rows = []
    for shape, components in SHAPES.items():
        for epoch in range(args.epochs):
            new = measure(components, True, 7, epoch)
            old = measure(components, False, 7, epoch)
            rows.append({"shape": shape, "epoch": epoch, "in_turn": new, "side_by_side": old})
    if args.json:
        print(json.dumps({"rows": rows, "versions": report.versions("numpy")}, indent=2))
        return
    table = Table(
        title=f"passes read in turn (format 6) vs side by side (format 5): batches of {BATCH}, "
        f"{LANES} lanes x {SHUFFLE_WINDOWS} streams, {WINDOW_ROWS}-row windows"
    )
    for column in ("shape", "epoch", "batches with a repeat", "most in a batch", "median gap"):
        table.add_column(column)
    for row in rows:
        new, old = row["in_turn"], row["side_by_side"]

        def gap(m: dict[str, Any]) -> str:
            share = m["median_gap_share"]
            return "-" if share is None else f"{share:.1%}"

        table.add_row(
            row["shape"],
            str(row["epoch"]),
            f"{new['batches_with_a_repeat']} / {new['batches']} "
            f"(was {old['batches_with_a_repeat']})",
            f"{new['most_in_one_batch']} (was {old['most_in_one_batch']})",
            f"{gap(new)} (was {gap(old)})",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
