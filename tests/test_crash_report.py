"""A test worker that dies says where: its threads' stacks come at the end of the run's output.

CI keeps the head and tail of a long log; pytest-xdist says only "worker 'gw1' crashed
while running ...", and a worker's own stderr lands among the progress dots, which
the shortened log cuts. The suite's conftest makes each worker write its fatal-error
(and hang backstop) stacks to a file the controller prints after the summary.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DIES = {
    "main": """
import faulthandler
import threading
import time


def test_fine():
    pass


def test_dies():
    threading.Thread(target=time.sleep, args=(30,), name="bystander", daemon=True).start()
    faulthandler._sigsegv()
""",
    "thread": """
import faulthandler
import threading


def test_fine():
    pass


def test_dies():
    crasher = threading.Thread(target=faulthandler._sigsegv, name="crasher")
    crasher.start()
    crasher.join()
""",
}


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_worker_that_segfaults_is_named_with_its_stack_at_the_end(
    tmp_path: Path, where: str
) -> None:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_dies.py").write_text(DIES[where])
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
    for folder in set(re.findall(r"\((/\S+/edgecache-test-crash-[^/]+)/crash-", out)):
        shutil.rmtree(folder)  # kept by the run, since a worker died in it
    tail = out.strip().splitlines()[-14:]
    text = "\n".join(tail)
    assert any("test worker(s) died: gw" in line for line in tail), out
    assert "Fatal Python error: Segmentation fault" in text, out
    assert "_pytest" not in text and "test_fine" not in text, text
    # The thread that died comes last; harness frames are left out.
    last = re.split(r"\n\s*\n", out.strip())[-1]
    assert last.startswith("Current thread"), last
    if where == "main":
        assert tail[-1].strip().startswith(f'File "{tmp_path / "test_dies.py"}", line 13 in ')
    else:
        assert "threading.py" in last and "test_dies.py" not in last, last
