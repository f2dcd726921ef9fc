"""Per-GPU memory plan of a training run: will the config fit, before any process is queued.

Owns: `plan_memory` (bytes per component on one rank, a total, the largest micro-batch that
fits a given memory), `activation_bytes_per_token_layer`, `kv_cache_bytes`, `format_plan`.
Must not touch: the network, the engine (it reads the same ZeRO sizes as
`pipeline.training.engine.zero_sizes` and the parameter shapes of `pipeline.model.tp` /
`pipeline.model.flops`), config validation (`pipeline.config`). The CLI is
`python -m pipeline.plan_memory`; the trainer prints the plan at start-up and refuses a config
whose plan exceeds the GPU (`train.memory_check`).

Notation (one rank): `t` TP size, `d` data-parallel size, `b` micro-batch rows, `s` fed tokens
per row, `h` hidden size, `I` intermediate size, `q = H_q * D`, `k = H_kv * D` (per TP rank
`q / t`, `k / t`, `I / t`), `V` vocabulary rows, `L` layers, `e` bytes of the run's dtype (bf16
2, fp32 4). Fed tokens: `pipeline.objective.reorganize_sample` reorders a sample and never
lengthens it (objective mode "dual" adds masked copies, but never past `data.max_length`), and
`pipeline.objective.collate` pads every row to `data.max_length` (`Plan.row_length`), so the
model is always fed `b x s` tokens with `s = data.max_length`. Mode "dual" always attends with
the dense-mask SDPA kernel (its mask is counted below, whatever `model.attention` says).

Model states (ZeRO, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5.1, in the form of DeepSpeed's
`estimate_zero3_model_states_mem_needs`): with `P_r` the parameters of one TP rank
(`pipeline.model.tp.tp_shard_shapes`, summing to `pipeline.model.flops.num_parameters` over the
TP group for the split ones), stage 3 keeps per rank `e * P_r / d` (the run-dtype partition),
`4 * P_r / d` (the fp32 master copy: DeepSpeed clones the partition to fp32 even when the run is
fp32), `8 * P_r / d` (AdamW's two fp32 moments) and `g * P_r / d` (the gradient partition:
`g` = 4 with `deepspeed.fp32_grad_accum` or fp32, else 2). Parameters with fewer elements than
`param_persistence_threshold` stay whole on every rank (`e` bytes each, norms). Stages 1/2
partition only the optimizer state (1) or optimizer + gradients (2); stage 0 none.

ZeRO-3 working set (DeepSpeed's `stage3_*` settings as `pipeline.training.engine.deepspeed_config`
builds them): gathered parameters of the module being computed (the largest module's TP-rank
weights, `e` bytes per element, e.g. the embedding `V / t x h`) plus the prefetch bucket
(`stage3_prefetch_bucket_size` elements), the total capped at `stage3_max_live_parameters`;
one gradient reduce bucket of `reduce_bucket_size` elements in the gradient dtype plus its
run-dtype copy (`e + g` bytes per element).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1 counts `s b h (34 + 5 a s / h)` bytes per layer for GPT; here the same
tensor-by-tensor count for this network, `activation_bytes_per_token_layer`): per token and
layer, with `r = 4` below fp32 (RMSNorm computes in fp32, `pipeline.model.qwen3.rms_norm`, and
`x.float()` copies a bf16 input) and `r = 0` in fp32 (no copy):
- none: two RMSNorms `2 x (r h + 2 e h)` (the fp32 input, the normalized value kept for the
  weight's gradient, the output kept by the next matrix multiply), the fused qkv output
  `e (q + 2k) / t` (v is a view of it, so it stays alive), the q/k RMSNorm and RoPE
  `(r + 4 e) (q + k) / t` (fp32 input, normalized, scaled, rotated half, rotated), the
  attention output and its row-major copy `2 e q / t` and log-sum-exp `4 H_q / t`, the
  residual after attention `e h`, SwiGLU `e (2I + I + I) / t` (gate|up output, silu(gate),
  product);
- selective (`pipeline.model.qwen3.Block` recomputes the norms, the attention core and the
  SwiGLU activation): the two norms' outputs `2 e h` (kept by the next matrix multiply), qkv
  output `e (q + 2k) / t`, attention core output `e q / t`, the residual after attention `e h`,
  gate|up `2 e I / t` and the SwiGLU output `e I / t`;
- full: nothing inside the block (its input is kept, below).
Every mode also keeps each block's input (the residual stream, `e h` per token and layer). In
backward the recomputed tensors of one block are alive on top: full, the block's whole "none"
set plus the gradient of its gate|up output (`2 e I / t`); selective, at most the regions it
recomputes ("none" minus "selective"); none, nothing (its backward frees as fast as it
allocates; measured). Outside the blocks: the embedding output and the final RMSNorm `(r + 3 e) h`, the
hidden-state gradient `e h`, and with the dense-mask SDPA kernel (`model.attention` "sdpa", the
CPU; "auto" on a CUDA GPU in bf16 is the varlen kernel without a mask) the boolean mask
`b s^2` bytes.

Output layer + cross-entropy (`pipeline.model.linear_ce`, `pipeline.objective`): the labelled
positions' hidden states `e h` per labelled position (at most every fed token) and per chunk of
`c = train.loss_chunk_tokens` rows: "chunked" / "torch" keep the chunk's logits `c V / t` in
`e` bytes plus megatron's fp32 vocab-parallel cross-entropy (`4 c V / t` for the fp32 copy and
`4 c V / t` for its softmax/gradient); "fused" keeps the chunk's logits (`e c V / t`), one fp32
column block (`min(c V / t, 2^25)` elements) and, from the forward to the backward, the weight
gradient buffer `e V h / t` and `grad_h` (`4 h` per labelled position).

Decoding KV cache (`pipeline.model.kv_cache.KVCache`): `2 L b_dec (H_kv / t) C D e` bytes for
`b_dec` rows of capacity `C`.

Peak = model states + ZeRO-3 working set + activations + max(output-layer chunk, one block's
backward). Measured against the trainer's step on the CPU in `tests/test_memory_plan.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1 << 30
FP32_NORM_BYTES = 4


def _dtype_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def activation_bytes_per_token_layer(mcfg, tp: int, mode: str, elem: int) -> float:
    """Bytes one decoder block keeps for its backward, per fed token, besides its input.

    Args:
        mcfg: `ModelConfig`. tp: tensor-parallel size. mode: "none" | "selective" | "full".
        elem: bytes per element of the run dtype (bf16 2, fp32 4).
    Returns:
        bytes (float); the module docstring's per-mode sums.
    """
    h, inter = mcfg.hidden_size, mcfg.intermediate_size / tp
    q = mcfg.num_attention_heads * mcfg.head_dim / tp
    k = mcfg.num_key_value_heads * mcfg.head_dim / tp
    r = FP32_NORM_BYTES if elem < FP32_NORM_BYTES else 0   # x.float() copies only below fp32
    if mode == "full":
        return 0.0
    if mode == "selective":
        return (elem * (q + 2 * k) + elem * q + elem * h + 2 * elem * inter + elem * inter
                + 2 * elem * h)
    norms = 2 * (r * h + 2 * elem * h)
    attn = (elem * (q + 2 * k) + (r + 4 * elem) * (q + k) + 2 * elem * q
            + 4 * mcfg.num_attention_heads / tp)
    return norms + attn + elem * h + elem * 4 * inter


def kv_cache_bytes(mcfg, tp: int, rows: int, capacity: int, elem: int) -> int:
    """Bytes of a decoding `KVCache`: `2 L rows (H_kv / tp) capacity D elem`."""
    return (2 * mcfg.num_layers * rows * (mcfg.num_key_value_heads // tp) * capacity
            * mcfg.head_dim * elem)


@dataclass
class MemoryPlan:
    """Bytes per component on one rank (`components`, insertion-ordered), `total` bytes, the
    layout they assume (`layout`: text), and `max_micro_batch` (largest micro-batch whose total
    fits `gpu_bytes`; None when no memory was given, 0 when not even 1 fits)."""
    components: dict = field(default_factory=dict)
    total: int = 0
    layout: str = ""
    gpu_bytes: int | None = None
    max_micro_batch: int | None = None
    groups: dict = field(default_factory=dict)

    def fits(self) -> bool | None:
        """Whether `total <= gpu_bytes` (None without a memory size)."""
        return None if self.gpu_bytes is None else self.total <= self.gpu_bytes


def _rank_params(mcfg, tp: int, persist_threshold: int) -> tuple[int, int, int]:
    """(partitioned parameters of one TP rank, persistent (unpartitioned) ones, largest
    module's parameters) from the TP table."""
    from pipeline.model.tp import tp_shard_shapes
    shapes = tp_shard_shapes(mcfg, tp)
    part = persist = 0
    modules: dict[str, int] = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        if n < persist_threshold:
            persist += n
        else:
            part += n
        mod = name.rsplit(".", 2)[0] if ".layers." in name else name.split(".")[0]
        modules[mod] = modules.get(mod, 0) + n
    return part, persist, max(modules.values())


def plan_memory(mcfg, *, tp: int, dp: int, micro_batch: int, seq_len: int, precision: str,
                zero_stage: int, zero: dict, fp32_grad_accum: bool = True,
                loss_impl: str = "chunked", chunk_tokens: int = 2048, device: str = "cuda",
                attention: str = "auto", offload_optimizer: bool = False,
                offload_params: bool = False, decode_rows: int = 0, decode_capacity: int = 0,
                gpu_bytes: int | None = None, search: bool = True) -> MemoryPlan:
    """The memory plan of one rank (module docstring: formulas and sources).

    Args:
        mcfg: `ModelConfig` (its `recompute` picks the activation formula).
        tp, dp: tensor- and data-parallel sizes. micro_batch: rows per micro-batch.
        seq_len: fed tokens per row (`data.max_length`). precision: "bf16" | "fp32".
        zero_stage: 0..3. zero: `pipeline.training.engine.zero_sizes` (elements).
        loss_impl, chunk_tokens: `train.loss_impl`, `train.loss_chunk_tokens`.
        device: "cuda" | "cpu" (picks the attention kernel for "auto"). attention: model.attention.
        decode_rows, decode_capacity: a decoding KV cache to add (0: none).
        gpu_bytes: memory of one device in bytes, for `max_micro_batch`.
    Returns:
        `MemoryPlan`.
    """
    from pipeline.model.config import recompute_mode
    e = _dtype_bytes(precision)
    g = 4 if (precision != "bf16" or fp32_grad_accum) else 2
    mode = recompute_mode(mcfg.recompute)
    persist_thr = zero["param_persistence_threshold"] if zero_stage == 3 else 0
    part, persist, largest = _rank_params(mcfg, tp, persist_thr)
    p_rank = part + persist
    c: dict[str, int] = {}
    pd = dp if zero_stage == 3 else 1
    c["weights (run dtype)"] = 0 if offload_params else e * part // pd + e * persist
    od = dp if zero_stage >= 1 else 1
    opt_dev = 0 if offload_optimizer else 1
    c["fp32 master weights"] = opt_dev * (4 * p_rank // od if precision == "bf16" or zero_stage >= 1 else 0)
    c["AdamW moments (fp32)"] = opt_dev * 8 * p_rank // od
    gd = dp if zero_stage >= 2 else 1
    c["gradients"] = g * p_rank // gd
    if zero_stage == 3:
        live = min(largest + zero["prefetch_bucket_size"], zero["max_live_parameters"])
        c["ZeRO-3 gathered + prefetched params"] = e * live
    if zero_stage >= 1:
        c["gradient reduce bucket"] = (e + g) * zero["reduce_bucket_size"]
    tokens = micro_batch * seq_len
    h = mcfg.hidden_size
    per_layer = activation_bytes_per_token_layer(mcfg, tp, mode, e)
    none_layer = activation_bytes_per_token_layer(mcfg, tp, "none", e)
    c["activations: block inputs"] = int(e * h * mcfg.num_layers * tokens)
    c[f"activations: inside blocks ({mode})"] = int(per_layer * mcfg.num_layers * tokens)
    c["activations: embedding, final norm, grad"] = int((FP32_NORM_BYTES + 4 * e) * h * tokens)
    kernel = attention
    if kernel == "auto":
        kernel = "varlen" if (device == "cuda" and precision == "bf16") else "sdpa"
    if kernel == "sdpa":
        c["attention mask (dense SDPA)"] = micro_batch * seq_len * seq_len
    vr = mcfg.vocab_size / tp
    chunk = min(chunk_tokens, tokens)
    head_rows = e * h * tokens
    if loss_impl == "fused":
        head = (head_rows + 4 * h * tokens + e * vr * h + e * chunk * vr
                + 4 * min(chunk * vr, 1 << 25))
    else:
        head = head_rows + (e + 8) * chunk * vr
    inter = mcfg.intermediate_size / tp
    if mode == "full":
        backward_block = (none_layer + 2 * e * inter) * tokens
    elif mode == "selective":
        backward_block = (none_layer - per_layer) * tokens
    else:
        backward_block = 0.0
    c["peak transient: max(output layer + CE, one block's backward)"] = int(max(head, backward_block))
    if decode_rows and decode_capacity:
        c["decoding KV cache"] = kv_cache_bytes(mcfg, tp, decode_rows, decode_capacity, e)
    total = int(sum(c.values()))
    layout = (f"TP {tp} x DP {dp}, ZeRO-{zero_stage}, {precision}, micro-batch {micro_batch} x "
              f"{seq_len} tokens, recompute {mode}, loss {loss_impl} (chunk {chunk_tokens}), "
              f"attention {kernel}")
    plan = MemoryPlan(components=c, total=total, layout=layout, gpu_bytes=gpu_bytes)
    if gpu_bytes is not None and search:
        plan.max_micro_batch = _largest_fitting(
            lambda b: plan_memory(mcfg, tp=tp, dp=dp, micro_batch=b, seq_len=seq_len,
                                  precision=precision, zero_stage=zero_stage, zero=zero,
                                  fp32_grad_accum=fp32_grad_accum, loss_impl=loss_impl,
                                  chunk_tokens=chunk_tokens, device=device, attention=attention,
                                  offload_optimizer=offload_optimizer,
                                  offload_params=offload_params, decode_rows=decode_rows,
                                  decode_capacity=decode_capacity, search=False).total,
            gpu_bytes)
    return plan


def _largest_fitting(total_of, limit: int, cap: int = 1 << 16) -> int:
    """Largest b in [0, cap] with total_of(b) <= limit (total_of increases with b)."""
    if total_of(1) > limit:
        return 0
    lo, hi = 1, 2
    while hi <= cap and total_of(hi) <= limit:
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total_of(mid) <= limit else (lo, mid)
    return lo


def plan_for_run(cfg, *, tp: int, dp: int, model_fields: dict, row_length: int,
                 device: str = "cuda", gpu_bytes: int | None = None) -> MemoryPlan:
    """`plan_memory` for a run config (`pipeline.config.load_config`) and its layout.

    Args:
        cfg: the run DictConfig. tp, dp: layout. model_fields: `ModelConfig` fields (with
            `recompute` from `train.activation_checkpointing`). row_length: fed tokens per row.
        device: "cuda" | "cpu". gpu_bytes: one device's memory in bytes, or None.
    """
    from pipeline.model import ModelConfig
    from pipeline.training.engine import zero_sizes
    mcfg = ModelConfig.from_dict(dict(model_fields), source="model")
    t = cfg.train
    return plan_memory(mcfg, tp=tp, dp=dp, micro_batch=int(t.micro_batch_size),
                       seq_len=int(row_length), precision=str(t.precision),
                       zero_stage=int(t.zero_stage),
                       zero=zero_sizes(cfg.deepspeed, int(mcfg.hidden_size)),
                       fp32_grad_accum=bool(cfg.deepspeed.fp32_grad_accum),
                       loss_impl=str(t.loss_impl), chunk_tokens=int(t.loss_chunk_tokens),
                       device=device, attention=("sdpa" if cfg.objective.get("mode") == "dual"
                                                 else str(model_fields.get("attention") or "auto")),
                       offload_optimizer=bool(t.offload_optimizer),
                       offload_params=bool(t.offload_params), gpu_bytes=gpu_bytes)


def format_plan(plan: MemoryPlan) -> list[str]:
    """The plan as console lines (GiB, one component a line, then the total and the fit)."""
    lines = [f"memory plan per GPU ({plan.layout}):"]
    width = max(len(k) for k in plan.components)
    for k, v in plan.components.items():
        lines.append(f"  {k:<{width}}  {v / GIB:9.2f} GiB")
    lines.append(f"  {'total':<{width}}  {plan.total / GIB:9.2f} GiB")
    if plan.gpu_bytes is not None:
        verdict = "fits" if plan.fits() else "does NOT fit"
        lines.append(f"  {verdict} in {plan.gpu_bytes / GIB:.1f} GiB; largest micro-batch that "
                     f"fits: {plan.max_micro_batch}")
    return lines
