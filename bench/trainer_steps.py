"""A few steps of the real trainer, timed, without any checkpoint save.

Builds `pipeline.train.Trainer` from a run config exactly as `python -m pipeline.train` does
(config validation, process groups, DeepSpeed engine, loader, metrics.jsonl), runs
`--steps` optimizer steps through `Trainer.train_step`, and prints one JSON line: tokens/s
(real tokens over the wall time of the steps after `--warmup`), mean MFU and HFU of those steps,
peak memory and the memory plan's total (`pipeline.training.memory_plan`, same config), on CUDA
the model states (`torch.cuda.memory_allocated()` before the last step) and that step's working
memory (`max_memory_allocated()` above it) against the plan's split, the last loss, and the
run's settings. The trainer's own loop (`Trainer.run`) is
not used because it always saves a final checkpoint; a GPU check has no time for a 28+ GB save.

    python bench/trainer_steps.py --config RUN.yaml [--steps 6] [--warmup 2] [--json OUT]
        [key=value ...]                       # one process; overrides as for pipeline.train

Exit status 0, or 2 with one line on a config error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        print("trainer_steps.py: error: --steps must exceed --warmup", file=sys.stderr)
        return 2
    from pipeline.config import ConfigError, load_config, validate
    from pipeline.train import Trainer
    from pipeline.training.job import launcher_env
    try:
        cfg = load_config(args.config, [f"train.max_steps={args.steps}", *args.overrides])
        plan = validate(cfg)
    except ConfigError as e:
        print(f"trainer_steps.py: config error: {e}", file=sys.stderr)
        return 2
    launcher_env()
    trainer = Trainer(cfg, plan)
    records = []
    t_setup = time.perf_counter()
    try:
        trainer.setup()
        setup_s = time.perf_counter() - t_setup
        import torch
        cuda = torch.cuda.is_available()
        for i in range(args.steps):
            if cuda and i == args.steps - 1:   # the last step: its own peak above the states
                torch.cuda.synchronize()
                states = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            metrics, nonfinite, _ = trainer.train_step()
            if nonfinite:
                print(f"trainer_steps.py: error: non-finite loss at step {metrics['step']}",
                      file=sys.stderr)
                return 3
            trainer._record(metrics)
            records.append(metrics)
        if cuda:
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated() - states
    finally:
        it = getattr(trainer, "_train_iter", None)
        if it is not None:
            it.close()
        if trainer.monitor is not None:
            trainer.monitor.finish(0)
        if trainer.run_lock is not None:
            trainer.run_lock.release()
        from pipeline.parallel import destroy_distributed
        destroy_distributed()
    timed = records[args.warmup:]
    secs = sum(m["step_time_s"] for m in timed)
    mean = lambda k: (sum(m[k] for m in timed) / len(timed)  # noqa: E731
                      if all(m.get(k) is not None for m in timed) else None)
    t = cfg.train
    from pipeline.training.memory_plan import ALLOWANCE_PREFIX, STATE_COMPONENTS, plan_for_run
    mem_plan = plan_for_run(cfg, tp=plan.tp_size, dp=plan.dp_size, model_fields=plan.model_fields,
                            row_length=plan.row_length,
                            device="cuda" if torch.cuda.is_available() else "cpu")
    planned_states = sum(v for k, v in mem_plan.components.items() if k in STATE_COMPONENTS)
    # the CUDA context + NCCL allowance is no tensor: max_memory_allocated never sees it
    allowance = sum(v for k, v in mem_plan.components.items() if k.startswith(ALLOWANCE_PREFIX))
    out = {"planned_memory_gib": (mem_plan.total - allowance) / 2 ** 30,   # tensors only
           # per component on CUDA: the model states (allocated between two steps) and the
           # last step's working memory (its peak above them), against the plan's split
           "planned_states_gib": planned_states / 2 ** 30,
           "planned_step_gib": (mem_plan.total - planned_states - allowance) / 2 ** 30,
           "measured_states_gib": states / 2 ** 30 if cuda else None,
           "measured_step_gib": step_peak / 2 ** 30 if cuda else None,
           "steps": len(timed), "tokens_per_s": sum(m["tokens_per_s"] * m["step_time_s"]
                                                   for m in timed) / secs,
           "step_s": secs / len(timed), "mfu": mean("mfu"), "hfu": mean("hfu"),
           "peak_memory_gib": max(m["peak_memory_bytes"] for m in records) / 2 ** 30,
           "loss_last": timed[-1]["loss"], "setup_s": setup_s,
           "settings": {"activation_checkpointing": str(t.activation_checkpointing),
                        "loss_impl": t.loss_impl, "optim_fused": bool(cfg.optim.fused),
                        "compile": bool(t.compile), "zero_stage": int(t.zero_stage),
                        "attention": plan.model_fields.get("attention") or "auto"}}
    line = json.dumps(out)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
