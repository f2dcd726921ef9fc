"""Shard writing for data preparation: the output folder, slot boundaries, tar samples, shards.

Owns: the output folder (local path or fsspec URL; every write is temp name + rename, a
failed write removes its temporary file, a full disk or quota becomes `OutputFull`), slot
sizes and segments of a sample, the tar layout of a sample, and `SplitWriter`, which packs
items into samples and samples into `<split>-NNNNNN.tar` shards with their manifest entries.
Must not touch: reading, dedup, tokenization, the CLI (data_prep/prepare.py, cli.py).
"""
from __future__ import annotations

import collections
import errno
import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass

import fsspec
import numpy as np

from data_prep.dedup import DigestSet
from pipeline.data import sample_index

_KEY_HEX = 20  # 80-bit keys

def slot_size(seed: int, key: str, segment_index: int, slot_sizes: tuple[int, ...]) -> int:
    """Slot length k (tokens) of one segment, drawn from `slot_sizes` by (seed, key, segment)."""
    h = hashlib.sha256(f"{seed}:{key}:{segment_index}".encode()).digest()
    return slot_sizes[int.from_bytes(h[:8], "little") % len(slot_sizes)]


def make_segments(lengths: list[tuple[int, int]], key: str, seed: int,
                  slot_sizes: tuple[int, ...]) -> list[dict]:
    """Segments of one sample from `(length, prompt_length)` of its parts, in order.

    Returns `[{"start", "end", "prompt_length", "slot_starts"}]` (ARCHITECTURE.md): offsets
    index the sample's tokens; slots of k tokens (the last may be shorter) cover
    `[start + prompt_length, end)`. Raises ValueError when a part has no response token.
    """
    segments, pos = [], 0
    for j, (n, p) in enumerate(lengths):
        if not 0 <= p < n:
            raise ValueError(f"segment {j} of {key}: prompt_length {p} leaves no response in {n} tokens")
        k = slot_size(seed, key, j, slot_sizes)
        segments.append({"start": pos, "end": pos + n, "prompt_length": p,
                         "slot_starts": list(range(pos + p, pos + n, k))})
        pos += n
    return segments


def encode_sample(key: str, tokens: np.ndarray, segments: list[dict]) -> dict:
    """The webdataset sample dict: `__key__`, `tokens.npy` (uint32[L] .npy bytes), `json`."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(tokens, dtype=np.uint32), allow_pickle=False)
    meta = json.dumps({"segments": segments}, separators=(",", ":")).encode()
    return {"__key__": key, "tokens.npy": buf.getvalue(), "json": meta}


def write_sample(tar: tarfile.TarFile, sample: dict) -> dict:
    """Append one sample to an open tar as `<key>.<ext>` members, extensions sorted.

    Headers are fixed (mtime 0, uid/gid 0, owner "refusion", mode 0644, USTAR) so equal
    samples give equal bytes; this is the layout webdataset's TarWriter writes (without its
    per-member PAX headers, which cost more than the samples here).

    Returns:
        `{"start": offset of the sample's first header, ext: (data offset, size), ...}` in
        bytes from the start of the archive (`TarFile.offset`, which counts what was written),
        for the shard's sample index (`pipeline.data.sample_index`).
    """
    key = sample["__key__"]
    where = {"start": tar.offset}
    for ext in sorted(k for k in sample if k != "__key__"):
        data = sample[ext]
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = "refusion"
        tar.addfile(info, io.BytesIO(data))
        where[ext] = (tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE, len(data))
    tar.members.clear()  # TarFile keeps every TarInfo it wrote (~300 B each); we never read them
    return where



@dataclass
class Item:
    """One tokenized unit: a query/response pair or one chunk of a text document."""
    split: str
    record: int       # index of the record within its split (after dedup), for resume
    chunk: int        # chunk index within the record (0 unless a long text was split)
    key: str
    ids: np.ndarray   # uint32[n]
    prompt_length: int



class TextChunks:
    """The items of one text document whose tokens arrive in pieces, in order.

    The document's sample tokens are `encode(text) + [eos]`; with `long_text="split"` they are
    cut into consecutive `max_length`-token chunks (the last may be shorter), each an item
    with prompt length 0, returned as soon as they are complete (`add`) and at the end
    (`finish`); only the incomplete tail (< max_length tokens) is held. With `"skip"` the one
    chunk is returned by `finish`, or "over_length" when the document has more than
    `max_length - 1` tokens (then nothing beyond max_length tokens is held). `emitted`: chunks
    returned so far (the next chunk's index within the document).
    """

    def __init__(self, max_length: int, long_text: str):
        self.max_length, self.split = max_length, long_text == "split"
        self.parts: list[np.ndarray] = []
        self.n, self.over, self.emitted = 0, False, 0

    def add(self, ids: np.ndarray) -> list[np.ndarray]:
        """Take the next piece's ids (uint32[n]); return the chunks completed by it."""
        if self.over or not len(ids):
            return []
        self.parts.append(ids)
        self.n += len(ids)
        if not self.split:
            if self.n + 1 > self.max_length:
                self.over, self.parts = True, []
            return []
        if self.n < self.max_length:
            return []
        arr, L = np.concatenate(self.parts), self.max_length
        k = len(arr) // L
        rest = arr[k * L:].copy()
        self.parts, self.n = ([rest] if len(rest) else []), len(rest)
        self.emitted += k
        return [arr[i * L:(i + 1) * L] for i in range(k)]

    def finish(self, eos_id: int) -> list[np.ndarray] | str:
        """The remaining chunks (the last ends with `eos_id`), or "over_length" (skip mode)."""
        if self.over:
            return "over_length"
        arr = np.concatenate(self.parts + [np.array([eos_id], dtype=np.uint32)])
        self.parts, self.n = [], 0
        L = self.max_length
        out = [arr[i:i + L] for i in range(0, len(arr), L)]
        self.emitted += len(out)
        return out


# ----------------------------------------------------------------------------- output

FULL_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}


class OutputError(Exception):
    """The output folder cannot be used (bad URL, missing filesystem package, not creatable);
    one-line message, exit code 2."""


class OutputFull(Exception):
    """The output filesystem is full (ENOSPC) or over quota (EDQUOT); one-line message naming
    the folder, the file being written, the cause and the free space seen. Exit code 4
    (`pipeline.common.cli.EXIT_DISK_FULL`)."""


def full_disk_error(out: "Output", error: BaseException) -> OutputFull | None:
    """An `OutputFull` for `error` when it (or its cause) is ENOSPC / EDQUOT, else None."""
    e = error
    while e is not None and not (isinstance(e, OSError) and e.errno in FULL_ERRNOS):
        e = e.__cause__ or e.__context__
    if e is None:
        return None
    free = ""
    if out.local:
        try:
            free = f", {shutil.disk_usage(out.root).free} bytes free"
        except OSError:
            pass
    where = f" while writing {out.current}" if out.current else ""
    return OutputFull(f"output {out.url}: {FULL_ERRNOS[e.errno]}{where}{free}; complete shards "
                      "are kept and the partial file was removed: free space (or raise the quota) "
                      "and rerun the same command to resume")


class Output:
    """The output folder (local path or fsspec URL); every write is temp-name + rename, and a
    failed write removes its temporary file. `current`: the name being written (messages)."""

    def __init__(self, url: str):
        self.url, self.current = url, None
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as e:
            from data_prep.sources import missing_fs_package
            raise OutputError(f"output {url}: {missing_fs_package(url, e)}")
        self.root = self.root.rstrip("/") or "/"
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")
        if protocol in ("http", "https"):
            raise OutputError(f"output {url}: http(s):// is read-only; write the shards to a "
                              "local folder, s3:// or gs:// (and serve that folder over HTTP)")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except (OSError, NotImplementedError) as e:  # NotImplementedError: read-only (http)
            raise OutputError(f"output {url}: cannot create ({type(e).__name__}"
                              f"{': ' + str(e) if str(e) else ''}; is this filesystem writable?)")

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(self.path(name)))
        except (FileNotFoundError, OSError):
            return None

    def read_json(self, name: str):
        with self.fs.open(self.path(name), "rb") as f:
            return json.loads(f.read().decode("utf-8"))

    def tmp_name(self, name: str) -> str:
        return f"{name}.tmp-{os.getpid()}"

    def commit(self, tmp: str, name: str) -> None:
        if self.local:  # atomic replace
            os.replace(self.path(tmp), self.path(name))
            return
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name))
        self.fs.mv(self.path(tmp), self.path(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self.tmp_name(name)
        self.current = name
        if "/" in name:
            self.fs.makedirs(self.path(name.rsplit("/", 1)[0]), exist_ok=True)
        try:
            with self.fs.open(self.path(tmp), "wb") as f:
                f.write(data)
        except BaseException:
            self.discard(tmp)
            raise
        self.commit(tmp, name)
        self.current = None

    def discard(self, name: str) -> None:
        """Remove `name` if it exists, ignoring errors (cleanup after a failed write)."""
        try:
            self.remove(name)
        except OSError:
            pass

    def write_json(self, name: str, obj) -> None:
        self.write_bytes(name, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())

    def remove(self, name: str) -> None:
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)

    def remove_stale_temps(self) -> None:
        for p in self.fs.find(self.root, maxdepth=2):
            if ".tmp-" in p.rsplit("/", 1)[-1]:
                self.fs.rm(p)


def index_entry(name: str, data: bytes) -> dict:
    """The manifest's `index` field of a shard whose sample index `name` holds `data`:
    `{"name", "bytes", "sha256", "version"}` (`version`: the layout version, byte 7 of `data`;
    manifests written before version 2 have no `version`, meaning 1)."""
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "version": int(data[7])}


class _HashingFile:
    """File wrapper counting bytes and sha256 of what is written, and the digest
    (`sample_index.sample_digest`) of each sample range announced with `sample(start, end)`.

    The tar stream buffers what it writes, so a sample's bytes may reach this file before or
    after `sample` is called for it: the bytes from the end of the last digested sample on are
    kept (one sample plus the stream's 10 KiB buffer) until its digest can be taken."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.buf, self.buf_off = bytearray(), 0
        self.pending: collections.deque = collections.deque()   # (start, end) not digested yet
        self.digests: list[int] = []

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.buf += data
        self._digest_ready()
        return self.f.write(data)

    def tell(self) -> int:
        return self.size

    def sample(self, start: int, end: int) -> None:
        """Announce the next sample's byte range `[start, end)` (in order, not overlapping)."""
        self.pending.append((start, end))
        self._digest_ready()

    def _digest_ready(self) -> None:
        while self.pending and self.pending[0][1] <= self.size:
            start, end = self.pending.popleft()
            with memoryview(self.buf) as view:
                self.digests.append(sample_index.sample_digest(
                    view[start - self.buf_off:end - self.buf_off]))
            del self.buf[:end - self.buf_off]
            self.buf_off = end


class SplitWriter:
    """Packs items of one split into samples and samples into shards (see module docstring).

    entries: the split's complete shards so far (`{"name", "samples", "tokens", "bytes",
    "sha256", "next": [record, chunk], "skipped": {reason: n}}`), `next` being the position
    of the first item not held by this or an earlier shard. Shards are named
    `<prefix><split>-NNNNNN.tar`. Each segment of a packed sample of two or more items also
    carries its item's key (`"key"`), so the merge can take a packed sample apart and pack it
    again without a duplicate (data_prep/merge.py). `flush_pack` ends the sample being packed
    (at a work unit's end: a pack never spans two units, data_prep/plan.py).
    """

    def __init__(self, split: str, out: Output, opts: dict, entries: list[dict], on_close,
                 prefix: str = ""):
        self.split, self.out, self.opts, self.on_close = split, out, opts, on_close
        self.prefix = prefix
        self.entries = list(entries)
        last = self.entries[-1] if self.entries else {"next": [0, 0], "skipped": {}}
        self.start = tuple(last["next"])
        self.last_pos = self.start
        self.skipped = collections.Counter(last["skipped"])  # committed (held before `next`)
        self.pending_skips: list[tuple[int, str]] = []
        self.buf: list[Item] = []
        self.buf_len = 0
        self.tar = None
        self.pack_keys = DigestSet()  # packed keys, ~16 bytes each
        self.written_samples = 0

    # items and skips arrive in record order
    def skip(self, record: int, reason: str) -> None:
        self.pending_skips.append((record, reason))

    def add(self, item: Item) -> None:
        if not self.opts["pack"]:
            self._emit([item])
            return
        if self.buf and self.buf_len + len(item.ids) > self.opts["max_length"]:
            self._flush_pack()
        self.buf.append(item)
        self.buf_len += len(item.ids)

    def flush_pack(self) -> None:
        """Write the sample being packed now (the next item starts a new one)."""
        self._flush_pack()

    def finish(self) -> None:
        self._flush_pack()
        if self.tar is not None:
            self._close_shard()

    def abort(self) -> None:
        """Drop the open shard (its temporary file) after an error or a requested stop. The
        tar is not finished (that would write more to a full disk); close errors are ignored."""
        if self.tar is not None:
            # mark the tar and its stream closed so their finalizers write nothing either
            self.tar.closed = True
            if hasattr(self.tar.fileobj, "closed"):
                self.tar.fileobj.closed = True
            self.tar = None
            try:
                self.cur_file.close()
            except OSError:
                pass
            self.out.discard(self.cur_tmp)

    def skipped_total(self) -> collections.Counter:
        c = collections.Counter(self.skipped)
        c.update(reason for _, reason in self.pending_skips)
        return c

    def _flush_pack(self) -> None:
        if self.buf:
            items = self.buf
            self.buf, self.buf_len = [], 0
            self._emit(items)

    def _next_pos(self) -> tuple[int, int]:
        return (self.buf[0].record, self.buf[0].chunk) if self.buf else self.last_pos

    def _emit(self, items: list[Item]) -> None:
        if len(items) == 1:
            key = items[0].key  # a record key: unique, checked by the reader's DigestSet
        else:
            digest = hashlib.sha256("|".join(i.key for i in items).encode()).digest()
            key = "p" + digest.hex()[:_KEY_HEX]
            if self.pack_keys.add(digest[:16]) != "new":
                raise RuntimeError(f"duplicate sample key {key} (hash collision); report this")
        tokens = np.concatenate([i.ids for i in items])
        segments = make_segments([(len(i.ids), i.prompt_length) for i in items], key,
                                 self.opts["seed"], tuple(self.opts["slot_sizes"]))
        if len(items) > 1:
            for seg, item in zip(segments, items):
                seg["key"] = item.key
        sample = encode_sample(key, tokens, segments)
        if self.tar is None:
            self._open_shard()
        where = write_sample(self.tar, sample)
        self.cur_index.append((where["start"], *where["tokens.npy"], *where["json"], int(tokens.size)))
        self.cur_layout.append((sample_index.key_hash(key), sample_index.slot_runs(segments)))
        self.cur_hash.sample(where["start"], max(a + n for a, n in (where["tokens.npy"], where["json"])))
        self.cur_samples += 1
        self.cur_tokens += int(tokens.size)
        self.cur_bytes += sum(512 + -(-len(v) // 512) * 512 for k, v in sample.items() if k != "__key__")
        self.last_pos = (items[-1].record, items[-1].chunk + 1)
        if (self.cur_samples >= self.opts["shard_samples"]
                or self.cur_bytes >= self.opts["shard_bytes"]):
            self._close_shard()

    def _open_shard(self) -> None:
        self.cur_name = f"{self.prefix}{self.split}-{len(self.entries):06d}.tar"
        self.cur_tmp = self.out.tmp_name(self.cur_name)
        self.out.current = self.cur_name
        self.cur_file = self.out.fs.open(self.out.path(self.cur_tmp), "wb")
        self.cur_hash = _HashingFile(self.cur_file)
        self.tar = tarfile.open(fileobj=self.cur_hash, mode="w|", format=tarfile.USTAR_FORMAT)
        self.cur_samples = self.cur_tokens = self.cur_bytes = 0
        self.cur_index = []
        self.cur_layout = []   # (key hash, slot runs) per sample: the index's slot layouts

    def _close_shard(self) -> None:
        self.tar.close()
        self.cur_file.close()
        self.tar = None
        # the sample index first: a shard whose entry is recorded always has its index
        if len(self.cur_hash.digests) != len(self.cur_index):
            raise RuntimeError(f"{self.cur_name}: {len(self.cur_hash.digests)} sample digests for "
                               f"{len(self.cur_index)} samples; report this")
        index = sample_index.encode(np.array(
            [(*row, d) for row, d in zip(self.cur_index, self.cur_hash.digests)],
            dtype=sample_index.DTYPE), sample_index.SlotLayout.of_samples(self.cur_layout))
        self.cur_index, self.cur_layout = [], []
        index_name = sample_index.index_name(self.cur_name)
        self.out.write_bytes(index_name, index)
        self.out.current = self.cur_name
        self.out.commit(self.cur_tmp, self.cur_name)
        self.out.current = None
        nxt = self._next_pos()
        keep = []
        for record, reason in self.pending_skips:
            if record < nxt[0]:
                self.skipped[reason] += 1
            else:
                keep.append((record, reason))
        self.pending_skips = keep
        self.entries.append({"name": self.cur_name, "samples": self.cur_samples,
                             "tokens": self.cur_tokens, "bytes": self.cur_hash.size,
                             "sha256": self.cur_hash.sha.hexdigest(),
                             "index": index_entry(index_name, index), "next": list(nxt),
                             "skipped": dict(sorted(self.skipped.items()))})
        self.written_samples += self.cur_samples
        self.on_close(self)


def index_shards(url: str, log=None) -> tuple[int, int]:
    """`shard.py index DIR`: write the missing sample indexes (`<shard>.idx`,
    `pipeline.data.sample_index`) of a finished shard folder, turn older indexes (version 1:
    no per-sample digests; version 2: no slot layouts) into version 3, and record them in its
    manifest.json.

    Each shard whose manifest entry lacks a valid version-3 index (missing file, other size or
    sha256, a bad layout or sample count, or layout version 1 or 2) gets one: the records of a
    valid older index are kept, otherwise they are built by walking the tar's headers; then one
    sequential read of the shard computes each sample's digest and slot layout (key and
    segments, from its header and json) and the shard's sha256 and size, which must equal the
    manifest's (`sha256`, `bytes`, where recorded), so the digests are those of the shard data
    prep wrote. An index that upgrades a valid older one is written under another name
    (`<shard>.idx`, or `<shard>.v3.idx` when the manifest names that one), and the old file
    is left in place: a loader that read the manifest before, or reads it during the upgrade,
    finds the index its manifest names with the bytes its sha256 says (delete the old files
    once no such loader runs). Each index is written atomically, then the manifest
    (atomically, after every shard, so an interrupted run loses nothing and a rerun skips what
    is done). Shards whose version-3 index is valid are not read: a second run changes
    nothing. A manifest without its checksum (`pipeline.data.format.CHECKSUM_FIELD`) gets
    one. Merged folders (`parts/uNNNNNN/...` names) work the same.

    Args:
        url: the shard folder (local path or fsspec URL).
        log: called with one line per written index (None: quiet).

    Returns:
        (indexes written or upgraded, indexes already valid).

    Raises:
        OutputError: one line: no or unreadable manifest.json, a shard that is missing or
            unreadable, whose sample count differs from the manifest, whose sha256 or size
            differs from the manifest (damaged or replaced; its index is not written), or a
            sample without a key header or valid segments.
    """
    from pipeline.data.format import CHECKSUM_FIELD, DataError, MANIFEST, with_checksum
    from pipeline.data.shard_io import read_manifest
    out = Output(url)
    try:
        manifest = read_manifest(url)
    except DataError as e:
        raise OutputError(str(e)) from None
    written = kept = 0
    for split, entries in manifest["splits"].items():
        for e in entries:
            records, version = _valid_index(out, e)
            if version == sample_index.VERSION:
                kept += 1
                continue
            upgrade = records is not None
            name = sample_index.index_name(e["name"])
            old = e["index"]["name"] if upgrade else None
            if name == old:  # never rewrite a valid index the manifest names (loaders read it)
                name = f"{e['name']}.v{sample_index.VERSION}{sample_index.SUFFIX}"
            path = out.path(e["name"])
            try:
                with out.fs.open(path, "rb") as f:
                    if records is None:
                        records, _ = sample_index.build(f, path)
                        f.seek(0)
                    if len(records) != e.get("samples"):
                        raise OutputError(f"shard {path}: {len(records)} samples, manifest.json "
                                          f"says {e.get('samples')} (damaged or replaced)")
                    layouts = [None] * len(records)

                    def on_sample(i, data, records=records, layouts=layouts):
                        layouts[i] = sample_index.layout_of_sample(records[i], data, path)

                    records, sha, size = sample_index.add_digests(f, records, path, on_sample)
            except FileNotFoundError:
                raise OutputError(f"shard {path}: missing") from None
            except DataError as ex:
                raise OutputError(str(ex)) from None
            want_sha, want_bytes = e.get("sha256"), e.get("bytes")
            if (want_sha and sha != want_sha) or (want_bytes is not None and size != want_bytes):
                raise OutputError(
                    f"shard {path}: sha256 {sha[:16]}... and {size} bytes, manifest.json says "
                    f"{(want_sha or 'none')[:16]}... and {want_bytes} bytes: damaged or replaced "
                    "after data prep; its sample index was not written (re-copy the shard or "
                    "rerun data prep)")
            data = sample_index.encode(records, sample_index.SlotLayout.of_samples(layouts))
            out.write_bytes(name, data)
            e["index"] = index_entry(name, data)
            out.write_json(MANIFEST, with_checksum(manifest))
            written += 1
            if log:
                log(f"{'upgraded' if upgrade else 'wrote'} {out.path(name)} ({len(records)} "
                    f"samples{f', layout version {version} -> {sample_index.VERSION}' if upgrade else ''}"
                    f"{f'; {old} left for loaders that read the manifest before' if upgrade else ''})")
    if CHECKSUM_FIELD not in manifest:   # a folder from before manifests checked themselves
        out.write_json(MANIFEST, with_checksum(manifest))
    return written, kept


def _valid_index(out: Output, entry: dict):
    """(records, layout version) of the shard entry's recorded sample index when it exists
    with its size, sha256 and layout (`sample_index.decode`, any version), else (None, None)."""
    from pipeline.data.format import DataError
    ix = entry.get("index")
    if not isinstance(ix, dict) or not isinstance(ix.get("name"), str):
        return None, None
    try:
        with out.fs.open(out.path(ix["name"]), "rb") as f:
            data = f.read()
        if len(data) != ix.get("bytes") or hashlib.sha256(data).hexdigest() != ix.get("sha256"):
            return None, None
        records = sample_index.decode(data, ix["name"], entry.get("samples"), entry.get("bytes"))
        return records, int(data[7])
    except (OSError, DataError):
        return None, None
