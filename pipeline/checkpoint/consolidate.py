"""Reading a finished training checkpoint offline: per-TP-rank fp32 weights merged over the
data-parallel ranks, one parameter at a time, and the full Hugging Face tensors for export and
inference.

Owns: the readers of DeepSpeed's ZeRO files (`open_tp_ranks`, streaming ZeRO-3 reads with
`os.preadv`), `consolidate_tp_ranks` / `consolidate_state_dict` (in memory), and
`hf_export_state` (lazy Hugging Face tensors through `pipeline.model.hf`). Must not touch:
saving or resuming (`pipeline.checkpoint.store`), the TP split rules (`pipeline.model.tp`).

Every public function takes `checkpoint_dir`, a complete step folder or a checkpoint root (its
latest is used), returns `info` = `read_checkpoint_info(checkpoint_dir)` with its result, and
raises `CheckpointError` for no complete checkpoint, missing files, or shapes that do not match
the recorded layout, and `UnsafeCheckpointError` (one) when a file names a type outside the
allow-list of `pipeline.checkpoint.safe_load`.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.errors import CheckpointError
from pipeline.checkpoint.safe_load import (UnsafeCheckpointError, check_checkpoint_files,
                                           load_checkpoint_file)
from pipeline.checkpoint.store import LAYOUT, META, MODEL_CONFIG, resolve_checkpoint_dir

log = logging.getLogger(__name__)


def _merge_tp_shards(shards: list[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """Merge per-TP-rank tensors into the full one (megatron-core's split, inverted).

    megatron-core cuts the full tensor along `dim` into `stride * tp` equal chunks and gives
    rank r chunks r, r + tp, r + 2 tp, ... (`_initialize_affine_weight_cpu`); stride 1 is a
    plain split into `tp` contiguous blocks. `dim` None = replicated: rank 0's copy.
    """
    if dim is None or len(shards) == 1:
        return shards[0]
    if stride == 1:
        return torch.cat(shards, dim=dim)
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


class _DictRankReader:
    """A TP rank's parameters held in memory (`{native name: tensor}`), read like
    `_Zero3RankReader`."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self.state[name]
        return t if start is None else t[start:stop]

    def close(self) -> None:
        pass


class _Zero3RankReader:
    """fp32 master weights of one TP rank of a ZeRO-3 checkpoint, one parameter (or a range of
    its rows) at a time, without holding the rank's weights in memory.

    Layout read: DeepSpeed 0.19's ZeRO-3 files, as `deepspeed.utils.zero_to_fp32` reads them
    (`fp32_flat_groups` per DP rank; each parameter of `param_shapes` takes `ceil(numel / dp)`
    elements on every DP rank, `zero3_partitioned_param_info`). DeepSpeed's `lazy_mode` keeps
    every page read resident (the rank's whole fp32 weights at the peak); here the mapping only
    locates each flat group in its file and `os.preadv` reads the values straight into the
    output. Without a known offset, values are copied from the map, unmapped every `remap_bytes`.

    Raises:
        CheckpointError: files missing, not ZeRO-3, or a DP file count that does not match.
        _NotStreamable: frozen or shared parameters (read by DeepSpeed instead).
    """

    def __init__(self, step_dir: Path, tp_rank: int, remap_bytes: int = 128 * 2 ** 20):
        from deepspeed.utils.zero_to_fp32 import natural_keys, zero3_partitioned_param_info

        mp = f"mp_rank_{tp_rank:02d}_"
        self.optim_files = sorted((f for f in step_dir.iterdir()
                                   if f"_{mp}" in f.name and f.name.endswith("_optim_states.pt")),
                                  key=lambda f: natural_keys(f.name))
        model_files = sorted((f for f in step_dir.iterdir()
                              if f"_{mp}" in f.name and f.name.endswith("_model_states.pt")),
                             key=lambda f: natural_keys(f.name))
        if not self.optim_files or not model_files:
            raise _NotStreamable("no ZeRO-3 per-DP-rank files")
        ms = load_checkpoint_file(model_files[0], mmap=True)
        if ms.get("frozen_param_shapes") or ms.get("shared_params"):
            raise _NotStreamable("frozen or shared parameters")
        osd = self._load(0)
        if osd.get("zero_stage") != 3:
            raise _NotStreamable(f"ZeRO stage {osd.get('zero_stage')}")
        self.dp = int(osd["partition_count"] if not isinstance(osd["partition_count"], list)
                      else max(osd["partition_count"]))
        if self.dp != len(self.optim_files):
            raise CheckpointError(f"{step_dir}: {len(self.optim_files)} optimizer files of TP "
                                  f"rank {tp_rank}, the checkpoint says {self.dp} DP ranks")
        group_sizes = [int(g.numel()) for g in osd["fp32_flat_groups"]]
        self.group_starts = [sum(group_sizes[:i]) for i in range(len(group_sizes) + 1)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.where: dict[str, tuple[int, int]] = {}   # name -> (offset in rank flat, per-rank)
        offset = 0
        for group in ms["param_shapes"]:
            for name, shape in group.items():
                numel = int(torch.Size(shape).numel())
                per, _ = zero3_partitioned_param_info(numel, self.dp)
                self.shapes[name] = tuple(int(x) for x in shape)
                self.where[name] = (offset, int(per))
                offset += int(per)
        if offset != self.group_starts[-1]:
            raise CheckpointError(f"{step_dir}: TP rank {tp_rank}: parameters take {offset} "
                                  f"elements per DP rank, the optimizer files hold "
                                  f"{self.group_starts[-1]}")
        del ms, osd
        self.remap_bytes = remap_bytes
        self._flat: dict[int, list[torch.Tensor]] = {}
        self._offsets: dict[int, list[int | None]] = {}
        self._read_bytes = 0

    def _load(self, dp: int) -> dict:
        sd = load_checkpoint_file(self.optim_files[dp], mmap=True)
        return sd["optimizer_state_dict"]

    def _groups(self, dp: int) -> list[torch.Tensor]:
        if dp not in self._flat:
            groups = list(self._load(dp)["fp32_flat_groups"])
            self._flat[dp] = groups
            self._offsets[dp] = [_file_offset(g, self.optim_files[dp]) for g in groups]
        return self._flat[dp]

    def _copy_flat(self, dp: int, start: int, out: torch.Tensor) -> None:
        """out[:] = elements [start, start + len(out)) of DP rank dp's concatenated groups
        (pread where the offset is known, else copied from the map)."""
        groups, done, n = self._groups(dp), 0, out.numel()
        while done < n:
            pos = start + done
            g = next(i for i in range(len(groups)) if pos < self.group_starts[i + 1])
            local = pos - self.group_starts[g]
            take = min(n - done, groups[g].numel() - local)
            base = self._offsets[dp][g]
            if base is not None and groups[g].dtype == torch.float32:
                _pread_into(self.optim_files[dp], base + local * 4, out[done:done + take])
            else:
                out[done:done + take].copy_(groups[g][local:local + take])
                self._read_bytes += take * 4
            done += take

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """FloatTensor of rows [start, stop) (dim 0) of parameter `name` (all rows if None)."""
        shape = self.shapes[name]
        rows = shape[0] if shape else 1
        start, stop = (0, rows) if start is None else (start, stop)
        cols = int(torch.Size(shape[1:]).numel()) if shape else 1
        lo, hi = start * cols, stop * cols            # elements of the flattened parameter
        offset, per = self.where[name]
        out = torch.empty(hi - lo, dtype=torch.float32)
        for dp in range(self.dp):
            a, b = max(lo, dp * per), min(hi, (dp + 1) * per)
            if a < b:
                self._copy_flat(dp, offset + a - dp * per, out[a - lo:b - lo])
        if self._read_bytes > self.remap_bytes:
            self.close()
        return out.view((stop - start,) + tuple(shape[1:])) if shape else out.view(())

    def close(self) -> None:
        """Unmap the optimizer files (pages read through them stop counting as resident)."""
        self._flat.clear()
        self._offsets.clear()
        self._read_bytes = 0


def _file_offset(t: torch.Tensor, path: Path) -> int | None:
    """Byte offset in `path` of the first element of `t` (memory-mapped from it by
    `torch.load(mmap=True)`), from /proc/self/maps (Linux); None when unknown."""
    try:
        real = os.path.realpath(path)
        ptr = t.data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if lo <= ptr < hi and ptr + t.numel() * t.element_size() <= hi:
                        return ptr - lo + int(parts[2], 16)
    except (OSError, ValueError):
        pass
    return None


def _pread_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` at `offset`."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path}: ends before byte {offset + len(view)}")
            done += n
    finally:
        os.close(fd)


class _NotStreamable(Exception):
    """A checkpoint the per-tensor ZeRO-3 reader does not handle (DeepSpeed's zero_to_fp32
    consolidates it as a whole instead)."""


def _tp_rank_reader(step_dir: Path, tp_rank: int):
    """A per-parameter reader of one TP rank's fp32 weights: `_Zero3RankReader` for ZeRO-3
    checkpoints, else the whole rank in memory (`_per_tp_rank_state_dict`: ZeRO 0-2, or
    frozen/shared parameters)."""
    try:
        return _Zero3RankReader(step_dir, tp_rank)
    except _NotStreamable:
        return _DictRankReader(_per_tp_rank_state_dict(step_dir, tp_rank))


def _per_tp_rank_state_dict(step_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 state dict of one TP rank, merged over its DP ranks.

    ZeRO 1-3: DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`, which refuses several
    model-parallel ranks, pointed at a temp folder of symlinks to this TP rank's files. ZeRO-0:
    the module state in `mp_rank_<tp>_model_states.pt`, cast to fp32.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    mp = f"mp_rank_{tp_rank:02d}_"
    files = [f for f in step_dir.iterdir()
             if (f.name.startswith(mp) or f"_{mp}" in f.name)
             and f.name.endswith(("_model_states.pt", "_optim_states.pt"))]
    if not any(f.name.endswith("_optim_states.pt") for f in files):
        plain = step_dir / f"{mp}model_states.pt"
        if not plain.is_file():
            raise CheckpointError(f"{step_dir}: no DeepSpeed model/optimizer files of TP rank "
                                  f"{tp_rank} (*{mp}*_states.pt)")
        module = load_checkpoint_file(plain)["module"]
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()
                if isinstance(v, torch.Tensor)}       # megatron's `_extra_state` entries: None
    check_checkpoint_files(files)     # zero_to_fp32 unpickles them with weights_only=False
    with tempfile.TemporaryDirectory(prefix="refusion-tp-") as tmp:
        view = Path(tmp) / step_dir.name
        view.mkdir()
        for f in files:
            (view / f.name).symlink_to(f.resolve())
        sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=step_dir.name)
    return dict(sd)


def read_checkpoint_info(checkpoint_dir: str | os.PathLike) -> dict:
    """What a complete checkpoint records about itself: `refusion_layout.json` (ARCHITECTURE.md
    "Checkpoints") plus "model_config" (dict or None), "step" and "checkpoint_dir" (str)."""
    step_dir = resolve_checkpoint_dir(checkpoint_dir)
    info = json.loads((step_dir / LAYOUT).read_text())
    meta = json.loads((step_dir / META).read_text())
    mcfg_path = step_dir / MODEL_CONFIG
    info["model_config"] = json.loads(mcfg_path.read_text()) if mcfg_path.is_file() else None
    info["step"] = meta["step"]
    info["checkpoint_dir"] = str(step_dir)
    return info


def open_tp_ranks(checkpoint_dir: str | os.PathLike) -> tuple[list, dict]:
    """Per-parameter readers of each TP rank's fp32 weights, merged over the DP ranks.

    ZeRO-3 is read one parameter at a time; ZeRO 0-2 ranks whole by DeepSpeed's zero_to_fp32.

    Returns:
        (readers: list indexed by TP rank, each with `shapes` ({native name: per-rank shape}),
        `read(name, start=None, stop=None) -> FloatTensor` (rows [start, stop) along dim 0)
        and `close()`; info).
    """
    info = read_checkpoint_info(checkpoint_dir)
    step_dir = Path(info["checkpoint_dir"])
    readers = [_tp_rank_reader(step_dir, r) for r in range(int(info["tp_size"]))]
    params = info["params"]
    for r, rd in enumerate(readers):
        missing = sorted(set(params) - set(rd.shapes))
        if missing:
            raise CheckpointError(f"{step_dir}: parameters missing from the DeepSpeed files of TP "
                                  f"rank {r}: {missing[:5]}")
        for name, p in params.items():
            if list(rd.shapes[name]) != p["shape"]:
                raise CheckpointError(f"{step_dir}: {name} on TP rank {r} has shape "
                                      f"{list(rd.shapes[name])}, the layout says {p['shape']}")
    return readers, info


def consolidate_tp_ranks(checkpoint_dir: str | os.PathLike
                         ) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """Per-TP-rank fp32 state dicts of a ZeRO (2 or 3) + TP checkpoint, each merged over its DP
    ranks, all in memory: (shards: list indexed by TP rank of {native name: FloatTensor at the
    per-rank shape}, info)."""
    readers, info = open_tp_ranks(checkpoint_dir)
    shards = [{name: rd.read(name) for name in rd.shapes} for rd in readers]
    for rd in readers:
        rd.close()
    return shards, info


def consolidate_state_dict(checkpoint_dir: str | os.PathLike
                           ) -> tuple[dict[str, torch.Tensor], dict]:
    """One full fp32 state dict (native names) from a ZeRO (2 or 3) + TP checkpoint.

    TP shards merged along the recorded partition dim and stride: right for plain (strided)
    splits only; fused `qkv_proj` / `gate_up_proj` need `pipeline.model.hf.merge_tp_state_dicts`.

    Returns (state_dict: {native name: FloatTensor at the full shape}, info).
    """
    shards, info = consolidate_tp_ranks(checkpoint_dir)
    full: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        p = info["params"].get(name)
        parts = [sd[name] for sd in shards]
        full[name] = parts[0] if p is None else _merge_tp_shards(parts, p["partition_dim"],
                                                                 p["partition_stride"])
    return full, info


def _token_ids_from_run(step_dir: Path) -> dict:
    """config.json token ids (bos/eos/pad/mask) from the shard manifest of the run (rank 0's
    client_state: `config.data.dir` or the first of `data.sources`); {} with one warning line
    naming the cause when not recorded or unreadable (`--tokenizer` then supplies them)."""
    from pipeline.data.shard_io import read_manifest
    try:
        ours = load_checkpoint_file(step_dir / "refusion_rank_00000.pt")
        from pipeline.config import data_sources   # a mixture's sources share one tokenizer
        tok = read_manifest(data_sources(ours["client_state"]["config"]["data"])[0].dir)["tokenizer"]
    except UnsafeCheckpointError:
        raise
    except (OSError, KeyError, TypeError, ValueError, ImportError, RuntimeError) as e:
        log.warning("token ids not taken from the run's shard manifest (%s: %s)",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return {}
    return {f"{k}_token_id": tok[f"{k}_id"] for k in ("bos", "eos", "pad", "mask")
            if tok.get(f"{k}_id") is not None}


def hf_export_state(checkpoint_dir: str | os.PathLike) -> tuple[dict, Any, dict]:
    """Full Hugging Face tensors of a ZeRO (2 or 3) + TP training checkpoint, lazily
    (`open_tp_ranks`, then `pipeline.model.hf.lazy_merged_state`): loading a tensor reads only
    its parts.

    Returns:
        (state: {hf_name: `pipeline.model.hf.LazyTensor`} (fp32; `.load(dtype)` reads, merges and
        casts that tensor) as `Qwen3ForCausalLM.state_dict()` names them,
        cfg: `pipeline.model.ModelConfig`, config_extra: `_token_ids_from_run`).
    Raises:
        CheckpointError: also when no model config is recorded (`UnsafeCheckpointError` also
            for `refusion_rank_00000.pt`).
    """
    from pipeline.model import ModelConfig
    from pipeline.model.hf import lazy_merged_state

    readers, info = open_tp_ranks(checkpoint_dir)
    where = f"{info['checkpoint_dir']}/{MODEL_CONFIG}"
    if info["model_config"] is None:
        raise CheckpointError(f"{where}: missing; no model config recorded with the checkpoint")
    cfg = ModelConfig.from_dict(info["model_config"], source=where)

    def read(name, rank, start=None, stop=None):
        return readers[rank].read(name, start, stop)

    state = lazy_merged_state(read, readers[0].shapes, torch.float32, cfg, len(readers))
    return state, cfg, _token_ids_from_run(Path(info["checkpoint_dir"]))
