"""The ReFusion training objective: per-sample reorganization and the hybrid AR + MDM loss.

Owns: turning one prepared sample into the sequence the model is fed (docs/METHOD.md "One
training sample"; the AR baseline, "The AR baseline"; boundary labels and natural-order
segments, "Boundary labels and natural-order segments"; mode "dual", "The dual-stream arm"),
collating reorganized samples into fixed-shape micro-batch tensors (with the label positions
and varlen boundaries the training step needs, so it reads nothing back from the device), and
the loss ("Loss of a micro-batch"), the output layer applied chunk by chunk on labelled
positions only (`labelled_cross_entropy`) or fused with the cross-entropy
(`hybrid_loss(..., head_loss=)`, `pipeline.model.linear_ce`).
Must not touch: the model, process groups (it only reads megatron-core's `parallel_state` to
pick the vocab-parallel cross-entropy), shard I/O (`pipeline.data`).

Everything here is a pure function of its arguments; a sample's randomness comes from
`sample_rng(seed, key, epoch)` (docs/METHOD.md "Determinism"), drawn in this order (changing it
changes every batch):
  1. only with `ObjectiveConfig.slot_sizes`: `rng.integers(len(slot_sizes), size=S)`, each
     segment's slot size k;
  2. `t = rng.random(S)`; `p = (1 - eps) * t + eps`;
  3. `u = rng.random(N)`, one per slot (natural order over all segments); masked iff `u < p`;
  4. `o = rng.random(N)`; a segment's clean slots are fed in increasing `o`;
  5. only with `natural_order_fraction > 0`: `n = rng.random(S)`; natural order iff
     `n < natural_order_fraction` (draws 2-4 are made and unused).
Mode "ar" draws nothing. Mode "dual" makes draw 1 and, with `dual_masking="refusion"`, draws 2
and 3 (slot copied iff `u < c * p`, c = `dual_copy_scale`, 1 by default); with "all" p = 1 and
c = 1. A copy token's weight is 1 / (c * p * n_r), as a masked token's in mode "refusion"
(c = 1). Data_prep ends responses with EOS, so EOS is an AR target.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

IGNORE_INDEX = -100
MODES = ("refusion", "ar", "dual")
DUAL_MASKINGS = ("all", "refusion")

__all__ = ["IGNORE_INDEX", "MODES", "DUAL_MASKINGS", "ObjectiveConfig", "Reorganized", "sample_rng", "slot_layout",
           "reorganize_sample", "collate", "token_cross_entropy", "labelled_cross_entropy",
           "hybrid_loss", "LOSS_CHUNK_TOKENS"]


@dataclass
class ObjectiveConfig:
    """Options of the objective. Defaults are the paper's.

    Attributes:
        mode: "refusion" (the method), "ar" (the baseline) or "dual" (the dual-stream arm).
        eps: lower bound of the mask probability, `p = (1 - eps) * t + eps`.
        slot_sizes: None = the shards' slot boundaries; a list of sizes = re-slice each
            segment's response into slots of a size drawn per (segment, epoch) from it.
        ar_weight / mdm_weight: loss = ar_weight * AR + mdm_weight * MDM.
        boundary_labels: AR labels across slot boundaries (False = the paper's labels).
        natural_order_fraction: share in [0, 1] of segments fed all clean, in natural order.
        dual_masking: mode "dual" only: "all" or "refusion" (which slots get a masked copy).
        dual_copy_scale: mode "dual" with `dual_masking="refusion"` only: c in (0, 1], a slot
            is copied with probability c * p (weight 1 / (c * p * n_r), so the MDM term's
            expectation is unchanged); 1 = the paper's draw.
    The meaning of each: docs/METHOD.md "Training objective". Raises ValueError (naming the
    `objective.` field) on a bad value or combination.
    """

    mode: str = "refusion"
    eps: float = 1e-3
    slot_sizes: list[int] | None = None
    ar_weight: float = 1.0
    mdm_weight: float = 1.0
    boundary_labels: bool = False
    natural_order_fraction: float = 0.0
    dual_masking: str = "all"
    dual_copy_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"objective.mode must be 'refusion' or 'ar' or 'dual', got "
                             f"{self.mode!r}")
        if self.dual_masking not in DUAL_MASKINGS:
            raise ValueError(f"objective.dual_masking must be 'all' or 'refusion', got "
                             f"{self.dual_masking!r}")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"objective.eps must be in [0, 1), got {self.eps}")
        if self.slot_sizes is not None:
            self.slot_sizes = [int(k) for k in self.slot_sizes]
            if not self.slot_sizes or min(self.slot_sizes) < 1:
                raise ValueError(f"objective.slot_sizes must be positive sizes, got {self.slot_sizes}")
        if self.ar_weight < 0 or self.mdm_weight < 0:
            raise ValueError("objective.ar_weight and objective.mdm_weight must be >= 0")
        if not isinstance(self.boundary_labels, bool):
            raise ValueError(f"objective.boundary_labels must be true or false, got "
                             f"{self.boundary_labels!r}")
        if not 0.0 <= float(self.natural_order_fraction) <= 1.0:
            raise ValueError(f"objective.natural_order_fraction must be in [0, 1], got "
                             f"{self.natural_order_fraction}")
        self.natural_order_fraction = float(self.natural_order_fraction)
        if self.mode == "dual" and self.boundary_labels:
            raise ValueError("objective.boundary_labels: mode dual already labels every clean "
                             "token (natural order); leave it false")
        if not 0.0 < float(self.dual_copy_scale) <= 1.0:
            raise ValueError(f"objective.dual_copy_scale must be in (0, 1], got "
                             f"{self.dual_copy_scale}")
        self.dual_copy_scale = float(self.dual_copy_scale)
        if self.dual_copy_scale != 1.0 and (self.mode != "dual" or self.dual_masking != "refusion"):
            raise ValueError("objective.dual_copy_scale: only mode dual with dual_masking refusion "
                             "draws its copies; leave it 1")
        if self.mode == "dual" and self.natural_order_fraction > 0:
            raise ValueError("objective.natural_order_fraction: mode dual feeds every segment in "
                             "natural order already; leave it 0")


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest(), "little")


def sample_rng(seed: int, key: str, epoch: int) -> np.random.Generator:
    """The random generator of one sample: numpy PCG64 seeded by
    `SeedSequence([seed, epoch, blake2b-128(key)])` (stable across processes and Python runs,
    unlike the salted builtin `hash`). seed, epoch: ints >= 0 (ValueError otherwise); key: the
    sample's `__key__`."""
    return _hashed_rng(seed, epoch, _key_hash(key))


def _hashed_rng(seed: int, epoch: int, key_hash: int) -> np.random.Generator:
    """`sample_rng` from the key's blake2b-128 (little-endian int) instead of the key."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed} epoch={epoch}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, key_hash])))


def slot_layout(segments: Sequence[dict], rng: np.random.Generator | None,
                cfg: ObjectiveConfig) -> tuple[np.ndarray, np.ndarray]:
    """Slot boundaries of a sample: the stored ones, or re-sliced per `cfg` (draw 1 from `rng`
    with `cfg.slot_sizes`; `rng` may be None otherwise).

    Args:
        segments: the shard sample's `json["segments"]` (absolute offsets into `tokens`).
    Returns:
        (slot_start, slot_segment): `int64[N]` absolute start offset of every slot in natural
        order, and each slot's segment index.
    """
    starts = np.array([s["start"] + s["prompt_length"] for s in segments], dtype=np.int64)
    ends = np.array([s["end"] for s in segments], dtype=np.int64)
    n_seg = len(segments)
    if cfg.mode == "ar":
        return starts, np.arange(n_seg, dtype=np.int64)
    if cfg.slot_sizes is None:
        counts = np.array([len(s["slot_starts"]) for s in segments], dtype=np.int64)
        slot_start = np.fromiter((x for s in segments for x in s["slot_starts"]), dtype=np.int64,
                                 count=int(counts.sum()))
        return slot_start, np.repeat(np.arange(n_seg, dtype=np.int64), counts)
    sizes = np.asarray(cfg.slot_sizes, dtype=np.int64)
    k = sizes[rng.integers(len(sizes), size=n_seg)]
    counts = -(-(ends - starts) // k)  # ceil
    slot_seg = np.repeat(np.arange(n_seg, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - first[slot_seg]
    return starts[slot_seg] + within * k[slot_seg], slot_seg


def dual_fed_length(num_tokens: int, key_hash: int, slot_size: np.ndarray,
                    slot_segment: np.ndarray, *, seed: int, epoch: int, cfg: ObjectiveConfig,
                    max_length: int | None = None) -> int:
    """The fed length of a sample in mode "dual", equal to `reorganize_sample(...).length`,
    from the sample's slot layout alone (a version-3 sample index's `SlotLayout`), so a packer
    need not read the sample. Makes `_dual_sample`'s draws and applies its `max_length` rule.

    Args:
        num_tokens: L, the sample's tokens.
        key_hash: blake2b-128 of the sample key, little-endian (`sample_rng`'s seed part).
        slot_size: int64[N] tokens of each stored slot (`slot_starts`), natural order.
        slot_segment: int64[N] the 0-based segment of each slot (non-decreasing, every
            segment present).
        seed, epoch, cfg, max_length: as `reorganize_sample` (cfg.mode must be "dual").

    Raises:
        ValueError: cfg.mode is not "dual", or L > max_length.
    """
    if cfg.mode != "dual":
        raise ValueError(f"dual_fed_length: objective mode is {cfg.mode!r}, not 'dual'")
    L = int(num_tokens)
    if max_length is not None and L > max_length:
        raise ValueError(f"{L} tokens > max_length {max_length}")
    rng = _hashed_rng(seed, epoch, int(key_hash))
    size = np.asarray(slot_size, dtype=np.int64)
    seg = np.asarray(slot_segment, dtype=np.int64)
    n_seg = int(seg[-1]) + 1
    if cfg.slot_sizes is not None:  # draw 1: re-slice each response (as `slot_layout`)
        resp = np.bincount(seg, weights=size, minlength=n_seg).astype(np.int64)
        sizes = np.asarray(cfg.slot_sizes, dtype=np.int64)
        k = sizes[rng.integers(len(sizes), size=n_seg)]
        counts = -(-resp // k)
        seg = np.repeat(np.arange(n_seg, dtype=np.int64), counts)
        size = np.repeat(k, counts)
        last = np.cumsum(counts) - 1
        size[last] = resp - (counts - 1) * k
    if cfg.dual_masking == "refusion":
        t = rng.random(n_seg)
        p = (1.0 - cfg.eps) * t + cfg.eps
        copy = np.where(rng.random(size.shape[0]) < cfg.dual_copy_scale * p[seg], size, 0)
    else:
        copy = size
    if max_length is not None:
        copy = copy[L + np.cumsum(copy) <= max_length]
    return L + int(copy.sum())


@dataclass
class Reorganized:
    """One shard sample after reorganization; arrays are in *fed* order, length L.

    Attributes:
        key: the sample key.
        input_ids: int64[L] fed tokens (mask id at masked positions).
        position_ids: int64[L] original position ids, restarting at 0 per segment.
        labels: int64[L] target token or IGNORE_INDEX (-100).
        is_masked: bool[L] token belongs to a masked slot (its label is the MDM target).
        loss_weight: float32[L] 1/(p * n_r) at masked tokens, 1 at AR-labelled tokens, else 0.
        segment: int64[L] 0-based index of the token's segment within this sample.
        p: float64[S] mask probability of each segment (0 in mode "ar"; 1 in mode "dual" with
            `dual_masking="all"`).
        response_tokens: int, number of response tokens over all segments.
        copy_id: mode "dual" only (else None): int64[L], 0 at clean tokens, c >= 1 at the tokens
            of the sample's c-th masked copy (copies numbered in fed order).
        clean_limit: mode "dual" only (else None): int64[L], the token sees its segment's clean
            tokens of position id < clean_limit (clean token: its own + 1; copy token: its
            slot's first), as `attention.dual_mask` reads it.
        copy_tokens: tokens of the masked copies (mode "dual"; else 0).
        dropped_copies / dropped_copy_tokens: copies (and their tokens) left out so that the
            sample fits `max_length` (mode "dual"; else 0).
    """

    key: str
    input_ids: np.ndarray
    position_ids: np.ndarray
    labels: np.ndarray
    is_masked: np.ndarray
    loss_weight: np.ndarray
    segment: np.ndarray
    p: np.ndarray
    response_tokens: int
    copy_id: np.ndarray | None = None
    clean_limit: np.ndarray | None = None
    copy_tokens: int = 0
    dropped_copies: int = 0
    dropped_copy_tokens: int = 0

    @property
    def length(self) -> int:
        """Number of tokens L."""
        return int(self.input_ids.shape[0])

    @property
    def num_segments(self) -> int:
        """Number of segments S."""
        return int(self.p.shape[0])


def reorganize_sample(tokens: np.ndarray, segments: Sequence[dict], key: str, *, seed: int,
                      epoch: int, mask_id: int, cfg: ObjectiveConfig,
                      max_length: int | None = None) -> Reorganized:
    """Reorganize one shard sample (docs/METHOD.md "One training sample", steps 1-5, or the
    mode's section), vectorized; each segment inside its own span.

    Args:
        tokens: uint32/int[L] natural-order token ids.
        segments: `json["segments"]` of the shard sample (see ARCHITECTURE.md "Shard format").
        key, seed, epoch: seed the sample's randomness (`sample_rng`).
        mask_id: id of the mask token. cfg: objective options.
        max_length: mode "dual" only: the most tokens the sample may have (a row's length;
            copies dropped, the last slot first); None = keep every copy.

    Returns:
        A `Reorganized` (arrays in fed order).

    Raises:
        ValueError: the segments do not cover `tokens` contiguously, or a response is empty;
            mode "dual": the clean tokens alone exceed `max_length`.
    """
    x = np.asarray(tokens).astype(np.int64, copy=False)
    L = int(x.shape[0])
    n_seg = len(segments)
    seg_start = np.array([s["start"] for s in segments], dtype=np.int64)
    seg_end = np.array([s["end"] for s in segments], dtype=np.int64)
    resp_start = seg_start + np.array([s["prompt_length"] for s in segments], dtype=np.int64)
    if (n_seg == 0 or seg_start[0] != 0 or seg_end[-1] != L or np.any(seg_start[1:] != seg_end[:-1])
            or np.any(resp_start >= seg_end) or np.any(resp_start < seg_start)):
        raise ValueError(f"sample {key}: segments must be contiguous, cover the {L} tokens and "
                         f"each have a non-empty response")
    rng = None if cfg.mode == "ar" else sample_rng(seed, key, epoch)
    slot_start, slot_seg = slot_layout(segments, rng, cfg)
    n_slot = int(slot_start.shape[0])
    slot_end = np.empty(n_slot, dtype=np.int64)
    slot_end[:-1] = slot_start[1:]
    last_of_seg = np.ones(n_slot, dtype=bool)
    last_of_seg[:-1] = slot_seg[1:] != slot_seg[:-1]
    slot_end[last_of_seg] = seg_end[slot_seg[last_of_seg]]
    first_of_seg = np.ones(n_slot, dtype=bool)
    first_of_seg[1:] = slot_seg[1:] != slot_seg[:-1]
    if (np.any(slot_end <= slot_start) or np.any(slot_start[first_of_seg] != resp_start)
            or np.bincount(slot_seg, minlength=n_seg).min() < 1):
        raise ValueError(f"sample {key}: slot_starts must be increasing and start at each "
                         f"segment's response start")
    if cfg.mode == "dual":
        return _dual_sample(x, key, rng, cfg, mask_id, max_length, seg_start, seg_end, resp_start,
                            slot_start, slot_end, slot_seg)

    if cfg.mode == "ar":
        p = np.zeros(n_seg, dtype=np.float64)
        slot_masked = np.zeros(n_slot, dtype=bool)
        order = np.zeros(n_slot, dtype=np.float64)
    else:
        t = rng.random(n_seg)
        p = (1.0 - cfg.eps) * t + cfg.eps
        slot_masked = rng.random(n_slot) < p[slot_seg]
        order = rng.random(n_slot)
        if cfg.natural_order_fraction > 0:
            natural = rng.random(n_seg) < cfg.natural_order_fraction
            if natural.any():
                nat_slot = natural[slot_seg]
                p = np.where(natural, 0.0, p)
                slot_masked = slot_masked & ~nat_slot
                # clean slots are ranked by `order`; natural-order ones by their start
                order = np.where(nat_slot, slot_start.astype(np.float64), order)

    pos = np.arange(L, dtype=np.int64)
    tok_seg = np.repeat(np.arange(n_seg, dtype=np.int64), seg_end - seg_start)
    in_resp = pos >= resp_start[tok_seg]
    tok_slot = np.full(L, -1, dtype=np.int64)
    tok_slot[in_resp] = np.repeat(np.arange(n_slot, dtype=np.int64), slot_end - slot_start)
    tok_masked = np.zeros(L, dtype=bool)
    tok_masked[in_resp] = slot_masked[tok_slot[in_resp]]

    # Group within a segment: 0 prompt, 1 clean slot, 2 masked slot; then the slot's rank key.
    group = np.where(in_resp, np.where(tok_masked, 2, 1), 0)
    rank_key = np.zeros(L, dtype=np.float64)
    rank_key[in_resp] = np.where(slot_masked, slot_start.astype(np.float64), order)[tok_slot[in_resp]]
    perm = np.lexsort((pos, rank_key, group, tok_seg))

    nxt = np.empty(L, dtype=np.int64)
    nxt[:-1] = x[1:]
    nxt[-1] = IGNORE_INDEX
    labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
    clean = in_resp & ~tok_masked
    slot_end_tok = np.zeros(L, dtype=np.int64)
    slot_end_tok[in_resp] = slot_end[tok_slot[in_resp]]
    ar_lab = clean & (pos + 1 < slot_end_tok)
    if cfg.mode == "ar" or cfg.boundary_labels:
        # the last prompt token predicts the first response token
        ar_lab |= (pos + 1 == resp_start[tok_seg]) & (pos + 1 > seg_start[tok_seg])
    if cfg.mode != "ar" and cfg.boundary_labels and n_slot > 1:
        # a clean slot's last token predicts the next slot's first token when that slot is
        # masked or fed later (clean slots are fed in increasing `order`; equal keys by position)
        nxt_slot = ~last_of_seg[:-1]           # slot i has a successor i+1 in its segment
        later = slot_masked[1:] | (order[1:] >= order[:-1])
        cross = np.flatnonzero(nxt_slot & ~slot_masked[:-1] & later)
        ar_lab[slot_end[cross] - 1] = True
    labels[ar_lab] = nxt[ar_lab]
    labels[tok_masked] = x[tok_masked]
    n_r = (seg_end - resp_start).astype(np.float64)
    weight = np.zeros(L, dtype=np.float64)
    weight[ar_lab] = 1.0
    weight[tok_masked] = 1.0 / (p[tok_seg[tok_masked]] * n_r[tok_seg[tok_masked]])
    input_ids = np.where(tok_masked, np.int64(mask_id), x)
    return Reorganized(
        key=key, input_ids=input_ids[perm], position_ids=(pos - seg_start[tok_seg])[perm],
        labels=labels[perm], is_masked=tok_masked[perm], loss_weight=weight[perm].astype(np.float32),
        segment=tok_seg[perm], p=p, response_tokens=int((seg_end - resp_start).sum()))


def _dual_sample(x: np.ndarray, key: str, rng: np.random.Generator, cfg: ObjectiveConfig,
                 mask_id: int, max_length: int | None, seg_start: np.ndarray, seg_end: np.ndarray,
                 resp_start: np.ndarray, slot_start: np.ndarray, slot_end: np.ndarray,
                 slot_seg: np.ndarray) -> Reorganized:
    """Mode "dual" of `reorganize_sample`. Arguments: the validated sample (`x` int64[L]) and its
    slots, in natural order."""
    L = int(x.shape[0])
    n_seg, n_slot = int(seg_start.shape[0]), int(slot_start.shape[0])
    if max_length is not None and L > max_length:
        raise ValueError(f"sample {key}: {L} tokens > max_length {max_length}")
    if cfg.dual_masking == "refusion":
        t = rng.random(n_seg)
        p = (1.0 - cfg.eps) * t + cfg.eps
        copied = rng.random(n_slot) < cfg.dual_copy_scale * p[slot_seg]
    else:
        p = np.ones(n_seg, dtype=np.float64)
        copied = np.ones(n_slot, dtype=bool)
    size = slot_end - slot_start
    kept = copied.copy()
    if max_length is not None:
        # keep the longest prefix (natural slot order) of the copies that fits: dropping the
        # last copies first until the sample fits gives exactly that prefix
        kept &= L + np.cumsum(np.where(copied, size, 0)) <= max_length
    cslot = np.flatnonzero(kept)                                   # copied slots, in order
    n_copy = int(cslot.shape[0])
    ctok_slot = np.repeat(cslot, size[cslot])                      # per copy token: its slot
    first = np.cumsum(size[cslot]) - size[cslot]
    cpos = (slot_start[ctok_slot] + np.arange(ctok_slot.shape[0], dtype=np.int64)
            - np.repeat(first, size[cslot]))                        # original offsets
    cseg = slot_seg[ctok_slot]

    pos = np.arange(L, dtype=np.int64)
    tok_seg = np.repeat(np.arange(n_seg, dtype=np.int64), seg_end - seg_start)
    nxt = np.full(L, IGNORE_INDEX, dtype=np.int64)
    nxt[:-1] = x[1:]
    # clean labels as in mode "ar": response tokens but each segment's last, and the last
    # prompt token (when the prompt is non-empty)
    ar_lab = ((pos >= resp_start[tok_seg]) & (pos + 1 < seg_end[tok_seg])) | (
        (pos + 1 == resp_start[tok_seg]) & (pos + 1 > seg_start[tok_seg]))
    n_r = (seg_end - resp_start).astype(np.float64)

    # all tokens (clean first, then copies), then the fed order: by segment, clean before
    # copies, copies by slot, each in natural order
    all_pos = np.concatenate([pos, cpos])
    all_seg = np.concatenate([tok_seg, cseg])
    is_copy = np.concatenate([np.zeros(L, dtype=bool), np.ones(cpos.shape[0], dtype=bool)])
    slot_key = np.concatenate([np.zeros(L, dtype=np.int64), ctok_slot])
    perm = np.lexsort((all_pos, slot_key, is_copy, all_seg))
    input_ids = np.concatenate([x, np.full(cpos.shape[0], mask_id, dtype=np.int64)])
    labels = np.concatenate([np.where(ar_lab, nxt, IGNORE_INDEX), x[cpos]])
    weight = np.concatenate([ar_lab.astype(np.float64),
                             1.0 / (cfg.dual_copy_scale * p[cseg] * n_r[cseg])])
    position_ids = all_pos - seg_start[all_seg]
    # copy number c >= 1 per copied slot in fed order (segment, then slot: the slot order)
    copy_no = np.zeros(n_slot, dtype=np.int64)
    copy_no[cslot] = np.arange(1, n_copy + 1, dtype=np.int64)
    copy_id = np.concatenate([np.zeros(L, dtype=np.int64), copy_no[ctok_slot]])
    clean_limit = np.concatenate([pos - seg_start[tok_seg] + 1,
                                  slot_start[ctok_slot] - seg_start[cseg]])
    dropped = copied & ~kept
    return Reorganized(
        key=key, input_ids=input_ids[perm], position_ids=position_ids[perm], labels=labels[perm],
        is_masked=is_copy[perm], loss_weight=weight[perm].astype(np.float32),
        segment=all_seg[perm], p=p, response_tokens=int((seg_end - resp_start).sum()),
        copy_id=copy_id[perm], clean_limit=clean_limit[perm], copy_tokens=int(cpos.shape[0]),
        dropped_copies=int(dropped.sum()), dropped_copy_tokens=int(size[dropped].sum()))


def collate(rows: Sequence[Sequence[Reorganized]], max_length: int, pad_id: int,
            sources: Sequence[Sequence[int]] | None = None) -> dict:
    """Lay reorganized samples into a fixed-shape micro-batch: row b holds `rows[b]` one after
    another, then padding (docs/METHOD.md step 4) up to `max_length`. Segment ids number a row's
    segments 1, 2, ... (0 = padding).

    Args:
        rows: B lists of `Reorganized` (an empty list gives an all-padding row).
        max_length: T, tokens per row.
        pad_id: id of the padding token.
        sources: None, or B lists of ints parallel to `rows`: each sample's source (the index
            of its folder in a data mixture, `pipeline.data.mixture`).

    Returns:
        the micro-batch dict, its keys, shapes and dtypes as ARCHITECTURE.md "Batch" lists them;
        `segment_p`, `keys` and `segment_lengths` row-major, `label_index` increasing,
        `cu_seqlens` equal to `attention.varlen_boundaries(segment_ids)`, `copy_id` and
        `clean_limit` (mode "dual") 0 at padding.

    Raises:
        ValueError: a row's samples are longer than `max_length`.
    """
    B, T = len(rows), int(max_length)
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    position_ids = np.zeros((B, T), dtype=np.int64)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    segment_ids = np.zeros((B, T), dtype=np.int64)
    loss_weight = np.zeros((B, T), dtype=np.float32)
    is_masked = np.zeros((B, T), dtype=bool)
    source = np.zeros((B, T), dtype=np.int64)
    keys, ps, response_tokens = [], [], 0
    dual = any(s.copy_id is not None for samples in rows for s in samples)
    if dual:
        copy_id = np.zeros((B, T), dtype=np.int64)
        clean_limit = np.zeros((B, T), dtype=np.int64)
        copy_tokens = dropped_copies = 0
    for b, samples in enumerate(rows):
        used, seg_base = 0, 0
        for n, s in enumerate(samples):
            end = used + s.length
            if end > T:
                raise ValueError(f"row {b}: samples need {end} tokens > max_length {T}")
            input_ids[b, used:end] = s.input_ids
            position_ids[b, used:end] = s.position_ids
            labels[b, used:end] = s.labels
            segment_ids[b, used:end] = s.segment + seg_base + 1
            loss_weight[b, used:end] = s.loss_weight
            is_masked[b, used:end] = s.is_masked
            if sources is not None:
                source[b, used:end] = sources[b][n]
            if dual:
                copy_id[b, used:end] = s.copy_id
                clean_limit[b, used:end] = s.clean_limit
                copy_tokens += s.copy_tokens
                dropped_copies += s.dropped_copies
            seg_base += s.num_segments
            used = end
            keys.append(s.key)
            ps.append(s.p)
            response_tokens += s.response_tokens
        if used < T:
            # after the last segment's length: its position ids are a permutation of 0..L-1 in
            # fed order (masked slots moved to the end), so L = their maximum + 1
            last = 0
            if used:
                s = samples[-1]
                last = int(s.position_ids[s.segment == s.segment[-1]].max()) + 1
            position_ids[b, used:] = np.arange(last, last + T - used)
    segment_p = np.concatenate(ps) if ps else np.zeros(0)
    # Varlen boundaries: a segment starts at each row start, where the id changes, and at every
    # padding token (the same rule as attention.varlen_boundaries).
    flat = segment_ids.reshape(-1)
    start = np.ones(B * T, dtype=bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::T] = True
    start |= flat == 0
    cu = np.append(np.flatnonzero(start), B * T).astype(np.int32)
    real_start = start & (flat > 0)
    seg_len = np.diff(cu)[real_start[cu[:-1]]]
    extra = {}
    if dual:
        extra = {"copy_id": torch.from_numpy(copy_id),
                 "clean_limit": torch.from_numpy(clean_limit),
                 "copy_tokens": torch.tensor(copy_tokens, dtype=torch.long),
                 "dropped_copies": torch.tensor(dropped_copies, dtype=torch.long)}
    return {
        "input_ids": torch.from_numpy(input_ids), "position_ids": torch.from_numpy(position_ids),
        "labels": torch.from_numpy(labels), "segment_ids": torch.from_numpy(segment_ids),
        "loss_weight": torch.from_numpy(loss_weight), "is_masked": torch.from_numpy(is_masked),
        "num_segments": torch.tensor(int(segment_p.shape[0]), dtype=torch.long),
        "segment_p": torch.from_numpy(segment_p.astype(np.float32)),
        "response_tokens": torch.tensor(response_tokens, dtype=torch.long),
        "real_tokens": torch.from_numpy(segment_ids > 0).sum(),
        "keys": keys, "source": torch.from_numpy(source),
        "label_index": torch.from_numpy(np.flatnonzero(labels.reshape(-1) != IGNORE_INDEX)),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(np.diff(cu).max()) if B * T else 0,
        "segment_lengths": torch.from_numpy(seg_len.astype(np.int64)),
        **extra,
    }


def _tp_initialized() -> bool:
    import sys
    if "megatron.core" not in sys.modules or not torch.distributed.is_initialized():
        return False
    from megatron.core import parallel_state
    return parallel_state.model_parallel_is_initialized()


def token_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32, 0 where `labels == IGNORE_INDEX`.

    With megatron-core's `parallel_state` initialized, `logits_shard` is this rank's vocab
    partition (`vocab_parallel_cross_entropy`, which overwrites fp32 logits in place: pass a
    clone to keep them); otherwise the full logits (`F.cross_entropy`).

    Args:
        logits_shard: FloatTensor[B, T, V / tp] (any float dtype; computed in fp32).
        labels: LongTensor[B, T], -100 = ignore.

    Returns:
        FloatTensor[B, T] cross-entropy in nats.
    """
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, torch.zeros_like(labels))
    if _tp_initialized():
        from megatron.core import tensor_parallel
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits_shard.float(), target)
    else:
        V = logits_shard.shape[-1]
        ce = F.cross_entropy(logits_shard.float().reshape(-1, V), target.reshape(-1),
                             reduction="none").view_as(labels)
    return torch.where(valid, ce, torch.zeros_like(ce))


# Tokens per chunk of the output layer + cross-entropy in `labelled_cross_entropy`: at most
# this many rows of fp32 logits (`chunk x V/tp x 4` bytes, 1.2 GB for Qwen3's 151936-row vocab at
# TP=1) exist at a time, in forward and in backward.
LOSS_CHUNK_TOKENS = 2048


def _chunk_cross_entropy(hidden: torch.Tensor, target: torch.Tensor, head) -> torch.Tensor:
    return token_cross_entropy(head(hidden), target)


def _labelled_rows(labels: torch.Tensor, label_index: torch.Tensor | None, device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions of the labelled tokens, keep: 1.0 per row), with one zero-weight row at
    position 0 when nothing is labelled. `label_index` (collate's) avoids `nonzero` on the
    device, which would make the host wait for it."""
    if label_index is None:
        idx = (labels.reshape(-1) != IGNORE_INDEX).nonzero().flatten()
    else:
        idx = label_index.to(device, non_blocking=True)
    keep = torch.ones(idx.shape, dtype=torch.float32, device=device)
    if idx.numel() == 0:
        # Keep the output layer in the graph (every parameter gets a gradient, here 0), as the
        # full-logits loss does: ZeRO-3 expects each parameter's gradient every backward.
        idx = torch.zeros(1, dtype=torch.long, device=device)
        keep = torch.zeros(1, dtype=torch.float32, device=device)
    return idx, keep


def labelled_cross_entropy(hidden: torch.Tensor, head, labels: torch.Tensor,
                           chunk_tokens: int = LOSS_CHUNK_TOKENS,
                           label_index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token cross-entropy of the labelled positions, applying the output layer in chunks.

    Only labelled positions go through `head`, `chunk_tokens` at a time; a chunk's logits are
    freed after it and recomputed in backward (`torch.utils.checkpoint`), so no
    `[B, T, V / tp]` tensor is ever alive. Equals `token_cross_entropy(head(hidden), labels)` up
    to float summation order.

    Args:
        hidden: FloatTensor[B, T, hidden], the final-norm hidden states
            (`Qwen3.forward(..., return_hidden=True)`).
        head: callable `FloatTensor[N, hidden] -> FloatTensor[N, V / tp]` (this rank's vocab
            slice of the logits, e.g. `Qwen3.head_logits`); every TP rank calls it on the same
            chunks.
        labels: LongTensor[B, T], -100 = no label.
        chunk_tokens: tokens per chunk (>= 1).
        label_index: LongTensor[N] flat positions of the labels (collate's `label_index`), or
            None to find them here (`nonzero`: a host sync on GPUs).
    Returns:
        FloatTensor[B, T] fp32 cross-entropy in nats, 0 where there is no label.
    Raises:
        ValueError: chunk_tokens < 1.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, t, width = hidden.shape
    flat = labels.reshape(-1)
    idx, keep = _labelled_rows(labels, label_index, hidden.device)
    h = hidden.reshape(-1, width).index_select(0, idx)
    target = torch.where(flat[idx] == IGNORE_INDEX, torch.zeros_like(idx), flat[idx])
    recompute = torch.is_grad_enabled() and h.requires_grad
    parts = []
    for s in range(0, idx.numel(), chunk_tokens):
        hc, tc = h[s:s + chunk_tokens], target[s:s + chunk_tokens]
        if recompute:
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_cross_entropy, hc, tc, head,
                                                           use_reentrant=False))
        else:
            parts.append(_chunk_cross_entropy(hc, tc, head))
    ce = torch.cat(parts) * keep
    out = torch.zeros(b * t, dtype=torch.float32, device=hidden.device)
    return out.index_put((idx,), ce).view(b, t)


def hybrid_loss(outputs: torch.Tensor, batch: dict, cfg: ObjectiveConfig | None = None, *,
                head=None, chunk_tokens: int = LOSS_CHUNK_TOKENS, head_loss=None,
                num_sources: int | None = None) -> tuple[torch.Tensor, dict]:
    """The ReFusion loss of a micro-batch (docs/METHOD.md "Loss of a micro-batch"; `loss_weight`
    carries 1 / (p * n_r)). An empty term is 0, never NaN.

    Args:
        outputs: without `head` / `head_loss`, FloatTensor[B, T, V / tp] vocab-parallel logits
            in fed order (overwritten in place, `token_cross_entropy`); with either,
            FloatTensor[B, T, hidden] final-norm hidden states.
        batch: a dict from `collate` (tensors are moved to the outputs' device); its
            `label_index`, when present, gives the labelled positions (no host sync).
        cfg: objective options (weights); default `ObjectiveConfig()`.
        head, chunk_tokens: None, or the output layer applied by `labelled_cross_entropy`.
        head_loss: None, or the fused output layer + weighted cross-entropy
            `(hidden FloatTensor[N, hidden], target LongTensor[N], coef FloatTensor[N]) ->
            (sum coef * CE, CE detached FloatTensor[N])` (`Qwen3.head_loss`); coef is the loss's
            own weight per position (`ar_weight / AR tokens` or `mdm_weight * loss_weight /
            num_segments`), so the value and gradients equal the unfused sum's.
        num_sources: None, or S, the number of data sources: the stats then also hold sums per
            `source` id (all 0 when absent) of the detached CE of labelled tokens, unweighted.

    Returns:
        (loss: FloatTensor[] with grad, stats: dict of detached tensors on the outputs' device,
        its keys as ARCHITECTURE.md "Batch" lists them; `mask_ratio` is the mean p over
        segments, `masked_fraction` masked / response tokens).

    Raises:
        IndexError / RuntimeError: a `source` id >= num_sources (the caller checks ids).
    """
    cfg = cfg or ObjectiveConfig()
    dev = outputs.device
    labels = batch["labels"].to(dev, non_blocking=True)
    is_masked = batch["is_masked"].to(dev, non_blocking=True)
    weight = batch["loss_weight"].to(dev, non_blocking=True)
    n_seg = batch["num_segments"].to(dev)
    labelled = labels != IGNORE_INDEX
    ar_mask = labelled & ~is_masked
    mdm_mask = labelled & is_masked
    ar_tokens = ar_mask.sum()
    mdm_tokens = mdm_mask.sum()
    fused = None
    if head_loss is not None:
        b, t, width = outputs.shape
        idx, keep = _labelled_rows(labels, batch.get("label_index"), dev)
        masked_rows = is_masked.reshape(-1)[idx]
        coef = torch.where(masked_rows,
                           cfg.mdm_weight * weight.reshape(-1)[idx] / n_seg.clamp(min=1),
                           cfg.ar_weight / ar_tokens.clamp(min=1).float()) * keep
        target = labels.reshape(-1)[idx].clamp(min=0)
        fused, ce_rows = head_loss(outputs.reshape(-1, width).index_select(0, idx), target, coef)
        ce = torch.zeros(b * t, dtype=torch.float32, device=dev).index_put(
            (idx,), ce_rows * keep).view(b, t)
    elif head is None:
        ce = token_cross_entropy(outputs, labels)
    else:
        ce = labelled_cross_entropy(outputs, head, labels, chunk_tokens,
                                    label_index=batch.get("label_index"))
    ar = torch.where(ar_mask, ce, torch.zeros_like(ce)).sum() / ar_tokens.clamp(min=1)
    mdm = torch.where(mdm_mask, ce * weight, torch.zeros_like(ce)).sum() / n_seg.clamp(min=1)
    loss = cfg.ar_weight * ar + cfg.mdm_weight * mdm if fused is None else fused
    seg_p = batch["segment_p"]
    resp = batch["response_tokens"]
    stats = {
        "ar_loss": ar.detach(), "mdm_loss": mdm.detach(),
        "ar_tokens": ar_tokens.detach(), "mdm_tokens": mdm_tokens.detach(),
        "mask_ratio": seg_p.float().mean() if seg_p.numel() else torch.zeros(()),
        "masked_fraction": mdm_tokens.detach().float() / resp.to(dev).clamp(min=1),
        "num_segments": batch["num_segments"], "real_tokens": batch["real_tokens"],
        "response_tokens": resp,
    }
    if num_sources is not None:
        src = batch.get("source")
        src = (torch.zeros_like(labels) if src is None else src.to(dev, non_blocking=True))
        src, lab = src.reshape(-1), labelled.reshape(-1)
        ce_lab = torch.where(lab, ce.detach().reshape(-1), torch.zeros((), device=dev))
        stats["ce_sum_by_source"] = torch.zeros(num_sources, dtype=torch.float64, device=dev
                                                ).index_add_(0, src, ce_lab.double())
        stats["labelled_by_source"] = torch.zeros(num_sources, dtype=torch.long, device=dev
                                                  ).index_add_(0, src, lab.long())
    return loss, stats
