"""Attention of one layer: masks, the packed-sequence kernels, one `attention` function.

Owns: the masks (document-causal, mode "dual"'s, the KV-cache forward's), the per-forward
`AttentionPlan` (`plan_attention`, `plan_decode_attention`), the kernel choice and its
fallbacks (`resolve_attention`), and `attention(q, k, v, plan)`. Must not touch: projections,
RoPE, the KV cache's storage (`pipeline.model.kv_cache`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.model.config import ATTENTION_KINDS


def build_attention_mask(segment_ids: torch.Tensor | None, batch: int, q_len: int,
                         past_len: int = 0, past_valid: torch.Tensor | None = None,
                         device=None) -> torch.Tensor:
    """Vectorized boolean mask, True = may attend: `BoolTensor[B, 1, T, past_len + T]`.

    New tokens attend causally over the fed order. With `segment_ids: LongTensor[B, T]` a token
    attends only within its own segment; segment 0 is padding and attends only to itself (so no
    row is empty). Cached positions (the first `past_len` columns) are visible to every
    non-padding new token where `past_valid: BoolTensor[B, past_len]` is True.
    """
    if device is None:
        device = segment_ids.device if segment_ids is not None else None
    idx = torch.arange(q_len, device=device)
    new = (idx[None, :] <= idx[:, None])[None].expand(batch, q_len, q_len)  # [B, T, T]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        pad = segment_ids == 0
        eye = torch.eye(q_len, dtype=torch.bool, device=device)[None]
        new = torch.where(pad[:, :, None], eye, new & same)
    if past_len:
        if past_valid is None:
            past = torch.ones(batch, q_len, past_len, dtype=torch.bool, device=device)
        else:
            past = past_valid[:, None, :].expand(batch, q_len, past_len)
        if segment_ids is not None:
            past = past & (segment_ids != 0)[:, :, None]
        new = torch.cat((past, new), dim=-1)
    return new[:, None]


def decode_mask(length: torch.Tensor, t: int, columns: int, new: torch.Tensor | None = None,
                cached: torch.Tensor | None = None) -> torch.Tensor:
    """Mask of a KV-cache forward over the cache's storage layout, built on `length`'s device.

    Row b's committed entries are storage columns `[0, length[b])`, its T new tokens columns
    `[length[b], length[b] + T)`. New token i may see committed entries (where `cached`
    allows) and new token j where `new[b, i, j]` (default j <= i); a query with nothing to see
    sees itself (no NaN).

    Args:
        length: LongTensor[B], committed entries per row (on the device).
        t: new tokens per row. columns: key length read (>= max(length) + t).
        new: BoolTensor[B, T, T] or None (causal).
        cached: BoolTensor[B, T, W] or None (all committed entries visible); column c < W is
            storage column c (W = the cache's width).
    Returns:
        BoolTensor[B, 1, T, columns], True = may attend.
    """
    b, dev = length.shape[0], length.device
    rel = torch.arange(columns, device=dev)[None, :] - length[:, None]   # [B, S]: new index j
    relq = rel[:, None, :]                                               # [B, 1, S]
    qi = torch.arange(t, device=dev)[None, :, None]                      # [1, T, 1]
    if new is None and cached is None:
        # committed (j < 0) or causal among the new (0 <= j <= i); sees itself, never empty
        return (relq <= qi)[:, None]
    is_new = (relq >= 0) & (relq < t)
    if new is None:
        see = is_new & (relq <= qi)
    else:
        see = is_new & new.to(torch.bool).gather(
            2, rel.clamp(0, max(t - 1, 0))[:, None, :].expand(b, t, columns))
    committed = relq < 0
    if cached is not None:
        committed = committed & F.pad(cached.to(torch.bool), (0, columns - cached.shape[-1]))
    mask = see | committed                                               # [B, T, S]
    mask = mask | ((relq == qi) & ~mask.any(-1, keepdim=True))
    return mask[:, None]


def plan_decode_attention(length: torch.Tensor, t: int, columns: int, dtype: torch.dtype,
                          group: int, new: torch.Tensor | None = None,
                          cached: torch.Tensor | None = None) -> "AttentionPlan":
    """The attention plan of a KV-cache forward: `decode_mask` as an additive bias in `dtype`
    (0 / -inf), its rows repeated for `group` = H_q / H_kv query heads folded onto each key/value
    head (see `attention`, kind "decode"). Built once per forward, on the device; arguments as
    `decode_mask`. Returns AttentionPlan("decode", mask=FloatTensor[B, 1, group * T, columns])."""
    mask = decode_mask(length, t, columns, new, cached)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias.masked_fill_(~mask, float("-inf"))
    b = mask.shape[0]
    if group > 1:
        bias = bias[:, :, None].expand(b, 1, group, t, columns).reshape(b, 1, group * t, columns)
    return AttentionPlan("decode", mask=bias)


_notified: set[str] = set()


def _notice_once(msg: str) -> None:
    if msg not in _notified:
        _notified.add(msg)
        logging.getLogger("pipeline.model").warning(msg)


@dataclass
class AttentionPlan:
    """How every layer of one forward attends; built once per forward by `plan_attention`.

    Attributes:
        kind: "causal" (plain causal SDPA, no segments), "sdpa" (SDPA with `mask`), "flex"
            (FlexAttention with `block_mask`), "varlen" (flash varlen over `cu_seqlens`) or
            "decode" (a KV-cache forward: SDPA with GQA folded into the query length).
        mask: BoolTensor[B, 1, T, S], True = may attend ("sdpa"); FloatTensor[B, 1, G * T, S]
            additive bias ("decode", `plan_decode_attention`).
        block_mask: `torch.nn.attention.flex_attention.BlockMask` ("flex" only).
        cu_seqlens: IntTensor[N + 1] start offset of each segment in the flattened `[B * T]`
            tokens, then B * T ("varlen" only). max_seqlen: longest segment (tokens).
    """

    kind: str
    mask: torch.Tensor | None = None
    block_mask: object = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0


def resolve_attention(kind: str, device: torch.device, needs_grad: bool,
                      dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel a packed forward uses: "sdpa", "flex" or "varlen".

    "auto" is varlen on CUDA in bf16/fp16, sdpa otherwise. varlen off CUDA or in fp32, and flex
    on the CPU with gradients (no CPU backward in torch 2.13), fall back to sdpa (one notice
    line per process).

    Raises:
        ValueError: `kind` not in `ATTENTION_KINDS`.
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {list(ATTENTION_KINDS)}, got {kind!r}")
    cuda = torch.device(device).type == "cuda"
    half = dtype in (torch.bfloat16, torch.float16)
    if kind == "auto":
        return "varlen" if cuda and half else "sdpa"
    if kind == "varlen" and not (cuda and half):
        _notice_once(f"model.attention=varlen needs CUDA and bf16/fp16 (have {device}, "
                     f"{dtype}); using sdpa")
        return "sdpa"
    if kind == "flex" and not cuda and needs_grad:
        _notice_once("model.attention=flex has no backward on CPU in this torch; training "
                     "forwards use sdpa (no-grad forwards still use flex)")
        return "sdpa"
    return kind


def document_causal_mask_mod(segment_ids: torch.Tensor):
    """FlexAttention `mask_mod` of `build_attention_mask(segment_ids)`'s pattern (segment_ids:
    LongTensor[B, T]), never materialized."""
    def mask_mod(b, h, q, kv):
        sq = segment_ids[b, q]
        return (kv <= q) & (sq == segment_ids[b, kv]) & ((sq != 0) | (q == kv))
    return mask_mod


def dual_mask(segment_ids: torch.Tensor, position_ids: torch.Tensor, copy_id: torch.Tensor,
              clean_limit: torch.Tensor) -> torch.Tensor:
    """The attention pattern of objective mode "dual" rows (docs/METHOD.md "The dual-stream
    arm"), built on the device, so no `[B, T, T]` tensor crosses from the loader: q may see k of
    the same non-padding segment iff k is clean (`copy_id[k] == 0`) with `position_ids[k] <
    clean_limit[q]`, or q is a copy's token and k in the same copy. Padding sees only itself; no
    row is empty.

    Args:
        segment_ids, position_ids, copy_id, clean_limit: LongTensor[B, T] (any signed integer
            dtype) as `pipeline.objective.collate` lays them out (0 at padding).
    Returns:
        BoolTensor[B, 1, T, T], True = may attend.
    """
    # The per-key and per-query conditions are folded into the vectors first (O(B T)), so that
    # only three [B, T, T] comparisons remain: padding queries get clean limit 0 (positions are
    # >= 0) and no copy (-1 matches no key), copy tokens get a position no limit exceeds.
    seg, cid = segment_ids, copy_id
    real = seg != 0
    limit = torch.where(real, clean_limit, torch.zeros_like(clean_limit))
    key_pos = torch.where(cid == 0, position_ids, torch.iinfo(position_ids.dtype).max)
    q_copy = torch.where(real & (cid != 0), cid, torch.full_like(cid, -1))
    mask = key_pos[:, None, :] < limit[:, :, None]        # clean keys before the limit
    mask |= q_copy[:, :, None] == cid[:, None, :]         # the query's own copy
    mask &= seg[:, :, None] == seg[:, None, :]            # same segment
    mask.diagonal(dim1=1, dim2=2).logical_or_(~real)      # padding sees itself
    return mask[:, None]


def dual_mask_mod(segment_ids: torch.Tensor, position_ids: torch.Tensor, copy_id: torch.Tensor,
                  clean_limit: torch.Tensor):
    """FlexAttention `mask_mod` of the pattern of `dual_mask` (same arguments), never
    materialized by us."""
    def mask_mod(b, h, q, kv):
        sq, cq, ck = segment_ids[b, q], copy_id[b, q], copy_id[b, kv]
        see = ((ck == 0) & (position_ids[b, kv] < clean_limit[b, q])) | ((cq != 0) & (cq == ck))
        return ((sq == segment_ids[b, kv]) & (sq != 0) & see) | ((sq == 0) & (q == kv))
    return mask_mod


def varlen_boundaries(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`cu_seqlens` of packed rows for the varlen kernel, with the rows flattened to `[B * T]`.

    A segment starts at each row start and wherever the id changes; every padding token is a
    segment of its own. Each segment must be contiguous in its row. segment_ids: LongTensor[B, T].

    Returns:
        (IntTensor[N + 1] int32 offsets ending with B * T, longest segment in tokens).
    """
    b, t = segment_ids.shape
    flat = segment_ids.reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::t] = True
    start |= flat == 0
    cu = torch.cat((start.nonzero().flatten(), flat.new_tensor([b * t]))).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def plan_attention(kind: str, segment_ids: torch.Tensor, needs_grad: bool,
                   dtype: torch.dtype = torch.bfloat16, cu_seqlens: torch.Tensor | None = None,
                   max_seqlen: int | None = None, dual: tuple | None = None) -> AttentionPlan:
    """Prepare the packed attention of one forward for `kind`: document-causal, or objective
    mode "dual"'s pattern with `dual`.

    Args:
        kind: `ModelConfig.attention`; resolved with `resolve_attention`.
        segment_ids: LongTensor[B, T], 0 = padding, each segment contiguous in its row.
        needs_grad: the forward will be differentiated (picks the CPU fallback of flex).
        dtype: dtype of q, k, v (varlen needs bf16/fp16).
        cu_seqlens, max_seqlen: `varlen_boundaries(segment_ids)` computed beforehand (collate's),
            taken as given by "varlen" (no host sync); other kinds ignore them.
        dual: None, or `(position_ids, copy_id, clean_limit)`, LongTensor[B, T] each on
            `segment_ids`' device: `dual_mask`'s pattern ("flex": `dual_mask_mod`; "varlen" and
            "auto" cannot express it and use "sdpa").
    Returns:
        AttentionPlan: "sdpa" a dense `[B, 1, T, T]` mask, "flex" a BlockMask
        (`_block_mask_builder`), "varlen" the given `cu_seqlens` or new ones (one host sync).
    """
    b, t = segment_ids.shape
    if dual is not None and kind != "flex":
        kind = "sdpa"
    kind = resolve_attention(kind, segment_ids.device, needs_grad, dtype)
    if kind == "flex":
        mod = (document_causal_mask_mod(segment_ids) if dual is None
               else dual_mask_mod(segment_ids, *dual))
        block_mask = _block_mask_builder(segment_ids.device)(mod, b, None, t, t,
                                                             device=segment_ids.device)
        return AttentionPlan("flex", block_mask=block_mask)
    if kind == "varlen":
        if cu_seqlens is not None and max_seqlen is not None:
            return AttentionPlan("varlen", cu_seqlens=cu_seqlens.to(segment_ids.device,
                                                                    torch.int32),
                                 max_seqlen=int(max_seqlen))
        cu, longest = varlen_boundaries(segment_ids)
        return AttentionPlan("varlen", cu_seqlens=cu, max_seqlen=longest)
    if dual is not None:
        return AttentionPlan("sdpa", mask=dual_mask(segment_ids, *dual))
    return AttentionPlan("sdpa", mask=build_attention_mask(segment_ids, b, t,
                                                           device=segment_ids.device))


_compiled_flex = None


_compiled_block_mask = None


def _block_mask_builder(device: torch.device):
    """`create_block_mask`, compiled on CUDA (the FlexAttention docs' advice: no dense
    `[B, 1, T, T]` tensor while building), eager elsewhere."""
    global _compiled_block_mask
    from torch.nn.attention.flex_attention import create_block_mask
    if device.type != "cuda":
        return create_block_mask
    if _compiled_block_mask is None:
        _compiled_block_mask = torch.compile(create_block_mask)
    return _compiled_block_mask


def _flex(q, k, v, block_mask):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if q.device.type == "cuda":
        # Eager FlexAttention materializes the scores; the fused kernel needs torch.compile.
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    import warnings
    with warnings.catch_warnings():  # CPU: the unfused reference is what we want (tests)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


@functools.lru_cache(maxsize=None)
def _varlen_kwargs(varlen_attn) -> dict:
    """Causal (and GQA where supported) keywords for this torch's `varlen_attn` (2.13:
    `window_size=(-1, 0)`, `enable_gqa`; 2.9-2.12: `is_causal`), read once per process."""
    import inspect
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              plan: AttentionPlan) -> torch.Tensor:
    """Scaled dot-product attention (scale 1/sqrt(D)) of one layer, by `plan.kind`.

    Args:
        q: `[B, H_q, T, D]`; k, v: `[B, H_kv, S, D]` (H_q a multiple of H_kv: GQA, query head
            i uses kv head i // (H_q / H_kv), as Qwen3 does). S = T except with a KV cache.
        plan: from `plan_attention` (or built by `Qwen3.forward` for decoding).
    Returns:
        `[B, H_q, T, D]` in q's dtype.
    """
    if plan.kind == "causal":
        # Plain causal: flash attention on GPU handles GQA natively.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if plan.kind == "flex":
        return _flex(q, k, v, plan.block_mask)
    if plan.kind == "decode":
        return _decode_attention(q, k, v, plan.mask)
    if plan.kind == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        b, hq, t, d = q.shape
        kw = _varlen_kwargs(varlen_attn)
        if "enable_gqa" not in kw and hq != k.shape[1]:   # torch < 2.13: no GQA flag
            k = k.repeat_interleave(hq // k.shape[1], dim=1)
            v = v.repeat_interleave(hq // v.shape[1], dim=1)
        flat = lambda x: x.transpose(1, 2).reshape(b * t, x.shape[1], d)  # noqa: E731
        out = varlen_attn(flat(q), flat(k), flat(v), plan.cu_seqlens, plan.cu_seqlens,
                          plan.max_seqlen, plan.max_seqlen, **kw)
        return out.view(b, t, hq, d).transpose(1, 2)
    # "sdpa": with a mask the memory-efficient kernel is the GPU choice, and it does not take
    # GQA: repeat kv heads.
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)


def _decode_backends(device: torch.device):
    """SDPA backends of KV-cache forwards: on CUDA the memory-efficient kernel (math as the
    fallback), not cuDNN, which builds a plan per new key length (the cache grows every step).
    Elsewhere: torch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _decode_attention(q, k, v, bias):
    """GQA without repeating keys/values: the G = H_q / H_kv query heads of each key/value head
    are folded into the query length (`[B, H_kv, G * T, D]`), so every backend reads each cached
    key/value once; `bias` rows are repeated to match (`plan_decode_attention`)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    with _decode_backends(q.device):
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, (hq // hkv) * t, d), k, v,
                                             attn_mask=bias)
    return out.reshape(b, hq, t, d)


def _eye_offset(t: int, s: int, offset: int, device) -> torch.Tensor:
    idx = torch.arange(t, device=device)
    out = torch.zeros(t, s, dtype=torch.bool, device=device)
    out[idx, idx + offset] = True
    return out
