"""Objective mode "dual" (docs/METHOD.md "The dual-stream arm") against a straightforward
implementation written here, and the other modes against the code before mode "dual" existed.

What is compared against what:
- Every position of every packed row the loader yields (input ids, position ids, labels,
  is_masked, loss weights, segment ids, the [T, T] attention mask, the copy counts): against
  rows built here with Python loops from the documented rules: the draws of the module docstring
  made here from their documented seeding, per segment the clean tokens then the copies, copies
  dropped last-first until a sample fits, and the mask by asking for each (query, key) pair
  "same segment, and is the key a clean token before the query's limit or in the query's own
  copy". Both `dual_masking` values, several seeds, best-fit / next-fit packing and one sample
  per row, prompts of 0-8 tokens, samples whose copies must be dropped.
- The mask the model builds on the device from the batch's per-token vectors
  (`pipeline.model.attention.dual_mask`, flex's `dual_mask_mod`): against the pairwise
  reference above and against `dense_dual_mask` below (the numpy `[B, 1, T, T]` mask the
  loader shipped before; a training step's loss and gradients through the model's mask equal
  those through that dense mask).
- The loss: the trainer's forward (the Qwen3 network, the batch's mask) and `hybrid_loss` on
  packed rows against logits from separate forwards built here: one plain causal forward per
  segment for the clean tokens, one forward per copy (its clean prefix, then the copy, with a
  mask built here); the loss then computed from those logits with the METHOD.md formula.
- The existing modes: batches of `reorganize_sample` + `collate` for mode refusion (with every
  option) and mode ar, against the same functions of `pipeline/objective.py` at the commit
  before mode "dual" (read from git): every tensor and list equal.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.objective import IGNORE_INDEX, ObjectiveConfig, collate, hybrid_loss, reorganize_sample
from shard_fixtures import TINY_MODEL, random_samples, write_shards, write_train_val
from test_train import _env, _metrics, _write_config

ROOT = Path(__file__).resolve().parents[1]
MASK_ID, PAD_ID, V = 2, 0, 64     # shard_fixtures.DEFAULT_TOKENIZER
EPS = 1e-3
BEFORE_DUAL = "ffd53988b67e35c5f983a5c710e2ffde2c03c820"   # last commit without mode "dual"


# -- the reference ---------------------------------------------------------------------------

def draws(seed: int, key: str, epoch: int) -> np.random.Generator:
    """The documented seeding: PCG64(SeedSequence([seed, epoch, blake2b-128(key) little-endian]))."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, h])))


def dual_cfg(masking: str, **options) -> ObjectiveConfig:
    """`masking` "all", "refusion" or "refusion@c" (`dual_copy_scale` c) as a mode-dual config,
    with further `ObjectiveConfig` options."""
    name, _, scale = masking.partition("@")
    return ObjectiveConfig(mode="dual", dual_masking=name, dual_copy_scale=float(scale or 1),
                           **options)


def reference_sample(x, segments, key, seed, epoch, masking, max_length):
    """Fed tokens of one sample in mode dual, as a list of dicts, and (p per segment, dropped
    copies). Each token: id, pos (position id), label, masked, weight, seg (index in the
    sample), orig (index into x), copy (None for a clean token, else (seg, slot start, slot end)).
    `masking` "refusion@c": a slot copied iff u < c p, its tokens weighted 1 / (c p n_r)."""
    masking, _, scale = masking.partition("@")
    c = float(scale or 1)
    rng = draws(seed, key, epoch)
    slots = []                                   # (segment, start, end), natural order
    for si, s in enumerate(segments):
        starts = list(s["slot_starts"])
        for a, b in zip(starts, starts[1:] + [s["end"]]):
            slots.append((si, a, b))
    if masking == "refusion":
        t = rng.random(len(segments))
        p = [(1 - EPS) * ti + EPS for ti in t]
        u = rng.random(len(slots))
        copies = [sl for i, sl in enumerate(slots) if u[i] < c * p[sl[0]]]
    else:
        p = [1.0] * len(segments)
        copies = list(slots)
    total = len(x) + sum(b - a for _, a, b in copies)
    dropped = 0
    while total > max_length:
        _, a, b = copies.pop()
        total -= b - a
        dropped += 1
    fed = []
    for si, s in enumerate(segments):
        a, b, P = s["start"], s["end"], s["prompt_length"]
        n_r = b - a - P
        for j in range(a, b):
            if P > 0 and j == a + P - 1:         # the prompt's last token
                label = int(x[j + 1])
            elif j >= a + P and j + 1 < b:       # a response token with a next one
                label = int(x[j + 1])
            else:
                label = IGNORE_INDEX
            fed.append(dict(id=int(x[j]), pos=j - a, label=label, masked=False,
                            weight=1.0 if label != IGNORE_INDEX else 0.0, seg=si, orig=j,
                            copy=None))
        for (cs, ca, cb) in copies:
            if cs != si:
                continue
            for j in range(ca, cb):
                fed.append(dict(id=MASK_ID, pos=j - a, label=int(x[j]), masked=True,
                                weight=1.0 / (c * p[si] * n_r), seg=si, orig=j,
                                copy=(cs, ca, cb)))
    return fed, p, dropped


def reference_row(samples_fed, T):
    """One row: arrays [T] and the boolean mask [T, T] by the pairwise rule."""
    toks = []
    for n, fed in enumerate(samples_fed):
        toks += [dict(t, sample=n) for t in fed]
    assert len(toks) <= T
    ids = [t["id"] for t in toks] + [PAD_ID] * (T - len(toks))
    labels = [t["label"] for t in toks] + [IGNORE_INDEX] * (T - len(toks))
    weight = [t["weight"] for t in toks] + [0.0] * (T - len(toks))
    masked = [t["masked"] for t in toks] + [False] * (T - len(toks))
    seg_no, seg_ids, last_len = {}, [], 0
    for t in toks:
        seg_ids.append(seg_no.setdefault((t["sample"], t["seg"]), len(seg_no) + 1))
    seg_ids += [0] * (T - len(toks))
    if toks:   # padding positions continue after the length of the row's last segment
        last = toks[-1]
        last_len = 1 + max(t["pos"] for t in toks if (t["sample"], t["seg"]) == (last["sample"], last["seg"]))
    pos = [t["pos"] for t in toks] + list(range(last_len, last_len + T - len(toks)))
    mask = np.zeros((T, T), dtype=bool)
    for qi in range(T):
        if qi >= len(toks):
            mask[qi, qi] = True
            continue
        q = toks[qi]
        for ki, k in enumerate(toks):
            if (k["sample"], k["seg"]) != (q["sample"], q["seg"]):
                continue
            if q["copy"] is None:
                mask[qi, ki] = k["copy"] is None and k["orig"] <= q["orig"]
            else:
                mask[qi, ki] = (k["copy"] is None and k["orig"] < q["copy"][1]) or k["copy"] == q["copy"]
    return dict(input_ids=ids, position_ids=pos, labels=labels, loss_weight=weight,
                is_masked=masked, segment_ids=seg_ids), mask


def dense_dual_mask(segment_ids, position_ids, copy_id, clean_limit):
    """The numpy mask `collate` shipped before the model built it (bool[B, 1, T, T]): q sees k
    iff same non-padding segment and (k clean with position < clean_limit[q], or q a copy's
    token and k in the same copy); padding sees itself."""
    seg, pos = segment_ids, position_ids
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    clean_key = (copy_id[:, None, :] == 0) & (pos[:, None, :] < clean_limit[:, :, None])
    own_copy = (copy_id[:, :, None] != 0) & (copy_id[:, :, None] == copy_id[:, None, :])
    mask = same & (clean_key | own_copy)
    mask |= np.eye(seg.shape[1], dtype=bool)[None] & (seg == 0)[:, :, None]
    return mask[:, None]


def model_mask(batch):
    """The mask the model builds from a batch (`attention.dual_mask`), as numpy bool[B, 1, T, T]."""
    from pipeline.model.attention import dual_mask
    return dual_mask(batch["segment_ids"], batch["position_ids"], batch["copy_id"],
                     batch["clean_limit"]).numpy()


# -- every fed position, through the loader ----------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    rng = np.random.default_rng(5)
    samples = random_samples(rng, 60, vocab_size=V, max_length=40, min_length=3,
                             slot_sizes=(1, 2, 3, 4, 8), max_prompt=8)
    d = tmp_path_factory.mktemp("dual") / "shards"
    write_shards(str(d), {"train": samples}, samples_per_shard=16, max_length=40)
    keys = [f"train{i:07d}" for i in range(len(samples))]
    return d, dict(zip(keys, samples))


@pytest.mark.parametrize("masking,seed,pack,packing", [
    ("all", 0, True, "best_fit"), ("all", 1, True, "best_fit"), ("all", 2, True, "next_fit"),
    ("refusion", 0, True, "best_fit"), ("refusion", 3, True, "best_fit"),
    ("refusion", 4, True, "next_fit"), ("all", 5, False, "best_fit"),
    ("refusion", 6, False, "best_fit"), ("refusion@0.5", 7, True, "best_fit"),
    ("refusion@0.25", 8, False, "next_fit")])
def test_every_fed_position_matches_the_reference(shards, masking, seed, pack, packing):
    from pipeline.data import build_loader
    data_dir, by_key = shards
    T, B = 48, 3
    cfg = dual_cfg(masking)
    loader = build_loader(str(data_dir), "train", B, T, seed=seed, num_workers=0, objective_cfg=cfg,
                          pack=pack, packing=packing, shuffle_buffer=20, infinite=False)
    seen, dropped_all, copy_all, multi = [], 0, 0, 0
    for epoch_batch in loader:
        batch = epoch_batch
        keys = list(batch["keys"])
        seen += keys
        dropped = copies = 0
        for b in range(B):
            # the row's samples: the next keys, as many as make up its segments
            n_seg = int(batch["segment_ids"][b].max())
            row, fed_row = [], []
            while sum(len(by_key[k][1]) for k in row) < n_seg:
                row.append(keys.pop(0))
            for k in row:
                x, segments = by_key[k]
                fed, p, d = reference_sample(x, segments, k, seed, 0, masking, T)
                fed_row.append(fed)
                dropped += d
                copies += sum(t["masked"] for t in fed)
            multi += len(row) > 1
            ref, mask = reference_row(fed_row, T)
            for name, want in ref.items():
                got = batch[name][b].tolist()
                if name == "loss_weight":
                    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{name} row {b}")
                else:
                    assert got == want, (name, b, row)
            np.testing.assert_array_equal(model_mask(batch)[b, 0], mask,
                                          err_msg=f"mask row {b} {row}")
        assert keys == []
        assert "attention_mask" not in batch   # per-token vectors only: no [B, T, T] shipped
        assert batch["copy_id"].dtype == batch["clean_limit"].dtype == torch.int64
        assert int(batch["dropped_copies"]) == dropped and int(batch["copy_tokens"]) == copies
        assert int(batch["real_tokens"]) == int((batch["segment_ids"] > 0).sum())
        dropped_all += dropped
        copy_all += copies
    assert sorted(seen) == sorted(by_key)             # one pass: every sample once
    assert copy_all > 0
    if masking == "all":
        assert dropped_all > 0                        # 40-token samples + copies > 48 tokens
    if pack:
        assert multi > 0                              # rows that hold several samples


# -- the loss through the network ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tp1):
    from pipeline.model import ModelConfig, Qwen3
    from pipeline.model.init import random_tp_shards
    from pipeline.model.weights import copy_into_model
    mcfg = ModelConfig.from_dict(dict(TINY_MODEL, init_std=0.1), source="test")
    model = Qwen3(mcfg, dtype=torch.float32, init_weights=False)
    copy_into_model(model, random_tp_shards(mcfg, 3, 0, 1), source="random")
    return model.eval()


@pytest.mark.parametrize("masking", ["all", "refusion", "refusion@0.5"])
def test_loss_equals_separate_forwards_per_segment_and_copy(tiny, masking):
    rng = np.random.default_rng({"all": 17, "refusion": 18}.get(masking, 19))
    samples = random_samples(rng, 6, vocab_size=V, max_length=20, min_length=4,
                             slot_sizes=(2, 3, 4), max_prompt=6)
    keys = [f"s{i}" for i in range(len(samples))]
    T, seed, epoch = 64, 9, 1
    cfg = dual_cfg(masking)
    reorg = [reorganize_sample(x, s, k, seed=seed, epoch=epoch, mask_id=MASK_ID, cfg=cfg,
                               max_length=T) for (x, s), k in zip(samples, keys)]
    rows_of, row, used = [], [], 0            # next-fit by fed length
    for i, r in enumerate(reorg):
        if used + r.length > T:
            rows_of.append(row)
            row, used = [], 0
        row.append(i)
        used += r.length
    rows_of.append(row)
    assert any(len(r) > 1 for r in rows_of)
    batch = collate([[reorg[i] for i in r] for r in rows_of], T, PAD_ID)
    with torch.no_grad():   # the trainer's forward and loss (chunked output layer)
        hidden = tiny(batch["input_ids"], batch["position_ids"], segment_ids=batch["segment_ids"],
                      copy_id=batch["copy_id"], clean_limit=batch["clean_limit"],
                      return_hidden=True)
        loss, stats = hybrid_loss(hidden, batch, cfg, head=tiny.head_logits)
        logits = tiny.head_logits(hidden)

    # the reference: separate forwards, then the formula
    ar_sum, ar_n, mdm_sum, n_seg, checked = 0.0, 0, 0.0, 0, 0
    for b, row in enumerate(rows_of):
        off = 0
        for i in row:
            x, segments = samples[i]
            fed, p, _ = reference_sample(x, segments, keys[i], seed, epoch, masking, T)
            for si, s in enumerate(segments):
                a, e = s["start"], s["end"]
                n_seg += 1
                clean = [t for t in fed if t["seg"] == si and not t["masked"]]
                ids = torch.tensor([[t["id"] for t in clean]])
                with torch.no_grad():
                    lc = tiny.head_logits(tiny(ids, torch.arange(e - a)[None], return_hidden=True))[0]
                copies = {}
                for t in fed:
                    if t["seg"] == si and t["masked"]:
                        copies.setdefault(t["copy"], []).append(t)
                ref_logits = {}          # original index -> logits, clean and copies
                for j, t in enumerate(clean):
                    ref_logits[("c", t["orig"])] = lc[j]
                for (_, ca, cb), toks in copies.items():
                    n_pre, n_c = ca - a, cb - ca
                    ids = torch.tensor([[int(v) for v in x[a:ca]] + [MASK_ID] * n_c])
                    m = torch.zeros(n_pre + n_c, n_pre + n_c, dtype=torch.bool)
                    for q in range(n_pre + n_c):
                        for k in range(n_pre + n_c):   # prefix: causal; copy: sees everything
                            m[q, k] = k <= q if q < n_pre else True
                    with torch.no_grad():
                        h = tiny(ids, torch.arange(cb - a)[None], attention_mask=m[None, None],
                                 return_hidden=True)
                        lm = tiny.head_logits(h)[0]
                    for j in range(n_c):
                        ref_logits[("m", ca + j)] = lm[n_pre + j]
                seg_fed = [t for t in fed if t["seg"] == si]
                for t in seg_fed:
                    want = ref_logits[("m" if t["masked"] else "c", t["orig"])]
                    torch.testing.assert_close(logits[b, off], want, rtol=1e-4, atol=1e-4)
                    checked += 1
                    if t["label"] != IGNORE_INDEX:
                        ce = F.cross_entropy(want[None].double(), torch.tensor([t["label"]]))
                        if t["masked"]:   # the token's weight: 1 / (c p n_r), as documented
                            c = float(masking.partition("@")[2] or 1)
                            mdm_sum += float(ce) / (c * p[si] * (e - a - s["prompt_length"]))
                        else:
                            ar_sum += float(ce)
                            ar_n += 1
                    off += 1
    ref = ar_sum / ar_n + mdm_sum / n_seg
    assert checked == int(batch["real_tokens"])
    assert int(stats["ar_tokens"]) == ar_n and int(stats["num_segments"]) == n_seg
    assert abs(float(loss) - ref) < 1e-4 * max(1.0, ref), (float(loss), ref)
    assert abs(float(stats["ar_loss"]) - ar_sum / ar_n) < 1e-4
    assert abs(float(stats["mdm_loss"]) - mdm_sum / n_seg) < 1e-4 * max(1.0, mdm_sum / n_seg)


# -- the mask on the device ---------------------------------------------------------------------

def _dual_batch(seed, masking, T=64, B=4, n=14, max_sample=40):
    """A packed mode-"dual" micro-batch of random samples (next-fit by fed length), some copies
    dropped to fit, rows of several samples, padding."""
    rng = np.random.default_rng(seed)
    samples = random_samples(rng, n, vocab_size=V, max_length=max_sample, min_length=3,
                             slot_sizes=(1, 2, 3, 4, 8), max_prompt=8)
    cfg = ObjectiveConfig(mode="dual", dual_masking=masking)
    reorg = [reorganize_sample(x, s, f"k{i}", seed=seed, epoch=0, mask_id=MASK_ID, cfg=cfg,
                               max_length=T) for i, (x, s) in enumerate(samples)]
    rows, row, used = [], [], 0
    for r in reorg:
        if used + r.length > T:
            rows.append(row)
            row, used = [], 0
        row.append(r)
        used += r.length
    rows.append(row)
    rows = (rows + [[]] * B)[:B - 1] + [[]]   # B rows, the last one all padding
    return collate(rows, T, PAD_ID), cfg


@pytest.mark.parametrize("seed", range(6))
def test_model_mask_equals_the_dense_numpy_mask(seed):
    """Issue 43.2: the mask the model builds from segment_ids, position_ids, copy_id and
    clean_limit equals the dense numpy mask the loader used to ship, on random packed rows."""
    batch, _ = _dual_batch(seed, "all" if seed % 2 else "refusion", T=96, n=20, max_sample=60)
    want = dense_dual_mask(*(batch[k].numpy() for k in ("segment_ids", "position_ids", "copy_id",
                                                         "clean_limit")))
    assert int(batch["copy_tokens"]) > 0 and (batch["segment_ids"] == 0).any()
    assert int(batch["segment_ids"].max(1).values.max()) > 1     # rows of several segments
    np.testing.assert_array_equal(model_mask(batch), want)


@pytest.mark.parametrize("masking", ["all", "refusion"])
def test_training_step_through_the_model_mask_equals_the_dense_mask_path(tiny, masking):
    """Issue 43.2: the trainer's dual forward (vectors, mask built in the model) gives the loss
    and every gradient of the forward with the dense numpy mask passed as `attention_mask` (the
    path before), on the same batch; and a flex forward (no grad, CPU) the same logits."""
    batch, cfg = _dual_batch(3 if masking == "all" else 4, masking)
    dense = torch.from_numpy(dense_dual_mask(*(batch[k].numpy() for k in (
        "segment_ids", "position_ids", "copy_id", "clean_limit"))))
    ids, pos, seg = batch["input_ids"], batch["position_ids"], batch["segment_ids"]
    results = []
    for kw in ({"attention_mask": dense},
               {"copy_id": batch["copy_id"], "clean_limit": batch["clean_limit"]}):
        tiny.zero_grad()
        hidden = tiny(ids, pos, segment_ids=None if "attention_mask" in kw else seg,
                      return_hidden=True, **kw)
        loss, stats = hybrid_loss(hidden, batch, cfg, head=tiny.head_logits)
        loss.backward()
        results.append((loss.detach(), stats["mdm_loss"],
                        {k: p.grad.clone() for k, p in tiny.named_parameters()}))
    tiny.zero_grad()
    (l0, m0, g0), (l1, m1, g1) = results
    assert float(m0) > 0 and torch.equal(l0, l1) and torch.equal(m0, m1)
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    assert any(g.abs().sum() > 0 for g in g0.values())
    with torch.no_grad():
        ref = tiny(ids, pos, segment_ids=seg, copy_id=batch["copy_id"],
                   clean_limit=batch["clean_limit"])
        tiny.cfg.attention = "flex"
        try:
            out = tiny(ids, pos, segment_ids=seg, copy_id=batch["copy_id"],
                       clean_limit=batch["clean_limit"])
        finally:
            tiny.cfg.attention = "auto"
    assert (out - ref).abs().max().item() <= 1e-5


def test_worker_batches_reach_the_model_with_the_vectors(shards):
    """The loader's worker processes ship `copy_id` / `clean_limit` (no dense mask) and the
    trainer's transfer to the device (`Trainer._batch_to_device`) carries them unchanged; the
    model's mask from them equals the dense numpy mask."""
    from pipeline.data import build_loader
    from pipeline.train import Trainer
    data_dir, _ = shards
    cfg = ObjectiveConfig(mode="dual", dual_masking="refusion")
    loader = build_loader(str(data_dir), "train", 2, 48, seed=3, num_workers=1, objective_cfg=cfg,
                          pack=True, shuffle_buffer=20, infinite=False)
    trainer = Trainer.__new__(Trainer)
    trainer.device = torch.device("cpu")
    n = 0
    for batch in loader:
        b = trainer._batch_to_device(batch)
        assert "attention_mask" not in b
        for k in ("copy_id", "clean_limit", "segment_ids", "position_ids"):
            assert torch.equal(b[k], batch[k]), k
        want = dense_dual_mask(*(batch[k].numpy() for k in ("segment_ids", "position_ids",
                                                             "copy_id", "clean_limit")))
        np.testing.assert_array_equal(model_mask(b), want)
        n += 1
    assert n > 3


def test_dual_vectors_without_their_partner_are_refused(tiny):
    batch, _ = _dual_batch(0, "all", T=32, n=3, max_sample=20)
    with pytest.raises(ValueError, match="copy_id and clean_limit go together"):
        tiny(batch["input_ids"], batch["position_ids"], segment_ids=batch["segment_ids"],
             copy_id=batch["copy_id"])


# -- the existing modes are unchanged ----------------------------------------------------------

def _objective_before_dual(tmp_path):
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE_DUAL}:pipeline/objective.py"],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        pytest.skip("git is not available")
    if src.returncode != 0:
        pytest.skip(f"commit {BEFORE_DUAL[:12]} is not in this checkout")
    path = tmp_path / "objective_before_dual.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("objective_before_dual", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("options", [
    {}, {"mode": "ar"}, {"boundary_labels": True}, {"natural_order_fraction": 0.5},
    {"slot_sizes": [2, 3, 5]}, {"eps": 0.2, "ar_weight": 0.5, "mdm_weight": 2.0},
    {"boundary_labels": True, "natural_order_fraction": 0.3, "slot_sizes": [1, 4]},
    {"mode": "refusion", "dual_masking": "refusion"}])
def test_existing_modes_build_the_batches_of_the_code_before_dual(tmp_path, options):
    old = _objective_before_dual(tmp_path)
    old_opts = {k: v for k, v in options.items() if k != "dual_masking"}
    rng = np.random.default_rng(23)
    samples = random_samples(rng, 40, vocab_size=V, max_length=30, min_length=2,
                             slot_sizes=(1, 2, 3, 4, 8), max_prompt=8)
    rows_of = [list(range(i, min(i + 3, 40))) for i in range(0, 40, 3)] + [[]]
    for seed, epoch in ((0, 0), (7, 2)):
        new_b = collate([[reorganize_sample(*samples[i], f"k{i}", seed=seed, epoch=epoch,
                                            mask_id=MASK_ID, cfg=ObjectiveConfig(**options),
                                            max_length=96) for i in r] for r in rows_of],
                        96, PAD_ID)
        old_b = old.collate([[old.reorganize_sample(*samples[i], f"k{i}", seed=seed, epoch=epoch,
                                                    mask_id=MASK_ID,
                                                    cfg=old.ObjectiveConfig(**old_opts))
                              for i in r] for r in rows_of], 96, PAD_ID)
        assert set(new_b) == set(old_b) | {"source"}   # per-source accounting (issue 42)
        assert not new_b["source"].any()   # one source: id 0 everywhere
        for k, v in old_b.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == new_b[k].dtype and torch.equal(v, new_b[k]), k
            else:
                assert v == new_b[k], k
        assert int(new_b["real_tokens"]) > 0


# -- configuration ---------------------------------------------------------------------------

def test_bad_options_are_one_line_naming_the_key(tmp_path):
    from pipeline.config import ConfigError, load_config, validate
    d = tmp_path / "shards"
    write_shards(str(d), {"train": random_samples(np.random.default_rng(0), 8, vocab_size=V,
                                                  max_length=16)}, max_length=16)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"run_dir": str(tmp_path / "run"), "model": {"inline": TINY_MODEL},
                               "data": {"dir": str(d), "num_workers": 0},
                               "train": {"max_steps": 2, "micro_batch_size": 1,
                                         "eval_interval": 0}}))   # JSON is YAML
    plan = validate(load_config(str(cfg), ["objective.mode=dual", "objective.dual_masking=refusion"]))
    assert plan.row_length == 16
    for overrides, expected in [
            (["objective.mode=dual", "objective.dual_masking=sometimes"],
             "objective: objective.dual_masking must be 'all' or 'refusion', got 'sometimes'"),
            (["objective.mode=duel"], "objective: objective.mode must be 'refusion' or 'ar' or "
                                      "'dual', got 'duel'"),
            (["objective.mode=dual", "objective.boundary_labels=true"],
             "objective: objective.boundary_labels: mode dual already labels every clean token"),
            (["objective.mode=dual", "objective.natural_order_fraction=0.5"],
             "objective: objective.natural_order_fraction: mode dual feeds every segment in "
             "natural order already"),
            (["objective.mode=dual", "objective.dual_masking=refusion",
              "objective.dual_copy_scale=0"],
             "objective: objective.dual_copy_scale must be in (0, 1], got 0"),
            (["objective.mode=dual", "objective.dual_copy_scale=0.5"],
             "objective: objective.dual_copy_scale: only mode dual with dual_masking refusion "
             "draws its copies"),
            (["objective.dual_copy_scale=0.5"],
             "objective: objective.dual_copy_scale: only mode dual with dual_masking refusion")]:
        with pytest.raises(ConfigError) as e:
            validate(load_config(str(cfg), overrides))
        assert "\n" not in str(e.value) and str(e.value).startswith(expected), str(e.value)
    # the training command line: exit 2, one line
    r = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(cfg),
                        "objective.mode=dual", "objective.dual_masking=sometimes"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["pipeline.train: config error: objective: objective.dual_masking must be 'all' or "
                     "'refusion', got 'sometimes'"], r.stderr[-2000:]


# -- exact resume ----------------------------------------------------------------------------

def _stoppable_run(rank, world_size, cfg_path, run_dir, signal_before_step):
    """`pipeline.train.Trainer` on `cfg_path` in `run_dir` (one process, one loader worker);
    with `signal_before_step`, a SIGTERM is flagged just before that step, as the trainer's
    handler flags it: the run ends that step, checkpoints and returns 0."""
    from pipeline.config import load_config, validate
    from pipeline.train import Trainer
    cfg = load_config(cfg_path, [f"run_dir={run_dir}"])
    trainer = Trainer(cfg, validate(cfg, world_size=world_size))
    trainer.setup()
    step = trainer.train_step

    def flagged_step():
        if trainer.step + 1 == signal_before_step:
            trainer.signal_received = signal.SIGTERM
        return step()
    trainer.train_step = flagged_step
    try:
        return trainer.run()
    finally:
        trainer.run_lock.release()


def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path):
    """Mode dual (refusion masking, packed rows, validation every 3 steps): a run stopped by a
    signal at step 3 and resumed gives every step's losses, grad norm and token counts, and the
    validations, exactly as the uninterrupted run."""
    from distributed import run_distributed
    data = tmp_path / "data"
    write_train_val(data, 24, 6, samples_per_shard=12)
    config = _write_config(tmp_path / "run.yaml", data,
                           data={"max_length": 40, "pack": True, "num_workers": 1},
                           objective={"mode": "dual", "dual_masking": "refusion"},
                           train={"max_steps": 6, "eval_interval": 3, "eval_batches": 2},
                           checkpoint={"interval": 0, "keep": 2})
    ref, stopped = tmp_path / "ref", tmp_path / "stopped"
    assert run_distributed(_stoppable_run, 1, (str(config), str(ref), 0)) == [0]
    assert run_distributed(_stoppable_run, 1, (str(config), str(stopped), 3)) == [0]
    assert max(s for k, s in _metrics(stopped) if k == "train") == 3
    assert run_distributed(_stoppable_run, 1, (str(config), str(stopped), 0)) == [0]
    want, got = _metrics(ref), _metrics(stopped)
    assert sorted(got) == sorted(want) == sorted([("train", s) for s in range(1, 7)]
                                                 + [("val", 3), ("val", 6)])
    fields = ("loss", "ar_loss", "mdm_loss", "grad_norm", "lr", "consumed_tokens",
              "consumed_samples", "clean_tokens", "copy_tokens", "dropped_copies")
    for s in range(1, 7):
        assert {f: got[("train", s)][f] for f in fields} == \
            {f: want[("train", s)][f] for f in fields}, s
        m = want[("train", s)]
        assert m["copy_tokens"] > 0 and m["clean_tokens"] > 0
    assert sum(want[("train", s)]["clean_tokens"] + want[("train", s)]["copy_tokens"]
               for s in range(1, 7)) == want[("train", 6)]["consumed_tokens"]
    for s in (3, 6):
        assert got[("val", s)]["val_loss"] == want[("val", s)]["val_loss"]


# -- the copy share (`dual_copy_scale`) ------------------------------------------------------

def test_copy_scale_keeps_a_subset_of_the_copies_at_twice_the_weight():
    """`dual_copy_scale=0.5` makes the same draws as 1: every sample's copied slots are a subset
    of those at scale 1 (u < p/2 implies u < p), each copy token weighs twice as much
    (1 / (0.5 p n_r)), the clean stream is the same, and about half the copy tokens remain."""
    rng = np.random.default_rng(23)
    samples = random_samples(rng, 300, vocab_size=V, max_length=40, min_length=4,
                             slot_sizes=(1, 2, 3, 4), max_prompt=6)
    full, half = dual_cfg("refusion"), dual_cfg("refusion@0.5")
    tokens = {1.0: 0, 0.5: 0}
    for i, (x, seg) in enumerate(samples):
        key = f"s{i}"
        a = reorganize_sample(x, seg, key, seed=5, epoch=2, mask_id=MASK_ID, cfg=full)
        b = reorganize_sample(x, seg, key, seed=5, epoch=2, mask_id=MASK_ID, cfg=half)
        tokens[1.0] += a.copy_tokens
        tokens[0.5] += b.copy_tokens
        np.testing.assert_array_equal(a.p, b.p)
        clean_a, clean_b = a.copy_id == 0, b.copy_id == 0
        for name in ("input_ids", "position_ids", "labels", "loss_weight"):
            np.testing.assert_array_equal(getattr(a, name)[clean_a], getattr(b, name)[clean_b])

        def copies(r):   # (segment, first position id) -> (labels, weights) of each copy
            out = {}
            for c in range(1, int(r.copy_id.max(initial=0)) + 1):
                at = r.copy_id == c
                out[(int(r.segment[at][0]), int(r.position_ids[at][0]))] = (
                    r.labels[at].tolist(), r.loss_weight[at].astype(np.float64))
            return out
        ca, cb = copies(a), copies(b)
        assert set(cb) <= set(ca), key
        for k, (labels, w) in cb.items():
            assert labels == ca[k][0]
            np.testing.assert_allclose(w, 2 * ca[k][1], rtol=1e-6)
    assert 0.4 < tokens[0.5] / tokens[1.0] < 0.6, tokens


# -- the fed length from a slot layout (what the loader packs by) ------------------------------

@pytest.mark.parametrize("masking", ["all", "refusion", "refusion@0.5"])
@pytest.mark.parametrize("slot_sizes", [None, [1, 3, 8]])
def test_fed_length_from_the_slot_layout_equals_reorganize_sample(masking, slot_sizes):
    """`dual_fed_length` from a sample's layout as a version-3 sample index stores it (key hash,
    run-length coded slot sizes, decoded back) equals `reorganize_sample(...).length` for every
    sample of random layouts (1-5 segments, slots of 1-70,000 tokens), seed, epoch and row
    length, the caps chosen so that copies are dropped."""
    from pipeline.data import sample_index
    from pipeline.objective import dual_fed_length
    rng = np.random.default_rng(11)
    samples = random_samples(rng, 120, max_length=90, min_length=2, max_segments=5,
                             slot_sizes=(1, 2, 3, 5, 7, 16, 40), max_prompt=8)
    # long runs of 1-token slots (a run of more than 65535 slots is cut in two) and a long slot
    L = 140_000
    samples.append((np.full(L, 5, np.uint32), [
        {"start": 0, "end": 70_000, "prompt_length": 3, "slot_starts": list(range(3, 70_000))},
        {"start": 70_000, "end": L, "prompt_length": 0, "slot_starts": [70_000, 70_001]}]))
    keys = [f"k{i:05d}" if i % 3 else f"p{hashlib.sha256(str(i).encode()).hexdigest()[:20]}"
            for i in range(len(samples))]
    layout = sample_index.SlotLayout.of_samples(
        [(sample_index.key_hash(k), sample_index.slot_runs(seg)) for k, (_, seg) in zip(keys, samples)])
    assert len(layout.runs[layout.run_first[-2]:layout.run_first[-1]]) == 4  # 65535 + 1 slots, 2
    cfg = dual_cfg(masking, slot_sizes=slot_sizes)
    checked = dropped = 0
    for i, ((x, seg), key) in enumerate(zip(samples, keys)):
        h, size, slot_seg = layout.sample(i)
        assert h == int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
        long = i == len(samples) - 1   # (its reorganization is slow: two seeds, two caps)
        for seed, epoch in ((0, 0), (3, 1)) if long else ((0, 0), (3, 1), (12345, 7)):
            n = len(x)
            for cap in (None, n + 5000) if long else (None, n, n + 5, 2 * n,
                                                       n + int(rng.integers(0, n + 1))):
                ref = reorganize_sample(x, seg, key, seed=seed, epoch=epoch, mask_id=MASK_ID,
                                        cfg=cfg, max_length=cap)
                got = dual_fed_length(n, h, size, slot_seg, seed=seed, epoch=epoch, cfg=cfg,
                                      max_length=cap)
                assert got == ref.length, (i, seed, epoch, cap)
                checked += 1
                dropped += ref.dropped_copies > 0
    assert checked == (len(samples) - 1) * 15 + 4 and dropped > len(samples)
    with pytest.raises(ValueError, match="max_length"):
        dual_fed_length(10, 0, np.array([10]), np.array([0]), seed=0, epoch=0, cfg=cfg, max_length=9)
