"""Issue 11.1: the trainer's validation covers every sample exactly once whatever the
data-parallel size, weights loss terms by tokens and segments, agrees between DP=1 and DP=2
(and with `pipeline.training.validation.validation_loss`), and no rank hangs when ranks hold different
numbers of samples."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from distributed import run_distributed
from shard_fixtures import TINY_MODEL, random_samples, write_shards

MODEL = dict(TINY_MODEL, init_std=0.1)


class _Engine:
    """What `Trainer.evaluate` uses of a DeepSpeed engine: call, eval/train, `.module`."""

    def __init__(self, model):
        self.module = model

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def _trainer(info, data_dir, micro_batch_size, pack):
    """A `pipeline.train.Trainer` holding what `evaluate()` reads, around a plain Qwen3
    (identical random weights on every rank) instead of a DeepSpeed engine."""
    import torch
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.objective import ObjectiveConfig
    from pipeline.train import Trainer
    from pipeline.training.state import TrainState
    from pipeline.model.weights import copy_into_model
    from pipeline.model.init import random_tp_shards
    mcfg = ModelConfig.from_dict(dict(MODEL))
    model = Qwen3(mcfg, dtype=torch.float32, init_weights=False)
    copy_into_model(model, random_tp_shards(mcfg, 3, 0, 1), source="random init")
    t = Trainer.__new__(Trainer)
    t.engine, t.mcfg, t.info, t.state = _Engine(model), mcfg, info, TrainState(step=4)
    t.device = torch.device("cpu")
    t.objective_cfg = ObjectiveConfig()
    t.watchdog = None          # no hang watchdog around this bare trainer
    t.plan = SimpleNamespace(micro_batch_size=micro_batch_size, row_length=24, tp_size=1)
    t.cfg = SimpleNamespace(
        train=SimpleNamespace(eval_batches=0, seed=7),
        debug=SimpleNamespace(slow_eval_s=0.0),
        data=SimpleNamespace(dir=data_dir, val_split="val", num_workers=0, pack=pack,
                             packing="best_fit", shuffle_buffer=4, verify_shards="error",
                             sources=None, phase=0))
    return t


def _evaluate(info, data_dir, micro_batch_size, pack):
    t = _trainer(info, data_dir, micro_batch_size, pack)
    keys = []
    real_build = t._build_loader

    def logged_build(split, train):   # log the keys each rank evaluates
        loader = real_build(split, train)

        class Logged:
            pad_id = loader.pad_id

            def __iter__(self):
                for b in loader:
                    keys.extend(b["keys"])
                    yield b
        return Logged()
    t._build_loader = logged_build
    return t.evaluate(), keys


def _dp2(rank, world_size, data_dir):
    from pipeline.parallel import init_distributed
    info = init_distributed(tensor_parallel_size=1, backend="gloo")
    return [_evaluate(info, data_dir, 1, False), _evaluate(info, data_dir, 3, True)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("val") / "shards"
    rng = np.random.default_rng(0)
    write_shards(str(d), {"train": random_samples(rng, 4, vocab_size=64, max_length=24, min_length=8),
                          "val": random_samples(rng, 7, vocab_size=64, max_length=24, min_length=8)},
                 samples_per_shard=3)
    return str(d)


def test_validation_is_the_same_on_dp1_and_dp2_and_covers_every_sample_once(tp1, data_dir):
    from pipeline.training.validation import validation_loss
    one = [_evaluate(SimpleNamespace(dp_rank=0, dp_size=1), data_dir, 1, False)]
    ranks = run_distributed(_dp2, 2, (data_dir,))
    two = [r[0] for r in ranks]       # DP=2, micro-batch 1, padded
    three = [r[1] for r in ranks]     # DP=2, micro-batch 3, packed (best fit)
    expected = [f"val{i:07d}" for i in range(7)]
    for res in (one, two, three):
        assert sorted(k for _, keys in res for k in keys) == expected   # each sample once
    ref = one[0][0]
    assert ref["val_batches"] == 7
    for res in (two, three):
        for metrics, _ in res:   # every rank reports the all-reduced figure
            for k in ("val_loss", "val_ar_loss", "val_mdm_loss"):
                assert metrics[k] == pytest.approx(ref[k], rel=1e-5), k
            assert metrics["val_tokens"] == ref["val_tokens"]
    assert two[0][0]["val_batches"] == two[1][0]["val_batches"] == 4   # 7 samples, 2 ranks
    # pipeline.evaluate gives the trainer's figure for the same weights and seed (the CLI
    # defaults to the run's seed for a training checkpoint), whatever its micro-batch size
    model = _trainer(SimpleNamespace(dp_rank=0, dp_size=1), data_dir, 1, False).engine.module
    for mb in (1, 4):
        ev = validation_loss(model, data_dir, "val", micro_batch_size=mb, seed=7)
        for k in ("val_loss", "val_ar_loss", "val_mdm_loss", "val_tokens"):
            assert ev[k] == pytest.approx(ref[k], rel=1e-5), (mb, k)
