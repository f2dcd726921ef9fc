"""Seeded random initialisation of a Qwen3 model, the same network whatever the layout.

Owns: the init rule of every Hugging Face tensor (`random_hf_tensor`) and `random_tp_shards`,
which cuts those tensors for one tensor-parallel rank exactly as a Hugging Face checkpoint is
cut (`pipeline.model.hf.iter_tp_shard` over `pipeline.model.tp`'s table), so a TP=2 run starts
from the same network as a TP=1 run. Must not touch: copying into parameters
(`pipeline.model.weights.copy_into_model`), optimizers.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator

import torch

from pipeline.model.config import ModelConfig
from pipeline.model.hf import LazyTensor, TensorSource, iter_tp_shard
from pipeline.model.tp import hf_shapes


def _name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (run seed, tensor name), stable across processes."""
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2 ** 63 - 1)


def random_hf_tensor(name: str, shape: tuple[int, ...], mcfg: ModelConfig,
                     seed: int) -> torch.Tensor:
    """Seeded random init of one full Hugging Face tensor (the same on every rank and layout).

    Norm weights (`*norm.weight`) are ones; `o_proj` / `down_proj` are N(0, (std/sqrt(2L))^2)
    (GPT-2's scaled residual init, as `pipeline.model.qwen3` does); every other matrix and the
    embedding is N(0, std^2) with std = `mcfg.init_std`. Values come from a torch.Generator
    seeded by `(seed, name)`, so they do not depend on the tensor-parallel or data-parallel
    layout.

    Returns:
        FloatTensor[shape] (fp32).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = mcfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = std / math.sqrt(2.0 * mcfg.num_layers)
    g = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def random_tp_shards(mcfg: ModelConfig, seed: int, tp_rank: int, tp_size: int
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(native_name, tensor)` of a seeded random model for this TP rank (fp32).

    Each Hugging Face tensor is drawn in full by `random_hf_tensor` and cut exactly as a
    checkpoint is (`iter_tp_shard`: split into `tp_size` contiguous blocks along the split dim,
    fused sources concatenated). Peak extra memory: one full Hugging Face tensor (fp32).
    """
    def lazy(name, shape):
        return LazyTensor(shape, torch.float32,
                          lambda dtype=None: random_hf_tensor(name, shape, mcfg, seed))

    src = TensorSource({n: lazy(n, s) for n, s in hf_shapes(mcfg).items()})
    yield from iter_tp_shard(src, mcfg, tp_rank, tp_size)
