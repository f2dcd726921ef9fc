"""What a training run must carry across a restart besides weights and optimizer: progress
counters, the wandb run id, a deferred validation; and how a resumed run's batch plan follows
from its checkpoint.

Owns: `TrainState` (`state_dict()` / `load_state_dict()`: the keys of a checkpoint's
`client_state`, unchanged from earlier checkpoints), `checkpoint_client_state` (what the trainer
saves with each checkpoint: TrainState + loader state + run config + global batch) and
`plan_for_resume` (keeping the global batch when a checkpoint is resumed on another layout).
Must not touch: the checkpoint files (`pipeline.checkpoint`), the loader's internals (its state
is opaque here), the loop.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pipeline.train")


class TrainError(RuntimeError):
    """A user-facing problem found after start-up (an HF folder that does not fit the model,
    wandb cannot start, a run directory held by another job, a global batch that cannot be
    kept on a new layout); raised on every rank, reported as one line, exit code 2."""


@dataclass
class TrainState:
    """Progress of a run, saved in every checkpoint and restored on resume.

    Attributes:
        step: optimizer steps done.
        consumed_samples: rows (packed sequences) consumed over all data-parallel ranks.
        consumed_tokens: non-padding tokens consumed over all data-parallel ranks.
        wandb_run_id: the wandb run this run logs to (resumed under the same id), or None.
        eval_pending: a validation due at `step` that a stop signal deferred; the resumed run
            runs it first (`pipeline.train.should_evaluate`).
    """

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    wandb_run_id: str | None = None
    eval_pending: bool = False

    def state_dict(self) -> dict[str, Any]:
        """JSON-able dict of the fields (the keys a checkpoint's client_state holds)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's client_state (other keys are ignored; `wandb_run_id`
        and `eval_pending` default to None / False for checkpoints that lack them).

        Raises:
            KeyError: `step`, `consumed_samples` or `consumed_tokens` missing.
        """
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.consumed_tokens = int(state["consumed_tokens"])
        self.wandb_run_id = state.get("wandb_run_id")
        self.eval_pending = bool(state.get("eval_pending", False))


def checkpoint_client_state(state: TrainState, loader_state: dict, config: dict,
                            global_batch_size: int) -> dict[str, Any]:
    """The `client_state` the trainer saves with a checkpoint (`pipeline.checkpoint.store`):
    the TrainState fields plus `loader` (the loader's `state_dict()`), `config` (the resolved
    run config, read back by export and evaluation) and `global_batch_size` (kept when resuming
    on another layout)."""
    return {**state.state_dict(), "loader": loader_state, "config": config,
            "global_batch_size": int(global_batch_size)}


def plan_for_resume(plan, step_dir):
    """The plan for resuming `step_dir` on this layout with `checkpoint.reshard`: when the
    checkpoint was saved on another layout with another global batch, keep the saved global
    batch and recompute gradient accumulation (global = micro-batch x accumulation x DP).

    Args:
        plan: `pipeline.config.Plan` of this run.
        step_dir: the checkpoint step folder to resume.
    Returns:
        `plan` itself, or a copy with `grad_accum_steps` and `global_batch_size` changed.
    Raises:
        TrainError: the saved global batch is not a multiple of micro-batch x DP size here.
    """
    from pipeline.checkpoint.reshard import saved_global_batch
    from pipeline.checkpoint.store import META
    meta = json.loads((Path(step_dir) / META).read_text())
    if (meta["world_size"], meta["tp_size"]) == (plan.world_size, plan.tp_size):
        return plan
    gbs = saved_global_batch(step_dir)
    if gbs is None or gbs == plan.global_batch_size:
        return plan
    per = plan.micro_batch_size * plan.dp_size
    if gbs % per:
        raise TrainError(f"checkpoint.reshard: the run's global batch {gbs} cannot be formed "
                         f"with train.micro_batch_size={plan.micro_batch_size} on data-parallel "
                         f"size {plan.dp_size} (global batch = micro-batch x grad accumulation x "
                         f"DP); pick a micro-batch size with {gbs} a multiple of it x {plan.dp_size}")
    log.info("checkpoint.reshard: keeping the run's global batch %d (was %d on this layout): "
             "gradient accumulation %d -> %d", gbs, plan.global_batch_size,
             plan.grad_accum_steps, gbs // per)
    return dataclasses.replace(plan, grad_accum_steps=gbs // per, global_batch_size=gbs)
