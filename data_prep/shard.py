"""`python data_prep/shard.py`: tokenize a corpus into ReFusion webdataset shards.

Owns: the shard-writing pipeline (read -> normalize -> dedup -> split -> tokenize -> chunk or
pack -> slot boundaries -> tar shards + manifest.json), its CLI, resume and the summary line.
Must not touch: the objective (pipeline/objective.py reorganizes slots at training time) or
the loader (pipeline/data.py reads what this writes). The output format is ARCHITECTURE.md
"Shard format".

Determinism (reruns are byte-identical, whatever `--workers`):
- a record's identity is the sha256 of its normalized content; exact duplicates are dropped;
- sample key = the first 20 hex digits of that digest (`-<chunk>` appended for the 2nd.. chunk
  of a long text); a packed sample's key is `p` + 20 hex digits of the sha256 of its members'
  keys. Keys are unique (checked) and have no dots;
- split: a record goes to `val` when the first 8 bytes of its digest, as an integer, are
  below `val_fraction * 2**64` (stable across seeds and input order);
- slot size of segment j of sample `key` = `slot_sizes[u % len(slot_sizes)]`,
  u = first 8 bytes (little endian) of sha256(f"{seed}:{key}:{j}");
- samples keep input order; tar members have mtime 0, fixed owner and mode (USTAR).
Resume: a shard is written to a temporary name and renamed when complete, then listed in
`manifest.partial.json` with the input position that follows it. A rerun with the same
options keeps every listed shard whose file exists with the recorded size, skips the input
records those shards hold (they are not tokenized again), and writes the rest. The partial
manifest is replaced by `manifest.json` at the end. (A resumed run still reads and hashes
every input record, which is cheap next to tokenization, so duplicates and splits come out
the same.) The hidden option `--stop-after-shards N` stops as if killed after N shards, for
resume tests. Memory: the duplicate filter keeps 16 bytes per accepted record.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import os
import signal
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's data_prep package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import fsspec
import numpy as np

from data_prep.sources import (Fields, InputError, OneLineParser, Source, iter_records, normalize,
                               resolve_inputs)
from data_prep.tokenizer_io import Tokenizer, TokenizerError, load_tokenizer

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
_KEY_HEX = 20  # 80-bit keys


class UserError(Exception):
    """A problem with the user's options or output folder; one-line message, exit code 2."""


class NoSamples(Exception):
    """Every record was skipped (or there were none): nothing to train on; exit code 1."""


def _check_not_empty(manifest: dict) -> None:
    """Raise NoSamples (naming the skip counts) when `manifest` lists no sample in any split."""
    if any(e["samples"] for split in SPLITS for e in manifest["splits"][split]):
        return
    skipped = manifest["skipped"]
    n = sum(skipped.values())
    if not n:
        raise NoSamples("no samples written: the inputs hold no records")
    reasons = ", ".join(f"{k} {v}" for k, v in skipped.items())
    raise NoSamples(f"no samples written: all {n} records skipped ({reasons})")


# ----------------------------------------------------------------------------- pure helpers

def record_digest(kind: str, parts: tuple[str, ...]) -> bytes:
    """sha256 of a normalized record: `kind`, then each part, NUL-separated (UTF-8)."""
    h = hashlib.sha256(kind.encode())
    for p in parts:
        h.update(b"\0" + p.encode("utf-8"))
    return h.digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """"val" when int(digest[:8], big endian) < val_fraction * 2**64, else "train"."""
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2.0 ** 64 else "train"


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


def write_sample(tar: tarfile.TarFile, sample: dict) -> None:
    """Append one sample to an open tar as `<key>.<ext>` members, extensions sorted.

    Headers are fixed (mtime 0, uid/gid 0, owner "refusion", mode 0644, USTAR) so equal
    samples give equal bytes; this is the layout webdataset's TarWriter writes (without its
    per-member PAX headers, which cost more than the samples here).
    """
    key = sample["__key__"]
    for ext in sorted(k for k in sample if k != "__key__"):
        data = sample[ext]
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = "refusion"
        tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------- tokenization

@dataclass
class Item:
    """One tokenized unit: a query/response pair or one chunk of a text document."""
    split: str
    record: int       # index of the record within its split (after dedup), for resume
    chunk: int        # chunk index within the record (0 unless a long text was split)
    key: str
    ids: np.ndarray   # uint32[n]
    prompt_length: int


def tokenize_record(tok: Tokenizer, kind: str, payload: tuple[str, ...], max_length: int,
                    long_text: str) -> list[tuple[np.ndarray, int]] | str:
    """Token chunks `[(uint32[n], prompt_length)]` of one normalized record, or a skip reason.

    qa: one chunk `prompt + response + [eos]`; longer than max_length -> "over_length".
    text: `encode(text) + [eos]`; when longer than max_length it is cut into consecutive
    max_length-token chunks (long_text="split") or skipped as "over_length" ("skip").
    """
    if kind == "qa":
        ids, p = tok.qa_sample(*payload)
        if len(ids) > max_length:
            return "over_length"
        return [(np.asarray(ids, dtype=np.uint32), p)]
    ids, _ = tok.text_sample(payload[0])
    if len(ids) > max_length and long_text == "skip":
        return "over_length"
    arr = np.asarray(ids, dtype=np.uint32)
    return [(arr[i:i + max_length], 0) for i in range(0, len(arr), max_length)]


_WORKER: dict = {}


def _init_worker(tokenizer_path: str | None) -> None:
    """Pool worker set-up: Ctrl-C is left to the parent (which stops the pool and reports it
    in one line); spawned workers load the tokenizer, forked ones inherit it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if tokenizer_path is not None:
        _WORKER["tok"] = load_tokenizer(tokenizer_path)


def _tokenize_batch(batch, max_length: int, long_text: str, tok: Tokenizer | None = None):
    tok = tok or _WORKER["tok"]
    return [tokenize_record(tok, kind, payload, max_length, long_text)
            for (_, _, _, kind, payload) in batch]


# ----------------------------------------------------------------------------- output

class Output:
    """The output folder (local path or fsspec URL); every write is temp-name + rename."""

    def __init__(self, url: str):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as e:
            raise UserError(f"output {url}: {e}")
        self.root = self.root.rstrip("/") or "/"
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise UserError(f"output {url}: cannot create ({e})")

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
        if "/" in name:
            self.fs.makedirs(self.path(name.rsplit("/", 1)[0]), exist_ok=True)
        with self.fs.open(self.path(tmp), "wb") as f:
            f.write(data)
        self.commit(tmp, name)

    def write_json(self, name: str, obj) -> None:
        self.write_bytes(name, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())

    def remove(self, name: str) -> None:
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)

    def remove_stale_temps(self) -> None:
        for p in self.fs.find(self.root, maxdepth=2):
            if ".tmp-" in p.rsplit("/", 1)[-1]:
                self.fs.rm(p)


class _HashingFile:
    """File wrapper counting bytes and sha256 of what is written."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.size


class SplitWriter:
    """Packs items of one split into samples and samples into shards (see module docstring).

    entries: the split's complete shards so far (`{"name", "samples", "tokens", "bytes",
    "sha256", "next": [record, chunk], "skipped": {reason: n}}`), `next` being the position
    of the first item not held by this or an earlier shard.
    """

    def __init__(self, split: str, out: Output, opts: dict, entries: list[dict], on_close):
        self.split, self.out, self.opts, self.on_close = split, out, opts, on_close
        self.entries = list(entries)
        last = self.entries[-1] if self.entries else {"next": [0, 0], "skipped": {}}
        self.start = tuple(last["next"])
        self.last_pos = self.start
        self.skipped = collections.Counter(last["skipped"])  # committed (held before `next`)
        self.pending_skips: list[tuple[int, str]] = []
        self.buf: list[Item] = []
        self.buf_len = 0
        self.tar = None
        self.keys: set[str] = set()
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

    def finish(self) -> None:
        self._flush_pack()
        if self.tar is not None:
            self._close_shard()

    def abort(self) -> None:
        """Drop the open shard (its temporary file) after an error or a requested stop."""
        if self.tar is not None:
            self.tar.close()
            self.cur_file.close()
            self.tar = None
            self.out.remove(self.cur_tmp)

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
            key = items[0].key
        else:
            key = "p" + hashlib.sha256("|".join(i.key for i in items).encode()).hexdigest()[:_KEY_HEX]
        if key in self.keys:
            raise RuntimeError(f"duplicate sample key {key} (hash collision); report this")
        self.keys.add(key)
        tokens = np.concatenate([i.ids for i in items])
        segments = make_segments([(len(i.ids), i.prompt_length) for i in items], key,
                                 self.opts["seed"], tuple(self.opts["slot_sizes"]))
        sample = encode_sample(key, tokens, segments)
        if self.tar is None:
            self._open_shard()
        write_sample(self.tar, sample)
        self.cur_samples += 1
        self.cur_tokens += int(tokens.size)
        self.cur_bytes += sum(512 + -(-len(v) // 512) * 512 for k, v in sample.items() if k != "__key__")
        self.last_pos = (items[-1].record, items[-1].chunk + 1)
        if (self.cur_samples >= self.opts["shard_samples"]
                or self.cur_bytes >= self.opts["shard_bytes"]):
            self._close_shard()

    def _open_shard(self) -> None:
        self.cur_name = f"{self.split}-{len(self.entries):06d}.tar"
        self.cur_tmp = self.out.tmp_name(self.cur_name)
        self.cur_file = self.out.fs.open(self.out.path(self.cur_tmp), "wb")
        self.cur_hash = _HashingFile(self.cur_file)
        self.tar = tarfile.open(fileobj=self.cur_hash, mode="w|", format=tarfile.USTAR_FORMAT)
        self.cur_samples = self.cur_tokens = self.cur_bytes = 0

    def _close_shard(self) -> None:
        self.tar.close()
        self.cur_file.close()
        self.tar = None
        self.out.commit(self.cur_tmp, self.cur_name)
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
                             "sha256": self.cur_hash.sha.hexdigest(), "next": list(nxt),
                             "skipped": dict(sorted(self.skipped.items()))})
        self.written_samples += self.cur_samples
        self.on_close(self)


# ----------------------------------------------------------------------------- pipeline

def _options(args, sources: list[Source]) -> dict:
    opts = {
        "inputs": list(args.input), "format": args.format, "max_length": args.max_length,
        "slot_sizes": list(args.slot_sizes), "seed": args.seed,
        "val_fraction": args.val_fraction, "pack": bool(args.pack),
        "long_text": args.long_text, "shard_samples": args.shard_samples,
        "shard_bytes": args.shard_bytes, "limit": args.limit, "dedup": "exact",
        "fields": {"query": args.query_field, "response": args.response_field,
                   "text": args.text_field},
    }
    if any(s.is_stdlib for s in sources):
        opts["stdlib_python"] = sys.version.split()[0]
    return opts


def _fingerprint(opts: dict, tok_json: dict) -> str:
    blob = json.dumps({"options": opts, "tokenizer": tok_json}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


_FLAGS = {"inputs": "--input", "format": "--format", "max_length": "--max-length",
          "slot_sizes": "--slot-sizes", "seed": "--seed", "val_fraction": "--val-fraction",
          "pack": "--pack", "long_text": "--long-text", "shard_samples": "--shard-samples",
          "shard_bytes": "--shard-bytes", "limit": "--limit",
          "fields": "--query-field/--response-field/--text-field",
          "stdlib_python": "stdlib Python version"}


def _differences(m: dict, opts: dict, tok_json: dict) -> str:
    """What differs between a manifest's recorded options/tokenizer and this run's, in words:
    `other options (--seed 0, now 9; ...)` and/or `another tokenizer (...)`."""
    old = m.get("options")
    if not isinstance(old, dict):  # an older partial manifest records only the fingerprint
        return "other options or another tokenizer"
    show = lambda v: json.dumps(v, ensure_ascii=False)
    diffs = [f"{_FLAGS.get(k, k)} {show(old.get(k))}, now {show(opts.get(k))}"
             for k in [*opts, *(k for k in old if k not in opts)] if old.get(k) != opts.get(k)]
    parts = [f"other options ({'; '.join(diffs)})"] if diffs else []
    oldtok = m.get("tokenizer")
    if oldtok != tok_json:
        oldtok = oldtok if isinstance(oldtok, dict) else {}
        desc = lambda t: f"{t.get('name')} hash {str(t.get('hash'))[:12]}"
        parts.append(f"another tokenizer ({desc(oldtok)}, now {desc(tok_json)})")
    return " and ".join(parts) or "other options or another tokenizer"


def _clear(out: Output) -> None:
    """Remove what an earlier run wrote: manifests, `<split>-NNNNNN.tar` shards, tokenizer/."""
    import re
    pattern = re.compile(r"^(%s)-\d{6}\.tar$" % "|".join(SPLITS))
    for p in out.fs.ls(out.root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name in (MANIFEST, PARTIAL, TOKENIZER_DIR) or pattern.match(name):
            out.remove(name)


def _resume_state(out: Output, fingerprint: str, overwrite: bool, opts: dict,
                  tok_json: dict) -> tuple[dict | None, dict]:
    """(complete manifest or None, {split: kept entries}) for this output folder.

    A folder made with the same options (same fingerprint) is kept or resumed. One made with
    other options raises UserError naming the options (or tokenizer) that differ from `opts`
    / `tok_json`, or is cleared first when `overwrite`.
    """
    fresh = None, {s: [] for s in SPLITS}
    for n in (MANIFEST, PARTIAL):
        if not out.exists(n):
            continue
        try:
            m = out.read_json(n)
            what = None if isinstance(m, dict) else "an unreadable manifest (not an object)"
        except (ValueError, OSError) as e:
            m, what = {}, f"an unreadable manifest ({type(e).__name__})"
        if not isinstance(m, dict) or m.get("fingerprint") != fingerprint:
            if overwrite:
                _clear(out)
                return fresh
            what = what or _differences(m, opts, tok_json)
            raise UserError(f"{out.path(n)}: this folder holds shards made with {what}; use "
                            "another --output or pass --overwrite")
        if n == MANIFEST:
            listed = [e for split in SPLITS for e in m.get("splits", {}).get(split, [])]
            if all(out.size(e["name"]) == e.get("bytes") for e in listed):
                return m, {}
            print(f"shard.py: {out.path(MANIFEST)} lists missing or changed shards; rebuilding",
                  file=sys.stderr)
            _clear(out)
            return fresh
        kept = {}
        for split in SPLITS:
            kept[split] = []
            for e in m.get("progress", {}).get(split, []):
                if out.size(e["name"]) != e["bytes"]:
                    break  # missing or partial: redo from here
                kept[split].append(e)
        return None, kept
    return fresh


def _stage_a(sources: list[Source], fmt: str, fields: Fields, val_fraction: float,
             limit: int | None, counts: collections.Counter):
    """Read, normalize, dedup and split records; yields (split, index_in_split, key, kind, payload).

    Skips are added to `counts` by reason.
    """
    seen: set[bytes] = set()
    n_split = {s: 0 for s in SPLITS}
    accepted = 0
    for source in sources:
        for _, raw in iter_records(source, fmt, fields):
            norm = normalize(raw, fmt, fields)
            if norm[0] == "skip":
                counts[norm[1]] += 1
                continue
            kind, payload = norm[0], norm[1:]
            digest = record_digest(kind, payload)
            short = digest[:16]
            if short in seen:
                counts["duplicate"] += 1
                continue
            seen.add(short)
            split = split_of(digest, val_fraction)
            index = n_split[split]
            n_split[split] += 1
            yield split, index, digest.hex()[:_KEY_HEX], kind, payload
            accepted += 1
            if limit is not None and accepted >= limit:
                return


def _batches(stream, resume_from: dict, max_records: int = 256, max_chars: int = 1 << 20):
    batch, chars = [], 0
    for rec in stream:
        split, index = rec[0], rec[1]
        if index < resume_from[split][0]:
            continue  # held by a kept shard: not tokenized again
        batch.append(rec)
        chars += sum(len(p) for p in rec[4])
        if len(batch) >= max_records or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _ordered_results(batches, args, tok: Tokenizer):
    """Yield (batch, results) in input order; a bounded window of batches in flight."""
    if args.workers <= 1:
        for b in batches:
            yield b, _tokenize_batch(b, args.max_length, args.long_text, tok)
        return
    import multiprocessing as mp
    if sys.platform.startswith("linux"):
        # fork: workers inherit the loaded tokenizer (a Qwen3 load costs seconds per process);
        # Rust tokenizer threads are kept off so the children cannot inherit a held lock.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        ctx, init, initargs = mp.get_context("fork"), _init_worker, (None,)
        _WORKER["tok"] = tok
    else:
        ctx, init, initargs = mp.get_context("spawn"), _init_worker, (args.tokenizer,)
    with ctx.Pool(args.workers, initializer=init, initargs=initargs) as pool:
        window = collections.deque()
        for b in batches:
            window.append((b, pool.apply_async(_tokenize_batch, (b, args.max_length, args.long_text))))
            if len(window) >= 2 * args.workers:
                b0, r0 = window.popleft()
                yield b0, r0.get()
        while window:
            b0, r0 = window.popleft()
            yield b0, r0.get()


def _save_tokenizer(out: Output, tok: Tokenizer) -> None:
    with tempfile.TemporaryDirectory() as d:
        files = sorted(tok.save(d))
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out.write_bytes(f"{TOKENIZER_DIR}/{name}", f.read())


def summary(where: str, manifest: dict) -> str:
    """One line: location, samples / tokens / shards per split, skip counts by reason."""
    parts = []
    for split in SPLITS:
        es = manifest["splits"][split]
        parts.append(f"{split} {sum(e['samples'] for e in es)} samples / "
                     f"{sum(e['tokens'] for e in es)} tokens in {len(es)} shard(s)")
    skipped = ", ".join(f"{k} {v}" for k, v in manifest["skipped"].items()) or "none"
    return f"{where}: {'; '.join(parts)}; skipped: {skipped}"


def run(args) -> dict:
    """Run the pipeline for parsed `args`; returns the manifest (also written to the output).

    Raises UserError / InputError / TokenizerError for user errors (one line each), and
    NoSamples after writing the manifest when every record was skipped.
    """
    t0 = time.time()
    tok = load_tokenizer(args.tokenizer)
    sources = resolve_inputs(args.input, output=args.output)
    fields = Fields(args.query_field, args.response_field, args.text_field)
    opts = _options(args, sources)
    tok_json = tok.info.to_json()
    tok_json["files"] = TOKENIZER_DIR
    fingerprint = _fingerprint(opts, tok_json)
    out = Output(args.output)
    done, kept = _resume_state(out, fingerprint, args.overwrite, opts, tok_json)
    if done is not None:
        _check_not_empty(done)
        print(f"shard.py: already complete (same options), kept {summary(args.output, done)}",
              file=sys.stderr)
        return done
    out.remove_stale_temps()
    n_kept = sum(len(v) for v in kept.values())
    if n_kept:
        print(f"shard.py: resuming: keeping {n_kept} complete shard(s)", file=sys.stderr)
    _save_tokenizer(out, tok)

    state = {"closed": 0}

    def on_close(_writer):
        state["closed"] += 1
        out.write_json(PARTIAL, {"fingerprint": fingerprint, "options": opts, "tokenizer": tok_json,
                                 "progress": {s: writers[s].entries for s in SPLITS}})
        if args.stop_after_shards is not None and state["closed"] >= args.stop_after_shards:
            raise _Stop()

    writers = {s: SplitWriter(s, out, opts, kept[s], on_close) for s in SPLITS}
    counts: collections.Counter = collections.Counter()
    stream = _stage_a(sources, args.format, fields, args.val_fraction, args.limit, counts)
    resume_from = {s: writers[s].start for s in SPLITS}
    from tqdm import tqdm
    bar = tqdm(unit="rec", desc="shard", disable=args.no_progress or None, file=sys.stderr)
    try:
        for batch, results in _ordered_results(_batches(stream, resume_from), args, tok):
            for (split, index, key, _, _), res in zip(batch, results):
                w = writers[split]
                if isinstance(res, str):
                    w.skip(index, res)
                    continue
                for c, (ids, p) in enumerate(res):
                    if (index, c) < w.start:
                        continue
                    w.add(Item(split, index, c, key if c == 0 else f"{key}-{c}", ids, p))
            bar.update(len(batch))
        for s in SPLITS:
            writers[s].finish()
    except _Stop:
        print(f"shard.py: stopped after {state['closed']} shard(s) (--stop-after-shards)", file=sys.stderr)
        return {}
    finally:
        bar.close()
        for w in writers.values():
            w.abort()

    skipped = collections.Counter(counts)
    for s in SPLITS:
        skipped.update(writers[s].skipped_total())
    manifest = {
        "format_version": FORMAT_VERSION, "tokenizer": tok_json, "max_length": args.max_length,
        "options": opts,
        "splits": {s: [{k: e[k] for k in ("name", "samples", "tokens", "bytes", "sha256")}
                       for e in writers[s].entries] for s in SPLITS},
        "skipped": dict(sorted(skipped.items())), "fingerprint": fingerprint,
    }
    out.write_json(MANIFEST, manifest)
    out.remove(PARTIAL)
    _check_not_empty(manifest)
    print(f"shard.py: wrote {summary(args.output, manifest)} ({time.time() - t0:.1f} s)",
          file=sys.stderr)
    return manifest


class _Stop(Exception):
    pass


# ----------------------------------------------------------------------------- CLI

def _slot_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slot-sizes {text!r}: expected comma-separated integers")
    if not sizes or any(k < 1 for k in sizes):
        raise argparse.ArgumentTypeError(f"--slot-sizes {text!r}: sizes must be >= 1")
    return sizes


def _size(text: str) -> int:
    units = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}
    t = text.strip().lower().rstrip("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a byte count like 256M")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="shard.py", description="Tokenize inputs into ReFusion webdataset shards "
        "(format: ARCHITECTURE.md 'Shard format').")
    p.add_argument("--input", action="append", required=True, metavar="PATH_GLOB_URL|stdlib",
                   help="input file, folder, glob or fsspec URL (.jsonl/.json/.txt/.parquet); "
                        "'stdlib' = the running interpreter's standard library sources. Repeatable.")
    p.add_argument("--output", required=True, metavar="DIR_OR_URL")
    p.add_argument("--tokenizer", required=True, metavar="HF_DIR_OR_SPM_MODEL")
    p.add_argument("--format", choices=("auto", "qa", "text"), default="auto",
                   help="qa = query/response pairs, text = documents, auto = per record "
                        "(stdlib: auto gives both the files as text and the functions as qa)")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per sample (default 4096)")
    p.add_argument("--slot-sizes", type=_slot_sizes, default=(4, 8, 16, 32))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1 = in-process)")
    p.add_argument("--val-fraction", type=float, default=0.0)
    p.add_argument("--pack", action="store_true", help="pack several items into one sample")
    p.add_argument("--long-text", choices=("split", "skip"), default="split",
                   help="text longer than --max-length: cut into chunks (default) or skip")
    p.add_argument("--shard-samples", type=int, default=100_000, help="samples per shard (max)")
    p.add_argument("--shard-bytes", type=_size, default=_size("256M"), help="bytes per shard (max)")
    p.add_argument("--limit", type=int, default=None, help="stop after N accepted records")
    p.add_argument("--query-field", default="query")
    p.add_argument("--response-field", default="response")
    p.add_argument("--text-field", default="text")
    p.add_argument("--overwrite", action="store_true",
                   help="when --output holds shards made with other options, delete them and "
                        "start over (same options: kept / resumed as usual)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 no sample written, 2 user error,
    130 interrupted by Ctrl-C: complete shards are kept and a rerun resumes)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = []
    if args.max_length < 2:
        problems.append("--max-length must be >= 2")
    if not 0.0 <= args.val_fraction < 1.0:
        problems.append("--val-fraction must be in [0, 1)")
    if args.workers < 1:
        problems.append("--workers must be >= 1")
    if args.shard_samples < 1 or args.shard_bytes < 1:
        problems.append("--shard-samples and --shard-bytes must be >= 1")
    if args.limit is not None and args.limit < 1:
        problems.append("--limit must be >= 1")
    if problems:
        parser.error("; ".join(problems))
    try:
        run(args)
    except (UserError, InputError, TokenizerError) as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return 2
    except NoSamples as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shard.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
