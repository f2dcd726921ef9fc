"""Qwen3 as ReFusion trains it: megatron-core tensor-parallel layers, explicit position ids,
packed-sequence masks, a reorderable KV cache, and FLOPs per token.

Owns: the network definition (`ModelConfig`, `Qwen3`), attention-mask building, the KV cache used
by decoding, the attention kernels (`attention`, chosen by `ModelConfig.attention`), parameter
counts, FLOPs per token and per packed batch, and the peak FLOP/s of known devices (for MFU).
Must not touch: the ReFusion objective (lives in `pipeline.objective`), checkpoint formats and
Hugging Face names (`pipeline.hf_io`), process-group creation (`pipeline.parallel`),
optimizers.

The definition reads like a single-device Qwen3 (Qwen3 technical report; transformers'
`Qwen3ForCausalLM` is the reference it is tested against): token embedding -> N x [RMSNorm ->
GQA attention with per-head RMSNorm on q and k and RoPE -> residual -> RMSNorm -> SwiGLU MLP ->
residual] -> RMSNorm -> LM head. Only the linear layers and the embedding are megatron-core
tensor-parallel layers, so TP=1 and TP>1 share one code path:
- `qkv_proj`: ColumnParallelLinear; rank r holds its q heads, then its k heads, then its v heads
  (`[q_r; k_r; v_r]` along the output dim), so each rank attends over its own heads;
- `o_proj`, `down_proj`: RowParallelLinear (input is parallel, output all-reduced);
- `gate_up_proj`: ColumnParallelLinear holding `[gate_r; up_r]`;
- `embed_tokens`: VocabParallelEmbedding; `lm_head`: ColumnParallelLinear over the vocab (or the
  embedding weight when tied); logits stay vocab-parallel (`[B, T, V / tp]`), see `gather_logits`.
CPU-safe megatron flags (../shared/FINDINGS.md): use_cpu_initialization=True,
gradient_accumulation_fusion=False, gather_output=False, no sequence parallelism.

Tensors are batch-first: `[B, T, hidden]`.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

ATTENTION_KINDS = ("auto", "sdpa", "flex", "varlen")

@dataclass
class ModelConfig:
    """Shape of a Qwen3 network (field names as in Qwen3's config.json where they exist).

    Attributes:
        vocab_size: embedding rows (tokens); must be a multiple of the tensor-parallel size.
        hidden_size: model width.
        intermediate_size: SwiGLU inner width.
        num_layers: transformer blocks (`num_hidden_layers` in config.json).
        num_attention_heads / num_key_value_heads: query heads / key-value heads (GQA); both
            must be multiples of the tensor-parallel size.
        head_dim: width of one head (Qwen3: 128, not hidden/heads).
        rope_theta: RoPE base.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: LM head shares the embedding weight.
        max_position_embeddings: largest position id + 1 the model is meant for (informational:
            RoPE is computed on the fly).
        recompute: activation checkpointing of every block during training.
        attention: attention kernel of packed training/evaluation forwards (segment ids, no
            KV cache), one of `ATTENTION_KINDS`: "sdpa" (explicit dense mask, the reference),
            "flex" (FlexAttention with a document-causal block mask), "varlen" (flash
            varlen kernel, CUDA and bf16/fp16 only), "auto" (varlen on CUDA in bf16/fp16, sdpa
            elsewhere). Decoding (KV cache or explicit masks) always uses SDPA. See
            `resolve_attention` for the fallbacks.
        init_std: std of the normal init of linear/embedding weights (residual output
            projections use init_std / sqrt(2 * num_layers), GPT-2 style).
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    recompute: bool = False
    attention: str = "auto"
    init_std: float = 0.02

    def validate(self, tp_size: int = 1, source: str = "model config") -> None:
        """Check sizes against each other and the tensor-parallel size.

        Raises:
            ValueError: one line naming `source` and the offending field.
        """
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{source}: {f} must be > 0, got {getattr(self, f)}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"{source}: attention must be one of {list(ATTENTION_KINDS)}, "
                             f"got {self.attention!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{source}: num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads}")
        for f in ("vocab_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size"):
            if getattr(self, f) % tp_size:
                raise ValueError(f"{source}: {f} {getattr(self, f)} is not a multiple of the "
                                 f"tensor-parallel size {tp_size}")

    @classmethod
    def from_dict(cls, d: dict, source: str = "model config") -> "ModelConfig":
        """Build from a plain dict; unknown keys raise ValueError naming `source` and the key."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown model config key(s) {unknown}; "
                             f"known: {sorted(names)}")
        cfg = cls(**d)
        cfg.validate(source=source)
        return cfg

    @classmethod
    def from_yaml(cls, path) -> "ModelConfig":
        """Read a preset (`configs/model/*.yaml`, a flat mapping of the fields above).

        Raises:
            ValueError: the file is not a mapping, or has an unknown key / bad value.
            FileNotFoundError: no such file.
        """
        import yaml
        path = Path(path)
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of model config fields")
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return asdict(self)


def num_parameters(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count of the full (unsharded) model.

    Args:
        include_embedding: count the input embedding (and, when tied, the shared head) too.
    Returns:
        number of parameters (Qwen3-8B: 8,190,735,360).
    """
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2) + 2 * d
    mlp = 3 * h * cfg.intermediate_size
    per_layer = attn + mlp + 2 * h
    n = cfg.num_layers * per_layer + h  # + final norm
    if include_embedding:
        n += cfg.vocab_size * h
    if not cfg.tie_word_embeddings:
        n += cfg.vocab_size * h
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B / nanoGPT `estimate_mfu`.

    `6 * N + 12 * L * H_q * D * seq_len`, where N counts the weights that take part in matrix
    multiplies (all blocks' linear layers and the LM head; not the embedding lookup or norms)
    and the second term is attention scores and values (QK^T and AV: 2 matmuls x 2 FLOPs per
    multiply-add x 3 for forward + backward), counted over the full `seq_len` window (no causal
    halving, as PaLM and nanoGPT do). Activation recompute is not counted (model FLOPs, for MFU).
    The trainer's MFU uses `training_flops` instead (attention per packed segment, causal).

    Args:
        seq_len: tokens per sequence (the attention window), e.g. the packed row length.
    Returns:
        FLOPs per token (float).
    """
    h, d = cfg.hidden_size, cfg.head_dim
    matmul_params = cfg.num_layers * (
        h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
        + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * d * seq_len
    return float(6 * matmul_params + attention)


def segment_lengths(segment_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the packed segments of a micro-batch, padding (segment 0) left out.

    Args:
        segment_ids: LongTensor[B, T] as `collate` builds them (segments numbered 1, 2, ... per
            row, each contiguous).
    Returns:
        LongTensor[N] tokens per segment, row-major.
    """
    seg = segment_ids.detach().to("cpu", torch.long)
    base = (seg.max() + 1) if seg.numel() else 1
    key = (torch.arange(seg.shape[0])[:, None] * base + seg)[seg > 0]
    return torch.unique(key, return_counts=True)[1] if key.numel() else key


def training_flops(cfg: ModelConfig, segment_lengths: torch.Tensor | list[int]) -> float:
    """Model FLOPs of one training forward + backward over packed segments (for MFU).

    `6 * N * tokens + 12 * L * H_q * D * sum_s s (s + 1) / 2`, with `tokens = sum_s s`: the
    PaLM appendix B / nanoGPT `estimate_mfu` count (N as in `flops_per_token`: weights in matrix
    multiplies, 2 FLOPs per multiply-add, x3 for forward + backward), except that attention is
    counted per packed segment and causally: a token at offset i of its segment attends to the
    i + 1 tokens up to itself (QK^T and AV: 2 matmuls x 2 FLOPs x D per query-key pair per head
    per layer, x3), instead of the full row window of `flops_per_token`. Padding is not counted;
    activation recompute is not counted (model FLOPs).

    Args:
        segment_lengths: tokens of each segment (`segment_lengths(segment_ids)`).
    Returns:
        FLOPs (float).
    """
    s = torch.as_tensor(segment_lengths, dtype=torch.float64)
    tokens, pairs = float(s.sum()), float((s * (s + 1) / 2).sum())
    dense = flops_per_token(cfg, 0) * tokens
    return dense + 12.0 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim * pairs


# Dense (no sparsity) BF16 tensor-core peak of one device in TFLOP/s, from the vendor
# datasheets (NVIDIA H100, H200, A100, GH200, B200, L40S product datasheets: half the
# "with sparsity" figure). First row whose substrings all occur in the lower-cased
# `torch.cuda.get_device_name()` wins, so variants come before their family. PCIe and NVL
# parts run at lower clocks/power than SXM and have their own rows; an H100 whose name names no
# variant is unknown (None), not guessed.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h100", "pcie"), 756.5),
    (("h100", "nvl"), 835.5),
    (("h100", "sxm"), 989.5),
    (("h100", "hbm3"), 989.5),      # "NVIDIA H100 80GB HBM3": the SXM5 board
    (("gh200",), 989.5),
    (("h200", "nvl"), 835.5),
    (("h200",), 989.5),             # "NVIDIA H200": SXM
    (("h800", "pcie"), 756.5),
    (("h800",), 989.5),
    (("a100",), 312.0),             # SXM4 and PCIe share the datasheet peak
    (("a800",), 312.0),
    (("b200",), 2250.0),
    (("l40s",), 362.05),
)


def peak_tflops_of_device(name: str) -> float | None:
    """Dense BF16 peak TFLOP/s of a device by its name (`torch.cuda.get_device_name()`), from
    `PEAK_BF16_TFLOPS`; None when the name matches no row (then MFU is not reported unless
    `log.peak_tflops` gives the figure)."""
    low = name.lower()
    for keys, tflops in PEAK_BF16_TFLOPS:
        if all(k in low for k in keys):
            return tflops
    return None


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------

def _tp_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_world_size()


def _megatron_config(dtype: torch.dtype, init_weights: bool):
    from megatron.core import ModelParallelConfig
    return ModelParallelConfig(
        tensor_model_parallel_size=_tp_size(),
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=init_weights,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as Qwen3 computes it: in fp32, then cast back, then scale.

    `y = weight * (x / sqrt(mean(x^2, -1) + eps)).to(x.dtype)`; x: `[..., dim]`.

    With `reduce_grad_over_tp=True` (q/k norms: each TP rank normalizes only its own heads) the
    weight enters through megatron's `copy_to_tensor_model_parallel_region`, so its gradient is
    all-reduced over the TP group and every rank holds the full gradient of this replicated
    weight (Megatron does the same for QK-layernorm grads).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32,
                 reduce_grad_over_tp: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.reduce_grad_over_tp = reduce_grad_over_tp and _tp_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.reduce_grad_over_tp:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
            weight = copy_to_tensor_model_parallel_region(weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (Su et al. 2021, "rotate half" layout as in Qwen/Llama) for explicit positions.

    Args:
        position_ids: LongTensor[B, T], original (natural-order) position of each fed token.
    Returns:
        cos, sin: `[B, 1, T, head_dim]` in `dtype` (computed in fp32).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [B, H, T, D]` by the tables from `rope_cos_sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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


# --------------------------------------------------------------------------------------------
# Attention kernels (one function, chosen by `ModelConfig.attention`)
# --------------------------------------------------------------------------------------------

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
            (FlexAttention with `block_mask`) or "varlen" (flash varlen over `cu_seqlens`).
        mask: BoolTensor[B, 1, T, S], True = may attend ("sdpa" only).
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

    "auto" is varlen on CUDA in bf16/fp16, sdpa otherwise. varlen off CUDA or in fp32 (the
    flash kernel takes half precision only), and flex on CPU when gradients are needed (torch
    2.13 has no FlexAttention backward on CPU), fall back to sdpa with one notice line per
    process.

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
    """FlexAttention `mask_mod` of packed rows: query q may see key kv of the same row iff they
    are in the same segment and kv <= q (causal over the fed order); padding (segment 0)
    sees only itself. Same pattern as `build_attention_mask(segment_ids, ...)`, never
    materialized. segment_ids: LongTensor[B, T]."""
    def mask_mod(b, h, q, kv):
        sq = segment_ids[b, q]
        return (kv <= q) & (sq == segment_ids[b, kv]) & ((sq != 0) | (q == kv))
    return mask_mod


def varlen_boundaries(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`cu_seqlens` of packed rows for the varlen kernel, with the rows flattened to `[B * T]`.

    A segment starts at each row start and wherever the segment id changes; every padding token
    (segment 0) is a segment of its own (so it sees only itself, as in `build_attention_mask`).
    Assumes (as `collate` guarantees) that each segment is contiguous in its row.

    Args:
        segment_ids: LongTensor[B, T].
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
                   dtype: torch.dtype = torch.bfloat16) -> AttentionPlan:
    """Prepare the packed (document-causal) attention of one forward for `kind`.

    Args:
        kind: `ModelConfig.attention`; resolved with `resolve_attention`.
        segment_ids: LongTensor[B, T], 0 = padding, each segment contiguous in its row.
        needs_grad: the forward will be differentiated (picks the CPU fallback of flex).
        dtype: dtype of q, k, v (varlen needs bf16/fp16).
    Returns:
        AttentionPlan. Only "sdpa" builds our dense `[B, 1, T, T]` mask; "flex" builds a
        BlockMask from `document_causal_mask_mod` (`_block_mask_builder`: compiled on CUDA;
        the eager builder used on CPU evaluates the mask densely inside torch); "varlen" builds
        `cu_seqlens` (one host sync for the longest segment).
    """
    b, t = segment_ids.shape
    kind = resolve_attention(kind, segment_ids.device, needs_grad, dtype)
    if kind == "flex":
        block_mask = _block_mask_builder(segment_ids.device)(
            document_causal_mask_mod(segment_ids), b, None, t, t, device=segment_ids.device)
        return AttentionPlan("flex", block_mask=block_mask)
    if kind == "varlen":
        cu, longest = varlen_boundaries(segment_ids)
        return AttentionPlan("varlen", cu_seqlens=cu, max_seqlen=longest)
    return AttentionPlan("sdpa", mask=build_attention_mask(segment_ids, b, t,
                                                           device=segment_ids.device))


_compiled_flex = None
_compiled_block_mask = None


def _block_mask_builder(device: torch.device):
    """`create_block_mask`, compiled on CUDA (as the FlexAttention docs advise: the compiled
    builder fuses evaluating `mask_mod` with the per-block reduction, instead of the eager
    builder's full `[B, 1, T, T]` boolean tensor); eager elsewhere (CPU tests)."""
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
    """Causal (and GQA where supported) keywords for this torch's `varlen_attn`: torch 2.13
    takes `window_size=(-1, 0)` and `enable_gqa`; 2.9-2.12 take `is_causal` and no GQA flag
    (measured on torch 2.11 on an H200, bench/gpu_check.sh). Cached: read once per process,
    not per layer and forward."""
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


class Attention(nn.Module):
    """GQA self-attention with QK-norm and RoPE; heads split over the tensor-parallel group."""

    def __init__(self, cfg: ModelConfig, mcfg, init_method, out_init_method):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        tp = _tp_size()
        self.head_dim = cfg.head_dim
        self.n_q = cfg.num_attention_heads // tp      # local query heads
        self.n_kv = cfg.num_key_value_heads // tp     # local key/value heads
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d,
            config=mcfg, init_method=init_method, bias=False, gather_output=False)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, config=mcfg,
            init_method=out_init_method, bias=False, input_is_parallel=True, skip_bias_add=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, mcfg.params_dtype, reduce_grad_over_tp=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, mcfg.params_dtype, reduce_grad_over_tp=True)

    def forward(self, x, cos, sin, plan, cache_layer=None):
        """x: `[B, T, hidden]`; plan: an `AttentionPlan` (for "sdpa" its mask is `[B, 1, T, S]`);
        cache_layer: `(past_k, past_v, store)` where past_*: `[B, H_kv/tp, S - T, D]` and
        `store(k, v)` keeps the new keys/values as the cache's pending entries."""
        b, t, _ = x.shape
        d = self.head_dim
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split((self.n_q * d, self.n_kv * d, self.n_kv * d), dim=-1)
        q = self.q_norm(q.view(b, t, self.n_q, d)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.n_kv, d)).transpose(1, 2)
        v = v.view(b, t, self.n_kv, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache_layer is not None:
            past_k, past_v, store = cache_layer
            store(k, v)
            k = torch.cat((past_k, k), dim=2)
            v = torch.cat((past_v, v), dim=2)
        out = attention(q, k, v, plan)
        out = out.transpose(1, 2).reshape(b, t, self.n_q * d)
        out, _ = self.o_proj(out)
        return out


class MLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): `down(silu(gate(x)) * up(x))`, inner dim split over TP."""

    def __init__(self, cfg: ModelConfig, mcfg, init_method, out_init_method):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.inner = cfg.intermediate_size // _tp_size()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, 2 * cfg.intermediate_size, config=mcfg, init_method=init_method,
            bias=False, gather_output=False)
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, config=mcfg, init_method=out_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.split(self.inner, dim=-1)
        out, _ = self.down_proj(F.silu(gate) * up)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: ModelConfig, mcfg, init_method, out_init_method):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, mcfg.params_dtype)
        self.self_attn = Attention(cfg, mcfg, init_method, out_init_method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                mcfg.params_dtype)
        self.mlp = MLP(cfg, mcfg, init_method, out_init_method)

    def forward(self, x, cos, sin, plan, cache_layer=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, cache_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------

class KVCache:
    """Per-layer keys/values of committed tokens, with room to append reordered entries.

    Layout: `keys[l], values[l]: [B, H_kv/tp, capacity, D]`; row b holds `length[b]` valid
    entries at the front (entries past `length[b]` are masked out of attention). Keys are stored
    after RoPE, so an entry carries its own original position and entries may sit in any order.

    Protocol (plan-and-infill): a forward with `kv_cache=cache` attends over the committed
    entries plus the new tokens and leaves the new keys/values *pending* (`[B, H, T, D]` per
    layer), without committing them. Then `commit(index)` appends the chosen pending entries
    (e.g. finished slots, ahead of remaining masks) in the given order; `discard_pending()` drops
    them; a second forward replaces them. `truncate(length)` shortens rows.

    Attributes:
        length: LongTensor[B], valid entries per row.
        width: int, the number of leading cache columns a forward attends over
            (= max(length) after commit/truncate); an explicit `attention_mask` passed to
            `Qwen3.forward` must have `S = width + T` columns.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        """Allocate an empty cache.

        Args:
            num_kv_heads: key/value heads on this tensor-parallel rank (H_kv / tp).
            capacity: most entries a row can hold (tokens).
        """
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.width = 0
        self.capacity = capacity
        self.pending_keys: list[torch.Tensor | None] = [None] * num_layers
        self.pending_values: list[torch.Tensor | None] = [None] * num_layers

    @classmethod
    def for_model(cls, model: "Qwen3", batch_size: int, capacity: int) -> "KVCache":
        """A cache shaped for `model` on this TP rank, in the model's dtype and device."""
        p = next(model.parameters())
        return cls(model.cfg.num_layers, batch_size, model.cfg.num_key_value_heads // model.tp,
                   model.cfg.head_dim, capacity, p.dtype, p.device)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]

    @property
    def num_pending(self) -> int:
        """New tokens from the last forward that are neither committed nor discarded (T or 0)."""
        pk = self.pending_keys[0]
        return 0 if pk is None else pk.shape[2]

    def valid_mask(self) -> torch.Tensor:
        """BoolTensor[B, width]: which of the leading `width` columns hold a valid entry."""
        return torch.arange(self.width, device=self.length.device)[None] < self.length[:, None]

    def layer_view(self, layer: int):
        """`(past_k, past_v, store)` for `Attention.forward`; past_*: `[B, H, width, D]`."""
        def store(k, v):
            self.pending_keys[layer] = k
            self.pending_values[layer] = v
        return (self.keys[layer][:, :, :self.width], self.values[layer][:, :, :self.width],
                store)

    def commit(self, index: torch.Tensor | None = None) -> None:
        """Append pending entries to the cache, then drop the rest of the pending entries.

        Args:
            index: LongTensor[B, N] of pending positions (0..T-1) to append to each row, in
                this order; entries < 0 are skipped (rows may append different counts).
                None appends all T pending entries in fed order.
        Raises:
            RuntimeError: nothing pending. ValueError: a row would exceed `capacity`, or `index`
            has the wrong batch size or an entry >= T.
        """
        if self.pending_keys[0] is None:
            raise RuntimeError("KVCache.commit: no pending entries (run a forward first)")
        b, h, t, d = self.pending_keys[0].shape
        dev = self.length.device
        if index is None:
            index = torch.arange(t, device=dev)[None].expand(b, t)
        index = index.to(dev)
        if index.shape[0] != b or (index.numel() and int(index.max()) >= t):
            raise ValueError(f"KVCache.commit: index {tuple(index.shape)} must be [B={b}, N] "
                             f"with entries < {t} (the pending tokens)")
        valid = index >= 0
        counts = valid.sum(1)
        new_len = self.length + counts
        max_len = int(new_len.max()) if b else 0
        if max_len > self.capacity:
            raise ValueError(f"KVCache.commit: {max_len} entries exceed capacity "
                             f"{self.capacity}")
        # Destination column of each kept entry: after the row's valid entries, in index order.
        dest = self.length[:, None] + valid.cumsum(1) - 1                    # [B, N]
        rows = torch.arange(b, device=dev)[:, None].expand_as(index)
        src = index.clamp(min=0)
        rows, dest, src = rows[valid], dest[valid], src[valid]              # [K]
        for layer in range(len(self.keys)):
            for store, pend in ((self.keys, self.pending_keys),
                                (self.values, self.pending_values)):
                # store[layer][rows, :, dest] has shape [K, H, D]
                store[layer][rows, :, dest] = pend[layer][rows, :, src].to(store[layer].dtype)
        self.length = new_len
        self.width = max_len
        self.discard_pending()

    def truncate(self, length: torch.Tensor | int) -> None:
        """Keep only the first `length` entries of each row (LongTensor[B] or int); never grows."""
        if not torch.is_tensor(length):
            length = torch.full_like(self.length, int(length))
        self.length = torch.minimum(self.length, length.to(self.length.device))
        self.width = int(self.length.max()) if self.batch_size else 0

    def discard_pending(self) -> None:
        """Forget the keys/values of the last forward's new tokens."""
        n = len(self.keys)
        self.pending_keys = [None] * n
        self.pending_values = [None] * n

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) batch rows: `rows: LongTensor[B']` (e.g. drop finished requests)."""
        rows = rows.to(self.length.device)
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.length = self.length[rows]
        self.width = int(self.length.max()) if len(rows) else 0
        self.discard_pending()


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

class Qwen3(nn.Module):
    """Qwen3 causal LM with megatron-core tensor-parallel layers.

    Needs megatron-core `parallel_state` initialized (`pipeline.parallel.init_distributed`;
    TP=1 is fine). Parameter names (native): `embed_tokens.weight`,
    `layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
    `layers.{i}.self_attn.{qkv_proj,o_proj,q_norm,k_norm}.weight`,
    `layers.{i}.mlp.{gate_up_proj,down_proj}.weight`, `norm.weight`, `lm_head.weight` (when
    tied, the head holds the embedding Parameter itself: `named_parameters()` lists it once as
    `embed_tokens.weight`, `state_dict()` has both keys). `pipeline.hf_io` maps them to and from Hugging Face names.

    Args:
        cfg: network shape; validated against the TP size (ValueError).
        dtype: parameter dtype.
        init_weights: random init (normal, std `cfg.init_std`); False leaves weights
            uninitialized (fast; for loading a checkpoint or building on the meta device).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 init_weights: bool = True):
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
        super().__init__()
        self.tp = _tp_size()
        cfg.validate(self.tp)
        self.cfg = cfg
        mcfg = _megatron_config(dtype, init_weights)
        init = partial(nn.init.normal_, mean=0.0, std=cfg.init_std)
        out_init = partial(nn.init.normal_, mean=0.0,
                           std=cfg.init_std / math.sqrt(2.0 * cfg.num_layers))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   init_method=init, config=mcfg)
        self.layers = nn.ModuleList(Block(cfg, mcfg, init, out_init)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, config=mcfg, init_method=init, bias=False,
            gather_output=False, skip_weight_param_allocation=cfg.tie_word_embeddings)
        if cfg.tie_word_embeddings:
            # The same Parameter registered in both modules (as transformers ties): ZeRO-3
            # then gathers it for the head's forward too. named_parameters() lists it once,
            # as `embed_tokens.weight`; vocab partitions of the two layers coincide.
            self.lm_head.weight = self.embed_tokens.weight
        self._mark_tensor_parallel()

    def _mark_tensor_parallel(self) -> None:
        """Give every TP-partitioned weight megatron-core's attributes (`tensor_model_parallel`,
        `partition_dim`, `partition_stride`) whether or not megatron initialized it.

        megatron-core sets them only inside its weight initialization (skipped with
        `init_weights=False`); DeepSpeed's gradient norm (clipping) counts a parameter without
        them on TP rank 0 only, which silently leaves the other ranks' shards out of the norm.
        Column-parallel and embedding weights split dim 0, row-parallel weights dim 1.
        """
        from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelEmbedding)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            w = getattr(module, "weight", None)
            if w is not None and not getattr(w, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(w, True, dim, 1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, return_hidden: bool = False) -> torch.Tensor:
        """Vocab-parallel logits of the fed tokens (or the final hidden states).

        Args:
            input_ids: LongTensor[B, T], tokens in fed order.
            position_ids: LongTensor[B, T], original position of each token (drives RoPE).
            segment_ids: LongTensor[B, T] or None; packed segments (attend causally within the
                own segment only; 0 = padding, attends only to itself).
            attention_mask: BoolTensor[B, 1, T, S] or None, True = may attend, with
                `S = kv_cache.width + T` (`T` without a cache). Takes precedence over
                `segment_ids`. Cache columns past a row's `length` are masked out regardless.
                A query row with no True entry is allowed to attend to itself (no NaN).
            kv_cache: KVCache or None. With a cache, attention covers the valid cached entries
                plus the new tokens, and the new keys/values become the cache's pending entries
                (see `KVCache.commit`). Without a mask the new tokens are causal among
                themselves and see all valid cached entries.
            return_hidden: return the final-norm hidden states instead of logits, so that the
                caller applies the output layer (`head_logits`) only where it needs logits
                (e.g. chunked over labelled tokens, `pipeline.objective.hybrid_loss`).
        Packed forwards (`segment_ids`, no mask, no cache) attend with the kernel of
        `cfg.attention` (see `plan_attention`); the others use SDPA.
        Returns:
            FloatTensor[B, T, V / tp] in the parameter dtype: this rank's vocab slice of the
            logits (`gather_logits` for all of them); with `return_hidden`,
            FloatTensor[B, T, hidden].
        """
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        past = kv_cache.width if kv_cache is not None else 0
        plan = AttentionPlan("causal")
        if attention_mask is not None:
            if attention_mask.shape[-2:] != (t, past + t):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"expected [B, 1, {t}, {past + t}]")
            mask = attention_mask.to(torch.bool)
            if past:
                mask = mask & torch.cat(
                    (kv_cache.valid_mask()[:, None, None, :],
                     mask.new_ones(kv_cache.batch_size, 1, 1, t)), dim=-1)
            # A row with nothing to attend to would give NaN: let it see itself.
            empty = ~mask.any(-1, keepdim=True)                                # [B, 1, T, 1]
            diag = _eye_offset(t, past + t, past, mask.device)
            plan = AttentionPlan("sdpa", mask=mask | (empty & diag))
        elif past:
            plan = AttentionPlan("sdpa", mask=build_attention_mask(
                segment_ids, b, t, past, kv_cache.valid_mask(), device=input_ids.device))
        elif segment_ids is not None:
            plan = plan_attention(self.cfg.attention, segment_ids,
                                  needs_grad=torch.is_grad_enabled(), dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            cache_layer = kv_cache.layer_view(i) if kv_cache is not None else None
            if self.cfg.recompute and self.training and kv_cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, plan,
                                                      use_reentrant=False)
            else:
                x = layer(x, cos, sin, plan, cache_layer)
        x = self.norm(x)
        return x if return_hidden else self.head_logits(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer: `hidden: FloatTensor[..., hidden]` (after the final norm, as
        `forward(..., return_hidden=True)` returns it) -> this rank's vocab slice of the logits
        `FloatTensor[..., V / tp]`, in the parameter dtype."""
        logits, _ = self.lm_head(hidden)
        return logits


def _eye_offset(t: int, s: int, offset: int, device) -> torch.Tensor:
    idx = torch.arange(t, device=device)
    out = torch.zeros(t, s, dtype=torch.bool, device=device)
    out[idx, idx + offset] = True
    return out


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim over the TP group; backward keeps this rank's slice.

    (megatron-core's `gather_from_tensor_model_parallel_region` allocates on CUDA, so it cannot
    run on CPU; this is the same operation with torch.distributed directly.) The backward
    assumes, as Megatron's does, that every TP rank computes the same function of the gathered
    tensor.
    """

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.size = x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.size, ctx.size).contiguous(), None


def gather_logits(shard: torch.Tensor) -> torch.Tensor:
    """All-gather vocab-parallel logits over the tensor-parallel group (differentiable).

    Args:
        shard: FloatTensor[B, T, V / tp] from `Qwen3.forward`.
    Returns:
        FloatTensor[B, T, V], vocab slices concatenated in TP-rank order. The backward gives
        each rank the gradient of its own slice (every TP rank must compute the same loss).
    """
    from megatron.core import parallel_state
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return shard
    return _GatherLastDim.apply(shard, parallel_state.get_tensor_model_parallel_group())
