"""benchmarks/gpu_check.sh skips cleanly without CUDA: exit 0 and one JSON object saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs the whole GPU check")
@pytest.mark.timeout(120)
def test_gpu_check_skips_without_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written == json.loads(done.stdout)
    assert written == {"skipped": True, "ok": True,
                       "reason": "no CUDA device here (torch.cuda.is_available() is False)"}
