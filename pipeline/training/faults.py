"""Fault injection in the training step (the run config's `debug` section; what each setting
does is said in `pipeline.config.DebugSection`): one call per place the step loop injects at.
Never active in a real run (every setting's default does nothing). Must not touch: anything but
sleeping, hanging and the loss value it is handed.
"""
from __future__ import annotations

import time


class Faults:
    """The `debug` settings of this rank, with the timing they need across one step.

    Args:
        debug: the run config's `debug` section.
        rank: this process's global rank.
    """

    def __init__(self, debug, rank: int):
        self.debug, self.rank = debug, rank
        self._steps = 0        # steps begun by this process (the first one may be slowed)
        self._t_work = 0.0     # perf_counter at the step's start, after `slow_first_step_s`

    def start_step(self) -> None:
        """Call when an optimizer step begins."""
        self._t_work = time.perf_counter()
        self._steps += 1

    def before_batch(self, micro: int, step_no: int) -> None:
        """Before micro-batch `micro` of step `step_no` (1-based) is read: `slow_first_step_s`
        (first micro-batch of this process's first step), `hang_rank` / `hang_at_step` (never
        returns)."""
        d = self.debug
        if micro == 0 and self._steps == 1 and d.slow_first_step_s:
            time.sleep(d.slow_first_step_s)
            self._t_work = time.perf_counter()
        if d.hang_rank == self.rank and step_no == d.hang_at_step:
            while True:   # alive, stuck for good
                time.sleep(3600)

    def loss(self, loss, micro: int, step_no: int):
        """The micro-batch's loss, NaN on rank 0's first micro-batch of a step in
        `nan_at_steps`."""
        if micro == 0 and self.rank == 0 and step_no in set(self.debug.nan_at_steps):
            return loss * float("nan")
        return loss

    def before_collective(self) -> None:
        """Before the step's all-reduce: the straggler's sleep (`slow_rank`), `slow_rank_s` plus
        `slow_rank_factor` x this rank's time in the step so far."""
        d = self.debug
        if d.slow_rank == self.rank:
            time.sleep(d.slow_rank_s + d.slow_rank_factor * (time.perf_counter() - self._t_work))


def slow_validation(debug) -> None:
    """In each validation micro-batch: sleep `debug.slow_eval_s` seconds."""
    if debug.slow_eval_s:
        time.sleep(float(debug.slow_eval_s))
