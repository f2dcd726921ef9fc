"""Hugging Face Qwen3 folders <-> our native tensor-parallel parameters (the state-dict adapter).

Owns: config.json -> `ModelConfig`, per-rank loading that reads only the slices a rank needs
(safetensors `get_slice`, single file or sharded), merging per-rank tensors into full ones,
writing a Hugging Face folder. Must not touch: the network, training checkpoints
(`pipeline.checkpoint`), process groups. Which native parameter is made of which Hugging Face
tensors, and how each is split over the TP group, is `pipeline.model.tp`'s table: this module
only reads it. The vocabulary rule (checkpoint rows kept, zero-padded to a multiple of the TP
size, `padded_vocab_size`): docs/METHOD.md "Qwen3 facts" (Tokens). API overview:
ARCHITECTURE.md "HF I/O API".
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from pipeline.model.config import ModelConfig
from pipeline.model.tp import ParamSpec, padded_vocab_size, param_specs
from pipeline.model.weights import copy_into_model
from pipeline.tokenizer import REFUSION_TOKENS, save_tokenizer


QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM",)


DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3


def read_hf_config(src) -> dict:
    """The parsed `config.json` of a Hugging Face folder. Raises FileNotFoundError (missing) or
    ValueError (not valid JSON; names the file)."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (expected a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def config_from_hf(src, tp_size: int = 1) -> ModelConfig:
    """`ModelConfig` from a Hugging Face Qwen3 `config.json` (folder path or parsed dict),
    vocab padded to a multiple of `tp_size`; accepts the authors' ReFusion folders (extra keys
    such as `mask_token_id`).

    Raises:
        ValueError: not a Qwen3 config, or a feature we do not implement (attention bias,
            sliding window, RoPE scaling); the message names the file and key.
    """
    if isinstance(src, dict):
        hc, where = src, "config.json"
    else:
        hc, where = read_hf_config(src), str(Path(src) / "config.json")
    if hc.get("model_type") not in ("qwen3", None):
        raise ValueError(f"{where}: model_type is {hc.get('model_type')!r}, expected 'qwen3'")
    archs = hc.get("architectures") or list(QWEN3_ARCHITECTURES)
    if not any(a in QWEN3_ARCHITECTURES for a in archs):
        raise ValueError(f"{where}: architectures {archs} is not Qwen3ForCausalLM")
    if hc.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported (Qwen3 has none)")
    if hc.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"{where}: RoPE type {rope_type!r} is not supported (only default)")
    theta = rope.get("rope_theta", hc.get("rope_theta", 10000.0))
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hc]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    heads = hc["num_attention_heads"]
    cfg = ModelConfig(
        vocab_size=padded_vocab_size(int(hc["vocab_size"]), tp_size),
        hidden_size=int(hc["hidden_size"]),
        intermediate_size=int(hc["intermediate_size"]),
        num_layers=int(hc["num_hidden_layers"]),
        num_attention_heads=int(heads),
        num_key_value_heads=int(hc.get("num_key_value_heads") or heads),
        head_dim=int(hc.get("head_dim") or hc["hidden_size"] // heads),
        rope_theta=float(theta),
        rms_norm_eps=float(hc.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hc.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hc.get("max_position_embeddings", 40960)),
        init_std=float(hc.get("initializer_range", 0.02)),
    )
    cfg.validate(tp_size, source=where)
    return cfg


def hf_config_dict(cfg: ModelConfig, vocab_size: int | None = None, **extra) -> dict:
    """A Qwen3 `config.json` dict for `cfg` (the keys `transformers.Qwen3Config` reads),
    declaring `vocab_size` rows (default `cfg.vocab_size`), plus the `extra` keys (e.g.
    `mask_token_id`, `dtype`)."""
    d = {
        "architectures": list(QWEN3_ARCHITECTURES),
        "model_type": "qwen3",
        "vocab_size": vocab_size or cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": cfg.init_std,
        "use_cache": True,
    }
    d.update(extra)
    return d


class SafetensorsFolder:
    """Lazy read access to the tensors of a HF folder (`model.safetensors` or a sharded set with
    `model.safetensors.index.json`); nothing is read until `get_slice(...)[...]`. Raises
    FileNotFoundError: no safetensors weights in the folder (names it)."""

    def __init__(self, src):
        self.root = Path(src)
        index = self.root / "model.safetensors.index.json"
        single = self.root / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: self.root / v for k, v in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open
            with safe_open(str(single), framework="pt") as f:
                self.file_of = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.root}: no model.safetensors or "
                                    f"model.safetensors.index.json")
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get_slice(self, name: str):
        """A safetensors slice object (index it, e.g. `[a:b]` or `[:, a:b]`, to read)."""
        from safetensors import safe_open
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_slice(name)

    def close(self) -> None:
        self._handles.clear()


def _rows_slice(sl, start: int, stop: int, dim: int) -> torch.Tensor:
    """Read `[start, stop)` along `dim` of a safetensors slice; rows past its end become zeros."""
    shape = sl.get_shape()
    have = min(stop, shape[dim])
    if dim == 0:
        t = sl[start:have] if have > start else None
    else:
        t = sl[:, start:have] if have > start else None
    want = list(shape)
    want[dim] = stop - start
    if t is None or t.shape[dim] < stop - start:
        out_dtype = t.dtype if t is not None else torch.float32
        out = torch.zeros(want, dtype=out_dtype)
        if t is not None:
            out.narrow(dim, 0, t.shape[dim]).copy_(t)
        t = out
    return t


def _read_tp_param(st: "SafetensorsFolder", src, spec: ParamSpec, tp_rank: int,
                   tp_size: int) -> torch.Tensor:
    """This rank's slice of one native parameter, read from the HF tensors of `spec` (block
    `tp_rank` of each part along the split dim, parts concatenated; rows past a tensor's end,
    i.e. vocab padding, are zeros)."""
    parts = []
    for name, per in zip(spec.hf, spec.part_lengths(tp_size)):
        if name not in st:
            raise KeyError(f"{src}: tensor {name} missing from the checkpoint")
        sl = st.get_slice(name)
        if spec.dim is None:
            parts.append(sl[:])
        else:
            parts.append(_rows_slice(sl, tp_rank * per, (tp_rank + 1) * per, spec.dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim or 0)


def tp_param_reader(src, cfg: ModelConfig, tp_rank: int, tp_size: int):
    """`read(native_name) -> Tensor`: this TP rank's slice of one parameter, read from the HF
    folder `src` as `iter_tp_shard` yields it (as stored; files reopened per call). `read` raises
    KeyError: an unknown parameter, or an HF tensor missing from the checkpoint."""
    specs = {s.native: s for s in param_specs(cfg)}
    st = SafetensorsFolder(src)

    def read(native: str) -> torch.Tensor:
        try:
            return _read_tp_param(st, src, specs[native], tp_rank, tp_size).contiguous()
        finally:
            st.close()
    return read


def iter_tp_shard(src, cfg: ModelConfig, tp_rank: int, tp_size: int,
                  dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(native_name, tensor)` for TP rank `tp_rank` of `tp_size`, each exactly the shape
    of `Qwen3(cfg)`'s parameter there (vocab padding rows zeros, cast to `dtype` when given),
    reading only the needed slices of `src` (a Hugging Face folder or anything with
    `SafetensorsFolder`'s read interface, e.g. a `TensorSource`). One parameter is held at a
    time: the files are reopened per parameter, so pages read through their memory maps do not
    stay resident (peak: about one parameter slice).

    Raises:
        KeyError: a tensor the model needs is missing from the checkpoint (names it)."""
    st = src if hasattr(src, "get_slice") else SafetensorsFolder(src)
    try:
        for spec in param_specs(cfg):
            t = _read_tp_param(st, src, spec, tp_rank, tp_size)
            st.close()
            if dtype is not None:
                t = t.to(dtype)
            yield spec.native, t.contiguous()
    finally:
        st.close()


def load_hf_into_model(model, src) -> None:
    """Copy this rank's slices (megatron-core's TP rank/size) of a HF folder into a `Qwen3`
    model in place, ZeRO-3 partitioned or not (`pipeline.model.weights.copy_into_model`).
    Raises KeyError for a missing tensor and ValueError for a shape mismatch (names it)."""
    from megatron.core import parallel_state
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    copy_into_model(model, iter_tp_shard(src, model.cfg, rank, size), source=str(src))


def native_state_dict(model) -> dict[str, torch.Tensor]:
    """This rank's native tensors of `model` (parameters only, detached, on CPU)."""
    return {k: v.detach().cpu() for k, v in model.named_parameters()}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced on demand (streaming export: one tensor in memory at a time): `shape`,
    `dtype` (what `load(None)` returns) and `load(dtype | None) -> Tensor` of `shape`, cast when
    `dtype` is given (a producer may cast piece by piece, holding less than a full fp32 copy)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[torch.dtype | None], torch.Tensor]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


# A rank reader: `read(native_name, tp_rank, start, stop) -> Tensor` gives rows [start, stop)
# along dim 0 of that rank's native parameter (all rows when start and stop are None).
RankReader = Callable[[str, int, "int | None", "int | None"], torch.Tensor]


class TensorSource:
    """Full Hugging Face tensors held in memory (or `LazyTensor`s, produced on each
    `get_slice(...)[...]`), read like a `SafetensorsFolder` (`name in src`, `get_slice(name)`
    indexed `[a:b]` / `[:, a:b]`, `get_shape()`, `close()`), so `iter_tp_shard` can cut them for
    any TP rank."""

    class _Slice:
        def __init__(self, value):
            self.value = value

        def get_shape(self) -> list[int]:
            return list(self.value.shape)

        def __getitem__(self, idx):
            t = self.value.load(None) if isinstance(self.value, LazyTensor) else self.value
            return t[idx]

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get_slice(self, name: str) -> "TensorSource._Slice":
        return self._Slice(self.tensors[name])

    def close(self) -> None:
        pass


def lazy_merged_state(read: RankReader, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                      cfg: ModelConfig, tp_size: int, vocab_rows: int | None = None
                      ) -> dict[str, LazyTensor]:
    """Full Hugging Face tensors (`{hf_name: LazyTensor}`, named as
    `Qwen3ForCausalLM.state_dict()`, no `lm_head.weight` when tied, in `param_specs` order) over
    per-TP-rank native parameters: `read` (a `RankReader`) gives them in `dtype`, `shapes` is
    `{native_name: per-rank shape}`; only the first `vocab_rows` embedding/head rows are kept
    (default `cfg.vocab_size`: the TP padding is dropped).

    A tensor is built when loaded: allocated at full shape, then every rank's part (only its
    rows of this HF tensor: one of a fused q/k/v or gate/up, the kept vocab rows) is read and
    copied in, cast on the copy, so at most the output plus one rank's part are held. Partitioned
    parameters are concatenated along `partition_dim` (fused shards split per rank first);
    replicated ones come from rank 0."""
    tp = tp_size

    def rows_of(native, offset, n_rank, keep):
        """(read-start, read-stop, dest-start) per rank: rows [offset, offset + n_rank) of each
        rank's parameter, laid end to end, cut at `keep` rows."""
        out = []
        for r in range(tp):
            dest = r * n_rank
            n = min(n_rank, keep - dest)
            if n > 0:
                out.append((r, offset, offset + n, dest))
        return out

    def make(native, spec_dim, rank_shape, offset, n_rank, keep):
        if spec_dim is None:
            full = tuple(rank_shape)
        elif spec_dim == 1:
            full = (rank_shape[0], rank_shape[1] * tp) + tuple(rank_shape[2:])
        else:
            full = (keep,) + tuple(rank_shape[1:])

        def load(want=None):
            want = want or dtype
            if spec_dim is None:
                return read(native, 0, None, None).to(want).clone()
            if spec_dim == 1:
                pieces = [(r, None, None) for r in range(tp)]
                if tp == 1:
                    return read(native, 0, None, None).to(want).contiguous()
                out = torch.empty(full, dtype=want)
                for r, _, _ in pieces:
                    part = read(native, r, None, None)
                    w = part.shape[1]
                    out[:, r * w:(r + 1) * w].copy_(part)
                    del part
                return out
            plan = rows_of(native, offset, n_rank, keep)
            if len(plan) == 1 and plan[0][3] == 0 and plan[0][2] - plan[0][1] == keep:
                r, a, b, _ = plan[0]
                return read(native, r, a, b).to(want).contiguous()
            out = torch.empty(full, dtype=want)
            for r, a, b, dest in plan:
                part = read(native, r, a, b)
                out[dest:dest + (b - a)].copy_(part)
                del part
            return out
        return LazyTensor(shape=tuple(int(x) for x in full), dtype=dtype, load=load)

    out: dict[str, LazyTensor] = {}
    for spec in param_specs(cfg):
        rank_shape = tuple(shapes[spec.native])
        if spec.dim is None or spec.dim == 1:
            out[spec.hf[0]] = make(spec.native, spec.dim, rank_shape, 0, 0, 0)
            continue
        if len(spec.hf) == 1:
            keep = rank_shape[0] * tp
            if spec.native in ("embed_tokens.weight", "lm_head.weight") and vocab_rows:
                keep = min(keep, vocab_rows)
            out[spec.hf[0]] = make(spec.native, 0, rank_shape, 0, rank_shape[0], keep)
            continue
        sizes = spec.part_lengths(tp)
        offset = 0
        for name, n in zip(spec.hf, sizes):
            out[name] = make(spec.native, 0, rank_shape, offset, n, n * tp)
            offset += n
    return out


def merge_tp_state_dicts(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig,
                         vocab_rows: int | None = None) -> dict[str, torch.Tensor]:
    """`lazy_merged_state`'s result (same rules, same `vocab_rows`), every tensor
    materialized, from `shards`: the native state dicts of TP ranks 0..tp-1 (names as
    `Qwen3.named_parameters`).

    Raises:
        KeyError: a parameter is missing from a shard.
    """
    def read(native, rank, start, stop):
        t = shards[rank][native]
        return t if start is None else t[start:stop]

    names = [s.native for s in param_specs(cfg)]
    for r, sd in enumerate(shards):
        missing = [n for n in names if n not in sd]
        if missing:
            raise KeyError(f"TP rank {r}: parameter {missing[0]} missing")
    shapes = {n: tuple(shards[0][n].shape) for n in names}
    dtype = shards[0][names[0]].dtype
    lazy = lazy_merged_state(read, shapes, dtype, cfg, len(shards), vocab_rows)
    return {k: v.load(None) for k, v in lazy.items()}


def _atomic_dir(out: Path, overwrite: bool):
    """Temporary sibling folder of `out`; `finish(tmp)` renames it into place."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder

    def finish():
        for f in tmp.iterdir():  # safetensors writes private files; make them ordinary
            f.chmod(0o666 & ~umask)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    return tmp, finish


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


# safetensors' dtype order (its Rust `Dtype` enum, ascending); its writer lays out the data by
# this order descending, then by name (checked against `save_file` in tests/test_hf_io.py).
_ST_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32",
             "U32", "F32", "F64", "I64", "U64")


def write_safetensors(path, entries: dict[str, LazyTensor], metadata: dict | None = None
                      ) -> None:
    """Write one safetensors file at `path` from `entries` (`{name: LazyTensor}`; each
    `load(dtype)` is called once, in data order, with the entry's dtype) and `metadata` (the
    `__metadata__` strings), one tensor at a time (peak: that tensor plus what its producer needs).

    Byte for byte what `safetensors.torch.save_file` writes for the same tensors (checked by
    tests/test_hf_io.py): an 8-byte little-endian header length, the JSON header (compact;
    `__metadata__` first, then the tensors in data order, padded with spaces to a multiple of 8
    bytes), then the raw little-endian data ordered by safetensors' dtype order, descending, then
    by name.

    Raises:
        ValueError: a produced tensor's shape or dtype differs from its entry; a dtype that
            safetensors cannot store.
        OSError: writing failed (e.g. ENOSPC)."""
    import struct
    for name, e in entries.items():
        if e.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {e.dtype} cannot be stored in safetensors")
    order = sorted(entries, key=lambda n: (-_ST_ORDER.index(_ST_DTYPES[entries[n].dtype]), n))
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        e = entries[name]
        n = math.prod(e.shape) * e.dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            e = entries[name]
            t = e.load(e.dtype)
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, expected "
                                 f"{tuple(e.shape)} {e.dtype}")
            flat = t.detach().contiguous().reshape(-1)
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))
            del t, flat


def _as_lazy(v, dtype: torch.dtype | None) -> LazyTensor:
    """A state entry (Tensor or LazyTensor) as a LazyTensor in its output dtype (`dtype` for
    floating tensors when given)."""
    if isinstance(v, LazyTensor):
        want = dtype if dtype is not None and v.dtype.is_floating_point else v.dtype
        return LazyTensor(shape=tuple(v.shape), dtype=want, load=lambda d=None, v=v: v.load(d))
    want = dtype if dtype is not None and v.is_floating_point() else v.dtype
    return LazyTensor(shape=tuple(v.shape), dtype=want,
                      load=lambda d=None, v=v: v.to(d or want).contiguous())


def save_hf_folder(state: dict, cfg: ModelConfig, out, *,
                   tokenizer_src=None, added_tokens=REFUSION_TOKENS,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   dtype: torch.dtype | None = None, config_extra: dict | None = None,
                   overwrite: bool = False) -> Path:
    """Write a Hugging Face Qwen3 folder atomically (temp folder, then rename; on any error it is
    removed and `out` is untouched).

    Writes `config.json` (with `config_extra` keys, `torch_dtype` = `dtype`), `model.safetensors`
    (or huggingface_hub's `split_torch_state_dict_into_shards` shards plus
    `model.safetensors.index.json` above `max_shard_bytes` bytes) from `state` (`{hf_name: Tensor |
    LazyTensor}`, floating tensors cast to `dtype` when given, written one at a time by
    `write_safetensors`), and with `tokenizer_src` (`save_tokenizer`) the tokenizer files with
    `added_tokens` and `mask_token_id` in config.json.

    Raises:
        FileExistsError: `out` is a non-empty folder and not `overwrite`.
        ValueError: the tokenizer is longer than the embedding rows.
        OSError: writing failed (ENOSPC / EDQUOT when the disk or quota is full)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    lazy = {k: _as_lazy(v, dtype) for k, v in state.items()}
    rows = lazy["model.embed_tokens.weight"].shape[0]
    tmp, finish = _atomic_dir(Path(out), overwrite)
    try:
        extra = dict(config_extra or {})
        if tokenizer_src is not None:
            tok = save_tokenizer(tokenizer_src, tmp, added_tokens)
            n = tok["length"]
            if 0 <= tok["mask_token_id"] < rows:
                extra["mask_token_id"] = tok["mask_token_id"]  # the written tokenizer's id
            if n > rows:
                raise ValueError(f"{tokenizer_src}: tokenizer has {n} tokens but the model has "
                                 f"only {rows} embedding rows")
        some = next(iter(lazy.values()))
        extra.setdefault("torch_dtype", str(some.dtype).replace("torch.", ""))
        extra.setdefault("dtype", extra["torch_dtype"])
        (tmp / "config.json").write_text(
            json.dumps(hf_config_dict(cfg, vocab_size=rows, **extra), indent=2) + "\n")
        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in lazy.items()}
        split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)
        for filename, names in split.filename_to_tensors.items():
            write_safetensors(tmp / filename, {n: lazy[n] for n in names},
                              metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(math.prod(v.shape) * v.dtype.itemsize
                                                    for v in lazy.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        finish()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out)
