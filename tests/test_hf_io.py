"""pipeline.hf_io: config reading, per-TP-rank slice loading (single file, sharded, ReFusion
layout), merging per-rank state back, HF folder writing. No process group needed."""
import json

import pytest
import torch

from tiny_qwen3 import make_tiny_qwen3

SMALL = dict(hidden_size=16, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=32, num_hidden_layers=2)


def _hf_state(folder):
    from transformers import Qwen3ForCausalLM
    return {k: v.detach().clone() for k, v in
            Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict().items()}


def _expected_rank_slices(hf, hc, rank, tp, vocab):
    """Independent per-rank slicing, written from the layout in ARCHITECTURE/hf_io docs."""
    def rows(t, n):  # rank's contiguous block of n // tp rows, zero-padded past the end
        per = n // tp
        out = torch.zeros((per,) + t.shape[1:], dtype=t.dtype)
        block = t[rank * per:(rank + 1) * per]
        out[:block.shape[0]] = block
        return out
    out = {"embed_tokens.weight": rows(hf["model.embed_tokens.weight"], vocab),
           "norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf and not hc.get("tie_word_embeddings"):
        out["lm_head.weight"] = rows(hf["lm_head.weight"], vocab)
    for i in range(hc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
        out[f"layers.{i}.self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(
            tp, dim=1)[rank]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"].chunk(tp)[rank],
             hf[p + "mlp.up_proj.weight"].chunk(tp)[rank]])
        out[f"layers.{i}.mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(
            tp, dim=1)[rank]
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                  "self_attn.k_norm"):
            out[f"layers.{i}.{n}.weight"] = hf[p + n + ".weight"]
    return out


def test_config_from_hf_and_errors(tmp_path):
    from pipeline.hf_io import config_from_hf
    src = make_tiny_qwen3(tmp_path / "a", vocab_size=511, **SMALL)
    cfg = config_from_hf(src)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == \
        (511, 16, 2, 4, 2, 8, 1e6, 1e-6)
    assert config_from_hf(src, tp_size=2).vocab_size == 512
    hc = json.loads((src / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(dict(hc, attention_bias=True))
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        config_from_hf(dict(hc, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}))
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not a multiple"):
        config_from_hf(src, tp_size=4)


def test_sharded_write_and_per_rank_slices(tmp_path):
    from transformers import Qwen3ForCausalLM
    from pipeline.hf_io import (config_from_hf, iter_tp_shard, merge_tp_state_dicts,
                                param_specs, partition_dim, save_hf_folder)
    src = make_tiny_qwen3(tmp_path / "src", seed=4, vocab_size=300, **SMALL)
    hf = _hf_state(src)
    cfg = config_from_hf(src)
    out = save_hf_folder(hf, cfg, tmp_path / "sharded", max_shard_bytes=8_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert set(index["weight_map"]) == set(hf)
    # transformers reads the sharded folder back bit for bit.
    back = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    # Per-rank slices from the sharded folder == independent slicing of the full tensors.
    hc = json.loads((src / "config.json").read_text())
    cfg2 = config_from_hf(out, tp_size=2)
    shards = []
    for rank in (0, 1):
        got = dict(iter_tp_shard(out, cfg2, rank, 2))
        want = _expected_rank_slices(hf, hc, rank, 2, cfg2.vocab_size)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (rank, k)
        shards.append(got)
    merged = merge_tp_state_dicts(shards, cfg2)
    for k, v in hf.items():
        assert torch.equal(merged[k], v), k
    for spec in param_specs(cfg2):
        assert partition_dim(spec.native) == spec.dim, spec.native


def test_refusion_release_layout(tmp_path):
    """The authors' folder: Qwen3 weights, vocab shrunk to 151671, bos/mask ids in config.json,
    sharded safetensors with an index (as HF Trainer saves)."""
    from transformers import Qwen3ForCausalLM
    from pipeline.hf_io import config_from_hf, iter_tp_shard, merge_tp_state_dicts
    src = make_tiny_qwen3(tmp_path / "qwen", seed=5, vocab_size=151671,
                          **dict(SMALL, num_hidden_layers=1))
    model = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.bos_token_id = 151669
    model.config.mask_token_id = 151670
    ref_dir = tmp_path / "refusion"
    model.save_pretrained(ref_dir, max_shard_size="4MB")
    assert (ref_dir / "model.safetensors.index.json").is_file()
    hc = json.loads((ref_dir / "config.json").read_text())
    assert hc["mask_token_id"] == 151670 and hc["vocab_size"] == 151671
    cfg = config_from_hf(ref_dir, tp_size=2)
    assert cfg.vocab_size == 151672
    shards = [dict(iter_tp_shard(ref_dir, cfg, r, 2)) for r in (0, 1)]
    assert shards[1]["embed_tokens.weight"].shape == (75836, 16)
    assert shards[1]["embed_tokens.weight"][-1].abs().max().item() == 0.0  # the padding row
    merged = merge_tp_state_dicts(shards, cfg, vocab_rows=151671)
    for k, v in model.state_dict().items():
        assert torch.equal(merged[k], v), k


def test_save_with_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece model (the demo tokenizer kind) is copied as tokenizer.model and its
    <|mask|> piece id lands in config.json."""
    import sentencepiece as spm
    from pipeline.hf_io import config_from_hf, save_hf_folder
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(400)))
    spm.SentencePieceTrainer.Train(input=str(text), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=120, model_type="bpe",
                                   user_defined_symbols=["<|mask|>"], minloglevel=2)
    src = make_tiny_qwen3(tmp_path / "src", vocab_size=128, **dict(SMALL, num_hidden_layers=1))
    out = save_hf_folder(_hf_state(src), config_from_hf(src), tmp_path / "out",
                         tokenizer_src=tmp_path / "spm.model")
    sp = spm.SentencePieceProcessor()
    sp.Load(str(out / "tokenizer.model"))
    mask = sp.PieceToId("<|mask|>")
    assert sp.IdToPiece(mask) == "<|mask|>"
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == mask
    assert (out / "tokenizer.model").read_bytes() == (tmp_path / "spm.model").read_bytes()
    with pytest.raises(ValueError, match="tokenizer has 120 tokens but the model has only 64"):
        src2 = make_tiny_qwen3(tmp_path / "src2", vocab_size=64, **dict(SMALL, num_hidden_layers=1))
        save_hf_folder(_hf_state(src2), config_from_hf(src2), tmp_path / "out2",
                       tokenizer_src=tmp_path / "spm.model")
    assert not (tmp_path / "out2").exists()  # failed writes leave nothing behind
