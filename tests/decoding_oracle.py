"""The cache-free plan-and-infill decoder the tests use as an oracle for
`pipeline.inference.decoding.refusion_generate`: every forward recomputes the whole committed
sequence (in commit order) followed by the step's tokens, so no KV cache is involved.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from pipeline.inference.decoding import _check
from pipeline.inference.driver import _gather, _model_device


@torch.no_grad()
def reference_generate(model, prompt: Sequence[int], gen_length: int, slot_size: int,
                       num_blocks: int, slot_threshold: float, token_threshold: float,
                       mask_id: int, eos_id: int | None, exact_cache: bool = False
                       ) -> tuple[list[int], Counter]:
    """Plan-and-infill for one prompt, greedy, without a KV cache: every forward recomputes the
    whole committed sequence (in commit order) followed by the step's tokens.

    The cache choice is modelled by the attention mask over the committed sequence: with
    `exact_cache` it is plain causal; otherwise tokens of slots committed together after parallel
    infill see the prefix before their group and their own slot only (not the sibling slots),
    as their cached keys/values would. Written straight from docs/METHOD.md ("Decoding"),
    independently of `refusion_generate`, which it must match token for token (and forward for forward).

    Args:
        model: `pipeline.model.Qwen3`. prompt: the prompt ids. Other args: `refusion_generate`.

    Returns:
        (generated ids sorted by position ending at the first EOS inclusive, Counter of forwards
        by kind).
    """
    k = slot_size
    P = len(prompt)
    G = _check(gen_length, k, num_blocks)
    device = _model_device(model)
    # committed entries: (token, position, group, slot); group/slot None = sequential.
    seq: list[tuple[int, int, object, object]] = [(t, i, None, None) for i, t in enumerate(prompt)]
    forwards: Counter = Counter()
    n_groups = 0

    def forward(kind, toks, poss, groups=None):
        """Logits of toks fed after the committed sequence; groups[i] = index of the parallel
        slot of toks[i] (tokens of different slots do not see each other) or None (causal)."""
        forwards[kind] += 1
        allt = [e[0] for e in seq] + list(toks)
        allp = [e[1] for e in seq] + list(poss)
        n, c = len(allt), len(seq)
        # group[i]: parallel group of token i (-1 = none); part[i]: its slot inside the group.
        group = torch.tensor([-1 if e[2] is None else e[2] for e in seq]
                             + [-2 if groups is None else -3] * len(toks))
        part = torch.tensor([-1 if e[3] is None else e[3] for e in seq]
                            + (list(groups) if groups is not None else [0] * len(toks)))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same_group = (group[:, None] == group[None, :]) & (group[:, None] != -1)
        same_group &= group[:, None] != -2   # request tokens without groups: causal
        m = causal & ~(same_group & (part[:, None] != part[None, :]))
        ids = torch.tensor([allt], device=device)
        pos = torch.tensor([allp], device=device)
        out = _gather(model(ids, pos, attention_mask=m[None, None].to(device)))
        return out[0, c:].cpu().double()

    slot_state = {s: "masked" for s in range(G // k)}
    per_block = (G // k) // num_blocks

    def first_eos():
        qs = [e[1] for e in seq if e[0] == eos_id and e[1] >= P] if eos_id is not None else []
        return min(qs) if qs else None

    def drop_after_eos():
        q = first_eos()
        if q is not None:
            for s in slot_state:
                if slot_state[s] == "masked" and P + s * k > q:
                    slot_state[s] = "dropped"

    for blk in range(num_blocks):
        while True:
            todo = [s for s in range(blk * per_block, (blk + 1) * per_block)
                    if slot_state[s] == "masked"]
            if not todo:
                break
            # plan
            lg = forward("plan", [mask_id] * (k * len(todo)),
                         [P + s * k + j for s in todo for j in range(k)])
            pr = torch.softmax(lg, -1)
            best = pr.argmax(-1)
            first_prob = [float(pr[i * k, best[i * k]]) for i in range(len(todo))]
            pick = [i for i in range(len(todo)) if first_prob[i] > slot_threshold]
            if not pick:
                pick = [max(range(len(todo)), key=lambda i: first_prob[i])]
            chosen = [todo[i] for i in pick]
            draft = {s: [int(best[i * k + j]) for j in range(k)] for i, s in zip(pick, chosen)}
            # verify all chosen slots in one causal sequence
            flat = [t for s in chosen for t in draft[s]]
            fpos = [P + s * k + j for s in chosen for j in range(k)]
            lg = forward("verify", flat, fpos)
            pr = torch.softmax(lg, -1)
            ok = []
            for i in range(len(flat)):
                ok.append(i % k == 0 or float(pr[i - 1, flat[i]]) > token_threshold)
            prefix = 0
            while prefix < len(flat) and ok[prefix]:
                prefix += 1
            eos_at = next((i for i in range(prefix) if flat[i] == eos_id), None)
            if eos_at is not None or prefix >= k:
                cut = eos_at + 1 if eos_at is not None else (prefix // k) * k
                for i in range(cut):
                    seq.append((flat[i], fpos[i], None, None))
                for s in chosen[:(cut + k - 1) // k]:
                    slot_state[s] = "done"
                drop_after_eos()
                continue
            # parallel draft / verify, each slot sees the committed prefix and itself
            acc = {}
            for s in chosen:
                i0 = chosen.index(s) * k
                a = 0
                while a < k and ok[i0 + a]:
                    a += 1
                acc[s] = a
            while any(acc[s] < k for s in chosen):
                groups = [gi for gi in range(len(chosen)) for _ in range(k)]
                pos = [P + s * k + j for s in chosen for j in range(k)]
                fed = [draft[s][j] if j < acc[s] else mask_id for s in chosen for j in range(k)]
                lg = forward("draft", fed, pos, groups)
                for gi, s in enumerate(chosen):
                    for j in range(acc[s], k):
                        draft[s][j] = int(lg[gi * k + j].argmax())
                lg = forward("verify", [draft[s][j] for s in chosen for j in range(k)], pos,
                             groups)
                pr = torch.softmax(lg, -1)
                for gi, s in enumerate(chosen):
                    a = acc[s]
                    j = a + 1 if a < k else k  # tokens up to index a are accepted regardless
                    j = min(j, k)
                    while j < k and float(pr[gi * k + j - 1, draft[s][j]]) > token_threshold:
                        j += 1
                    acc[s] = j
                hit = [gi for gi, s in enumerate(chosen)
                       if eos_id is not None and eos_id in draft[s][:acc[s]]]
                if hit:
                    chosen = chosen[:hit[0] + 1]
                    acc[chosen[-1]] = k
            tokens = [draft[s][j] for s in chosen for j in range(k)]
            poss = [P + s * k + j for s in chosen for j in range(k)]
            if eos_id is not None and eos_id in tokens:
                cut = tokens.index(eos_id) + 1
                tokens, poss = tokens[:cut], poss[:cut]
            parallel = not exact_cache and len(chosen) > 1
            n_groups += 1
            for i, (t, q) in enumerate(zip(tokens, poss)):
                seq.append((t, q, n_groups if parallel else None, i // k))
            for s in chosen:
                slot_state[s] = "done"
            drop_after_eos()
        if all(v != "masked" for v in slot_state.values()):
            break
    q = first_eos()
    out = sorted((e[1], e[0]) for e in seq if e[1] >= P and (q is None or e[1] <= q))
    assert [p for p, _ in out] == list(range(P, P + len(out))), "gaps in the output"
    return [t for _, t in out], forwards
