"""The decoding memory plan (`pipeline.training.memory_plan.plan_decoding`, `python -m
pipeline.plan_memory --decode-batch ...`) against real decodes of a tiny Qwen3 on the CPU.

Measured: the peak bytes of the tensor storages created during one `ar_generate` /
`refusion_generate` call and alive at once (`live_storage.LiveStorage`, the model's parameters
and buffers excluded): the KV cache, each forward's working memory, its logits and the
decisions read from them (one forward's logits alive at a time: they are freed before the next
forward). The plan without its weights must be within 10% of it (verify "authors" is planned
with every slot selected; the test selects them all); the bytes of the cache tensors the decode
allocated (`KVCache.keys` / `values`, storage after any growth) must equal the written-out
count, and their storage columns the planned ones (an upper bound: authors' rows go in step and
do not reach it).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from live_storage import LiveStorage
from tiny_qwen3 import make_tiny_qwen3

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tp1):
    """Tiny checkpoints written by transformers, loaded by `load_model` in fp32 and bf16:
    one with a 512-row vocabulary (the cache and the prompt's forward dominate), one with
    8192 rows (the logits dominate)."""
    from pipeline.inference.loading import load_model
    out = {}
    for vocab in (512, 8192):
        src = make_tiny_qwen3(tmp_path_factory.mktemp(f"v{vocab}") / "hf", vocab_size=vocab,
                              num_hidden_layers=4, max_position_embeddings=1024)
        for dtype in (torch.float32, torch.bfloat16):
            out[vocab, dtype] = load_model(src, dtype, device="cpu")[:2]
    return out


def _decode(model, mode, batch, prompt, gen, caches, slot_threshold):
    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.model import KVCache
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompts = torch.randint(0, vocab - 2, (batch, prompt), generator=g)
    made = KVCache.for_model.__func__

    def for_model(cls, *args, **kwargs):   # keep the decode's cache to count its bytes
        caches.append(made(cls, *args, **kwargs))
        return caches[-1]

    tracker = LiveStorage(exclude=[*model.parameters(), *model.buffers()])
    KVCache.for_model = classmethod(for_model)
    try:
        with tracker:
            if mode == "ar":
                ar_generate(model, prompts, gen, 0.0, None)
            else:   # eos None: every row decodes all `gen` tokens
                refusion_generate(model, prompts, gen, 4, 2, slot_threshold, 0.5, 0.0, vocab - 1,
                                  None, verify=mode)
    finally:
        KVCache.for_model = classmethod(made)
    return tracker.peak


CASES = [  # vocab, dtype, verify, batch, prompt, generated, tolerance
    (512, torch.float32, "ar", 4, 192, 64, 0.10),
    (8192, torch.float32, "draft_every", 4, 32, 32, 0.10),
    (8192, torch.bfloat16, "draft_ahead", 2, 16, 64, 0.10),
    # every slot selected (slot_threshold 0), as the plan assumes
    (8192, torch.bfloat16, "authors", 2, 16, 64, 0.10),
]


@pytest.mark.parametrize("vocab,dtype,mode,batch,prompt,gen,tol", CASES,
                         ids=[f"{c[2]}-{c[0]}-{str(c[1])[6:]}" for c in CASES])
def test_decode_plan_matches_measured_peak_and_cache_bytes(models, vocab, dtype, mode, batch,
                                                           prompt, gen, tol):
    from pipeline.training.memory_plan import decode_feed, kv_cache_bytes, plan_decoding
    model, cfg = models[vocab, dtype]
    caches = []
    measured = _decode(model, mode, batch, prompt, gen, caches, slot_threshold=0.0)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    plan = plan_decoding(cfg, tp=1, batch=batch, prompt=prompt, gen_length=gen, verify=mode,
                         slot_size=4, num_blocks=2, precision=precision, device="cpu")
    c = plan.components
    planned = plan.total - c["weights (decode dtype)"]
    print(f"{mode} V={vocab} {precision} B={batch} P={prompt} G={gen}: planned {planned} "
          f"measured {measured} ({planned / measured:.3f}); {plan.layout}")
    assert abs(planned - measured) <= tol * measured, (planned, measured, c)
    # the cache: the bytes of the tensors the decode allocated, storage growth included (rows
    # that finished early have left it: bytes per row x rows)
    (cache,) = caches
    counted = (sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
               // cache.batch_size * batch)
    # written out: 2 (keys, values) x layers x rows x kv heads x columns x head_dim x bytes
    assert counted == (2 * cfg.num_layers * batch * cfg.num_key_value_heads
                       * cache.storage_columns * cfg.head_dim * dtype.itemsize)
    assert counted == kv_cache_bytes(cfg, 1, batch, cache.storage_columns, dtype.itemsize)
    feed = decode_feed(mode, prompt, gen, 4, 2, batch=batch)
    assert c["decoding KV cache"] == kv_cache_bytes(cfg, 1, batch, feed["columns"],
                                                    dtype.itemsize)
    # the planned storage is an upper bound (rows at different progress may need more
    # columns); here the decodes reach it except authors, whose rows go in step
    assert cache.storage_columns <= feed["columns"]
    if mode != "authors":
        assert cache.storage_columns == feed["columns"]
    if mode in ("draft_every", "draft_ahead"):   # the storage grew past prompt + generation
        assert cache.storage_columns > prompt + gen
    assert c["weights (decode dtype)"] == sum(p.numel() * p.element_size()
                                              for p in model.parameters())


def test_decode_feed_sizes():
    """The fed tokens of each mode, written out (module docstring of memory_plan)."""
    from pipeline.training.memory_plan import decode_feed
    assert decode_feed("ar", 100, 50)["first"] == 100 and decode_feed("ar", 100, 50)["later"] == 1
    f = decode_feed("draft_every", 100, 64, slot_size=4)
    assert (f["first"], f["later"]) == (105, 1 + 4 + 25)
    # the last offset with 4 drafts and 5 whole blocks of 5 masks: c = 55 (55 + 4 + 4 + 1 = 64)
    assert f["need"] == 100 + 55 + 4 + 25 > 164
    assert f["columns"] == 164 + 82     # one growth: max(need, 1.5 C)
    f = decode_feed("draft_ahead", 100, 64, slot_size=4, bucket=64)
    assert (f["first"], f["later"], f["columns"]) == (108, 9, 192)
    # two rows: one row's longest cache (163) + another's largest feed (9) > 164 -> 1.5 x 164
    f = decode_feed("draft_ahead", 100, 64, slot_size=4, batch=2)
    assert (f["need"], f["columns"]) == (172, 246)
    # only authors and correct round the generation up to whole slots (issue 43 item 4)
    assert [decode_feed(m, 100, 10, slot_size=4)["capacity"]
            for m in ("ar", "draft_ahead", "draft_every", "authors", "correct")] == [
        110, 110, 110, 112, 112]
    f = decode_feed("authors", 10, 32, slot_size=4, num_blocks=2, exact_cache=True)
    assert (f["first"], f["later"]) == (26, 32)
    with pytest.raises(ValueError, match="verify must be one of"):
        decode_feed("nope", 1, 1)


def test_cli_decoding_plan_qwen3_8b():
    """`--decode-batch 8 --decode-prompt 1024 --decode-gen 256` on configs/qwen3_8b.yaml (TP 2):
    the KV cache is 2 x 36 layers x 8 rows x 4 KV heads x 1280 columns (bucket 64) x 128 x 2
    bytes; a missing size is one line, exit 2."""
    r = subprocess.run([sys.executable, "-m", "pipeline.plan_memory", "--config",
                        "configs/qwen3_8b.yaml", "--nodes", "4", "--gpu-memory", "80",
                        "--decode-batch", "8", "--decode-prompt", "1024", "--decode-gen", "256"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decoding memory plan per GPU (decoding, TP 2, bf16, batch 8" in r.stdout
    kv = [ln for ln in r.stdout.splitlines() if "decoding KV cache" in ln]
    assert float(kv[0].split()[-2]) == pytest.approx(2 * 36 * 8 * 4 * 1280 * 128 * 2 / 2 ** 30,
                                                     abs=0.005)
    assert "largest decode batch that fits" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pipeline.plan_memory", "--config",
                        "configs/qwen3_8b.yaml", "--nodes", "4", "--decode-batch", "8"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--decode-prompt" in r.stderr
