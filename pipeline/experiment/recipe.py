"""The scaled-down ReFusion recipe, ReFusion vs AR, end to end: `make experiment`.

    python -m pipeline.experiment [--task math|code] [--output outputs/experiment/<task>]
        [--pretrain-steps N] [--finetune-steps N] [--micro-batch-size B] [--threads T]
        [--nproc P] [--parallel] [--only-report]

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
   and learning-rate schedule): `refusion` (`init.source=hf`, `objective.mode=refusion`) and
   `ar_continued` (`init.source=hf`, `objective.mode=ar`); export both.
3. evaluation: the validation loss of both stage-2 models under the ReFusion objective
   (`pipeline.training.validation.validation_loss`), then every decode of `task.jobs()` (AR decoding of
   both models, the ReFusion grid of `refusion`, the task's extra decodes), each cached as
   JSON under `<out>/eval/<set>/<model>__<setting>.json` with every decoded answer.
3b. diagnosis: `slot_acceptance` (teacher-forced plan + verify profile) of `refusion` and
   `ar_continued` on the main held-out set, per slot size; cached under `<out>/diagnose/`.
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
from pipeline.experiment.tasks import ROOT, TASKS, Setting, Task

VAL_LOSS_BATCHES = 40              # micro-batches of 4 samples (160 of the validation split)
TARGET_TPF, TARGET_EM_RATIO = 1.5, 0.9   # TPF >= 1.5 at >= 90% of AR's exact match

RUN_LABELS = {"pretrain_ar": "1. AR pretraining (from scratch)",
              "refusion": "2a. ReFusion fine-tuning", "ar_continued": "2b. AR continued"}


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
    import socket
    procs = []
    for cmd in cmds:
        _log("$ " + " ".join(cmd))
        env = _env(threads)
        with socket.socket() as sock:   # a bare trainer's gloo rendezvous: one free port each
            sock.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
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
        micro_batch_size: packed rows per optimizer step (all three runs; default the task's).
        parallel: train the two stage-2 runs concurrently.
        config: the run config YAML shared by the three training runs (default the task's).
    """

    def __init__(self, task: Task | str, out: str | None = None,
                 pretrain_steps: int | None = None, finetune_steps: int | None = None,
                 threads: int = 2, nproc: int = 1, micro_batch_size: int | None = None,
                 parallel: bool = False, config: str | None = None):
        self.task = TASKS[task] if isinstance(task, str) else task
        t = self.task
        self.out = Path(out or f"outputs/experiment/{t.name}")
        self.pretrain_steps = pretrain_steps or t.pretrain_steps
        self.finetune_steps = finetune_steps or t.finetune_steps
        self.micro_batch_size = micro_batch_size or t.micro_batch_size
        self.threads, self.nproc, self.parallel = threads, nproc, parallel
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

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    def hf_dir(self, name: str) -> Path:
        return self.out / "hf" / name

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
        if self.parallel:
            _run_many(todo, self.threads)
        else:
            for cmd in todo:
                _run_many([cmd], self.threads)

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

    def finetune_overrides(self, mode: str) -> list[str]:
        """Stage-2 options: identical for both arms except the objective mode."""
        return ["init.source=hf", f"init.hf_path={self.hf_dir('pretrain_ar')}",
                f"objective.mode={mode}", "optim.lr=1.0e-3", "optim.min_lr=1.0e-4",
                f"optim.warmup_steps={min(30, self.finetune_steps // 10)}"]

    # ---------------------------------------------------------------- 3. evaluation
    def _cached(self, path: Path, model: str) -> dict | None:
        """A cached result, if it was computed from the current export of `model`."""
        weights = self.hf_dir(model) / "config.json"
        if path.is_file() and path.stat().st_mtime >= weights.stat().st_mtime:
            return json.loads(path.read_text())
        return None

    def decode_args(self, s: Setting) -> argparse.Namespace:
        """The options `pipeline.inference.evaluation.exact_match_eval` reads for a setting (AR: the
        ReFusion fields are unused)."""
        g = self.task.gen_length
        return argparse.Namespace(gen_length=g, slot_size=s.slot_size, num_blocks=s.blocks(g),
                                  slot_threshold=s.slot_threshold,
                                  token_threshold=s.token_threshold, verify=s.verify,
                                  temperature=0.0, exact_cache=False, seed=0,
                                  batch_size=self.task.decode_batch)

    def stage_eval(self):
        import torch
        from pipeline.inference.evaluation import exact_match_eval
        from pipeline.training.validation import validation_loss
        from pipeline.inference.cli import check_decoding_args
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        ran = False   # False when everything was cached: the first run's time stays recorded
        by_model: dict[str, list] = {}
        for model, set_name, s in self.task.jobs():
            by_model.setdefault(model, []).append((set_name, s))
        for model, jobs in by_model.items():
            loss_path = self.out / "eval" / f"{model}__val_loss.json"
            todo = [(n, s) for n, s in jobs if self._cached(self.eval_path(model, n, s), model)
                    is None]
            if self._cached(loss_path, model) is not None and not todo:
                continue
            loaded = load_for_inference(str(self.hf_dir(model)))
            if self._cached(loss_path, model) is None:
                ran = True
                t0 = time.time()
                loss = validation_loss(loaded.model, str(self.shards), "val", 4,
                                       VAL_LOSS_BATCHES, 0)
                loss["seconds"] = time.time() - t0
                write_json(loss_path, {"model": model, "loss": loss})
                _log(f"{model}: validation loss {loss['val_loss']:.4f} (AR "
                     f"{loss['val_ar_loss']:.4f}, MDM {loss['val_mdm_loss']:.4f})")
            for set_name, s in todo:
                ran = True
                args = self.decode_args(s)
                check_decoding_args(args, refusion=s.mode == "refusion")
                examples = self.examples(set_name)
                r = exact_match_eval(loaded, examples, args, [s.mode], self.task.metric,
                                     keep_outputs=True)
                doc = {"model": model, "set": set_name, "mode": s.mode,
                       "setting": s.to_dict(), "gen_length": args.gen_length,
                       "num_blocks": args.num_blocks, **r[s.mode]}
                write_json(self.eval_path(model, set_name, s), doc, indent=None)
                _log(f"{model} {set_name} {s.name()}: exact match {doc['exact_match']:.3f} "
                     f"token accuracy {doc['token_accuracy']:.3f} TPF {doc['tpf']:.2f} "
                     f"tokens/s {doc['tps']:.0f}")
            del loaded
        return None if ran else False

    def stage_diagnose(self):
        """Teacher-forced plan + verify profile (`diagnosis.slot_acceptance`) of the main set
        for `refusion` and, as the contrast without MDM training, `ar_continued`, at each of
        the task's slot sizes and the grid's token thresholds, and the weight of the answer's
        first token (`diagnosis.first_token_effect`); cached under `<out>/diagnose/`."""
        import torch
        from pipeline.experiment.diagnosis import first_token_effect, slot_acceptance
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        t = self.task
        thresholds = sorted({s.token_threshold for s in t.grid})
        ran = False
        for model in ("refusion", "ar_continued"):
            loaded = None
            for k in t.diagnose_slot_sizes:
                path = self.out / "diagnose" / f"{model}__slot_acceptance_k{k}.json"
                if self._cached(path, model) is not None:
                    continue
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = slot_acceptance(loaded, self.examples(t.main_set), k,
                                    t.diagnose_block_size, thresholds)
                write_json(path, {"model": model, **r})
                ran = True
                _log(f"{model} k={k}: first token {r['first_token_accuracy']:.3f}, drafts by "
                     f"offset {[round(x, 3) for x in r['draft_accuracy_by_offset']]}, accepted "
                     f"per slot {r['accepted']}, AR next token {r['ar_next_token_accuracy']:.3f}")
            path = self.out / "diagnose" / f"{model}__first_token.json"
            if self._cached(path, model) is None:
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = first_token_effect(loaded, self.examples(t.main_set), t.gen_length,
                                       t.diagnose_slot_sizes[0], t.metric)
                write_json(path, {"model": model, **r})
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
        return {"rows": rows, "losses": losses, "diagnose": diag, "first_token": first}

    def training_runs(self) -> dict:
        """{run label: metrics} of the three runs, stage-2 steps counted after stage 1."""
        from pipeline.report import ReportError, read_metrics
        runs, offset = {}, {"pretrain_ar": 0, "refusion": self.pretrain_steps,
                            "ar_continued": self.pretrain_steps}
        for name, label in RUN_LABELS.items():
            try:
                m = read_metrics(self.run_dir(name) / "metrics.jsonl")
            except ReportError:
                continue
            drop = ("mdm_loss", "val_mdm_loss") if name != "refusion" else ()  # AR: logged 0
            runs[label] = {k: [{**{f: x for f, x in r.items() if f not in drop},
                                "step": r["step"] + offset[name], "run_step": r["step"]}
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
        text = report_markdown(self, got, runs, tok, TARGET_TPF, TARGET_EM_RATIO)
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
        arms = (("refusion", "refusion"), ("ar_continued", "ar"))
        self._timed("train refusion + ar_continued" if self.parallel else "train stage 2",
                    lambda: self.stage_train([(name, self.finetune_steps,
                                               self.finetune_overrides(mode))
                                              for name, mode in arms]))
        for name, _ in arms:
            self._timed(f"export {name}", lambda: self.stage_export(name))
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
    p.add_argument("--parallel", action="store_true",
                   help="train the two stage-2 runs at the same time (each with --threads)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads per process (default 2)")
    p.add_argument("--nproc", type=int, default=1, help="training processes (default 1)")
    p.add_argument("--only-report", action="store_true",
                   help="rewrite report.md and the figures from what is there")
    args = p.parse_args(argv)
    given = [v for v in (args.pretrain_steps, args.finetune_steps, args.micro_batch_size)
             if v is not None]
    if min(given + [args.threads, args.nproc]) < 1:
        print("error: --pretrain-steps, --finetune-steps, --micro-batch-size, --threads, "
              "--nproc must be >= 1", file=sys.stderr)
        return 2
    exp = Experiment(args.task, args.out, args.pretrain_steps, args.finetune_steps,
                     args.threads, args.nproc, args.micro_batch_size, args.parallel,
                     args.config)
    if args.only_report and not any((exp.out / "eval").glob("*/*.json")):
        print(f"error: --only-report: {exp.out} holds no decode results of task {args.task} "
              f"(run without --only-report first)", file=sys.stderr)
        return 2
    t0 = time.time()
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
