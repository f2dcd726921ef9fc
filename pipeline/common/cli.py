"""Conventions every entry point shares (`pipeline.*` CLIs, `data_prep/*.py`, `pipeline.launch`):
exit codes, the user-error type, dtype names.

Owns: the exit code numbers and what each means (entry points return these names, never bare
numbers), `UsageError`, and the `--dtype` names. Imports only torch.
"""
from __future__ import annotations

import torch

EXIT_OK = 0
# A stage failed for a reason not listed below (its traceback or failing command is shown).
EXIT_FAILED = 1
# A usage, config or input error found before or after start-up (one line on stderr); for
# training also a folder it must write that is read-only or not permitted, found at start-up.
EXIT_USAGE = 2
# Training stopped on a non-finite loss (`train.nan_policy=stop`).
EXIT_NONFINITE = 3
# An output could not be written: the filesystem is full or the quota is exceeded (found at
# start-up or later), and, for training, any failed checkpoint or metrics.jsonl write during the
# run (read-only, permission, ...); one line names the folder, the cause and what to do.
EXIT_DISK_FULL = 4
# Training: this rank stopped because another rank of the job is gone (killed, crashed, node
# lost) and a collective failed; one line per surviving rank. The cause is the other rank's own
# output or the launcher's line (`pipeline.launch` reports that rank's code, not this one).
EXIT_PEER_LOST = 5
# Training: the hang watchdog found a rank that made no progress for its allowance
# (`pipeline.training.watchdog`); one line per live rank naming the stuck rank(s), their host,
# last step and phase and how long they were silent; the report in <run_dir>/hang.json.
# `slurm/pretrain.sh` requeues the job on it (and on 5), `pipeline.launch --max-restarts N`
# restarts the workers; both resume from the latest checkpoint.
EXIT_HUNG = 6
# A second Ctrl-C: stopped at once, no checkpoint.
EXIT_INTERRUPTED = 130

# Codes whose cause the process has already printed as one line (launchers add nothing).
REPORTED = (EXIT_USAGE, EXIT_NONFINITE, EXIT_DISK_FULL, EXIT_PEER_LOST, EXIT_HUNG)

# `--dtype` names of the CLIs (each may offer a subset).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class UsageError(Exception):
    """A user input problem found by a CLI or the library it calls (a path, an option, a
    file's content): reported as one line on stderr, exit code `EXIT_USAGE`."""


def hidden_alias(parser, *names: str, dest: str, **kwargs) -> None:
    """Accept `names` (an older spelling of an option, e.g. `--tp` for
    `--tensor-parallel-size`) as the option stored in `dest`, without listing them in `--help`,
    so scripts written against the old spelling keep working.

    Args:
        parser: an `argparse.ArgumentParser` (or argument group) holding the visible option.
        names: the old spellings.
        dest: the visible option's `dest`.
        kwargs: the visible option's `type` / `action` (no default: the visible option's wins).
    """
    import argparse
    parser.add_argument(*names, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                        **kwargs)
