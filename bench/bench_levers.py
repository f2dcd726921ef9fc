"""The training speed levers one at a time, then together: one process, one model, the same batches.

The plain packed training step (no DeepSpeed: model forward on packed rows, `hybrid_loss` on the
labelled positions, backward, torch AdamW) with today's trainer settings as the baseline
(activation checkpointing "full", output layer "chunked", AdamW foreach, no compile; the
attention kernel is `--attention`, default auto = flash varlen on CUDA in bf16), then each lever
alone:
  recompute=selective, recompute=none, loss=fused, loss=torch (when this torch has
  `torch.nn.functional.linear_cross_entropy`), optim=fused, compile (regional torch.compile),
then "all": the best measured choice of each (fastest recompute mode that ran, fastest loss
path, fused AdamW and compile when they were faster than the baseline). For each: tokens/s
(real tokens), the ratio to the baseline, MFU and HFU (`pipeline.model.flops.step_flops` over
the device's dense BF16 peak, `pipeline.model.PEAK_BF16_TFLOPS`; `--peak-tflops` overrides;
n/a on a CPU), peak memory (CUDA max allocated; a lever that runs out of memory is reported
as such and the run goes on) and the last loss.

A profile of one step of the baseline and of "all" (`--profile`): the step is cut into phases
with the device synchronized at each boundary (body forward; output layer + loss, forward and
backward on detached hidden states; body backward; optimizer step), and `torch.profiler`'s
device kernels of each phase are summed by kind: GEMM (cuBLAS/CUTLASS kernel names), attention
(flash/varlen/flex/SDPA kernels), elementwise (everything else in the body phases), loss (every
kernel of the loss phase), optimizer (every kernel of the optimizer phase), and idle (phase wall
time not covered by kernels: launch gaps, host work). On a CPU the split uses the profiler's
CPU operators instead of kernels (GEMM = aten mm/addmm/bmm).

    python bench/bench_levers.py --data SHARDS --model-config configs/model/qwen3_8b_16layers.yaml \\
        --rows 2 --row-length 4096 --device cuda --dtype bf16 [--steps 3] [--warmup 1] \\
        [--levers baseline,selective,none,loss_fused,loss_torch,optim_fused,compile,all] \\
        [--profile baseline,all] [--json FIGURES.json] [--time-limit SECONDS]

With `--time-limit`, a single lever is skipped (one line) once that many seconds have passed since
the start ("all" still runs), so the run stays inside a budget (bench/gpu_check.sh gives it part
of the time it has).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BASELINE = {"recompute": "full", "loss_impl": "chunked", "fused_optim": False, "compile": False}
LEVERS = {
    "baseline": {},
    "selective": {"recompute": "selective"},
    "none": {"recompute": "none"},
    "loss_fused": {"loss_impl": "fused"},
    "loss_torch": {"loss_impl": "torch"},
    "optim_fused": {"fused_optim": True},
    "compile": {"compile": True},
}
ALL_ORDER = ["baseline", "selective", "none", "loss_fused", "loss_torch", "optim_fused",
             "compile", "all"]


def categorize(name: str) -> str:
    """Kind of a device kernel (or CPU operator) by its name: gemm, attention or elementwise."""
    low = name.lower()
    if re.search(r"flash|fmha|attention|attn|sdpa|varlen|flex", low):
        return "attention"
    if re.search(r"gemm|cutlass|cublas|nvjet|xmma|sm\d\d_|aten::(mm|addmm|bmm|matmul|linear"
                 r"|baddbmm|addmm_)$", low):
        return "gemm"
    return "elementwise"


def _device_events(prof):
    """The device's kernels, copies and sets of a profile: device-side events that are not the
    device-side images of `record_function` ranges (torch's optimizer step opens one; counting
    it would count its kernels twice)."""
    from torch.autograd import DeviceType
    return [e for e in prof.events()
            if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)]


def profile_phases(phases, device) -> dict:
    """Run `phases` [(name, fn)] one after another under torch.profiler, the device
    synchronized at each boundary; returns seconds per kind (module docstring) and `step_s`."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {k: 0.0 for k in ("gemm", "attention", "elementwise", "loss", "optimizer", "idle")}
    total = 0.0
    for phase, fn in phases:
        _sync(device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            _sync(device)
            wall = time.perf_counter() - t0
        total += wall
        if cuda:
            busy = {}
            for e in _device_events(prof):
                us = e.time_range.elapsed_us()
                kind = phase if phase in ("loss", "optimizer") else categorize(e.name)
                busy[kind] = busy.get(kind, 0.0) + us / 1e6
        else:   # CPU: self time of the operators (one thread of work, launched in order)
            busy = {}
            for e in prof.key_averages():
                if not e.key.startswith("aten::"):
                    continue
                kind = phase if phase in ("loss", "optimizer") else categorize(e.key)
                busy[kind] = busy.get(kind, 0.0) + e.self_cpu_time_total / 1e6
        used = sum(busy.values())
        for k, v in busy.items():
            out[k] += v
        out["idle"] += max(0.0, wall - used)
    out["step_s"] = total
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", required=True, help="shard folder (train split)")
    ap.add_argument("--model-config", default=str(ROOT / "configs/model/qwen3_8b_16layers.yaml"))
    ap.add_argument("--vocab-size", type=int, default=0, help="override the preset's vocab_size")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per micro-batch")
    ap.add_argument("--row-length", type=int, default=0, help="tokens per row (0 = manifest's)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per lever")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per lever first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--attention", default="auto", help="model.attention of the packed forward")
    ap.add_argument("--levers", default=",".join(ALL_ORDER))
    ap.add_argument("--profile", default="baseline,all", help="levers to profile one step of")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds (0 = none)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from pipeline.parallel import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    from pipeline.data import DataError, build_loader, read_manifest
    from pipeline.model import ModelConfig, Qwen3, peak_tflops_of_device
    from pipeline.model.flops import step_flops
    from pipeline.model.linear_ce import torch_linear_ce_available
    from pipeline.objective import ObjectiveConfig, hybrid_loss
    from pipeline.parallel import init_distributed
    from pipeline.training.engine import make_torch_adamw, param_groups
    try:
        man = read_manifest(args.data)
    except DataError as e:
        print(f"bench_levers.py: error: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_levers.py: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    T = args.row_length or int(man["max_length"])
    init_distributed(1, backend="gloo")
    cfg = ModelConfig.from_yaml(args.model_config)
    if args.vocab_size:
        cfg.vocab_size = args.vocab_size
    cfg.attention = args.attention
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3(cfg, dtype=dtype, init_weights=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0.0, cfg.init_std)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = (args.peak_tflops or peak_tflops_of_device(name) or 0.0) * 1e12 or None

    # The same batches for every lever, loaded once (loader time is not part of the step here).
    it = iter(build_loader(args.data, "train", args.rows, T, seed=0, num_workers=0, pack=True,
                           shuffle=False, infinite=True, vocab_size=cfg.vocab_size))
    batches = []
    for _ in range(args.warmup + args.steps):
        b = next(it)
        batches.append({k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()})
    ocfg = ObjectiveConfig()
    print(f"model {Path(args.model_config).name}: {cfg.num_layers} layers, {n_params / 1e9:.2f}B "
          f"parameters (built in {build_s:.0f} s); {args.rows} packed rows x {T} tokens; "
          f"{name}, {args.dtype}, attention {args.attention}; {args.warmup} warm-up + "
          f"{args.steps} timed steps per lever", flush=True)

    def loss_kwargs(s):
        if s["loss_impl"] == "chunked":
            return {"head": model.head_logits}
        return {"head_loss": lambda h, t, c: model.head_loss(h, t, c, impl=s["loss_impl"])}

    def forward(batch):
        return model(batch["input_ids"], batch["position_ids"], segment_ids=batch["segment_ids"],
                     return_hidden=True, cu_seqlens=batch["cu_seqlens"],
                     max_seqlen=batch["max_seqlen"])

    def step(opt, batch, s):
        hidden = forward(batch)
        loss, _ = hybrid_loss(hidden, batch, ocfg, **loss_kwargs(s))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def flops(batch, s):
        real = int(batch["real_tokens"])
        return step_flops(cfg, batch["segment_lengths"].cpu(), int(batch["label_index"].numel()),
                          batch["input_ids"].numel() - real, s["recompute"], s["loss_impl"])

    def apply(s):
        model.cfg.recompute = s["recompute"]
        model.compile_layers(enabled=s["compile"])

    results: dict[str, dict] = {}
    profiles: dict[str, dict] = {}
    wanted = [x for x in args.levers.split(",") if x]
    to_profile = {x for x in args.profile.split(",") if x}

    def measure(lever: str, s: dict) -> None:
        if (lever != "all" and args.time_limit
                and time.perf_counter() - t_start > args.time_limit):
            print(f"{lever:<12} skipped (--time-limit {args.time_limit:.0f} s spent)", flush=True)
            return
        apply(s)
        opt = make_torch_adamw(param_groups(model, 0.0), lr=1e-6, betas=(0.9, 0.95), eps=1e-8,
                               fused=s["fused_optim"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            t_lever = time.perf_counter()
            for b in batches[:args.warmup]:
                step(opt, b, s)
            _sync(device)
            t0 = time.perf_counter()
            for b in batches[args.warmup:]:
                loss = step(opt, b, s)
            _sync(device)
            dt = time.perf_counter() - t0
            mf = hf = tokens = 0.0
            for b in batches[args.warmup:]:
                m, h = flops(b, s)
                mf, hf, tokens = mf + m, hf + h, tokens + int(b["real_tokens"])
            r = {"settings": dict(s), "tokens_per_s": tokens / dt, "step_s": dt / args.steps,
                 "mfu": mf / dt / peak if peak else None, "hfu": hf / dt / peak if peak else None,
                 "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                                     if device.type == "cuda" else None),
                 "loss": float(loss), "lever_s": time.perf_counter() - t_lever}
            if lever in to_profile:
                b = batches[-1]
                holder = {}

                def body_forward():
                    holder["hidden"] = forward(b)
                    holder["cut"] = holder["hidden"].detach().requires_grad_(True)

                def loss_phase():
                    loss, _ = hybrid_loss(holder["cut"], b, ocfg, **loss_kwargs(s))
                    loss.backward()

                def body_backward():
                    holder["hidden"].backward(holder["cut"].grad)

                def optimizer():
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                profiles[lever] = profile_phases(
                    [("body_forward", body_forward), ("loss", loss_phase),
                     ("body_backward", body_backward), ("optimizer", optimizer)], device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if "out of memory" not in str(e).lower():
                raise
            r = {"settings": dict(s), "oom": True}
        opt = None  # free the optimizer state before the next lever
        gc.collect()
        results[lever] = r
        base = results.get("baseline", {}).get("tokens_per_s")
        if r.get("oom"):
            print(f"{lever:<12} out of memory", flush=True)
            return
        fmt = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f} GiB"
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        print(f"{lever:<12} {r['tokens_per_s']:>10.0f} tokens/s ({ratio} baseline) | MFU "
              f"{fmt(r['mfu'])} | HFU {fmt(r['hfu'])} | peak memory {mem} | step "
              f"{r['step_s']:.3f} s | loss {r['loss']:.3f} | {_describe(s)}", flush=True)

    for lever in wanted:
        if lever == "all":
            continue
        if lever not in LEVERS:
            print(f"bench_levers.py: error: unknown lever {lever!r}; known: "
                  f"{','.join(ALL_ORDER)}", file=sys.stderr)
            return 2
        if lever == "loss_torch" and not torch_linear_ce_available():
            print(f"{lever:<12} skipped (torch {torch.__version__} has no "
                  f"torch.nn.functional.linear_cross_entropy)", flush=True)
            continue
        measure(lever, {**BASELINE, **LEVERS[lever]})
    chosen = choose(results)
    if "all" in wanted:
        measure("all", chosen)
    for lever, p in profiles.items():
        tot = p["step_s"]
        parts = " | ".join(f"{k} {100 * p[k] / tot:.0f}%" for k in
                           ("gemm", "attention", "elementwise", "loss", "optimizer", "idle"))
        print(f"profile {lever:<8} one step {tot:.3f} s (phases synchronized): {parts}",
              flush=True)
    summary = {"device": name, "dtype": args.dtype, "model": Path(args.model_config).name,
               "layers": cfg.num_layers, "parameters": n_params, "rows": args.rows,
               "row_length": T, "attention": args.attention, "results": results,
               "chosen": chosen, "chosen_overrides": trainer_overrides(chosen),
               "profiles": profiles, "seconds": time.perf_counter() - t_start}
    print(f"chosen from these measurements: {_describe(chosen)} (trainer overrides: "
          f"{' '.join(summary['chosen_overrides'])})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _describe(s: dict) -> str:
    return (f"recompute {s['recompute']}, loss {s['loss_impl']}, AdamW "
            f"{'fused' if s['fused_optim'] else 'foreach'}, compile {'on' if s['compile'] else 'off'}")


def choose(results: dict) -> dict:
    """The best measured choice of each lever (module docstring); the baseline's where a lever
    was not measured or was not faster."""
    def rate(name):
        r = results.get(name)
        return r["tokens_per_s"] if r and not r.get("oom") else None
    base = rate("baseline")
    s = dict(BASELINE)
    best = max(((rate(n), n) for n in ("baseline", "selective", "none") if rate(n)),
               default=(None, "baseline"))
    s["recompute"] = {**BASELINE, **LEVERS[best[1]]}["recompute"]
    best = max(((rate(n), n) for n in ("baseline", "loss_fused", "loss_torch") if rate(n)),
               default=(None, "baseline"))
    s["loss_impl"] = {**BASELINE, **LEVERS[best[1]]}["loss_impl"]
    s["fused_optim"] = bool(base and rate("optim_fused") and rate("optim_fused") > base)
    s["compile"] = bool(base and rate("compile") and rate("compile") > base)
    return s


def trainer_overrides(s: dict) -> list[str]:
    """The run-config overrides (`pipeline.config`) that select settings `s` in the trainer."""
    return [f"train.activation_checkpointing={s['recompute']}", f"train.loss_impl={s['loss_impl']}",
            f"optim.fused={'true' if s['fused_optim'] else 'false'}",
            f"train.compile={'true' if s['compile'] else 'false'}"]


if __name__ == "__main__":
    sys.exit(main())
