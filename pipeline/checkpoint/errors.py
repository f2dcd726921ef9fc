"""The checkpoint package's error types (a leaf module: raising them imports nothing else of
the package, so `store`, `reshard` and `safe_load` can all use them without an import circle).
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match the running job (a user
    input error for CLIs: one line, exit code 2)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (read-only filesystem, permission denied, disk full,
    quota exceeded, or another write error) on at least one rank. Raised on every rank with the
    same one-line message naming the folder, the failing rank(s), the cause (with the free space
    seen for a full disk or quota, `pipeline.common.diskspace`) and a remedy that fits it; the
    `.partial` folder has been removed and the previous complete checkpoint is still the
    latest."""
