"""The learning-rate schedule (`pipeline.training.schedule`) and how a resumed run keeps it.

What is compared against what:
- wsd against a piecewise formula written out here (warmup, constant, each decay shape);
  cosine is checked against torch's schedulers in tests/test_config.py.
- `schedule_change` on records: a cosine run extended, another lr, a wsd run extended before and
  inside its decay.
- Through the trainer (one process): a 4-step cosine run relaunched with `train.max_steps=8`
  is refused in one line naming only that key (nothing trained); with
  `optim.override_schedule=true` steps 5-8 get the new schedule's lr; a wsd run resumed from a
  step before its decay with a larger `train.max_steps` goes on without a word and steps 4-10
  get the extended schedule's lr, while extending it again after its decay began is refused.
  The refusal runs `python -m pipeline.train` itself (exit code, stderr); the other legs run
  its `main` in a process forked from the preloaded forkserver (`distributed.run_train_main`),
  which spares each leg the trainer's imports.
"""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from pipeline.training.schedule import lr_at, schedule_change, schedule_record
from distributed import run_train_main
from shard_fixtures import random_samples, write_shards
from test_train import _metrics, _write_config
from test_train_data_change import _train


def _wsd(step, lr, min_lr, warmup, max_steps, decay, shape):
    """Written out from the definition: warmup ramp, lr held, decay over the last `decay` steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < max_steps - decay:
        return lr
    q = min(1.0, (step - (max_steps - decay)) / decay)
    f = {"linear": 1 - q, "1-sqrt": 1 - q ** 0.5, "cosine": (1 + math.cos(math.pi * q)) / 2}[shape]
    return min_lr + (lr - min_lr) * f


@pytest.mark.parametrize("shape", ["linear", "1-sqrt", "cosine"])
@pytest.mark.parametrize("warmup, max_steps, decay", [(3, 20, 5), (0, 10, 1), (0, 10, 10)])
def test_wsd_matches_its_definition(shape, warmup, max_steps, decay):
    for step in range(max_steps + 2):
        assert lr_at(step, 1e-3, 1e-5, warmup, max_steps, schedule="wsd", decay_steps=decay,
                     decay_shape=shape) == pytest.approx(
            _wsd(step, 1e-3, 1e-5, warmup, max_steps, decay, shape), rel=1e-12), step
    assert lr_at(max_steps - 1, 1e-3, 1e-5, warmup, max_steps, "wsd", decay, shape) > 1e-5


def test_schedule_change_names_only_what_moves_an_lr():
    cos10 = schedule_record({"lr": 1e-3, "min_lr": 0.0, "warmup_steps": 2}, 10)
    cos20 = schedule_record({"lr": 1e-3, "min_lr": 0.0, "warmup_steps": 2}, 20)
    why = schedule_change(cos10, cos20, 10)
    assert why is not None and why.startswith("train.max_steps 10 -> 20: the lr of step 4 ")
    assert "optim." not in why
    assert schedule_change(cos10, cos10, 10) is None
    # during warmup an extension moves no lr yet (steps 1-2 are the ramp in both)
    assert schedule_change(cos10, cos20, 1) is None
    # a finished run extended: only the steps it took count (its step 4 was never planned);
    # 3 steps of warmup 2 end at q = 0 (lr 1e-3) under either length
    cos3 = schedule_record({"lr": 1e-3, "min_lr": 0.0, "warmup_steps": 2}, 3)
    cos6 = schedule_record({"lr": 1e-3, "min_lr": 0.0, "warmup_steps": 2}, 6)
    assert schedule_change(cos3, cos6, 3) is None
    assert schedule_change(cos6, cos3, 3) is not None   # a stopped 6-step run's step 4 was planned
    lr5 = schedule_record({"lr": 5e-4, "min_lr": 0.0, "warmup_steps": 2}, 10)
    assert schedule_change(cos10, lr5, 3).startswith("optim.lr 0.001 -> 0.0005: the lr of step 1 ")

    wsd = {"lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 2, "schedule": "wsd", "decay_fraction": 0.2}
    w10, w20 = schedule_record(wsd, 10), schedule_record(wsd, 20)
    assert (w10["decay_steps"], w20["decay_steps"]) == (2, 4)
    # steps 1-9 carry lr 1e-3 in both (step 9 is the 10-step decay's first, at q = 0)
    assert schedule_change(w10, w20, 8) is None
    why = schedule_change(w10, w20, 9)                   # step 10 was decayed in the 10-step run
    assert why.startswith("train.max_steps 10 -> 20, optim.decay_steps 2 -> 4: the lr of step 10 ")
    # the record keeps only what the schedule uses: decay settings do not matter to cosine
    assert schedule_record({**wsd, "schedule": "cosine"}, 10) == cos10 | {"min_lr": 1e-5}


def test_resume_refuses_a_silent_lr_change_and_extends_wsd(tmp_path):
    data = tmp_path / "data"
    samples = random_samples(np.random.default_rng(0), 24, vocab_size=64, max_length=24,
                             min_length=8)
    val = random_samples(np.random.default_rng(9), 4, vocab_size=64, max_length=24, min_length=8)
    write_shards(str(data), {"train": samples, "val": val}, samples_per_shard=12, max_length=24)

    # cosine: extending changes the lr of steps already taken
    config = _write_config(tmp_path / "cos.yaml", data, train={"max_steps": 4, "eval_interval": 0},
                           checkpoint={"interval": 2, "keep": 5})
    run = tmp_path / "cos"
    r, = run_train_main(config, run)
    assert r.returncode == 0, r.stderr[-3000:]
    before = {s: m["lr"] for (k, s), m in _metrics(run).items() if k == "train"}
    assert before == {s: lr_at(s - 1, 1e-3, 0.0, 2, 4) for s in range(1, 5)}

    r = _train(config, run, "train.max_steps=8")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("pipeline.")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0] == (
        "pipeline.train: error: optim: the learning-rate schedule differs from the checkpoint's "
        f"(train.max_steps 4 -> 8: the lr of step 4 would be {lr_at(3, 1e-3, 0.0, 2, 8):.3g} "
        f"instead of {lr_at(3, 1e-3, 0.0, 2, 4):.3g}); set optim.override_schedule=true to apply "
        "the new schedule from step 5, or resume with the saved settings")
    assert max(s for k, s in _metrics(run) if k == "train") == 4

    r, = run_train_main(config, run, "train.max_steps=8", "optim.override_schedule=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "learning-rate schedule changed from step 5" in r.stdout + r.stderr
    after = {s: m["lr"] for (k, s), m in _metrics(run).items() if k == "train"}
    assert after == {**before, **{s: lr_at(s - 1, 1e-3, 0.0, 2, 8) for s in range(5, 9)}}

    # wsd: resumed before its decay with a larger max_steps, every lr applied stays
    wsd = {"schedule": "wsd", "decay_steps": 2}
    config = _write_config(tmp_path / "wsd.yaml", data, optim=wsd,
                           train={"max_steps": 6, "eval_interval": 0},
                           checkpoint={"interval": 3, "keep": 5})
    run = tmp_path / "wsd"
    r, = run_train_main(config, run)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_000000006")                # as if it stopped at step 3
    (ckpts / "latest").write_text("step_000000003")
    r, = run_train_main(config, run, "train.max_steps=10")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "learning-rate schedule" not in r.stdout + r.stderr
    lrs = {s: m["lr"] for (k, s), m in _metrics(run).items() if k == "train"}
    assert lrs == {s: lr_at(s - 1, 1e-3, 0.0, 2, 10, "wsd", 2) for s in range(1, 11)}
    assert lrs[4] == lrs[9] == 1e-3 > lrs[10]   # held through step 9 (the decay starts at q = 0)

    # after its decay began, an extension would raise the lr again: refused
    r, = run_train_main(config, run, "train.max_steps=12")
    assert r.returncode == 2 and "train.max_steps 10 -> 12" in r.stderr, r.stderr[-3000:]
