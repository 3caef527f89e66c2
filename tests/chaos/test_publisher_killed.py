"""A publisher SIGKILLed at random moments: half-published versions are never visible."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaosutil import count
from edgeutil import write_parquet_shards

from edgecache.cache.registry import Registry


def test_killed_publishers_leave_no_visible_half_versions(tmp_path: Path, figure) -> None:  # noqa: ANN001
    kills = count(4, 10)
    write_parquet_shards(tmp_path / "origin", 20, rows=200)
    registry = f"file://{tmp_path}/registry"
    command = [
        sys.executable,
        "-m",
        "edgecache.clients.cli",
        "publish",
        f"file://{tmp_path}/origin",
        "--dataset",
        "tokens",
        "--registry",
        registry,
        "--json",
    ]
    rng = random.Random(3)
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True)  # how long a whole publish takes
    duration = time.monotonic() - started
    completed = 1
    for _ in range(kills):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 1.0) * duration)  # mostly after startup, before the end
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        completed += proc.wait() == 0

    async def listing(reg: Registry) -> tuple[list[int], int]:
        numbers = await reg.versions("tokens")
        broken = 0
        for n in numbers:  # every visible version must be whole and verify
            try:
                manifest = await reg.manifest("tokens", n)
                broken += len(manifest.shards) != 20
            except Exception:  # noqa: BLE001 - a half-written manifest counts as broken
                broken += 1
        return numbers, broken

    visible, broken = Registry.run(registry, listing)
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    figure("publishers killed", kills)
    figure("publishes that exited 0 (the first, uninterrupted one included)", completed)
    figure(
        "publishers killed after their manifest landed (their version is whole)",
        len(visible) - completed,
    )
    figure("half-published versions visible", broken)
    assert broken == 0
    assert visible == list(range(1, len(visible) + 1))
    assert f'"tokens@{len(visible) + 1}"' in out.stdout  # the next publish gets a clean number
