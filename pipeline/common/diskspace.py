"""Diagnosis of failed writes, and the start-up check that a folder can be written at all.

Owns: turning a write failure (an OSError, or a library error that hides one, such as torch's
`RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos` or `Parent directory
... does not exist`) into one readable cause with a remedy that fits it (`diagnose`), and the
write probe a job runs on every folder it will write before doing any work (`check_writable`).
Must not touch: what was being written (callers clean up their own files).

Causes told apart (errno): read-only filesystem (EROFS), permission denied (EACCES, EPERM),
no space left (ENOSPC), quota exceeded (EDQUOT), anything else (its strerror). The free space
seen is part of the cause only for the two space errors and for failures whose errno a library
hid (where space may still be the reason); a read-only or forbidden folder is not helped by
freeing space.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
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


@dataclass(frozen=True)
class WriteFailure:
    """Why a write under a folder failed (picklable: ranks exchange it).

    Attributes:
        errno: the OSError's errno (EROFS, EACCES, ENOSPC, ...), or None when a library hid it.
        cause: one line, e.g. "read-only file system", "permission denied (user alice, uid
            1000)", "no space left on device (free space seen: 0 B)".
    """

    errno: int | None
    cause: str

    @property
    def disk_full(self) -> bool:
        """True for ENOSPC / EDQUOT (the remedy is space; exit code 4)."""
        return self.errno in DISK_FULL_ERRNOS

    def remedy(self, setting: str) -> str:
        """What to do, fitting the cause; `setting` names the config key or option that chooses
        the folder (e.g. "checkpoint.dir")."""
        if self.errno == errno.ENOSPC:
            return f"free space on that filesystem or set {setting} to a folder on a larger one"
        if self.errno == errno.EDQUOT:
            return (f"free space within your quota (or have it raised) or set {setting} to a "
                    f"folder on another filesystem")
        if self.errno == errno.EROFS:
            return (f"set {setting} to a folder on a writable filesystem, or have this one "
                    f"remounted read-write")
        if self.errno in (errno.EACCES, errno.EPERM):
            return (f"set {setting} to a folder this user may write, or fix the folder's owner "
                    f"or permissions")
        return f"fix that, or set {setting} to another folder"

    def __str__(self) -> str:
        return self.cause


def _errno_in_chain(e: BaseException) -> OSError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def _existing_dir(path: str | os.PathLike) -> str | None:
    d = os.path.abspath(os.fspath(path))
    while not os.path.isdir(d):
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
    return d


def _probe(path: str | os.PathLike, size: int = PROBE_BYTES) -> OSError | None:
    """Write and fsync `size` bytes in `path`'s nearest existing folder; the OSError it raised,
    if any."""
    d = _existing_dir(path)
    if d is None:
        return None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-probe-", dir=d)
    except OSError as e:
        return e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * size)
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


def _user() -> str:
    uid = os.geteuid()
    try:
        import pwd
        return f"user {pwd.getpwuid(uid).pw_name}, uid {uid}"
    except (ImportError, KeyError):
        return f"uid {uid}"


def failure_of(os_err: OSError | None, path: str | os.PathLike,
               fallback: str | None = None) -> WriteFailure:
    """The `WriteFailure` of an OSError seen writing under `path` (None: `fallback` text, the
    cause of a library error without errno)."""
    if os_err is None or os_err.errno is None:
        return WriteFailure(None, f"{fallback or 'unknown error'} "
                                  f"(free space seen: {human_bytes(free_bytes(path))})")
    n = os_err.errno
    if n in DISK_FULL_ERRNOS:
        what = "no space left on device" if n == errno.ENOSPC else "disk quota exceeded"
        return WriteFailure(n, f"{what} (free space seen: {human_bytes(free_bytes(path))})")
    if n == errno.EROFS:
        return WriteFailure(n, "read-only file system")
    if n in (errno.EACCES, errno.EPERM):
        return WriteFailure(n, f"permission denied ({_user()})")
    return WriteFailure(n, os_err.strerror or type(os_err).__name__)


def diagnose(e: BaseException, path: str | os.PathLike) -> WriteFailure:
    """Why writing under `path` failed with `e`.

    An OSError in `e`'s chain gives the cause directly. Otherwise (libraries that hide the
    errno, e.g. torch's zip writer) a 1 MiB probe write next to `path` tells a full disk,
    quota, read-only filesystem or missing permission from other failures; when the probe
    succeeds the cause is `e`'s type and first line, with the free space seen.
    """
    os_err = _errno_in_chain(e)
    if os_err is None or os_err.errno not in DISK_FULL_ERRNOS + NOT_WRITABLE_ERRNOS:
        probe = _probe(path)
        if probe is not None and probe.errno in DISK_FULL_ERRNOS + NOT_WRITABLE_ERRNOS:
            os_err = probe
    if os_err is not None:
        return failure_of(os_err, path)
    text = str(e).strip().splitlines()
    return failure_of(None, path, f"{type(e).__name__}: {text[0] if text else ''}")


class NotWritableError(RuntimeError):
    """A folder a job must write cannot be written, found by `check_writable` before the job
    did any work. The message is one line; `failure` is the `WriteFailure` (exit code 2, or 4
    when `failure.disk_full`)."""

    def __init__(self, message: str, failure: WriteFailure):
        super().__init__(message)
        self.failure = failure


def check_writable(folder: str | os.PathLike, files: tuple[str, ...] = ()) -> WriteFailure | None:
    """Whether this process can write in `folder` (created if missing, with its parents): a
    small file is created, written, fsynced and removed there, and each name in `files` (files
    the job appends to, e.g. "metrics.jsonl") is opened for appending (created empty if
    missing). Run before a job does work, so a read-only or forbidden folder stops it at once.

    Returns:
        None when every write worked, else the `WriteFailure` of the first one that did not.
    """
    folder = os.fspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".write-probe-{socket.gethostname()}-{os.getpid()}-",
                                   dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        for name in files:
            with open(os.path.join(folder, name), "ab"):
                pass
    except OSError as e:
        return failure_of(e, folder)
    return None
