"""What a run fed at given steps, from its deterministic data order, without training.

    python -m pipeline.data.batches RUN_DIR --steps 120:125 [--json] [--checkpoints DIR]

For each step of the range (both ends included) and each data-parallel rank it prints the
micro-batches the rank fed: every row's samples as `source:key` (a one-folder run has one
source, named after its folder). The order is rebuilt from the run's checkpoints: the steps
after checkpoint s and up to the next kept checkpoint t were fed from s's loader state (the
run's start before the first) under the run config and layout (data-parallel size,
micro-batch, gradient accumulation) saved at t (after the last checkpoint: the last one's);
the loader walks the order from that state with the sample indexes only and reads the printed
rows' keys. A data phase that began strictly between two kept checkpoints is refused in one
line (the configuration before it is no longer recorded).

Owns: this CLI. Must not touch: training state (it only reads checkpoints).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.common.cli import EXIT_USAGE, UsageError


def _checkpoints(ckdir: Path) -> list[tuple[int, dict, dict]]:
    """(step, rank 0's client_state, refusion_meta.json) of every complete checkpoint, oldest
    first."""
    from pipeline.checkpoint import list_complete
    from pipeline.checkpoint.safe_load import load_checkpoint_file
    out = []
    for step, d in list_complete(ckdir):
        try:
            state = load_checkpoint_file(d / "refusion_rank_00000.pt")["client_state"]
            meta = json.loads((d / "refusion_meta.json").read_text())
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is one line
            raise UsageError(f"{d}: unreadable checkpoint ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        out.append((int(step), state, meta))
    return out


def batches(run_dir: str, first: int, last: int, ckdir: str | None = None) -> list[dict]:
    """The micro-batches of steps `first`..`last`.

    Args:
        run_dir: the run folder. first, last: optimizer steps (1-based, inclusive).
        ckdir: checkpoint root (default: the saved `checkpoint.dir`, else RUN_DIR/checkpoints).
    Returns:
        [{"step", "dp_rank", "micro_batch", "rows": [[[source, key], ...], ...]}, ...] in step,
        rank, micro-batch order.
    Raises:
        UsageError: no checkpoint, a bad range, a phase change the walk cannot follow,
            unreadable shards (one line).
    """
    from pipeline.data import DataError
    if not 1 <= first <= last:
        raise UsageError(f"--steps {first}:{last}: need 1 <= A <= B")
    root = Path(ckdir) if ckdir else Path(run_dir) / "checkpoints"
    ckpts = _checkpoints(root) if root.is_dir() else []
    if not ckpts:
        raise UsageError(f"{root}: no complete checkpoint; the data order is rebuilt from a "
                         f"checkpoint's saved run config (give --checkpoints DIR if it is elsewhere)")
    # steps (s_i, s_i+1] were trained from checkpoint s_i's data state under the config saved at
    # s_i+1; steps after the last checkpoint under the last config
    out = []
    step = first
    try:
        while step <= last:
            before = [c for c in ckpts if c[0] < step]
            after = [c for c in ckpts if c[0] >= step]
            start_step, start_state = (before[-1][0], before[-1][1]["loader"]) if before else (0, None)
            end = min(last, after[0][0]) if after else last
            out += _segment(start_step, start_state, *(after[0] if after else ckpts[-1])[1:],
                            step, end)
            step = end + 1
    except DataError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    return out


def _segment(start_step: int, start_state: dict | None, state: dict, meta: dict, first: int,
             last: int) -> list[dict]:
    """Steps first..last, walked from the loader state `start_state` taken at `start_step`
    (None: the run's start) under the run config and layout of the checkpoint (`state`,
    `meta`) that ends the segment."""
    from pipeline.config import data_sources
    from pipeline.data import build_loader, read_manifest
    from pipeline.objective import ObjectiveConfig
    for ph in state.get("data_phases", []):
        if start_step < ph["step"] < last:
            raise UsageError(f"data phase {ph['phase']} began at step {ph['step']}, after the "
                             f"checkpoint the walk to step {last} starts from (step {start_step}), "
                             f"whose checkpoint is no longer kept; ask for steps after it")
    phase0 = (state.get("data_phases") or [{"step": 0}])[0]["step"]
    if start_state is None and phase0 > 0:
        raise UsageError(f"the oldest checkpoint kept begins with data phase "
                         f"{state['data_phases'][0]['phase']} at step {phase0}; steps before it "
                         f"need a checkpoint of the earlier phase")
    cfg = state["config"]
    d, t = cfg["data"], cfg["train"]
    tp = int(t.get("tensor_parallel_size", 1))
    dp = int(meta["world_size"]) // tp
    mbs = int(t["micro_batch_size"])
    ga = int(state.get("global_batch_size", t["global_batch_size"])) // (mbs * dp)
    srcs = data_sources(d)
    row = d.get("max_length") or max(int(read_manifest(s.dir)["max_length"]) for s in srcs)
    obj = ObjectiveConfig(**(cfg.get("objective") or {}))
    loaders = []
    for rank in range(dp):
        ld = build_loader(d["dir"] if not d.get("sources") else srcs, d.get("train_split", "train"),
                          mbs, int(row), dp_rank=rank, dp_size=dp, seed=int(t["seed"]),
                          num_workers=0, objective_cfg=obj, pack=bool(d.get("pack")),
                          packing=d.get("packing", "best_fit"),
                          shuffle_buffer=int(d.get("shuffle_buffer", 1000)),
                          verify_shards=d.get("verify_shards", "error"),
                          phase=int(d.get("phase", 0)))
        if start_state is not None:
            ld.load_state_dict(start_state, allow_reshard=True,
                               on_shard_change=d.get("on_shard_change", "refuse"))
        for _ in ld.plan((first - 1 - start_step) * ga, keys=False):
            pass
        loaders.append(ld)
    out = []
    for step in range(first, last + 1):
        for rank, ld in enumerate(loaders):
            for micro, rows in enumerate(ld.plan(ga)):
                out.append({"step": step, "dp_rank": rank, "micro_batch": micro,
                            "rows": [[list(x) for x in r] for r in rows]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.data.batches",
                                description="Print the samples each data-parallel rank fed at "
                                            "steps A..B of a run, from its data order.")
    p.add_argument("run_dir", help="run folder (its checkpoints hold the config and loader state)")
    p.add_argument("--steps", required=True, metavar="A:B", help="first and last step (inclusive)")
    p.add_argument("--checkpoints", default=None, help="checkpoint root (default RUN_DIR/checkpoints)")
    p.add_argument("--json", action="store_true", help="one JSON object per micro-batch")
    args = p.parse_args(argv)
    try:
        a, _, b = args.steps.partition(":")
        try:
            first, last = int(a), int(b or a)
        except ValueError:
            raise UsageError(f"--steps {args.steps!r}: expected A:B, two step numbers") from None
        res = batches(args.run_dir, first, last, args.checkpoints)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    for m in res:
        if args.json:
            print(json.dumps(m))
        else:
            rows = " | ".join(" ".join(f"{s}:{k}" for s, k in r) or "(padding)" for r in m["rows"])
            print(f"step {m['step']} dp {m['dp_rank']} micro-batch {m['micro_batch']}: {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
