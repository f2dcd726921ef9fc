"""pipeline.checkpoint: crash-safe save, keep-K, resume equal to an uninterrupted run, and TP=2 x
DP=2 ZeRO-3 consolidation equal to the gathered weights and to a plain single-process network.

The model is a tiny stand-in built from the same megatron-core TP layers the real model uses
(VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear), so the test does not
depend on pipeline.model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from pipeline import checkpoint as ckpt
from pipeline.checkpoint import consolidate as ckpt_consolidate
from pipeline.checkpoint import store as ckpt_store
from pipeline.checkpoint.safe_load import load_checkpoint_file

V, H, F = 16, 8, 12          # vocab, hidden, feed-forward sizes (all divisible by TP=2)
TP, WORLD = 2, 4
SEQ, MICRO = 6, 2


class Crash(Exception):
    """Raised at a checkpoint crash point to simulate a process dying mid-save."""


def _build(seed: int, stage: int = 3):
    """Tiny TP model (inside zero.Init for ZeRO-3) + a DeepSpeed ZeRO engine over the DP group."""
    import deepspeed
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)

    from pipeline.parallel import MegatronMPU

    mcfg = ModelParallelConfig(tensor_model_parallel_size=TP, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, params_dtype=torch.float32)
    init = torch.nn.init.normal_

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = {"vocab_size": V, "hidden_size": H, "ffn": F}
            self.emb = VocabParallelEmbedding(V, H, init_method=init, config=mcfg)
            self.fc1 = ColumnParallelLinear(H, F, config=mcfg, init_method=init, bias=True,
                                            gather_output=False)
            self.fc2 = RowParallelLinear(F, H, config=mcfg, init_method=init, bias=True,
                                         input_is_parallel=True, skip_bias_add=False)
            self.norm = torch.nn.LayerNorm(H)
            self.head = ColumnParallelLinear(H, V, config=mcfg, init_method=init, bias=False,
                                             gather_output=False)

        def forward(self, ids):                      # LongTensor[B, T] -> FloatTensor[B, T, V/tp]
            x = self.emb(ids)
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            logits, _ = self.head(self.norm(x + y))
            return logits

    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 20, "warmup_num_steps": 3}},
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
    }
    deepspeed.init_distributed(dist_backend="gloo")   # wrap the default group (zero.Init reads it)
    torch.manual_seed(seed)
    with deepspeed.zero.Init(data_parallel_group=parallel_state.get_data_parallel_group(),
                             mpu=MegatronMPU(), config_dict_or_path=ds_config,
                             enabled=stage == 3):
        model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                      mpu=MegatronMPU())
    return engine


def _train_step(engine):
    """One step on a batch drawn from the global RNGs (torch, numpy, python): the batch, and so
    the loss, only repeat after a resume if the RNG states were restored."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ids = torch.randint(0, V, (MICRO, SEQ))
    ids[:, int(np.random.randint(0, SEQ))] = random.randrange(V)
    logits = engine(ids[:, :-1])
    loss = vocab_parallel_cross_entropy(logits.clone(), ids[:, 1:]).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _gathered_local_weights(engine) -> dict:
    """Each parameter's full TP-local tensor on this rank (ZeRO-3 gathered over DP)."""
    import deepspeed
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _tp_logits(engine, ids) -> torch.Tensor:
    """Full-vocab logits: the TP shards all-gathered and concatenated (independent of export)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    with torch.no_grad():
        shard = engine(ids)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(TP)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _seed_rngs(dp_rank: int):
    import random

    import numpy as np
    # the same on both TP ranks of a DP group (they must see the same batch)
    random.seed(100 + dp_rank)
    np.random.seed(200 + dp_rank)
    torch.manual_seed(300 + dp_rank)


def _phase1(rank, world_size, root):
    """Uninterrupted run of 6 steps; checkpoints at 2, 3, 4 (keep 2); a crashed save at 5."""
    from pipeline.parallel import init_distributed
    info = init_distributed(tensor_parallel_size=TP)
    engine = _build(seed=0)
    _seed_rngs(info.dp_rank)
    losses, probe = {}, torch.arange(10).reshape(2, 5) % V
    result = {}
    for step in range(1, 7):
        losses[step] = _train_step(engine)
        if step in (2, 3, 4):
            ckpt.save_checkpoint(engine, root, step, {"consumed_samples": step * 4,
                                                      "loader": {"offset": step, "rank": rank},
                                                      "wandb_run_id": "run-abc"}, keep_last=2)
        if step == 4:
            result["weights_4"] = _gathered_local_weights(engine)
            result["logits_4"] = _tp_logits(engine, probe)
            result["latest_after_4"] = (Path(root) / "latest").read_text()
        if step == 5:  # every rank "dies" after its files are written, before publication
            def crash(name):
                if name == "before_publish":
                    raise Crash(name)
            ckpt_store._crash_point = crash
            try:
                ckpt.save_checkpoint(engine, root, step, {"consumed_samples": 20}, keep_last=2)
                raise AssertionError("the simulated crash did not happen")
            except Crash:
                pass
            finally:
                ckpt_store._crash_point = lambda name: None
            result["dirs_after_crash"] = sorted(os.listdir(root))
    result["losses"] = losses
    result["tp_rank"], result["dp_rank"] = info.tp_rank, info.dp_rank
    # ZeRO-2 (other DeepSpeed file names: mp_rank_XX_model_states.pt) in a second root
    engine2 = _build(seed=7, stage=2)
    _train_step(engine2)
    ckpt.save_checkpoint(engine2, root + "-zero2", 1, {}, keep_last=1)
    result["weights_zero2"] = {n: p.detach().clone() for n, p in engine2.module.named_parameters()}
    return result


def _phase2(rank, world_size, root):
    """Restart the same job: resume from the latest complete checkpoint, train steps 5 and 6."""
    from pipeline.parallel import init_distributed
    info = init_distributed(tensor_parallel_size=TP)
    engine = _build(seed=12345)          # different init: the weights must come from the file
    _seed_rngs(info.dp_rank + 50)        # different RNG: it must come from the file
    state = ckpt.load_latest(engine, root)
    losses = {step: _train_step(engine) for step in range(state["step"] + 1, 7)}
    ckpt.save_checkpoint(engine, root, 6, {"consumed_samples": 23}, keep_last=2)
    # the same step saved again (e.g. a signal right after a periodic save) replaces it
    ckpt.save_checkpoint(engine, root, 6, {"consumed_samples": 24}, keep_last=2)
    return {"state": state, "losses": losses, "dirs": sorted(os.listdir(root))}


def _reference_logits(sd: dict, ids: torch.Tensor) -> torch.Tensor:
    """The stand-in network written with plain torch ops on full (unsharded) weights."""
    F_ = torch.nn.functional
    x = F_.embedding(ids, sd["emb.weight"])
    h = F_.linear(x, sd["fc1.weight"], sd["fc1.bias"])
    y = F_.linear(F_.gelu(h), sd["fc2.weight"], sd["fc2.bias"])
    z = F_.layer_norm(x + y, (H,), sd["norm.weight"], sd["norm.bias"])
    return F_.linear(z, sd["head.weight"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    p1 = run_distributed(_phase1, WORLD, (str(root),))
    p2 = run_distributed(_phase2, WORLD, (str(root),))
    return root, p1, p2


def test_keep_last_and_crash_leaves_previous_latest(runs):
    root, p1, p2 = runs
    r0 = p1[0]
    assert r0["latest_after_4"] == "step_000000004"
    # keep_last=2 removed step 2; the crashed save at 5 left only a .partial folder
    assert [d for d in r0["dirs_after_crash"] if d.startswith("step_")] == [
        "step_000000003", "step_000000004", "step_000000005.partial"]
    assert "latest" in r0["dirs_after_crash"]
    # after the restart: the next save removed the .partial leftover and step 3 (keep 2)
    assert [d for d in p2[0]["dirs"] if d.startswith("step_")] == [
        "step_000000004", "step_000000006"]
    assert (root / "latest").read_text() == "step_000000006"
    assert ckpt.find_latest(root) == root / "step_000000006"
    for rank in range(WORLD):  # the second save of step 6 won, rank by rank
        saved = load_checkpoint_file(root / "step_000000006" / f"refusion_rank_{rank:05d}.pt")
        assert saved["client_state"] == {"consumed_samples": 24} and saved["rank"] == rank


def test_resume_restores_state_and_equals_uninterrupted_run(runs):
    root, p1, p2 = runs
    for rank in range(WORLD):
        state = p2[rank]["state"]
        assert state["step"] == 4
        assert state["consumed_samples"] == 16
        assert state["loader"] == {"offset": 4, "rank": rank}   # this rank's own state
        assert state["wandb_run_id"] == "run-abc"
        # losses of steps 5 and 6 after resume == the uninterrupted run, exactly (fp32, CPU)
        assert p2[rank]["losses"] == {5: p1[rank]["losses"][5], 6: p1[rank]["losses"][6]}
    # the two DP groups saw different batches (else the RNG check above proves little)
    assert p1[0]["losses"][5] != p1[2]["losses"][5]


def test_consolidation_equals_gathered_weights_and_plain_forward(runs):
    root, p1, _ = runs
    full, layout = ckpt.consolidate_state_dict(root / "step_000000004")
    assert layout["step"] == 4 and layout["tp_size"] == TP and layout["dp_size"] == 2
    assert layout["model_config"] == {"vocab_size": V, "hidden_size": H, "ffn": F}
    assert full["emb.weight"].shape == (V, H) and full["fc2.weight"].shape == (H, F)
    assert full["fc1.weight"].shape == (F, H) and full["head.weight"].shape == (V, H)
    for res in p1:  # every rank's gathered TP-local tensor is its slice of the merged one
        tp_rank = res["tp_rank"]
        for name, local in res["weights_4"].items():
            dim = layout["params"][name]["partition_dim"]
            expect = full[name] if dim is None else full[name].chunk(TP, dim=dim)[tp_rank]
            torch.testing.assert_close(local, expect, rtol=0, atol=0, msg=name)
    probe = torch.arange(10).reshape(2, 5) % V
    torch.testing.assert_close(_reference_logits(full, probe), p1[0]["logits_4"],
                               rtol=1e-5, atol=1e-5)


def test_zero2_consolidation_equals_the_weights(runs):
    root, p1, _ = runs
    full, layout = ckpt.consolidate_state_dict(Path(str(root) + "-zero2"))
    assert layout["tp_size"] == TP and layout["dp_size"] == 2
    for res in p1:
        for name, local in res["weights_zero2"].items():
            dim = layout["params"][name]["partition_dim"]
            expect = full[name] if dim is None else full[name].chunk(TP, dim=dim)[res["tp_rank"]]
            torch.testing.assert_close(local, expect, rtol=0, atol=0, msg=name)


def test_merge_tp_shards_inverts_megatron_strided_split():
    # megatron-core's CPU init: cut the master weight into stride*tp chunks along dim, rank r
    # keeps chunks r, r+tp, ... concatenated (layers._initialize_affine_weight_cpu)
    full = torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8 * 2, 3)
    for tp, stride in [(2, 1), (2, 2), (4, 2)]:
        chunks = full.split(full.shape[0] // (tp * stride), dim=0)
        shards = [torch.cat(chunks[r::tp], dim=0) for r in range(tp)]
        assert torch.equal(ckpt_consolidate._merge_tp_shards(shards, 0, stride), full)
    assert torch.equal(ckpt_consolidate._merge_tp_shards([full, full + 1], None, 1), full)


def test_find_latest_ignores_incomplete_and_falls_back(tmp_path):
    assert ckpt.find_latest(tmp_path) is None
    for step in (1, 2):
        d = tmp_path / ckpt.tag_for_step(step)
        d.mkdir()
        (d / ckpt_store.META).write_text(json.dumps({"step": step}))
    (tmp_path / "step_000000003").mkdir()                    # no meta: incomplete
    (tmp_path / "step_000000004.partial").mkdir()
    (tmp_path / "step_000000004.partial" / ckpt_store.META).write_text("{}")
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_000000002"  # no pointer: scan
    (tmp_path / "latest").write_text("step_000000001")
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_000000001"  # pointer wins
    (tmp_path / "latest").write_text("step_000000003")                # names incomplete
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_000000002"
    elsewhere = tmp_path / "other" / "step_000000009"
    elsewhere.mkdir(parents=True)
    (elsewhere / ckpt_store.META).write_text("{}")
    (tmp_path / "latest").write_text("other/step_000000009")          # outside the root
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_000000002"
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint_dir(tmp_path / "step_000000003")


def test_load_latest_refuses_a_different_world_size(tmp_path):
    d = tmp_path / ckpt.tag_for_step(7)
    d.mkdir()
    (d / ckpt_store.META).write_text(json.dumps({"step": 7, "world_size": 8, "tp_size": 2}))

    class NoEngine:      # the check must fire before DeepSpeed is asked to load anything
        mpu = None

        def load_checkpoint(self, *a, **k):
            raise AssertionError("DeepSpeed load attempted")

    with pytest.raises(ckpt.CheckpointError, match="world size 8 with TP 2"):
        ckpt.load_latest(NoEngine(), tmp_path)
    assert ckpt.load_latest(NoEngine(), tmp_path / "empty") is None


class _FakeEngine:
    """Just enough of a DeepSpeed engine for the publish logic (no DeepSpeed involved)."""
    mpu = None

    def __init__(self):
        self.module = torch.nn.Linear(2, 2)

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import torch.distributed as dist
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.module.state_dict(), d / f"fake_rank_{dist.get_rank()}.pt")
        dist.barrier()

    def zero_optimization_stage(self):
        return 0


def _rank0_fails_publishing(rank, world_size, root):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = _FakeEngine()
    ckpt.save_checkpoint(engine, root, 1, {"n": 1}, keep_last=2)

    def crash(name):
        if name == "before_latest":          # only rank 0 gets there
            raise Crash(name)
    ckpt_store._crash_point = crash
    try:
        ckpt.save_checkpoint(engine, root, 2, {"n": 2}, keep_last=2)
    except (Crash, ckpt.CheckpointError) as e:
        return type(e).__name__
    return "no error"


def test_rank0_publish_failure_raises_everywhere_and_keeps_latest(tmp_path):
    got = run_distributed(_rank0_fails_publishing, 2, (str(tmp_path),), timeout_s=120)
    assert got == ["Crash", "CheckpointError"]          # nobody left waiting in a barrier
    assert (tmp_path / "latest").read_text() == "step_000000001"
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_000000001"


def test_load_latest_refuses_a_different_model_config(tmp_path):
    d = tmp_path / ckpt.tag_for_step(3)
    d.mkdir()
    (d / ckpt_store.META).write_text(json.dumps({"step": 3, "world_size": 1, "tp_size": 1}))
    saved = {"vocab_size": 64, "hidden_size": 64, "num_layers": 2, "recompute": False,
             "init_std": 0.02}
    (d / ckpt_store.MODEL_CONFIG).write_text(json.dumps(saved))

    class NoEngine:
        mpu = None

        def load_checkpoint(self, *a, **k):
            raise AssertionError("DeepSpeed load attempted")

    changed = dict(saved, hidden_size=128, num_layers=3)
    with pytest.raises(ckpt.CheckpointError) as e:      # before DeepSpeed is asked to load
        ckpt.load_latest(NoEngine(), tmp_path, model_config=changed)
    msg = str(e.value)
    assert "\n" not in msg and str(d / ckpt_store.MODEL_CONFIG) in msg
    assert "hidden_size 64 -> 128, num_layers 2 -> 3 (saved -> now)" in msg
    assert "vocab_size" not in msg
    # the same model (activation checkpointing and init_std may change) gets to DeepSpeed's load
    for same in (saved, dict(saved, recompute=True, init_std=0.5)):
        with pytest.raises(AssertionError, match="DeepSpeed load attempted"):
            ckpt.load_latest(NoEngine(), tmp_path, model_config=same)


def test_remove_leftovers_cleans_incomplete_step_folders_older_than_latest(tmp_path):
    for step in (2, 4):
        d = tmp_path / ckpt.tag_for_step(step)
        d.mkdir()
        (d / ckpt_store.META).write_text(json.dumps({"step": step}))
    for name in ("step_000000001", "step_000000003", "step_000000005",
                 "step_000000006.partial", "step_000000004.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    removed = ckpt_store.remove_leftovers(tmp_path)
    assert sorted(removed) == ["step_000000001", "step_000000003", "step_000000004.old",
                               "step_000000006.partial"]
    # the complete ones stay, and an incomplete folder newer than the latest is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000000002", "step_000000004", "step_000000005"]


class _FailingEngine(_FakeEngine):
    """Rank 0's DeepSpeed save fails mid-write (as torch's zip writer does on a full disk)."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import torch.distributed as dist
        if dist.get_rank() == 0 and tag.startswith("step_000000003"):
            (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5 vs 3")
        super().save_checkpoint(save_dir, tag, client_state, save_latest)


def _disk_full_on_one_rank(rank, world_size, root):
    import errno
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = _FailingEngine()
    stale = Path(root) / "step_000000000"      # an incomplete step folder left by an old crash
    if rank == 0:
        stale.mkdir(parents=True)
    dist.barrier()
    ckpt.save_checkpoint(engine, root, 1, {"n": 1}, keep_last=2)
    out = {"stale_removed": not stale.exists()}

    def crash(name):   # rank 1's own file: no space left
        if name == "after_deepspeed_save" and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
    ckpt_store._crash_point = crash
    try:
        ckpt.save_checkpoint(engine, root, 2, {"n": 2}, keep_last=2)
        out["enospc"] = "no error"
    except ckpt.CheckpointWriteError as e:
        out["enospc"] = str(e)
    ckpt_store._crash_point = lambda name: None
    out["partial_2_gone"] = not (Path(root) / "step_000000002.partial").exists()
    try:   # a failure inside DeepSpeed's save on rank 0 only (the others wait in its barrier)
        ckpt.save_checkpoint(engine, root, 3, {"n": 3}, keep_last=2)
        out["inside"] = "no error"
    except ckpt.CheckpointWriteError as e:
        out["inside"] = str(e)
    out["partial_3_gone"] = not (Path(root) / "step_000000003.partial").exists()
    ckpt.save_checkpoint(engine, root, 4, {"n": 4}, keep_last=2)   # the run goes on afterwards
    out["latest"] = (Path(root) / "latest").read_text()
    return out


def test_write_failure_on_one_rank_is_one_line_on_every_rank(tmp_path):
    got = run_distributed(_disk_full_on_one_rank, 2, (str(tmp_path),), timeout_s=120)
    for r in got:
        assert r["stale_removed"] and r["partial_2_gone"] and r["partial_3_gone"]
        assert r["latest"] == "step_000000004"
    assert got[0]["enospc"] == got[1]["enospc"]   # the same line on every rank
    msg = got[0]["enospc"]
    assert "\n" not in msg and msg.startswith(f"checkpoint {tmp_path / 'step_000000002.partial'}: "
                                              f"rank 1 could not write it: no space left on device "
                                              f"(free space seen: ")
    assert "the previous checkpoint step_000000001 is intact and stays the latest" in msg
    assert got[0]["inside"] == got[1]["inside"]
    assert "rank 0 could not write it: RuntimeError: [enforce fail" in got[0]["inside"]
