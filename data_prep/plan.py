"""Data prep on many machines, stages 1 and 2: the plan (`shard.py plan`) and the run of one
array task (`shard.py run`). Stage 3, the merge, is data_prep/merge.py.

Owns: `plan.json` (the frozen input list with each input's identity, the options, the
tokenizer's description and path, and the work units), dealing units to tasks, and running
a task's units through the shard pipeline (data_prep/prepare.py `run(args, unit)`) into one
part folder per unit.
Must not touch: cutting inputs into units and reading a unit's records (data_prep/units.py),
tokenization and shard writing (data_prep/prepare.py, writer.py), the global duplicate filter
and the final manifest (data_prep/merge.py).

Layout of the output folder:
- `plan.json`: written once, atomically (temp name + rename); a different plan over it is
  refused (exit code 2) unless `--overwrite`, which also clears the parts and the manifest.
- `tokenizer/`: the tokenizer's loadable copy, saved by the plan (`manifest.json`
  `tokenizer.files`).
- `parts/uNNNNNN/`: unit N's part, a shard folder of its own (`train-000000.tar`, ...,
  `records.npz`, `manifest.json` last, the part's completion mark); a unit's run resumes from
  its `manifest.partial.json` like the one-machine command.
- `manifest.json`: written by the merge only, after its checks.

Work units (how inputs are cut, the order of their records): data_prep/units.py.

Dealing: units are dealt to K tasks by longest-first (each unit to the task with the least
bytes so far, ties to the lower task), a function of the plan and K only; the output of a
unit does not depend on K, so a rerun with another K, a task run twice or tasks run in any
order leave the same parts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

from pipeline.data.format import MANIFEST
from pipeline.tokenizer import load_tokenizer

from data_prep import prepare
from data_prep.decontaminate import EvalSets
from data_prep.resume import TOKENIZER_DIR, UserError, clear, differences
from data_prep.sources import (STDLIB, Fields, Source, input_changes, input_identity,
                               resolve_inputs, url_to_fs)
from data_prep.units import cut_units, unit_reads
from data_prep.writer import Output

PLAN = "plan.json"
PLAN_VERSION = 1
PARTS = "parts"


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


@dataclass
class UnitJob:
    """One unit's run, as `prepare.run(args, unit)` takes it (see there)."""
    out_url: str
    tok: object
    sources: list
    opts: dict
    inputs: list
    reads: object       # digests dict -> [(source, records)]
    extra: dict = field(default_factory=dict)   # added to the part's manifest.json
    decon: EvalSets | None = None   # --decontaminate: the plan's evaluation sets


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
    clear(out)
    for name in (PLAN, PARTS):
        out.remove(name)


def make_plan(args) -> dict:
    """`shard.py plan`: write `plan.json` (and `tokenizer/`) into `args.output`; returns it.

    Raises UserError when the folder holds another plan or one-machine shards (unless
    `args.overwrite`), InputError / TokenizerError for inputs and tokenizer as the
    one-machine command does.
    """
    if args.limit is not None:
        raise UserError("--limit needs one process reading in order; use the one-machine "
                        "command (shard.py without plan/run/merge)")
    tok = load_tokenizer(args.tokenizer)
    sources = resolve_inputs(args.input, output=args.output)
    decon = EvalSets.from_args(args)  # read and checked now; each task reads them again
    opts = {**prepare.options(args, sources, decon), "unit_bytes": args.unit_bytes}  # (also with --pack)
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
    prepare.save_tokenizer(out, tok)
    out.write_json(PLAN, plan)
    total = sum(u["bytes"] for u in units)
    print(f"shard.py: planned {len(units)} unit(s) over {len(inputs)} input(s), {total} bytes "
          f"({out.path(PLAN)}); next: `shard.py run --output {args.output} --task I "
          f"--num-tasks K` for I in 0..K-1, then `shard.py merge --output {args.output}`",
          file=sys.stderr)
    return plan


def _plan_difference(old: dict, new: dict) -> str:
    """What differs between two plans, in words (for the refusal)."""
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
    (`prepare.run(args, unit)`). Raises UserError when the plan is missing, an input of these
    units changed since the plan (one line naming it), or the tokenizer is not the plan's;
    EvalSetError when a `--decontaminate` file changed since the plan.
    """
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
    # the plan's evaluation files, refused in one line when one changed since the plan
    decon = EvalSets.from_spec(o["decontaminate"]) if o.get("decontaminate") else None
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
                      extra={"plan": plan["fingerprint"], "unit": i}, decon=decon)
        part = prepare.run(run_args, job)
        if not part:  # --stop-after-shards
            return []
        parts.append(part)
    print(f"shard.py: {who} done: {len(mine)} unit(s) "
          f"({time.time() - t0:.1f} s); when every task is done: `shard.py merge --output "
          f"{args.output}`", file=sys.stderr)
    return parts
