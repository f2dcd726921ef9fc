"""Run a test function in N gloo processes on this CPU machine.

Usage in a test:

    def _body(rank, world_size, tmp):      # module-level, picklable
        info = init_distributed(tensor_parallel_size=2)
        ...
        return some_picklable_value        # collected per rank

    results = run_distributed(_body, world_size=4, args=(tmp_path,))   # list indexed by rank

A failure in any rank raises in the test with that rank's traceback.

The ranks are forked from a multiprocessing forkserver that imported torch, DeepSpeed,
megatron-core and the pipeline once (per test process): a spawned rank spent most of its CPU
time on those imports. Each rank still starts from the test process's environment, working
folder and stdout/stderr at the time of the call, as a spawned one did.

`run_train_main(config, run_dir, *overrides, nproc=1)` runs the trainer's entry point
(`pipeline.train.main`) the same way, as `python -m pipeline.train` would.
"""
from __future__ import annotations

import io
import os
import queue as queue_module
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from pipeline.parallel import free_port



# Imported once in the forkserver (the ranks' common imports); a name that fails to import is
# skipped by multiprocessing and then imported by the rank that needs it.
PRELOAD = ["torch", "numpy", "deepspeed", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "pipeline.parallel", "pipeline.model",
           "pipeline.checkpoint", "pipeline.train"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)   # read when the forkserver starts (first use)
    return ctx


def _adopt_parent(parent_pid: int, environ: dict, cwd: str) -> None:
    """Make this forked rank look spawned by the test process: its environment and working
    folder now, and its stdout/stderr (pytest's capture of the current test), which the
    forkserver, started during an earlier test, does not hold."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import sys
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            target = os.open(f"/proc/{parent_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        stream.flush()
        os.dup2(target, fd)
        os.close(target)


def _worker(rank, world_size, port, fn, args, queue, parent=None):
    if parent is not None:
        _adopt_parent(*parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        # Sent as bytes, not as tensors: torch's queue shares a tensor's storage through a file
        # the sending process owns, and a rank that exits before the parent reads its result
        # takes that file with it (FileNotFoundError in the parent).
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        from pipeline.parallel import destroy_distributed
        try:
            destroy_distributed()
        except Exception:
            pass


_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def run_distributed(fn, world_size: int, args: tuple = (), timeout_s: float = 600.0,
                    port_retries: int = 2) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes.

    The rendezvous port is picked free just before the start; when another test process grabs
    it in between (tests run concurrently on shared machines), the run is retried on a new port
    up to `port_retries` times. Any other failure is raised at once.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), or timed out.
    """
    for attempt in range(port_retries + 1):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except RuntimeError as e:
            if attempt == port_retries or not any(s in str(e) for s in _PORT_TAKEN):
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size: int, args: tuple, timeout_s: float) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    parent = (os.getpid(), dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, parent))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except queue_module.Empty:
        errors.append(f"timed out after {timeout_s} s waiting for ranks")
    except Exception as e:
        errors.append(f"reading the ranks' results failed: {e!r}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _rank_main(rank, world_size, port, argv, out, parent):
    """One rank of `run_train_main`: what `python -m pipeline.train argv` runs, in a process
    forked from the forkserver: the test process's environment and folder, fd 1 and 2 to
    `<out>/rank<rank>/{stdout,stderr}.txt`, main's return value as the exit code."""
    import signal
    _adopt_parent(*parent)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "WANDB_MODE"):
        os.environ.pop(k, None)
    os.environ.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if world_size > 1:   # the ranks meet as under srun: rank variables and an address
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
    folder = Path(out) / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    for fd, stream, name in ((1, sys.stdout, "stdout.txt"), (2, sys.stderr, "stderr.txt")):
        stream.flush()
        with open(folder / name, "wb") as f:
            os.dup2(f.fileno(), fd)
    torch.set_num_threads(1)
    from pipeline.train import main
    code = main([str(a) for a in argv])
    for s in (signal.SIGTERM, signal.SIGUSR1):   # as pipeline/train.py's __main__ does
        signal.signal(s, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_train_main(config: Path, run_dir: Path, *overrides: str, nproc: int = 1,
                   timeout_s: float = 600.0) -> list[SimpleNamespace]:
    """`python -m pipeline.train --config config run_dir=run_dir *overrides` as its `main` in
    `nproc` processes forked from the forkserver: torch, DeepSpeed, megatron-core and the
    pipeline are imported once per test process, not once per run. One process runs bare (it
    binds its own free port), more meet as under srun (rank variables, MASTER_ADDR/PORT). For
    checks of the trainer; a check of the command line itself (import noise, the launcher)
    needs the real process.

    Returns:
        Per rank, `returncode` (main's return value; 1 and a traceback on stderr for an
        exception, as the command gives), `stdout`, `stderr` (str); they are also kept in
        `<run_dir>.main-<n>/rank<r>/` beside the run folder.

    Raises:
        AssertionError: a rank still ran after `timeout_s` seconds (all are killed; the
            message holds their output).
    """
    n = len(list(run_dir.parent.glob(f"{run_dir.name}.main-*")))
    out = run_dir.parent / f"{run_dir.name}.main-{n}"
    argv = ["--config", config, f"run_dir={run_dir}", *overrides]
    ctx, port = _context(), free_port()
    parent = (os.getpid(), dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, argv, str(out), parent))
             for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()

    def text(r: int, name: str) -> str:
        f = out / f"rank{r}" / name
        return f.read_text(errors="replace") if f.exists() else ""
    res = [SimpleNamespace(returncode=p.exitcode, stdout=text(r, "stdout.txt"),
                           stderr=text(r, "stderr.txt")) for r, p in enumerate(procs)]
    assert not late, (f"ranks {late} still running after {timeout_s} s:\n"
                      + "\n".join(x.stdout[-3000:] + x.stderr[-3000:] for x in res))
    return res
