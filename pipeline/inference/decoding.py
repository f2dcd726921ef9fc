"""The decoding API: plan-and-infill (ReFusion) decoding (`refusion_generate`) and plain
autoregressive decoding (`ar_generate`) of a batch of prompts with a KV cache, and their figures
(`GenerationOutput`: tokens, forwards by kind, TPF, TPS).

The method, every verify mode, and where this code differs from the reference code
(ML-GSAI/ReFusion `generate.py`) are docs/METHOD.md's ("Decoding: plan and infill", "Differences
from the reference code"). Each prompt is a row decoded by a program (`pipeline.inference.rows`):
verify "authors" and "correct" in `pipeline.inference.plan_infill`, "draft_ahead" and
"draft_every" in `pipeline.inference.left_to_right`, AR decoding here; `pipeline.inference.driver`
runs the programs, one batched forward per step. Must not touch: model weights, tokenizers,
files, process groups (with TP > 1 every rank of the TP group makes the same call).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Generator

import torch

from pipeline.inference.decisions import Decision, Need
from pipeline.inference.driver import _model_device, _run
from pipeline.inference.left_to_right import _left_to_right_program
from pipeline.inference.plan_infill import _refusion_program
from pipeline.inference.rows import _Request, _Row

__all__ = ["GenerationOutput", "refusion_generate", "ar_generate", "split_prompts",
           "VERIFY_MODES"]

FORWARD_KINDS = ("prefill", "plan", "verify", "draft", "ar")


@dataclass
class GenerationOutput:
    """Result of a batched decode.

    Attributes:
        tokens: per prompt, the generated ids (`list[int]`, natural order, prompt excluded, ending
            at the first EOS inclusive when one was generated).
        forwards: per prompt, `Counter` of model forwards that row took part in, by kind
            ("plan", "verify", "draft", "ar", "prefill"; how they count: docs/METHOD.md "TPF,
            TPS and the other figures").
        batch_forwards: number of model forward calls for the whole batch.
        seconds: wall-clock seconds of the whole call, the model's device synchronized at both
            ends.
        tpf_reference_style: per prompt, the reference code's "TPF" (METHOD.md, same section);
            None in ar mode. With verify="correct": tokens committed per step / 2;
            "draft_ahead" and "draft_every": tokens committed per forward.
        commit_forward: per prompt, aligned with `tokens`: the 1-based index of the prompt's
            forward after which each token was committed (tokens sharing an index were
            accepted together: the parallel infill made visible).
    """

    tokens: list[list[int]]
    forwards: list[Counter]
    batch_forwards: int
    seconds: float
    tpf_reference_style: list[float | None] = field(default_factory=list)
    commit_forward: list[list[int]] = field(default_factory=list)

    def num_forwards(self, i: int) -> int:
        """Forwards of prompt i (all kinds)."""
        return sum(self.forwards[i].values())

    def tpf(self, i: int) -> float:
        """Tokens per forward of prompt i: generated tokens (through EOS) / its forwards."""
        n = self.num_forwards(i)
        return len(self.tokens[i]) / n if n else 0.0

    def tps(self, i: int | None = None) -> float:
        """Tokens per second: prompt i's tokens (or all prompts' when i is None) / wall seconds
        of the whole batched call."""
        n = sum(len(t) for t in self.tokens) if i is None else len(self.tokens[i])
        return n / self.seconds if self.seconds > 0 else 0.0

    def stats(self, i: int) -> dict:
        """JSON-ready per-prompt figures: tokens, forwards (total and by kind), TPF, TPS."""
        return {"tokens": len(self.tokens[i]), "forwards": self.num_forwards(i),
                "forwards_by_kind": dict(self.forwards[i]), "tpf": self.tpf(i),
                "tps": self.tps(i),
                "tpf_reference_style": (self.tpf_reference_style[i]
                                        if self.tpf_reference_style else None)}


# --------------------------------------------------------------------------------------------
# Inputs


def split_prompts(prompt_ids, attention_mask=None) -> list[list[int]]:
    """Normalize prompts to `list[list[int]]`, one list of prompt ids per row, padding removed.
    `prompt_ids`: `LongTensor[B, T]` (left or right padded, with `attention_mask`: `Tensor[B, T]`,
    1/True on real tokens; without it every position is a prompt token), or a sequence of 1-D
    `LongTensor[P_b]` / `list[int]`. Raises ValueError: a prompt is empty."""
    rows: list[list[int]] = []
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids.unsqueeze(0)
        for b in range(prompt_ids.shape[0]):
            ids = prompt_ids[b]
            if attention_mask is not None:
                ids = ids[attention_mask[b].bool()]
            rows.append([int(x) for x in ids.tolist()])
    else:
        for p in prompt_ids:
            rows.append([int(x) for x in (p.tolist() if isinstance(p, torch.Tensor) else p)])
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {b} is empty")
    return rows


def _clock(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued (asynchronous CUDA) work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


VERIFY_MODES = ("authors", "correct", "draft_ahead", "draft_every")
# How the masks of one drafting block attend to each other (docs/METHOD.md "Mask attention").
MASK_ATTENTIONS = ("causal", "bidirectional")


def check_mask_attention(mask_attention: str, verify: str) -> None:
    """Raise ValueError (one line) unless `mask_attention` is one of MASK_ATTENTIONS and, when
    "bidirectional", `verify` is "draft_ahead" or "draft_every" (the only decoders whose
    drafting blocks it defines)."""
    if mask_attention not in MASK_ATTENTIONS:
        raise ValueError(f"mask_attention must be one of {', '.join(MASK_ATTENTIONS)}, "
                         f"got {mask_attention!r}")
    if mask_attention == "bidirectional" and verify not in ("draft_ahead", "draft_every"):
        raise ValueError(f"mask_attention 'bidirectional' needs verify draft_ahead or "
                         f"draft_every, got verify {verify!r}")


def _ar_program(row: _Row, *, gen_length: int, eos_id: int | None
                ) -> Generator[_Request, Decision, None]:
    """AR decoding of one row: a prefill forward of the prompt, then one forward per token."""
    p0 = len(row.prompt)
    d = yield _Request("prefill", list(row.prompt), list(range(p0)), need=Need([p0 - 1]))
    row.commit = list(range(p0))
    row.tokens.extend(row.prompt)
    row.positions.extend(range(p0))
    for i in range(gen_length):
        tok = d.ids[0]
        row.tokens.append(tok)
        row.positions.append(p0 + i)
        row.commit_forward.append(sum(row.forwards.values()))
        if (eos_id is not None and tok == eos_id) or i == gen_length - 1:
            return
        d = yield _Request("ar", [tok], [p0 + i], need=Need([0]))
        row.commit = [0]


def _check(gen_length: int, slot_size: int, num_blocks: int) -> int:
    """The generation region's length G (`gen_length` rounded up to whole slots). Raises
    ValueError: a size < 1, or the slots are not a multiple of `num_blocks`."""
    if slot_size < 1 or gen_length < 1 or num_blocks < 1:
        raise ValueError("gen_length, slot_size and num_blocks must be >= 1")
    g = math.ceil(gen_length / slot_size) * slot_size
    if (g // slot_size) % num_blocks:
        raise ValueError(f"{g // slot_size} slots (gen_length {gen_length} rounded up to a "
                         f"multiple of slot_size {slot_size}) are not a multiple of "
                         f"num_blocks {num_blocks}")
    return g


@torch.no_grad()
def refusion_generate(model, prompt_ids, gen_length: int, slot_size: int, num_blocks: int,
                      slot_threshold: float, token_threshold: float, temperature: float,
                      mask_id: int, eos_id: int | None, exact_cache: bool = False,
                      attention_mask: torch.Tensor | None = None,
                      seed: int = 0, verify: str = "authors",
                      mask_attention: str = "causal") -> GenerationOutput:
    """Plan-and-infill decoding of a batch of prompts with a KV cache; returns a
    `GenerationOutput`. The method and each option's role: docs/METHOD.md "Decoding: plan and
    infill" and the sections named below.

    Args:
        model: `pipeline.model.Qwen3` in eval mode (any TP size).
        prompt_ids, attention_mask: as `split_prompts`.
        gen_length: tokens to generate at most; "authors" and "correct" round it up to a
            multiple of `slot_size` (k, tokens per slot); "draft_ahead" and "draft_every" do not.
        num_blocks: left-to-right blocks of the generation region (divides the slot count).
        slot_threshold: a slot is selected when its first token's probability exceeds this
            (> 1: exactly one slot per step).
        token_threshold: a drafted token is accepted when its causal probability exceeds this
            (0: whole slots accepted at once).
        temperature: Gumbel-max sampling temperature (0 = argmax); `seed` seeds it.
        mask_id / eos_id: the mask token id; the end-of-sequence id (None: never stop early).
        exact_cache: re-encode slots infilled in parallel in commit order (exact KV cache)
            instead of keeping each slot's prefix-only keys/values (the reference's choice).
        verify: "authors" (default, the reference algorithm: "One step"), "correct" ("The
            corrected verify": the cache is always exact), "draft_ahead" ("Drafting inside the
            verify forward") or "draft_every" ("Drafting for every acceptance length"); the
            last two go slot by slot: `num_blocks`, `slot_threshold`, `exact_cache` unused.
        mask_attention: "causal" (default) or "bidirectional" ("Mask attention"; verify
            draft_ahead and draft_every only).
    Raises:
        ValueError: inconsistent sizes, an unknown `verify` or `mask_attention`, a bidirectional
            `mask_attention` with verify "authors" or "correct", or the prompt + generation
            exceeds the model's `max_position_embeddings`."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    check_mask_attention(mask_attention, verify)
    left_to_right = verify in ("draft_ahead", "draft_every")   # num_blocks does not apply,
    g = _check(gen_length, slot_size, 1 if left_to_right else num_blocks)
    g = gen_length if left_to_right else g   # nor the slot grid: gen_length tokens at most
    prompts = split_prompts(prompt_ids, attention_mask)
    _check_positions(model, prompts, g)
    gen = torch.Generator(device=_model_device(model)).manual_seed(seed)
    t0 = _clock(_model_device(model))
    rows = [_Row(prompt=p, carry=list(p), carry_positions=list(range(len(p))))
            for p in prompts]
    for r in rows:
        r.tokens.extend(r.prompt)
        r.positions.extend(range(len(r.prompt)))
    if left_to_right:
        programs = [_left_to_right_program(r, gen_length=g, slot_size=slot_size,
                                           token_threshold=token_threshold, mask_id=mask_id,
                                           eos_id=eos_id, every=verify == "draft_every",
                                           bidirectional=mask_attention == "bidirectional")
                    for r in rows]
    else:
        programs = [_refusion_program(r, gen_length=g, slot_size=slot_size,
                                      num_blocks=num_blocks, slot_threshold=slot_threshold,
                                      token_threshold=token_threshold, mask_id=mask_id,
                                      eos_id=eos_id, exact_cache=exact_cache, verify=verify)
                    for r in rows]
    max_len = max(len(p) for p in prompts) + g
    calls = _run(model, rows, programs, max_len, temperature, gen)
    return GenerationOutput(
        tokens=[r.output(eos_id) for r in rows], forwards=[r.forwards for r in rows],
        batch_forwards=calls, seconds=_clock(_model_device(model)) - t0,
        tpf_reference_style=[r.ref_tpf_sum / r.ref_tpf_steps if r.ref_tpf_steps else 0.0
                             for r in rows],
        commit_forward=[r.trace(eos_id) for r in rows])


@torch.no_grad()
def ar_generate(model, prompt_ids, gen_length: int, temperature: float, eos_id: int | None,
                attention_mask: torch.Tensor | None = None, seed: int = 0,
                cuda_graph: bool = False) -> GenerationOutput:
    """Plain autoregressive decoding (a prefill, then one token per forward) with the same model
    and KV cache: the baseline for TPF/TPS/accuracy; returns a `GenerationOutput` (forwards
    "prefill", "ar"). `model`, `prompt_ids`, `attention_mask`, `seed`: as `refusion_generate`;
    at most `gen_length` tokens (stops after an EOS `eos_id`, kept); `temperature` 0 = greedy.
    `cuda_graph`: on CUDA, replay the one-token steps from a captured graph
    (`driver._GraphedStep`, checked against the eager logits); ignored elsewhere.

    Raises:
        ValueError: gen_length < 1, or prompt + generation exceeds `max_position_embeddings`."""
    if gen_length < 1:
        raise ValueError("gen_length must be >= 1")
    prompts = split_prompts(prompt_ids, attention_mask)
    _check_positions(model, prompts, gen_length)
    gen = torch.Generator(device=_model_device(model)).manual_seed(seed)
    t0 = _clock(_model_device(model))
    rows = [_Row(prompt=p) for p in prompts]
    programs = [_ar_program(r, gen_length=gen_length, eos_id=eos_id) for r in rows]
    calls = _run(model, rows, programs, max(len(p) for p in prompts) + gen_length,
                 temperature, gen, cuda_graph=cuda_graph)
    return GenerationOutput(tokens=[r.output(eos_id) for r in rows],
                            forwards=[r.forwards for r in rows], batch_forwards=calls,
                            seconds=_clock(_model_device(model)) - t0,
                            tpf_reference_style=[None] * len(rows),
                            commit_forward=[r.trace(eos_id) for r in rows])


def _check_positions(model, prompts: list[list[int]], g: int) -> None:
    """Raise ValueError when the longest prompt + `g` exceeds `max_position_embeddings`."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None)
    need = max(len(p) for p in prompts) + g
    if limit is not None and need > limit:
        raise ValueError(f"prompt + generation needs {need} positions, the model has "
                         f"max_position_embeddings {limit}")
