"""bench/gpu_decode_check.py: the decoding part of the one-GPU check. Not a test; CI never needs it.

    python bench/gpu_decode_check.py [--json PATH]          # one CUDA GPU (an H200: 1-2 minutes)
    python bench/gpu_decode_check.py --smoke [--json PATH]  # CPU smoke mode: tiny model, few tokens

On one CUDA GPU: a Qwen3-8B-shaped model (configs/model/qwen3_8b.yaml: hidden size, heads and
vocabulary of 8B) with `--layers` (4) layers and random weights (transformers' initialisation,
copied into ours), bf16, a batch of `--batch` (8) prompts of 64-127 random ids. It prints
1. per-forward milliseconds of AR decoding (the one-token steps of `--gen-length` (128) new
   tokens) and of refusion decoding (slot size 4, 2 blocks, slot/token thresholds 0.9/0.5, so
   plan, verify and draft forwards): median, 90th percentile and max over the forwards of a
   timed decode after a warm-up decode, the device synchronized around every forward;
2. the same AR steps replayed from a CUDA graph (`ar_generate(cuda_graph=True)`) and whether
   its tokens equal the eager decode's;
3. AR tokens/s of ours vs transformers' `generate` with `cache_implementation="static"` on the
   same weights and prompts, as a ratio (`bench_decoding.compare_with_transformers`): with
   transformers eager, and, when at least `--compile-min-left-s` of the `--budget-s` are left,
   with transformers' default on CUDA (its forward auto-compiled; the warm-up call absorbs the
   compilation);
4. the targets "AR decode forward <= 10 ms at batch 8 on the 4-layer model" and "AR tokens/s >=
   transformers' generate", each MET or NOT MET;
5. decode memory against the plan (`pipeline.training.memory_plan.plan_decoding`): for ar and
   draft_every, `torch.cuda.max_memory_allocated()` during one decode above the allocation
   before it (the weights) vs the plan without its weights, and the KV cache's bytes vs the
   planned cache (no target: a ratio far from 1 is a finding; the CPU measurement is
   tests/test_memory_plan_decode.py; `--smoke` prints the planned figures only);
6. (run before 5, when `--lossless-min-left-s` (15) of the budget are left) lossless decoding
   in bf16: the share of `--lossless-prompts` (32) prompts whose ids from
   `verify=draft_ahead` and `draft_every` (greedy, token threshold 0.5, slot size 4, no EOS,
   `--gen-length` tokens, batches of `--batch`) equal bf16 AR decoding's, and the mean number
   of leading tokens equal (exact arithmetic would make every prompt equal: docs/METHOD.md
   "Lossless in bf16"); on the CPU (`--smoke`) a bf16 copy of the model. `--lossless-only`
   runs this part alone (with `--smoke`: at `--gen-length` and `--batch`, not the smoke sizes).
`--smoke` runs the same parts on the CPU with the tiny preset (configs/model/tiny.yaml), fp32, 3
prompts and a few tokens (seconds); its figures only show that the parts run, and the targets
are not judged. `bench/gpu_check.sh` runs this script.

Exit status: 0 when every part ran (a target not met is a finding, not a failure), 1 when a
part failed (its error is printed), 2 without CUDA and without `--smoke` (one line).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

TARGET_FORWARD_MS = 10.0


def _figures(ms: list[float]) -> dict:
    """Median, 90th percentile and max of per-forward milliseconds."""
    s = sorted(ms)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
            "max": s[-1], "forwards": len(s)}


class ForwardTimer:
    """Times every batched forward of the decoding driver (`driver._forward`: eager or a CUDA
    graph replay), the device synchronized before and after; records `(new tokens per row,
    milliseconds)`."""

    def __init__(self, device: torch.device):
        from pipeline.inference import driver
        from pipeline.inference.loading import synchronize
        self.records: list[tuple[int, float]] = []
        self._decoding, self._real = driver, driver._forward

        def timed(model, batch, cache, graphs):
            synchronize(device)
            t0 = time.perf_counter()
            out = self._real(model, batch, cache, graphs)
            synchronize(device)
            self.records.append((batch.ids.shape[1], (time.perf_counter() - t0) * 1e3))
            return out
        driver._forward = timed

    def take(self) -> list[tuple[int, float]]:
        out, self.records = self.records, []
        return out

    def close(self) -> None:
        self._decoding._forward = self._real


def build_models(cfg, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(ours, transformers') Qwen3 with the same random weights: transformers' initialisation
    on `device`, copied into ours (`pipeline.model.hf.TensorSource`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from pipeline.model import Qwen3
    from pipeline.model.hf import TensorSource, hf_config_dict, load_hf_into_model
    from pipeline.model.weights import empty_model
    torch.manual_seed(seed)
    with torch.device(device):
        hf = Qwen3ForCausalLM(Qwen3Config(**hf_config_dict(cfg))).to(dtype).eval()
    model = empty_model(Qwen3, cfg, dtype, device)
    load_hf_into_model(model, TensorSource(dict(hf.state_dict())))
    return model.eval(), hf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke mode (tiny model)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the 8B-shaped model")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--gen-length", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed calls per tokens/s figure (median)")
    ap.add_argument("--budget-s", type=float, default=110.0,
                    help="seconds the check aims to stay within")
    ap.add_argument("--compile-min-left-s", type=float, default=60.0,
                    help="run the auto-compiled transformers comparison only with this many "
                         "seconds of the budget left")
    ap.add_argument("--lossless-prompts", type=int, default=32,
                    help="prompts of the bf16 lossless comparison (part 6)")
    ap.add_argument("--lossless-min-left-s", type=float, default=15.0,
                    help="run part 6 only with this many seconds of the budget left")
    ap.add_argument("--lossless-only", action="store_true",
                    help="run part 6 alone (with --smoke: at --gen-length and --batch)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    t_start = time.perf_counter()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("bench/gpu_decode_check.py: error: no CUDA device visible "
              "(torch.cuda.is_available() is False); --smoke runs the CPU smoke mode",
              file=sys.stderr)
        return 2

    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.model import ModelConfig
    from pipeline.parallel import init_single_process
    from bench_decoding import compare_with_transformers

    init_single_process()
    if smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cfg = ModelConfig.from_yaml(ROOT / "configs/model/tiny.yaml")
        batch, gen, ref_gen, repeats = 3, 6, 8, 1
        if args.lossless_only:
            batch, gen = args.batch, args.gen_length
        lengths = (4, 10)
        name = "CPU (smoke mode)"
    else:
        device, dtype = torch.device("cuda:0"), torch.bfloat16
        cfg = dataclasses.replace(ModelConfig.from_yaml(ROOT / "configs/model/qwen3_8b.yaml"),
                                  num_layers=args.layers, recompute=False)
        batch, gen, ref_gen, repeats = args.batch, args.gen_length, args.gen_length, args.repeats
        lengths = (64, 128)
        name = torch.cuda.get_device_name(device)
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    model, hf = build_models(cfg, dtype, device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(cfg.vocab_size, 151000), (int(n),), generator=g).tolist()
               for n in torch.randint(lengths[0], lengths[1], (batch,), generator=g)]
    res: dict = {"device": name, "dtype": str(dtype).replace("torch.", ""),
                 "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "batch": batch,
                 "gen_length": gen, "prompt_lengths": [len(p) for p in prompts],
                 "smoke": smoke, "failed": []}
    print(f"gpu_decode_check: {name}; Qwen3 {'tiny preset' if smoke else '8B-shaped'} with "
          f"{cfg.num_layers} layers, random weights, {res['dtype']}, batch {batch}, prompts of "
          f"{min(res['prompt_lengths'])}-{max(res['prompt_lengths'])} tokens, {gen} new tokens; "
          f"torch {torch.__version__}; models built in {time.perf_counter() - t_start:.1f} s")
    timer = ForwardTimer(device)

    def part(label, fn):
        try:
            fn()
        except Exception as e:   # report, go on with the other parts
            res["failed"].append(label)
            print(f"{label}: FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stderr)

    def ar_forwards():
        outs = {}
        for graph in (False, True):
            ar_generate(model, prompts, gen, 0.0, None, cuda_graph=graph)       # warm-up
            timer.take()
            outs[graph] = ar_generate(model, prompts, gen, 0.0, None, cuda_graph=graph)
            steps = [ms for t, ms in timer.take() if t == 1]
            res["ar_graph_forward_ms" if graph else "ar_forward_ms"] = _figures(steps)
        res["graph_tokens_equal_eager"] = outs[True].tokens == outs[False].tokens
        f, fg = res["ar_forward_ms"], res["ar_graph_forward_ms"]
        print(f"AR decode forward (one new token per row, {f['forwards']} steps): median "
              f"{f['median']:.2f} ms, p90 {f['p90']:.2f} ms, max {f['max']:.2f} ms")
        graph_note = ("CUDA graph" if device.type == "cuda"
                      else "cuda_graph=True (no CUDA: the eager path)")
        print(f"AR decode forward, {graph_note}: median {fg['median']:.2f} ms, p90 "
              f"{fg['p90']:.2f} ms, max {fg['max']:.2f} ms; tokens equal to the eager decode: "
              f"{res['graph_tokens_equal_eager']}")

    def refusion_forwards():
        kw = dict(gen_length=ref_gen, slot_size=4, num_blocks=2, slot_threshold=0.9,
                  token_threshold=0.5, temperature=0.0, mask_id=cfg.vocab_size - 1,
                  eos_id=None)
        refusion_generate(model, prompts, **kw)                               # warm-up
        timer.take()
        out = refusion_generate(model, prompts, **kw)
        ms = [m for _, m in timer.take()]
        f = res["refusion_forward_ms"] = _figures(ms)
        kinds = sum(out.forwards, start=Counter())
        print(f"refusion decode forward (slot size 4, 2 blocks, thresholds 0.9/0.5; "
              f"{f['forwards']} batched forwards, per-row kinds {dict(kinds)}): median "
              f"{f['median']:.2f} ms, p90 {f['p90']:.2f} ms, max {f['max']:.2f} ms")

    def versus_transformers():
        runs = [("hf_eager", "off", False), ("hf_eager_graph", "off", True)]
        if device.type == "cuda":
            runs.append(("hf_compiled", "auto", False))
        for key, mode, graph in runs:
            if mode == "auto" and left() < args.compile_min_left_s:
                print(f"ar vs transformers generate (static cache, auto-compiled): skipped "
                      f"({left():.0f} s of the {args.budget_s:.0f} s budget left, "
                      f"--compile-min-left-s {args.compile_min_left_s:.0f})")
                continue
            if graph and device.type != "cuda":
                continue
            t0 = time.perf_counter()
            c = compare_with_transformers(model, prompts, gen, repeats, mode, hf=hf,
                                          cuda_graph=graph)
            res[key] = {k: c[k] for k in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio",
                                          "same_tokens", "prompts", "hf_mode")}
            print(f"ar{' (CUDA graph)' if graph else ''} vs transformers generate (static "
                  f"cache, {c['hf_mode']}): ours {c['ours_tokens_per_s']:.0f} tokens/s, "
                  f"transformers {c['hf_tokens_per_s']:.0f} tokens/s, ratio {c['ratio']:.2f}; "
                  f"identical greedy tokens {c['same_tokens']}/{c['prompts']} prompts "
                  f"({time.perf_counter() - t0:.0f} s)")

    try:
        if not args.lossless_only:
            part("AR forwards", ar_forwards)
            part("refusion forwards", refusion_forwards)
    finally:
        timer.close()   # tokens/s are timed without the per-forward synchronization
    if not args.lossless_only:
        part("transformers comparison", versus_transformers)

    def decode_memory():
        from pipeline.model import KVCache
        from pipeline.training.memory_plan import plan_decoding
        made = KVCache.for_model.__func__
        caches = []

        def for_model(cls, *a, **kw):     # keep the decode's cache to count its bytes
            caches.append(made(cls, *a, **kw))
            return caches[-1]

        res["decode_memory"] = {}
        for mode in ("ar", "draft_every"):
            plan = plan_decoding(cfg, tp=1, batch=batch, prompt=max(res["prompt_lengths"]),
                                 gen_length=gen, verify=mode, slot_size=4,
                                 precision="bf16" if dtype == torch.bfloat16 else "fp32",
                                 device=device.type)
            planned = plan.total - plan.components["weights (decode dtype)"]
            rec = {"planned_bytes": planned,
                   "planned_cache_bytes": plan.components["decoding KV cache"]}
            measured = ""
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                KVCache.for_model = classmethod(for_model)
                try:
                    if mode == "ar":
                        ar_generate(model, prompts, gen, 0.0, None)
                    else:
                        refusion_generate(model, prompts, gen, 4, 1, 0.5, 0.5, 0.0,
                                          cfg.vocab_size - 1, None, verify=mode)
                finally:
                    KVCache.for_model = classmethod(made)
                torch.cuda.synchronize()
                cache = caches.pop()
                rec["measured_bytes"] = torch.cuda.max_memory_allocated() - before
                rec["cache_bytes_per_row_x_batch"] = (
                    sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
                    // cache.batch_size * batch)
                measured = (f"measured {rec['measured_bytes'] / 2 ** 20:.1f} MiB (measured / "
                            f"planned {rec['measured_bytes'] / planned:.2f}); KV cache "
                            f"{rec['cache_bytes_per_row_x_batch'] / 2 ** 20:.1f} MiB vs planned "
                            f"{rec['planned_cache_bytes'] / 2 ** 20:.1f} MiB; ")
            res["decode_memory"][mode] = rec
            how = ("max_memory_allocated" if device.type == "cuda"
                   else "not measured on the CPU")
            print(f"decode memory ({mode}, batch {batch}, {gen} new tokens) above the weights: "
                  f"{measured}planned {planned / 2 ** 20:.1f} MiB ({how})")

    def lossless_bf16():
        if left() < args.lossless_min_left_s and not args.lossless_only:
            print(f"lossless in bf16: skipped ({left():.0f} s of the {args.budget_s:.0f} s "
                  f"budget left, --lossless-min-left-s {args.lossless_min_left_s:.0f})")
            return
        bf16 = model if dtype == torch.bfloat16 else build_models(cfg, torch.bfloat16, device)[0]
        n = args.lossless_prompts
        g = torch.Generator().manual_seed(1)
        more = [torch.randint(0, min(cfg.vocab_size, 151000), (int(m),), generator=g).tolist()
                for m in torch.randint(lengths[0], lengths[1], (n,), generator=g)]
        res["lossless_bf16"] = lossless_share(bf16, more, gen, batch, cfg.vocab_size - 1)
        for v, r in res["lossless_bf16"].items():
            print(f"lossless in bf16 ({v}, greedy, token threshold 0.5, k 4, {gen} tokens, "
                  f"batch {batch}): ids equal to bf16 AR decoding for {r['equal']}/{r['prompts']}"
                  f" prompts ({r['share']:.2f}); mean leading tokens equal {r['mean_prefix']:.1f}"
                  f" of {gen}")

    part("lossless in bf16", lossless_bf16)
    if not args.lossless_only:
        part("decode memory", decode_memory)

    # Targets
    targets = {}
    if "ar_forward_ms" in res:
        best = min(res["ar_forward_ms"]["median"],
                   res.get("ar_graph_forward_ms", {}).get("median", float("inf")))
        targets["ar_forward_le_10ms"] = best <= TARGET_FORWARD_MS
        print(f"target: AR decode forward <= {TARGET_FORWARD_MS:g} ms at batch {batch} on the "
              f"{cfg.num_layers}-layer model: "
              f"{_verdict(targets['ar_forward_le_10ms'], smoke)} (median {best:.2f} ms, the "
              f"faster of eager and CUDA graph)")
    ours_best = max((res[k]["ours_tokens_per_s"] for k in ("hf_eager", "hf_eager_graph")
                     if k in res), default=None)
    for key, label in (("hf_eager", "eager"), ("hf_compiled", "auto-compiled")):
        if key in res and ours_best is not None:
            ratio = ours_best / res[key]["hf_tokens_per_s"]
            targets[f"ar_tokens_per_s_ge_transformers_{label}"] = ratio >= 1.0
            print(f"target: AR tokens/s >= transformers' generate (static cache, {label}): "
                  f"{_verdict(ratio >= 1.0, smoke)} (ours {ours_best:.0f} tokens/s, the faster "
                  f"of eager and CUDA graph; ratio {ratio:.2f})")
    res["targets"] = targets
    res["seconds"] = time.perf_counter() - t_start
    print(f"gpu_decode_check: {res['seconds']:.0f} s"
          + (f"; FAILED parts: {', '.join(res['failed'])}" if res["failed"] else ""))
    if args.json:
        from pipeline.common.atomic_io import write_json
        write_json(args.json, res, indent=1)
    return 1 if res["failed"] else 0


def lossless_share(model, prompts: list[list[int]], gen: int, batch: int, mask_id: int,
                   modes=("draft_ahead", "draft_every")) -> dict:
    """Per lossless mode: how many of `prompts` get exactly the ids of AR decoding with the same
    `model` (greedy, token threshold 0.5, slot size 4, no EOS, `gen` tokens, `batch` prompts per
    call). Returns `{mode: {"equal", "prompts", "share", "mean_prefix"}}` (`mean_prefix`: mean
    count of leading tokens equal to AR's)."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    ar = [t for c in chunks for t in ar_generate(model, c, gen, 0.0, None).tokens]
    out = {}
    for v in modes:
        ids = [t for c in chunks for t in refusion_generate(model, c, gen, 4, 1, 0.9, 0.5, 0.0,
                                                            mask_id, None, verify=v).tokens]
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                  for x, y in zip(ids, ar)]
        equal = sum(x == y for x, y in zip(ids, ar))
        out[v] = {"equal": equal, "prompts": len(prompts), "share": equal / len(prompts),
                  "mean_prefix": sum(prefix) / len(prefix)}
    return out


def _verdict(ok: bool, smoke: bool) -> str:
    if smoke:
        return "not judged (smoke mode)"
    return "MET" if ok else "NOT MET"


if __name__ == "__main__":
    sys.exit(main())
