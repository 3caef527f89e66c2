"""The CLI keeps numpy's OpenBLAS to one thread (clients/cli/__init__.py says why).

OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy's library loads, and
starts its threads then. Each case runs in a fresh interpreter, since this one
loaded numpy long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The setting as it stood when numpy's first module started to load, and the process's
# threads once numpy has loaded (OpenBLAS starts its pool then; the CLI's import starts none).
_PROBE = """
import importlib.abc, json, os, sys
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not seen:
            seen["value"] = os.environ.get("OPENBLAS_NUM_THREADS")
        return None
sys.meta_path.insert(0, Watch())
import edgecache.clients.cli  # noqa: F401
import numpy
threads = [line.split()[1] for line in open("/proc/self/status") if line.startswith("Threads:")]
print(json.dumps({"seen": seen.get("value"), "threads": int(threads[0])}))
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_one_blas_thread_is_set_before_numpy_loads() -> None:
    assert _probe()["seen"] == "1"


def test_numpy_then_starts_no_blas_pool() -> None:
    """What the setting is for: OpenBLAS starts no threads beside the caller's.

    Counted against the same process with two OpenBLAS threads asked for, which
    start one (pyarrow's own background thread is in both counts). OpenBLAS
    takes no more threads than the process may run on cores, so one core cannot show it.
    """
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: OpenBLAS starts no pool whatever it is asked for")
    assert _probe()["threads"] + 1 == _probe(OPENBLAS_NUM_THREADS="2")["threads"]


def test_a_value_the_user_set_wins() -> None:
    assert _probe(OPENBLAS_NUM_THREADS="3")["seen"] == "3"
