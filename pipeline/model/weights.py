"""Putting tensors into a model: the one copy-into-model helper and the meta-device build.

Owns: `copy_into_model` (named tensors into parameters with a shape check, ZeRO-3 partitioned
parameters gathered and re-partitioned) and `empty_model` (a model allocated directly on its
device and dtype, weights uninitialized). Every loader goes through them: Hugging Face folders
(`pipeline.model.hf.load_hf_into_model`), seeded initialisation (`pipeline.model.init`),
checkpoints for inference (`pipeline.inference.loading`) and the trainer's initial weights.
Must not touch: where tensors come from (files, generators), names' meaning
(`pipeline.model.tp`).
"""
from __future__ import annotations

from typing import Iterable

import torch


def copy_into_model(model: torch.nn.Module, pairs: Iterable[tuple[str, torch.Tensor]],
                    source: str) -> None:
    """Copy `(native_name, tensor)` pairs into `model`'s parameters in place, cast to each
    parameter's dtype and moved to its device on the copy, one tensor at a time.

    A ZeRO-3 partitioned parameter (DeepSpeed's `ds_id` attribute) is gathered with
    `deepspeed.zero.GatheredParameters(modifier_rank=0)`, written and re-partitioned (DP rank
    0's value is broadcast: every rank must pass the same tensors); its expected shape is the
    unpartitioned `ds_shape`.

    Args:
        pairs: names as `model.named_parameters()` gives them, each tensor at that
            parameter's (per-TP-rank) shape; every parameter exactly once.
        source: what the tensors come from, for messages (a folder, "random init", ...).
    Raises:
        KeyError: a name the model does not have, or parameters left without a value (names
            `source` and up to five of them).
        ValueError: a tensor whose shape differs from its parameter's (names both shapes).
    """
    params = dict(model.named_parameters())
    seen = set()
    for name, t in pairs:
        if name not in params:
            raise KeyError(f"{source}: model has no parameter {name}")
        p = params[name]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if tuple(t.shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, model expects {shape}")
        if hasattr(p, "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                p.data.copy_(t.to(device=p.device, dtype=p.dtype))
        else:
            with torch.no_grad():
                p.copy_(t.to(device=p.device, dtype=p.dtype))
        seen.add(name)
        del t
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"{source}: no value for parameters {missing[:5]}")


def empty_model(cls, cfg, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """`cls(cfg, dtype=dtype, init_weights=False)` with uninitialized parameters allocated
    directly on `device`: built on the meta device, then materialized in place (parameter
    objects kept, so a tied embedding/head stays one tensor; megatron-core's tensor-parallel
    attributes restored with `_mark_tensor_parallel`). Needs megatron-core's parallel state
    (`pipeline.parallel`)."""
    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, init_weights=False)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    if hasattr(model, "_mark_tensor_parallel"):
        model._mark_tensor_parallel()
    return model
