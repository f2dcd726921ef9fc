"""Decontamination at data-prep time (`shard.py --decontaminate FILE[,FILE...]`): a training
record that shares an n-gram of words with an evaluation item is dropped and counted.

Owns: reading evaluation files into items, the n-gram index of their words (`EvalSets`),
matching one training record against it (`Match`), the spec a run records
(`options["decontaminate"]`, part of the resume fingerprint and of the plan) and the manifest's
`decontamination` block (one run's counts; the merge's sum, `merge_blocks`).
Must not touch: where a record is checked (data_prep/prepare.py, `_stage_a`: after reading,
before the duplicate filter), the command line (data_prep/cli.py), the plan and the merge
(data_prep/plan.py, merge.py).

Words, not tokens: a text's words are the runs of `\\w` characters (Unicode letters, digits,
underscore) of its `str.casefold()`; whitespace, punctuation and markup only separate words; no
Unicode normalization (NFC and NFD spellings differ). Words are tokenizer-independent (the
experiment's SentencePiece model and Qwen3 drop the same records, so counts compare across
runs), have no BPE context effects (a token at an item's start changes with a leading space),
and are known before tokenization, which lets the check run before the duplicate filter (so a
job array counts exactly what one process counts). The default n = 13 is the n-gram length of
GPT-3's contamination study; 13 words are about 17 Qwen3 tokens. Scripts written without
spaces (Chinese, Japanese) make a whole run of characters one word: the filter is weak there.

Evaluation files (read whole: evaluation sets are small; uncompressed UTF-8, a leading byte
order mark dropped; local paths or fsspec URLs):
- `.jsonl` / `.json` (JSONL, or one JSON list of records): every string value of each record,
  found through nested objects and lists, is one item (so a `{"query", "response", "answer"}`
  problem gives three items); with `--decontaminate-field F` (repeatable; `a.b` walks into
  nested objects) only those fields' strings, and a record without one is an error.
- any other file: plain text, one item per paragraph (lines up to a blank line).
An item of fewer than n words is not used (counted as `short_items`): matching a short item
whole (an answer `114`, a label `yes`) would drop every record that contains it. A file with
no item of n words is refused, as is a missing, empty, non-UTF-8 or unparsable one (one line
naming the file and, for a bad JSONL line, the line; exit code 2).

Matching: a training record's words are its text's (a text), its query's then its response's
(a pair), its messages' contents in order (a chat); its n-grams run across those strings, an
item's n-grams lie within the item. The record is dropped when one of its n-grams equals one of
an item's; it is counted under every evaluation file holding such an n-gram (so the per-file
counts may add up to more than `skipped.contaminated`, the records dropped).

Index and memory: each word is hashed to 64 bits (BLAKE2b); an n-gram's hash is the polynomial
sum_k h(w_k) * M^(n-1-k) mod 2^64 of its word hashes (vectorized over a record). The index
holds the items' word hashes (uint64 per word), their n-gram hashes sorted (uint64), each
n-gram's position (int64) and a bitmap of the hashes' top bits (>= 32 bits per n-gram, which
rules out ~97 % of a record's n-grams before a binary search): 24.3 bytes per evaluation word,
about 110 at the peak while it is built (`bench/bench_decontaminate.py`, 1.2 M words). A hash
hit is confirmed by comparing the n word hashes, so an n-gram hash collision only costs that
comparison; a false match needs two different words with the same 64-bit word hash in the
same place (about 2^-64 per pair of distinct words). A per-run cache of word hashes (cleared
at 2^20 words) avoids hashing frequent words again.
Speed (same bench, this shared 2-core machine, three runs): 14-20 MB of text per CPU second
for whole files, 9.5-13.8 for 200-word records, in data prep's main process; SentencePiece
encodes ~4 MB per CPU second, the Qwen3 tokenizer ~1.4, so the check costs a main process
7-15 % of one Qwen3 tokenizer process's time per byte.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from typing import Iterable

import numpy as np

from data_prep.sources import BOM, InputError, url_to_fs

DEFAULT_NGRAM = 13
JSON_EVAL_EXTS = (".jsonl", ".json")
_WORD = re.compile(r"\w+")
_WORD_ASCII = re.compile(r"\w+", re.ASCII)  # the same words in ASCII text, ~1.5x faster
_M = np.uint64(0x9E3779B97F4A7C15)    # odd multiplier of the n-gram polynomial
_CACHE_MAX = 1 << 20                  # word hashes cached before the cache is cleared
_FLUSH_WORDS = 1 << 16                # words of a streamed record checked at a time
_CARRY_MAX = 1 << 20                  # a longer run of word characters is cut at a block end
_BITS_PER_GRAM = 32                   # bitmap bits per evaluation n-gram (at least)
REASON = "contaminated"               # the skip reason of a dropped record


class EvalSetError(InputError):
    """An evaluation file that cannot be used (missing, empty, unparsable, changed since the
    plan); one-line message naming it, exit code 2."""


def _findall(text: str) -> list[str]:
    return (_WORD_ASCII if text.isascii() else _WORD).findall(text)


def words(text: str) -> list[str]:
    """The words of `text` (module docstring): runs of `\\w` in its casefold."""
    return _findall(text.casefold())


class _WordHashes(dict):
    """word -> 64-bit BLAKE2b hash, computed on first use."""

    def __missing__(self, word: str) -> int:
        v = int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"),
                                           digest_size=8).digest(), "little")
        self[word] = v
        return v

    def of(self, ws: list[str]) -> np.ndarray:
        """uint64[len(ws)] word hashes."""
        if len(self) > _CACHE_MAX:
            self.clear()
        return np.fromiter(map(self.__getitem__, ws), np.uint64, len(ws))


def ngram_hashes(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64[len(wh) - n + 1] polynomial hashes of the n-grams of word hashes `wh`
    (uint64[L], L >= n)."""
    m = wh.size - n + 1
    h = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * _M + wh[k:k + m]
    return h


def split_files(values: list[str] | None) -> list[str]:
    """The evaluation files of repeated, comma-separated `--decontaminate` values, in order."""
    return [p for v in values or [] for p in v.split(",") if p]


def file_name(path: str) -> str:
    """The name a file is recorded under: the absolute path of a local file, a URL as given."""
    return path if "://" in path else os.path.abspath(path)


def _read(name: str) -> bytes:
    fs, path = url_to_fs(name, what="--decontaminate")
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise EvalSetError(f"--decontaminate {name}: no such file") from None
    except (OSError, ValueError) as e:
        raise EvalSetError(f"--decontaminate {name}: cannot be read ({type(e).__name__}: "
                           f"{e})") from None


def _strings(value) -> Iterable[str]:
    """Every string in a JSON value (through objects and lists), in order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _field(record, path: str):
    for part in path.split("."):
        if not isinstance(record, dict) or part not in record:
            return None
        record = record[part]
    return record


def _items(name: str, raw: bytes, fields: list[str] | None) -> Iterable[tuple[int, str]]:
    """(line number, item text) of an evaluation file's bytes (module docstring)."""
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    try:
        text = codecs.decode(raw, "utf-8")
    except UnicodeDecodeError as e:
        raise EvalSetError(f"--decontaminate {name}: not UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise EvalSetError(f"--decontaminate {name}: empty file")
    if not name.lower().endswith(JSON_EVAL_EXTS):
        line, para, start = 0, [], 1
        for line, ln in enumerate(text.splitlines() + [""], start=1):
            if ln.strip():
                if not para:
                    start = line
                para.append(ln)
            elif para:
                yield start, "\n".join(para)
                para = []
        return
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except ValueError as e:
            raise EvalSetError(f"--decontaminate {name}: not a JSON list or JSONL ({e})") from None
        numbered = [(i + 1, r) for i, r in enumerate(records)]
        where = "record"
    else:
        numbered = []
        for i, ln in enumerate(text.splitlines(), start=1):
            if not ln.strip():
                continue
            try:
                numbered.append((i, json.loads(ln)))
            except ValueError as e:
                raise EvalSetError(f"--decontaminate {name}:{i}: not a JSON line ({e})") from None
        where = "line"
    for i, record in numbered:
        if not fields:
            for s in _strings(record):
                yield i, s
            continue
        for f in fields:
            v = _field(record, f)
            if v is None:
                raise EvalSetError(f"--decontaminate {name}: {where} {i} has no field "
                                   f"{json.dumps(f)} (--decontaminate-field)")
            for s in _strings(v):
                yield i, s


class EvalSets:
    """The n-gram index of the items of the evaluation files (module docstring).

    Args:
        names: evaluation files (paths or URLs), as `file_name` records them.
        ngram: n, words per n-gram (>= 1).
        fields: JSONL fields to read (None: every string value).
        expected: {name: sha256 hex} a plan recorded; a file whose bytes differ raises
            EvalSetError naming it.

    Attributes: `spec` (the recorded options: `{"ngram", "fields", "files": [{"name",
    "sha256"}]}`), `files` (per file `{"sha256", "items", "short_items"}`, in order).
    Raises EvalSetError for a missing, unreadable, empty or unparsable file, a file named twice,
    and a file without an item of `ngram` words.
    """

    def __init__(self, names: list[str], ngram: int = DEFAULT_NGRAM,
                 fields: list[str] | None = None, expected: dict | None = None):
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise EvalSetError(f"--decontaminate {dup}: given twice")
        self.n, self.names, self.fields = ngram, list(names), list(fields) if fields else None
        self.hashes = _WordHashes()
        self.files: list[dict] = []
        word_parts, gram_parts, pos_parts = [], [], []
        item_starts, item_lines, file_starts = [], [], []
        total = 0
        for name in self.names:
            raw = _read(name)
            sha = hashlib.sha256(raw).hexdigest()
            if expected is not None and expected.get(name) != sha:
                raise EvalSetError(f"--decontaminate {name}: changed since the plan (sha256 "
                                   f"{sha[:12]}, the plan's {str(expected.get(name))[:12]}); make "
                                   "a new plan (`shard.py plan ... --overwrite`) and run every "
                                   "task again")
            file_starts.append(total)
            items = short = 0
            for line, text in _items(name, raw, self.fields):
                ws = words(text)
                if len(ws) < ngram:
                    short += bool(ws)
                    continue
                wh = self.hashes.of(ws)
                word_parts.append(wh)
                gram_parts.append(ngram_hashes(wh, ngram))
                pos_parts.append(np.arange(total, total + wh.size - ngram + 1, dtype=np.int64))
                item_starts.append(total)
                item_lines.append(line)
                total += wh.size
                items += 1
            if not items:
                raise EvalSetError(f"--decontaminate {name}: no item of {ngram} or more words "
                                   f"({short} shorter); lower --decontaminate-ngram or leave "
                                   "the file out")
            self.files.append({"sha256": sha, "items": items, "short_items": short})
        self.words = np.concatenate(word_parts) if word_parts else np.zeros(0, np.uint64)
        grams = np.concatenate(gram_parts) if gram_parts else np.zeros(0, np.uint64)
        pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
        order = np.argsort(grams, kind="stable")
        self.grams, self.pos = grams[order], pos[order]
        # a bitmap of the n-gram hashes' top bits (>= 32 bits per n-gram): most n-grams of a
        # record are ruled out by one look-up in it instead of a binary search of `grams`
        self.bits = max(10, int(max(1, grams.size) * _BITS_PER_GRAM - 1).bit_length())
        self.bitmap = np.zeros(1 << (self.bits - 3), np.uint8)
        top = (grams >> np.uint64(64 - self.bits)).astype(np.int64)
        np.bitwise_or.at(self.bitmap, top >> 3, (1 << (top & 7)).astype(np.uint8))
        self.item_starts = np.array(item_starts, np.int64)
        self.item_lines = item_lines
        self.file_starts = np.array(file_starts, np.int64)
        self.spec = {"ngram": ngram, "fields": self.fields,
                     "files": [{"name": n, "sha256": f["sha256"]}
                               for n, f in zip(self.names, self.files)]}

    @classmethod
    def from_args(cls, args) -> "EvalSets | None":
        """The evaluation sets of parsed shard.py options (None without `--decontaminate`)."""
        files = split_files(getattr(args, "decontaminate", None))
        if not files:
            return None
        return cls([file_name(f) for f in files],
                   getattr(args, "decontaminate_ngram", None) or DEFAULT_NGRAM,
                   getattr(args, "decontaminate_field", None))

    @classmethod
    def from_spec(cls, spec: dict) -> "EvalSets":
        """The evaluation sets a plan recorded (`spec`); a file changed since raises
        EvalSetError."""
        return cls([f["name"] for f in spec["files"]], spec["ngram"], spec["fields"],
                   expected={f["name"]: f["sha256"] for f in spec["files"]})

    def nbytes(self) -> int:
        """Bytes held by the index arrays."""
        return int(self.words.nbytes + self.grams.nbytes + self.pos.nbytes + self.bitmap.nbytes)

    def candidates(self, h: np.ndarray) -> np.ndarray:
        """Indices into `h` (uint64[m] n-gram hashes) of the hashes present in the index."""
        top = (h >> np.uint64(64 - self.bits)).astype(np.int64)
        maybe = np.nonzero((self.bitmap[top >> 3] >> (top & 7).astype(np.uint8)) & 1)[0]
        if not maybe.size:
            return maybe
        lo = np.searchsorted(self.grams, h[maybe], "left")
        inside = lo < self.grams.size
        maybe, lo = maybe[inside], lo[inside]
        return maybe[self.grams[lo] == h[maybe]]

    def matcher(self) -> "Match":
        """A `Match` for one training record."""
        return Match(self)

    def block(self, dropped: dict) -> dict:
        """The manifest's `decontamination` block; `dropped`: {file index: records dropped}."""
        return {"ngram": self.n, "fields": self.fields,
                "files": {n: {**f, "dropped_documents": int(dropped.get(i, 0))}
                          for i, (n, f) in enumerate(zip(self.names, self.files))}}


class Match:
    """Matching of one training record's strings against `EvalSets` (module docstring).

    `feed(text, final)` takes a string (`final=True`) or the next block of a streamed one
    (`final=False` keeps a word cut by the block's end for the next block); `finish()` checks
    what is left and returns the set of evaluation file indices hit; `where` describes the
    first hit (None without one).
    """

    def __init__(self, ev: EvalSets):
        self.ev = ev
        self.carry = ""
        self.pending: list[str] = []
        self.tail_words: list[str] = []
        self.tail = np.zeros(0, np.uint64)
        self.files: set[int] = set()
        self.where: str | None = None

    def feed(self, text: str, final: bool = True) -> None:
        text = self.carry + text.casefold()
        self.carry = ""
        if not final:
            cut = len(text)
            while cut and (text[cut - 1].isalnum() or text[cut - 1] == "_"):
                cut -= 1
            if len(text) - cut <= _CARRY_MAX:  # longer: a word as long as a block is cut
                self.carry, text = text[cut:], text[:cut]
        self.pending += _findall(text)
        if len(self.pending) >= _FLUSH_WORDS:
            self._check()

    def finish(self) -> set[int]:
        if self.carry:
            self.pending += _findall(self.carry)
            self.carry = ""
        self._check()
        return self.files

    def _check(self) -> None:
        ev, n = self.ev, self.ev.n
        ws, self.pending = self.pending, []
        if not ws or len(self.files) == len(ev.names):
            return
        if len(ws) + self.tail.size < n:
            self.tail_words += ws
            self.tail = np.concatenate([self.tail, ev.hashes.of(ws)])
            return
        wh = np.concatenate([self.tail, ev.hashes.of(ws)])
        ws = self.tail_words + ws
        keep = wh.size - (n - 1)
        self.tail, self.tail_words = wh[keep:], ws[keep:]
        h = ngram_hashes(wh, n)
        hit = ev.candidates(h)
        if not hit.size:
            return
        lo = np.searchsorted(ev.grams, h[hit], "left")
        hi = np.searchsorted(ev.grams, h[hit], "right")
        steps = np.arange(n)
        for i, a, b in zip(hit.tolist(), lo.tolist(), hi.tolist()):
            pos = ev.pos[a:b]
            same = pos[(ev.words[pos[:, None] + steps] == wh[i:i + n]).all(axis=1)]
            if not same.size:
                continue  # an n-gram hash collision
            for f in np.unique(np.searchsorted(ev.file_starts, same, "right") - 1).tolist():
                self.files.add(f)
            if self.where is None:
                p = int(same[0])
                item = int(np.searchsorted(ev.item_starts, p, "right")) - 1
                f = int(np.searchsorted(ev.file_starts, p, "right")) - 1
                self.where = (f"shares the {n}-word sequence \"{' '.join(ws[i:i + n])}\" with "
                              f"{ev.names[f]}:{ev.item_lines[item]}")
            if len(self.files) == len(ev.names):
                return


def merge_blocks(spec: dict, blocks: list[dict]) -> dict:
    """The `decontamination` block of a merged folder: the parts' blocks (made with `spec`,
    the plan's) with `dropped_documents` summed per file."""
    files = {}
    for f in spec["files"]:
        parts = [b["files"][f["name"]] for b in blocks]
        first = parts[0] if parts else {"items": 0, "short_items": 0}
        files[f["name"]] = {"sha256": f["sha256"], "items": first["items"],
                            "short_items": first["short_items"],
                            "dropped_documents": sum(int(p["dropped_documents"]) for p in parts)}
    return {"ngram": spec["ngram"], "fields": spec["fields"], "files": files}


def describe(block: dict) -> str:
    """`decontamination (13-word n-grams): test.jsonl 2, dev.jsonl 0 record(s) dropped`."""
    per = ", ".join(f"{name.rsplit('/', 1)[-1]} {f['dropped_documents']}"
                    for name, f in block["files"].items())
    return f"decontamination ({block['ngram']}-word n-grams): records sharing one with {per}"
