"""The decoding KV cache: per-layer keys/values of committed tokens, written in place, reorderable.

Owns: `KVCache` (preallocated storage, where a forward's new keys/values are written, the
attention width a forward reads, commit in any order, truncate, row selection) and
`host_to_device` (the one way the cache and the decoding driver copy host data to the device).
Must not touch: attention masks and kernels (`pipeline.model.attention`), the decoding
algorithms (`pipeline.inference.decoding`).

Layout: row b holds its `length[b]` committed entries in columns `[0, length[b])`. A forward of
T new tokens writes their keys/values straight into the storage at columns
`[length[b], length[b] + T)` of each row (nothing is concatenated) and attends over the first
`columns` storage columns, a view. Committing the new tokens in fed order moves nothing (the
lengths grow); a reordered commit moves only the entries that change column. Host-side
bookkeeping (`width`, a mirror of `length`) is kept on the host, so no forward or commit has to
read a device value back.
"""
from __future__ import annotations

from functools import partial

import torch


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without stalling the host.

    On CUDA the tensor is staged in pinned memory (PyTorch's caching host allocator keeps the
    block until the copy has run) and copied asynchronously: a plain `.to("cuda")` of pageable
    memory synchronizes the stream, i.e. waits for all queued kernels. Elsewhere a plain copy
    (a no-op when `t` is already there).
    """
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class KVCache:
    """Per-layer keys/values of committed tokens, preallocated; new entries written in place.

    Storage: `keys[l], values[l]: [B, H_kv/tp, C, D]` with `C >= capacity` storage columns (the
    columns past the committed entries hold the pending entries of a forward; C grows if a
    forward needs more). Keys are stored after RoPE, so an entry carries its own original
    position and entries may sit in any order.

    Protocol (plan-and-infill): `Qwen3.forward(..., kv_cache=cache)` calls `begin(T)`, writes
    the T new keys/values of each layer at columns `[length[b], length[b] + T)` of row b and
    attends over the committed entries plus the new tokens; the new entries stay *pending*.
    Then `commit(index)` appends the chosen pending entries (e.g. finished slots, ahead of
    remaining masks) in the given order; `discard_pending()` drops them; a second forward
    replaces them. `truncate(length)` shortens rows.

    Attention width: a forward of T tokens reads the first `columns` storage columns,
    `width + T` rounded up to a multiple of `bucket` (so the attention kernel sees a new key
    length only every `bucket` tokens; the extra columns are masked out), or all C columns
    when `fixed_width` is set (a CUDA-graph step keeps every shape fixed).

    Attributes:
        length: LongTensor[B] on the cache's device, committed entries per row (updated in
            place, so a captured CUDA graph reads the current value).
        width: int, max(length) (host).
        capacity: int, most committed entries a row may hold (tokens); `commit` raises past it.
        bucket: int, attention-width granularity (columns); 1 = exactly `width + T`.
        fixed_width: bool, attend over every storage column (default False).
        version: int, bumped whenever the storage tensors are replaced (growth, `select_rows`).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", bucket: int = 1):
        """Allocate an empty cache.

        Args:
            num_kv_heads: key/value heads on this tensor-parallel rank (H_kv / tp).
            capacity: most committed entries a row can hold (tokens); the storage starts at
                `capacity` rounded up to `bucket` columns.
            bucket: attention-width granularity in columns (>= 1).
        Raises:
            ValueError: bucket < 1 or capacity < 0.
        """
        if bucket < 1 or capacity < 0:
            raise ValueError(f"KVCache: bucket must be >= 1 and capacity >= 0 (got {bucket}, "
                             f"{capacity})")
        self.capacity = capacity
        self.bucket = bucket
        self.fixed_width = False
        self.version = 0
        self.device = torch.device(device)
        cols = max(_round_up(capacity, bucket), bucket)
        shape = (batch_size, num_kv_heads, cols, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._host_length = torch.zeros(batch_size, dtype=torch.long)
        self.width = 0
        self._pending = 0
        self._write_rows = self._write_cols = None
        self._columns = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, capacity: int,
                  bucket: int | None = None) -> "KVCache":
        """A cache shaped for `model` (a `Qwen3`: its `cfg`, `tp` and parameters are read; this
        module does not import the model) on this TP rank, in the model's dtype and device.

        `bucket` defaults to 64 columns on CUDA (few distinct attention shapes, and a key length
        aligned for the memory-efficient kernel) and 1 elsewhere (the CPU reads exactly
        `width + T` columns).
        """
        p = next(model.parameters())
        if bucket is None:
            bucket = 64 if p.device.type == "cuda" else 1
        return cls(model.cfg.num_layers, batch_size, model.cfg.num_key_value_heads // model.tp,
                   model.cfg.head_dim, capacity, p.dtype, p.device, bucket=bucket)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]

    @property
    def storage_columns(self) -> int:
        """C, the number of storage columns per row (>= capacity)."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def num_pending(self) -> int:
        """New tokens from the last forward that are neither committed nor discarded (T or 0)."""
        return self._pending

    def valid_mask(self) -> torch.Tensor:
        """BoolTensor[B, width]: which of the leading `width` columns hold a committed entry."""
        return torch.arange(self.width, device=self.length.device)[None] < self.length[:, None]

    # ---------------------------------------------------------------------------------------
    # The forward's side (Qwen3.forward)

    def reserve(self, columns: int) -> None:
        """Grow the storage (by at least half, bumping `version`) so that it holds `columns`
        columns; a no-op when it already does."""
        have = self.storage_columns
        if columns <= have:
            return
        cols = _round_up(max(columns, have + have // 2), self.bucket)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[:2] + (cols,) + old.shape[3:])
                new[:, :, :self.width] = old[:, :, :self.width]
                store[i] = new
        self.version += 1

    def begin(self, t: int) -> int:
        """Prepare a forward of `t` new tokens per row; returns its attention width `columns`.

        Makes room for columns `[0, width + t)`, marks `t` entries pending (replacing any
        pending ones) and computes where each row's new entries go. Host arithmetic plus one
        small device op; no device value is read back.
        """
        need = self.width + t
        self.reserve(need)
        self._pending = t
        dev = self.length.device
        self._write_rows = torch.arange(self.batch_size, device=dev)[:, None]       # [B, 1]
        self._write_cols = self.length[:, None] + torch.arange(t, device=dev)[None]  # [B, T]
        self._columns = self.columns(t)
        return self._columns

    def columns(self, t: int) -> int:
        """Attention width (storage columns read) of a forward of `t` new tokens."""
        if self.fixed_width:
            return self.storage_columns
        return min(_round_up(self.width + t, self.bucket), self.storage_columns)

    def layer_view(self, layer: int):
        """The function `(k, v) -> (keys, values)` that `Attention.forward` calls for layer
        `layer` of the forward `begin` prepared: `write_and_read` at that forward's width."""
        return partial(self.write_and_read, layer, columns=self._columns)

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor, columns: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new keys/values in place; return what attention reads.

        Args:
            k, v: `[B, H_kv/tp, T, D]`, the new tokens' keys (after RoPE) and values, T as
                passed to `begin`.
            columns: the attention width `begin` returned.
        Returns:
            (keys, values): `[B, H_kv/tp, columns, D]` views of the storage; row b's new token
            j sits at column `length[b] + j`.
        """
        rows, cols = self._write_rows, self._write_cols
        # store[rows, :, cols] is [B, T, H, D]
        self.keys[layer][rows, :, cols] = k.transpose(1, 2).to(self.keys[layer].dtype)
        self.values[layer][rows, :, cols] = v.transpose(1, 2).to(self.values[layer].dtype)
        return self.keys[layer][:, :, :columns], self.values[layer][:, :, :columns]

    # ---------------------------------------------------------------------------------------
    # The caller's side

    def commit(self, index: torch.Tensor | None = None, *,
               on_device: torch.Tensor | None = None) -> None:
        """Append pending entries to the cache, then drop the rest of the pending entries.

        Args:
            index: LongTensor[B, N] of pending positions (0..T-1) to append to each row, in
                this order; entries < 0 are skipped (rows may append different counts).
                None appends all T pending entries in fed order. Best given on the host: the
                bookkeeping is done there (a device `index` is read back once).
            on_device: the same index already on the cache's device (saves a copy).
        Raises:
            RuntimeError: nothing pending. ValueError: a row would exceed `capacity`, or `index`
            has the wrong batch size or an entry >= T.
        """
        t = self._pending
        if not t:
            raise RuntimeError("KVCache.commit: no pending entries (run a forward first)")
        b = self.batch_size
        if index is None:
            counts = torch.full((b,), t, dtype=torch.long)
        else:
            host = index.cpu() if index.device.type != "cpu" else index
            if host.dim() != 2 or host.shape[0] != b or (host.numel() and int(host.max()) >= t):
                raise ValueError(f"KVCache.commit: index {tuple(host.shape)} must be [B={b}, N] "
                                 f"with entries < {t} (the pending tokens)")
            valid = host >= 0
            counts = valid.sum(1)
        new_len = self._host_length + counts
        if b and int(new_len.max()) > self.capacity:
            raise ValueError(f"KVCache.commit: {int(new_len.max())} entries exceed capacity "
                             f"{self.capacity}")
        if index is not None:
            # Entries land after the row's committed ones, in index order; only those whose
            # column changes are moved (a commit of a prefix in fed order moves nothing).
            dest = valid.cumsum(1) - 1
            move = valid & (host != dest)
            if bool(move.any()):
                r, j = move.nonzero(as_tuple=True)
                base = self._host_length[r]
                where = host_to_device(torch.stack((r, base + host[r, j], base + dest[r, j])),
                                       self.device)
                rows, src, dst = where[0], where[1], where[2]
                for store in (self.keys, self.values):
                    for layer in store:
                        layer[rows, :, dst] = layer[rows, :, src]   # right side gathered first
            dev_counts = ((on_device if on_device is not None
                           else host_to_device(host, self.device)) >= 0).sum(1)
            self.length.add_(dev_counts)
        else:
            self.length.add_(t)
        self._host_length = new_len
        self.width = int(new_len.max()) if b else 0
        self.discard_pending()

    def truncate(self, length: torch.Tensor | int) -> None:
        """Keep only the first `length` entries of each row (LongTensor[B] or int); never grows."""
        if not torch.is_tensor(length):
            length = torch.full_like(self._host_length, int(length))
        self._host_length = torch.minimum(self._host_length, length.cpu())
        self.length.copy_(host_to_device(self._host_length, self.device))
        self.width = int(self._host_length.max()) if self.batch_size else 0

    def discard_pending(self) -> None:
        """Forget the keys/values of the last forward's new tokens."""
        self._pending = 0
        self._write_rows = self._write_cols = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) batch rows: `rows: LongTensor[B']` (e.g. drop finished requests)."""
        host = rows.cpu()
        rows = host_to_device(host, self.device)
        for store in (self.keys, self.values):   # one layer at a time: at most one extra tensor
            for i, old in enumerate(store):
                store[i] = old[rows]
        self.length = self.length[rows]
        self._host_length = self._host_length[host]
        self.width = int(self._host_length.max()) if len(host) else 0
        self.version += 1
        self.discard_pending()
