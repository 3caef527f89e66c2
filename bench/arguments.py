"""What the suites check before they run: a bad value, or a missing package, is argparse's
usage error (exit 2), not a traceback minutes into a run (``--repeat 0`` ended in ``min()
arg is an empty sequence``, ``--workers x`` in a ValueError, ``--images 0`` in a
ZeroDivisionError, a missing litdata in an ImportError after bench.images' first parts)."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterable


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is not at least {minimum}")
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1 (sizes, repeats, counts)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number of at least 0 (a dataset's MiB, where 0 leaves it out)."""
    return _whole(text, 0)


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds, rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number above 0")
    return value


def some_data(parser: argparse.ArgumentParser, tokens_mib: int, images_mib: int) -> None:
    """``--tokens-mib 0`` or ``--images-mib 0`` leaves that dataset out; not both."""
    if not tokens_mib + images_mib:
        parser.error("--tokens-mib and --images-mib: 0 leaves a dataset out, not both")


def workers_list(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--workers 0,2``: DataLoader ``num_workers`` values, each at least 0."""
    try:
        values = [int(w) for w in text.split(",")]
    except ValueError:
        parser.error(f"--workers {text!r}: give num_workers values, e.g. 0,2")
    if not values or min(values) < 0:
        parser.error(f"--workers {text!r}: each value is at least 0")
    return values


def require_modules(parser: argparse.ArgumentParser, modules: Iterable[str], why: str) -> None:
    """Exit 2 naming what to install when one of ``modules`` is not importable here.

    Checked before the suite starts: a missing peer surfaced as a traceback, in
    bench.images after minutes of its other parts.
    """
    missing = sorted({m for m in modules if importlib.util.find_spec(m) is None})
    if missing:
        parser.error(
            f"{why} needs {', '.join(missing)}, not installed here: "
            "pip install --no-deps -r bench/requirements.txt (in the venv with edgecache)"
        )
