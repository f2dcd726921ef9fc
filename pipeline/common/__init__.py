"""Small helpers every layer may import (data prep included); they import nothing else of ours.

- `exit_codes.py`: the exit codes of every entry point;
- `atomic_io.py`: atomic file writes (temp file, optional fsync, rename);
- `diskspace.py`: the cause of a failed write (disk full, quota) with the free space seen;
- `fs.py`: fsspec filesystems for URLs, with one-line errors for missing packages.
"""
