"""bench/gpu_check.sh refuses to run without CUDA in one clear line (exit 2).

Its reduced CPU smoke mode (GPU_CHECK_SMOKE=1) takes minutes on 2 cores, too long for the suite;
docs/PERFORMANCE.md "The one-GPU check" says how it was run.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_without_cuda_is_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_SMOKE"}
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT,
                       env={**env, "PYTHON": sys.executable}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("bench/gpu_check.sh: error: no CUDA device visible")
    assert "GPU_CHECK_SMOKE=1" in lines[0]
