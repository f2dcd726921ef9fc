"""Verify "draft_ahead" and "draft_every": slots left to right, one forward per step that
verifies the drafts and drafts the next slot (`_draft_ahead_program`, `_draft_every_program`),
and the walk that judges the drafts with the AR head (`_walk_and_commit`)."""
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


def _draft_ahead_program(row: _Row, *, gen_length: int, slot_size: int,
                         token_threshold: float, mask_id: int, eos_id: int | None,
                         bidirectional: bool = False) -> Generator[_Request, Decision, None]:
    """verify="draft_ahead" (docs/METHOD.md "Drafting inside the verify forward"): slots left to
    right, one forward per step. Each forward feeds, after the cache and the carried token,
    the drafts of the open offsets up to the end of the current slot, then masks up to the end
    of the next slot (causal among themselves, or every mask seeing every other one when
    `bidirectional`)."""
    k, p0, g = slot_size, len(row.prompt), gen_length
    cur = 0                              # first offset not committed (all before it are)
    draft: list[int] = []                # drafts of offsets cur, cur + 1, ... (< slot end)
    while cur < g:
        end = min((cur // k + 1) * k, g)             # end of the slot holding `cur`
        d_tok = draft[:end - cur]
        n_mask = min(end + k, g) - cur - len(d_tok)  # rest of this slot, then the next slot
        positions = [p0 + cur + i for i in range(len(d_tok) + n_mask)]
        mask = None
        if bidirectional and n_mask > 1:   # the masks form one block, both ways
            n = len(d_tok)
            mask = torch.ones(n + n_mask, n + n_mask, dtype=torch.bool).tril()
            mask[n:, n:] = True
        d = yield _Request("verify" if d_tok else "plan", d_tok + [mask_id] * n_mask,
                           positions, mask, _walk_need(d_tok, len(positions)))
        toks, finished = _walk_and_commit(row, d_tok, d, p0=p0, cur=cur, gen_length=g,
                                          token_threshold=token_threshold, eos_id=eos_id,
                                          mode="draft_ahead")
        if finished:
            return
        # next drafts: the old drafts after the new `cur`, then this forward's mask predictions
        ahead = d_tok + d.ids[len(d_tok) + 1:]   # predictions of offsets cur, cur + 1, ...
        cur += len(toks)
        draft = ahead[len(toks):]


def _draft_every_program(row: _Row, *, gen_length: int, slot_size: int,
                         token_threshold: float, mask_id: int, eos_id: int | None,
                         bidirectional: bool = False) -> Generator[_Request, Decision, None]:
    """verify="draft_every" (docs/METHOD.md "Drafting for every acceptance length"): one
    forward per step. With `L` the committed length (the carried token at position L - 1) and
    `n <= k` drafts of positions L .. L + n - 1, each forward feeds, after the carried token,
    the drafts (causal), then for each acceptance length a = 0 .. n a block of k + 1 masks at
    positions L + a .. L + a + k (the first stands for the correction or bonus token at L + a,
    the other k draft the next k positions), causal within itself or, when `bidirectional`,
    both ways; block a sees the cache, the carried token and drafts 0 .. a - 1 only. After the
    walk (`_walk_and_commit`) accepted a drafts, block a's last k predictions are the next
    drafts. Blocks past a drafted EOS and positions past the generation region are not fed."""
    k, p0, g = slot_size, len(row.prompt), gen_length
    cur = 0                              # first offset not committed (all before it are)
    draft: list[int] = []                # drafts of offsets cur, cur + 1, ... (<= k of them)
    while cur < g:
        d_tok = draft[:g - cur]
        n = len(d_tok)
        last = d_tok.index(eos_id) if eos_id is not None and eos_id in d_tok else n
        # block a: offset cur + a (the correction / bonus), then the drafts of offsets
        # cur + a + 1 .. cur + a + k cut at the region's end (no block when none is left)
        sizes = [min(k, g - cur - a - 1) for a in range(last + 1)]
        sizes = [1 + sz if sz > 0 else 0 for sz in sizes]
        starts = [n + sum(sizes[:a]) for a in range(len(sizes))]
        t = n + sum(sizes)
        positions = [p0 + cur + i for i in range(n)]
        mask = torch.zeros(t, t, dtype=torch.bool)
        mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        for a, (o, sz) in enumerate(zip(starts, sizes)):
            positions += [p0 + cur + a + j for j in range(sz)]
            mask[o:o + sz, :a] = True
            block = torch.ones(sz, sz, dtype=torch.bool)
            mask[o:o + sz, o:o + sz] = block if bidirectional else block.tril()
        d = yield _Request("verify" if d_tok else "plan", d_tok + [mask_id] * (t - n),
                           positions, mask if t > n else None, _walk_need(d_tok, t))
        toks, finished = _walk_and_commit(row, d_tok, d, p0=p0, cur=cur, gen_length=g,
                                          token_threshold=token_threshold, eos_id=eos_id,
                                          mode="draft_every")
        if finished:
            return
        m = len(toks) - 1                # accepted drafts (a correction or bonus follows)
        cur += len(toks)
        if cur < g:                      # the block of the acceptance that happened
            o = starts[m]
            draft = d.ids[o + 2:o + sizes[m] + 1]   # entry i + 1 is fed token i
