"""pipeline.checkpoint.reshard through pipeline.checkpoint.load_latest(reshard=True): a ZeRO-3 checkpoint
saved on one layout continues on another.

The oracle is the saving run itself: before saving, it gathers every fp32 master weight and Adam
moment (DeepSpeed's `safe_get_full_*`, merged over TP by the test), then takes one more step on
a fixed global batch. The resharded run must hold bit-identical weights and moments after
loading, and its step on the same global batch must give the same loss and weights within
float tolerance (the reductions run in another order).
"""
from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed
from shard_fixtures import TINY_MODEL
from pipeline import checkpoint as ckpt
from pipeline.checkpoint import store as ckpt_store

MODEL = dict(TINY_MODEL, init_std=0.1)
GLOBAL_ROWS, SEQ = 4, 12


def _engine(tp: int):
    import deepspeed
    from megatron.core import parallel_state

    from pipeline.model import ModelConfig, Qwen3
    from pipeline.parallel import MegatronMPU, init_distributed

    info = init_distributed(tensor_parallel_size=tp)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = ModelConfig.from_dict(dict(MODEL), source="test")
    micro = GLOBAL_ROWS // info.dp_size
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
          "train_batch_size": GLOBAL_ROWS, "gradient_clipping": 1.0,
          "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "steps_per_print": 10 ** 9}
    torch.manual_seed(0)
    with deepspeed.zero.Init(mpu=MegatronMPU(), config_dict_or_path=ds,
                             data_parallel_group=parallel_state.get_data_parallel_group()):
        model = Qwen3(cfg, init_weights=True)
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds, mpu=MegatronMPU())
    return engine, info, cfg


def _step(engine, info, seed: int) -> float:
    """One optimizer step on a fixed global batch (GLOBAL_ROWS rows, split over DP ranks);
    returns the global mean loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_ROWS, SEQ + 1), generator=g)
    per = GLOBAL_ROWS // info.dp_size
    mine = ids[info.dp_rank * per:(info.dp_rank + 1) * per]
    pos = torch.arange(SEQ).expand(per, SEQ)
    logits = engine(mine[:, :-1], pos)
    loss = vocab_parallel_cross_entropy(logits.float().clone(), mine[:, 1:]).mean()
    engine.backward(loss)
    engine.step()
    out = loss.detach().clone()
    dist.all_reduce(out, group=parallel_state.get_data_parallel_group())
    return float(out) / info.dp_size


def _full_state(engine, info, cfg) -> dict:
    """{key: {hf name: full tensor}} for fp32 weights and Adam moments, gathered over DP by
    DeepSpeed and over TP here (then merged the way export merges weights)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron.core import parallel_state

    from pipeline.model.hf import merge_tp_state_dicts

    local = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in engine.module.named_parameters():
        local["fp32"][n] = safe_get_full_fp32_param(p).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            local[k][n] = safe_get_full_optimizer_state(p, k).clone()
    shards = [None] * info.tp_size
    dist.all_gather_object(shards, local, group=parallel_state.get_tensor_model_parallel_group())
    return {k: merge_tp_state_dicts([s[k] for s in shards], cfg) for k in local}


def _save_body(rank, world, tp, root):
    engine, info, cfg = _engine(tp)
    losses = [_step(engine, info, seed=s) for s in (1, 2)]
    state = _full_state(engine, info, cfg)
    ckpt.save_checkpoint(engine, root, step=2, client_state={"loader": {"dp": info.dp_rank}},
                         keep_last=2, model_config=cfg)
    next_loss = _step(engine, info, seed=3)
    after = _full_state(engine, info, cfg)["fp32"]
    return (losses, state, next_loss, after) if rank == 0 else None


def _load_body(rank, world, tp, root):
    engine, info, cfg = _engine(tp)
    resumed = ckpt.load_latest(engine, root, model_config=cfg, reshard=True)
    state = _full_state(engine, info, cfg)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in
              engine.optimizer.optimizer.param_groups]
    next_loss = _step(engine, info, seed=3)
    after = _full_state(engine, info, cfg)["fp32"]
    return (resumed, state, next_loss, after, groups) if rank == 0 else None


@pytest.fixture(scope="module")
def saved_tp2_dp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard") / "ckpt"
    return root, run_distributed(_save_body, world_size=4, args=(2, str(root)))[0]


@pytest.mark.parametrize("tp,world", [(2, 2), (1, 2)],
                         ids=["tp2dp2-to-tp2dp1", "tp2dp2-to-tp1dp2"])
def test_reshard_keeps_weights_and_moments_exactly(saved_tp2_dp2, tp, world):
    root, (losses, saved, old_next, old_after) = saved_tp2_dp2
    step_dir = ckpt.find_latest(root)
    files_before = {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()}
    resumed, state, new_next, new_after, groups = run_distributed(
        _load_body, world_size=world, args=(tp, str(root)))[0]
    assert resumed["step"] == 2
    assert resumed["resharded_from"] == {"world_size": 4, "tp_size": 2, "dp_size": 2}
    assert resumed["loader_states"] == [{"dp": 0}, {"dp": 1}]
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert saved[key].keys() == state[key].keys()
        for name, t in saved[key].items():
            assert torch.equal(t, state[key][name]), (key, name)
    # Adam moments are not trivially zero (two steps were taken), so equality means something.
    assert all(t.abs().sum() > 0 for t in saved["exp_avg"].values())
    # Weight decay per group survives DeepSpeed's universal loader (it copies group 0's).
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert new_next == pytest.approx(old_next, rel=1e-5, abs=1e-6)
    diffs = {n: float((new_after[n] - t).abs().max()) for n, t in old_after.items()}
    assert max(diffs.values()) < 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
    # The original checkpoint is untouched; the conversion lives beside it.
    assert {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()} == files_before
    conv = root / "universal" / f"{step_dir.name}_tp{tp}"
    assert json.loads((conv / "refusion_universal.json").read_text())["new_tp_size"] == tp


def test_interrupted_conversion_leaves_checkpoint_usable(saved_tp2_dp2, monkeypatch):
    """A conversion that dies midway leaves only a `.partial` folder; the next one redoes it."""
    from pipeline.checkpoint import reshard
    root, _ = saved_tp2_dp2
    step_dir = ckpt.find_latest(root)
    dest = reshard.universal_dir(step_dir, 1)
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(dest, ignore_errors=True)

    def boom(*a, **k):
        raise RuntimeError("killed")
    monkeypatch.setattr(reshard, "_retarget_tp", boom)
    with pytest.raises(RuntimeError):
        reshard.convert_to_universal(step_dir, 1)
    assert not dest.exists() and dest.with_name(dest.name + ".partial").exists()
    assert ckpt.find_latest(root) == step_dir and ckpt_store.is_complete(step_dir)
    with pytest.raises(reshard.ReshardError, match="not divisible"):
        reshard.convert_to_universal(step_dir, 3)
    monkeypatch.undo()
    assert (reshard.convert_to_universal(step_dir, 1) / reshard.MARKER).is_file()
    assert not dest.with_name(dest.name + ".partial").exists()


def _refused_body(rank, world, root):
    engine, info, cfg = _engine(1)
    try:
        ckpt.load_latest(engine, root, model_config=cfg)
    except ckpt.CheckpointError as e:
        return str(e)


def test_layout_change_without_reshard_is_one_line(saved_tp2_dp2):
    root, _ = saved_tp2_dp2
    msg = run_distributed(_refused_body, world_size=1, args=(str(root),))[0]
    assert "checkpoint.reshard=true" in msg and "\n" not in msg
