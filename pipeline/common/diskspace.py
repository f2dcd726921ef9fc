"""Diagnosis of failed writes: was it a full disk or an exceeded quota, and how much space was free.

Owns: turning a write failure (an OSError, or a library error that hides one, such as torch's
`RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`) into one readable
cause. Must not touch: what was being written (callers clean up their own files).
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
PROBE_BYTES = 1 << 20


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes available to this user on the filesystem holding `path` (or its nearest existing
    parent); None when it cannot be read."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human_bytes(n: int | None) -> str:
    """`12.0 KiB`-style size (binary units); "unknown" for None."""
    if n is None:
        return "unknown"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def _errno_in_chain(e: BaseException) -> OSError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def _probe(path: str | os.PathLike) -> OSError | None:
    """Write and fsync `PROBE_BYTES` in `path`'s folder; the OSError it raised, if any."""
    d = os.path.abspath(os.fspath(path))
    while not os.path.isdir(d):
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".space-probe-", dir=d)
    except OSError as e:
        return e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def write_failure_cause(e: BaseException, path: str | os.PathLike) -> str:
    """One-line cause of a failed write under `path`, with the free space seen.

    An OSError in `e`'s chain gives the cause directly; otherwise (libraries that hide the
    errno) a 1 MiB probe write next to `path` tells a full disk or quota from other failures.

    Returns:
        e.g. "no space left on device (free space seen: 0 B)", "disk quota exceeded (...)", or
        "<ExceptionType>: <first line> (free space seen: ...)".
    """
    os_err = _errno_in_chain(e)
    if os_err is None or os_err.errno not in DISK_FULL_ERRNOS:
        probe = _probe(path)
        if probe is not None and probe.errno in DISK_FULL_ERRNOS:
            os_err = probe
    seen = f"free space seen: {human_bytes(free_bytes(path))}"
    if os_err is not None and os_err.errno == errno.ENOSPC:
        return f"no space left on device ({seen})"
    if os_err is not None and os_err.errno == errno.EDQUOT:
        return f"disk quota exceeded ({seen})"
    if os_err is not None:
        return f"{os_err.strerror or type(os_err).__name__} ({seen})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''} ({seen})"

