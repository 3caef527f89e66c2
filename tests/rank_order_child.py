"""One gloo rank building EdgeDatasets with the order settings of each scenario.

Started by ``torch.multiprocessing.spawn`` from test_dataset_review41: the function a
spawned child runs must be importable there, and this module is (``tests`` is on the
path pytest gives its children), where a test module imported by pytest's importlib
mode is not.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgecache.clients import EdgeDataset


def labels(batch: dict) -> list[int]:
    return [int(x) for x in batch["label"]]


SCENARIOS: list[tuple[str, dict[str, object], dict[str, object]]] = [
    # name, rank 0's settings, rank 1's (None: both the same, reading together)
    ("seed", {"seed": 5}, {"seed": 6}),
    ("shuffle_windows", {"shuffle_windows": 4}, {"shuffle_windows": 8}),
    ("rows", {"rows": (0.0, 0.5)}, {"rows": (0.0, 0.6)}),
    ("lanes", {"lanes": 4}, {"lanes": 2}),
    ("window_bytes", {"window_bytes": 24 << 10}, {"window_bytes": 48 << 10}),
    ("samples_per_epoch", {}, {"samples_per_epoch": 1000}),
    ("same", {"seed": 5}, {"seed": 5}),
    # Spelled differently, the same order: the default window (the chunk size) named.
    ("same windows", {"window_bytes": None}, {"window_bytes": 64 << 10}),
    # A fraction and the row it falls on (2,100 of 4,200 rows): the same split.
    ("same rows", {"rows": (0.0, 0.5)}, {"rows": (0, 2100)}),
    # Not shuffled: the seed (per rank, for augmentation) and shuffle_windows choose nothing.
    (
        "unshuffled",
        {"shuffle": False, "seed": 5},
        {"shuffle": False, "seed": 6, "shuffle_windows": 3},
    ),
]


def run(rank: int, init: str, cache: str, out: str) -> None:
    """One gloo rank: build a dataset per scenario, report what each raised or read."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    report: dict[str, object] = {}
    try:
        for name, first, second in SCENARIOS:
            kwargs = {"batch_size": 50, "seed": 5, **(first if rank == 0 else second)}
            try:
                ds = EdgeDataset("tokens@1", endpoints=[cache], **kwargs)  # type: ignore[arg-type]
            except ValueError as exc:
                report[name] = {"raised": str(exc)}
                continue
            assert (ds.rank, ds.world_size) == (rank, 2)
            report[name] = {"labels": [x for b in ds for x in labels(b)]}
    finally:
        Path(out.format(rank=rank)).write_text(json.dumps(report))
        dist.barrier()
        dist.destroy_process_group()
