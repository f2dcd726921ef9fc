"""The ReFusion objective against an independent per-segment implementation of docs/METHOD.md ("Training objective"),
its invariants, plain-AR parity with transformers' causal-LM loss, and vocab-parallel CE."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.objective import (IGNORE_INDEX, ObjectiveConfig, Reorganized, collate, hybrid_loss,
                                reorganize_sample, sample_rng, slot_layout)
from shard_fixtures import random_samples

MASK_ID, PAD_ID, V = 2, 0, 64


class TinyAttention(torch.nn.Module):
    """One causal attention layer + MLP head, enough to make logits depend on the fed order,
    the position ids and the attention pattern."""

    def __init__(self, vocab=V, d=16, max_pos=128):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, d, generator=g) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(max_pos, d, generator=g) * 0.5)
        self.qkv = torch.nn.Parameter(torch.randn(d, 3 * d, generator=g) / d ** 0.5)
        self.out = torch.nn.Parameter(torch.randn(d, vocab, generator=g) / d ** 0.5)

    def forward(self, input_ids, position_ids, allowed):
        h = self.emb[input_ids] + self.pos[position_ids]
        q, k, v = (h @ self.qkv).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        return (h + att @ v) @ self.out


def segment_mask(segment_ids):
    """ARCHITECTURE.md rule: causal over the fed order, same segment only; 0 attends itself."""
    T = segment_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    pad_self = (segment_ids == 0)[:, :, None] & torch.eye(T, dtype=torch.bool)
    return (causal & same & (segment_ids[:, :, None] > 0)) | pad_self


def reference_segment(x, seg, p, slot_clean, order):
    """Straightforward docs/METHOD.md "One training sample" steps 3-5 for one segment (Python loops, natural offsets).

    Returns fed (ids, position ids, labels, is_masked) lists and n_r."""
    a, b, P = seg["start"], seg["end"], seg["prompt_length"]
    starts = list(seg["slot_starts"])
    slots = [(s, e) for s, e in zip(starts, starts[1:] + [b])]
    ids, pos, lab, msk = [], [], [], []
    for j in range(a, a + P):
        ids.append(int(x[j])); pos.append(j - a); lab.append(IGNORE_INDEX); msk.append(False)
    clean = [i for i in range(len(slots)) if slot_clean[i]]
    clean.sort(key=lambda i: order[i])
    for i in clean:
        s, e = slots[i]
        for j in range(s, e):
            ids.append(int(x[j])); pos.append(j - a); msk.append(False)
            lab.append(int(x[j + 1]) if j + 1 < e else IGNORE_INDEX)
    for i in range(len(slots)):
        if not slot_clean[i]:
            s, e = slots[i]
            for j in range(s, e):
                ids.append(MASK_ID); pos.append(j - a); lab.append(int(x[j])); msk.append(True)
    return ids, pos, lab, msk, b - a - P


def reference_loss(model, samples, keys, seed, epoch, eps=1e-3):
    """docs/METHOD.md "Loss of a micro-batch" computed segment by segment, each fed alone with plain causal attention."""
    ar_sum, ar_n, mdm_sum, n_seg = 0.0, 0, 0.0, 0
    for (x, segments), key in zip(samples, keys):
        rng = sample_rng(seed, key, epoch)
        n_slots = [len(s["slot_starts"]) for s in segments]
        t = rng.random(len(segments))
        u = rng.random(sum(n_slots))
        o = rng.random(sum(n_slots))
        off = 0
        for si, seg in enumerate(segments):
            p = (1 - eps) * t[si] + eps
            k = n_slots[si]
            ids, pos, lab, msk, n_r = reference_segment(x, seg, p, [u[off + i] >= p for i in range(k)],
                                                        [o[off + i] for i in range(k)])
            off += k
            n_seg += 1
            T = len(ids)
            logits = model(torch.tensor([ids]), torch.tensor([pos]),
                           torch.ones(1, T, T, dtype=torch.bool).tril())[0]
            ces = F.cross_entropy(logits, torch.tensor(lab), reduction="none")
            for j in range(T):
                if lab[j] == IGNORE_INDEX:
                    continue
                ce = ces[j]
                if msk[j]:
                    mdm_sum = mdm_sum + ce / (p * n_r)
                else:
                    ar_sum, ar_n = ar_sum + ce, ar_n + 1
    ar = ar_sum / ar_n if ar_n else torch.zeros(())
    return ar + mdm_sum / n_seg


def build_batch(samples, keys, seed, epoch, rows_of, T, cfg=None):
    cfg = cfg or ObjectiveConfig()
    reorg = [reorganize_sample(x, s, k, seed=seed, epoch=epoch, mask_id=MASK_ID, cfg=cfg)
             for (x, s), k in zip(samples, keys)]
    return collate([[reorg[i] for i in r] for r in rows_of], T, PAD_ID)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_reference(seed):
    rng = np.random.default_rng(100 + seed)
    samples = random_samples(rng, 7, vocab_size=V, max_length=30, min_length=3,
                             slot_sizes=(1, 2, 3, 4, 5, 8, 16), max_prompt=8)
    keys = [f"s{seed}-{i}" for i in range(len(samples))]
    # Packed rows (several samples per row) plus an all-padding row.
    rows_of = [[0, 1, 2], [3], [4, 5], [6], []]
    batch = build_batch(samples, keys, seed, epoch=3, rows_of=rows_of, T=96)
    model = TinyAttention()
    logits = model(batch["input_ids"], batch["position_ids"], segment_mask(batch["segment_ids"]))
    loss, stats = hybrid_loss(logits, batch)
    loss.backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = reference_loss(model, samples, keys, seed, epoch=3)
    ref.backward()
    torch.testing.assert_close(loss, ref.float(), rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, model.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-5)
    assert int(stats["num_segments"]) == sum(len(s) for _, s in samples)
    assert int(stats["ar_tokens"]) > 0 and int(stats["mdm_tokens"]) > 0
    assert int(stats["real_tokens"]) == sum(len(x) for x, _ in samples)


def test_reorganization_invariants():
    rng = np.random.default_rng(7)
    samples = random_samples(rng, 200, vocab_size=V, max_length=60, min_length=2,
                             slot_sizes=(1, 2, 4, 8, 16, 32), max_prompt=10)
    masked_slots = total_slots = 0
    changed_with_epoch = 0
    for i, (x, segments) in enumerate(samples):
        r = reorganize_sample(x, segments, f"k{i}", seed=5, epoch=0, mask_id=MASK_ID, cfg=ObjectiveConfig())
        again = reorganize_sample(x, segments, f"k{i}", seed=5, epoch=0, mask_id=MASK_ID, cfg=ObjectiveConfig())
        other = reorganize_sample(x, segments, f"k{i}", seed=5, epoch=1, mask_id=MASK_ID, cfg=ObjectiveConfig())
        for f in ("input_ids", "position_ids", "labels", "is_masked", "loss_weight"):
            np.testing.assert_array_equal(getattr(r, f), getattr(again, f))
        changed_with_epoch += not np.array_equal(r.input_ids, other.input_ids)
        for si, seg in enumerate(segments):
            a, b, P = seg["start"], seg["end"], seg["prompt_length"]
            # Each segment stays inside its own span of the fed order.
            sel = np.flatnonzero(r.segment == si)
            assert sel.tolist() == list(range(a, b))
            pos, ids, lab, msk = (r.position_ids[sel], r.input_ids[sel], r.labels[sel], r.is_masked[sel])
            assert sorted(pos.tolist()) == list(range(b - a))          # a permutation
            assert pos[:P].tolist() == list(range(P))                   # prompt first, in order
            assert (lab[:P] == IGNORE_INDEX).all() and not msk[:P].any()
            starts = seg["slot_starts"]
            ends = starts[1:] + [b]
            slot_of = {j - a: s for s, (st, en) in enumerate(zip(starts, ends)) for j in range(st, en)}
            # masked tokens come last, in natural order; clean slots are contiguous whole slots
            n_clean = int((~msk[P:]).sum())
            assert not msk[P:P + n_clean].any() and msk[P + n_clean:].all()
            assert (np.diff(pos[P + n_clean:]) > 0).all()
            clean_pos = pos[P:P + n_clean]
            runs = np.split(clean_pos, np.flatnonzero(np.diff(clean_pos) != 1) + 1) if n_clean else []
            for run in runs:
                s = slot_of[int(run[0])]
                assert run[0] + a == starts[s]
            for j in range(P, b - a):
                k = int(np.flatnonzero(pos == j)[0])
                s = slot_of[j]
                last = j + a == ends[s] - 1
                if msk[k]:
                    assert ids[k] == MASK_ID and lab[k] == x[j + a]
                elif last:
                    assert lab[k] == IGNORE_INDEX and ids[k] == x[j + a]
                else:
                    assert lab[k] == x[j + a + 1] and ids[k] == x[j + a]
            total_slots += len(starts)
            masked_slots += int(len({slot_of[int(j)] for j in pos[msk]}))
    # E[p] = (1 + eps) / 2: the mask rate over ~1000 slots is near 1/2.
    assert 0.4 < masked_slots / total_slots < 0.6
    assert changed_with_epoch > 150


def test_empty_terms_are_zero_not_nan():
    x = np.arange(3, 13, dtype=np.uint32)
    seg = [{"start": 0, "end": 10, "prompt_length": 2, "slot_starts": list(range(2, 10))}]  # k = 1
    logits = torch.randn(2, 12, V, requires_grad=True)
    # Slot size 1: a clean slot has no labelled token, so AR is empty for any draw.
    batch = build_batch([(x, seg)], ["only"], 0, 0, [[0], []], 12)
    loss, stats = hybrid_loss(logits.clone(), batch)
    loss.backward()
    assert int(stats["ar_tokens"]) == 0 and float(stats["ar_loss"]) == 0.0
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    # All padding: both terms empty.
    empty = collate([[], []], 12, PAD_ID)
    logits.grad = None
    loss, stats = hybrid_loss(logits.clone(), empty)
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(stats["num_segments"]) == 0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_ar_mode_equals_transformers_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    rng = np.random.default_rng(3)
    samples = random_samples(rng, 5, vocab_size=V, max_length=20, min_length=3, max_segments=1, max_prompt=6)
    cfg = ObjectiveConfig(mode="ar")
    batch = build_batch(samples, [f"a{i}" for i in range(5)], 0, 0, [[i] for i in range(5)], 24, cfg)
    logits = torch.randn(5, 24, V)
    loss, stats = hybrid_loss(logits.clone(), batch, cfg)
    hf_labels = torch.full((5, 24), IGNORE_INDEX)
    for i, (x, segs) in enumerate(samples):
        P = segs[0]["prompt_length"]
        hf_labels[i, P:len(x)] = torch.from_numpy(x[P:].astype(np.int64))
    # Natural order, nothing masked.
    for i, (x, _) in enumerate(samples):
        assert batch["input_ids"][i, :len(x)].tolist() == x.tolist()
        assert batch["position_ids"][i, :len(x)].tolist() == list(range(len(x)))
    ref = ForCausalLMLoss(logits, hf_labels, vocab_size=V)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    assert float(stats["mdm_loss"]) == 0.0 and int(stats["mdm_tokens"]) == 0


def test_slot_size_override_and_weights():
    rng = np.random.default_rng(4)
    samples = random_samples(rng, 30, vocab_size=V, max_length=60, min_length=10)
    cfg = ObjectiveConfig(slot_sizes=[3, 7])
    seen = set()
    for i, (x, segs) in enumerate(samples):
        starts, seg_of = slot_layout(segs, sample_rng(0, f"o{i}", 0), cfg)
        for si, seg in enumerate(segs):
            st = starts[seg_of == si].tolist()
            assert st[0] == seg["start"] + seg["prompt_length"]
            sizes = np.diff(st + [seg["end"]])
            assert (sizes[:-1] == sizes[0]).all() and sizes[0] in (3, 7) or len(st) == 1
            assert sizes[-1] <= (sizes[0] if len(st) > 1 else 7)
            seen.add(int(sizes[0]) if len(st) > 1 else None)
    assert {3, 7} <= seen
    # Weights scale the two terms.
    batch = build_batch(samples[:4], ["w0", "w1", "w2", "w3"], 0, 0, [[0], [1], [2], [3]], 60)
    logits = torch.randn(4, 60, V)
    _, st = hybrid_loss(logits.clone(), batch)
    loss, _ = hybrid_loss(logits.clone(), batch, ObjectiveConfig(ar_weight=0.25, mdm_weight=2.0))
    torch.testing.assert_close(loss, 0.25 * st["ar_loss"] + 2.0 * st["mdm_loss"])


def _hidden_and_head(shape, hidden=12, seed=0):
    """Random final hidden states [B, T, hidden] and a full head weight [V, hidden] (fp32,
    drawn in fp64 so every process gets the same values)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).float()
    w = (torch.randn(V, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).float()
    return h, w


@pytest.mark.parametrize("mode", ["refusion", "ar"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_head_loss_equals_full_logits_loss(mode, chunk):
    """hybrid_loss(hidden, head=...) (output layer on labelled positions only, chunked, chunks
    recomputed in backward) == hybrid_loss(head(hidden)) in loss, stats and gradients of both
    the hidden states and the head weight (fp32, 1e-6); includes an all-padding row."""
    rng = np.random.default_rng(21)
    cfg = ObjectiveConfig(mode=mode)
    samples = random_samples(rng, 6, vocab_size=V, max_length=30, min_length=3, max_prompt=8)
    batch = build_batch(samples, [f"c{i}" for i in range(6)], 1, 0, [[0, 1], [2], [3, 4, 5], []],
                        80, cfg)
    h0, w0 = _hidden_and_head((4, 80))
    results = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if chunked:
            loss, stats = hybrid_loss(h, batch, cfg, head=lambda x: x @ w.T, chunk_tokens=chunk)
        else:
            loss, stats = hybrid_loss(h @ w.T, batch, cfg)
        loss.backward()
        results.append((loss.detach(), stats, h.grad, w.grad))
    (l0, s0, gh0, gw0), (l1, s1, gh1, gw1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    for k in ("ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens"):
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh1, gh0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw1, gw0, rtol=1e-6, atol=1e-7)
    assert int(s0["ar_tokens"]) > 0 and (mode == "ar") == (int(s0["mdm_tokens"]) == 0)


def test_chunked_head_sees_only_labelled_rows_in_chunks():
    """The output layer runs on exactly the labelled positions, at most `chunk_tokens` rows per
    call (forward, and again for the recompute in backward); no label: one zero-weight row keeps
    the head in the graph."""
    from pipeline.objective import labelled_cross_entropy
    h, w = _hidden_and_head((2, 9))
    h.requires_grad_(True)
    labels = torch.full((2, 9), IGNORE_INDEX)
    labels[0, 2:7] = torch.arange(5)
    labels[1, 8] = 3
    rows = []

    def head(x):
        rows.append(x.shape[0])
        return x @ w.T
    ce = labelled_cross_entropy(h, head, labels, chunk_tokens=4)
    assert rows == [4, 2]
    ce.sum().backward()
    assert rows == [4, 2, 4, 2] or rows == [4, 2, 2, 4]
    assert (ce[labels == IGNORE_INDEX] == 0).all() and (ce[labels != IGNORE_INDEX] > 0).all()
    rows.clear()
    none = labelled_cross_entropy(h, head, torch.full((2, 9), IGNORE_INDEX), chunk_tokens=4)
    assert rows == [1] and float(none.detach().abs().sum()) == 0.0 and none.requires_grad


def _tp_body(rank, world_size, data_dir):
    from megatron.core import parallel_state
    from pipeline.data import build_loader
    from pipeline.parallel import init_distributed

    info = init_distributed(tensor_parallel_size=2)
    loader = build_loader(data_dir, "train", 2, 48, dp_rank=info.dp_rank, dp_size=info.dp_size,
                          seed=11, num_workers=0, vocab_size=V)
    batches = []
    for i, b in enumerate(loader):
        batches.append(b)
        if i == 2:
            break
    batch = batches[-1]
    torch.manual_seed(0)
    full = torch.randn(2, 48, V, dtype=torch.float64).float()
    tp = parallel_state.get_tensor_model_parallel_rank()
    shard = full[..., tp * V // 2:(tp + 1) * V // 2].clone().requires_grad_(True)
    loss, stats = hybrid_loss(shard, batch)
    loss.backward()
    # The chunked output layer over this rank's vocab rows of the head weight; the input's
    # gradient is all-reduced over TP as megatron's ColumnParallelLinear does.
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
    chunked = {}
    for mode in ("refusion", "ar"):
        cfg = ObjectiveConfig(mode=mode)
        mb = batch if mode == "refusion" else _ar_batch()
        h0, w0 = _hidden_and_head(tuple(mb["input_ids"].shape))
        h = h0.requires_grad_(True)
        w = w0[tp * V // 2:(tp + 1) * V // 2].clone().requires_grad_(True)
        closs, _ = hybrid_loss(h, mb, cfg, head=lambda x: copy_to_tensor_model_parallel_region(x) @ w.T,
                               chunk_tokens=5)
        closs.backward()
        chunked[mode] = (closs.detach(), h.grad, w.grad)
    return {"loss": loss.detach(), "grad": shard.grad, "batches": batches,
            "stats": {k: v for k, v in stats.items()}, "chunked": chunked}


def _ar_batch():
    rng = np.random.default_rng(5)
    cfg = ObjectiveConfig(mode="ar")
    samples = random_samples(rng, 4, vocab_size=V, max_length=20, min_length=3, max_prompt=6)
    return build_batch(samples, [f"t{i}" for i in range(4)], 0, 0, [[0, 1], [2, 3], []], 40, cfg)


def test_vocab_parallel_loss_and_same_batch_on_tp_ranks(tmp_path):
    from distributed import run_distributed
    from shard_fixtures import write_shards

    write_shards(str(tmp_path), {"train": random_samples(np.random.default_rng(9), 12)}, samples_per_shard=5)
    out = run_distributed(_tp_body, world_size=2, args=(str(tmp_path),))
    for b0, b1 in zip(out[0]["batches"], out[1]["batches"]):
        assert b0["keys"] == b1["keys"]
        for k, v in b0.items():
            if torch.is_tensor(v):
                assert torch.equal(v, b1[k]), k
    batch = out[0]["batches"][-1]
    torch.manual_seed(0)
    full = torch.randn(2, 48, V, dtype=torch.float64).float().requires_grad_(True)
    ref, ref_stats = hybrid_loss(full, batch)
    ref.backward()
    for r in range(2):
        torch.testing.assert_close(out[r]["loss"], ref.detach(), rtol=1e-6, atol=1e-6)
        for k in ("ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens"):
            torch.testing.assert_close(out[r]["stats"][k], ref_stats[k], rtol=1e-6, atol=1e-6)
    grad = torch.cat([out[0]["grad"], out[1]["grad"]], dim=-1)
    torch.testing.assert_close(grad, full.grad, rtol=1e-6, atol=1e-7)
    # Chunked output layer at TP=2 == full logits in one process (loss, hidden and weight grads).
    for mode in ("refusion", "ar"):
        cfg = ObjectiveConfig(mode=mode)
        mb = batch if mode == "refusion" else _ar_batch()
        h0, w0 = _hidden_and_head(tuple(mb["input_ids"].shape))
        h, w = h0.requires_grad_(True), w0.requires_grad_(True)
        ref, _ = hybrid_loss(h @ w.T, mb, cfg)
        ref.backward()
        for r in range(2):
            loss, gh, gw = out[r]["chunked"][mode]
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(gh, h.grad, rtol=1e-6, atol=1e-7)
        gw = torch.cat([out[0]["chunked"][mode][2], out[1]["chunked"][mode][2]], dim=0)
        torch.testing.assert_close(gw, w.grad, rtol=1e-6, atol=1e-7)


def _reorganized(key, input_ids, position_ids, segment, is_masked):
    n = len(input_ids)
    return Reorganized(key=key, input_ids=np.array(input_ids), position_ids=np.array(position_ids),
                       labels=np.full(n, IGNORE_INDEX), is_masked=np.array(is_masked, dtype=bool),
                       loss_weight=np.zeros(n, np.float32), segment=np.array(segment),
                       p=np.full(int(max(segment)) + 1, 0.5), response_tokens=n)


def test_collate_padding_positions_continue_after_the_last_segment_length():
    # issue 11: tokens [7, 8], slot 0 masked, slot 1 clean: fed [8, mask] at positions [1, 0];
    # padding continues after L = 2, not after the last fed position 0
    s = _reorganized("a", [8, 99], [1, 0], [0, 0], [False, True])
    b = collate([[s]], 4, pad_id=0)
    assert b["position_ids"].tolist() == [[1, 0, 2, 3]]
    # a two-segment sample before it, a packed row: after the row's LAST segment (length 3)
    two = _reorganized("b", [5, 6, 7, 99], [0, 1, 1, 0], [0, 0, 1, 1], [False] * 3 + [True])
    last = _reorganized("c", [9, 99, 98], [2, 0, 1], [0, 0, 0], [False, True, True])
    b = collate([[two, last], []], 9, pad_id=0)
    assert b["position_ids"][0].tolist() == [0, 1, 1, 0, 2, 0, 1, 3, 4]
    assert b["position_ids"][1].tolist() == list(range(9))       # all-padding row
    assert b["segment_ids"][0].tolist() == [1, 1, 2, 2, 3, 3, 3, 0, 0]
