"""Shard reading, one global sample order per epoch, packing, data-parallel split, batching and
exact (also layout-changing) resumption.

Owns: reading the shard folder written by `data_prep/shard.py` (ARCHITECTURE.md "Shard
format", local path or fsspec URL), checking it against the model, the epoch order of the
split's samples, packing or padding them into rows, dealing rows to data-parallel ranks as
fixed-shape micro-batches reorganized by `pipeline.objective`, and the loader state.
Must not touch: the model, the loss, process groups (the caller passes dp_rank / dp_size).

How the data is ordered and cut (computed from the manifest and, when packing, the lengths of
the samples of one window; it does not depend on dp_size, micro_batch_size or num_workers):
- Split samples are numbered 0..N-1 in manifest order (shard by shard).
- Epoch e: the N samples are cut into chunks of max(1, shuffle_buffer // 16) consecutive
  samples (never across shards), the chunks are put in an order drawn from (seed, e), and the
  resulting sequence is cut into windows of `shuffle_buffer` samples, each window in an order
  drawn from (seed, e, window). A window mixes ~16 chunks from anywhere in the split
  (data_prep keeps input order, so neighbouring samples are alike); reads stay sequential
  inside a chunk. `shuffle=False`: manifest order.
- Rows: each window is laid into rows of `max_length` tokens, never across windows or epochs:
  one sample per row (padded), or packed (`packing`): `next_fit` fills rows in window order
  and starts a new row when the next sample does not fit; `best_fit` (best-fit decreasing)
  takes the window's samples longest first and puts each into the open row with the least
  room that still holds it (a new row if none does), then orders the rows by a draw from
  (seed, e, window). The epoch's global row list is the windows' rows in window order, and
  epochs follow each other.
- Dealing: the global row list is consumed in rounds of dp_size x micro_batch_size rows; in
  every round data-parallel rank d takes rows [d*B, (d+1)*B) of it as one micro-batch (TP
  ranks of a DP group build the same loader and get the same batches). Round k after the
  loader's start is produced by loader worker k % num_workers, and torch's DataLoader returns
  the workers' batches round-robin, so the batch sequence does not depend on num_workers.
  A one-pass loader (`infinite=False`) gives every rank a batch in every round that has any
  row left (all-padding rows fill the rest), so all ranks yield the same number of batches
  and every sample is in exactly one of them.
- Reading: each shard's sample index (`<shard>.idx`, `pipeline.data.sample_index`; one read
  of 44 bytes a sample when a process first needs the shard, never a walk of tar headers)
  gives each sample's byte range, read in one request, and its digest, checked on that read
  (`data.verify_shards`, `pipeline.data.shard_io`: per sample read, no whole-shard hash).
  Unpacked, a worker reads only the samples of its own rows. Packed, the rows depend on the
  lengths of the whole window, which every worker takes from the indexes (no read per
  sample), then it reads only the samples of its own rows. Objective mode "dual" packs by the
  fed length, clean tokens plus masked copies, which depends on each sample's slots and its
  (seed, key, epoch) draws: `objective.dual_fed_length` computes it from the slot layout a
  version-3 index holds (key hash, slot sizes), so there too a worker reads only its own rows'
  samples; for a shard whose index has no layouts (version 1 or 2) each worker reads and
  reorganizes every sample of the window (one note per process names `shard.py index`, which
  adds them). TP ranks of a DP rank each build the loader and read the same samples
  (ARCHITECTURE.md "Loader" says why they do not share them). A manifest whose shards have
  no index entry (a folder made before indexes) is
  refused at start-up in one line naming `python data_prep/shard.py index DIR`, which writes
  them: a DataError (exit 2) rather than a fallback to the tar walk, so no job silently pays
  ~45 us a sample per shard per worker at every start.
Mixtures (`build_loader` given `mixture.Source`s): the folders' shards are numbered one after
another; training reads the blend (`_BlendOrder`: window w is `shuffle_buffer` draws of
`pipeline.data.mixture.draw` from the blend state at its start, each source's samples in its own
one-folder order seeded by its name, each sample reorganized with its source's epoch), packed
like a one-folder window; the cursor is (phase, window, row) with the blend state of the window
(`_blend`); a one-pass loader reads the folders in turn. Batches carry each token's source.
Signals: loader workers ignore SIGTERM, SIGINT and SIGUSR1 (`_worker_init`). SLURM preemption /
scancel and a terminal's Ctrl-C signal every process of the job, workers included, and torch's
own worker handler would make a worker die, killing the trainer's next `next()` before it can
checkpoint; only the training process reacts, and it shuts its workers down. Workers still exit
via the DataLoader's sentinel (the iterator is closed, garbage-collected, or reaped by an
`atexit` hook that runs before multiprocessing's, which could otherwise wait forever for a worker
that ignores its SIGTERM), leftovers are SIGKILLed, and torch's parent-death watchdog ends a
worker within seconds when the training process is killed outright. The DataLoader gets its own
torch.Generator (seeded from the run seed), so starting workers never draws from the global
torch RNG (a resumed run's RNG stays equal to the uninterrupted run's).
State: the cursor (epoch, window, row within the window) of the first row not yet in a yielded
round, the batches yielded, consumed samples of this rank, and the settings it must be resumed
with (checked on load; the shard set by its fingerprint `data`). The cursor is the same on
every rank after the same number of batches and does not depend on the layout: a state saved
with one dp_size / micro_batch_size / num_workers continues on another (`allow_reshard=True`)
with every not yet consumed row of the epoch seen exactly once. Samples prefetched by workers
but not yielded are not consumed. `data_dir`, the folder it was read from, is informational
(for the message when the shards differ). Resuming reads the current window (and the sample
indexes of the shards it touches), never replays the epoch. A state whose shard set differs
(shards rebuilt with more input) is refused, unless the caller asks for a new pass
(`load_state_dict(..., on_shard_change="new_pass")`): then the loader starts the next epoch
from its beginning over the new set.
"""
from __future__ import annotations

import atexit
import bisect
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing
import signal
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data import mixture, sample_index, shard_io
from pipeline.data.format import DataError, check_tokenizer
from pipeline.data.shard_io import read_manifest
from pipeline.objective import ObjectiveConfig, collate, dual_fed_length, reorganize_sample

log = logging.getLogger("pipeline.data")

STATE_VERSION = 2
_SALT_PIECES = 0x5EED01
_SALT_WINDOW = 0x5EED02
_SALT_ROWS = 0x5EED03


@dataclass(frozen=True)
class _Folder:
    """One shard folder of the loader: `data.dir`, or a source of a mixture (picklable)."""
    name: str
    fs: object
    root: str
    weight: float = 1.0   # normalized token share (mixtures)


@dataclass(frozen=True)
class _Spec:
    """Everything a worker needs (picklable). `shards` lists every folder's shards, folder by
    folder; `shard_folder[s]` is shard s's index into `folders`."""
    folders: tuple       # (_Folder, ...)
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


PACKINGS = ("next_fit", "best_fit")


def _digest(obj) -> str:
    """16 hex digits of the sha256 of `obj` as sorted-key JSON (shard set and tokenizer
    fingerprints of the loader state)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _open_shard(fs, path: str):
    """Open one shard for binary, seekable reading: the only place shards are opened (a hook
    for verification or remote-filesystem error handling wraps this function).

    Without a read cache (`cache_type="none"`): each `read` is one request for exactly the
    sample's byte range. fsspec's remote files otherwise read ahead (s3fs: 50 MB past a read,
    fsspec's http: 5 MB), which in the loader's shuffled order fetched up to the rest of the
    shard at every jump: one epoch of 10,000 samples in 10 shards took 72x the shards' bytes
    from an S3 server (`bench/bench_s3_bytes.py`). Local and in-memory files ignore it."""
    return fs.open(path, "rb", cache_type="none")


class _Order:
    """The global order of the split's N samples in an epoch, window by window (see the
    module docstring). Memory: O(N / chunk) integers."""

    def __init__(self, spec: _Spec):
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


class _BlendOrder:
    """A mixture's training order (`pipeline.data.mixture`): window w of phase `spec.phase` is
    `spec.window` draws of the blend, from the blend state at its start; the windows are
    walked in order from the one the loader started at (`start`: its index and state).
    Global sample ids are those of `_Order` over all folders' shards."""

    def __init__(self, spec: _Spec, start_window: int, start_state: mixture.BlendState):
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
            self.orders.append(_Order(view))
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


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: indices into `lengths` grouped into rows of at most
    `capacity` tokens.

    Items are taken longest first (ties: lower index first); each goes into the open row with
    the least room that still holds it, or starts a new row. Rows are returned in creation
    order, each row's items in insertion order. Deterministic. Cost O(n log n).

    Why not a library packer: TRL's `pack_dataset(strategy="bfd")` and NeMo's
    first-fit-decreasing pack a whole (Arrow / in-memory) dataset offline; our loader packs
    one shuffle window at a time while streaming and must be resumable at any row, so it
    needs the rows of one window as a pure function of that window, which is these few lines.

    Args:
        lengths: sequence of int (tokens per item), each <= capacity.
        capacity: tokens per row.

    Raises:
        ValueError: an item longer than `capacity`.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []   # sorted (free tokens, row index) of rows with room
    for i in order:
        L = int(lengths[i])
        if L > capacity:
            raise ValueError(f"item {i} has {L} tokens > row capacity {capacity}")
        j = bisect.bisect_left(room, (L, -1))
        if j < len(room):
            free, r = room.pop(j)
        else:
            free, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if free - L > 0:
            bisect.insort(room, (free - L, r))
    return rows


def next_fit(lengths, capacity: int) -> list[list[int]]:
    """Next-fit packing in the given order: a row is closed when the next item does not fit.
    Same contract as `best_fit_decreasing`."""
    rows: list[list[int]] = []
    used = capacity + 1
    for i, L in enumerate(lengths):
        L = int(L)
        if L > capacity:
            raise ValueError(f"item {i} has {L} tokens > row capacity {capacity}")
        if used + L > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += L
    return rows


class _Reader:
    """Random access to samples by global id: each shard's sample index
    (`pipeline.data.sample_index`, read when the shard is first needed) gives every sample's
    byte range, read in one request from an open-file cache; no tar header is parsed but the
    one inside a sample's range that names its key."""

    def __init__(self, spec: _Spec, order: _Order):
        self.spec, self.order = spec, order
        self._indexes: dict[int, np.ndarray] = {}
        self._layouts: dict[int, object] = {}    # shard -> SlotLayout, or None (before version 3)
        self._files: dict[int, object] = {}
        self._first = None

    def _index(self, gid: int):
        """(shard, shard path, index records, sample within the shard) of global sample gid."""
        spec = self.spec
        s = self.shard_of(gid)
        fs, path = spec.where(s)
        if s not in self._indexes:
            sha, size = spec.shard_meta[s] if spec.shard_meta else (None, None)
            idx, self._layouts[s] = self._read_index(s)
            if sample_index.version_of(idx) == sample_index.VERSION_2:
                # per-sample digests: the size now (one stat), each sample when it is read
                shard_io.check_shard_size(fs, path, size, spec.verify, zip(
                    (n for n, _ in spec.shards), (m[1] for m in spec.shard_meta)))
            else:  # a version-1 index: the whole shard, once per process
                shard_io.verify_shard(fs, path, sha, spec.verify, size,
                                      zip((n for n, _ in spec.shards), (m[0] for m in spec.shard_meta)))
            self._indexes[s] = idx
        return s, path, self._indexes[s], gid - int(self.order.shard_first[s])

    def _read_index(self, s: int, mode: str | None = None):
        """(records, slot layout or None) of shard s's checked sample index
        (`shard_io.read_sample_index`)."""
        spec = self.spec
        sha, size = spec.shard_meta[s] if spec.shard_meta else (None, None)
        name, nbytes, digest = spec.index_meta[s]
        entry = {"name": spec.shards[s][0], "samples": spec.shards[s][1], "bytes": size,
                 "index": {"name": name, "bytes": nbytes, "sha256": digest}}
        folder = spec.folders[spec.shard_folder[s]]
        return shard_io.read_sample_index(folder.fs, folder.root, entry, mode or spec.verify,
                                          with_layout=True)

    def _swapped_with(self, s: int, i: int, f) -> str | None:
        """The name of another shard of the split whose sample i is what shard s's file holds
        at that sample's range (its index's range and digest), else None. Read on a digest
        mismatch only: the indexes of the other shards of the same size (at most 64) and one
        sample range of open file `f` for each."""
        spec = self.spec
        size = spec.shard_meta[s][1] if spec.shard_meta else None
        tried = 0
        for t, (name, _) in enumerate(spec.shards):
            if t == s or spec.shard_folder[t] != spec.shard_folder[s] or (
                    size is not None and spec.shard_meta[t][1] != size):
                continue
            tried += 1
            if tried > 64:
                break
            try:
                idx = self._indexes.get(t)
                if idx is None:
                    idx = self._read_index(t, mode="off")[0]
                if i >= len(idx) or sample_index.version_of(idx) != sample_index.VERSION_2:
                    continue
                a, b = int(idx["start"][i]), int(sample_index.sample_end(idx[i:i + 1])[0])
                f.seek(a)
                if sample_index.sample_digest(f.read(b - a)) == int(idx["digest"][i]):
                    return name
            except (DataError, OSError, ValueError):
                continue
        return None

    def length(self, gid: int) -> int:
        """Tokens of global sample `gid`, from its shard's sample index (no read of the sample)."""
        _, _, idx, i = self._index(gid)
        return int(idx["num_tokens"][i])

    def folder(self, gid: int) -> int:
        """The folder (mixture source) of global sample `gid`."""
        return self.spec.shard_folder[self.shard_of(gid)]

    def shard_of(self, gid: int) -> int:
        """The shard (index into `spec.shards`) of global sample `gid`."""
        if self._first is None:   # a list: bisect on it is ~20x faster than numpy per call
            self._first = [int(v) for v in self.order.shard_first]
        return bisect.bisect_right(self._first, gid) - 1

    def dual_length(self, gid: int, epoch: int) -> int | None:
        """The fed length in objective mode "dual" of global sample `gid` in `epoch`, from its
        shard's slot layout (`objective.dual_fed_length`; no read of the sample), or None when
        its index has no layouts (before version 3)."""
        s, _, idx, i = self._index(gid)
        layout = self._layouts[s]
        if layout is None:
            return None
        h, size, seg = layout.sample(i)
        spec = self.spec
        return dual_fed_length(int(idx["num_tokens"][i]), h, size, seg, seed=spec.seed,
                               epoch=epoch, cfg=spec.objective, max_length=spec.max_length)

    def read(self, gid: int):
        """(shard path, key, tokens: int ndarray[L], segments) of global sample `gid`: one read
        of the sample's byte range `[start, end)` (its member headers and data)."""
        s, path, idx, i = self._index(gid)
        spec = self.spec
        rec = idx[i]
        start = int(rec["start"])
        end = int(sample_index.sample_end(idx[i:i + 1])[0])
        key, keyed = f"#{i}", False
        try:
            f = self._files.get(s)
            if f is None:
                if len(self._files) >= 8:
                    old = next(iter(self._files))
                    self._files.pop(old).close()
                f = self._files[s] = _open_shard(spec.where(s)[0], path)
            f.seek(start)
            raw = f.read(end - start)
            if len(raw) != end - start:
                raise EOFError(f"short read: {len(raw)} of {end - start} bytes at offset {start}")
            jo, to = int(rec["json_offset"]) - start, int(rec["tokens_offset"]) - start
            if self.spec.verify != "off" and "digest" in idx.dtype.names:
                # the bytes against their digest first: a damage is named as such, not as an
                # undecodable header or array
                try:
                    key, keyed = sample_index.key_from_header(raw[jo - 512:jo]), True
                except (ValueError, UnicodeDecodeError):
                    pass
                shard_io.check_sample(spec.where(s)[0], path, i, key, raw, int(rec["digest"]),
                                      self.spec.verify, self.spec.index_meta[s][0],
                                      lambda: self._swapped_with(s, i, f))
            if not keyed:
                key = sample_index.key_from_header(raw[jo - 512:jo])
            tokens = np.load(io.BytesIO(raw[to:to + int(rec["tokens_size"])]), allow_pickle=False)
            meta = json.loads(raw[jo:jo + int(rec["json_size"])].decode("utf-8"))
        except FileNotFoundError:
            raise DataError(f"shard {path}: missing") from None
        except DataError:  # a digest mismatch (shard_io.check_sample): its own message
            raise
        except (ValueError, OSError, EOFError, UnicodeDecodeError) as e:
            size = self.spec.shard_meta[s][1] if self.spec.shard_meta else None
            h = shard_io.damage_hint(spec.where(s)[0], path, size)
            raise DataError(shard_io.no_range_message(path, e) or f"shard {path}: sample {key} is "
                            f"undecodable ({e}){'; ' + h if h else ''}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or not isinstance(meta, dict) \
                or "segments" not in meta:
            raise DataError(f"shard {path}: sample {key}: tokens.npy must be a 1-D integer array "
                            f"and json must have segments")
        if tokens.shape[0] != int(rec["num_tokens"]):
            raise DataError(f"shard {path}: sample {key} has {tokens.shape[0]} tokens, its sample "
                            f"index says {int(rec['num_tokens'])} (index of another shard version?)")
        return path, key, tokens, meta["segments"]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _window_rows(spec: _Spec, order, reader: _Reader, epoch: int, w: int):
    """Rows of window w: (list of rows, each a list of (global id, epoch) items; {item: read
    sample} of samples already read; {item: planned fed length} in objective mode "dual").
    Packing takes the lengths from the shards' sample indexes, and each worker reads only its
    own rows' samples; in mode "dual" it packs by the fed length, clean tokens + masked copies,
    computed from the index's slot layouts (version 3), or, for a shard whose index has none,
    from the sample read and reorganized here (every such sample of the window, in every
    worker). A mixture's window (`_BlendOrder`) comes with its items' source epochs and fed
    lengths."""
    if spec.blend:
        items, lengths = order.items(w)
    else:
        items = [(int(i), epoch) for i in order.window(epoch, w)]
        lengths = None
    if spec.packing == "none":
        return [[it] for it in items], {}, {}
    if lengths is None:   # (a blend window's lengths were checked as it was drawn)
        lengths = [reader.length(g) for g, _ in items]  # from the sample indexes: no sample read
        for (g, _), L in zip(items, lengths):
            if L > spec.max_length:
                path, key = reader.read(g)[:2]
                raise DataError(f"shard {path}: sample {key} has {L} tokens > max_length "
                                f"{spec.max_length}")
    loaded, planned = {}, {}
    if spec.objective.mode == "dual":
        # the fed length (clean tokens + masked copies) depends on the sample's slots and draws
        for n, it in enumerate(items):
            fed = reader.dual_length(*it)
            if fed is None:  # an index without slot layouts: read the sample
                loaded[it] = reader.read(it[0])
                fed = _reorganize(spec, loaded[it], it[1]).length
            else:
                planned[it] = fed
            lengths[n] = fed
    if spec.packing == "next_fit":
        rows = next_fit(lengths, spec.max_length)
    else:
        rows = best_fit_decreasing(lengths, spec.max_length)
        if spec.shuffle:  # BFD creates rows longest-first: do not feed them in that trend
            rng = np.random.default_rng([spec.seed, epoch, w, _SALT_ROWS])
            rows = [rows[int(r)] for r in rng.permutation(len(rows))]
    return [[items[i] for i in row] for row in rows], loaded, planned


def _reorganize(spec: _Spec, item, epoch: int):
    path, key, tokens, segments = item
    L = int(tokens.shape[0])
    if L > spec.max_length:
        raise DataError(f"shard {path}: sample {key} has {L} tokens > max_length {spec.max_length}")
    if L and int(tokens.max()) >= spec.vocab_limit:
        raise DataError(f"shard {path}: sample {key} has token id {int(tokens.max())} >= "
                        f"tokenizer.vocab_size {spec.vocab_limit}")
    try:
        return reorganize_sample(tokens, segments, key, seed=spec.seed, epoch=epoch,
                                 mask_id=spec.mask_id, cfg=spec.objective,
                                 max_length=spec.max_length)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"shard {path}: bad segments in sample {key} ({e})") from None


def _rounds(spec: _Spec, cursor: tuple, worker: int, num_workers: int,
            blend_start: list | None = None):
    """The walk of the global row list from `cursor` = (epoch, window, row) (a mixture's:
    (phase, window, row), with `blend_start`, the blend state at that window's start): for
    rounds k = worker, worker + num_workers, ..., yields (the cursor after round k, for a
    mixture the blend states of the cursor's window (`_BlendOrder.window_states`) else None,
    this DP rank's rows of the round as [(items, loaded, planned), ...] (`_window_rows`), the
    reader). No sample is read but those `_window_rows` reads."""
    epoch, w, r = (int(v) for v in cursor)
    if spec.blend:
        state = (mixture.BlendState.from_list(blend_start, len(spec.folders)) if blend_start
                 else mixture.BlendState.zeros(len(spec.folders)))
        order = _BlendOrder(spec, w, state)
    else:
        order = _Order(spec)
    reader = _Reader(spec, order)
    order.reader = reader
    B, R, d = spec.micro_batch_size, spec.micro_batch_size * spec.dp_size, spec.dp_rank
    j = 0          # rows walked since the cursor
    mine: list = []

    def out(pos):
        return pos, order.window_states(pos[1]) if spec.blend else None, mine, reader

    try:
        while order.size:
            if w >= order.n_windows:
                if not spec.infinite:
                    break
                epoch, w, r = epoch + 1, 0, 0
            rows, loaded, planned = _window_rows(spec, order, reader, epoch, w)
            if spec.blend:   # rows consumed before the cursor count as walked
                for row in rows[:r]:
                    order.walk(row)
            for ri in range(r, len(rows)):
                if spec.blend:
                    order.walk(rows[ri])
                k, slot = divmod(j, R)
                if k % num_workers == worker and slot // B == d:
                    mine.append((rows[ri], loaded, planned))
                j += 1
                if j % R == 0:
                    if k % num_workers == worker:
                        yield out((epoch, w, ri + 1))
                    mine = []
            w, r = w + 1, 0
        if j % R and (j // R) % num_workers == worker:  # one pass: the last, partial round
            yield out((epoch, w, 0))
    finally:
        reader.close()


def _rank_batches(spec: _Spec, cursor: tuple, worker: int, num_workers: int,
                  blend_start: list | None = None) -> Iterator[dict]:
    """Micro-batches of this DP rank for the rounds of `_rounds`; each carries `_pos`, the
    cursor after its round, and for a mixture `_blend`, its blend states."""
    for pos, blend, mine, reader in _rounds(spec, cursor, worker, num_workers, blend_start):
        rows, sources = [], []
        for row, loaded, planned in mine:
            rows.append([_reorganize(spec, loaded.get(it) or reader.read(it[0]), it[1]) for it in row])
            sources.append([reader.folder(g) for g, _ in row])
            for it, r in zip(row, rows[-1]):
                if it in planned and planned[it] != r.length:
                    raise DataError(f"shard {reader._index(it[0])[1]}: sample {r.key}: its sample "
                                    f"index's slot layout gives {planned[it]} fed tokens, the "
                                    f"sample {r.length} (index of another shard version?)")
        B = spec.micro_batch_size
        rows += [[] for _ in range(B - len(rows))]
        sources += [[] for _ in range(B - len(sources))]
        out = collate(rows, spec.max_length, spec.pad_id, sources=sources)
        out["_pos"] = pos
        if blend is not None:
            out["_blend"] = blend
        yield out


def _worker_init(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: ignore SIGTERM, SIGINT and SIGUSR1 in a loader worker.

    It runs after torch's worker signal set-up, so it replaces torch's SIGTERM handler (which
    exits unless the parent sent the signal). See the module docstring, "Signals"."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


_LIVE_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _stop_workers(it) -> None:
    """Shut a multi-process DataLoader iterator's workers down (sentinel, join), then SIGKILL
    any that are still alive (they ignore SIGTERM, torch's fallback)."""
    try:
        it._shutdown_workers()
    finally:
        for w in getattr(it, "_workers", []):
            if w.is_alive():
                w.kill()
                w.join(timeout=5)


def _stop_all_workers() -> None:
    for it in list(_LIVE_ITERATORS):
        _stop_workers(it)


class _RankDataset(IterableDataset):
    def __init__(self, spec: _Spec, cursor: tuple, num_workers: int, blend_start: list | None):
        self.spec, self.cursor, self.num_workers = spec, cursor, num_workers
        self.blend_start = blend_start

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info is not None else 0
        spec = self.spec
        if info is not None:  # a forked worker: an async filesystem (http, s3) needs its own instance
            spec = dataclasses.replace(spec, folders=tuple(
                dataclasses.replace(f, fs=shard_io.fs_for_this_process(f.fs)) for f in spec.folders))
        return _rank_batches(spec, self.cursor, wid, max(1, self.num_workers), self.blend_start)


# Settings that define the global row list: a state only continues under the same ones.
_ORDER_KEYS = ("split", "seed", "max_length", "packing", "shuffle_buffer", "shuffle", "objective",
               "data")
# What a state may meet when its shard set (`data`) changed (`load_state_dict`'s
# `on_shard_change`): "refuse" (one-line DataError) or "new_pass" (a new epoch over the new set).
SHARD_CHANGE_POLICIES = ("refuse", "new_pass")
# Settings of the layout: the same on a plain resume; another one only with allow_reshard.
_LAYOUT_KEYS = ("dp_size", "dp_rank", "micro_batch_size")


class ShardLoader:
    """Iterable of micro-batches for one data-parallel rank, with exact resumption.

    Build it with `build_loader`. Iterating yields `objective.collate` dicts
    (`LongTensor[B, T]` etc., see ARCHITECTURE.md "Batch"). Breaking out of the loop and
    iterating again continues where the last yielded batch left off (prefetched batches are
    not consumed).

    Attributes:
        manifest: the folder's manifest. mask_id / pad_id: from it.
        samples_per_epoch: shard samples per epoch of the split (all ranks together).
        consumed_samples: shard samples in the batches this rank yielded.
        batches: micro-batches yielded so far (equal on every rank: one per round).
        cursor: (epoch, window, row) of the first row not in a yielded round (same on every
            rank); a mixture's training loader: (phase, window, row) of its blend.
        sources: per folder (the one of `data.dir`, or each source of a mixture, in order):
            {"name", "weight" (normalized), "dir", "max_epochs", "samples", "tokens" (of the
            split, from the manifest), "data" (the folder's shard-set fingerprint)}.
        source_names, source_weights: tuples from `sources` (a batch's `source` indexes them).
    """

    def __init__(self, spec: _Spec, manifest: dict, fingerprint: str, num_workers: int,
                 prefetch_factor: int, data_dir: str | None = None, sources: list | None = None):
        self.spec, self.manifest, self.fingerprint = spec, manifest, fingerprint
        self.sources = sources or []
        self.source_names = tuple(m["name"] for m in self.sources)
        self.source_weights = tuple(m["weight"] for m in self.sources)
        self.blend_window = None   # mixture: `_BlendOrder.window_states` of the cursor's window
        self.tokenizer_fingerprint = _digest(manifest["tokenizer"])
        self.data_dir = data_dir
        self.dp_rank, self.dp_size, self.num_workers = spec.dp_rank, spec.dp_size, num_workers
        self.prefetch_factor = prefetch_factor
        self.mask_id, self.pad_id = spec.mask_id, spec.pad_id
        self.samples_per_epoch = sum(n for _, n in spec.shards)
        self.cursor = (0, 0, 0)
        self.batches = 0
        self.consumed_samples = 0

    @property
    def epoch(self) -> int:
        """The epoch of the next row (0-based)."""
        return self.cursor[0]

    def __iter__(self) -> Iterator[dict]:
        ds = _RankDataset(self.spec, tuple(self.cursor), self.num_workers,
                          self.blend_window[0] if self.blend_window else None)
        if self.num_workers > 0:
            # fork: workers start in milliseconds and inherit in-memory fsspec stores; the
            # workers never touch CUDA. Elsewhere (no fork) the platform default is used.
            ctx = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            # Own generator: the iterator's base seed must not be drawn from the global torch RNG
            # (a resumed run would be one draw ahead). Workers use no torch randomness.
            gen = torch.Generator().manual_seed(self.spec.seed)
            it = iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                 prefetch_factor=self.prefetch_factor, persistent_workers=False,
                                 multiprocessing_context=ctx, worker_init_fn=_worker_init,
                                 generator=gen))
            global _ATEXIT_REGISTERED
            if not _ATEXIT_REGISTERED:  # registered after torch's/multiprocessing's: runs first
                atexit.register(_stop_all_workers)
                _ATEXIT_REGISTERED = True
            _LIVE_ITERATORS.add(it)
        else:
            it = iter(ds)
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                except DataError as e:  # a worker's error arrives with its traceback: keep one line
                    lines = [ln for ln in str(e).splitlines() if ln.strip()]
                    msg = lines[-1].split("DataError: ", 1)[-1] if lines else str(e)
                    raise DataError(msg) from None
                self.cursor = tuple(int(v) for v in batch.pop("_pos"))
                if "_blend" in batch:
                    self.blend_window = batch.pop("_blend")
                self.batches += 1
                self.consumed_samples += len(batch["keys"])
                yield batch
        finally:
            if self.num_workers > 0:
                _LIVE_ITERATORS.discard(it)
                _stop_workers(it)

    def plan(self, batches: int, keys: bool = True) -> Iterator[list[list[tuple[str, str]]]]:
        """The next `batches` micro-batches of this rank without building them: per
        micro-batch, its rows as [(source name, sample key), ...] (`keys=False`: the global
        sample id as a string instead of the key, and no sample is read). Advances the cursor
        as iterating would (`pipeline.data.batches`: what step N fed)."""
        it = _rounds(self.spec, tuple(self.cursor), 0, 1,
                     self.blend_window[0] if self.blend_window else None)
        try:
            for _ in range(batches):
                try:
                    pos, blend, mine, reader = next(it)
                except StopIteration:
                    return
                rows = [[(self.source_names[reader.folder(g)],
                          reader.read(g)[1] if keys else str(g)) for g, _ in row]
                        for row, _, _ in mine]
                self.cursor, self.batches = pos, self.batches + 1
                self.consumed_samples += sum(len(r) for r in rows)
                if blend is not None:
                    self.blend_window = blend
                yield rows
        finally:
            it.close()

    def _config(self) -> dict:
        s = self.spec
        return {"split": s.split, "seed": s.seed, "dp_size": s.dp_size, "dp_rank": s.dp_rank,
                "num_workers": self.num_workers, "micro_batch_size": s.micro_batch_size,
                "max_length": s.max_length, "packing": s.packing, "shuffle_buffer": s.window,
                "shuffle": s.shuffle, "objective": dict(vars(s.objective)), "data": self.fingerprint,
                "tokenizer": self.tokenizer_fingerprint}

    def state_dict(self) -> dict:
        """JSON-able state after the last yielded batch. Its `cursor` is the same on every rank
        after the same number of batches (any rank's state continues any layout); `batches`
        and `consumed_samples` are this rank's counters."""
        state = {"version": STATE_VERSION, "config": self._config(), "cursor": list(self.cursor),
                 "batches": self.batches, "consumed_samples": self.consumed_samples,
                 "data_dir": self.data_dir}
        if self.spec.blend:
            n = len(self.sources)
            state["mix"] = self._mix()
            state["window"] = self.blend_window or [mixture.BlendState.zeros(n).to_list(), [0] * n]
        return state

    def _mix(self) -> dict:
        return {"phase": self.spec.phase,
                "sources": [{"name": m["name"], "weight": m["weight"], "data": m["data"]}
                            for m in self.sources]}

    @property
    def source_epochs(self) -> dict[str, int]:
        """A mixture's training loader: each source's epoch at the cursor's window start (the
        passes it began; 0 in the first); other loaders: {name: epoch}."""
        if not self.spec.blend:
            return {self.source_names[0]: self.epoch} if self.source_names else {}
        n = len(self.sources)
        st = mixture.BlendState.from_list(self.blend_window[0], n) if self.blend_window \
            else mixture.BlendState.zeros(n)
        return {m["name"]: int(st.pos[k]) // max(1, m["samples"]) for k, m in enumerate(self.sources)}

    def load_state_dict(self, state: dict, allow_reshard: bool = False,
                        on_shard_change: str = "refuse") -> dict | None:
        """Continue after the batch the state was taken at.

        On the same layout (dp_size, dp_rank, micro_batch_size) the batches are bit-identical
        to an uninterrupted run's; num_workers may differ (it does not change the batches).
        With `allow_reshard=True` the layout may differ too: the global row list continues at
        the saved cursor, dealt to the new ranks, so every row of the epoch not yet consumed is
        seen exactly once (the cursor must come from a point where every old rank yielded the
        same number of batches, as at a training checkpoint).

        A state of another shard set (its `data` fingerprint: the split's shard list with names,
        sample and token counts, sizes and sha256, plus the tokenizer) is refused by default.
        With `on_shard_change="new_pass"` it continues on this loader's set instead: the loader
        starts a new pass at the first epoch the saved cursor had not begun (the saved epoch
        + 1, or the saved epoch when the cursor was at its start), row 0, in the order that
        epoch has over the new set; the rest of the saved pass over the old set is not read.
        The counters (`batches`, `consumed_samples`) go on. The tokenizer must be the same
        (a state saved before the tokenizer was recorded is taken on trust, with a warning).

        Args:
            state: from `state_dict()` (any rank's, when resharding).
            allow_reshard: accept another data-parallel size / rank / micro-batch size.
            on_shard_change: "refuse" (default) or "new_pass" (see above).

        Returns:
            None; after a new data phase: {"phase", "from_phase", "positions": {source name:
            samples drawn from it before}}; or when the shard set changed and a new pass began: {"from": saved
            fingerprint, "from_dir": the folder it was saved from (or None), "to": this
            loader's fingerprint, "epoch": the new pass's epoch, "samples_per_epoch": samples of
            the new set}.

        A mixture (or a state of one) follows `data.phase` instead of `on_shard_change`
        (`pipeline.data.mixture`): the same phase continues only with the same sources,
        weights and shard sets; a higher phase starts a new data phase.

        Raises:
            DataError: a state of another version, seed, row length, packing, shuffle
                settings, objective, shard set (unless `on_shard_change="new_pass"`) or
                tokenizer, or (without allow_reshard) another layout; an unknown
                `on_shard_change`; a mixture changed without a higher phase, or a lower
                phase. The message names the field.
        """
        if on_shard_change not in SHARD_CHANGE_POLICIES:
            raise DataError(f"on_shard_change {on_shard_change!r} is not one of "
                            f"{', '.join(SHARD_CHANGE_POLICIES)}")
        if state.get("version") != STATE_VERSION:
            raise DataError(f"loader state: version {state.get('version')!r} is not {STATE_VERSION} "
                            f"(states of the per-stream order before version 2 cannot continue the "
                            f"global order; restart the data stream or use the older release)")
        saved, now = state["config"], self._config()
        if not allow_reshard:
            if saved["dp_size"] != now["dp_size"]:
                raise DataError(f"loader state: saved with data-parallel size {saved['dp_size']}, this "
                                f"run has {now['dp_size']}; changing the DP size on resume needs "
                                f"allow_reshard (checkpoint.reshard: true)")
            keys = _ORDER_KEYS + _LAYOUT_KEYS
        else:
            keys = _ORDER_KEYS
        new_pass = on_shard_change == "new_pass" and saved.get("data") != now["data"]
        saved_phase = int((state.get("mix") or {}).get("phase", state.get("phase", 0)))
        phase_up = self.spec.phase > saved_phase
        if self.spec.blend or "mix" in state:   # a mixture on either side: data.phase rules
            why = mixture.phase_change(state.get("mix"), self._mix()) if self.spec.blend else (
                "the checkpoint trained on a mixture (data.sources)")
            if why is not None and not phase_up:
                raise DataError(f"loader state: the data changed since the checkpoint ({why}); "
                                f"set data.phase above {saved_phase} to start a new data phase, or "
                                f"resume with the saved data settings")
            keys = tuple(k for k in keys if k != "data")
            new_pass = False
        else:
            phase_up = False
        if new_pass:
            keys = tuple(k for k in keys if k != "data")
            if "tokenizer" not in saved:
                log.warning("loader state: saved before the tokenizer was recorded; starting a new "
                            "pass over the shards of %s assuming they use the same tokenizer",
                            self.data_dir)
            elif saved["tokenizer"] != now["tokenizer"]:
                raise DataError(f"loader state: the shards of {self.data_dir} were made with another "
                                f"tokenizer than those the run trained on (tokenizer was "
                                f"{saved['tokenizer']!r}, is {now['tokenizer']!r}); a new pass "
                                f"(on_shard_change=new_pass) needs shards of the same tokenizer")
        if isinstance(saved.get("objective"), dict):
            # an objective option added after the state was saved is at its default there
            # (new options default to the behaviour before them)
            saved = {**saved, "objective": {**vars(ObjectiveConfig()), **saved["objective"]}}
        for k in keys:  # (the tokenizer is part of `data`; compared alone for a new pass only)
            if saved.get(k) != now[k]:
                if k == "objective" and isinstance(saved.get(k), dict):  # name the options only
                    old, new = saved[k], now[k]
                    diff = ", ".join(f"objective.{o} {old.get(o)!r} -> {new.get(o)!r}"
                                     for o in sorted(set(old) | set(new)) if old.get(o) != new.get(o))
                    raise DataError(f"loader state: the objective changed since the checkpoint "
                                    f"({diff}); resume with the same data settings")
                where = ""
                if k == "data":  # the shard set: name the folders (states before data_dir: unknown)
                    where = (f" (shards of {state.get('data_dir') or 'an unrecorded folder'} when "
                             f"saved, of {self.data_dir} now)")
                raise DataError(f"loader state: {k} was {saved.get(k)!r} when saved, is {now[k]!r} now"
                                f"{where}; resume with the same data settings")
        cursor = tuple(int(v) for v in state["cursor"])
        change = None
        if self.spec.blend and not phase_up:
            self.blend_window = state["window"]
        elif phase_up:   # a new data phase: sources keep their positions (mixture module docstring)
            if self.spec.blend:
                st = mixture.next_phase_state(state.get("mix"), state.get("window"), self._mix())
                self.blend_window = [st.to_list(), [int(v) for v in st.pos]]
                cursor = (self.spec.phase, 0, 0)
                positions = {m["name"]: int(st.pos[k]) for k, m in enumerate(self.sources)}
            else:   # a mixture's checkpoint continued on one folder: its first epoch
                cursor, positions = (0, 0, 0), {self.source_names[0]: 0}
            change = {"phase": self.spec.phase, "from_phase": saved_phase, "positions": positions}
        if new_pass:
            epoch = cursor[0] if cursor[1:] == (0, 0) else cursor[0] + 1
            cursor = (epoch, 0, 0)
            change = {"from": saved.get("data"), "from_dir": state.get("data_dir"),
                      "to": now["data"], "epoch": epoch, "samples_per_epoch": self.samples_per_epoch}
        self.cursor = cursor
        self.batches = int(state["batches"])
        self.consumed_samples = int(state["consumed_samples"])
        return change


def build_loader(data_dir, split: str, micro_batch_size: int, max_length: int, *,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, num_workers: int = 2,
                 objective_cfg: ObjectiveConfig | None = None, pack: bool = False,
                 packing: str = "best_fit", shuffle_buffer: int = 1000, shuffle: bool = True,
                 infinite: bool = True, vocab_size: int | None = None,
                 tokenizer_hash: str | None = None, prefetch_factor: int = 4,
                 verify_shards: str = "error", phase: int = 0) -> ShardLoader:
    """The training/eval loader of one data-parallel rank (the same on every TP rank).

    Args:
        data_dir: shard folder, local path or fsspec URL; or a mixture, a sequence of
            `pipeline.data.mixture.Source` (training: their blend; one pass (`infinite=False`):
            each source's split in turn, in the order given).
        split: "train", "val", ... (a key of manifest["splits"]).
        micro_batch_size: rows per micro-batch (B).
        max_length: tokens per row (T); must be >= the manifest's max_length.
        dp_rank, dp_size: data-parallel rank and size.
        seed: run seed; shuffling and the objective's randomness derive from it.
        num_workers: DataLoader worker processes (0 = in this process); does not change the
            batches.
        objective_cfg: objective options (default: the paper's).
        pack: several shard samples per row; otherwise one sample per row, padded.
        packing: with `pack`: "best_fit" (best-fit decreasing within each shuffle window) or
            "next_fit" (window order, a sample that does not fit starts the next row).
        shuffle_buffer: window size of the shuffle and of packing, in samples (memory: that
            many sample lengths per worker when packing; in objective mode "dual" on indexes
            without slot layouts, before version 3, that many samples).
        shuffle: False = manifest order (eval).
        infinite: True = loop over epochs forever (training); False = one pass, rows of the
            last round filled with all-padding rows (every rank gets the same batch count).
        vocab_size: model embedding rows, checked against the manifest (None = no check).
        tokenizer_hash: if given, must equal manifest tokenizer.hash.
        prefetch_factor: micro-batches each worker prepares ahead.
        verify_shards: "error" (default) / "warn" / "off": check each shard against the
            manifest (`pipeline.data.shard_io`): its size when a loader process first needs it
            and each sample's digest when it is read (sample index version 2), or its whole
            sha256 when a process first needs it (version 1).
        phase: data phase of a mixture (`data.phase`; `ShardLoader.load_state_dict`).

    Returns:
        A `ShardLoader`.

    Raises:
        DataError: bad folder/manifest/split, tokenizer mismatch (also between two sources),
            an empty split for an infinite loader (any source's), max_length smaller than the
            shards', unknown packing, a bad weight or a repeated source name.
    """
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if verify_shards not in shard_io.VERIFY_MODES:
        raise DataError(f"verify_shards {verify_shards!r} is not one of {', '.join(shard_io.VERIFY_MODES)}")
    if micro_batch_size < 1 or num_workers < 0 or shuffle_buffer < 1 or seed < 0:
        raise DataError("micro_batch_size and shuffle_buffer must be >= 1, num_workers and seed >= 0")
    if packing not in PACKINGS:
        raise DataError(f"packing {packing!r} is not one of {', '.join(PACKINGS)}")
    mix = not isinstance(data_dir, (str, bytes)) and not hasattr(data_dir, "__fspath__")
    sources = list(data_dir) if mix else [mixture.Source(name=mixture.folder_name(data_dir),
                                                             dir=str(data_dir))]
    if mix and not sources:
        raise DataError("data.sources is empty")
    weights = mixture.normalized_weights(sources)
    objective_cfg = objective_cfg or ObjectiveConfig()
    folders, shards, shard_folder, shard_meta, index_meta, metas = [], [], [], [], [], []
    first = None
    for k, src in enumerate(sources):
        manifest = read_manifest(src.dir)
        where = f"{src.dir}/manifest.json" + (f" (source {src.name!r})" if mix else "")
        check_tokenizer(manifest, vocab_size, tokenizer_hash, where)
        if first is not None:
            mixture.check_same_tokenizer(first, (src, manifest))
        first = first or (src, manifest)
        if split not in manifest["splits"]:
            raise DataError(f"{where}: no split {split!r} (has {sorted(manifest['splits'])})")
        if manifest["max_length"] > max_length:
            raise DataError(f"{where}: shards hold samples up to max_length {manifest['max_length']} "
                            f"tokens, the loader's max_length is {max_length}")
        entries = manifest["splits"][split]
        for e in entries:
            ix = e.get("index")
            if not isinstance(ix, dict) or not isinstance(ix.get("name"), str):
                raise DataError(shard_io.missing_index_message(str(src.dir), e["name"]))
        if verify_shards != "off":  # indexes without per-sample digests: each process hashes shards whole
            shard_io.note_version_1_indexes(str(src.dir), split, [
                e["name"] for e in entries if e["index"].get("version", 1) < sample_index.VERSION_2])
        old = [e["name"] for e in entries if e["index"].get("version", 1) < sample_index.VERSION]
        if pack and objective_cfg.mode == "dual":  # fed lengths need layouts
            shard_io.note_indexes_without_layouts(str(src.dir), split, old)
        if mix and infinite and objective_cfg.mode == "dual" and old:
            raise DataError(f"{where}: shard {old[0]} has a sample index without slot layouts "
                            f"(before version 3); a mixture in objective mode dual blends by fed "
                            f"length and needs them: `python data_prep/shard.py index {src.dir}` "
                            f"adds them")
        n = sum(int(e["samples"]) for e in entries)
        if mix and infinite and n < 1:
            raise DataError(f"{where}: split {split!r} has no samples")
        fs, root = shard_io.open_fs(src.dir)
        folders.append(_Folder(name=src.name, fs=fs, root=root, weight=weights[k]))
        shards += [(e["name"], int(e["samples"])) for e in entries]
        shard_folder += [k] * len(entries)
        shard_meta += [(e.get("sha256"), e.get("bytes")) for e in entries]
        index_meta += [(e["index"]["name"], e["index"].get("bytes"), e["index"].get("sha256"))
                       for e in entries]
        # the sample indexes are left out: adding them (`shard.py index`) keeps the shard set
        metas.append({"name": src.name, "weight": weights[k], "dir": str(src.dir),
                      "max_epochs": src.max_epochs, "samples": n,
                      "tokens": sum(int(e.get("tokens", 0)) for e in entries),
                      "data": _digest([manifest["tokenizer"],
                                       [{k2: v for k2, v in e.items() if k2 != "index"}
                                        for e in entries]])})
    manifest = first[1]
    total = sum(n for _, n in shards)
    if infinite and total < 1:
        raise DataError(f"{first[0].dir}/manifest.json: split {split!r} has no samples")
    tok = manifest["tokenizer"]
    spec = _Spec(folders=tuple(folders), shard_folder=tuple(shard_folder), split=split,
                 shards=tuple(shards), seed=int(seed), dp_rank=int(dp_rank),
                 dp_size=int(dp_size), micro_batch_size=int(micro_batch_size),
                 max_length=int(max_length), packing=packing if pack else "none",
                 window=int(shuffle_buffer), shuffle=bool(shuffle), infinite=bool(infinite),
                 mask_id=int(tok["mask_id"]), pad_id=int(tok["pad_id"]),
                 vocab_limit=int(tok["vocab_size"]), objective=objective_cfg,
                 shard_meta=tuple(shard_meta), verify=verify_shards, index_meta=tuple(index_meta),
                 blend=bool(mix and infinite), phase=int(phase))
    fingerprint = metas[0]["data"] if not mix else _digest([[m["name"], m["data"]] for m in metas])
    return ShardLoader(spec, manifest, fingerprint, num_workers, prefetch_factor,
                       data_dir=str(data_dir) if not mix else ", ".join(m["dir"] for m in metas),
                       sources=metas)

