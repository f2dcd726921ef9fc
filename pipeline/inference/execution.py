"""Running generated code against its tests in a sandboxed subprocess (pass@1 by execution).

Owns: `run_tests` (one program: code + assert tests, in a fresh `python -I` process with a
scratch directory as its cwd and a wall-clock limit that kills its process group), `run_batch`
(a bounded number of processes at once), `pass_at_1`. Must not touch: decoding, the tasks'
data, printing.

The sandbox stops mistakes, not an adversary: the limits are `resource.setrlimit` (address
space, CPU seconds, file size, and no new processes where the user is not exempt from
RLIMIT_NPROC, e.g. root), the network is cut by replacing `socket`'s constructors with a
function that raises (and the environment holds no proxy variables), and files are written
relative to a temporary directory that is removed afterwards. The limits are set by the child
itself before it reads the code (not in a `preexec_fn`, which is unsafe in a process with
threads, as `run_batch` and a torch process are); the code only runs after they are in place.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

STATUSES = ("passed", "failed", "timeout", "crashed")
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 512 * 2 ** 20
OUTPUT_LIMIT_BYTES = 2 ** 20        # RLIMIT_FSIZE: any file the program writes, its output too

# The child: limits first, then the network cut, then the job from stdin (JSON: nonce, code,
# tests, limits), the code defined once, each test run in order. The last line of stdout is
# `<nonce> passed`, `<nonce> failed <i>` or `<nonce> crashed <i> <error>` (i = -1: the code
# itself). A program that exits without such a line (os._exit, a signal) crashed.
_RUNNER = r"""
import json, os, resource, sys
_job = json.loads(sys.stdin.read())
sys.stdin.close()
for _name, _v in (("RLIMIT_AS", _job["memory_bytes"]), ("RLIMIT_CPU", _job["cpu_s"]),
                  ("RLIMIT_FSIZE", _job["fsize"]), ("RLIMIT_NPROC", 0),
                  ("RLIMIT_CORE", 0)):
    if hasattr(resource, _name):
        try:
            resource.setrlimit(getattr(resource, _name), (_v, _v))
        except (ValueError, OSError):
            pass
import socket as _socket_mod, _socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the sandbox")
for _m in (_socket_mod, _socket):
    for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd",
                  "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(_m, _name):
            setattr(_m, _name, _no_network)
_nonce, _tests = _job.pop("nonce"), _job.pop("tests")
_out = os.fdopen(os.dup(1), "w")
def _report(text):
    sys.stdout.flush()
    _out.write("\n" + _nonce + " " + text + "\n")
    _out.flush()
    os._exit(0)
def _error(e):
    return (type(e).__name__ + ": " + str(e)).replace("\n", " ")[:300]
_g = {"__name__": "__answer__", "__builtins__": __builtins__}
try:
    exec(compile(_job.pop("code"), "<answer>", "exec"), _g)
except BaseException as e:
    _report("crashed -1 " + _error(e))
for _i, _t in enumerate(_tests):
    try:
        exec(compile(_t, "<test %d>" % _i, "exec"), _g)
    except AssertionError:
        _report("failed %d" % _i)
    except BaseException as e:
        _report("crashed %d %s" % (_i, _error(e)))
_report("passed")
"""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one program.

    status: "passed" (every test ran and held), "failed" (an assert test was false),
    "timeout" (the wall-clock or CPU limit was reached; the process group was killed),
    "crashed" (the code or a test raised, e.g. SyntaxError, ZeroDivisionError, MemoryError,
    SystemExit; or the process exited without reporting, e.g. `os._exit` or a signal).
    failed_test: the index of the failing or crashing test (-1: defining the code; None).
    detail: the failing assert's text, the error, or why it stopped (one line).
    seconds: wall time of the subprocess.
    """

    status: str
    failed_test: int | None = None
    detail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


def _child_env() -> dict:
    """A bare environment: no proxies, no PYTHON* variables (ignored under -I anyway)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}


def run_tests(code: str, tests: list[str], timeout_s: float = DEFAULT_TIMEOUT_S,
              memory_bytes: int = DEFAULT_MEMORY_BYTES) -> ExecResult:
    """`ExecResult` of running `code` (str), then each of `tests` (statements, usually
    `assert f(...) == ...`, in order in the code's namespace; the first failure ends the run) in
    a sandboxed subprocess (module docstring); never raises for anything the code does.
    `timeout_s`: wall-clock seconds for the whole run (also the CPU-seconds limit, rounded up);
    `memory_bytes`: the address-space limit (RLIMIT_AS). Raises ValueError: timeout_s <= 0 or
    memory_bytes <= 0."""
    if timeout_s <= 0 or memory_bytes <= 0:
        raise ValueError(f"run_tests: timeout_s and memory_bytes must be > 0, got {timeout_s}, "
                         f"{memory_bytes}")
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "code": code, "tests": list(tests),
                      "memory_bytes": int(memory_bytes), "cpu_s": int(math.ceil(timeout_s)) + 1,
                      "fsize": OUTPUT_LIMIT_BYTES})
    with tempfile.TemporaryDirectory(prefix="refusion_exec_") as tmp:
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        out_path = Path(tmp) / "stdout"
        t0 = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RUNNER],
                                    stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.DEVNULL, cwd=scratch, env=_child_env(),
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                proc.communicate(job.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:        # the child died before reading its job
                pass
            finally:
                _kill_group(proc.pid)      # also any process it left behind
                proc.wait()
        seconds = time.monotonic() - t0
        if timed_out:
            return ExecResult("timeout", None, f"wall-clock limit {timeout_s:g} s", seconds)
        return _parse(out_path, nonce, proc.returncode, tests, seconds)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parse(out_path: Path, nonce: str, rc: int, tests: list[str], seconds: float) -> ExecResult:
    """The result from the child's last report line and its exit status."""
    with open(out_path, "rb") as f:
        f.seek(max(0, out_path.stat().st_size - 4096))
        tail = f.read().decode("utf-8", "replace")
    lines = [ln for ln in tail.splitlines() if ln.startswith(nonce + " ")]
    if lines and rc == 0:
        word, *rest = lines[-1][len(nonce) + 1:].split(" ", 2)
        if word == "passed":
            return ExecResult("passed", None, "", seconds)
        i = int(rest[0])
        if word == "failed":
            return ExecResult("failed", i, tests[i].strip(), seconds)
        return ExecResult("crashed", i, rest[1] if len(rest) > 1 else "", seconds)
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        # SIGXCPU at RLIMIT_CPU's soft limit, SIGKILL at its hard one (the same second)
        if -rc in (getattr(signal, "SIGXCPU", None), signal.SIGKILL):
            return ExecResult("timeout", None, f"CPU-time limit ({sig})", seconds)
        return ExecResult("crashed", None, f"killed by {sig}", seconds)
    return ExecResult("crashed", None, f"exited with code {rc} without a result", seconds)


def run_batch(programs: list[tuple[str, list[str]]], timeout_s: float = DEFAULT_TIMEOUT_S,
              memory_bytes: int = DEFAULT_MEMORY_BYTES, workers: int = 2) -> list[ExecResult]:
    """`run_tests` for every (code, tests) pair, at most `workers` subprocesses at a time; one
    `ExecResult` per program, in order. Raises ValueError as `run_tests`, or for workers < 1."""
    if workers < 1:
        raise ValueError(f"run_batch: workers must be >= 1, got {workers}")
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(programs))) as pool:
        return list(pool.map(lambda p: run_tests(p[0], p[1], timeout_s, memory_bytes),
                             programs))


def pass_at_1(results: list[ExecResult]) -> float | None:
    """Share of programs (one answer per problem) whose tests all passed; None for none."""
    return sum(r.passed for r in results) / len(results) if results else None


def status_counts(results: list[ExecResult]) -> dict[str, int]:
    """{status: count} over `STATUSES` (zeros included)."""
    return {s: sum(r.status == s for r in results) for s in STATUSES}
