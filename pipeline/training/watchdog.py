"""Hang detection of a training job: progress records, the watchdog thread, the allowances.

Owns: what each rank publishes about its progress (`<run_dir>/progress/rank_NNNNN.json`), how
long a phase may go without progress (`HangPolicy`), deciding that the job is hung and which
rank(s) it waits for, the hang report (`<run_dir>/hang.json`, one line per live rank, Python
stacks of a stuck rank) and the exit (`EXIT_HUNG`). Must not touch: the training step, process
groups (it only runs one all-reduce when started), checkpoints.

Why files and not the c10d store: under srun the store lives inside rank 0's process, so a
stopped rank 0 would silence the channel the others need to report it; torchrun's agent store
does not exist there. The run folder is already shared (metrics, checkpoints by default), is
written by the ranks at start-up (`pipeline.training.startup.check_write_access`), and a hang
report written there outlives the console. Cost: every rank rewrites one ~300-byte file every
`beat_s` seconds (5 s by default: 200 small writes per second for 1,000 ranks); only two ranks (0 and
the last) read all of them, every other rank checks one file (`hang.json`) per beat.

How a hang is decided. Every rank runs the same sequence of phases (SPMD): set-up, then per
step data / forward_backward (per micro-batch) / collective / optimizer, validation (per
micro-batch), checkpoint. Each phase change is progress and increments the rank's `seq`. A
rank waiting in a collective for a slower peer stops progressing too, but it is ahead of (or
level with) the peer: the job waits for the ranks with the lowest `seq` (the laggards). The job
is hung when the laggards made no progress for longer than their phase's allowance (which each
rank publishes with its record). The report names the laggards whose own heartbeat also stopped
(a stopped or frozen process) when there are any, else all laggards. Independently of phases,
a rank whose heartbeat stopped (`HEARTBEAT_LOST_S`) hangs the job at once: a stopped or dead
process is not slow, so no allowance of its phase applies.

What happens then, on every rank that can still act: one line on stderr
(`pipeline.train: rank R: hang: ...`), `<run_dir>/hang.json` (written by the rank that found it),
`<run_dir>/stacks_rank_NNNNN.txt` (faulthandler, all threads) from every named rank that is
still alive, and `os._exit(EXIT_HUNG)` from the watchdog thread: the main thread may be
blocked in a collective that never returns. Under torchrun, a named rank on the same host whose
process is stopped (state T in /proc, e.g. SIGSTOP) is SIGKILLed, so the agent does not wait 30 s for it
before restarting or ending the job (under srun, Slurm's step teardown resumes and ends it).
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.cli import EXIT_HUNG

PROGRESS_DIR = "progress"
HANG_FILE = "hang.json"
DONE = "done"

# Derived step allowance: max(FLOOR_S, FACTOR x median step time) once warm-up is over (the
# first step after warm-up: the median of the warm-up steps). The floor plus one check period
# (`beat_s`, 5 s) must stay well under 150 s: a hang of a seconds-per-step run ends then.
DERIVED_FLOOR_S = 120.0
DERIVED_FACTOR = 10.0
WARMUP_STEPS = 3            # steps after each (re)start judged by the warm-up allowance
STEP_WINDOW = 50            # step times the median is taken over
# Checkpoint save allowance: max(SAVE_FACTOR x the last save, min(SAVE_FLOOR_S, SAVE_FACTOR x
# step allowance) + this rank's checkpoint bytes / SAVE_MIN_BYTES_PER_S). The ranks write their
# own files at the same time, so the bytes are one rank's share (16 bytes per parameter over
# all ranks); 10 MB/s per rank is pessimistic for a shared filesystem (320 MB/s for 32 ranks).
SAVE_FACTOR = 3.0
SAVE_FLOOR_S = 60.0
SAVE_MIN_BYTES_PER_S = 10e6
# A rank whose heartbeat (written by its watchdog thread every `beat_s`, whatever the main
# thread does) is older than max(HEARTBEAT_LOST_S, 3 x beat_s) at two checks in a row is
# stopped or dead: the job is hung at once, in any phase, set-up and warm-up included (found
# within about 20 s at the default 5 s beat; a live rank without progress keeps the phase
# allowances below).
HEARTBEAT_LOST_S = 10.0
# A validation micro-batch (forward only): VALIDATION_FACTOR x the step allowance before its
# floor, at least DERIVED_FLOOR_S when derived.
VALIDATION_FACTOR = 3.0


@dataclass
class HangPolicy:
    """How long a phase may go without progress before the job counts as hung (seconds).

    Args:
        hang_timeout_s: `train.hang_timeout_s`: a fixed allowance per phase of a step; None
            derives it from the step times seen after warm-up (`step_allowance`); 0 disables
            the watchdog (`enabled`).
        warmup_s: `train.hang_warmup_s`: allowance of the set-up (engine build, DeepSpeed op
            builds, checkpoint load), of the first `WARMUP_STEPS` steps after each start
            (compilation, first loader fill) and of the first validation.
        rank_checkpoint_bytes: estimated bytes this rank writes in one checkpoint save (for the
            save allowance); 0 when unknown.
    """
    hang_timeout_s: float | None
    warmup_s: float
    rank_checkpoint_bytes: float = 0.0
    step_times: list = field(default_factory=list)
    warmup_times: list = field(default_factory=list)
    steps_seen: int = 0
    last_save_s: float = 0.0
    validations_seen: int = 0

    @property
    def enabled(self) -> bool:
        """False for `train.hang_timeout_s: 0`."""
        return self.hang_timeout_s is None or self.hang_timeout_s > 0

    @property
    def warm(self) -> bool:
        """True once `WARMUP_STEPS` steps have been timed since this process started."""
        return self.steps_seen >= WARMUP_STEPS

    def record_step(self, seconds: float) -> None:
        """Note one optimizer step's wall time (seconds)."""
        self.steps_seen += 1
        if self.steps_seen > WARMUP_STEPS:   # warm-up steps would inflate the median
            self.step_times.append(float(seconds))
            del self.step_times[:-STEP_WINDOW]
        else:
            self.warmup_times.append(float(seconds))

    def _measured(self) -> float | None:
        """The step allowance before its floor (seconds): the fixed `hang_timeout_s`, or
        `DERIVED_FACTOR` x the median step time after warm-up (of the warm-up steps while no
        later step is timed: a median of 3 ignores one compiling step); None during warm-up."""
        if not self.warm:
            return None
        if self.hang_timeout_s is not None:
            return float(self.hang_timeout_s)
        times = self.step_times or self.warmup_times
        return DERIVED_FACTOR * statistics.median(times) if times else 0.0

    def step_allowance(self) -> float:
        """Seconds a phase of a training step may take: `warmup_s` during warm-up; then the
        fixed `hang_timeout_s`, or max(`DERIVED_FLOOR_S`, `DERIVED_FACTOR` x median step
        time)."""
        measured = self._measured()
        if measured is None:
            return self.warmup_s
        if self.hang_timeout_s is not None:
            return measured
        return max(DERIVED_FLOOR_S, measured)

    def save_allowance(self) -> float:
        """Seconds a checkpoint save may take: max(`SAVE_FACTOR` x the last save of this process,
        min(`SAVE_FLOOR_S`, `SAVE_FACTOR` x `step_allowance()`) + `rank_checkpoint_bytes` /
        `SAVE_MIN_BYTES_PER_S`). A save costs its bytes, not steps: a few-MB checkpoint gets
        60 s (or 3 x a small fixed `hang_timeout_s`) until a slower save was measured."""
        floor = min(SAVE_FLOOR_S, SAVE_FACTOR * self.step_allowance())
        return max(SAVE_FACTOR * self.last_save_s,
                   floor + self.rank_checkpoint_bytes / SAVE_MIN_BYTES_PER_S)

    def validation_allowance(self) -> float:
        """Seconds one validation micro-batch may take: `warmup_s` in the first validation of
        this process (its loader is built then, eval shapes may compile) and during warm-up,
        else `VALIDATION_FACTOR` x the step allowance before its floor: 3 x `hang_timeout_s`,
        or max(`DERIVED_FLOOR_S`, 3 x `DERIVED_FACTOR` x median step time)."""
        measured = self._measured()
        if self.validations_seen == 0 or measured is None:
            return max(self.warmup_s, VALIDATION_FACTOR * self.step_allowance())
        if self.hang_timeout_s is not None:
            return VALIDATION_FACTOR * measured
        return max(DERIVED_FLOOR_S, VALIDATION_FACTOR * measured)

    def allowance(self, phase: str) -> float:
        """The allowance of `phase` (seconds; inf for "done")."""
        if phase == DONE:
            return math.inf
        if phase == "setup":
            return self.warmup_s
        if phase == "checkpoint":
            return self.save_allowance()
        if phase == "validation":
            return self.validation_allowance()
        return self.step_allowance()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _process_stopped(pid: int) -> bool:
    """True when `pid` on this host is in state T (stopped by a signal, e.g. SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def lost_heartbeats(records: dict[int, dict | None], now: float, lost_after_s: float
                    ) -> dict[int, float]:
    """{rank: its last heartbeat (Unix seconds)} of the running ranks (a record of this run,
    phase not "done") whose heartbeat is older than `lost_after_s` seconds."""
    return {r: rec["beat_unix_s"] for r, rec in records.items()
            if rec is not None and rec.get("phase") != DONE
            and now - rec["beat_unix_s"] > lost_after_s}


def find_stuck(records: dict[int, dict | None], now: float, frozen_after_s: float,
               lost: dict[int, float] | None = None, lost_after_s: float = math.inf
               ) -> dict | None:
    """Decide from the ranks' progress records whether the job is hung.

    Args:
        records: {rank: record or None (no record of this run yet)}; a record holds "seq",
            "step", "phase", "host", "pid", "progress_unix_s", "beat_unix_s", "allowance_s".
        now: the checker's wall clock (Unix seconds).
        frozen_after_s: a heartbeat older than this (seconds) means the process is not running.
        lost: ranks whose heartbeat stopped, confirmed by two checks (`lost_heartbeats`): the
            job is hung now, in any phase, whatever that phase's allowance (`lost_after_s`
            seconds, reported as the allowance).

    Returns:
        None when the job progresses (or waits within the laggards' allowance); else
        {"ranks": [named rank, ...], "silent_s", "allowance_s", "frozen", "cause" ("heartbeat"
        or "progress"), "records": {rank: record}}. A rank without a record counts as a laggard
        at the start (seq -1) whose silence is measured from the oldest heartbeat of the others.
    """
    live = {r: rec for r, rec in records.items() if rec is None or rec.get("phase") != DONE}
    if not live:
        return None
    lost = sorted(r for r in (lost or {}) if live.get(r) is not None)
    if lost:
        silent = now - min(live[r]["progress_unix_s"] for r in lost)
        return {"ranks": lost, "silent_s": silent, "allowance_s": lost_after_s,
                "frozen": lost, "cause": "heartbeat", "records": {r: live[r] for r in lost}}
    have = [rec for rec in live.values() if rec is not None]
    if not have:
        return None
    seq = {r: (rec["seq"] if rec is not None else -1) for r, rec in live.items()}
    low = min(seq.values())
    laggards = sorted(r for r, s in seq.items() if s == low)
    start = min(rec["progress_unix_s"] for rec in have)
    last = max((live[r]["progress_unix_s"] if live[r] is not None else start) for r in laggards)
    allowance = max((live[r]["allowance_s"] if live[r] is not None else
                     max(rec["allowance_s"] for rec in have)) for r in laggards)
    silent = now - last
    if silent <= allowance:
        return None
    frozen = [r for r in laggards if live[r] is None
              or now - live[r]["beat_unix_s"] > frozen_after_s]
    return {"ranks": frozen or laggards, "silent_s": silent, "allowance_s": allowance,
            "frozen": frozen, "cause": "progress", "records": {r: live[r] for r in laggards}}


def describe(found: dict, now: float, frozen_after_s: float) -> str:
    """The hang in words (one line, no rank prefix): who, where, how long, the allowance."""
    parts = []
    for r in found["ranks"]:
        rec = found["records"].get(r)
        if rec is None:
            parts.append(f"rank {r} (no progress record from this run)")
            continue
        beat = now - rec["beat_unix_s"]
        state = (f"; its process is not running: no heartbeat for {beat:.0f} s"
                 if beat > frozen_after_s else "")
        parts.append(f"rank {r} (host {rec['host']}, pid {rec['pid']}) after step {rec['step']} "
                     f"in phase {rec['phase']}{state}")
    who = "; ".join(parts)
    kind = "heartbeat allowance" if found.get("cause") == "heartbeat" else "allowance"
    return (f"{who}: no progress for {found['silent_s']:.1f} s ({kind} "
            f"{found['allowance_s']:.0f} s)")


class Watchdog:
    """This rank's progress record and the thread that watches the job (see the module).

    Args:
        run_dir: the run folder (shared by all ranks).
        rank / world_size: this process's global rank and the number of processes.
        policy: the allowances (`HangPolicy`).
        token: the same string on every rank of this run (records and reports of an earlier
            run in the folder are ignored).
        on_exit: called (from the watchdog thread) just before `os._exit`, e.g. to release the
            run lock; must not block.
        beat_s: seconds between heartbeats and checks; default min(5, max(0.5, allowance/10)).
    """

    def __init__(self, run_dir: str, rank: int, world_size: int, policy: HangPolicy, token: str,
                 on_exit=None, beat_s: float | None = None):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / PROGRESS_DIR
        self.rank, self.world_size, self.policy, self.token = rank, world_size, policy, token
        self.on_exit = on_exit
        base = policy.hang_timeout_s if policy.hang_timeout_s else DERIVED_FLOOR_S
        self.beat_s = beat_s if beat_s is not None else min(5.0, max(0.5, base / 10.0))
        self.frozen_after_s = max(2.0, 3.0 * self.beat_s)
        self.lost_after_s = max(HEARTBEAT_LOST_S, 3.0 * self.beat_s)
        self._lost_seen: dict[int, float] = {}   # heartbeats found lost at the last check
        self.checker = rank in (0, world_size - 1)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._state = (0, 0, "setup", time.time())   # (seq, step, phase, progress time)
        self._stop = threading.Event()
        self._wake = threading.Event()   # entering a save or validation: publish at once
        self._thread: threading.Thread | None = None
        self.enabled = policy.enabled

    # -- the main thread's side -------------------------------------------------------

    def progress(self, phase: str, step: int | None = None) -> None:
        """Record progress: this rank entered `phase` (or advanced within it) at step `step`
        (optimizer steps done; default unchanged). Cheap: no I/O."""
        seq, old_step, old_phase, _ = self._state
        self._state = (seq + 1, old_step if step is None else step, phase, time.time())
        if phase != old_phase and phase in ("checkpoint", "validation", DONE):
            self._wake.set()   # their allowance differs: peers should see it within ms

    def record_file(self, rank: int) -> Path:
        """Where `rank` publishes its record."""
        return self.folder / f"rank_{rank:05d}.json"

    def start(self) -> None:
        """Write the first record and start the thread (collective: one all-reduce checks that
        every rank sees every record, i.e. that the run folder is shared; when it is not the
        watchdog is switched off with one warning line)."""
        if not self.enabled:
            return
        import torch
        import torch.distributed as dist
        self.folder.mkdir(parents=True, exist_ok=True)
        self._beat()
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
            seen = sum(1 for r in range(self.world_size)
                       if (_read_json(self.record_file(r)) or {}).get("token") == self.token)
            t = torch.tensor([float(seen == self.world_size)])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            if t.item() < 1:
                if self.rank == 0:
                    print(f"pipeline.train: warning: hang watchdog off: the ranks do not all see "
                          f"{self.folder} (run_dir must be on a filesystem every node shares)",
                          file=sys.stderr, flush=True)
                self.enabled = False
                return
        self._thread = threading.Thread(target=self._loop, name="hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Publish phase "done" (peers no longer wait for this rank) and stop the thread."""
        if not self.enabled:
            return
        self.progress(DONE)
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        try:
            self._beat()
        except OSError:
            pass

    def act_on_report(self) -> None:
        """When a hang report of this run exists (another rank declared the hang), act on it
        now (one line, exit `EXIT_HUNG`; never returns then); otherwise return. For the main
        thread's error path: a collective that failed because a hung job's ranks are exiting."""
        if not self.enabled:
            return
        report = _read_json(self.run_dir / HANG_FILE)
        if report is not None and report.get("token") == self.token:
            self._act(report)

    # -- the thread -------------------------------------------------------------------

    def _beat(self) -> None:
        seq, step, phase, t = self._state
        rec = {"token": self.token, "rank": self.rank, "host": self.host, "pid": self.pid,
               "seq": seq, "step": step, "phase": phase, "progress_unix_s": t,
               "beat_unix_s": time.time(), "allowance_s": self.policy.allowance(phase)}
        if math.isinf(rec["allowance_s"]):
            rec["allowance_s"] = 1e18
        _atomic_write(self.record_file(self.rank), json.dumps(rec))

    def _records(self) -> dict[int, dict | None]:
        out = {}
        for r in range(self.world_size):
            rec = _read_json(self.record_file(r))
            out[r] = rec if rec is not None and rec.get("token") == self.token else None
        return out

    def _loop(self) -> None:
        next_check = time.monotonic() + self.beat_s
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_check - time.monotonic()))
            if self._stop.is_set():
                return
            if self._wake.is_set():   # a phase with another allowance began: publish only
                self._wake.clear()
                try:
                    self._beat()
                except OSError:
                    pass
                if time.monotonic() < next_check:
                    continue
            next_check = time.monotonic() + self.beat_s
            try:
                self._beat()
                report = _read_json(self.run_dir / HANG_FILE)
                if report is not None and report.get("token") == self.token:
                    self._act(report)
                if self.checker:
                    now = time.time()
                    records = self._records()
                    # a heartbeat counts as lost when two checks saw the same old beat: one
                    # late check of this thread (a loaded host, a stalled filesystem) is not it
                    lost = lost_heartbeats(records, now, self.lost_after_s)
                    confirmed = {r: b for r, b in lost.items() if self._lost_seen.get(r) == b}
                    self._lost_seen = lost
                    found = find_stuck(records, now, self.frozen_after_s, confirmed,
                                       self.lost_after_s)
                    if found is not None:
                        report = {"token": self.token, "found_by_rank": self.rank,
                                  "time_unix_s": now, "ranks": found["ranks"],
                                  "frozen": found["frozen"], "cause": found["cause"],
                                  "silent_s": round(found["silent_s"], 1),
                                  "allowance_s": found["allowance_s"],
                                  "line": describe(found, now, self.frozen_after_s),
                                  "records": {str(r): v for r, v in found["records"].items()}}
                        _atomic_write(self.run_dir / HANG_FILE, json.dumps(report, indent=1))
                        self._act(report)
            except OSError:
                pass   # a filesystem hiccup: the next beat tries again

    def _act(self, report: dict) -> None:
        """Report the hang on this rank and end the process (never returns)."""
        named = [int(r) for r in report["ranks"]]
        where = self.run_dir / HANG_FILE
        if self.rank in named:
            try:
                with open(self.run_dir / f"stacks_rank_{self.rank:05d}.txt", "w") as f:
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError:
                pass
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            for r in named:
                rec = report["records"].get(str(r)) or {}
                pid = rec.get("pid")
                if rec.get("host") == self.host and isinstance(pid, int) and _process_stopped(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        print(f"pipeline.train: rank {self.rank}: hang: {report['line']}; stopping with exit "
              f"{EXIT_HUNG} (report: {where})", file=sys.stderr, flush=True)
        try:
            if self.on_exit is not None:
                self.on_exit()
        except Exception:
            pass
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(EXIT_HUNG)


def start_watchdog(run_dir: str, rank: int, world_size: int, train_cfg, on_exit=None
                   ) -> Watchdog | None:
    """The job's watchdog (collective): the policy from `train.hang_timeout_s` /
    `train.hang_warmup_s`, a token agreed through rank 0, started; None when
    `train.hang_timeout_s: 0` disables it. `on_exit`: as for `Watchdog` (the trainer releases
    its run lock before a hang exit)."""
    import secrets
    from pipeline.parallel import broadcast_from_rank0
    policy = HangPolicy(hang_timeout_s=train_cfg.hang_timeout_s,
                        warmup_s=float(train_cfg.hang_warmup_s))
    if not policy.enabled:
        return None
    token = broadcast_from_rank0(secrets.token_hex(8))
    watchdog = Watchdog(str(run_dir), rank, world_size, policy, token, on_exit=on_exit)
    watchdog.start()
    return watchdog


def rank_checkpoint_bytes(engine, tp_size: int, world_size: int) -> float:
    """Estimated bytes one rank writes in a checkpoint save (`HangPolicy.rank_checkpoint_bytes`):
    16 bytes per parameter (16-bit weights, fp32 master weights, two fp32 Adam moments) of the
    whole model (this rank's tensor-parallel shard x `tp_size`), spread by ZeRO-3 over all
    `world_size` ranks."""
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    return 16.0 * n * tp_size / max(1, world_size)
