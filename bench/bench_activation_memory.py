"""Saved activations of one decoder block per token, by activation-checkpointing mode.

Builds one block of a model preset (default: Qwen3-8B's shape) in bf16 on the CPU, runs its
forward on `--tokens` tokens with the gradient on, and reports the bytes still allocated after
the forward (allocations minus frees that `torch.profiler` records during it), less the block's
output: what the block keeps for its backward, per token. The block's input (the residual
stream, `2 x hidden_size` bytes per token in bf16) is allocated before and not counted; "full"
keeps only that. The attention is plain causal SDPA with GQA done natively, which keeps what the
GPU kernels (flash / varlen) keep: q, k, v, the output and the log-sum-exp.

    python bench/bench_activation_memory.py [--model-config configs/model/qwen3_8b.yaml]
        [--tokens 256] [--layers 16] [--rows-tokens 8192]

It also prints the total over `--layers` blocks for `--rows-tokens` tokens per micro-batch
(the 16-layer GPU proxy at 2 x 4096 by default), block inputs included. Figures in bytes.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default=str(ROOT / "configs/model/qwen3_8b.yaml"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows-tokens", type=int, default=8192)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from pipeline.parallel import free_port, init_distributed
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed(1, backend="gloo")
    from pipeline.model import ModelConfig
    from pipeline.model.attention import AttentionPlan
    from pipeline.model.qwen3 import Block, _megatron_config, rope_cos_sin
    cfg = ModelConfig.from_yaml(args.model_config)
    dtype = torch.bfloat16
    init = partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    block = Block(cfg, _megatron_config(dtype, True), init, init).train()
    T = args.tokens
    x0 = torch.randn(1, T, cfg.hidden_size, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta, dtype)
    plan = AttentionPlan("causal")
    h_in = 2 * cfg.hidden_size          # the block input, bf16, per token
    print(f"{Path(args.model_config).name}: one block, {T} tokens, bf16, CPU")
    for mode in ("none", "selective", "full"):
        gc.collect()
        x = x0.clone().requires_grad_(True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if mode == "full":
                y = torch.utils.checkpoint.checkpoint(block, x, cos, sin, plan,
                                                      use_reentrant=False)
            else:
                y = block(x, cos, sin, plan, None, mode == "selective")
        net = sum(e.self_cpu_memory_usage for e in prof.key_averages())
        kept = (net - y.numel() * y.element_size()) / T
        total = (kept + h_in) * args.layers * args.rows_tokens
        print(f"{mode:<10} {kept:>10,.0f} bytes/token/layer kept for backward "
              f"({kept / cfg.hidden_size:.1f} x hidden_size); {args.layers} layers x "
              f"{args.rows_tokens} tokens, block inputs included: {total / 2 ** 30:.1f} GiB")
        y.float().sum().backward()
        del x, y
    return 0


if __name__ == "__main__":
    sys.exit(main())
