"""The output layer fused with the cross-entropy: `linear_cross_entropy` (weighted, chunked,
vocab-parallel), for the training loss.

Owns: the kernels that take final hidden states of the labelled positions, the output-layer
weight, the targets and one loss coefficient per position, and return the weighted loss without
keeping `[N, V / tp]` logits alive: "fused" (ours, any tensor-parallel size) and "torch" (torch's
`torch.nn.functional.linear_cross_entropy`, TP=1). Which positions and which coefficients is the
objective's business (`pipeline.objective.hybrid_loss`); the model calls this from its output
layer (`pipeline.model.qwen3.OutputLayer`, so that ZeRO-3 gathers the weight). Must not touch:
labels, the ReFusion weights' meaning, process-group creation.

The loss is `sum_i coef_i * CE_i` with `CE_i = logsumexp_v(logit_iv) - logit_i,target_i` in fp32
(logits = `hidden_i @ weight.T`, computed in the weight's dtype), so any per-token weighting (AR
mean: 1 / AR tokens; MDM: 1 / (p n_r B)) is exact, not an approximation.

"fused" (what Liger-Kernel's and torch's chunked scalar-reduction paths do, with per-token
coefficients and the vocab split over the tensor-parallel group): for each chunk of
`chunk_tokens` rows, in the forward pass,
  1. `logits = h_c @ W_r.T` (this rank's vocab rows, weight dtype);
  2. row max, sum of `exp(logit - max)` and the target's logit, each all-reduced over the TP
     group (as megatron-core's `vocab_parallel_cross_entropy` does), with the fp32 math done over
     column blocks of at most `_BLOCK_ELEMENTS` elements, so no fp32 copy of the chunk's logits
     exists (the one the "chunked" path makes, 1.2 GB for 2048 tokens x 151936 rows);
  3. the gradient of the weighted loss with respect to the logits, `coef * (softmax - onehot)`,
     written over the logits buffer, then `grad_h_c = G @ W_r` and `grad_W_r += G.T @ h_c`.
The backward pass only scales the stored gradients by the incoming scalar gradient: the output
layer's matrix multiply runs 3 times (forward, two gradient products) instead of 4 (the
"chunked" path recomputes each chunk's forward in backward). Cost: the weight-sized gradient
buffer (`V / tp x h` in the weight's dtype) and `grad_h` (`N x h`) live from the loss's forward
to its backward. `grad_h` is all-reduced over the TP group (the input of a column-parallel layer
is replicated; megatron's ColumnParallelLinear all-reduces its input gradient the same way).

"torch": `torch.nn.functional.linear_cross_entropy(..., reduction="none",
options=LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens))` (torch >= 2.13; TP=1 only;
its backward recomputes each chunk; it returns each position's CE in the input dtype, so in bf16
the loss carries bf16 rounding that "fused" and "chunked" do not). Liger-Kernel's fused linear cross-entropy is not offered:
its backward assumes a scalar loss (no per-token weights); cut-cross-entropy takes per-token
gradients but is CUDA/Triton only and not a dependency.
"""
from __future__ import annotations

import torch

LOSS_IMPLS = ("chunked", "fused", "torch")

# Largest fp32 temporary of the fused path, in elements (128 MiB): the column block of a chunk's
# logits that is upcast at a time (2048 rows x 16384 columns; 10 blocks for Qwen3's vocab at
# TP=1). Larger blocks mean fewer, larger kernels; smaller ones less transient memory.
_BLOCK_ELEMENTS = 1 << 25


def torch_linear_ce_available() -> bool:
    """Whether this torch has `torch.nn.functional.linear_cross_entropy` with chunking options
    (torch >= 2.13)."""
    import torch.nn.functional as F
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


class _FusedLinearCE(torch.autograd.Function):
    """forward(hidden [N, h], weight [Vr, h], target [N], coef [N] fp32, chunk, vocab_start,
    group) -> (loss [], ce [N] fp32); the gradients are computed in forward (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, coef, chunk_tokens, vocab_start, group):
        import torch.distributed as dist
        n, vr = hidden.shape[0], weight.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_w = torch.zeros_like(weight) if need_grad else None
        block = max(1, min(vr, _BLOCK_ELEMENTS // max(1, min(chunk_tokens, n))))
        for s in range(0, n, chunk_tokens):
            h, t, c = hidden[s:s + chunk_tokens], target[s:s + chunk_tokens], coef[s:s + chunk_tokens]
            logits = h @ weight.T                                         # [c, Vr], weight dtype
            local = t - vocab_start
            mine = (local >= 0) & (local < vr)
            local = local.clamp(0, vr - 1)
            row_max = _all_reduce(logits.amax(-1).float(), group,
                                  dist.ReduceOp.MAX if group is not None else None)
            tgt = _all_reduce(logits.gather(1, local[:, None])[:, 0].float() * mine, group)
            sum_exp = torch.zeros_like(row_max)
            for j in range(0, vr, block):
                sum_exp += torch.exp(logits[:, j:j + block].float() - row_max[:, None]).sum(-1)
            lse = row_max + torch.log(_all_reduce(sum_exp, group))
            ce[s:s + h.shape[0]] = lse - tgt
            if not need_grad:
                continue
            # d(sum coef * CE) / d logits = coef * (softmax - onehot(target)), block by block
            for j in range(0, vr, block):
                g = torch.exp(logits[:, j:j + block].float() - lse[:, None]) * c[:, None]
                at = local - j
                hit = mine & (at >= 0) & (at < g.shape[1])
                g.scatter_add_(1, at.clamp(0, g.shape[1] - 1)[:, None], -(c * hit)[:, None])
                logits[:, j:j + block] = g
            grad_h[s:s + h.shape[0]] = logits @ weight
            grad_w.addmm_(logits.T, h)
        if need_grad:
            _all_reduce(grad_h, group)
            ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(ce)
        return (ce * coef).sum(), ce

    @staticmethod
    def backward(ctx, grad_loss, grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        g = grad_loss.to(grad_h.dtype)
        gh = grad_h * g if ctx.needs_input_grad[0] else None
        gw = grad_w * g.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         coef: torch.Tensor, *, impl: str = "fused", chunk_tokens: int = 2048,
                         vocab_start: int = 0, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy of the output layer, `sum_i coef_i * CE_i` (module docstring).

    Args:
        hidden: FloatTensor[N, h], final-norm hidden states of the positions to score.
        weight: FloatTensor[V / tp, h], this rank's rows of the output layer (vocab rows
            `[vocab_start, vocab_start + V / tp)`).
        target: LongTensor[N], global token ids in `[0, V)`.
        coef: FloatTensor[N] (fp32), loss coefficient of each position (0 = no contribution).
        impl: "fused" (any TP) or "torch" (TP=1, torch >= 2.13).
        chunk_tokens: rows per chunk (>= 1): at most this many rows of logits exist at a time.
        vocab_start: first vocab row of `weight` (TP rank x V / tp).
        group: the tensor-parallel process group when V is split over it (None at TP=1).
    Returns:
        (loss: FloatTensor[] fp32 with grad to `hidden` and `weight`, ce: FloatTensor[N] fp32,
        detached, each position's cross-entropy in nats).
    Raises:
        ValueError: unknown impl, chunk_tokens < 1, "torch" with a TP group or without the
            torch function.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    coef = coef.to(torch.float32)
    if impl == "fused":
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        return _FusedLinearCE.apply(hidden, weight, target, coef, int(chunk_tokens),
                                    int(vocab_start), group)
    if impl == "torch":
        if group is not None:
            raise ValueError("loss_impl=torch needs tensor-parallel size 1 (use fused)")
        if not torch_linear_ce_available():
            raise ValueError(f"loss_impl=torch needs torch.nn.functional.linear_cross_entropy "
                             f"(torch >= 2.13; this is {torch.__version__}); use fused")
        import torch.nn.functional as F
        ce = F.linear_cross_entropy(hidden, weight, target, reduction="none",
                                    options=torch.nn.LinearCrossEntropyOptions(
                                        batch_chunk_size=int(chunk_tokens)))
        ce = ce.float()
        return (ce * coef).sum(), ce.detach()
    raise ValueError(f"linear_cross_entropy impl must be fused or torch, got {impl!r}")
