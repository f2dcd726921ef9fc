"""Agreement of the packed attention kernels (`model.attention` = flex / varlen) with sdpa.

One model, one packed batch (random segment lengths, padding at the end of the last row), one
forward + backward per kernel with the same weights; prints, per kernel, the max abs and the
relative (||x - ref|| / ||ref||) difference to the sdpa run of the logits and of the gradients
(the worst parameter), and the seconds of its step. On CUDA all three kernels run forward and
backward (varlen is CUDA only; flex is compiled on first use, so its first step includes the
compilation). On CPU only the forward of flex can be compared (torch has no FlexAttention
backward on CPU; training falls back to sdpa), which is what `--device cpu` checks.

Importable: `attention_parity(model_cfg, kinds, ...)` returns the figures as a dict
(bench/gpu_check.sh prints them beside its training runs).

    .venv/bin/python bench/attention_check.py [--preset configs/model/qwen3_8b.yaml]
        [--layers 2] [--rows 1] [--row-length 4096] [--dtype bf16] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def packed_batch(rows: int, row_length: int, vocab: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> dict:
    """Random packed rows: segments of 1..row_length/2 tokens with per-segment position ids
    fed in a shuffled order (as reorganized ReFusion samples are), the last row ending in
    padding (segment 0, positions continuing). Returns input_ids, position_ids, segment_ids,
    labels (LongTensor[B, T]; labels -100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(rows, row_length, dtype=torch.long)
    pos = torch.zeros(rows, row_length, dtype=torch.long)
    for r in range(rows):
        used, n = 0, 0
        end = row_length - (row_length // 8 if r == rows - 1 else 0)
        while used < end:
            length = min(end - used, int(torch.randint(1, max(2, row_length // 2), (1,),
                                                       generator=g)))
            n += 1
            seg[r, used:used + length] = n
            pos[r, used:used + length] = torch.randperm(length, generator=g)
            used += length
        pos[r, used:] = torch.arange(row_length - used) + (int(pos[r, :used].max()) + 1
                                                           if used else 0)
    ids = torch.randint(0, vocab, (rows, row_length), generator=g)
    labels = torch.randint(0, vocab, (rows, row_length), generator=g)
    labels[seg == 0] = -100
    return {k: v.to(device) for k, v in (("input_ids", ids), ("position_ids", pos),
                                         ("segment_ids", seg), ("labels", labels))}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def attention_parity(model_cfg, kinds=("flex", "varlen"), rows: int = 1,
                     row_length: int = 4096, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", seed: int = 0, grads: bool | None = None) -> dict:
    """Logits and gradients of each kernel in `kinds` against sdpa on one packed batch.

    Needs megatron-core's parallel_state initialized (`pipeline.parallel.init_distributed`).

    Args:
        model_cfg: `pipeline.model.ModelConfig` (its `attention` is overridden per run).
        kinds: kernels to compare with "sdpa".
        grads: also run backward (default: on CUDA only).
    Returns:
        {kind: {"logits_max_abs", "logits_rel", "grad_max_abs", "grad_rel", "grad_worst",
        "seconds"}}; the grad fields are None without backward; "sdpa" gives its own seconds.
    """
    from pipeline.model import Qwen3
    from pipeline.objective import IGNORE_INDEX
    dev = torch.device(device)
    grads = dev.type == "cuda" if grads is None else grads
    torch.manual_seed(seed)
    model = Qwen3(model_cfg, dtype=dtype).to(dev).train()
    batch = packed_batch(rows, row_length, model_cfg.vocab_size, seed, dev)

    def run(kind):
        model.cfg.attention = kind
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grads):
            logits = model(batch["input_ids"], batch["position_ids"],
                           segment_ids=batch["segment_ids"])
            if grads:
                loss = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, 1), batch["labels"].flatten(),
                    ignore_index=IGNORE_INDEX)
                loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        g = ({k: p.grad.detach().clone() for k, p in model.named_parameters()}
             if grads else None)
        return logits.detach(), g, time.perf_counter() - t0

    ref_logits, ref_grads, ref_s = run("sdpa")
    out = {"sdpa": {"seconds": ref_s}}
    for kind in kinds:
        logits, g, secs = run(kind)
        row = {"logits_max_abs": float((logits.float() - ref_logits.float()).abs().max()),
               "logits_rel": _rel(logits, ref_logits), "grad_max_abs": None,
               "grad_rel": None, "grad_worst": None, "seconds": secs}
        if g is not None:
            rel = {k: _rel(g[k], ref_grads[k]) for k in g}
            worst = max(rel, key=rel.get)
            row.update(grad_max_abs=max(float((g[k] - ref_grads[k]).abs().max()) for k in g),
                       grad_rel=rel[worst], grad_worst=worst)
        out[kind] = row
    model.cfg.attention = "auto"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=str(ROOT / "configs/model/qwen3_8b.yaml"))
    ap.add_argument("--layers", type=int, default=2, help="override num_layers (0 = preset's)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--row-length", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kinds", default=None, help="comma list (default: flex,varlen on CUDA, "
                    "flex on CPU)")
    args = ap.parse_args()
    from pipeline.model import ModelConfig
    from pipeline.parallel import init_distributed
    cfg = ModelConfig.from_yaml(args.preset)
    if args.layers:
        cfg.num_layers = args.layers
    cuda = torch.device(args.device).type == "cuda"
    kinds = args.kinds.split(",") if args.kinds else (["flex", "varlen"] if cuda else ["flex"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    init_distributed(tensor_parallel_size=1)
    res = attention_parity(cfg, kinds, args.rows, args.row_length,
                           torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                           args.device)
    print(f"attention_check: {args.preset} with {cfg.num_layers} layers, B={args.rows} "
          f"T={args.row_length} {args.dtype} on {args.device}; differences vs sdpa")
    print(f"  sdpa:   step {res['sdpa']['seconds']:.3f} s")
    for kind in kinds:
        r = res[kind]
        line = (f"  {kind}: logits max abs {r['logits_max_abs']:.3e} rel {r['logits_rel']:.3e}")
        if r["grad_rel"] is not None:
            line += (f"; grads max abs {r['grad_max_abs']:.3e}, worst rel {r['grad_rel']:.3e} "
                     f"({r['grad_worst']})")
        else:
            line += "; grads not compared (forward only on this device)"
        print(line + f"; step {r['seconds']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
