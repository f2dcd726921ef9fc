"""One job per run directory: the `<run_dir>/run.lock` file.

Owns: taking, keeping alive (heartbeat) and releasing the lock; deciding when a lock left by
another job is stale. Must not touch: training, checkpoints.

Why not `flock`: on NFS and Lustre advisory locks are optional, per-client, or silently local.
This lock uses only operations those filesystems make atomic across clients:
- take: `open(O_CREAT | O_EXCL)` of `run.lock`, which then holds one JSON line
  `{"host", "pid", "slurm_job_id", "token", "started_unix_s"}`;
- keep: the holder touches the file every `HEARTBEAT_S` seconds (a daemon thread), so its mtime
  is a heartbeat;
- take over an existing lock only when
  1. it names this job's SLURM job id (a requeued job continues its own run), or
  2. it was taken on this host by a process id that no longer exists, or
  3. its heartbeat is older than `STALE_S` seconds (a killed job on another host; ages are
     measured against the mtime of a probe file written next to it, both stamped by the same
     file server, so client clock skew does not matter);
  a takeover writes a temp file and `os.replace`s it over the lock, then reads it back to see
  that it won (two jobs taking over at once: one wins, the other stops).
- release: the holder removes the file when it exits (only if it still holds it).

Clearing a lock by hand (a job you know is gone, before the stale time has passed):
`rm <run_dir>/run.lock`. Environment knobs: `REFUSION_RUN_LOCK_STALE_S` (default 300),
`REFUSION_RUN_LOCK_HEARTBEAT_S` (default 30).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

LOCK_NAME = "run.lock"


def _float_env(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class RunLockError(RuntimeError):
    """Another live job holds the run directory (the message is one line naming the holder), or
    the lock file cannot be written there (one line: the file, the cause, what to do)."""


def _holder_text(h: dict) -> str:
    job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
    return f"host {h.get('host', '?')}, pid {h.get('pid', '?')}{job}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The lock on one run directory, held by this process (see the module docstring).

    Args:
        run_dir: the run folder (created if missing).
        stale_s: heartbeat age (seconds) after which another host's lock counts as abandoned.
        heartbeat_s: seconds between heartbeats.
    """

    def __init__(self, run_dir: str, stale_s: float | None = None,
                 heartbeat_s: float | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.stale_s = stale_s if stale_s is not None else _float_env("REFUSION_RUN_LOCK_STALE_S", 300.0)
        self.heartbeat_s = (heartbeat_s if heartbeat_s is not None
                            else _float_env("REFUSION_RUN_LOCK_HEARTBEAT_S", 30.0))
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                   "token": secrets.token_hex(8), "started_unix_s": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict | None = None   # the holder whose lock we replaced, if any

    # -- take ---------------------------------------------------------------------------

    def acquire(self) -> "RunLock":
        """Take the lock (or a stale one / our own SLURM job's) and start the heartbeat.

        Raises:
            RunLockError: a live job holds it (one line: holder, how to clear), or the lock
                cannot be written (read-only run folder, permission, full disk; one line).
        """
        data = (json.dumps(self.me) + "\n").encode()
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_raise(data)
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:  # read-only run folder, permission, full disk: one line
            from pipeline.common.diskspace import failure_of
            f = failure_of(e, self.run_dir)
            raise RunLockError(f"{self.path}: cannot write the run lock: {f.cause}; "
                               f"{f.remedy('run_dir')}") from None
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                h = json.loads(f.read() or "null")
            return h if isinstance(h, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: judged by its age only

    def _age_s(self) -> float | None:
        """Seconds since the lock's last heartbeat, by the file server's clock."""
        probe = f"{self.path}.probe-{self.me['token']}"
        try:
            lock_mtime = os.stat(self.path).st_mtime
            with open(probe, "w"):
                pass
            now = os.stat(probe).st_mtime
        except FileNotFoundError:
            return None
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        return now - lock_mtime

    def _take_over_or_raise(self, data: bytes) -> None:
        holder = self._read()
        if holder is None:  # released in between: try a clean take once more
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read() or {}
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return
        age = self._age_s()
        reason = None
        if holder.get("slurm_job_id") and holder.get("slurm_job_id") == self.me["slurm_job_id"]:
            reason = "same SLURM job (requeued)"
        elif (holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int)
              and not _pid_alive(holder["pid"])):
            reason = "its process is gone"
        elif age is not None and age > self.stale_s:
            reason = f"no heartbeat for {age:.0f} s"
        if reason is None:
            hb = f", last heartbeat {age:.0f} s ago" if age is not None else ""
            raise RunLockError(
                f"{self.run_dir} is in use by another job ({_holder_text(holder)}{hb}); "
                f"one job per run directory: wait for it, use another run_dir, or, if that job "
                f"is gone, remove {self.path} (taken over automatically after "
                f"{self.stale_s:.0f} s without heartbeat)")
        tmp = f"{self.path}.{self.me['token']}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        time.sleep(0.05)
        now = self._read() or {}
        if now.get("token") != self.me["token"]:
            raise RunLockError(f"{self.run_dir} is in use by another job ({_holder_text(now)}) "
                               f"that took over the stale lock at the same time")
        self.took_over = dict(holder, reason=reason)

    # -- keep / release -----------------------------------------------------------------

    def holds(self) -> bool:
        """True while the lock file still names this process."""
        return (self._read() or {}).get("token") == self.me["token"]

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if this process still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.holds():
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
