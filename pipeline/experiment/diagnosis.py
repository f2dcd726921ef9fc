"""The experiment's diagnosis: a teacher-forced profile of one plan + verify step.

Owns: `slot_acceptance`, which separates what the model can draft from what the decoder makes
of it (per-offset draft accuracy, tokens one verify accepts per slot, the AR ceiling), on the
reference answers of an evaluation set. Must not touch: decoding (it reproduces one step of
`pipeline.inference.decoding`'s rules on teacher-forced contexts), training, files.
"""
from __future__ import annotations

import torch

__all__ = ["slot_acceptance", "first_token_effect"]


@torch.no_grad()
def slot_acceptance(loaded, examples: list[dict], slot_size: int, block_size: int,
                    thresholds=(0.1, 0.5, 0.9), batch_size: int = 64) -> dict:
    """Teacher-forced profile of one plan + verify step of ReFusion decoding, at every slot of
    every reference answer: why a decode reaches the TPF it does.

    For each example and each slot start s = 0, k, 2k, ... inside its reference (EOS included),
    the committed context is the prompt plus the reference's first s tokens (what a decode that
    got everything before s right would have in its cache). Plan: masks from s to the end of
    s's block (blocks of `block_size` tokens from the answer start, as the decoder splits
    gen_length), fed causally after that context: the draft is the argmax at each mask. Verify:
    the slot's drafted tokens fed after the context: q_j = P(draft_j | context, draft_<j).
    A step accepts draft_0 and then draft_j while q_j > threshold (the decoder's rule).

    Args:
        loaded: `pipeline.inference.loading.Loaded`.
        examples: [{"prompt_ids": list[int], "reference_ids": list[int] (EOS included)}].
        slot_size: k (tokens); block_size: tokens per decoding block (gen_length / num_blocks),
            a multiple of k.
        thresholds: token thresholds to evaluate.
        batch_size: sequences per forward.

    Returns:
        {"slots": number of slots profiled, "slot_size", "first_token_accuracy" (draft_0 ==
        reference, the slot-selection token), "draft_accuracy_by_offset" ([k] fractions: draft_j
        == reference_j, over slots long enough), "exact_slot_drafts" (fraction of slots whose
        whole draft equals the reference), "accepted" ({threshold: mean tokens accepted per slot
        by one verify}), "accepted_correct" ({threshold: mean accepted tokens that are a
        correct prefix}), "ar_next_token_accuracy" (greedy causal prediction of reference_j
        from the reference prefix, over the same positions: the AR decode's ceiling),
        "ar_next_token_accuracy_by_place" (the same, split into the answer's first token
        (predicted at the prompt's last token), the first token of every later slot, and the
        tokens inside slots: the ReFusion objective trains only the last kind),
        "accepted_verify_correct" (mean leading drafts equal to the AR head's greedy choice,
        draft_0 judged by the prediction at the last context token: what one verify of
        `verify="correct"` accepts before its correction or bonus token)}.
    Raises:
        ValueError: block_size not a positive multiple of slot_size.
    """
    from pipeline.model import gather_logits
    k = slot_size
    if block_size < k or block_size % k:
        raise ValueError(f"block_size {block_size} must be a positive multiple of slot_size {k}")
    model, mask_id = loaded.model, loaded.mask_id
    device = next(model.parameters()).device

    def logits_of(seqs: list[list[int]]) -> list[torch.Tensor]:
        # batched by length (longest first), so a batch pads little; returned in input order
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list = [None] * len(seqs)
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            t = len(seqs[idx[0]])
            ids = torch.tensor([seqs[j] + [0] * (t - len(seqs[j])) for j in idx], device=device)
            pos = torch.arange(t, device=device).expand(len(idx), t)
            lg = gather_logits(model(ids, pos)).float().cpu()   # plain causal; right padding inert
            for row, j in enumerate(idx):
                out[j] = lg[row, :len(seqs[j])]
        return out

    jobs = []   # (prompt, reference, s, slot length)
    for e in examples:
        ref = list(e["reference_ids"])
        for s in range(0, len(ref), k):
            jobs.append((list(e["prompt_ids"]), ref, s, min(k, len(ref) - s)))
    if not jobs:
        return {"slots": 0, "slot_size": k}
    plans = logits_of([p + r[:s] + [mask_id] * ((s // block_size + 1) * block_size - s)
                       for p, r, s, _ in jobs])
    drafts = [lg[len(p) + s:len(p) + s + n].argmax(-1) for lg, (p, r, s, n) in zip(plans, jobs)]
    verifies = logits_of([p + r[:s] + d.tolist() for d, (p, r, s, _) in zip(drafts, jobs)])
    ar = logits_of([p + r for p, r, s, _ in jobs if s == 0])
    ar_by_ex = iter(ar)
    first = exact = 0
    off_hit, off_n = [0] * k, [0] * k
    acc = {t: 0 for t in thresholds}
    acc_ok = {t: 0 for t in thresholds}
    ar_hit = ar_n = 0
    by_place = {"first": [0, 0], "slot_first": [0, 0], "within": [0, 0]}
    corr = 0
    cur = None
    for (p, r, s, n), d, vl in zip(jobs, drafts, verifies):
        if s == 0:
            cur = next(ar_by_ex)
        gold = torch.tensor(r[s:s + n])
        ok = d == gold
        first += int(ok[0])
        exact += int(bool(ok.all()))
        for j in range(n):
            off_hit[j] += int(ok[j])
            off_n[j] += 1
        ar_pred = cur[len(p) + s - 1:len(p) + s + n - 1].argmax(-1)
        ar_hit += int((ar_pred == gold).sum())
        ar_n += n
        hits = (ar_pred == gold).tolist()
        for j, h in enumerate(hits):
            place = "within" if j else ("first" if s == 0 else "slot_first")
            by_place[place][0] += int(h)
            by_place[place][1] += 1
        q = torch.softmax(vl[len(p) + s:len(p) + s + n - 1], -1).gather(
            -1, d[1:, None])[:, 0] if n > 1 else torch.empty(0)
        # verify="correct": leading drafts equal to the AR head's choice (offset 0 judged by
        # the logits at the last context token), then one corrected or bonus token.
        agree = d == vl[len(p) + s - 1:len(p) + s + n - 1].argmax(-1)
        lead = int(torch.cumprod(agree.long(), 0).sum())
        corr += lead

        for t in thresholds:
            m = 1
            while m < n and float(q[m - 1]) > t:
                m += 1
            acc[t] += m
            c = 0
            while c < m and bool(ok[c]):
                c += 1
            acc_ok[t] += c
    total = len(jobs)
    return {"slots": total, "slot_size": k,
            "first_token_accuracy": first / total,
            "draft_accuracy_by_offset": [h / c if c else None for h, c in zip(off_hit, off_n)],
            "exact_slot_drafts": exact / total,
            "accepted": {str(t): acc[t] / total for t in thresholds},
            "accepted_correct": {str(t): acc_ok[t] / total for t in thresholds},
            "ar_next_token_accuracy": ar_hit / ar_n,
            "ar_next_token_accuracy_by_place": {k: h / c if c else None
                                                for k, (h, c) in by_place.items()},
            "accepted_verify_correct": corr / total}


@torch.no_grad()
def first_token_effect(loaded, examples: list[dict], gen_length: int, slot_size: int,
                       metric: str = "text", batch_size: int = 64) -> dict:
    """How much of a model's free-decoding accuracy hangs on the answer's first token: greedy
    AR decoding after the prompt with the first answer token chosen three ways, the AR head's
    own choice (plain AR decoding), the plan's (the argmax at the first of `slot_size` masks
    fed after the prompt, the MDM head), and the reference's; then the rest decoded
    greedily. (With one slot per block the corrected decoder, `verify="correct"`, continues
    exactly as AR decoding does, so these are also its accuracies.)

    Args:
        loaded: `pipeline.inference.loading.Loaded`.
        examples: [{"prompt_ids", "reference_ids" (EOS included), "reference" (text)}].
        gen_length: tokens generated at most (the first one included).
        slot_size: masks fed after the prompt for the plan's choice.
        metric: `pipeline.inference.evaluation.score_answers` metric (pass_at_1: examples
            with "signature" and "tests").

    Returns:
        {"examples", "first_token_accuracy": {"ar", "plan"}, "exact_match": {"ar", "plan",
        "reference"}}.
    """
    from pipeline.inference.decoding import ar_generate
    from pipeline.inference.evaluation import score_answers
    from pipeline.model import gather_logits
    model, eos = loaded.model, loaded.eos_id
    device = next(model.parameters()).device
    prompts = [list(e["prompt_ids"]) for e in examples]
    refs = [e.get("reference") or loaded.decode(e["reference_ids"][:-1]) for e in examples]
    firsts = {"reference": [e["reference_ids"][0] for e in examples], "ar": [], "plan": []}
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        for kind, extra in (("ar", 0), ("plan", slot_size)):
            seqs = [p + [loaded.mask_id] * extra for p in chunk]
            t = max(map(len, seqs))
            ids = torch.tensor([s + [0] * (t - len(s)) for s in seqs], device=device)
            pos = torch.arange(t, device=device).expand(len(seqs), t)
            lg = gather_logits(model(ids, pos)).float()
            at = [len(p) - 1 if kind == "ar" else len(p) for p in chunk]
            firsts[kind] += [int(lg[j, a].argmax()) for j, a in enumerate(at)]
    out = {"examples": len(examples), "first_token_accuracy": {}, "exact_match": {}}
    for kind in ("ar", "plan", "reference"):
        if kind != "reference":
            out["first_token_accuracy"][kind] = sum(
                a == b for a, b in zip(firsts[kind], firsts["reference"])) / len(examples)
        texts = []
        for i in range(0, len(prompts), batch_size):
            heads = [p + [f] for p, f in zip(prompts[i:i + batch_size],
                                             firsts[kind][i:i + batch_size])]
            gen = ar_generate(model, heads, gen_length - 1, 0.0, eos)
            for f, toks in zip(firsts[kind][i:i + batch_size], gen.tokens):
                ids = [f] + toks if f != eos else [f]
                texts.append(loaded.decode(ids[:ids.index(eos)] if eos in ids else ids))
        out["exact_match"][kind] = sum(score_answers(texts, examples, metric, refs)[0]
                                       ) / len(examples)
    return out
