"""Training-step throughput: our layout vs the reference code's, same model, same real data.

Prints, for each arm, optimizer steps, real (non-padding) tokens, wall seconds, tokens/s (total
and the median of per-step figures) and padding fraction (padding tokens / all fed tokens),
then the tokens/s ratios. One process (CPU fp32 by default; --device, --dtype),
plain `torch.optim.AdamW` (no DeepSpeed: the arms differ only in data layout and where the
ReFusion reorganization runs, which is what is measured).

- ours: `pipeline.data` loader with packing (several samples per row of `max_length` tokens,
  `--packing`, default best_fit; the reorganization vectorized in numpy outside the model,
  deterministic from (seed, key, epoch)), model forward with segment masks,
  `pipeline.objective.hybrid_loss`.
- ours with the other packing (next_fit when --packing is best_fit, and the reverse): the same
  model and loop, so the best_fit / next_fit tokens/s ratio is the effect of packing alone
  (issue 14: less padding = fewer fed tokens per real token).
- reference-style baseline (what ML-GSAI/ReFusion does): one sample per row, rows padded to the
  longest sample of the micro-batch (HF `pad_sequence` collator); inside the model's forward a
  Python loop over samples draws t, the slot size and the slot masks from the global RNG and
  rebuilds each sample with per-slot tensor ops, then the loss is summed per sample in Python.
Both arms read the train split in manifest order; each baseline step takes whole samples until
it has at least as many real tokens as our step had. The arms alternate step by step so that
both see the same machine load (this machine is shared; the ratio is the figure to read). The
baseline's sample reading is not timed; our loader (reading + reorganization + packing) is.

    .venv/bin/python bench/bench_train_step.py [--data outputs/demo/shards] [--steps 6]
        [--model-config configs/model/demo.yaml] [--rows 2] [--row-length TOKENS]
        [--device cpu|cuda[:N]] [--dtype fp32|bf16] [--json FIGURES.json]
        [--packing best_fit|next_fit]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def reference_style_forward(model, samples, mask_id: int, pad_id: int, eps: float = 1e-3,
                            slot_sizes=(4, 8, 16, 32), device="cpu"):
    """The baseline: per-sample Python reorganization inside the forward (global RNG), padded
    batch, per-sample loss loop. `samples`: list of (LongTensor[L] tokens, prompt_length), on
    the CPU; the padded batch and the loss inputs are moved to `device`.
    Returns (loss, real tokens, fed tokens)."""
    rows, poss, labs, weights, masked_flags = [], [], [], [], []
    for tokens, P in samples:
        L = tokens.shape[0]
        k = random.choice(slot_sizes)
        t = torch.rand(()).item()
        p = (1 - eps) * t + eps
        starts = list(range(P, L, k))
        is_masked = [torch.rand(()).item() < p for _ in starts]
        clean = [i for i, m in enumerate(is_masked) if not m]
        order = [clean[j] for j in torch.randperm(len(clean)).tolist()]
        ids, pos, lab, w, mf = [tokens[:P]], [torch.arange(P)], [torch.full((P,), -100)], \
            [torch.zeros(P)], [torch.zeros(P, dtype=torch.bool)]
        for i in order:
            a, b = starts[i], min(starts[i] + k, L)
            ids.append(tokens[a:b])
            pos.append(torch.arange(a, b))
            lab.append(torch.cat([tokens[a + 1:b], torch.tensor([-100])]))
            w.append(torch.zeros(b - a))
            mf.append(torch.zeros(b - a, dtype=torch.bool))
        for i, m in enumerate(is_masked):
            if m:
                a, b = starts[i], min(starts[i] + k, L)
                ids.append(torch.full((b - a,), mask_id))
                pos.append(torch.arange(a, b))
                lab.append(tokens[a:b])
                w.append(torch.full((b - a,), 1.0 / (p * (L - P))))
                mf.append(torch.ones(b - a, dtype=torch.bool))
        rows.append(torch.cat(ids))
        poss.append(torch.cat(pos))
        labs.append(torch.cat(lab))
        weights.append(torch.cat(w))
        masked_flags.append(torch.cat(mf))
    T = max(r.shape[0] for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    segment_ids = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r.shape[0]
        input_ids[b, :n], position_ids[b, :n], segment_ids[b, :n] = r, poss[b], 1
        position_ids[b, n:] = torch.arange(n, T)
    logits = model(input_ids.to(device), position_ids.to(device),
                   segment_ids=segment_ids.to(device))
    ar_sum, ar_n, mdm = 0.0, 0, 0.0
    for b in range(B):
        n = rows[b].shape[0]
        lab, w, mf = labs[b].to(device), weights[b].to(device), masked_flags[b].to(device)
        ce = F.cross_entropy(logits[b, :n].float(), lab.clamp(min=0), reduction="none")
        valid = lab != -100
        ar_mask = valid & ~mf
        ar_sum = ar_sum + ce[ar_mask].sum()
        ar_n += int(ar_mask.sum())
        mdm = mdm + (ce * w)[mf].sum()
    loss = ar_sum / max(ar_n, 1) + mdm / B
    real = sum(r.shape[0] for r in rows)
    return loss, real, B * T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "outputs/demo/shards"),
                    help="shard folder (train split)")
    ap.add_argument("--model-config", default=str(ROOT / "configs/model/demo.yaml"),
                    help="model preset YAML")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm (after 1 warm-up)")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per micro-batch (ours)")
    ap.add_argument("--row-length", type=int, default=0,
                    help="tokens per packed row (ours; 0 = the manifest max_length)")
    ap.add_argument("--packing", default="best_fit", choices=("best_fit", "next_fit"),
                    help="packing of our arm; the other packing runs as a third arm")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (timed with the device "
                    "synchronized)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="parameter and activation dtype of both arms")
    ap.add_argument("--json", default=None, help="also write the per-arm figures to this file")
    args = ap.parse_args()
    if not (Path(args.data) / "manifest.json").is_file():
        print(f"error: {args.data}/manifest.json not found; build the demo shards first "
              f"(scripts/demo.sh stage 1)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_PORT", "29533")
    from pipeline.data import DataError, build_loader, read_manifest
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.objective import hybrid_loss
    from pipeline.parallel import init_distributed
    try:
        man = read_manifest(args.data)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = man["tokenizer"]
    T = args.row_length or int(man["max_length"])
    if T < int(man["max_length"]):
        print(f"error: --row-length {T} is shorter than the shards' max_length "
              f"{man['max_length']} ({args.data}/manifest.json); use >= {man['max_length']}",
              file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
    except RuntimeError as e:
        print(f"error: --device {args.device}: {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    init_distributed(1, backend="gloo")
    cfg = ModelConfig.from_yaml(args.model_config)
    cfg.vocab_size = max(cfg.vocab_size, -(-int(tok["vocab_size"]) // 64) * 64)
    torch.manual_seed(0)
    model_a = Qwen3(cfg).to(device=device, dtype=dtype).train()
    model_b = Qwen3(cfg, init_weights=False).to(device=device, dtype=dtype).train()
    model_c = Qwen3(cfg, init_weights=False).to(device=device, dtype=dtype).train()
    model_b.load_state_dict(model_a.state_dict())
    model_c.load_state_dict(model_a.state_dict())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-4)
    opt_c = torch.optim.AdamW(model_c.parameters(), lr=1e-4)
    other = "next_fit" if args.packing == "best_fit" else "best_fit"

    def packed_loader(packing):
        return iter(build_loader(args.data, "train", args.rows, T, seed=0, num_workers=0,
                                 pack=True, packing=packing, shuffle=False, infinite=True,
                                 vocab_size=cfg.vocab_size))
    loader, loader_c = packed_loader(args.packing), packed_loader(other)
    import webdataset as wds
    urls = [str(Path(args.data) / s["name"]) for s in man["splits"]["train"]]
    stream = iter(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode())
    random.seed(0)
    torch.manual_seed(0)
    ours = {"steps": 0, "real": 0, "fed": 0, "seconds": 0.0, "rates": []}
    base = {"steps": 0, "real": 0, "fed": 0, "seconds": 0.0, "rates": []}
    alt = {"steps": 0, "real": 0, "fed": 0, "seconds": 0.0, "rates": []}

    def record(arm, step, real, fed, dt):
        if step:   # step 0 is warm-up
            arm["steps"] += 1
            arm["real"] += real
            arm["fed"] += fed
            arm["seconds"] += dt
            arm["rates"].append(real / dt)

    def packed_step(model, opt, it):
        """One timed step of ours on the next batch of `it`: (real tokens, fed tokens, seconds)."""
        sync()
        t0 = time.perf_counter()
        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(it).items()}
        logits = model(batch["input_ids"], batch["position_ids"],
                       segment_ids=batch["segment_ids"])
        loss, st = hybrid_loss(logits, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return int(st["real_tokens"]), batch["input_ids"].numel(), time.perf_counter() - t0

    # The arms alternate step by step, so both see the same machine load.
    for step in range(args.steps + 1):
        # ours: packed rows, reorganization in the loader (timed: it is part of our step)
        real_a, fed, dt = packed_step(model_a, opt_a, loader)
        record(ours, step, real_a, fed, dt)
        # ours with the other packing (its own stream of the same data)
        record(alt, step, *packed_step(model_c, opt_c, loader_c))
        # baseline: the next samples of the same stream order, as many real tokens as ours
        samples, n = [], 0
        while n < real_a:
            s = next(stream)
            toks = torch.from_numpy(s["tokens.npy"].astype("int64"))
            for seg in s["json"]["segments"]:
                piece = toks[seg["start"]:seg["end"]]
                samples.append((piece, int(seg["prompt_length"])))
                n += piece.shape[0]
        sync()
        t0 = time.perf_counter()
        loss, real, fed = reference_style_forward(model_b, samples, int(tok["mask_id"]),
                                                  int(tok["pad_id"]), device=device)
        loss.backward()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        sync()
        record(base, step, real, fed, time.perf_counter() - t0)
    print(f"model {Path(args.model_config).name}: hidden {cfg.hidden_size}, layers "
          f"{cfg.num_layers}, vocab {cfg.vocab_size}; data {args.data} (row length {T}); "
          f"device {device}, {args.dtype}; torch threads {torch.get_num_threads()}")
    print(f"ours: packing {args.packing}")
    print(f"{'arm':<28}{'steps':>6}{'real tokens':>13}{'seconds':>9}{'tokens/s':>10}"
          f"{'median':>9}{'padding':>9}")
    med = {}
    arms = (("ours (packed, vectorized)", ours), (f"ours, {other}", alt),
            ("reference-style (padded)", base))
    for name, r in arms:
        med[name] = statistics.median(r["rates"])
        print(f"{name:<28}{r['steps']:>6}{r['real']:>13}{r['seconds']:>9.2f}"
              f"{r['real'] / r['seconds']:>10.0f}{med[name]:>9.0f}{1 - r['real'] / r['fed']:>9.1%}")
    ratio = (ours["real"] / ours["seconds"]) / (base["real"] / base["seconds"])
    mratio = med["ours (packed, vectorized)"] / med["reference-style (padded)"]
    print(f"tokens/s ratio ours / reference-style: {ratio:.2f}x (total), {mratio:.2f}x (median "
          f"of per-step tokens/s; steps are noisy on a shared machine)")
    r_bf, r_nf = (ours, alt) if args.packing == "best_fit" else (alt, ours)
    print(f"tokens/s ratio best_fit / next_fit packing: "
          f"{(r_bf['real'] / r_bf['seconds']) / (r_nf['real'] / r_nf['seconds']):.2f}x (total), "
          f"padding {1 - r_bf['real'] / r_bf['fed']:.1%} vs {1 - r_nf['real'] / r_nf['fed']:.1%}")
    if args.json:
        import json
        out = {name: {"steps": r["steps"], "real_tokens": r["real"], "fed_tokens": r["fed"],
                      "seconds": r["seconds"], "tokens_per_s": r["real"] / r["seconds"],
                      "median_tokens_per_s": med[label]}
               for name, label, r in (("ours", "ours (packed, vectorized)", ours),
                                      (f"ours_{other}", f"ours, {other}", alt),
                                      ("reference", "reference-style (padded)", base))}
        out.update(device=str(device), dtype=args.dtype, row_length=T, rows=args.rows,
                   packing=args.packing)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
