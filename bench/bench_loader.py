"""Loader figures: padding fraction unpacked / next-fit / best-fit packing, and loader
throughput (samples/s, tokens/s per worker) next to what a trainer consumes.

Data: documented functions of the Python standard library as query/response pairs
(`data_prep/shard.py --input stdlib --format qa`), tokenized with the real Qwen3 tokenizer
(chat template), slot sizes {4, 8, 16, 32}, written to a temporary folder (not timed); and a
long-tailed synthetic set (issue 14): `--synthetic` samples with lognormal lengths (median
`--median` tokens, sigma `--sigma`, clipped to [32, row length]) at rows of `--synthetic-length`
(4096) tokens, one query/response segment each.

Figures:
- padding fraction = 1 - real tokens / (micro-batches x B x T), over one pass of the split
  (best_fit: best-fit decreasing within each `--shuffle-buffer` window; target <= 3% on the
  synthetic set);
- loader throughput: shard samples (and real tokens) per second delivered by `build_loader`
  (reorganization + collation included) after the first batch, per worker count;
- trainer consumption: tokens/s one GPU trains at = MFU x peak FLOP/s / FLOPs per token
  (`pipeline.model.flops_per_token`, PaLM/nanoGPT formula), converted to samples/s with the
  measured tokens per sample. The loader must exceed it per GPU (one loader per GPU).

    .venv/bin/python bench/bench_loader.py [--limit 2000] [--max-length 1024] [--batches 200]
        [--synthetic 1500] [--synthetic-length 4096]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep import cli  # noqa: E402
from pipeline.tokenizer import qwen3_tokenizer_dir  # noqa: E402
from pipeline.data import build_loader  # noqa: E402


MODES = (("unpacked", dict(pack=False)), ("next_fit", dict(pack=True, packing="next_fit")),
         ("best_fit", dict(pack=True, packing="best_fit")))


def padding_fraction(data_dir: str, B: int, T: int, window: int, **kw) -> tuple[float, int]:
    real = total = batches = 0
    for b in build_loader(data_dir, "train", B, T, num_workers=0, infinite=False,
                          shuffle_buffer=window, **kw):
        real += int(b["real_tokens"])
        total += b["input_ids"].numel()
        batches += 1
    return 1.0 - real / total, batches


def throughput(data_dir: str, B: int, T: int, window: int, workers: int, n: int,
               **kw) -> tuple[float, float]:
    """(samples/s, real tokens/s) of the loader's batches after the first one."""
    it = iter(build_loader(data_dir, "train", B, T, num_workers=workers, shuffle_buffer=window, **kw))
    next(it)  # worker start-up and first window not counted
    samples = tokens = 0
    t0 = time.perf_counter()
    for _ in range(n):
        b = next(it)
        samples += len(b["keys"])
        tokens += int(b["real_tokens"])
    dt = time.perf_counter() - t0
    return samples / dt, tokens / dt


def synthetic_shards(out: str, n: int, T: int, median: float, sigma: float, seed: int = 0) -> float:
    """Write n lognormal-length samples (one segment, prompt 1/4 of the sample); returns the
    mean tokens per sample."""
    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    from shard_fixtures import write_shards
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), sigma, size=n)), 32, T).astype(int)
    samples = [(rng.integers(3, 64, size=L).astype(np.uint32),
                [{"start": 0, "end": int(L), "prompt_length": int(L) // 4,
                 "slot_starts": list(range(int(L) // 4, int(L), 32))}])
               for L in lengths]
    write_shards(out, {"train": samples}, samples_per_shard=500, max_length=T)
    return float(lengths.mean())


def report(name: str, out: str, B: int, T: int, args, per_sample: float, gpu_tok_s: float) -> None:
    for mode, kw in MODES:
        frac, nb = padding_fraction(out, B, T, args.shuffle_buffer, **kw)
        print(f"[{name}] padding {mode:8}: {frac:6.1%} ({nb} micro-batches of {B}x{T} per epoch)")
    for mode, kw in MODES:
        for w in (int(x) for x in args.workers.split(",")):
            sps, tps = throughput(out, B, T, args.shuffle_buffer, w, args.batches, **kw)
            per = max(1, w)
            print(f"[{name}] loader {mode:8} workers={w}: {sps:8,.0f} samples/s {tps:11,.0f} tokens/s "
                  f"({sps / per:,.0f} samples/s, {tps / per:,.0f} tokens/s per worker; "
                  f"{tps / gpu_tok_s:.0f}x trainer consumption)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=2000, help="query/response pairs to shard")
    ap.add_argument("--max-length", type=int, default=1024, help="row length T (tokens)")
    ap.add_argument("--micro-batch-size", dest="micro_batch", type=int, default=4,
                    help="rows per micro-batch")
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)  # the old spelling
    ap.add_argument("--batches", type=int, default=200, help="micro-batches timed per setting")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--shuffle-buffer", type=int, default=1000, help="shuffle/packing window (samples)")
    ap.add_argument("--synthetic", type=int, default=1500, help="lognormal-length samples (0 = skip)")
    ap.add_argument("--synthetic-length", type=int, default=4096, help="row length T of the synthetic set")
    ap.add_argument("--median", type=float, default=700.0, help="median synthetic sample length")
    ap.add_argument("--sigma", type=float, default=0.75, help="lognormal sigma of the lengths")
    ap.add_argument("--model", default=str(ROOT / "configs/model/qwen3_8b.yaml"))
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, bf16 dense (H100/H200)")
    ap.add_argument("--mfu", type=float, default=0.4)
    args = ap.parse_args()
    T, B = args.max_length, args.micro_batch
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "shards")
        t0 = time.perf_counter()
        code = cli.main(["--input", "stdlib", "--format", "qa", "--output", out,
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
        from pipeline.model import ModelConfig, flops_per_token
        mcfg = ModelConfig.from_yaml(args.model)
        for name, T_ in (("stdlib", T), ("synthetic", args.synthetic_length)):
            if name == "synthetic":
                if not args.synthetic:
                    break
                out = str(Path(tmp) / "synthetic")
                per_sample = synthetic_shards(out, args.synthetic, T_, args.median, args.sigma)
                print(f"data: {args.synthetic} synthetic samples, lognormal lengths (median "
                      f"{args.median:.0f}, sigma {args.sigma}) clipped to [32, {T_}], "
                      f"{per_sample:.1f} tokens/sample, T={T_}, B={B}")
            else:
                per_sample = toks / n
            gpu_tok_s = args.mfu * args.peak_tflops * 1e12 / flops_per_token(mcfg, T_)
            print(f"[{name}] trainer consumption ({Path(args.model).stem}, MFU {args.mfu:.0%} of "
                  f"{args.peak_tflops:.0f} TFLOP/s): {gpu_tok_s:,.0f} tokens/s per GPU "
                  f"= {gpu_tok_s / per_sample:,.1f} samples/s")
            report(name, out, B, T_, args, per_sample, gpu_tok_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
