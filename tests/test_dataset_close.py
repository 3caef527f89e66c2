"""Stopping a training loop early: reads stop and join before what they read from is released.

A max-steps training loop leaves every epoch early. The read-ahead threads
may then be decoding zero-copy views of an LMDB map, or holding a gRPC
stream; closing the store or channel under them crashed the process (SIGSEGV)
or logged failovers that never happened. The loops run in a subprocess
(tests/early_stop_child.py) so that a crash fails the test instead of pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from edgeutil import publish, stub, write_parquet_shards

from edgecache.clients.node_client import LocalNode, start_local_node
from edgecache.v1 import edge_pb2

ROUNDS = 25
CHILD = Path(__file__).with_name("early_stop_child.py")
# The child, run with torch's wait for each DataLoader worker to exit (5 s, then it is
# terminated: exit code -15, not 0) at 20 s: a loaded host can take more than 5 s to end a
# worker, which is not a leak.
RUN_CHILD = (
    "import runpy, sys\n"
    "import torch.utils.data._utils\n"
    "torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = 20.0\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[LocalNode]]]:
    """Two nodes; the first has the whole version staged in its LMDB cache."""
    root = tmp_path_factory.mktemp("early-stop")
    write_parquet_shards(root / "origin", 6, rows=2000)
    registry = f"file://{root}/registry"
    publish(registry, f"file://{root}/origin", "tokens")
    nodes = [start_local_node(r, root / f"cache-{r}", registry) for r in ("eu", "us")]
    for _ in stub(nodes[0].address).Stage(edge_pb2.StageRequest(dataset="tokens", version=1)):
        pass
    yield root / "cache-eu", nodes
    for node in nodes:
        node.stop()


def run_child(endpoints: list[str], cache_dir: Path) -> tuple[dict, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUN_CHILD,
            str(CHILD),
            json.dumps(endpoints),
            str(cache_dir),
            str(ROUNDS),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} (-11 is SIGSEGV)\n{proc.stderr[-6000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_clean(report: dict, log: str) -> None:
    failures = [
        line for line in log.splitlines() if line.startswith(("WARNING", "ERROR", "CRITICAL"))
    ]
    assert not failures, "\n".join(failures[:20])
    assert "continuing from row" not in log and "Traceback" not in log, log[-4000:]
    assert report["failovers"] == 0 and report["failures"] == 0, report
    assert report["after"] == report["before"], report  # threads, descriptors, reader slots
    assert report["exit_codes"] and set(report["exit_codes"]) == {0}, report  # workers too


def test_early_stops_over_lmdb_never_crash_or_leak(staged) -> None:
    cache_dir, _ = staged
    report, log = run_child([f"lmdb://{cache_dir}"], cache_dir)
    assert_clean(report, log)


def test_early_stops_over_grpc_log_no_phantom_failovers(staged) -> None:
    cache_dir, nodes = staged
    report, log = run_child([n.address for n in nodes], cache_dir)
    assert_clean(report, log)


def test_closing_while_a_window_waits_for_its_neighbour_does_not_deadlock() -> None:
    # A window whose neighbour is still queued waits for it in a done-callback. Closing
    # cancels the queued neighbour inside ThreadPoolExecutor.shutdown, which runs that
    # callback under the executor's non-reentrant shutdown lock: submitting from there
    # hung the close for good (seen as a DataLoader test that never ended).
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from edgecache.clients.pipeline import Pipeline, _Stopped

    gate, stop = threading.Event(), threading.Event()
    executor = ThreadPoolExecutor(1)
    pipeline = SimpleNamespace(
        order=SimpleNamespace(
            order=SimpleNamespace(
                neighbours=lambda w: [w - 1], windows=SimpleNamespace(component=[0, 0])
            )
        ),
        targets=[SimpleNamespace(compressed=True)],
        _continuation=lambda window: None,
        _shard=lambda window: ("d", 1, 0),
        pool=SimpleNamespace(reads_locally=lambda shard: False),  # a node's windows
        _executor=executor,
        _load=lambda window, extend_to: window,
        _stop=stop,
    )
    executor.submit(gate.wait)  # the one fetch thread is busy
    futures = {0: executor.submit(lambda: 0)}  # window 0 queued behind it
    futures[1] = Pipeline._submit(pipeline, 1, futures)  # type: ignore[arg-type]
    stop.set()  # what Pipeline.close does first
    closer = threading.Thread(
        target=executor.shutdown, kwargs={"wait": False, "cancel_futures": True}, daemon=True
    )
    closer.start()
    closer.join(10)
    gate.set()
    assert not closer.is_alive(), "shutdown deadlocked in the neighbour's callback"
    with pytest.raises(_Stopped):
        futures[1].result(timeout=5)


def test_an_evaluation_with_workers_mid_epoch_reads_the_same_lmdb_cache(staged) -> None:
    """Training at num_workers=0 over lmdb:// with an evaluation DataLoader with workers
    every N steps: the workers were forked while the training loop's reads held the cache
    open, py-lmdb refused to open it again in them, and every read waited out
    retry_timeout before failing with the advice to check the nodes."""
    from torch.utils.data import DataLoader

    from edgecache.clients.dataset import EdgeDataset

    cache, _ = staged
    endpoints = [f"lmdb://{cache}"]
    train = EdgeDataset(
        "tokens@1", endpoints=endpoints, batch_size=64, rows=(0.0, 0.9), seed=1, drop_last=False
    )
    evaluation = EdgeDataset(
        "tokens@1",
        endpoints=endpoints,
        batch_size=64,
        rows=(0.9, 1.0),
        shuffle=False,
        drop_last=False,
        retry_timeout=5,
    )
    trained: list[int] = []
    evaluated: list[int] = []
    for step, batch in enumerate(DataLoader(train, batch_size=None)):
        trained += batch["label"].tolist()
        if step == 5:
            for other in DataLoader(evaluation, batch_size=None, num_workers=2):
                evaluated += other["label"].tolist()
    rows = 6 * 2000
    assert sorted(evaluated) == list(range(int(rows * 0.9), rows))
    assert sorted(trained) == list(range(int(rows * 0.9)))
    train.close()
    evaluation.close()


COLLECTED_UNDER_THE_STORES_LOCK = """
import gc, sys
from edgecache.clients import EdgeDataset, local_stores

ds = EdgeDataset("tokens@1", endpoints=[sys.argv[1]], batch_size=100)
batches = iter(ds)
next(batches)  # the local store is open, a pipeline running
with local_stores._LOCK:  # as a fetch thread opening a store holds it when it collects
    del ds, batches
    gc.collect()  # the dataset's finalizer runs here, under that lock
print("collected")
"""


def test_a_dataset_collected_while_its_thread_holds_the_stores_lock_does_not_deadlock(
    staged,
) -> None:
    # CI: a fetch thread opening an LMDB store (local_stores' lock held) allocated, the
    # collection closed an older dataset right there, and its close waited for that
    # lock: the whole read hung until pytest's 7-minute timeout.
    cache, _ = staged
    done = subprocess.run(
        [sys.executable, "-c", COLLECTED_UNDER_THE_STORES_LOCK, f"lmdb://{cache}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "collected" in done.stdout, done
