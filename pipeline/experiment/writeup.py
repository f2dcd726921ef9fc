"""The experiment's report: `report.md` text, `frontier.png`, the side-by-side solutions.

Owns: turning cached results (`Experiment.collect()`: decode results, validation losses,
diagnosis profiles) and training metrics into tables, the Pareto frontier, and decoded answers
with the tokens each forward committed marked. Must not touch: running anything (no model,
no decoding); plotting of one run (`pipeline.report`); the ratios to AR and the target check
(`pipeline.experiment.ratios`).
"""
from __future__ import annotations

from pathlib import Path

# check_target, paired_bootstrap_ratio: re-exported (tests call them `writeup.check_target`, ...)
from pipeline.experiment.ratios import (_f, ar_row, arm_of, baseline_of, batch_of,  # noqa: F401
                                        check_target, paired_bootstrap_ratio, ratio_rows,
                                        ratio_table, setting_of, target_lines)
from pipeline.experiment.tasks import Setting, arm_setting, arm_text

COLORS = {4: "tab:blue", 8: "tab:orange", 16: "tab:green", 32: "tab:purple"}
MARKERS = {"authors": "o", "correct": "^", "draft_ahead": "D"}
AR_FACE = {"refusion": "white", "ar_continued": "black", "refusion_boundary": "tab:red"}


def pareto(rows: list[dict]) -> list[dict]:
    """Rows not dominated in (TPF, exact match, token accuracy): no other row is at least as
    good in all three and better in one. Sorted by TPF."""
    def key(r):
        return (r["tpf"], r["exact_match"], r.get("token_accuracy") or 0.0)
    out = [r for r in rows
           if not any(all(a >= b for a, b in zip(key(o), key(r))) and key(o) != key(r)
                      for o in rows)]
    return sorted(out, key=lambda r: r["tpf"])


def same_as_ar(row: dict, rows: list[dict]) -> float | None:
    """Fraction of examples whose decoded ids equal the AR decoding of the same model on the
    same set (None when either has no kept outputs)."""
    ar = ar_row(rows, row["model"], row.get("set"))
    if ar is None or "outputs" not in ar or "outputs" not in row:
        return None
    pairs = list(zip(row["outputs"], ar["outputs"]))
    return sum(a["ids"] == b["ids"] for a, b in pairs) / len(pairs) if pairs else None


def target_check(rows: list[dict], tpf: float, ratio: float) -> dict:
    """The target per ReFusion model and verify mode: ReFusion decoding at TPF >= tpf with
    exact match >= ratio x the exact match of `ar_continued`'s AR decoding.

    Returns:
        {"baseline": that exact match or None, "need": ratio x baseline, (model, verify mode):
        [rows meeting it]} over the refusion-mode rows (default batch) of every model but
        `ar_continued` in `rows`.
    """
    base = ar_row(rows, "ar_continued")
    out: dict = {"baseline": None if base is None else base["exact_match"]}
    if base is None:
        return out
    need = ratio * base["exact_match"]
    out["need"] = need
    for r in rows:
        if r["mode"] == "refusion" and r["model"] != "ar_continued" and batch_of(r) == 0:
            key = (r["model"], setting_of(r).verify)
            out.setdefault(key, [])
            if r["tpf"] >= tpf and r["exact_match"] >= need:
                out[key].append(r)
    return out


def timing_lines(timings: dict) -> list[str]:
    """Markdown: the last invocation's stages (`timings.json`): ran or reused, wall seconds,
    threads, processes, date, and for a reused stage when it last ran."""
    if not timings:
        return []
    L = ["| stage | this invocation | wall s | threads | processes | date | last run (s, date) |",
         "|---|---|---|---|---|---|---|"]
    total = 0.0
    for k, v in timings.items():
        v = {"status": "ran", "seconds": float(v)} if isinstance(v, (int, float)) else v
        total += v.get("seconds") or 0.0
        last = v.get("last_run") or {}
        L.append(f"| {k} | {v.get('status', '-')} | {v.get('seconds', 0):.0f} | "
                 f"{v.get('threads', '-')} | {v.get('processes', '-')} | {v.get('date', '-')} | "
                 + (f"{last.get('seconds', 0):.0f}, {last.get('date', '-')}" if last else "-")
                 + " |")
    return L + ["", f"Total of this invocation: {total:.0f} s ({total / 60:.1f} min)."]


# ---------------------------------------------------------------- figures
def plot_frontier(rows: list[dict], path: Path, task, target_tpf: float = 1.5,
                  target_ratio: float = 0.9) -> dict:
    """TPF and tokens/s against exact match and token accuracy: one point per ReFusion decode
    of the main set (colour = slot size, marker = verify mode, hollow = one slot per block),
    AR decodes as stars; the target region's edges as dotted lines.

    Returns:
        {panel: {series label: (x values, y values)}} of the points drawn.
    """
    from pipeline.report import pyplot, save_figure
    plt = pyplot()
    panels = (("exact_match", "tpf", "exact match", "TPF (tokens per forward)"),
              ("token_accuracy", "tpf", "token accuracy", "TPF (tokens per forward)"),
              ("exact_match", "tps", "exact match", "tokens/s"))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    drawn: dict = {}
    rows = [r for r in rows if batch_of(r) == 0]
    base = target_check(rows, target_tpf, target_ratio)
    for ax, (xk, yk, xl, yl) in zip(axes, panels):
        d = drawn.setdefault(f"{yl} vs {xl}", {})
        for r in rows:
            if r.get(xk) is None:
                continue
            if r["mode"] == "refusion":
                s = setting_of(r)
                order = "1 slot/block" if s.num_blocks == 0 else f"{s.num_blocks} blocks"
                if s.verify == "draft_ahead":
                    order = "left to right"
                who = "" if r["model"] == "refusion" else f" [{r['model']}]"
                label = f"ReFusion k={s.slot_size} {order} verify {s.verify}{who}"
                color = ("black" if r["model"] == "ar_continued"
                         else COLORS.get(s.slot_size, "gray"))
                if r["model"] == "refusion_boundary":   # filled, black edge
                    ax.scatter(r[xk], r[yk], marker=MARKERS.get(s.verify, "s"), s=55,
                               facecolors=color, edgecolors="black", linewidths=1.5,
                               label=label if label not in d else None)
                else:
                    ax.scatter(r[xk], r[yk], marker=MARKERS.get(s.verify, "s"), s=40,
                               facecolors="none" if s.num_blocks == 0 else color,
                               edgecolors=color, label=label if label not in d else None)
                ax.annotate(f"t{s.token_threshold}", (r[xk], r[yk]), fontsize=6,
                            xytext=(3, 2), textcoords="offset points")
            else:
                label = f"AR decoding of {r['model']}"
                ax.scatter(r[xk], r[yk], marker="*", s=180, edgecolors="black",
                           c=AR_FACE.get(r["model"], "gray"),
                           label=label if label not in d else None)
            xs, ys = d.setdefault(label, ([], []))
            xs.append(r[xk])
            ys.append(r[yk])
        if yk == "tpf":
            ax.axhline(target_tpf, color="red", linestyle=":", linewidth=1,
                       label=f"target TPF {target_tpf}")
        if xk == "exact_match" and base.get("need") is not None:
            ax.axvline(base["need"], color="red", linestyle="--", linewidth=1,
                       label=f"{target_ratio:.0%} of ar_continued's AR exact match")
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="best")
    fig.suptitle(f"ReFusion decoding vs AR: {task.title}, held-out set `{task.main_set}`, greedy")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------- side-by-side answers
def marked_text(tok, ids: list[int], commit_forward: list[int], eos_id: int) -> str:
    """The decoded answer with each run of consecutive tokens committed by the same forward
    written `{f:text}` (f = the row's forward after which they were committed). Text pieces
    are cut from the decode of growing prefixes, so spaces survive. Ids past the tokenizer
    (embedding rows no piece uses) are dropped, as `Loaded.decode` drops them."""
    n = ids.index(eos_id) if eos_id in ids else len(ids)
    keep = [j for j in range(n) if 0 <= ids[j] < tok.info.vocab_size]
    ids, fw = [ids[j] for j in keep], [commit_forward[j] for j in keep]
    n = len(ids)
    if not ids:
        return ""

    def text(j):
        return _text(tok, ids[:j])
    out, start = [], 0
    for j in range(1, n + 1):
        if j == n or fw[j] != fw[start]:
            head, full = text(start), text(j)
            piece = full[len(head):] if full.startswith(head) else full
            out.append(f"{{{fw[start]}:{piece}}}")
            start = j
    return "".join(out)


def _text(tok, ids: list[int]) -> str:
    """The text of `ids`, ids past the tokenizer (embedding rows no piece uses) dropped."""
    ids = [i for i in ids if 0 <= i < tok.info.vocab_size]
    return tok.sp.DecodeIds(ids) if hasattr(tok, "sp") else tok.tok.decode(ids)


def plain_text(tok, ids: list[int], eos_id: int) -> str:
    """The text of `ids` up to the first `eos_id`, ids past the tokenizer dropped."""
    n = ids.index(eos_id) if eos_id in ids else len(ids)
    return _text(tok, ids[:n])


def samples_markdown(rows: list[dict], task, examples: list[dict] | None, tok,
                     n: int = 3, models=None) -> list[str]:
    """The first `n` examples of the main set: reference, AR decodes, and the task's sample
    settings with the tokens each forward committed marked, for `models` (default the task's
    ReFusion arms)."""
    if tok is None:
        return []
    eos = tok.info.eos_id
    pick = [("AR decoding of ar_continued", "ar_continued", Setting())]
    for m in (task.refusion_arms if models is None else models):
        pick += [(f"AR decoding of {m}", m, Setting())]
        pick += [(f"ReFusion decoding of {m} ({s.label()})", m, s)
                 for s in (arm_setting(m, x) for x in task.sample_settings)
                 if m == "refusion" or s.verify != "authors"]
    found = []
    for title, model, s in pick:
        r = next((r for r in rows if r["model"] == model and setting_of(r) == s
                  and "outputs" in r), None)
        if r is not None:
            found.append((title, r))
    if not found:
        return []
    L = ["## Decoded answers side by side", "",
         f"The first {n} problems of `{task.main_set}` (not selected). In ReFusion decodes, "
         "`{f:text}` marks the tokens committed together after the row's f-th forward (a plan "
         "or verify; with several slots per step, runs with the same f are filled in "
         "parallel). Forward counts include the plan forwards, so a verify that accepts a "
         "whole slot shows as one run.", ""]
    for i in range(n):
        if examples is not None and i < len(examples) and "query" in examples[i]:
            L += [f"**Problem {i + 1}.** {examples[i]['query']}", ""]
        else:
            L += [f"**Example {i + 1}.**", ""]
        if examples is not None and i < len(examples):
            ref = examples[i].get("reference") or plain_text(
                tok, examples[i]["reference_ids"], eos)
            L += ["Reference:", "```", ref, "```"]
        for title, r in found:
            if i >= len(r["outputs"]):
                continue
            o = r["outputs"][i]
            body = (plain_text(tok, o["ids"], eos) if r["mode"] == "ar"
                    else marked_text(tok, o["ids"], o["commit_forward"], eos))
            forwards = max(o["commit_forward"]) if o["commit_forward"] else 0
            L += [f"{title}: {len(o['ids'])} tokens, committed by forward {forwards} at the "
                  f"latest", "```", body, "```"]
        L.append("")
    return L


# ---------------------------------------------------------------- report.md
def decode_table(rows: list[dict]) -> list[str]:
    L = ["| model | decoding | verify | k | order | slot thr | token thr | TPF | tokens/s | "
         "exact match | token accuracy | identical to AR decoding of the same model |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    models = {"refusion": 0, "refusion_boundary": 1, "ar_continued": 2}

    def order(r):
        s = setting_of(r)
        return (r["mode"] != "ar", models.get(r["model"], 3), s.verify, s.slot_size,
                s.num_blocks, s.token_threshold)
    for r in sorted((r for r in rows if batch_of(r) == 0), key=order):
        s = setting_of(r)
        if r["mode"] == "ar":
            cells = ["ar", "-", "-", "-", "-", "-"]
        elif s.verify == "draft_ahead":
            cells = ["refusion", s.verify, str(s.slot_size), "left to right", "-",
                     str(s.token_threshold)]
        else:
            cells = ["refusion", s.verify, str(s.slot_size),
                     "1 slot/block" if s.num_blocks == 0 else f"{s.num_blocks} blocks",
                     str(s.slot_threshold), str(s.token_threshold)]
        same = same_as_ar(r, rows) if r["mode"] == "refusion" else None
        em = f"{r['exact_match']:.3f}"
        if r.get("metric") == "pass_at_1" and r.get("text_match") is not None:
            em += f" (body {r['text_match']:.3f})"     # pass@1, whole-body exact match beside
        L.append(f"| {r['model']} | " + " | ".join(cells) + f" | {r['tpf']:.2f} | "
                 f"{r['tps']:.0f} | {em} | {_f(r.get('token_accuracy'))} | "
                 f"{_f(same)} |")
    return L


def latency_table(rows: list[dict]) -> list[str]:
    """Tokens/s of the batch-1 decodes beside the same decodes at the task's batch, and the
    wall-clock speedup over `ar_continued`'s AR decoding at batch 1 at the same seed (its wall
    seconds over this decode's, on the same problems)."""
    one = [r for r in rows if batch_of(r) == 1]
    if not one:
        return []
    L = ["| model | decoding | problems | TPF | tokens/s at batch 1 | wall-clock speedup over AR "
         "of ar_continued at batch 1 | tokens/s at the default batch |",
         "|---|---|---|---|---|---|---|"]
    for r in one:
        base = next((o for o in one if o["mode"] == "ar"
                     and o["model"] == baseline_of(r["model"])), None)
        plain = Setting(**{**setting_of(r).to_dict(), "batch_size": 0})   # at the default batch
        twin = next((o for o in rows if batch_of(o) == 0 and o["model"] == r["model"]
                     and o["mode"] == r["mode"] and (o["mode"] == "ar" or setting_of(o) == plain)),
                    None)
        label = "AR" if r["mode"] == "ar" else plain.label()
        ok = base and r["seconds"] and base["examples"] == r["examples"]
        L.append(f"| {r['model']} | {label} | {r['examples']} | {r['tpf']:.2f} | {r['tps']:.0f} | "
                 + (f"{base['seconds'] / r['seconds']:.2f}" if ok else "-") + " | "
                 + (f"{twin['tps']:.0f}" if twin else "-") + " |")
    return L


def sweep_lines(sweep: dict | None) -> list[str]:
    """The natural-order sweep (`sweep.json`) as a table and its choice."""
    if not sweep:
        return []
    st = Setting.from_dict(sweep["setting"])
    L = ["## The natural-order sweep (`--sweep`)", "",
         f"`refusion_boundary` arms at equal compute, one per natural-order share, decoded on "
         f"`{sweep['set']}` (not the reported set). AR decoding of `ar_continued` there: "
         f"{sweep['ar_continued_exact_match']:.3f}; the rule: the largest TPF of {st.label()} "
         f"among the shares whose AR decoding reaches {sweep['ratio']:.0%} of it, else the "
         "largest exact match.", "",
         "| natural-order share | AR decoding: exact match / token accuracy | "
         f"{st.label()}: TPF / exact match | chosen |", "|---|---|---|---|"]
    for r in sweep["rows"]:
        L.append(f"| {r['natural_order_fraction']:g} | {r['ar_exact_match']:.3f} / "
                 f"{r['ar_token_accuracy']:.3f} | {r['tpf']:.2f} / {r['exact_match']:.3f} | "
                 + ("**yes**" if r["natural_order_fraction"] == sweep["chosen"] else "") + " |")
    return L + [""]


def report_markdown(exp, got: dict, runs: dict, tok=None, target: dict | None = None,
                    goal: dict | None = None) -> str:
    """report.md of an `Experiment` (`exp`) from `exp.collect()` (`got`), the training runs'
    metrics (`runs`: {label: read_metrics result}) and the task's tokenizer (for the
    side-by-side answers; None leaves them out); the target (and, when given, the goal:
    {"tpf", "em_ratio", "lower", "speedup"}, `check_target`) checked on the main set."""
    task = exp.task
    models = exp.models()
    ref_models = [m for m in models if arm_of(m) != "ar_continued"]
    rows = got["rows"]
    main = [r for r in rows if r.get("set") == task.main_set]
    n_main = main[0]["examples"] if main else 0
    L = [f"# ReFusion vs AR, scaled down: {task.title} (`make experiment TASK={task.name}`)", ""]
    L += ["## Settings", "",
          f"- data: {task.data_description} (`{exp.shards}`)",
          f"- model: run config `{exp.config}`; {exp.nproc} process(es) x {exp.threads} "
          f"thread(s)" + (f"; {exp.parallel or len(models)} stage-2 runs at a time"
                          if exp.parallel != 1 else "")
          + (f"; evaluation in {exp.eval_workers()} processes at a time, the batch-1 decodes "
             f"alone afterwards" if exp.eval_workers() > 1 else ""),
          f"- 1. AR pretraining from scratch: {exp.pretrain_steps} steps of "
          f"{exp.micro_batch_size} packed 256-token rows",
          "- stage 2 from the export, " + ", ".join(
              arm_text(a) for a in exp.arms) + f": {exp.finetune_steps} steps each"
          + "".join(f" ({a}: {exp.stage2_steps(a)})" for a in exp.arms
                    if exp.stage2_steps(a) != exp.finetune_steps)
          + ", same batch, data order and lr schedule; seeds (`train.seed`): "
          + ", ".join(map(str, exp.seeds)) + f"; decoding grid `{exp.grid}`"]
    L += task.settings_text()
    L += ["- the held-out sets, metric, generation length and grid were fixed before any "
          "decode result was seen (`pipeline/experiment/tasks.py`)", ""]
    if exp.timings:
        L += ["Stages of the last invocation (`timings.json`; `reused`: its result was there, "
              "made from the same inputs; `skipped`: the options did not ask for it):", ""] + timing_lines(exp.timings) + [""]
    clean = exp.clean_tokens_fed(runs)
    L += ["## Training", "", "| run | steps | tokens | clean tokens | last train loss (AR / MDM) "
          "| last validation loss (AR / MDM) |", "|---|---|---|---|---|---|"]
    for label, m in runs.items():
        tr, va = m.get("train", []), m.get("val", [])
        if not tr:
            continue
        t = tr[-1]
        k = max(1, min(10, len(tr) // 4))

        def mean(key):
            vals = [x[key] for x in tr[-k:] if isinstance(x.get(key), (int, float))]
            return sum(vals) / len(vals) if vals else None
        v = va[-1] if va else {}
        L.append(f"| {label} | {t['run_step']} | {t.get('consumed_tokens', '-')} | "
                 f"{clean.get(label, '-')} | "
                 f"{_f(mean('loss'))} ({_f(mean('ar_loss'))} / {_f(mean('mdm_loss'))}) | "
                 f"{_f(v.get('val_loss'))} ({_f(v.get('val_ar_loss'))} / "
                 f"{_f(v.get('val_mdm_loss'))}) |")
    L += ["", "(tokens: real tokens fed, padding left out; clean tokens: those fed unmasked "
          "with next-token targets, copies left out, for the AR and dual-objective runs; train "
          "loss: mean of the last logged steps; each run's validation uses its own objective; "
          "steps of 2a/2b are counted after stage 1 in loss.png)", ""]
    if got["losses"]:
        L += ["Validation loss of each stage-2 model under the paper's ReFusion objective "
              "(`pipeline.training.validation.validation_loss`, first 160 validation samples):", "",
              "| model | loss | AR term | MDM term |", "|---|---|---|---|"]
        for m, v in got["losses"].items():
            L.append(f"| {m} | {_f(v['val_loss'], '.4f')} | {_f(v['val_ar_loss'], '.4f')} | "
                     f"{_f(v['val_mdm_loss'], '.4f')} |")
        L.append("")
    metric = {"final_answer": "exact match of the final answer (the number after `####`)",
              "pass_at_1": "pass@1 in the exact-match columns (the answer passes all its "
                           "assert tests, run in a sandboxed subprocess: "
                           "`pipeline.inference.execution`), in brackets the whole body's "
                           "exact match"}.get(
                               task.metric, "exact match of the whole answer")
    L += [f"## Decoding `{task.main_set}` ({n_main} examples)", "",
          f"Greedy; {metric}; token accuracy against the reference ids; TPF = generated tokens "
          f"/ forwards; tokens/s at batch {task.decode_batch}; the last column: answers whose "
          "ids equal the AR decoding of the same model.", ""]
    L += decode_table(main) + [""]
    lat = latency_table(main)
    if lat:
        L += ["Latency: the same decodes one prompt at a time (batch 1), where a forward costs "
              "about the same whatever it feeds on a GPU; on these CPUs it still grows with "
              "the tokens fed.", ""] + lat + [""]
    L += sweep_lines(got.get("sweep"))
    for model in ref_models:
        ref = [r for r in main if r["mode"] == "refusion" and r["model"] == model
               and batch_of(r) == 0]
        if not ref:
            continue
        L += [f"## Frontier of `{model}`", "", f"ReFusion decodes of `{model}` not dominated in "
              "(TPF, exact match, token accuracy):", ""]
        for r in pareto(ref):
            L.append(f"- {setting_of(r).label()}: TPF {r['tpf']:.2f}, exact match "
                     f"{r['exact_match']:.3f}, token accuracy {_f(r.get('token_accuracy'))}")
        L.append("")
    ratios = ratio_rows(main)
    score = task.score_name
    if ratios:
        L += [f"## {score[0].upper() + score[1:]} relative to AR", "",
              f"Each ReFusion decode's {score} over the AR decoding of `ar_continued` at the "
              f"same seed, on the same {n_main} problems; the 95% interval is a paired "
              "bootstrap over problems (10,000 resamples of the problem indices, the ratio of "
              "means per resample, percentile interval; seed 0). Batch-1 speedup: wall seconds "
              "of `ar_continued`'s AR decoding at batch 1 over this setting's at batch 1, on the "
              f"same first {min(task.latency_examples or n_main, n_main)} problems.", ""]
        L += ratio_table(ratios, score) + [""]
    if target is not None and ratios:
        L += ["## Target"] + target_lines(ratios, target, "Target (issue 34)", score)
        if goal is not None:
            L += target_lines(ratios, goal, "Goal beyond it", score)
        L.append("")
    others = [r for r in rows if r.get("set") != task.main_set]
    for set_name in dict.fromkeys(r["set"] for r in others):
        part = [r for r in others if r["set"] == set_name]
        L += [f"## Decoding `{set_name}` ({part[0]['examples']} examples)", ""]
        L += decode_table(part) + [""]
        part_ratios = ratio_rows(part)
        if part_ratios:
            L += [f"Relative to AR on `{set_name}`: each ReFusion decode over the AR decoding "
                  "of `ar_continued` at the same seed, paired bootstrap 95% interval as above.",
                  ""] + ratio_table(part_ratios, score) + [""]
    examples = None
    if tok is not None:   # the examples need the task's tokenizer too
        try:
            examples = exp.examples(task.main_set)[:3]
        except (OSError, ValueError, KeyError):
            pass
    L += samples_markdown(main, task, examples, tok, models=ref_models)
    diag = got.get("diagnose") or []
    if diag:
        thr = list(diag[0]["accepted"])
        L += ["## Diagnosis: one plan + verify step, teacher-forced", "",
              "`pipeline.experiment.diagnosis.slot_acceptance`: at every slot of every reference "
              "answer of the main set, with the prompt and the reference before the slot as "
              "context (what a decode that got everything before right would hold), the plan "
              "drafts the slot from masks and one verify forward accepts drafted tokens while "
              "their causal probability exceeds the token threshold (the authors' rule; the "
              "slot's first token is always kept), or, for verify=correct, while they equal the "
              "AR head's greedy choice (the first token included). The last column splits the "
              "AR next-token accuracy by where the token is: the answer's first token "
              "(predicted at the prompt's last token), a later slot's first token, a token "
              "inside a slot (the only transition the ReFusion objective's AR term trains).", "",
              "| model | k | slots | first token correct | draft correct by offset | whole "
              "slot drafted correctly | tokens accepted per slot (thr " + " / ".join(thr) +
              ") | of them a correct prefix | drafts equal to the AR choice (verify=correct) | "
              "AR next-token accuracy | of which: answer's first token / slot's first token / "
              "inside a slot |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in diag:
            offs = " ".join(f"{x:.2f}" for x in d["draft_accuracy_by_offset"] if x is not None)
            L.append(f"| {d['model']} | {d['slot_size']} | {d['slots']} | "
                     f"{d['first_token_accuracy']:.3f} | {offs} | {d['exact_slot_drafts']:.3f} | "
                     + " / ".join(f"{d['accepted'][t]:.2f}" for t in thr) + " | "
                     + " / ".join(f"{d['accepted_correct'][t]:.2f}" for t in thr) + " | "
                     f"{_f(d.get('accepted_verify_correct'), '.2f')} | "
                     f"{d['ar_next_token_accuracy']:.3f} | "
                     + " / ".join(_f((d.get("ar_next_token_accuracy_by_place") or {}).get(k))
                                  for k in ("first", "slot_first", "within")) + " |")
        L.append("")
    first = got.get("first_token") or []
    if first:
        L += ["### The answer's first token", "",
              "`pipeline.experiment.diagnosis.first_token_effect`: greedy AR decoding of the main "
              "set with the answer's first token chosen three ways, then the rest decoded by the "
              "AR head: its own choice (plain AR decoding), the plan's (the argmax at the first "
              "of k masks after the prompt, as the authors' decoder keeps it), the reference's. "
              "The ReFusion objective gives the prompt's last token no AR label, so the AR head "
              "is never trained to start an answer.", "",
              "| model | first token right: AR head / plan | exact match with the first token of: "
              "AR head / plan / reference |", "|---|---|---|"]
        for d in first:
            acc, em = d["first_token_accuracy"], d["exact_match"]
            L.append(f"| {d['model']} | {_f(acc.get('ar'))} / {_f(acc.get('plan'))} | "
                     + " / ".join(_f(em.get(k)) for k in ("ar", "plan", "reference")) + " |")
        L.append("")
    L += ["Figures: `frontier.png` (TPF / tokens/s vs exact match and token accuracy), "
          "`loss.png` (training and validation losses of all runs).", ""]
    return "\n".join(L)
