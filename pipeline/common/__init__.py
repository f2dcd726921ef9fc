"""Small helpers every layer may import (data prep included); they import nothing else of ours.

- `cli.py`: the exit codes of every entry point, `UsageError`, dtype names;
- `atomic_io.py`: atomic file writes (temp file, optional fsync, rename);
- `diskspace.py`: the cause of a failed write (read-only, permission, disk full, quota) with a
  remedy that fits it, and the start-up write probe (`check_writable`);
- `fs.py`: fsspec filesystems for URLs, with one-line errors for missing packages.
"""
