"""FLOPs and parameter counts of a Qwen3 config, and the peak FLOP/s of known devices (for MFU).

Owns: `num_parameters`, `flops_per_token`, `training_flops` (attention per packed segment),
`segment_lengths`, the dense BF16 peak table. Must not touch: the network, the trainer's
clocks (`pipeline.training.metrics` divides these counts by time).
"""
from __future__ import annotations

import torch

from pipeline.model.config import ModelConfig


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
