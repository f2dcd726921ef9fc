"""Shard reading, data-parallel / worker split, shuffling, batching and exact resumption.

Owns: reading the shard folder written by `data_prep/shard.py` (ARCHITECTURE.md "Shard
format", local path or fsspec URL), checking it against the model, cutting it into one
*stream* per (data-parallel rank, loader worker), shuffling, packing or padding samples into
fixed-shape micro-batches reorganized by `pipeline.objective`, and the loader state.
Must not touch: the model, the loss, process groups (the caller passes dp_rank / dp_size).

How the data is cut and ordered (everything is computed from the manifest, no data is read):
- Split samples are numbered 0..N-1 in manifest order (shard by shard). With S = dp_size x
  max(1, num_workers) streams, stream g = dp_rank * max(1, num_workers) + worker owns the
  contiguous range [g*N//S, (g+1)*N//S): balanced to one sample, never empty when
  infinite (N >= S is checked; a one-pass loader allows empty streams), whatever the
  number of shards, and each stream reads only the shards its range touches. The
  assignment does not change across epochs.
- Epoch e of a stream: its samples are cut into chunks of max(1, shuffle_buffer // 16)
  consecutive samples (never across shards), the chunks are put in an order drawn from
  (seed, e, g), and the resulting sequence is emitted window by window (`shuffle_buffer`
  samples), each window in an order drawn from (seed, e, g, window). So a window mixes ~16
  chunks from anywhere in the stream's range (data_prep keeps input order, so neighbouring
  samples are alike), and reads stay sequential inside a chunk. A per-shard header index
  (tar headers only; data skipped by seeking), built when a shard is first needed, gives
  random access to chunks. A stream loops over epochs on its own (the loader is infinite by
  default, so data-parallel ranks never wait for each other at an epoch end); the
  reorganization of a sample uses its own stream's epoch.
- Worker w of a torch DataLoader yields whole micro-batches of its stream; the DataLoader
  returns them round-robin (batch i from worker i % num_workers).
Signals: loader workers ignore SIGTERM, SIGINT and SIGUSR1 (`_worker_init`). SLURM preemption /
scancel and a terminal's Ctrl-C signal every process of the job, workers included, and torch's
own worker handler would make a worker die, killing the trainer's next `next()` before it can
checkpoint; only the training process reacts, and it shuts its workers down. Workers still exit
via the DataLoader's sentinel (the iterator is closed, garbage-collected, or reaped by an
`atexit` hook that runs before multiprocessing's, which could otherwise wait forever for a worker
that ignores its SIGTERM), leftovers are SIGKILLed, and torch's parent-death watchdog ends a
worker within seconds when the training process is killed outright.
State: for each stream, (epoch, number of samples already placed in yielded batches), plus the
number of batches yielded, and the settings it must be resumed with (checked on load; the shard
set by its fingerprint `data`). `data_dir`, the folder it was read from, is informational (for
the message when the shards differ; states without it still load). Resuming reads the current window (indexing the headers of the
shards it touches), never replays the epoch.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import io
import json
import multiprocessing
import posixpath
import signal
import tarfile
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline import shard_io
from pipeline.objective import ObjectiveConfig, collate, reorganize_sample

__all__ = ["DataError", "read_manifest", "check_tokenizer", "ShardLoader", "build_loader"]

STATE_VERSION = 1
_SALT_PIECES = 0x5EED01
_SALT_WINDOW = 0x5EED02


class DataError(ValueError):
    """A user-facing data problem (bad folder, manifest, shard, state); the message is one line
    naming the file/field. CLIs catch it and exit with code 2."""


def _fs(data_dir: str):
    return shard_io.open_fs(data_dir)  # one-line DataError for a missing fsspec package


def read_manifest(data_dir: str) -> dict:
    """Read and check `<data_dir>/manifest.json`.

    Args:
        data_dir: local folder or fsspec URL (e.g. `memory://shards`, `s3://bucket/shards`).

    Returns:
        The manifest dict.

    Raises:
        DataError: missing/unreadable manifest, unknown format_version, missing fields.
    """
    fs, root = _fs(data_dir)
    path = f"{root}/manifest.json"
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise DataError(f"{data_dir}: no manifest.json (not a shard folder written by data_prep.shard)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: expected a JSON object")
    if manifest.get("format_version") != 1:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r} is not supported (expected 1)")
    for field in ("tokenizer", "max_length", "splits"):
        if field not in manifest:
            raise DataError(f"{path}: missing field {field!r}")
    if not isinstance(manifest["tokenizer"], dict) or not isinstance(manifest["splits"], dict):
        raise DataError(f"{path}: tokenizer and splits must be JSON objects")
    for field in ("vocab_size", "pad_id", "mask_id", "eos_id"):
        if manifest["tokenizer"].get(field) is None:
            raise DataError(f"{path}: tokenizer.{field} is missing")
    return manifest


def check_tokenizer(manifest: dict, vocab_size: int | None, tokenizer_hash: str | None = None,
                    where: str = "manifest.json") -> None:
    """Refuse shards that do not fit the model.

    Args:
        manifest: from `read_manifest`.
        vocab_size: the model's embedding rows (`ModelConfig.vocab_size`); None skips the check.
        tokenizer_hash: if given, the manifest's `tokenizer.hash` must equal it.
        where: name used in messages.

    Raises:
        DataError: vocab too small, a special id outside the embedding, or another tokenizer.
    """
    tok = manifest["tokenizer"]
    if tokenizer_hash is not None and tok.get("hash") != tokenizer_hash:
        raise DataError(f"{where}: shards were tokenized with {tok.get('name')!r} (hash {tok.get('hash')}), "
                        f"the model expects tokenizer hash {tokenizer_hash}")
    if vocab_size is None:
        return
    if tok["vocab_size"] > vocab_size:
        raise DataError(f"{where}: tokenizer.vocab_size {tok['vocab_size']} > model vocab_size {vocab_size}")
    for name in ("pad_id", "mask_id", "eos_id", "bos_id"):
        v = tok.get(name)
        if v is not None and not 0 <= v < vocab_size:
            raise DataError(f"{where}: tokenizer.{name} {v} is outside the model vocab [0, {vocab_size})")


@dataclass(frozen=True)
class _Piece:
    shard: int   # index into the split's shard list
    start: int   # first sample (0-based, within the shard)
    stop: int    # one past the last sample

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class _Spec:
    """Everything a worker needs (picklable)."""
    fs: object
    root: str
    split: str
    shards: tuple        # ((name, samples), ...)
    pieces: tuple        # per local stream: tuple[_Piece, ...]
    stream_ids: tuple    # global stream id of each local stream
    seed: int
    micro_batch_size: int
    max_length: int
    pack: bool
    window: int
    shuffle: bool
    infinite: bool
    mask_id: int
    pad_id: int
    vocab_limit: int
    objective: ObjectiveConfig
    shard_meta: tuple = ()   # per shard: (sha256 or None, bytes or None) from the manifest
    verify: str = "error"    # shard_io.VERIFY_MODES


@dataclass
class _PieceIndex:
    """Where each sample of a piece lies in its tar: keys and byte offsets/sizes of members."""
    keys: list
    tok_off: np.ndarray
    tok_size: np.ndarray
    json_off: np.ndarray
    json_size: np.ndarray


def _index_piece(fs, path: str, piece: _Piece, expected_bytes: int | None = None) -> _PieceIndex:
    """Scan the tar headers (data is skipped by seeking) and locate samples
    `piece.start .. piece.stop-1`.

    Raises:
        DataError: unreadable/corrupt/truncated tar, a sample without tokens.npy or json, or
            fewer samples than the manifest promises.
    """
    def bad(msg):
        return DataError(f"shard {path}: {msg}")

    def hint():  # truncated, or damaged in place (shard_io)
        h = shard_io.damage_hint(fs, path, expected_bytes)
        return f"; {h}" if h else ""

    keys, offs = [], {"tokens.npy": [], "json": []}
    index, key, found = -1, None, {}

    def close_sample():
        if piece.start <= index < piece.stop:
            missing = [e for e in offs if e not in found]
            if missing:
                raise bad(f"sample {key} lacks {', '.join(missing)}")
            keys.append(key)
            for e in offs:
                offs[e].append(found[e])

    try:
        with fs.open(path, "rb") as f:
            tf = tarfile.open(fileobj=f, mode="r:")
            while True:
                member = tf.next()
                if member is None:
                    break
                if not member.isfile():
                    continue
                d, base = posixpath.split(member.name)
                mkey, _, ext = base.partition(".")
                mkey = posixpath.join(d, mkey) if d else mkey
                if mkey != key:
                    if key is not None:
                        close_sample()
                    index, key, found = index + 1, mkey, {}
                    if index >= piece.stop:
                        break
                if ext in offs:
                    found[ext] = (member.offset_data, member.size)
                tf.members.clear()  # do not keep every header of a large shard in memory
            if key is not None and index < piece.stop:
                close_sample()
    except DataError:
        raise
    except FileNotFoundError:
        raise bad("missing") from None
    except tarfile.TarError as e:
        raise bad(f"unreadable tar ({e}){hint()}") from None
    except (EOFError, OSError, ValueError) as e:
        raise DataError(shard_io.no_range_message(path, e) or f"shard {path}: unreadable ({e}){hint()}") from None
    if len(keys) != piece.count:
        raise bad(f"has {index + 1 if index < piece.stop else 'more'} samples, the manifest says "
                  f"{piece.stop} or more{hint()}")
    arr = {e: np.asarray(v, dtype=np.int64).reshape(-1, 2) for e, v in offs.items()}
    return _PieceIndex(keys=keys, tok_off=arr["tokens.npy"][:, 0], tok_size=arr["tokens.npy"][:, 1],
                       json_off=arr["json"][:, 0], json_size=arr["json"][:, 1])


class _SampleStream:
    """One stream's samples in emission order, from a position; `peek()` / `advance()`.

    Order of epoch e: the stream's samples are cut into chunks of max(1, window // 16) samples
    (never across shards); the chunk order is a permutation drawn from (seed, e, stream); the
    resulting sequence is emitted window by window (`window` samples), each window in an order
    drawn from (seed, e, stream, window index). A window is read chunk by chunk with seeks,
    through a per-piece header index built on first use.
    """

    def __init__(self, spec: _Spec, local: int, epoch: int, n: int):
        self.spec, self.local, self.gid = spec, local, spec.stream_ids[local]
        self.pieces = spec.pieces[local]
        counts = np.array([p.count for p in self.pieces], dtype=np.int64)
        self.piece_first = np.concatenate([[0], np.cumsum(counts)])  # stream-local index of each piece
        self.size = int(self.piece_first[-1])
        C = max(1, spec.window // 16)
        starts, sizes = [], []
        for first, c in zip(self.piece_first[:-1], counts):
            s = np.arange(first, first + c, C)
            starts.append(s)
            sizes.append(np.minimum(C, first + c - s))
        self.chunk_start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.chunk_size = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        self.epoch, self.n = epoch, n
        self._seq_epoch, self._seq = None, None
        self._window_id, self._window = None, []
        self._indexes: dict[int, _PieceIndex] = {}
        self._files: dict[int, object] = {}

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.n

    def _sequence(self) -> np.ndarray:
        """Stream-local sample indices in this epoch's chunk order, int64[size]."""
        if self._seq_epoch != self.epoch:
            if self.spec.shuffle:
                rng = np.random.default_rng([self.spec.seed, self.epoch, self.gid, _SALT_PIECES])
                perm = rng.permutation(len(self.chunk_start))
                sizes = self.chunk_size[perm]
                base = np.repeat(self.chunk_start[perm] - (np.cumsum(sizes) - sizes), sizes)
                self._seq = base + np.arange(self.size, dtype=np.int64)
            else:
                self._seq = np.arange(self.size, dtype=np.int64)
            self._seq_epoch = self.epoch
        return self._seq

    def _read(self, local_index: int):
        spec = self.spec
        p = int(np.searchsorted(self.piece_first, local_index, side="right") - 1)
        piece = self.pieces[p]
        path = f"{spec.root}/{spec.shards[piece.shard][0]}"
        sha, size = spec.shard_meta[piece.shard] if spec.shard_meta else (None, None)
        if p not in self._indexes:
            shard_io.verify_shard(spec.fs, path, sha, spec.verify, size,  # whole shard, once
                                  zip((n for n, _ in spec.shards), (m[0] for m in spec.shard_meta)))
            self._indexes[p] = _index_piece(spec.fs, path, piece, size)
        idx, i = self._indexes[p], local_index - int(self.piece_first[p])
        f = self._files.get(p)
        if f is None:
            if len(self._files) >= 8:
                old = next(iter(self._files))
                self._files.pop(old).close()
            f = self._files[p] = spec.fs.open(path, "rb")
        key = idx.keys[i]
        try:
            f.seek(int(idx.tok_off[i]))
            raw_tokens = f.read(int(idx.tok_size[i]))
            f.seek(int(idx.json_off[i]))
            raw_json = f.read(int(idx.json_size[i]))
            if len(raw_tokens) != idx.tok_size[i] or len(raw_json) != idx.json_size[i]:
                raise EOFError("short read")
            tokens = np.load(io.BytesIO(raw_tokens), allow_pickle=False)
            meta = json.loads(raw_json.decode("utf-8"))
        except (ValueError, OSError, EOFError, UnicodeDecodeError) as e:
            h = shard_io.damage_hint(spec.fs, path, size)
            raise DataError(shard_io.no_range_message(path, e) or f"shard {path}: sample {key} is "
                            f"undecodable ({e}){'; ' + h if h else ''}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or not isinstance(meta, dict) \
                or "segments" not in meta:
            raise DataError(f"shard {path}: sample {key}: tokens.npy must be a 1-D integer array "
                            f"and json must have segments")
        return path, key, tokens, meta["segments"]

    def _load_window(self) -> None:
        W = self.spec.window
        w = self.n // W
        if self._window_id == (self.epoch, w):
            return
        ids = self._sequence()[w * W:(w + 1) * W]
        loaded = {int(i): self._read(int(i)) for i in np.sort(ids)}  # file order within chunks
        if self.spec.shuffle:
            rng = np.random.default_rng([self.spec.seed, self.epoch, self.gid, w, _SALT_WINDOW])
            ids = ids[rng.permutation(len(ids))]
        self._window = [loaded[int(i)] for i in ids]
        self._window_id = (self.epoch, w)

    def peek(self):
        """(shard path, key, tokens, segments, epoch) of the next sample, or None at the end."""
        if self.n >= self.size:
            if not self.spec.infinite or self.size == 0:
                return None
            self.epoch, self.n = self.epoch + 1, 0
        self._load_window()
        return (*self._window[self.n % self.spec.window], self.epoch)

    def advance(self) -> None:
        self.n += 1

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _reorganize(spec: _Spec, item):
    path, key, tokens, segments, epoch = item
    L = int(tokens.shape[0])
    if L > spec.max_length:
        raise DataError(f"shard {path}: sample {key} has {L} tokens > max_length {spec.max_length}")
    if L and int(tokens.max()) >= spec.vocab_limit:
        raise DataError(f"shard {path}: sample {key} has token id {int(tokens.max())} >= "
                        f"tokenizer.vocab_size {spec.vocab_limit}")
    try:
        return reorganize_sample(tokens, segments, key, seed=spec.seed, epoch=epoch,
                                 mask_id=spec.mask_id, cfg=spec.objective)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"shard {path}: bad segments in sample {key} ({e})") from None


def _stream_batches(spec: _Spec, local: int, epoch: int, n: int) -> Iterator[dict]:
    """Micro-batches of one stream; each carries `_stream` and `_pos` (position after it)."""
    stream = _SampleStream(spec, local, epoch, n)
    try:
        yield from _batches_of(spec, stream)
    finally:
        stream.close()


def _batches_of(spec: _Spec, stream: _SampleStream) -> Iterator[dict]:
    B, T = spec.micro_batch_size, spec.max_length
    while True:
        rows: list[list] = []
        if not spec.pack:
            while len(rows) < B and (item := stream.peek()) is not None:
                rows.append([_reorganize(spec, item)])
                stream.advance()
        else:
            row, used = [], 0
            while len(rows) < B and (item := stream.peek()) is not None:
                L = int(item[2].shape[0])
                if used + L <= T:
                    row.append(_reorganize(spec, item))
                    used += L
                    stream.advance()
                else:
                    rows.append(row)
                    row, used = [], 0
            if row and len(rows) < B:
                rows.append(row)
        if not rows:
            return
        rows += [[] for _ in range(B - len(rows))]
        batch = collate(rows, T, spec.pad_id)
        batch["_stream"] = stream.local
        batch["_pos"] = stream.position
        yield batch


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


class _StreamDataset(IterableDataset):
    def __init__(self, spec: _Spec, positions: list, rotate: int):
        self.spec, self.positions, self.rotate = spec, positions, rotate

    def __iter__(self):
        info = get_worker_info()
        n_local = len(self.spec.stream_ids)
        wid = info.id if info is not None else 0
        local = (wid + self.rotate) % n_local
        epoch, n = self.positions[local]
        spec = self.spec
        if info is not None:  # a forked worker: an async filesystem (http, s3) needs its own instance
            spec = dataclasses.replace(spec, fs=shard_io.fs_for_this_process(spec.fs))
        return _stream_batches(spec, local, epoch, n)


class ShardLoader:
    """Iterable of micro-batches for one data-parallel rank, with exact resumption.

    Build it with `build_loader`. Iterating yields `objective.collate` dicts
    (`LongTensor[B, T]` etc., see ARCHITECTURE.md "Batch"). Breaking out of the loop and
    iterating again continues where the last yielded batch left off. Exact continuation
    (the same interleaving of workers) holds for infinite loaders; a one-pass loader resumes
    every stream at the right sample but may interleave workers differently near its end.

    Attributes:
        manifest: the folder's manifest. mask_id / pad_id: from it.
        samples_per_epoch: shard samples this rank sees per epoch (all its streams).
        consumed_samples: shard samples in the batches yielded so far (this rank).
        batches: micro-batches yielded so far.
    """

    def __init__(self, spec: _Spec, manifest: dict, fingerprint: str, dp_rank: int, dp_size: int,
                 num_workers: int, prefetch_factor: int, data_dir: str | None = None):
        self.spec, self.manifest, self.fingerprint = spec, manifest, fingerprint
        self.data_dir = data_dir
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.prefetch_factor = prefetch_factor
        self.mask_id, self.pad_id = spec.mask_id, spec.pad_id
        self.samples_per_epoch = sum(p.count for ps in spec.pieces for p in ps)
        self._positions = [(0, 0) for _ in spec.pieces]
        self.batches = 0
        self.consumed_samples = 0

    @property
    def epoch(self) -> int:
        """The lowest epoch any of this rank's streams is in (0-based)."""
        return min(e for e, _ in self._positions)

    def __iter__(self) -> Iterator[dict]:
        n_local = len(self.spec.stream_ids)
        ds = _StreamDataset(self.spec, list(self._positions), self.batches % n_local)
        if self.num_workers > 0:
            # fork: workers start in milliseconds and inherit in-memory fsspec stores; the
            # workers never touch CUDA. Elsewhere (no fork) the platform default is used.
            ctx = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            it = iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                 prefetch_factor=self.prefetch_factor, persistent_workers=False,
                                 multiprocessing_context=ctx, worker_init_fn=_worker_init))
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
                local, pos = int(batch.pop("_stream")), tuple(int(v) for v in batch.pop("_pos"))
                self._positions[local] = pos
                self.batches += 1
                self.consumed_samples += len(batch["keys"])
                yield batch
        finally:
            if self.num_workers > 0:
                _LIVE_ITERATORS.discard(it)
                _stop_workers(it)

    def _config(self) -> dict:
        s = self.spec
        return {"split": s.split, "seed": s.seed, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "num_workers": self.num_workers, "micro_batch_size": s.micro_batch_size,
                "max_length": s.max_length, "pack": s.pack, "shuffle_buffer": s.window,
                "shuffle": s.shuffle, "objective": dict(vars(s.objective)), "data": self.fingerprint}

    def state_dict(self) -> dict:
        """Picklable/JSON-able state after the last yielded batch (one per data-parallel rank;
        the TP ranks of a DP group have equal states)."""
        return {"version": STATE_VERSION, "config": self._config(),
                "positions": [list(p) for p in self._positions], "batches": self.batches,
                "consumed_samples": self.consumed_samples, "data_dir": self.data_dir}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batch the state was taken at.

        Raises:
            DataError: the state comes from a different data-parallel size, worker count,
                seed, batch shape, objective or shard set (named in the message).
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(f"loader state: version {state.get('version')!r} is not {STATE_VERSION}")
        saved, now = state["config"], self._config()
        if saved["dp_size"] != now["dp_size"]:
            raise DataError(f"loader state: saved with data-parallel size {saved['dp_size']}, this run has "
                            f"{now['dp_size']}; changing the DP size on resume is not supported")
        for k in now:
            if saved.get(k) != now[k]:
                where = ""
                if k == "data":  # the shard set: name the folders (states before data_dir: unknown)
                    where = (f" (shards of {state.get('data_dir') or 'an unrecorded folder'} when "
                             f"saved, of {self.data_dir} now)")
                raise DataError(f"loader state: {k} was {saved.get(k)!r} when saved, is {now[k]!r} now"
                                f"{where}; resume with the same data settings")
        self._positions = [tuple(p) for p in state["positions"]]
        self.batches = int(state["batches"])
        self.consumed_samples = int(state["consumed_samples"])


def build_loader(data_dir: str, split: str, micro_batch_size: int, max_length: int, *,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, num_workers: int = 2,
                 objective_cfg: ObjectiveConfig | None = None, pack: bool = False,
                 shuffle_buffer: int = 1000, shuffle: bool = True, infinite: bool = True,
                 vocab_size: int | None = None, tokenizer_hash: str | None = None,
                 prefetch_factor: int = 4, verify_shards: str = "error") -> ShardLoader:
    """The training/eval loader of one data-parallel rank (the same on every TP rank).

    Args:
        data_dir: shard folder, local path or fsspec URL.
        split: "train", "val", ... (a key of manifest["splits"]).
        micro_batch_size: rows per micro-batch (B).
        max_length: tokens per row (T); must be >= the manifest's max_length.
        dp_rank, dp_size: data-parallel rank and size.
        seed: run seed; shuffling and the objective's randomness derive from it.
        num_workers: DataLoader worker processes (0 = in this process). Part of the state.
        objective_cfg: objective options (default: the paper's).
        pack: greedily pack several shard samples into a row (in stream order; a sample that
            does not fit starts the next row); otherwise one sample per row, padded.
        shuffle_buffer: window size of the shuffle, in samples (memory: that many samples per
            worker).
        shuffle: False = manifest order (eval).
        infinite: True = loop over epochs forever (training); False = one pass, the last
            micro-batch filled with all-padding rows.
        vocab_size: model embedding rows, checked against the manifest (None = no check).
        tokenizer_hash: if given, must equal manifest tokenizer.hash.
        prefetch_factor: micro-batches each worker prepares ahead.
        verify_shards: "error" (default) / "warn" / "off": check each shard's sha256 against
            the manifest when a loader process first reads it (`pipeline.shard_io`).

    Returns:
        A `ShardLoader`.

    Raises:
        DataError: bad folder/manifest/split, tokenizer mismatch, too few samples for
            dp_size x num_workers streams, max_length smaller than the shards'.
    """
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if verify_shards not in shard_io.VERIFY_MODES:
        raise DataError(f"verify_shards {verify_shards!r} is not one of {', '.join(shard_io.VERIFY_MODES)}")
    if micro_batch_size < 1 or num_workers < 0 or shuffle_buffer < 1 or seed < 0:
        raise DataError("micro_batch_size and shuffle_buffer must be >= 1, num_workers and seed >= 0")
    manifest = read_manifest(data_dir)
    where = f"{data_dir}/manifest.json"
    check_tokenizer(manifest, vocab_size, tokenizer_hash, where)
    if split not in manifest["splits"]:
        raise DataError(f"{where}: no split {split!r} (has {sorted(manifest['splits'])})")
    if manifest["max_length"] > max_length:
        raise DataError(f"{where}: shards hold samples up to max_length {manifest['max_length']} tokens, "
                        f"the loader's max_length is {max_length}")
    shards = tuple((s["name"], int(s["samples"])) for s in manifest["splits"][split])
    total = sum(n for _, n in shards)
    nw = max(1, num_workers)
    S = dp_size * nw
    if infinite and total < S:
        raise DataError(f"{where}: split {split!r} has {total} samples, fewer than dp_size x workers = {S} "
                        f"streams; use fewer loader workers")
    starts = np.cumsum([0] + [n for _, n in shards])
    stream_ids = tuple(dp_rank * nw + w for w in range(nw))
    pieces = []
    for g in stream_ids:
        a, b = g * total // S, (g + 1) * total // S
        mine = []
        for i, (_, n) in enumerate(shards):
            lo, hi = max(a, starts[i]), min(b, starts[i + 1])
            if lo < hi:
                mine.append(_Piece(i, int(lo - starts[i]), int(hi - starts[i])))
        pieces.append(tuple(mine))
    fs, root = _fs(data_dir)
    tok = manifest["tokenizer"]
    spec = _Spec(fs=fs, root=root, split=split, shards=shards, pieces=tuple(pieces),
                 stream_ids=stream_ids, seed=int(seed), micro_batch_size=int(micro_batch_size),
                 max_length=int(max_length), pack=bool(pack), window=int(shuffle_buffer),
                 shuffle=bool(shuffle), infinite=bool(infinite), mask_id=int(tok["mask_id"]),
                 pad_id=int(tok["pad_id"]), vocab_limit=int(tok["vocab_size"]),
                 objective=objective_cfg or ObjectiveConfig(),
                 shard_meta=tuple((s.get("sha256"), s.get("bytes")) for s in manifest["splits"][split]),
                 verify=verify_shards)
    fingerprint = hashlib.sha256(json.dumps([manifest["tokenizer"], manifest["splits"][split]],
                                            sort_keys=True).encode()).hexdigest()[:16]
    return ShardLoader(spec, manifest, fingerprint, dp_rank, dp_size, num_workers, prefetch_factor,
                       data_dir=str(data_dir))
