"""Will it fit: `python -m pipeline.plan_memory --config RUN.yaml [key=value ...] [--nodes N]
[--gpus-per-node G | --world-size W] [--gpu-memory GiB] [--device cuda|cpu]
[--decode-batch B --decode-prompt P --decode-gen G [--decode-verify MODE] [--slot-size K]
[--num-blocks N] [--exact-cache]]`.

Prints the per-GPU memory plan of a run config (`pipeline.training.memory_plan`: weights,
fp32 master weights, AdamW moments, gradients, ZeRO-3 gathered parameters and buckets,
activations by recompute mode, the output layer's buffers, a total) and, with a memory size,
whether it fits and the largest micro-batch that does. Nothing is built, no shard folder or HF
folder is read (the model preset is enough). The config is read by `pipeline.config.load_config`
like `pipeline.train` reads it (same overrides, same one-line errors, exit 2). The world size:
`--world-size`, else `--nodes x --gpus-per-node` (default 8 GPUs per node), else
WORLD_SIZE / SLURM_NTASKS, else 1 (refused in one line naming the flags when the config's TP
size is larger). The fed row length is `data.max_length` (or the shards'
`max_length` when `data.dir` is readable). `--gpu-memory` defaults to `train.gpu_memory_gib`.
Training never decodes (validation is a loss); with `--decode-batch` it also prints the plan of
decoding with the config's model and TP size (`plan_decoding`: weights in the decode dtype, bf16
on cuda and fp32 on cpu as `pipeline.inference.loading.default_dtype`; the KV cache; the largest
forward's attention bias, RoPE tables, MLP or logits, the decisions read from the logits), for
`--decode-batch` rows (`pipeline.generate` / `pipeline.evaluate --batch-size`), prompts of at
most `--decode-prompt` tokens and `--decode-gen` generated tokens (`--gen-length`), decoded with
`--decode-verify` ar (`ar_generate`, the default) or a `--verify` mode of `refusion_generate`.
Exit codes: 0 fits (or no memory size given), 1 a plan does not fit, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys

from pipeline.common.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE

GIB = 1 << 30


def _row_length(cfg) -> int:
    from pipeline.config import ConfigError
    if cfg.data.max_length is not None:
        return int(cfg.data.max_length)
    if cfg.data.dir or cfg.data.sources:
        from pipeline.config import data_sources
        from pipeline.data import DataError, read_manifest
        key = "data.dir" if cfg.data.dir else "data.sources"
        try:
            return max(int(read_manifest(s.dir)["max_length"]) for s in data_sources(cfg.data))
        except DataError as e:
            raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    raise ConfigError("data.max_length: not set and no readable data.dir or data.sources; give "
                      "data.max_length=TOKENS to plan")


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, print the plan. Returns the exit code (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m pipeline.plan_memory",
                                 description="Per-GPU memory plan of a training run config.")
    ap.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="omegaconf overrides, e.g. train.micro_batch_size=8")
    ap.add_argument("--world-size", type=int, default=None, help="processes (GPUs) in the job")
    ap.add_argument("--nodes", type=int, default=None, help="nodes (x --gpus-per-node)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                    help="memory of one GPU in GiB (default train.gpu_memory_gib)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the run trains (picks the attention kernel; default cuda)")
    from pipeline.inference.cli import DECODING_DEFAULTS
    dec = ap.add_argument_group("decoding (module docstring)")
    dec.add_argument("--decode-batch", type=int, default=None, metavar="B",
                     help="also plan decoding B prompts at a time")
    dec.add_argument("--decode-prompt", type=int, default=None, metavar="TOKENS",
                     help="tokens of the longest prompt")
    dec.add_argument("--decode-gen", type=int, default=None, metavar="TOKENS",
                     help="tokens generated (--gen-length)")
    dec.add_argument("--decode-verify", default="ar",
                     choices=("ar", "authors", "correct", "draft_ahead", "draft_every"))
    dec.add_argument("--slot-size", type=int, default=DECODING_DEFAULTS["slot_size"])
    dec.add_argument("--num-blocks", type=int, default=DECODING_DEFAULTS["num_blocks"])
    dec.add_argument("--exact-cache", action="store_true")
    args = ap.parse_args(argv)
    from pipeline.config import ConfigError, _world_size_from_env, load_config, model_fields
    from pipeline.training.memory_plan import format_plan, plan_decoding, plan_for_run
    try:
        cfg = load_config(args.config, args.overrides)
        import os
        tp = int(cfg.train.tensor_parallel_size)
        if args.world_size is not None:
            ws = args.world_size
        elif args.nodes is not None:
            ws = args.nodes * args.gpus_per_node
        elif any(os.environ.get(k) for k in ("WORLD_SIZE", "SLURM_NTASKS")):
            ws = _world_size_from_env()
        elif tp > 1:
            raise ConfigError(f"no world size given and train.tensor_parallel_size={tp} needs "
                              f"more than 1 GPU: pass --nodes N [--gpus-per-node G] (G defaults "
                              f"to 8) or --world-size W")
        else:
            ws = 1
        if ws < 1 or args.gpus_per_node < 1:
            raise ConfigError(f"world size must be >= 1, got {ws}")
        if tp < 1 or ws % tp:
            raise ConfigError(f"train.tensor_parallel_size={tp} does not divide the world size {ws}")
        if int(cfg.train.micro_batch_size) < 1:
            raise ConfigError(f"train.micro_batch_size must be >= 1, got {cfg.train.micro_batch_size}")
        fields = model_fields(cfg, tp)
        row = _row_length(cfg)
        gib = args.gpu_memory if args.gpu_memory is not None else cfg.train.gpu_memory_gib
        if gib is not None and gib <= 0:
            raise ConfigError(f"--gpu-memory must be > 0 GiB, got {gib}")
        plan = plan_for_run(cfg, tp=tp, dp=ws // tp, model_fields=fields, row_length=row,
                            device=args.device,
                            gpu_bytes=None if gib is None else int(gib * GIB))
        plans = [plan]
        if args.decode_batch is not None:
            if args.decode_prompt is None or args.decode_gen is None:
                raise ConfigError("--decode-batch needs --decode-prompt and --decode-gen")
            if min(args.decode_batch, args.decode_prompt, args.decode_gen) < 1:
                raise ConfigError("--decode-batch, --decode-prompt and --decode-gen must be >= 1")
            from pipeline.model import ModelConfig
            plans.append(plan_decoding(
                ModelConfig.from_dict(dict(fields), source="model"), tp=tp,
                batch=args.decode_batch, prompt=args.decode_prompt, gen_length=args.decode_gen,
                verify=args.decode_verify, slot_size=args.slot_size, num_blocks=args.num_blocks,
                exact_cache=args.exact_cache, precision="bf16" if args.device == "cuda" else "fp32",
                device=args.device, gpu_bytes=None if gib is None else int(gib * GIB)))
    except (ConfigError, ValueError) as e:
        print(f"pipeline.plan_memory: config error: {str(e).strip().splitlines()[0]}",
              file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(line for p in plans for line in format_plan(p)))
    return EXIT_FAILED if any(p.fits() is False for p in plans) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
