"""The data-prep pipeline behind `python data_prep/shard.py`: tokenize a corpus into ReFusion
webdataset shards.

The pipeline: read -> normalize -> decontaminate -> dedup -> split -> tokenize -> chunk or
pack -> slot boundaries -> tar shards + manifest.json, for the whole corpus (the one-machine
command) or one work unit of a plan (data_prep/plan.py). Owns: that pipeline, resume, the
summary line, and what the stages share (`options`, `save_tokenizer`, the empty and skip-share
checks). Must not touch: the command line (cli.py), the plan and the merge, the objective, the
loader (ARCHITECTURE.md "data preparation" names each owner). The output format:
ARCHITECTURE.md "Shard format"; the user's view of skips, resume, input identity and memory:
data_prep/README.md.

Determinism (reruns are byte-identical, whatever `--workers`):
- a record's identity is the sha256 of its normalized content; exact duplicates are dropped;
- sample key = the first 20 hex digits of that digest (`-<chunk>` appended for the 2nd.. chunk
  of a long text or the 2nd.. response turn of a chat); a packed sample's key is `p` + 20 hex
  digits of the sha256 of its members' keys. Keys are unique (checked) and have no dots;
- split: a record goes to `val` when the first 8 bytes of its digest, as an integer, are
  below `val_fraction * 2**64` (stable across seeds and input order);
- slot size of segment j of sample `key` = `slot_sizes[u % len(slot_sizes)]`,
  u = first 8 bytes (little endian) of sha256(f"{seed}:{key}:{j}");
- samples keep input order; with --pack a sample never spans two work units of
  `data_prep.units.cut_units` (--unit-bytes), as in a run on many machines, and a packed
  sample's segments carry their item keys; tar members have mtime 0, fixed owner and mode
  (USTAR).
Resume (data_prep/resume.py decides what a used folder gets): a shard is renamed into place
when complete and listed in `manifest.partial.json` with the input position that follows it;
a rerun keeps listed shards whose file has the recorded size and does not tokenize their
records again, but still reads and hashes every input record (cheap next to tokenization), so
duplicates and splits come out the same; a resumed run checks each input's sha256 again as it
reads it (`InputChanged`). `--stop-after-shards N` (hidden) stops as if killed, for tests.
Memory: the duplicate filter and the key-collision check share one `data_prep.dedup.DigestSet`;
a long text travels as pieces (`pipeline.tokenizer.text_pieces`) and its max-length chunks are
cut as the pieces' tokens arrive (`writer.TextChunks`), so no stage holds a whole long
document's tokens.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from pipeline.data.format import FORMAT_VERSION, MANIFEST, SPLITS, with_checksum

from data_prep.decontaminate import REASON as CONTAMINATED
from data_prep.decontaminate import EvalSets, describe as describe_decontamination
from data_prep.dedup import DUPLICATE, KEY_COLLISION, DigestSet
from pipeline import tokenizer as tokenizers
from data_prep.sources import (_READ_ERRORS, Fields, Source, TextFile,
                               _unreadable, input_identity, iter_records, normalize,
                               resolve_inputs)
from pipeline.tokenizer import (Tokenizer, chat_samples, encode_piece,
                                load_tokenizer, piece_end, piecewise_ok, qa_sample_bounded,
                                text_pieces)
# what to do with a used output folder (keep, resume, refuse, clear): data_prep/resume.py
from data_prep.resume import PARTIAL, TOKENIZER_DIR, UserError, fingerprint, resume_state
from data_prep.units import cut_units, unit_reads
# the writing half lives in data_prep/writer.py
from data_prep.writer import (_KEY_HEX, Item, Output, SplitWriter, TextChunks,
                              full_disk_error)

# reasons the --max-skip-fraction check only notes (one line, exit code unchanged): they are
# the filters the options ask for (dropping exact repeats, --max-length), not input that was
# misread (contaminated: --decontaminate); over_length_turns also counts assistant turns, not records
_SHARE_NOTED = ("duplicate", "over_length", "over_length_turns", CONTAMINATED)


class NoSamples(Exception):
    """Every record was skipped (or there were none): nothing to train on; exit code 1."""


class TooManySkipped(Exception):
    """A skip reason covers more than --max-skip-fraction of the input records; the shards
    are written; exit code 2."""


def input_records(manifest: dict) -> int:
    """Input records a manifest accounts for: records written plus records skipped (the
    reasons that count records, i.e. all but `over_length_turns`)."""
    skipped = manifest["skipped"]
    return (manifest.get("counts", {}).get("records", 0)
            + sum(v for k, v in skipped.items() if k != "over_length_turns"))


def check_skip_share(manifest: dict, max_fraction: float) -> None:
    """Compare each skip reason's share of the input records with `max_fraction`: a filter
    reason (`duplicate`, `over_length`, `over_length_turns`) over it gets a one-line `note:` on
    stderr; any other raises TooManySkipped (one line naming each reason, its count and share)."""
    total = input_records(manifest)
    if not total:
        return
    over = [(k, v) for k, v in manifest["skipped"].items() if v / total > max_fraction]
    said = lambda rs: ", ".join(f"{k} {v} of {total} input records ({100 * v / total:.1f}%)"
                                for k, v in rs)
    noted = [(k, v) for k, v in over if k in _SHARE_NOTED]
    if noted:
        hint = ("; raise --max-length to keep long records"
                if any(k.startswith("over_length") for k, _ in noted) else "")
        print(f"shard.py: note: skipped {said(noted)}: more than --max-skip-fraction "
              f"{max_fraction:g}, by the filters the options ask for (not an error){hint}",
              file=sys.stderr)
    bad = [(k, v) for k, v in over if k not in _SHARE_NOTED]
    if not bad:
        return
    worst = max(v for _, v in bad) / total
    raise TooManySkipped(
        f"skipped {said(bad)}: more than --max-skip-fraction {max_fraction:g} (the shards are "
        f"written without them); check the inputs and options, or pass --max-skip-fraction "
        f"{min(1.0, worst + 0.005):.2f} to accept")


def check_not_empty(manifest: dict) -> None:
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


def tokenize_record(tok: Tokenizer, kind: str, payload: tuple, max_length: int,
                    chat_turns: str = "all", first: bool = True):
    """Tokens of one normalized record (or, for a text, one piece of it).

    qa / chat: `([(uint32[n], prompt_length)], n_dropped)` or a skip reason ("over_length"; chat:
    `pipeline.tokenizer.chat_samples`), given up as soon as the pieces are too long. text:
    `payload = (piece,)`, the piece's ids, uint32[n] (`first`: the text's first piece); EOS and
    max-length chunks are added by `writer.TextChunks` in the main process."""
    if kind == "text":
        return np.asarray(encode_piece(tok, payload[0], first), dtype=np.uint32)
    if kind == "qa":
        got = qa_sample_bounded(tok, payload[0], payload[1], max_length)
        if got is None:
            return "over_length"
        return [(np.asarray(got[0], dtype=np.uint32), got[1])], 0
    turns = list(zip(payload[0::2], payload[1::2]))
    got = chat_samples(tok, turns, chat_turns, max_length)
    if isinstance(got, str):
        return got
    samples, dropped = got
    return [(np.asarray(ids, dtype=np.uint32), p) for ids, p in samples], dropped


_WORKER: dict = {}


def _init_worker(tokenizer_path: str | None) -> None:
    """Pool worker set-up: Ctrl-C is left to the parent (which stops the pool and reports it
    in one line); spawned workers load the tokenizer, forked ones inherit it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if tokenizer_path is not None:
        _WORKER["tok"] = load_tokenizer(tokenizer_path)


def _tokenize_batch(batch, max_length: int, chat_turns: str, tok: Tokenizer | None = None):
    """Results of `tokenize_record` for the records of a batch (None where not tokenized)."""
    tok = tok or _WORKER["tok"]
    return [tokenize_record(tok, r.kind, r.payload, max_length, chat_turns, r.piece == 0)
            if r.tokenize else None for r in batch]


# ----------------------------------------------------------------------------- pipeline

def options(args, sources: list[Source], decon: EvalSets | None = None) -> dict:
    """The options a shard folder records (`manifest.json` `options`, part of its resume
    fingerprint), from the parsed command line `args` and the resolved `sources`; with --pack
    also `unit_bytes`, with the stdlib corpus the interpreter's version, with --decontaminate
    `decon.spec` (n, fields, each evaluation file's name and sha256)."""
    opts = {
        "inputs": list(args.input), "format": args.format, "max_length": args.max_length,
        "slot_sizes": list(args.slot_sizes), "seed": args.seed,
        "val_fraction": args.val_fraction, "pack": bool(args.pack),
        "long_text": args.long_text, "shard_samples": args.shard_samples,
        "shard_bytes": args.shard_bytes, "limit": args.limit, "dedup": "exact",
        "fields": {"query": args.query_field, "response": args.response_field,
                   "text": args.text_field, "messages": args.messages_field},
        "chat_turns": args.chat_turns,
    }
    if args.pack:  # packs end at work-unit boundaries (data_prep/plan.py)
        opts["unit_bytes"] = args.unit_bytes
    if any(s.is_stdlib for s in sources):
        opts["stdlib_python"] = sys.version.split()[0]
    if decon is not None:
        opts["decontaminate"] = decon.spec
    return opts


@dataclass
class Record:
    """One accepted record (or one piece of a long text) on its way from reading to the writers,
    in input order. skips_before: stage-A skip reasons met since the previous record, counted
    when this record is consumed (so a `--limit` stop counts exactly the records before it,
    whatever `--workers`); on a text's first piece. special_text: the content holds a
    special-token string; on a text's last piece. tokenize: False for a record held by a kept
    shard (resume). A text comes as pieces (`piece` 0, 1, ..., `last` on the final one);
    `unsafe_cut`: this piece ends where no space allowed a cut."""
    split: str
    index: int      # within its split, after dedup
    key: str
    kind: str       # "qa" | "text" | "chat"
    payload: tuple
    skips_before: tuple = ()
    special_text: bool = False
    tokenize: bool = True
    rid: str = ""   # record id (file#line) for messages
    digest: bytes = b""  # first 16 bytes of the record digest (the duplicate filter's)
    read: int = 0        # index of the (source, records) read it came from (`_stage_a`)
    piece: int = 0
    last: bool = True
    unsafe_cut: bool = False


class RecordLog:
    """What became of each record that passed a unit's duplicate filter, in input order, for
    the merge's global dedup (data_prep/merge.py). Columns of `records.npz`: `digest` uint8[n, 16]
    (the record digest's first 16 bytes), `outcome` uint16[n] (0 = written, i = the skip reason
    `outcomes[i]`), `dropped` uint32[n] (chat turns dropped as over_length_turns), `special`
    uint8[n] (1 = held special-token text), `cuts` uint32[n] (unsafe piece cuts)."""
    NAME = "records.npz"

    def __init__(self):
        self.outcomes = ["written"]
        self.rows: list[tuple] = []

    def add(self, digest: bytes, reason: str | None, dropped: int, special: bool,
            cuts: int) -> None:
        if reason is not None and reason not in self.outcomes:
            self.outcomes.append(reason)
        self.rows.append((digest, 0 if reason is None else self.outcomes.index(reason),
                          dropped, int(special), cuts))

    def write(self, out: Output) -> dict:
        """Write `records.npz` to `out`; returns its manifest entry `{"name", "rows",
        "outcomes", "bytes", "sha256"}`."""
        import io
        cols = list(zip(*self.rows)) or [(), (), (), (), ()]
        buf = io.BytesIO()
        np.savez(buf, digest=np.frombuffer(b"".join(cols[0]), np.uint8).reshape(-1, 16),
                 outcome=np.array(cols[1], np.uint16), dropped=np.array(cols[2], np.uint32),
                 special=np.array(cols[3], np.uint8), cuts=np.array(cols[4], np.uint32))
        data = buf.getvalue()
        out.write_bytes(self.NAME, data)
        return {"name": self.NAME, "rows": len(self.rows), "outcomes": self.outcomes,
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class InputChanged(UserError):
    """A resumed run found an input whose bytes differ from the interrupted run's."""


def _stage_a(reads, fmt: str, fields: Fields, val_fraction: float,
             tok: Tokenizer, tail: list, details: dict, digests: dict,
             recorded_sha: dict, whole_texts: bool, decon: EvalSets | None = None):
    """Read, normalize, decontaminate, dedup and split the records of `reads` (`(source,
    iterator of (record id, raw record))` per input, in order: a whole file's
    `sources.iter_records` or a work unit's pieces); yields `Record`s in input order, a text as
    its pieces (`pipeline.tokenizer.text_pieces`; one piece when `whole_texts`).

    decon: with --decontaminate, a contaminated record is skipped as `(CONTAMINATED, file
    indices)` (the caller counts the reason and each file), before the duplicate filter, so a
    work unit's counts add up to the one-process run's. Skip reasons met after the last record go
    to `tail`; the first record skipped for each described reason fills `details[reason]`
    ("<record id>: <what it had and what was expected>"); `digests[name]`: sha256 of each input
    read to its end; raises InputChanged when `recorded_sha` (a resumed run's) differs."""
    seen = DigestSet(width=16, key_bytes=_KEY_HEX // 2)
    n_split = {s: 0 for s in SPLITS}
    skips: list[str] = []
    limit = float("inf") if whole_texts else tokenizers.MAX_PIECE_CHARS
    cut = (lambda text, start: (len(text), True)) if whole_texts else piece_end

    def skip(reason: str, detail: str | None, rid: str) -> None:
        skips.append(reason)
        if detail and reason not in details:
            details[reason] = f"{rid}: {detail}"

    def str_pieces(text: str):
        if whole_texts:
            return [(text, True)]
        return ((text[a:b], safe) for a, b, safe in text_pieces(text))

    for read, (source, records) in enumerate(reads):
        for rid, raw in records:
            norm = normalize(raw, fmt, fields)
            if norm[0] == "skip":
                skip(norm[1], norm[2], rid)
                continue
            kind, payload = norm[0], norm[1:]
            doc = payload[0] if kind == "text" and isinstance(payload[0], TextFile) else None
            match = decon.matcher() if decon is not None else None
            if doc is not None:
                try:
                    digest, nonblank = (doc.scan(b"text") if match is None
                                        else doc.scan(b"text", match.feed))
                except UnicodeDecodeError:
                    skip("invalid_utf8", None, rid)
                    continue
                except _READ_ERRORS as e:
                    _unreadable(rid, e)
                    skip("unreadable_file", None, rid)
                    continue
                if not nonblank:
                    skip("empty_text", None, rid)
                    continue
            else:
                digest = record_digest(kind, payload)
            if match is not None:
                if doc is None:
                    for text in (payload[1::2] if kind == "chat" else payload):
                        match.feed(text)
                hit = match.finish()
                if hit:
                    skips.append((CONTAMINATED, tuple(sorted(hit))))
                    if CONTAMINATED not in details:
                        details[CONTAMINATED] = f"{rid}: {match.where}"
                    continue
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
            key = digest.hex()[:_KEY_HEX]
            if kind != "text":
                yield Record(split, index, key, kind, payload, tuple(skips),
                             tok.has_special_text(*payload), rid=rid, digest=digest[:16],
                             read=read)
                skips = []
                continue
            pieces = iter(doc.pieces(cut, limit) if doc is not None else str_pieces(payload[0]))
            cur, special, j = next(pieces), False, 0
            for nxt in pieces:
                special = special or tok.has_special_text(cur[0])
                yield Record(split, index, key, kind, (cur[0],), tuple(skips) if j == 0 else (),
                             rid=rid, piece=j, last=False, unsafe_cut=not cur[1], read=read)
                cur, j = nxt, j + 1
            special = special or tok.has_special_text(cur[0])
            yield Record(split, index, key, kind, (cur[0],), tuple(skips) if j == 0 else (),
                         special, rid=rid, piece=j, last=True, digest=digest[:16], read=read)
            skips = []
        want, got = recorded_sha.get(source.name), digests.get(source.name)
        if want and got and want != got:
            raise InputChanged(f"input {source.name} changed since the interrupted run (its "
                               "bytes differ from those the kept shards were made from, though "
                               "its size and modification time agree); pass --overwrite to make "
                               "the shards again from the current inputs")
    tail.extend(skips)


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


def _pool_born_ignoring_ctrl_c(ctx, workers: int, init, initargs):
    """`ctx.Pool(workers, init, initargs)` whose workers ignore SIGINT from the fork on: the
    parent ignores it while the pool starts its workers, then restores its handler. A Ctrl-C
    (SIGINT to the whole process group) that reached a worker between fork and `init` raised
    KeyboardInterrupt inside the child's at-fork hooks and could leave shard.py hung after its
    "interrupted" line. A Ctrl-C during the start-up itself is lost (press it again). Only the
    main thread may set handlers; from another thread the pool starts as before."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(workers, initializer=init, initargs=initargs)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return ctx.Pool(workers, initializer=init, initargs=initargs)
    finally:
        if previous is not None:      # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGINT, previous)


def _ordered_results(batches, args, tok: Tokenizer):
    """Yield (batch, results) in input order; a bounded window of batches in flight."""
    if args.workers <= 1:
        for b in batches:
            yield b, _tokenize_batch(b, args.max_length, args.chat_turns, tok)
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
    with _pool_born_ignoring_ctrl_c(ctx, args.workers, init, initargs) as pool:
        window = collections.deque()
        for b in batches:
            window.append((b, pool.apply_async(_tokenize_batch,
                                               (b, args.max_length, args.chat_turns))))
            if len(window) >= 2 * args.workers:
                b0, r0 = window.popleft()
                yield b0, r0.get()
        while window:
            b0, r0 = window.popleft()
            yield b0, r0.get()


def save_tokenizer(out: Output, tok: Tokenizer) -> None:
    """Write `tok`'s loadable files into `out`'s `tokenizer/` folder (`manifest.json`
    `tokenizer.files`). Raises OSError from the output filesystem (a full disk is turned into
    OutputFull by the caller)."""
    with tempfile.TemporaryDirectory() as d:
        files = sorted(tok.save(d))
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out.write_bytes(f"{TOKENIZER_DIR}/{name}", f.read())


def summary(where: str, manifest: dict) -> str:
    """One line: location, samples / tokens / shards per split, skip counts by reason, and
    the notes on special-token text and unsafe piece cuts when there are any."""
    parts = []
    for split in SPLITS:
        es = manifest["splits"][split]
        parts.append(f"{split} {sum(e['samples'] for e in es)} samples / "
                     f"{sum(e['tokens'] for e in es)} tokens in {len(es)} shard(s)")
    skipped = ", ".join(f"{k} {v}" for k, v in manifest["skipped"].items()) or "none"
    counts = manifest.get("counts", {})
    special, cuts = counts.get("special_token_text", 0), counts.get("unsafe_piece_cuts", 0)
    note = f"; {special} record(s) held special-token text (encoded as text)" if special else ""
    if cuts:
        note += (f"; {cuts} long-text cut(s) without a space near them (tokens at a cut may "
                 "differ from whole-text tokenization)")
    if manifest.get("decontamination"):
        note += f"; {describe_decontamination(manifest['decontamination'])}"
    return f"{where}: {'; '.join(parts)}; skipped: {skipped}{note}"


def run(args, unit=None) -> dict:
    """Run the pipeline for parsed `args`; returns the manifest (also written to the output).
    `unit`: None for the whole corpus, or one work unit of a plan (`data_prep.plan.UnitJob`),
    whose run also writes `records.npz` (`RecordLog`), saves no tokenizer, re-tokenizes the
    records of kept shards on resume (their outcome is logged) and leaves the empty and
    skip-share checks to the merge.

    Raises UserError / InputError / TokenizerError for user errors (one line each), and, after
    writing the manifest, NoSamples or TooManySkipped."""
    t0 = time.time()
    fields = Fields(args.query_field, args.response_field, args.text_field, args.messages_field)
    if unit is None:
        tok = load_tokenizer(args.tokenizer)
        sources = resolve_inputs(args.input, output=args.output)
        decon = EvalSets.from_args(args)
        opts = options(args, sources, decon)
        inputs = [input_identity(s) for s in sources]
        out = Output(args.output)
    else:
        tok, sources, opts, inputs = unit.tok, unit.sources, unit.opts, unit.inputs
        decon = unit.decon
        out = Output(unit.out_url)
    tok_json = tok.info.to_json()
    tok_json["files"] = TOKENIZER_DIR
    fp = fingerprint(opts, tok_json)
    done, kept, recorded_sha = resume_state(out, fp, args.overwrite, opts, tok_json,
                                             inputs, sources)
    if done is not None:
        if unit is not None:
            return done
        check_not_empty(done)
        print(f"shard.py: already complete (same options, inputs unchanged), kept "
              f"{summary(args.output, done)}", file=sys.stderr)
        check_skip_share(done, args.max_skip_fraction)
        return done
    out.remove_stale_temps()
    n_kept = sum(len(v) for v in kept.values())
    if n_kept:
        print(f"shard.py: resuming: keeping {n_kept} complete shard(s)", file=sys.stderr)
    whole_texts = not piecewise_ok(tok)
    if whole_texts:
        print(f"shard.py: note: tokenizer {tok.info.name} gives other tokens when a text is cut "
              "at a space, so each text is tokenized whole (memory grows with the longest "
              "document)", file=sys.stderr)
    try:
        if unit is None:
            save_tokenizer(out, tok)
    except OSError as e:
        full = full_disk_error(out, e)
        if full is None:
            raise
        raise full from None

    state = {"closed": 0}
    digests: dict = {}

    def input_entries() -> list[dict]:
        """The inputs with the sha256 known so far: a resumed run keeps the recorded one."""
        out_ = []
        for ident in inputs:
            sha = recorded_sha.get(ident["name"]) or digests.get(ident["name"])
            out_.append({**ident, "sha256": sha} if sha else dict(ident))
        return out_

    def on_close(_writer):
        state["closed"] += 1
        out.write_json(PARTIAL, {"fingerprint": fp, "options": opts, "tokenizer": tok_json,
                                 "inputs": input_entries(),
                                 "progress": {s: writers[s].entries for s in SPLITS}})
        if args.stop_after_shards is not None and state["closed"] >= args.stop_after_shards:
            raise _Stop()

    writers = {s: SplitWriter(s, out, opts, kept[s], on_close) for s in SPLITS}
    counts: collections.Counter = collections.Counter()
    tail: list = []
    details: dict = {}
    warned: set = set()

    decon_counts: collections.Counter = collections.Counter()  # evaluation file -> records

    def count_skips(reasons) -> None:
        """Count stage-A skips (a contaminated record also under each evaluation file it
        matched); the first of each described reason is printed, once."""
        for reason in reasons:
            if isinstance(reason, tuple):
                reason, files = reason
                decon_counts.update(files)
            counts[reason] += 1
            if reason in details and reason not in warned:
                warned.add(reason)
                print(f"shard.py: warning: skipped ({reason}) {details[reason]}; further "
                      "records skipped for this reason are counted, not shown", file=sys.stderr)

    unit_of = None  # with --pack: the work unit of each read; a pack never spans two units
    if unit is not None:
        reads = unit.reads(digests)
    elif args.pack:
        units = cut_units(sources, inputs, args.unit_bytes)
        reads, unit_of = [], []
        for u in range(len(units)):
            got = unit_reads(units, u, sources, args.format, fields, digests)
            reads += got
            unit_of += [u] * len(got)
    else:
        reads = [(s, iter_records(s, args.format, fields, digests)) for s in sources]
    stream = _stage_a(reads, args.format, fields, args.val_fraction, tok, tail, details,
                      digests, recorded_sha, whole_texts, decon)
    # --limit counts accepted records, kept shards' records included: with a limit they are
    # tokenized again on resume (to know which were over-length); without, they are not. A
    # unit logs every record's outcome, so it tokenizes them again too.
    resume_from = ({s: writers[s].start for s in SPLITS}
                   if args.limit is None and unit is None else None)
    log = RecordLog() if unit is not None else None
    accepted, special, unsafe_cuts, rec_cuts = 0, 0, 0, 0
    cur_unit = None
    chunks: TextChunks | None = None  # the text being assembled from its pieces
    from tqdm import tqdm
    bar = tqdm(unit="rec", desc="shard", disable=args.no_progress or None, file=sys.stderr)
    try:
        with contextlib.closing(_ordered_results(_batches(stream, resume_from), args, tok)) as results:
            for batch, res_list in results:
                for rec, res in zip(batch, res_list):
                    if unit_of is not None and unit_of[rec.read] != cur_unit:
                        if cur_unit is not None:
                            for wr in writers.values():
                                wr.flush_pack()
                        cur_unit = unit_of[rec.read]
                    count_skips(rec.skips_before)
                    unsafe_cuts += rec.unsafe_cut
                    rec_cuts += rec.unsafe_cut
                    w = writers[rec.split]
                    items, c0 = [], 0  # (ids, prompt_length) of this record or piece; first index
                    if rec.kind == "text":
                        if rec.piece == 0:
                            chunks = TextChunks(args.max_length, args.long_text)
                        c0 = chunks.emitted
                        if res is not None:
                            items = [(c, 0) for c in chunks.add(res)]
                            if rec.last:
                                final = chunks.finish(tok.info.eos_id)
                                if isinstance(final, str):
                                    res = final  # over_length (--long-text skip)
                                else:
                                    items += [(c, 0) for c in final]
                    dropped = 0
                    if rec.kind != "text" and isinstance(res, tuple):
                        items, dropped = res
                        if rec.index >= w.start[0]:  # earlier ones are counted by kept shards
                            for _ in range(dropped):
                                w.skip(rec.index, "over_length_turns")
                    for c, (ids, p) in enumerate(items, start=c0):
                        if (rec.index, c) >= w.start:
                            w.add(Item(rec.split, rec.index, c,
                                       rec.key if c == 0 else f"{rec.key}-{c}", ids, p))
                    if not rec.last:
                        continue
                    special += rec.special_text
                    if log is not None:
                        log.add(rec.digest, res if isinstance(res, str) else None, dropped,
                                rec.special_text, rec_cuts)
                    rec_cuts = 0
                    if isinstance(res, str):
                        if rec.index >= w.start[0]:  # earlier ones are counted by kept shards
                            w.skip(rec.index, res)
                        continue
                    accepted += 1
                    if args.limit is not None and accepted >= args.limit:
                        break
                bar.update(sum(r.last for r in batch))
                if args.limit is not None and accepted >= args.limit:
                    break
            else:
                count_skips(tail)  # after the last record (inputs read whole)
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
        "splits": {s: [{k: e[k] for k in ("name", "samples", "tokens", "bytes", "sha256", "index") if k in e}
                       for e in writers[s].entries] for s in SPLITS},
        "skipped": dict(sorted(skipped.items())),
        "counts": {"special_token_text": special, "records": accepted,
                   "unsafe_piece_cuts": unsafe_cuts},
        "inputs": input_entries(),
        "fingerprint": fp,
    }
    if decon is not None:
        manifest["decontamination"] = decon.block(decon_counts)
    try:
        if log is not None:  # before manifest.json, the part's completion mark
            manifest["records_log"] = log.write(out)
            manifest.update(unit.extra)
        out.write_json(MANIFEST, with_checksum(manifest))
        out.remove(PARTIAL)
    except OSError as e:
        full = full_disk_error(out, e)
        if full is None:
            raise
        raise full from None
    if unit is not None:
        print(f"shard.py: {summary(unit.out_url, manifest)} ({time.time() - t0:.1f} s)",
              file=sys.stderr)
        return manifest
    check_not_empty(manifest)
    print(f"shard.py: wrote {summary(args.output, manifest)} ({time.time() - t0:.1f} s)",
          file=sys.stderr)
    check_skip_share(manifest, args.max_skip_fraction)
    return manifest


class _Stop(Exception):
    pass

