"""Loader figures on real query/response data: padding fraction with and without packing, and
loader throughput (samples/s, tokens/s) next to what a trainer consumes.

Data: documented functions of the Python standard library as query/response pairs
(`data_prep/shard.py --input stdlib --format qa`), tokenized with the real Qwen3 tokenizer
(chat template), slot sizes {4, 8, 16, 32}, written to a temporary folder (not timed).

Figures:
- padding fraction = 1 - real tokens / (micro-batches x B x T), over one pass of the split;
- loader throughput: shard samples (and real tokens) per second delivered by `build_loader`
  (reorganization + collation included) after the first batch, per worker count;
- trainer consumption: tokens/s one GPU trains at = MFU x peak FLOP/s / FLOPs per token
  (`pipeline.model.flops_per_token`, PaLM/nanoGPT formula), converted to samples/s with the
  measured tokens per sample. The loader must exceed it per GPU (one loader per GPU).

    .venv/bin/python bench/bench_loader.py [--limit 2000] [--max-length 1024] [--batches 200]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep import shard  # noqa: E402
from data_prep.tokenizer_io import qwen3_tokenizer_dir  # noqa: E402
from pipeline.data import build_loader  # noqa: E402


def padding_fraction(data_dir: str, B: int, T: int, pack: bool) -> tuple[float, int]:
    real = total = batches = 0
    for b in build_loader(data_dir, "train", B, T, num_workers=0, pack=pack, infinite=False):
        real += int(b["real_tokens"])
        total += b["input_ids"].numel()
        batches += 1
    return 1.0 - real / total, batches


def throughput(data_dir: str, B: int, T: int, pack: bool, workers: int, n: int) -> tuple[float, float]:
    it = iter(build_loader(data_dir, "train", B, T, num_workers=workers, pack=pack))
    next(it)  # worker start-up and first window not counted
    samples = tokens = 0
    t0 = time.perf_counter()
    for _ in range(n):
        b = next(it)
        samples += len(b["keys"])
        tokens += int(b["real_tokens"])
    dt = time.perf_counter() - t0
    return samples / dt, tokens / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=2000, help="query/response pairs to shard")
    ap.add_argument("--max-length", type=int, default=1024, help="row length T (tokens)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=200, help="micro-batches timed per setting")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--model", default=str(ROOT / "configs/model/qwen3_8b.yaml"))
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, bf16 dense (H100/H200)")
    ap.add_argument("--mfu", type=float, default=0.4)
    args = ap.parse_args()
    T, B = args.max_length, args.micro_batch
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "shards")
        t0 = time.perf_counter()
        code = shard.main(["--input", "stdlib", "--format", "qa", "--output", out,
                           "--tokenizer", qwen3_tokenizer_dir(), "--max-length", str(T),
                           "--limit", str(args.limit), "--shard-samples", "500", "--no-progress"])
        if code != 0:
            return code
        import json
        manifest = json.loads((Path(out) / "manifest.json").read_text())
        n = sum(e["samples"] for e in manifest["splits"]["train"])
        toks = sum(e["tokens"] for e in manifest["splits"]["train"])
        print(f"data: {n} stdlib query/response pairs, Qwen3 tokenizer, {toks / n:.1f} tokens/sample, "
              f"T={T}, B={B} (sharded in {time.perf_counter() - t0:.1f} s)")
        for pack in (False, True):
            frac, nb = padding_fraction(out, B, T, pack)
            print(f"padding fraction, pack={pack!s:5}: {frac:6.1%} ({nb} micro-batches per epoch)")
        from pipeline.model import ModelConfig, flops_per_token
        mcfg = ModelConfig.from_yaml(args.model)
        gpu_tok_s = args.mfu * args.peak_tflops * 1e12 / flops_per_token(mcfg, T)
        print(f"trainer consumption ({Path(args.model).stem}, MFU {args.mfu:.0%} of "
              f"{args.peak_tflops:.0f} TFLOP/s): {gpu_tok_s:,.0f} tokens/s per GPU "
              f"= {gpu_tok_s / (toks / n):,.1f} samples/s")
        for pack in (False, True):
            for w in (int(x) for x in args.workers.split(",")):
                sps, tps = throughput(out, B, T, pack, w, args.batches)
                print(f"loader pack={pack!s:5} workers={w}: {sps:8,.0f} samples/s  {tps:10,.0f} tokens/s  "
                      f"({sps / (gpu_tok_s / (toks / n)):.0f}x trainer consumption)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
