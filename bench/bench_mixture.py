"""Data mixtures against one folder of the same samples (issue 42 item 8), in one run.

Data: `--samples` synthetic samples (lognormal lengths, median `--median` tokens, clipped to
[16, row length], random segments and slots), written once to temporary folders (not timed):
- one folder holding all of them;
- the same samples split into 3 sources of 50 / 30 / 20 % (weights 0.5 / 0.3 / 0.2, close to
  their token shares, so both loaders feed about the same samples);
- the same samples split into 50 sources (equal weights).

Figures (printed; medians over `--repeats` alternating runs, ratios within each pair):
- throughput: shard samples and real tokens per second of `build_loader`'s micro-batches after
  the first one (packing best_fit, one process: `num_workers=0`, so the figure is the loader's
  own CPU cost), 3-source mixture / one folder (target >= 0.95);
- loader start-up: seconds from `build_loader` to the first micro-batch, 50 sources / one
  folder, and 3 sources / one folder (each source adds its manifest and its first shard's
  sample index: a fixed cost of well under a millisecond, independent of the shard size);
- job start-up: wall seconds of `python -m pipeline.train` (one process, tiny model, one
  step, no checkpoint) on the 50 sources / on the one folder (target <= 1.10).

    .venv/bin/python bench/bench_mixture.py [--samples 20000] [--batches 300] [--repeats 5]

6 December 2026, 2-core VM, nothing else running, defaults: throughput 0.998 (tokens 1.005),
loader first batch 50 sources / one 2.44 (25 ms vs 10 ms), job start-up 50 / one 1.038
(6.34 s vs 6.43 s).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_loader import throughput  # noqa: E402
from pipeline.data import build_loader  # noqa: E402
from pipeline.data.mixture import Source  # noqa: E402
from shard_fixtures import random_segments, write_shards  # noqa: E402


def _samples(n: int, T: int, median: float, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for L in np.clip(rng.lognormal(np.log(median), 0.8, n), 16, T).astype(int):
        out.append((rng.integers(3, 64, size=int(L)).astype(np.uint32),
                    random_segments(rng, int(L), max_segments=2, slot_sizes=(4, 8, 16, 32))))
    return out


def _split(samples: list, shares) -> list[list]:
    cuts = np.cumsum([0, *(int(round(s * len(samples))) for s in shares)])
    cuts[-1] = len(samples)
    return [samples[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _first_batch_s(data, B: int, T: int) -> float:
    t0 = time.perf_counter()
    next(iter(build_loader(data, "train", B, T, num_workers=0, pack=True, seed=1)))
    return time.perf_counter() - t0


def _throughput(data, B: int, T: int, n: int) -> tuple[float, float]:
    """(samples/s, real tokens/s) after the first batch, one process (`bench_loader`'s)."""
    return throughput(data, B, T, 1000, 0, n, pack=True, seed=1)


def _train_one_step_s(tmp: str, data: dict, tag: str) -> float:
    """Wall seconds of `python -m pipeline.train` (one process, the tiny test model, one step,
    no checkpoint, validation or wandb) on `data` (a `data` config section): what a job's
    start-up costs in all, from the process start to its exit."""
    import json
    import os
    import subprocess
    from shard_fixtures import TINY_MODEL
    cfg = {"model": {"inline": dict(TINY_MODEL, vocab_size=64, max_position_embeddings=1024)},
           "data": {**data, "num_workers": 1, "pack": True},
           "train": {"max_steps": 1, "micro_batch_size": 1, "global_batch_size": 1,
                     "precision": "fp32", "eval_interval": 0},
           "checkpoint": {"interval": 0}, "wandb": {"mode": "disabled"}}
    path = f"{tmp}/{tag}.yaml"
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline.train", "--config", path,
                    f"run_dir={tmp}/run-{tag}-{time.monotonic_ns()}", "checkpoint.resume=false"],
                   env=env, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--median", type=float, default=200)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    T, B = a.max_length, a.micro_batch
    samples = _samples(a.samples, T, a.median)
    with tempfile.TemporaryDirectory() as tmp:
        one = f"{tmp}/one"
        write_shards(one, {"train": samples}, samples_per_shard=1000, max_length=T)
        three = []
        for k, (name, w, part) in enumerate(zip(("web", "code", "math"), (0.5, 0.3, 0.2),
                                                _split(samples, (0.5, 0.3, 0.2)))):
            write_shards(f"{tmp}/{name}", {"train": part}, samples_per_shard=1000, max_length=T)
            three.append(Source(name, f"{tmp}/{name}", w))
        fifty = []
        for k, part in enumerate(_split(samples, [1 / 50] * 50)):
            write_shards(f"{tmp}/s{k}", {"train": part}, samples_per_shard=1000, max_length=T)
            fifty.append(Source(f"s{k}", f"{tmp}/s{k}", 1.0))
        tp, start3, start50, job = [], [], [], []
        mix50 = {"sources": [{"name": x.name, "dir": x.dir, "weight": 1} for x in fifty]}
        _train_one_step_s(tmp, {"dir": one}, "warm-up")   # imports, DeepSpeed's op build cache
        for r in range(a.repeats):
            s1, t1 = _throughput(one, B, T, a.batches)
            s3, t3 = _throughput(three, B, T, a.batches)
            tp.append((s3 / s1, t3 / t1, s1, s3))
            o = _first_batch_s(one, B, T)
            f3 = _first_batch_s(three, B, T)
            f50 = _first_batch_s(fifty, B, T)
            start3.append((f3 / o, o, f3))
            start50.append((f50 / o, o, f50))
            if r % 2:   # alternate which goes first
                j50 = _train_one_step_s(tmp, mix50, "fifty")
                j1 = _train_one_step_s(tmp, {"dir": one}, "one")
            else:
                j1 = _train_one_step_s(tmp, {"dir": one}, "one")
                j50 = _train_one_step_s(tmp, mix50, "fifty")
            job.append((j50 / j1, j1, j50))
            print(f"repeat {r + 1}: throughput one {s1:.0f} samples/s, 3 sources {s3:.0f} "
                  f"(ratio {s3 / s1:.3f}); start-up one {o:.3f} s, 3 sources {f3:.3f} s, "
                  f"50 sources {f50:.3f} s; one-step job one {j1:.2f} s, 50 sources {j50:.2f} s",
                  flush=True)
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(f"\n{a.samples} samples, rows of {T} tokens, micro-batch {B}, best_fit, 1 process, "
          f"median of {a.repeats}:")
    print(f"throughput 3-source / one folder: samples {med(tp, 0):.3f}, tokens {med(tp, 1):.3f} "
          f"(one folder {med(tp, 2):.0f} samples/s; target >= 0.95)")
    print(f"start-up 50 sources / one folder: {med(start50, 0):.3f} ({med(start50, 2):.3f} s vs "
          f"{med(start50, 1):.3f} s); 3 sources / one: {med(start3, 0):.3f}")
    print(f"job start-up (pipeline.train to the end of step 1) 50 sources / one folder: "
          f"{med(job, 0):.3f} ({med(job, 2):.2f} s vs {med(job, 1):.2f} s; target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
