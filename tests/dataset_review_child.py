"""One rank of a gloo job making an EdgeDataset of an unknown version (test_dataset_review).

Usage: python dataset_review_child.py JOB_JSON

JOB_JSON: init (tcp://…), rank, world, spec, endpoints, out (a path with ``{rank}``).
Writes what the rank raised (type, message, seconds taken), then meets the
other ranks in a barrier and takes the group down: rank 0 must not keep the
others waiting in the broadcast of the versions.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from edgecache.clients import EdgeDataset

job = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method=job["init"], rank=job["rank"], world_size=job["world"])
started = time.monotonic()
report: dict = {"rank": job["rank"]}
try:
    EdgeDataset(job["spec"], endpoints=job["endpoints"], batch_size=10)
    report["raised"] = None
except Exception as exc:  # noqa: BLE001 - the report says what it was
    report.update(raised=type(exc).__name__, message=str(exc))
report["seconds"] = time.monotonic() - started
Path(job["out"].format(rank=job["rank"])).write_text(json.dumps(report))
# Every rank is here once each has its error (rank 0 alive until then, as a training
# script that logs the error and writes its report would be). Leaving with the gloo group
# still up aborted a rank now and then ("terminate called without an active exception"
# from gloo's threads at exit): the group is taken down first.
dist.barrier()
dist.destroy_process_group()
