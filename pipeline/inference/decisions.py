"""What the row programs read from a forward's logits: computed on the logits' device for every
row of the batch, brought to the host in one transfer per forward.

A program states what it reads (`Need`); the driver lays the needs out before the forward
(`plan_needs`) and answers them after it (`decide` -> `Decision`). The forward's logits are not
kept: a program copies the few vectors it keeps (`Decision.vector`) while it handles its
decision. Must not touch: the decoding algorithms, the model, the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

OWN = -1    # `Need.score`: the probability of the entry's own choice
NONE = -2   # `Need.score`: no probability


@dataclass
class Need:
    """What a row program reads from the logits of its request (one entry per logits row).

    rows: per entry, an index into the request's tokens (-1: the row's last carried token,
        fed ahead of the request) or a `FloatTensor[V]` on the device (logits kept from an
        earlier forward, `Decision.vector`).
    score: per entry, the token id whose softmax probability is wanted, `OWN` (the entry's
        choice) or `NONE` (none; the default for every entry when empty).
    greedy: the choices are argmax even at temperature > 0 (the authors' draft rounds)."""
    rows: list = field(default_factory=list)
    score: list[int] = field(default_factory=list)
    greedy: bool = False


class Decision:
    """A forward's answer to one row's `Need`, on the host.

    Attributes:
        ids: `list[int]` per entry: the argmax of its logits, or at temperature > 0 a
            Gumbel-max sample (argmax with `Need.greedy`).
        probs: `list[float]` per entry: the softmax probability of its `score` token (float32
            logsumexp, float64 for a float64 model; nan where `NONE`).
    """

    def __init__(self, ids: list[int], probs: list[float], logits, offset: int):
        self.ids, self.probs = ids, probs
        self._logits, self._offset = logits, offset

    def vector(self, i: int) -> torch.Tensor:
        """`FloatTensor[V]` on the device: a copy of the logits at request index `i` (-1: the
        carried token before the request). Only while the program handles this decision (the
        forward's logits are freed before the next forward). Raises AssertionError after
        `release`."""
        if self._logits is None:
            raise AssertionError("Decision.vector after the forward's logits were freed")
        return self._logits[self._offset + i].clone()

    def release(self) -> None:
        """Drop the reference to the forward's logits (the driver, once the program has run)."""
        self._logits = None


@dataclass
class NeedPlan:
    """Host side of one forward's needs (`plan_needs`). `index`: `LongTensor[N]`, sent to the
    device with the forward's inputs in one copy; the rest is the layout `decide` reads."""
    index: torch.Tensor
    kept: list              # FloatTensor[V] per entry naming a kept vector
    counts: tuple[int, int, int]   # entries read from the logits; scored ones of those;
                                   # scored entries read from kept vectors
    greedy: list[bool]      # per entry (logits entries first, kept ones after)
    # per need: logits offset of its request, its entries' positions, their scored positions
    needs: list[tuple[int, list[int], list[int | None]]]


def plan_needs(needs: list[tuple[int, Need]]) -> NeedPlan:
    """Lay out the needs of one forward. `needs`: per row, (the flat index in the forward's
    logits `[B * T, V]` of its request's index 0: `b * T + carried tokens`, its `Need`)."""
    rows, kept, g_rows, g_kept, lay = [], [], [], [], []
    for off, need in needs:
        ent = []
        for r in need.rows:
            if isinstance(r, torch.Tensor):
                ent.append(~len(kept))
                kept.append(r)
                g_kept.append(need.greedy)
            else:
                ent.append(len(rows))
                rows.append(off + r)
                g_rows.append(need.greedy)
        lay.append(ent)
    n_r = len(rows)
    s_rows, s_kept, s_pos_r, s_pos_k, s_tok_r, s_tok_k, out = [], [], [], [], [], [], []
    for (off, need), ent in zip(needs, lay):
        pos = [e if e >= 0 else n_r + ~e for e in ent]
        scored = []
        for e, p, tok in zip(ent, pos, need.score or [NONE] * len(ent)):
            if tok == NONE:
                scored.append(None)
            elif e >= 0:   # from this forward's logits
                scored.append(len(s_rows))
                s_rows.append(rows[e])
                s_pos_r.append(p)
                s_tok_r.append(tok)
            else:          # from a kept vector (numbered after those: ~index for now)
                scored.append(~len(s_kept))
                s_kept.append(~e)
                s_pos_k.append(p)
                s_tok_k.append(tok)
        out.append((off, pos, scored))
    n_s = len(s_rows)
    needs_out = [(off, pos, [s if s is None or s >= 0 else n_s + ~s for s in scored])
                 for off, pos, scored in out]
    index = torch.tensor(rows + s_rows + s_kept + s_pos_r + s_pos_k + s_tok_r + s_tok_k,
                         dtype=torch.long)
    return NeedPlan(index=index, kept=kept, counts=(n_r, len(s_rows), len(s_kept)),
                    greedy=g_rows + g_kept, needs=needs_out)


def decide(logits: torch.Tensor, plan: NeedPlan, index: torch.Tensor, temperature: float,
           generator) -> list[Decision]:
    """Answer every need of one forward (`plan_needs`): choices and probabilities computed on
    the logits' device, brought back in one `device_to_host` call.

    Args:
        logits: `FloatTensor[B, T, V]` of the forward, on the device.
        index: `plan.index` on the device (sent with the forward's inputs).
        temperature, generator: `_sample`'s.
    Returns:
        one `Decision` per need, in `plan_needs`' order (`release()` them before the next
        forward).
    """
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)
    n_r, n_sr, n_sk = plan.counts
    n_s = n_sr + n_sk
    o = [0, n_r, n_r + n_sr, n_r + n_s, n_r + 2 * n_s]
    rows, s_rows, s_kept = index[:o[1]], index[o[1]:o[2]], index[o[2]:o[3]]
    s_pos, s_tok = index[o[3]:o[4]], index[o[4]:]
    kept = torch.stack(plan.kept).to(flat.dtype) if plan.kept else None
    greedy = temperature > 0 and any(plan.greedy)
    if temperature <= 0:   # argmax of every row: no copy of the logits
        choice = flat.argmax(-1).index_select(0, rows)
        choice = torch.cat([choice, kept.argmax(-1)]) if kept is not None else choice
        parts = [choice]
    else:
        x = flat.index_select(0, rows)
        x = torch.cat([x, kept]) if kept is not None else x
        choice = _sample(x, temperature, generator)
        parts = [choice] + ([x.argmax(-1)] if greedy else [])
    if n_s:
        tok = torch.where(s_tok == OWN, choice.index_select(0, s_pos), s_tok)
        x = flat.index_select(0, s_rows)
        x = torch.cat([x, kept.index_select(0, s_kept)]) if n_sk else x
        parts.append(_token_probs(x, tok))
    # ids (exact in float64) and probabilities in one buffer: one copy
    host = device_to_host(torch.cat([p.double() for p in parts]) if len(parts) > 1
                          else parts[0]).tolist()
    n = n_r + len(plan.kept)
    ids = [int(v) for v in host[:n]] if len(parts) > 1 else host
    if greedy:
        ids = [int(a) if g else c for c, a, g in zip(ids, host[n:2 * n], plan.greedy)]
    probs = host[2 * n if greedy else n:]
    return [Decision([ids[p] for p in pos], [math.nan if s is None else probs[s] for s in scored],
                     flat, off) for off, pos, scored in plan.needs]


def device_to_host(t: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of a forward's decisions (`decide`): `t` on the host (waits
    for the device's queued work)."""
    return t.cpu()


def _token_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Softmax probability of `ids` under `logits`, on the logits' device (float64 for a
    float64 model, else float32). `logits: FloatTensor[..., V]`, `ids: LongTensor[...]` ->
    `DoubleTensor[...]` on that device."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    lp = x.gather(-1, ids[..., None])[..., 0] - torch.logsumexp(x, -1)
    return lp.exp().double()


def _sample(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Argmax of `logits / temperature + Gumbel noise` (= a sample from softmax(logits / T)),
    computed in float64 (low-precision Gumbel-max hurts quality: arXiv 2409.02908); plain argmax
    when temperature == 0. `logits: FloatTensor[..., V]` -> `LongTensor[...]`."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator,
                   device=logits.device).clamp_(min=1e-300)
    return (logits.double() / temperature - torch.log(-torch.log(u))).argmax(-1)
