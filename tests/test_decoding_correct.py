"""pipeline.inference.decoding with verify="correct" (the AR head corrects rejected drafts).

Oracles: `ar_generate` (itself equal to transformers' greedy `generate`, tests/test_decoding.py)
for the property "one slot per block, token threshold >= 0.5, greedy: the output equals AR
decoding"; and a cache-free decoder written here (`_correct_reference`: every forward recomputes
the committed sequence in commit order, the AR head's prediction of a position read off the
committed token before it) for parallel and out-of-order slots.

Two models: the random tiny checkpoint of test_decoding (LM head scaled, float64: drafts are
rarely the AR head's choice, so corrections dominate) and a tiny model trained here for a few
hundred steps on a toy language with the hybrid objective (AR + ReFusion), whose drafts are
mostly accepted; one position of each answer is random, so some drafts are rejected and
corrected.
"""
import numpy as np
import pytest
import torch

from tiny_qwen3 import make_scaled_tiny_qwen3, make_tiny_qwen3

MASK = 511
SCALE = 6.0


@pytest.fixture(scope="module")
def random_model(tp1, tmp_path_factory):
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    out = make_scaled_tiny_qwen3(tmp_path_factory, seed=1, scale=SCALE)
    m = Qwen3(config_from_hf(out), dtype=torch.float64, init_weights=False)
    load_hf_into_model(m, out)
    return m.eval()


# ------------------------------------------------------------------ a toy language, trained

T_VOCAB, T_MASK, T_EOS = 64, 63, 62
ANSWER = 16                 # answer tokens before EOS
NOISE_AT = 11               # this answer position holds a random token (unpredictable)
STEPS, BATCH = 200, 16      # training of the toy model
PHRASES = np.random.default_rng(0).integers(10, 60, size=(4, ANSWER))


def _toy_example(rng):
    """prompt [class c, token r]; answer = phrase c with r at position 3, r+1 at 8, a random
    token at NOISE_AT; then EOS."""
    c, r = int(rng.integers(4)), int(rng.integers(10, 58))
    ans = PHRASES[c].copy()
    ans[3], ans[8], ans[NOISE_AT] = r, r + 1, int(rng.integers(10, 60))
    return [c, r], [int(x) for x in ans] + [T_EOS]


@pytest.fixture(scope="module")
def trained_model(tp1, tmp_path_factory):
    """A tiny Qwen3 trained STEPS Adam steps (float32) on the toy language, returned in float64:
    each step's loss is the AR loss of one batch plus the ReFusion loss (AR + MDM, slots of 4)
    of another, like AR pretraining followed by ReFusion fine-tuning, in one go."""
    from pipeline.model.hf import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3
    from pipeline.objective import ObjectiveConfig, collate, hybrid_loss, reorganize_sample
    src = make_tiny_qwen3(tmp_path_factory.mktemp("toy") / "hf", seed=2, vocab_size=T_VOCAB,
                          max_position_embeddings=64, initializer_range=0.02)
    m = Qwen3(config_from_hf(src), dtype=torch.float32, init_weights=False)
    load_hf_into_model(m, src)
    torch.manual_seed(0)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    rng = np.random.default_rng(1)
    cfgs = (ObjectiveConfig(mode="ar"), ObjectiveConfig(mode="refusion"))
    L = 2 + ANSWER + 1
    for step in range(STEPS):
        loss = 0.0
        for cfg in cfgs:
            rows = []
            for b in range(BATCH):
                p, a = _toy_example(rng)
                seg = [{"start": 0, "end": L, "prompt_length": 2,
                        "slot_starts": list(range(2, L, 4))}]
                rows.append([reorganize_sample(np.array(p + a), seg, f"s{step}_{b}", seed=0,
                                               epoch=0, mask_id=T_MASK, cfg=cfg)])
            batch = collate(rows, L, pad_id=0)
            logits = m(batch["input_ids"], batch["position_ids"],
                       segment_ids=batch["segment_ids"])
            loss = loss + hybrid_loss(logits, batch, cfg)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    m64 = Qwen3(m.cfg, dtype=torch.float64, init_weights=False)
    trained = dict(m.named_parameters())
    with torch.no_grad():
        for name, p in m64.named_parameters():
            p.copy_(trained[name])
    return m64.eval()


# ------------------------------------------------------------------ cache-free oracle


@torch.no_grad()
def _correct_reference(model, prompt, G, k, num_blocks, slot_threshold, token_threshold,
                       mask_id, eos):
    """verify="correct", greedy, from docs/METHOD.md "The corrected verify", without a cache:
    each forward recomputes prompt + committed tokens (commit order, original positions, plain
    causal) + the step's tokens. Returns (output, Counter of forwards)."""
    from collections import Counter
    P = len(prompt)
    seq = [(t, i) for i, t in enumerate(prompt)]       # (token, position) in commit order
    fw = Counter()

    def forward(kind, toks, poss):
        fw[kind] += 1
        ids = torch.tensor([[t for t, _ in seq] + toks])
        pos = torch.tensor([[q for _, q in seq] + poss])
        lg = model(ids, pos)[0].double()
        return lg[:len(seq)], lg[len(seq):]

    def committed():
        return {q: i for i, (_, q) in enumerate(seq)}

    def eos_pos():
        qs = [q for t, q in seq if t == eos and q >= P]
        return min(qs) if qs else None

    def open_(o):
        e = eos_pos()
        return P + o not in committed() and (e is None or P + o < e)

    per = (G // k) // num_blocks
    for blk in range(num_blocks):
        while True:
            slots = [s for s in range(blk * per, (blk + 1) * per)
                     if any(open_(o) for o in range(s * k, (s + 1) * k))]
            if not slots:
                break
            offs = [[o for o in range(s * k, (s + 1) * k) if open_(o)] for s in slots]
            _, lg = forward("plan", [mask_id] * sum(map(len, offs)),
                            [P + o for os_ in offs for o in os_])
            pr = lg.softmax(-1)
            draft = pr.argmax(-1).tolist()
            heads = np.cumsum([0] + [len(x) for x in offs[:-1]])
            score = [float(pr[h, draft[h]]) for h in heads]
            pick = [i for i, sc in enumerate(score) if sc > slot_threshold]
            pick = pick or [int(np.argmax(score))]
            d_off = [o for i in pick for o in offs[i]]
            d_tok = [draft[heads[i] + j] for i in pick for j in range(len(offs[i]))]
            old, lg = forward("verify", d_tok, [P + o for o in d_off])
            where = committed()
            new = []
            extra = None
            for i, (o, d) in enumerate(zip(d_off, d_tok)):
                if i > 0 and d_off[i - 1] == o - 1:
                    v = lg[i - 1]
                elif P + o - 1 in where:
                    v = old[where[P + o - 1]]
                else:
                    v = None
                if v is not None and d != int(v.argmax()) \
                        and not float(v.softmax(-1)[d]) > token_threshold:
                    extra = (int(v.argmax()), P + o)
                    break
                new.append((d, P + o))
                if d == eos:
                    break
            seq += new
            if extra is None and len(new) == len(d_tok) and eos not in d_tok:
                if d_off[-1] + 1 < G and open_(d_off[-1] + 1):
                    extra = (int(lg[-1].argmax()), P + d_off[-1] + 1)
            if extra is not None:
                seq.append(extra)
    e = eos_pos()
    out = sorted((q, t) for t, q in seq if q >= P and (e is None or q <= e))
    assert [q for q, _ in out] == list(range(P, P + len(out)))
    return [t for _, t in out], fw


def _prompts(n, seed, lo=0, hi=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (L,), generator=g).tolist() for L in [5, 9, 2, 7, 3][:n]]


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("k,thr", [(4, 0.5), (4, 0.9), (3, 0.6)])
def test_left_to_right_equals_ar_decoding_on_a_random_model(random_model, k, thr):
    from pipeline.inference.decoding import ar_generate, refusion_generate
    prompts = _prompts(3, seed=11)
    G = 6 * k
    ar = ar_generate(random_model, prompts, G, 0.0, None)
    out = refusion_generate(random_model, prompts, G, k, G // k, 0.9, thr, 0.0, MASK, None,
                            verify="correct")
    assert out.tokens == ar.tokens
    # With an EOS (a token the AR decode produced): both stop there.
    eos = ar.tokens[0][G // 2]
    ar_e = ar_generate(random_model, prompts, G, 0.0, eos)
    out_e = refusion_generate(random_model, prompts, G, k, G // k, 0.9, thr, 0.0, MASK, eos,
                              verify="correct")
    assert out_e.tokens == ar_e.tokens and ar_e.tokens[0][-1] == eos
    for i in range(3):   # each step is one plan + one verify
        assert out.forwards[i]["plan"] == out.forwards[i]["verify"]
        assert set(out.forwards[i]) == {"plan", "verify"}


def test_trained_model_left_to_right_equals_ar_at_tpf_above_one(trained_model):
    """The property of issue 20: one slot per block, token threshold >= 0.5, greedy: the
    output equals AR decoding token for token, and since drafts are accepted, TPF > 1. The
    authors' decoder on the same model and settings does not reproduce AR decoding (its drafts
    are sometimes wrong and never corrected), so the equality is the correction's doing."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    rng = np.random.default_rng(5)
    prompts = [_toy_example(rng)[0] for _ in range(12)]
    G = 20
    ar = ar_generate(trained_model, prompts, G, 0.0, T_EOS)
    assert sum(t[-1] == T_EOS for t in ar.tokens) >= 10          # the model learned the form
    for k, thr in ((4, 0.5), (4, 0.9), (2, 0.7)):
        out = refusion_generate(trained_model, prompts, G, k, G // k, 0.9, thr, 0.0, T_MASK,
                                T_EOS, verify="correct")
        assert out.tokens == ar.tokens, (k, thr)
        tokens = sum(map(len, out.tokens))
        forwards = sum(out.num_forwards(i) for i in range(len(prompts)))
        assert tokens / forwards > 1.0, (k, thr, tokens, forwards)
        # Tokens committed together by one forward: more than one at a time somewhere.
        assert any(max(np.bincount(f)) > 2 for f in out.commit_forward)
    authors = refusion_generate(trained_model, prompts, G, 4, G // 4, 0.9, 0.9, 0.0, T_MASK,
                                T_EOS, verify="authors")
    assert authors.tokens != ar.tokens


@pytest.mark.parametrize("setting", [dict(k=4, blocks=2, slot_thr=0.3, tok_thr=0.5),
                                     dict(k=4, blocks=1, slot_thr=0.0, tok_thr=0.9),
                                     dict(k=2, blocks=2, slot_thr=0.5, tok_thr=0.2)])
def test_parallel_slots_equal_the_cache_free_reference(random_model, trained_model, setting):
    """Several slots per step, slots planned ahead of the ones before them, thresholds below
    0.5: the cached decoder equals the cache-free recompute, forward for forward."""
    from pipeline.inference.decoding import refusion_generate
    s = setting
    rng = np.random.default_rng(7)
    cases = [(random_model, _prompts(3, seed=12), MASK, 24, None),
             (trained_model, [_toy_example(rng)[0] for _ in range(4)], T_MASK, 24, T_EOS)]
    multi = 0
    for model, prompts, mask, G, eos in cases:
        out = refusion_generate(model, prompts, G, s["k"], s["blocks"], s["slot_thr"],
                                s["tok_thr"], 0.0, mask, eos, verify="correct")
        for i, p in enumerate(prompts):
            ref, fw = _correct_reference(model, p, G, s["k"], s["blocks"], s["slot_thr"],
                                         s["tok_thr"], mask, eos)
            assert out.tokens[i] == ref
            assert out.forwards[i] == fw
            multi += fw["plan"] < len(ref)
    assert multi > 0


def test_verify_is_checked(random_model):
    from pipeline.inference.decoding import refusion_generate
    with pytest.raises(ValueError, match="verify must be one of authors, correct, draft_ahead, "
                                         "draft_every"):
        refusion_generate(random_model, [[1, 2]], 8, 4, 1, 0.5, 0.5, 0.0, MASK, None,
                          verify="fix")


# ------------------------------------------------------------------ verify="draft_ahead"


@torch.no_grad()
def _draft_ahead_reference(model, prompt, G, k, token_threshold, mask_id, eos):
    """verify="draft_ahead", greedy, from docs/METHOD.md "Drafting inside the verify forward",
    without a cache: every forward recomputes prompt + committed tokens (natural order, plain
    causal) + this step's drafts and masks. Returns (output, Counter of forwards)."""
    from collections import Counter
    P = len(prompt)
    seq = list(prompt)                  # committed, natural order = commit order here
    ahead: dict[int, int] = {}          # offset -> the latest prediction to draft it with
    fw = Counter()
    while len(seq) - P < G:
        cur = len(seq) - P
        end = min((cur // k + 1) * k, G)
        drafts = [ahead[o] for o in range(cur, end) if o in ahead]
        assert len(drafts) in (0, end - cur)
        masks = list(range(cur + len(drafts), min(end + k, G)))
        fw["verify" if drafts else "plan"] += 1
        fed = seq + drafts + [mask_id] * len(masks)
        lg = model(torch.tensor([fed]), torch.tensor([list(range(len(fed)))]))[0].double()
        judge = lg[len(seq) - 1:len(seq) - 1 + len(drafts) + 1]   # AR logits for cur, cur+1, ...
        new, stop = [], False
        for i, d in enumerate(drafts):
            pr = judge[i].softmax(-1)
            if d != int(pr.argmax()) and not float(pr[d]) > token_threshold:
                new.append(int(pr.argmax()))
                break
            new.append(d)
            if d == eos:
                stop = True
                break
        else:
            if cur + len(drafts) < G:
                new.append(int(judge[len(drafts)].argmax()))
        seq += new
        if stop or (eos is not None and new[-1] == eos):
            break
        preds = drafts + lg[len(seq) - len(new) + len(drafts):].argmax(-1).tolist()
        ahead = {cur + i: t for i, t in enumerate(preds) if cur + i >= len(seq) - P}
    return seq[P:], fw


@pytest.mark.parametrize("k,thr", [(4, 0.5), (4, 0.9), (3, 0.6)])
def test_draft_ahead_equals_ar_decoding_on_a_random_model(random_model, k, thr):
    """Greedy, token threshold >= 0.5: the output is AR decoding's, with and without an EOS
    inside; every forward after the first is a verify that also drafts."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    prompts = _prompts(4, seed=13)
    G = 6 * k
    for eos in (None, "mid"):
        if eos == "mid":
            eos = ar.tokens[0][G // 2]          # a token the AR decode produced
        ar = ar_generate(random_model, prompts, G, 0.0, eos)
        out = refusion_generate(random_model, prompts, G, k, 1, 0.9, thr, 0.0, MASK, eos,
                                verify="draft_ahead")
        assert out.tokens == ar.tokens, (k, thr, eos)
        for i in range(len(prompts)):
            assert out.forwards[i]["plan"] == 1
            assert set(out.forwards[i]) <= {"plan", "verify"}
    assert ar.tokens[0][-1] == eos and len(ar.tokens[0]) < G


def test_draft_ahead_on_the_trained_model_equals_ar_at_higher_tpf_than_correct(trained_model):
    """The trained toy model's drafts are mostly accepted: draft_ahead equals AR decoding (EOS
    at the end of every answer), commits more than one token per forward, and needs fewer
    forwards than the plan + verify of verify="correct" on the same prompts."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    rng = np.random.default_rng(5)
    prompts = [_toy_example(rng)[0] for _ in range(12)]
    G = 20
    ar = ar_generate(trained_model, prompts, G, 0.0, T_EOS)
    assert sum(t[-1] == T_EOS for t in ar.tokens) >= 10
    for k, thr in ((4, 0.5), (4, 0.9), (2, 0.7)):
        out = refusion_generate(trained_model, prompts, G, k, 1, 0.9, thr, 0.0, T_MASK, T_EOS,
                                verify="draft_ahead")
        assert out.tokens == ar.tokens, (k, thr)
        corr = refusion_generate(trained_model, prompts, G, k, G // k, 0.9, thr, 0.0, T_MASK,
                                 T_EOS, verify="correct")
        fwd = sum(out.num_forwards(i) for i in range(len(prompts)))
        fwd_corr = sum(corr.num_forwards(i) for i in range(len(prompts)))
        tokens = sum(map(len, out.tokens))
        assert tokens / fwd > 1.0 and fwd < fwd_corr, (k, thr, tokens, fwd, fwd_corr)
        assert any(max(np.bincount(f)) > 2 for f in out.commit_forward)


@pytest.mark.parametrize("k,thr", [(4, 0.2), (4, 0.0), (2, 0.3), (3, 0.9)])
def test_draft_ahead_equals_the_cache_free_reference(random_model, trained_model, k, thr):
    """Thresholds below 0.5 (drafts that are not the AR head's choice are accepted, so the output
    is not AR decoding's): the cached decoder equals a recompute of the whole committed
    sequence at every forward, forward for forward. Rejected drafts and masks therefore leave
    no keys/values in the cache."""
    from pipeline.inference.decoding import refusion_generate
    rng = np.random.default_rng(8)
    cases = [(random_model, _prompts(3, seed=14), MASK, 24, None),
             (trained_model, [_toy_example(rng)[0] for _ in range(4)], T_MASK, 20, T_EOS)]
    for model, prompts, mask, G, eos in cases:
        out = refusion_generate(model, prompts, G, k, 1, 0.9, thr, 0.0, mask, eos,
                                verify="draft_ahead")
        for i, p in enumerate(prompts):
            ref, fw = _draft_ahead_reference(model, p, G, k, thr, mask, eos)
            assert out.tokens[i] == ref, (k, thr, i)
            assert out.forwards[i] == fw


# ------------------------------------------------------------------ verify="draft_every"


@torch.no_grad()
def _draft_every_reference(model, prompt, G, k, token_threshold, mask_id, eos):
    """verify="draft_every", greedy, from docs/METHOD.md "Drafting for every acceptance length",
    without a cache: the verify is a causal forward of prompt + committed tokens + the drafts;
    the next drafts come from a forward of its own, prompt + committed tokens (before this
    step) + the accepted drafts + a mask at the correction or bonus token's position + k masks
    after it, whose predictions they are. Returns (output, Counter of forwards: one per
    step)."""
    from collections import Counter
    P = len(prompt)
    seq = list(prompt)                  # committed, natural order
    drafts: list[int] = []
    fw = Counter()

    def run(toks, poss):
        return model(torch.tensor([toks]), torch.tensor([poss]))[0].double()

    while len(seq) - P < G:
        L = len(seq)
        d = drafts[:P + G - L]
        fw["verify" if d else "plan"] += 1
        judge = run(seq + d, list(range(L + len(d))))[L - 1:]   # AR logits for L, L + 1, ...
        new, stop = [], False
        for i, t in enumerate(d):
            pr = judge[i].softmax(-1)
            if t != int(pr.argmax()) and not float(pr[t]) > token_threshold:
                new.append(int(pr.argmax()))
                break
            new.append(t)
            if t == eos:
                stop = True
                break
        else:
            if L + len(d) < P + G:
                new.append(int(judge[len(d)].argmax()))
        seq += new
        if stop or (eos is not None and new[-1] == eos) or len(seq) - P >= G:
            break
        a = len(new) - 1                # accepted drafts; new[-1] is at position L + a
        n = min(k, P + G - (L + a + 1))
        blk = run(seq[:L] + d[:a] + [mask_id] * (1 + n), list(range(L + a + 1 + n)))
        drafts = blk[L + a + 1:].argmax(-1).tolist()
    return seq[P:], fw


def _eos_cases(ar_tokens, G):
    """EOS choices for the equality tests: a token the AR decode produced mid-way (row 0), and a
    token that a row's AR decode first produces at its very last position."""
    last = [t[-1] for t in ar_tokens if len(t) == G and t[-1] not in t[:-1]]
    assert last, "no row whose last token is new"
    return [("mid", ar_tokens[0][G // 2]), ("end", last[0])]


@pytest.mark.parametrize("k,thr", [(4, 0.5), (4, 0.9), (8, 0.6)])
def test_draft_every_equals_ar_and_draft_ahead_on_a_random_model(random_model, k, thr):
    """Greedy, token threshold >= 0.5: the output is AR decoding's (and so draft_ahead's),
    without an EOS, with one mid-way and with one at the generation's last position; one
    forward per step (a plan, then verifies)."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    prompts = _prompts(4, seed=13)
    G = 4 * k
    ar = ar_generate(random_model, prompts, G, 0.0, None)
    cases = [("none", None)] + _eos_cases(ar.tokens, G)
    for name, eos in cases:
        ar = ar_generate(random_model, prompts, G, 0.0, eos)
        out = refusion_generate(random_model, prompts, G, k, 0, 0.9, thr, 0.0, MASK, eos,
                                verify="draft_every")
        ahead = refusion_generate(random_model, prompts, G, k, 1, 0.9, thr, 0.0, MASK, eos,
                                  verify="draft_ahead")
        assert out.tokens == ar.tokens == ahead.tokens, (k, thr, name)
        for i in range(len(prompts)):
            assert out.forwards[i]["plan"] == 1
            assert set(out.forwards[i]) <= {"plan", "verify"}
            # one forward per step, each committing >= 1 token
            assert out.commit_forward[i] == sorted(out.commit_forward[i])
            assert len(set(out.commit_forward[i])) == out.num_forwards(i)
            assert out.tpf(i) == len(out.tokens[i]) / out.num_forwards(i)
        if name == "end":
            assert any(len(t) == G and t[-1] == eos for t in ar.tokens)
        if name == "mid":
            assert ar.tokens[0][-1] == eos and len(ar.tokens[0]) < G


def test_draft_every_on_the_trained_model_equals_ar_at_tpf_above_one(trained_model):
    """The trained toy model's drafts are mostly right, but one answer position is random: in
    the same batched forward some rows accept all drafts and others stop early. Greedy with
    token threshold >= 0.5, draft_every equals AR decoding (EOS at the end of every answer)
    and draft_ahead token for token, at slot sizes 4 and 8, committing more than one token
    per forward."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    rng = np.random.default_rng(5)
    prompts = [_toy_example(rng)[0] for _ in range(12)]
    G = 24
    ar = ar_generate(trained_model, prompts, G, 0.0, T_EOS)
    assert sum(t[-1] == T_EOS for t in ar.tokens) >= 10
    for k, thr in ((4, 0.5), (4, 0.9), (8, 0.9)):
        out = refusion_generate(trained_model, prompts, G, k, 0, 0.9, thr, 0.0, T_MASK, T_EOS,
                                verify="draft_every")
        ahead = refusion_generate(trained_model, prompts, G, k, 1, 0.9, thr, 0.0, T_MASK,
                                  T_EOS, verify="draft_ahead")
        assert out.tokens == ar.tokens == ahead.tokens, (k, thr)
        fwd = sum(out.num_forwards(i) for i in range(len(prompts)))
        tokens = sum(map(len, out.tokens))
        assert tokens / fwd > 1.0, (k, thr, tokens, fwd)
        # rows with different acceptance lengths in one batched forward (the batch forward
        # index is each row's own forward index: every row takes part until it ends)
        per_forward = {}
        for f in out.commit_forward:
            for j, c in zip(*np.unique(f, return_counts=True)):
                per_forward.setdefault(int(j), set()).add(int(c))
        assert any(len(c) > 1 for c in per_forward.values()), (k, thr)
        assert any(max(np.bincount(f)) > 2 for f in out.commit_forward)


@pytest.mark.parametrize("k,thr", [(4, 0.2), (8, 0.0), (2, 0.3), (8, 0.3)])
def test_draft_every_equals_the_cache_free_reference(random_model, trained_model, k, thr):
    """Thresholds below 0.5 (accepted drafts that are not the AR head's choice, so not AR
    decoding's output): the cached decoder equals the cache-free recompute, forward for
    forward, on rows that accept different numbers of drafts in the same forward."""
    from pipeline.inference.decoding import refusion_generate
    rng = np.random.default_rng(8)
    cases = [(random_model, _prompts(3, seed=14), MASK, 24, None),
             (trained_model, [_toy_example(rng)[0] for _ in range(4)], T_MASK, 24, T_EOS)]
    for model, prompts, mask, G, eos in cases:
        out = refusion_generate(model, prompts, G, k, 0, 0.9, thr, 0.0, mask, eos,
                                verify="draft_every")
        for i, p in enumerate(prompts):
            ref, fw = _draft_every_reference(model, p, G, k, thr, mask, eos)
            assert out.tokens[i] == ref, (k, thr, i)
            assert out.forwards[i] == fw


class _CacheSpy(torch.nn.Module):
    """The model, with a copy of every row's committed keys/values and lengths taken at each
    forward (after the driver applied the previous forward's commit, before this one runs)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg, self.tp = model, model.cfg, model.tp
        self.seen = []

    def forward(self, ids, positions, attention_mask=None, kv_cache=None):
        n = kv_cache.length.clone()
        w = int(n.max())
        self.seen.append((n, [k[:, :, :w].clone() for k in kv_cache.keys],
                          [v[:, :, :w].clone() for v in kv_cache.values]))
        return self.model(ids, positions, attention_mask=attention_mask, kv_cache=kv_cache)


@pytest.mark.parametrize("k,thr", [(4, 0.3), (8, 0.9)])
def test_draft_every_cache_holds_exactly_the_committed_tokens(trained_model, k, thr):
    """Before every forward, each row's KV cache holds the keys/values of a fresh causal forward
    of exactly its committed tokens except the carried one (the prompt and the generated
    tokens committed so far, in order): no mask block and no rejected draft is left behind,
    also after rows with other acceptance lengths or finished rows left the batch."""
    from pipeline.inference.decoding import refusion_generate
    from pipeline.model import KVCache
    rng = np.random.default_rng(9)
    prompts = [_toy_example(rng)[0] + [int(rng.integers(10, 58))] * (i % 3)
               for i in range(5)]
    spy = _CacheSpy(trained_model)
    out = refusion_generate(spy, prompts, 24, k, 0, 0.9, thr, 0.0, T_MASK, T_EOS,
                            verify="draft_every")
    assert len(spy.seen) == out.batch_forwards
    left = 0
    for f, (lengths, keys, values) in enumerate(spy.seen, start=1):
        active = [i for i in range(len(prompts)) if out.num_forwards(i) >= f]
        left += len(active) < len(prompts)
        assert len(lengths) == len(active)
        for r, i in enumerate(active):
            n = int(lengths[r])
            done = sum(c <= f - 1 for c in out.commit_forward[i])
            assert n == (0 if f == 1 else len(prompts[i]) + done - 1), (f, i)
            if n == 0:
                continue
            seq = (prompts[i] + out.tokens[i])[:n]
            fresh = KVCache.for_model(trained_model, 1, n)
            with torch.no_grad():
                trained_model(torch.tensor([seq]), torch.arange(n)[None], kv_cache=fresh)
            fresh.commit()
            for lyr in range(len(keys)):
                torch.testing.assert_close(keys[lyr][r, :, :n], fresh.keys[lyr][0, :, :n],
                                           rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(values[lyr][r, :, :n], fresh.values[lyr][0, :, :n],
                                           rtol=1e-9, atol=1e-9)
    assert left > 0          # some forwards ran after a row had finished


@pytest.mark.parametrize("verify", ["draft_ahead", "draft_every"])
def test_left_to_right_modes_equal_ar_at_every_length(random_model, trained_model, verify):
    """Issue 43 item 4: greedy with token threshold 0.5, draft_ahead and draft_every return
    exactly `ar_generate`'s ids at every gen_length 1 .. 2k + 1, not only at multiples of k
    (they used to round it up: 12 tokens for 10 at k = 4): a batch of prompts of different
    lengths without an EOS and with one AR produced mid-way; the trained model (drafts mostly
    accepted, so a forward commits several tokens and may reach past the end) at lengths
    around its answers' EOS too."""
    from pipeline.inference.decoding import ar_generate, refusion_generate

    def check(model, prompts, k, G, eos, mask):
        ar = ar_generate(model, prompts, G, 0.0, eos)
        out = refusion_generate(model, prompts, G, k, 1, 0.9, 0.5, 0.0, mask, eos,
                                verify=verify)
        assert out.tokens == ar.tokens, (k, G, eos)
        return ar.tokens

    prompts = _prompts(4, seed=17)          # 5, 9, 2 and 7 tokens
    for k in (2, 3, 4):
        for G in range(1, 2 * k + 2):
            tokens = check(random_model, prompts, k, G, None, MASK)
            assert [len(t) for t in tokens] == [G] * 4
            eos = tokens[1][G // 2]       # row 1 stops there, others where it occurs
            tokens = check(random_model, prompts, k, G, eos, MASK)
            assert tokens[1][-1] == eos and len(tokens[1]) == G // 2 + 1
    rng = np.random.default_rng(6)
    toy = [_toy_example(rng)[0] for _ in range(6)]
    ended = 0
    for k in (4, 8):
        for G in [*range(1, 2 * k + 2), *range(ANSWER - 2, ANSWER + 3)]:
            tokens = check(trained_model, toy, k, G, T_EOS, T_MASK)
            assert max(len(t) for t in tokens) == min(G, ANSWER + 1)
            ended += sum(t[-1] == T_EOS for t in tokens)
    assert ended > 0                        # some rows stopped at their EOS


class _ReadBacks(torch.overrides.TorchFunctionMode):
    """Counts the reads back to the host of values computed from a forward's logits: a tensor
    is tainted when `taint` marks it (the logits) or an op made it from a tainted one; reading
    one (`.cpu()`, `.item()`, `.tolist()`, `int()`, `float()`, `bool()`, ...) counts; `.cpu()`'s
    result is on the host, so reads of it do not."""
    READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__,
             torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads, self._tainted = 0, {}

    def taint(self, t):
        self._tainted[id(t)] = __import__("weakref").ref(t)

    def _is_tainted(self, t):
        r = self._tainted.get(id(t))
        return r is not None and r() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten
        kwargs = kwargs or {}
        src = any(isinstance(t, torch.Tensor) and self._is_tainted(t)
                  for t in tree_flatten((args, kwargs))[0])
        out = func(*args, **kwargs)
        if src and func in self.READS:
            self.reads += 1
            if func is torch.Tensor.cpu:
                self._tainted.pop(id(out), None)
        elif src:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.taint(t)
        return out


@pytest.mark.parametrize("mode", ["ar", "authors", "correct", "draft_ahead", "draft_every"])
def test_one_read_back_per_forward_and_logits_freed_before_the_next(random_model, trained_model,
                                                                    monkeypatch, mode):
    """Issue 43 item 6: per batched forward, the rows' decisions reach the host in one
    transfer (`decisions.device_to_host`), and nothing else computed from the logits is read
    back (counted with a torch function mode over everything derived from the logits); each
    forward's logits are freed before the next forward starts. A batch of prompts of different
    lengths, greedy and at temperature > 0, with an EOS; the outputs are unchanged by the
    counting (equal to an uncounted decode)."""
    import weakref
    from pipeline.inference import decisions, decoding, driver
    copies, alive = [], []
    real_forward, real_copy = driver._forward, decisions.device_to_host
    counter = _ReadBacks()

    def forward(*args):
        alive[:] = [r for r in alive if r() is not None]
        assert not alive, "the previous forward's logits are still alive"
        out = real_forward(*args)
        counter.taint(out)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(driver, "_forward", forward)
    monkeypatch.setattr(decisions, "device_to_host", lambda t: copies.append(1) or real_copy(t))

    def decode(model, prompts, eos, mask, temperature):
        if mode == "ar":
            return decoding.ar_generate(model, prompts, 12, temperature, eos, seed=1)
        return decoding.refusion_generate(model, prompts, 12, 4, 1, 0.3, 0.5, temperature, mask,
                                          eos, seed=1, verify=mode)

    rng = np.random.default_rng(7)
    cases = [(random_model, _prompts(3, seed=19), None, MASK),
             (trained_model, [_toy_example(rng)[0] for _ in range(4)] + [[1, 30, 7]], T_EOS,
              T_MASK)]
    for model, prompts, eos, mask in cases:
        for temperature in (0.0, 0.7):
            copies.clear()
            counter.reads = 0
            with counter:
                out = decode(model, prompts, eos, mask, temperature)
            assert len(copies) == counter.reads == out.batch_forwards, (temperature, eos)
            assert out.tokens == decode(model, prompts, eos, mask, temperature).tokens


def test_draft_every_at_temperature_above_zero_decodes_every_row(random_model):
    """Sampling (temperature > 0): every row gets a contiguous output of the requested length
    (no EOS), and the same seed gives the same tokens."""
    from pipeline.inference.decoding import refusion_generate
    prompts = _prompts(3, seed=15)
    runs = [refusion_generate(random_model, prompts, 16, 4, 0, 0.9, 0.9, 0.8, MASK, None,
                              seed=3, verify="draft_every") for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert [len(t) for t in runs[0].tokens] == [16, 16, 16]


# ------------------------------------------------------------------ mask_attention


@pytest.mark.parametrize("verify", ["draft_ahead", "draft_every"])
def test_bidirectional_mask_blocks_equal_ar_decoding(random_model, trained_model, verify):
    """mask_attention="bidirectional" changes only how a drafting block's masks see each other:
    greedy with token threshold >= 0.5 the output is still AR decoding's, token for token (EOS
    at the end of the trained model's answers), one forward per step."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    rng = np.random.default_rng(5)
    cases = [(trained_model, [_toy_example(rng)[0] for _ in range(8)], T_MASK, 24, T_EOS),
             (random_model, _prompts(4, seed=13), MASK, 16, None)]
    for model, prompts, mask, G, eos in cases:
        ar = ar_generate(model, prompts, G, 0.0, eos)
        if eos is not None:                  # the model learned the form
            assert sum(t[-1] == eos for t in ar.tokens) >= 6
        for k, thr in ((4, 0.5), (8, 0.9)):
            out = refusion_generate(model, prompts, G, k, 1, 0.9, thr, 0.0, mask, eos,
                                    verify=verify, mask_attention="bidirectional")
            assert out.tokens == ar.tokens, (verify, k, thr)
            for i in range(len(prompts)):
                assert out.forwards[i]["plan"] == 1
                assert set(out.forwards[i]) <= {"plan", "verify"}


class _LogitSpy(torch.nn.Module):
    """The model, recording per forward the fed ids and positions, each row's cache length
    before it, and the logits it returned."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg, self.tp = model, model.cfg, model.tp
        self.seen = []

    def forward(self, ids, positions, attention_mask=None, kv_cache=None):
        n = kv_cache.length.clone()
        out = self.model(ids, positions, attention_mask=attention_mask, kv_cache=kv_cache)
        self.seen.append((ids.clone(), positions.clone(), n, out.clone()))
        return out


@pytest.mark.parametrize("verify", ["draft_ahead", "draft_every"])
@pytest.mark.parametrize("mask_attention", ["bidirectional", "causal"])
def test_mask_block_logits_equal_a_dense_forward(trained_model, verify, mask_attention):
    """At every forward of a batch of rows, the logits at each block of masks equal those of a
    cache-free dense forward of the block's prefix (the row's committed tokens, then the fed
    carried token and drafts at positions before the block) followed by the block's masks,
    with a mask built here: causal, except (bidirectional) the block's masks see each other
    both ways. A block is a run of fed masks with consecutive positions (draft_every's
    blocks restart at a lower position). The two settings give different mask logits."""
    from pipeline.inference.decoding import refusion_generate
    rng = np.random.default_rng(12)
    prompts = [_toy_example(rng)[0] + [int(rng.integers(10, 58))] * (i % 3)
               for i in range(4)]
    spy = _LogitSpy(trained_model)
    out = refusion_generate(spy, prompts, 24, 4, 1, 0.9, 0.9, 0.0, T_MASK, T_EOS,
                            verify=verify, mask_attention=mask_attention)
    assert len(spy.seen) == out.batch_forwards
    blocks = differ = fed_rows = 0
    for f, (ids, positions, lengths, logits) in enumerate(spy.seen, start=1):
        active = [i for i in range(len(prompts)) if out.num_forwards(i) >= f]
        assert len(active) == ids.shape[0]
        for r, i in enumerate(active):
            committed = (prompts[i] + out.tokens[i])[:int(lengths[r])]
            fed, pos = ids[r].tolist(), positions[r].tolist()
            if T_MASK not in fed:    # the last slot: drafts only
                continue
            fed_rows += 1
            first = fed.index(T_MASK)
            known = fed[:first]        # carried token(s) and drafts, natural order
            assert pos[:first] == list(range(len(committed), len(committed) + first))
            j = first
            while j < len(fed) and fed[j] == T_MASK:
                e = j + 1
                while e < len(fed) and fed[e] == T_MASK and pos[e] == pos[e - 1] + 1:
                    e += 1
                s, m = pos[j], e - j
                prefix = (committed + known)[:s]
                assert len(prefix) == s
                att = torch.ones(s + m, s + m, dtype=torch.bool).tril()
                bidir = att.clone()
                bidir[s:, s:] = True
                seq = torch.tensor([prefix + [T_MASK] * m])
                p = torch.arange(s + m)[None]
                with torch.no_grad():
                    ref = {a: trained_model(seq, p, attention_mask=mk[None, None])[0, s:]
                           for a, mk in (("causal", att), ("bidirectional", bidir))}
                torch.testing.assert_close(logits[r, j:e], ref[mask_attention],
                                           rtol=1e-7, atol=1e-7)
                blocks += 1
                gap = float((ref["causal"] - ref["bidirectional"]).abs().max())
                differ += m > 1 and gap > 1e-3
                j = e
    assert fed_rows > len(prompts) and differ > 0
    if verify == "draft_every":
        assert blocks > fed_rows             # several blocks in some forwards
    else:
        assert blocks == fed_rows


def test_mask_attention_is_checked(random_model):
    from pipeline.inference.decoding import refusion_generate
    with pytest.raises(ValueError, match="mask_attention must be one of causal, bidirectional"):
        refusion_generate(random_model, [[1, 2]], 8, 4, 1, 0.9, 0.9, 0.0, MASK, None,
                          verify="draft_ahead", mask_attention="full")
    for verify in ("authors", "correct"):
        with pytest.raises(ValueError, match="bidirectional' needs verify draft_ahead or "
                                             "draft_every"):
            refusion_generate(random_model, [[1, 2]], 8, 4, 1, 0.9, 0.9, 0.0, MASK, None,
                              verify=verify, mask_attention="bidirectional")
