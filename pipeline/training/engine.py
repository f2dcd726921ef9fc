"""Building the DeepSpeed engine of a run: the DeepSpeed config, ZeRO communication sizes,
the model under `zero.Init`, its initial weights, the optimizer and its parameter groups (the
learning-rate schedule the trainer applies each step is `pipeline.training.schedule`).

Owns: `deepspeed_config`, `zero_sizes`, `param_groups`, `make_torch_adamw`,
`initial_weights`, `build_engine` (which also applies the model-side levers that must precede
`deepspeed.initialize`: regional `torch.compile`). Must not touch: the loop, checkpoints, data, logging.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Iterator

import torch

log = logging.getLogger("pipeline.train")


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


def deepspeed_config(cfg, plan) -> dict:
    """The DeepSpeed config dict for a validated run config.

    `train_batch_size = micro-batch x GA x data-parallel size` (DeepSpeed checks it against the
    `mpu`'s data-parallel size). The lr is set by the trainer every step
    (`pipeline.training.schedule`), so no DeepSpeed scheduler. With `optim.impl=torch` the client `torch.optim.AdamW` is used
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
    cuda = torch.cuda.is_available()
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: every weight decays by `weight_decay` except norm weights
    (`*norm.weight`), which decay by 0 (as Megatron and torchtitan do)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("norm.weight") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_torch_adamw(groups, lr: float, betas: tuple[float, float], eps: float,
                     fused: bool = False) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `groups` (`param_groups`). `fused=True` is `optim.fused`: torch's
    fused AdamW kernel (the whole update of all parameters in a few kernels instead of
    torch's default multi-tensor "foreach" loop; CUDA, and the CPU in torch >= 2.4), with the
    same arithmetic (tests/test_levers.py: equal to fp32 rounding).

    Raises:
        TrainError: `fused` on a device type torch has no fused AdamW for (one line naming
            `optim.fused`; the trainer reports it and exits 2).
    """
    if not fused:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    devices = {p.device.type for g in groups for p in g["params"]}
    unsupported = sorted(devices - set(_get_fused_kernels_supported_devices()))
    if unsupported:
        from pipeline.training.state import TrainError
        raise TrainError(f"optim.fused: torch {torch.__version__} has no fused AdamW on "
                         f"{', '.join(unsupported)}; set optim.fused=false")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def initial_weights(cfg, mcfg, tp_rank: int, tp_size: int
                    ) -> tuple[Iterator[tuple[str, torch.Tensor]], str]:
    """This TP rank's initial parameters and a name for messages: the Hugging Face folder of
    `init.hf_path` (`init.source=hf`, only this rank's slices read) or the seeded random
    network of `train.seed` (`init.source=random`, the same network on every layout)."""
    if cfg.init.source == "hf":
        from pipeline.model.hf import iter_tp_shard
        return iter_tp_shard(cfg.init.hf_path, mcfg, tp_rank, tp_size), str(cfg.init.hf_path)
    from pipeline.model.init import random_tp_shards
    return random_tp_shards(mcfg, cfg.train.seed, tp_rank, tp_size), "random init"


def build_engine(cfg, plan, mcfg, init: Iterable[tuple[str, torch.Tensor]] | None,
                 init_source: str = ""):
    """The model built under `deepspeed.zero.Init` (ZeRO-3 partitions it over the data-parallel
    group as it is built), `init` copied in (`pipeline.model.weights.copy_into_model`; None
    when a checkpoint will be loaded), the optimizer, and `deepspeed.initialize` with the
    megatron-core `mpu` (so DeepSpeed reduces over the data-parallel group only).

    Returns:
        the `deepspeed.DeepSpeedEngine`.
    Raises:
        KeyError / ValueError / OSError: from `init` (a missing tensor, a shape that does not
            fit, an unreadable file; messages name `init_source`).
        RuntimeError: the parameters were not built in the run's precision.
    """
    import deepspeed
    from megatron.core import parallel_state

    from pipeline.model import Qwen3
    from pipeline.model.weights import copy_into_model
    from pipeline.parallel import MegatronMPU

    ds_config = deepspeed_config(cfg, plan)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    mpu = MegatronMPU()
    t0 = time.time()
    # dtype comes from ds_config's bf16 flag: zero.Init(dtype=...) with a config is ignored on
    # accelerators without fp16 (deepspeed 0.19: its fallback picks bf16 on CPU).
    with deepspeed.zero.Init(mpu=mpu, data_parallel_group=parallel_state.get_data_parallel_group(),
                             config_dict_or_path=ds_config, enabled=cfg.train.zero_stage == 3):
        model = Qwen3(mcfg, dtype=dtype, init_weights=False)
    got = {p.dtype for p in model.parameters()}
    if got != {dtype}:
        raise RuntimeError(f"parameters were built as {sorted(map(str, got))}, expected {dtype}")
    if init is not None:
        copy_into_model(model, init, source=init_source)
    log.info("model built and initialized (%s) in %.1f s", init_source or "resume",
             time.time() - t0)
    if cfg.train.compile:
        model.compile_layers()
        log.info("decoder blocks compiled with torch.compile (train.compile; the first steps "
                 "include the compilation)")
    optimizer = None
    if cfg.optim.impl == "torch":
        optimizer = make_torch_adamw(param_groups(model, cfg.optim.weight_decay),
                                     lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                     eps=cfg.optim.eps, fused=bool(cfg.optim.fused))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           mpu=mpu)
    return engine
