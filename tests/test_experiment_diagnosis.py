"""pipeline.experiment.diagnosis: the teacher-forced plan + verify profile (`slot_acceptance`)
on stand-in models whose answers are known."""
import pytest
import torch


class _Rule(torch.nn.Module):
    """A stand-in model with known answers: the token at position i is f(i) = (5 i + 9) mod V.
    At a mask it predicts its own position's token (the plan/MDM reading); at any other token
    it predicts the next position's (the causal reading): `oracle`; `shifted` drafts f(i) + 1
    at a mask instead (every draft wrong); `first_wrong` is the oracle except that, at
    position `prompt_last` (set on the instance: the prompts' last position), it predicts a
    wrong next token;
    `uniform`: zero logits.
    f never yields the mask id 5 (f(i) = 4 mod 5)."""

    def __init__(self, kind, vocab=50, mask_id=5):
        super().__init__()
        self.kind, self.vocab, self.mask_id = kind, vocab, mask_id
        self.w = torch.nn.Parameter(torch.zeros(1))

    @staticmethod
    def f(i, vocab=50):
        return (5 * i + 9) % vocab

    def forward(self, ids, pos):
        out = torch.zeros(*ids.shape, self.vocab)
        if self.kind in ("oracle", "shifted", "first_wrong"):
            at_mask = self.f(pos) + (self.kind == "shifted")
            target = torch.where(ids == self.mask_id, at_mask % self.vocab, self.f(pos + 1))
            if self.kind == "first_wrong":   # the prompt's last token predicts a wrong token
                last = pos == self.prompt_last
                target = torch.where(last & (ids != self.mask_id), (self.f(pos + 1) + 1)
                                     % self.vocab, target)
            out.scatter_(-1, target[..., None], 20.0)
        return out


def _tiny_qwen3(vocab: int, seed: int):
    """A tiny random Qwen3 (2 layers, hidden 32) in eval mode, weights from `seed`."""
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.model.init import random_tp_shards
    from pipeline.model.weights import copy_into_model
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      attention="sdpa", init_std=0.5)
    m = Qwen3(cfg, init_weights=False)
    copy_into_model(m, random_tp_shards(cfg, seed, 0, 1), source="test")
    return m.eval()


def test_slot_acceptance_on_models_with_known_answers(tp1):
    """The teacher-forced plan + verify profile, checked where the answer is known: an oracle
    drafts and accepts every token (reading masks as 'this position' and tokens as 'the next
    position', the decoder's convention); a uniform model accepts only each slot's first token
    at threshold 0.5 and every drafted token at threshold 0 (q = 1/V > 0), and drafts id 0."""
    import types

    from pipeline.experiment.diagnosis import slot_acceptance
    f = _Rule.f
    examples = [{"prompt_ids": [f(i) for i in range(p)],
                 "reference_ids": [f(i) for i in range(p, p + n)]} for p, n in ((3, 10), (6, 4))]
    # slots of 4: (10 -> 4 + 4 + 2) and (4 -> 4): 4 slots, 14 tokens
    oracle = types.SimpleNamespace(model=_Rule("oracle"), mask_id=5)
    r = slot_acceptance(oracle, examples, slot_size=4, block_size=8, thresholds=(0.0, 0.5, 0.99))
    assert r["slots"] == 4 and r["first_token_accuracy"] == 1.0 and r["exact_slot_drafts"] == 1.0
    assert r["draft_accuracy_by_offset"] == [1.0, 1.0, 1.0, 1.0]
    assert r["accepted"] == {"0.0": 3.5, "0.5": 3.5, "0.99": 3.5}       # 14 tokens / 4 slots
    assert r["accepted_correct"]["0.99"] == 3.5 and r["ar_next_token_accuracy"] == 1.0
    assert r["accepted_verify_correct"] == 3.5        # every draft is the AR head's choice
    shifted = types.SimpleNamespace(model=_Rule("shifted"), mask_id=5)
    r = slot_acceptance(shifted, examples, slot_size=4, block_size=8, thresholds=(0.5,))
    assert r["first_token_accuracy"] == 0.0 and r["ar_next_token_accuracy"] == 1.0
    assert r["accepted_verify_correct"] == 0.0 and r["accepted"] == {"0.5": 1.0}
    assert r["ar_next_token_accuracy_by_place"] == {"first": 1.0, "slot_first": 1.0,
                                                     "within": 1.0}
    same = [{"prompt_ids": [f(i) for i in range(3)],
             "reference_ids": [f(i) for i in range(3, 3 + n)]} for n in (10, 4)]
    rule = _Rule("first_wrong")
    rule.prompt_last = 2
    first_wrong = types.SimpleNamespace(model=rule, mask_id=5)
    r = slot_acceptance(first_wrong, same, slot_size=4, block_size=8, thresholds=(0.5,))
    # 2 answers: their first tokens wrong; 2 later slot starts and 10 inner tokens right
    assert r["ar_next_token_accuracy_by_place"] == {"first": 0.0, "slot_first": 1.0,
                                                     "within": 1.0}
    assert r["ar_next_token_accuracy"] == 12 / 14
    uniform = types.SimpleNamespace(model=_Rule("uniform"), mask_id=5)
    r = slot_acceptance(uniform, examples, slot_size=4, block_size=8, thresholds=(0.0, 0.5))
    assert r["accepted"] == {"0.0": 3.5, "0.5": 1.0}
    assert r["first_token_accuracy"] == 0.0 and r["ar_next_token_accuracy"] == 0.0  # drafts 0
    with pytest.raises(ValueError, match="multiple of slot_size"):
        slot_acceptance(uniform, examples, slot_size=4, block_size=6)


def test_first_token_effect_against_plain_ar_decoding(tp1):
    """`first_token_effect` on a tiny random Qwen3 whose references are its own greedy AR
    decodes: the AR head's first token is always right and its decode matches (exact match 1);
    the plan's first token is right exactly where the argmax at the first mask after the prompt
    (computed here from a plain forward) equals it. With every reference's first token changed,
    the AR head's first token is always wrong and so is its decode, and the reference's first
    token gives exactly the answers whose greedy continuation (decoded here separately) equals
    the changed reference."""
    import types

    from pipeline.inference.decoding import ar_generate
    from pipeline.experiment.diagnosis import first_token_effect
    V, MASK, EOS, G = 64, 63, 62, 6
    m = _tiny_qwen3(V, seed=5)
    text = lambda ids: " ".join(map(str, ids))  # noqa: E731
    loaded = types.SimpleNamespace(model=m, mask_id=MASK, eos_id=EOS, decode=text)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (3, 5, 4, 7, 2, 6)]
    refs = [ar_generate(m, [p], G, 0.0, EOS).tokens[0] for p in prompts]

    def cut(ids):
        return ids[:ids.index(EOS)] if EOS in ids else ids

    examples = [{"prompt_ids": p, "reference_ids": r, "reference": text(cut(r))}
                for p, r in zip(prompts, refs)]
    with torch.no_grad():
        plan = [int(m(torch.tensor([p + [MASK] * 4]),
                      torch.arange(len(p) + 4)[None]).float()[0, len(p)].argmax())
                for p in prompts]
    r = first_token_effect(loaded, examples, G, slot_size=4, batch_size=4)
    assert r["examples"] == 6 and r["first_token_accuracy"]["ar"] == 1.0
    assert r["exact_match"]["ar"] == 1.0 and r["exact_match"]["reference"] == 1.0
    assert r["first_token_accuracy"]["plan"] == sum(
        a == ref[0] for a, ref in zip(plan, refs)) / 6
    changed = [[(ref[0] + 1) % 60] + ref[1:] for ref in refs]
    examples = [{"prompt_ids": p, "reference_ids": c, "reference": text(cut(c))}
                for p, c in zip(prompts, changed)]
    r = first_token_effect(loaded, examples, G, slot_size=4, batch_size=4)
    assert r["first_token_accuracy"]["ar"] == 0.0 and r["exact_match"]["ar"] == 0.0
    own = [cut([c[0]] + ar_generate(m, [p + [c[0]]], G - 1, 0.0, EOS).tokens[0])
           if c[0] != EOS else [] for p, c in zip(prompts, changed)]
    assert r["exact_match"]["reference"] == sum(o == cut(c) for o, c in zip(own, changed)) / 6


def test_slot_acceptance_does_not_depend_on_how_sequences_are_batched(tp1):
    """`slot_acceptance` batches its sequences by length: on a tiny random Qwen3 with prompts
    and answers of many lengths, every figure is the same at batch size 1 (no padding), 3 and
    64."""
    import types

    from pipeline.experiment.diagnosis import slot_acceptance
    V, MASK = 64, 63
    m = _tiny_qwen3(V, seed=7)
    g = torch.Generator().manual_seed(1)
    examples = [{"prompt_ids": torch.randint(0, 60, (p,), generator=g).tolist(),
                 "reference_ids": torch.randint(0, 60, (n,), generator=g).tolist()}
                for p, n in ((3, 13), (7, 4), (2, 9), (5, 16), (4, 1), (6, 7))]
    loaded = types.SimpleNamespace(model=m, mask_id=MASK)
    runs = [slot_acceptance(loaded, examples, 4, 8, (0.1, 0.5), batch_size=b) for b in (1, 3, 64)]
    assert runs[0]["slots"] == 4 + 1 + 3 + 4 + 1 + 2
    assert runs[0] == runs[1] == runs[2]
