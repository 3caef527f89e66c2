"""One rank of a torch.distributed (gloo) job reading an EdgeDataset (test_dataset_distributed).

Usage: python dist_child.py JOB_JSON

JOB_JSON: init (tcp://…), rank, world, spec (a string or a mapping of weights),
endpoints, batch, workers, steps (None: to the end), state_in / state_out
(paths or None), out (path), kwargs (more EdgeDataset arguments); optional:
timeout (the process group's, seconds), solo (rank 0 first reads a dataset of
its own, rank=0 and world_size=1, while the others wait at a barrier).

The rank and world size come from torch.distributed, the version from rank 0
(broadcast). With ``steps`` every rank takes that many batches in lockstep (an
all_reduce per step, like DDP), then rank 0 saves ``state_dict(batches=steps)``.
Writes the (component, label) of every sample read, ``len(ds)`` before reading
and the batch sizes.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from edgecache.clients import EdgeDataset

job = json.loads(sys.argv[1])
dist.init_process_group(
    "gloo",
    init_method=job["init"],
    rank=job["rank"],
    world_size=job["world"],
    timeout=timedelta(seconds=job.get("timeout", 1800)),
)
try:
    if job.get("solo") and job["rank"] == 0:
        # An evaluation set on rank 0 alone, as training scripts make one: its own
        # rank and world size, so no collective (the other ranks go on to the barrier).
        solo = EdgeDataset(
            job["spec"], endpoints=job["endpoints"], batch_size=job["batch"], rank=0, world_size=1
        )
        solo_rows = sum(len(batch["label"]) for batch in solo)
        with open(job["out"] + ".solo", "w") as f:
            json.dump({"rows": solo_rows}, f)
    if job.get("solo"):
        dist.barrier()  # the next collective every rank makes
    ds = EdgeDataset(
        job["spec"], endpoints=job["endpoints"], batch_size=job["batch"], **job["kwargs"]
    )
    assert (ds.rank, ds.world_size) == (job["rank"], job["world"]), (ds.rank, ds.world_size)
    if job["state_in"]:
        with open(job["state_in"]) as f:
            ds.load_state_dict(json.load(f))
    length = len(ds)
    column = job["kwargs"].get("component_column")
    samples, sizes = [], []
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=job["workers"])
    for step, batch in enumerate(loader):
        source = batch[column] if column else torch.zeros(len(batch["label"]), dtype=torch.int64)
        samples += [[int(c), int(x)] for c, x in zip(source, batch["label"], strict=True)]
        sizes.append(len(batch["label"]))
        if job["steps"] is not None:
            tick = torch.ones(1)
            dist.all_reduce(tick)  # lockstep, as DDP's gradient all-reduce makes it
            if step + 1 == job["steps"]:
                break
    if job["rank"] == 0 and job["state_out"]:
        with open(job["state_out"], "w") as f:
            json.dump(ds.state_dict(batches=len(sizes)), f)
    with open(job["out"], "w") as f:
        json.dump({"samples": samples, "len": length, "sizes": sizes}, f)
    dist.barrier()
finally:
    dist.destroy_process_group()
