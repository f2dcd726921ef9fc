"""Data prep on many machines, stages 1 and 2: the plan (`shard.py plan`) and the run of one
array task (`shard.py run`). Stage 3, the merge, is data_prep/merge.py.

Owns: `plan.json` (the frozen input list with each input's identity, the options, the
tokenizer's description and path, and the work units), cutting inputs into units, dealing
units to tasks, reading one unit's records, and running a task's units through the shard
pipeline (data_prep/shard.py `run(args, unit)`) into one part folder per unit.
Must not touch: tokenization and shard writing (data_prep/shard.py, writer.py), the global
duplicate filter and the final manifest (data_prep/merge.py).

Layout of the output folder:
- `plan.json`: written once, atomically (temp name + rename); a different plan over it is
  refused (exit code 2) unless `--overwrite`, which also clears the parts and the manifest.
- `tokenizer/`: the tokenizer's loadable copy, saved by the plan (`manifest.json`
  `tokenizer.files`).
- `parts/uNNNNNN/`: unit N's part, a shard folder of its own (`train-000000.tar`, ...,
  `records.npz`, `manifest.json` last, the part's completion mark); a unit's run resumes from
  its `manifest.partial.json` like the one-machine command.
- `manifest.json`: written by the merge only, after its checks.

Work units (sizes in bytes of the stored file): an uncompressed JSONL file (`.jsonl`, or a
`.json` whose first non-blank byte is not `[`) larger than `--unit-bytes` is cut into byte
ranges that start right after a `\\n` (so each range holds whole lines: lines end with `\\n`,
`\\r\\n` or `\\r`, and a range never starts inside a `\\r\\n`); a Parquet file is cut into runs
of consecutive row groups of about `--unit-bytes` (uncompressed size from its metadata); a
JSON list, a compressed file, a text file (one document) and the stdlib corpus are read whole.
Consecutive small files share a unit until it holds `--unit-bytes`. A unit's records come in
the order a one-process run reads them, and units follow input order, so "plan order" is
input order.

Dealing: units are dealt to K tasks by longest-first (each unit to the task with the least
bytes so far, ties to the lower task), a function of the plan and K only; the output of a
unit does not depend on K, so a rerun with another K, a task run twice or tasks run in any
order leave the same parts.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field

from data_prep.resume import TOKENIZER_DIR, UserError
from data_prep.sources import (BOM, PARQUET_EXTS, STDLIB, Fields, Source,
                               _jsonl_records, _lines, input_changes, input_identity,
                               iter_records, url_to_fs)
from data_prep.writer import Output

PLAN = "plan.json"
PLAN_VERSION = 1
PARTS = "parts"
UNIT_BYTES = 64 << 20  # default --unit-bytes
_SCAN = 1 << 20        # bytes read at a time when looking for a line end


def unit_dir(index: int) -> str:
    """The part folder of unit `index`, relative to the output folder."""
    return f"{PARTS}/u{index:06d}"


def unit_options(plan: dict, index: int) -> dict:
    """The options a unit's part records (its resume fingerprint): the plan's options, the
    plan's fingerprint and the unit's index."""
    return {**plan["options"], "plan": plan["fingerprint"], "unit": index}


def describe_unit(plan: dict, index: int) -> str:
    """`unit 3 (data.jsonl bytes 0-67108871, b.jsonl)` for messages."""
    names = []
    for piece in plan["units"][index]["pieces"][:3]:
        name = plan["inputs"][piece["input"]]["name"]
        if "start" in piece:
            name += f" bytes {piece['start']}-{piece['end']}"
        elif "row_groups" in piece:
            rg = piece["row_groups"]
            name += f" row groups {rg[0]}-{rg[-1]}"
        names.append(name)
    more = len(plan["units"][index]["pieces"]) - 3
    return f"unit {index} ({', '.join(names)}{f' and {more} more' if more > 0 else ''})"


# ----------------------------------------------------------------------------- cutting

def _first_byte(source: Source) -> bytes:
    """The first non-blank byte of a file (after a byte order mark), b"" when there is none
    in its first MiB."""
    with source.fs.open(source.path, "rb") as f:
        head = f.read(_SCAN)
    if head.startswith(BOM):
        head = head[len(BOM):]
    return head.lstrip()[:1]


def _line_cuts(source: Source, size: int, unit_bytes: int) -> list[int]:
    """Offsets (bytes) just after a `\\n`, one at or after each multiple of `unit_bytes`,
    strictly inside the file; reads only around each target."""
    cuts: list[int] = []
    with source.fs.open(source.path, "rb") as f:
        target = unit_bytes
        while target < size - unit_bytes // 4:  # no range of less than a quarter unit at the end
            pos = max(target - 1, cuts[-1] if cuts else 0)
            f.seek(pos)
            while True:
                block = f.read(_SCAN)
                if not block:
                    return cuts
                i = block.find(b"\n")
                if i >= 0:
                    cut = pos + i + 1
                    break
                pos += len(block)
            if cut >= size:
                return cuts
            cuts.append(cut)
            target = max(target + unit_bytes, cut + 1)
    return cuts


def _pieces(j: int, source: Source, ident: dict, unit_bytes: int) -> list[tuple[dict, int]]:
    """`(piece, bytes)` of input `j` in order: byte ranges, row-group runs, or the whole file."""
    size = int(ident.get("size") or 0)
    if source.is_stdlib:
        return [({"input": j}, 0)]
    lower = source.path.lower()
    if lower.endswith(PARQUET_EXTS):
        try:
            import pyarrow.parquet as pq
            with source.fs.open(source.path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                groups = [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size)
                          for i in range(meta.num_row_groups)]
        except Exception:  # not Parquet: the run counts it as unreadable_file, once
            return [({"input": j}, size)]
        out, run, nbytes, row = [], [], 0, 0
        first = 0
        for i, (rows, b) in enumerate(groups):
            if run and nbytes + b > unit_bytes:
                out.append(({"input": j, "row_groups": run, "first_row": first}, nbytes))
                run, nbytes, first = [], 0, row
            run.append(i)
            nbytes += b
            row += rows
        if run:
            out.append(({"input": j, "row_groups": run, "first_row": first}, nbytes))
        return out or [({"input": j}, size)]
    jsonl = lower.endswith(".jsonl") or lower.endswith(".json")
    if not jsonl or size <= unit_bytes or _first_byte(source) in (b"[", b""):
        return [({"input": j}, size)]
    bounds = [0, *_line_cuts(source, size, unit_bytes), size]
    return [({"input": j, "start": a, "end": b}, b - a) for a, b in zip(bounds, bounds[1:])]


def cut_units(sources: list[Source], inputs: list[dict], unit_bytes: int) -> list[dict]:
    """Work units `[{"pieces": [...], "bytes": n}]` in input order (module docstring)."""
    units, cur, nbytes = [], [], 0
    for j, (source, ident) in enumerate(zip(sources, inputs)):
        for piece, b in _pieces(j, source, ident, unit_bytes):
            if cur and (nbytes + b > unit_bytes or len(piece) > 1):
                units.append({"pieces": cur, "bytes": nbytes})
                cur, nbytes = [], 0
            cur.append(piece)
            nbytes += b
            if len(piece) > 1:  # a range or row-group run is a unit of its own
                units.append({"pieces": cur, "bytes": nbytes})
                cur, nbytes = [], 0
    if cur:
        units.append({"pieces": cur, "bytes": nbytes})
    return units


def deal(plan: dict, num_tasks: int) -> list[list[int]]:
    """Unit indices of each of `num_tasks` tasks (longest first to the least loaded task),
    each list in plan order."""
    loads = [0] * num_tasks
    tasks: list[list[int]] = [[] for _ in range(num_tasks)]
    units = plan["units"]
    for i in sorted(range(len(units)), key=lambda i: (-units[i]["bytes"], i)):
        t = min(range(num_tasks), key=lambda t: (loads[t], t))
        loads[t] += units[i]["bytes"] + 1
        tasks[t].append(i)
    return [sorted(t) for t in tasks]


# ----------------------------------------------------------------------------- reading a unit

class _Range(io.RawIOBase):
    """The bytes [start, end) of an open binary file, hashed (sha256) as they are read."""

    def __init__(self, f, start: int, end: int):
        f.seek(start)
        self.f, self.left, self.sha = f, end - start, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(min(len(b), self.left)) if self.left > 0 else b""
        b[:len(data)] = data
        self.left -= len(data)
        self.sha.update(data)
        return len(data)


def _range_records(source: Source, start: int, end: int, digests: dict):
    """JSONL records of the byte range [start, end) of `source` (record ids
    `name@start#line`, lines counted from the range's start); `digests["name@start"]` is set
    to the sha256 of the range's bytes once read."""
    name = f"{source.name}@{start}"
    with source.fs.open(source.path, "rb") as f:
        rng = _Range(f, start, end)
        lines = _lines(io.BufferedReader(rng, 1 << 20))
        n = 0
        for line in lines:
            if n == 0 and start == 0 and line.startswith(BOM):
                line = line[len(BOM):]
            n += 1
            if line.strip():
                yield from _jsonl_records(line, n, lines, name)
                break
        digests[name] = rng.sha.hexdigest()


def unit_reads(units: list[dict], index: int, sources: list[Source], fmt: str, fields: Fields,
               digests: dict) -> list:
    """`(source, records)` of each piece of `units[index]`, in order (shard._stage_a's reads)."""
    from data_prep.sources import _parquet_records
    reads = []
    for piece in units[index]["pieces"]:
        source = sources[piece["input"]]
        if "start" in piece:
            recs = _range_records(source, piece["start"], piece["end"], digests)
        elif "row_groups" in piece:
            recs = _parquet_records(source, fields, piece["row_groups"], piece["first_row"])
        else:
            recs = iter_records(source, fmt, fields, digests)
        reads.append((source, recs))
    return reads


@dataclass
class UnitJob:
    """One unit's run, as `shard.run(args, unit)` takes it (see there)."""
    out_url: str
    tok: object
    sources: list
    opts: dict
    inputs: list
    reads: object       # digests dict -> [(source, records)]
    extra: dict = field(default_factory=dict)   # added to the part's manifest.json


# ----------------------------------------------------------------------------- plan

def planned_output(url: str) -> Output:
    """The output folder of a plan, for `run` and `merge`. Raises UserError (one line) when
    it holds no plan.json, without creating the folder; InputError for an unknown protocol."""
    fs, root = url_to_fs(url, what="output")
    if not fs.exists(f"{root.rstrip('/')}/{PLAN}"):
        raise UserError(f"{url.rstrip('/')}/{PLAN}: no plan; run `shard.py plan --output {url} "
                        "...` first")
    return Output(url)


def read_plan(out: Output) -> dict:
    """The plan of an output folder. Raises UserError when there is none or it is unreadable."""
    if not out.exists(PLAN):
        raise UserError(f"{out.path(PLAN)}: no plan; run `shard.py plan --output {out.url} ...` first")
    try:
        plan = out.read_json(PLAN)
    except (OSError, ValueError) as e:
        raise UserError(f"{out.path(PLAN)}: unreadable plan ({type(e).__name__}); make it again "
                        "with `shard.py plan ... --overwrite`") from None
    if not isinstance(plan, dict) or plan.get("plan_version") != PLAN_VERSION:
        raise UserError(f"{out.path(PLAN)}: not a plan of this version; make it again with "
                        "`shard.py plan ... --overwrite`")
    return plan


def plan_sources(plan: dict) -> list[Source]:
    """Sources of a plan's inputs (by their recorded names). Raises InputError for a protocol
    whose filesystem package is missing."""
    out = []
    for ident in plan["inputs"]:
        name = ident["name"]
        if name == STDLIB:
            out.append(Source(name=STDLIB))
            continue
        fs, path = url_to_fs(name)
        out.append(Source(name=name, fs=fs, path=path))
    return out


def _clear(out: Output) -> None:
    """Remove a distributed run's files: plan, parts, manifests, tokenizer/."""
    from data_prep.resume import clear
    clear(out)
    for name in (PLAN, PARTS):
        out.remove(name)


def make_plan(args) -> dict:
    """`shard.py plan`: write `plan.json` (and `tokenizer/`) into `args.output`; returns it.

    Raises UserError when the folder holds another plan or one-machine shards (unless
    `args.overwrite`), InputError / TokenizerError for inputs and tokenizer as the
    one-machine command does.
    """
    from data_prep import shard
    from pipeline.data.format import MANIFEST
    from pipeline.tokenizer import load_tokenizer
    if args.limit is not None:
        raise UserError("--limit needs one process reading in order; use the one-machine "
                        "command (shard.py without plan/run/merge)")
    tok = load_tokenizer(args.tokenizer)
    sources = shard.resolve_inputs(args.input, output=args.output)
    opts = {**shard._options(args, sources), "unit_bytes": args.unit_bytes}  # (also with --pack)
    tok_json = tok.info.to_json()
    tok_json["files"] = TOKENIZER_DIR
    inputs = [input_identity(s) for s in sources]
    units = cut_units(sources, inputs, args.unit_bytes)
    body = {"options": opts, "tokenizer": tok_json, "inputs": inputs, "units": units}
    fp = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    plan = {"plan_version": PLAN_VERSION, "fingerprint": fp, **body,
            "tokenizer_path": os.path.abspath(args.tokenizer)
            if os.path.exists(args.tokenizer) else args.tokenizer}
    out = Output(args.output)
    old = None
    if out.exists(PLAN):
        try:
            old = out.read_json(PLAN)
        except (OSError, ValueError):
            old = {}
    if old is not None and old.get("fingerprint") == fp:
        print(f"shard.py: {out.path(PLAN)}: the same plan is there; kept", file=sys.stderr)
        return old
    if old is not None or out.exists(MANIFEST) or out.exists(PARTS):
        if not args.overwrite:
            what = (f"another plan ({_plan_difference(old, plan)})" if old is not None
                    else "shards made another way")
            raise UserError(f"{out.path(PLAN if old is not None else MANIFEST)}: this folder "
                            f"holds {what}; use another --output or pass --overwrite")
        _clear(out)
    shard._save_tokenizer(out, tok)
    out.write_json(PLAN, plan)
    total = sum(u["bytes"] for u in units)
    print(f"shard.py: planned {len(units)} unit(s) over {len(inputs)} input(s), {total} bytes "
          f"({out.path(PLAN)}); next: `shard.py run --output {args.output} --task I "
          f"--num-tasks K` for I in 0..K-1, then `shard.py merge --output {args.output}`",
          file=sys.stderr)
    return plan


def _plan_difference(old: dict, new: dict) -> str:
    """What differs between two plans, in words (for the refusal)."""
    from data_prep.resume import differences
    if not isinstance(old, dict):
        return "unreadable"
    if old.get("options") != new["options"] or old.get("tokenizer") != new["tokenizer"]:
        return differences(old, new["options"], new["tokenizer"])
    if old.get("inputs") != new["inputs"]:
        change = input_changes(old.get("inputs") or [], new["inputs"], [])
        return change or "other input identities"
    return "other work units"


# ----------------------------------------------------------------------------- run

def task_from_env(task: int | None, num_tasks: int | None) -> tuple[int, int]:
    """(task, number of tasks) from the options, else SLURM_ARRAY_TASK_ID minus
    SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_COUNT. Raises UserError when neither gives
    them or they are out of range."""
    env = os.environ
    if task is None and "SLURM_ARRAY_TASK_ID" in env:
        task = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
    if num_tasks is None and "SLURM_ARRAY_TASK_COUNT" in env:
        num_tasks = int(env["SLURM_ARRAY_TASK_COUNT"])
    if task is None or num_tasks is None:
        raise UserError("shard.py run needs --task and --num-tasks (or a SLURM array's "
                        "SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT)")
    if num_tasks < 1 or not 0 <= task < num_tasks:
        raise UserError(f"--task {task} --num-tasks {num_tasks}: expected 0 <= task < num-tasks")
    return task, num_tasks


def run_task(args) -> list[dict]:
    """`shard.py run`: run the units dealt to task `args.task` of `args.num_tasks` (or the
    units `args.unit` names); returns their part manifests ([] when stopped by
    --stop-after-shards).

    Each unit's part is kept when complete, resumed when interrupted, made otherwise
    (`shard.run(args, unit)`). Raises UserError when the plan is missing, an input of these
    units changed since the plan (one line naming it), or the tokenizer is not the plan's.
    """
    from data_prep import shard
    from pipeline.tokenizer import load_tokenizer
    out = planned_output(args.output)
    plan = read_plan(out)
    if args.unit:
        bad = [u for u in args.unit if not 0 <= u < len(plan["units"])]
        if bad:
            raise UserError(f"--unit {bad[0]}: the plan has units 0..{len(plan['units']) - 1}")
        mine = sorted(set(args.unit))
        who = f"unit(s) {', '.join(map(str, mine))}"
    else:
        task, num_tasks = task_from_env(args.task, args.num_tasks)
        mine = deal(plan, num_tasks)[task]
        who = f"task {task} of {num_tasks}"
    sources = plan_sources(plan)
    used = sorted({p["input"] for i in mine for p in plan["units"][i]["pieces"]})
    now = [input_identity(sources[j]) for j in used]
    change = input_changes([plan["inputs"][j] for j in used], now, [sources[j] for j in used])
    if change is not None:
        raise UserError(f"{out.path(PLAN)}: {change} since the plan; make a new plan "
                        "(`shard.py plan ... --overwrite`) and run every task again")
    tok_path = args.tokenizer or plan["tokenizer_path"]
    tok = load_tokenizer(tok_path)
    tok_json = {**tok.info.to_json(), "files": TOKENIZER_DIR}
    if tok_json != plan["tokenizer"]:
        raise UserError(f"tokenizer {tok_path}: not the plan's ({plan['tokenizer'].get('name')} "
                        f"hash {str(plan['tokenizer'].get('hash'))[:12]}); pass --tokenizer "
                        "with the plan's tokenizer")
    o = plan["options"]
    fields = Fields(o["fields"]["query"], o["fields"]["response"], o["fields"]["text"],
                    o["fields"]["messages"])
    run_args = argparse.Namespace(
        format=o["format"], max_length=o["max_length"], slot_sizes=tuple(o["slot_sizes"]),
        seed=o["seed"], val_fraction=o["val_fraction"], pack=o["pack"],
        long_text=o["long_text"], shard_samples=o["shard_samples"],
        shard_bytes=o["shard_bytes"], limit=None, query_field=fields.query,
        response_field=fields.response, text_field=fields.text,
        messages_field=fields.messages, chat_turns=o["chat_turns"], workers=args.workers,
        no_progress=True, tokenizer=tok_path, overwrite=args.overwrite,
        stop_after_shards=args.stop_after_shards, max_skip_fraction=1.0)
    t0, parts = time.time(), []
    print(f"shard.py: {who}: {len(mine)} unit(s) of {len(plan['units'])}",
          file=sys.stderr)
    for i in mine:
        url = f"{args.output.rstrip('/')}/{unit_dir(i)}"
        if args.overwrite:
            out.remove(unit_dir(i))

        def reads(digests, i=i):
            return unit_reads(plan["units"], i, sources, o["format"], fields, digests)
        job = UnitJob(out_url=url, tok=tok, sources=sources, opts=unit_options(plan, i),
                      inputs=plan["inputs"], reads=reads,
                      extra={"plan": plan["fingerprint"], "unit": i})
        part = shard.run(run_args, job)
        if not part:  # --stop-after-shards
            return []
        parts.append(part)
    print(f"shard.py: {who} done: {len(mine)} unit(s) "
          f"({time.time() - t0:.1f} s); when every task is done: `shard.py merge --output "
          f"{args.output}`", file=sys.stderr)
    return parts
