"""Stages 2b, 3 and 3b of the experiment, evaluation: the natural-order sweep's decodes and its
choice, the validation loss of every stage-2 model, every decode of `jobs()` (batch-1 decodes
give the latency figures), the teacher-forced diagnosis of every model, each cached as JSON
with the key of the export it came from, and the worker processes that share that work.

Owns: `EvaluationStage`, methods of `recipe.Experiment` (mixed in; they read `task`, `out`,
`shards`, `threads`, `parallel`, `worker`, `sweep`, `fraction` (`stage_sweep` sets it),
`eval_dir`, `diagnose_dir`, `_missing_modes`, set by its `__init__`, and its names `jobs`,
`models`, `eval_path`, `hf_dir`), `choose_fraction`. Must not touch: decoding and scoring
(`pipeline.inference.evaluation`), the diagnosis's measures (`pipeline.experiment.diagnosis`),
the report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pipeline.common.atomic_io import write_json
from pipeline.experiment.stage import SKIPPED, _log, _run_many, boundary_run, split_seed
from pipeline.experiment.tasks import AR, Setting

VAL_LOSS_BATCHES = 40              # micro-batches of 4 samples (160 of the validation split)
SWEEP_EM_RATIO = 0.9               # the sweep's rule (issue 26): 90% of ar_continued's


def choose_fraction(ar_em: dict, tpf: dict, baseline_em: float, ratio: float = SWEEP_EM_RATIO
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


class EvaluationStage:
    """Stages 2b, 3 and 3b of `recipe.Experiment` (see the module docstring)."""

    def _cached(self, path: Path, model: str) -> dict | None:
        """A cached result, if it was computed from the current export of `model`: the result
        records the export's run key (`model_key`) and it is the export's now; for a result or
        export from before these records, the same export folder, written before the
        result."""
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        key = self.export_key(model)
        if doc.get("model_key") is not None and key is not None:
            return doc if doc["model_key"] == key else None
        weights = self.hf_dir(model) / "config.json"
        if weights.is_file() and path.stat().st_mtime >= weights.stat().st_mtime:
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
                                  mask_attention=s.mask_attention,
                                  temperature=0.0, exact_cache=False, seed=0,
                                  batch_size=s.batch_size or self.task.decode_batch)

    def decode_examples(self, set_name: str, s: Setting) -> list[dict]:
        """The examples a decode runs on: the set, or for a batch-1 decode (a latency figure)
        its first `task.latency_examples` (0: all)."""
        ex = self.examples(set_name)
        n = self.task.latency_examples
        return ex[:n] if s.batch_size == 1 and n else ex

    def decode(self, loaded, model: str, set_name: str, s: Setting) -> dict:
        """Decode `set_name` with one setting, write the result (every answer kept, and
        `correct`: per problem, whether its answer matched by the task's metric) to
        `eval_path` and return it; `threads` and `processes` record what its tokens/s were
        measured with (torch threads; evaluation processes running at once); `model_key`
        the run key of the export decoded."""
        from pipeline.inference.cli import check_decoding_args
        from pipeline.inference.evaluation import exact_match_eval
        args = self.decode_args(s)
        check_decoding_args(args, refusion=s.mode == "refusion")
        examples = self.decode_examples(set_name, s)
        r = exact_match_eval(loaded, examples, args, [s.mode], self.task.metric,
                             keep_outputs=True)
        import torch
        correct = [o.pop("correct") for o in r[s.mode]["outputs"]]
        doc = {"model": model, "set": set_name, "mode": s.mode, "setting": s.to_dict(),
               "gen_length": args.gen_length, "num_blocks": args.num_blocks,
               "hf_dir": str(self.hf_dir(model)), "model_key": self.export_key(model),
               "threads": torch.get_num_threads(),
               "processes": self.eval_workers() if self.worker else 1, **r[s.mode],
               "correct": correct}
        write_json(self.eval_path(model, set_name, s), doc, indent=None)
        _log(f"{model} {set_name} {s.name()}: {self.task.score_name} {doc['exact_match']:.3f} "
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
            return SKIPPED
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
            "ar_continued_exact_match": base, "ratio": SWEEP_EM_RATIO, "rows": rows,
            "chosen": self.fraction})
        _log(f"sweep on {t.sweep_set}: " + "; ".join(
            f"f={r['natural_order_fraction']:g}: AR exact match {r['ar_exact_match']:.3f}, "
            f"TPF {r['tpf']:.2f}" for r in rows)
            + f" (ar_continued {base:.3f}); chosen natural_order_fraction={self.fraction:g}")
        return None if ran else False

    def eval_workers(self) -> int:
        """Evaluation processes `stage_eval_workers` starts: `--parallel` (0: one per arm),
        at most one per `--threads` threads of this machine's cores; 1 means none."""
        if self.parallel == 1:
            return 1
        n = self.parallel or len(self.models())
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
        for d in (self.eval_dir, self.diagnose_dir):
            for p in d.rglob("*.claim"):
                p.unlink()

    def stage_eval_workers(self):
        """Stages 3 and 3b in `eval_workers()` processes at once (`python -m
        pipeline.experiment --eval-worker`, `--threads` each); the batch-1 decodes stay for
        `stage_eval`. Returns SKIPPED (nothing to run) with one worker.

        Raises:
            StageError: a worker failed (after all have ended).
        """
        n = self.eval_workers()
        if n == 1:
            return SKIPPED
        self._clear_claims()       # a claim left by an interrupted run is stale
        cmd = [sys.executable, "-m", "pipeline.experiment", "--task", self.task.name,
               "--output", str(self.out), "--threads", str(self.threads),
               "--natural-order-fraction", f"{self.fraction:g}", "--parallel", str(n),
               "--arms", ",".join(self.arms), "--seeds", ",".join(map(str, self.seeds)),
               "--grid", self.grid, "--config", self.config,
               "--examples", str(self.limit_examples), "--eval-worker"]
        _log(f"evaluation in {n} worker processes of {self.threads} thread(s) each")
        try:
            _run_many([cmd] * n, self.threads)
        finally:
            self._clear_claims()

    def _decodable(self, s: Setting) -> bool:
        """False (logged once per mode) for a setting whose verify mode this checkout's decoder
        does not have (`pipeline.inference.decoding.VERIFY_MODES`): its decodes are left out
        and the report has no row for them."""
        from pipeline.inference.decoding import VERIFY_MODES
        if s.mode != "refusion" or s.verify in VERIFY_MODES:
            return True
        if s.verify not in self._missing_modes:
            self._missing_modes.add(s.verify)
            _log(f"the decoder has no verify mode {s.verify!r}: its decodes are left out")
        return False

    def stage_eval(self):
        """Stage 3: the validation loss of every model (`VAL_LOSS_BATCHES`), then every decode of
        `jobs()` not cached (`_cached`); in a worker, only unclaimed items and no batch-1 decode.
        Returns False when everything was cached."""
        import torch
        from pipeline.training.validation import validation_loss
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        ran = False   # False when everything was cached: the first run's time stays recorded
        by_model: dict[str, list] = {}
        for model, set_name, s in self.jobs():
            by_model.setdefault(model, []).append((set_name, s))
        # the task's newest arm first: its decodes are the ones the task adds
        for model in sorted(by_model, key=lambda m: split_seed(m)[0] != "refusion_boundary"):
            jobs = by_model[model]
            loss_path = self.eval_dir / f"{model}__val_loss.json"
            # a worker leaves the batch-1 decodes (latency) to the parent, which runs them alone
            todo = [(n, s) for n, s in jobs if self._cached(self.eval_path(model, n, s), model)
                    is None and not (self.worker and s.batch_size == 1)
                    and self._decodable(s)]
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
                                       "hf_dir": str(self.hf_dir(model)),
                                       "model_key": self.export_key(model)})
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
        (its first `task.diagnose_examples`) for every model (`ar_continued` is the contrast
        without MDM training), at each of the task's slot sizes and the grid's token
        thresholds, and the weight of the answer's first token
        (`diagnosis.first_token_effect`); cached under `<out>/diagnose/`."""
        import torch
        from pipeline.experiment.diagnosis import first_token_effect, slot_acceptance
        from pipeline.inference.loading import load_for_inference
        torch.set_num_threads(self.threads)
        t = self.task
        thresholds = sorted({s.token_threshold for s in t.grid})
        n = t.diagnose_examples
        examples = self.examples(t.main_set)
        examples = examples[:n] if n else examples
        ran = False
        for model in self.models():
            loaded = None
            for k in t.diagnose_slot_sizes:
                path = self.diagnose_dir / f"{model}__slot_acceptance_k{k}.json"
                if self._cached(path, model) is not None or not self._claim(path):
                    continue
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = slot_acceptance(loaded, examples, k, t.diagnose_block_size, thresholds)
                write_json(path, {"model": model, "hf_dir": str(self.hf_dir(model)),
                                  "model_key": self.export_key(model), **r})
                ran = True
                _log(f"{model} k={k}: first token {r['first_token_accuracy']:.3f}, drafts by "
                     f"offset {[round(x, 3) for x in r['draft_accuracy_by_offset']]}, accepted "
                     f"per slot {r['accepted']}, AR next token {r['ar_next_token_accuracy']:.3f}")
            path = self.diagnose_dir / f"{model}__first_token.json"
            if self._cached(path, model) is None and self._claim(path):
                loaded = loaded or load_for_inference(str(self.hf_dir(model)))
                r = first_token_effect(loaded, examples, t.gen_length,
                                       t.diagnose_slot_sizes[0], t.metric)
                write_json(path, {"model": model, "hf_dir": str(self.hf_dir(model)),
                                  "model_key": self.export_key(model), **r})
                ran = True
                _log(f"{model}: answer's first token from AR / plan: accuracy "
                     f"{r['first_token_accuracy']}, exact match then {r['exact_match']}")
            del loaded
        return None if ran else False
