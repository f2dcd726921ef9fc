"""Verify "authors" (the reference algorithm) and "correct" (a rejected draft replaced by the AR
head's choice): the row program of a plan forward, then a verify forward (and, for "authors",
infill rounds) per step (`_refusion_program`), and its parts."""
from __future__ import annotations

import math
from typing import Generator, Sequence

import torch

from pipeline.inference.decisions import NONE, OWN, Decision, Need
from pipeline.inference.rows import _Request, _Row, _accepted


def _block_causal(lengths: Sequence[int]) -> torch.Tensor:
    """BoolTensor[T, T] (T = sum of lengths): causal inside each consecutive group, no attention
    across groups. Used to infill parallel slots in one row, each seeing only the prefix."""
    t = sum(lengths)
    m = torch.zeros(t, t, dtype=torch.bool)
    o = 0
    for n in lengths:
        m[o:o + n, o:o + n] = torch.ones(n, n, dtype=torch.bool).tril()
        o += n
    return m


def _select(score: list[float], slot_threshold: float) -> list[int]:
    """Indices of the planned slots to infill: score > slot_threshold, else the single best."""
    chosen = [i for i in range(len(score)) if score[i] > slot_threshold]
    return chosen or [max(range(len(score)), key=score.__getitem__)]


def _refusion_program(row: _Row, *, gen_length: int, slot_size: int, num_blocks: int,
                      slot_threshold: float, token_threshold: float, mask_id: int,
                      eos_id: int | None, exact_cache: bool, verify: str
                      ) -> Generator[_Request, Decision, None]:
    """One row decoded with verify "authors" (docs/METHOD.md "One step") or "correct" ("The
    corrected verify"): per step a plan forward of the current block's open slots, then a
    verify forward (and, for "authors", draft/verify rounds); commits on `row`. `gen_length`
    is G, whole slots (`decoding._check`)."""
    k = slot_size
    p0 = len(row.prompt)
    n_slots = gen_length // k
    per_block = n_slots // num_blocks
    filled = [False] * gen_length  # by offset from the generation start: committed
    # verify="correct": offset -> logits of the AR head's prediction for that offset (computed at
    # the committed token before it, with the context it was encoded in).
    pred: dict[int, torch.Tensor] = {}

    def start(s: int) -> int:
        return p0 + s * k

    def is_open(o: int) -> bool:
        """Offset o still to decode: not committed and not after a committed EOS."""
        return not filled[o] and (row.eos_pos is None or p0 + o < row.eos_pos)

    def open_offsets(s: int) -> list[int]:
        return [o for o in range(s * k, (s + 1) * k) if is_open(o)]

    def commit_tokens(toks: list[int], poss: list[int]) -> None:
        row.tokens.extend(toks)
        row.positions.extend(poss)
        row.commit_forward.extend([sum(row.forwards.values())] * len(toks))
        for t, q in zip(toks, poss):
            filled[q - p0] = True
            if eos_id is not None and t == eos_id and (row.eos_pos is None or q < row.eos_pos):
                row.eos_pos = q

    for b in range(num_blocks):
        block = range(b * per_block, (b + 1) * per_block)
        while True:
            masked = [s for s in block if open_offsets(s)]
            if not masked:
                break
            # 1. plan: masks at the open offsets of the block's open slots
            offs = [open_offsets(s) for s in masked]
            first = [sum(map(len, offs[:i])) for i in range(len(offs))]
            positions = [p0 + o for os_ in offs for o in os_]
            score = [NONE] * len(positions)   # a slot's score: its first token's probability
            for f in first:
                score[f] = OWN
            d = yield _Request("plan", [mask_id] * len(positions), positions,
                               need=Need(list(range(len(positions))), score))
            row.commit = []
            if verify == "correct" and row.carry_last >= 0:
                o = row.carry_last - p0 + 1   # the carried token's AR prediction of the next
                if 0 <= o < gen_length and is_open(o):
                    pred[o] = d.vector(-1)
            x0 = d.ids
            chosen = _select([d.probs[f] for f in first], slot_threshold)
            sel = [masked[i] for i in chosen]
            if verify == "correct":
                d_off = [o for i in chosen for o in offs[i]]
                d_tok = [x0[first[i] + j] for i in chosen for j in range(len(offs[i]))]
                judges = _judges(d_off, pred)
                d = yield _Request("verify", d_tok, [p0 + o for o in d_off],
                                   need=Need([j for j in judges if j is not None]
                                             + [len(d_tok) - 1],
                                             [t for t, j in zip(d_tok, judges) if j is not None]
                                             + [NONE]))
                row.commit = []
                _correct(row, d_off, d_tok, judges, d, pred, is_open, commit_tokens, p0=p0,
                         gen_length=gen_length, token_threshold=token_threshold, eos_id=eos_id)
                continue
            # authors' verify: every slot is whole (masked or committed)
            n = len(sel)
            flat = torch.tensor([x0[i * k + j] for i in chosen for j in range(k)])
            drafts = flat.view(n, k)   # LongTensor[n, k]
            sel_pos = [start(s) + j for s in sel for j in range(k)]
            # 2. verify the concatenation (fast path)
            d = yield _Request("verify", flat.tolist(), sel_pos,
                               need=Need(list(range(n * k - 1)), flat[1:].tolist()))
            row.commit = []
            q = torch.ones(n * k, dtype=torch.float64)
            q[1:] = torch.tensor(d.probs, dtype=torch.float64)
            acc = q > token_threshold
            acc.view(n, k)[:, 0] = True
            prefix = int(torch.cumprod(acc.long(), 0).sum())
            eos_hits = ([i for i in range(prefix) if int(flat[i]) == eos_id]
                        if eos_id is not None else [])
            if eos_hits or prefix >= k:
                m = eos_hits[0] + 1 if eos_hits else (prefix // k) * k
                row.commit = list(range(m))
                commit_tokens(flat[:m].tolist(), sel_pos[:m])
                row.ref_tpf_sum += k * math.ceil(m / k) / 2
                row.ref_tpf_steps += 1
                continue
            # 3. parallel draft/verify rounds, each slot against the prefix only
            tags = torch.cumprod(acc.view(n, k).long(), 1).bool()
            toks = drafts
            n_chosen = n
            rounds = 0
            while not bool(tags.all()):
                rounds += 1
                n = len(sel)
                mask = _block_causal([k] * n)
                pos = [start(s) + j for s in sel for j in range(k)]
                fed = torch.where(tags, toks, torch.full_like(toks, mask_id))
                d = yield _Request("draft", fed.view(-1).tolist(), pos, mask,
                                   need=Need(list(range(n * k)), greedy=True))
                row.commit = []
                toks = torch.where(tags, toks, torch.tensor(d.ids).view(n, k))
                d = yield _Request("verify", toks.view(-1).tolist(), pos, mask,
                                   need=Need([s * k + j for s in range(n) for j in range(k - 1)],
                                             toks[:, 1:].reshape(-1).tolist()))
                row.commit = []
                q = torch.ones(n, k, dtype=torch.float64)
                q[:, 1:] = torch.tensor(d.probs, dtype=torch.float64).view(n, k - 1)
                force = torch.ones(n, k, dtype=torch.bool)
                force[:, 1:] = tags[:, :-1]
                tags = torch.cumprod(((q > token_threshold) | force).long(), 1).bool()
                if eos_id is not None:
                    hit = ((toks == eos_id) & tags).any(1).nonzero()
                    if len(hit):
                        e = int(hit[0])
                        sel, toks, tags = sel[:e + 1], toks[:e + 1], tags[:e + 1]
                        tags[e] = True
                if rounds > k:
                    raise AssertionError("draft/verify did not converge")
            flat = toks.reshape(-1).tolist()
            pos = [start(s) + j for s in sel for j in range(k)]
            m = len(flat)
            if eos_id is not None and eos_id in flat:
                m = flat.index(eos_id) + 1
            if exact_cache and len(sel) > 1:
                row.carry.extend(flat[:m])
                row.carry_positions.extend(pos[:m])
            else:
                row.commit = list(range(m))
            commit_tokens(flat[:m], pos[:m])
            row.ref_tpf_sum += k * n_chosen / (2 * rounds + 2)
            row.ref_tpf_steps += 1
        if not any(is_open(o) for o in range(gen_length)):
            break


def _judges(d_off: list[int], pred: dict) -> list:
    """verify="correct": per draft (at offsets `d_off`, fed in this order), the logits that
    judge it (a `Need` row): the token before it in this forward when that is its left
    neighbour, else `pred[offset]` (kept from an earlier forward), else None (not judged)."""
    return [i - 1 if i > 0 and d_off[i - 1] == o - 1 else pred.get(o)
            for i, o in enumerate(d_off)]


def _correct(row: _Row, d_off: list[int], d_tok: list[int], judges: list, d: Decision,
             pred: dict, is_open, commit_tokens, *, p0: int, gen_length: int,
             token_threshold: float, eos_id: int | None) -> None:
    """verify="correct": what one verify forward of the drafts `d_tok` (at offsets `d_off`, fed
    causally in this order after the cache) commits; `d` answers a `Need` of the judged drafts
    (`judges`, `_judges`: choice and probability of the draft), then the last draft (choice).

    A drafted token is judged by the AR head's prediction of its offset (`_judges`); a token
    whose left neighbour is not decoded yet has no AR prediction and keeps its draft (as in the
    authors' decoder). It is accepted as `_accepted` says; at the first token that is not, the
    AR head's own choice is committed instead (the correction) and the walk stops. After a
    fully accepted walk the AR head's choice for the next open offset is committed (the bonus).
    The accepted drafts keep this forward's keys/values (fed in commit order: exact); a
    correction or bonus token is carried into the row's next forward, whose logits at it give
    `pred` of the offset after it."""
    m, extra, e = 0, None, 0
    for i, (o, t) in enumerate(zip(d_off, d_tok)):
        if judges[i] is not None:
            if not _accepted(t, d.ids[e], d.probs[e], token_threshold):
                extra = (d.ids[e], o)
                break
            e += 1
        m = i + 1
        if eos_id is not None and t == eos_id:
            break
    row.commit = list(range(m))
    commit_tokens(d_tok[:m], [p0 + o for o in d_off[:m]])
    if extra is None and m == len(d_tok) and (eos_id is None or eos_id not in d_tok):
        o = d_off[-1] + 1   # bonus: the token after the last accepted one
        if o < gen_length and is_open(o):
            extra = (d.ids[-1], o)
    if extra is not None:
        commit_tokens([extra[0]], [p0 + extra[1]])
        row.carry, row.carry_positions = [extra[0]], [p0 + extra[1]]
    for i in range(m):   # AR predictions of open offsets after accepted tokens, for later steps
        o = d_off[i] + 1
        if o < gen_length and is_open(o):
            pred[o] = d.vector(i)   # a copy: the forward's logits are freed
    for o in [o for o in pred if not is_open(o)]:
        del pred[o]
    row.ref_tpf_sum += (m + (extra is not None)) / 2
    row.ref_tpf_steps += 1
