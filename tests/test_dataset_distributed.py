"""EdgeDataset under torch.distributed: real processes (gloo), elastic resume from rank 0's state.

Each rank is its own Python process (tests/dist_child.py) joined by a gloo
process group over loopback TCP; ranks take their rank, world size and the
pinned versions from torch.distributed. A job reads some steps in lockstep,
rank 0 saves its state, and a job of another world size and batch size
resumes from it: together they must read every sample of the epoch exactly
once (or, with drop_last, never twice and in equal full batches).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from s3server import free_port
from test_dataset_features import CODE_BASE, CODE_ROWS, CODE_SHARDS, TOTAL, cluster, endpoints

CHILD = Path(__file__).with_name("dist_child.py")
__all__ = ["cluster"]  # the shared module fixture: two nodes, tokens@1 and code@1 staged


def run_job(
    tmp: Path,
    name: str,
    world: int,
    *,
    spec: object,
    eps: list[str],
    batch: int,
    workers: int = 0,
    steps: int | None = None,
    state_in: Path | None = None,
    extra: dict | None = None,
    **kwargs: object,
) -> list[dict]:
    """Start ``world`` rank processes, wait for all, return each rank's report.

    ``extra``: more of the job's settings (dist_child.py: timeout, solo).
    """
    extra = extra or {}
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"{name}-{rank}.json"
        job = {
            **extra,
            "init": init,
            "rank": rank,
            "world": world,
            "spec": spec,
            "endpoints": eps,
            "batch": batch,
            "workers": workers,
            "steps": steps,
            "state_in": str(state_in) if state_in else None,
            "state_out": str(tmp / f"{name}-state.json"),
            "out": str(out),
            "kwargs": {"window_bytes": 24 << 10, "seed": 5, **kwargs},
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(job)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        outs.append(out)
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{logs[rank][-5000:]}"
    return [json.loads(o.read_text()) for o in outs]


def samples(reports: list[dict]) -> Counter:
    return Counter(tuple(s) for r in reports for s in r["samples"])


def test_elastic_resume_across_processes_over_grpc_with_workers(cluster, tmp_path: Path) -> None:
    # Two ranks (DataLoader workers each) read 9 steps of 50; rank 0's state alone
    # resumes three ranks with batches of 40: every sample exactly once.
    eps = endpoints(cluster, "grpc")
    first = run_job(tmp_path, "a", 2, spec="tokens@1", eps=eps, batch=50, workers=2, steps=9)
    assert all(r["sizes"] == [50] * 9 for r in first)
    rest = run_job(
        tmp_path,
        "b",
        3,
        spec="tokens@1",
        eps=eps,
        batch=40,
        workers=2,
        state_in=tmp_path / "a-state.json",
    )
    for report in rest:
        assert len(report["sizes"]) == report["len"]  # len(): what is left, this rank
        assert all(s == 40 for s in report["sizes"][:-1])  # at most one partial batch
    seen = samples(first) + samples(rest)
    assert set(seen.values()) == {1} and {x for _, x in seen} == set(range(TOTAL))


def test_mixture_drop_last_elastic_across_processes_over_lmdb(cluster, tmp_path: Path) -> None:
    # A mixture with its component column, drop_last, read from the node's LMDB cache:
    # three ranks then two, equal full batches on every rank, no sample twice, each
    # component at its weight.
    eps = endpoints(cluster, "lmdb")
    spec = {"tokens@1": 0.75, "code@1": 0.25}
    options = {"samples_per_epoch": 4000, "component_column": "source", "drop_last": True}
    first = run_job(tmp_path, "a", 3, spec=spec, eps=eps, batch=32, steps=10, **options)
    rest = run_job(
        tmp_path,
        "b",
        2,
        spec=spec,
        eps=eps,
        batch=48,
        state_in=tmp_path / "a-state.json",
        **options,
    )
    assert {len(r["sizes"]) for r in first} == {10}
    assert len({len(r["sizes"]) for r in rest}) == 1
    assert all(s == 48 for r in rest for s in r["sizes"]) and rest[0]["len"] == len(
        rest[0]["sizes"]
    )
    seen = samples(first) + samples(rest)
    assert set(seen.values()) == {1}
    assert 4000 - len(seen) < 2 * 48 * 5  # dropped: only what cannot fill a batch everywhere
    code = {x for c, x in seen if c == 1}
    assert code <= set(range(CODE_BASE, CODE_BASE + CODE_SHARDS * CODE_ROWS))
    assert abs(len(code) - 1000) <= 2 * 48 * 5 and {x for c, x in seen if c == 0} <= set(
        range(TOTAL)
    )


def test_a_dataset_of_rank_0_alone_makes_no_collective(cluster, tmp_path: Path) -> None:
    """An evaluation set built on rank 0 only (rank=0, world_size=1) under a process group
    broadcast and gathered on the default group: the other ranks' next collective (a
    barrier; DDP's all-reduce) was paired with them, and the job hung until the timeout."""
    reports = run_job(
        tmp_path, "solo", 2, spec="tokens@1", eps=endpoints(cluster, "grpc"), batch=64,
        extra={"solo": True, "timeout": 60},
    )  # fmt: skip
    solo = json.loads((tmp_path / "solo-0.json.solo").read_text())
    assert solo["rows"] == TOTAL  # the whole epoch: a dataset of its own
    assert sum(len(r["samples"]) for r in reports) == TOTAL  # the group's, split as before
