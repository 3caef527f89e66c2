"""The CLI sets mimalloc's purge delay before pyarrow loads (clients/cli/__init__.py says why).

mimalloc reads its options from the environment once, when pyarrow's library
loads: set any later, the setting does nothing. Each case runs in a fresh
interpreter, since this one loaded pyarrow long ago.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Records the variable as it stood when pyarrow's first module started to load.
_PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pyarrow" and not seen:
            seen.append(os.environ.get("MIMALLOC_PURGE_DELAY"))
        return None
sys.meta_path.insert(0, Watch())
import edgecache.clients.cli  # noqa: F401
print(seen[0] if seen else "pyarrow never loaded")
"""


def _seen_at_pyarrow_load(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_purge_delay_is_set_before_pyarrow_loads() -> None:
    assert _seen_at_pyarrow_load() == "10000"


def test_a_purge_delay_the_user_set_wins() -> None:
    assert _seen_at_pyarrow_load(MIMALLOC_PURGE_DELAY="10") == "10"
