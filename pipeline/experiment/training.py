"""Stages 1 and 2 of the experiment, training: the AR pretraining and the stage-2 runs (every
arm at every seed, the swept shares), their options, their inputs keys and the check of their
folders, run one by one or `parallel` at a time.

Owns: `TrainingStage`, methods of `recipe.Experiment` (mixed in; they read `config`, `out`,
`shards`, `pretrain_steps`, `finetune_steps`, `micro_batch_size`, `nproc`, `threads`,
`parallel`, `sweep`, `_keys`, set by its `__init__`, and its run names: `run_name`,
`run_dir`, `hf_dir`, `models`). Must not touch: the training loop (`pipeline.train`, run as a
subprocess), what identifies a run's inputs (`pipeline.experiment.reuse`).
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.experiment import reuse
from pipeline.experiment.stage import _log, _run_many, boundary_run, split_seed
from pipeline.experiment.tasks import ARM_OBJECTIVES, ARM_ROW_TOKENS, ARM_STEP_SCALE, ROW_TOKENS


class TrainingStage:
    """Stages 1 and 2 of `recipe.Experiment` (see the module docstring)."""

    def stage2_runs(self) -> list[str]:
        """Run names of stage 2: every model (`models`), then (with `sweep`) every swept
        share."""
        names = [self.run_name(m) for m in self.models()]
        if self.sweep:
            names += [boundary_run(f) for f in self.task.sweep_fractions]
        return list(dict.fromkeys(names))

    def _finished(self, name: str, steps: int) -> bool:
        from pipeline.checkpoint import find_latest
        latest = find_latest(self.run_dir(name) / "checkpoints")
        return latest is not None and latest.name == f"step_{steps:09d}"

    def train_overrides(self, name: str, steps: int, overrides: list[str]) -> list[str]:
        """The `key=value` options a training run is started with (after `--config`). An arm
        of `tasks.ARM_ROW_TOKENS` is fed rows of that length and `micro_batch_size x
        ROW_TOKENS / length` rows per step: the same tokens per step as every other arm."""
        rows, extra = self.micro_batch_size, []
        length = ARM_ROW_TOKENS.get(split_seed(name)[0])
        if length:
            if (self.micro_batch_size * ROW_TOKENS) % length:
                from pipeline.common.cli import UsageError
                raise UsageError(f"--micro-batch-size {self.micro_batch_size}: {name} needs "
                                 f"rows x {ROW_TOKENS} divisible by its row length {length}")
            rows, extra = self.micro_batch_size * ROW_TOKENS // length, [f"data.max_length={length}"]
        return [f"run_dir={self.run_dir(name)}", f"data.dir={self.shards}",
                f"train.max_steps={steps}", f"train.micro_batch_size={rows}"] + extra + list(
                    overrides)

    def train_command(self, name: str, steps: int, overrides: list[str]) -> list[str]:
        """The `pipeline.train` command line of a run (torchrun when `nproc` > 1)."""
        launch = ([sys.executable] if self.nproc == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(self.nproc)])
        return launch + ["-m", "pipeline.train", "--config", self.config] + \
            self.train_overrides(name, steps, overrides)

    def pretrain_overrides(self) -> list[str]:
        """Stage-1 options: AR from scratch."""
        return ["init.source=random", "objective.mode=ar",
                f"optim.warmup_steps={min(30, self.pretrain_steps // 10)}"]

    def training_plan(self) -> list[tuple[str, int, list[str]]]:
        """Every training run of this invocation as (run name, steps, overrides): stage 1,
        then stage 2 (`stage2_runs`)."""
        return ([("pretrain_ar", self.pretrain_steps, self.pretrain_overrides())]
                + [(r, self.stage2_steps(r), self.finetune_overrides(r))
                   for r in self.stage2_runs()])

    def stage2_steps(self, run: str) -> int:
        """Optimizer steps of a stage-2 run: `finetune_steps`, times `tasks.ARM_STEP_SCALE` of
        its arm (rounded) where the arm has one."""
        return round(self.finetune_steps * ARM_STEP_SCALE.get(split_seed(run)[0], 1))

    def run_inputs(self, name: str, steps: int, overrides: list[str]) -> dict:
        """The inputs record of a run (`pipeline.experiment.reuse.run_inputs`); a stage-2 run's
        `init` is the pretraining's key."""
        cfg = reuse.resolved_config(self.config, self.train_overrides(name, steps, overrides))
        init = None if name == "pretrain_ar" else self.key("pretrain_ar")
        return reuse.run_inputs(cfg, self.data_fingerprint(), self.nproc, init)

    def key(self, name: str) -> str:
        """The inputs key of a run of `training_plan` (by run or model name)."""
        name = self.run_name(name)
        if name not in self._keys:
            plan = {n: (st, ov) for n, st, ov in self.training_plan()}
            if name not in plan:    # a model of another invocation's arms or seeds
                plan[name] = (self.stage2_steps(name), self.finetune_overrides(name))
            self._keys[name] = reuse.inputs_key(self.run_inputs(name, *plan[name]))
        return self._keys[name]

    def check_runs(self) -> dict[str, str]:
        """Check every run folder of `training_plan` against its inputs before any training
        (`reuse.check_run`: new, same, adopted), so that a folder of other inputs stops the
        invocation before it spends anything.

        Raises:
            reuse.InputsMismatch: a folder holds a run of other inputs (one line).
        """
        out = {}
        for name, steps, overrides in self.training_plan():
            inputs = self.run_inputs(name, steps, overrides)
            self._keys[name] = reuse.inputs_key(inputs)
            out[name] = reuse.check_run(self.run_dir(name), inputs,
                                        init_of=lambda hf: self._keys.get(Path(hf).name))
            if out[name] == "adopted":
                _log(f"{self.run_dir(name)}: no {reuse.INPUTS}; its checkpoint recorded the same "
                     f"inputs, adopted")
        return out

    def stage_train(self, runs: list[tuple[str, int, list[str]]]):
        """Train the runs not finished yet, concurrently (`self.parallel`) or one by one (their
        folders checked by `check_runs` first). Returns False when every run was finished."""
        todo = []
        for name, steps, overrides in runs:
            if self._finished(name, steps):
                _log(f"train {name}: {steps} steps done with the same inputs, reused")
            else:
                todo.append(self.train_command(name, steps, overrides))
        if not todo:
            return False
        n = self.parallel or len(todo)
        for i in range(0, len(todo), n):
            _run_many(todo[i:i + n], self.threads)

    def finetune_overrides(self, run: str) -> list[str]:
        """Stage-2 options of a run: identical for every arm except the objective options
        (`tasks.ARM_OBJECTIVES`; `refusion_boundary_f<F>` adds the natural-order share F) and,
        for a run `<arm>_seed<N>`, `train.seed=N`.

        Raises:
            ValueError: an unknown arm.
        """
        base, seed = split_seed(run)
        if base.startswith("refusion_boundary_f"):
            objective = list(ARM_OBJECTIVES["refusion_boundary"]) + [
                f"objective.natural_order_fraction={base[len('refusion_boundary_f'):]}"]
        elif base in ARM_OBJECTIVES and base != "refusion_boundary":
            objective = list(ARM_OBJECTIVES[base])
        else:
            raise ValueError(f"unknown stage-2 run {run!r}")
        return ["init.source=hf", f"init.hf_path={self.hf_dir('pretrain_ar')}", *objective,
                "optim.lr=1.0e-3", "optim.min_lr=1.0e-4",
                f"optim.warmup_steps={min(30, self.finetune_steps // 10)}"] + (
                    [] if seed is None else [f"train.seed={seed}"])
