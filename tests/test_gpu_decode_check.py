"""bench/gpu_decode_check.py: its CPU smoke mode runs every part (about half a minute on 2
cores) and reports correctness facts (ours and transformers' static-cache `generate` give the
same greedy tokens; cuda_graph=True gives the eager tokens); without CUDA and without --smoke it
refuses in one line with exit 2. Timing figures are only checked to be present."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    return env


def test_smoke_mode_runs_every_part(tmp_path):
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_decode_check.py"), "--smoke",
                        "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["smoke"] and res["failed"] == []
    assert res["hf_eager"]["same_tokens"] == res["hf_eager"]["prompts"] == res["batch"] == 3
    assert res["graph_tokens_equal_eager"] is True
    assert res["ar_forward_ms"]["forwards"] == res["gen_length"] - 1
    assert res["refusion_forward_ms"]["forwards"] > 0
    lines = r.stdout.splitlines()
    for start in ("AR decode forward (", "refusion decode forward", "ar vs transformers generate",
                  "target: AR decode forward <= 10 ms", "target: AR tokens/s >= transformers",
                  "decode memory (ar, batch 3", "decode memory (draft_every, batch 3"):
        assert any(x.startswith(start) for x in lines), (start, r.stdout)
    assert "not judged (smoke mode)" in r.stdout
    # part 6: draft_ahead / draft_every against AR decoding, both in bf16 (issue 43 item 5)
    for mode in ("draft_ahead", "draft_every"):
        rec = res["lossless_bf16"][mode]
        assert rec["prompts"] == 32 and 0 <= rec["equal"] <= 32
        assert rec["share"] == rec["equal"] / 32 and 0 <= rec["mean_prefix"] <= res["gen_length"]
        assert any(x.startswith(f"lossless in bf16 ({mode}, greedy") for x in lines)
    # the decode memory plan runs in smoke mode (planned only; measured on CUDA)
    assert res["decode_memory"]["ar"]["planned_cache_bytes"] > 0
    assert "measured_bytes" not in res["decode_memory"]["ar"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_decode_check.py")], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bench/gpu_decode_check.py: error: no CUDA device visible"), r.stderr
