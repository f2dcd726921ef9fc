"""The launcher: `python -m pipeline.launch [torchrun options] -m pipeline.train --config ...`.

Owns: starting the local worker processes through torchrun's own machinery
(`torch.distributed.run`, same options) while keeping the trainer's exit codes and signal story.
Must not touch: training, configs.

What plain torchrun does, and what this changes:
- A worker that exits non-zero (for example 2, a user error, already printed by the trainer as
  one line) makes torchrun exit 1 with a `ChildFailedError` traceback. Here the launcher exits
  with the code of the worker whose failure caused the others (`root_failure`: the first failed
  worker, passing over those that only stopped because a peer was gone, exit 5, or that
  torchrun's agent stopped with SIGTERM) (2, 3, 4, 5 as
  `pipeline.train` documents them; 128 + N for a worker killed by signal N) and prints nothing
  more for codes 2-5 (the trainer's line is the story) and one line otherwise, e.g.
  "pipeline.launch: worker rank 1 (pid 123) was killed by SIGKILL; its output is above".
- SIGTERM / SIGINT / SIGUSR1 to torchrun make it raise `SignalException`, stop the workers (SIGKILL
  after 30 s, whatever their checkpoint needs) and exit non-zero with a traceback. Here the
  launcher forwards the signal once to each worker (they checkpoint at the step they reached and
  exit 0, see `pipeline.train`) and then exits 0 like them. Workers run in their own sessions
  (torchrun starts them so), so a Ctrl-C in the terminal reaches them only through this
  forwarding: the first one checkpoints, a second one aborts (the trainer's rule).
- torchrun's `--max-restarts N` works as there: when a worker fails (a hang, exit 6; a dead
  peer, exit 5; a crash) all workers of the group are stopped and started again, up to N
  times, and the new workers resume from the latest complete checkpoint (rank 0 logs one line
  per restart, with the last hang report's line when there is one). A hang exit is preferred
  as the cause reported at the end (`root_failure`).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from pipeline.common.cli import EXIT_HUNG, EXIT_PEER_LOST, REPORTED

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _children() -> list[int]:
    """Process ids of this process's children (Linux /proc)."""
    out = []
    try:
        for t in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{t}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _forward(signum, frame) -> None:
    kids = _children()
    if not kids:  # no worker yet (rendezvous): stop like a plain interrupted process
        raise SystemExit(128 + signum)
    for pid in kids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def root_failure(failures: dict) -> tuple[int, object]:
    """The failed worker whose failure is the job's cause: `(rank, failure)` of the earliest
    failure (by torchrun's timestamp in whole seconds, then rank) that is not a consequence of
    another, a hang exit (`EXIT_HUNG`) before any other: a worker that stopped because a peer was gone (`EXIT_PEER_LOST`), or one killed by
    SIGTERM (torchrun's agent stops the remaining workers that way once one has failed; a
    SIGTERM from outside reaches our workers through `_forward` and they exit 0). When only
    such failures exist, the earliest of them. `failures`: torchrun's `{rank: ProcessFailure}`
    (`.exitcode`: negative = killed by that signal, `.timestamp`)."""
    def consequence(f) -> bool:
        return f.exitcode in (EXIT_PEER_LOST, -signal.SIGTERM)
    # a hang exit (EXIT_HUNG) is the job's story first: the stuck rank it names may have been
    # SIGKILLed by its peers (`pipeline.training.watchdog`) or stopped by the agent afterwards
    return min(failures.items(), key=lambda rf: (rf[1].exitcode != EXIT_HUNG,
                                                 consequence(rf[1]), rf[1].timestamp, rf[0]))


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: sys.argv[1:]); returns the exit code (see module)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for s in FORWARDED:
        signal.signal(s, _forward)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's agent would install its own handlers (SignalException) for the forwarded ones
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        code = failure.exitcode
        if code < 0:  # killed by a signal
            try:
                what = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                what = f"was killed by signal {-code}"
            code = 128 - code
        else:
            what = f"exited with code {code}"
        if code not in REPORTED:
            print(f"pipeline.launch: worker rank {rank} (pid {failure.pid}) {what}; its output is "
                  f"above", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
