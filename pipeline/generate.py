"""Decoding CLI: text in, text out, with tokens, forwards, TPF and TPS per prompt.

    python -m pipeline.generate --model HF_DIR_OR_CHECKPOINT (--prompt TEXT | --prompts FILE.jsonl)
        [--mode refusion|ar] [--gen-length N] [--slot-size K] [--num-blocks B]
        [--slot-threshold X] [--token-threshold Y] [--temperature T] [--batch-size N]
        [--exact-cache] [--raw] [--tokenizer PATH] [--dtype float32|bfloat16|float64]
        [--seed S] [--json] [--json-out FILE]

Owns: loading a model + tokenizer for inference (`load_for_inference`, also used by
`pipeline.evaluate`), building prompts, batching, printing. Must not touch: the decoding
algorithms (`pipeline.decoding`), weights on disk.

`--model` is a Hugging Face Qwen3 folder, or a training checkpoint (a step folder or a
checkpoint root, recognised by `pipeline.checkpoint`; consolidated to a temporary HF folder
first). The tokenizer comes from the model folder: Hugging Face tokenizer files, else a
SentencePiece `tokenizer.model`; `--tokenizer` overrides. Prompts are wrapped as the data
pipeline wraps queries (`data_prep.tokenizer_io`: the chat template, or `<s> <|user|> query
<|assistant|>` for SentencePiece); `--raw` feeds the text as is (continuation). The mask and
EOS ids are the tokenizer's.

`--gen-length` is an upper bound on generated tokens; in refusion mode it is rounded up to a
multiple of `--slot-size` (the generation region is whole slots, REFUSION.md), so
`--gen-length 10 --slot-size 4` may give 12 tokens.
Sampling (`--temperature` > 0) draws from one generator per batch, seeded by `--seed`, so a
prompt's sample depends on the batch it is decoded in (`--batch-size`, the other prompts and
their order) as well as on the seed; greedy decoding (temperature 0) does not.
`--prompts FILE.jsonl`: one JSON object per line with a "prompt" (or "query") string.
`--json` / `--json-out`: {"settings": the model and decoding options used (mode, gen_length,
slot_size, num_blocks, thresholds, temperature, seed, exact_cache, ...), "summary", "results"}.
TPS = a prompt's generated tokens / wall seconds of its batch (tokens per second), measured
after one short untimed warm-up decode.
Exit codes: 0 done; 2 usage or input error (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "float16": torch.float16}


class UsageError(Exception):
    """A user input problem: reported as one line, exit code 2."""


@dataclass
class Loaded:
    """A model ready for decoding.

    Attributes:
        model: `pipeline.model.Qwen3` in eval mode.
        tokenizer: `data_prep.tokenizer_io.Tokenizer` (`info.mask_id`, `info.eos_id`).
        folder: the HF folder the weights were read from.
    """

    model: torch.nn.Module
    tokenizer: object
    folder: Path

    @property
    def mask_id(self) -> int:
        return int(self.tokenizer.info.mask_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.info.eos_id)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens; ids past the tokenizer's length (embedding
        rows no token uses, e.g. Qwen3's 151936 rows vs 151671 tokens) are dropped."""
        tok = self.tokenizer
        ids = [i for i in ids if 0 <= i < tok.info.vocab_size]
        if hasattr(tok, "sp"):
            return tok.sp.DecodeIds([i for i in ids if i != tok.info.eos_id])
        return tok.tok.decode(ids, skip_special_tokens=True)


def _is_checkpoint(path: Path) -> bool:
    from pipeline.checkpoint import CheckpointError, resolve_checkpoint_dir
    if (path / "config.json").is_file():
        return False
    try:
        resolve_checkpoint_dir(path)
        return True
    except (CheckpointError, OSError, ValueError):
        return False


def _find_tokenizer(folder: Path) -> str | None:
    """The tokenizer of a model folder: HF tokenizer files, except that a SentencePiece
    `tokenizer.model` wins over HF files without a chat template (an export of a data_prep
    SentencePiece model: its prompt layout needs the SentencePiece pieces)."""
    spm_file = folder / "tokenizer.model"
    cfg = folder / "tokenizer_config.json"
    has_hf = cfg.is_file() or (folder / "tokenizer.json").is_file()
    if has_hf and spm_file.is_file():
        chat = (folder / "chat_template.jinja").is_file() or (
            cfg.is_file() and "chat_template" in json.loads(cfg.read_text()))
        return str(folder) if chat else str(spm_file)
    if has_hf:
        return str(folder)
    if spm_file.is_file():
        return str(spm_file)
    return None


def load_for_inference(model_path, tokenizer_path=None, dtype: torch.dtype = torch.float32
                       ) -> Loaded:
    """Load a HF folder or a training checkpoint into `pipeline.model.Qwen3` (TP=1).

    Starts a single-process gloo group and megatron-core's parallel state when none exists.
    A checkpoint is consolidated (`pipeline.checkpoint.consolidate_to_hf`, fp32) into a
    temporary folder that is removed once the weights are loaded.

    Args:
        model_path: HF Qwen3 folder, or a checkpoint step folder / root.
        tokenizer_path: tokenizer folder or SentencePiece file (default: the model folder's;
            for a checkpoint, a `tokenizer/` next to it or inside it, if any).
        dtype: parameter dtype.

    Returns:
        `Loaded` (`folder` is the HF folder, or the checkpoint path for a checkpoint).

    Raises:
        UsageError: missing paths, unreadable checkpoint, no tokenizer, mask/EOS ids outside
            the model's vocab.
    """
    from pipeline.hf_io import config_from_hf, load_hf_into_model
    from pipeline.model import Qwen3

    path = Path(model_path)
    if not path.exists():
        raise UsageError(f"--model {path}: no such file or folder")
    _init_single_process()
    with tempfile.TemporaryDirectory(prefix="refusion-ckpt-hf-") as tmp:
        if _is_checkpoint(path):
            from pipeline.checkpoint import CheckpointError, consolidate_to_hf
            folder = Path(tmp) / "hf"
            try:
                consolidate_to_hf(path, folder, dtype=None, overwrite=True)
            except (CheckpointError, OSError, ValueError) as e:
                raise UsageError(f"--model {path}: {e}")
            if tokenizer_path is None:
                for cand in (path / "tokenizer", path.parent / "tokenizer"):
                    if cand.is_dir():
                        tokenizer_path = _find_tokenizer(cand)
                        break
        else:
            folder = path
            if not (folder / "config.json").is_file():
                raise UsageError(f"--model {folder}: neither a Hugging Face folder "
                                 f"(config.json) nor a training checkpoint")
            if tokenizer_path is None:
                tokenizer_path = _find_tokenizer(folder)
        if tokenizer_path is not None and Path(tokenizer_path).is_dir():
            found = _find_tokenizer(Path(tokenizer_path))
            if found is None:
                raise UsageError(f"--tokenizer {tokenizer_path}: no tokenizer files in this "
                                 f"folder (tokenizer.json, tokenizer_config.json or "
                                 f"tokenizer.model)")
            tokenizer_path = found
        if tokenizer_path is None:
            raise UsageError(f"--model {path}: no tokenizer files (tokenizer.json / "
                             f"tokenizer.model); pass --tokenizer")
        from data_prep.tokenizer_io import TokenizerError, load_tokenizer
        try:
            tok = load_tokenizer(str(tokenizer_path))
        except (TokenizerError, OSError, ValueError) as e:
            raise UsageError(f"--tokenizer {tokenizer_path}: {str(e).splitlines()[0]}")
        try:
            cfg = config_from_hf(folder)
        except (ValueError, KeyError, OSError) as e:
            raise UsageError(f"--model {path}: {e}")
        for name in ("mask_id", "eos_id"):
            i = getattr(tok.info, name)
            if i is None or not 0 <= int(i) < cfg.vocab_size:
                raise UsageError(f"tokenizer {tokenizer_path}: {name} {i} is outside the "
                                 f"model's {cfg.vocab_size} embedding rows")
        model = Qwen3(cfg, dtype=dtype, init_weights=False)
        load_hf_into_model(model, folder)
    return Loaded(model=model.eval(), tokenizer=tok, folder=path)


def _init_single_process() -> None:
    import socket
    from pipeline.parallel import init_distributed
    if (not torch.distributed.is_initialized() and "MASTER_PORT" not in os.environ
            and "WORLD_SIZE" not in os.environ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    init_distributed(tensor_parallel_size=1, backend="gloo")


def prompt_ids(loaded: Loaded, text: str, raw: bool = False) -> list[int]:
    """Token ids of a prompt: the data pipeline's query wrapping, or the plain text (`raw`,
    with the SentencePiece BOS in front when the tokenizer has one)."""
    tok = loaded.tokenizer
    if not raw:
        return tok.prompt_ids(text)
    ids = tok.encode(text)
    if hasattr(tok, "sp") and tok.info.bos_id is not None:
        ids = [tok.info.bos_id] + ids
    if not ids:
        raise UsageError("a prompt encodes to no tokens")
    return ids


def decode_batch(loaded: Loaded, prompts: list[list[int]], args) -> "object":
    """Run the chosen mode on one batch of prompt ids; returns `GenerationOutput`."""
    from pipeline.decoding import ar_generate, refusion_generate
    if args.mode == "ar":
        return ar_generate(loaded.model, prompts, args.gen_length, args.temperature,
                           loaded.eos_id, seed=args.seed)
    return refusion_generate(loaded.model, prompts, args.gen_length, args.slot_size,
                             args.num_blocks, args.slot_threshold, args.token_threshold,
                             args.temperature, loaded.mask_id, loaded.eos_id,
                             exact_cache=args.exact_cache, seed=args.seed)


def warm_up(loaded: Loaded, prompt: list[int]) -> None:
    """One short untimed decode in each mode, so that one-time costs (kernel selection, lazy
    initialization, first allocations) do not count in the reported tokens/s."""
    from pipeline.decoding import ar_generate, refusion_generate
    try:
        ar_generate(loaded.model, [prompt], 2, 0.0, None)
        refusion_generate(loaded.model, [prompt], 4, 2, 1, 0.5, 0.5, 0.0, loaded.mask_id, None)
    except ValueError:  # e.g. a prompt at the position limit: the real decode reports it
        pass


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding options shared with `pipeline.evaluate` (defaults: the reference's demo)."""
    p.add_argument("--gen-length", type=int, default=128,
                   help="tokens to generate at most; in refusion mode rounded up to a multiple "
                        "of --slot-size (the generation region is whole slots)")
    p.add_argument("--slot-size", type=int, default=4, help="tokens per slot (k; refusion mode)")
    p.add_argument("--num-blocks", type=int, default=2,
                   help="left-to-right blocks of the generation region (refusion mode; must "
                        "divide the number of slots)")
    p.add_argument("--slot-threshold", type=float, default=0.6,
                   help="refusion: plan every masked slot whose first-token probability exceeds "
                        "this, else the best one (>= 0; >= 1 = one slot per step)")
    p.add_argument("--token-threshold", type=float, default=0.3,
                   help="refusion: accept a drafted token when its causal probability exceeds "
                        "this (in [0, 1]; 1 = only each slot's first token)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 samples (samples depend on the batch composition, "
                        "i.e. --batch-size, for the same --seed)")
    p.add_argument("--exact-cache", action="store_true",
                   help="re-encode slots infilled in parallel (exact KV cache)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="parameter dtype")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or SentencePiece file (None: the model's)")


def decoding_settings(args, mode) -> dict:
    """The settings a decode ran with, recorded in the JSON outputs (`mode`: a mode or a list
    of modes)."""
    keys = ("gen_length", "slot_size", "num_blocks", "slot_threshold", "token_threshold",
            "temperature", "seed", "exact_cache", "batch_size", "dtype", "tokenizer")
    return {"model": str(args.model), "mode": mode, **{k: getattr(args, k) for k in keys}}


def check_decoding_args(args, refusion: bool = True) -> None:
    """Raise UsageError for out-of-range decoding options (`refusion`: also the slot/block
    layout, which ar mode does not use). Thresholds: token threshold in [0, 1] (1 = never
    accept a drafted token by probability), slot threshold >= 0 (>= 1 = one slot per step,
    the best one)."""
    for name in ("gen_length", "slot_size", "num_blocks", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.temperature >= 0:
        raise UsageError("--temperature must be >= 0")
    if not 0 <= args.token_threshold <= 1:  # 1: never accept a drafted token by probability
        raise UsageError(f"--token-threshold {args.token_threshold} must be in [0, 1]")
    if not args.slot_threshold >= 0:  # > 1 is valid: one slot (the best) per step
        raise UsageError(f"--slot-threshold {args.slot_threshold} must be >= 0 (values >= 1 "
                         f"select one slot per step)")
    slots = -(-args.gen_length // args.slot_size)
    if refusion and slots % args.num_blocks:
        raise UsageError(f"--num-blocks {args.num_blocks} must divide the {slots} slots "
                         f"(--gen-length rounded up to a multiple of --slot-size)")


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
    """Raise UsageError when `--json-out path` cannot be written as a file (checked before any
    decoding, so that no results are lost): a folder, or a parent that is a file."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--json-out {path}: is a folder; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--json-out {path}: {parent} is not a folder")
            if not os.access(parent, os.W_OK):
                raise UsageError(f"--json-out {path}: {parent} is not writable")
            break


def _write_json(path, doc) -> None:
    """Write `doc` as JSON to `path` atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    import warnings
    # megatron-core warns at import that optional CUDA extensions are absent (harmless).
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    p = argparse.ArgumentParser(prog="python -m pipeline.generate",
                                description="Decode prompts with a ReFusion model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or training checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="JSONL file, one {\"prompt\": ...} per line")
    p.add_argument("--mode", choices=("refusion", "ar"), default="refusion",
                   help="plan-and-infill (refusion) or left-to-right (ar) decoding")
    p.add_argument("--raw", action="store_true", help="feed prompts as plain text")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--json-out", default=None, help="also write the JSON document to this file")
    add_decoding_args(p)
    args = p.parse_args(argv)
    try:
        check_decoding_args(args, refusion=args.mode == "refusion")
        check_json_out(args.json_out)
        if args.prompt is not None:
            texts = [args.prompt]
        else:
            texts = []
            for n, rec in enumerate(read_prompts_jsonl(args.prompts), 1):
                t = rec.get("prompt", rec.get("query"))
                if not isinstance(t, str):
                    raise UsageError(f"{args.prompts}: record {n} has no \"prompt\" string")
                texts.append(t)
        # Libraries print progress to stdout (DeepSpeed's consolidation, its logger): keep
        # stdout for our output only.
        with contextlib.redirect_stdout(sys.stderr):
            loaded = load_for_inference(args.model, args.tokenizer, DTYPES[args.dtype])
        results, seconds = [], 0.0
        warm_up(loaded, prompt_ids(loaded, texts[0], args.raw))
        for i in range(0, len(texts), args.batch_size):
            chunk = texts[i:i + args.batch_size]
            ids = [prompt_ids(loaded, t, args.raw) for t in chunk]
            try:
                out = decode_batch(loaded, ids, args)
            except ValueError as e:
                raise UsageError(str(e))
            seconds += out.seconds
            for j, t in enumerate(chunk):
                results.append({"prompt": t, "text": loaded.decode(out.tokens[j]),
                                "token_ids": out.tokens[j], **out.stats(j)})
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total_tokens = sum(r["tokens"] for r in results)
    total_forwards = sum(r["forwards"] for r in results)
    summary = {"mode": args.mode, "prompts": len(results), "tokens": total_tokens,
               "forwards": total_forwards, "seconds": seconds,
               "tpf": total_tokens / total_forwards if total_forwards else 0.0,
               "tps": total_tokens / seconds if seconds else 0.0}
    doc = {"settings": decoding_settings(args, args.mode), "summary": summary,
           "results": results}
    if args.json_out:
        _write_json(args.json_out, doc)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    for r in results:
        print(f"=== prompt: {r['prompt'][:200]!r}")
        print(r["text"])
        print(f"--- tokens {r['tokens']}  forwards {r['forwards']} "
              f"{dict(r['forwards_by_kind'])}  TPF {r['tpf']:.2f}  TPS {r['tps']:.1f}")
    print(f"=== {args.mode}: {len(results)} prompts, {total_tokens} tokens, "
          f"{total_forwards} forwards, TPF {summary['tpf']:.2f}, TPS {summary['tps']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
