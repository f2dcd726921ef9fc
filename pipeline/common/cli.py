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
# A usage, config or input error found before or after start-up (one line on stderr).
EXIT_USAGE = 2
# Training stopped on a non-finite loss (`train.nan_policy=stop`).
EXIT_NONFINITE = 3
# An output could not be written: the filesystem is full or the quota is exceeded (and, for
# training, any other failed checkpoint or metrics.jsonl write); one line names the folder.
EXIT_DISK_FULL = 4
# A second Ctrl-C: stopped at once, no checkpoint.
EXIT_INTERRUPTED = 130

# Codes whose cause the process has already printed as one line (launchers add nothing).
REPORTED = (EXIT_USAGE, EXIT_NONFINITE, EXIT_DISK_FULL)

# `--dtype` names of the CLIs (each may offer a subset).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class UsageError(Exception):
    """A user input problem found by a CLI or the library it calls (a path, an option, a
    file's content): reported as one line on stderr, exit code `EXIT_USAGE`."""
