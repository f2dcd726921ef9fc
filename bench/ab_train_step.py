"""A/B of the training step between another source tree ("before") and this one ("after"),
in ONE process on the same inputs, as a ratio.

The other tree's `pipeline` package is imported under the name `pipeline_before` (a copy with
its imports renamed, made in a temporary folder), next to this tree's `pipeline`. Both build
the same model (this tree's weights copied into the other's), read the same shard samples
(reorganized once), and then alternate, repetition by repetition:
- collate: `objective.collate` of the same rows (what a loader worker does per micro-batch);
- step: the trainer's micro-batch on the CPU with each tree's own defaults: the packed forward
  to the final hidden states, `hybrid_loss` with the chunked output layer, backward, AdamW
  (foreach), plus the step's FLOP accounting (before: `training_flops(segment_lengths(...))`;
  after: `step_flops` from the collate fields).
The figures are ratios of median times, after / before (< 1 = this tree is faster), with the
spread of the per-repetition ratios, for wall time and for the CPU time of this thread
(`time.thread_time`; with one torch thread the step's work runs on it, and CPU time does not
count the time other jobs on a shared machine take the core away). Alternating makes both
sides see the same machine load; the median keeps single slow repetitions out.

    python bench/ab_train_step.py --before /path/to/old/tree [--data outputs/demo/shards]
        [--model-config configs/model/demo.yaml] [--rows 4] [--reps 40]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def import_before(tree: Path):
    """Copy `tree/pipeline` to a temp folder as `pipeline_before` (imports renamed) and import it."""
    tmp = Path(tempfile.mkdtemp(prefix="ab_before_"))
    dst = tmp / "pipeline_before"
    shutil.copytree(tree / "pipeline", dst)
    for f in dst.rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\bpipeline\.", "pipeline_before.", text)
        text = re.sub(r"^(\s*)from pipeline import", r"\1from pipeline_before import", text,
                      flags=re.M)
        text = re.sub(r"^(\s*)import pipeline\b", r"\1import pipeline_before", text, flags=re.M)
        f.write_text(text)
    sys.path.insert(0, str(tmp))
    import pipeline_before  # noqa: F401
    return tmp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the other source tree (has pipeline/)")
    ap.add_argument("--data", default=str(ROOT / "outputs/demo/shards"))
    ap.add_argument("--model-config", default=str(ROOT / "configs/model/demo.yaml"))
    ap.add_argument("--vocab-size", type=int, default=6016,
                    help="vocabulary rows (6016: the stdlib SentencePiece tokenizer's, to 64)")
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch (demo: 4)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (demo: 1 per rank)")
    args = ap.parse_args()
    before_tree = Path(args.before).resolve()
    if not (before_tree / "pipeline").is_dir():
        print(f"ab_train_step.py: error: {before_tree}/pipeline not found", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(args.threads)
    tmp = import_before(before_tree)
    import importlib
    B = {m: importlib.import_module(f"pipeline_before.{m}")
         for m in ("model", "objective", "parallel")}
    from pipeline import model as A_model, objective as A_obj
    from pipeline.data import build_loader, read_manifest
    from pipeline.model.flops import step_flops
    from pipeline.parallel import free_port, init_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed(1, backend="gloo")   # megatron's parallel_state is shared by both trees
    man = read_manifest(args.data)
    T = int(man["max_length"])
    cfg_a = A_model.ModelConfig.from_yaml(args.model_config)
    cfg_a.vocab_size = args.vocab_size
    cfg_b = B["model"].ModelConfig.from_yaml(args.model_config)
    cfg_b.vocab_size = args.vocab_size
    torch.manual_seed(0)
    model_a = A_model.Qwen3(cfg_a).train()
    model_b = B["model"].Qwen3(cfg_b, init_weights=False).train()
    model_b.load_state_dict(model_a.state_dict())
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-4)

    # The same reorganized rows for both collates: one packed loader's rows, kept as samples.
    loader = build_loader(args.data, "train", args.rows, T, seed=0, num_workers=0, pack=True,
                          shuffle=False, infinite=True, vocab_size=cfg_a.vocab_size)
    rows_list = []
    orig = A_obj.collate

    def grab(rows, max_length, pad_id, **kw):
        rows_list.append(([list(r) for r in rows], max_length, pad_id))
        return orig(rows, max_length, pad_id, **kw)
    import pipeline.data.rows as L
    L.collate = grab
    it = iter(loader)
    for _ in range(args.reps):
        next(it)
    L.collate = orig

    def to_before(s):   # a Reorganized of this tree -> the other tree's class (same fields)
        return B["objective"].Reorganized(**{k: getattr(s, k) for k in s.__dataclass_fields__})

    rows_b = [([[to_before(s) for s in r] for r in rows], m, p) for rows, m, p in rows_list]

    def step_a(batch):
        real = int(batch["real_tokens"])
        step_flops(cfg_a, batch["segment_lengths"], int(batch["label_index"].numel()),
                   batch["input_ids"].numel() - real, cfg_a.recompute, "chunked")
        hidden = model_a(batch["input_ids"], batch["position_ids"],
                         segment_ids=batch["segment_ids"], return_hidden=True,
                         cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
        loss, _ = A_obj.hybrid_loss(hidden, batch, head=model_a.head_logits)
        loss.backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        return loss

    def step_b(batch):
        M = B["model"]
        M.training_flops(cfg_b, M.segment_lengths(batch["segment_ids"]))
        hidden = model_b(batch["input_ids"], batch["position_ids"],
                         segment_ids=batch["segment_ids"], return_hidden=True)
        loss, _ = B["objective"].hybrid_loss(hidden, batch, head=model_b.head_logits)
        loss.backward()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        return loss

    times = {f"{w}_{s}{c}": [] for w in ("collate", "step") for s in ("before", "after")
             for c in ("", "_cpu")}
    for i in range(args.reps):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            rows, m, p = rows_list[i] if side == "after" else rows_b[i]
            fn = A_obj.collate if side == "after" else B["objective"].collate
            t0, c0 = time.perf_counter(), time.thread_time()
            batch = fn(rows, m, p)
            times[f"collate_{side}"].append(time.perf_counter() - t0)
            times[f"collate_{side}_cpu"].append(time.thread_time() - c0)
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = (step_a if side == "after" else step_b)(batch)
            times[f"step_{side}"].append(time.perf_counter() - t0)
            times[f"step_{side}_cpu"].append(time.thread_time() - c0)
            if i == 0:
                print(f"first loss {side}: {float(loss.detach()):.6f}")
    shutil.rmtree(tmp, ignore_errors=True)
    skip = min(2, args.reps - 1)   # the first repetitions warm allocators up
    print(f"A/B in one process: {args.reps} alternating repetitions (first {skip} left out), "
          f"{args.rows} rows x {T} tokens, {Path(args.model_config).name} (vocab "
          f"{args.vocab_size}), {torch.get_num_threads()} torch thread(s); before = "
          f"{before_tree}, after = {ROOT}")
    for what in ("collate", "collate_cpu", "step", "step_cpu"):
        b = times[what.replace("_cpu", "_before_cpu") if "cpu" in what else f"{what}_before"][skip:]
        a = times[what.replace("_cpu", "_after_cpu") if "cpu" in what else f"{what}_after"][skip:]
        per = sorted(x / y for x, y in zip(a, b))
        q = lambda f: per[min(len(per) - 1, int(f * len(per)))]  # noqa: E731
        print(f"{what:<12} median before {1e3 * statistics.median(b):8.2f} ms, after "
              f"{1e3 * statistics.median(a):8.2f} ms: after / before = "
              f"{statistics.median(a) / statistics.median(b):.3f} (per-repetition ratios: "
              f"quartiles {q(0.25):.3f} / {q(0.5):.3f} / {q(0.75):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
