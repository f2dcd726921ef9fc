"""The command line of data preparation: `python data_prep/shard.py [plan|run|merge|index] ...`.

Owns: the options of the one-machine command and of the three stages of a run on many
machines, their checks (one line, exit code 2), and the mapping of errors to exit codes.
Must not touch: the pipeline (data_prep/prepare.py `run`), the plan and the tasks
(data_prep/plan.py), the merge (data_prep/merge.py). data_prep/shard.py, the entry point,
only calls `main`.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from pipeline.common.cli import EXIT_DISK_FULL, EXIT_USAGE
from pipeline.tokenizer import TokenizerError

from data_prep.decontaminate import DEFAULT_NGRAM, split_files
from data_prep import prepare
from data_prep.merge import merge
from data_prep.plan import make_plan, run_task
from data_prep.prepare import (NoSamples, TooManySkipped, check_not_empty, check_skip_share,
                               summary)
from data_prep.resume import UserError
from data_prep.sources import InputError, OneLineParser
from data_prep.writer import OutputError, OutputFull, index_shards

MAX_SKIP_FRACTION = 0.1    # default of --max-skip-fraction


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


STAGES = ("plan", "run", "merge", "index")  # the stages of a run on many machines
# (data_prep/plan.py); `index` writes the sample indexes of a folder made before they existed


def build_stage_parser(stage: str) -> argparse.ArgumentParser:
    """The parser of `shard.py plan|run|merge` (data_prep/README.md "On a cluster")."""
    if stage == "plan":
        return build_parser(prog="shard.py plan")
    if stage == "index":
        p = OneLineParser(prog="shard.py index", description="Write the missing sample indexes "
                          "(<shard>.idx) of a shard folder and record them in its manifest.json.")
        p.add_argument("output", metavar="DIR_OR_URL", help="a finished shard folder")
        return p
    p = OneLineParser(prog=f"shard.py {stage}")
    p.add_argument("--output", required=True, metavar="DIR_OR_URL",
                   help="the folder `shard.py plan` wrote")
    if stage == "run":
        p.add_argument("--task", type=int, default=None,
                       help="this task's index (default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN)")
        p.add_argument("--num-tasks", type=int, default=None,
                       help="number of tasks (default: SLURM_ARRAY_TASK_COUNT)")
        p.add_argument("--unit", type=int, action="append", default=None,
                       help="run this unit (repeatable) instead of a task's share, e.g. the "
                            "one a failed merge names")
        p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1 = in-process)")
        p.add_argument("--tokenizer", default=None,
                       help="the plan's tokenizer at another path (default: the plan's path)")
        p.add_argument("--overwrite", action="store_true",
                       help="make this task's parts again from scratch")
        p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)
    else:
        p.add_argument("--max-skip-fraction", type=float, default=MAX_SKIP_FRACTION,
                       help="as for the one-machine command")
    return p


def build_parser(prog: str = "shard.py") -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog, description="Tokenize inputs into ReFusion webdataset shards "
        "(format: ARCHITECTURE.md 'Shard format'). On many machines: `shard.py plan`, "
        "`shard.py run`, `shard.py merge` (data_prep/README.md).")
    p.add_argument("--input", action="append", required=True, metavar="PATH_GLOB_URL|stdlib",
                   help="input file, folder, glob or fsspec URL (.jsonl/.json/.txt/.parquet); "
                        "'stdlib' = the running interpreter's standard library sources. Repeatable.")
    p.add_argument("--output", required=True, metavar="DIR_OR_URL")
    p.add_argument("--tokenizer", required=True, metavar="HF_DIR_OR_SPM_MODEL")
    p.add_argument("--format", choices=("auto", "qa", "text", "chat"), default="auto",
                   help="qa = query/response pairs, text = documents, chat = conversations "
                        "(a messages list), auto = per record: chat when it has the messages "
                        "field, else qa when it has the query or response field, else text "
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
    p.add_argument("--messages-field", default="messages",
                   help="field of a chat record: a list of {role, content} messages, roles "
                        "system / user / assistant (data_prep/README.md 'Chat records')")
    p.add_argument("--chat-turns", choices=("all", "last"), default="all",
                   help="which assistant turns of a chat become responses: all (one sample "
                        "each, the conversation before it as its prompt) or only the last")
    p.add_argument("--max-skip-fraction", type=float, default=MAX_SKIP_FRACTION,
                   help="exit with code 2 when a skip reason covers more than this share of "
                        f"the input records (default {MAX_SKIP_FRACTION}); duplicate and "
                        "over_length only get a note; the shards are written either way")
    p.add_argument("--overwrite", action="store_true",
                   help="when --output holds shards made with other options, delete them and "
                        "start over (same options: kept / resumed as usual)")
    p.add_argument("--unit-bytes", type=_size, default=_size("64M"),
                   help="bytes of input per work unit (default 64M): larger JSONL files are cut "
                        "into newline-aligned ranges, Parquet into row groups (plan); with "
                        "--pack a packed sample never spans two units (both commands)")
    p.add_argument("--decontaminate", action="append", default=None, metavar="FILE[,FILE...]",
                   help="evaluation files (JSONL/JSON: every string value, or the "
                        "--decontaminate-field ones; other files: one item per paragraph): "
                        "drop training records sharing an n-gram of words with an item, counted "
                        "per file in the manifest (data_prep/README.md 'Decontamination'). "
                        "Repeatable")
    p.add_argument("--decontaminate-ngram", type=int, default=None, metavar="N",
                   help=f"words per n-gram (default {DEFAULT_NGRAM}); shorter items are not used")
    p.add_argument("--decontaminate-field", action="append", default=None, metavar="FIELD",
                   help="JSONL field of an evaluation record to read (repeatable; a.b for a "
                        "nested one); default: every string value")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 no sample written, 2 user error,
    3 a skip reason covers more than --max-skip-fraction of the input (shards written),
    4 the output filesystem is full or over quota, 130 interrupted by Ctrl-C; after 4 and 130
    complete shards are kept and a rerun resumes)."""
    # Ctrl-C must reach us even when started with SIGINT ignored (an inherited SIG_IGN, e.g.
    # from a parent that ignores it): the handling below relies on KeyboardInterrupt.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else list(argv)
    stage = argv[0] if argv and argv[0] in STAGES else None
    parser = build_stage_parser(stage) if stage else build_parser()
    args = parser.parse_args(argv[1:] if stage else argv)
    if stage in ("run", "merge", "index"):
        if stage == "run" and args.workers < 1:
            parser.error("--workers must be >= 1")
        return _guarded(lambda: _stage(stage, args))
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
    if not 0.0 <= args.max_skip_fraction <= 1.0:
        problems.append("--max-skip-fraction must be in [0, 1]")
    if args.unit_bytes < 1:
        problems.append("--unit-bytes must be >= 1")
    if not split_files(args.decontaminate) and (args.decontaminate_ngram is not None
                                                or args.decontaminate_field):
        problems.append("--decontaminate-ngram and --decontaminate-field need --decontaminate")
    if args.decontaminate_ngram is None:
        args.decontaminate_ngram = DEFAULT_NGRAM
    elif args.decontaminate_ngram < 1:
        problems.append("--decontaminate-ngram must be >= 1")
    if problems:
        parser.error("; ".join(problems))
    if stage == "plan":
        return _guarded(lambda: make_plan(args))
    return _guarded(lambda: prepare.run(args))


def _stage(stage: str, args) -> None:
    """`shard.py run` / `merge` / `index` (data_prep/plan.py, data_prep/merge.py,
    data_prep/writer.py `index_shards`)."""
    if stage == "run":
        run_task(args)
        return
    if stage == "index":
        written, kept = index_shards(args.output, log=lambda line: print(f"shard.py: {line}",
                                                                         file=sys.stderr))
        print(f"shard.py: {args.output}: {written} sample index(es) written, {kept} already "
              "valid", file=sys.stderr)
        return
    t0 = time.time()
    manifest = merge(args.output)
    check_not_empty(manifest)
    print(f"shard.py: merged {manifest['plan']['units']} part(s) "
          f"({manifest['plan']['duplicates_across_units']} duplicate(s) across units dropped): "
          f"{summary(args.output, manifest)} ({time.time() - t0:.1f} s)", file=sys.stderr)
    check_skip_share(manifest, args.max_skip_fraction)


def _guarded(action) -> int:
    """Run `action()`; user errors become one line on stderr and the exit code (main)."""
    try:
        action()
    except (UserError, InputError, TokenizerError, OutputError) as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OutputFull as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return EXIT_DISK_FULL
    except NoSamples as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return 1
    except TooManySkipped as e:
        print(f"shard.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("shard.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0
