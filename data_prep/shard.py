"""`python data_prep/shard.py [plan|run|merge] ...` (also `python -m data_prep.shard`): tokenize
a corpus into ReFusion webdataset shards (data_prep/README.md).

Owns: nothing but the entry point. The command line and its exit codes are data_prep/cli.py;
the pipeline, its options and checks are data_prep/prepare.py; the stages of a run on many
machines are data_prep/plan.py and data_prep/merge.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's data_prep package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from data_prep.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
