"""Per-source accounting (issue 42 item 5): collate's `source`, hybrid_loss's per-source sums,
the trainer's `tokens_by_source` / `loss_by_source` / `loss_by_source`, wandb's keys.

What is compared against what:
- collate's `source` against a loop laying each sample's id over its fed length;
- the per-source CE sums against the per-token cross-entropy computed by hand (log-softmax of
  full fp64 logits) over a random batch of 3 sources, for the three loss paths (full logits,
  chunked head, fused head + CE); loss and gradients bitwise equal with and without the stats;
- a real training run (2 gloo DP ranks in-process, tiny Qwen3 from a Hugging Face folder,
  a negligible lr so the weights stay the folder's): each train and val line's per-source
  losses against transformers' Qwen3 logits of the batches the ranks saw (each packed segment
  fed alone), per-source tokens against the batches, and their sum against the step's tokens;
- the trainer's per-step record (`StepTally`, with a non-finite micro-batch and TP repeats)
  against the same figures summed straight from the micro-batches.
"""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
import torch

from pipeline.objective import (IGNORE_INDEX, ObjectiveConfig, collate, hybrid_loss,
                                reorganize_sample)
from shard_fixtures import TINY_MODEL, random_samples, write_train_val

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
    from pipeline.training.metrics import source_losses, source_tokens
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
    assert source_tokens(batch, 3).tolist() == tokens
    assert sum(tokens) == int(batch["real_tokens"])
    got = source_losses(stats["ce_sum_by_source"].tolist(), labelled, ("a", "b", "c"))
    assert got == pytest.approx({n: c / k for n, c, k in zip("abc", ce_sum, labelled)}, rel=1e-6)
    # a source without a labelled token reports None, not 0 or NaN
    assert source_losses([1.0, 0.0], [2, 0], ("a", "b")) == {"a": 0.5, "b": None}


def test_source_tokens_refuses_an_id_beyond_the_names():
    from pipeline.training.metrics import source_tokens
    rows = _rows(6, ObjectiveConfig(), [[0], [1]], 40)
    batch = collate(rows, 40, PAD_ID, sources=[[0], [2]])
    with pytest.raises(ValueError, match="source id 2 >= the loader's 2 source"):
        source_tokens(batch, 2)


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


def test_wandb_items_flatten_per_source_fields():
    from pipeline.monitor import wandb_items
    line = {"kind": "train", "step": 3, "loss": 1.5, "tokens_by_source": {"web": 10, "code": 4},
            "loss_by_source": {"web": 2.0, "code": None}, "time_unix_s": 0.0}
    assert wandb_items(line) == {"train/loss": 1.5, "train/tokens_by_source/web": 10,
                                 "train/tokens_by_source/code": 4,
                                 "train/loss_by_source/web": 2.0}
    assert wandb_items({"kind": "val", "step": 4, "val_loss": 1.0,
                        "loss_by_source": {"web": 0.5}}) == {
        "val_loss": 1.0, "loss_by_source/web": 0.5}


# -- a real training run ----------------------------------------------------------------------

NAMES = ("web", "code", "math")
WEIGHTS = (0.5, 0.3, 0.2)


def _source_of(key: str) -> int:
    return zlib.crc32(key.encode()) % len(NAMES)


class _Tagged:
    """A loader whose batches carry `source` (each row's sample id from its key, as the mixture
    loader's collate(sources=) would give with one sample per row), with `source_names` and
    `source_weights`; each yielded batch is kept in `seen`."""

    def __init__(self, loader, seen: list):
        self._loader, self.seen = loader, seen
        self.source_names, self.source_weights = NAMES, WEIGHTS

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __iter__(self):
        for batch in self._loader:
            rows = batch["input_ids"].shape[0]
            assert len(batch["keys"]) <= rows   # one sample per row (data.pack=false)
            ids = torch.tensor([_source_of(k) for k in batch["keys"]]
                               + [0] * (rows - len(batch["keys"])))
            batch["source"] = torch.where(batch["segment_ids"] > 0, ids[:, None], 0)
            self.seen.append({k: v.clone() for k, v in batch.items()
                              if k in ("input_ids", "position_ids", "labels", "segment_ids",
                                       "source")})
            yield batch


def _tagged_run(rank, world_size, cfg_path, run_dir):
    """The trainer (in-process, DP = world size) with tagged train and val loaders. Returns
    {"train": [batches in step order], "val": [...]} this rank fed."""
    from pipeline.config import load_config, validate
    from pipeline.train import Trainer
    cfg = load_config(cfg_path, [f"run_dir={run_dir}"])
    trainer = Trainer(cfg, validate(cfg, world_size=world_size))
    trainer.setup()
    seen = {"train": [], "val": []}
    trainer.train_loader = _Tagged(trainer.train_loader, seen["train"])
    build = trainer._build_loader
    trainer._build_loader = lambda split, train: (
        _Tagged(build(split, train), seen["val"]) if not train else build(split, train))
    try:
        assert trainer.run() == 0
    finally:
        if trainer.run_lock is not None:   # rank 0's
            trainer.run_lock.release()
    return seen


def _by_hand(hf, batches) -> tuple[list[float], list[int], list[int]]:
    """(CE sums, labelled tokens, non-padding tokens) per source over `batches`, from
    transformers' Qwen3 logits with each packed segment fed alone."""
    ce, lab, tok = [0.0] * len(NAMES), [0] * len(NAMES), [0] * len(NAMES)
    for batch in batches:
        for b in range(batch["input_ids"].shape[0]):
            seg = batch["segment_ids"][b]
            for s in seg.unique().tolist():
                if s == 0:
                    continue
                idx = (seg == s).nonzero()[:, 0]
                a, e = int(idx[0]), int(idx[-1]) + 1
                with torch.no_grad():
                    logits = hf(input_ids=batch["input_ids"][b:b + 1, a:e],
                                position_ids=batch["position_ids"][b:b + 1, a:e],
                                attention_mask=torch.ones(1, e - a, dtype=torch.long)).logits[0]
                logp = torch.log_softmax(logits.double(), -1)
                for t in range(a, e):
                    src = int(batch["source"][b, t])
                    tok[src] += 1
                    y = int(batch["labels"][b, t])
                    if y != IGNORE_INDEX:
                        ce[src] -= float(logp[t - a, y])
                        lab[src] += 1
    return ce, lab, tok


def test_training_run_logs_per_source_tokens_and_losses(tmp_path):
    from distributed import run_distributed
    from tiny_qwen3 import make_tiny_qwen3
    from transformers import Qwen3ForCausalLM
    data = tmp_path / "data"
    write_train_val(data, 16, 6, samples_per_shard=8)
    shape = {k: TINY_MODEL[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_attention_heads", "num_key_value_heads", "head_dim")}
    hf_dir = make_tiny_qwen3(tmp_path / "hf", num_hidden_layers=TINY_MODEL["num_layers"], **shape)
    steps = 2
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "init": {"source": "hf", "hf_path": str(hf_dir)},
        "data": {"dir": str(data), "num_workers": 0},
        "optim": {"lr": 1e-12, "warmup_steps": 0},   # the weights stay the HF folder's
        "train": {"max_steps": steps, "micro_batch_size": 1, "global_batch_size": 4,
                  "precision": "fp32", "seed": 3, "eval_interval": steps, "eval_batches": 0},
        "checkpoint": {"interval": 0}, "wandb": {"mode": "disabled"}}))
    run_dir = tmp_path / "run"
    seen = run_distributed(_tagged_run, 2, (str(config), str(run_dir)))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {m["step"]: m for m in lines if m["kind"] == "train"}
    val = [m for m in lines if m["kind"] == "val"]
    assert sorted(train) == list(range(1, steps + 1)) and [m["step"] for m in val] == [steps]
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ga = 2   # global batch 4 = micro-batch 1 x GA 2 x DP 2
    consumed = 0
    for step in range(1, steps + 1):
        m = train[step]
        batches = [b for r in seen for b in r["train"][(step - 1) * ga:step * ga]]
        ce, lab, tok = _by_hand(hf, batches)
        assert m["tokens_by_source"] == dict(zip(NAMES, tok))
        assert sum(m["tokens_by_source"].values()) == m["consumed_tokens"] - consumed
        consumed = m["consumed_tokens"]
        assert m["target_share_by_source"] == dict(zip(NAMES, WEIGHTS))
        for n, c, k in zip(NAMES, ce, lab):
            want = pytest.approx(c / k, rel=1e-5) if k else None   # None: no labelled token
            assert m["loss_by_source"][n] == want, (step, n)
    assert sum(1 for m in train.values() for v in m["loss_by_source"].values() if v) >= 4
    ce, lab, tok = _by_hand(hf, [b for r in seen for b in r["val"]])
    assert sum(tok) == val[0]["val_tokens"] and all(lab)
    assert val[0]["loss_by_source"] == pytest.approx(
        {n: c / k for n, c, k in zip(NAMES, ce, lab)}, rel=1e-5)


def test_source_names_and_target_shares_of_a_loader():
    from types import SimpleNamespace
    from pipeline.training.metrics import source_names, target_shares
    plain = SimpleNamespace()   # a loader without source names
    assert source_names(plain) == ("data",) and target_shares(plain, 1) == (1.0,)
    mix = SimpleNamespace(source_names=("web", "code"), source_weights=(0.75, 0.25))
    assert source_names(mix) == ("web", "code") and target_shares(mix, 2) == (0.75, 0.25)
    assert target_shares(SimpleNamespace(source_names=("a", "b")), 2) is None
    with pytest.raises(ValueError, match="1 source weight"):
        target_shares(SimpleNamespace(source_weights=(1.0,)), 2)


@pytest.mark.parametrize("mode", ["refusion", "dual"])
def test_step_tally_record_against_the_micro_batches(mode):
    """`StepTally` (the trainer's per-step figures): three micro-batches of 3 sources, the second
    made non-finite, its packed vector doubled as the all-reduce over 2 TP ranks of one DP rank
    gives it; the "train" record against the figures computed straight from the micro-batches:
    losses the mean over finite micro-batches, tokens / rows / copies over all of them,
    per-source tokens over all and per-source CE over finite ones, the consumed counters
    advanced, the non-finite micro-batch's keys, the signal flag, FLOPs / s per device."""
    from pipeline.model import ModelConfig
    from pipeline.model.flops import segment_lengths, step_flops
    from pipeline.training.metrics import NONFINITE, SIGNAL, StepTally
    cfg = ObjectiveConfig(mode=mode)
    mcfg = ModelConfig.from_dict(dict(TINY_MODEL))
    names = ("a", "b", "c")
    tally = StepTally(mcfg, "chunked", names)
    batches, losses, stats_of = [], [], []
    for i in range(3):
        rows = _rows(20 + i, cfg, ROWS_OF, T)
        batch = collate(rows, T, PAD_ID, sources=[[(b + j + i) % 3 for j in range(len(r))]
                                                  for b, r in enumerate(rows)])
        batch["keys"] = [f"m{i}-{b}" for b in range(len(rows))]
        h, w = _hidden_head((len(rows), T), seed=i)
        loss, stats = _loss("chunked", h, w, batch, cfg, 3)
        if i == 1:
            loss = loss * float("nan")
        tally.add_batch(batch)
        tally.add_losses(loss, stats)
        batches.append(batch)
        losses.append((float(loss), float(stats["ar_loss"]), float(stats["mdm_loss"])))
        stats_of.append(stats)
    sums = tally.packed(signal=True) * 2        # the all-reduce over 2 TP ranks
    assert sums[NONFINITE].item() == 2 and sums[SIGNAL].item() == 2
    assert tally.nonfinite_batches() == [(1, batches[1]["keys"])]
    rec = tally.record(sums, step=7, tp=2, losses=3, world_size=2, step_time_s=0.5, lr=1e-3,
                       grad_norm=1.5, applied=True, peak_flops=2e9, consumed_samples=10,
                       consumed_tokens=100, shares=(0.5, 0.25, 0.25), dual=mode == "dual")
    finite = [0, 2]
    for k, name in enumerate(("loss", "ar_loss", "mdm_loss")):
        assert rec[name] == pytest.approx(sum(losses[i][k] for i in finite) / 2, rel=1e-12)
    tokens = sum(int(b["real_tokens"]) for b in batches)
    rows = sum(int(b["input_ids"].shape[0]) for b in batches)
    assert (rec["consumed_samples"], rec["consumed_tokens"]) == (10 + rows, 100 + tokens)
    assert rec["tokens_per_s"] == pytest.approx(tokens / 0.5)
    want_tokens = {n: sum(int(((b["source"] == s) & (b["segment_ids"] > 0)).sum())
                          for b in batches) for s, n in enumerate(names)}
    assert rec["tokens_by_source"] == want_tokens and sum(want_tokens.values()) == tokens
    ce = [sum(float(stats_of[i]["ce_sum_by_source"][s]) for i in finite) for s in range(3)]
    lab = [sum(int(stats_of[i]["labelled_by_source"][s]) for i in finite) for s in range(3)]
    assert rec["loss_by_source"] == pytest.approx({n: c / k for n, c, k in zip(names, ce, lab)},
                                                  rel=1e-12)
    assert rec["target_share_by_source"] == {"a": 0.5, "b": 0.25, "c": 0.25}
    flops = [step_flops(mcfg, segment_lengths(b["segment_ids"]),
                        int((b["labels"] != IGNORE_INDEX).sum()),
                        b["input_ids"].numel() - int(b["real_tokens"]), mcfg.recompute, "chunked")
             for b in batches]
    assert rec["tflops_per_device"] == pytest.approx(sum(f[0] for f in flops) / 0.5 / 2 / 1e12)
    assert rec["mfu"] == pytest.approx(sum(f[0] for f in flops) / 0.5 / 2 / 2e9)
    assert rec["hfu"] == pytest.approx(sum(f[1] for f in flops) / 0.5 / 2 / 2e9)
    assert (rec["step"], rec["lr"], rec["grad_norm"], rec["skipped"]) == (7, 1e-3, 1.5, False)
    if mode == "dual":
        copies = sum(int(b["copy_tokens"]) for b in batches)
        assert copies > 0 and rec["copy_tokens"] == copies
        assert rec["clean_tokens"] == tokens - copies
        assert rec["dropped_copies"] == sum(int(b.get("dropped_copies", 0)) for b in batches)
    else:
        assert "copy_tokens" not in rec


def test_validation_console_line_names_each_source_of_a_mixture(caplog):
    from pipeline.training.metrics import ConsoleLog
    rec = {"kind": "val", "step": 8, "val_loss": 2.5, "val_ar_loss": 1.0, "val_mdm_loss": 1.5,
           "val_batches": 3}
    log = ConsoleLog(max_steps=10, log_interval=1)
    with caplog.at_level("INFO", logger="pipeline.train"):
        log({**rec, "loss_by_source": {"math": 2.25, "code": None}})
        log({**rec, "loss_by_source": {"shards": 2.5}})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "validation at step 8: loss 2.5000 | ar 1.0000 | mdm 1.5000 | by source: math 2.2500, "
        "code n/a (3 micro-batches per DP rank)",
        "validation at step 8: loss 2.5000 | ar 1.0000 | mdm 1.5000 (3 micro-batches per DP "
        "rank)"]
