"""Training checkpoints: save, find the latest complete one, load (on the same layout or, through
`pipeline.checkpoint.reshard`, another one), keep the last K.

Owns: the on-disk layout below, the `latest` pointer, retention, per-rank RNG state. Must not
touch: the training loop, signals, the loader's internals (its state is an opaque part of
`client_state`), Hugging Face names, offline reading (`pipeline.checkpoint.consolidate`).

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
the previous complete checkpoint and `latest` untouched; only `is_complete` folders are ever
loaded, the one `latest` names first (so a crash between the rename and the pointer update
resumes from the older checkpoint, and `latest` can be pointed back by hand). The next save
deletes the leftovers (`remove_leftovers`).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.checkpoint.errors import CheckpointError, CheckpointWriteError
from pipeline.common import atomic_io

log = logging.getLogger(__name__)

LATEST = "latest"
META = "refusion_meta.json"
LAYOUT = "refusion_layout.json"
MODEL_CONFIG = "refusion_model_config.json"
PARTIAL = ".partial"
OLD = ".old"
_TAG_RE = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


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


def _gather_errors(error: Any) -> list[tuple[int, Any]]:
    """Every rank's `(rank, error)` for the ranks whose `error` (picklable) is not None
    (collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [(0, error)] if error is not None else []
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, error)
    return [(r, e) for r, e in enumerate(box) if e is not None]


def _write_failed(partial: Path, root: Path, failures: list) -> CheckpointWriteError:
    """Rank 0 removes `partial`; every rank builds the same one-line error from `failures`
    (`[(rank, pipeline.common.diskspace.WriteFailure)]`): the folder, the failing rank, the
    cause, what became of the partial folder and of the previous checkpoint, and a remedy that
    fits the cause (space only for a full disk or quota). Collective."""
    note = None
    if _rank() == 0:
        existed = partial.exists()
        shutil.rmtree(partial, ignore_errors=True)
        note = ("the partial folder could not be removed (it is never loaded; the next save "
                "deletes it)" if partial.exists() else
                "the partial folder was removed" if existed else "no partial folder was left")
    note = _broadcast_from_rank0(note)
    rank, failure = failures[0]
    others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    try:
        latest = find_latest(root)
    except OSError:
        latest = None
    kept = (f"the previous checkpoint {latest.name} is intact and stays the latest" if latest
            else "no earlier checkpoint exists")
    return CheckpointWriteError(
        f"checkpoint {partial}: rank {rank}{others} could not write it: {failure.cause}; {note}, "
        f"{kept}; {failure.remedy('checkpoint.dir')}, then rerun to resume")


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
    """The folder of the latest complete checkpoint under `root_dir`, or None: the one `latest`
    names when complete, else (pointer missing, or naming a folder that is gone or incomplete)
    the complete one with the highest step, with a warning."""
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
    """A complete step folder from either a step folder or a checkpoint root. Raises
    CheckpointError: `path` is neither a complete step folder nor a root holding one."""
    p = Path(path)
    if (p / META).is_file():
        return p
    latest = find_latest(p)
    if latest is None:
        raise CheckpointError(f"{p}: no complete checkpoint here (expected {META} in the folder, "
                              f"or step_<N>/ sub-folders holding it)")
    return latest


# --------------------------------------------------------------------------- layout

def parameter_layout(module: torch.nn.Module) -> dict[str, dict]:
    """Per-parameter TP layout of `module` as seen on this rank: {name: {"shape": per-TP-rank
    shape (ZeRO-3's unpartitioned `ds_shape` when present), "partition_dim": int | None
    (None = replicated), "partition_stride": int}}, names as in `module.named_parameters()`,
    read from megatron-core's parameter attributes (which `pipeline.model.Qwen3` sets from
    `pipeline.model.tp`'s table)."""
    out = {}
    for name, p in module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        dim = None
        if getattr(p, "tensor_model_parallel", False):
            dim = int(getattr(p, "partition_dim", -1))
            dim = dim + len(shape) if dim < 0 else dim
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
                    keep_last: int, model_config: Any = None,
                    pause_after_write_s: float = 0.0) -> Path:
    """Save a complete checkpoint of a DeepSpeed engine (its `mpu`, when set, gives TP/DP
    ranks) as `root_dir/step_<step>` (the module docstring's layout; returned), then keep the
    newest `keep_last` complete ones (0 keeps all); collective.

    Args:
        client_state: picklable dict of our state, stored per rank, returned by `load_latest`.
        model_config: recorded for export (dataclass, dict or DictConfig); default
            `engine.module.cfg` or `engine.module.config` when present.
        pause_after_write_s: fault injection (`debug.slow_save_s`): seconds to sleep after
            DeepSpeed's files are in the `.partial` folder, before this rank's own file.
    Raises:
        ValueError: `keep_last` < 0 or `step` < 0.
        CheckpointWriteError: on every rank, when any rank could not write its files or rank 0
            could not create the root or publish (an OSError); one line (`_write_failed`); the
            `.partial` folder is removed.
        Exception: on rank 0, any other failure while publishing; the other ranks then raise
            CheckpointError (no rank is left waiting in a collective).
    In every case the previous complete checkpoint stays the latest."""
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

    # Writing: any failure (read-only, permission, disk full, quota, ...) on any rank is agreed
    # on, so every rank raises the same CheckpointWriteError and nobody is left waiting in a
    # collective.
    from pipeline.common.diskspace import diagnose
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(root)
        except OSError as e:
            error = diagnose(e, root)
    error = _broadcast_from_rank0(error)   # also the barrier before anyone writes
    if error is not None:
        raise _write_failed(partial, root, [(0, error)])
    try:
        engine.save_checkpoint(str(root), tag=partial_tag, client_state={}, save_latest=False)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = diagnose(e, partial)
        _barrier()  # the barrier DeepSpeed's save ends with, where the other ranks wait
    if error is None:
        try:
            _crash_point("after_deepspeed_save")
            if pause_after_write_s > 0:
                time.sleep(pause_after_write_s)
            partial.mkdir(parents=True, exist_ok=True)  # ranks that wrote no DeepSpeed file
            _atomic_torch_save(partial / f"refusion_rank_{rank:05d}.pt",
                               {"client_state": client_state, "rng": rng_state(), "rank": rank,
                                "world_size": world})
        except (OSError, RuntimeError) as e:  # torch's zip writer hides the errno (RuntimeError)
            error = diagnose(e, partial)
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
            if isinstance(e, OSError):  # read-only, disk full, ...: the same error on every rank
                error = ("write", diagnose(e, partial))
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
    """Rank 0: delete (and return the names of) what crashed or failed saves left under `root`:
    `.partial` and `.old` folders, and `step_<N>` folders without `refusion_meta.json` older than
    the latest complete checkpoint (a newer incomplete one is left for inspection)."""
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
    """Resume from the latest complete checkpoint under `root_dir` (`find_latest`, chosen by
    rank 0); collective. Under ZeRO-3 the engine must be fresh (no save since
    `deepspeed.initialize`), as DeepSpeed requires.

    Args:
        load_optimizer_states / restore_rng: also restore optimizer and lr-scheduler state / this
            rank's RNG states.
        model_config: when given, checked with `check_model_config` before DeepSpeed loads.
        reshard: allow a checkpoint of another world size / TP size (ZeRO-3 only; converted once
            by `pipeline.checkpoint.reshard`). The returned state is then old rank 0's
            client_state plus `"resharded_from"` ({world_size, tp_size, dp_size}) and
            `"loader_states"` (every old DP rank's `client_state["loader"]`, in DP order); this
            rank restores the RNG states of old rank `rank % old world size`.
    Returns:
        This rank's saved `client_state` plus `"step"` and `"checkpoint_dir"` (str); None when
        there is no complete checkpoint.
    Raises:
        CheckpointError: another world size or TP size (without `reshard`) or model config,
            DeepSpeed could not load it, (`reshard`) it cannot be converted, or a file names a
            type outside the allow-list (`safe_load.UnsafeCheckpointError`)."""
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
    from pipeline.checkpoint.safe_load import load_checkpoint_file
    ours = load_checkpoint_file(step_dir / f"refusion_rank_{rank:05d}.pt")
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
    """`load_latest` for a checkpoint of another layout: rank 0 converts it (once), every rank
    loads its TP rank's part."""
    from pipeline.checkpoint import reshard

    rank = _rank()
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
