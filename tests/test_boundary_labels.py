"""`objective.boundary_labels` and `objective.natural_order_fraction` (docs/METHOD.md "Boundary
labels") against a straightforward implementation written here: every fed position of many
random (packed) samples, built by walking the fed sequence and asking, token by token, which
original positions are already visible."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.objective import (IGNORE_INDEX, ObjectiveConfig, collate, hybrid_loss,
                                reorganize_sample, sample_rng)
from shard_fixtures import random_samples

MASK_ID, PAD_ID, V = 2, 0, 64
EPS = 1e-3


def reference_sample(x, segments, key, seed, epoch, boundary, fraction):
    """Fed (ids, position ids, labels, is_masked, loss weight) of one sample, by the rule's
    words: draws in the documented order; per segment: prompt, clean slots in increasing draw
    `o` (natural order for a natural-order segment), masked slots in natural order; then labels
    from what is visible: a clean slot's last token at q gets x[q+1] unless q+1 lies outside the
    segment or x[q+1] was fed (clean) before it."""
    rng = sample_rng(seed, key, epoch)
    n_slots = [len(s["slot_starts"]) for s in segments]
    t = rng.random(len(segments))
    u = rng.random(sum(n_slots))
    o = rng.random(sum(n_slots))
    nat = rng.random(len(segments)) < fraction if fraction > 0 else np.zeros(len(segments), bool)
    ids, pos, lab, msk, wt = [], [], [], [], []
    off = 0
    for si, seg in enumerate(segments):
        a, b, P = seg["start"], seg["end"], seg["prompt_length"]
        p = (1 - EPS) * t[si] + EPS
        starts = list(seg["slot_starts"])
        slots = [(s, e) for s, e in zip(starts, starts[1:] + [b])]
        k = len(slots)
        clean = [bool(nat[si]) or u[off + i] >= p for i in range(k)]
        rank = [i if nat[si] else o[off + i] for i in range(k)]
        off += k
        n_r = b - a - P
        fed = [(j, False) for j in range(a, a + P)]                      # (original index, masked)
        for i in sorted((i for i in range(k) if clean[i]), key=lambda i: rank[i]):
            fed += [(j, False) for j in range(*slots[i])]
        for i in range(k):
            if not clean[i]:
                fed += [(j, True) for j in range(*slots[i])]
        slot_end = {j: e for s, e in slots for j in range(s, e)}
        visible = set()
        for j, masked in fed:
            ids.append(MASK_ID if masked else int(x[j]))
            pos.append(j - a)
            msk.append(masked)
            if masked:
                lab.append(int(x[j])); wt.append(1.0 / (p * n_r))
            elif j < a + P:        # prompt: only its last token, and only with boundary labels
                last = boundary and j == a + P - 1
                lab.append(int(x[j + 1]) if last else IGNORE_INDEX); wt.append(1.0 if last else 0.0)
            elif j + 1 < slot_end[j]:                                    # inside a slot
                lab.append(int(x[j + 1])); wt.append(1.0)
            elif boundary and j + 1 < b and j + 1 not in visible:        # across a boundary
                lab.append(int(x[j + 1])); wt.append(1.0)
            else:
                lab.append(IGNORE_INDEX); wt.append(0.0)
            if not masked:
                visible.add(j)
    return ids, pos, lab, msk, wt


@pytest.mark.parametrize("boundary,fraction", [(True, 0.0), (True, 0.5), (False, 0.5),
                                               (True, 1.0)])
def test_every_position_matches_reference(boundary, fraction):
    rng = np.random.default_rng(11)
    samples = random_samples(rng, 300, vocab_size=V, max_length=70, min_length=2,
                             slot_sizes=(1, 2, 3, 4, 8), max_prompt=8)
    cfg = ObjectiveConfig(boundary_labels=boundary, natural_order_fraction=fraction)
    cross = natural = 0
    for n, (x, segments) in enumerate(samples):
        key = f"k{n}"
        r = reorganize_sample(x, segments, key, seed=5, epoch=2, mask_id=MASK_ID, cfg=cfg)
        ids, pos, lab, msk, wt = reference_sample(x, segments, key, 5, 2, boundary, fraction)
        assert r.input_ids.tolist() == ids, key
        assert r.position_ids.tolist() == pos, key
        assert r.labels.tolist() == lab, key
        assert r.is_masked.tolist() == msk, key
        np.testing.assert_allclose(r.loss_weight, np.float32(wt), rtol=1e-6)
        cross += sum(1 for i, l in enumerate(lab) if l != IGNORE_INDEX and not msk[i])
        natural += int((r.p == 0).sum())
    assert cross > 0
    if fraction == 0.5:
        assert 0.3 < natural / sum(len(s) for _, s in samples) < 0.7
    if fraction == 1.0:
        assert natural == sum(len(s) for _, s in samples)


def test_defaults_are_the_papers_labels_and_fraction_zero_is_bit_identical():
    """boundary_labels=False, fraction 0: the paper's labels (the reference with both off);
    boundary labels only add labels, at slot-last and prompt-last tokens, never move a token."""
    rng = np.random.default_rng(3)
    samples = random_samples(rng, 200, vocab_size=V, max_length=60, min_length=2, max_prompt=8)
    added = 0
    for n, (x, segments) in enumerate(samples):
        kw = dict(seed=1, epoch=0, mask_id=MASK_ID)
        base = reorganize_sample(x, segments, f"k{n}", cfg=ObjectiveConfig(), **kw)
        ids, pos, lab, msk, wt = reference_sample(x, segments, f"k{n}", 1, 0, False, 0.0)
        assert base.labels.tolist() == lab and base.input_ids.tolist() == ids
        bl = reorganize_sample(x, segments, f"k{n}", cfg=ObjectiveConfig(boundary_labels=True),
                               **kw)
        assert np.array_equal(bl.input_ids, base.input_ids)
        assert np.array_equal(bl.position_ids, base.position_ids)
        assert np.array_equal(bl.is_masked, base.is_masked)
        had = base.labels != IGNORE_INDEX
        assert np.array_equal(bl.labels[had], base.labels[had])
        added += int((bl.labels[~had] != IGNORE_INDEX).sum())
    assert added > 0


def test_all_natural_with_boundary_labels_is_plain_next_token_training():
    """fraction 1 + boundary labels: every segment fed in natural order and labelled like
    objective.mode=ar (the independent AR path of the objective)."""
    rng = np.random.default_rng(4)
    samples = random_samples(rng, 100, vocab_size=V, max_length=60, min_length=2, max_prompt=8)
    for n, (x, segments) in enumerate(samples):
        kw = dict(seed=2, epoch=1, mask_id=MASK_ID)
        nat = reorganize_sample(x, segments, f"k{n}", cfg=ObjectiveConfig(
            boundary_labels=True, natural_order_fraction=1.0), **kw)
        ar = reorganize_sample(x, segments, f"k{n}", cfg=ObjectiveConfig(mode="ar"), **kw)
        for f in ("input_ids", "position_ids", "labels", "is_masked", "loss_weight"):
            assert np.array_equal(getattr(nat, f), getattr(ar, f)), f


def test_loss_counts_boundary_labels_in_the_ar_mean():
    """The added labels are AR labels: hybrid_loss's AR term averages over them (weight 1), the
    MDM term is unchanged; deterministic for (seed, key, epoch)."""
    rng = np.random.default_rng(9)
    samples = random_samples(rng, 6, vocab_size=V, max_length=40, min_length=4, max_prompt=6)
    rows_of = [[0, 1], [2], [3, 4, 5]]

    def batch(cfg):
        reorg = [reorganize_sample(x, s, f"k{i}", seed=0, epoch=0, mask_id=MASK_ID, cfg=cfg)
                 for i, (x, s) in enumerate(samples)]
        return collate([[reorg[i] for i in r] for r in rows_of], 128, PAD_ID)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 128, V, generator=g)
    b0, b1 = batch(ObjectiveConfig()), batch(ObjectiveConfig(boundary_labels=True))
    _, s0 = hybrid_loss(logits.clone(), b0)
    _, s1 = hybrid_loss(logits.clone(), b1)
    _, s1b = hybrid_loss(logits.clone(), batch(ObjectiveConfig(boundary_labels=True)))
    assert int(s1["ar_tokens"]) > int(s0["ar_tokens"])
    assert int(s1["mdm_tokens"]) == int(s0["mdm_tokens"])
    torch.testing.assert_close(s1["mdm_loss"], s0["mdm_loss"])
    ar_rows = (b1["labels"] != IGNORE_INDEX) & ~b1["is_masked"]
    ce = torch.nn.functional.cross_entropy(logits[ar_rows], b1["labels"][ar_rows])
    torch.testing.assert_close(s1["ar_loss"], ce)
    torch.testing.assert_close(s1["ar_loss"], s1b["ar_loss"])


@pytest.mark.parametrize("bad", [{"natural_order_fraction": 1.5},
                                 {"natural_order_fraction": -0.1},
                                 {"boundary_labels": "yes"}])
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError, match="objective"):
        ObjectiveConfig(**bad)
