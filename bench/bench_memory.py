"""Peak memory of one training step (forward, loss, backward): full logits vs the chunked head.

- before: `Qwen3.forward` returns the vocab-parallel logits `[B, T, V]` of every position and
  `hybrid_loss(logits, batch)` takes their fp32 copy (the trainer's path until 2026-11);
- after: `Qwen3.forward(..., return_hidden=True)` and `hybrid_loss(hidden, batch,
  head=model.head_logits)`: the output layer runs only on labelled positions, `--chunk` tokens
  at a time, each chunk recomputed in backward (`pipeline.objective.labelled_cross_entropy`).

Each arm runs in a fresh process (TP=1, gloo, same seed, same batch: packed ReFusion samples
with a prompt of 1/8, so about 7/8 of the positions carry a label). On CUDA the figure is
`torch.cuda.max_memory_allocated()` above the allocation before the step; on CPU it is the
peak resident set size (`ru_maxrss`) above the resident size before the step, so pick a
model whose logits dominate (big vocab, long rows; the defaults: 2 x 2048 tokens x 49152 vocab,
bf16). Prints both peaks in MiB, the loss of each arm (they must agree), and after/before as a
ratio from one run (this machine is shared: read the ratio, not the absolute figures).

    .venv/bin/python bench/bench_memory.py [--vocab 49152] [--rows 2] [--row-length 2048]
        [--hidden 256] [--layers 2] [--dtype bf16|fp32] [--chunk TOKENS] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _arm(args) -> dict:
    """One arm in this process: build, one step, return {peak_bytes, loss}."""
    import numpy as np
    import torch
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.objective import ObjectiveConfig, collate, hybrid_loss, reorganize_sample
    from pipeline.parallel import init_distributed

    init_distributed(tensor_parallel_size=1, backend="gloo")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=2 * args.hidden, num_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=heads, head_dim=64,
                      attention="sdpa")
    model = Qwen3(cfg, dtype=dtype).to(dev).train()
    rng = np.random.default_rng(0)
    T = args.row_length
    rows = []
    for b in range(args.rows):
        x = rng.integers(3, args.vocab, size=T).astype(np.uint32)
        segs = [{"start": 0, "end": T, "prompt_length": T // 8,
                 "slot_starts": list(range(T // 8, T, 8))}]
        rows.append([reorganize_sample(x, segs, f"r{b}", seed=0, epoch=0, mask_id=2,
                                       cfg=ObjectiveConfig())])
    batch = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in collate(rows, T, 0).items()}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    args_in = (batch["input_ids"], batch["position_ids"])
    if args.arm == "before":
        logits = model(*args_in, segment_ids=batch["segment_ids"])
        loss, _ = hybrid_loss(logits, batch)
    else:
        hidden = model(*args_in, segment_ids=batch["segment_ids"], return_hidden=True)
        loss, _ = hybrid_loss(hidden, batch, head=model.head_logits, chunk_tokens=args.chunk)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_bytes": int(peak), "loss": float(loss.detach())}


def main() -> int:
    from pipeline.objective import LOSS_CHUNK_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, default=2, help="micro-batch rows (B)")
    ap.add_argument("--row-length", type=int, default=2048, help="tokens per row (T)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--chunk", type=int, default=LOSS_CHUNK_TOKENS, help="tokens per chunk")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arm", choices=("before", "after"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(_arm(args)))
        return 0
    out = {}
    for arm in ("before", "after"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        cmd = [sys.executable, __file__, "--arm", arm] + sys.argv[1:]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            print(f"bench_memory: arm {arm} failed:\n{res.stderr[-2000:]}", file=sys.stderr)
            return 1
        out[arm] = json.loads(res.stdout.strip().splitlines()[-1])
    b, a = out["before"], out["after"]
    print(f"B={args.rows} T={args.row_length} V={args.vocab} hidden={args.hidden} "
          f"layers={args.layers} {args.dtype} on {args.device}; chunk {args.chunk} tokens")
    print(f"before (full logits):   peak {b['peak_bytes'] / 2 ** 20:8.1f} MiB above the "
          f"pre-step baseline, loss {b['loss']:.6f}")
    print(f"after (chunked head):   peak {a['peak_bytes'] / 2 ** 20:8.1f} MiB above the "
          f"pre-step baseline, loss {a['loss']:.6f}")
    print(f"after / before peak: {a['peak_bytes'] / max(1, b['peak_bytes']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
