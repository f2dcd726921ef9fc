"""pipeline.model at TP=1 against transformers' Qwen3ForCausalLM on a tiny random checkpoint."""

import pytest
import torch

from tiny_qwen3 import make_tiny_qwen3

ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=1)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tp1, ckpt):
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    m = Qwen3(config_from_hf(ckpt), init_weights=False)
    load_hf_into_model(m, ckpt)
    return m.eval()


def _ids(b, t, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


def test_logits_natural_and_permuted_positions(model, hf_model):
    ids = _ids(2, 24)
    pos = torch.arange(24).expand(2, 24)
    # Permuted: tokens fed out of natural order keep their original position ids.
    perm = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(s))
                        for s in (3, 4)])
    with torch.no_grad():
        for p in (pos, perm):
            ours = model(ids, p)
            ref = hf_model(input_ids=ids, position_ids=p).logits
            assert ours.shape == ref.shape == (2, 24, 512)
            assert (ours - ref).abs().max().item() <= ATOL


def test_logits_with_padding_and_packing(model, hf_model):
    # Row 0: one segment of 10 + 6 padding; row 1: segments of 7 and 9 packed.
    ids = _ids(2, 16, seed=5)
    seg = torch.tensor([[1] * 10 + [0] * 6, [1] * 7 + [2] * 9])
    pos = torch.tensor([list(range(10)) + list(range(10, 16)),
                        list(range(7)) + list(range(9))])
    with torch.no_grad():
        ours = model(ids, pos, segment_ids=seg)
        assert torch.isfinite(ours).all()
        for row, spans in ((0, [(0, 10)]), (1, [(0, 7), (7, 16)])):
            for a, b in spans:
                ref = hf_model(input_ids=ids[row:row + 1, a:b],
                               position_ids=pos[row:row + 1, a:b]).logits[0]
                assert (ours[row, a:b] - ref).abs().max().item() <= ATOL
        # transformers' own right-padding path agrees on the valid tokens too.
        ref = hf_model(input_ids=ids[:1], attention_mask=(seg[:1] > 0).long()).logits
        assert (ours[0, :10] - ref[0, :10]).abs().max().item() <= ATOL


def test_explicit_mask_equals_separate_forwards(model):
    # Prefix of 6, then two 3-token "slots" fed together, each seeing the prefix and itself only.
    ids = _ids(1, 12, seed=7)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 9, 10, 11, 6, 7, 8]])
    t = 12
    causal = torch.ones(t, t).tril().bool()
    mask = causal.clone()
    mask[9:12, 6:9] = False
    with torch.no_grad():
        ours = model(ids, pos, attention_mask=mask[None, None])
        a = model(ids[:, :9], pos[:, :9])
        b = model(torch.cat([ids[:, :6], ids[:, 9:]], 1), torch.cat([pos[:, :6], pos[:, 9:]], 1))
    assert (ours[:, :9] - a).abs().max().item() <= ATOL
    assert (ours[:, 9:] - b[:, 6:]).abs().max().item() <= ATOL


def test_cached_equals_uncached_with_reordered_commit(model):
    from pipeline.model import KVCache
    ids = _ids(2, 14, seed=9)
    pos = torch.arange(14).expand(2, 14)
    cache = KVCache.for_model(model, batch_size=2, capacity=32)
    with torch.no_grad():
        # Prompt of 6, all committed.
        full_prompt = model(ids[:, :6], pos[:, :6], kv_cache=cache)
        cache.commit()
        assert cache.length.tolist() == [6, 6] and cache.width == 6
        # Forward 8 new tokens without keeping them, then commit a reordered subset:
        # row 0 keeps new tokens [4, 5, 0] (in that order), row 1 keeps [1] only. The mask lets
        # each kept token see the prefix and the kept tokens before it in commit order (others
        # see the prefix and themselves), so the committed cache equals a fresh causal forward
        # of prefix + kept tokens in commit order.
        order = torch.full((2, 8), 99)
        order[0, [4, 5, 0]] = torch.tensor([0, 1, 2])
        order[1, 1] = 0
        new_mask = (order[:, None, :] <= order[:, :, None]) & (order[:, None, :] < 99)
        new_mask |= torch.eye(8, dtype=torch.bool)
        mask = torch.cat([torch.ones(2, 8, 6, dtype=torch.bool), new_mask], -1)[:, None]
        model(ids[:, 6:], pos[:, 6:], attention_mask=mask, kv_cache=cache)
        with pytest.raises(ValueError, match="entries < 8"):
            cache.commit(torch.tensor([[8], [0]]))
        cache.commit(torch.tensor([[4, 5, 0], [1, -1, -1]]))
        assert cache.length.tolist() == [9, 7] and cache.width == 9
        nxt = torch.tensor([[100, 101], [102, 103]])
        nxt_pos = torch.tensor([[20, 21], [22, 23]])
        cached = model(nxt, nxt_pos, kv_cache=cache)
        assert cache.num_pending == 2
        # Uncached references: the committed sequences fed in commit order, then the new ones.
        for row, keep in ((0, [10, 11, 6]), (1, [7])):
            seq = torch.cat([ids[row, :6], ids[row, keep], nxt[row]])[None]
            sp = torch.cat([pos[row, :6], pos[row, keep], nxt_pos[row]])[None]
            ref = model(seq, sp)
            assert (cached[row] - ref[0, -2:]).abs().max().item() <= ATOL
        assert (full_prompt - model(ids[:, :6], pos[:, :6])).abs().max().item() <= ATOL
        # Truncate row 0 back to the prompt: same result as a fresh cache of the prompt.
        cache.discard_pending()
        cache.truncate(torch.tensor([6, 7]))
        assert cache.width == 7
        again = model(nxt, nxt_pos, kv_cache=cache)
        small = KVCache.for_model(model, batch_size=2, capacity=4)
        model(ids[:, :6], pos[:, :6], kv_cache=small)
        with pytest.raises(ValueError, match="exceed capacity 4"):
            small.commit()
        ref0 = model(torch.cat([ids[0, :6], nxt[0]])[None], torch.cat([pos[0, :6], nxt_pos[0]])[None])
        assert (again[0] - ref0[0, -2:]).abs().max().item() <= ATOL


def test_cache_with_explicit_mask(model):
    # Two slots fed together after a cached prefix, each seeing the prefix and itself only.
    from pipeline.model import KVCache
    ids = _ids(1, 12, seed=11)
    pos = torch.arange(12)[None]
    cache = KVCache.for_model(model, 1, 16)
    with torch.no_grad():
        model(ids[:, :6], pos[:, :6], kv_cache=cache)
        cache.commit()
        m = torch.zeros(1, 1, 6, 12, dtype=torch.bool)
        m[..., :6] = True
        m[0, 0, :3, 6:9] = torch.ones(3, 3).tril().bool()
        m[0, 0, 3:, 9:] = torch.ones(3, 3).tril().bool()
        out = model(ids[:, 6:], pos[:, 6:], attention_mask=m, kv_cache=cache)
        ref_a = model(ids[:, :9], pos[:, :9])[:, 6:]
        ref_b = model(torch.cat([ids[:, :6], ids[:, 9:]], 1),
                      torch.cat([pos[:, :6], pos[:, 9:]], 1))[:, 6:]
    assert (out[:, :3] - ref_a).abs().max().item() <= ATOL
    assert (out[:, 3:] - ref_b).abs().max().item() <= ATOL


def _greedy(model, prompt, steps):
    """Plain KV-cached greedy decoding with our model (batch 1)."""
    from pipeline.model import KVCache
    cache = KVCache.for_model(model, 1, prompt.shape[1] + steps)
    ids, out = prompt, []
    start = 0
    with torch.no_grad():
        for _ in range(steps):
            pos = torch.arange(start, start + ids.shape[1])[None]
            logits = model(ids, pos, kv_cache=cache)
            cache.commit()
            start += ids.shape[1]
            ids = logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


def test_greedy_decode_matches_transformers_generate(model, hf_model):
    prompt = _ids(1, 5, seed=13)
    ours = _greedy(model, prompt, 12)
    ref = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
    assert ours == ref[0, 5:].tolist()
    assert len(set(ours)) > 1  # not a degenerate constant output


def test_gradients_match_transformers(model, hf_model, ckpt):
    from pipeline.model.hf import merge_tp_state_dicts
    ids = _ids(2, 10, seed=17)
    labels = _ids(2, 10, seed=18)
    pos = torch.arange(10).expand(2, 10)
    model.zero_grad()
    hf_model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten())
    loss.backward()
    ref = torch.nn.functional.cross_entropy(hf_model(input_ids=ids).logits.flatten(0, 1),
                                            labels.flatten())
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5
    grads = merge_tp_state_dicts([{k: p.grad for k, p in model.named_parameters()}], model.cfg)
    hf_grads = {k: p.grad for k, p in hf_model.named_parameters()}
    assert set(grads) == set(hf_grads)
    for k, g in grads.items():
        assert torch.allclose(g, hf_grads[k], atol=1e-5, rtol=1e-4), k
    model.zero_grad()
    hf_model.zero_grad()


def test_recompute_gives_same_gradients(model):
    ids = _ids(1, 8, seed=19)
    pos = torch.arange(8)[None]
    grads = []
    for recompute in (False, True):
        model.cfg.recompute = recompute
        model.train()
        model.zero_grad()
        model(ids, pos).float().pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    model.cfg.recompute = False
    model.eval()
    model.zero_grad()
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-7), k


def test_tied_embeddings(tp1, tmp_path):
    from transformers import Qwen3ForCausalLM
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    ckpt = make_tiny_qwen3(tmp_path / "tied", seed=2, tie_word_embeddings=True, num_hidden_layers=1)
    cfg = config_from_hf(ckpt)
    assert cfg.tie_word_embeddings
    m = Qwen3(cfg, init_weights=False)
    load_hf_into_model(m, ckpt)
    assert "lm_head.weight" not in dict(m.named_parameters())
    ref = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ids = _ids(1, 9, seed=23)
    with torch.no_grad():
        diff = (m(ids, torch.arange(9)[None]) - ref(input_ids=ids).logits).abs().max().item()
    assert diff <= ATOL


def test_presets_and_8b_meta_build(tp1, tmp_path):
    from pathlib import Path
    from pipeline.model import ModelConfig, Qwen3, num_parameters
    root = Path(__file__).resolve().parents[1] / "configs" / "model"
    cfg = ModelConfig.from_yaml(root / "qwen3_8b.yaml")
    with torch.device("meta"):
        m = Qwen3(cfg, dtype=torch.bfloat16, init_weights=False)
    n = sum(p.numel() for p in m.parameters())
    # Qwen3-8B: 36 x (q 4096x4096 + k,v 4096x1024 + o 4096x4096 + MLP 3x4096x12288 + norms)
    # + embedding and head 151936x4096 each + final norm.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert n == num_parameters(cfg) == 36 * per_layer + 2 * 151936 * 4096 + 4096
    assert abs(n - 8.19e9) < 0.01e9
    assert m.layers[0].self_attn.qkv_proj.weight.shape == (6144, 4096)
    small = ModelConfig.from_yaml(root / "qwen3_0_6b.yaml")
    assert small.tie_word_embeddings and abs(num_parameters(small) - 0.596e9) < 0.001e9
    for name in ("tiny", "demo"):
        ModelConfig.from_yaml(root / f"{name}.yaml").validate(tp_size=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 8\nhiden_layers: 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown model config key.*hiden_layers"):
        ModelConfig.from_yaml(bad)


def test_flops_per_token_matches_flop_counter(model):
    """The 6N part against torch's FlopCounterMode (counts every matmul of forward+backward);
    the attention term is the PaLM formula 12 * L * H * D * T (SDPA on CPU is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode
    from pipeline.model import flops_per_token
    cfg = model.cfg
    t = 16
    ids = _ids(2, t, seed=29)
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids, torch.arange(t).expand(2, t)).float().sum().backward()
    model.zero_grad()
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim * t
    assert counter.get_total_flops() / (2 * t) == flops_per_token(cfg, t) - attention


def test_bf16_matches_transformers_bf16(tp1, ckpt):
    """bf16 follows Qwen3's casts (RMSNorm in fp32 then cast, RoPE tables in the model dtype):
    logits agree with transformers' bf16 model to within one bf16 step at their magnitude."""
    from transformers import Qwen3ForCausalLM
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    m = Qwen3(config_from_hf(ckpt), dtype=torch.bfloat16, init_weights=False)
    load_hf_into_model(m, ckpt)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ref = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    ids = _ids(2, 24, seed=31)
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        ours = m(ids, pos, segment_ids=torch.ones_like(ids))
        theirs = ref(input_ids=ids).logits
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - theirs.float()).abs().max().item() <= 0.04


def _packed_reorganized(seed=37):
    """Two rows of 20: packed segments fed in a reorganized (non-monotonic) position order,
    then padding (its position ids continuing after the last segment)."""
    g = torch.Generator().manual_seed(seed)
    ids = _ids(2, 20, seed=seed)
    seg = torch.tensor([[1] * 6 + [2] * 9 + [0] * 5, [1] * 11 + [2] * 9])
    pos = torch.empty(2, 20, dtype=torch.long)
    for row, spans in ((0, [(0, 6), (6, 15)]), (1, [(0, 11), (11, 20)])):
        for a, b in spans:
            pos[row, a:b] = torch.randperm(b - a, generator=g)
    pos[0, 15:] = torch.arange(9, 14)
    assert (pos[:, 1:] < pos[:, :-1]).any()
    return ids, pos, seg


def test_flex_forward_equals_sdpa_without_dense_mask(model, monkeypatch):
    """attention=flex (no-grad forward on CPU) == the sdpa reference on packed, padded rows with
    reorganized positions, and the flex path never builds the dense [B, 1, T, T] mask."""
    import pipeline.model.attention as pm
    ids, pos, seg = _packed_reorganized()
    model.cfg.attention = "sdpa"
    with torch.no_grad():
        ref = model(ids, pos, segment_ids=seg)

    def refuse(*a, **k):
        raise AssertionError("dense mask built on the flex path")
    monkeypatch.setattr(pm, "build_attention_mask", refuse)
    model.cfg.attention = "flex"
    try:
        with torch.no_grad():
            plan = pm.plan_attention("flex", seg, needs_grad=False)
            out = model(ids, pos, segment_ids=seg)
    finally:
        model.cfg.attention = "auto"
    assert plan.kind == "flex" and plan.mask is None
    assert (out - ref).abs().max().item() <= 1e-5


def test_flex_training_on_cpu_falls_back_to_sdpa(model, caplog):
    """torch 2.13 has no FlexAttention backward on CPU: a training forward with attention=flex
    runs the sdpa kernel (one notice line) and gives sdpa's gradients instead of crashing."""
    import logging
    import pipeline.model.attention as pm
    ids, pos, seg = _packed_reorganized(seed=41)
    grads = []
    pm._notified.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.model"):
        for kind in ("sdpa", "flex", "flex"):
            model.cfg.attention = kind
            model.zero_grad()
            model(ids, pos, segment_ids=seg).float().pow(2).mean().backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    model.cfg.attention = "auto"
    model.zero_grad()
    notices = [r for r in caplog.records if "attention=flex" in r.getMessage()]
    assert len(notices) == 1
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_attention_resolution_and_varlen_boundaries():
    from pipeline.model import ModelConfig
    from pipeline.model.attention import resolve_attention, varlen_boundaries
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention("auto", cpu, True) == "sdpa"
    assert resolve_attention("auto", cuda, True) == "varlen"
    assert resolve_attention("auto", cuda, True, torch.float32) == "sdpa"
    assert resolve_attention("varlen", cuda, True, torch.float32) == "sdpa"
    assert resolve_attention("varlen", cuda, True, torch.bfloat16) == "varlen"
    assert resolve_attention("varlen", cpu, False) == "sdpa"
    assert resolve_attention("flex", cpu, False) == "flex"
    assert resolve_attention("flex", cpu, True) == "sdpa"
    assert resolve_attention("flex", cuda, True) == "flex"
    with pytest.raises(ValueError, match="model: attention must be one of"):
        ModelConfig.from_dict({"attention": "flash"}, source="model")
    # Row 0: segments 3 + 2, then 2 padding tokens (one segment each); row 1: one segment of 7.
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1] * 7])
    cu, longest = varlen_boundaries(seg)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 7, 14] and longest == 7


def test_training_flops_counts_causal_attention_per_segment():
    """training_flops == 6 N tokens + 12 L H D x (query-key pairs the packed mask allows),
    counted by brute force on `build_attention_mask` (padding left out)."""
    from pipeline.model import ModelConfig, flops_per_token, segment_lengths, training_flops
    from pipeline.model.attention import build_attention_mask
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    seg = torch.tensor([[1] * 5 + [2] * 3 + [3] * 1 + [0] * 3,
                        [1] * 12,
                        [0] * 12])
    lengths = segment_lengths(seg)
    assert lengths.tolist() == [5, 3, 1, 12]
    mask = build_attention_mask(seg, 3, 12)[:, 0]                     # [B, T, T]
    pairs = int(mask[seg > 0].sum())
    tokens = int((seg > 0).sum())
    assert pairs == 15 + 6 + 1 + 78
    expected = flops_per_token(cfg, 0) * tokens + 12 * 3 * 4 * 8 * pairs
    assert training_flops(cfg, lengths) == expected
    # One full row: the causal count is (T + 1) / (2 T) of the row-window (PaLM) count.
    row = training_flops(cfg, [12]) - flops_per_token(cfg, 0) * 12
    assert row * 2 * 12 == (flops_per_token(cfg, 12) - flops_per_token(cfg, 0)) * 12 * 13
    assert training_flops(cfg, segment_lengths(torch.zeros(2, 4, dtype=torch.long))) == 0.0


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 SXM5 94GB", 989.5),
    ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.5), ("NVIDIA H200 NVL", 835.5), ("NVIDIA GH200 480GB", 989.5),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA H100", None), ("Tesla T4", None), ("cpu", None),
])
def test_peak_tflops_table(name, tflops):
    from pipeline.model import peak_tflops_of_device
    assert peak_tflops_of_device(name) == tflops


def test_trainer_peak_flops_explicit_or_none_with_notice(caplog):
    """`log.peak_tflops` wins; without it an unknown device (here the CPU) gives no MFU (None)
    and one notice, not a guessed figure."""
    import logging
    from types import SimpleNamespace
    from pipeline.training.metrics import peak_flops_per_device
    assert peak_flops_per_device(SimpleNamespace(log=SimpleNamespace(peak_tflops=500.0))) == 5e14
    if torch.cuda.is_available():
        pytest.skip("the None case needs a device without a table entry")
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert peak_flops_per_device(SimpleNamespace(log=SimpleNamespace(peak_tflops=None))) is None
    assert any("MFU not reported" in r.getMessage() and "log.peak_tflops" in r.getMessage()
               for r in caplog.records)


def test_hidden_states_and_chunked_head_give_the_logits_gradients(model):
    """forward(return_hidden=True) + head_logits per chunk of labelled tokens
    (`objective.labelled_cross_entropy`) == the CE of the full logits: values and every
    parameter's gradient (fp32; megatron's vocab-parallel CE at TP=1)."""
    from pipeline.objective import IGNORE_INDEX, labelled_cross_entropy, token_cross_entropy
    ids, pos, seg = _packed_reorganized(seed=43)
    labels = _ids(2, 20, seed=47)
    labels[:, :3] = IGNORE_INDEX
    labels[seg == 0] = IGNORE_INDEX
    model.train()
    runs = []
    for chunked in (False, True):
        model.zero_grad()
        if chunked:
            hidden = model(ids, pos, segment_ids=seg, return_hidden=True)
            assert hidden.shape == (2, 20, model.cfg.hidden_size)
            ce = labelled_cross_entropy(hidden, model.head_logits, labels, chunk_tokens=6)
        else:
            ce = token_cross_entropy(model(ids, pos, segment_ids=seg), labels)
        (ce.sum() / (labels != IGNORE_INDEX).sum()).backward()   # the mean, as the loss is
        runs.append((ce.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    model.eval()
    model.zero_grad()
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-6)
    for k in runs[0][1]:
        torch.testing.assert_close(runs[1][1][k], runs[0][1][k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("signature", ["torch_2_13", "torch_2_11"])
def test_varlen_attention_matches_masked_sdpa_across_torch_signatures(monkeypatch, signature):
    """attention(kind="varlen") against the dense-mask sdpa path, with a stand-in for
    `varlen_attn` in each signature torch has shipped: 2.13 (`window_size`, `enable_gqa`) and
    2.9-2.12 (`is_causal`, no GQA flag; an H200 run on torch 2.11 failed with
    "unexpected keyword argument 'enable_gqa'" before `_varlen_kwargs`). The stand-in is a
    straightforward per-segment causal softmax attention, written here."""
    import torch.nn.attention.varlen as varlen_mod
    from pipeline.model.attention import AttentionPlan, attention, build_attention_mask, varlen_boundaries

    def reference(q, k, v, cu, causal, gqa):        # q: [N, Hq, D], k/v: [N, Hkv, D]
        if k.shape[1] != q.shape[1]:
            assert gqa, "GQA heads passed to a varlen_attn without enable_gqa"
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        assert causal
        out = torch.empty_like(q)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / q.shape[-1] ** 0.5
            keep = torch.ones(e - s, e - s, dtype=torch.bool).tril()
            probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
            out[s:e] = torch.einsum("hqk,khd->qhd", probs, v[s:e])
        return out

    if signature == "torch_2_13":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                 scale=None, window_size=(-1, -1), enable_gqa=False):
            return reference(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0),
                             enable_gqa)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                 return_aux=None):
            return reference(query, key, value, cu_seq_q, is_causal, False)
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    g = torch.Generator().manual_seed(3)
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1] * 7])
    q = torch.randn(2, 4, 7, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    cu, longest = varlen_boundaries(seg)
    out = attention(q, k, v, AttentionPlan("varlen", cu_seqlens=cu, max_seqlen=longest))
    want = attention(q, k, v, AttentionPlan("sdpa", mask=build_attention_mask(seg, 2, 7)))
    real = seg > 0                        # padding rows differ by design (own 1-token segment)
    assert torch.allclose(out.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=1e-5)


def test_tp1_no_grad_forward_skips_megatron_regions_with_the_same_logits(model, monkeypatch):
    """At TP=1 without autograd the linear layers and the embedding run `F.linear` /
    `F.embedding` (`qwen3._megatron_layers`): megatron's region functions are not called, and
    the logits equal those of megatron's forward (taken with autograd on)."""
    from megatron.core.tensor_parallel import layers
    calls = []
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        real = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    ids, pos = _ids(2, 12, seed=5), torch.arange(12).expand(2, 12)
    ref = model(ids, pos).detach()
    megatron_calls = len(calls)
    calls.clear()
    with torch.no_grad():
        got = model(ids, pos)
    assert megatron_calls > 0 and calls == []
    assert got.shape == (2, 12, 512)
    assert (got - ref).abs().max().item() <= 1e-5
