"""One rank of a real DDP training job on an EdgeDataset, started by torchrun (test_dataset_walk).

Usage: torchrun --nproc_per_node=N ddp_child.py JOB_JSON

JOB_JSON: endpoints, spec, batch, epochs, workers, out (a path with ``{rank}``),
kwargs (more EdgeDataset arguments). The dataset is made the way the docs
show, with no rank or world size: it must take them from torch.distributed.
Every step is a DDP forward and backward (a gradient all-reduce), so ranks
with different batch counts fail here as they would in training. Writes the
rank, world size, ``len(loader)`` and the labels read in each epoch.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from edgecache.clients import EdgeDataset

job = json.loads(sys.argv[1])
dist.init_process_group("gloo")
try:
    ds = EdgeDataset(
        job["spec"], endpoints=job["endpoints"], batch_size=job["batch"], **job["kwargs"]
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=job["workers"])
    model = DistributedDataParallel(torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    report: dict = {"rank": ds.rank, "world": ds.world_size, "len": len(loader), "epochs": []}
    for epoch in range(job["epochs"]):
        ds.set_epoch(epoch)
        labels: list[int] = []
        for batch in loader:
            loss = model(batch["input_ids"].float()).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            labels += batch["label"].tolist()
        report["epochs"].append(labels)
    with open(job["out"].format(rank=dist.get_rank()), "w") as f:
        json.dump(report, f)
    dist.barrier()
finally:
    dist.destroy_process_group()
