"""Per-source accounting (issue 42 item 5): collate's `source`, hybrid_loss's per-source sums.

What is compared against what:
- collate's `source` against a loop laying each sample's id over its fed length;
- the per-source CE sums against the per-token cross-entropy computed by hand (log-softmax of
  full fp64 logits) over a random batch of 3 sources, for the three loss paths (full logits,
  chunked head, fused head + CE); loss and gradients bitwise equal with and without the stats.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.objective import IGNORE_INDEX, ObjectiveConfig, collate, hybrid_loss, reorganize_sample
from shard_fixtures import random_samples

V, MASK_ID, PAD_ID = 64, 2, 0


def _rows(seed: int, cfg: ObjectiveConfig, rows_of, length: int):
    rng = np.random.default_rng(seed)
    samples = random_samples(rng, sum(len(r) for r in rows_of), vocab_size=V, max_length=24,
                             min_length=4, max_prompt=6)
    reorg = [reorganize_sample(x, s, f"k{seed}-{i}", seed=seed, epoch=0, mask_id=MASK_ID,
                               cfg=cfg, max_length=length) for i, (x, s) in enumerate(samples)]
    return [[reorg[i] for i in r] for r in rows_of]


ROWS_OF = [[0, 1, 2], [3], [4, 5], [], [6]]   # packed rows and an all-padding row
T = 160         # tokens per row (mode "dual" feeds copies too)


@pytest.mark.parametrize("mode", ["refusion", "ar", "dual"])
def test_collate_source_against_a_loop(mode):
    rows = _rows(3, ObjectiveConfig(mode=mode), ROWS_OF, T)
    rng = np.random.default_rng(9)
    sources = [[int(rng.integers(0, 4)) for _ in r] for r in rows]
    got = collate(rows, T, PAD_ID, sources=sources)
    want = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (samples, ids) in enumerate(zip(rows, sources)):
        t = 0
        for s, i in zip(samples, ids):
            for _ in range(s.length):
                want[b, t] = i
                t += 1
    assert torch.equal(got["source"], want)
    assert got["source"].dtype == torch.long
    assert int(got["source"][got["segment_ids"] == 0].abs().sum()) == 0   # 0 at padding
    assert len(set(sum(sources, []))) > 1
    plain = collate(rows, T, PAD_ID)
    assert torch.equal(plain["source"], torch.zeros(len(rows), T, dtype=torch.long))
    for k, v in plain.items():   # the rest of the batch does not depend on `sources`
        if k != "source":
            assert (torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k]), k


def test_collate_refuses_sources_not_parallel_to_rows():
    rows = _rows(4, ObjectiveConfig(), [[0, 1], [2]], 64)
    with pytest.raises(ValueError, match="one id per sample"):
        collate(rows, 64, PAD_ID, sources=[[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="one id per sample"):
        collate(rows, 64, PAD_ID, sources=[[0, 1]])
    with pytest.raises(ValueError, match="row 1 sample 0: source id -1 < 0"):
        collate(rows, 64, PAD_ID, sources=[[0, 1], [-1]])


def _hidden_head(shape, hidden=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).float()
    w = (torch.randn(V, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).float()
    return h, w


def _loss(impl: str, h, w, batch, cfg, num_sources):
    from pipeline.model.linear_ce import linear_cross_entropy
    if impl == "logits":
        return hybrid_loss(h @ w.T, batch, cfg, num_sources=num_sources)
    if impl == "chunked":
        return hybrid_loss(h, batch, cfg, head=lambda x: x @ w.T, chunk_tokens=7,
                           num_sources=num_sources)
    return hybrid_loss(h, batch, cfg, num_sources=num_sources, head_loss=lambda x, t, c:
                       linear_cross_entropy(x, w, t, c, impl="fused", chunk_tokens=7))


IMPLS = ["logits", "chunked", "fused"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["refusion", "dual"])
def test_per_source_ce_equals_per_token_ce_by_hand(impl, mode):
    cfg = ObjectiveConfig(mode=mode)
    rows = _rows(5, cfg, ROWS_OF, T)
    sources = [[(b + i) % 3 for i in range(len(r))] for b, r in enumerate(rows)]
    batch = collate(rows, T, PAD_ID, sources=sources)
    h, w = _hidden_head((len(rows), T))
    _, stats = _loss(impl, h, w, batch, cfg, 3)
    logp = torch.log_softmax(h.double() @ w.double().T, dim=-1)
    ce_sum, labelled, tokens = [0.0] * 3, [0] * 3, [0] * 3
    for b in range(len(rows)):
        for t in range(T):
            s = int(batch["source"][b, t])
            tokens[s] += int(batch["segment_ids"][b, t] > 0)
            y = int(batch["labels"][b, t])
            if y != IGNORE_INDEX:
                ce_sum[s] += -float(logp[b, t, y])
                labelled[s] += 1
    assert min(labelled) > 0 and sum(labelled) == int(stats["ar_tokens"] + stats["mdm_tokens"])
    assert stats["labelled_by_source"].tolist() == labelled
    torch.testing.assert_close(stats["ce_sum_by_source"], torch.tensor(ce_sum, dtype=torch.float64),
                               rtol=1e-6, atol=1e-5)
    assert sum(tokens) == int(batch["real_tokens"])


@pytest.mark.parametrize("impl", IMPLS)
def test_stats_leave_loss_and_gradients_bitwise_unchanged(impl):
    cfg = ObjectiveConfig()
    rows = _rows(7, cfg, ROWS_OF, T)
    batch = collate(rows, T, PAD_ID, sources=[[i % 2 for i in range(len(r))] for r in rows])
    h0, w0 = _hidden_head((len(rows), T), seed=1)
    out = []
    for n in (None, 2):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss, stats = _loss(impl, h, w, batch, cfg, n)
        loss.backward()
        out.append((loss.detach(), h.grad, w.grad, stats))
    (l0, gh0, gw0, s0), (l1, gh1, gw1, s1) = out
    assert torch.equal(l0, l1) and torch.equal(gh0, gh1) and torch.equal(gw0, gw1)
    assert "ce_sum_by_source" not in s0 and s1["ce_sum_by_source"].shape == (2,)
