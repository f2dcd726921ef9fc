"""Decoding speed: TPF and tokens/s of plan-and-infill (refusion) vs AR mode, across thresholds
and verify modes, and AR decoding against transformers' `generate`.

Prints one line per setting: generated tokens, model forwards, TPF (tokens / forwards), tokens/s
(tokens / wall seconds of the batched decode; each setting is decoded `--repeats` times and the
median wall time is used, as single timings on a shared machine are noisy), the reference code's TPF figure, and the fraction
of prompts whose text equals the AR decode of the same model (docs/METHOD.md "TPF, TPS and the other figures").
`--verify` takes one or more modes (`pipeline.generate --verify`): each setting is decoded with
each, the timed decodes of the modes alternating (A B A B ...) so that all see the same load,
and a last column gives each mode's tokens/s over the first mode's (the median of the
per-repeat ratios). draft_ahead and draft_every do not use the slot threshold (one line per
token threshold). `--mask-attention bidirectional` decodes draft_ahead and draft_every with
bidirectional mask blocks (`pipeline.generate --mask-attention`; the other modes stay causal).
`--device auto` (default) decodes on CUDA when available, else on the CPU; the dtype defaults
to bfloat16 on CUDA, float32 on the CPU (`--dtype`); wall times are read with the device
synchronized (`pipeline.inference.decoding`).

Model: `--model` (an HF folder or checkpoint; an error when it cannot be loaded), else the
demo's export `outputs/demo/hf` when it exists, else a tiny random Qwen3 (tests/tiny_qwen3.py)
with random prompts; a random model's distributions are
flat, so its figures only show the mechanics. Prompts: the query/response prompts of the demo
shards' val split when `--data` exists and the model has a tokenizer, else random ids.

With `--baseline FILE` (a `pipeline/inference/decoding.py` of another version, e.g. `git show
REF:pipeline/inference/decoding.py > /tmp/decoding_before.py`, loaded beside ours as a module),
every setting is also decoded with it, the timed decodes alternating (before, ours, before, ...),
and the last column of our line is ours' tokens/s over the baseline's (median of the per-repeat
ratios): a before/after speed figure from one run. Only that file is the other version's: what it
imports from `pipeline.inference` (the driver; since issue 45 also the row programs of
`plan_infill.py` and `left_to_right.py`) is this tree's.

With `--vs-transformers`, a last line compares our AR decoding with transformers'
`Qwen3ForCausalLM.generate` using its static KV cache (`cache_implementation="static"`), on the same weights (copied from our model)
and the same prompts (left-padded for transformers), greedy, without EOS, so both produce
`--gen-length` tokens per prompt: tokens/s of each (median of `--repeats` timed calls after
one warm-up call each; the calls alternate ours / transformers', so both see the same load) and
the median of the per-pair ratios, and how many prompts got identical tokens.
`--only-vs-transformers` prints only that line (no refusion grid). transformers compiles
its forward with a static cache on CUDA by default (`--hf-compile auto`; the warm-up call
absorbs the compilation); `--hf-compile off` measures it eager.

    .venv/bin/python bench/bench_decoding.py [--model outputs/demo/hf] [--data outputs/demo/shards]
        [--prompts 8] [--gen-length 64] [--slot-size 4] [--num-blocks 2] [--batch-size 8]
        [--verify MODE [MODE ...]] [--mask-attention causal|bidirectional] [--repeats 3]
        [--baseline FILE]
        [--device auto|cpu|cuda[:N]]
        [--dtype float32|bfloat16|float16]
        [--vs-transformers | --only-vs-transformers [--hf-compile auto|off]]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from pipeline.inference.decoding import MASK_ATTENTIONS, VERIFY_MODES  # noqa: E402

GRID = [(0.9, 0.9), (0.9, 0.5), (0.6, 0.3), (0.6, 0.1), (0.3, 0.3), (0.3, 0.0), (1.5, 0.0)]


def hf_twin(model):
    """transformers' `Qwen3ForCausalLM` holding the weights of our `model` (TP=1), in its dtype
    and on its device, in eval mode.

    Raises:
        ValueError: the copy left a transformers tensor without a value.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from pipeline.model.hf import hf_config_dict, merge_tp_state_dicts
    p = next(model.parameters())
    state = merge_tp_state_dicts([{n: t.detach() for n, t in model.named_parameters()}],
                                 model.cfg)
    with torch.device(p.device):
        hf = Qwen3ForCausalLM(Qwen3Config(**hf_config_dict(model.cfg))).to(p.dtype)
    missing, _ = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"hf_twin: no value for transformers tensors {missing[:5]}")
    return hf.eval()


def _left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, attention_mask)`: LongTensor[B, max P] left-padded with 0, and its 0/1 mask."""
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        am[i, t - len(p):] = 1
    return ids.to(device), am.to(device)


def compare_with_transformers(model, prompts: list[list[int]], gen_length: int, repeats: int,
                              hf_compile: str = "auto", hf=None,
                              cuda_graph: bool = False) -> dict:
    """AR tokens/s of ours vs transformers' `generate` with its static cache (see the module
    docstring): same weights (`hf_twin(model)` unless `hf`, a `Qwen3ForCausalLM` with our
    model's weights, is given), same prompts, greedy, no EOS, `gen_length` new tokens per
    prompt, one batched call each.

    Args:
        hf_compile: "auto" (transformers' default: compiled on CUDA with a static cache) or
            "off" (`disable_compile=True`).
        cuda_graph: our AR steps from a CUDA graph (`ar_generate(cuda_graph=True)`).
    Returns:
        dict: `ours_tokens_per_s`, `hf_tokens_per_s`, `ratio` (ours / transformers: the
        median over the `repeats` pairs of one call of each, run back to back), `ratios` (each
        pair's),
        `same_tokens` (prompts whose greedy tokens are identical), `prompts`, `ours_tokens`,
        `hf_tokens` (`list[list[int]]`), `hf_mode`. Tokens/s: `len(prompts) * gen_length`
        over the median wall seconds of `repeats` timed calls after one warm-up call, the device
        synchronized; the timed calls alternate ours / transformers'.
    """
    import time
    from pipeline.inference.decoding import ar_generate
    from pipeline.inference.loading import synchronize
    if hf_compile not in ("auto", "off"):
        raise ValueError(f"hf_compile must be auto or off, got {hf_compile!r}")
    device = next(model.parameters()).device
    hf = hf_twin(model) if hf is None else hf
    # No EOS: generate runs to max_new_tokens, as ar_generate(..., eos_id=None) does.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids, am = _left_padded(prompts, device)
    kw = dict(attention_mask=am, max_new_tokens=gen_length, do_sample=False,
              cache_implementation="static", pad_token_id=0, eos_token_id=None)
    if hf_compile == "off":
        kw["disable_compile"] = True

    def timed(fn):
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        return out, time.perf_counter() - t0

    def run_ours():
        return ar_generate(model, prompts, gen_length, 0.0, None, cuda_graph=cuda_graph).tokens

    def run_hf():
        return hf.generate(ids, **kw)

    with torch.no_grad():
        run_ours(), run_hf()   # warm-up (transformers compiles here on CUDA)
        pairs = [(timed(run_ours), timed(run_hf)) for _ in range(repeats)]
    ours, seq = pairs[-1][0][0], pairs[-1][1][0]
    ours_s = statistics.median(o[1] for o, _ in pairs)
    hf_s = statistics.median(h[1] for _, h in pairs)
    ratios = [h[1] / o[1] for o, h in pairs]
    hf_tokens = seq[:, ids.shape[1]:].tolist()
    n = len(prompts) * gen_length
    return {"ours_tokens_per_s": n / ours_s, "hf_tokens_per_s": n / hf_s,
            "ratio": statistics.median(ratios), "ratios": ratios,
            "same_tokens": sum(a == b for a, b in zip(ours, hf_tokens)),
            "prompts": len(prompts), "ours_tokens": ours, "hf_tokens": hf_tokens,
            "hf_mode": ("eager" if hf_compile == "off" or device.type != "cuda"
                        else "transformers' default (auto-compiled on CUDA)")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="HF folder or checkpoint (default: outputs/demo/hf if it exists, else "
                         "a tiny random Qwen3)")
    ap.add_argument("--data", default=str(ROOT / "outputs/demo/shards"),
                    help="shard folder whose val prompts are used (when the model is real)")
    ap.add_argument("--prompts", type=int, default=8, help="number of prompts")
    ap.add_argument("--gen-length", type=int, default=64,
                    help="tokens to generate (authors / correct: rounded up to a multiple of "
                         "--slot-size)")
    ap.add_argument("--slot-size", type=int, default=4, help="tokens per slot (k)")
    ap.add_argument("--num-blocks", type=int, default=2,
                    help="blocks of the generation region (must divide the number of slots)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed decodes per setting; tokens/s uses the median wall time")
    ap.add_argument("--verify", nargs="+", choices=VERIFY_MODES, default=["authors"],
                    help="what a rejected draft becomes (pipeline.generate --verify); several "
                         "modes are decoded side by side, their timed decodes alternating")
    ap.add_argument("--mask-attention", choices=MASK_ATTENTIONS, default="causal",
                    help="draft_ahead and draft_every: how a drafting block's masks attend to "
                         "each other (pipeline.generate --mask-attention)")
    ap.add_argument("--exact-cache", action="store_true",
                    help="re-encode slots infilled in parallel (exact KV cache)")
    ap.add_argument("--device", default="auto",
                    help="auto (CUDA when available), cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="parameter dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--hf-compile", default="auto", choices=("auto", "off"),
                    help="transformers' generate: its default (compiled on CUDA with a static "
                         "cache) or eager")
    ap.add_argument("--vs-transformers", action="store_true",
                    help="add AR tokens/s against transformers' generate (static cache)")
    ap.add_argument("--only-vs-transformers", action="store_true",
                    help="only the comparison with transformers' generate (no refusion grid)")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="decoding.py of another version: each setting also decoded with it, "
                         "alternating; the ratio column is ours over it")
    args = ap.parse_args()
    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.common.cli import DTYPES, UsageError
    from pipeline.model.weights import empty_model
    from pipeline.parallel import init_single_process
    from pipeline.inference.cli import check_decoding_args
    from pipeline.inference.loading import default_dtype, load_for_inference, resolve_device
    try:  # validate before any decoding
        for v in args.verify:
            check_decoding_args(argparse.Namespace(**{**vars(args), "verify": v,
                                                      "mask_attention": _mask_attention(args, v)},
                                                   temperature=0.0, slot_threshold=0.0,
                                                   token_threshold=0.5))
        if args.prompts < 1 or args.repeats < 1:
            raise UsageError("--prompts and --repeats must be >= 1")
        base = _load_baseline(args.baseline) if args.baseline else None
        device = resolve_device(args.device)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    init_single_process()
    model_path = args.model
    if model_path is None and (ROOT / "outputs/demo/hf/config.json").is_file():
        model_path = str(ROOT / "outputs/demo/hf")
    if model_path is not None:
        try:
            loaded = load_for_inference(model_path, dtype=dtype, device=device)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        args.model = model_path
        model, mask_id, eos_id = loaded.model, loaded.mask_id, loaded.eos_id
        source = args.model
        prompts = []
        if (Path(args.data) / "manifest.json").is_file():
            from pipeline.inference.evaluation import shard_qa_examples
            prompts = [e["prompt_ids"] for e in shard_qa_examples(args.data, "val", args.prompts)]
        if not prompts:
            prompts = [loaded.tokenizer.prompt_ids(q) for q in
                       ["def add(a, b):", "class Stack:", "def read_lines(path):"]]
    else:
        from pipeline.model.hf import config_from_hf, load_hf_into_model
        from pipeline.model import Qwen3
        from tiny_qwen3 import make_tiny_qwen3
        folder = make_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny", seed=0)
        model = empty_model(Qwen3, config_from_hf(folder), dtype, device)
        load_hf_into_model(model, folder)
        model.eval()
        mask_id, eos_id = 511, None
        source = "tiny random Qwen3 (no --model, no outputs/demo/hf)"
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 40, (args.prompts,), generator=g)]
    prompts = prompts[:args.prompts]
    print(f"model: {source}; {len(prompts)} prompts; gen_length {args.gen_length}, slot_size "
          f"{args.slot_size}, num_blocks {args.num_blocks}, batch {args.batch_size}, "
          f"cache {'exact' if args.exact_cache else 'default (reference)'}; "
          f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), "
          f"{str(dtype).replace('torch.', '')}; torch threads {torch.get_num_threads()}; "
          f"tokens/s: median of {args.repeats} timed decodes per setting (device synchronized)")

    def run_once(fn):
        toks, fw, secs, ref_tpf = [], 0, 0.0, []
        for i in range(0, len(prompts), args.batch_size):
            out = fn(prompts[i:i + args.batch_size])
            toks += out.tokens
            fw += sum(out.num_forwards(j) for j in range(len(out.tokens)))
            secs += out.seconds
            ref_tpf += [x for x in out.tpf_reference_style if x is not None]
        return toks, fw, secs, (sum(ref_tpf) / len(ref_tpf) if ref_tpf else None)

    def run(fn):
        """Greedy decodes are deterministic: tokens/forwards of the first run; wall seconds:
        the median over `--repeats` runs."""
        runs = [run_once(fn) for _ in range(args.repeats)]
        toks, fw, _, rt = runs[0]
        return toks, fw, statistics.median(r[2] for r in runs), rt

    def run_side_by_side(fns):
        """`run` of several decodes, their timed runs alternating (A B A B ...); also each
        one's tokens/s over the first one's: the median of the per-repeat ratios."""
        runs = [[] for _ in fns]
        for _ in range(args.repeats):
            for r, fn in zip(runs, fns):
                r.append(run_once(fn))

        def tps(x):
            return sum(len(t) for t in x[0]) / x[2]

        return [(r[0][0], r[0][1], statistics.median(x[2] for x in r), r[0][3],
                 statistics.median(tps(b) / tps(a) for a, b in zip(runs[0], r)))
                for r in runs]

    if args.only_vs_transformers:
        return _print_comparison(model, prompts, args)
    run_once(lambda p: ar_generate(model, p, 4, 0.0, eos_id))  # warm-up

    def ar_fn(gen=ar_generate):
        return lambda p: gen(model, p, args.gen_length, 0.0, eos_id)

    if base is not None:   # ar against the baseline's
        ar_before, ar = run_side_by_side([ar_fn(base.ar_generate), ar_fn()])
    else:
        ar = run(ar_fn())
    print(f"{'mode':<22}{'slot_thr':>9}{'tok_thr':>8}{'tokens':>8}{'forwards':>9}{'TPF':>7}"
          f"{'tokens/s':>10}{'ref-TPF':>8}{'same as AR':>11}{'tok/s ratio':>12}")

    def line(name, st, tt, r, ratio=None):
        toks, fw, secs, rt = r[:4]
        n = sum(len(t) for t in toks)
        same = sum(a == b for a, b in zip(toks, ar[0])) / len(toks)
        print(f"{name:<22}{st:>9}{tt:>8}{n:>8}{fw:>9}{n / fw:>7.2f}{n / secs:>10.1f}"
              f"{(f'{rt:.2f}' if rt is not None else '-'):>8}{same:>11.2f}"
              f"{(f'{ratio:.2f}' if ratio is not None else '-'):>12}")

    if base is not None:
        line("before/ar", "-", "-", ar_before)
    line("ar", "-", "-", ar, ar[4] if base is not None else None)
    left_to_right = ("draft_ahead", "draft_every")
    done = set()
    for st, tt in GRID:
        modes = [v for v in args.verify if (v, tt if v in left_to_right else (st, tt)) not in done]
        done |= {(v, tt if v in left_to_right else (st, tt)) for v in modes}
        if not modes:
            continue
        def fn(v, gen=refusion_generate):
            return lambda p: gen(model, p, args.gen_length, args.slot_size, args.num_blocks, st,
                                 tt, 0.0, mask_id, eos_id, exact_cache=args.exact_cache,
                                 verify=v, mask_attention=_mask_attention(args, v))

        if base is not None:   # each mode against the baseline's
            for v in modes:
                before, r = run_side_by_side([fn(v, base.refusion_generate), fn(v)])
                line(f"before/{v}", "-" if v in left_to_right else st, tt, before)
                line(f"refusion/{v}", "-" if v in left_to_right else st, tt, r, r[4])
            continue
        for v, r in zip(modes, run_side_by_side([fn(v) for v in modes])):
            line(f"refusion/{v}", "-" if v in left_to_right else st, tt, r,
                 r[4] if len(args.verify) > 1 else None)
    if args.vs_transformers:
        return _print_comparison(model, prompts, args)
    return 0


def _load_baseline(path: str):
    """The module of another version's decoding.py at `path` (`--baseline`). Raises UsageError
    when it cannot be loaded or lacks `ar_generate` / `refusion_generate`."""
    import importlib.util
    from pipeline.common.cli import UsageError
    if not Path(path).is_file():
        raise UsageError(f"--baseline {path}: no such file")
    spec = importlib.util.spec_from_file_location("decoding_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise UsageError(f"--baseline {path}: cannot be loaded ({type(e).__name__}: {e})")
    if not all(hasattr(mod, f) for f in ("ar_generate", "refusion_generate")):
        raise UsageError(f"--baseline {path}: no ar_generate / refusion_generate")
    return mod


def _mask_attention(args, verify: str) -> str:
    """`--mask-attention` for the modes that take it (draft_ahead, draft_every), else causal."""
    return args.mask_attention if verify in ("draft_ahead", "draft_every") else "causal"


def _print_comparison(model, prompts, args) -> int:
    c = compare_with_transformers(model, prompts[:args.batch_size], args.gen_length,
                                  args.repeats, args.hf_compile)
    print(f"ar vs transformers generate (static cache, {c['hf_mode']}; same weights and "
          f"{c['prompts']} prompts, greedy, no EOS, {args.gen_length} tokens each): ours "
          f"{c['ours_tokens_per_s']:.1f} tokens/s, transformers "
          f"{c['hf_tokens_per_s']:.1f} tokens/s, ratio {c['ratio']:.2f} (median of "
          f"{len(c['ratios'])} alternating pairs: "
          f"{' '.join(f'{r:.2f}' for r in sorted(c['ratios']))}); identical tokens "
          f"{c['same_tokens']}/{c['prompts']} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
