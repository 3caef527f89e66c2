"""The Makefile's targets report failure: CI and people read their exit status."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_chaos_fails_when_a_chaos_test_fails(tmp_path: Path) -> None:
    # make chaos pipes pytest into grep for the figures; without pipefail a failed test
    # left grep's status (0) as the target's.
    failing = tmp_path / "test_always_fails.py"
    failing.write_text("def test_fails():\n    print('FIGURE x: 1')\n    assert False\n")
    passing = tmp_path / "test_passes.py"
    passing.write_text("def test_passes():\n    print('FIGURE y: 2')\n")
    stamp = ROOT / ".venv" / ".installed"
    if not stamp.exists():
        pytest.skip("the Makefile's venv is not set up (make test builds it)")
    args = ["make", "-s", "-C", str(ROOT), "-o", ".venv/.installed", "chaos"]
    bad = subprocess.run([*args, f"CHAOS_TESTS={failing}"], capture_output=True, text=True)
    good = subprocess.run([*args, f"CHAOS_TESTS={passing}"], capture_output=True, text=True)
    assert bad.returncode != 0, bad.stdout
    assert "1 failed" in bad.stdout and "FIGURE x" in bad.stdout
    assert good.returncode == 0, good.stdout + good.stderr
