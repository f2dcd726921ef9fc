"""Continuing a run on a grown shard set (`data.on_shard_change`), through `python -m pipeline.train`.

What is compared against what:
- A run trains 3 steps on shard set A (24 samples), then the shards are rebuilt in the same
  folder with 24 more samples (set B). Resuming without the switch is refused in one line
  (exit 2) whose text is the loader's usual refusal, with both fingerprints computed here from
  the manifests (sha256 of the tokenizer entry and the train split's shard list).
- Resuming with `data.on_shard_change=new_pass`: step 4's loss in metrics.jsonl equals the loss
  computed here, in this process, from the step-3 checkpoint's weights (consolidated and loaded
  by `pipeline.inference.loading.load_model`, a plain forward without DeepSpeed) on the first
  4 rows of epoch 1 of set B as a fresh loader of set B yields them after its epoch 0; the
  same weights on the rows the run would have read next from set A give another loss (the
  comparison tells the two apart). The lr continues the schedule at step 4, DeepSpeed's Adam
  state counts 5 steps in the final checkpoint (2 had the optimizer started afresh), and the
  checkpoint records both shard sets with the step each began at.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.checkpoint.safe_load import load_checkpoint_file
from shard_fixtures import random_samples, write_shards
from test_train import ROOT, _env, _log, _metrics, _train_forked, _write_config


def _train(config: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(config),
                           f"run_dir={run_dir}", *overrides], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _fingerprint(data_dir: Path) -> str:
    m = json.loads((data_dir / "manifest.json").read_text())
    entries = [{k: v for k, v in e.items() if k != "index"} for e in m["splits"]["train"]]
    blob = json.dumps([m["tokenizer"], entries], sort_keys=True).encode()  # sample indexes left out
    return hashlib.sha256(blob).hexdigest()[:16]


def _step_loss(model, data_dir: Path, objective_cfg, skip: int, rows: int = 4) -> float:
    """Mean hybrid loss of rows skip..skip+rows-1 of the training order of `data_dir` (one row
    per micro-batch, seed 7, as the run's config), each from `model` as it is (no update)."""
    from pipeline.data import build_loader
    from pipeline.objective import hybrid_loss
    loader = build_loader(str(data_dir), "train", 1, 24, seed=7, num_workers=0,
                          objective_cfg=objective_cfg, vocab_size=64)
    losses = []
    with torch.no_grad():
        for i, b in enumerate(loader):
            if i >= skip:
                logits = model(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"])
                losses.append(float(hybrid_loss(logits.float(), b, objective_cfg)[0]))
            if len(losses) == rows:
                return sum(losses) / rows
    raise AssertionError("loader ended")


def test_resume_on_a_grown_shard_set_keeps_weights_optimizer_and_step(tmp_path):
    from omegaconf import OmegaConf
    from pipeline.config import load_config
    from pipeline.inference.loading import load_model
    from pipeline.objective import ObjectiveConfig
    from pipeline.training.schedule import lr_at

    data = tmp_path / "data"
    first = random_samples(np.random.default_rng(0), 24, vocab_size=64, max_length=24, min_length=8)
    val = random_samples(np.random.default_rng(9), 4, vocab_size=64, max_length=24, min_length=8)
    write_shards(str(data), {"train": first, "val": val}, samples_per_shard=12, max_length=24)
    shutil.copytree(data, tmp_path / "data_a")   # set A as it was, for the comparison below
    config = _write_config(tmp_path / "run.yaml", data, train={"max_steps": 3, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 5})
    run_dir = tmp_path / "run"
    assert _train_forked(1, config, run_dir) == [0], _log(run_dir)   # makes the checkpoint
    fp_a = _fingerprint(data)

    more = random_samples(np.random.default_rng(1), 24, vocab_size=64, max_length=24, min_length=8)
    write_shards(str(data), {"train": first + more, "val": val}, samples_per_shard=12, max_length=24)
    fp_b = _fingerprint(data)
    assert fp_a != fp_b

    # without the switch: refused in one line, nothing trained
    r = _train(config, run_dir, "train.max_steps=5")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("pipeline.")]
    assert lines == [f"pipeline.train: error: loader state: data was '{fp_a}' when saved, is "
                     f"'{fp_b}' now (shards of {data} when saved, of {data} now); resume with the "
                     f"same data settings"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert max(s for k, s in _metrics(run_dir) if k == "train") == 3

    # with the switch: weights, optimizer and step continue; the data is a new pass over set B
    r = _train(config, run_dir, "train.max_steps=5", "data.on_shard_change=new_pass")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "data.on_shard_change=new_pass" in r.stdout and "(epoch 1)" in r.stdout
    m = _metrics(run_dir)
    assert sorted(s for k, s in m if k == "train") == [1, 2, 3, 4, 5]
    assert m[("train", 4)]["lr"] == lr_at(3, 1e-3, 0.0, 2, 5)

    cfg = load_config(str(config), [])
    objective_cfg = ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))
    ckpts = run_dir / "checkpoints"
    model, _, _ = load_model(ckpts / "step_000000003", dtype=torch.float32, device="cpu")
    expected = _step_loss(model, data, objective_cfg, skip=48)          # epoch 1 of set B
    assert abs(m[("train", 4)]["loss"] - expected) < 1e-5 * max(1.0, abs(expected)), \
        (m[("train", 4)]["loss"], expected)
    continuing_a = _step_loss(model, tmp_path / "data_a", objective_cfg, skip=12)
    assert abs(continuing_a - expected) > 1e-3

    # the final checkpoint: Adam's state went on (5 steps), both shard sets recorded
    optim = load_checkpoint_file(next((ckpts / "step_000000005").glob("*optim_states.pt")))
    adam = optim["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    assert adam and all(int(s["step"]) == 5 for s in adam.values())
    client = load_checkpoint_file(ckpts / "step_000000005" / "refusion_rank_00000.pt")
    client = client["client_state"]
    assert client["shard_sets"] == [
        {"step": 0, "fingerprint": fp_a, "data_dir": str(data), "epoch": 0, "samples_per_epoch": 24},
        {"step": 3, "fingerprint": fp_b, "data_dir": str(data), "epoch": 1, "samples_per_epoch": 48}]
    assert client["loader"]["config"]["data"] == fp_b and client["loader"]["cursor"][0] == 1
