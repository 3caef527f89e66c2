"""atheris harness: schedule files; the first byte's low bit checks regions against a topology.

With a topology, load_schedule also refuses jobs in unknown regions; without
one it validates the file alone (as ``edgecache plan`` and the demo do).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["fuzztargets", "edgecache", "yaml"]):
    import fuzztargets as t

import _harness  # noqa: E402

PATH = Path(tempfile.mkdtemp(prefix="fuzz-schedule-")) / "schedule.yaml"


@atheris.instrument_func
def one_input(data: bytes) -> None:
    if not data:
        return
    t.check_schedule(data[1:], PATH, t.TOPOLOGY if data[0] & 1 else None)


def seeds() -> list[bytes]:
    return [mode + seed for seed in t.SCHEDULE_SEEDS for mode in (b"\0", b"\1")]


if __name__ == "__main__":
    _harness.main(one_input, seeds)
