"""The memory planner (`pipeline.training.memory_plan`, `python -m pipeline.plan_memory`) against
memory measured on the CPU over the real trainer's step.

Measured: the model states are the bytes of every tensor alive between two optimizer steps (the
engine's partitions, fp32 master copy, AdamW moments and gradient partitions; `gc` over all
tensors, unique storages); the step's working memory is the peak of the bytes of storages
created during one `Trainer.train_step` (forward, loss, backward, optimizer step) and still
alive, tracked by a `TorchDispatchMode` that registers every storage an op returns and drops it
when the storage is freed (`weakref.finalize`). The plan must be within 10% of both and of
their sum.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from live_storage import LiveStorage
from shard_fixtures import TINY_MODEL, random_samples, write_shards

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _tensor_bytes() -> int:
    """Bytes of all live CPU tensors' storages (unique), found through `gc`."""
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
                st = o.untyped_storage()
                if st.data_ptr():
                    seen[st.data_ptr()] = st.nbytes()
        except Exception:
            pass
    return sum(seen.values())


def _measure(rank, world_size, config, run_dir, modes):
    """Per recompute mode: the trainer's plan and the measured model states and step peak.
    The modes' trainers share this launch's process groups (the first trainer's
    `init_distributed` creates them, the later ones find them; the rank tears them down when
    it ends): a process group is not re-created on the same port."""
    from pipeline.config import load_config, validate
    from pipeline.train import Trainer
    from pipeline.training.memory_plan import plan_for_run
    out = {}
    for mode in modes:
        cfg = load_config(config, [f"run_dir={run_dir}/{mode}",
                                   f"train.activation_checkpointing={mode}"])
        plan = validate(cfg)
        gc.collect()
        baseline = _tensor_bytes()         # what earlier modes of this process left behind
        trainer = Trainer(cfg, plan)
        try:
            trainer.setup()
            trainer.train_step()          # AdamW's moments exist from the first step on
            gc.collect()
            before = _tensor_bytes() - baseline
            tracker = LiveStorage()
            with tracker:
                trainer.train_step()
            gc.collect()
        finally:
            it = getattr(trainer, "_train_iter", None)
            if it is not None:
                it.close()
            if trainer.run_lock is not None:
                trainer.run_lock.release()
        mp = plan_for_run(cfg, tp=plan.tp_size, dp=plan.dp_size, model_fields=plan.model_fields,
                          row_length=plan.row_length, device="cpu")
        out[mode] = {"states": before, "step_peak": tracker.peak,
                     "components": mp.components, "total": mp.total}
        del trainer
        gc.collect()
    return out


def _config(tmp_path, tp=1, row=256, mb=2, precision="fp32"):
    rng = np.random.default_rng(5)
    write_shards(str(tmp_path / "data"), {"train": random_samples(
        rng, 16, vocab_size=64, max_length=row, min_length=row // 2)}, samples_per_shard=8)
    model = {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 192, "head_dim": 16,
             "max_position_embeddings": row}
    cfg = {"model": {"inline": model},
           "data": {"dir": str(tmp_path / "data"), "num_workers": 0, "max_length": row},
           "optim": {"lr": 1e-3, "warmup_steps": 1},
           "train": {"max_steps": 4, "micro_batch_size": mb, "grad_accum_steps": 1,
                     "precision": precision, "seed": 3, "tensor_parallel_size": tp},
           "checkpoint": {"interval": 0}, "wandb": {"mode": "disabled"},
           "log": {"peak_tflops": 1.0}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


STATES = ("weights (run dtype)", "fp32 master weights", "AdamW moments (fp32)", "gradients")


def _split(rec):
    states = sum(v for k, v in rec["components"].items() if k in STATES)
    return states, rec["total"] - states


def _check(rec, tol=0.10):
    planned_states, planned_step = _split(rec)
    rows = (("model states", planned_states, rec["states"]),
            ("step working memory", planned_step, rec["step_peak"]),
            ("total", rec["total"], rec["states"] + rec["step_peak"]))
    for name, planned, measured in rows:
        assert abs(planned - measured) <= tol * measured, (name, planned, measured, rec)


def _run(tmp_path, world_size, tp, modes, precision="fp32"):
    from distributed import run_distributed
    config = _config(tmp_path, tp=tp, precision=precision)
    res = run_distributed(_measure, world_size, (config, str(tmp_path), modes))
    for rank, per_mode in enumerate(res):
        for mode, rec in per_mode.items():
            print(f"world {world_size} tp {tp} rank {rank} {mode}: states planned "
                  f"{_split(rec)[0]} measured {rec['states']}; step planned {_split(rec)[1]} "
                  f"measured {rec['step_peak']}")
    return res


def test_plan_matches_measured_dp1_tp1_every_recompute_mode(tmp_path):
    res = _run(tmp_path, 1, 1, ("none", "selective", "full"))
    for mode, rec in res[0].items():
        _check(rec)


def test_plan_matches_measured_dp2_every_recompute_mode(tmp_path):
    for per_mode in _run(tmp_path, 2, 1, ("none", "selective", "full")):
        for rec in per_mode.values():
            _check(rec)


def test_plan_matches_measured_tp2_every_recompute_mode(tmp_path):
    for per_mode in _run(tmp_path, 2, 2, ("none", "selective", "full")):
        for rec in per_mode.values():
            _check(rec)


def _cli(*args):
    """`python -m pipeline.plan_memory ARGS` in a fresh process (the command line users run)."""
    return subprocess.run([sys.executable, "-m", "pipeline.plan_memory", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _cli_here(monkeypatch, capsys, *args):
    """`pipeline.plan_memory.main(ARGS)` in this process, from the repository root, without a
    fresh process's imports: a CompletedProcess-like (returncode, stdout, stderr)."""
    from types import SimpleNamespace
    from pipeline.plan_memory import main
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_cli_qwen3_8b_model_states_and_fit(monkeypatch, capsys):
    """configs/qwen3_8b.yaml on 4 nodes x 8 GPUs (TP 2, DP 16): the model states are ZeRO-3's
    (2 + 4 + 8 + 4) bytes per parameter of a TP rank over 16 ranks (the persistent norms whole),
    and a micro-batch that does not fit 80 GiB without recompute exits 1. The first plan from
    the command line, the others from `main` in this process."""
    from pipeline.model import ModelConfig
    from pipeline.model.flops import num_parameters
    r = _cli("--config", "configs/qwen3_8b.yaml", "--nodes", "4", "--gpu-memory", "80")
    assert r.returncode == 0, r.stderr
    lines = {ln.split("  ")[1].strip(): float(ln.split()[-2]) for ln in r.stdout.splitlines()
             if ln.startswith("  ") and ln.strip().endswith("GiB") and "fits" not in ln}
    cfg = ModelConfig.from_yaml(str(ROOT / "configs/model/qwen3_8b.yaml"))
    n = num_parameters(cfg)
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    per_rank = (n - norms) / 2 + norms
    assert lines["AdamW moments (fp32)"] == pytest.approx(8 * per_rank / 16 / 2 ** 30, abs=0.01)
    assert lines["fp32 master weights"] == pytest.approx(4 * per_rank / 16 / 2 ** 30, abs=0.01)
    assert "recompute full" in r.stdout and "largest micro-batch that fits" in r.stdout
    # ZeRO-3's gathered weights: DeepSpeed's limits (1e9 elements) + the largest weight, the
    # head's TP shard V / 2 x h, in bf16 (not every layer summed as one module)
    head = cfg.vocab_size // 2 * cfg.hidden_size
    assert lines["ZeRO-3 gathered + prefetched params"] == pytest.approx(
        2 * (10 ** 9 + head) / 2 ** 30, abs=0.01)
    # the CUDA context and NCCL's buffers of the world, TP and DP communicators
    from pipeline.training.memory_plan import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_COMMUNICATOR
    assert lines["CUDA context + NCCL buffers (3 communicators; allowance)"] == pytest.approx(
        (CUDA_CONTEXT_BYTES + 3 * NCCL_BYTES_PER_COMMUNICATOR) / 2 ** 30, abs=0.01)
    assert 0.5 < NCCL_BYTES_PER_COMMUNICATOR / 2 ** 30 < 0.6
    r = _cli_here(monkeypatch, capsys, "--config", "configs/qwen3_8b.yaml", "--nodes", "4",
                  "--gpu-memory", "80", "train.activation_checkpointing=none",
                  "train.micro_batch_size=8")
    assert r.returncode == 1 and "does NOT fit" in r.stdout
    # the dual-stream recipe at the same shape: 2 rows of 8192 tokens, the dense SDPA mask
    r = _cli_here(monkeypatch, capsys, "--config", "configs/qwen3_8b_dual.yaml", "--nodes", "4",
                  "--gpus-per-node", "8", "--gpu-memory", "80")
    assert r.returncode == 0 and "fits in 80.0 GiB" in r.stdout, r.stdout + r.stderr
    assert "TP 2 x DP 16" in r.stdout and "micro-batch 2 x 8192 tokens" in r.stdout
    assert "attention mask (dense SDPA)" in r.stdout


def test_cli_bad_input_is_one_line_exit_2(monkeypatch, capsys):
    """The first refusal from the command line, the others from `main` in this process."""
    r = _cli("--config", "configs/qwen3_8b.yaml", "train.no_such_key=1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "train.no_such_key" in r.stderr
    r = _cli_here(monkeypatch, capsys, "--config", "configs/qwen3_8b.yaml", "--world-size", "3")
    assert r.returncode == 2 and "tensor_parallel_size=2" in r.stderr
    # no world size at all on a TP config: the flags are named, not "world size 1"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    r = _cli_here(monkeypatch, capsys, "--config", "configs/qwen3_8b.yaml")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--nodes" in r.stderr and "--gpus-per-node" in r.stderr
    assert "world size 1" not in r.stderr
    r = _cli_here(monkeypatch, capsys, "--config", "configs/qwen3_8b.yaml", "--device", "cpu",
                  "--nodes", "1")
    assert r.returncode == 0 and "CUDA context" not in r.stdout, r.stderr   # CUDA only


def test_trainer_prints_the_plan_and_refuses_before_building(tmp_path, monkeypatch, capsys):
    """`pipeline.train`'s start-up check: the plan printed by rank 0; on a (pretended) CUDA
    device smaller than the plan, `train.memory_check=error` stops with one config-error line
    and exit 2 before any process group or weight exists; `warn` prints one warning line."""
    import pipeline.train as train
    config = _config(tmp_path)
    base = [f"run_dir={tmp_path}/run", "train.gpu_memory_gib=0.001"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = []
    monkeypatch.setattr(train.Trainer, "setup", lambda self: built.append(1))
    assert train.main(["--config", config, *base]) == 2
    err = capsys.readouterr().err
    assert "memory plan per GPU" in err and built == []
    refusal = [ln for ln in err.splitlines() if "config error" in ln]
    assert len(refusal) == 1 and "train.memory_check" in refusal[0] and "GiB" in refusal[0]
    from pipeline.config import load_config, validate
    from pipeline.training.startup import memory_check
    cfg = load_config(config, [*base, "train.memory_check=warn"])   # printed once locked
    lines = memory_check(cfg, validate(cfg), True)
    assert "memory plan per GPU" in lines[0] and "warning: train.memory_check" in lines[-1]
    cfg = load_config(config, [*base, "train.memory_check=off"])
    assert memory_check(cfg, validate(cfg), True) == []
    assert capsys.readouterr().err == ""


def _train_main(rank, world_size, argv, err_path):
    """`pipeline.train.main(ARGV)` in this forked rank (its imports done by the forkserver),
    its stderr (fd 2) written to ERR_PATH: the exit code."""
    import os
    from pipeline.train import main
    sys.stderr.flush()
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        return main(argv)
    finally:
        sys.stderr.flush()


def test_trainer_prints_the_plan_only_once_it_holds_the_run_lock(tmp_path):
    """A second job on a live run directory prints its one-line refusal and not the memory
    plan (the plan is printed after the run lock is taken); a job that gets the lock prints it.
    The refused job is `main` in a forked rank (the command line's refusal is
    tests/test_run_safety.py's), the job that trains one step is the command line."""
    import os
    import socket
    config = _config(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_JOB_ID")}
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text(json.dumps({   # held by this (live) test process
        "host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
        "token": "x"}) + "\n")

    def train(run):
        return subprocess.run([sys.executable, "-m", "pipeline.train", "--config", config,
                               f"run_dir={run}", "train.max_steps=1"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    from types import SimpleNamespace

    from distributed import run_distributed
    err = tmp_path / "refused.err"
    (code,) = run_distributed(_train_main, 1, (["--config", config, f"run_dir={run_dir}",
                                                "train.max_steps=1"], str(err)))
    r = SimpleNamespace(returncode=code, stderr=err.read_text())
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeline.train: error: "), r.stderr[-3000:]
    assert "is in use by another job" in lines[0]
    r = train(tmp_path / "free")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "memory plan per GPU" in r.stderr


def test_plan_matches_measured_bf16_dp1_every_recompute_mode(tmp_path):
    """bf16: 2-byte weights and activations, fp32 master weights and gradients, and the fp32
    copies RMSNorm makes of a bf16 input."""
    for rec in _run(tmp_path, 1, 1, ("none", "selective", "full"), precision="bf16")[0].values():
        _check(rec)


def _gathered(rank, world_size, config, run_dir, cases):
    """Per case (name, overrides): the most partitioned weight elements DeepSpeed holds
    gathered at once during the second step (the first records its trace), read from each
    weight's `ds_status` before every op of the step, and the plan's figure."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.config import load_config, validate
    from pipeline.parallel import destroy_distributed
    from pipeline.train import Trainer
    from pipeline.training.memory_plan import GIB, plan_for_run
    out = {}
    for name, overrides in cases:
        cfg = load_config(config, [f"run_dir={run_dir}/{name}", "train.zero_stage=3",
                                   "model.inline.num_layers=4", *overrides])
        plan = validate(cfg)
        trainer = Trainer(cfg, plan)
        peak = [0]
        try:
            trainer.setup()
            trainer.train_step()
            weights = [p for p in trainer.engine.module.parameters() if not p.ds_persist]

            class Gathered(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    peak[0] = max(peak[0], sum(p.ds_numel for p in weights
                                               if p.ds_status != ZeroParamStatus.NOT_AVAILABLE))
                    return func(*args, **(kwargs or {}))
            with Gathered():
                trainer.train_step()
            partitioned = sum(p.ds_numel for p in weights)
        finally:
            it = getattr(trainer, "_train_iter", None)
            if it is not None:
                it.close()
            if trainer.run_lock is not None:
                trainer.run_lock.release()
            destroy_distributed()
        mp = plan_for_run(cfg, tp=plan.tp_size, dp=plan.dp_size, model_fields=plan.model_fields,
                          row_length=plan.row_length, device="cpu", gpu_bytes=GIB)
        e = 4   # fp32
        out[name] = {"measured": peak[0], "partitioned": partitioned,
                     "planned": mp.components["ZeRO-3 gathered + prefetched params"] // e}
    return out


def test_zero3_gathered_weights_match_deepspeed():
    """The plan's ZeRO-3 gathered weights against DeepSpeed's own (a 4-layer model, fp32):
    with the default limits every partitioned weight is gathered at the forward/backward turn,
    also with a small max_live_parameters while max_reuse_distance keeps them; with both
    limits small, the gathered set stays within 10% below max(limits) + the largest weight
    (`pipeline.training.memory_plan.zero3_gathered_elements`)."""
    import tempfile

    from distributed import run_distributed
    cases = (("defaults", ("train.activation_checkpointing=full",)),
             ("live_60k", ("train.activation_checkpointing=none",
                           "deepspeed.max_live_parameters=60000")),
             ("live_30k_reuse_20k", ("train.activation_checkpointing=full",
                                     "deepspeed.max_live_parameters=30000",
                                     "deepspeed.max_reuse_distance=20000")),
             ("live_30k_reuse_1", ("train.activation_checkpointing=none",
                                   "deepspeed.max_live_parameters=30000",
                                   "deepspeed.max_reuse_distance=1")))
    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path
        config = _config(Path(tmp))
        res = run_distributed(_gathered, 1, (config, tmp, cases))[0]
    for name, rec in res.items():
        print(name, rec)
    for name in ("defaults", "live_60k"):
        assert res[name]["measured"] == res[name]["partitioned"] == res[name]["planned"], res
    for name in ("live_30k_reuse_20k", "live_30k_reuse_1"):
        rec = res[name]
        assert rec["measured"] < rec["partitioned"] / 3, res   # the limits bind
        assert 0.9 * rec["planned"] <= rec["measured"] <= rec["planned"], res
