"""FLOPs and parameter counts of a Qwen3 config, and the peak FLOP/s of known devices (MFU, HFU).

Owns: `num_parameters`, `flops_per_token`, `training_flops` (attention per packed segment),
`step_flops` (model and hardware FLOPs of a training micro-batch: the MFU and HFU numerators),
`segment_lengths`, the dense BF16 peak table. Must not touch: the network, the trainer's
clocks (`pipeline.training.metrics` divides these counts by time).

The accounting, written down once (every count is 2 FLOPs per multiply-add; forward + backward
is 3x the forward, as PaLM appendix B and nanoGPT's `estimate_mfu` count):
- body: `6 * N_body` per token, `N_body` = the weights of all blocks' linear layers (q, k, v, o,
  gate, up, down); norms and the embedding lookup are not matrix multiplies;
- attention: `12 * L * H_q * D` per query-key pair a token attends to (QK^T and AV), counted per
  packed segment and causally (a token at offset i of its segment: i + 1 pairs);
- output layer: `6 * V * h` per position whose logits are computed, which is only the positions
  that carry a label (`pipeline.objective` runs the head there alone), not every token.
MFU (PaLM, Chowdhery et al. 2022, section 4.1 and appendix B) divides these model FLOPs of the
real (non-padding) tokens by time x peak. HFU divides the FLOPs the step's matrix multiplies
execute: the same terms for every fed token (padding included: each padding token is a segment
of its own), plus what is computed twice: activation recompute (`full`: one more forward of every
block, `selective`: one more forward of the attention core, as Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", sections 4-5, count it) and the
output layer's forward again in backward (`loss_impl` "chunked" and "torch"; "fused" computes
its gradients in the forward pass). Masked-out work of a dense-mask kernel (sdpa computes the
whole `T x T` score matrix) is not counted: HFU counts the work the step needs as designed.
"""
from __future__ import annotations

import torch

from pipeline.model.config import ModelConfig, recompute_mode


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


def _body_params(cfg: ModelConfig) -> int:
    """Weights of all blocks' linear layers (the matrix-multiply parameters without the head)."""
    h, d = cfg.hidden_size, cfg.head_dim
    return cfg.num_layers * (h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
                             + 3 * h * cfg.intermediate_size)


def _attention_per_pair(cfg: ModelConfig) -> float:
    """Training FLOPs of attention per query-key pair over all layers (QK^T and AV, x3)."""
    return 12.0 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim


def training_flops(cfg: ModelConfig, segment_lengths: torch.Tensor | list[int],
                   labelled_tokens: int | None = None) -> float:
    """Model FLOPs of one training forward + backward over packed segments (for MFU).

    `6 * N_body * tokens + 6 * V * h * labelled + 12 * L * H_q * D * sum_s s (s + 1) / 2`, with
    `tokens = sum_s s` (the module docstring's accounting): the PaLM appendix B / nanoGPT
    `estimate_mfu` count, except that attention is counted per packed segment and causally (a
    token at offset i of its segment attends to the i + 1 tokens up to itself) instead of the
    full row window of `flops_per_token`, and the output layer only at the `labelled_tokens`
    positions whose logits are computed. Padding is not counted; activation recompute is not
    counted (model FLOPs).

    Args:
        segment_lengths: tokens of each segment (`segment_lengths(segment_ids)`).
        labelled_tokens: positions that carry a label (the output layer runs there only);
            None counts the output layer at every token (as `flops_per_token` does).
    Returns:
        FLOPs (float).
    """
    s = torch.as_tensor(segment_lengths, dtype=torch.float64)
    tokens, pairs = float(s.sum()), float((s * (s + 1) / 2).sum())
    head_rows = tokens if labelled_tokens is None else float(labelled_tokens)
    return (6.0 * _body_params(cfg) * tokens + 6.0 * cfg.vocab_size * cfg.hidden_size * head_rows
            + _attention_per_pair(cfg) * pairs)


def step_flops(cfg: ModelConfig, segment_lengths: torch.Tensor | list[int],
               labelled_tokens: int, padding_tokens: int = 0, recompute="none",
               loss_impl: str = "chunked") -> tuple[float, float]:
    """Model and hardware FLOPs of one training micro-batch (the MFU and HFU numerators).

    Model FLOPs: `training_flops(cfg, segment_lengths, labelled_tokens)`. Hardware FLOPs (module
    docstring): the same over every fed token, `padding_tokens` included (each a one-token
    segment), plus the recomputed forwards: `recompute` "full" adds
    `2 * N_body + 4 * L * H_q * D * pairs` (one forward of every block), "selective" adds
    `4 * L * H_q * D * pairs` (one forward of the attention core), "none" nothing; `loss_impl`
    "chunked" and "torch" add `2 * V * h * labelled` (the head's forward again in backward),
    "fused" nothing.

    Args:
        segment_lengths: tokens of each real segment (LongTensor[N] or list; padding left out).
        labelled_tokens: positions with a label (the output layer's rows).
        padding_tokens: fed padding tokens (rows x row length - real tokens).
        recompute: activation checkpointing mode ("none" | "selective" | "full", or the bool
            alias of `ModelConfig.recompute`).
        loss_impl: "chunked" | "fused" | "torch" (`pipeline.model.linear_ce.LOSS_IMPLS`).
    Returns:
        (model FLOPs, hardware FLOPs), floats.
    Raises:
        ValueError: unknown `recompute` or `loss_impl`.
    """
    mode = recompute_mode(recompute)
    if loss_impl not in ("chunked", "fused", "torch"):
        raise ValueError(f"loss_impl must be chunked, fused or torch, got {loss_impl!r}")
    s = torch.as_tensor(segment_lengths, dtype=torch.float64)
    tokens, pairs = float(s.sum()), float((s * (s + 1) / 2).sum())
    model = training_flops(cfg, s, labelled_tokens)
    fed, fed_pairs = tokens + padding_tokens, pairs + padding_tokens
    head = 2.0 * cfg.vocab_size * cfg.hidden_size * labelled_tokens     # one head forward
    attn_fwd = _attention_per_pair(cfg) / 3 * fed_pairs                 # one attention forward
    hardware = (6.0 * _body_params(cfg) * fed + 3 * head + 3 * attn_fwd)
    if mode == "full":
        hardware += 2.0 * _body_params(cfg) * fed + attn_fwd
    elif mode == "selective":
        hardware += attn_fwd
    if loss_impl != "fused":
        hardware += head
    return model, hardware


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
