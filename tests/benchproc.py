"""What the benchmark smoke tests check after a run: nothing it started is left behind.

A benchmark run starts namespaces (``ip netns``) and processes across them;
the tests mark its environment with a unique value (every descendant inherits
it) and afterwards look for live processes carrying it and namespaces that
were not there before.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "ecwan"  # bench.wan.link.PREFIX: the benchmarks' namespaces are named after it


def left_behind(before: set[str]) -> set[str]:
    """Namespaces made since ``before`` whose maker is gone: those a run left behind.

    A namespace is named after the process that made it (``ecwan<pid>o``), and the
    smoke tests run beside each other (pytest-xdist): one benchmark's namespaces,
    live while it runs, are not the other's leak (seen: the schedule smoke failing
    on the link of the wan smoke running at the same time).
    """
    found = set()
    for name in namespaces() - before:
        maker = re.match(rf"{PREFIX}(?:probe)?(\d+)", name)
        if maker is None or not Path(f"/proc/{maker.group(1)}").exists():
            found.add(name)
    return found


def namespaces() -> set[str]:
    """The benchmark link's network namespaces that exist now."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return set()
    return {line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)}


def marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in environ and state != "Z":
                found.append(int(entry))
    return found


def run_marked(argv: list[str], variable: str, marker: str, timeout: float) -> tuple[int, str]:
    """Run ``argv`` from the checkout with ``variable=marker``; its exit code and output.

    On a timeout the benchmark gets SIGTERM, which it must answer by tearing
    everything down (the caller then checks :func:`marked` and :func:`namespaces`).
    """
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, variable: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            log, _ = proc.communicate(timeout=30)
    return proc.returncode, log
