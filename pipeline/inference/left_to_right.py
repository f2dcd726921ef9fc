"""Verify "draft_ahead" and "draft_every": slots left to right, one forward per step that
verifies the drafts and drafts the next slot (`_left_to_right_program`, one program whose block
policy tells the two apart), and the walk that judges the drafts with the AR head
(`_walk_and_commit`)."""
from __future__ import annotations

from typing import Generator

import torch

from pipeline.inference.decisions import NONE, Decision, Need
from pipeline.inference.rows import _Request, _Row, _accepted


def _walk_need(d_tok: list[int], fed: int) -> Need:
    """What a left-to-right step reads from a forward that fed the drafts `d_tok` first, then
    `fed - len(d_tok)` masks: the choice at the carried token (entry 0) and at every fed token
    (entry i + 1), with the probability of draft i at entry i."""
    return Need([-1] + list(range(fed)), d_tok + [NONE] * (fed + 1 - len(d_tok)))


def _walk_and_commit(row: _Row, d_tok: list[int], d: Decision, *, p0: int, cur: int,
                     gen_length: int, token_threshold: float, eos_id: int | None,
                     mode: str) -> tuple[list[int], bool]:
    """One left-to-right step's verdict (verify="draft_ahead" and "draft_every"): the drafts
    `d_tok` of offsets `cur, cur + 1, ...` were fed causally right after the carried token at
    offset `cur - 1`; `d` answers `_walk_need`.

    Walks the drafts with the AR head (`_accepted`: the carried token's logits judge the first
    draft, draft i's logits the next); at the first failure the AR head's choice is committed
    in its place; after a full walk, the AR head's choice for the next offset (the bonus) when
    it is inside the generation region. Records the commit on `row`: the accepted drafts are
    committed to the cache from this forward (`row.commit`, a prefix of the request), the
    correction/bonus token is carried into the next forward; sets `row.eos_pos` on an EOS.

    Returns:
        (the committed tokens: accepted drafts + the correction or bonus token, in natural
        order from offset `cur`; True when an EOS ended the row).
    Raises:
        AssertionError: the last forward carried no token at offset `cur - 1` (a driver bug).
    """
    if row.carry_last != p0 + cur - 1:
        raise AssertionError(f"{mode}: no AR prediction for the first open offset")
    # walk the drafts with the AR head; the first failure gets the AR head's choice
    m, extra = 0, None
    for i, t in enumerate(d_tok):
        if not _accepted(t, d.ids[i], d.probs[i], token_threshold):
            extra = d.ids[i]
            break
        m = i + 1
        if eos_id is not None and t == eos_id:
            break
    done = eos_id is not None and eos_id in d_tok[:m]
    if extra is None and not done and cur + m < gen_length:
        extra = d.ids[m]   # the bonus token: the AR head's choice after the last accepted
    row.commit = list(range(m))
    toks = d_tok[:m] + ([extra] if extra is not None else [])
    row.tokens.extend(toks)
    row.positions.extend(p0 + cur + i for i in range(len(toks)))
    row.commit_forward.extend([sum(row.forwards.values())] * len(toks))
    row.ref_tpf_sum += len(toks)
    row.ref_tpf_steps += 1
    if done or (eos_id is not None and extra == eos_id):
        row.eos_pos = p0 + cur + len(toks) - 1
        return toks, True
    if extra is not None:    # encoded ahead of the next forward, whose logits judge after it
        row.carry, row.carry_positions = [extra], [p0 + cur + m]
    return toks, False


def _left_to_right_program(row: _Row, *, gen_length: int, slot_size: int,
                           token_threshold: float, mask_id: int, eos_id: int | None,
                           every: bool, bidirectional: bool = False
                           ) -> Generator[_Request, Decision, None]:
    """verify="draft_ahead" or, with `every`, "draft_every" (docs/METHOD.md "Drafting inside the
    verify forward", "Drafting for every acceptance length", which lay out what a step feeds):
    after the carried token at L - 1, the drafts of L .. L + n - 1, then blocks of masks, block
    a (a accepted drafts) starting at L + a, causal within itself or, when `bidirectional`, both
    ways. The block policy: draft_every feeds a block of k + 1 masks for every a = 0 .. n;
    draft_ahead drafts to the end of the slot of a fixed grid holding L and feeds one block,
    a = n, to the end of the next slot. The next drafts are the predictions of the walk's
    outcome's block after its first mask; without that block (draft_ahead's rejection at a), the
    old drafts after a, then the block's predictions from its first mask on."""
    k, p0, g = slot_size, len(row.prompt), gen_length
    cur = 0                              # first offset not committed (all before it are)
    draft: list[int] = []                # drafts of offsets cur, cur + 1, ...
    while cur < g:
        if every:
            d_tok = draft[:g - cur]
            n = len(d_tok)
            last = d_tok.index(eos_id) if eos_id is not None and eos_id in d_tok else n
            # block a: offset cur + a (the correction / bonus), then the drafts of offsets
            # cur + a + 1 .. cur + a + k cut at the region's end (no block when none is left)
            sizes = [min(k, g - cur - a - 1) for a in range(last + 1)]
            blocks = [(a, 1 + sz if sz > 0 else 0) for a, sz in enumerate(sizes)]
        else:
            end = min((cur // k + 1) * k, g)         # end of the slot holding `cur`
            d_tok = draft[:end - cur]
            n = len(d_tok)
            blocks = [(n, min(end + k, g) - cur - n)]  # rest of this slot, then the next slot
        t = n + sum(sz for _, sz in blocks)
        mask = None   # draft_ahead's one block after the drafts: causal unless bidirectional
        if t > n and (every or (bidirectional and t - n > 1)):
            mask = torch.zeros(t, t, dtype=torch.bool)
            mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        positions = [p0 + cur + i for i in range(n)]
        start, o = {}, n
        for a, sz in blocks:
            start[a] = o
            positions += [p0 + cur + a + j for j in range(sz)]
            if mask is not None:
                mask[o:o + sz, :a] = True
                block = torch.ones(sz, sz, dtype=torch.bool)
                mask[o:o + sz, o:o + sz] = block if bidirectional else block.tril()
            o += sz
        d = yield _Request("verify" if d_tok else "plan", d_tok + [mask_id] * (t - n),
                           positions, mask, _walk_need(d_tok, t))
        toks, finished = _walk_and_commit(row, d_tok, d, p0=p0, cur=cur, gen_length=g,
                                          token_threshold=token_threshold, eos_id=eos_id,
                                          mode="draft_every" if every else "draft_ahead")
        if finished:
            return
        m = len(toks) - 1                # accepted drafts (a correction or bonus follows)
        cur += len(toks)
        if cur >= g:
            return
        if m in start:                   # the block of the acceptance that happened
            o = start[m]
            draft = d.ids[o + 2:o + dict(blocks)[m] + 1]   # entry i + 1 is fed token i
        else:                            # draft_ahead's rejection: old drafts, then the block
            draft = d_tok[m + 1:] + d.ids[start[n] + 1:]
