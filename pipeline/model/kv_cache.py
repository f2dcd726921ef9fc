"""The decoding KV cache: per-layer keys/values of committed tokens, reorderable.

Owns: `KVCache` (storage, pending entries of the last forward, commit in any order, truncate,
row selection). Must not touch: attention math (`pipeline.model.attention`), the decoding
algorithms (`pipeline.inference.decoding`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.model.qwen3 import Qwen3


class KVCache:
    """Per-layer keys/values of committed tokens, with room to append reordered entries.

    Layout: `keys[l], values[l]: [B, H_kv/tp, capacity, D]`; row b holds `length[b]` valid
    entries at the front (entries past `length[b]` are masked out of attention). Keys are stored
    after RoPE, so an entry carries its own original position and entries may sit in any order.

    Protocol (plan-and-infill): a forward with `kv_cache=cache` attends over the committed
    entries plus the new tokens and leaves the new keys/values *pending* (`[B, H, T, D]` per
    layer), without committing them. Then `commit(index)` appends the chosen pending entries
    (e.g. finished slots, ahead of remaining masks) in the given order; `discard_pending()` drops
    them; a second forward replaces them. `truncate(length)` shortens rows.

    Attributes:
        length: LongTensor[B], valid entries per row.
        width: int, the number of leading cache columns a forward attends over
            (= max(length) after commit/truncate); an explicit `attention_mask` passed to
            `Qwen3.forward` must have `S = width + T` columns.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        """Allocate an empty cache.

        Args:
            num_kv_heads: key/value heads on this tensor-parallel rank (H_kv / tp).
            capacity: most entries a row can hold (tokens).
        """
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.width = 0
        self.capacity = capacity
        self.pending_keys: list[torch.Tensor | None] = [None] * num_layers
        self.pending_values: list[torch.Tensor | None] = [None] * num_layers

    @classmethod
    def for_model(cls, model: "Qwen3", batch_size: int, capacity: int) -> "KVCache":
        """A cache shaped for `model` on this TP rank, in the model's dtype and device."""
        p = next(model.parameters())
        return cls(model.cfg.num_layers, batch_size, model.cfg.num_key_value_heads // model.tp,
                   model.cfg.head_dim, capacity, p.dtype, p.device)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]

    @property
    def num_pending(self) -> int:
        """New tokens from the last forward that are neither committed nor discarded (T or 0)."""
        pk = self.pending_keys[0]
        return 0 if pk is None else pk.shape[2]

    def valid_mask(self) -> torch.Tensor:
        """BoolTensor[B, width]: which of the leading `width` columns hold a valid entry."""
        return torch.arange(self.width, device=self.length.device)[None] < self.length[:, None]

    def layer_view(self, layer: int):
        """`(past_k, past_v, store)` for `Attention.forward`; past_*: `[B, H, width, D]`."""
        def store(k, v):
            self.pending_keys[layer] = k
            self.pending_values[layer] = v
        return (self.keys[layer][:, :, :self.width], self.values[layer][:, :, :self.width],
                store)

    def commit(self, index: torch.Tensor | None = None) -> None:
        """Append pending entries to the cache, then drop the rest of the pending entries.

        Args:
            index: LongTensor[B, N] of pending positions (0..T-1) to append to each row, in
                this order; entries < 0 are skipped (rows may append different counts).
                None appends all T pending entries in fed order.
        Raises:
            RuntimeError: nothing pending. ValueError: a row would exceed `capacity`, or `index`
            has the wrong batch size or an entry >= T.
        """
        if self.pending_keys[0] is None:
            raise RuntimeError("KVCache.commit: no pending entries (run a forward first)")
        b, h, t, d = self.pending_keys[0].shape
        dev = self.length.device
        if index is None:
            index = torch.arange(t, device=dev)[None].expand(b, t)
        index = index.to(dev)
        if index.shape[0] != b or (index.numel() and int(index.max()) >= t):
            raise ValueError(f"KVCache.commit: index {tuple(index.shape)} must be [B={b}, N] "
                             f"with entries < {t} (the pending tokens)")
        valid = index >= 0
        counts = valid.sum(1)
        new_len = self.length + counts
        max_len = int(new_len.max()) if b else 0
        if max_len > self.capacity:
            raise ValueError(f"KVCache.commit: {max_len} entries exceed capacity "
                             f"{self.capacity}")
        # Destination column of each kept entry: after the row's valid entries, in index order.
        dest = self.length[:, None] + valid.cumsum(1) - 1                    # [B, N]
        rows = torch.arange(b, device=dev)[:, None].expand_as(index)
        src = index.clamp(min=0)
        rows, dest, src = rows[valid], dest[valid], src[valid]              # [K]
        for layer in range(len(self.keys)):
            for store, pend in ((self.keys, self.pending_keys),
                                (self.values, self.pending_values)):
                # store[layer][rows, :, dest] has shape [K, H, D]
                store[layer][rows, :, dest] = pend[layer][rows, :, src].to(store[layer].dtype)
        self.length = new_len
        self.width = max_len
        self.discard_pending()

    def truncate(self, length: torch.Tensor | int) -> None:
        """Keep only the first `length` entries of each row (LongTensor[B] or int); never grows."""
        if not torch.is_tensor(length):
            length = torch.full_like(self.length, int(length))
        self.length = torch.minimum(self.length, length.to(self.length.device))
        self.width = int(self.length.max()) if self.batch_size else 0

    def discard_pending(self) -> None:
        """Forget the keys/values of the last forward's new tokens."""
        n = len(self.keys)
        self.pending_keys = [None] * n
        self.pending_values = [None] * n

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) batch rows: `rows: LongTensor[B']` (e.g. drop finished requests)."""
        rows = rows.to(self.length.device)
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.length = self.length[rows]
        self.width = int(self.length.max()) if len(rows) else 0
        self.discard_pending()
