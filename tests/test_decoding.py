"""pipeline.inference.decoding on a tiny random Qwen3 checkpoint (tests/tiny_qwen3.py).

Oracles: the cache-free reference decoder (`reference_generate`, whole reorganized sequence
recomputed every forward); transformers' Qwen3ForCausalLM (greedy `generate`, and an
independent one-slot-per-step plan-and-commit loop written here on top of it); the same prompts
decoded one by one. The checkpoint's LM head is scaled by 6 so that a random model's
probabilities spread over (0, 1) and the thresholds take effect; float64 keeps cached and
recomputed logits equal to ~1e-12, so no greedy decision can flip between the two.
"""

import pytest
import torch

from tiny_qwen3 import make_scaled_tiny_qwen3

MASK = 511          # the tiny vocab is 512; the last row serves as the mask token
SCALE = 6.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny HF checkpoint with the LM head scaled (sharper, non-flat distributions)."""
    return make_scaled_tiny_qwen3(tmp_path_factory, seed=1, scale=SCALE)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def model(tp1, ckpt):
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    m = Qwen3(config_from_hf(ckpt), dtype=torch.float64, init_weights=False)
    load_hf_into_model(m, ckpt)
    return m.eval()


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 9, 2, 7, 3][:n]
    return [torch.randint(0, 500, (L,), generator=g).tolist() for L in lens]


def _padded(prompts, side):
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    am = torch.zeros(len(prompts), t, dtype=torch.long)
    for i, p in enumerate(prompts):
        if side == "left":
            ids[i, t - len(p):], am[i, t - len(p):] = torch.tensor(p), 1
        else:
            ids[i, :len(p)], am[i, :len(p)] = torch.tensor(p), 1
    return ids, am


# Threshold settings that exercise the fast path, partial acceptance and parallel infill.
SETTINGS = [dict(slot_threshold=0.3, token_threshold=0.5), dict(slot_threshold=0.2,
            token_threshold=0.8), dict(slot_threshold=0.6, token_threshold=0.3)]


@pytest.mark.parametrize("exact", [False, True])
def test_cached_decoder_equals_cache_free_reference(model, exact):
    from decoding_oracle import reference_generate
    from pipeline.inference.decoding import refusion_generate
    prompts = _prompts(3)
    ids, am = _padded(prompts, "left")
    drafts = plans = eos_hits = 0
    for s in SETTINGS:
        eos = None
        for _ in range(2):   # without EOS, then with a token the first run produced as EOS
            out = refusion_generate(model, ids, gen_length=24, slot_size=4, num_blocks=2,
                                    temperature=0.0, mask_id=MASK, eos_id=eos, exact_cache=exact,
                                    attention_mask=am, **s)
            for i, p in enumerate(prompts):
                ref, fw = reference_generate(model, p, 24, 4, 2, mask_id=MASK, eos_id=eos,
                                             exact_cache=exact, **s)
                assert out.tokens[i] == ref, (s, eos, i)
                assert out.forwards[i] == fw, (s, eos, i)
                drafts += fw["draft"]
                plans += fw["plan"]
                eos_hits += eos is not None and ref[-1] == eos
            eos = out.tokens[0][10] if eos is None else eos
    # The settings did exercise parallel draft/verify and multi-slot steps (6 slots per prompt).
    assert drafts > 0
    assert plans < 6 * len(SETTINGS) * 2 * 3
    assert eos_hits >= len(SETTINGS)


def test_default_cache_is_not_the_exact_cache(model):
    """The two cache modes are different models of the committed prefix: on this checkpoint
    they give different text, and each equals its own cache-free recompute (test above)."""
    from pipeline.inference.decoding import refusion_generate
    prompts = _prompts(3)
    a = refusion_generate(model, prompts, 24, 4, 2, 0.2, 0.8, 0.0, MASK, None)
    b = refusion_generate(model, prompts, 24, 4, 2, 0.2, 0.8, 0.0, MASK, None, exact_cache=True)
    assert all(x != y for x, y in zip(a.tokens, b.tokens))
    assert a.forwards == b.forwards   # the re-encode rides along with the next plan forward


def _hf_one_slot_per_step(hf, prompt, G, k, num_blocks, eos):
    """Independent plan-and-commit loop for slot_threshold > 1 (one slot per step) and
    token_threshold 0 (the whole drafted slot accepted): every step recomputes prompt +
    committed slots (commit order, original positions) + the block's remaining masks with
    transformers, commits the slot whose first token is most probable, stops the slots after an
    EOS. Returns (tokens in natural order ending at the first EOS, commit order of slots)."""
    P = len(prompt)
    seq = [(t, i) for i, t in enumerate(prompt)]
    state = ["masked"] * (G // k)
    order = []
    per = len(state) // num_blocks
    for blk in range(num_blocks):
        while True:
            todo = [s for s in range(blk * per, (blk + 1) * per) if state[s] == "masked"]
            if not todo:
                break
            ids = [t for t, _ in seq] + [MASK] * (k * len(todo))
            pos = [q for _, q in seq] + [P + s * k + j for s in todo for j in range(k)]
            with torch.no_grad():
                lg = hf(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
            pr = lg[len(seq):].softmax(-1)
            best = pr.argmax(-1)
            scores = [float(pr[i * k, best[i * k]]) for i in range(len(todo))]
            i = scores.index(max(scores))
            s = todo[i]
            toks = best[i * k:(i + 1) * k].tolist()
            if eos in toks:
                toks = toks[:toks.index(eos) + 1]
            seq += [(t, P + s * k + j) for j, t in enumerate(toks)]
            state[s] = "done"
            order.append(s)
            if eos in toks:
                q = P + s * k + len(toks) - 1
                state = [("dropped" if st == "masked" and P + x * k > q else st)
                         for x, st in enumerate(state)]
    out = [t for q, t in sorted((q, t) for t, q in seq if q >= P)]
    if eos in out:
        out = out[:out.index(eos) + 1]
    return out, order


def test_slot_threshold_above_one_decodes_one_slot_per_step(model, hf_model):
    from pipeline.inference.decoding import refusion_generate
    prompts = _prompts(2, seed=3)
    out = refusion_generate(model, prompts, 20, 4, 1, slot_threshold=1.5, token_threshold=0.0,
                            temperature=0.0, mask_id=MASK, eos_id=None)
    for i, p in enumerate(prompts):
        ref, order = _hf_one_slot_per_step(hf_model, p, 20, 4, 1, eos=None)
        assert out.tokens[i] == ref
        assert order != sorted(order)           # slots really were decoded out of order
        assert dict(out.forwards[i]) == {"plan": 5, "verify": 5}
        assert out.tpf(i) == pytest.approx(20 / 10)


def test_token_threshold_zero_accepts_whole_slots(model, hf_model):
    """slot_threshold 0 selects every slot, token_threshold 0 accepts every drafted token: one
    plan and one verify per block, and the text is the plan's argmax over prompt + masks."""
    from pipeline.inference.decoding import refusion_generate
    p = _prompts(1, seed=4)[0]
    out = refusion_generate(model, [p], 16, 4, 1, slot_threshold=0.0, token_threshold=0.0,
                            temperature=0.0, mask_id=MASK, eos_id=None)
    ids = torch.tensor([p + [MASK] * 16])
    with torch.no_grad():
        lg = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    assert out.tokens[0] == lg[len(p):].argmax(-1).tolist()
    assert dict(out.forwards[0]) == {"plan": 1, "verify": 1}
    assert out.tpf(0) == 8.0


def test_eos_after_is_discarded_before_is_still_decoded(model, hf_model):
    from pipeline.inference.decoding import refusion_generate
    # Find a prompt whose first committed slot is not the first slot; make its first token EOS.
    for seed in range(20):
        p = _prompts(1, seed=seed)[0]
        free, order = _hf_one_slot_per_step(hf_model, p, 24, 4, 1, eos=None)
        if order[0] not in (0, 5):
            break
    else:
        pytest.fail("no prompt commits a middle slot first")
    eos = free[order[0] * 4]
    ref, ref_order = _hf_one_slot_per_step(hf_model, p, 24, 4, 1, eos=eos)
    out = refusion_generate(model, [p], 24, 4, 1, slot_threshold=1.5, token_threshold=0.0,
                            temperature=0.0, mask_id=MASK, eos_id=eos)
    assert out.tokens[0] == ref
    assert out.tokens[0][-1] == eos and out.tokens[0].count(eos) == 1
    # Slots after the EOS were never decoded; the ones before it were.
    q = out.tokens[0].index(eos)
    assert q <= order[0] * 4 and len(ref_order) == q // 4 + 1
    assert sum(out.forwards[0].values()) == 2 * len(ref_order)
    assert out.tpf(0) == pytest.approx(len(ref) / (2 * len(ref_order)))


def test_eos_in_left_to_right_blocks_ends_output(model):
    """One slot per block = left-to-right slots: the text before the EOS cannot depend on it,
    so the output is the EOS-free output cut after its first EOS, and decoding stops there."""
    from pipeline.inference.decoding import refusion_generate
    p = _prompts(1, seed=5)[0]
    free = refusion_generate(model, [p], 24, 4, 6, 0.5, 0.5, 0.0, MASK, None).tokens[0]
    eos = free[13]
    q = free.index(eos)
    out = refusion_generate(model, [p], 24, 4, 6, 0.5, 0.5, 0.0, MASK, eos)
    assert out.tokens[0] == free[:q + 1]
    assert out.forwards[0]["plan"] == q // 4 + 1


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_equals_one_by_one(model, side):
    from pipeline.inference.decoding import ar_generate, refusion_generate
    prompts = _prompts(4, seed=6)
    ids, am = _padded(prompts, side)
    kw = dict(gen_length=16, slot_size=4, num_blocks=2, slot_threshold=0.3,
              token_threshold=0.6, temperature=0.0, mask_id=MASK, eos_id=11)
    batch = refusion_generate(model, ids, attention_mask=am, **kw)
    arb = ar_generate(model, ids, 10, 0.0, 11, attention_mask=am)
    assert batch.batch_forwards < sum(batch.num_forwards(i) for i in range(4))
    for i, p in enumerate(prompts):
        one = refusion_generate(model, [p], **kw)
        assert batch.tokens[i] == one.tokens[0]
        assert batch.forwards[i] == one.forwards[0]
        assert arb.tokens[i] == ar_generate(model, [p], 10, 0.0, 11).tokens[0]


def test_ar_mode_equals_transformers_greedy_generate(model, hf_model):
    from pipeline.inference.decoding import ar_generate
    prompts = _prompts(3, seed=7)
    out = ar_generate(model, prompts, gen_length=12, temperature=0.0, eos_id=None)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.tokens[i] == ref[0, len(p):].tolist()
        assert dict(out.forwards[i]) == {"prefill": 1, "ar": 11}
    # With an EOS: stops at it (kept), as transformers does.
    eos = out.tokens[0][5]
    cut = ar_generate(model, prompts[:1], 12, 0.0, eos).tokens[0]
    assert cut == out.tokens[0][:out.tokens[0].index(eos) + 1]


def test_sampling_is_seeded_and_arguments_are_checked(model):
    from pipeline.inference.decoding import refusion_generate
    p = _prompts(2, seed=8)
    kw = dict(gen_length=16, slot_size=4, num_blocks=2, slot_threshold=0.3,
              token_threshold=0.6, temperature=1.0, mask_id=MASK, eos_id=None)
    a = refusion_generate(model, p, seed=1, **kw).tokens
    assert a == refusion_generate(model, p, seed=1, **kw).tokens
    assert a != refusion_generate(model, p, seed=2, **kw).tokens
    with pytest.raises(ValueError, match="num_blocks"):
        refusion_generate(model, p, 16, 4, 3, 0.5, 0.5, 0.0, MASK, None)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        refusion_generate(model, p, 1024, 4, 1, 0.5, 0.5, 0.0, MASK, None)


def _tp2_decode(rank, world_size, ckpt, prompts):
    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    from pipeline.parallel import init_distributed
    init_distributed(tensor_parallel_size=2)
    m = Qwen3(config_from_hf(ckpt, tp_size=2), dtype=torch.float64, init_weights=False)
    load_hf_into_model(m, ckpt)
    m.eval()
    a = refusion_generate(m, prompts, 16, 4, 2, 0.3, 0.6, 0.0, MASK, 11)
    b = ar_generate(m, prompts, 8, 0.0, 11)
    return a.tokens, [dict(f) for f in a.forwards], b.tokens


def test_tensor_parallel_decode_equals_single_process(model, ckpt):
    """TP=2 (heads and vocab split over 2 gloo processes, logits all-gathered): every rank
    decodes the same tokens as the single-process model."""
    from distributed import run_distributed
    from pipeline.inference.decoding import ar_generate, refusion_generate
    prompts = _prompts(3, seed=9)
    one = refusion_generate(model, prompts, 16, 4, 2, 0.3, 0.6, 0.0, MASK, 11)
    ar = ar_generate(model, prompts, 8, 0.0, 11)
    for toks, fw, ar_toks in run_distributed(_tp2_decode, 2, (str(ckpt), prompts)):
        assert toks == one.tokens
        assert fw == [dict(f) for f in one.forwards]
        assert ar_toks == ar.tokens
