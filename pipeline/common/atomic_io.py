"""Atomic file writes: a reader sees the old file or the new one, never a partial one.

Owns: the temp-file-then-rename pattern used by every small file the pipeline writes
(checkpoint metadata, run state, reports, plots, decode/eval results). Must not touch: what is
written, or folders written as a whole (`pipeline.model.hf` writes a folder under a temporary name).

Files get the mode a plain `open(path, "w")` would give (0o666 less the process umask), not
mkstemp's owner-only 0o600, so reports and checkpoints stay readable by the rest of a team.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", fsync: bool = False
                ) -> Iterator[str]:
    """Yield a temporary file name next to `path` (parent folders created); when the block
    ends without an exception the file replaces `path` (os.replace, atomic on POSIX), after
    an fsync when `fsync`. On any exception, KeyboardInterrupt included, the temporary file is
    removed and `path` is untouched.

    Args:
        path: the destination file.
        suffix: the temporary name's ending (some writers pick the format from it, e.g. ".png").
        fsync: flush the file's data to the device before the rename (checkpoint metadata).
    Raises:
        OSError: from creating, syncing or renaming the file (ENOSPC, EDQUOT, EACCES...).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = False) -> None:
    """Write `data` to `path` atomically (`atomic_path`). Raises OSError."""
    with atomic_path(path, fsync=fsync) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically (`atomic_path`). Raises OSError."""
    write_bytes(path, text.encode("utf-8"), fsync=fsync)


def write_json(path: str | os.PathLike, obj: Any, fsync: bool = False, **dump_kw) -> None:
    """Write `obj` as JSON (`indent=1` unless `dump_kw` says otherwise, then a newline) to
    `path` atomically. Raises OSError, or TypeError for an object JSON cannot hold."""
    text = json.dumps(obj, **{"indent": 1, **dump_kw}) + "\n"
    write_text(path, text, fsync=fsync)
