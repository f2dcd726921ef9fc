"""What data preparation does with an output folder that already holds shards.

Owns: the fingerprint of a run's options and tokenizer, naming the options (or tokenizer) that
differ from a folder's recorded ones, checking the folder's recorded inputs against the inputs
as they are now (`data_prep.sources.input_changes`), and the decision: keep a finished folder,
resume an interrupted one (its complete shards), refuse (`UserError`, one line, exit code 2),
or clear it first (`--overwrite`).
Must not touch: reading inputs, tokenization, writing shards (data_prep/prepare.py, writer.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import sys

from data_prep.sources import Source, input_changes
from data_prep.writer import Output
from pipeline.data.format import MANIFEST, SPLITS
from pipeline.data.format import PARTIAL_MANIFEST as PARTIAL

TOKENIZER_DIR = "tokenizer"


class UserError(Exception):
    """A problem with the user's options or output folder; one-line message, exit code 2."""


def fingerprint(opts: dict, tok_json: dict) -> str:
    """sha256 hex of a run's options and tokenizer description (what resume compares)."""
    blob = json.dumps({"options": opts, "tokenizer": tok_json}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


_FLAGS = {"inputs": "--input", "format": "--format", "max_length": "--max-length",
          "slot_sizes": "--slot-sizes", "seed": "--seed", "val_fraction": "--val-fraction",
          "pack": "--pack", "long_text": "--long-text", "shard_samples": "--shard-samples",
          "shard_bytes": "--shard-bytes", "limit": "--limit",
          "fields": "--query-field/--response-field/--text-field/--messages-field",
          "chat_turns": "--chat-turns", "stdlib_python": "stdlib Python version",
          "unit_bytes": "--unit-bytes",
          "decontaminate": "--decontaminate/--decontaminate-ngram/--decontaminate-field "
                           "(or an evaluation file's bytes)"}


def differences(m: dict, opts: dict, tok_json: dict) -> str:
    """What differs between a manifest's recorded options/tokenizer and this run's, in words:
    `other options (--seed 0, now 9; ...)` and/or `another tokenizer (...)`."""
    old = m.get("options")
    if not isinstance(old, dict):  # an older partial manifest records only the fingerprint
        return "other options or another tokenizer"
    show = lambda v: json.dumps(v, ensure_ascii=False)
    keys = [k for k in [*opts, *(k for k in old if k not in opts)] if old.get(k) != opts.get(k)]
    if "pack" in keys:  # --unit-bytes is recorded with --pack only: implied by it
        keys = [k for k in keys if k != "unit_bytes"]
    diffs = [_decon_difference(old.get(k), opts.get(k)) or
             f"{_FLAGS.get(k, k)} {show(old.get(k))}, now {show(opts.get(k))}" for k in keys]
    parts = [f"other options ({'; '.join(diffs)})"] if diffs else []
    oldtok = m.get("tokenizer")
    if oldtok != tok_json:
        oldtok = oldtok if isinstance(oldtok, dict) else {}
        desc = lambda t: f"{t.get('name')} hash {str(t.get('hash'))[:12]}"
        parts.append(f"another tokenizer ({desc(oldtok)}, now {desc(tok_json)})")
    return " and ".join(parts) or "other options or another tokenizer"


def _decon_difference(old, new) -> str | None:
    """`--decontaminate FILE: changed (sha256 ..., now ...)` when two decontamination specs
    (data_prep/decontaminate.py) differ only in their files' bytes, else None."""
    if not (isinstance(old, dict) and isinstance(new, dict) and "files" in old and "files" in new):
        return None
    names = lambda spec: [f.get("name") for f in spec["files"]]
    if {**old, "files": names(old)} != {**new, "files": names(new)}:
        return None
    return "; ".join(f"--decontaminate {a['name']}: changed (sha256 {str(a.get('sha256'))[:12]}, "
                     f"now {str(b.get('sha256'))[:12]})"
                     for a, b in zip(old["files"], new["files"]) if a != b)


def clear(out: Output) -> None:
    """Remove what an earlier run wrote: manifests, `<split>-NNNNNN.tar` shards and their
    `.idx` sample indexes (`.v3.idx` too, `shard.py index`'s upgrades), tokenizer/."""
    pattern = re.compile(r"^(%s)-\d{6}\.tar(\.(v\d+\.)?idx)?$" % "|".join(SPLITS))  # shards, indexes
    for p in out.fs.ls(out.root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name in (MANIFEST, PARTIAL, TOKENIZER_DIR) or pattern.match(name):
            out.remove(name)


def resume_state(out: Output, expected: str, overwrite: bool, opts: dict, tok_json: dict,
                 inputs: list[dict], sources: list[Source]) -> tuple[dict | None, dict, dict]:
    """(complete manifest or None, {split: kept entries}, {input name: recorded sha256}) for
    this output folder.

    A folder made with the same options (fingerprint `expected`) from the same inputs is kept or
    resumed. One made with other options raises UserError naming the options (or tokenizer)
    that differ from `opts` / `tok_json`; one made from inputs that changed since (`inputs`:
    `input_identity` of `sources`; see `sources.input_changes`) raises UserError naming the
    input; with `overwrite` either is cleared first. The recorded sha256 of inputs read to
    their end lets a resumed run check that their bytes are those the kept shards came from.
    """
    fresh = None, {s: [] for s in SPLITS}, {}
    for n in (MANIFEST, PARTIAL):
        if not out.exists(n):
            continue
        try:
            m = out.read_json(n)
            what = None if isinstance(m, dict) else "an unreadable manifest (not an object)"
        except (ValueError, OSError) as e:
            m, what = {}, f"an unreadable manifest ({type(e).__name__})"
        if not isinstance(m, dict) or m.get("fingerprint") != expected:
            if overwrite:
                clear(out)
                return fresh
            what = what or differences(m, opts, tok_json)
            raise UserError(f"{out.path(n)}: this folder holds shards made with {what}; use "
                            "another --output or pass --overwrite")
        recorded = m.get("inputs")
        if not isinstance(recorded, list):  # made before inputs were recorded
            print(f"shard.py: note: {out.path(n)} records no input identities (an older "
                  "version made it); the inputs are not checked", file=sys.stderr)
            recorded = []
        else:
            change = input_changes(recorded, inputs, sources)
            if change is not None:
                if overwrite:
                    clear(out)
                    return fresh
                since = "these shards were made" if n == MANIFEST else "the interrupted run"
                raise UserError(f"{out.path(n)}: {change} since {since}; pass --overwrite to "
                                "make the shards again from the current inputs, or use another "
                                "--output")
        shas = {e["name"]: e["sha256"] for e in recorded
                if isinstance(e, dict) and e.get("sha256") and "name" in e}
        if n == MANIFEST:
            listed = [e for split in SPLITS for e in m.get("splits", {}).get(split, [])]
            if all(out.size(e["name"]) == e.get("bytes") and _index_kept(out, e) for e in listed):
                return m, {}, shas
            print(f"shard.py: {out.path(MANIFEST)} lists missing or changed shards; rebuilding",
                  file=sys.stderr)
            clear(out)
            return fresh
        kept = {}
        for split in SPLITS:
            kept[split] = []
            for e in m.get("progress", {}).get(split, []):
                if out.size(e["name"]) != e["bytes"] or not _index_kept(out, e):
                    break  # missing or partial: redo from here
                kept[split].append(e)
        return None, kept, shas
    return fresh


def _index_kept(out, entry: dict) -> bool:
    """A shard entry's sample index (`pipeline.data.sample_index`) is there with its recorded
    size (an entry without `index`, from before indexes existed, counts as kept)."""
    index = entry.get("index")
    return not isinstance(index, dict) or out.size(index.get("name", "")) == index.get("bytes")
