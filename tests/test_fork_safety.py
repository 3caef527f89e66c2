"""A process that forks while it runs gRPC aio and reads over gRPC is told so, once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WARNING = "this process forks while it uses gRPC aio"


def forks_with(tmp_path: Path, where: str, iterator: str = "none") -> str:
    """What tests/aio_fork_child.py logs on stderr, its node served ``where``."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    done = subprocess.run(
        [sys.executable, str(HERE / "aio_fork_child.py"), str(tmp_path), where, iterator],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize("where", ["in-process", "subprocess"])
def test_a_fork_beside_grpc_aio_is_warned_once_with_the_way_out(tmp_path: Path, where: str) -> None:
    said = forks_with(tmp_path, where)
    if where == "subprocess":  # no aio in the forking process: nothing to say
        assert WARNING not in said, said
        return
    assert said.count(WARNING) == 1, said  # two forks, one warning
    line = next(line for line in said.splitlines() if WARNING in line)
    assert "gc.collect()" in line and "multiprocessing_context='forkserver'" in line, line


OPEN_STREAMS = "stream(s) are open over gRPC in it"


@pytest.mark.parametrize("iterator", ["open", "closed"])
def test_a_fork_with_an_iterator_left_open_is_warned_once(tmp_path: Path, iterator: str) -> None:
    """``next(iter(ds))`` before the DataLoader starts: its streams are calls in flight.

    gRPC then skips its fork handlers (seen here: every fork of a loader after such a
    look at a batch) and a worker may crash; a closed iterator leaves nothing open.
    """
    said = forks_with(tmp_path, "subprocess", iterator)
    if iterator == "closed":
        assert OPEN_STREAMS not in said, said
        return
    assert said.count(OPEN_STREAMS) == 1, said  # two forks, one warning
    line = next(line for line in said.splitlines() if OPEN_STREAMS in line)
    assert "it.close()" in line and "multiprocessing_context='forkserver'" in line, line
