"""The scaled-down ReFusion recipe, ReFusion vs AR, end to end: `make experiment`.

    python -m pipeline.experiment [--task math|code|mbpp] [--output outputs/experiment/<task>]
        [--arms A,B,...] [--seeds N,M,...] [--grid default|full|lossless] [--examples N]
        [--pretrain-steps N] [--finetune-steps N] [--micro-batch-size B] [--threads T]
        [--nproc P] [--parallel [N]] [--sweep] [--natural-order-fraction F] [--only-report]

Owns: the CLI, the order of the stages and their timings (`Experiment.run`, `_timed`), the
names and folders of runs, models and results (`Experiment`). Must not touch: training,
decoding, evaluation loops, plotting of one run (it calls `pipeline.train`,
`pipeline.export` and data_prep as subprocesses, `pipeline.evaluate` and `pipeline.report` as
libraries). Each stage's work and reuse decision is a class `Experiment` mixes in:
`pipeline.experiment.data` (0), `.training` (1, 2), `.export`, `.evaluation` (2b, 3, 3b),
`.report` (4); what they share is in `.stage`. The task's fixed choices are in
`pipeline.experiment.tasks`, what identifies a stage's inputs in `pipeline.experiment.reuse`,
the diagnosis's measures in `pipeline.experiment.diagnosis`, the report text and figures in
`pipeline.experiment.writeup`.

Stages (each reused when its result exists and was made from the same inputs, so an
interrupted run resumes with the same command, and a new arm or seed reuses the pretraining;
the trainer itself resumes from its latest checkpoint):
0. data: the task's tokenizer and shards (math, mbpp: the problems first). Then every run folder of
   this invocation is checked against its inputs (`check_runs`, `reuse.check_run`): a folder
   of other inputs stops it here (one line, exit code 2).
1. `pretrain_ar`: a small Qwen3 (the task's run config) from scratch, `objective.mode=ar`.
2. export it (`pipeline.export`); from it, with equal compute (same steps, batch, data order
   and learning-rate schedule), the arms (`--arms`, default the task's; objective options in
   `tasks.ARM_OBJECTIVES`): `refusion`, `ar_continued` (always), for the math task
   `refusion_boundary` (`objective.boundary_labels=true`, `objective.natural_order_fraction=F`;
   its run folder is `runs/refusion_boundary_f<F>`), `dual_all`, `dual_refusion`,
   `dual_all_ar4`, `dual_all_ar16`, `dual_all_ar64` (`dual_all` with `objective.ar_weight`
   4 / 16 / 64), `dual_refusion_ar16` (`dual_refusion` with weight 16), the levers
   `dual_refusion_ar16_copy50` (`objective.dual_copy_scale=0.5`) and `dual_refusion_ar16_long`
   (4/3 the steps, `tasks.ARM_STEP_SCALE`: not equal compute); each once per
   seed of `--seeds` (`runs/<arm>_seed<N>` for a seed other than the config's); export each.
   With `--sweep`, one `refusion_boundary` run per share of `task.sweep_fractions`.
2b. only with `--sweep`: AR decoding and `task.sweep_setting` of every swept share (and AR
   decoding of `ar_continued`) on `task.sweep_set`; `choose_fraction` picks F by the rule fixed
   in `pipeline.experiment.tasks`, the rest of the run uses it, and `sweep.json` records it.
3. evaluation: the validation loss of every stage-2 model under the ReFusion objective
   (`pipeline.training.validation.validation_loss`), then every decode of `jobs()` (the task's
   jobs for `--grid` and the arms, at every seed; the dual arms decode draft_ahead and
   draft_every with bidirectional mask attention, `tasks.arm_setting`), each cached as JSON under
   `<out>/eval/<set>/<model>__<setting>.json` with every decoded answer and whether it was
   right, and the key of the export decoded.
3b. diagnosis: `slot_acceptance` (teacher-forced plan + verify profile) of every model on the
   main held-out set, per slot size; cached under `<out>/diagnose/`.
   With `--parallel` other than 1, stages 3 and 3b first run in `eval_workers()` processes of
   `--threads` threads each (`stage_eval_workers`), which take their items (a validation loss,
   a decode, a profile) one at a time through claim files, so the work balances itself; the
   decodes at batch 1 (a latency figure) are left to this process, which runs them alone
   after the workers.
4. `report.md`, `frontier.png`, `loss.png`; `timings.json` records every stage of the
   invocation (`_timed`).
Exit codes: 0 done; 1 a stage failed (its command and exit code on stderr); 2 bad options or
a folder of other inputs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.common.cli import EXIT_USAGE, hidden_alias
from pipeline.common.atomic_io import write_json
from pipeline.experiment import reuse
from pipeline.experiment.data import DataStage
from pipeline.experiment.evaluation import EvaluationStage
from pipeline.experiment.export import ExportStage
from pipeline.experiment.report import ReportStage
from pipeline.experiment.stage import SKIPPED, StageError, _log, boundary_run, split_seed
from pipeline.experiment.tasks import ARM_OBJECTIVES, GRIDS, TASKS, Setting, Task
from pipeline.experiment.training import TrainingStage


def parse_arms(text: str) -> list[str]:
    """`--arms A,B,...`: the names, in order, each once; `ar_continued` (the AR baseline every
    ratio needs) appended when missing.

    Raises:
        UsageError: an empty list or an unknown arm (one line naming it and the known ones).
    """
    from pipeline.common.cli import UsageError
    arms = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in arms if a not in ARM_OBJECTIVES]
    if not arms or bad:
        raise UsageError(f"--arms {text!r}: unknown arm {bad[0] if bad else '(none given)'}; "
                         f"known: {', '.join(ARM_OBJECTIVES)}")
    return arms + ([] if "ar_continued" in arms else ["ar_continued"])


def parse_seeds(text: str) -> list[int]:
    """`--seeds 1234,1235`: distinct integers >= 0, in order.

    Raises:
        UsageError: an empty list, a non-integer, a negative or repeated seed (one line).
    """
    from pipeline.common.cli import UsageError
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        seeds = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--seeds {text!r}: expected integers separated by commas") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: expected distinct integers >= 0")
    return seeds


class Experiment(DataStage, TrainingStage, ExportStage, EvaluationStage, ReportStage):
    """The stages of one task over one output folder; see the module docstring. Each stage's
    methods come from its mixin (`DataStage`, `TrainingStage`, `ExportStage`, `EvaluationStage`,
    `ReportStage`); this class holds the state they share, set here, and the names of runs,
    models and results.

    Args:
        task: a `pipeline.experiment.tasks.Task` (or its name).
        out: output folder (created; default `outputs/experiment/<task>`).
        pretrain_steps, finetune_steps: optimizer steps of stage 1 and of each stage-2 run
            (default: the task's).
        threads: torch threads per training process (OMP_NUM_THREADS) and for evaluation.
        nproc: training processes (torchrun, DeepSpeed over the data-parallel group).
        micro_batch_size: packed rows per optimizer step (all runs; default the task's).
        parallel: stage-2 runs trained at the same time (1: one by one; 0 or True: all).
        config: the run config YAML shared by the training runs (default the task's).
        sweep: also train and compare every share of `task.sweep_fractions` (stage 2b).
        natural_order_fraction: the `refusion_boundary` arm's share (default: the one a
            `--sweep` of this folder chose (`sweep.json`), else the task's; `--sweep` replaces
            it by the one it chooses).
        worker: True in an evaluation worker process (`stage_eval_workers`): it takes only
            unclaimed items and leaves the batch-1 decodes to the parent.
        arms: the stage-2 arms (`parse_arms`; default the task's); `ar_continued` is always
            among them.
        seeds: stage-2 seeds (`train.seed`); default: the run config's. The run of the
            config's seed is `runs/<arm>`, another's `runs/<arm>_seed<N>`; all start from the
            one AR pretraining.
        grid: "default" (the task's `default_grid`), "full" (`Task.jobs`) or "lossless" (the
            default grid's draft_ahead / draft_every settings: `Task.arm_settings`).
        limit_examples: evaluate on the first N examples of each held-out set only (0: all);
            results under `eval_first<N>/`, `diagnose_first<N>/`.
    """

    def __init__(self, task: Task | str, out: str | None = None,
                 pretrain_steps: int | None = None, finetune_steps: int | None = None,
                 threads: int = 2, nproc: int = 1, micro_batch_size: int | None = None,
                 parallel: int | bool = 1, config: str | None = None, sweep: bool = False,
                 natural_order_fraction: float | None = None, worker: bool = False,
                 arms=None, seeds=None, grid: str = "default", limit_examples: int = 0):
        self.task = TASKS[task] if isinstance(task, str) else task
        t = self.task
        self.arms = list(arms) if arms else list(t.arms)
        if "ar_continued" not in self.arms:
            self.arms.append("ar_continued")
        if grid not in GRIDS:
            raise ValueError(f"grid {grid!r} is not one of {', '.join(GRIDS)}")
        self.grid = grid
        self._seeds = list(seeds) if seeds else None
        self._keys: dict[str, str] = {}
        self._data_fp: str | None = None
        self.stage_status: dict[str, str] = {}    # this invocation: stage -> "ran" | "reused"
        self.out = Path(out or f"outputs/experiment/{t.name}")
        # a quick check on the first N problems of each set: its results in folders of their
        # own, never mixed with those of the whole sets
        self.limit_examples = int(limit_examples or 0)
        suffix = f"_first{self.limit_examples}" if self.limit_examples else ""
        self.eval_dir = self.out / f"eval{suffix}"
        self.diagnose_dir = self.out / f"diagnose{suffix}"
        self.pretrain_steps = pretrain_steps or t.pretrain_steps
        self.finetune_steps = finetune_steps or t.finetune_steps
        self.micro_batch_size = micro_batch_size or t.micro_batch_size
        self.threads, self.nproc = threads, nproc
        self.parallel = 0 if parallel is True else 1 if parallel is False else int(parallel)
        self.sweep = sweep
        self.worker = worker
        # the share a `--sweep` of this folder chose, else the task's default
        chosen = self.out / "sweep.json"
        default = (json.loads(chosen.read_text())["chosen"] if chosen.is_file()
                   else t.natural_order_fraction)
        self.fraction = (default if natural_order_fraction is None
                         else float(natural_order_fraction))
        self.config = config or t.config
        self.shards = t.shards(self.out)
        self.timings_path = self.out / "timings.json"
        self.timings = (json.loads(self.timings_path.read_text())
                        if self.timings_path.is_file() else {})
        self._examples: dict[str, list[dict]] = {}
        self._missing_modes: set[str] = set()

    # ---------------------------------------------------------------- bookkeeping
    def _timed(self, name: str, fn, processes: int = 1) -> None:
        """Run a stage and record it in `timings.json`: {stage: {"status": "ran" | "reused"
        (the stage returned False: its result was there) | "skipped" (it returned SKIPPED:
        not asked for by the options), "seconds" (wall, this invocation),
        "threads" (torch threads per process), "processes" (at once), "date" (UTC, ISO
        8601)}, and for a reused stage "last_run": the record of when it last ran, if known}.
        An older file's bare numbers are read as records of stages that ran."""
        t0 = time.time()
        done = fn()
        status = "reused" if done is False else "skipped" if done == SKIPPED else "ran"
        rec = {"status": status, "seconds": round(time.time() - t0, 1),
               "threads": self.threads, "processes": processes,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        old = getattr(self, "_last_timings", self.timings).get(name)
        if isinstance(old, (int, float)):
            old = {"status": "ran", "seconds": float(old)}
        if status == "reused" and isinstance(old, dict):
            last = old if old.get("status") == "ran" else old.get("last_run")
            if last:
                rec["last_run"] = {k: v for k, v in last.items() if k != "last_run"}
        self.timings[name] = rec
        self.stage_status[name] = status
        write_json(self.timings_path, self.timings, indent=1)

    @property
    def default_seed(self) -> int:
        """`train.seed` of the run config."""
        if not hasattr(self, "_default_seed"):
            self._default_seed = int(reuse.resolved_config(self.config, [])["train"]["seed"])
        return self._default_seed

    @property
    def seeds(self) -> list[int]:
        """The stage-2 seeds (default: the run config's)."""
        return self._seeds or [self.default_seed]

    def model_name(self, arm: str, seed: int) -> str:
        """A stage-2 model's name: the arm, with `_seed<N>` unless `seed` is the config's."""
        return arm if seed == self.default_seed else f"{arm}_seed{seed}"

    def models(self, arms=None) -> list[str]:
        """Every stage-2 model (each arm at each seed), seed by seed."""
        return [self.model_name(a, s) for s in self.seeds for a in (arms or self.arms)]

    def jobs(self) -> list[tuple[str, str, Setting]]:
        """The evaluation's decodes (model, set, setting): `task.jobs(arms, grid)` for every
        seed, the models named by `model_name`."""
        base = self.task.jobs(self.arms, self.grid)
        return [(self.model_name(m, seed), n, s) for seed in self.seeds for m, n, s in base]

    def run_name(self, name: str) -> str:
        """The folder name of a model or run: `refusion_boundary` is the run of its share
        (`refusion_boundary_f<F>`, then any `_seed<N>`)."""
        base, seed = split_seed(name)
        if base != "refusion_boundary":
            return name
        return boundary_run(self.fraction) + ("" if seed is None else f"_seed{seed}")

    def run_dir(self, name: str) -> Path:
        """`<out>/runs/<run_name(name)>`: a run's folder (checkpoints, metrics, inputs)."""
        return self.out / "runs" / self.run_name(name)

    def hf_dir(self, name: str) -> Path:
        """`<out>/hf/<run_name(name)>`: the export of a run."""
        return self.out / "hf" / self.run_name(name)

    def eval_path(self, model: str, set_name: str, s: Setting) -> Path:
        """`<eval_dir>/<set>/<model>__<setting name>.json`: the cached result of a decode."""
        return self.eval_dir / set_name / f"{model}__{s.name()}.json"

    def run(self) -> Path:
        """Every stage in order (the module docstring); every run folder is checked against
        its inputs (`check_runs`) before the first training starts.

        Raises:
            StageError: a stage's command failed; reuse.InputsMismatch: a folder of other
                inputs.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        checked = (self.shards / "manifest.json").is_file()
        if checked:                # before anything is written, timings.json included
            self.check_runs()
        self.timings = {}          # this invocation's record (`_timed`) replaces the last one
        old = json.loads(self.timings_path.read_text()) if self.timings_path.is_file() else {}
        self._last_timings = old if isinstance(old, dict) else {}
        self._timed("data", self.stage_data)
        if not checked or self.stage_status["data"] == "ran":   # the shards may have changed
            self._data_fp, self._keys = None, {}
            self.check_runs()
        plan = self.training_plan()
        self._timed("train pretrain_ar", lambda: self.stage_train(plan[:1]), self.nproc)
        self._timed("export pretrain_ar", lambda: self.stage_export("pretrain_ar"))
        stage2 = plan[1:]
        if self.parallel == 1:
            for run in stage2:
                self._timed(f"train {run[0]}", lambda: self.stage_train([run]), self.nproc)
        else:
            self._timed("train stage 2", lambda: self.stage_train(stage2),
                        min(self.parallel or len(stage2), len(stage2)) * self.nproc)
        for name, _, _ in stage2:
            self._timed(f"export {name}", lambda: self.stage_export(name))
        self._timed("sweep", self.stage_sweep)
        self._timed("evaluate and diagnose (workers)", self.stage_eval_workers,
                    self.eval_workers())
        self._timed("evaluate", self.stage_eval)
        self._timed("diagnose", self.stage_diagnose)
        return self.stage_report()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.experiment",
                                description="ReFusion vs AR, scaled down (issues 10 and 20).")
    p.add_argument("--task", choices=sorted(TASKS), default="math",
                   help="math (default): GSM8K-form word problems; code: stdlib functions; "
                        "mbpp: MBPP-form code problems judged by execution")
    p.add_argument("--output", dest="out", default=None,
                   help="output folder (default outputs/experiment/TASK)")
    hidden_alias(p, "--out", dest="out")
    p.add_argument("--config", default=None, help="run config (default: the task's)")
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="default: the task's (math 2400, code 3000, mbpp 2400)")
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="steps of each stage-2 run (default: the task's, 1500)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows of 256 tokens per optimizer step, all three runs (default 8)")
    p.add_argument("--parallel", nargs="?", type=int, const=0, default=1, metavar="N",
                   help="train N stage-2 runs at a time, each with --threads (no N: all), "
                        "then evaluate in N processes (at most cores / --threads)")
    p.add_argument("--eval-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sweep", action="store_true",
                   help="also train every natural-order share of the task's sweep and choose "
                        "refusion_boundary's by the task's rule (writes sweep.json)")
    p.add_argument("--natural-order-fraction", type=float, default=None, metavar="F",
                   help="refusion_boundary's natural-order share (default: the task's)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads per process (default 2)")
    p.add_argument("--nproc", type=int, default=1, help="training processes (default 1)")
    p.add_argument("--only-report", action="store_true",
                   help="rewrite report.md and the figures from what is there")
    p.add_argument("--arms", default=None, metavar="A,B,...",
                   help="stage-2 arms to train and evaluate (default: the task's; "
                        "ar_continued is always added): " + ", ".join(ARM_OBJECTIVES))
    p.add_argument("--seeds", default=None, metavar="N,M,...",
                   help="stage-2 seeds (train.seed; default: the run config's): one run per "
                        "arm and seed, runs/<arm>_seed<N> for a seed other than the config's")
    hidden_alias(p, "--seed", dest="seeds")
    p.add_argument("--examples", type=int, default=0, metavar="N",
                   help="a quick check: evaluate on the first N problems of each held-out set "
                        "(results in eval_firstN/, diagnose_firstN/; default: all)")
    p.add_argument("--grid", choices=GRIDS, default="default",
                   help="ReFusion decodes of each ReFusion arm: default (the paper's setting, "
                        "draft_ahead and draft_every), full (the task's whole grid too) or "
                        "lossless (draft_ahead and draft_every only)")
    args = p.parse_args(argv)
    from pipeline.common.cli import UsageError
    try:
        arms = parse_arms(args.arms) if args.arms is not None else None
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    given = [v for v in (args.pretrain_steps, args.finetune_steps, args.micro_batch_size)
             if v is not None]
    if min(given + [args.threads, args.nproc]) < 1 or args.parallel < 0 or args.examples < 0:
        print("error: --pretrain-steps, --finetune-steps, --micro-batch-size, --threads, "
              "--nproc must be >= 1 (--parallel, --examples >= 0)", file=sys.stderr)
        return 2
    f = args.natural_order_fraction
    if f is not None and not 0.0 <= f <= 1.0:
        print(f"error: --natural-order-fraction must be in [0, 1], got {f:g}", file=sys.stderr)
        return 2
    exp = Experiment(args.task, args.out, args.pretrain_steps, args.finetune_steps,
                     args.threads, args.nproc, args.micro_batch_size, args.parallel,
                     args.config, args.sweep, args.natural_order_fraction,
                     worker=args.eval_worker, arms=arms, seeds=seeds, grid=args.grid,
                     limit_examples=args.examples)
    if args.only_report and not any(exp.eval_dir.glob("*/*.json")):
        print(f"error: --only-report: {exp.out} holds no decode results of task {args.task} "
              f"(run without --only-report first)", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.eval_worker:       # one of stage_eval_workers' processes
        exp.stage_eval()
        exp.stage_diagnose()
        return 0
    try:
        path = exp.stage_report() if args.only_report else exp.run()
    except StageError as e:
        print(f"error: experiment stage failed: {e}", file=sys.stderr)
        return 1
    except UsageError as e:       # reuse.InputsMismatch: a folder of other inputs
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if exp.stage_status:
        _log("stages " + ", ".join(f"{k}: {v}" for k, v in exp.stage_status.items()))
    _log(f"done in {time.time() - t0:.0f} s: {path}, {exp.out / 'frontier.png'}, "
         f"{exp.out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
