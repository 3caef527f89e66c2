"""A test worker that dies says where: its threads' stacks come at the end of the run's output.

CI keeps the head and tail of a long log; pytest-xdist says only "worker 'gw1' crashed
while running ...", and a worker's own stderr lands among the progress dots, which
the shortened log cuts. The suite's conftest makes each worker write its fatal-error
(and hang backstop) stacks to a file the controller prints after the summary.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

DIES = """
import faulthandler
import threading
import time


def test_fine():
    pass


def test_dies_in_c():
    threading.Thread(target=time.sleep, args=(30,), name="bystander", daemon=True).start()
    faulthandler._sigsegv()
"""


def test_a_worker_that_segfaults_is_named_with_its_stack_at_the_end(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_dies.py").write_text(DIES)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider"]
        + ["-p", "no:faulthandler", "-o", "timeout=60", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout + run.stderr
    tail = out.strip().splitlines()[-12:]
    assert any("test worker(s) died: gw" in line for line in tail), out
    assert "Fatal Python error: Segmentation fault" in "\n".join(tail)
    # The dying thread last, at the test's own line; harness frames left out.
    assert tail[-1].strip().startswith(f'File "{tmp_path / "test_dies.py"}", line 13 in ')
    assert "time.sleep" not in tail[-1] and "_pytest" not in "\n".join(tail)
    assert "test_fine" not in "\n".join(tail)
