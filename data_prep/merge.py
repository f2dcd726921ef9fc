"""Data prep on many machines, stage 3: `shard.py merge` checks every unit's part and writes
the one `manifest.json` the trainer reads (format: ARCHITECTURE.md "Shard format").

Owns: the checks of the parts against the plan, the global exact-duplicate filter, the
rewrite of a part that held a duplicate of an earlier unit's record, and the merged manifest.
Must not touch: the plan, reading inputs, tokenizing (data_prep/plan.py, prepare.py).

Checks, before anything is written (a failure is one line naming the unit or shard and the
command that mends it; exit code 2):
- every unit of the plan has a complete part (`parts/uNNNNNN/manifest.json`), made from this
  plan with its options and tokenizer (the part's fingerprint is that of `unit_options`), from
  inputs with the plan's identities;
- the part's `records.npz` and each shard have the recorded size and sha256 (every byte is
  read once), each shard holds the recorded number of samples, and no sample key appears twice
  in the dataset (a 16-byte digest of each key in a `DigestSet`);
- the counts add up: each part's logged records agree with its written and skipped counts,
  and the merged input records (written + skipped by reason + dropped as duplicates) equal the
  sum of the parts'. Counts are Python ints (no 32-bit overflow).

Global dedup, the same records as a one-process run: a unit's run drops repeats within the
unit and logs, per remaining record, its digest and what became of it (`prepare.RecordLog`).
The merge walks the logs in plan order (input order) with one `DigestSet`; a record whose
digest an earlier unit already holds is a duplicate, as the one-process run would have found
it before tokenizing it: it moves from its outcome (written, or a skip such as over_length)
to `duplicate`, its chat turns dropped, special-token text and unsafe cuts are taken off the
counts. The shards of a unit that wrote such a record are rewritten without it as
`dedup-<split>-NNNNNN.tar` in its part folder (the originals are kept, so a merge can run
again): unpacked samples are filtered; packed samples are taken apart into their items
(segments carry their item keys) and packed again in the same order with the same greedy
rule, so the samples are those the unit would have written had it known. Keys, tokens, slot
boundaries, splits and skip counts are thus independent of K and of the order tasks ran in.
Memory: 16 bytes per record (digests) plus 16 per sample key.
Decontamination (`--decontaminate`, data_prep/decontaminate.py): a unit drops and counts
contaminated records before its duplicate filter, so none is in a records log and the global
dedup never moves one; the merge checks each part's `decontamination` block against the
plan's files and sums its counts.
"""
from __future__ import annotations

import collections
import hashlib
import io
import json

import numpy as np

from data_prep.decontaminate import REASON as CONTAMINATED
from data_prep.decontaminate import merge_blocks
from data_prep.dedup import DUPLICATE, KEY_COLLISION, DigestSet
from data_prep.plan import (PLAN, describe_unit, planned_output, read_plan, unit_dir,
                            unit_options)
from data_prep.prepare import input_records
from data_prep.resume import UserError, differences, fingerprint
from data_prep.writer import Item, Output, SplitWriter
from pipeline.data import sample_index
from pipeline.data.format import (FORMAT_VERSION, MANIFEST, PARTIAL_MANIFEST, SPLITS, DataError,
                                  with_checksum)

DEDUP_PREFIX = "dedup-"


class MergeError(UserError):
    """A part is missing, stale, damaged or inconsistent; one line naming it and what to rerun."""


def _samples(out: Output, d: str, entry: dict, verify: str = "off"):
    """`(key, tokens.npy bytes, json bytes)` of the samples of shard `entry` of part folder
    `d`, in order (`pipeline.data.shard_io.iter_shard_samples`; `verify="error"`: each sample
    against its digest, or the shard's sha256 without a version-2 index, DataError when one
    differs)."""
    from pipeline.data.shard_io import iter_shard_samples
    for sample in iter_shard_samples(f"{out.url.rstrip('/')}/{d}", [entry], verify):
        yield sample["__key__"], sample.get("tokens.npy"), sample.get("json")


def _key_digest(key: str) -> bytes:
    """16 bytes standing for a sample key in the duplicate-key check."""
    return hashlib.sha256(key.encode()).digest()[:16]


def _decode(key: str, tokens: bytes, meta: bytes) -> tuple[np.ndarray, list]:
    return np.load(io.BytesIO(tokens), allow_pickle=False), json.loads(meta)["segments"]


def _rerun(output: str, plan: dict, i: int) -> str:
    """The command that makes unit `i`'s part again."""
    return f"rerun `shard.py run --output {output} --unit {i} --overwrite`"


def _read_part(out: Output, plan: dict, i: int, tok_json: dict) -> dict:
    """Unit `i`'s part manifest, checked against the plan (module docstring)."""
    d = unit_dir(i)
    what = describe_unit(plan, i)
    redo = _rerun(out.url, plan, i)
    if not out.exists(f"{d}/{MANIFEST}"):
        state = "interrupted" if out.exists(f"{d}/{PARTIAL_MANIFEST}") else "not run"
        raise MergeError(f"{out.path(d)}: {what} has no complete part ({state}); {redo}, "
                         "then merge again")
    try:
        part = out.read_json(f"{d}/{MANIFEST}")
    except (OSError, ValueError) as e:
        raise MergeError(f"{out.path(d)}/{MANIFEST}: unreadable ({type(e).__name__}); {redo}") from None
    opts = unit_options(plan, i)
    if part.get("plan") != plan["fingerprint"] or part.get("unit") != i:
        raise MergeError(f"{out.path(d)}/{MANIFEST}: the part of {what} was made from another "
                         f"plan (plan {str(part.get('plan'))[:12]}, this one "
                         f"{plan['fingerprint'][:12]}: {_plan_differences(part, opts, tok_json)})"
                         f"; {redo}")
    if part.get("fingerprint") != fingerprint(opts, tok_json):
        raise MergeError(f"{out.path(d)}/{MANIFEST}: the part of {what} was made with "
                         f"{differences(part, opts, tok_json)} than the plan's; {redo}")
    recorded = {e.get("name"): e for e in part.get("inputs", [])}
    for j in sorted({p["input"] for p in plan["units"][i]["pieces"]}):
        ident = plan["inputs"][j]
        got = recorded.get(ident["name"], {})
        if any(got.get(k) != ident.get(k) for k in ("size", "mtime", "etag")):
            raise MergeError(f"{out.path(d)}/{MANIFEST}: the part of {what} was made from "
                             f"another version of {ident['name']} (stale); {redo}")
    return part


def _plan_differences(part: dict, opts: dict, tok_json: dict) -> str:
    """What differs between a part's recorded options and the plan's, besides the plan's
    fingerprint and the unit (for the refusal of a part of another plan)."""
    old = part.get("options")
    if not isinstance(old, dict):
        return "other options, inputs or work units"
    said = differences({**part, "options": {**old, "plan": None, "unit": None}},
                       {**opts, "plan": None, "unit": None}, tok_json)
    return "other inputs or work units" if said == "other options or another tokenizer" else said


def _check_decontamination(out: Output, part: dict, d: str, spec: dict, redo: str) -> dict:
    """A part's `decontamination` block, checked against the plan's spec: one entry per
    evaluation file, each count at most the part's contaminated records."""
    block = part.get("decontamination")
    dropped = part.get("skipped", {}).get(CONTAMINATED, 0)
    names = [f["name"] for f in spec["files"]]
    ok = (isinstance(block, dict) and isinstance(block.get("files"), dict)
          and sorted(block["files"]) == sorted(names)
          and all(isinstance(e, dict) and isinstance(e.get("dropped_documents"), int)
                  and 0 <= e["dropped_documents"] <= dropped for e in block["files"].values())
          and (dropped == 0 or any(e["dropped_documents"] for e in block["files"].values())))
    if not ok:
        raise MergeError(f"{out.path(d)}/{MANIFEST}: its decontamination counts are missing or "
                         f"do not add up with its {dropped} contaminated record(s); {redo}")
    return block


def _read_log(out: Output, part: dict, d: str, redo: str) -> dict:
    e = part.get("records_log") or {}
    try:
        with out.fs.open(out.path(f"{d}/{e.get('name')}"), "rb") as f:
            data = f.read()
    except (OSError, TypeError):
        raise MergeError(f"{out.path(d)}: records log missing; {redo}") from None
    if len(data) != e.get("bytes") or hashlib.sha256(data).hexdigest() != e.get("sha256"):
        raise MergeError(f"{out.path(d)}/{e.get('name')}: size or sha256 differs from its part "
                         f"manifest (damaged); {redo}")
    z = np.load(io.BytesIO(data), allow_pickle=False)
    return {k: z[k] for k in z.files}


def _check_index(out: Output, d: str, e: dict, redo: str) -> None:
    """Shard `e` of part `d` has its sample index (`pipeline.data.sample_index`) with the
    recorded size and sha256, for as many samples as the shard holds."""
    ix = e.get("index")
    path = out.path(f"{d}/{e['name']}")
    if not isinstance(ix, dict) or "name" not in ix:
        raise MergeError(f"{path}: its part manifest records no sample index (made before "
                         f"indexes existed); {redo}")
    try:
        with out.fs.open(out.path(f"{d}/{ix['name']}"), "rb") as f:
            data = f.read()
    except OSError:
        raise MergeError(f"{out.path(d)}/{ix['name']}: sample index missing; {redo}") from None
    if len(data) != ix.get("bytes") or hashlib.sha256(data).hexdigest() != ix.get("sha256"):
        raise MergeError(f"{out.path(d)}/{ix['name']}: size or sha256 differs from its part "
                         f"manifest (damaged); {redo}")
    try:
        sample_index.decode(data, f"sample index {out.path(d)}/{ix['name']}", e["samples"], e["bytes"])
    except DataError as ex:
        raise MergeError(f"{ex}; {redo}") from None


def merge(output: str) -> dict:
    """`shard.py merge`: check the parts of `output`'s plan, resolve duplicates across units,
    write `manifest.json`; returns it.

    Raises MergeError (one line naming the unit or shard and what to rerun) for a failed check
    (module docstring), UserError when there is no plan. Shards are read once each (sha256).
    """
    out = planned_output(output)
    plan = read_plan(out)
    tok_json = plan["tokenizer"]
    n = len(plan["units"])
    parts = [_read_part(out, plan, i, tok_json) for i in range(n)]
    keys = DigestSet(width=16, key_bytes=16)
    seen = DigestSet(width=16, key_bytes=10)
    skipped: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    part_inputs, across = 0, 0
    drops: dict[int, set] = {}
    logs = []
    decon = plan["options"].get("decontaminate")
    blocks = []
    for i, part in enumerate(parts):
        d, redo = unit_dir(i), _rerun(output, plan, i)
        if decon:
            blocks.append(_check_decontamination(out, part, d, decon, redo))
        log = _read_log(out, part, d, redo)
        logs.append(log)
        outcomes = part["records_log"]["outcomes"]
        by = collections.Counter(outcomes[k] for k in log["outcome"].tolist())
        pc = part.get("counts", {})
        ps = part.get("skipped", {})
        bad = [r for r, c in by.items() if r != "written" and ps.get(r, 0) < c]
        if by.get("written", 0) != pc.get("records", 0) or bad or \
                int(log["dropped"].sum()) > ps.get("over_length_turns", 0):
            raise MergeError(f"{out.path(d)}/{MANIFEST}: its counts do not add up with its "
                             f"records log (written {pc.get('records', 0)}, logged "
                             f"{by.get('written', 0)}); {redo}")
        part_inputs += input_records(part)
        skipped.update(ps)
        for k in ("records", "special_token_text", "unsafe_piece_cuts"):
            counts[k] += int(pc.get(k, 0))
        # the global duplicate filter, in plan order
        for r, digest in enumerate(log["digest"]):
            got = seen.add(digest.tobytes())
            if got == KEY_COLLISION:
                raise RuntimeError(f"duplicate sample key {digest.tobytes().hex()[:20]} (hash "
                                   "collision); report this")
            if got != DUPLICATE:
                continue
            reason = outcomes[int(log["outcome"][r])]
            skipped["duplicate"] += 1
            across += 1
            if reason == "written":
                counts["records"] -= 1
                drops.setdefault(i, set()).add(digest.tobytes().hex()[:20])
            else:
                skipped[reason] -= 1
            skipped["over_length_turns"] -= int(log["dropped"][r])
            counts["special_token_text"] -= int(log["special"][r])
            counts["unsafe_piece_cuts"] -= int(log["cuts"][r])
        for split in SPLITS:
            for e in part["splits"][split]:
                path = out.path(f"{d}/{e['name']}")
                samples = 0
                try:
                    for key, _, _ in _samples(out, d, e, verify="error"):
                        samples += 1
                        if i not in drops and keys.add(_key_digest(key)) != "new":
                            raise MergeError(f"{path}: sample key {key} appears twice in the "
                                             f"dataset; {redo}")
                except DataError as ex:
                    raise MergeError(f"{ex} (damaged or replaced); {redo}") from None
                if samples != e["samples"]:
                    raise MergeError(f"{path}: {samples} samples, its part manifest says "
                                     f"{e['samples']} (damaged or replaced); {redo}")
                _check_index(out, d, e, redo)
    splits = {s: [] for s in SPLITS}
    for i, part in enumerate(parts):
        d = unit_dir(i)
        for split in SPLITS:
            entries = part["splits"][split]
            if i in drops:
                entries = _rewrite(out, plan, i, split, entries, drops[i])
                for e in entries:
                    for key, _, _ in _samples(out, d, e):
                        if keys.add(_key_digest(key)) != "new":
                            raise MergeError(f"{out.path(d)}/{e['name']}: sample key {key} "
                                             "appears twice in the dataset; report this")
            splits[split] += [{**{k: e[k] for k in ("name", "samples", "tokens", "bytes", "sha256")},
                               "name": f"{d}/{e['name']}",
                               "index": {**e["index"], "name": f"{d}/{e['index']['name']}"}}
                              for e in entries]
    skipped = collections.Counter({k: v for k, v in skipped.items() if v})
    manifest = {
        "format_version": FORMAT_VERSION, "tokenizer": tok_json,
        "max_length": plan["options"]["max_length"], "options": plan["options"],
        "splits": splits, "skipped": dict(sorted(skipped.items())),
        "counts": {"special_token_text": counts["special_token_text"],
                   "records": counts["records"],
                   "unsafe_piece_cuts": counts["unsafe_piece_cuts"]},
        "inputs": plan["inputs"], "fingerprint": plan["fingerprint"],
        "plan": {"units": n, "duplicates_across_units": across,
                 "rewritten_units": sorted(drops)},
    }
    if decon:  # contaminated records never pass a unit's duplicate filter: the sum is exact
        manifest["decontamination"] = merge_blocks(decon, blocks)
    if input_records(manifest) != part_inputs:
        raise MergeError(f"{out.path(PLAN)}: merged counts do not add up (input records "
                         f"{input_records(manifest)}, the parts read {part_inputs}); report this")
    out.write_json(MANIFEST, with_checksum(manifest))
    return manifest


def _items(out: Output, d: str, entry: dict):
    """Items of a shard: `(key, tokens uint32[n], prompt_length)` per segment (a packed
    sample's segments carry their item's key; an unpacked sample is one item)."""
    for key, tokens, meta in _samples(out, d, entry):
        ids, segments = _decode(key, tokens, meta)
        for seg in segments:
            k = seg.get("key", key)
            yield k, ids[seg["start"]:seg["end"]], seg["prompt_length"]


def _rewrite(out: Output, plan: dict, i: int, split: str, entries: list[dict],
             drop: set) -> list[dict]:
    """Unit `i`'s shards of `split` without the items of the records in `drop` (record keys),
    written as `dedup-<split>-NNNNNN.tar` in its part folder; returns their entries."""
    d = unit_dir(i)
    unit_out = Output(f"{out.url.rstrip('/')}/{d}")
    opts = unit_options(plan, i)
    for p in unit_out.fs.ls(unit_out.root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(f"{DEDUP_PREFIX}{split}-"):
            unit_out.remove(name)
    w = SplitWriter(split, unit_out, opts, [], lambda _w: None, prefix=DEDUP_PREFIX)
    try:
        pos = 0
        for e in entries:
            for key, ids, p in _items(out, d, e):
                if key.split("-", 1)[0] in drop:
                    continue
                w.add(Item(split, pos, 0, key, ids, p))
                pos += 1
        w.finish()
    finally:
        w.abort()
    return w.entries
