"""Run the atheris harnesses and report inputs tried and crashes; exit 1 on any crash.

Coverage-guided fuzzing finds what hand-picked hostile inputs miss, but
libFuzzer's own output is a stream of status lines. This runner gives each
harness a fresh seed corpus of valid inputs, runs it for N seconds or N
inputs with a per-input time limit (a hang) and a memory limit (huge
allocation), and prints one figure per harness in the form ``make chaos``
collects::

    python tests/fuzz/run.py --seconds 60           # the full run: 60 s per harness
    python tests/fuzz/run.py --runs 2000 chunk      # a quick look at one harness

A crashing input is kept under ``--workdir`` (default: a temporary folder,
printed) as ``<target>/crash-*``; rerun it with
``python tests/fuzz/fuzz_<target>.py <that file>``.
Needs atheris in the Python that runs it (``pip install atheris``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("manifest", "topology", "schedule", "chunk")
INPUT_TIMEOUT_S = 10  # one input running longer than this is a hang
RSS_LIMIT_MB = 2048  # the harness process growing past this is a huge allocation


@dataclass
class Result:
    """One harness run."""

    target: str
    tried: int
    crashed: bool
    seconds: float
    detail: str  # the exception or libFuzzer's error and where the input was kept
    log: Path


def run_harness(
    target: str,
    workdir: Path,
    *,
    runs: int | None = None,
    seconds: int | None = None,
    seed: int = 1,
    python: str = sys.executable,
) -> Result:
    """Fuzz one target from fresh seeds for ``runs`` inputs or ``seconds``, whichever is given."""
    folder = workdir / target
    corpus = folder / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        str(HERE / f"fuzz_{target}.py"),
        f"--write-seeds={corpus}",
        str(corpus),
        f"-seed={seed}",
        f"-timeout={INPUT_TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        "-keep_seed=1",
        "-print_final_stats=1",
        f"-artifact_prefix={folder}/",
    ]
    if runs is not None:
        command.append(f"-runs={runs}")
    if seconds is not None:
        command.append(f"-max_total_time={seconds}")
    log = folder / "fuzz.log"
    started = time.monotonic()
    limit = (seconds or 0) + (runs or 0) // 100 + 120  # libFuzzer stops itself well before
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=limit, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    return Result(target, _tried(text), code != 0, elapsed, _detail(text, code), log)


def _tried(text: str) -> int:
    final = re.search(r"stat::number_of_executed_units: (\d+)", text)
    if final:
        return int(final.group(1))
    progress = re.findall(r"^#(\d+)\s", text, re.MULTILINE)  # the run died before its stats
    return int(progress[-1]) if progress else 0


def _detail(text: str, code: int) -> str:
    if code == 0:
        return ""
    if code == -1:
        return "the harness outlived its time limit and was killed"
    lines = text.splitlines()
    found = [
        line.strip()
        for line in lines
        if re.match(r"^\w*(Error|Exception)\b.*:", line.strip())
        or "ERROR: libFuzzer" in line
        or "Test unit written to" in line
    ]
    return "; ".join(dict.fromkeys(found)) or f"exit code {code}; see the log"


def run_all(
    targets: list[str],
    workdir: Path,
    *,
    runs: int | None = None,
    seconds: int | None = None,
    seed: int = 1,
    jobs: int = 2,
) -> list[Result]:
    """Run several harnesses, ``jobs`` at a time (each is one process on one core)."""
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [
            pool.submit(run_harness, t, workdir, runs=runs, seconds=seconds, seed=seed)
            for t in targets
        ]
        return [f.result() for f in futures]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"any of {', '.join(TARGETS)} (default: all)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=int, help="fuzz each harness this long")
    budget.add_argument("--runs", type=int, help="fuzz each harness on this many inputs")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed")
    parser.add_argument("--jobs", type=int, default=2, help="harnesses run at once")
    parser.add_argument("--workdir", type=Path, help="where corpora, logs and crashes go")
    args = parser.parse_args(argv)
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown target(s) {', '.join(sorted(unknown))}; use {', '.join(TARGETS)}")
    args.targets = args.targets or list(TARGETS)
    if args.seconds is None and args.runs is None:
        args.runs = 2000
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="edgecache-fuzz-"))
    print(f"fuzzing {', '.join(args.targets)}; corpora, logs and crashes in {workdir}")
    results = run_all(
        args.targets, workdir, runs=args.runs, seconds=args.seconds, seed=args.seed, jobs=args.jobs
    )
    for r in results:
        print(f"FIGURE atheris {r.target}: inputs tried = {r.tried}")
        print(f"FIGURE atheris {r.target}: crashes = {int(r.crashed)}")
        if r.crashed:
            print(f"  {r.target} crashed after {r.seconds:.0f} s: {r.detail} (log: {r.log})")
    return 1 if any(r.crashed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
