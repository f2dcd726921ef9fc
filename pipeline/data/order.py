"""The global sample order of a shard split: one-folder epochs cut into shuffle windows, and a
mixture's blend (`pipeline.data.mixture`). Read by `pipeline.data.rows`, which packs each window
into rows; owns no reading and no packing.

How the data is ordered and cut (computed from the manifest and, when packing, the lengths of
the samples of one window; it does not depend on dp_size, micro_batch_size or num_workers):
- Split samples are numbered 0..N-1 in manifest order (shard by shard).
- Epoch e: the N samples are cut into chunks of max(1, shuffle_buffer // 16) consecutive
  samples (never across shards), the chunks are put in an order drawn from (seed, e), and the
  resulting sequence is cut into windows of `shuffle_buffer` samples, each window in an order
  drawn from (seed, e, window). A window mixes ~16 chunks from anywhere in the split
  (data_prep keeps input order, so neighbouring samples are alike); reads stay sequential
  inside a chunk. `shuffle=False`: manifest order.
Mixtures (`build_loader` given `mixture.Source`s): the folders' shards are numbered one after
another; training reads the blend (`_BlendOrder`: window w is `shuffle_buffer` draws of
`pipeline.data.mixture.draw` from the blend state at its start, each source's samples in its own
one-folder order seeded by its name, each sample reorganized with its source's epoch), packed
like a one-folder window; the cursor is (phase, window, row) with the blend state of the window
(`_blend`); a one-pass loader reads the folders in turn. Batches carry each token's source.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pipeline.data import mixture
from pipeline.data.format import DataError
from pipeline.objective import ObjectiveConfig

_SALT_PIECES = 0x5EED01
_SALT_WINDOW = 0x5EED02
SALT_ROWS = 0x5EED03   # the row order of a best-fit window (`pipeline.data.rows`)


@dataclass(frozen=True)
class Folder:
    """One shard folder of the loader: `data.dir`, or a source of a mixture (picklable)."""
    name: str
    fs: object
    root: str
    weight: float = 1.0   # normalized token share (mixtures)


@dataclass(frozen=True)
class Spec:
    """Everything a worker needs (picklable). `shards` lists every folder's shards, folder by
    folder; `shard_folder[s]` is shard s's index into `folders`."""
    folders: tuple       # (Folder, ...)
    shard_folder: tuple  # per shard: its folder
    split: str
    shards: tuple        # ((name, samples), ...)
    seed: int
    dp_rank: int
    dp_size: int
    micro_batch_size: int
    max_length: int
    packing: str         # "none" | "next_fit" | "best_fit"
    window: int
    shuffle: bool
    infinite: bool
    mask_id: int
    pad_id: int
    vocab_limit: int
    objective: ObjectiveConfig
    shard_meta: tuple = ()   # per shard: (sha256 or None, bytes or None) from the manifest
    verify: str = "error"    # shard_io.VERIFY_MODES
    index_meta: tuple = ()   # per shard: its manifest "index" entry as (name, bytes, sha256)
    blend: bool = False      # a mixture's training order (pipeline.data.mixture), else folder order
    phase: int = 0           # data.phase (mixtures)

    def where(self, s: int) -> tuple:
        """(fs, path) of shard s."""
        f = self.folders[self.shard_folder[s]]
        return f.fs, f"{f.root}/{self.shards[s][0]}"



class Order:
    """The global order of the split's N samples in an epoch, window by window (see the
    module docstring). Memory: O(N / chunk) integers."""

    def __init__(self, spec: Spec):
        self.spec = spec
        counts = np.array([n for _, n in spec.shards], dtype=np.int64)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)])
        self.size = int(self.shard_first[-1])
        self.n_windows = -(-self.size // spec.window)
        C = max(1, spec.window // 16)
        starts, sizes = [], []
        for first, c in zip(self.shard_first[:-1], counts):
            s = np.arange(first, first + c, C)
            starts.append(s)
            sizes.append(np.minimum(C, first + c - s))
        self.chunk_start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.chunk_size = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        self._epoch, self._starts, self._pos = None, None, None

    def window(self, epoch: int, w: int) -> np.ndarray:
        """Global sample ids of window w of `epoch` in emission order, int64[<= window]."""
        spec, W = self.spec, self.spec.window
        pos = np.arange(w * W, min(self.size, (w + 1) * W), dtype=np.int64)
        if not spec.shuffle:
            return pos
        if self._epoch != epoch:
            rng = np.random.default_rng([spec.seed, epoch, _SALT_PIECES])
            perm = rng.permutation(len(self.chunk_start))
            self._starts = self.chunk_start[perm]
            self._pos = np.concatenate([[0], np.cumsum(self.chunk_size[perm])])
            self._epoch = epoch
        c = np.searchsorted(self._pos, pos, side="right") - 1
        ids = self._starts[c] + (pos - self._pos[c])
        rng = np.random.default_rng([spec.seed, epoch, w, _SALT_WINDOW])
        return ids[rng.permutation(len(ids))]


class BlendOrder:
    """A mixture's training order (`pipeline.data.mixture`): window w of phase `spec.phase` is
    `spec.window` draws of the blend, from the blend state at its start; the windows are
    walked in order from the one the loader started at (`start`: its index and state).
    Global sample ids are those of `Order` over all folders' shards."""

    def __init__(self, spec: Spec, start_window: int, start_state: mixture.BlendState):
        self.spec = spec
        counts = np.array([n for _, n in spec.shards], dtype=np.int64)
        self.shard_first = np.concatenate([[0], np.cumsum(counts)])
        self.size = int(self.shard_first[-1])
        self.n_windows = np.iinfo(np.int64).max   # the blend never ends
        self.weights = np.array([f.weight for f in spec.folders], dtype=np.float64)
        self.first, self.orders, self.samples = [], [], []
        for k, f in enumerate(spec.folders):
            mine = [s for s in range(len(spec.shards)) if spec.shard_folder[s] == k]
            self.first.append(int(self.shard_first[mine[0]]) if mine else 0)
            self.samples.append(sum(spec.shards[s][1] for s in mine))
            view = dataclasses.replace(spec, shards=tuple(spec.shards[s] for s in mine),
                                       seed=mixture.source_seed(spec.seed, f.name))
            self.orders.append(Order(view))
        self._cache: dict = {}   # source -> (epoch, window, ids)
        self.position: dict = {}  # item of the drawn window -> (source, position in the source)
        self.states = {start_window: start_state}   # window -> state at its start
        self.reader = None        # set by the reader's owner (lengths come from the indexes)

    def sample(self, src: int, p: int) -> tuple[int, int]:
        """(global id, source epoch) of position p of source `src`'s own sequence."""
        n = self.samples[src]
        e, q = divmod(p, n)
        W = self.spec.window
        key = (e, q // W)
        c = self._cache.get(src)
        if c is None or c[0] != key:
            c = self._cache[src] = (key, self.orders[src].window(e, q // W))
        return self.first[src] + int(c[1][q % W]), e

    def length(self, src: int, item: tuple[int, int]) -> int:
        """Tokens the sample feeds (its dual fed length in objective mode "dual")."""
        g, e = item
        n = self.reader.length(g)
        if n > self.spec.max_length:
            path, key = self.reader.read(g)[:2]
            raise DataError(f"shard {path}: sample {key} has {n} tokens > max_length "
                            f"{self.spec.max_length}")
        if self.spec.objective.mode == "dual":
            return self.reader.dual_length(g, e)
        return n

    def items(self, w: int):
        """Window w: ([(global id, source epoch), ...], [tokens, ...]); records the state at
        the start of window w + 1. Windows must be asked for in order."""
        if w not in self.states:
            raise RuntimeError(f"blend window {w} asked before window {w - 1}")
        out, end = mixture.draw(self.states[w], self.spec.window, self.weights,
                                self.sample, self.length)
        self.states = {w: self.states[w], w + 1: end}
        at = [int(v) for v in self.states[w].pos]
        self.walked = list(at)
        self.position = {}
        for s, it, _ in out:
            self.position[it] = (s, at[s])
            at[s] += 1
        return [it for _, it, _ in out], [L for _, _, L in out]

    def walk(self, row) -> None:
        """Count a row of the window drawn last as walked (consumed once its round is)."""
        for it in row:
            s, p = self.position[it]
            if p >= self.walked[s]:
                self.walked[s] = p + 1

    def window_states(self, w: int) -> list:
        """[the blend state at the start of window w (`BlendState.to_list()`), each source's
        position after its samples in the rows of window w walked so far (1 + the largest
        position among them, or its start position)]. Window w must be the one drawn last."""
        return [self.states[w].to_list(), list(self.walked)]
