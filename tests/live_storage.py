"""Test helper: peak bytes of the CPU tensor storages that ops create while a dispatch mode is
active (`LiveStorage`), used by the memory-plan tests to measure a step or a decode."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorage(TorchDispatchMode):
    """Bytes of the storages created by ops inside the mode and still alive: `live`, and the
    maximum it reached: `peak`."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}

    def _drop(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self._seen:
                    self._seen[key] = st.nbytes()
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._drop, key)
        return out
