"""Training checkpoints: save, find the latest complete one, load, keep the last K, and merge a
ZeRO-3 + tensor-parallel checkpoint into one full state dict (or a Hugging Face folder).

Owns: the on-disk layout below, the `latest` pointer, retention, per-rank RNG state, and the
TP-aware consolidation. Must not touch: the training loop, signals, the data loader's
internals (its state is an opaque part of `client_state`), Hugging Face names (those are
`pipeline.hf_io`'s).

Layout of `root_dir` (a filesystem every rank sees, e.g. the cluster's shared filesystem):

    root_dir/
      latest                          text: the tag of the newest complete checkpoint
      step_000000100/                 one complete checkpoint (tag = "step_%09d" % step)
        zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt      DeepSpeed, ZeRO-3 (ZeRO 0-2:
        [bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt  mp_rank_{tp:02d}_model_states.pt)
        refusion_rank_{rank:05d}.pt   ours, per global rank: client_state + RNG states
        refusion_layout.json          ours: tp/dp sizes, each parameter's per-rank shape,
                                      TP partition dim and stride (for export)
        refusion_model_config.json    ours: the model config (for export)
        refusion_meta.json            ours, written last: step, tag, world/tp/dp sizes, time
      step_000000200.partial/         a save in progress (or one that crashed): never loaded

Crash safety: a save writes everything into `<tag>.partial`; after every rank has finished
(barrier), rank 0 writes `refusion_meta.json`, renames the folder to `<tag>` (an atomic
rename) and only then replaces `latest` (temp file + os.replace). A crash at any point leaves
the previous complete checkpoint and `latest` untouched; the loader only ever considers
folders named exactly `step_<digits>` that hold `refusion_meta.json`, and prefers the one
`latest` names (so a crash between the rename and the pointer update resumes from the older
checkpoint, and `latest` can be pointed back by hand). Leftover `.partial` / `.old` folders,
and `step_<N>` folders without `refusion_meta.json` older than the latest complete checkpoint,
are deleted by the next save (`remove_leftovers`). A save that cannot be written (disk full,
quota) raises `CheckpointWriteError` on every rank and removes its `.partial` folder.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline import atomic_io

log = logging.getLogger(__name__)

LATEST = "latest"
META = "refusion_meta.json"
LAYOUT = "refusion_layout.json"
MODEL_CONFIG = "refusion_model_config.json"
PARTIAL = ".partial"
OLD = ".old"
_TAG_RE = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match the running job (a user
    input error for CLIs: one line, exit code 2)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, quota exceeded, or another write error) on
    at least one rank. Raised on every rank with the same one-line message naming the folder,
    the failing rank(s) and the cause with the free space seen; the `.partial` folder has been
    removed and the previous complete checkpoint is still the latest."""


def tag_for_step(step: int) -> str:
    """The folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step:09d}"


# --------------------------------------------------------------------------- small helpers

def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(obj: Any) -> Any:
    """Every rank returns rank 0's `obj` (so all ranks act on the same decision)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_errors(error: str | None) -> list[tuple[int, str]]:
    """Every rank's `(rank, error)` for the ranks whose `error` is not None (collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [(0, error)] if error is not None else []
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, error)
    return [(r, e) for r, e in enumerate(box) if e is not None]


def _write_failed(partial: Path, root: Path, failures: list[tuple[int, str]]) -> CheckpointWriteError:
    """Rank 0 removes `partial`; every rank builds the same one-line error."""
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    rank, cause = failures[0]
    others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    latest = find_latest(root)
    kept = (f"the previous checkpoint {latest.name} is intact and stays the latest" if latest
            else "no earlier checkpoint exists")
    return CheckpointWriteError(
        f"checkpoint {partial}: rank {rank}{others} could not write it: {cause}; the partial "
        f"folder was removed, {kept}; free space (or use a larger checkpoint.dir) and rerun to "
        f"resume")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_json(path: Path, obj: Any) -> None:
    """Checkpoint metadata: sorted keys, fsync before the rename."""
    atomic_io.write_json(path, obj, fsync=True, sort_keys=True)


def _atomic_torch_save(path: Path, obj: Any) -> None:
    with atomic_io.atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _crash_point(name: str) -> None:
    """Test hook: tests replace this to simulate a crash at a named point of a save."""


# --------------------------------------------------------------------------- RNG

def rng_state() -> dict:
    """This process's RNG states: python `random`, numpy's global RNG, torch CPU, and every
    CUDA device's (when CUDA is available)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned (the CUDA part only when CUDA is available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- discovery

def is_complete(step_dir: str | os.PathLike) -> bool:
    """True when `step_dir` is a finished checkpoint: named `step_<digits>` and holding
    `refusion_meta.json` (written last, before the rename that publishes the folder)."""
    p = Path(step_dir)
    return bool(_TAG_RE.match(p.name)) and (p / META).is_file()


def list_complete(root_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root_dir` as (step, folder), oldest first."""
    root = Path(root_dir)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _TAG_RE.match(child.name)
        if m and child.is_dir() and is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_latest(root_dir: str | os.PathLike) -> Path | None:
    """The folder of the latest complete checkpoint under `root_dir`, or None.

    The `latest` pointer wins when it names a complete checkpoint; otherwise (pointer missing,
    or naming a folder that is gone or incomplete) the complete checkpoint with the highest
    step is used, with a warning.
    """
    root = Path(root_dir)
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if _TAG_RE.match(tag) and is_complete(root / tag):
            return root / tag
        log.warning("%s names %r, which is not a complete checkpoint; scanning %s",
                    pointer, tag, root)
    found = list_complete(root)
    return found[-1][1] if found else None


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A complete step folder from either a step folder or a checkpoint root.

    Raises:
        CheckpointError: `path` is neither a complete step folder nor a root holding one.
    """
    p = Path(path)
    if (p / META).is_file():
        return p
    latest = find_latest(p)
    if latest is None:
        raise CheckpointError(f"{p}: no complete checkpoint here (expected {META} in the folder, "
                              f"or step_<N>/ sub-folders holding it)")
    return latest


# --------------------------------------------------------------------------- layout

def _module_partition_dims(module: torch.nn.Module) -> dict[str, int]:
    """TP partition dim of every parameter owned by a megatron-core parallel layer, from the
    layer's type (its parameters carry `partition_dim` attributes only when megatron itself
    initialized them, not with `perform_initialization=False`)."""
    try:
        from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelEmbedding)
    except ImportError:  # megatron-core absent: attributes only
        return {}
    dims = {}
    for mod_name, mod in module.named_modules():
        prefix = mod_name + "." if mod_name else ""
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            rules = {"weight": 0, "bias": 0}      # output rows (vocab rows) split
        elif isinstance(mod, RowParallelLinear):
            rules = {"weight": 1}                 # input columns split; bias replicated
        else:
            continue
        for pname, _ in mod.named_parameters(recurse=False):
            if pname in rules:
                dims[prefix + pname] = rules[pname]
    return dims


def parameter_layout(module: torch.nn.Module) -> dict[str, dict]:
    """Per-parameter TP layout of `module` as seen on this rank.

    Returns:
        {name: {"shape": [...] per-TP-rank shape (the ZeRO-3 unpartitioned `ds_shape` when
        present), "partition_dim": int | None (None = replicated on every TP rank),
        "partition_stride": int}}, names as in `module.named_parameters()`. The partition dim
        comes from the owning megatron-core layer's type (VocabParallelEmbedding and
        ColumnParallelLinear: 0, RowParallelLinear weight: 1), else from megatron-core's
        parameter attributes (`tensor_model_parallel`, `partition_dim`); the stride from
        `partition_stride` when set, else 1.
    """
    by_type = _module_partition_dims(module)
    out = {}
    for name, p in module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        if name in by_type:
            dim = by_type[name]
        elif getattr(p, "tensor_model_parallel", False):
            dim = int(getattr(p, "partition_dim", -1))
            dim = dim + len(shape) if dim < 0 else dim
        else:
            dim = None
        stride = int(getattr(p, "partition_stride", 1)) if dim is not None else 1
        out[name] = {"shape": shape, "partition_dim": dim, "partition_stride": stride}
    return out


def _model_config_dict(engine, model_config) -> dict | None:
    import dataclasses
    cfg = model_config
    if cfg is None:
        cfg = getattr(engine.module, "cfg", None) or getattr(engine.module, "config", None)
    if cfg is None:
        return None
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, dict):
        return dict(cfg)
    try:  # omegaconf DictConfig
        from omegaconf import OmegaConf
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        raise TypeError(f"model_config of type {type(cfg).__name__} is not a dataclass, dict or "
                        f"DictConfig") from e


def _tp_dp(engine) -> tuple[int, int, int, int]:
    mpu = getattr(engine, "mpu", None)
    if mpu is not None:
        return (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    return 0, 1, _rank(), _world_size()


# --------------------------------------------------------------------------- save

def save_checkpoint(engine, root_dir: str | os.PathLike, step: int, client_state: dict,
                    keep_last: int, model_config: Any = None) -> Path:
    """Save a complete, crash-safe checkpoint of a DeepSpeed engine; collective (all ranks).

    Writes DeepSpeed's sharded state (module, ZeRO optimizer partitions, lr scheduler) with
    `engine.save_checkpoint` into `root_dir/step_<step>.partial`, then each rank's
    `client_state` and RNG states (`refusion_rank_<rank>.pt`), the TP layout and model config
    (rank 0), then publishes it: `refusion_meta.json`, rename to `step_<step>`, replace
    `latest`, delete complete checkpoints older than the newest `keep_last`.

    Args:
        engine: a `deepspeed.DeepSpeedEngine` (its `mpu`, when set, gives TP/DP ranks).
        root_dir: checkpoint root, on a filesystem all ranks share.
        step: optimizer steps taken so far (names the folder).
        client_state: picklable dict of our state (step, consumed samples, loader state,
            config, wandb run id, ...); stored per rank and returned by `load_latest`.
        keep_last: number of complete checkpoints to keep (>= 1; 0 keeps all).
        model_config: the model config (dataclass, dict or DictConfig) recorded for export;
            default: `engine.module.cfg` or `engine.module.config` when present.

    Returns:
        The published folder `root_dir/step_<step>`.

    Raises:
        ValueError: `keep_last` < 0 or `step` < 0.
        CheckpointWriteError: on every rank, when any rank could not write its files or rank 0
            could not publish them (an OSError: disk full, quota, ...); one line naming the
            folder, the rank and the cause with the free space seen. The `.partial` folder is
            removed.
        Exception: on rank 0, any other failure while publishing; the other ranks then raise
            CheckpointError (no rank is left waiting in a collective). In every case the
            previous complete checkpoint stays the latest.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = Path(root_dir)
    tag = tag_for_step(step)
    partial_tag = tag + PARTIAL
    partial = root / partial_tag
    rank, world = _rank(), _world_size()
    t0 = time.time()

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
    _barrier()

    # Writing: any failure (disk full, quota, ...) on any rank is agreed on below, so every rank
    # raises the same CheckpointWriteError and nobody is left waiting in a collective.
    from pipeline.diskspace import write_failure_cause
    error = None
    try:
        engine.save_checkpoint(str(root), tag=partial_tag, client_state={}, save_latest=False)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = write_failure_cause(e, partial)
        _barrier()  # the barrier DeepSpeed's save ends with, where the other ranks wait
    if error is None:
        try:
            _crash_point("after_deepspeed_save")
            partial.mkdir(parents=True, exist_ok=True)  # ranks that wrote no DeepSpeed file
            _atomic_torch_save(partial / f"refusion_rank_{rank:05d}.pt",
                               {"client_state": client_state, "rng": rng_state(), "rank": rank,
                                "world_size": world})
        except OSError as e:
            error = write_failure_cause(e, partial)
        except RuntimeError as e:  # torch's zip writer hides the errno of a short write
            error = write_failure_cause(e, partial)
    failures = _gather_errors(error)  # also: every rank's files are closed before publishing
    if failures:
        raise _write_failed(partial, root, failures)
    layout = parameter_layout(engine.module)
    mcfg = _model_config_dict(engine, model_config)
    _, tp_size, _, dp_size = _tp_dp(engine)
    _crash_point("before_publish")

    error = None
    if rank == 0:
        try:
            _publish(engine, root, partial, step, tag, world, tp_size, dp_size, layout, mcfg,
                     keep_last)
            log.info("saved checkpoint %s in %.1f s", root / tag, time.time() - t0)
        except Exception as e:  # tell the other ranks instead of leaving them in a barrier
            if isinstance(e, OSError):  # disk full, quota, ...: the same error on every rank
                error = ("write", write_failure_cause(e, partial))
            else:
                error = ("other", f"{type(e).__name__}: {e}")
                raise
        finally:
            _broadcast_from_rank0(error)
    else:
        error = _broadcast_from_rank0(None)
        if error is not None and error[0] == "other":
            raise CheckpointError(f"{partial}: rank 0 failed to publish the checkpoint: {error[1]}")
    if error is not None:
        raise _write_failed(partial, root, [(0, error[1])])
    return root / tag


def remove_leftovers(root: str | os.PathLike) -> list[str]:
    """Rank 0: delete what crashed or failed saves left under `root` (never loaded): `.partial`
    and `.old` folders, and `step_<N>` folders without `refusion_meta.json` whose step is older
    than the latest complete checkpoint (a newer incomplete one is left for inspection).

    Returns:
        The names removed.
    """
    root = Path(root)
    complete = list_complete(root)
    newest = complete[-1][0] if complete else None
    removed = []
    for child in root.iterdir():
        if not child.is_dir():
            continue
        m = _TAG_RE.match(child.name)
        stale_incomplete = (m is not None and newest is not None and int(m.group(1)) < newest
                            and not is_complete(child))
        if child.name.endswith((PARTIAL, OLD)) or stale_incomplete:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def _publish(engine, root: Path, partial: Path, step: int, tag: str, world: int, tp_size: int,
             dp_size: int, layout: dict, mcfg: dict | None, keep_last: int) -> None:
    """Rank 0: write our metadata into the finished `.partial` folder, rename it into place,
    replace `latest`, apply retention."""
    _atomic_write_json(partial / LAYOUT, {"format_version": FORMAT_VERSION, "tp_size": tp_size,
                                          "dp_size": dp_size, "params": layout})
    if mcfg is not None:
        _atomic_write_json(partial / MODEL_CONFIG, mcfg)
    _atomic_write_json(partial / META, {
        "format_version": FORMAT_VERSION, "step": step, "tag": tag, "world_size": world,
        "tp_size": tp_size, "dp_size": dp_size, "zero_stage": int(engine.zero_optimization_stage()),
        "saved_at_unix_s": time.time()})
    _fsync_dir(partial)
    final = root / tag
    old = None
    if final.exists():  # same step saved again: swap, then drop the old copy
        old = root / (tag + OLD)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(root)
    _crash_point("before_latest")
    atomic_io.write_bytes(root / LATEST, tag.encode(), fsync=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last > 0:
        for _, d in list_complete(root)[:-keep_last]:
            if d.name != tag:
                shutil.rmtree(d, ignore_errors=True)
    remove_leftovers(root)


# --------------------------------------------------------------------------- load

# Model-config fields that may change on resume (they do not change the network's parameters or
# function); every other recorded field must match.
RESUMABLE_MODEL_FIELDS = ("recompute", "init_std", "attention")


def check_model_config(step_dir: str | os.PathLike, model_config: Any) -> None:
    """Raise `CheckpointError` (one line naming the differing fields) when `model_config` differs
    from the one recorded in `step_dir/refusion_model_config.json` (fields in
    `RESUMABLE_MODEL_FIELDS`, and fields recorded on one side only, are not compared). No record
    (older checkpoints) or `model_config=None`: nothing to check."""
    path = Path(step_dir) / MODEL_CONFIG
    if model_config is None or not path.is_file():
        return
    saved = json.loads(path.read_text())
    now = _model_config_dict(None, model_config)
    diff = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in saved
            if k in now and k not in RESUMABLE_MODEL_FIELDS and saved[k] != now[k]]
    if diff:
        raise CheckpointError(
            f"{path}: the checkpoint's model differs from this run's: {', '.join(diff)} "
            f"(saved -> now); resume with the same model, or use another run_dir / checkpoint.dir")


def load_latest(engine, root_dir: str | os.PathLike, load_optimizer_states: bool = True,
                restore_rng: bool = True, model_config: Any = None,
                reshard: bool = False) -> dict | None:
    """Resume from the latest complete checkpoint under `root_dir`; collective (all ranks).

    Rank 0 chooses the folder (see `find_latest`) and every rank loads that one: DeepSpeed's
    module, optimizer and lr-scheduler state, then this rank's `client_state` and (by
    default) its RNG states. Under ZeRO-3 the engine must be fresh (no save since
    `deepspeed.initialize`), as DeepSpeed requires.

    Args:
        engine: a `deepspeed.DeepSpeedEngine` built like the one that saved.
        root_dir: checkpoint root given to `save_checkpoint`.
        load_optimizer_states: also restore optimizer and lr-scheduler state.
        restore_rng: restore python/numpy/torch/CUDA RNG states of this rank.
        model_config: this run's model config (dataclass, dict or DictConfig); when given, it
            is compared with the recorded one before DeepSpeed loads anything
            (`check_model_config`).
        reshard: allow a checkpoint of another world size / TP size (ZeRO-3 only): it is
            converted once (`pipeline.reshard`) and loaded on this layout. The returned state is
            then old rank 0's client_state plus `"resharded_from"` ({world_size, tp_size,
            dp_size}) and `"loader_states"` (every old DP rank's `client_state["loader"]`, in DP
            order); this rank restores the RNG states of old rank `rank % old world size`.

    Returns:
        The `client_state` this rank saved, with `"step"` set to the checkpoint's step and
        `"checkpoint_dir"` to its folder (str); None when there is no complete checkpoint.

    Raises:
        CheckpointError: the checkpoint was written by a job of a different world size or
            TP size (without `reshard`) or for a different model config, or DeepSpeed could
            not load it, or (`reshard`) it cannot be converted to this layout.
    """
    chosen = None
    if _rank() == 0:
        found = find_latest(root_dir)
        chosen = str(found) if found is not None else None
    chosen = _broadcast_from_rank0(chosen)
    if chosen is None:
        return None
    step_dir = Path(chosen)
    meta = json.loads((step_dir / META).read_text())
    rank, world = _rank(), _world_size()
    _, tp_size, _, _ = _tp_dp(engine)
    if meta["world_size"] != world or meta["tp_size"] != tp_size:
        if not reshard:
            raise CheckpointError(
                f"{step_dir}: saved by world size {meta['world_size']} with TP {meta['tp_size']}, "
                f"this job has world size {world} with TP {tp_size}; set checkpoint.reshard=true "
                f"to continue it on this layout (ZeRO-3), or run on the saved layout")
        check_model_config(step_dir, model_config)
        return _load_resharded(engine, step_dir, meta, load_optimizer_states, restore_rng)
    check_model_config(step_dir, model_config)
    load_path, _ = engine.load_checkpoint(str(step_dir.parent), tag=step_dir.name,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_optimizer_states)
    if load_path is None:
        raise CheckpointError(f"{step_dir}: DeepSpeed could not load this checkpoint")
    ours = torch.load(step_dir / f"refusion_rank_{rank:05d}.pt", map_location="cpu",
                      weights_only=False)
    if restore_rng:
        set_rng_state(ours["rng"])
    state = dict(ours["client_state"])
    state["step"] = meta["step"]
    state["checkpoint_dir"] = str(step_dir)
    _barrier()
    log.info("resumed from %s (step %d)", step_dir, meta["step"])
    return state


def _load_resharded(engine, step_dir: Path, meta: dict, load_optimizer_states: bool,
                    restore_rng: bool) -> dict:
    """`load_latest` for a checkpoint of another layout (see `pipeline.reshard`): rank 0
    converts it (once), every rank loads its TP rank's part, client state from old rank 0."""
    from pipeline import reshard

    rank, world = _rank(), _world_size()
    tp_rank, tp_size, _, dp_size = _tp_dp(engine)
    conv, error = None, None
    if rank == 0:
        try:
            conv = str(reshard.convert_to_universal(step_dir, tp_size))
        except Exception as e:  # tell every rank, then all raise the same one line
            error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    conv, error = _broadcast_from_rank0((conv, error))
    if error is not None:
        raise CheckpointError(f"{step_dir}: cannot reshard to TP {tp_size} x DP {dp_size}: {error}")
    reshard.load_universal(engine, conv, tp_rank, load_optimizer_states)
    saved = reshard.saved_client_states(step_dir)
    old_world, old_tp = int(meta["world_size"]), int(meta["tp_size"])
    if restore_rng:
        set_rng_state(saved[rank % old_world]["rng"])
    state = dict(saved[0]["client_state"])
    state["step"] = meta["step"]
    state["checkpoint_dir"] = str(step_dir)
    state["resharded_from"] = {"world_size": old_world, "tp_size": old_tp,
                               "dp_size": int(meta["dp_size"])}
    # global rank = dp_rank * tp + tp_rank (megatron-core's default order): TP rank 0 of each
    # old DP group holds that DP rank's loader state.
    state["loader_states"] = [saved[d * old_tp]["client_state"].get("loader")
                              for d in range(int(meta["dp_size"]))]
    engine.global_steps = int(meta["step"])
    _barrier()
    log.info("resumed from %s (step %d) resharded from TP %d x DP %d to TP %d x DP %d",
             step_dir, meta["step"], old_tp, meta["dp_size"], tp_size, dp_size)
    return state


# --------------------------------------------------------------------------- consolidation

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

    Layout read (DeepSpeed 0.19's ZeRO-3 checkpoint, as `deepspeed.utils.zero_to_fp32` reads
    it): each DP rank's `*_optim_states.pt` holds `optimizer_state_dict["fp32_flat_groups"]`,
    one flat fp32 tensor per parameter group; the parameters of `param_shapes` (in the
    `*_model_states.pt`, a list of ordered `{name: shape}` per group) follow each other in the
    concatenation of the groups, each taking `ceil(numel / dp)` elements on every DP rank
    (`zero3_partitioned_param_info`): DP rank d holds elements `[d * p, (d + 1) * p)` of the
    flattened parameter, the last one zero-padded. DeepSpeed's own `lazy_mode` maps every
    optimizer file once and keeps it mapped, so every page read stays resident until the end
    (the rank's whole fp32 weights at the peak). Here the files are mapped with
    `torch.load(mmap=True)` only to find each flat group's byte offset in the file (Linux:
    the mapping's address in /proc/self/maps); the values are then read with `os.preadv`
    straight into the output, so no mapped page is touched and the resident set stays near
    the parameter being read. Without a known offset the values are copied from the map and
    the files are unmapped whenever more than `remap_bytes` have been read through it.

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
        ms = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=False)
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
        sd = torch.load(self.optim_files[dp], map_location="cpu", mmap=True, weights_only=False)
        return sd["optimizer_state_dict"]

    def _groups(self, dp: int) -> list[torch.Tensor]:
        if dp not in self._flat:
            groups = list(self._load(dp)["fp32_flat_groups"])
            self._flat[dp] = groups
            self._offsets[dp] = [_file_offset(g, self.optim_files[dp]) for g in groups]
        return self._flat[dp]

    def _copy_flat(self, dp: int, start: int, out: torch.Tensor) -> None:
        """out[:] = elements [start, start + len(out)) of DP rank dp's concatenated groups:
        read from the file with pread where the group's byte offset in it is known (no page
        of the memory map touched, so nothing stays resident), else copied from the map."""
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
    """Byte offset in `path` of the first element of `t`, a tensor memory-mapped from that
    file by `torch.load(mmap=True)`: found through the mapping's range in /proc/self/maps
    (Linux); None when it cannot be established (then the caller reads through the map)."""
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

    ZeRO 1-3: DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`, which expects the files
    of one model-parallel rank only (FINDINGS trap 3), pointed at a temp folder of symlinks to
    this rank's files (`zero_pp_rank_<dp>_mp_rank_<tp>_model_states.pt` for ZeRO-3 or
    `mp_rank_<tp>_model_states.pt` for ZeRO 1-2, and `[bf16_]zero_pp_rank_<dp>_mp_rank_<tp>_
    optim_states.pt`). ZeRO-0 (no optimizer partitions): the module state in
    `mp_rank_<tp>_model_states.pt`, cast to fp32.
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
        module = torch.load(plain, map_location="cpu", weights_only=False)["module"]
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()
                if isinstance(v, torch.Tensor)}       # megatron's `_extra_state` entries: None
    with tempfile.TemporaryDirectory(prefix="refusion-tp-") as tmp:
        view = Path(tmp) / step_dir.name
        view.mkdir()
        for f in files:
            (view / f.name).symlink_to(f.resolve())
        sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=step_dir.name)
    return dict(sd)


def read_checkpoint_info(checkpoint_dir: str | os.PathLike) -> dict:
    """What a complete checkpoint records about itself.

    Args:
        checkpoint_dir: a complete step folder, or a checkpoint root (its latest is used).

    Returns:
        `refusion_layout.json` ({"tp_size", "dp_size", "params": {name: {"shape",
        "partition_dim", "partition_stride"}}}) plus "model_config" (dict or None), "step" and
        "checkpoint_dir" (str).

    Raises:
        CheckpointError: no complete checkpoint there.
    """
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

    A ZeRO-3 checkpoint is read one parameter at a time (`_Zero3RankReader`, no rank held in
    memory); ZeRO 0-2 ranks are consolidated whole by DeepSpeed's zero_to_fp32.

    Returns:
        (readers: list indexed by TP rank, each with `shapes` ({native name: per-rank shape}),
        `read(name, start=None, stop=None) -> FloatTensor` (rows [start, stop) along dim 0)
        and `close()`; info: `read_checkpoint_info`).

    Raises:
        CheckpointError: no complete checkpoint, missing files, or shapes that do not match
            the recorded layout.
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
    ranks (all in memory; `open_tp_ranks` reads one parameter at a time).

    Args:
        checkpoint_dir: a complete step folder, or a checkpoint root (its latest is used).

    Returns:
        (shards: list indexed by TP rank of {native name: FloatTensor at the per-rank shape},
        info: `read_checkpoint_info`).

    Raises:
        CheckpointError: no complete checkpoint, missing files, or shapes that do not match
            the recorded layout.
    """
    readers, info = open_tp_ranks(checkpoint_dir)
    shards = [{name: rd.read(name) for name in rd.shapes} for rd in readers]
    for rd in readers:
        rd.close()
    return shards, info


def consolidate_state_dict(checkpoint_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """One full fp32 state dict (native names) from a ZeRO (2 or 3) + TP checkpoint.

    `consolidate_tp_ranks`, then each parameter's TP shards merged along its recorded
    partition dim and stride (`refusion_layout.json`, from megatron-core's attributes).
    Correct for layers whose full weight is the plain (strided) concatenation of the rank
    shards. Fused layers whose rank shard is itself a concatenation of parts (the Qwen3
    model's `qkv_proj` = [q_r; k_r; v_r] and `gate_up_proj` = [gate_r; up_r]) need a
    model-aware merge: `consolidate_to_hf` uses `pipeline.hf_io.merge_tp_state_dicts`.

    Returns:
        (state_dict: {native name: FloatTensor at the full shape}, info: `read_checkpoint_info`).

    Raises:
        CheckpointError: as `consolidate_tp_ranks`.
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
    """config.json token ids (bos/eos/pad/mask) from the shard manifest the run trained on,
    found through the run config stored in rank 0's client_state (`config.data.dir`); {} when
    it is not recorded or no longer readable (one warning line naming the cause: the export
    then lacks these ids in config.json, and `--tokenizer` supplies them)."""
    try:
        ours = torch.load(step_dir / "refusion_rank_00000.pt", map_location="cpu",
                          weights_only=False)
        data_dir = ours["client_state"]["config"]["data"]["dir"]
        import fsspec
        with fsspec.open(f"{str(data_dir).rstrip('/')}/manifest.json", "r") as f:
            tok = json.load(f)["tokenizer"]
    except (OSError, KeyError, TypeError, ValueError, ImportError, RuntimeError) as e:
        log.warning("token ids not taken from the run's shard manifest (%s: %s)",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return {}
    return {f"{k}_token_id": tok[f"{k}_id"] for k in ("bos", "eos", "pad", "mask")
            if tok.get(f"{k}_id") is not None}


def hf_export_state(checkpoint_dir: str | os.PathLike) -> tuple[dict, Any, dict]:
    """Full Hugging Face tensors of a ZeRO (2 or 3) + TP training checkpoint, produced one at a
    time.

    `open_tp_ranks` (per-parameter fp32 readers per TP rank), then
    `pipeline.hf_io.lazy_merged_state` (TP merge, fused qkv / gate_up split, native -> HF
    names): nothing is read until a tensor is loaded, and loading one reads only its parts.

    Args:
        checkpoint_dir: a complete step folder, or a checkpoint root (its latest is used).

    Returns:
        (state: {hf_name: `pipeline.hf_io.LazyTensor`} (fp32; `.load(dtype)` reads, merges and
        casts that tensor) as `Qwen3ForCausalLM.state_dict()` names them,
        cfg: `pipeline.model.ModelConfig`, config_extra: token ids for config.json from the
        run's shard manifest when still readable, else {}).

    Raises:
        CheckpointError: no complete checkpoint, or no model config recorded with it.
    """
    from pipeline import hf_io
    from pipeline.model import ModelConfig

    readers, info = open_tp_ranks(checkpoint_dir)
    where = f"{info['checkpoint_dir']}/{MODEL_CONFIG}"
    if info["model_config"] is None:
        raise CheckpointError(f"{where}: missing; no model config recorded with the checkpoint")
    cfg = ModelConfig.from_dict(info["model_config"], source=where)

    def read(name, rank, start=None, stop=None):
        return readers[rank].read(name, start, stop)

    state = hf_io.lazy_merged_state(read, readers[0].shapes, torch.float32, cfg, len(readers))
    return state, cfg, _token_ids_from_run(Path(info["checkpoint_dir"]))


def consolidate_to_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      dtype: torch.dtype | None = torch.bfloat16, tokenizer_src=None,
                      overwrite: bool = False) -> Path:
    """Write a Hugging Face Qwen3 folder from a ZeRO-3 + TP training checkpoint:
    `hf_export_state`, then `pipeline.hf_io.save_hf_folder` (config.json + safetensors,
    written atomically, one tensor in memory at a time), loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
    (`python -m pipeline.export CHECKPOINT OUT` does the same from the command line.)

    Args:
        checkpoint_dir: a complete step folder or a checkpoint root.
        out_dir: the folder to write.
        dtype: dtype of the written weights (None: the fp32 master weights as they are).
        tokenizer_src: a tokenizer folder to copy in (with the ReFusion tokens added).
        overwrite: replace a non-empty `out_dir`.

    Returns:
        Path(out_dir).

    Raises:
        CheckpointError: no complete checkpoint, or no model config recorded with it.
        FileExistsError: `out_dir` is not empty and not `overwrite`.
    """
    from pipeline import hf_io

    state, cfg, extra = hf_export_state(checkpoint_dir)
    return hf_io.save_hf_folder(state, cfg, out_dir, dtype=dtype, tokenizer_src=tokenizer_src,
                                config_extra=extra, overwrite=overwrite)
