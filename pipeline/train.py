"""The training job: `python -m pipeline.train --config configs/<run>.yaml [key=value ...]`.

Owns: the training loop (DeepSpeed ZeRO over the data-parallel group + megatron-core tensor
parallelism), weight initialization (seeded random or a Hugging Face folder), the learning-rate
schedule, validation, logging (console, `<run_dir>/metrics.jsonl`, wandb), checkpoint cadence and
auto-resume, SIGTERM/SIGUSR1/SIGINT handling and the NaN policy. Must not touch: the network
(`pipeline.model`), the objective (`pipeline.objective`), shard reading (`pipeline.data`), the
checkpoint format (`pipeline.checkpoint`), config validation (`pipeline.config`).

Launch with `python -m pipeline.launch --nproc_per_node N -m pipeline.train ...` (torchrun's
options; keeps the exit codes below and forwards signals), plain torchrun, or srun (one task per
device; MASTER_ADDR/MASTER_PORT set by the launcher script); a bare `python -m pipeline.train`
is one process on a free rendezvous port. One job per run directory (`pipeline.runlock`). The config is validated before any process group exists; a config error is one
line on stderr and exit code 2.

One optimizer step (all ranks):
  for each of the `grad_accum_steps` micro-batches: forward -> `hybrid_loss` -> backward
  (DeepSpeed scales by 1/GA and reduces gradients over the data-parallel group only, `mpu=`);
  one all-reduce of [loss sums, token counts, non-finite flag, signal flag] over the world;
  NaN policy; lr = `lr_at(step)`; DeepSpeed step (clip, AdamW). The loss of a step is the mean of
  its micro-batch losses over data-parallel ranks and accumulation steps, which is what its
  gradient descends.

Signals: SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) on any rank finish the current step; all ranks
agree through the step's all-reduce, checkpoint and exit 0. A second SIGINT aborts at once (no
checkpoint, exit 130, one line). Loader workers ignore these signals (`pipeline.data`), so a
signal sent to the whole process group (SLURM preemption, scancel, Ctrl-C) reaches the trainer only.

Exit codes: 0 done (or checkpointed after SIGTERM/SIGUSR1/SIGINT), 2 config error or a user error
found after start-up (a checkpoint or loader state from another layout or model shape, an HF
folder that does not fit, wandb cannot start, another live job holds the run directory, the
ranks cannot meet at MASTER_ADDR:MASTER_PORT within REFUSION_RENDEZVOUS_TIMEOUT), 3
non-finite loss with `train.nan_policy=stop` (no checkpoint written for that step), 4 a checkpoint
or metrics.jsonl could not be written (disk full, quota exceeded: one line naming the folder or
file, the cause and the free space seen; the partial checkpoint folder removed, the previous one
intact), 130 a second Ctrl-C. An error raised on one rank only is printed once by that rank; the
other ranks exit with the same code without a traceback. Under torchrun the launcher turns these
into its own exit 1 and a traceback; `python -m pipeline.launch` (same arguments) keeps them.
A wandb failure mid-run is one warning line; training goes on (`pipeline.monitor`).

metrics.jsonl (rank 0, appended; a resumed run appends again from its checkpoint step, so a
reader keeps the last line per (kind, step)): one JSON object per line with `kind` "train"
(step, loss, ar_loss, mdm_loss, lr, grad_norm, tokens_per_s, tflops_per_device, mfu,
peak_memory_bytes, consumed_samples, consumed_tokens, step_time_s, skipped) or "val" (step,
val_loss, val_ar_loss, val_mdm_loss, val_batches).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from pipeline.diskspace import EXIT_DISK_FULL

log = logging.getLogger("pipeline.train")

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_WRITE = EXIT_DISK_FULL   # 4: a checkpoint or metrics.jsonl could not be written
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------------------------
# Pure helpers (unit-tested without processes)
# --------------------------------------------------------------------------------------------

def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to `min_lr`.

    Warmup: `lr * (step + 1) / warmup_steps` for `step < warmup_steps`. Then with
    `q = (step - warmup_steps) / max(1, max_steps - warmup_steps)` (clamped to [0, 1]):
    `min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * q))` (Loshchilov & Hutter 2017, SGDR, one cycle).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    q = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))


def deepspeed_config(cfg, plan) -> dict:
    """The DeepSpeed config dict for a validated run config.

    `train_batch_size = micro-batch x GA x data-parallel size` (DeepSpeed checks it against the
    `mpu`'s data-parallel size). The lr is set by the trainer every step (`lr_at`), so no
    DeepSpeed scheduler. With `optim.impl=torch` the client `torch.optim.AdamW` is used
    (`zero_allow_untested_optimizer`, `zero_force_ds_cpu_optimizer: false` so offload accepts it).
    bf16 with `deepspeed.fp32_grad_accum` (the default): `data_types.grad_accum_dtype` and
    `communication_data_type` are fp32. ZeRO bucket sizes: `zero_sizes`.
    """
    t, o = cfg.train, cfg.optim
    zero: dict[str, Any] = {"stage": int(t.zero_stage)}
    sizes = zero_sizes(cfg.deepspeed, int(plan.model_fields["hidden_size"]))
    if t.zero_stage >= 1:
        zero["contiguous_gradients"] = True
        zero["reduce_bucket_size"] = sizes["reduce_bucket_size"]
    if t.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": sizes["prefetch_bucket_size"],
                     "stage3_param_persistence_threshold": sizes["param_persistence_threshold"],
                     "stage3_max_live_parameters": sizes["max_live_parameters"],
                     "stage3_max_reuse_distance": sizes["max_reuse_distance"]})
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _cuda()}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": _cuda()}
    ds = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": float(o.grad_clip),
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2 ** 31 - 1,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16" and cfg.deepspeed.fp32_grad_accum:
        ds["communication_data_type"] = "fp32"
        if t.zero_stage >= 1:  # DeepSpeed 0.19 refuses bf16 params with fp32 accumulation at stage 0
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if o.impl == "deepspeed":
        ds["optimizer"] = {"type": "AdamW", "params": {
            "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
            "weight_decay": o.weight_decay}}
    return ds


def should_evaluate(step: int, eval_interval: int, stop_pending: bool) -> bool:
    """Whether to validate after optimizer step `step`: every `eval_interval` steps (0 = never),
    but not when a stop signal is pending (all ranks agreed on it in the step's all-reduce):
    the time left before the job is killed (`slurm/pretrain.sh` SIGNAL_MARGIN) goes to the
    checkpoint, not to a validation pass. The checkpoint then records `eval_pending` and the
    resumed run validates at that step before training on (same weights, same val loader,
    so the val curve has no gap)."""
    return bool(eval_interval) and step % eval_interval == 0 and not stop_pending


def zero_sizes(ds_cfg, hidden_size: int) -> dict[str, int]:
    """ZeRO communication sizes in elements: the `deepspeed.*` value when set, else derived
    from the hidden size h as DeepSpeed's Hugging Face integration fills "auto"
    (transformers `HfTrainerDeepSpeedConfig`): reduce bucket h^2, ZeRO-3 prefetch bucket
    0.9 h^2, persistence threshold 10 h; max live parameters / reuse distance 1e9
    (DeepSpeed's defaults)."""
    h = int(hidden_size)
    derived = {"reduce_bucket_size": h * h, "prefetch_bucket_size": int(0.9 * h * h),
               "param_persistence_threshold": 10 * h, "max_live_parameters": 10 ** 9,
               "max_reuse_distance": 10 ** 9}
    return {k: int(ds_cfg[k]) if ds_cfg[k] is not None else v for k, v in derived.items()}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (run seed, tensor name), stable across processes."""
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2 ** 63 - 1)


def random_hf_tensor(name: str, shape: tuple[int, ...], mcfg, seed: int):
    """Seeded random init of one full Hugging Face tensor (the same on every rank and layout).

    Norm weights (`*norm.weight`) are ones; `o_proj` / `down_proj` are N(0, (std/sqrt(2L))^2)
    (GPT-2's scaled residual init, as `pipeline.model` does); every other matrix and the embedding
    is N(0, std^2) with std = `mcfg.init_std`. Values come from a torch.Generator seeded by
    `(seed, name)`, so they do not depend on the tensor-parallel or data-parallel layout.

    Returns:
        FloatTensor[shape] (fp32).
    """
    import torch
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = mcfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = std / math.sqrt(2.0 * mcfg.num_layers)
    g = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def _hf_shape(name: str, mcfg) -> tuple[int, ...]:
    h, d, i = mcfg.hidden_size, mcfg.head_dim, mcfg.intermediate_size
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return (mcfg.vocab_size, h)
    if name.endswith("q_proj.weight"):
        return (mcfg.num_attention_heads * d, h)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return (mcfg.num_key_value_heads * d, h)
    if name.endswith("o_proj.weight"):
        return (h, mcfg.num_attention_heads * d)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (i, h)
    if name.endswith("down_proj.weight"):
        return (h, i)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (d,)
    if name.endswith("norm.weight"):
        return (h,)
    raise KeyError(f"no init rule for {name}")


def random_tp_shards(mcfg, seed: int, tp_rank: int, tp_size: int
                     ) -> Iterator[tuple[str, Any]]:
    """Yield `(native_name, tensor)` of a seeded random model for this TP rank.

    Each Hugging Face tensor is drawn in full by `random_hf_tensor` and cut exactly as
    `pipeline.hf_io.iter_tp_shard` cuts a checkpoint (`hf_io.param_specs`: each source tensor
    split into `tp_size` contiguous blocks along the partition dim, fused sources concatenated),
    so a TP=2 run starts from the same network as a TP=1 run. Peak extra memory: one full HF
    tensor (fp32).
    """
    import torch
    from pipeline.hf_io import param_specs
    for spec in param_specs(mcfg):
        parts = []
        for name in spec.hf:
            full = random_hf_tensor(name, _hf_shape(name, mcfg), mcfg, seed)
            if spec.dim is None:
                parts.append(full)
            else:
                parts.append(full.chunk(tp_size, dim=spec.dim)[tp_rank])
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim or 0)
        yield spec.native, t.contiguous()


def copy_into_model(model, shards: Iterator[tuple[str, Any]], source: str) -> None:
    """Copy `(native_name, tensor)` pairs into `model`'s parameters, ZeRO-3 partitioned or not.

    A ZeRO-3 parameter is gathered (`deepspeed.zero.GatheredParameters(modifier_rank=0)`), written,
    and re-partitioned (DP rank 0's value is broadcast; every rank writes the same tensor).

    Raises:
        ValueError: shape mismatch; KeyError: unknown or missing parameter (names `source`).
    """
    import deepspeed
    import torch
    params = dict(model.named_parameters())
    seen = set()
    for name, t in shards:
        if name not in params:
            raise KeyError(f"{source}: model has no parameter {name}")
        p = params[name]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if tuple(t.shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, model expects {shape}")
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0,
                                               enabled=hasattr(p, "ds_id")):
            with torch.no_grad():
                p.data.copy_(t.to(device=p.device, dtype=p.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"{source}: no value for parameters {missing[:5]}")


def peak_flops_per_device(cfg) -> float | None:
    """Peak FLOP/s of one device: `log.peak_tflops` when set, else the table of known parts by
    CUDA device name (`pipeline.model.PEAK_BF16_TFLOPS`), else None with one notice (CPU or
    unknown GPU: MFU is reported as null, never a guessed figure)."""
    if cfg.log.peak_tflops is not None:
        return float(cfg.log.peak_tflops) * 1e12
    import torch
    from pipeline.model import peak_tflops_of_device
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tflops = peak_tflops_of_device(name)
    if tflops is None:
        log.info("MFU not reported: no peak TFLOP/s known for device %r; set log.peak_tflops",
                 name)
        return None
    return tflops * 1e12


def peak_memory_bytes() -> int:
    """Peak memory of this process in bytes: CUDA max allocated on GPU, else peak RSS (CPU)."""
    import torch
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------

class TrainError(RuntimeError):
    """A user-facing problem found after start-up (HF folder does not fit the model, wandb
    cannot start); raised on every rank, reported as one line, exit code 2."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().strip("'\"")
    return text.splitlines()[0] if text else type(e).__name__


class Trainer:
    """One training run on this process (collective: every rank builds one).

    Args:
        cfg: a validated `RunConfig` DictConfig.
        plan: `pipeline.config.validate(cfg)`'s derived numbers.
    """

    def __init__(self, cfg, plan):
        self.cfg, self.plan = cfg, plan
        self.signal_received = 0
        self.run_lock = None          # pipeline.runlock.RunLock (rank 0)
        self.monitor = None           # pipeline.monitor.Monitor (metrics.jsonl, wandb), set up in setup()
        self.wandb_run_id: str | None = None
        self.step = 0                 # optimizer steps done
        self.consumed_samples = 0     # rows (packed sequences) consumed, global
        self.consumed_tokens = 0      # non-padding tokens consumed, global
        self._eval_pending = False    # a validation a stop signal deferred (should_evaluate)
        self._log_window: list[tuple[float, float, float]] = []  # losses since the last console line

    # -- set-up ---------------------------------------------------------------------------

    def _install_signals(self) -> None:
        """SIGTERM/SIGUSR1/SIGINT set a flag read at the end of each step (checkpoint, exit 0).
        After the first SIGINT, Python's default handler is back: a second Ctrl-C raises
        KeyboardInterrupt (`main`: one line, exit 130)."""
        def handler(signum, frame):
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            self.signal_received = signum
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, handler)

    def setup(self) -> None:
        """Process groups, seeds, model + init, DeepSpeed engine, loaders, resume, wandb."""
        import deepspeed
        import torch
        from omegaconf import OmegaConf
        from megatron.core import parallel_state
        from pipeline import checkpoint as ckpt
        from pipeline.model import ModelConfig, Qwen3
        from pipeline.objective import ObjectiveConfig
        from pipeline.parallel import MegatronMPU, init_distributed

        cfg, plan = self.cfg, self.plan
        self._install_signals()
        self.info = info = init_distributed(plan.tp_size)
        # deepspeed.comm wraps the existing default group (zero.Init reads ranks through it).
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   auto_mpi_discovery=False)
        self.is_rank0 = info.rank == 0
        _setup_logging(self.is_rank0)
        self.device = info.device
        _seed_everything(cfg.train.seed)
        self.objective_cfg = ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))
        self.mcfg = ModelConfig.from_dict(dict(plan.model_fields), source="model")
        self.ckdir = plan.checkpoint_dir
        os.makedirs(cfg.run_dir, exist_ok=True)
        self._lock_run_dir()

        # Resume decided before building: a resumed run does not need initial weights.
        latest = ckpt.find_latest(self.ckdir) if (cfg.checkpoint.resume and self.is_rank0) else None
        resuming = _broadcast_object(latest is not None)
        if resuming and cfg.checkpoint.reshard:  # another layout keeps the run's global batch
            plan_or_error = None
            if self.is_rank0:
                try:
                    plan_or_error = _plan_keeping_global_batch(plan, latest)
                except TrainError as e:
                    plan_or_error = str(e)
            plan_or_error = _broadcast_object(plan_or_error)
            if isinstance(plan_or_error, str):
                raise TrainError(plan_or_error)
            self.plan = plan = plan_or_error

        ds_config = deepspeed_config(cfg, plan)
        dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        mpu = MegatronMPU()
        zero3 = cfg.train.zero_stage == 3
        t0 = time.time()
        # dtype comes from ds_config's bf16 flag: zero.Init(dtype=...) with a config is ignored on
        # accelerators without fp16 (deepspeed 0.19: its fallback picks bf16 on CPU).
        with deepspeed.zero.Init(mpu=mpu, data_parallel_group=parallel_state.get_data_parallel_group(),
                                 config_dict_or_path=ds_config, enabled=zero3):
            model = Qwen3(self.mcfg, dtype=dtype, init_weights=False)
        got = {p.dtype for p in model.parameters()}
        if got != {dtype}:
            raise RuntimeError(f"parameters were built as {sorted(map(str, got))}, expected {dtype}")
        if not resuming:
            if cfg.init.source == "hf":
                from pipeline.hf_io import iter_tp_shard
                shards = iter_tp_shard(cfg.init.hf_path, self.mcfg, info.tp_rank, info.tp_size)
                try:
                    copy_into_model(model, shards, source=cfg.init.hf_path)
                except (KeyError, ValueError, OSError) as e:  # same files on every rank
                    raise TrainError(f"init.hf_path: {_first_line(e)}") from None
            else:
                copy_into_model(model, random_tp_shards(self.mcfg, cfg.train.seed, info.tp_rank,
                                                        info.tp_size), source="random init")
        log.info("model built and initialized (%s) in %.1f s", "resume" if resuming else
                 cfg.init.source, time.time() - t0)

        optimizer = None
        if cfg.optim.impl == "torch":
            decay, no_decay = [], []
            for n, p in model.named_parameters():
                (no_decay if n.endswith("norm.weight") else decay).append(p)
            groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
            optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr,
                                          betas=(cfg.optim.beta1, cfg.optim.beta2),
                                          eps=cfg.optim.eps)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=ds_config, mpu=mpu)

        self.train_loader = self._build_loader(cfg.data.train_split, train=True)

        if resuming:
            state = ckpt.load_latest(self.engine, self.ckdir, model_config=self.mcfg,
                                     reshard=bool(cfg.checkpoint.reshard))
            if state is None:
                raise RuntimeError(f"{self.ckdir}: the latest checkpoint vanished while resuming")
            self.step = int(state["step"])
            self.consumed_samples = int(state["consumed_samples"])
            self.consumed_tokens = int(state["consumed_tokens"])
            self.train_loader.load_state_dict(state["loader"],
                                              allow_reshard="resharded_from" in state)
            self.wandb_run_id = state.get("wandb_run_id")
            # a validation a stop signal deferred at this step, if this run still validates there
            self._eval_pending = bool(state.get("eval_pending", False)) and should_evaluate(
                self.step, cfg.train.eval_interval, False)
            log.info("resumed from %s at step %d", state["checkpoint_dir"], self.step)
        self._init_wandb()
        self.peak_flops = peak_flops_per_device(cfg)

    def _lock_run_dir(self) -> None:
        """One job per run directory (`pipeline.runlock`): rank 0 takes `<run_dir>/run.lock`;
        when a live job holds it, every rank raises TrainError (one line naming the holder)."""
        err = None
        if self.is_rank0:
            from pipeline.runlock import RunLock, RunLockError
            try:
                self.run_lock = RunLock(self.cfg.run_dir).acquire()
            except RunLockError as e:
                err = str(e)
            else:
                held = self.run_lock.took_over
                if held is not None:
                    log.warning("took over the run lock of %s (host %s, pid %s, SLURM job %s): %s",
                                self.cfg.run_dir, held.get("host"), held.get("pid"),
                                held.get("slurm_job_id"), held["reason"])
        err = _broadcast_object(err)
        if err:
            raise TrainError(err)

    def _build_loader(self, split: str, train: bool):
        """A `pipeline.data` loader of `split` for this data-parallel rank (the TP ranks of a DP
        group get identical batches). Training: shuffled, infinite; validation: manifest order,
        one pass (built afresh for every evaluation)."""
        d = self.cfg.data
        from pipeline.data import build_loader
        return build_loader(d.dir, split, self.plan.micro_batch_size, self.plan.row_length,
                            dp_rank=self.info.dp_rank, dp_size=self.info.dp_size,
                            seed=self.cfg.train.seed, num_workers=d.num_workers if train else 0,
                            objective_cfg=self.objective_cfg, pack=d.pack, packing=d.packing,
                            shuffle_buffer=d.shuffle_buffer, shuffle=train, infinite=train,
                            vocab_size=self.mcfg.vocab_size, verify_shards=d.verify_shards)

    def _init_wandb(self) -> None:
        """Start (or resume, same run id) the wandb run through `pipeline.monitor.Monitor`
        (rank 0); its failure is a TrainError on every rank (one line, exit 2)."""
        from omegaconf import OmegaConf
        from pipeline.monitor import Monitor
        cfg = self.cfg
        self.monitor = Monitor(cfg.run_dir, self.is_rank0, cfg.wandb,
                               OmegaConf.to_container(cfg, resolve=True))
        if cfg.wandb.mode == "disabled":
            return
        run_id, err = None, None
        if self.is_rank0:
            try:
                run_id = self.monitor.start_wandb(self.wandb_run_id, self.step)
            except RuntimeError as e:  # e.g. online mode without credentials or network
                err = _first_line(e)
        run_id, err = _broadcast_object((run_id, err))
        if err:
            raise TrainError(err)
        self.wandb_run_id = run_id

    # -- the loop -------------------------------------------------------------------------

    def _batch_to_device(self, batch: dict) -> dict:
        return {k: (v.to(self.device, non_blocking=True) if hasattr(v, "to") else v)
                for k, v in batch.items()}

    def _next_batch(self) -> dict:
        if not hasattr(self, "_train_iter"):
            self._train_iter = iter(self.train_loader)
        return next(self._train_iter)

    def train_step(self) -> tuple[dict, bool, bool]:
        """Run one optimizer step (GA micro-batches). Returns (metrics, nonfinite, signal)."""
        import torch
        import torch.distributed as dist
        from pipeline.model import segment_lengths, training_flops
        from pipeline.objective import hybrid_loss

        cfg, plan, eng = self.cfg, self.plan, self.engine
        step_no = self.step + 1
        t0 = time.perf_counter()
        per_micro: list = []          # detached [loss, ar, mdm] per micro-batch (on device)
        keys_of: list[list[str]] = []
        tokens = rows = 0
        model_flops = 0.0             # this rank's micro-batches, attention per packed segment
        for micro in range(plan.grad_accum_steps):
            batch = self._next_batch()
            keys_of.append(list(batch.get("keys", [])))
            b = self._batch_to_device(batch)
            tokens += int(batch["real_tokens"])
            rows += int(batch["input_ids"].shape[0])
            model_flops += training_flops(self.mcfg, segment_lengths(batch["segment_ids"]))
            hidden = eng(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"],
                         return_hidden=True)
            loss, stats = hybrid_loss(hidden, b, self.objective_cfg, head=eng.module.head_logits)
            if micro == 0 and self.info.rank == 0 and step_no in set(cfg.debug.nan_at_steps):
                loss = loss * float("nan")
            per_micro.append(torch.stack([loss.detach().float(), stats["ar_loss"].float(),
                                          stats["mdm_loss"].float()]))
            eng.backward(loss)
            if micro < plan.grad_accum_steps - 1:
                eng.step()
        vals = torch.stack(per_micro).double()                            # [GA, 3]
        finite = torch.isfinite(vals[:, 0])
        # one all-reduce over the world: [loss, ar, mdm sums over finite micro-batches,
        # real tokens, rows, non-finite micro-batches, signal flag, model FLOPs]
        sums = torch.cat([torch.where(finite[:, None], vals, torch.zeros_like(vals)).sum(0),
                          vals.new_tensor([tokens, rows, float((~finite).sum()),
                                           1.0 if self.signal_received else 0.0,
                                           model_flops])])
        dist.all_reduce(sums)
        sums = sums.cpu()
        bad = [(i, keys_of[i]) for i in range(len(keys_of)) if not bool(finite[i])]
        tp = plan.tp_size
        nonfinite = sums[5].item() > 0
        sig = sums[6].item() > 0
        for micro, keys in bad:
            print(f"pipeline.train: rank {self.info.rank}: non-finite loss at step {step_no}, "
                  f"micro-batch {micro}, batch keys {keys}", file=sys.stderr, flush=True)
        if nonfinite and cfg.train.nan_policy == "stop":
            return {"step": step_no}, True, sig

        lr = lr_at(self.step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps,
                   cfg.train.max_steps)
        for g in eng.optimizer.param_groups:
            g["lr"] = lr
        eng.step()
        applied = bool(eng.was_step_applied())
        if nonfinite and applied:
            raise RuntimeError(f"step {step_no}: the loss was non-finite but DeepSpeed applied the "
                               f"update; nan_policy=skip is not supported with this ZeRO stage")
        dt = time.perf_counter() - t0
        n_losses = (plan.dp_size * plan.grad_accum_steps) - sums[5].item() / tp
        tokens = int(round(sums[3].item() / tp))  # global: sum over DP ranks (TP ranks repeat)
        rows = int(round(sums[4].item() / tp))
        self.step = step_no
        self.consumed_samples += rows
        self.consumed_tokens += tokens
        flops = sums[7].item() / tp / dt / plan.world_size   # model FLOP/s per device
        gnorm = eng.get_global_grad_norm()
        metrics = {
            "kind": "train", "step": step_no,
            "loss": (sums[0].item() / tp / n_losses) if n_losses else float("nan"),
            "ar_loss": (sums[1].item() / tp / n_losses) if n_losses else float("nan"),
            "mdm_loss": (sums[2].item() / tp / n_losses) if n_losses else float("nan"),
            "lr": lr,
            "grad_norm": float(gnorm) if gnorm is not None and applied else None,
            "tokens_per_s": tokens / dt, "tflops_per_device": flops / 1e12,
            "mfu": (flops / self.peak_flops) if self.peak_flops else None,
            "peak_memory_bytes": peak_memory_bytes(),
            "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens,
            "step_time_s": dt, "skipped": not applied,
        }
        return metrics, nonfinite, sig

    def evaluate(self) -> dict:
        """Validation loss over up to `train.eval_batches` micro-batches per DP rank (0 = the
        whole split, every sample exactly once whatever the DP size: `pipeline.data` deals one
        order to the ranks). Loss, AR and MDM terms are weighted by tokens and segments over
        all ranks' batches (`pipeline.evaluate.loss_figures`), so the figure does not depend
        on the DP size or micro-batch size. Every rank runs the same number of forwards (ZeRO-3
        gathers weights collectively): a rank out of batches while another still has one
        evaluates an all-padding batch, which adds nothing."""
        import torch
        import torch.distributed as dist
        from pipeline.evaluate import loss_figures, loss_sums
        from pipeline.objective import collate, hybrid_loss
        eng, limit = self.engine, self.cfg.train.eval_batches
        eng.eval()
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        n = 0
        loader = self._build_loader(self.cfg.data.val_split, train=False)
        it = iter(loader)
        with torch.no_grad():
            while limit == 0 or n < limit:
                batch = next(it, None)
                have = torch.tensor([0.0 if batch is None else 1.0], device=self.device)
                dist.all_reduce(have, op=dist.ReduceOp.MAX)
                if have.item() == 0:
                    break
                if batch is None:
                    batch = collate([[] for _ in range(self.plan.micro_batch_size)],
                                    self.plan.row_length, loader.pad_id)
                b = self._batch_to_device(batch)
                hidden = eng(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"],
                             return_hidden=True)
                _, stats = hybrid_loss(hidden, b, self.objective_cfg,
                                       head=eng.module.head_logits)
                sums += loss_sums(stats)
                n += 1
        dist.all_reduce(sums)
        sums = (sums / self.plan.tp_size).cpu()  # the TP ranks of a DP group repeat its sums
        eng.train()
        figs = loss_figures(sums, self.objective_cfg)
        return {"kind": "val", "step": self.step, "val_loss": figs["val_loss"],
                "val_ar_loss": figs["val_ar_loss"], "val_mdm_loss": figs["val_mdm_loss"],
                "val_batches": n, "val_tokens": figs["val_tokens"]}

    def save(self) -> None:
        """Checkpoint now (collective) via `pipeline.checkpoint.save_checkpoint`."""
        from omegaconf import OmegaConf
        from pipeline.checkpoint import save_checkpoint
        state = {"step": self.step, "consumed_samples": self.consumed_samples,
                 "consumed_tokens": self.consumed_tokens,
                 "global_batch_size": self.plan.global_batch_size,
                 "loader": self.train_loader.state_dict(),
                 "config": OmegaConf.to_container(self.cfg, resolve=True),
                 "wandb_run_id": self.wandb_run_id,
                 "eval_pending": self._eval_pending}
        t0 = time.time()
        save_checkpoint(self.engine, self.ckdir, self.step, state,
                        keep_last=self.cfg.checkpoint.keep, model_config=self.mcfg)
        self._last_saved = self.step
        if self.is_rank0 and self.cfg.checkpoint.reshard:  # a conversion is stale now
            from pipeline.reshard import remove_conversions
            remove_conversions(self.ckdir)
        log.info("checkpoint step %d saved in %.1f s", self.step, time.time() - t0)

    def _record(self, metrics: dict) -> None:
        if not self.is_rank0:
            return
        metrics = dict(metrics, time_unix_s=time.time())
        self.monitor.append(metrics)   # metrics.jsonl; MonitorError on a full disk
        self.monitor.log(metrics)      # wandb; never raises (one warning line on failure)
        if metrics["kind"] == "train":
            # The console line shows losses averaged over the steps since the previous line
            # (Megatron-style; one step's MDM term is noisy); metrics.jsonl/wandb keep every step.
            window = self._log_window
            if not metrics["skipped"]:
                window.append((metrics["loss"], metrics["ar_loss"], metrics["mdm_loss"]))
            if metrics["step"] % self.cfg.train.log_interval == 0 or metrics["skipped"]:
                m = dict(metrics)
                if window:
                    n = len(window)
                    m["loss"], m["ar_loss"], m["mdm_loss"] = (sum(v[i] for v in window) / n
                                                              for i in range(3))
                    window.clear()
                mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
                gn = f"{m['grad_norm']:.3f}" if m["grad_norm"] is not None else "n/a"
                log.info("step %d/%d | loss %.4f | ar %.4f | mdm %.4f (means since last line) | lr %.3e | grad norm %s | "
                         "%.0f tokens/s | %.3f TFLOP/s/device | MFU %s | peak mem %.2f GiB | "
                         "samples %d | tokens %d%s", m["step"], self.cfg.train.max_steps, m["loss"],
                         m["ar_loss"], m["mdm_loss"], m["lr"], gn, m["tokens_per_s"],
                         m["tflops_per_device"], mfu, m["peak_memory_bytes"] / 2 ** 30,
                         m["consumed_samples"], m["consumed_tokens"],
                         " | SKIPPED (non-finite loss)" if m["skipped"] else "")
        else:
            log.info("validation at step %d: loss %s (%d micro-batches per DP rank)",
                     metrics["step"], metrics["val_loss"], metrics["val_batches"])

    def run(self) -> int:
        """Train to `train.max_steps`; returns the process exit code. A run resumed at (or past)
        `train.max_steps` logs one line and returns 0 without training or saving (unless a
        stop signal deferred that step's validation: it runs it and saves the step again)."""
        cfg = self.cfg
        self._last_saved = self.step
        interval = cfg.checkpoint.interval
        code = 0
        if self.step >= cfg.train.max_steps and not self._eval_pending:
            log.info("already at train.max_steps=%d (checkpoint step %d); nothing to do",
                     cfg.train.max_steps, self.step)
        try:
            if self._eval_pending:  # deferred by a stop signal at this step (should_evaluate)
                log.info("running the validation at step %d that the stop signal deferred",
                         self.step)
                self._record(self.evaluate())
                self._eval_pending = False
                if self.step >= cfg.train.max_steps:
                    self.save()  # the final checkpoint again, without the flag
            while self.step < cfg.train.max_steps:
                metrics, nonfinite, sig = self.train_step()
                if nonfinite and cfg.train.nan_policy == "stop":
                    if self.is_rank0:
                        print(f"pipeline.train: error: non-finite loss at step {metrics['step']}; "
                              f"stopping (train.nan_policy=stop, no checkpoint written; latest "
                              f"good checkpoint in {self.ckdir})", file=sys.stderr, flush=True)
                    code = EXIT_NONFINITE
                    break
                self._record(metrics)
                if should_evaluate(self.step, cfg.train.eval_interval, sig):
                    self._record(self.evaluate())
                if sig:
                    self._eval_pending = should_evaluate(self.step, cfg.train.eval_interval, False)
                    name = (signal.Signals(self.signal_received).name if self.signal_received
                            else "on another rank")
                    log.info("signal received (%s): checkpointing at step %d and exiting", name,
                             self.step)
                    self.save()
                    break
                if interval and self.step % interval == 0:
                    self.save()
            else:
                if self._last_saved != self.step:
                    self.save()
        except BaseException:
            code = 1
            raise
        finally:
            it = getattr(self, "_train_iter", None)
            if it is not None:  # stops the loader workers now (pipeline.data: sentinel, join)
                it.close()
            if getattr(self, "monitor", None) is not None:
                self.monitor.finish(code)   # never raises
        return code


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def _plan_keeping_global_batch(plan, step_dir):
    """The plan for resuming `step_dir` on this layout with `checkpoint.reshard`: when the
    checkpoint was saved on another layout with another global batch, keep the saved global
    batch and recompute gradient accumulation (global = micro-batch x accumulation x DP).

    Raises:
        TrainError: the saved global batch is not a multiple of micro-batch x DP size here.
    """
    import dataclasses
    import json
    from pathlib import Path

    from pipeline.reshard import saved_global_batch
    meta = json.loads((Path(step_dir) / "refusion_meta.json").read_text())
    if (meta["world_size"], meta["tp_size"]) == (plan.world_size, plan.tp_size):
        return plan
    gbs = saved_global_batch(step_dir)
    if gbs is None or gbs == plan.global_batch_size:
        return plan
    per = plan.micro_batch_size * plan.dp_size
    if gbs % per:
        raise TrainError(f"checkpoint.reshard: the run's global batch {gbs} cannot be formed "
                         f"with train.micro_batch_size={plan.micro_batch_size} on data-parallel "
                         f"size {plan.dp_size} (global batch = micro-batch x grad accumulation x "
                         f"DP); pick a micro-batch size with {gbs} a multiple of it x {plan.dp_size}")
    log.info("checkpoint.reshard: keeping the run's global batch %d (was %d on this layout): "
             "gradient accumulation %d -> %d", gbs, plan.global_batch_size,
             plan.grad_accum_steps, gbs // per)
    return dataclasses.replace(plan, grad_accum_steps=gbs // per, global_batch_size=gbs)


def _seed_everything(seed: int) -> None:
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def _broadcast_object(obj):
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _setup_logging(rank0: bool) -> None:
    """Our INFO lines on rank 0's stdout; other ranks print warnings only. DeepSpeed's logger is
    turned down to warnings (its per-step chatter), and torch 2.13's FutureWarnings about the
    collectives DeepSpeed 0.19 calls (`reduce_scatter_tensor`, `all_gather_into_tensor`) are
    ignored: they are not ours to act on and come back once per ZeRO bucket (hundreds of lines
    per step at 8B)."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
    logger = logging.getLogger("pipeline")
    logger.handlers.clear()
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO if rank0 else logging.WARNING)
    logger.propagate = False
    try:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
    except Exception:
        pass


def _launcher_env() -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK from srun's SLURM_* variables (or a single process)
    when no torchrun set them; DeepSpeed reads LOCAL_RANK."""
    for ours, slurm, default in (("RANK", "SLURM_PROCID", "0"), ("WORLD_SIZE", "SLURM_NTASKS", "1"),
                                 ("LOCAL_RANK", "SLURM_LOCALID", "0")):
        if ours not in os.environ:
            os.environ[ours] = os.environ.get(slurm, default)
    if (os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" not in os.environ
            and "SLURM_PROCID" not in os.environ):
        # a bare single process: a free port, so two such runs on one host do not collide
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")
                          if "SLURM_PROCID" in os.environ else os.environ["WORLD_SIZE"])


_ERROR_KEY = "pipeline_train_error"


def _default_store():
    """The process group's key-value store (torchrun's agent store or rank 0's TCPStore), or
    None before the process group exists. Store calls need no other rank's participation."""
    try:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() > 1:
            return dist.distributed_c10d._get_default_store()
    except Exception:
        pass
    return None


def _agent_store():
    """A client of torchrun's agent store (torchrun / pipeline.launch set
    TORCHELASTIC_USE_AGENT_STORE and point MASTER_ADDR/MASTER_PORT at it), usable before the
    process group exists; None elsewhere or when it cannot be reached in 10 s."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
            or os.environ.get("WORLD_SIZE", "1") == "1"):
        return None
    try:
        import datetime
        from torch.distributed import TCPStore
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=datetime.timedelta(seconds=10))
    except Exception:
        return None


def _report_error(code: int, line: str, store=None) -> int:
    """Print a user-facing error line once for the whole job, whichever rank raised it: the
    first rank to report it through the store prints (a rank-only error is not lost behind
    rank 0's silence), the others stay quiet. Without a store (one process, or the store is
    gone) the line is printed. Returns `code`."""
    store, first = store if store is not None else _default_store(), True
    if store is not None:
        try:
            store.set(_ERROR_KEY + "_code", str(code))
            first = store.add(_ERROR_KEY, 1) == 1
        except Exception:
            first = True
    if first:
        rank = os.environ.get("RANK", "0")
        print(line if rank == "0" else f"{line} (rank {rank})", file=sys.stderr, flush=True)
    return code


def _reported_error_code() -> int | None:
    """The exit code another rank reported through `_report_error`, or None."""
    store = _default_store()
    if store is None:
        return None
    try:
        if store.check([_ERROR_KEY + "_code"]):
            return int(store.get(_ERROR_KEY + "_code").decode())
    except Exception:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse `--config PATH [key=value ...]`, validate, train. Returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m pipeline.train",
                                 description="Train a ReFusion model (DeepSpeed ZeRO + TP).")
    ap.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="omegaconf overrides, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    from pipeline.config import ConfigError, load_config, validate
    rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    try:
        cfg = load_config(args.config, args.overrides)
        plan = validate(cfg)
    except ConfigError as e:
        # Before any process group: under torchrun / pipeline.launch the agent's store dedupes
        # (so a config error only one rank sees is still printed, once); otherwise rank 0 prints.
        store = _agent_store()
        if store is not None:
            _report_error(EXIT_CONFIG, f"pipeline.train: config error: {e}", store)
        elif rank0:
            print(f"pipeline.train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _launcher_env()
    from pipeline.checkpoint import CheckpointError, CheckpointWriteError
    from pipeline.data import DataError
    from pipeline.monitor import MonitorError
    from pipeline.parallel import RendezvousError
    trainer = Trainer(cfg, plan)
    try:
        trainer.setup()
        code = trainer.run()
    except (TrainError, CheckpointError, DataError, RendezvousError) as e:  # user errors at run time
        code = _report_error(EXIT_CONFIG, f"pipeline.train: error: {_first_line(e)}")
    except (CheckpointWriteError, MonitorError) as e:  # disk full, quota, other write errors
        code = _report_error(EXIT_WRITE, f"pipeline.train: error: {_first_line(e)}")
    except KeyboardInterrupt:  # a second Ctrl-C (the first one checkpoints; see _install_signals)
        print(f"pipeline.train: rank {os.environ.get('RANK', '0')}: interrupted; no checkpoint "
              f"written for the current step", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except Exception:
        # A rank whose peer stopped on a reported error fails in its next collective (gloo:
        # "Connection closed by peer"); that rank's one line is the story, not this traceback.
        peer = _reported_error_code()
        if peer is None:
            raise
        code = peer
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
        from pipeline.parallel import destroy_distributed
        try:
            destroy_distributed()
        except Exception:
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
