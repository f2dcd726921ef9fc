"""Cost of the objective: reorganization per sample (numpy, in loader workers) and the hybrid
loss versus a plain cross-entropy on the same logits (CPU, single process).

Figures:
- reorganize_sample: milliseconds per sample and samples/s for samples of L tokens (one
  segment, prompt L/8, slot size drawn from {4, 8, 16, 32}), i.e. one loader worker's ceiling;
- hybrid_loss forward + backward vs `F.cross_entropy` forward + backward on identical
  FloatTensor[B, T, V] logits, milliseconds each (the extra is the masking and the two terms).

    .venv/bin/python bench/bench_objective.py [--length 4096] [--samples 200] [--vocab 32768]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.objective import ObjectiveConfig, collate, hybrid_loss, reorganize_sample  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096, help="tokens per sample (L)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--batch", type=int, default=2, help="rows for the loss timing (B)")
    ap.add_argument("--seq", type=int, default=1024, help="row length for the loss timing (T)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab for the loss timing (V)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    L = args.length
    samples = []
    for _ in range(args.samples):
        P, k = L // 8, int(rng.choice([4, 8, 16, 32]))
        samples.append((rng.integers(3, 150000, size=L).astype(np.uint32),
                        [{"start": 0, "end": L, "prompt_length": P, "slot_starts": list(range(P, L, k))}]))
    cfg = ObjectiveConfig()
    t0 = time.perf_counter()
    for i, (x, segs) in enumerate(samples):
        reorganize_sample(x, segs, f"k{i}", seed=0, epoch=0, mask_id=2, cfg=cfg)
    dt = (time.perf_counter() - t0) / len(samples)
    print(f"reorganize_sample, L={L}: {dt * 1e3:.2f} ms/sample = {1 / dt:,.0f} samples/s "
          f"= {L / dt:,.0f} tokens/s per worker")

    B, T, V = args.batch, args.seq, args.vocab
    rows = []
    for b in range(B):
        x = rng.integers(3, V, size=T).astype(np.uint32)
        segs = [{"start": 0, "end": T, "prompt_length": T // 8, "slot_starts": list(range(T // 8, T, 8))}]
        rows.append([reorganize_sample(x, segs, f"r{b}", seed=0, epoch=0, mask_id=2, cfg=cfg)])
    batch = collate(rows, T, 0)
    base = torch.randn(B, T, V)

    def timed(fn, reps=5):
        best = float("inf")
        for _ in range(reps):
            logits = base.clone().requires_grad_(True)
            t = time.perf_counter()
            fn(logits).backward()
            best = min(best, time.perf_counter() - t)
        return best

    t_h = timed(lambda lg: hybrid_loss(lg, batch)[0])
    t_ce = timed(lambda lg: F.cross_entropy(lg.view(-1, V), batch["labels"].view(-1)))
    print(f"loss fwd+bwd, B={B} T={T} V={V}: hybrid_loss {t_h * 1e3:.1f} ms, "
          f"plain cross_entropy {t_ce * 1e3:.1f} ms (best of 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
