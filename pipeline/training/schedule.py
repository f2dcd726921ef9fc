"""The learning-rate schedule the trainer applies each optimizer step, its record in a
checkpoint, and the check of a resumed run's schedule against that record.

Owns: `lr_at`, `LR_SCHEDULES`, `DECAY_SHAPES`, `wsd_decay_steps`, `schedule_record`,
`record_lr`, `schedule_change`. Must not touch: the optimizer, the loop, checkpoints.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

LR_SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")
# what a record holds besides `from_step`, in the order a refusal names changed keys
_RECORD_KEYS = ("schedule", "lr", "min_lr", "warmup_steps", "max_steps", "decay_steps",
                "decay_shape")
_KEY_NAMES = {"max_steps": "train.max_steps"}


def wsd_decay_steps(decay_steps: int | None, decay_fraction: float, max_steps: int) -> int:
    """Steps of a wsd schedule's decay: `decay_steps` when set, else
    `round(decay_fraction * max_steps)`, at least 1."""
    if decay_steps is not None:
        return int(decay_steps)
    return max(1, round(decay_fraction * max_steps))


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int,
          schedule: str = "cosine", decay_steps: int = 0, decay_shape: str = "linear") -> float:
    """Learning rate of optimizer step `step` (0-based).

    Warmup (both schedules): `lr * (step + 1) / warmup_steps` for `step < warmup_steps`.
    "cosine": with `q = (step - warmup_steps) / max(1, max_steps - warmup_steps)` (clamped to
    [0, 1]), `min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * q))` (Loshchilov & Hutter 2017,
    SGDR, one cycle).
    "wsd" (warmup-stable-decay; Hu et al. 2024, MiniCPM, arXiv 2404.06395): `lr` until
    `d0 = max_steps - decay_steps`, then with `q = (step - d0) / decay_steps` (clamped)
    `min_lr + (lr - min_lr) * f(q)`, `f` = `1 - q` ("linear"), `1 - sqrt(q)` ("1-sqrt", Hägele
    et al. 2024, arXiv 2405.18392) or `0.5 * (1 + cos(pi * q))` ("cosine").
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        q = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))
    if schedule != "wsd":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    start = max_steps - decay_steps
    if step < start:
        return lr
    q = min(1.0, (step - start) / max(1, decay_steps))
    f = {"linear": 1.0 - q, "1-sqrt": 1.0 - math.sqrt(q),
         "cosine": 0.5 * (1.0 + math.cos(math.pi * q))}[decay_shape]
    return min_lr + (lr - min_lr) * f


def schedule_record(optim: Mapping[str, Any], max_steps: int, from_step: int = 0) -> dict:
    """The schedule a run config gives, as saved in a checkpoint (`TrainState.lr_schedule`).

    Args:
        optim: the run config's `optim` section (a dict or DictConfig; keys missing from an old
            config take the defaults: cosine).
        max_steps: `train.max_steps`.
        from_step: the first optimizer step (0-based) this schedule applied to.
    Returns:
        `{"schedule", "lr", "min_lr", "warmup_steps", "max_steps", "decay_steps" (wsd: resolved,
        cosine: 0), "decay_shape", "from_step"}`; `record_lr(step, record)` evaluates it.
    """
    schedule = optim.get("schedule", "cosine")
    wsd = schedule == "wsd"
    return {"schedule": schedule, "lr": float(optim["lr"]), "min_lr": float(optim["min_lr"]),
            "warmup_steps": int(optim["warmup_steps"]), "max_steps": int(max_steps),
            "decay_steps": (wsd_decay_steps(optim.get("decay_steps"),
                                            float(optim.get("decay_fraction", 0.1)), max_steps)
                            if wsd else 0),
            "decay_shape": optim.get("decay_shape", "linear") if wsd else "linear",
            "from_step": int(from_step)}


def record_lr(step: int, record: Mapping[str, Any]) -> float:
    """`lr_at(step)` of a `schedule_record`."""
    return lr_at(step, *(record[k] for k in ("lr", "min_lr", "warmup_steps", "max_steps")),
                 schedule=record["schedule"], decay_steps=record["decay_steps"],
                 decay_shape=record["decay_shape"])


def schedule_change(saved: Mapping[str, Any], now: Mapping[str, Any], step: int) -> str | None:
    """Why resuming at `step` (optimizer steps done) with schedule `now` would move the lr, or None.

    The lr may not change at any step the saved schedule applied to (`saved["from_step"]` ..
    `step - 1`) nor at the next one (`step`) when the saved schedule planned it (`step <
    saved["max_steps"]`): extending a wsd run before its decay began passes, extending a
    cosine run past its warmup or changing `optim.lr` does not.

    Returns:
        None, or one phrase naming only the keys that differ and the first step (1-based, as
        metrics.jsonl counts) whose lr would change, e.g. "train.max_steps 10 -> 20: the lr of
        step 4 would be 0.000992 instead of 0.000962".
    """
    if all(saved.get(k) == now[k] for k in _RECORD_KEYS):
        return None
    for s in range(int(saved.get("from_step", 0)), min(step + 1, int(saved["max_steps"]))):
        old, new = record_lr(s, saved), record_lr(s, now)
        if not math.isclose(old, new, rel_tol=1e-12, abs_tol=0.0):
            keys = ", ".join(f"{_KEY_NAMES.get(k, 'optim.' + k)} {saved.get(k)} -> {now[k]}"
                             for k in _RECORD_KEYS if saved.get(k) != now[k])
            return f"{keys}: the lr of step {s + 1} would be {new:.3g} instead of {old:.3g}"
    return None
