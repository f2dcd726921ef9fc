"""A row (one prompt's decode) and the protocol of its program, shared by every decoder of
`pipeline.inference.decoding`: the row's state (`_Row`), the request its program yields per
forward (`_Request`), and the AR head's verdict on a draft (`_accepted`: verify "correct",
"draft_ahead", "draft_every"). The driver (`pipeline.inference.driver._run`) runs the programs."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from pipeline.inference.decisions import Need


# Row programs: each yields a request (tokens to feed after the row's cache, and what it reads
# from their logits: `Need`) and receives the answer (`Decision`, on the host); it records what
# to commit from that forward in `row.commit`.


@dataclass
class _Request:
    """What a row feeds in one forward, after its cache and carry: `kind` (the forward's kind,
    counted in `row.forwards`), token ids and their position ids (equal lengths), the mask
    among them and what the row reads from their logits (`need`)."""

    kind: str
    tokens: list[int]
    positions: list[int]
    # BoolTensor[T, T], True = may attend (within the request); None = causal.
    mask: torch.Tensor | None = None
    need: Need = field(default_factory=Need)


@dataclass
class _Row:
    """One prompt's decode state, changed by its program (what to commit) and by the driver
    (forwards counted, the carry fed)."""

    prompt: list[int]
    # Logical committed sequence in commit order (prompt first).
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # Tokens to encode and commit ahead of the next request (prompt / exact-mode re-encode).
    carry: list[int] = field(default_factory=list)
    carry_positions: list[int] = field(default_factory=list)
    # Indices into the last request's tokens to commit to the cache, in this order.
    commit: list[int] = field(default_factory=list)
    forwards: Counter = field(default_factory=Counter)
    # Per entry of `tokens`: the number of forwards this row had taken when it was committed.
    commit_forward: list[int] = field(default_factory=list)
    # Position of the last token carried into the latest forward (-1: nothing was carried).
    carry_last: int = -1
    eos_pos: int | None = None
    ref_tpf_sum: float = 0.0
    ref_tpf_steps: int = 0

    def output(self, eos_id: int | None) -> list[int]:
        """Generated ids sorted by position, ending at the first EOS (inclusive)."""
        return [tok for tok, _ in self._generated(eos_id)]

    def trace(self, eos_id: int | None) -> list[int]:
        """Per token of `output`: the 1-based index (among this row's forwards) of the forward
        after which it was committed."""
        return [f for _, f in self._generated(eos_id)]

    def _generated(self, eos_id: int | None) -> list[tuple[int, int]]:
        p = len(self.prompt)
        gen = sorted((pos, tok, f) for pos, tok, f in
                     zip(self.positions[p:], self.tokens[p:], self.commit_forward))
        out = []
        for expect, (pos, tok, f) in enumerate(gen, start=p):
            if pos != expect:
                raise AssertionError(f"generated positions are not contiguous at {expect}")
            out.append((tok, f))
            if eos_id is not None and tok == eos_id:
                break
        return out


def _accepted(d: int, a: int, p: float, token_threshold: float) -> bool:
    """The AR head's verdict on the drafted token `d`: accepted when it is the AR head's choice
    `a` (the argmax, or its sample at temperature > 0) or its probability `p` exceeds
    `token_threshold`; else `a` is committed in its place (the correction)."""
    return d == a or p > token_threshold
