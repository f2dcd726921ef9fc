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
