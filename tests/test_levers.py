"""The training speed levers (issue 19), each against today's path on a tiny fp32 model.

What is compared against what (loss AND gradients of every parameter, fp32):
- activation checkpointing "selective" and "full" against "none" (and the boolean alias);
- the output layer + cross-entropy "fused" (ours, TP=1 and TP=2) and "torch"
  (`torch.nn.functional.linear_cross_entropy`, TP=1) against "chunked" (today's
  `labelled_cross_entropy`), in both objective modes, with several chunk sizes and an
  all-padding row; at TP=2 through `tests/distributed.py` against the TP=1 model with the same
  seeded weights;
- torch AdamW `fused=True` against the default (foreach) step;
- regional `torch.compile` of the decoder layers (inductor on the CPU) against eager;
- the step's precomputed collate fields (`label_index`, `cu_seqlens`, `max_seqlen`,
  `segment_lengths`) against what the step used to compute on the device, and a forward +
  loss + backward that performs no device-to-host read (no `nonzero`, no `.item()`);
- MFU/HFU accounting (`pipeline.model.flops.step_flops`) against a brute-force count: torch's
  FlopCounterMode over every matrix multiply the step runs (recompute and loss path
  included), and the attention pairs counted on the dense mask.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shard_fixtures import random_samples

V = 512
PAD_ID, MASK_ID = 0, 2


def _tiny_cfg(**kw):
    from pipeline.model import ModelConfig
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention="sdpa",
                init_std=0.1)
    base.update(kw)
    return ModelConfig(**base)


def _model(cfg, seed=3, tp_rank=0, tp_size=1):
    """A Qwen3 with the seeded random weights of `pipeline.model.init` (the same network on
    every TP layout)."""
    from pipeline.model import Qwen3
    from pipeline.model.init import random_tp_shards
    from pipeline.model.weights import copy_into_model
    m = Qwen3(cfg, init_weights=False)
    copy_into_model(m, random_tp_shards(cfg, seed, tp_rank, tp_size), source="test")
    return m.train()


def _batch(mode="refusion", seed=0, rows_of=((0, 1), (2,), (3, 4, 5), ()), T=96):
    from pipeline.objective import ObjectiveConfig, collate, reorganize_sample
    cfg = ObjectiveConfig(mode=mode)
    rng = np.random.default_rng(seed)
    samples = random_samples(rng, 6, vocab_size=V, max_length=30, min_length=3, max_prompt=8)
    reorg = [reorganize_sample(x, s, f"k{seed}-{i}", seed=1, epoch=0, mask_id=MASK_ID, cfg=cfg)
             for i, (x, s) in enumerate(samples)]
    return collate([[reorg[i] for i in r] for r in rows_of], T, PAD_ID), cfg


def _step(model, batch, ocfg, loss_impl="chunked", chunk=2048, use_index=True):
    """Forward + hybrid_loss + backward the way the trainer does; returns (loss, stats, grads)."""
    from pipeline.objective import hybrid_loss
    b = dict(batch)
    if not use_index:
        for k in ("label_index", "cu_seqlens", "max_seqlen"):
            b.pop(k)
    model.zero_grad(set_to_none=True)
    hidden = model(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"],
                   return_hidden=True, cu_seqlens=b.get("cu_seqlens"),
                   max_seqlen=b.get("max_seqlen"))
    if loss_impl == "chunked":
        loss, stats = hybrid_loss(hidden, b, ocfg, head=model.head_logits, chunk_tokens=chunk)
    else:
        loss, stats = hybrid_loss(
            hidden, b, ocfg,
            head_loss=lambda h, t, c: model.head_loss(h, t, c, impl=loss_impl, chunk_tokens=chunk))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), {k: v for k, v in stats.items()}, grads


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    (la, sa, ga), (lb, sb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    for k in ("ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens"):
        torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=rtol, atol=atol, msg=k)
        assert ga[k].abs().sum() > 0 or gb[k].abs().sum() == 0, k


# ---- collate fields: no host sync in the step ------------------------------------------------

def test_collate_carries_label_index_and_varlen_boundaries():
    """collate's precomputed fields equal what the step computed on the device before:
    `label_index` = nonzero(labels != -100), `cu_seqlens`/`max_seqlen` =
    `attention.varlen_boundaries(segment_ids)`, `segment_lengths` = `flops.segment_lengths`."""
    from pipeline.model import segment_lengths
    from pipeline.model.attention import varlen_boundaries
    batch, _ = _batch()
    flat = batch["labels"].reshape(-1)
    assert torch.equal(batch["label_index"], (flat != -100).nonzero().flatten())
    cu, longest = varlen_boundaries(batch["segment_ids"])
    assert batch["cu_seqlens"].dtype == torch.int32 and torch.equal(batch["cu_seqlens"], cu)
    assert isinstance(batch["max_seqlen"], int) and batch["max_seqlen"] == longest
    assert torch.equal(batch["segment_lengths"], segment_lengths(batch["segment_ids"]))
    assert int(batch["segment_lengths"].sum()) == int(batch["real_tokens"])


_SYNC_OPS = ("nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2",
             "unique_consecutive", "unique_dim")


def test_training_step_reads_nothing_back_from_the_device(tp1):
    """With collate's fields, forward + hybrid_loss + backward run no op whose output size or
    value the host must wait for (on a GPU: a device-to-host synchronisation): no `nonzero`,
    no `.item()` / `int(tensor)` (`_local_scalar_dense`), no boolean-mask indexing. Checked for
    both output-layer paths and for selective recompute; without `label_index` the old path's
    `nonzero` is seen (so the check can fail)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _SYNC_OPS:
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    batch, ocfg = _batch()
    for impl, recompute in (("chunked", "none"), ("fused", "selective"), ("fused", "full")):
        model = _model(_tiny_cfg(recompute=recompute))
        with Recorder() as rec:
            _step(model, batch, ocfg, impl)
        assert rec.seen == [], (impl, rec.seen)
    with Recorder() as rec:
        _step(_model(_tiny_cfg()), batch, ocfg, "chunked", use_index=False)
    assert "nonzero" in rec.seen


def test_varlen_plan_takes_collate_boundaries(monkeypatch):
    """`plan_attention("varlen", ..., cu_seqlens=, max_seqlen=)` uses them as given and does not
    recompute them (the recompute is the host sync)."""
    from pipeline.model import attention as A
    batch, _ = _batch()
    monkeypatch.setattr(A, "resolve_attention", lambda kind, *a, **k: kind)
    monkeypatch.setattr(A, "varlen_boundaries", lambda seg: (_ for _ in ()).throw(
        AssertionError("recomputed")))
    plan = A.plan_attention("varlen", batch["segment_ids"], True, torch.bfloat16,
                            cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
    assert plan.kind == "varlen" and torch.equal(plan.cu_seqlens, batch["cu_seqlens"])
    assert plan.max_seqlen == batch["max_seqlen"]


# ---- activation checkpointing ----------------------------------------------------------------

def test_recompute_modes_give_todays_loss_and_gradients(tp1):
    """"selective" and "full" (and the boolean alias True) == "none": same loss and gradients
    of every parameter (fp32), in both objective modes and for both output-layer paths."""
    from pipeline.model.config import recompute_mode
    assert [recompute_mode(v) for v in (True, False, None, "true", "False", "selective")] == \
        ["full", "none", "none", "full", "none", "selective"]
    with pytest.raises(ValueError, match="recompute must be one of none|selective|full"):
        recompute_mode("some")
    for mode in ("refusion", "ar"):
        batch, ocfg = _batch(mode, seed=4)
        model = _model(_tiny_cfg())
        ref = _step(model, batch, ocfg)
        for recompute in ("selective", "full", True):
            model.cfg.recompute = recompute
            _assert_same(_step(model, batch, ocfg), ref, rtol=1e-6, atol=1e-7)
            _assert_same(_step(model, batch, ocfg, "fused"), ref)


# ---- the output layer + cross-entropy --------------------------------------------------------

@pytest.mark.parametrize("mode", ["refusion", "ar"])
@pytest.mark.parametrize("chunk", [13, 4096])
def test_fused_and_torch_output_loss_equal_chunked(tp1, mode, chunk):
    """`loss_impl` "fused" and "torch" == "chunked" (today's): loss, AR/MDM terms and every
    parameter's gradient (the output layer's and, through the hidden states, the body's),
    fp32, on packed rows with an all-padding row; also with nothing labelled (the head still
    gets its zero gradient, as ZeRO-3 needs)."""
    from pipeline.model.linear_ce import torch_linear_ce_available
    batch, ocfg = _batch(mode, seed=5)
    model = _model(_tiny_cfg())
    ref = _step(model, batch, ocfg, "chunked", chunk)
    impls = ["fused"] + (["torch"] if torch_linear_ce_available() else [])
    for impl in impls:
        _assert_same(_step(model, batch, ocfg, impl, chunk), ref)
    empty, _ = _batch(mode, seed=5, rows_of=((), ()))
    for impl in ["chunked"] + impls:
        loss, _, grads = _step(model, empty, ocfg, impl, chunk)
        assert float(loss) == 0.0 and grads["lm_head.weight"].abs().sum() == 0


def test_fused_output_loss_bf16_close_to_chunked(tp1):
    """In bf16 the fused path keeps the chunked path's fp32 softmax math (logits in bf16, their
    exponentials and sums in fp32): same loss to 1e-5, gradients within bf16 rounding (2e-2
    relative L2 per parameter). torch's linear_cross_entropy returns each position's CE in the
    input dtype (bf16), so its loss is within 2e-3 and its gradients within 4e-2."""
    from pipeline.model.linear_ce import torch_linear_ce_available
    batch, ocfg = _batch("refusion", seed=6)
    model = _model(_tiny_cfg()).to(torch.bfloat16)
    (l0, s0, g0) = _step(model, batch, ocfg, "chunked", 16)
    tolerances = {"fused": (1e-5, 2e-2)}
    if torch_linear_ce_available():
        tolerances["torch"] = (2e-3, 4e-2)
    for impl, (loss_tol, grad_tol) in tolerances.items():
        (l1, s1, g1) = _step(model, batch, ocfg, impl, 16)
        torch.testing.assert_close(l1, l0, rtol=loss_tol, atol=loss_tol)
        for k in g0:
            rel = (g1[k].float() - g0[k].float()).norm() / g0[k].float().norm().clamp(min=1e-12)
            assert rel < grad_tol, (impl, k, float(rel))


def _tp2_body(rank, world_size, seed):
    from pipeline.parallel import init_distributed
    init_distributed(tensor_parallel_size=2)
    out = {}
    for mode in ("refusion", "ar"):
        batch, ocfg = _batch(mode, seed=7)
        model = _model(_tiny_cfg(), seed=seed, tp_rank=rank, tp_size=2)
        out[mode] = {"chunked": _step(model, batch, ocfg, "chunked", 5),
                     "fused": _step(model, batch, ocfg, "fused", 5)}
        model.cfg.recompute = "selective"
        out[mode]["selective"] = _step(model, batch, ocfg, "fused", 5)
    return out


def test_fused_output_loss_at_tp2_equals_tp1(tp1):
    """TP=2 (2 gloo processes, vocab-parallel output layer): "fused" (the vocab-parallel
    all-reduces of row max, sum of exponentials and target logit; the input gradient
    all-reduced) == "chunked" (megatron's vocab_parallel_cross_entropy) on each rank, and both
    == the TP=1 model with the same seeded weights: loss and every gradient (each rank's
    TP-split gradients concatenated along the split dim of the tensor-parallel table).
    Selective recompute at TP=2 gives the same too."""
    from distributed import run_distributed
    from pipeline.model.hf import merge_tp_state_dicts
    from pipeline.model.tp import partition_dim
    out = run_distributed(_tp2_body, world_size=2, args=(11,))
    cfg = _tiny_cfg()
    for mode in ("refusion", "ar"):
        batch, ocfg = _batch(mode, seed=7)
        l_ref, s_ref, g_ref = _step(_model(cfg, seed=11), batch, ocfg, "chunked", 5)
        ref = (l_ref, s_ref, merge_tp_state_dicts([g_ref], cfg))
        for impl in ("chunked", "fused", "selective"):
            (l0, s0, g0), (l1, s1, g1) = out[0][mode][impl], out[1][mode][impl]
            torch.testing.assert_close(l1, l0)
            for k in g0:   # replicated parameters: the same full gradient on both ranks
                if partition_dim(k) is None:
                    torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6, msg=k)
            _assert_same((l0, s0, merge_tp_state_dicts([g0, g1], cfg)), ref)


# ---- fused optimizer step ---------------------------------------------------------------------

def test_fused_adamw_equals_foreach_step(tp1):
    """torch AdamW(fused=True) (`optim.fused`) == the default (foreach) AdamW over 3 steps of
    the real loss: every parameter within 1e-5 (fp32 rounding, amplified by Adam's division by
    sqrt(v) where gradients are tiny; each step moves weights by about lr = 1e-2; torch 2.13 has
    the fused kernel on the CPU too)."""
    from pipeline.training.engine import make_torch_adamw, param_groups
    batch, ocfg = _batch(seed=8)
    finals = []
    for fused in (False, True):
        model = _model(_tiny_cfg())
        opt = make_torch_adamw(param_groups(model, 0.01), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                               fused=fused)
        assert opt.defaults["fused"] is (True if fused else None)
        for _ in range(3):
            _step(model, batch, ocfg)
            opt.step()
        finals.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for k in finals[0]:
        torch.testing.assert_close(finals[1][k], finals[0][k], rtol=1e-5, atol=1e-5, msg=k)
        assert not torch.equal(finals[0][k], _model(_tiny_cfg()).state_dict()[k]), k
    # a device without torch's fused kernel: one line naming the switch, not a traceback
    from pipeline.training.state import TrainError
    with pytest.raises(TrainError, match=r"^optim.fused: torch .* has no fused AdamW on meta; "
                                         r"set optim.fused=false$"):
        make_torch_adamw([{"params": [torch.nn.Parameter(torch.empty(2, device="meta"))]}],
                         lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---- regional torch.compile -------------------------------------------------------------------

def test_compiled_regions_equal_eager(tp1):
    """`Qwen3.compile_layers()` (torch.compile of the layers' RMSNorm, RoPE and SwiGLU regions,
    inductor: C++ kernels generated and built on this CPU) == eager: loss and gradients, with
    selective recompute (the compiled regions run again in backward); parameter names
    unchanged."""
    import shutil
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.fail("no C++ compiler: inductor cannot build CPU kernels here")
    batch, ocfg = _batch(seed=9, rows_of=((0, 1), (2, 3)), T=48)
    cfg = _tiny_cfg(num_layers=2, recompute="selective")
    eager = _model(cfg)
    compiled = _model(cfg)
    names = [n for n, _ in compiled.named_parameters()]
    compiled.compile_layers(backend="inductor")
    assert [n for n, _ in compiled.named_parameters()] == names
    ref = _step(eager, batch, ocfg, "fused")
    from torch._dynamo.utils import counters
    counters.clear()
    _assert_same(_step(compiled, batch, ocfg, "fused"), ref, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1    # compiled, not silently eager


# ---- accounting: MFU and HFU ------------------------------------------------------------------

@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_step_flops_against_a_brute_force_count(tp1, monkeypatch, recompute):
    """`step_flops` (model and hardware FLOPs of a micro-batch) against counts it does not
    compute itself: torch's FlopCounterMode over every matrix multiply of forward + loss +
    backward (recomputed forwards included: it sees them run), the query-key pairs counted on
    the dense packed mask (`build_attention_mask`), and the number of attention calls the step
    makes (1 per layer, 2 with recompute). The output layer runs on the labelled positions only
    (its FLOPs scale with `label_index`, not with tokens); "chunked" runs its forward twice,
    "fused" once. (torch's linear_cross_entropy is left out: its forward matmul runs inside one
    op that FlopCounterMode cannot see.)"""
    from torch.utils.flop_counter import FlopCounterMode
    from pipeline.model import qwen3, training_flops
    from pipeline.model.attention import build_attention_mask
    from pipeline.model.flops import step_flops
    batch, ocfg = _batch(seed=10)
    cfg = _tiny_cfg(recompute=recompute)
    seg = batch["segment_ids"]
    b, t = seg.shape
    mask = build_attention_mask(seg, b, t)[:, 0]
    pairs_real, pairs_fed = int(mask[seg > 0].sum()), int(mask.sum())
    labelled, real = int(batch["label_index"].numel()), int(batch["real_tokens"])
    padding = b * t - real
    assert padding > 0 and labelled < real and pairs_fed == pairs_real + padding
    per_pair = 4 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim   # one forward
    calls = []
    inner = qwen3.attention
    monkeypatch.setattr(qwen3, "attention", lambda *a: calls.append(1) or inner(*a))
    # FlopCounterMode's table has no in-place addmm_ (the fused path accumulates the weight
    # gradient with it): count it as addmm.
    aten = torch.ops.aten
    mapping = {aten.addmm_: lambda c, a, b, out_shape=None, **kw: 2 * a[0] * a[1] * b[1]}
    for impl in ("chunked", "fused"):
        model = _model(cfg)
        counter = FlopCounterMode(display=False, custom_mapping=mapping)
        calls.clear()
        with counter:
            _step(model, batch, ocfg, impl)
        forwards = len(calls) / cfg.num_layers
        assert forwards == (1 if recompute == "none" else 2)
        mflops, hflops = step_flops(cfg, batch["segment_lengths"], labelled, padding, recompute,
                                    impl)
        # CPU SDPA is not a matmul FlopCounterMode counts: add attention from the mask count
        # (each attention forward `per_pair` per pair, its backward twice that).
        assert counter.get_total_flops() + per_pair * pairs_fed * (forwards + 2) == hflops
        assert mflops == training_flops(cfg, batch["segment_lengths"], labelled)
        if recompute == "none" and impl == "fused":   # model FLOPs = hardware FLOPs - padding
            body_pad = hflops - mflops - 3 * per_pair * padding
            assert body_pad == 6 * (_body(cfg)) * padding
    # The output layer at labelled positions only, not at every token.
    assert training_flops(cfg, batch["segment_lengths"]) - mflops == \
        6 * V * cfg.hidden_size * (real - labelled)


def _body(cfg):
    h = cfg.hidden_size
    return cfg.num_layers * (h * cfg.head_dim * 2 * (cfg.num_attention_heads
                                                      + cfg.num_key_value_heads)
                             + 3 * h * cfg.intermediate_size)


def test_gpu_proxy_presets():
    """The 8B-shaped GPU proxies: 16 layers (about 4.3B parameters, output layer about 16% of
    the matmul FLOPs per token) and the 4-layer one kept for continuity (2.0B, 44%)."""
    from pathlib import Path
    from pipeline.model import ModelConfig, num_parameters
    from pipeline.model.flops import _body_params
    root = Path(__file__).resolve().parents[1] / "configs" / "model"
    full = ModelConfig.from_yaml(root / "qwen3_8b.yaml")
    for name, layers, params, share in (("qwen3_8b_16layers.yaml", 16, 4.33e9, 0.168),
                                        ("qwen3_8b_4layers.yaml", 4, 2.02e9, 0.446)):
        cfg = ModelConfig.from_yaml(root / name)
        assert cfg.num_layers == layers
        assert {k: v for k, v in cfg.to_dict().items() if k not in ("num_layers", "recompute")} \
            == {k: v for k, v in full.to_dict().items() if k not in ("num_layers", "recompute")}
        assert abs(num_parameters(cfg) - params) < 0.01e9
        head = cfg.vocab_size * cfg.hidden_size
        assert abs(head / (head + _body_params(cfg)) - share) < 0.002


# ---- through the real trainer ------------------------------------------------------------------

def _two_trainer_runs(rank, world_size, config, base_dir):
    from pipeline.train import main
    codes = []
    for name, extra in (("today", []),
                        ("levers", ["train.activation_checkpointing=selective",
                                    "train.loss_impl=fused", "train.loss_chunk_tokens=16",
                                    "optim.fused=true", "train.compile=true"])):
        codes.append(main(["--config", config, f"run_dir={base_dir}/{name}", *extra]))
    return codes


def test_trainer_with_every_lever_equals_todays_trainer(tmp_path):
    """`python -m pipeline.train` (one process, DeepSpeed ZeRO-3, fp32, packed rows, GA 2)
    with selective recompute, the fused output layer, fused AdamW and compiled regions ==
    the same run with today's defaults: per-step loss, AR and MDM terms and gradient norm within
    1e-5 over 4 steps (so the levers also hold under ZeRO-3's parameter gathering: the fused
    loss runs inside the output layer's forward). metrics.jsonl carries HFU beside MFU, and
    HFU > MFU (recompute and padding are hardware work, not model work)."""
    import json
    from distributed import run_distributed
    from shard_fixtures import write_shards
    rng = np.random.default_rng(12)
    write_shards(str(tmp_path / "data"), {"train": random_samples(rng, 24, vocab_size=64,
                                                                  max_length=40)},
                 samples_per_shard=8)
    cfg = {"model": {"inline": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                "num_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 8, "init_std": 0.1,
                                "max_position_embeddings": 64}},
           "data": {"dir": str(tmp_path / "data"), "num_workers": 0, "pack": True},
           "optim": {"lr": 1e-3, "warmup_steps": 1},
           "train": {"max_steps": 4, "micro_batch_size": 1, "global_batch_size": 2,
                     "precision": "fp32", "seed": 3},
           "checkpoint": {"interval": 0}, "wandb": {"mode": "disabled"},
           "log": {"peak_tflops": 1.0}}
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(cfg))
    codes, = run_distributed(_two_trainer_runs, 1, (str(config), str(tmp_path)))
    assert codes == [0, 0]
    runs = {}
    for name in ("today", "levers"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(x) for x in lines if json.loads(x)["kind"] == "train"]
    assert [m["step"] for m in runs["levers"]] == [1, 2, 3, 4]
    for a, b in zip(runs["today"], runs["levers"]):
        for k in ("loss", "ar_loss", "mdm_loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (a["step"], k, a[k], b[k])
        assert a["hfu"] > a["mfu"] > 0 and b["hfu"] > b["mfu"] > 0
