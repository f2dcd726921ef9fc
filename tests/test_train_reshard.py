"""Elastic resume through the real entry point: a run saved on 2 data-parallel ranks continues
on 1 with `checkpoint.reshard=true`, against the uninterrupted 2-rank run (on a two-source data
mixture).

Same global batch (4 rows: micro-batch 1 x accumulation 2 x DP 2, then 1 x 4 x 1), same
loader order (the global row list), same weights and Adam state (`pipeline.checkpoint.reshard`): every
later step's loss equals the uninterrupted run's within the tolerance of the reduction order,
and consumed samples/tokens continue. Without `checkpoint.reshard` the layout change is one
line, exit 2.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The tiny model, the two-source data, the subprocess environment and the forked runs of the
# other entry-point tests.
from test_train import MODEL, _env, _log, _train_forked, mixture_data

ROOT = Path(__file__).resolve().parents[1]


def _run(config: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.train", "--config", str(config), f"run_dir={run_dir}",
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


def _train_metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("kind") == "train":
            out[m["step"]] = m           # the last line per step wins (a resumed leg re-appends)
    return out


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_reshard")
    cfg = {"model": {"inline": MODEL}, "data": {**mixture_data(base), "num_workers": 0},
           "optim": {"lr": 1e-3, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.01},
           "train": {"max_steps": 6, "micro_batch_size": 1, "grad_accum_steps": 2,
                     "precision": "fp32", "seed": 7, "eval_interval": 0},
           "checkpoint": {"interval": 3, "keep": 2}, "wandb": {"mode": "disabled"}}
    path = base / "run.yaml"
    path.write_text(json.dumps(cfg))
    return base, path


def test_dp2_to_dp1_continues_the_run(config):
    base, cfg = config
    # the two 2-rank runs make the reference and the checkpoint to reshard: `main` on ranks
    # forked with the imports done; the 1-process legs go through the entry point
    ref = base / "ref"
    assert _train_forked(2, cfg, ref) == [0, 0], _log(ref)
    want = _train_metrics(ref)

    run = base / "elastic"
    assert _train_forked(2, cfg, run, "train.max_steps=3") == [0, 0], _log(run)

    refused = _run(cfg, run)  # one process: DP 1, without checkpoint.reshard
    assert refused.returncode == 2
    err = [l for l in refused.stderr.splitlines() if "error" in l.lower()]
    assert len(err) == 1 and "checkpoint.reshard=true" in err[0], refused.stderr[-2000:]
    assert err[0].startswith("pipeline.train: error: ") and "saved by world size 2" in err[0]
    assert "Traceback" not in refused.stderr

    r = _run(cfg, run, "checkpoint.reshard=true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gradient accumulation 2 -> 4" in r.stderr + r.stdout
    got = _train_metrics(run)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=1e-12)
        assert got[step]["consumed_samples"] == want[step]["consumed_samples"]
        assert got[step]["consumed_tokens"] == want[step]["consumed_tokens"]
    for step in (4, 5, 6):  # after the layout change: same clipping, same update
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4)
    # Converted once into the run directory; removed after this layout's own first save, with
    # the original checkpoint kept (keep=2).
    assert "to a universal checkpoint for TP 1" in r.stderr + r.stdout
    assert not (run / "checkpoints" / "universal").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == \
        ["step_000000003", "step_000000006"]
