"""The training job's start-up: checks that stop a run before (or right after) anything is built,
and the process's seeds and logging.

Owns: the per-GPU memory check (`memory_check`, before any process group), the write probe of
every folder the run writes (`check_write_access`), the passes each data source would need
(`check_source_epochs`), a resumed run's learning-rate schedule against its checkpoint's
(`resumed_schedule`), `seed_everything`, `setup_logging`. Called by `pipeline.train.Trainer.setup`
and `main`; must not touch the step, the loop or checkpoints.
"""
from __future__ import annotations

import logging
import os
import sys

from pipeline.training.schedule import schedule_change, schedule_record
from pipeline.training.state import TrainError

log = logging.getLogger("pipeline.train")


def memory_check(cfg, plan, rank0: bool) -> list[str]:
    """The per-GPU memory plan (`pipeline.training.memory_plan`) and, on CUDA, the refusal of a
    plan above the device's memory before anything is built or loaded (`train.memory_check`:
    error / warn / off; `train.gpu_memory_gib` or the CUDA device's total memory; no check on
    the CPU).

    Returns:
        The lines rank 0 prints once it holds the run lock (`Trainer.setup`): the plan, and
        with `warn` the warning line; [] on other ranks and with `off`.
    Raises:
        ConfigError: `train.memory_check=error` and the plan exceeds the memory (one line; rank
            0 prints the plan first, as the refusal's reasons).
    """
    mode = str(cfg.train.memory_check)
    if mode == "off":
        return []
    import torch

    from pipeline.config import ConfigError
    from pipeline.training.memory_plan import GIB, format_plan, plan_for_run
    cuda = torch.cuda.is_available()
    gib = cfg.train.gpu_memory_gib
    gpu_bytes = int(gib * GIB) if gib is not None else (
        torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))
                                         % torch.cuda.device_count()).total_memory
        if cuda else None)
    mp = plan_for_run(cfg, tp=plan.tp_size, dp=plan.dp_size, model_fields=plan.model_fields,
                      row_length=plan.row_length, device="cuda" if cuda else "cpu",
                      gpu_bytes=gpu_bytes if cuda else None)
    # not prefixed "pipeline.": those lines are the job's outcome (errors, warnings)
    lines = format_plan(mp) if rank0 else []
    if not cuda or gpu_bytes is None or mp.total <= gpu_bytes:
        return lines
    line = (f"train.memory_check: the memory plan needs {mp.total / GIB:.1f} GiB per GPU, more "
            f"than the {gpu_bytes / GIB:.1f} GiB the GPU has (largest micro-batch that fits: "
            f"{mp.max_micro_batch}); lower train.micro_batch_size or data.max_length, set "
            f"train.activation_checkpointing, or train.memory_check=warn to run anyway")
    if mode == "error":
        if rank0:
            print("\n".join(lines), file=sys.stderr, flush=True)
        raise ConfigError(line)
    return lines + ([f"pipeline.train: warning: {line}"] if rank0 else [])


def check_write_access(run_dir, ckdir: str, rank0: bool) -> None:
    """Before anything is built (collective): every rank writes a probe file where it will write
    (`pipeline.common.diskspace.check_writable`): rank 0 in the run folder (run.lock,
    metrics.jsonl, which it also opens for appending, wandb files), every rank in the
    checkpoint folder (each writes its own files there; both folders are created if
    missing). The ranks compare results, and any failure stops every rank with the same
    one line naming the setting, the folder, the first failing rank, the cause (read-only
    filesystem, permission denied, ...) and what to do: `NotWritableError` (exit 2, or 4
    for a full disk or quota)."""
    import torch.distributed as dist
    from pipeline.common.diskspace import NotWritableError, check_writable
    from pipeline.monitor import METRICS_FILE
    from pipeline.training.watchdog import PROGRESS_DIR
    # every rank: the watchdog's progress records (`pipeline.training.watchdog`)
    targets = [("run_dir", os.path.join(str(run_dir), PROGRESS_DIR), ()),
               ("checkpoint.dir", ckdir, ())]
    if rank0:
        targets.insert(0, ("run_dir", run_dir, (METRICS_FILE,)))
    mine = None
    for setting, folder, files in targets:
        failure = check_writable(folder, files)
        if failure is not None:
            mine = (setting, str(folder), failure)
            break
    box = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, mine)
    bad = [(r, m) for r, m in enumerate(box) if m is not None]
    if bad:
        rank, (setting, folder, failure) = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise NotWritableError(
            f"{setting} {folder} is not writable on rank {rank}{more}: {failure.cause}; "
            f"{failure.remedy(setting)} (checked at start-up, nothing was trained)", failure)


def check_source_epochs(loader, cfg, plan, step: int, rank0: bool) -> None:
    """The passes over each source's training split the rest of the run (optimizer steps `step`
    .. `train.max_steps`) makes at most (`pipeline.data.mixture.epochs_needed`: every row of
    every remaining step full), one log line per source on rank 0; a source whose `max_epochs`
    that exceeds is refused.

    Raises:
        TrainError: one line naming the source, its tokens and the passes it would need.
    """
    from pipeline.data.mixture import epochs_needed
    ld = loader
    steps = max(0, int(cfg.train.max_steps) - step)
    fed = steps * plan.global_batch_size * plan.row_length
    done = ld.source_epochs
    need = epochs_needed([m["tokens"] for m in ld.sources], ld.source_weights, fed)
    for m, e in zip(ld.sources, need):
        total = done.get(m["name"], 0) + e
        if rank0 and len(ld.sources) > 1:
            log.info("data source %s: weight %.3g, %d tokens, <= %.2f passes by step %d",
                     m["name"], m["weight"], m["tokens"], total, cfg.train.max_steps)
        if m["max_epochs"] is not None and total > float(m["max_epochs"]):
            raise TrainError(f"data.sources: source {m['name']!r} ({m['tokens']} tokens, weight "
                             f"{m['weight']:.3g}) would be read up to {total:.2f} times by step "
                             f"{cfg.train.max_steps}, more than its max_epochs "
                             f"{m['max_epochs']:g}; lower its weight or train.max_steps, or "
                             f"raise max_epochs")


def resumed_schedule(saved: dict | None, saved_config: dict, cfg, step: int,
                     explicit: str | None) -> dict:
    """The learning-rate schedule record a run resumed at `step` (optimizer steps done) goes on
    with, checked against the checkpoint's (`saved`, the `TrainState.lr_schedule` it recorded;
    None for a checkpoint that predates the record: its saved run config `saved_config` gives
    it) by `pipeline.training.schedule.schedule_change`. A change that would move an lr is
    refused unless `optim.override_schedule` or a new data pass or phase makes it explicit
    (`explicit`: the setting that did, or None); then the new schedule applies from this step,
    said in one line.

    Raises:
        TrainError: the schedule changed without either (one line naming the keys).
    """
    saved = saved or schedule_record(saved_config["optim"], saved_config["train"]["max_steps"])
    now = schedule_record(cfg.optim, cfg.train.max_steps, from_step=saved.get("from_step", 0))
    why = schedule_change(saved, now, step)
    if why is None:
        return now
    if not (cfg.optim.override_schedule or explicit):
        raise TrainError(f"optim: the learning-rate schedule differs from the checkpoint's "
                         f"({why}); set optim.override_schedule=true to apply the new schedule "
                         f"from step {step + 1}, or resume with the saved settings")
    log.info("learning-rate schedule changed from step %d (%s; %s)", step + 1, why,
             "optim.override_schedule" if cfg.optim.override_schedule else explicit)
    return {**now, "from_step": step}


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's (`seed` mod 2**32) and torch's generators."""
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def setup_logging(rank0: bool) -> None:
    """Our INFO lines on rank 0's stdout; other ranks print warnings only. DeepSpeed's logger is
    turned down to warnings (its per-step chatter; third-party warnings: `pipeline/__init__.py`)."""
    logger = logging.getLogger("pipeline")
    logger.handlers.clear()
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO if rank0 else logging.WARNING)
    logger.propagate = False
    try:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
    except Exception:
        pass
