"""The command-line side of decoding shared by `pipeline.generate`, `pipeline.evaluate`,
`pipeline.lm_eval` and the experiment: the decoding options, their checks, the settings recorded
with results, one batch decoded with the chosen mode, and small input/output checks.

Must not touch: the algorithms (`pipeline.inference.decoding`), loading
(`pipeline.inference.loading`), printing (each CLI prints its own output).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pipeline.common.cli import DTYPES, UsageError, hidden_alias
from pipeline.inference.decoding import MASK_ATTENTIONS, VERIFY_MODES
from pipeline.inference.loading import Loaded, load_for_inference


def decode_batch(loaded: Loaded, prompts: list[list[int]], args) -> "object":
    """Run the chosen mode on one batch of prompt ids; returns `GenerationOutput`."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    if args.mode == "ar":
        return ar_generate(loaded.model, prompts, args.gen_length, args.temperature,
                           loaded.eos_id, seed=args.seed)
    return refusion_generate(loaded.model, prompts, args.gen_length, args.slot_size,
                             args.num_blocks, args.slot_threshold, token_threshold(args),
                             args.temperature, loaded.mask_id, loaded.eos_id,
                             exact_cache=args.exact_cache, seed=args.seed,
                             verify=getattr(args, "verify", "authors"),
                             mask_attention=getattr(args, "mask_attention", "causal"))


def warm_up(loaded: Loaded, prompt: list[int]) -> None:
    """One short untimed decode in each mode, so that one-time costs (kernel selection, lazy
    initialization, first allocations) do not count in the reported tokens/s."""
    from pipeline.inference.decoding import ar_generate, refusion_generate
    try:
        ar_generate(loaded.model, [prompt], 2, 0.0, None)
        refusion_generate(loaded.model, [prompt], 4, 2, 1, 0.5, 0.5, 0.0, loaded.mask_id, None)
    except ValueError:  # e.g. a prompt at the position limit: the real decode reports it
        pass


# The decoding options' defaults, the one statement of them (the CLIs' flags, lm_eval's
# `--model_args`). k = 4 and the thresholds 0.6 / 0.3 are the reference code's demo settings;
# the token threshold's default (None) depends on --verify: TOKEN_THRESHOLDS.
DECODING_DEFAULTS = {"gen_length": 128, "slot_size": 4, "num_blocks": 2, "slot_threshold": 0.6,
                     "token_threshold": None, "temperature": 0.0, "exact_cache": False,
                     "verify": "authors", "mask_attention": "causal", "batch_size": 8, "seed": 0}
# The lossless modes (greedy, token threshold >= 0.5: output equal to --mode ar) default to the
# least threshold that keeps them lossless; the others to the reference demo's 0.3.
LOSSLESS_MODES, LOSSLESS_TOKEN_THRESHOLD = ("draft_ahead", "draft_every"), 0.5
TOKEN_THRESHOLDS = {"authors": 0.3, "correct": 0.3, "draft_ahead": 0.5, "draft_every": 0.5}


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding options shared by `pipeline.generate`, `pipeline.evaluate` and
    `pipeline.lm_eval` (defaults: `DECODING_DEFAULTS`)."""
    d = DECODING_DEFAULTS
    p.add_argument("--gen-length", type=int, default=d["gen_length"],
                   help="tokens to generate at most; --verify authors and correct round it up to "
                        "a multiple of --slot-size (their generation region is whole slots)")
    p.add_argument("--slot-size", type=int, default=d["slot_size"],
                   help="tokens per slot (k; refusion mode)")
    p.add_argument("--num-blocks", type=int, default=d["num_blocks"],
                   help="left-to-right blocks of the generation region (refusion mode; must "
                        "divide the number of slots)")
    p.add_argument("--slot-threshold", type=float, default=d["slot_threshold"],
                   help="refusion: plan every masked slot whose first-token probability exceeds "
                        "this, else the best one (>= 0; >= 1 = one slot per step)")
    p.add_argument("--token-threshold", type=float, default=d["token_threshold"],
                   help="refusion: accept a drafted token when its causal probability exceeds "
                        "this (in [0, 1]; 1 = never by probability: each draft/verify round "
                        "then force-accepts one more token per slot). None: by --verify, 0.3 "
                        "for authors and correct, 0.5 for draft_ahead and draft_every, which "
                        "are lossless (output = --mode ar) only at --temperature 0 and >= 0.5 "
                        "(a run without that says so in one line)")
    p.add_argument("--temperature", type=float, default=d["temperature"],
                   help="0 = greedy; > 0 samples (samples depend on the batch composition, "
                        "i.e. --batch-size, for the same --seed)")
    p.add_argument("--exact-cache", action="store_true",
                   help="re-encode slots infilled in parallel (exact KV cache)")
    p.add_argument("--verify", choices=VERIFY_MODES, default=d["verify"],
                   help="refusion: what a rejected draft becomes. authors: the reference "
                        "algorithm (re-drafted from masks and force-accepted); correct: the AR "
                        "head's own token from the verify forward (speculative decoding's "
                        "correction; with one slot per block, --token-threshold >= 0.5 and "
                        "temperature 0 the output equals --mode ar); draft_ahead: correct's "
                        "rule in one forward per step, the next slot drafted inside the verify "
                        "forward (slots left to right; --num-blocks and --slot-threshold "
                        "unused); draft_every: draft_ahead with the next slot drafted for "
                        "every acceptance length (a block of masks each), so a rejection "
                        "costs no re-draft. docs/METHOD.md")
    p.add_argument("--mask-attention", choices=MASK_ATTENTIONS, default=d["mask_attention"],
                   help="refusion, --verify draft_ahead or draft_every: how the masks of one "
                        "drafting block attend to each other. causal: as objective.mode "
                        "refusion trains them; bidirectional: each sees all, as objective.mode "
                        "dual trains them (use it for a dual-trained model). docs/METHOD.md")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="prompts decoded together")
    hidden_alias(p, "--batch_size", dest="batch_size", type=int)
    p.add_argument("--seed", type=int, default=d["seed"], help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or SentencePiece file (None: the model's)")


def load_model_from_args(args, load=None) -> Loaded:
    """`load_for_inference` (or `load`, same signature) with `args`' `--model`, `--tokenizer`,
    `--device`, `--dtype` (and `args.data_tokenizer` as the fallback tokenizer); writes the
    resolved device and dtype back into `args`. Raises UsageError."""
    extra = ({"fallback_tokenizer": args.data_tokenizer}
             if getattr(args, "data_tokenizer", None) else {})
    loaded = (load or load_for_inference)(args.model, args.tokenizer,
                                          DTYPES[args.dtype] if args.dtype else None,
                                          device=args.device, **extra)
    p = next(loaded.model.parameters())
    args.device = str(p.device)
    args.dtype = str(p.dtype).replace("torch.", "")
    return loaded


def decoding_settings(args, mode) -> dict:
    """The settings a decode ran with, recorded in the JSON outputs (`mode`: a mode or a list
    of modes)."""
    keys = ("gen_length", "slot_size", "num_blocks", "slot_threshold", "token_threshold",
            "temperature", "seed", "exact_cache", "verify", "batch_size", "device", "dtype",
            "tokenizer")
    return {"model": str(args.model), "mode": mode, **{k: getattr(args, k) for k in keys},
            "mask_attention": getattr(args, "mask_attention", "causal")}


def check_decoding_args(args, refusion: bool = True) -> None:
    """Raise UsageError for out-of-range decoding options (`refusion`: also the slot/block
    layout): token threshold in [0, 1] (1 = never accept a drafted token by probability), slot
    threshold >= 0 (>= 1 = one slot per step, the best one)."""
    for name in ("gen_length", "slot_size", "num_blocks", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.temperature >= 0:
        raise UsageError("--temperature must be >= 0")
    args.token_threshold = token_threshold(args)
    if not 0 <= args.token_threshold <= 1:  # 1: never accept a drafted token by probability
        raise UsageError(f"--token-threshold {args.token_threshold} must be in [0, 1]")
    if getattr(args, "verify", "authors") not in VERIFY_MODES:
        raise UsageError(f"--verify {args.verify}: expected one of {', '.join(VERIFY_MODES)}")
    mask_attention = getattr(args, "mask_attention", "causal")
    if mask_attention not in MASK_ATTENTIONS:
        raise UsageError(f"--mask-attention {mask_attention}: expected one of "
                         f"{', '.join(MASK_ATTENTIONS)}")
    if (refusion and mask_attention == "bidirectional"
            and getattr(args, "verify", "authors") not in ("draft_ahead", "draft_every")):
        raise UsageError(f"--mask-attention bidirectional needs --verify draft_ahead or "
                         f"draft_every, not {getattr(args, 'verify', 'authors')}")
    if not args.slot_threshold >= 0:  # > 1 is valid: one slot (the best) per step
        raise UsageError(f"--slot-threshold {args.slot_threshold} must be >= 0 (values >= 1 "
                         f"select one slot per step)")
    slots = -(-args.gen_length // args.slot_size)
    # draft_ahead and draft_every decode left to right and do not use --num-blocks
    left_to_right = getattr(args, "verify", "authors") in ("draft_ahead", "draft_every")
    if refusion and not left_to_right and slots % args.num_blocks:
        raise UsageError(f"--num-blocks {args.num_blocks} must divide the {slots} slots "
                         f"(--gen-length rounded up to a multiple of --slot-size)")


def token_threshold(args) -> float:
    """`args.token_threshold`, or when None (the default) the --verify mode's default
    (`TOKEN_THRESHOLDS`)."""
    if args.token_threshold is not None:
        return args.token_threshold
    return TOKEN_THRESHOLDS.get(getattr(args, "verify", "authors"), 0.3)


def lossless_note(args) -> str | None:
    """The one-line statement for a lossless mode (`LOSSLESS_MODES`) run with settings that
    can make its output differ from --mode ar (temperature > 0 or token threshold < 0.5), else
    None; each decoding CLI prints it on stderr and decodes on. `args`: decoding options."""
    verify = getattr(args, "verify", "authors")
    why = [f"--temperature {args.temperature:g}"] if args.temperature > 0 else []
    if token_threshold(args) < LOSSLESS_TOKEN_THRESHOLD:
        why.append(f"--token-threshold {token_threshold(args):g}")
    if verify not in LOSSLESS_MODES or not why:
        return None
    return (f"note: --verify {verify} with {' and '.join(why)} is not lossless: its output may "
            f"differ from --mode ar (lossless: --temperature 0 and --token-threshold >= "
            f"{LOSSLESS_TOKEN_THRESHOLD:g})")


def read_prompts_jsonl(path) -> list[dict]:
    """Records of a JSONL file (blank lines skipped). Raises UsageError naming file:line."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON ({e.msg})")
        if not isinstance(rec, dict):
            raise UsageError(f"{path}:{n}: expected a JSON object")
        out.append(rec)
    if not out:
        raise UsageError(f"{path}: no records")
    return out


def check_json_out(path) -> None:
    """Raise UsageError, before any decoding, when `--output path` (the JSON results file)
    cannot be written as a file: a folder, or a parent that is a file."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--output {path}: is a folder; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--output {path}: {parent} is not a folder")
            if not os.access(parent, os.W_OK):
                raise UsageError(f"--output {path}: {parent} is not writable")
            break
