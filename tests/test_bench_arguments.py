"""The benchmarks refuse bad values and missing packages before they run (exit 2, said).

`--repeat 0` ended in "min() arg is an empty sequence", `--workers x` in a ValueError,
`--images 0` in a ZeroDivisionError, a misspelt `--modes` ran the naive day under the
wrong name and compared nothing, exit 0 (a helper's hunt)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["bench.planner", "--repeat", "0"], "--repeat: 0 is not at least 1"),
        (["bench.images", "--images", "0"], "--images: 0 is not at least 1"),
        (["bench.peers", "--smoke", "--workers", "x"], "--workers 'x'"),
        (["bench.peers", "--tokens-mib", "0", "--images-mib", "0"], "not both"),
        (["bench.schedule", "--smoke", "--modes", "controller,Naive"], "unknown ['Naive']"),
        (["bench.wan", "--smoke", "--parts", "9"], "choose among 1, 2 and 3"),
    ],
)
def test_a_bad_value_is_a_usage_error(args: list[str], said: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 2 and said in out.stderr, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr


def test_a_missing_package_is_named_with_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # bench is not installed with edgecache
    from bench.arguments import require_modules

    parser = argparse.ArgumentParser(prog="bench.x")
    with pytest.raises(SystemExit) as exited:
        require_modules(parser, ["json", "edgecache_no_such_module"], "bench.x")
    assert exited.value.code == 2
    require_modules(parser, ["json"], "bench.x")  # present: nothing said
