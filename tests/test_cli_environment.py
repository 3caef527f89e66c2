"""The CLI sets its libraries' options before they load (clients/cli/__init__.py says why).

mimalloc (Arrow's pool) and numpy's OpenBLAS each read their options from the
environment once, when their library loads: set any later, a setting does
nothing. Each case runs in a fresh interpreter, since this one loaded both long
ago; one probe records what each library saw and what the process then is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The options each library reads as it loads.
WATCHED = {
    "pyarrow": ("MIMALLOC_PURGE_DELAY", "MIMALLOC_ALLOW_THP"),
    "numpy": ("OPENBLAS_NUM_THREADS",),
}

# Records the options as they stood when each library's first module started to load; then,
# once both have loaded (the CLI's import loads them), the process's threads (OpenBLAS starts
# its pool as numpy loads; the CLI's import starts none), and whether the process may still
# get transparent huge pages once Arrow's pool has allocated.
_PROBE = """
import importlib.abc, json, os, sys
WATCHED = __WATCHED__
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in WATCHED and name not in seen:
            seen[name] = {k: os.environ.get(k) for k in WATCHED[name]}
        return None
sys.meta_path.insert(0, Watch())
import edgecache.clients.cli  # noqa: F401
import numpy
import pyarrow as pa
threads = [line.split()[1] for line in open("/proc/self/status") if line.startswith("Threads:")]
buffer = pa.allocate_buffer(1 << 20)  # mimalloc initialises on its first allocation
thp = [line.split()[1] for line in open("/proc/self/status") if line.startswith("THP_enabled:")]
print(json.dumps({"seen": seen, "threads": int(threads[0]), "thp_enabled": (thp or [None])[0]}))
""".replace("__WATCHED__", repr(WATCHED))


def _probe(**env: str) -> dict:
    options = {k for names in WATCHED.values() for k in names}
    base = {k: v for k, v in os.environ.items() if k not in options}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_options_are_set_before_pyarrow_loads() -> None:
    seen = _probe()["seen"]["pyarrow"]
    assert seen == {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0"}


def test_options_the_user_set_win() -> None:
    seen = _probe(MIMALLOC_PURGE_DELAY="10", MIMALLOC_ALLOW_THP="1")["seen"]["pyarrow"]
    assert seen == {"MIMALLOC_PURGE_DELAY": "10", "MIMALLOC_ALLOW_THP": "1"}


def test_arrow_turns_huge_pages_off_for_the_whole_process() -> None:
    """What the setting is for: mimalloc's allow_thp=0 takes effect (prctl), not just parsed."""
    allowed = _probe(MIMALLOC_ALLOW_THP="1")["thp_enabled"]
    if allowed is None:
        pytest.skip("this kernel's /proc/self/status has no THP_enabled line (before Linux 5.0)")
    if allowed != "1":  # a kernel built without them: nothing to turn off
        pytest.skip("this kernel has no transparent huge pages (THP_enabled 0 when allowed)")
    assert _probe()["thp_enabled"] == "0"  # allowed read "1" here, so "0" means something


def test_one_blas_thread_is_set_before_numpy_loads() -> None:
    assert _probe()["seen"]["numpy"] == {"OPENBLAS_NUM_THREADS": "1"}


def test_numpy_then_starts_no_blas_pool() -> None:
    """What the setting is for: OpenBLAS starts no threads beside the caller's.

    Counted against the same process with two OpenBLAS threads asked for, which
    start one (pyarrow's own background thread is in both counts). OpenBLAS
    takes no more threads than the process may run on cores, so one core cannot show it.
    """
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: OpenBLAS starts no pool whatever it is asked for")
    assert _probe()["threads"] + 1 == _probe(OPENBLAS_NUM_THREADS="2")["threads"]


def test_a_blas_thread_count_the_user_set_wins() -> None:
    assert _probe(OPENBLAS_NUM_THREADS="3")["seen"]["numpy"] == {"OPENBLAS_NUM_THREADS": "3"}
