"""`python data_prep/shard.py`: tokenize a corpus into ReFusion webdataset shards.

Owns: the shard-writing pipeline (read -> normalize -> dedup -> split -> tokenize -> chunk or
pack -> slot boundaries -> tar shards + manifest.json), its CLI, resume and the summary line.
Must not touch: the objective (pipeline/objective.py reorganizes slots at training time) or
the loader (pipeline/data/loader.py reads what this writes). The output format is ARCHITECTURE.md
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
resume tests.
Memory: the duplicate filter and the key-collision check share one `data_prep.dedup.DigestSet`
(16-byte digests in a sorted numpy array plus a small buffer); data prep's peak RSS grows by
about 40 bytes per accepted record (measured by `bench/bench_data_prep.py --memory`: 42.7 B
unpacked, 40.2 B packed; before: 462 and 97, a Python set of digests plus a set of keys, and
tarfile's list of every member written to the open shard).
`--limit N` stops after the N-th accepted record (one that is written: after dedup and the
over-length filter), in input order; skip counts cover exactly the records before it.
Special-token strings in content are encoded as text (pipeline/tokenizer.py); records that
held one are counted in manifest["counts"]["special_token_text"].
The output folder's writes: data_prep/writer.py (a full disk or quota: one line, exit code 4,
the partial shard removed, complete shards kept for the rerun).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's data_prep package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from pipeline.common.cli import EXIT_DISK_FULL, EXIT_USAGE
from pipeline.data.format import FORMAT_VERSION, MANIFEST, SPLITS

from data_prep.dedup import DUPLICATE, KEY_COLLISION, DigestSet
from data_prep.sources import (Fields, InputError, OneLineParser, Source, iter_records, normalize,
                               resolve_inputs)
from pipeline.tokenizer import Tokenizer, TokenizerError, load_tokenizer
# the writing half lives in data_prep/writer.py; re-exported names are used by tests/benches
from data_prep.writer import (_KEY_HEX, Item, Output, OutputError, OutputFull, SplitWriter,  # noqa: F401
                              encode_sample, full_disk_error, make_segments, slot_size,
                              write_sample)

PARTIAL = "manifest.partial.json"
TOKENIZER_DIR = "tokenizer"


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


# ----------------------------------------------------------------------------- tokenization


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
    """Results of `tokenize_record` for the records of a batch (None where not tokenized)."""
    tok = tok or _WORKER["tok"]
    return [tokenize_record(tok, r.kind, r.payload, max_length, long_text) if r.tokenize else None
            for r in batch]


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


@dataclass
class Record:
    """One accepted record as it travels from reading to the writers (in input order).

    skips_before: stage-A skip reasons (malformed_json, duplicate, ...) met since the previous
    record; they are counted when this record is consumed, so a `--limit` stop counts exactly
    the records before the stopping point, whatever `--workers`. special_text: the record's
    content holds a special-token string (counted as `special_token_text`). tokenize: False for
    a record held by a kept shard (resume), which is not tokenized again.
    """
    split: str
    index: int      # within its split, after dedup
    key: str
    kind: str       # "qa" | "text"
    payload: tuple
    skips_before: tuple = ()
    special_text: bool = False
    tokenize: bool = True


def _stage_a(sources: list[Source], fmt: str, fields: Fields, val_fraction: float,
             tok: Tokenizer, tail: collections.Counter):
    """Read, normalize, dedup and split records; yields `Record`s in input order.

    Skip reasons met after the last record are added to `tail` when the inputs end. Memory:
    the duplicate filter (`data_prep.dedup.DigestSet`) keeps ~16 bytes per accepted record
    (module docstring).
    """
    seen = DigestSet(width=16, key_bytes=_KEY_HEX // 2)
    n_split = {s: 0 for s in SPLITS}
    skips: list[str] = []
    for source in sources:
        for _, raw in iter_records(source, fmt, fields):
            norm = normalize(raw, fmt, fields)
            if norm[0] == "skip":
                skips.append(norm[1])
                continue
            kind, payload = norm[0], norm[1:]
            digest = record_digest(kind, payload)
            seen_as = seen.add(digest[:16])
            if seen_as == DUPLICATE:
                skips.append("duplicate")
                continue
            if seen_as == KEY_COLLISION:
                raise RuntimeError(f"duplicate sample key {digest.hex()[:_KEY_HEX]} (hash "
                                   "collision); report this")
            split = split_of(digest, val_fraction)
            index = n_split[split]
            n_split[split] += 1
            yield Record(split, index, digest.hex()[:_KEY_HEX], kind, payload, tuple(skips),
                         tok.has_special_text(*payload))
            skips = []
    tail.update(skips)


def _batches(stream, resume_from: dict | None, max_records: int = 256, max_chars: int = 1 << 20):
    """Records in batches for the tokenizer workers; with `resume_from` ({split: (record,
    chunk)}), records before it are marked `tokenize=False` (held by kept shards)."""
    batch, chars = [], 0
    for rec in stream:
        if resume_from is not None and rec.index < resume_from[rec.split][0]:
            rec.tokenize, rec.payload = False, ()  # held by a kept shard: not tokenized again
        batch.append(rec)
        chars += sum(len(p) for p in rec.payload)
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
    special = manifest.get("counts", {}).get("special_token_text", 0)
    note = f"; {special} record(s) held special-token text (encoded as text)" if special else ""
    return f"{where}: {'; '.join(parts)}; skipped: {skipped}{note}"


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
    try:
        _save_tokenizer(out, tok)
    except OSError as e:
        full = full_disk_error(out, e)
        if full is None:
            raise
        raise full from None

    state = {"closed": 0}

    def on_close(_writer):
        state["closed"] += 1
        out.write_json(PARTIAL, {"fingerprint": fingerprint, "options": opts, "tokenizer": tok_json,
                                 "progress": {s: writers[s].entries for s in SPLITS}})
        if args.stop_after_shards is not None and state["closed"] >= args.stop_after_shards:
            raise _Stop()

    writers = {s: SplitWriter(s, out, opts, kept[s], on_close) for s in SPLITS}
    counts: collections.Counter = collections.Counter()
    tail: collections.Counter = collections.Counter()
    stream = _stage_a(sources, args.format, fields, args.val_fraction, tok, tail)
    # --limit counts accepted records, kept shards' records included: with a limit they are
    # tokenized again on resume (to know which were over-length); without, they are not.
    resume_from = None if args.limit is not None else {s: writers[s].start for s in SPLITS}
    accepted, special = 0, 0
    from tqdm import tqdm
    bar = tqdm(unit="rec", desc="shard", disable=args.no_progress or None, file=sys.stderr)
    try:
        with contextlib.closing(_ordered_results(_batches(stream, resume_from), args, tok)) as results:
            for batch, res_list in results:
                for rec, res in zip(batch, res_list):
                    counts.update(rec.skips_before)
                    special += rec.special_text
                    w = writers[rec.split]
                    if isinstance(res, str):
                        if rec.index >= w.start[0]:  # earlier ones are counted by kept shards
                            w.skip(rec.index, res)
                        continue
                    accepted += 1
                    for c, (ids, p) in enumerate(res or ()):
                        if (rec.index, c) < w.start:
                            continue
                        w.add(Item(rec.split, rec.index, c,
                                   rec.key if c == 0 else f"{rec.key}-{c}", ids, p))
                    if args.limit is not None and accepted >= args.limit:
                        break
                bar.update(len(batch))
                if args.limit is not None and accepted >= args.limit:
                    break
            else:
                counts.update(tail)  # skips after the last record (the inputs were read to the end)
        for s in SPLITS:
            writers[s].finish()
    except _Stop:
        print(f"shard.py: stopped after {state['closed']} shard(s) (--stop-after-shards)", file=sys.stderr)
        return {}
    except OSError as e:
        full = full_disk_error(out, e)
        if full is None:
            raise
        raise full from None
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
        "skipped": dict(sorted(skipped.items())),
        "counts": {"special_token_text": special},
        "fingerprint": fingerprint,
    }
    try:
        out.write_json(MANIFEST, manifest)
        out.remove(PARTIAL)
    except OSError as e:
        full = full_disk_error(out, e)
        if full is None:
            raise
        raise full from None
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
    p.add_argument("--limit", type=int, default=None,
                   help="stop after N accepted records: records that become samples, after "
                        "every filter (duplicates, over-length, ...); a long text cut into "
                        "chunks counts once, so without --pack N records give >= N samples")
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
    4 the output filesystem is full or over quota, 130 interrupted by Ctrl-C; after 4 and 130
    complete shards are kept and a rerun resumes)."""
    # Ctrl-C must reach us even when started with SIGINT ignored (an inherited SIG_IGN, e.g.
    # from a parent that ignores it): the handling below relies on KeyboardInterrupt.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
    except (UserError, InputError, TokenizerError, OutputError) as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OutputFull as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return EXIT_DISK_FULL
    except NoSamples as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shard.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
