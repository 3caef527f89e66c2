"""The atheris entry point the four ``fuzz_*.py`` harnesses share.

A harness is run as ``python tests/fuzz/fuzz_X.py [--write-seeds=DIR] [libFuzzer flags] [DIR]``;
``--write-seeds`` first writes its valid inputs into DIR so that libFuzzer starts from
inputs that get past the first checks (``run.py`` does this for every run).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import atheris


def main(one_input: Callable[[bytes], None], seeds: Callable[[], Iterable[bytes]]) -> None:
    """Write the seed corpus if asked, then hand over to libFuzzer (which never returns)."""
    argv = []
    for arg in sys.argv:
        if arg.startswith("--write-seeds="):
            folder = Path(arg.split("=", 1)[1])
            folder.mkdir(parents=True, exist_ok=True)
            for n, seed in enumerate(seeds()):
                (folder / f"seed-{n:03d}").write_bytes(seed)
        else:
            argv.append(arg)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()
