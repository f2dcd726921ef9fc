"""Decoding CLI: text in, text out, with tokens, forwards, TPF and TPS per prompt.

    python -m pipeline.generate --model HF_DIR_OR_CHECKPOINT (--prompt TEXT | --prompts FILE.jsonl)
        [--mode refusion|ar] [--gen-length N] [--slot-size K] [--num-blocks B]
        [--slot-threshold X] [--token-threshold Y] [--temperature T] [--batch-size N]
        [--exact-cache] [--verify authors|correct] [--raw] [--tokenizer PATH]
        [--device auto|cpu|cuda[:N]]
        [--dtype float32|bfloat16|float16|float64]
        [--seed S] [--json] [--json-out FILE]

Owns: loading a model + tokenizer for inference (`load_for_inference`, also used by
`pipeline.evaluate`), building prompts, batching, printing. Must not touch: the decoding
algorithms (`pipeline.decoding`), weights on disk.

`--model` is a Hugging Face Qwen3 folder, or a training checkpoint (a step folder or a
checkpoint root, recognised by `pipeline.checkpoint`; its fp32 master weights are consolidated
one tensor at a time straight into the model, no Hugging Face folder is written).
`--device auto` (default) decodes on CUDA when available (`cuda:<LOCAL_RANK mod GPUs>`), else
on the CPU; the parameter dtype defaults to bfloat16 on CUDA, float32 on the CPU (`--dtype`).
The model is built on the meta device and materialized on the target device in that dtype. The tokenizer comes from the model folder: Hugging Face tokenizer files, else a
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
slot_size, num_blocks, thresholds, temperature, seed, exact_cache, verify, ...), "summary",
"results"}.
TPS = a prompt's generated tokens / wall seconds of its batch (tokens per second), measured
after one short untimed warm-up decode, the device synchronized before each clock reading.
Exit codes: 0 done; 2 usage or input error (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
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


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The device a `--device` value names.

    Args:
        spec: "auto" or None (CUDA when `torch.cuda.is_available()`, as `cuda:<LOCAL_RANK
            modulo the visible GPUs>` or `cuda:0`; else the CPU), "cpu", "cuda", "cuda:N", or a
            `torch.device`.
    Returns:
        `torch.device` ("cuda" without an index becomes the current CUDA device).
    Raises:
        UsageError: an unknown value, CUDA asked for where none is available, or an index past
            the visible GPUs.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return torch.device("cuda", local % torch.cuda.device_count())
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = spec[5:] if spec.startswith("cuda:") else ""
        if index and not index.isdigit():
            raise UsageError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available here (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}); use "
                             f"--device cpu or auto")
        count = torch.cuda.device_count()
        i = int(index) if index else torch.cuda.current_device()
        if i >= count:
            raise UsageError(f"--device {spec}: only {count} CUDA device(s) visible")
        return torch.device("cuda", i)
    raise UsageError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")


def default_dtype(device: torch.device) -> torch.dtype:
    """Parameter dtype when none is given: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA), so that host clocks time finished work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill_from_hf_tensors(model, get, names_ok: set[str]) -> None:
    """Copy full HF tensors (`get(hf_name) -> Tensor`, TP=1) into a TP=1 `Qwen3`'s parameters,
    one HF tensor at a time, cast (and moved) on the copy. Raises KeyError / ValueError naming
    a missing tensor or a shape mismatch."""
    from pipeline.hf_io import param_specs
    params = dict(model.named_parameters())
    with torch.no_grad():
        for spec in param_specs(model.cfg):
            p = params.pop(spec.native)
            row = 0
            for name in spec.hf:
                if name not in names_ok:
                    raise KeyError(f"tensor {name} missing from the checkpoint")
                t = get(name)
                n = t.shape[0] if spec.dim is not None and len(spec.hf) > 1 else p.shape[0]
                dst = p.narrow(0, row, n) if len(spec.hf) > 1 else p
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}, the model expects "
                                     f"{tuple(dst.shape)}")
                dst.copy_(t)
                row += n
                del t
    if params:
        raise KeyError(f"no source for parameters {sorted(params)}")


def _empty_model(cls, cfg, dtype: torch.dtype, device: torch.device):
    """`cls(cfg)` with uninitialized parameters allocated directly on `device` in `dtype`:
    built on the meta device, then materialized in place (parameter objects kept, so a tied
    embedding/head stays one tensor; megatron's TP attributes restored)."""
    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, init_weights=False)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    if hasattr(model, "_mark_tensor_parallel"):
        model._mark_tensor_parallel()
    return model


def load_model(model_path, dtype: torch.dtype | None = None, *,
               device: str | torch.device | None = None):
    """The weights of a HF folder or a training checkpoint in `pipeline.model.Qwen3` (TP=1),
    without a tokenizer (`load_for_inference` adds it).

    The model is built on the meta device and materialized directly on `device` in `dtype`;
    the weights are then copied in one tensor at a time (cast and moved on the copy), so no
    full-size host copy is made. A checkpoint is consolidated tensor by tensor
    (`pipeline.checkpoint.hf_export_state`: fp32 master weights, merged over DP and TP ranks)
    straight into the parameters: no Hugging Face folder is written.

    Args:
        model_path: HF Qwen3 folder, or a checkpoint step folder / root.
        dtype: parameter dtype (None: `default_dtype(device)`).
        device: as `resolve_device`.
    Returns:
        (model in eval mode, its `ModelConfig`, a tokenizer path found with the weights or None).
    Raises:
        UsageError: a missing path, an unreadable HF folder or checkpoint, an unavailable
            device.
    """
    from pipeline.hf_io import config_from_hf
    from pipeline.model import Qwen3

    path = Path(model_path)
    if not path.exists():
        raise UsageError(f"--model {path}: no such file or folder")
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    _init_single_process()
    state, tokenizer_path = None, None
    if _is_checkpoint(path):
        from pipeline.checkpoint import CheckpointError, hf_export_state
        try:
            state, cfg, _ = hf_export_state(path)
        except (CheckpointError, OSError, ValueError) as e:
            raise UsageError(f"--model {path}: {e}")
        for cand in (path / "tokenizer", path.parent / "tokenizer"):
            if cand.is_dir():
                tokenizer_path = _find_tokenizer(cand)
                break
    else:
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {path}: neither a Hugging Face folder "
                             f"(config.json) nor a training checkpoint")
        try:
            cfg = config_from_hf(path)
        except (ValueError, KeyError, OSError) as e:
            raise UsageError(f"--model {path}: {e}")
        tokenizer_path = _find_tokenizer(path)
    model = _empty_model(Qwen3, cfg, dtype, dev)
    try:
        if state is not None:
            _fill_from_hf_tensors(model, lambda n: state[n].load(None), set(state))
        else:
            from pipeline.hf_io import load_hf_into_model
            load_hf_into_model(model, path)
    except (KeyError, ValueError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise UsageError(f"--model {path}: {msg}")
    return model.eval(), cfg, tokenizer_path


def load_for_inference(model_path, tokenizer_path=None, dtype: torch.dtype | None = None, *,
                       device: str | torch.device | None = None) -> Loaded:
    """Load a HF folder or a training checkpoint into `pipeline.model.Qwen3` (TP=1), with its
    tokenizer.

    Starts a single-process gloo group and megatron-core's parallel state when none exists.
    The weights: `load_model` (meta-device build, materialized on `device` in `dtype`, weights
    copied in one tensor at a time; a checkpoint is consolidated straight into the model, no
    temporary Hugging Face folder).

    Args:
        model_path: HF Qwen3 folder, or a checkpoint step folder / root.
        tokenizer_path: tokenizer folder or SentencePiece file (default: the model folder's;
            for a checkpoint, a `tokenizer/` next to it or inside it, if any).
        dtype: parameter dtype (None: bf16 on CUDA, fp32 on the CPU; `default_dtype`).
        device: "auto" / None (CUDA when available), "cpu", "cuda", "cuda:N" or a
            `torch.device` (`resolve_device`).

    Returns:
        `Loaded` (`folder` is the HF folder, or the checkpoint path for a checkpoint).

    Raises:
        UsageError: missing paths, unreadable checkpoint, no tokenizer, mask/EOS ids outside
            the model's vocab, an unavailable device.
    """
    path = Path(model_path)
    # the tokenizer is loaded first: a wrong one fails before the weights are read
    if not path.exists():
        raise UsageError(f"--model {path}: no such file or folder")
    resolve_device(device)
    if tokenizer_path is None:
        if _is_checkpoint(path):
            for cand in (path / "tokenizer", path.parent / "tokenizer"):
                if cand.is_dir():
                    tokenizer_path = _find_tokenizer(cand)
                    break
        elif (path / "config.json").is_file():
            tokenizer_path = _find_tokenizer(path)
    if tokenizer_path is not None and Path(tokenizer_path).is_dir():
        found = _find_tokenizer(Path(tokenizer_path))
        if found is None:
            raise UsageError(f"--tokenizer {tokenizer_path}: no tokenizer files in this "
                             f"folder (tokenizer.json, tokenizer_config.json or "
                             f"tokenizer.model)")
        tokenizer_path = found
    known = (path / "config.json").is_file() or _is_checkpoint(path)
    if tokenizer_path is None and known:
        raise UsageError(f"--model {path}: no tokenizer files (tokenizer.json / "
                         f"tokenizer.model); pass --tokenizer")
    tok = None
    if tokenizer_path is not None:
        from data_prep.tokenizer_io import TokenizerError, load_tokenizer
        try:
            tok = load_tokenizer(str(tokenizer_path))
        except (TokenizerError, OSError, ValueError) as e:
            raise UsageError(f"--tokenizer {tokenizer_path}: {str(e).splitlines()[0]}")
    model, cfg, _ = load_model(path, dtype, device=device)   # raises for an unknown folder
    for name in ("mask_id", "eos_id"):
        i = getattr(tok.info, name)
        if i is None or not 0 <= int(i) < cfg.vocab_size:
            raise UsageError(f"tokenizer {tokenizer_path}: {name} {i} is outside the "
                             f"model's {cfg.vocab_size} embedding rows")
    return Loaded(model=model, tokenizer=tok, folder=path)


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
                             exact_cache=args.exact_cache, seed=args.seed,
                             verify=getattr(args, "verify", "authors"))


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
    p.add_argument("--verify", choices=("authors", "correct"), default="authors",
                   help="refusion: what a rejected draft becomes. authors: the reference "
                        "algorithm (re-drafted from masks and force-accepted); correct: the AR "
                        "head's own token from the verify forward (speculative decoding's "
                        "correction; with one slot per block, --token-threshold >= 0.5 and "
                        "temperature 0 the output equals --mode ar). pipeline/decoding.py")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or SentencePiece file (None: the model's)")


def load_model_from_args(args, load=None) -> Loaded:
    """`load_for_inference` (or `load`, same signature) with the `--model`, `--tokenizer`,
    `--device` and `--dtype` of `args`; writes the resolved device and dtype back into `args`
    (recorded in the JSON settings). Raises UsageError."""
    loaded = (load or load_for_inference)(args.model, args.tokenizer,
                                          DTYPES[args.dtype] if args.dtype else None,
                                          device=args.device)
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
    if getattr(args, "verify", "authors") not in ("authors", "correct"):
        raise UsageError(f"--verify {args.verify}: expected authors or correct")
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
            loaded = load_model_from_args(args)
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
        from pipeline.atomic_io import write_json
        write_json(args.json_out, doc)
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
