"""The shape of a Qwen3 network: `ModelConfig` and its validation.

Owns: the model config fields (names as in Qwen3's config.json where they exist), their checks
against each other and the tensor-parallel size, YAML presets (`configs/model/*.yaml`).
Must not touch: parameters, tensors, Hugging Face files (`pipeline.model.hf` reads config.json).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path


ATTENTION_KINDS = ("auto", "sdpa", "flex", "varlen")
RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_mode(value) -> str:
    """The activation-checkpointing mode of a `recompute` value: one of `RECOMPUTE_MODES`.

    The old boolean form stays valid as an alias: True = "full", False (or None) = "none"; the
    strings "true"/"false" (as a command line gives them) are read the same way.

    Raises:
        ValueError: anything else (one line naming the allowed values).
    """
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if isinstance(value, str):
        low = value.strip().lower()
        if low in RECOMPUTE_MODES:
            return low
        if low in ("true", "false"):
            return "full" if low == "true" else "none"
    raise ValueError(f"recompute must be one of {'|'.join(RECOMPUTE_MODES)} (or true = full, "
                     f"false = none), got {value!r}")


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
        recompute: activation checkpointing during training, one of `RECOMPUTE_MODES`:
            "none" (keep every activation), "full" (keep each block's input only and recompute
            the whole block in backward), "selective" (recompute only the cheap parts whose saved
            tensors are large: the block's two RMSNorms, the attention core, i.e. q/k norms,
            RoPE and the attention kernel, and the SwiGLU activation; matrix multiplies are
            never run twice; Megatron's selective recompute and torchtitan's op-level AC make
            the same kind of split). Qwen3-8B's shape in bf16 keeps 226 / 119 / 8 kB per token
            per layer with none / selective / full (`bench/bench_activation_memory.py`). The
            boolean form is an alias (True = "full", False = "none"; `recompute_mode`).
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
    recompute: bool | str = False
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
        try:
            recompute_mode(self.recompute)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
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
