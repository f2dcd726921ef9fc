"""Plan-and-infill (ReFusion) decoding and plain autoregressive decoding, batched, with a KV cache.

Owns: the decoding algorithms (`refusion_generate`, `ar_generate`) and their statistics (tokens,
forwards by kind, TPF). The tests compare them with a cache-free oracle that recomputes the whole
reorganized sequence at every forward (`tests/decoding_oracle.py`).
Must not touch: model weights, tokenizers, files, process groups (a caller with tensor
parallelism > 1 runs the same call on every rank of the TP group; logits are all-gathered).

The method is "Decoding: plan and infill" in docs/METHOD.md (ReFusion, arXiv 2512.13586). One decode
step of a prompt ("row"):

1. plan: feed the block's still-masked slots (mask ids at their original positions) after the
   cache; argmax tokens (Gumbel-max sampling when temperature > 0) and their softmax
   probabilities; a slot's score is the probability of its first token; select the slots with
   score > slot_threshold, or the single best one.
2. verify (fast path): feed the selected slots' drafts concatenated in slot order (plain causal);
   token j is accepted when P(token j | everything before it) > token_threshold, the first token
   of every slot always; the accepted prefix of the concatenation is computed. If it contains an
   EOS, the tokens through that EOS are committed; else if it covers >= 1 whole slot, the leading
   whole slots are committed (their keys/values from this forward are exact) and the rest is
   planned again; else go to 3 with the per-slot acceptance found here.
3. draft/verify rounds (the selected slots in parallel, each seeing only the committed prefix and
   itself): draft = argmax at the masked (not yet accepted) positions; verify = causal
   probabilities; a token is accepted when its probability > token_threshold or the token before
   it was accepted before this round (so every round accepts at least one more token per slot);
   acceptance is a prefix per slot. An accepted EOS in slot e drops the selected slots after e and
   completes slot e. When every selected slot is complete, the slots' tokens, cut after the first
   EOS, are committed in slot order with the keys/values of the last verify forward (each slot's
   k/v computed against the prefix only: the reference code's cache, default) or re-encoded in
   commit order (`exact_cache=True`: the re-encode rides along with the row's next forward, so
   it costs tokens, not forwards).
4. Once an EOS is committed at position q, masked slots after q are discarded; slots before q are
   still decoded; the output is the committed tokens sorted by original position, ending at the
   first EOS (inclusive).

2'. `verify="correct"` (an option; the default "authors" is steps 2-3 above, the reference):
   the plan drafts the open (not yet committed) offsets of the block's slots, which may now be
   parts of slots; the selected slots' drafts are verified once, concatenated in slot order
   (plain causal), and walked left to right. Each drafted token is judged by the AR head's
   prediction for its position: the logits at the token before it in this forward when that
   is its left neighbour, else the logits kept from the forward that encoded its committed left
   neighbour (the prompt's last token for the first position). It is accepted when it is the
   AR head's choice (argmax; its sample at temperature > 0) or its probability exceeds
   token_threshold; at the first one that is not, the AR head's choice is committed in its
   place (speculative decoding's correction token) and the walk stops; after a fully accepted
   walk, the AR head's choice for the next position is committed too (the bonus token). A
   correction or bonus token is encoded ahead of the row's next forward (carried). The rest of
   a partly committed slot stays masked and is planned again. A draft whose left neighbour is
   not decoded yet (a slot planned ahead of the ones before it) has no AR prediction and is
   kept as drafted, as the authors' decoder keeps every slot's first token. Consequences: one
   plan + one verify per step, each committing at least one token; no committed token is one
   the AR head rejected while it could judge it; with one slot per block (left-to-right
   slots), token_threshold >= 0.5 and greedy decoding, the output equals `ar_generate`'s token
   for token (a token with probability > 0.5 is the argmax), at TPF = (accepted drafts +
   1) / 2 per step. The keys/values are always those of the committed sequence in commit order
   (`exact_cache` has no effect).

2''. `verify="draft_ahead"` (an option; docs/METHOD.md "Drafting inside the verify forward"):
   the corrected verify's rule with the plan folded into the verify forward, slots left to
   right (`num_blocks` and `slot_threshold` are unused: the next slot is always the one to the
   right). Each forward feeds, after the cache and the carried token, the drafts of the open
   offsets of the current slot, then the masks of the next slot: the AR logits at the carried
   token and the drafts judge the drafts (accept when the AR head's choice or probability >
   token_threshold; at the first failure the AR head's choice is committed, after a full walk
   the AR head's choice for the next offset: the bonus), while the mask logits, which see the
   drafts, draft the next slot. The next forward's drafts are the predictions this forward made
   for the offsets after the committed ones (the rest of a rejected slot's old drafts, then the
   mask predictions). One forward per step, each committing accepted drafts + 1 token; the
   first forward has no drafts (a plan: its AR logit at the prompt's last token gives the
   first token). Greedy with token_threshold >= 0.5, the output equals `ar_generate`'s. Only
   the carried token and the accepted drafts (a prefix of the fed tokens, in natural order)
   are committed to the cache, so it holds exactly the keys/values of a causal forward of the
   committed sequence; rejected drafts and the masks leave nothing behind.

2'''. `verify="draft_every"` (an option; docs/METHOD.md "Drafting for every acceptance
   length", after TiDAR, arXiv 2511.08923): draft_ahead's rule, one forward per step, but the
   next slot is drafted for every possible outcome of the walk, so that a rejection costs no
   forward that only re-drafts. With L the committed length (the carried token at L - 1) and
   n <= k drafts at positions L .. L + n - 1 (k = slot_size; slots are the k positions after
   the last committed token, not a fixed grid), each forward feeds, after the cache and the
   carried token, the drafts (causal), then for each acceptance length a = 0 .. n a block of
   k + 1 masks at positions L + a .. L + a + k: the first stands for the correction or bonus
   token the walk commits at L + a (unknown when the forward is built), the other k draft
   the next slot. Block a sees the cache, the carried token and drafts 0 .. a - 1, and is
   causal within itself; blocks do not see each other, drafts see no block. After the walk
   accepted a drafts, block a's last k predictions are the next step's drafts: made with
   exactly the committed prefix, except for the token at L + a. Only the carried token and
   the accepted drafts are committed (a prefix of the fed tokens), so the cache is exact and
   no block leaves anything in it. Greedy with token_threshold >= 0.5, the output equals
   `ar_generate`'s (and draft_ahead's). Tokens fed per forward: 1 + k + (k + 1)^2 at most.

`mask_attention` (draft_ahead and draft_every; docs/METHOD.md "Mask attention"): "causal"
(default) feeds a drafting block's masks causally among themselves, as mode refusion trains
masked slots; "bidirectional" lets every mask of a block see every other mask of the same
block, as mode dual trains its masked copies. A block is draft_ahead's masks of one forward
(the next slot; at the first forward the first two slots) or one of draft_every's blocks of
k + 1 masks. Nothing else changes (what a block sees before it, the drafts, the walk), so the
greedy output with token_threshold >= 0.5 is still `ar_generate`'s.

Where this differs from the reference code (ML-GSAI/ReFusion `generate.py`): prompts are batched
(each row keeps its own state; each model forward serves every row's current phase, so rows at
different progress share forwards); parallel slots share one batch row with a block-diagonal
attention mask instead of copying the cache per slot, and each round re-feeds the selected
slots whole (k tokens each) instead of caching their accepted tokens (same logits, more tokens
per forward, no per-slot cache); EOS handling as in 4; TPF is generated tokens / forwards (the
reference's per-step average is reported as `tpf_reference_style`). As in the reference, the
acceptance that step 3 starts from is the one of the concatenated verify of step 2, so for the
second and later selected slots it was computed with the earlier slots' drafts in context.

Batch layout of a forward: row b feeds `carry_b + request_b` (carry = tokens to be encoded and
committed ahead of the request: the prompt at the first forward, re-encoded slots in exact
mode), right-padded to the longest row; rows that have finished leave the batch
(`KVCache.select_rows`). The host sends the ids, positions, the mask among the new tokens (only
when a request has one) and the previous forward's commit index to the device in one copy
(`_pack`); the model writes the new keys/values into the cache in place and builds the mask
over the cache on the device; nothing else goes back and forth but the decisions. Every tensor
the model and the KV cache see is on the model's device (the cache in the model's dtype);
logits stay there. Each request names what its row reads from the logits (`Need`: choices,
probabilities of given tokens); they are computed there for every row at once and come back in
one transfer per forward (`pipeline.inference.decisions`); the logits are freed before the next
forward (a program keeps copies of single rows where it needs them later: verify "correct").
`ar_generate(..., cuda_graph=True)` replays its one-token steps from a CUDA graph.
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
from pipeline.inference.left_to_right import _draft_ahead_program, _draft_every_program
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
            ("plan", "verify", "draft", "ar"; the prompt prefill rides along with the first plan
            in refusion mode and is its own "prefill" forward in ar mode).
        batch_forwards: number of model forward calls for the whole batch.
        seconds: wall-clock seconds of the whole call, the model's device synchronized at both
            ends (CUDA work is asynchronous).
        tpf_reference_style: per prompt, the reference code's "TPF" (per-step average of
            slot_size x slots committed / forwards of that step); None in ar mode. With
            verify="correct": tokens committed per step / 2; "draft_ahead" and
            "draft_every": tokens committed per forward.
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
    """Normalize prompts to a list of id lists.

    Args:
        prompt_ids: `LongTensor[B, T]` (left or right padded, with `attention_mask`), or a
            sequence of 1-D `LongTensor[P_b]` / `list[int]`.
        attention_mask: `Tensor[B, T]`, 1/True on real tokens (required to drop padding from a
            padded 2-D tensor; without it every position is a prompt token).

    Returns:
        `list[list[int]]`, one list of prompt ids per row (padding removed).

    Raises:
        ValueError: a prompt is empty.
    """
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
    """`time.perf_counter()` after the device's queued work has finished (CUDA kernels run
    asynchronously: without the synchronization a wall time would miss work still queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


VERIFY_MODES = ("authors", "correct", "draft_ahead", "draft_every")
# How the masks of one drafting block attend to each other (module docstring, "mask_attention").
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
    """Plan-and-infill decoding of a batch of prompts with a KV cache (module docstring).

    Args:
        model: `pipeline.model.Qwen3` in eval mode (any TP size; every TP rank calls this).
        prompt_ids: `LongTensor[B, T]` (left or right padded; give `attention_mask`) or a list
            of 1-D `LongTensor[P_b]` / `list[int]`.
        gen_length: tokens to generate at most; "authors" and "correct" round it up to a
            multiple of `slot_size` (their plan grid is whole slots), "draft_ahead" and
            "draft_every" do not (their output equals `ar_generate`'s at every length).
        slot_size: k, tokens per slot.
        num_blocks: the generation region is decoded in this many left-to-right blocks; the
            number of slots must be a multiple of it.
        slot_threshold: a slot is selected when its first token's probability exceeds this
            (> 1: exactly one slot per step).
        token_threshold: a drafted token is accepted when its causal probability exceeds this
            (0 (< every probability): whole slots accepted at once).
        temperature: Gumbel-max sampling temperature of the plan step (0 = argmax).
        mask_id / eos_id: the mask token id; the end-of-sequence id (None: never stop early).
        exact_cache: re-encode slots infilled in parallel in commit order (exact KV cache)
            instead of keeping each slot's prefix-only keys/values (the reference's choice).
        attention_mask: `Tensor[B, T]` marking real prompt tokens of a padded `prompt_ids`.
        seed: seed of the sampling generator (used only when temperature > 0).
        verify: "authors" (default: the reference algorithm, module docstring steps 2-3) or
            "correct" (step 2' of the module docstring: a rejected draft is replaced by the
            AR head's own token; the KV cache is then always exact and `exact_cache` has no
            effect) or "draft_ahead" (step 2'': the same rule, one forward per step, the next
            slot drafted by masks fed after the drafts; slots left to right, `num_blocks`,
            `slot_threshold` and `exact_cache` unused) or "draft_every" (step 2''': as
            draft_ahead, with the next slot drafted for every acceptance length by a block of
            masks each; the same options unused).
        mask_attention: "causal" (default) or "bidirectional": how the masks of one drafting
            block attend to each other (module docstring, "mask_attention"); bidirectional
            matches a model trained with `objective.mode=dual`. Verify draft_ahead and
            draft_every only.

    Returns:
        `GenerationOutput` (generated ids per prompt, forwards by kind, TPF, TPS, the forward
        that committed each token).

    Raises:
        ValueError: inconsistent sizes, an unknown `verify` or `mask_attention`, a
            bidirectional `mask_attention` with verify "authors" or "correct", or the prompt +
            generation exceeds the model's `max_position_embeddings`.
    """
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
        program = _draft_ahead_program if verify == "draft_ahead" else _draft_every_program
        programs = [program(r, gen_length=g, slot_size=slot_size,
                            token_threshold=token_threshold, mask_id=mask_id, eos_id=eos_id,
                            bidirectional=mask_attention == "bidirectional") for r in rows]
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
    """Plain autoregressive decoding (one token per forward after a prefill) with the same model
    and KV cache: the baseline for TPF/TPS/accuracy.

    Args:
        model, prompt_ids, attention_mask, seed: as `refusion_generate`.
        gen_length: tokens to generate at most (stops earlier at EOS, which is kept).
        temperature: sampling temperature (0 = greedy).
        eos_id: end-of-sequence id, or None.
        cuda_graph: on CUDA, replay the one-token steps from a CUDA graph captured at the first
            of them (the cache then attends over its full storage width); the capture is
            checked against the eager logits of its step, and decoding stays eager if they
            differ. Ignored elsewhere.

    Returns:
        `GenerationOutput` (forwards by kind: "prefill", "ar").

    Raises:
        ValueError: gen_length < 1, or prompt + generation exceeds `max_position_embeddings`.
    """
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
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None)
    need = max(len(p) for p in prompts) + g
    if limit is not None and need > limit:
        raise ValueError(f"prompt + generation needs {need} positions, the model has "
                         f"max_position_embeddings {limit}")
