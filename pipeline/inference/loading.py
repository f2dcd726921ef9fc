"""Loading a model for inference: a Hugging Face folder or a training checkpoint, with its
tokenizer, on the chosen device and dtype.

Owns: `load_model` / `load_for_inference`, the device choice (`resolve_device`,
`default_dtype`, `synchronize`), finding the tokenizer next to the weights, `prompt_ids` (a
prompt as the data pipeline wraps queries). Must not touch: the decoding algorithms, the
command-line options (`pipeline.inference.cli`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.common.cli import UsageError


@dataclass
class Loaded:
    """A model ready for decoding: `model` (`pipeline.model.Qwen3`, eval mode), `tokenizer`
    (`pipeline.tokenizer.Tokenizer`), `folder` (the HF folder or checkpoint path read)."""

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
    """The `torch.device` a `--device` value `spec` names: "auto" or None (CUDA when available,
    as `cuda:<LOCAL_RANK modulo the visible GPUs>` or `cuda:0`; else the CPU), "cpu", "cuda" (the
    current CUDA device), "cuda:N", or a `torch.device`. Raises UsageError: an unknown value, CUDA
    asked for where none is available, or an index past the visible GPUs."""
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


def load_model(model_path, dtype: torch.dtype | None = None, *,
               device: str | torch.device | None = None):
    """(model in eval mode, its `ModelConfig`, a tokenizer path found with the weights or None):
    the weights of `model_path` (a HF Qwen3 folder, or a checkpoint step folder / root) in
    `pipeline.model.Qwen3` (TP=1) on `device` (as `resolve_device`) in `dtype` (None:
    `default_dtype`); `load_for_inference` adds the tokenizer.

    The model is built on the meta device and materialized on `device`; the weights are copied in
    one tensor at a time (cast and moved on the copy), so no full-size host copy is made. A
    checkpoint's fp32 master weights are consolidated tensor by tensor
    (`pipeline.checkpoint.hf_export_state`) straight into the parameters: no Hugging Face folder
    is written.

    Raises:
        UsageError: a missing path, an unreadable HF folder or checkpoint, an unavailable device."""
    from pipeline.model import Qwen3
    from pipeline.model.hf import TensorSource, config_from_hf, iter_tp_shard, load_hf_into_model
    from pipeline.model.weights import copy_into_model, empty_model
    from pipeline.parallel import init_single_process

    path = Path(model_path)
    if not path.exists():
        raise UsageError(f"--model {path}: no such file or folder")
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    init_single_process()
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
    model = empty_model(Qwen3, cfg, dtype, dev)
    try:
        if state is not None:   # TP=1: each native parameter from its full HF tensors
            copy_into_model(model, iter_tp_shard(TensorSource(state), cfg, 0, 1), str(path))
        else:
            load_hf_into_model(model, path)
    except (KeyError, ValueError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise UsageError(f"--model {path}: {msg}")
    return model.eval(), cfg, tokenizer_path


def load_for_inference(model_path, tokenizer_path=None, dtype: torch.dtype | None = None, *,
                       device: str | torch.device | None = None,
                       fallback_tokenizer: str | None = None) -> Loaded:
    """`Loaded`: a HF folder or training checkpoint in `pipeline.model.Qwen3` (TP=1;
    `load_model` with the same `model_path`, `dtype`, `device`) with its tokenizer; starts a
    single-process gloo group and megatron-core's parallel state when none exists.

    `tokenizer_path`: tokenizer folder or SentencePiece file (default: the model folder's,
    `_find_tokenizer`; for a checkpoint, a `tokenizer/` next to or inside it), else
    `fallback_tokenizer` (`pipeline.evaluate`: the one saved with the shards it evaluates on).

    Raises:
        UsageError: missing paths, unreadable checkpoint, no tokenizer, mask/EOS ids outside the
            model's vocab, an unavailable device."""
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
        if tokenizer_path is None:
            tokenizer_path = fallback_tokenizer
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
        from pipeline.tokenizer import TokenizerError, load_tokenizer
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
