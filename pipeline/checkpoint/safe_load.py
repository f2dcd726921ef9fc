"""Reading checkpoint files without running code from them: `torch.load(weights_only=True)` with
an allow-list of the few non-tensor types our checkpoints and DeepSpeed's hold.

Owns: the allow-list (`allowed_globals`), `load_checkpoint_file` (every `*.pt` read of a
checkpoint folder by our code goes through it) and `check_checkpoint_files` (for files that
DeepSpeed's converters then unpickle themselves). Must not touch: where files are
(`pipeline.checkpoint.store`), what they mean (`store`, `reshard`, `consolidate`), DeepSpeed's
own loaders (`engine.load_checkpoint` unpickles a run's checkpoint on resume with
`weights_only=False`; docs/EVALUATION.md "Security").

A pickle can name any importable function (`os.system`, `builtins.exec`) and have it called
on load; `weights_only=True` only rebuilds tensors, containers, numbers and strings, plus the
globals allowed here. The list was taken from real checkpoints written by the tests (ZeRO-2
and ZeRO-3, TP 1 and 2, saved, resharded and converted to universal folders), with
`torch.serialization.get_unsafe_globals_in_checkpoint`:
- `refusion_rank_<rank>.pt`: numpy's RNG state (`np.random.get_state()`: a uint32 array);
- DeepSpeed ZeRO-3 `*_optim_states.pt`: `ZeroStageEnum`, the static `LossScaler` and
  `fragment_address` (DeepSpeed 0.19); ZeRO-2 files and the universal tensors hold none.
The allow-list is applied with the `torch.serialization.safe_globals` context manager for the
duration of one load, not with `add_safe_globals`, so importing this module changes nothing in
the process's global `torch.load` behaviour.
"""
from __future__ import annotations

import functools
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from pipeline.checkpoint.errors import CheckpointError

__all__ = ["allowed_globals", "UnsafeCheckpointError", "load_checkpoint_file",
           "check_checkpoint_files"]


@functools.cache
def allowed_globals() -> tuple:
    """The types a checkpoint file may name besides torch's own (imported on first use, so
    importing the package does not import DeepSpeed)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    try:                               # numpy >= 2 pickles arrays through numpy._core
        from numpy._core.multiarray import _reconstruct
    except ImportError:                # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    # a checkpoint names the function by the path of the numpy that wrote it: numpy 1.x
    # `numpy.core.multiarray`, numpy 2 `numpy._core.multiarray`; both are the same function
    reconstruct = [(_reconstruct, f"numpy.{core}.multiarray._reconstruct")
                   for core in ("core", "_core")]
    return (*reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # numpy RNG state
            ZeroStageEnum, LossScaler, fragment_address)                    # ZeRO-3 optim states


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file's pickle names a global outside `allowed_globals()` (it could run code
    when loaded); nothing of it was executed. One line naming the file and the global (a
    user input error for CLIs: exit code 2)."""


def _offending_global(err: Exception) -> str:
    """The global torch's weights-only unpickler refused, from its (multi-line) message."""
    text = str(err)
    for pattern in (r"GLOBAL (\S+) was not an allowed global", r"but got <class '([^']+)'>",
                    r"[Uu]nsupported global: (?:GLOBAL )?(\S+)"):
        m = re.search(pattern, text)
        if m:
            return m.group(1)
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip()
    return detail.splitlines()[0] if detail else type(err).__name__


def load_checkpoint_file(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """`torch.load(path, map_location="cpu", weights_only=True)` allowing `allowed_globals()`.

    Args:
        path: a `*.pt` file of a checkpoint folder (ours, DeepSpeed's, or a universal tensor).
        mmap: map the file's tensor storages instead of reading them (zip-format files only).

    Returns:
        the unpickled object (CPU tensors, dicts, lists, numbers, strings, allowed types).

    Raises:
        UnsafeCheckpointError: the pickle names another global; the message is one line:
            "<path>: not loaded: it names <module.name>, which ...".
        OSError / RuntimeError: the file is missing or not a torch checkpoint (as torch.load).
    """
    try:
        with torch.serialization.safe_globals(list(allowed_globals())):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{Path(path)}: not loaded: it names {_offending_global(e)}, which is not on the "
            f"checkpoint allow-list (pipeline/checkpoint/safe_load.py) and could run code; "
            f"load checkpoints only from a source you trust") from None


def check_checkpoint_files(paths: Iterable[str | os.PathLike]) -> None:
    """Check each file with `load_checkpoint_file(mmap=True)` (the pickle is read, the tensor
    data is only mapped) before handing it to a DeepSpeed converter that unpickles it with
    `weights_only=False` (`zero_to_fp32`, `ds_to_universal`).

    Raises:
        UnsafeCheckpointError: as `load_checkpoint_file`, for the first file that fails.
    """
    for p in paths:
        load_checkpoint_file(p, mmap=True)
