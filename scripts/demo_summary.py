"""`make demo` stage 6: the run's loss curve and what the decodes showed, with the demo's checks.

    python scripts/demo_summary.py --metrics RUN/metrics.jsonl --problems TEST.jsonl
        --ar DECODE_AR.json --draft DECODE_DRAFT.json [--eval EVAL.json] [--weights a=0.9,b=0.1]

Owns: the demo's summary lines and its two checks. Must not touch: decoding, the metric
(`pipeline.inference.evaluation.answers_match`), the files it reads (written by
`pipeline.train`, `data_prep/math_problems.py`, `pipeline.generate --output`,
`pipeline.evaluate --output`).

Prints the training loss (window means, validation losses), with `--weights` each data
source's realized share of the training tokens beside its weight, then for the held-out problems
(`--problems`: records with "response", in the order they were decoded) per decode: exact
match of the final answer (the number after `####`, GSM8K's metric), TPF (generated tokens /
forwards, summed over the problems) and the share of answers whose token ids equal AR's.
Exit codes: 0 both checks passed; 1 the training loss did not fall (mean of the last logged
steps not below the first), or the draft decode is not lossless (an answer's ids differ from
AR's); 2 a missing or unreadable input (one line on stderr each).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pipeline.inference.evaluation import answers_match


class InputError(ValueError):
    """A missing or malformed input file (one line)."""


def _json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read JSON ({e})")


def _jsonl(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read JSONL ({e})")


def loss_fell(metrics: list[dict]) -> tuple[bool, list[str]]:
    """Whether the training loss fell, and the lines that show it.

    Args:
        metrics: metrics.jsonl records ({"kind": "train"|"val", "step", losses...}); the last
            record of a step wins (a resumed run re-logs).
    Returns:
        (mean loss of the last n logged steps < mean of the first n, n = a quarter of the
        logged steps, 1 to 10; the printed lines).
    Raises:
        InputError: no training record.
    """
    train, val = {}, {}
    for m in metrics:
        (train if m.get("kind") == "train" else val)[m["step"]] = m
    steps = sorted(train)
    if not steps:
        raise InputError("metrics.jsonl: no training step logged")
    n = max(1, min(10, len(steps) // 4))
    first = sum(train[s]["loss"] for s in steps[:n]) / n
    last = sum(train[s]["loss"] for s in steps[-n:]) / n
    lines = [f"training loss (dual objective: ar_weight x AR + MDM): steps {steps[0]}..{steps[-1]};"
             f" mean of the first {n} logged steps {first:.3f} -> of the last {n} {last:.3f}"]
    w = -(-len(steps) // 6)   # 6 windows at most
    for i in range(0, len(steps), w):
        win = [train[s] for s in steps[i:i + w]]
        mean = lambda k: sum(m[k] for m in win) / len(win)  # noqa: E731
        lines.append(f"  steps {steps[i]:4d}-{steps[min(i + w, len(steps)) - 1]:4d}  mean loss "
                     f"{mean('loss'):.3f}  (AR {mean('ar_loss'):.3f}, MDM {mean('mdm_loss'):.3f})"
                     f"  tokens/s {mean('tokens_per_s'):.0f}")
    for s in sorted(val):
        lines.append(f"  validation at step {s}: loss {val[s]['val_loss']:.3f} "
                     f"(AR {val[s]['val_ar_loss']:.3f}, MDM {val[s]['val_mdm_loss']:.3f})")
    return last < first, lines


def data_shares(metrics: list[dict], weights: dict[str, float]) -> list[str]:
    """Lines comparing each source's realized share of the training tokens (its
    `tokens_by_source` summed over the logged steps / their tokens) with its weight.

    Args:
        metrics: metrics.jsonl records; the last record of a step wins.
        weights: {source name: weight} (normalized here).
    """
    train = {m["step"]: m for m in metrics if m.get("kind") == "train"}
    got: dict[str, int] = {}
    for m in train.values():
        for name, n in (m.get("tokens_by_source") or {}).items():
            got[name] = got.get(name, 0) + int(n)
    total, wsum = sum(got.values()), sum(weights.values())
    if not total:
        return ["data mixture: no tokens_by_source in metrics.jsonl"]
    return [f"data mixture ({total} tokens fed over {len(train)} steps): " + ", ".join(
        f"{name} weight {w / wsum:.3f} realized {got.get(name, 0) / total:.3f}"
        for name, w in weights.items())]


def decode_figures(decode: dict, references: list[str], ar: dict) -> dict:
    """One decode's figures on the held-out problems.

    Args:
        decode, ar: `pipeline.generate --output` documents ({"summary": {"tokens",
            "forwards"}, "results": [{"text", "token_ids"}]}), results in problem order.
        references: the reference solutions, one per result.
    Returns:
        {"problems", "exact_match" (final answer; fraction), "tpf", "tokens", "forwards",
        "identical_to_ar" (fraction of answers with AR's token ids), "differ" (indices)}.
    Raises:
        InputError: the decode has another number of results than references or AR.
    """
    res, ar_res = decode["results"], ar["results"]
    if not len(res) == len(ar_res) == len(references):
        raise InputError(f"{len(res)} decoded answers, {len(ar_res)} AR answers, "
                         f"{len(references)} problems: decode every problem in both modes")
    n = len(res)
    hits = sum(answers_match(r["text"], ref, "final_answer") for r, ref in zip(res, references))
    differ = [i for i, (r, a) in enumerate(zip(res, ar_res)) if r["token_ids"] != a["token_ids"]]
    s = decode["summary"]
    return {"problems": n, "exact_match": hits / n if n else 0.0,
            "tpf": s["tokens"] / s["forwards"] if s["forwards"] else 0.0,
            "tokens": s["tokens"], "forwards": s["forwards"],
            "identical_to_ar": (n - len(differ)) / n if n else 1.0, "differ": differ}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/demo_summary.py",
                                description="The make demo summary and checks.")
    p.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    p.add_argument("--problems", required=True, help="held-out problems JSONL (\"response\")")
    p.add_argument("--ar", required=True, help="pipeline.generate --output of the AR decode")
    p.add_argument("--draft", required=True, help="... of the lossless draft decode")
    p.add_argument("--eval", default=None, help="pipeline.evaluate --output (validation)")
    p.add_argument("--weights", default=None, metavar="NAME=W,...",
                   help="the run's data.sources weights: print the realized token shares beside")
    args = p.parse_args(argv)
    try:
        records = _jsonl(args.metrics)
        fell, lines = loss_fell(records)
        if args.weights:
            try:
                weights = {k: float(v) for k, v in (x.split("=") for x in args.weights.split(","))}
            except ValueError:
                raise InputError(f"--weights {args.weights!r}: expected NAME=W,NAME=W") from None
            lines += data_shares(records, weights)
        refs = [r.get("response", "") for r in _jsonl(args.problems)]
        ar, draft = _json(args.ar), _json(args.draft)
        figs = {"ar": decode_figures(ar, refs, ar), "draft": decode_figures(draft, refs, ar)}
        ev = _json(args.eval) if args.eval else None
    except (InputError, KeyError, TypeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        print(f"error: demo summary: {what}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    ds = draft["settings"]
    labels = {"ar": "ar", "draft": f"{ds.get('verify')} k={ds.get('slot_size')}"}
    print(f"held-out problems ({len(refs)}, greedy; exact match = the final answer after '####'):")
    for k, f in figs.items():
        print(f"  {labels[k]:16s} exact match {f['exact_match']:.3f}  TPF {f['tpf']:.2f}  "
              f"({f['tokens']} tokens, {f['forwards']} forwards)  "
              f"answers identical to AR {f['identical_to_ar']:.0%}")
    if ev and "qa" in ev:
        qa = ev["qa"]
        print(f"evaluate (validation split): loss {ev['loss']['val_loss']:.3f}; final-answer "
              f"exact match of {qa['ar']['examples']} problems: ar {qa['ar']['exact_match']:.3f}"
              f", {labels['draft']} {qa['refusion']['exact_match']:.3f} (TPF "
              f"{qa['refusion']['tpf']:.2f})")
    d = figs["draft"]
    if not fell:
        print("FAIL: the training loss did not fall", file=sys.stderr)
        return 1
    if d["differ"]:
        print(f"FAIL: {labels['draft']} is not lossless: {len(d['differ'])} of {d['problems']} "
              f"held-out answers differ from AR's (first: problem {d['differ'][0]})",
              file=sys.stderr)
        return 1
    print(f"OK: the training loss fell; {labels['draft']} decoded every held-out answer with "
          f"AR's token ids in {figs['ar']['forwards'] / max(1, d['forwards']):.2f}x fewer "
          f"forwards (TPF {d['tpf']:.2f}), AR exact match {figs['ar']['exact_match']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
