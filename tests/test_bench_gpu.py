"""``python -m bench.gpu`` on a machine without CUDA: it says why it cannot run and exits 0.

On a CUDA host it measures host-to-device copies and EdgeDataset epochs with
every batch on the GPU (see bench/gpu.py); nothing here can time that.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the benchmark itself")
def test_gpu_benchmark_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bench.gpu skipped: no CUDA device here" in proc.stdout
    assert "no CUDA device" in json.loads(out.read_text())["skipped"]
