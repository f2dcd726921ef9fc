"""From the sample order to micro-batches: packing each window into rows, dealing rows to
data-parallel ranks in rounds, and collating a rank's rows (`pipeline.objective.collate`).

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
"""
from __future__ import annotations

import bisect
from typing import Iterator

import numpy as np

from pipeline.data import mixture
from pipeline.data.format import DataError
from pipeline.data.order import SALT_ROWS, BlendOrder, Order, Spec
from pipeline.data.reader import Reader
from pipeline.objective import collate, reorganize_sample

PACKINGS = ("next_fit", "best_fit")


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing (module docstring, "Rows"): indices into `lengths` (ints,
    each <= `capacity` tokens) grouped into rows of at most `capacity` tokens; ties longest-first
    by lower index; rows in creation order, each row's items in insertion order. Deterministic,
    O(n log n). Raises ValueError: an item longer than `capacity`.

    Why not a library packer: TRL's `pack_dataset(strategy="bfd")` and NeMo's
    first-fit-decreasing pack a whole (Arrow / in-memory) dataset offline; our loader packs one
    shuffle window at a time while streaming and must be resumable at any row, so it needs the
    rows of one window as a pure function of that window, which is these few lines."""
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


def window_rows(spec: Spec, order, reader: Reader, epoch: int, w: int):
    """Rows of window w: (list of rows, each a list of (global id, epoch) items; {item: read
    sample} of samples already read; {item: planned fed length} in objective mode "dual").
    Packing takes the lengths from the shards' sample indexes, and each worker reads only its
    own rows' samples; in mode "dual" it packs by the fed length, clean tokens + masked copies,
    computed from the index's slot layouts (version 3), or, for a shard whose index has none,
    from the sample read and reorganized here (every such sample of the window, in every
    worker). A mixture's window (`BlendOrder`) comes with its items' source epochs and fed
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
                fed = reorganize(spec, loaded[it], it[1]).length
            else:
                planned[it] = fed
            lengths[n] = fed
    if spec.packing == "next_fit":
        rows = next_fit(lengths, spec.max_length)
    else:
        rows = best_fit_decreasing(lengths, spec.max_length)
        if spec.shuffle:  # BFD creates rows longest-first: do not feed them in that trend
            rng = np.random.default_rng([spec.seed, epoch, w, SALT_ROWS])
            rows = [rows[int(r)] for r in rng.permutation(len(rows))]
    return [[items[i] for i in row] for row in rows], loaded, planned


def reorganize(spec: Spec, item, epoch: int):
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


def rounds(spec: Spec, cursor: tuple, worker: int, num_workers: int,
            blend_start: list | None = None):
    """The walk of the global row list from `cursor` = (epoch, window, row) (a mixture's:
    (phase, window, row), with `blend_start`, the blend state at that window's start): for
    rounds k = worker, worker + num_workers, ..., yields (the cursor after round k, for a
    mixture the blend states of the cursor's window (`BlendOrder.window_states`) else None,
    this DP rank's rows of the round as [(items, loaded, planned), ...] (`window_rows`), the
    reader). No sample is read but those `window_rows` reads."""
    epoch, w, r = (int(v) for v in cursor)
    if spec.blend:
        state = (mixture.BlendState.from_list(blend_start, len(spec.folders)) if blend_start
                 else mixture.BlendState.zeros(len(spec.folders)))
        order = BlendOrder(spec, w, state)
    else:
        order = Order(spec)
    reader = Reader(spec, order)
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
            rows, loaded, planned = window_rows(spec, order, reader, epoch, w)
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


def rank_batches(spec: Spec, cursor: tuple, worker: int, num_workers: int,
                  blend_start: list | None = None) -> Iterator[dict]:
    """Micro-batches of this DP rank for the rounds of `rounds`; each carries `_pos`, the
    cursor after its round, and for a mixture `_blend`, its blend states."""
    for pos, blend, mine, reader in rounds(spec, cursor, worker, num_workers, blend_start):
        rows, sources = [], []
        for row, loaded, planned in mine:
            rows.append([reorganize(spec, loaded.get(it) or reader.read(it[0]), it[1]) for it in row])
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
