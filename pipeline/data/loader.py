"""The resumable data loader: `build_loader` (checks a shard folder, or a mixture's folders,
against the model), `ShardLoader` (one data-parallel rank's micro-batches, its worker processes,
and the loader state with exact, also layout-changing, resumption).

Owns: the loader state, worker processes, `build_loader`. The sample order is
`pipeline.data.order`'s, packing and dealing rows to DP ranks `pipeline.data.rows`', reading
samples `pipeline.data.reader`'s. Must not touch: the model, the loss, process groups.

Signals: loader workers ignore SIGTERM, SIGINT and SIGUSR1 (`_worker_init`): SLURM preemption
and Ctrl-C signal every process of the job, and torch's own worker handler would make a worker
die, killing the trainer's next `next()` before it can checkpoint. Workers still exit
via the DataLoader's sentinel (the iterator is closed, garbage-collected, or reaped by an
`atexit` hook that runs before multiprocessing's, which could otherwise wait forever for a worker
that ignores its SIGTERM), leftovers are SIGKILLed, and torch's parent-death watchdog ends a
worker within seconds when the training process is killed outright. The DataLoader gets its own
torch.Generator (seeded from the run seed), so starting workers never draws from the global
torch RNG (a resumed run's RNG stays equal to the uninterrupted run's).

State: the cursor (epoch, window, row within the window) of the first row not yet in a yielded
round, this rank's counters, and the settings it must be resumed with (checked on load; the
shard set by its fingerprint `data`; `data_dir` is informational, for the message when the
shards differ). The cursor is the same on every rank after the same number of batches and does
not depend on the layout, so a state continues on another one (`load_state_dict`). Resuming
reads the current window (and the sample indexes of the shards it touches), never replays the
epoch.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import signal
import weakref
from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data import mixture, sample_index, shard_io
from pipeline.data.format import DataError, check_tokenizer
from pipeline.data.order import Folder, Spec
from pipeline.data.rows import PACKINGS, best_fit_decreasing, next_fit, rank_batches, rounds
from pipeline.data.shard_io import read_manifest
from pipeline.objective import ObjectiveConfig

__all__ = ["PACKINGS", "SHARD_CHANGE_POLICIES", "ShardLoader", "best_fit_decreasing",
           "build_loader", "next_fit"]

log = logging.getLogger("pipeline.data")

STATE_VERSION = 2


def _digest(obj) -> str:
    """16 hex digits of the sha256 of `obj` as sorted-key JSON (shard set and tokenizer
    fingerprints of the loader state)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _worker_init(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: ignore SIGTERM, SIGINT and SIGUSR1 in a loader worker (module
    docstring, "Signals"); it runs after torch's worker signal set-up, so it replaces torch's
    SIGTERM handler."""
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
    def __init__(self, spec: Spec, cursor: tuple, num_workers: int, blend_start: list | None):
        self.spec, self.cursor, self.num_workers = spec, cursor, num_workers
        self.blend_start = blend_start

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info is not None else 0
        spec = self.spec
        if info is not None:  # a forked worker: an async filesystem (http, s3) needs its own instance
            spec = dataclasses.replace(spec, folders=tuple(
                dataclasses.replace(f, fs=shard_io.fs_for_this_process(f.fs)) for f in spec.folders))
        return rank_batches(spec, self.cursor, wid, max(1, self.num_workers), self.blend_start)


# Settings that define the global row list: a state only continues under the same ones.
_ORDER_KEYS = ("split", "seed", "max_length", "packing", "shuffle_buffer", "shuffle", "objective",
               "data")
# What a state may meet when its shard set (`data`) changed (`load_state_dict`'s
# `on_shard_change`): "refuse" (one-line DataError) or "new_pass" (a new epoch over the new set).
SHARD_CHANGE_POLICIES = ("refuse", "new_pass")
# Settings of the layout: the same on a plain resume; another one only with allow_reshard.
_LAYOUT_KEYS = ("dp_size", "dp_rank", "micro_batch_size")


class ShardLoader:
    """Iterable of micro-batches for one data-parallel rank, with exact resumption; build it
    with `build_loader`. Yields `objective.collate` dicts (ARCHITECTURE.md "Batch"); iterating
    again after a break continues after the last yielded batch (prefetched ones are not consumed).

    Attributes:
        manifest: the folder's manifest. mask_id / pad_id: from it.
        samples_per_epoch: shard samples per epoch of the split (all ranks together).
        consumed_samples / batches: shard samples / micro-batches this rank yielded (batches are
            equal on every rank: one per round).
        cursor: (epoch, window, row) of the first row not in a yielded round; a mixture's
            training loader: (phase, window, row) of its blend.
        sources: per folder (`data.dir`'s, or each source of a mixture, in order): {"name",
            "weight" (normalized), "dir", "max_epochs", "samples", "tokens" (of the split),
            "data" (the folder's shard-set fingerprint)}.
        source_names, source_weights: tuples from `sources` (a batch's `source` indexes them)."""

    def __init__(self, spec: Spec, manifest: dict, fingerprint: str, num_workers: int,
                 prefetch_factor: int, data_dir: str | None = None, sources: list | None = None):
        self.spec, self.manifest, self.fingerprint = spec, manifest, fingerprint
        self.sources = sources or []
        self.source_names = tuple(m["name"] for m in self.sources)
        self.source_weights = tuple(m["weight"] for m in self.sources)
        self.blend_window = None   # mixture: `BlendOrder.window_states` of the cursor's window
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
        it = rounds(self.spec, tuple(self.cursor), 0, 1,
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
        """Continue after the batch `state` (from `state_dict()`; any rank's when
        resharding) was taken at.

        On the same layout (dp_size, dp_rank, micro_batch_size) the batches are bit-identical
        to an uninterrupted run's, whatever num_workers. With `allow_reshard=True` the layout
        may differ: the global row list continues at the saved cursor, dealt to the new ranks,
        so every row of the epoch not yet consumed is seen exactly once (the cursor must come
        from a point where every old rank yielded the same number of batches, as at a training
        checkpoint).

        A state of another shard set (its `data` fingerprint: the split's shard list with
        names, sample and token counts, sizes and sha256, plus the tokenizer) is refused unless
        `on_shard_change="new_pass"`: then a new pass over this loader's set starts at the first
        epoch the saved cursor had not begun, row 0; the counters go on. The tokenizer must be
        the same (a state saved before it was recorded is taken on trust, with a warning). A
        mixture (or a state of one) follows `data.phase` instead: the same phase continues only
        with the same sources, weights and shard sets; a higher phase starts a new data phase.

        Returns:
            None; after a new data phase: {"phase", "from_phase", "positions": {source name:
            samples drawn from it before}}; after a new pass: {"from" / "to": the saved / this
            loader's fingerprint, "from_dir": the saved folder or None, "epoch": the new pass's,
            "samples_per_epoch": of the new set}.
        Raises:
            DataError (naming the field): a state of another version, seed, row length,
                packing, shuffle settings, objective, shard set or tokenizer, or (without
                allow_reshard) another layout; an unknown `on_shard_change`; a mixture changed
                without a higher phase, or a lower phase."""
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
    """The training/eval `ShardLoader` of one data-parallel rank (the same on every TP rank).

    Args:
        data_dir: shard folder, local path or fsspec URL; or a mixture, a sequence of
            `pipeline.data.mixture.Source` (training: their blend; one pass: each source's split
            in turn).
        split: a key of manifest["splits"].
        micro_batch_size / max_length: rows per micro-batch (B) / tokens per row (T, >= the
            manifest's max_length).
        seed: run seed; shuffling and the objective's randomness derive from it.
        num_workers: DataLoader worker processes (0 = in this process); does not change the
            batches.
        objective_cfg: objective options (default: the paper's).
        pack, packing, shuffle_buffer: one sample per row (padded) or packed, "best_fit" or
            "next_fit", within shuffle windows of `shuffle_buffer` samples (`pipeline.data.rows`;
            memory: that many sample lengths per worker when packing).
        shuffle: False = manifest order (eval).
        infinite: True = loop over epochs forever (training); False = one pass
            (`pipeline.data.rows`, "Dealing").
        vocab_size / tokenizer_hash: checked against the manifest when given.
        prefetch_factor: micro-batches each worker prepares ahead.
        verify_shards: `data.verify_shards` ("error" | "warn" | "off").
        phase: data phase of a mixture (`data.phase`).
    Raises:
        DataError: bad folder/manifest/split, tokenizer mismatch (also between two sources), an
            empty split for an infinite loader (any source's), max_length smaller than the
            shards', unknown packing, a bad weight or a repeated source name."""
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
        folders.append(Folder(name=src.name, fs=fs, root=root, weight=weights[k]))
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
    spec = Spec(folders=tuple(folders), shard_folder=tuple(shard_folder), split=split,
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
