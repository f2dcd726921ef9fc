"""pipeline.model.hf: config reading, per-TP-rank slice loading (single file, sharded, ReFusion
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
    from pipeline.model.hf import config_from_hf
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
    from pipeline.model.hf import config_from_hf, iter_tp_shard, merge_tp_state_dicts, save_hf_folder
    from pipeline.model.tp import param_specs, partition_dim
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
    from pipeline.model.hf import config_from_hf, iter_tp_shard, merge_tp_state_dicts
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
    from pipeline.model.hf import config_from_hf, save_hf_folder
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


@pytest.fixture(scope="module")
def shard_tokenizer(tmp_path_factory):
    """A data_prep SentencePiece model (train_tokenizer.py, vocab 600, ids <pad>=0 <unk>=1 <s>=2
    </s>=3 <|mask|>=4) in the layout of a shard folder's copy: `<shards>/tokenizer/tokenizer.model`."""
    from pathlib import Path

    from data_prep import stdlib_corpus, train_tokenizer
    tmp = tmp_path_factory.mktemp("spm_shards")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for rel in ("json/decoder.py", "textwrap.py", "string.py", "bisect.py"):
        (corpus / rel.replace("/", "_").replace(".py", ".txt")).write_bytes(
            Path(stdlib_corpus.stdlib_root(), rel).read_bytes())
    folder = tmp / "shards" / "tokenizer"
    folder.mkdir(parents=True)
    assert train_tokenizer.main(["--input", str(corpus), "--output",
                                 str(folder / "tokenizer.model"), "--vocab-size", "600"]) == 0
    return folder


SPM_TEXTS = ["hello world", "  two  spaces\n\n\ttab ", "<s>not bos</s> <|mask|>x",
             "def f(x):\n    return x * 42  # ünïcode 日本\n"]


def test_spm_shard_folder_exports_hf_tokenizer_that_encodes_like_training(tmp_path,
                                                                         shard_tokenizer):
    """The shard folder's SentencePiece copy (README: `--tokenizer <shards>/tokenizer`) is
    written as-is (600 tokens: nothing added, so a 600-row model fits) plus HF files that
    AutoTokenizer loads with the training ids; load_tokenizer on either folder is SentencePiece."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from pipeline.tokenizer import SPMTokenizer, load_tokenizer
    from pipeline.model.hf import config_from_hf, save_hf_folder
    sp = spm.SentencePieceProcessor(model_file=str(shard_tokenizer / "tokenizer.model"))
    src = make_tiny_qwen3(tmp_path / "src", vocab_size=600, **dict(SMALL, num_hidden_layers=1))
    out = save_hf_folder(_hf_state(src), config_from_hf(src), tmp_path / "out",
                         tokenizer_src=shard_tokenizer)
    assert (out / "tokenizer.model").read_bytes() == (shard_tokenizer / "tokenizer.model").read_bytes()
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == 4
    tok = AutoTokenizer.from_pretrained(out)
    assert (len(tok), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (600, 3, 2, 0)
    for text in SPM_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == sp.EncodeAsIds(text), text
    for folder in (shard_tokenizer, out):
        ours = load_tokenizer(str(folder))
        assert isinstance(ours, SPMTokenizer)
        assert (ours.info.vocab_size, ours.info.eos_id, ours.info.mask_id) == (600, 3, 4)
        assert ours.encode("hello world") == sp.EncodeAsIds("hello world")


def test_spm_export_keeps_no_hf_file_that_encodes_differently(tmp_path, shard_tokenizer,
                                                               monkeypatch, capsys):
    """A converted tokenizer.json that encodes differently (here: transformers' non-legacy dummy
    prefix, which drops the extra '▁' before leading spaces) is not kept; AutoTokenizer's own
    reading of tokenizer.model is checked instead, and when that differs too, one warning line
    says so. load_tokenizer always reads tokenizer.model."""
    import sentencepiece as spm
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    from pipeline.tokenizer import SPMTokenizer, load_tokenizer
    from pipeline import tokenizer as tokenizer_io
    sp = spm.SentencePieceProcessor(model_file=str(shard_tokenizer / "tokenizer.model"))

    def non_legacy(model_path, out):
        proto = import_protobuf().ModelProto()
        proto.ParseFromString(model_path.read_bytes())
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=False)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=True,
                                      **tokenizer_io._spm_special_tokens(sp))
        assert tok.encode("  two") != sp.EncodeAsIds("  two")  # really differs
        tok.save_pretrained(out)
    monkeypatch.setattr(tokenizer_io, "_write_hf_spm_files", non_legacy)
    checked = []
    real_check = tokenizer_io._spm_hf_mismatch
    monkeypatch.setattr(tokenizer_io, "_spm_hf_mismatch",
                        lambda sp_, out: checked.append(real_check(sp_, out)) or checked[-1])
    out = tmp_path / "out"
    out.mkdir()
    info = tokenizer_io.save_tokenizer(shard_tokenizer, out)
    assert checked[0].startswith("ids differ on "), checked
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(out)
    agrees = all(tok.encode(t, add_special_tokens=False) == sp.EncodeAsIds(t) for t in SPM_TEXTS)
    assert info == {"length": 600, "mask_token_id": 4, "auto_tokenizer": checked[1] is None}
    assert agrees or checked[1] is not None  # never claimed loadable while encoding differently
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == (0 if checked[1] is None else 1), err

    monkeypatch.setattr(tokenizer_io, "_spm_hf_mismatch", lambda sp_, out: "ids differ on 'x'")
    out2 = tmp_path / "out2"
    out2.mkdir()
    assert tokenizer_io.save_tokenizer(shard_tokenizer, out2)["auto_tokenizer"] is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AutoTokenizer cannot load it correctly" in err[0], err
    assert sorted(p.name for p in out2.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    for folder in (out, out2):
        ours = load_tokenizer(str(folder))
        assert isinstance(ours, SPMTokenizer) and ours.info.eos_id == 3
        assert ours.encode("  two") == sp.EncodeAsIds("  two")


def test_write_safetensors_is_byte_identical_to_safetensors_save_file(tmp_path):
    """The streaming writer against the library's own writer: same bytes for mixed dtypes
    (order by dtype size, then name), 0-d and empty tensors, metadata."""
    from safetensors.torch import save_file

    from pipeline.model.hf import LazyTensor, write_safetensors
    g = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
               "a.weight": torch.randn(4, 2, generator=g),
               "z": torch.arange(7), "h": torch.randn(6, generator=g).half(),
               "flag": torch.tensor(True), "empty": torch.zeros(0, 3),
               "d": torch.randn(2, 2, generator=g).double(), "i8": torch.tensor([1, -2],
                                                                              dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    calls = []

    def lazy(name, t):
        def load(dtype=None):
            calls.append(name)
            return t.to(dtype or t.dtype)
        return LazyTensor(tuple(t.shape), t.dtype, load)

    write_safetensors(tmp_path / "ours.safetensors", {k: lazy(k, v) for k, v in tensors.items()},
                      metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()
    assert sorted(calls) == sorted(tensors)          # each tensor produced exactly once


def test_lazy_merge_casts_piecewise_like_a_full_cast(tmp_path):
    """`lazy_merged_state(...).load(bf16)` (cast per rank piece on the copy) equals merging in
    fp32 and casting the full tensor, for TP 2 with vocab padding dropped."""
    from pipeline.model.hf import config_from_hf, iter_tp_shard, lazy_merged_state, merge_tp_state_dicts
    from pipeline.model.tp import tp_shard_shapes
    src = make_tiny_qwen3(tmp_path / "src", seed=5, vocab_size=301, **SMALL)
    cfg = config_from_hf(src, tp_size=2)                   # 302 rows: one padding row
    shards = [dict(iter_tp_shard(src, cfg, r, 2)) for r in (0, 1)]
    assert {k: tuple(v.shape) for k, v in shards[0].items()} == tp_shard_shapes(cfg, 2)
    full = merge_tp_state_dicts(shards, cfg, vocab_rows=301)
    reads = []

    def read(name, rank, start=None, stop=None):
        reads.append((name, rank, start, stop))
        t = shards[rank][name]
        return t if start is None else t[start:stop]

    lazy = lazy_merged_state(read, tp_shard_shapes(cfg, 2), torch.float32, cfg, 2,
                             vocab_rows=301)
    assert list(lazy) == list(full)
    for k, v in full.items():
        assert lazy[k].shape == tuple(v.shape), k
        assert torch.equal(lazy[k].load(torch.bfloat16), v.to(torch.bfloat16)), k
    assert full["model.embed_tokens.weight"].shape[0] == 301
    # a q tensor reads only the q rows of each rank's fused qkv
    q_reads = [r for r in reads if r[0] == "layers.0.self_attn.qkv_proj.weight"]
    assert q_reads[0][2:] == (0, cfg.num_attention_heads * cfg.head_dim // 2)
