"""The decoding machinery on the CPU: the in-place KV cache, the device-built decode mask, the
one-copy batch transfer, bucketed / fixed attention widths, and AR decoding against transformers'
`generate` with its static cache (bench/bench_decoding.py's comparison).

Oracles: recomputing without a cache (`Qwen3.forward` on the whole committed sequence), a mask
written as a plain loop, the cache-free decoder (`tests/decoding_oracle.py`), transformers'
Qwen3ForCausalLM. float64 keeps cached and recomputed logits equal to ~1e-12, so no greedy
decision can flip between them; the CUDA-only branches (graph capture, pinned SDPA backends) are
not reached here (bench/gpu_decode_check.py runs them).
"""
import sys
from pathlib import Path

import pytest
import torch

from tiny_qwen3 import make_tiny_qwen3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

MASK = 511
ATOL = 1e-9


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny checkpoint with the LM head scaled by 6 (as tests/test_decoding.py: probabilities
    spread over (0, 1), so the refusion thresholds take effect)."""
    from transformers import Qwen3ForCausalLM
    src = make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=1)
    hf = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    out = tmp_path_factory.mktemp("tiny") / "scaled"
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def model(tp1, ckpt):
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    m = Qwen3(config_from_hf(ckpt), dtype=torch.float64, init_weights=False)
    load_hf_into_model(m, ckpt)
    return m.eval()


def _loop_mask(length, t, columns, new, cached):
    """decode_mask written as loops over (row, query, column)."""
    b = len(length)
    out = torch.zeros(b, 1, t, columns, dtype=torch.bool)
    for r in range(b):
        L = int(length[r])
        for i in range(t):
            for c in range(columns):
                if c < L:
                    out[r, 0, i, c] = True if cached is None else (
                        c < cached.shape[-1] and bool(cached[r, i, c]))
                elif c - L < t:
                    j = c - L
                    out[r, 0, i, c] = (j <= i) if new is None else bool(new[r, i, j])
            if not out[r, 0, i].any():
                out[r, 0, i, L + i] = True
    return out


@pytest.mark.parametrize("with_masks", [False, True])
def test_decode_mask_equals_a_plain_loop(with_masks):
    from pipeline.model.attention import decode_mask, plan_decode_attention
    g = torch.Generator().manual_seed(0)
    length = torch.tensor([0, 3, 7, 5])
    t, width = 4, 7
    columns = 16                       # bucketed: more columns than width + t
    new = cached = None
    if with_masks:
        new = torch.rand(4, t, t, generator=g) < 0.5
        new[0, 2] = False              # a query that sees nothing: falls back to itself
        cached = torch.rand(4, t, width, generator=g) < 0.7
    got = decode_mask(length, t, columns, new, cached)
    assert torch.equal(got, _loop_mask(length, t, columns, new, cached))
    # The plan's bias: 0 where allowed, -inf elsewhere, rows repeated for each folded head.
    plan = plan_decode_attention(length, t, columns, torch.float64, 3, new, cached)
    assert plan.kind == "decode" and plan.mask.shape == (4, 1, 3 * t, columns)
    for h in range(3):
        rows = plan.mask[:, :, h * t:(h + 1) * t]
        assert torch.equal(rows == 0, got) and torch.isinf(rows[~got]).all()


def test_decode_attention_folds_gqa_like_repeated_heads():
    """Kind "decode" (query heads folded onto their key/value head) equals SDPA over keys and
    values repeated per query head, with the same mask."""
    import torch.nn.functional as F
    from pipeline.model.attention import attention, decode_mask, plan_decode_attention
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, t, s, d = 2, 6, 2, 3, 9, 8
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    length = torch.tensor([2, 6])
    plan = plan_decode_attention(length, t, s, torch.float64, hq // hkv)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                         attn_mask=decode_mask(length, t, s))
    assert (attention(q, k, v, plan) - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("bucket,fixed", [(1, False), (8, False), (8, True)])
def test_in_place_cache_equals_recompute(model, bucket, fixed):
    """Ragged rows, a reordered commit (entries moved inside the storage), storage growth for a
    forward wider than the capacity, bucketed and fixed attention widths: every cached forward's
    logits equal recomputing the committed sequence (commit order) plus the new tokens."""
    from pipeline.model import KVCache
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (2, 40), generator=g)
    pos = torch.arange(40).expand(2, 40)
    cache = KVCache.for_model(model, batch_size=2, capacity=12, bucket=bucket)
    cache.fixed_width = fixed
    assert cache.storage_columns % bucket == 0 and cache.storage_columns >= 12
    seqs = [[], []]   # committed (token, position) per row, in commit order

    def check(logits, new_ids, new_pos, rows_t):
        for r in range(2):
            n = rows_t[r]
            seq = seqs[r] + list(zip(new_ids[r, :n].tolist(), new_pos[r, :n].tolist()))
            ref = model(torch.tensor([[s[0] for s in seq]]), torch.tensor([[s[1] for s in seq]]))
            assert (logits[r, :n] - ref[0, -n:]).abs().max().item() <= ATOL

    with torch.no_grad():
        # Prefill of unequal lengths (row 1 commits 3 of the 5 tokens fed).
        logits = model(ids[:, :5], pos[:, :5], kv_cache=cache)
        check(logits, ids[:, :5], pos[:, :5], [5, 5])
        cache.commit(torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]))
        seqs[0] += list(zip(ids[0, :5].tolist(), range(5)))
        seqs[1] += list(zip(ids[1, :3].tolist(), range(3)))
        assert cache.length.tolist() == [5, 3] and cache.width == 5
        # 14 new tokens: width + 14 > storage, so the storage grows; nothing committed yet.
        version = cache.version
        logits = model(ids[:, 5:19], pos[:, 5:19], kv_cache=cache)
        assert cache.version > version and cache.storage_columns >= 19
        assert cache.storage_columns % bucket == 0
        check(logits, ids[:, 5:19], pos[:, 5:19], [14, 14])
        # Commit out of order: row 0 keeps new tokens [3, 1] (in that order), row 1 keeps
        # [0, 2, 1]. The mask lets each kept token see the prefix and the kept tokens before it
        # in commit order (the others: prefix and themselves), so the committed entries equal
        # a causal forward of the prefix plus the kept tokens in commit order.
        cache.discard_pending()
        order = torch.full((2, 4), 99)
        order[0, [3, 1]] = torch.tensor([0, 1])
        order[1, [0, 2, 1]] = torch.tensor([0, 1, 2])
        new_mask = (order[:, None, :] <= order[:, :, None]) & (order[:, None, :] < 99)
        new_mask |= torch.eye(4, dtype=torch.bool)
        model(ids[:, 19:23], pos[:, 19:23], attention_mask=new_mask[:, None], kv_cache=cache)
        cache.commit(torch.tensor([[3, 1, -1], [0, 2, 1]]))
        seqs[0] += [(int(ids[0, 19 + j]), 19 + j) for j in (3, 1)]
        seqs[1] += [(int(ids[1, 19 + j]), 19 + j) for j in (0, 2, 1)]
        assert cache.length.tolist() == [7, 6] and cache.width == 7
        # Steps of one token per row, committed in fed order (nothing moves).
        for step in range(3):
            p = 30 + step
            logits = model(ids[:, p:p + 1], pos[:, p:p + 1], kv_cache=cache)
            check(logits, ids[:, p:p + 1], pos[:, p:p + 1], [1, 1])
            cache.commit()
            for r in range(2):
                seqs[r].append((int(ids[r, p]), p))
        assert cache.length.tolist() == [10, 9]
        with pytest.raises(ValueError, match="exceed capacity 12"):
            model(ids[:, 33:36], pos[:, 33:36], kv_cache=cache)
            cache.commit()


def test_pack_is_one_copy_and_round_trips():
    from pipeline.inference.driver import _pack
    g = torch.Generator().manual_seed(2)
    committed = torch.tensor([[0, 1, -1], [2, -1, -1], [0, 1, 2]])
    ids = torch.randint(0, 150000, (2, 5), generator=g)
    pos = torch.randint(0, 4000, (2, 5), generator=g)
    mask = torch.rand(2, 5, 5, generator=g) < 0.5
    b = _pack(committed, ids, pos, mask, torch.device("cpu"))
    assert torch.equal(b.committed, committed) and torch.equal(b.ids, ids)
    assert torch.equal(b.positions, pos) and torch.equal(b.mask, mask[:, None])
    b = _pack(None, ids, pos, None, torch.device("cpu"))
    assert b.committed is None and b.mask is None and torch.equal(b.positions, pos)


def test_driver_copies_to_the_device_once_per_forward(model, monkeypatch):
    """Each batched forward's inputs and the previous commit reach the device in one copy
    (`host_to_device`); rows leaving the batch add one copy of the row index."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.model import kv_cache
    calls = []
    real = kv_cache.host_to_device
    monkeypatch.setattr(kv_cache, "host_to_device",
                        lambda t, d: calls.append(tuple(t.shape)) or real(t, d))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    out = ar_generate(model, prompts, 6, 0.0, None)
    assert len(calls) == out.batch_forwards == 6
    calls.clear()
    out = refusion_generate(model, prompts, 16, 4, 2, 0.3, 0.6, 0.0, MASK, None)
    finished_early = int(out.num_forwards(0) != out.num_forwards(1))
    assert len(calls) == out.batch_forwards + finished_early


@pytest.fixture
def cache_kind(monkeypatch, request):
    """Decode with every KVCache made with `bucket` columns of granularity, or at its full
    storage width (`fixed_width`), instead of the CPU default (bucket 1)."""
    from pipeline.model import KVCache
    bucket, fixed = request.param
    real = KVCache.for_model.__func__

    def for_model(cls, model, batch_size, capacity, requested=None):
        c = real(cls, model, batch_size, capacity, bucket=bucket)
        c.fixed_width = fixed
        return c
    monkeypatch.setattr(KVCache, "for_model", classmethod(for_model))
    return request.param


@pytest.mark.parametrize("cache_kind", [(8, False), (16, True)], indirect=True)
def test_bucketed_and_fixed_width_decodes_equal_the_cache_free_oracle(model, cache_kind):
    from decoding_oracle import reference_generate
    from pipeline.inference.decoding import ar_generate, refusion_generate
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 9, 2)]
    for exact, s in ((False, dict(slot_threshold=0.3, token_threshold=0.5)),
                     (True, dict(slot_threshold=0.2, token_threshold=0.8))):
        out = refusion_generate(model, prompts, 16, 4, 2, temperature=0.0, mask_id=MASK,
                                eos_id=None, exact_cache=exact, **s)
        for i, p in enumerate(prompts):
            ref, fw = reference_generate(model, p, 16, 4, 2, mask_id=MASK, eos_id=None,
                                         exact_cache=exact, **s)
            assert out.tokens[i] == ref and out.forwards[i] == fw, (exact, i)
    ar = ar_generate(model, prompts, 8, 0.0, None)
    for i, p in enumerate(prompts):
        assert ar.tokens[i] == _greedy_uncached(model, p, 8)


def _greedy_uncached(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_ar_generate_equals_transformers_static_cache_generate(model):
    """bench/bench_decoding.py's comparison on the tiny weights: transformers' copy of our
    weights gives our logits, and its `generate` with the static cache (left-padded batch)
    gives our greedy tokens for every prompt; the figures are reported."""
    from bench_decoding import compare_with_transformers, hf_twin
    hf = hf_twin(model)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        ours = model(ids, torch.arange(6)[None])
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-9
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]
    c = compare_with_transformers(model, prompts, 10, 1, "auto", hf=hf)
    assert c["same_tokens"] == c["prompts"] == 4
    assert c["ours_tokens"] == c["hf_tokens"] and all(len(t) == 10 for t in c["ours_tokens"])
    assert c["hf_mode"] == "eager"                      # transformers compiles on CUDA only
    assert c["ratio"] == pytest.approx(c["ours_tokens_per_s"] / c["hf_tokens_per_s"])
    with pytest.raises(ValueError, match="hf_compile"):
        compare_with_transformers(model, prompts, 10, 1, "always", hf=hf)


def test_bench_decoding_vs_transformers_line(tmp_path):
    """`bench/bench_decoding.py --vs-transformers` (tiny random model, CPU) appends one line
    with both tokens/s, their ratio and the identical-token count (all prompts here)."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("MASTER_PORT", None)
    r = subprocess.run([sys.executable, str(root / "bench" / "bench_decoding.py"), "--device",
                        "cpu", "--data", str(tmp_path / "none"), "--prompts", "2",
                        "--gen-length", "4", "--num-blocks", "1", "--repeats", "1",
                        "--vs-transformers"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith("ar vs transformers generate (static cache, eager; same weights "
                           "and 2 prompts, greedy, no EOS, 4 tokens each): ours "), last
    assert "ratio " in last and last.endswith("identical tokens 2/2 prompts"), last
