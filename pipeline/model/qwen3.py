"""Qwen3 as ReFusion trains it: megatron-core tensor-parallel layers, explicit position ids,
packed-sequence attention, an optional KV cache.

Owns: the network definition (`Qwen3`, its blocks, RMSNorm, RoPE) and `gather_logits`.
Must not touch: the ReFusion objective (`pipeline.objective`), checkpoint formats and Hugging
Face names (`pipeline.model.hf`), the split of each parameter over the tensor-parallel group
(`pipeline.model.tp`, the one table), process-group creation (`pipeline.parallel`), optimizers.

The definition reads like a single-device Qwen3 (Qwen3 technical report; tested against
transformers' `Qwen3ForCausalLM`): embedding -> N x [RMSNorm -> GQA attention with q/k RMSNorm
and RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. Only the
linear layers and the embedding are megatron-core TP layers (Column/RowParallelLinear,
VocabParallelEmbedding; fused `qkv_proj` and `gate_up_proj` as `pipeline.model.tp` lays them
out), so TP=1 and TP>1 share one code path; logits stay vocab-parallel (`[B, T, V / tp]`,
`gather_logits`). On the CPU megatron-core needs use_cpu_initialization=True,
gradient_accumulation_fusion=False, gather_output=False and no sequence parallelism (its
CUDA-only paths fail there). Tensors are batch-first: `[B, T, hidden]`.
"""
from __future__ import annotations

import functools
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.attention import (AttentionPlan, _eye_offset, attention, build_attention_mask,
                                      plan_attention, plan_decode_attention)
from pipeline.model.config import ModelConfig, recompute_mode
from pipeline.model.kv_cache import KVCache
from pipeline.model.tp import partition_dim


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as Qwen3 computes it: in fp32, then cast back, then scale.

    `y = weight * (x / sqrt(mean(x^2, -1) + eps)).to(x.dtype)`; x: `[..., dim]`, weight: `[dim]`.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm as a module (`impl`: `rms_norm` or its compiled form). With
    `reduce_grad_over_tp=True` (q/k norms: each TP rank normalizes its own heads) the weight's
    gradient is all-reduced over the TP group (`copy_to_tensor_model_parallel_region`, as
    Megatron does for QK-layernorm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32,
                 reduce_grad_over_tp: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.reduce_grad_over_tp = reduce_grad_over_tp and _tp_size() > 1
        self.impl = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.reduce_grad_over_tp:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
            weight = copy_to_tensor_model_parallel_region(weight)
        return self.impl(x, weight, self.eps)


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


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of the queries and the keys (one region for `Qwen3.compile_layers`)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@functools.lru_cache(maxsize=None)
def _megatron_layers():
    """megatron-core's `(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)`, each
    running plain `F.linear` / `F.embedding` at TP=1 without autograd (decoding): there
    megatron's region functions are identities, yet cost more than a small model's one-token
    matrix multiply. The shortcut sits inside the module's forward, so hooks (ZeRO-3's gather)
    still run; every other case is megatron's forward unchanged (bias-free: bias None)."""
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)

    def plain_at_tp1(base):
        class Layer(base):
            def forward(self, input_, *args, **kwargs):
                if (not args and not kwargs and self.bias is None and _tp_size() == 1
                        and not torch.is_grad_enabled()):
                    return F.linear(input_, self.weight), None
                return super().forward(input_, *args, **kwargs)
        Layer.__name__ = Layer.__qualname__ = base.__name__
        return Layer

    class Embedding(VocabParallelEmbedding):
        def forward(self, input_):
            if _tp_size() == 1 and not torch.is_grad_enabled():
                return F.embedding(input_, self.weight)
            return super().forward(input_)
    Embedding.__name__ = Embedding.__qualname__ = VocabParallelEmbedding.__name__

    return plain_at_tp1(ColumnParallelLinear), plain_at_tp1(RowParallelLinear), Embedding


class Attention(nn.Module):
    """GQA self-attention with QK-norm and RoPE; heads split over the tensor-parallel group."""

    def __init__(self, cfg: ModelConfig, mcfg, init_method, out_init_method):
        ColumnParallelLinear, RowParallelLinear, _ = _megatron_layers()
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
        self.rope = rope_qk

    def forward(self, x, cos, sin, plan, cache_layer=None, selective: bool = False):
        """x: `[B, T, hidden]`; plan: an `AttentionPlan` (for "sdpa" its mask is `[B, 1, T, S]`);
        cache_layer: a function `(k, v) -> (keys, values)` that writes the new keys/values
        `[B, H_kv/tp, T, D]` into the KV cache in place and returns the `[B, H_kv/tp, S, D]`
        views attention reads (`KVCache.write_and_read`); selective: recompute the attention
        core (`_core`: q/k norms, RoPE, the kernel) in backward instead of keeping its
        activations (training, no cache)."""
        qkv, _ = self.qkv_proj(x)
        if selective and cache_layer is None:
            out = torch.utils.checkpoint.checkpoint(self._core, qkv, cos, sin, plan,
                                                    use_reentrant=False)
        else:
            out = self._core(qkv, cos, sin, plan, cache_layer)
        out, _ = self.o_proj(out)
        return out

    def _core(self, qkv, cos, sin, plan, cache_layer=None):
        """The attention core between the projections: `qkv: [B, T, (H_q + 2 H_kv) / tp * D]`
        -> `[B, T, H_q / tp * D]`."""
        b, t, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split((self.n_q * d, self.n_kv * d, self.n_kv * d), dim=-1)
        q = self.q_norm(q.view(b, t, self.n_q, d)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.n_kv, d)).transpose(1, 2)
        v = v.view(b, t, self.n_kv, d).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        if cache_layer is not None:
            k, v = cache_layer(k, v)
        out = attention(q, k, v, plan)
        return out.transpose(1, 2).reshape(b, t, self.n_q * d)


def swiglu(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """SwiGLU activation of `gate_up: [..., 2 * inner]` = `[gate; up]`: `silu(gate) * up`."""
    gate, up = gate_up.split(inner, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): `down(silu(gate(x)) * up(x))`, inner dim split over TP."""

    def __init__(self, cfg: ModelConfig, mcfg, init_method, out_init_method):
        ColumnParallelLinear, RowParallelLinear, _ = _megatron_layers()
        super().__init__()
        self.inner = cfg.intermediate_size // _tp_size()
        self.act = swiglu
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, 2 * cfg.intermediate_size, config=mcfg, init_method=init_method,
            bias=False, gather_output=False)
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, config=mcfg, init_method=out_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x, selective: bool = False):
        """x: `[B, T, hidden]`; selective: recompute the SwiGLU activation in backward (keeps
        only `gate_up` instead of gate, silu(gate), up and their product)."""
        gate_up, _ = self.gate_up_proj(x)
        if selective:
            act = torch.utils.checkpoint.checkpoint(self.act, gate_up, self.inner,
                                                    use_reentrant=False)
        else:
            act = self.act(gate_up, self.inner)
        out, _ = self.down_proj(act)
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

    def forward(self, x, cos, sin, plan, cache_layer=None, selective: bool = False):
        """selective: recompute the two norms (keeping only their input, the residual stream),
        the attention core and the SwiGLU activation in backward."""
        norm = partial(_checkpointed, self.input_layernorm) if selective else self.input_layernorm
        x = x + self.self_attn(norm(x), cos, sin, plan, cache_layer, selective)
        norm = (partial(_checkpointed, self.post_attention_layernorm) if selective
                else self.post_attention_layernorm)
        return x + self.mlp(norm(x), selective)


def _checkpointed(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


@functools.lru_cache(maxsize=None)
def _output_layer_class():
    """`OutputLayer`: megatron-core's ColumnParallelLinear over the vocab, plus a `loss_inputs`
    entry running `linear_ce.linear_cross_entropy` inside the layer's own forward, so that
    ZeRO-3 gathers the weight for it and hands its gradient back."""
    ColumnParallelLinear = _megatron_layers()[0]

    class OutputLayer(ColumnParallelLinear):
        """The LM head (`lm_head`): `forward(hidden)` -> `(logits [..., V / tp], None)` as
        ColumnParallelLinear; `forward(hidden_rows, loss_inputs=(target, coef, impl,
        chunk_tokens))` -> `(loss [], ce [N])` (`linear_cross_entropy`)."""

        def forward(self, input_, weight=None, runtime_gather_output=None, loss_inputs=None):
            if loss_inputs is None:
                if weight is None and runtime_gather_output is None:
                    return super().forward(input_)   # the TP=1 shortcut when it applies
                return super().forward(input_, weight, runtime_gather_output)
            from megatron.core import parallel_state
            from pipeline.model.linear_ce import linear_cross_entropy
            target, coef, impl, chunk_tokens = loss_inputs
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rows = self.weight.shape[0]
            group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
            start = parallel_state.get_tensor_model_parallel_rank() * rows
            return linear_cross_entropy(input_, self.weight, target, coef, impl=impl,
                                        chunk_tokens=chunk_tokens, vocab_start=start,
                                        group=group)

    return OutputLayer


class Qwen3(nn.Module):
    """Qwen3 causal LM with megatron-core tensor-parallel layers.

    Needs megatron-core `parallel_state` initialized (`pipeline.parallel.init_distributed`;
    TP=1 is fine). Parameter names and splits: `pipeline.model.tp`. When tied, the head holds
    the embedding Parameter itself (`named_parameters()` lists it once, `state_dict()` has both
    keys). Training levers (default off, set by the trainer): `cfg.recompute`,
    `compile_layers`, precomputed varlen boundaries, `head_loss`.

    Args:
        cfg: network shape; validated against the TP size (ValueError).
        dtype: parameter dtype.
        init_weights: random init (normal, std `cfg.init_std`); False leaves weights
            uninitialized (fast; for loading a checkpoint or building on the meta device).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 init_weights: bool = True):
        VocabParallelEmbedding = _megatron_layers()[2]
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
        self.lm_head = _output_layer_class()(
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

        megatron-core sets them only in its weight initialization (skipped with
        `init_weights=False`), and DeepSpeed's gradient norm counts a parameter without them on
        TP rank 0 only, silently leaving the other ranks' shards out. Split dims: `model.tp`.
        """
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        for name, w in self.named_parameters():
            dim = partition_dim(name)
            if dim is not None and not getattr(w, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(w, True, dim, 1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, return_hidden: bool = False,
                cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None, copy_id: torch.Tensor | None = None,
                clean_limit: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel logits of the fed tokens (or the final hidden states).

        Args:
            input_ids: LongTensor[B, T], tokens in fed order.
            position_ids: LongTensor[B, T], original position of each token (drives RoPE).
            segment_ids: LongTensor[B, T] or None; packed segments (attend causally within the
                own segment only; 0 = padding, attends only to itself).
            attention_mask: BoolTensor[B, 1, T, S] or None, True = may attend, over
                `S = kv_cache.width + T` columns (cache, then new tokens; `S = T` with a cache:
                every committed entry visible). Takes precedence over `segment_ids`; semantics:
                `attention.plan_decode_attention`.
            kv_cache: KVCache or None: the new keys/values become its pending entries
                (`KVCache.commit`); without a mask the new tokens are causal among themselves
                and see every valid cached entry.
            return_hidden: return the final-norm hidden states instead, for `head_logits` /
                `head_loss` applied only where logits are needed.
            cu_seqlens, max_seqlen: `segment_ids`' varlen boundaries (IntTensor[N + 1] on the
                model's device, int; `objective.collate`'s); None computes them here (one host
                sync). Used by packed forwards with the "varlen" kernel only.
            copy_id, clean_limit: LongTensor[B, T] or None (both or neither, with `segment_ids`,
                no mask, no cache): mode "dual" rows (`attention.dual_mask`).
        Packed forwards attend with `cfg.attention`'s kernel (`plan_attention`), others SDPA.
        Raises:
            ValueError: a mask of the wrong shape; `copy_id` / `clean_limit` without the other,
                without `segment_ids`, or with a mask or cache.
        Returns:
            FloatTensor[B, T, V / tp] in the parameter dtype: this rank's vocab slice of the
            logits (`gather_logits` for all of them); with `return_hidden`,
            FloatTensor[B, T, hidden].
        """
        b, t = input_ids.shape
        dual = None
        if copy_id is not None or clean_limit is not None:
            if (copy_id is None or clean_limit is None or segment_ids is None
                    or attention_mask is not None or kv_cache is not None):
                raise ValueError("copy_id and clean_limit go together, with segment_ids and "
                                 "without attention_mask or kv_cache")
            dual = (position_ids, copy_id, clean_limit)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        plan = AttentionPlan("causal")
        if kv_cache is not None:
            past = kv_cache.width
            new = cached = None
            if attention_mask is not None:
                if attention_mask.shape[-2:] not in ((t, past + t), (t, t)):
                    raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                     f"expected [B, 1, {t}, {past + t}] or [B, 1, {t}, {t}]")
                mask = attention_mask[:, 0]
                new, cached = mask[..., -t:], (mask[..., :past] if mask.shape[-1] > t else None)
            elif segment_ids is not None:
                new = build_attention_mask(segment_ids, b, t)[:, 0]
                if past:   # padding (segment 0) sees only itself
                    cached = (segment_ids != 0)[:, :, None].expand(b, t, past)
            columns = kv_cache.begin(t)   # new keys/values then go in place: layer_view
            plan = plan_decode_attention(kv_cache.length, t, columns, x.dtype,
                                         self.cfg.num_attention_heads
                                         // self.cfg.num_key_value_heads, new, cached)
        elif attention_mask is not None:
            if attention_mask.shape[-2:] != (t, t):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"expected [B, 1, {t}, {t}]")
            mask = attention_mask.to(torch.bool)
            # A row with nothing to attend to would give NaN: let it see itself.
            empty = ~mask.any(-1, keepdim=True)                                # [B, 1, T, 1]
            plan = AttentionPlan("sdpa", mask=mask | (empty & _eye_offset(t, t, 0, mask.device)))
        elif segment_ids is not None:
            plan = plan_attention(self.cfg.attention, segment_ids,
                                  needs_grad=torch.is_grad_enabled(), dtype=x.dtype,
                                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, dual=dual)
        mode = "none"
        if self.training and kv_cache is None and torch.is_grad_enabled():
            mode = recompute_mode(self.cfg.recompute)
        for i, layer in enumerate(self.layers):
            cache_layer = kv_cache.layer_view(i) if kv_cache is not None else None
            if mode == "full":
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, plan,
                                                      use_reentrant=False)
            else:
                x = layer(x, cos, sin, plan, cache_layer, mode == "selective")
        x = self.norm(x)
        return x if return_hidden else self.head_logits(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer: `hidden: FloatTensor[..., hidden]` (after the final norm, as
        `forward(..., return_hidden=True)` returns it) -> this rank's vocab slice of the logits
        `FloatTensor[..., V / tp]`, in the parameter dtype."""
        logits, _ = self.lm_head(hidden)
        return logits

    def head_loss(self, hidden: torch.Tensor, target: torch.Tensor, coef: torch.Tensor,
                  impl: str = "fused", chunk_tokens: int = 2048
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output layer fused with the weighted cross-entropy: `linear_ce.linear_cross_entropy`
        (its `hidden`, `target`, `coef`, `impl`, `chunk_tokens`, result and errors) on this
        layer's weight, this rank's vocab rows and the TP group."""
        return self.lm_head(hidden, loss_inputs=(target, coef, impl, int(chunk_tokens)))

    def compile_layers(self, enabled: bool = True, **compile_kwargs) -> None:
        """Regional `torch.compile` of the decoder layers' elementwise regions (`rms_norm`,
        `rope_qk`, `swiglu`; one compilation per region and shape, `dynamic=False` unless
        given); names, state dict and every `recompute` mode unchanged. Regions rather than
        whole blocks (torchtitan's way): ZeRO-3's gather/release hooks on every submodule are
        `torch.compiler.disable`d, so a block compile breaks at each projection and dynamo
        compiles DeepSpeed's hook frames (recompile-limit warnings on the CPU).

        Args:
            enabled: False puts the eager functions back (benchmarks compare both).
            **compile_kwargs: passed to `torch.compile` (e.g. `backend="aot_eager"`).
        """
        compile_kwargs.setdefault("dynamic", False)
        norm, rope, act = rms_norm, rope_qk, swiglu
        if enabled:
            norm = torch.compile(rms_norm, **compile_kwargs)
            rope = torch.compile(rope_qk, **compile_kwargs)
            act = torch.compile(swiglu, **compile_kwargs)
        for layer in self.layers:
            for n in (layer.input_layernorm, layer.post_attention_layernorm,
                      layer.self_attn.q_norm, layer.self_attn.k_norm):
                n.impl = norm
            layer.self_attn.rope = rope
            layer.mlp.act = act
        self.norm.impl = norm


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim over the TP group; backward keeps this rank's slice
    (megatron-core's `gather_from_tensor_model_parallel_region`, which allocates on CUDA, with
    torch.distributed directly)."""

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
