"""The tensor-parallel table: every parameter of `Qwen3`, the Hugging Face tensors it is made
of, the dimension it is split along over the tensor-parallel group, and its per-rank shape.

Owns: the one statement of how Qwen3's weights are laid out over TP ranks. Read by the model
(megatron-core's partition attributes), Hugging Face import and export (`pipeline.model.hf`),
seeded initialisation (`pipeline.model.init`), checkpoint consolidation and resharding
(`pipeline.checkpoint`). Must not touch: files, tensors' values, process groups.

| native parameter (per layer i)      | Hugging Face tensor(s)                 | split dim |
|-------------------------------------|----------------------------------------|-----------|
| `embed_tokens.weight`               | `model.embed_tokens.weight`            | 0 (vocab) |
| `layers.i.self_attn.qkv_proj.weight`| `model.layers.i.self_attn.{q,k,v}_proj.weight` | 0, fused: rank r holds `[q_r; k_r; v_r]` |
| `layers.i.self_attn.o_proj.weight`  | `model.layers.i.self_attn.o_proj.weight` | 1       |
| `layers.i.mlp.gate_up_proj.weight`  | `model.layers.i.mlp.{gate,up}_proj.weight` | 0, fused: rank r holds `[gate_r; up_r]` |
| `layers.i.mlp.down_proj.weight`     | `model.layers.i.mlp.down_proj.weight`  | 1         |
| `lm_head.weight` (absent when tied) | `lm_head.weight`                       | 0 (vocab) |
| norms (input / post-attention layernorm, q_norm, k_norm, final `norm`) | same name under `model.` | replicated |

Each Hugging Face tensor of a split parameter is cut into `tp` contiguous equal blocks along the
split dim (megatron-core's stride 1); rank r takes block r of each, and a fused parameter
concatenates its parts' blocks along dim 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.model.config import ModelConfig

# Split dim by the last two components of a native name; anything else is replicated.
_SPLIT_DIMS = {"embed_tokens.weight": 0, "lm_head.weight": 0, "qkv_proj.weight": 0,
               "gate_up_proj.weight": 0, "o_proj.weight": 1, "down_proj.weight": 1}


@dataclass(frozen=True)
class ParamSpec:
    """How one native parameter is made of Hugging Face tensors.

    Attributes:
        native: native parameter name (`Qwen3.named_parameters()`).
        hf: Hugging Face tensor names whose per-rank blocks are concatenated along dim 0
            (fused layers list several: q, k, v or gate, up); one name otherwise.
        dim: split dim over the TP group (0 = rows / output, 1 = columns / input), None when
            replicated.
        hf_shapes: the full shape of each tensor of `hf` (embedding and head rows:
            `cfg.vocab_size`, i.e. the model's rows, TP padding included).
    """

    native: str
    hf: tuple[str, ...]
    dim: int | None
    hf_shapes: tuple[tuple[int, ...], ...]

    def part_lengths(self, tp_size: int) -> tuple[int, ...]:
        """Per-rank length along `dim` of each part of `hf` (elements); the full shapes' when
        replicated."""
        d = self.dim or 0
        return tuple(s[d] // (tp_size if self.dim is not None else 1) for s in self.hf_shapes)

    def rank_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of this parameter on one rank of a TP group of `tp_size` (the same on every
        rank)."""
        if self.dim is None:
            return self.hf_shapes[0]
        shape = list(self.hf_shapes[0])
        shape[self.dim] = sum(self.part_lengths(tp_size))
        return tuple(shape)


def partition_dim(native_name: str) -> int | None:
    """Split dim over the TP group of a native parameter (0, 1, or None when replicated)."""
    return _SPLIT_DIMS.get(".".join(native_name.split(".")[-2:]))


def padded_vocab_size(rows: int, tp_size: int) -> int:
    """Smallest multiple of `tp_size` that is >= `rows` (embedding rows, tokens)."""
    return -(-rows // tp_size) * tp_size


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every native parameter of `Qwen3(cfg)` with its Hugging Face sources, split dim and full
    shapes, in a fixed order (embedding, layers, final norm, head)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def spec(native: str, hf: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> ParamSpec:
        return ParamSpec(native, hf, partition_dim(native), shapes)

    specs = [spec("embed_tokens.weight", ("model.embed_tokens.weight",), ((cfg.vocab_size, h),))]
    for i in range(cfg.num_layers):
        a, n = f"model.layers.{i}.", f"layers.{i}."
        specs += [
            spec(n + "input_layernorm.weight", (a + "input_layernorm.weight",), ((h,),)),
            spec(n + "self_attn.qkv_proj.weight",
                 tuple(a + f"self_attn.{x}_proj.weight" for x in "qkv"), ((q, h), (kv, h), (kv, h))),
            spec(n + "self_attn.o_proj.weight", (a + "self_attn.o_proj.weight",), ((h, q),)),
            spec(n + "self_attn.q_norm.weight", (a + "self_attn.q_norm.weight",), ((d,),)),
            spec(n + "self_attn.k_norm.weight", (a + "self_attn.k_norm.weight",), ((d,),)),
            spec(n + "post_attention_layernorm.weight", (a + "post_attention_layernorm.weight",),
                 ((h,),)),
            spec(n + "mlp.gate_up_proj.weight",
                 (a + "mlp.gate_proj.weight", a + "mlp.up_proj.weight"), ((inter, h), (inter, h))),
            spec(n + "mlp.down_proj.weight", (a + "mlp.down_proj.weight",), ((h, inter),)),
        ]
    specs.append(spec("norm.weight", ("model.norm.weight",), ((h,),)))
    if not cfg.tie_word_embeddings:
        specs.append(spec("lm_head.weight", ("lm_head.weight",), ((cfg.vocab_size, h),)))
    return specs


def tp_shard_shapes(cfg: ModelConfig, tp_size: int) -> dict[str, tuple[int, ...]]:
    """`{native_name: shape}` of every parameter of `Qwen3(cfg)` on one rank of a TP group of
    `tp_size` (every rank has the same shapes), in `param_specs` order."""
    return {s.native: s.rank_shape(tp_size) for s in param_specs(cfg)}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """`{hf_name: full shape}` of every Hugging Face tensor of `Qwen3ForCausalLM` for `cfg`
    (embedding / head rows: `cfg.vocab_size`)."""
    return {name: shape for s in param_specs(cfg) for name, shape in zip(s.hf, s.hf_shapes)}
