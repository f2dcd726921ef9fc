"""Cost of the per-source accounting (issue 42 item 5) in a training micro-batch.

Prints, for one micro-batch of random packed samples from `--sources` sources:
- `hybrid_loss` forward + backward (chunked output layer, the trainer's default) with and without
  `num_sources` (ms, medians of `--repeats` interleaved pairs), and the difference;
- on CUDA, whether the per-source stats make the host wait (`torch.cuda.set_sync_debug_mode`
  "error" around the call: any synchronizing op raises);
- the bytes of the batch's `source` tensor against the whole batch as built (what each
  micro-batch carries from the loader workers to the trainer and the device);
- the trainer's per-micro-batch CPU work (`source_tokens`: bincount of the batch's real tokens).

    .venv/bin/python bench/bench_source_metrics.py [--rows 4] [--length 2048] [--hidden 512]
        [--vocab 32768] [--sources 3] [--repeats 5] [--device auto]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pipeline.objective import (ObjectiveConfig, collate, hybrid_loss,  # noqa: E402
                                reorganize_sample)
from pipeline.training.metrics import source_tokens  # noqa: E402
from shard_fixtures import random_samples  # noqa: E402


def _batch(rows: int, length: int, vocab: int, n_src: int) -> dict:
    rng = np.random.default_rng(0)
    cfg = ObjectiveConfig()
    out, ids = [], []
    for b in range(rows):
        used, row, src = 0, [], []
        while True:
            (x, seg), = random_samples(rng, 1, vocab_size=vocab, max_length=256, min_length=32,
                                       max_prompt=16, slot_sizes=(4, 8, 16, 32))
            if used + len(x) > length:
                break
            row.append(reorganize_sample(x, seg, f"r{b}-{len(row)}", seed=0, epoch=0, mask_id=2,
                                         cfg=cfg))
            src.append(int(rng.integers(n_src)))
            used += len(x)
        out.append(row)
        ids.append(src)
    return collate(out, length, 0, sources=ids)


def _time(fn, repeats: int, cuda: bool) -> float:
    times = []
    for _ in range(repeats + 1):   # the first call warms up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available()
                       else ("cpu" if a.device == "auto" else a.device))
    cuda = dev.type == "cuda"
    cpu_batch = _batch(a.rows, a.length, a.vocab, a.sources)
    batch = {k: (v.to(dev) if hasattr(v, "to") else v) for k, v in cpu_batch.items()}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(a.rows, a.length, a.hidden, generator=g).to(dev).requires_grad_(True)
    weight = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5).to(dev)
    weight.requires_grad_(True)

    def step(n_src):
        loss, _ = hybrid_loss(hidden, batch, None, head=lambda x: x @ weight.T,
                              num_sources=n_src)
        loss.backward()

    # interleaved, so that a shared machine's load changes hit both alike
    pairs = [(_time(lambda: step(None), 1, cuda), _time(lambda: step(a.sources), 1, cuda))
             for _ in range(a.repeats)]
    without = statistics.median(p[0] for p in pairs)
    with_src = statistics.median(p[1] for p in pairs)
    print(f"device {dev}; micro-batch {a.rows} x {a.length} tokens, hidden {a.hidden}, vocab "
          f"{a.vocab}, {a.sources} sources, {cpu_batch['label_index'].numel()} labelled tokens")
    print(f"hybrid_loss forward+backward: {without:.2f} ms without per-source stats, "
          f"{with_src:.2f} ms with ({with_src - without:+.2f} ms, "
          f"{100 * (with_src - without) / without:+.1f}%)")
    ce = torch.rand(a.rows, a.length, device=dev)
    lab = batch["labels"] != -100

    def stats_alone():   # what num_sources adds to hybrid_loss, on a [B, T] CE
        src, m = batch["source"].reshape(-1), lab.reshape(-1)
        x = torch.where(m, ce.reshape(-1), torch.zeros((), device=dev)).double()
        torch.zeros(a.sources, dtype=torch.float64, device=dev).index_add_(0, src, x)
        torch.zeros(a.sources, dtype=torch.long, device=dev).index_add_(0, src, m.long())
    print(f"the per-source ops alone: {_time(stats_alone, a.repeats, cuda):.3f} ms")
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, stats = hybrid_loss(hidden.detach(), batch, None, head=lambda x: x @ weight.T,
                                   num_sources=a.sources)
            verdict = "none (sync debug mode 'error' raised nothing)"
        except RuntimeError as e:
            verdict = f"SYNC: {str(e).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print(f"host syncs in hybrid_loss with per-source stats: {verdict}")
    total = sum(v.numel() * v.element_size() for v in cpu_batch.values() if hasattr(v, "numel"))
    src = cpu_batch["source"]
    print(f"batch as built: {total / 1e6:.2f} MB, of which `source` {src.numel() * 8 / 1e6:.2f} "
          f"MB ({100 * src.numel() * 8 / total:.1f}%)")
    t = _time(lambda: source_tokens(cpu_batch, a.sources), a.repeats, False)
    print(f"source_tokens (CPU, per micro-batch): {t:.3f} ms")


if __name__ == "__main__":
    main()
