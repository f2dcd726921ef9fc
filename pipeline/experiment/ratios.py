"""The experiment's comparison with AR decoding: each ReFusion decode's exact match over the AR
decoding of `ar_continued` at the same seed, its paired bootstrap interval, the batch-1
speedup, and the check of a target (issue 34's) over seeds; the accessors of a decode result
they share with `pipeline.experiment.writeup`.

Owns: the ratios, their interval and the target check, as numbers and as markdown. Must not
touch: running anything (no model, no decoding); the rest of the report
(`pipeline.experiment.writeup`).
"""
from __future__ import annotations

from pipeline.experiment.stage import split_seed
from pipeline.experiment.tasks import Setting


def _f(v, fmt=".3f"):
    return "-" if v is None else format(v, fmt)


def setting_of(row: dict) -> Setting:
    return Setting.from_dict(row.get("setting")) if row["mode"] == "refusion" else Setting()


def batch_of(row: dict) -> int:
    """The decode's batch size setting (0 = the task's default)."""
    return int((row.get("setting") or {}).get("batch_size") or 0)


def ar_row(rows: list[dict], model: str, set_name: str | None = None) -> dict | None:
    """The AR decode of `model` (on `set_name` when given) at the task's default batch."""
    return next((r for r in rows if r["mode"] == "ar" and r["model"] == model
                 and batch_of(r) == 0 and (set_name is None or r.get("set") == set_name)),
                None)


def paired_bootstrap_ratio(a, b, resamples: int = 10_000, level: float = 0.95,
                           seed: int = 0) -> tuple[float, float, float] | None:
    """Ratio of means mean(a) / mean(b) of two paired per-problem scores, with a paired
    bootstrap percentile interval (Efron & Tibshirani, "An Introduction to the Bootstrap",
    1993, ch. 13: the percentile interval): `resamples` times, draw n problem indices with
    replacement, the same indices for both arms, and take the ratio of the two means over
    them; the interval is the (1 - level) / 2 and (1 + level) / 2 quantiles of those ratios
    (numpy's linear interpolation). A resample whose mean(b) is 0 has no ratio and is left out.

    Args:
        a, b: per-problem scores of the same n problems in the same order (e.g. 1 / 0 for a
            correct / wrong answer), sequences of bool or float of length n >= 1.
        resamples: bootstrap resamples; level: the interval's coverage in (0, 1); seed: the
            generator's seed (fixed: the same inputs give the same interval).

    Returns:
        (ratio, lower, upper), or None when mean(b) is 0 (no ratio).

    Raises:
        ValueError: a and b of different lengths, or empty.
    """
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(f"paired scores must be two equal, non-empty 1-d sequences, got "
                         f"shapes {a.shape} and {b.shape}")
    if b.mean() == 0:
        return None
    n, rng, ratios = len(a), np.random.default_rng(seed), []
    for start in range(0, resamples, 1000):       # 1000 resamples x n indices at a time
        idx = rng.integers(0, n, size=(min(1000, resamples - start), n))
        num, den = a[idx].mean(axis=1), b[idx].mean(axis=1)
        ok = den > 0
        ratios.append(num[ok] / den[ok])
    r = np.concatenate(ratios)
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return float(a.mean() / b.mean()), float(lo), float(hi)


def seed_of(model: str) -> int | None:
    """The seed suffix of a model name (`refusion_seed1235` -> 1235; none -> None)."""
    return split_seed(model)[1]


def arm_of(model: str) -> str:
    """A model's arm (its name without the `_seed<N>` suffix)."""
    return split_seed(model)[0]


def baseline_of(model: str) -> str:
    """The AR model a model is compared with: `ar_continued` at the same seed."""
    seed = seed_of(model)
    return "ar_continued" if seed is None else f"ar_continued_seed{seed}"


def ratio_rows(rows: list[dict], resamples: int = 10_000) -> list[dict]:
    """Per ReFusion decode (default batch) of every model but the AR ones: its exact match over
    the exact match of `ar_continued`'s AR decoding at the same seed on the same set, with the
    paired bootstrap 95% interval over problems (`paired_bootstrap_ratio`, seed 0), and the
    batch-1 wall-clock speedup: seconds of `ar_continued`'s AR decode at batch 1 / seconds of
    the same setting at batch 1 (same problems), when both were decoded.

    Returns:
        [{"model", "arm", "seed", "setting" (Setting), "tpf", "exact_match", "ar_exact_match",
        "ratio", "lower", "upper" (None without per-problem results or with an AR exact match
        of 0), "speedup" (or None)}].
    """
    out = []
    for r in rows:
        if r["mode"] != "refusion" or arm_of(r["model"]) == "ar_continued" or batch_of(r):
            continue
        base_name = baseline_of(r["model"])
        base = ar_row(rows, base_name, r.get("set"))
        if base is None:
            continue
        ci = None
        if r.get("correct") is not None and base.get("correct") is not None and \
                len(r["correct"]) == len(base["correct"]):
            ci = paired_bootstrap_ratio(r["correct"], base["correct"], resamples)
        s = setting_of(r)
        one = Setting(**{**s.to_dict(), "batch_size": 1})
        fast = next((o for o in rows if o["model"] == r["model"] and o["mode"] == "refusion"
                     and o.get("set") == r.get("set") and setting_of(o) == one), None)
        slow = next((o for o in rows if o["model"] == base_name and o["mode"] == "ar"
                     and o.get("set") == r.get("set") and batch_of(o) == 1), None)
        speedup = (slow["seconds"] / fast["seconds"] if fast and slow and fast["seconds"]
                   and fast["examples"] == slow["examples"] else None)
        ratio = (r["exact_match"] / base["exact_match"] if base["exact_match"] else None)
        out.append({"model": r["model"], "arm": arm_of(r["model"]), "seed": seed_of(r["model"]),
                    "setting": s, "tpf": r["tpf"], "exact_match": r["exact_match"],
                    "ar_exact_match": base["exact_match"],
                    "ratio": ci[0] if ci else ratio, "lower": ci[1] if ci else None,
                    "upper": ci[2] if ci else None, "speedup": speedup})
    return out


def check_target(ratios: list[dict], target: dict) -> dict:
    """Issue 34's check per (arm, setting) over the seeds present: met when there are at
    least target["seeds"] seeds (default 1) and at every one TPF >= target["tpf"], ratio >=
    target["em_ratio"], the interval's lower end >= target["lower"] and the batch-1 speedup
    >= target["speedup"].

    Returns:
        {(arm, setting name): {"setting": Setting, "seeds": [ratio_rows entries], "met": bool,
        "failed": [what failed, in words]}}.
    """
    out: dict = {}
    for r in ratios:
        out.setdefault((r["arm"], r["setting"].name()), {"setting": r["setting"], "seeds": []})[
            "seeds"].append(r)
    for v in out.values():
        failed = []
        if len(v["seeds"]) < target.get("seeds", 1):
            failed.append(f"{len(v['seeds'])} seed(s) of the {target['seeds']} needed")
        for r in v["seeds"]:
            at = "" if r["seed"] is None else f" (seed {r['seed']})"
            if r["tpf"] < target["tpf"]:
                failed.append(f"TPF {r['tpf']:.2f} < {target['tpf']}{at}")
            if r["ratio"] is None or r["ratio"] < target["em_ratio"]:
                failed.append(f"ratio {_f(r['ratio'])} < {target['em_ratio']}{at}")
            if r["lower"] is None or r["lower"] < target["lower"]:
                failed.append(f"lower end {_f(r['lower'])} < {target['lower']}{at}")
            if r["speedup"] is None or r["speedup"] < target["speedup"]:
                failed.append(f"batch-1 speedup {_f(r['speedup'], '.2f')} < "
                              f"{target['speedup']}{at}")
        v["failed"], v["met"] = failed, not failed
    return out


def ratio_table(ratios: list[dict], score: str = "exact match") -> list[str]:
    """Markdown: each ReFusion decode's ratio to AR with its interval, per seed, then (with
    several seeds) the mean over seeds per arm and setting; `score` names the metric in the
    column heads ("exact match", "pass@1")."""
    if not ratios:
        return []
    L = [f"| model | decoding | TPF | {score} | AR {score} (ar_continued, same seed) | "
         "ratio | 95% interval (paired bootstrap) | batch-1 speedup |",
         "|---|---|---|---|---|---|---|---|"]
    for r in sorted(ratios, key=lambda r: (r["arm"], r["setting"].name(), r["seed"] or 0)):
        ci = "-" if r["lower"] is None else f"[{r['lower']:.3f}, {r['upper']:.3f}]"
        L.append(f"| {r['model']} | {r['setting'].label()} | {r['tpf']:.2f} | "
                 f"{r['exact_match']:.3f} | {r['ar_exact_match']:.3f} | {_f(r['ratio'])} | "
                 f"{ci} | {_f(r['speedup'], '.2f')} |")
    groups: dict = {}
    for r in ratios:
        groups.setdefault((r["arm"], r["setting"].name()), []).append(r)
    if any(len(g) > 1 for g in groups.values()):
        L += ["", "Mean over seeds:", "",
              "| arm | decoding | seeds | TPF | ratio | lowest lower end | batch-1 speedup |",
              "|---|---|---|---|---|---|---|"]

        def mean(xs):
            xs = [x for x in xs if x is not None]
            return sum(xs) / len(xs) if xs else None
        for (arm, _), g in sorted(groups.items()):
            lows = [r["lower"] for r in g]
            L.append(f"| {arm} | {g[0]['setting'].label()} | {len(g)} | "
                     f"{mean([r['tpf'] for r in g]):.2f} | {_f(mean([r['ratio'] for r in g]))} | "
                     f"{_f(None if None in lows else min(lows))} | "
                     f"{_f(mean([r['speedup'] for r in g]), '.2f')} |")
    return L


def target_lines(ratios: list[dict], target: dict, what: str,
                 score: str = "exact match") -> list[str]:
    """Markdown: the target (or goal) and, per arm and setting, met or what failed; `score`
    names the metric ("exact match", "pass@1")."""
    t = target
    L = ["", f"{what}: at one setting of one ReFusion arm, at every seed evaluated (at least "
         f"{t.get('seeds', 1)}), TPF >= {t['tpf']} "
         f"with {score} >= {t['em_ratio']:.0%} of the AR decoding of `ar_continued` (same "
         f"seed), the 95% interval's lower end >= {t['lower']:.0%}, and a batch-1 wall-clock "
         f"speedup >= {t['speedup']}x over `ar_continued`'s AR decoding at batch 1.", ""]
    checked = check_target(ratios, t)
    met = [(k, v) for k, v in sorted(checked.items()) if v["met"]]
    if met:
        L += [f"- met by `{arm}`, {v['setting'].label()}" for (arm, _), v in met]
    else:
        L.append("- not met.")
        for (arm, _), v in sorted(checked.items()):
            L.append(f"  - `{arm}`, {v['setting'].label()}: " + "; ".join(v["failed"]))
    return L
