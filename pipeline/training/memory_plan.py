"""Per-GPU memory plan of a training run or a decode: will it fit, before any process is queued.

Owns the formulas (`plan_memory`, `plan_decoding`, `decode_feed`, `kv_cache_bytes`,
`activation_bytes_per_token_layer`, `format_plan`). Must not touch: the network, the engine
(it reads the ZeRO sizes of `pipeline.training.engine.zero_sizes` and the shapes of
`pipeline.model.tp`), config validation. CLI and start-up check: docs/TRAINING.md "Will it fit".

Notation (one rank): `t` TP size, `d` DP size, `b` micro-batch rows, `s` fed tokens per row,
`h` hidden size, `I` intermediate size, `q = H_q * D`, `k = H_kv * D`, `V` vocabulary rows, `L`
layers, `e` bytes of the run dtype (bf16 2, fp32 4). `s = data.max_length`: collate pads every
row to it, and the objective never lengthens a row past it (mode "dual" included). Mode "dual"'s
dense mask is counted even with flex (an overestimate of `b s^2` bytes).

Model states (ZeRO, Rajbhandari et al. 2020, section 5.1, in the form of DeepSpeed's
`estimate_zero3_model_states_mem_needs`), with `P_r` the parameters of one TP rank: stage 3 keeps
`e P_r / d` (run-dtype partition), `4 P_r / d` (fp32 master copy, cloned even in an fp32 run),
`8 P_r / d` (AdamW's moments) and `g P_r / d` (gradients; `g` = 4 with
`deepspeed.fp32_grad_accum` or fp32, else 2). Parameters under `param_persistence_threshold`
stay whole (`e` bytes each). Stage 1 partitions the optimizer state, 2 also the gradients.

ZeRO-3 working set (`zero3_gathered_elements`): DeepSpeed gathers per module
(`partitioned_param_coordinator.py`, `fetch_sub_module`), keeps a weight reused within
`stage3_max_reuse_distance` elements and prefetches while fewer than
`stage3_max_live_parameters` are gathered, but always gathers the module in use. Measured with
DeepSpeed's own status of every weight at every op (`tests/test_memory_plan.py`), the gathered
set reached all partitioned weights when they were fewer than either limit, else stayed within
10% below `max(max_live, max_reuse_distance)` + the largest weight; the plan takes
`min(P_part, max(max_live, max_reuse_distance) + largest)` elements in `e` bytes. Plus one
gradient reduce bucket of `reduce_bucket_size` elements (`e + g` bytes each).

Outside the tensors (`device` "cuda" only; allowances, not measured): the CUDA context and NCCL's
buffers per communicator the step uses (the constants below). `torch.cuda.max_memory_allocated`
never sees them.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1; the same tensor-by-tensor count for this network), per token and layer,
with `r = 4` below fp32 (RMSNorm's `x.float()` copy) and `r = 0` in fp32:
- none: two RMSNorms `2 (r h + 2 e h)`, qkv output `e (q + 2k) / t`, q/k norm and RoPE
  `(r + 4 e) (q + k) / t`, attention output and its copy `2 e q / t`, log-sum-exp `4 H_q / t`,
  the residual `e h`, SwiGLU `e 4I / t`. Autograd actually saves `2 e (q + k) / t + e q / t`
  (+ `e h` below fp32) fewer (262.3 vs 225.6 kB for Qwen3-8B in bf16,
  `bench/bench_activation_memory.py`); the over-count is kept on purpose: it stands in for step
  memory the plan does not itemise (without it the plan falls 13-18% below the measured step
  peak, with it within 10%);
- selective (`pipeline.model.qwen3.Block`'s recompute regions): the norms' outputs `2 e h`, qkv
  `e (q + 2k) / t`, attention core output `e q / t`, the residual `e h`, gate|up `2 e I / t`,
  SwiGLU output `e I / t`;
- full: nothing inside the block.
Every mode keeps each block's input (`e h`). In backward one block's recomputed tensors are alive
on top: full, its "none" set plus the gate|up gradient `2 e I / t`; selective, "none" minus
"selective"; none, nothing (measured). Outside the blocks: embedding output and final norm
`(r + 3 e) h`, the hidden-state gradient `e h`, and with the dense-mask SDPA kernel the boolean
mask `b s^2` bytes.

Output layer + cross-entropy (`pipeline.model.linear_ce`): labelled hidden states `e h` per
labelled position, and per chunk of `c = train.loss_chunk_tokens` rows: "chunked" / "torch" the
logits `e c V / t` plus megatron's fp32 vocab-parallel CE `8 c V / t`; "fused" the logits, one
fp32 column block (`min(c V / t, 2^25)` elements), the weight gradient `e V h / t` and `grad_h`
(`4 h` per labelled position).

Peak = model states + ZeRO-3 working set + activations + max(output-layer chunk, one block's
backward); checked against the trainer's step on the CPU (`tests/test_memory_plan.py`).

Decoding (`plan_decoding`, `--batch-size` prompts `B`, longest prompt `P`, `g` generated tokens,
slot size `k`; the model whole in `e` bytes, no gradients):
- weights `e P_r`;
- the KV cache `2 L B (H_kv / t) C D e` (`kv_cache_bytes`), `C` the storage columns: capacity
  `P + g` rounded up to the bucket (64 on CUDA, 1 on the CPU), grown by `KVCache.reserve` to
  `max(need, 1.5 C)` when a forward needs more (`decode_feed`: with `B > 1` rows at different
  progress up to `P + g - 1 + later`; alone, only draft_every's mask blocks pass `P + g`);
- the largest forward's working set, of the first forward, the second and one over the whole
  storage (`decode_feed`'s fed tokens `T` over `S` columns): the additive attention bias
  (`plan_decode_attention`) `e B G T S`, `G = H_q / H_kv`; RoPE's cos/sin `2 e B T D`; the larger
  of one block's MLP `e B T (3 h + 4 I / t)` and the output layer `e B T (h + V / t)` (+ the
  gathered logits `e B T V` when `t > 1`). SDPA with a bias runs a fused kernel (no `[T, S]`
  scores per head); a forward's logits are freed before the next one. While its decisions are
  computed (`decisions.decide`), the logits plus `(e + 4) V` per scored row; the plan adds what
  this exceeds the forward's set by. authors / correct are planned with every slot selected.
  Temperature > 0 adds float64 Gumbel buffers (`16 T V` per row), not planned.
Transients not planned (each smaller than the forward's set): the mask while the bias is built,
one layer's old tensor while the cache grows or drops rows. Checked against real decodes on the
CPU within 7% (`tests/test_memory_plan_decode.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20
FP32_NORM_BYTES = 4
# The CUDA context of a training process: the driver's context, the kernels a step loads (lazily
# since CUDA 11.7) and cuBLAS workspaces; 0.5-1 GiB is what nvidia-smi commonly shows above
# `torch.cuda.memory_reserved` on an H100 with CUDA 12. The upper end, as an allowance (not
# measured in this repository: no multi-process GPU run yet, docs/PERFORMANCE.md).
CUDA_CONTEXT_BYTES = 1 * GIB
# NCCL's buffers of one communicator, from NCCL's default sizes: per channel (up to 32,
# NCCL's MAXCHANNELS, on NVLink/InfiniBand H100 nodes) and per peer connection (2: a ring's
# neighbours / a tree's parent and child), one buffer per protocol: Simple 4 MiB
# (`NCCL_BUFFSIZE`), LL128 4.7 MiB (120 x 640 x 8 x 8 bytes), LL 0.5 MiB (8 x 512 x 8 x 16):
# 32 x 2 x 9.2 MiB = 588 MiB, an upper estimate (fewer channels use less).
NCCL_BYTES_PER_COMMUNICATOR = 32 * 2 * (4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)
# the components of `plan_memory` that persist between steps (the model states)
STATE_COMPONENTS = ("weights (run dtype)", "fp32 master weights", "AdamW moments (fp32)",
                    "gradients")
# the start of the component name of the CUDA context + NCCL allowance (no tensor: a measure of
# allocated memory, `torch.cuda.max_memory_allocated`, never includes it)
ALLOWANCE_PREFIX = "CUDA context + NCCL buffers"


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


def kv_cache_bytes(mcfg, tp: int, rows: int, columns: int, elem: int) -> int:
    """Bytes of a decoding `KVCache` of `rows` rows and `columns` storage columns (one keys and
    one values tensor `[rows, H_kv / tp, columns, D]` per layer)."""
    return (2 * mcfg.num_layers * rows * (mcfg.num_key_value_heads // tp) * columns
            * mcfg.head_dim * elem)


DECODE_MODES = ("ar", "authors", "correct", "draft_ahead", "draft_every")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def decode_feed(verify: str, prompt: int, gen_length: int, slot_size: int = 4,
                num_blocks: int = 1, bucket: int = 1, exact_cache: bool = False,
                batch: int = 1) -> dict:
    """Fed tokens and cache columns of one decode (module docstring, "Decoding").

    Args:
        verify: "ar" (`ar_generate`) or a `refusion_generate` verify mode.
        prompt: tokens of the longest prompt. gen_length: `--gen-length` (tokens).
        slot_size, num_blocks: plan-and-infill's k and blocks (unused by "ar").
        bucket: the cache's column granularity (64 on CUDA, 1 on the CPU).
        exact_cache: authors' `exact_cache` (slots re-encoded ahead of a later forward).
        batch: rows decoded together (> 1: rows at different progress share a forward).
    Returns:
        {"first": tokens fed by the first forward, "later": most tokens fed by a later one,
        "capacity": the cache's capacity (tokens), "need": most columns a forward needs,
        "columns": storage columns after any growth}.
    Raises:
        ValueError: an unknown mode or sizes < 1.
    """
    if verify not in DECODE_MODES:
        raise ValueError(f"verify must be one of {', '.join(DECODE_MODES)}, got {verify!r}")
    if min(prompt, gen_length, slot_size, num_blocks, bucket) < 1:
        raise ValueError("prompt, gen_length, slot_size, num_blocks and bucket must be >= 1")
    k = slot_size
    g = gen_length if verify not in ("authors", "correct") else _round_up(gen_length, k)
    need = prompt + g
    if verify == "ar":
        first, later = prompt, 1
    elif verify in ("authors", "correct"):
        block = g // num_blocks
        first, later = prompt + block, block + (block if exact_cache else 1)
    elif verify == "draft_ahead":
        first, later = prompt + min(2 * k, g), 1 + min(2 * k, g)
    else:
        first, later = prompt + min(k + 1, g), 1
        for c in range(1, g):
            n = min(k, g - c)
            blocks = sum(1 + min(k, g - c - a - 1) for a in range(n + 1) if g - c - a - 1 > 0)
            later = max(later, 1 + n + blocks)
            need = max(need, prompt + c + n + blocks)
    if batch > 1 and verify != "ar":   # the widest row's cache + another row's largest feed
        need = max(need, prompt + g - 1 + later)
    cap = prompt + g
    cols = max(_round_up(cap, bucket), bucket)
    if need > cols:
        grown = max(need, cols + cols // 2)
        if need > cols + cols // 2:
            grown = max(grown, (need - 1) + (need - 1) // 2)
        cols = _round_up(grown, bucket)
    return {"first": first, "later": later, "capacity": cap, "need": need, "columns": cols}


def plan_decoding(mcfg, *, tp: int, batch: int, prompt: int, gen_length: int,
                  verify: str = "ar", slot_size: int = 4, num_blocks: int = 1,
                  exact_cache: bool = False, precision: str = "bf16", device: str = "cuda",
                  gpu_bytes: int | None = None, search: bool = True) -> MemoryPlan:
    """The memory plan of one rank decoding `batch` prompts (module docstring, "Decoding").

    Args:
        mcfg: `ModelConfig`. tp: tensor-parallel size. batch: rows decoded together
            (`--batch-size`). prompt: tokens of the longest prompt. gen_length: `--gen-length`.
        verify: "ar" or a `refusion_generate` verify mode. slot_size, num_blocks, exact_cache:
            `refusion_generate`'s k, blocks and `exact_cache`.
        precision: the model's dtype, "bf16" | "fp32". device: "cuda" | "cpu" (the bucket).
        gpu_bytes: one device's memory in bytes, for `max_micro_batch` (here: the largest
            decode batch that fits).
    Returns:
        `MemoryPlan` (components in bytes).
    Raises:
        ValueError: as `decode_feed`.
    """
    e = _dtype_bytes(precision)
    feed = decode_feed(verify, prompt, gen_length, slot_size, num_blocks,
                       bucket=64 if device == "cuda" else 1, exact_cache=exact_cache,
                       batch=batch)
    part, persist, _ = _rank_params(mcfg, tp, 0)
    h, d = mcfg.hidden_size, mcfg.head_dim
    inter, vr = mcfg.intermediate_size / tp, mcfg.vocab_size / tp
    group = mcfg.num_attention_heads // mcfg.num_key_value_heads
    refusion = verify != "ar"

    def working(t: int, s: int, scored: int) -> dict:
        out = e * (h + vr) * batch * t
        if tp > 1:
            out += e * mcfg.vocab_size * batch * t
        during = {"bias": e * batch * group * t * s, "rope": 2 * e * batch * t * d,
                  "peak": max(e * (3 * h + 4 * inter) * batch * t, out)}
        # the decisions (`decisions.decide`): the logits, and per scored row (a probability
        # wanted) its copy and its fp32 copy or logsumexp's temporary
        after = e * batch * t * mcfg.vocab_size + (e + 4) * batch * scored * mcfg.vocab_size
        during["probabilities"] = max(0, after - sum(during.values()))
        return during

    later, k = feed["later"], slot_size
    # scored rows per row: authors / correct's plan scores each slot's first mask, a verify
    # (at most) every fed token; draft_ahead / draft_every's walk the drafts (<= k), ar none
    first = -(-(feed["first"] - prompt) // k) if verify in ("authors", "correct") else 0
    scored = {"ar": 0, "authors": later, "correct": later}.get(verify, min(k, later - 1))
    forwards = {"first": working(feed["first"], feed["first"], first),
                "second": working(later, feed["first"] + later, scored),
                "later": working(later, feed["columns"], scored)}
    which = max(forwards, key=lambda n: sum(forwards[n].values()))
    w = forwards[which]
    c: dict[str, int] = {}
    c["weights (decode dtype)"] = e * (part + persist)
    c["decoding KV cache"] = kv_cache_bytes(mcfg, tp, batch, feed["columns"], e)
    c["decode forward: attention bias"] = int(w["bias"])
    c["decode forward: RoPE cos/sin"] = int(w["rope"])
    if w["probabilities"]:
        c["after the forward: logits + probability buffers (beyond)"] = int(w["probabilities"])
    c["decode forward: max(one block's MLP, logits)"] = int(w["peak"])
    total = int(sum(c.values()))
    layout = (f"decoding, TP {tp}, {precision}, batch {batch}, prompt {prompt} + {gen_length} "
              f"tokens, {verify}" + (f" (k {slot_size})" if refusion else "")
              + f"; cache {feed['columns']} columns; largest forward: the {which} "
              f"({feed['first' if which == 'first' else 'later']} tokens fed)")
    plan = MemoryPlan(components=c, total=total, layout=layout, gpu_bytes=gpu_bytes,
                      batch_name="decode batch")
    if gpu_bytes is not None and search:
        plan.max_micro_batch = _largest_fitting(
            lambda b: plan_decoding(mcfg, tp=tp, batch=b, prompt=prompt, gen_length=gen_length,
                                    verify=verify, slot_size=slot_size, num_blocks=num_blocks,
                                    exact_cache=exact_cache, precision=precision,
                                    device=device, search=False).total,
            gpu_bytes)
    return plan


@dataclass
class MemoryPlan:
    """Bytes per component on one rank (`components`, insertion-ordered), `total` bytes, the
    layout they assume (`layout`: text), and `max_micro_batch` (largest micro-batch whose total
    fits `gpu_bytes`; None when no memory was given, 0 when not even 1 fits; for a decoding
    plan the largest decode batch, `batch_name` "decode batch")."""
    components: dict = field(default_factory=dict)
    total: int = 0
    layout: str = ""
    gpu_bytes: int | None = None
    max_micro_batch: int | None = None
    groups: dict = field(default_factory=dict)
    batch_name: str = "micro-batch"

    def fits(self) -> bool | None:
        """Whether `total <= gpu_bytes` (None without a memory size)."""
        return None if self.gpu_bytes is None else self.total <= self.gpu_bytes


def _rank_params(mcfg, tp: int, persist_threshold: int) -> tuple[int, int, int]:
    """(partitioned parameters of one TP rank, persistent (unpartitioned) ones, largest
    weight's elements) from the TP table (`pipeline.model.tp.tp_shard_shapes`)."""
    from pipeline.model.tp import tp_shard_shapes
    part = persist = largest = 0
    for shape in tp_shard_shapes(mcfg, tp).values():
        n = math.prod(shape)
        largest = max(largest, n)
        if n < persist_threshold:
            persist += n
        else:
            part += n
    return part, persist, largest


def zero3_gathered_elements(partitioned: int, largest: int, max_live: int,
                            max_reuse_distance: int) -> int:
    """Most partitioned weight elements ZeRO-3 holds gathered at once on one rank in a step
    (module docstring, "ZeRO-3 working set"). All arguments in elements: the rank's partitioned
    weights (its TP shard, before the DP split), the largest one weight,
    `stage3_max_live_parameters`, `stage3_max_reuse_distance`."""
    return min(partitioned, max(max_live, max_reuse_distance) + largest)


def plan_memory(mcfg, *, tp: int, dp: int, micro_batch: int, seq_len: int, precision: str,
                zero_stage: int, zero: dict, fp32_grad_accum: bool = True,
                loss_impl: str = "chunked", chunk_tokens: int = 2048, device: str = "cuda",
                attention: str = "auto", offload_optimizer: bool = False,
                offload_params: bool = False,
                gpu_bytes: int | None = None, search: bool = True) -> MemoryPlan:
    """The memory plan of one rank (module docstring: formulas and sources).

    Args:
        mcfg: `ModelConfig` (its `recompute` picks the activation formula).
        tp, dp: tensor- and data-parallel sizes. micro_batch: rows per micro-batch.
        seq_len: fed tokens per row (`data.max_length`). precision: "bf16" | "fp32".
        zero_stage: 0..3. zero: `pipeline.training.engine.zero_sizes` (elements).
        loss_impl, chunk_tokens: `train.loss_impl`, `train.loss_chunk_tokens`.
        device: "cuda" | "cpu" (picks the attention kernel for "auto"; "cuda" adds the CUDA
            context and NCCL allowance). attention: model.attention.
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
        live = zero3_gathered_elements(part, largest, zero["max_live_parameters"],
                                       zero["max_reuse_distance"])
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
    if device == "cuda":
        groups = (tp * dp > 1) + (1 < tp < tp * dp) + (1 < dp < tp * dp)
        name = f"{groups} communicator{'s' * (groups != 1)}"
        c[f"{ALLOWANCE_PREFIX} ({name}; allowance)"] = (
            CUDA_CONTEXT_BYTES + groups * NCCL_BYTES_PER_COMMUNICATOR)
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
                                  offload_params=offload_params, search=False).total,
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
    lines = [f"{'decoding ' if plan.batch_name == 'decode batch' else ''}memory plan per GPU "
             f"({plan.layout}):"]
    width = max(len(k) for k in plan.components)
    for k, v in plan.components.items():
        lines.append(f"  {k:<{width}}  {v / GIB:9.2f} GiB")
    lines.append(f"  {'total':<{width}}  {plan.total / GIB:9.2f} GiB")
    if plan.gpu_bytes is not None:
        verdict = "fits" if plan.fits() else "does NOT fit"
        lines.append(f"  {verdict} in {plan.gpu_bytes / GIB:.1f} GiB; largest "
                     f"{plan.batch_name} that fits: {plan.max_micro_batch}")
    return lines
