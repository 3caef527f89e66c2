"""The CLI sets mimalloc's options before pyarrow loads (clients/cli/__init__.py says why).

mimalloc reads its options from the environment once, when pyarrow's library
loads: set any later, a setting does nothing. Each case runs in a fresh
interpreter, since this one loaded pyarrow long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

OPTIONS = ("MIMALLOC_PURGE_DELAY", "MIMALLOC_ALLOW_THP")

# Records the options as they stood when pyarrow's first module started to load, then
# whether the process may still get transparent huge pages once Arrow's pool has allocated.
_PROBE = """
import importlib.abc, json, os, sys
OPTIONS = __OPTIONS__
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pyarrow" and not seen:
            seen.update({k: os.environ.get(k) for k in OPTIONS})
        return None
sys.meta_path.insert(0, Watch())
import edgecache.clients.cli  # noqa: F401
import pyarrow as pa
buffer = pa.allocate_buffer(1 << 20)  # mimalloc initialises on its first allocation
thp = [line.split()[1] for line in open("/proc/self/status") if line.startswith("THP_enabled:")]
print(json.dumps({"seen": seen or None, "thp_enabled": thp[0] if thp else None}))
""".replace("__OPTIONS__", repr(OPTIONS))


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in OPTIONS}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_options_are_set_before_pyarrow_loads() -> None:
    assert _probe()["seen"] == {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0"}


def test_options_the_user_set_win() -> None:
    seen = _probe(MIMALLOC_PURGE_DELAY="10", MIMALLOC_ALLOW_THP="1")["seen"]
    assert seen == {"MIMALLOC_PURGE_DELAY": "10", "MIMALLOC_ALLOW_THP": "1"}


def test_arrow_turns_huge_pages_off_for_the_whole_process() -> None:
    """What the setting is for: mimalloc's allow_thp=0 takes effect (prctl), not just parsed."""
    allowed = _probe(MIMALLOC_ALLOW_THP="1")["thp_enabled"]
    if allowed is None:
        pytest.skip("this kernel's /proc/self/status has no THP_enabled line (before Linux 5.0)")
    if allowed != "1":  # a kernel built without them: nothing to turn off
        pytest.skip("this kernel has no transparent huge pages (THP_enabled 0 when allowed)")
    assert _probe()["thp_enabled"] == "0"  # allowed read "1" here, so "0" means something
