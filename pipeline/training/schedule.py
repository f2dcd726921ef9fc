"""The learning-rate schedule the trainer applies each optimizer step.

Owns: `lr_at`. Must not touch: the optimizer, the loop, checkpoints.
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to `min_lr`.

    Warmup: `lr * (step + 1) / warmup_steps` for `step < warmup_steps`. Then with
    `q = (step - warmup_steps) / max(1, max_steps - warmup_steps)` (clamped to [0, 1]):
    `min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * q))` (Loshchilov & Hutter 2017, SGDR, one cycle).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    q = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))
