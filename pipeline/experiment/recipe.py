"""The scaled-down ReFusion recipe, ReFusion vs AR, end to end: `make experiment`.

    python -m pipeline.experiment [--task math|code] [--output outputs/experiment/<task>]
        [--pretrain-steps N] [--finetune-steps N] [--micro-batch-size B] [--threads T]
        [--nproc P] [--parallel [N]] [--sweep] [--natural-order-fraction F] [--only-report]

Owns: the experiment's stages, their skip-if-done logic and timings. Must not touch:
training, decoding, evaluation loops, plotting of one run (it calls `pipeline.train`,
`pipeline.export` and data_prep as subprocesses, `pipeline.evaluate` and `pipeline.report` as
libraries). The task's fixed choices are in `pipeline.experiment.tasks`, the diagnosis in
`pipeline.experiment.diagnosis`, the report text and figures in `pipeline.experiment.writeup`.

Stages (each skipped when its result exists, so an interrupted run resumes with the same
command; the trainer itself resumes from its latest checkpoint):
0. data: the task's tokenizer and shards (math: the problems first).
1. `pretrain_ar`: a small Qwen3 (the task's run config) from scratch, `objective.mode=ar`.
2. export it (`pipeline.export`); from it, with equal compute (same steps, batch, data order
   and learning-rate schedule), the task's arms: `refusion` (`init.source=hf`,
   `objective.mode=refusion`), `ar_continued` (`init.source=hf`, `objective.mode=ar`) and, for
   the math task, `refusion_boundary` (`objective.mode=refusion`,
   `objective.boundary_labels=true`, `objective.natural_order_fraction=F`; its run folder is
   `runs/refusion_boundary_f<F>`); export each. With `--sweep`, one such run per share of
   `task.sweep_fractions`.
2b. only with `--sweep`: AR decoding and `task.sweep_setting` of every swept share (and AR
   decoding of `ar_continued`) on `task.sweep_set`; `choose_fraction` picks F by the rule fixed
   in `pipeline.experiment.tasks`, the rest of the run uses it, and `sweep.json` records it.
3. evaluation: the validation loss of both stage-2 models under the ReFusion objective
   (`pipeline.training.validation.validation_loss`), then every decode of `task.jobs()` (AR decoding of
   both models, the ReFusion grid of `refusion`, the task's extra decodes), each cached as
   JSON under `<out>/eval/<set>/<model>__<setting>.json` with every decoded answer.
3b. diagnosis: `slot_acceptance` (teacher-forced plan + verify profile) of every arm on the
   main held-out set, per slot size; cached under `<out>/diagnose/`.
   With `--parallel` other than 1, stages 3 and 3b first run in `eval_workers()` processes of
   `--threads` threads each (`stage_eval_workers`), which take their items (a validation loss,
   a decode, a profile) one at a time through claim files, so the work balances itself; the
   decodes at batch 1 (a latency figure) are left to this process, which runs them alone
   after the workers.
4. `report.md`, `frontier.png`, `loss.png`.
Exit codes: 0 done; 1 a stage failed (its command and exit code on stderr); 2 bad options.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline.common.cli import hidden_alias
from pipeline.common.atomic_io import write_json, write_text
from pipeline.experiment.tasks import AR, ROOT, TASKS, Setting, Task

VAL_LOSS_BATCHES = 40              # micro-batches of 4 samples (160 of the validation split)
TARGET_TPF, TARGET_EM_RATIO = 2.0, 0.9   # issue 26: TPF >= 2 at >= 90% of AR's exact match
GOAL_TPF, GOAL_EM_RATIO = 2.5, 0.95      # and the goal beyond it

RUN_LABELS = {"pretrain_ar": "1. AR pretraining (from scratch)",
              "refusion": "2a. ReFusion fine-tuning", "ar_continued": "2b. AR continued",
              "refusion_boundary": "2c. ReFusion fine-tuning, boundary labels + natural order"}


def boundary_run(fraction: float) -> str:
    """Run (and export) folder name of a `refusion_boundary` arm with this natural-order share."""
    return f"refusion_boundary_f{fraction:g}"


def choose_fraction(ar_em: dict, tpf: dict, baseline_em: float, ratio: float = TARGET_EM_RATIO
                    ) -> float:
    """The sweep's rule (fixed in `pipeline.experiment.tasks` before any result): among the
    shares whose AR-decoding exact match reaches `ratio` x the AR model's, the one of largest
    TPF of the sweep decode; if none reaches it, the one of largest exact match. Ties go to the
    smaller share.

    Args:
        ar_em: {share: exact match of that arm's AR decoding}; tpf: {share: TPF of the sweep
            setting}; baseline_em: exact match of `ar_continued`'s AR decoding; ratio in [0, 1].

    Returns:
        The chosen share.
    """
    fs = sorted(ar_em)
    ok = [f for f in fs if ar_em[f] >= ratio * baseline_em]
    if ok:
        return max(ok, key=lambda f: (tpf[f], -f))
    return max(fs, key=lambda f: (ar_em[f], -f))


class StageError(RuntimeError):
    """A stage's command failed (message: the command and its exit code)."""


def _log(msg: str) -> None:
    print(f"[experiment {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": env.get("DS_ACCELERATOR", "cpu"),
                "WANDB_MODE": env.get("WANDB_MODE", "offline"),
                "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore::FutureWarning"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def _run_many(cmds: list[list[str]], threads: int) -> None:
    """Run commands concurrently from the repository root; raise StageError for the first
    that failed (after all have ended)."""
    from pipeline.parallel import free_port
    procs = []
    for cmd in cmds:
        _log("$ " + " ".join(cmd))
        env = _env(threads)
        env["MASTER_PORT"] = str(free_port())   # a bare trainer's gloo rendezvous: one each
        procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, env=env)))
    failed = [(cmd, p.wait()) for cmd, p in procs]
    for cmd, rc in failed:
        if rc != 0:
            raise StageError(f"exit code {rc}: {' '.join(cmd)}")


class Experiment:
    """The stages of one task over one output folder; see the module docstring.

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
    """

    def __init__(self, task: Task | str, out: str | None = None,
                 pretrain_steps: int | None = None, finetune_steps: int | None = None,
                 threads: int = 2, nproc: int = 1, micro_batch_size: int | None = None,
                 parallel: int | bool = 1, config: str | None = None, sweep: bool = False,
                 natural_order_fraction: float | None = None, worker: bool = False):
        self.task = TASKS[task] if isinstance(task, str) else task
        t = self.task
        self.out = Path(out or f"outputs/experiment/{t.name}")
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

    # ---------------------------------------------------------------- bookkeeping
    def _timed(self, name: str, fn) -> None:
        t0 = time.time()
        done = fn()
        if done is not False:     # False: skipped (its earlier time stays recorded)
            self.timings[name] = round(time.time() - t0, 1)
            write_json(self.timings_path, self.timings)

    def run_name(self, name: str) -> str:
        """The folder name of a model or run: `refusion_boundary` is the run of its share."""
        return boundary_run(self.fraction) if name == "refusion_boundary" else name

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / self.run_name(name)

    def hf_dir(self, name: str) -> Path:
        return self.out / "hf" / self.run_name(name)

    def stage2_runs(self) -> list[str]:
        """Run names of stage 2: the task's arms, then (with `sweep`) every swept share."""
        names = [self.run_name(a) for a in self.task.arms]
        if self.sweep:
            names += [boundary_run(f) for f in self.task.sweep_fractions]
        return list(dict.fromkeys(names))

    def eval_path(self, model: str, set_name: str, s: Setting) -> Path:
        return self.out / "eval" / set_name / f"{model}__{s.name()}.json"

    def examples(self, set_name: str) -> list[dict]:
        if set_name not in self._examples:
            self._examples[set_name] = self.task.examples(self.out, set_name)
        return self._examples[set_name]

    # ---------------------------------------------------------------- 0. data
    def stage_data(self):
        if not self.task.prepare(self.out, lambda cmd: _run_many([cmd], self.threads)):
            _log(f"data: {self.shards} exists, kept")
            return False

    # ---------------------------------------------------------------- 1./2. training
    def _finished(self, name: str, steps: int) -> bool:
        from pipeline.checkpoint import find_latest
        latest = find_latest(self.run_dir(name) / "checkpoints")
        return latest is not None and latest.name == f"step_{steps:09d}"

    def train_command(self, name: str, steps: int, overrides: list[str]) -> list[str]:
        launch = ([sys.executable] if self.nproc == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(self.nproc)])
        return launch + ["-m", "pipeline.train", "--config", self.config,
                         f"run_dir={self.run_dir(name)}", f"data.dir={self.shards}",
                         f"train.max_steps={steps}",
                         f"train.micro_batch_size={self.micro_batch_size}"] + overrides

    def stage_train(self, runs: list[tuple[str, int, list[str]]]):
        """Train the runs not finished yet, concurrently (`self.parallel`) or one by one."""
        todo = []
        for name, steps, overrides in runs:
            if self._finished(name, steps):
                _log(f"train {name}: {steps} steps done, kept")
            else:
                todo.append(self.train_command(name, steps, overrides))
        if not todo:
            return False
        n = self.parallel or len(todo)
        for i in range(0, len(todo), n):
            _run_many(todo[i:i + n], self.threads)

    def stage_export(self, name: str):
        hf = self.hf_dir(name)
        if (hf / "config.json").is_file() and (hf / "tokenizer.model").is_file():
            _log(f"export {name}: {hf} exists, kept")
            return False
        _run_many([[sys.executable, "-m", "pipeline.export",
                    str(self.run_dir(name) / "checkpoints"), str(hf), "--tokenizer",
                    str(self.shards / "tokenizer"), "--dtype", "float32", "--overwrite"]],
                  self.threads)
        shutil.copy(self.shards / "tokenizer" / "tokenizer.model", hf / "tokenizer.model")

    def finetune_overrides(self, run: str) -> list[str]:
        """Stage-2 options of a run: identical for every arm except the objective options
        (`ar_continued`: mode ar; `refusion`: mode refusion; `refusion_boundary_f<F>`: mode
        refusion with boundary labels and natural-order share F)."""
        if run == "ar_continued":
            objective = ["objective.mode=ar"]
        elif run == "refusion":
            objective = ["objective.mode=refusion"]
        elif run.startswith("refusion_boundary_f"):
            objective = ["objective.mode=refusion", "objective.boundary_labels=true",
                         f"objective.natural_order_fraction={run[len('refusion_boundary_f'):]}"]
        else:
            raise ValueError(f"unknown stage-2 run {run!r}")
        return ["init.source=hf", f"init.hf_path={self.hf_dir('pretrain_ar')}", *objective,
                "optim.lr=1.0e-3", "optim.min_lr=1.0e-4",
                f"optim.warmup_steps={min(30, self.finetune_steps // 10)}"]

    # ---------------------------------------------------------------- 3. evaluation
    def _cached(self, path: Path, model: str) -> dict | None:
        """A cached result, if it was computed from the current export of `model` (the same
        export folder, written before the result)."""
        weights = self.hf_dir(model) / "config.json"
        if path.is_file() and path.stat().st_mtime >= weights.stat().st_mtime:
            doc = json.loads(path.read_text())
            if doc.get("hf_dir", str(self.hf_dir(model))) == str(self.hf_dir(model)):
                return doc
        return None

    def decode_args(self, s: Setting) -> argparse.Namespace:
        """The options `pipeline.inference.evaluation.exact_match_eval` reads for a setting (AR: the
        ReFusion fields are unused)."""
        g = self.task.gen_length
        return argparse.Namespace(gen_length=g, slot_size=s.slot_size, num_blocks=s.blocks(g),
                                  slot_threshold=s.slot_threshold,
                                  token_threshold=s.token_threshold, verify=s.verify,
                                  temperature=0.0, exact_cache=False, seed=0,
                                  batch_size=s.batch_size or self.task.decode_batch)

    def decode(self, loaded, model: str, set_name: str, s: Setting) -> dict:
        """Decode `set_name` with one setting, write the result (every answer kept) to
        `eval_path` and return it; `threads` and `processes` record what its tokens/s were
        measured with (torch threads; evaluation processes running at once)."""
        from pipeline.inference.cli import check_decoding_args
        from pipeline.inference.evaluation import exact_match_eval
        args = self.decode_args(s)
        check_decoding_args(args, refusion=s.mode == "refusion")
        r = exact_match_eval(loaded, self.examples(set_name), args, [s.mode], self.task.metric,
                             keep_outputs=True)
        import torch
        doc = {"model": model, "set": set_name, "mode": s.mode, "setting": s.to_dict(),
               "gen_length": args.gen_length, "num_blocks": args.num_blocks,
               "hf_dir": str(self.hf_dir(model)), "threads": torch.get_num_threads(),
               "processes": self.eval_workers() if self.worker else 1, **r[s.mode]}
        write_json(self.eval_path(model, set_name, s), doc, indent=None)
        _log(f"{model} {set_name} {s.name()}: exact match {doc['exact_match']:.3f} "
             f"token accuracy {doc['token_accuracy']:.3f} TPF {doc['tpf']:.2f} "
             f"tokens/s {doc['tps']:.0f}")
        return doc

    def stage_sweep(self):
        """Stage 2b (`--sweep`): decode `task.sweep_set` with AR decoding and
        `task.sweep_setting` for every swept share, and AR decoding of `ar_continued`; choose
        the share (`choose_fraction`), use it for the rest of the run, write `sweep.json`."""
        import torch
        from pipeline.inference.loading import load_for_inference
        t = self.task
        if not self.sweep:
            return False
        torch.set_num_threads(self.threads)
        ran = False
        docs: dict = {}
        for model, settings in ([("ar_continued", [AR])] +
                                [(boundary_run(f), [AR, t.sweep_setting])
                                 for f in t.sweep_fractions]):
            loaded = None
            for s in settings:
                doc = self._cached(self.eval_path(model, t.sweep_set, s), model)
                if doc is None:
                    loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                    doc = self.decode(loaded, model, t.sweep_set, s)
                    ran = True
                docs[(model, s.name())] = doc
            del loaded
        base = docs[("ar_continued", "ar")]["exact_match"]
        ar_em = {f: docs[(boundary_run(f), "ar")]["exact_match"] for f in t.sweep_fractions}
        tpf = {f: docs[(boundary_run(f), t.sweep_setting.name())]["tpf"]
               for f in t.sweep_fractions}
        self.fraction = choose_fraction(ar_em, tpf, base)
        rows = [{"natural_order_fraction": f, "ar_exact_match": ar_em[f],
                 "ar_token_accuracy": docs[(boundary_run(f), "ar")]["token_accuracy"],
                 "tpf": tpf[f],
                 "exact_match": docs[(boundary_run(f), t.sweep_setting.name())]["exact_match"]}
                for f in t.sweep_fractions]
        write_json(self.out / "sweep.json", {
            "set": t.sweep_set, "setting": t.sweep_setting.to_dict(),
            "ar_continued_exact_match": base, "ratio": TARGET_EM_RATIO, "rows": rows,
            "chosen": self.fraction})
        _log(f"sweep on {t.sweep_set}: " + "; ".join(
            f"f={r['natural_order_fraction']:g}: AR exact match {r['ar_exact_match']:.3f}, "
            f"TPF {r['tpf']:.2f}" for r in rows)
            + f" (ar_continued {base:.3f}); chosen natural_order_fraction={self.fraction:g}")
        return None if ran else False

    # ------------------------------------------------ 3./3b. evaluation workers
    def eval_workers(self) -> int:
        """Evaluation processes `stage_eval_workers` starts: `--parallel` (0: one per arm),
        at most one per `--threads` threads of this machine's cores; 1 means none."""
        if self.parallel == 1:
            return 1
        n = self.parallel or len(self.task.arms)
        return max(1, min(n, (os.cpu_count() or 1) // self.threads))

    def _claim(self, path: Path) -> bool:
        """True when this process is to compute `path`: always outside a worker; in a worker,
        when it created `<path>.claim` first (O_EXCL, so two workers never take one item)."""
        if not self.worker:
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(f"{path}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _clear_claims(self) -> None:
        for d in ("eval", "diagnose"):
            for p in (self.out / d).rglob("*.claim"):
                p.unlink()

    def stage_eval_workers(self):
        """Stages 3 and 3b in `eval_workers()` processes at once (`python -m
        pipeline.experiment --eval-worker`, `--threads` each); the batch-1 decodes stay for
        `stage_eval`. Returns False (nothing run) with one worker.

        Raises:
            StageError: a worker failed (after all have ended).
        """
        n = self.eval_workers()
        if n == 1:
            return False
        self._clear_claims()       # a claim left by an interrupted run is stale
        cmd = [sys.executable, "-m", "pipeline.experiment", "--task", self.task.name,
               "--output", str(self.out), "--threads", str(self.threads),
               "--natural-order-fraction", f"{self.fraction:g}", "--parallel", str(n),
               "--eval-worker"]
        _log(f"evaluation in {n} worker processes of {self.threads} thread(s) each")
        try:
            _run_many([cmd] * n, self.threads)
        finally:
            self._clear_claims()

    def stage_eval(self):
        import torch
        from pipeline.training.validation import validation_loss
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        ran = False   # False when everything was cached: the first run's time stays recorded
        by_model: dict[str, list] = {}
        for model, set_name, s in self.task.jobs():
            by_model.setdefault(model, []).append((set_name, s))
        # the newest arm first: its decodes are the ones the task adds
        for model in sorted(by_model, key=lambda m: m != "refusion_boundary"):
            jobs = by_model[model]
            loss_path = self.out / "eval" / f"{model}__val_loss.json"
            # a worker leaves the batch-1 decodes (latency) to the parent, which runs them alone
            todo = [(n, s) for n, s in jobs if self._cached(self.eval_path(model, n, s), model)
                    is None and not (self.worker and s.batch_size == 1)]
            if self._cached(loss_path, model) is not None and not todo:
                continue
            loaded = None
            if self._cached(loss_path, model) is None and self._claim(loss_path):
                loaded = load_for_inference(str(self.hf_dir(model)))
                ran = True
                t0 = time.time()
                loss = validation_loss(loaded.model, str(self.shards), "val", 4,
                                       VAL_LOSS_BATCHES, 0)
                loss["seconds"] = time.time() - t0
                write_json(loss_path, {"model": model, "loss": loss,
                                       "hf_dir": str(self.hf_dir(model))})
                _log(f"{model}: validation loss {loss['val_loss']:.4f} (AR "
                     f"{loss['val_ar_loss']:.4f}, MDM {loss['val_mdm_loss']:.4f})")
            for set_name, s in todo:
                if not self._claim(self.eval_path(model, set_name, s)):
                    continue
                ran = True
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                self.decode(loaded, model, set_name, s)
            del loaded
        return None if ran else False

    def stage_diagnose(self):
        """Teacher-forced plan + verify profile (`diagnosis.slot_acceptance`) of the main set
        for every arm (`ar_continued` is the contrast without MDM training), at each of the
        task's slot sizes and the grid's token thresholds, and the weight of the answer's
        first token (`diagnosis.first_token_effect`); cached under `<out>/diagnose/`."""
        import torch
        from pipeline.experiment.diagnosis import first_token_effect, slot_acceptance
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        t = self.task
        thresholds = sorted({s.token_threshold for s in t.grid})
        ran = False
        for model in t.arms:
            loaded = None
            for k in t.diagnose_slot_sizes:
                path = self.out / "diagnose" / f"{model}__slot_acceptance_k{k}.json"
                if self._cached(path, model) is not None or not self._claim(path):
                    continue
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = slot_acceptance(loaded, self.examples(t.main_set), k,
                                    t.diagnose_block_size, thresholds)
                write_json(path, {"model": model, "hf_dir": str(self.hf_dir(model)), **r})
                ran = True
                _log(f"{model} k={k}: first token {r['first_token_accuracy']:.3f}, drafts by "
                     f"offset {[round(x, 3) for x in r['draft_accuracy_by_offset']]}, accepted "
                     f"per slot {r['accepted']}, AR next token {r['ar_next_token_accuracy']:.3f}")
            path = self.out / "diagnose" / f"{model}__first_token.json"
            if self._cached(path, model) is None and self._claim(path):
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = first_token_effect(loaded, self.examples(t.main_set), t.gen_length,
                                       t.diagnose_slot_sizes[0], t.metric)
                write_json(path, {"model": model, "hf_dir": str(self.hf_dir(model)), **r})
                ran = True
                _log(f"{model}: answer's first token from AR / plan: accuracy "
                     f"{r['first_token_accuracy']}, exact match then {r['exact_match']}")
            del loaded
        return None if ran else False

    # ---------------------------------------------------------------- 4. report
    def collect(self) -> dict:
        """Cached results of the current task's jobs: {"rows": [result docs], "losses":
        {model: validation loss figures}, "diagnose": [profiles], "first_token": [effects]}."""
        rows, losses = [], {}
        for model, set_name, s in self.task.jobs():
            p = self.eval_path(model, set_name, s)
            if p.is_file():
                rows.append(json.loads(p.read_text()))
        for p in sorted((self.out / "eval").glob("*__val_loss.json")):
            d = json.loads(p.read_text())
            losses[d["model"]] = d["loss"]
        diag = [json.loads(p.read_text())
                for p in sorted((self.out / "diagnose").glob("*__slot_acceptance_k*.json"))]
        first = [json.loads(p.read_text())
                 for p in sorted((self.out / "diagnose").glob("*__first_token.json"))]
        arms = set(self.task.arms)
        diag = [d for d in diag if d["model"] in arms]
        first = [d for d in first if d["model"] in arms]
        losses = {m: v for m, v in losses.items() if m in arms}
        sweep = self.out / "sweep.json"
        return {"rows": rows, "losses": losses, "diagnose": diag, "first_token": first,
                "sweep": json.loads(sweep.read_text()) if sweep.is_file() else None}

    def training_runs(self) -> dict:
        """{run label: metrics} of the training runs (stage 1 and the task's arms), stage-2
        steps counted after stage 1."""
        from pipeline.report import ReportError, read_metrics
        runs = {}
        for name, label in RUN_LABELS.items():
            if name != "pretrain_ar" and name not in self.task.arms:
                continue
            if name == "refusion_boundary":
                label = f"{label} (share {self.fraction:g})"
            offset = 0 if name == "pretrain_ar" else self.pretrain_steps
            try:
                m = read_metrics(self.run_dir(name) / "metrics.jsonl")
            except ReportError:
                continue
            drop = (("mdm_loss", "val_mdm_loss") if name not in self.task.refusion_arms
                    else ())  # AR: logged 0
            runs[label] = {k: [{**{f: x for f, x in r.items() if f not in drop},
                                "step": r["step"] + offset, "run_step": r["step"]}
                               for r in v] for k, v in m.items()}
        return runs

    def stage_report(self) -> Path:
        from pipeline.experiment.writeup import plot_frontier, report_markdown
        from pipeline.report import plot_loss
        runs = self.training_runs()
        if runs:
            plot_loss(runs, self.out / "loss.png")
        got = self.collect()
        main = [r for r in got["rows"] if r["set"] == self.task.main_set]
        plot_frontier(main, self.out / "frontier.png", self.task, TARGET_TPF, TARGET_EM_RATIO)
        tok = None
        spm = self.task.spm(self.out)
        if spm.is_file():
            from pipeline.tokenizer import load_tokenizer
            tok = load_tokenizer(str(spm))
        text = report_markdown(self, got, runs, tok, TARGET_TPF, TARGET_EM_RATIO, GOAL_TPF,
                               GOAL_EM_RATIO)
        write_text(self.out / "report.md", text)
        return self.out / "report.md"

    def run(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        self._timed("data", self.stage_data)
        self._timed("train pretrain_ar", lambda: self.stage_train([(
            "pretrain_ar", self.pretrain_steps,
            ["init.source=random", "objective.mode=ar",
             f"optim.warmup_steps={min(30, self.pretrain_steps // 10)}"])]))
        self._timed("export pretrain_ar", lambda: self.stage_export("pretrain_ar"))
        runs = self.stage2_runs()
        self._timed("train stage 2", lambda: self.stage_train([
            (name, self.finetune_steps, self.finetune_overrides(name)) for name in runs]))
        for name in runs:
            self._timed(f"export {name}", lambda: self.stage_export(name))
        self._timed("sweep", self.stage_sweep)
        self._timed("evaluate and diagnose (workers)", self.stage_eval_workers)
        self._timed("evaluate", self.stage_eval)
        self._timed("diagnose", self.stage_diagnose)
        return self.stage_report()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.experiment",
                                description="ReFusion vs AR, scaled down (issues 10 and 20).")
    p.add_argument("--task", choices=sorted(TASKS), default="math",
                   help="math (default): GSM8K-form word problems; code: stdlib functions")
    p.add_argument("--output", dest="out", default=None,
                   help="output folder (default outputs/experiment/TASK)")
    hidden_alias(p, "--out", dest="out")
    p.add_argument("--config", default=None, help="run config (default: the task's)")
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="default: the task's (math 2400, code 3000)")
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="steps of each stage-2 run (default: the task's, math 1500, code 1500)")
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
    args = p.parse_args(argv)
    given = [v for v in (args.pretrain_steps, args.finetune_steps, args.micro_batch_size)
             if v is not None]
    if min(given + [args.threads, args.nproc]) < 1 or args.parallel < 0:
        print("error: --pretrain-steps, --finetune-steps, --micro-batch-size, --threads, "
              "--nproc must be >= 1 (--parallel >= 0)", file=sys.stderr)
        return 2
    f = args.natural_order_fraction
    if f is not None and not 0.0 <= f <= 1.0:
        print(f"error: --natural-order-fraction must be in [0, 1], got {f:g}", file=sys.stderr)
        return 2
    exp = Experiment(args.task, args.out, args.pretrain_steps, args.finetune_steps,
                     args.threads, args.nproc, args.micro_batch_size, args.parallel,
                     args.config, args.sweep, args.natural_order_fraction,
                     worker=args.eval_worker)
    if args.only_report and not any((exp.out / "eval").glob("*/*.json")):
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
    _log(f"done in {time.time() - t0:.0f} s: {path}, {exp.out / 'frontier.png'}, "
         f"{exp.out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
