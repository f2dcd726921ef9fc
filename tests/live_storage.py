"""Test helper: peak bytes of the CPU tensor storages that ops create while a dispatch mode is
active (`LiveStorage`), used by the memory-plan tests to measure a step or a decode."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorage(TorchDispatchMode):
    """Bytes of the storages created by ops inside the mode and still alive: `live`, and the
    maximum it reached: `peak`.

    An op that returns a view of a tensor made before the mode (e.g. `weight.t()` inside a
    linear layer) returns that tensor's storage; it is counted as new unless the tensor is in
    `exclude` (e.g. `model.parameters()`, whose storages then never count)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}
        self._old = {t.untyped_storage().data_ptr() for t in exclude}

    def _drop(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self._seen and key not in self._old:
                    self._seen[key] = st.nbytes()
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._drop, key)
        return out
