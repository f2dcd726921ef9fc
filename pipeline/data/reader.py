"""Random access to a split's samples by global id, through each shard's sample index.

- Reading: each shard's sample index (`<shard>.idx`, `pipeline.data.sample_index`, read once
  when a process first needs the shard, never a walk of tar headers) gives each sample's byte
  range, read in one request, and its digest, checked on that read (`data.verify_shards`,
  `pipeline.data.shard_io`). A worker reads only the samples of its own rows; packing takes
  the lengths (and in objective mode "dual" the fed lengths) from the indexes
  (`pipeline.data.rows.window_rows`, and its exception for indexes without slot layouts). TP
  ranks of a DP rank each build the loader and read the same samples (ARCHITECTURE.md "Loader"
  says why they do not share them). A manifest whose shards have
  no index entry (a folder made before indexes) is
  refused at start-up in one line naming `python data_prep/shard.py index DIR`, which writes
  them: a DataError (exit 2) rather than a fallback to the tar walk, so no job silently pays
  ~45 us a sample per shard per worker at every start.
"""
from __future__ import annotations

import bisect
import io
import json

import numpy as np

from pipeline.data import sample_index, shard_io
from pipeline.data.format import DataError
from pipeline.data.order import Order, Spec
from pipeline.objective import dual_fed_length


def open_shard(fs, path: str):
    """Open one shard for binary, seekable reading: the only place shards are opened (a hook
    for verification or remote-filesystem error handling wraps this function).

    Without a read cache (`cache_type="none"`): each `read` is one request for exactly the
    sample's byte range. fsspec's remote files otherwise read ahead (s3fs: 50 MB past a read,
    fsspec's http: 5 MB), which in the loader's shuffled order fetched up to the rest of the
    shard at every jump: one epoch of 10,000 samples in 10 shards took 72x the shards' bytes
    from an S3 server (`bench/bench_s3_bytes.py`). Local and in-memory files ignore it."""
    return fs.open(path, "rb", cache_type="none")


class Reader:
    """Random access to samples by global id (module docstring), from an open-file cache; no
    tar header is parsed but the one inside a sample's range that names its key."""

    def __init__(self, spec: Spec, order: Order):
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
                f = self._files[s] = open_shard(spec.where(s)[0], path)
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
