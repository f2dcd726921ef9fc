"""Row fill of objective mode "dual": the share of fed tokens that are not padding, per row
length, on a real shard folder (what `configs/qwen3_8b_dual.yaml` chose its row length by).

In mode "dual" a sample of L tokens is fed as L clean tokens plus masked copies of some of its
response slots (`pipeline.objective`, docs/METHOD.md "The dual-stream arm"), never past the row
length `data.max_length`; the loader packs rows by that fed length (best-fit decreasing within
each shuffle window). With rows as long as the shards' `max_length`, long samples lose copies
(`dropped`); with longer rows, rows of one long sample are part padding. Figures per row
length T, over `--batches` micro-batches of one pass of the split (`build_loader`, the
trainer's loader, dual mode, seed 1234):
- fill = real (non-padding) tokens / (micro-batches x B x T);
- copies = masked-copy tokens / real tokens; dropped = copy tokens cut by T / copy tokens wanted.

    .venv/bin/python bench/bench_dual_fill.py --data DIR [DIR ...] --row-lengths 4096,6144,8192
        [--masking refusion|all] [--micro-batch-size 4] [--shuffle-buffer 10000] [--batches 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.data import build_loader, read_manifest  # noqa: E402
from pipeline.objective import ObjectiveConfig  # noqa: E402


def fill(data_dir: str, T: int, B: int, window: int, batches: int, masking: str) -> dict:
    """Figures of one pass (at most `batches` micro-batches) of `data_dir`'s train split fed in
    rows of T tokens: {"fill", "copies", "dropped", "batches"}."""
    obj = ObjectiveConfig(mode="dual", dual_masking=masking)
    real = total = copies = dropped = n = 0
    for b in build_loader(data_dir, "train", B, T, num_workers=0, infinite=False, seed=1234,
                          shuffle_buffer=window, pack=True, objective_cfg=obj):
        real += int(b["real_tokens"])
        total += b["input_ids"].numel()
        copies += int(b["copy_tokens"])
        dropped += int(b["dropped_copies"])
        n += 1
        if n >= batches:
            break
    return {"fill": real / total, "copies": copies / max(real, 1),
            "dropped": dropped / max(copies + dropped, 1), "batches": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="shard folders (data_prep/shard.py)")
    ap.add_argument("--row-lengths", default="", help="row lengths T, comma-separated "
                    "(default: 1x, 1.5x, 2x the shards' max_length)")
    ap.add_argument("--masking", choices=("refusion", "all"), default="refusion",
                    help="objective.dual_masking")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--shuffle-buffer", type=int, default=10000)
    ap.add_argument("--batches", type=int, default=200, help="micro-batches per figure (at most)")
    args = ap.parse_args()
    for d in args.data:
        m = read_manifest(d)
        S = int(m["max_length"])
        train = m["splits"]["train"]
        n = sum(e["samples"] for e in train)
        per = sum(e["tokens"] for e in train) / max(n, 1)
        print(f"{d}: shards' max_length {S}, {n} samples, {per:.0f} tokens/sample")
        rows = ([int(x) for x in args.row_lengths.split(",")] if args.row_lengths
                else [S, S * 3 // 2, 2 * S])
        for T in rows:
            if T < S:
                continue
            f = fill(d, T, args.micro_batch_size, args.shuffle_buffer, args.batches, args.masking)
            print(f"  T={T:6d} ({T / S:.2f}x): fill {f['fill']:6.1%}  copies {f['copies']:5.1%} "
                  f"of real tokens  dropped {f['dropped']:5.1%} of copies  ({f['batches']} "
                  f"micro-batches of {args.micro_batch_size}x{T})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
