"""Cost of the objective: reorganization per sample (numpy, in loader workers) and the hybrid
loss versus a plain cross-entropy on the same logits (CPU, single process).

Figures:
- reorganize_sample: milliseconds per sample and samples/s for samples of L tokens (one
  segment, prompt L/8, slot size drawn from {4, 8, 16, 32}), i.e. one loader worker's ceiling;
- hybrid_loss forward + backward vs `F.cross_entropy` forward + backward on identical
  FloatTensor[B, T, V] logits, milliseconds each (the extra is the masking and the two terms).
- `--dual T1,T2,...` (only this part): objective mode "dual" micro-batches of `--batch` rows
  x T tokens (packed random samples, every slot copied), the attention pattern shipped as the
  dense numpy `[B, 1, T, T]` mask the loader built before ("before") against the per-token
  `copy_id` / `clean_limit` the model turns into the mask on the device ("after"), in one
  process, alternating: host bytes per micro-batch (sum of the batch tensors' nbytes), the
  collate's peak of Python-heap allocations (tracemalloc: numpy temporaries included), collate
  milliseconds, and the training micro-batch's milliseconds, wall and CPU time of this thread
  (a small Qwen3, fp32, SDPA: forward, chunked `hybrid_loss`, backward), as medians and
  after / before ratios.

    .venv/bin/python bench/bench_objective.py [--length 4096] [--samples 200] [--vocab 32768]
    .venv/bin/python bench/bench_objective.py --dual 1024,4096 [--batch 4] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pipeline.objective import ObjectiveConfig, collate, hybrid_loss, reorganize_sample  # noqa: E402
from test_objective_dual import dense_dual_mask  # noqa: E402  (the mask the loader shipped before)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096, help="tokens per sample (L)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--batch", type=int, default=2, help="rows for the loss timing (B)")
    ap.add_argument("--seq", type=int, default=1024, help="row length for the loss timing (T)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab for the loss timing (V)")
    ap.add_argument("--dual", default="", help="comma list of row lengths: the dual-mask A/B only")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the dual A/B")
    args = ap.parse_args()
    if args.dual:
        return dual_mask_ab([int(t) for t in args.dual.split(",")], args.batch, args.reps)
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


def collate_before(rows, T, pad_id):
    """The collate of before: the dense mask instead of the two per-token vectors."""
    out = collate(rows, T, pad_id)
    cid, lim = out.pop("copy_id"), out.pop("clean_limit")
    out["attention_mask"] = torch.from_numpy(dense_dual_mask(
        out["segment_ids"].numpy(), out["position_ids"].numpy(), cid.numpy(), lim.numpy()))
    return out


def dual_mask_ab(lengths, B, reps) -> int:
    import os
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.parallel import free_port, init_distributed
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed(1, backend="gloo")   # megatron's parallel_state (TP size 1)
    torch.set_num_threads(1)
    cfg = ObjectiveConfig(mode="dual")
    print(f"dual mask A/B, {B} rows, one torch thread, median of {reps} alternating repetitions")
    for T in lengths:
        mcfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=T, attention="sdpa")
        torch.manual_seed(0)
        model = Qwen3(mcfg, dtype=torch.float32).train()
        rng = np.random.default_rng(T)
        rows = []
        for b in range(B):            # next-fit: samples of T/8..T/3 clean tokens + their copies
            row, used = [], 0
            while True:
                L = int(rng.integers(T // 8, T // 3))
                P, k = L // 8, int(rng.choice([4, 8, 16, 32]))
                x = rng.integers(5, 512, size=L).astype(np.uint32)
                r = reorganize_sample(x, [{"start": 0, "end": L, "prompt_length": P,
                                           "slot_starts": list(range(P, L, k))}],
                                      f"r{b}_{len(row)}", seed=0, epoch=0, mask_id=2, cfg=cfg,
                                      max_length=T)
                if used + r.length > T:
                    break
                row.append(r)
                used += r.length
            rows.append(row)

        def step(batch):
            kw = ({"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else
                  {"copy_id": batch["copy_id"], "clean_limit": batch["clean_limit"]})
            hidden = model(batch["input_ids"], batch["position_ids"],
                           segment_ids=batch["segment_ids"], return_hidden=True, **kw)
            loss, _ = hybrid_loss(hidden, batch, cfg, head=model.head_logits)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return float(loss.detach())

        fig = {s: {"bytes": 0, "peak": 0, "collate": [], "step": [], "step_cpu": []}
               for s in ("before", "after")}
        losses = {}
        for i in range(reps):
            for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                fn = collate_before if side == "before" else collate
                tracemalloc.start()
                t0 = time.perf_counter()
                batch = fn(rows, T, 0)
                dt = time.perf_counter() - t0
                fig[side]["peak"] = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                fig[side]["collate"].append(dt)
                fig[side]["bytes"] = sum(v.nbytes for v in batch.values()
                                         if isinstance(v, torch.Tensor))
                t0, c0 = time.perf_counter(), time.thread_time()
                losses[side] = step(batch)
                fig[side]["step"].append(time.perf_counter() - t0)
                fig[side]["step_cpu"].append(time.thread_time() - c0)
        bf, af = fig["before"], fig["after"]
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        print(f"T={T}: real tokens {int(batch['real_tokens'])} of {B * T}, copy tokens "
              f"{int(batch['copy_tokens'])}; loss before {losses['before']:.6f}, after "
              f"{losses['after']:.6f}")
        print(f"  host bytes per micro-batch: before {bf['bytes'] / 2**20:.2f} MiB, after "
              f"{af['bytes'] / 2**20:.2f} MiB (after / before = {af['bytes'] / bf['bytes']:.4f})")
        print(f"  collate peak heap (tracemalloc): before {bf['peak'] / 2**20:.1f} MiB, after "
              f"{af['peak'] / 2**20:.1f} MiB")
        print(f"  collate: before {med(bf['collate']):.1f} ms, after {med(af['collate']):.1f} ms "
              f"(after / before = {med(af['collate']) / med(bf['collate']):.3f})")
        for k, what in (("step", "wall"), ("step_cpu", "CPU time of this thread")):
            print(f"  training micro-batch (fwd + chunked loss + bwd), {what}: before "
                  f"{med(bf[k]):.0f} ms, after {med(af[k]):.0f} ms (after / before = "
                  f"{med(af[k]) / med(bf[k]):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
