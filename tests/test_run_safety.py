"""Run robustness: preemption with wandb on, rank-only user errors, the launcher's exit codes,
one job per run directory, full disks.

What is compared against what:
- Preemption: SIGTERM at the same moment to every process of a 2-process run (trainers, their
  loader workers, wandb's service process `wandb-core`) -> exit 0, a checkpoint at the step
  reached, and the next leg continues the same wandb run id with every step's loss equal to
  metrics.jsonl, read back with wandb's own reader (`wandb leet inspect --json`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shard_fixtures import random_samples, write_shards
from test_train import (ROOT, _env, _finish, _kill_tree, _log, _metrics, _wait_step,
                        _wandb_history, _write_config)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("safety")
    rng = np.random.default_rng(0)
    d = base / "data"
    write_shards(str(d), {"train": random_samples(rng, 48, vocab_size=64, max_length=24,
                                                  min_length=8),
                          "val": random_samples(rng, 4, vocab_size=64, max_length=24,
                                                min_length=8)},
                 samples_per_shard=12)
    return base, d


def _start(nproc: int, config: Path, run_dir: Path, *overrides: str, log_name: str = "log",
           launcher: str = "pipeline.launch") -> subprocess.Popen:
    """A run in its own session (so a test can signal every process of it)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "pipeline.train"]
    else:
        cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}",
               "-m", "pipeline.train"]
    cmd += ["--config", str(config), f"run_dir={run_dir}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / f"{log_name}.txt", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_preemption_with_wandb_checkpoints_and_keeps_history(data):
    from pipeline.checkpoint import find_latest
    base, d = data
    run_dir = base / "preempt"
    config = _write_config(base / "preempt.yaml", d, train={"max_steps": 60, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 2}, wandb={"mode": "offline"},
                           data={"num_workers": 1})
    proc = _start(2, config, run_dir, log_name="leg1", launcher="torch.distributed.run")
    _wait_step(proc, run_dir, 3)
    # wandb's service is a child of rank 0's trainer; every process below the launcher
    tree = _descendants(proc.pid)
    cores = [p for p in tree if "wandb-core" in _cmdline(p)]
    assert cores, [_cmdline(p) for p in tree]
    for p in tree:  # as SLURM does: SIGTERM to every process of the job at the same moment
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert _finish(proc, run_dir) == 0, _log(run_dir)
    text = (run_dir / "leg1.txt").read_text()
    reached = max(s for k, s in _metrics(run_dir) if k == "train")
    assert reached < 60
    assert find_latest(run_dir / "checkpoints").name == f"step_{reached:09d}"
    assert f"checkpointing at step {reached}" in text
    assert "Traceback" not in text, text[-4000:]
    # the next leg: same wandb run, every step of both legs in its history
    proc = _start(2, config, run_dir, f"train.max_steps={reached + 2}", log_name="leg2",
                  launcher="torch.distributed.run")
    assert _finish(proc, run_dir) == 0, _log(run_dir)
    ids, hist = _wandb_history(run_dir)
    assert len(ids) == 2 and len(set(ids)) == 1, ids
    m = _metrics(run_dir)
    for step in range(1, reached + 3):
        assert hist[step]["train/loss"] == m[("train", step)]["loss"], step
    assert json.loads((run_dir / "wandb_state.json").read_text())["confirmed_step"] == reached + 2
