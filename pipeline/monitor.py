"""Run monitoring sinks of the trainer: `<run_dir>/metrics.jsonl` and wandb (rank 0 only).

Owns: appending metrics lines, the wandb run (init, log, finish) and the rule that monitoring
never takes training down. Must not touch: the training loop, checkpoints, console lines (those
stay in `pipeline.train`).

wandb runs its writer in a separate service process (`wandb-core`). SLURM's preemption, requeue
and scancel send SIGTERM to every process of the job, that service included; it then exits at
once, without writing what it still buffered (measured with wandb 0.31 offline: a run of 10
logged steps left a 7-byte `.wandb` file), and every later wandb call raises
`ConnectionResetError`. So:
- every wandb call is guarded: the first failure is one warning line, wandb is off for the rest
  of this leg, and metrics.jsonl, training and checkpointing go on;
- `<run_dir>/wandb_state.json` (rank 0, atomic) records the run id and the last step whose
  history wandb confirmed (written after a successful `finish`); the next leg resumes the same
  wandb run id and first re-logs, from metrics.jsonl, every step after that confirmed one up to
  its resume step, so the run's history has all steps even when a leg's wandb writer died.
  (Online, steps below the resumed run's `step`, which the server already has, are skipped.)
- `wandb.init` is bounded (`WANDB_INIT_TIMEOUT` seconds, default `INIT_TIMEOUT_S`) and a failure
  there is one line saying what to do (offline mode, `wandb sync`).

metrics.jsonl write failures (read-only filesystem, permission, disk full, quota) raise
`MonitorError` naming the file, the cause (with the free space seen for a full disk or quota) and
a remedy fitting it (the trainer turns it into its write-failure exit code, 4). The trainer checks
at start-up that metrics.jsonl can be appended to (`pipeline.common.diskspace.check_writable`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("pipeline.monitor")

INIT_TIMEOUT_S = 30.0
STATE_FILE = "wandb_state.json"
METRICS_FILE = "metrics.jsonl"


class MonitorError(RuntimeError):
    """metrics.jsonl could not be written (read-only filesystem, permission, disk full, quota
    exceeded, or another OS error); the message is one line."""


def read_metrics(path: str) -> dict[tuple[str, int], dict]:
    """Last line per (kind, step) of a metrics.jsonl (a resumed run re-logs steps); a torn last
    line (a crash mid-write) is skipped. Missing file: {}."""
    out: dict[tuple[str, int], dict] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    m = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(m, dict) and "kind" in m and "step" in m:
                    out[(m["kind"], int(m["step"]))] = m
    except FileNotFoundError:
        pass
    return out


def wandb_items(metrics: dict) -> dict:
    """The wandb history item of one metrics line (train fields under `train/`, None dropped;
    a dict field such as `loss_by_source` flattened to `<field>/<key>`, e.g.
    `train/loss_by_source/web`)."""
    prefix = "train/" if metrics["kind"] == "train" else ""
    out = {}
    for k, v in metrics.items():
        if k in ("kind", "step", "time_unix_s"):
            continue
        for name, x in (v.items() if isinstance(v, dict) else ((None, v),)):
            if x is not None:
                out[prefix + k + ("" if name is None else f"/{name}")] = x
    return out


class Monitor:
    """metrics.jsonl + wandb for one leg of a run; every method is a no-op off rank 0.

    Args:
        run_dir: the run folder (metrics.jsonl, wandb_state.json, wandb/ live there).
        is_rank0: only rank 0 writes.
        wandb_cfg: the config's `wandb` section (mode, project, entity, name) or None.
        config: the resolved run config (dict) recorded in wandb.
    """

    def __init__(self, run_dir: str, is_rank0: bool, wandb_cfg: Any = None,
                 config: dict | None = None):
        self.run_dir, self.is_rank0 = run_dir, is_rank0
        self.wandb_cfg, self.config = wandb_cfg, config
        self.run = None            # the wandb run while it works
        self.run_id: str | None = None
        self.failed: str | None = None   # first wandb failure of this leg
        self.last_step = 0         # the highest step handed to wandb in this leg

    # -- metrics.jsonl ----------------------------------------------------------------------

    def append(self, metrics: dict) -> None:
        """Append one JSON line to metrics.jsonl (flushed). Raises MonitorError on a write
        failure (one line: file, cause, remedy)."""
        if not self.is_rank0:
            return
        path = os.path.join(self.run_dir, METRICS_FILE)
        try:
            with open(path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
                f.flush()
        except OSError as e:
            from pipeline.common.diskspace import diagnose
            f = diagnose(e, path)
            raise MonitorError(f"{path}: cannot append metrics: {f.cause}; "
                               f"{f.remedy('run_dir')}, then rerun to resume") from None

    # -- wandb ----------------------------------------------------------------------------

    def start_wandb(self, run_id: str | None, resume_step: int) -> str | None:
        """Start (or resume) the wandb run `run_id` (a new id when None) and re-log the steps in
        (confirmed step, `resume_step`] from metrics.jsonl. Returns the run id.

        Raises:
            RuntimeError: wandb.init failed; the message is one line saying what to do.
        """
        import secrets
        w = self.wandb_cfg
        if not self.is_rank0 or w is None or w.mode == "disabled":
            return run_id
        import wandb
        state = self._read_state()
        run_id = run_id or state.get("run_id") or secrets.token_hex(6)
        kwargs = {}
        if "WANDB_INIT_TIMEOUT" not in os.environ:
            kwargs["settings"] = wandb.Settings(init_timeout=INIT_TIMEOUT_S)
        t0 = time.time()
        try:
            self.run = wandb.init(project=w.project, entity=w.entity, name=w.name, id=run_id,
                                  resume="allow", dir=self.run_dir, mode=w.mode,
                                  config=self.config, **kwargs)
        except Exception as e:  # no credentials, no network, timeout
            text = str(e).strip().splitlines()
            hint = ("; without network use wandb.mode=offline and upload later with "
                    f"`wandb sync {self.run_dir}/wandb/offline-run-*`") if w.mode == "online" else ""
            raise RuntimeError(f"wandb.init failed after {time.time() - t0:.0f} s (wandb.mode="
                               f"{w.mode}): {text[0] if text else type(e).__name__}{hint}") from None
        self.run_id = run_id
        confirmed = int(state.get("confirmed_step", 0)) if state.get("run_id") == run_id else 0
        try:  # online resume: the server's history already reaches run.step (wandb would refuse
            confirmed = max(confirmed, int(getattr(self.run, "step", 0) or 0) - 1)  # lower steps)
        except Exception:  # noqa: BLE001 - a hint only
            pass
        if resume_step > confirmed:
            lines = [m for (k, s), m in read_metrics(os.path.join(self.run_dir, METRICS_FILE)).items()
                     if confirmed < s <= resume_step]
            lines.sort(key=lambda m: (m["step"], m["kind"] != "train"))
            for m in lines:
                self.log(m)
            if lines:
                log.info("wandb: re-logged %d metrics lines of steps %d..%d from %s (not confirmed "
                         "by the previous leg's wandb)", len(lines), confirmed + 1, resume_step,
                         METRICS_FILE)
        return run_id

    def log(self, metrics: dict) -> None:
        """Log one metrics line to wandb at its step; a failure is one warning line and turns
        wandb off for the rest of this leg."""
        if self.run is None:
            return
        try:
            self.run.log(wandb_items(metrics), step=metrics["step"])
            self.last_step = max(self.last_step, int(metrics["step"]))
        except BaseException as e:  # noqa: BLE001 - monitoring must not stop training
            if isinstance(e, KeyboardInterrupt):
                raise
            self._fail(f"log at step {metrics['step']}", e)

    def finish(self, exit_code: int) -> None:
        """Finish the wandb run (flushes its history); on success record the confirmed step in
        wandb_state.json. A failure is one warning line."""
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish(exit_code=exit_code)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self.run = run
            self._fail("finish", e)
            self.run = None
            return
        state = {"run_id": self.run_id, "confirmed_step": self.last_step,
                 "time_unix_s": time.time()}
        try:
            from pipeline.common.atomic_io import write_text
            write_text(os.path.join(self.run_dir, STATE_FILE), json.dumps(state) + "\n")
        except OSError as e:
            log.warning("wandb: could not write %s: %s", STATE_FILE, e)

    def _fail(self, what: str, e: BaseException) -> None:
        self.failed = f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        log.warning("wandb stopped working (%s); training and checkpointing go on without it, "
                    "metrics.jsonl keeps every step and the next leg re-logs the missing steps",
                    self.failed)
        self.run = None
        _silence_wandb()

    def _read_state(self) -> dict:
        try:
            with open(os.path.join(self.run_dir, STATE_FILE)) as f:
                s = json.load(f)
            return s if isinstance(s, dict) else {}
        except (OSError, ValueError):
            return {}


def _silence_wandb() -> None:
    """After the service died: run wandb's teardown now (it unregisters its atexit hook first,
    which would otherwise print a traceback at exit) and drop its asyncio warnings."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        import wandb
        wandb.teardown()
    except BaseException:  # noqa: BLE001 - the connection is gone; nothing to save
        pass


