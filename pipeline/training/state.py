"""What a training run must carry across a restart besides weights and optimizer: progress
counters, the wandb run id, a deferred validation, the shard sets it trained on; and how a
resumed run's batch plan follows from its checkpoint.

Owns: `TrainState` (`state_dict()` / `load_state_dict()`: the keys of a checkpoint's
`client_state`; earlier checkpoints, without the newer keys, still load),
`checkpoint_client_state` (what the trainer saves with each checkpoint: TrainState + loader
state + run config + global batch) and
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
        shard_sets: the training shard sets the run went through, oldest first: one dict per
            set, `{"step": optimizer steps done when training on it began, "fingerprint": the
            loader's shard-set fingerprint, "data_dir": the folder, "epoch": the loader epoch
            it began at, "samples_per_epoch": its samples}` (a new one is appended when a run
            resumes on rebuilt shards with `data.on_shard_change=new_pass`). Empty until the
            trainer fills it (and in checkpoints written before it existed).
        data_phases: the data phases the run went through (`data.phase`), oldest first:
            `{"phase", "step": optimizer steps done when it began, "weights": {source name:
            normalized weight}}`. Empty in checkpoints written before it existed.
        lr_schedule: the learning-rate schedule in force (`pipeline.training.schedule.
            schedule_record`), or None until the trainer sets it (and in checkpoints written
            before it was recorded: the trainer then derives it from the saved run config).
    """

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    wandb_run_id: str | None = None
    eval_pending: bool = False
    shard_sets: list = dataclasses.field(default_factory=list)
    lr_schedule: dict | None = None
    data_phases: list = dataclasses.field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able dict of the fields (the keys a checkpoint's client_state holds)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's client_state (other keys are ignored; `wandb_run_id`,
        `eval_pending`, `shard_sets`, `lr_schedule` and `data_phases` default to None / False /
        [] / None / [] for
        checkpoints that lack them).

        Raises:
            KeyError: `step`, `consumed_samples` or `consumed_tokens` missing.
        """
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.consumed_tokens = int(state["consumed_tokens"])
        self.wandb_run_id = state.get("wandb_run_id")
        self.eval_pending = bool(state.get("eval_pending", False))
        self.shard_sets = [dict(s) for s in state.get("shard_sets", [])]
        self.lr_schedule = dict(state["lr_schedule"]) if state.get("lr_schedule") else None
        self.data_phases = [dict(p) for p in state.get("data_phases", [])]


    def track_shard_set(self, current: dict[str, Any], change: dict[str, Any] | None) -> None:
        """Bring `shard_sets` up to date when a run starts (after a resume, if any).

        Args:
            current: the set this run trains on: {"fingerprint", "data_dir", "epoch" (the
                loader's epoch now), "samples_per_epoch"}.
            change: what `ShardLoader.load_state_dict` returned: None when the set is the one
                the checkpoint was taken on (or a new run), else {"from", "from_dir", ...}.
        A new run (or a checkpoint written before `shard_sets`) starts the list with the first
        set at step 0; a change appends `current` at this run's `step`.
        """
        if not self.shard_sets:
            first = (dict(current) if change is None else
                     {"fingerprint": change["from"], "data_dir": change["from_dir"], "epoch": 0,
                      "samples_per_epoch": None})
            self.shard_sets.append({"step": 0, **first})
        if change is not None:
            self.shard_sets.append({"step": self.step, **current})


    def track_phase(self, phase: int, step: int, loader) -> None:
        """Append the data phase this run trains in to `data_phases` unless it is the last one.

        Args:
            phase: `data.phase`. step: optimizer steps done when it began (here).
            loader: the training `ShardLoader` (its `source_names`, `source_weights`).
        """
        if self.data_phases and self.data_phases[-1]["phase"] == phase:
            return
        self.data_phases.append({"phase": int(phase), "step": int(step), "weights": dict(
            zip(loader.source_names, (float(w) for w in loader.source_weights)))})


def checkpoint_client_state(state: TrainState, loader_state: dict, config: dict,
                            global_batch_size: int) -> dict[str, Any]:
    """The `client_state` the trainer saves with a checkpoint (`pipeline.checkpoint.store`):
    the TrainState fields (step, consumed_samples, consumed_tokens, wandb_run_id, eval_pending,
    shard_sets, lr_schedule, data_phases) plus `loader` (the loader's `state_dict()`), `config` (the resolved
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
