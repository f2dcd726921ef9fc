"""Hang detection, stragglers and restarts of the training job, with real processes (2 gloo
ranks through `python -m pipeline.launch`, tiny CPU model, ZeRO-3).

What is compared against what:
- The reference is one healthy 12-step run slowed on purpose by the `debug.*` switches: a first
  step slower than the hang timeout (warm-up allowance), checkpoint saves twice as long as the
  hang timeout (save allowance), a validation micro-batch longer than it (validation
  allowance) and rank 1 slowed in every step (a straggler). It must finish (exit 0, no hang
  line), and rank 1 must be named as the straggler in metrics.jsonl and in one warning line.
- A hung rank is a stopped process (SIGSTOP: alive, silent, holding its peer in the next
  collective, as a hung GPU process does). Both cases below are one run (`stopped_twice`,
  `--max-restarts 1`): the save case first, then the mid-run case in the restarted workers.
- During a checkpoint save (the `.partial` folder with DeepSpeed's files exists): detected by
  its lost heartbeat, not after the longer save allowance; with `--max-restarts 1` the
  launcher restarts the workers, which
  resume from the previous complete checkpoint (the partial one is never loaded); the run
  finishes with the reference's losses.
- Mid-run (no restart left): the job ends with exit 6 within the hang
  timeout (in a step) or the lost-heartbeat allowance (in a longer phase) plus a few seconds
  (the detection time is measured from the SIGSTOP to the launcher's exit), one line names
  rank 1, no traceback; the same command then resumes and every step's losses equal the
  reference's.
- The decision itself (`find_stuck`, `HangPolicy`): pure functions over progress records.
Timeouts in these runs: `train.hang_timeout_s=4`, `train.hang_warmup_s=60`.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shard_fixtures import write_train_val
from test_run_safety import _start, _trainer_pid
from test_train import ROOT, _env, _finish, _kill_tree, _log, _metrics, _write_config

from pipeline.training.watchdog import HEARTBEAT_LOST_S

HANG_S = 4.0
STEPS = 12
TRAIN = {"max_steps": STEPS, "eval_interval": 6, "eval_batches": 1, "log_interval": 1,
         "hang_timeout_s": HANG_S, "hang_warmup_s": 60.0}
LOSS_FIELDS = ("loss", "ar_loss", "mdm_loss", "val_loss", "grad_norm", "lr", "consumed_samples")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("hang")
    d = base / "data"
    write_train_val(d, 48, 4, samples_per_shard=12)
    return base, d


@pytest.fixture(scope="module")
def healthy(data):
    """The reference: 12 steps, slowed everywhere the watchdog gives an allowance."""
    base, d = data
    run_dir = base / "healthy"
    config = _write_config(base / "healthy.yaml", d, train=dict(TRAIN, straggler_intervals=3,
                                                                   straggler_factor=1.1),
                           checkpoint={"interval": 6, "keep": 2},
                           debug={"slow_first_step_s": 1.5 * HANG_S, "slow_save_s": 2 * HANG_S,
                                  "slow_eval_s": 1.5 * HANG_S, "slow_rank": 1,
                                  "slow_rank_s": 0.8, "slow_rank_factor": 1.0})
    t0 = time.time()
    proc = _start(2, config, run_dir, log_name="log")
    code = _finish(proc, run_dir, timeout=600)
    return run_dir, code, time.time() - t0


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("pipeline.")]


def _same_losses(ref: Path, got: Path) -> None:
    a, b = _metrics(ref), _metrics(got)
    assert sorted(a) == sorted(b)
    assert len([k for k in a if k[0] == "train"]) == STEPS
    for key in a:
        for f in LOSS_FIELDS:
            if f in a[key]:
                assert b[key][f] == a[key][f], (key, f, a[key][f], b[key][f])


def test_healthy_slow_run_is_never_stopped(healthy):
    run_dir, code, took = healthy
    text = (run_dir / "log.txt").read_text()
    assert code == 0, _log(run_dir)
    assert "hang:" not in text and not (run_dir / "hang.json").exists(), text[-3000:]
    m = _metrics(run_dir)
    assert max(s for k, s in m if k == "train") == STEPS
    assert [s for k, s in sorted(m) if k == "val"] == [6, 12]
    # the slowness really happened: the first step, two 8 s saves, two validations
    assert m[("train", 1)]["step_time_s"] > 1.5 * HANG_S
    assert text.count("checkpoint step ") == 2
    assert took > 1.5 * HANG_S + 2 * 2 * HANG_S + 2 * 1.5 * HANG_S


def test_slowed_rank_is_named_in_metrics_and_one_warning(healthy):
    run_dir, code, _ = healthy
    assert code == 0, _log(run_dir)
    m = _metrics(run_dir)
    host = socket.gethostname()
    for step in range(2, STEPS + 1):   # step 1: both ranks slept in their first step
        r = m[("train", step)]
        assert r["straggler_rank"] == 1 and r["straggler_host"] == host, (step, r)
        # 2 ranks: the median is their mean, so skew = 2 s / (s + f) < 2, with rank 1's
        # s = 0.8 + 2 c1 and rank 0's f = c0 (c: a rank's own compute): above 4/3 when c0 = c1
        # however loaded the machine, above 1.14 even if load makes c0 = 1.5 c1
        assert r["straggler_skew"] > 1.1, (step, r)
        assert r["straggler_compute_s"] >= 0.8
    text = (run_dir / "log.txt").read_text()
    warn = [ln for ln in text.splitlines() if "straggler: rank" in ln]
    assert len(warn) == 1, warn
    assert f"straggler: rank 1 (host {host}) computed " in warn[0]
    # the warning comes with the third straggling interval in a row: step 4, or step 3 when the
    # first step's interval (both ranks slept; warm-up) already straggled, as metrics.jsonl says
    slow = [s for s in range(1, STEPS + 1) if m[("train", s)]["straggler_skew"] > 1.1
            and m[("train", s)]["straggler_rank"] == 1]
    third = next(s for s in slow if {s - 1, s - 2} <= set(slow))
    assert third in (3, 4), slow
    assert (f"for 3 log intervals in a row (up to step {third}; train.straggler_factor=1.1)"
            in warn[0])


def _wait_for(what, cond, timeout_s: float, proc):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        v = cond()
        if v:
            return v
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _try_pid(root: int, rank: int):
    try:
        return _trainer_pid(root, rank)
    except AssertionError:
        return None


@contextlib.contextmanager
def _rank_1_stopped_in_save(proc, run_dir: Path, step: int):
    """SIGSTOP rank 1 once its DeepSpeed files of the save of `step` are in the `.partial`
    folder; yields (its pid, the time of the SIGSTOP) and SIGKILLs it on leaving."""
    partial = run_dir / "checkpoints" / f"step_{step:09d}.partial"
    victim = _wait_for("rank 1's process", lambda: _try_pid(proc.pid, 1), 300, proc)
    _wait_for(f"the partial save of step {step}", lambda: partial.is_dir() and any(
        "model_states" in p.name for p in partial.iterdir()), 300, proc)
    os.kill(victim, signal.SIGSTOP)
    try:
        yield victim, time.time()
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _launch_restartable(config: Path, run_dir: Path, log_name: str) -> subprocess.Popen:
    """`pipeline.launch --max-restarts=1` of a 2-rank run in its own session."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pipeline.launch", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "-m", "pipeline.train", "--config", str(config),
           f"run_dir={run_dir}"]
    out = open(run_dir / f"{log_name}.txt", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def stopped_twice(data):
    """One run folder, one command (`pipeline.launch --max-restarts 1`, a save every 4 steps,
    each held 8 s by `debug.slow_save_s`), rank 1 stopped twice:
    leg 1, first workers: SIGSTOP inside the save of step 8 (its DeepSpeed files are in
    step_000000008.partial): hang report, the launcher's one restart, the new workers resume
    from step 4 (the partial folder is not a checkpoint);
    leg 1, restarted workers: SIGSTOP mid-run in steps 9-12, once rank 1's record shows it
    left the save of step 8 (past its first validation, whose allowance is 60 s, and the three
    steps from the save of step 12): no restart left, the launcher exits;
    leg 2: the same command resumes and finishes.
    Returns what the two tests below read (codes, both reports, pids, times, the logs)."""
    from pipeline.checkpoint import find_latest
    base, d = data
    run_dir = base / "stopped"
    config = _write_config(base / "stopped.yaml", d, train=TRAIN,
                           checkpoint={"interval": 4, "keep": 5},
                           debug={"slow_save_s": 2 * HANG_S})
    out = SimpleNamespace(run_dir=run_dir)
    proc = _launch_restartable(config, run_dir, "leg1")
    try:
        with _rank_1_stopped_in_save(proc, run_dir, 8) as (victim, t_stop):
            _wait_for("the hang report", lambda: (run_dir / "hang.json").exists(), 60, proc)
            out.save_took = time.time() - t_stop
            out.save_report = json.loads((run_dir / "hang.json").read_text())
            out.latest_at_save_report = find_latest(run_dir / "checkpoints").name
            out.save_victim = victim
            # the launcher restarts the workers: a new rank 1
            def restarted():
                pid = _try_pid(proc.pid, 1)
                return pid if pid not in (None, victim) else None
            out.mid_victim = _wait_for("the restarted rank 1", restarted, 300, proc)
        # rank 1 published that it left the (8 s) save of step 8: its record, rewritten every
        # 0.5 s, still says "checkpoint" for up to a beat after the save (then a SIGSTOP is
        # judged by the save's allowance from the save's start)
        record = run_dir / "progress" / "rank_00001.json"
        _wait_for("rank 1's record after the save of step 8", lambda: (
            (r := _read_record(record)) and r["pid"] == out.mid_victim and r["step"] >= 8
            and r["phase"] != "checkpoint"), 300, proc)
        os.kill(out.mid_victim, signal.SIGSTOP)
        t_stop = time.time()
        try:
            out.leg1_code = proc.wait(timeout=HANG_S + 90)
        finally:
            try:
                os.kill(out.mid_victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.mid_took = time.time() - t_stop
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    out.mid_report = json.loads((run_dir / "hang.json").read_text())
    out.leg1 = (run_dir / "leg1.txt").read_text()
    proc = _launch_restartable(config, run_dir, "leg2")
    out.leg2_code = _finish(proc, run_dir, timeout=600)
    out.leg2 = (run_dir / "leg2.txt").read_text()
    return out


def _attempts(text: str) -> tuple[list[str], list[str]]:
    """The lines of a leg's log before and after the restarted workers' restart line."""
    lines = text.splitlines()
    at = [i for i, ln in enumerate(lines)
          if "restart 1 of at most 1 by the launcher (--max-restarts)" in ln]
    assert len(at) == 1, text[-6000:]
    return lines[:at[0]], lines[at[0] + 1:]


def test_sigstop_mid_run_exits_6_naming_the_rank_and_resumes_exactly(stopped_twice, healthy):
    """SIGSTOP of rank 1 mid-run (the restarted workers of `stopped_twice`, no restart left):
    exit 6 within the allowance, one line naming rank 1; the same command resumes and every
    step's losses equal the reference's."""
    run = stopped_twice
    run_dir, victim, took = run.run_dir, run.mid_victim, run.mid_took
    text = run.leg1
    assert run.leg1_code == 6, text[-4000:]
    report = run.mid_report
    assert report["ranks"] == [1] and report["frozen"] == [1]
    rec = report["records"]["1"]
    assert rec["pid"] == victim and rec["host"] == socket.gethostname()
    # in a step's phase its 4 s allowance comes first; validation (3 x 4 s) and a save (at least
    # 3 x 4 s) last longer than the lost-heartbeat allowance, which ends the job then
    if rec["phase"] in ("validation", "checkpoint"):
        assert (report["cause"], report["allowance_s"]) == ("heartbeat", HEARTBEAT_LOST_S), rec
    else:
        assert (report["cause"], report["allowance_s"]) == ("progress", HANG_S), rec
    # measured: ends within the allowance + the 0.5 s check periods + the exit (generous)
    assert report["allowance_s"] <= took <= report["allowance_s"] + 10, took
    lines = _lines("\n".join(_attempts(text)[1]))   # the restarted workers' output
    assert len(lines) == 1, text[-4000:]
    assert lines[0].startswith(f"pipeline.train: rank 0: hang: rank 1 (host {rec['host']}, pid "
                               f"{victim}) after step {rec['step']} in phase {rec['phase']}; its "
                               f"process is not running: no heartbeat for ")
    assert f"stopping with exit 6 (report: {run_dir / 'hang.json'})" in lines[0]
    assert "Traceback" not in text, text[-4000:]
    print(f"\nSIGSTOP mid-run: exit after {took:.1f} s (allowance {report['allowance_s']} s, "
          f"phase {rec['phase']})")
    # the same command resumes and finishes with the reference's losses
    assert run.leg2_code == 0, _log(run_dir)
    assert "resumed from" in run.leg2
    _same_losses(healthy[0], run_dir)


def test_sigstop_during_a_save_restarts_from_the_previous_checkpoint(stopped_twice, healthy):
    """SIGSTOP of rank 1 while it is inside the save of step 8 (the first workers of
    `stopped_twice`; `debug.slow_save_s` holds it there): detected by its lost heartbeat (the
    save allowance, at least 3 x 8 s, is longer); `pipeline.launch --max-restarts 1` starts the
    workers again, they resume from step 4 (the partial folder is not a checkpoint) and the run
    finishes equal to the reference."""
    from pipeline.checkpoint import find_latest
    run = stopped_twice
    run_dir, report, took = run.run_dir, run.save_report, run.save_took
    text = run.leg1
    assert run.latest_at_save_report == "step_000000004"
    assert report["ranks"] == [1] and report["records"]["1"]["phase"] == "checkpoint"
    assert report["records"]["1"]["pid"] == run.save_victim
    # its save allowance, max(3 x the step-4 save (8 s asleep + the write), min(60, 3 x 4 s) +
    # tiny bytes) = 24 s or more, was not waited for
    assert (report["cause"], report["allowance_s"]) == ("heartbeat", HEARTBEAT_LOST_S), report
    assert took <= report["allowance_s"] + 10, took
    print(f"\nSIGSTOP in a save: reported after {took:.1f} s (allowance "
          f"{report['allowance_s']:.1f} s)")
    assert "restart 1 of at most 1 by the launcher (--max-restarts)" in text, text[-4000:]
    assert "the last hang report" in text
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000000004'} at step 4" in text
    first, _ = _attempts(text)   # the first workers' output
    hang_lines = [ln for ln in first if ": hang: " in ln]
    assert len(hang_lines) == 1 and hang_lines[0].startswith("pipeline.train: rank 0: hang: rank 1")
    assert "Traceback" not in text, text[-4000:]
    assert run.leg2_code == 0, run.leg2[-6000:]
    assert find_latest(run_dir / "checkpoints").name == f"step_{STEPS:09d}"
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    _same_losses(healthy[0], run_dir)


# ------------------------------------------------------------------ the decision, pure

def _rec(seq, progress, beat=None, phase="forward_backward", allowance=4.0, step=5):
    return {"seq": seq, "step": step, "phase": phase, "host": "h", "pid": 1,
            "progress_unix_s": progress, "beat_unix_s": progress if beat is None else beat,
            "allowance_s": allowance}


def test_find_stuck_names_the_laggard_not_the_rank_waiting_for_it():
    from pipeline.training.watchdog import find_stuck
    now = 100.0
    # rank 1 is behind (seq 10) and silent 5 s > 4 s; rank 0 waits ahead (seq 12), heartbeat fresh
    recs = {0: _rec(12, 99.0, beat=99.9), 1: _rec(10, 95.0, beat=99.9)}
    found = find_stuck(recs, now, frozen_after_s=2.0)
    assert found["ranks"] == [1] and found["frozen"] == [] and found["silent_s"] == 5.0
    # within its allowance: no hang, however long the waiting rank has been silent
    assert find_stuck({0: _rec(12, 50.0), 1: _rec(10, 97.0, beat=99.9)}, now, 2.0) is None
    # a long save: the laggard's own allowance counts
    assert find_stuck({0: _rec(12, 50.0), 1: _rec(10, 60.0, phase="checkpoint",
                                                  allowance=60.0, beat=99.9)}, now, 2.0) is None
    # level in the same collective: the one whose heartbeat stopped is named
    found = find_stuck({0: _rec(10, 90.0, beat=99.9), 1: _rec(10, 90.0, beat=90.0)}, now, 2.0)
    assert found["ranks"] == [1] and found["frozen"] == [1]
    # level and both alive (e.g. a GPU hang inside one collective): both named
    assert find_stuck({0: _rec(10, 90.0, beat=99.9), 1: _rec(10, 90.0, beat=99.9)}, now,
                      2.0)["ranks"] == [0, 1]
    # a rank that finished is not waited for
    assert find_stuck({0: _rec(30, 10.0, phase="done", allowance=1e18), 1: _rec(40, 99.0)},
                      now, 2.0) is None


def test_a_lost_heartbeat_ends_the_job_in_any_phase():
    """A rank whose heartbeat stopped is a stopped or dead process: no phase allowance applies,
    set-up's and a save's included; a live rank without progress keeps its allowance."""
    from pipeline.training.watchdog import find_stuck, lost_heartbeats
    now = 100.0
    for phase, allowance in (("setup", 900.0), ("validation", 900.0), ("checkpoint", 60.0),
                             ("forward_backward", 120.0)):
        recs = {0: _rec(12, 99.0, beat=99.9),
                1: _rec(10, 80.0, beat=85.0, phase=phase, allowance=allowance)}
        assert find_stuck(recs, now, 2.0) is None                 # within the phase allowance
        lost = lost_heartbeats(recs, now, lost_after_s=10.0)
        assert lost == {1: 85.0}
        found = find_stuck(recs, now, 2.0, lost, lost_after_s=10.0)
        assert (found["ranks"], found["frozen"], found["cause"]) == ([1], [1], "heartbeat")
        assert (found["silent_s"], found["allowance_s"]) == (20.0, 10.0)
        assert found["records"][1]["phase"] == phase
    # a fresh heartbeat, a finished rank and a rank without a record are not lost
    recs = {0: _rec(12, 50.0, beat=95.0), 1: _rec(3, 1.0, beat=1.0, phase="done"), 2: None}
    assert lost_heartbeats(recs, now, lost_after_s=10.0) == {}


def test_hang_policy_derives_allowances_from_measured_steps():
    from pipeline.training import watchdog as w
    p = w.HangPolicy(hang_timeout_s=None, warmup_s=900.0)
    assert p.allowance("setup") == 900.0 and p.allowance("data") == 900.0   # warm-up
    for t in (50.0, 40.0, 30.0):          # warm-up steps (compilation) are not in the median
        p.record_step(t)
    assert p.warm
    assert p.step_allowance() == 400.0    # no later step timed yet: 10 x median of warm-up
    for t in (1.0, 2.0, 30.0):
        p.record_step(t)
    assert p.step_allowance() == w.DERIVED_FLOOR_S == 120.0        # 10 x median 2 s < floor
    for t in [20.0] * 10:
        p.record_step(t)
    assert p.step_allowance() == 200.0                              # 10 x median 20 s
    # Qwen3-8B (8,190,735,360 parameters) x 16 bytes over 32 ranks: 4.1 GB per rank at 10 MB/s
    p.rank_checkpoint_bytes = 16 * 8_190_735_360 / 32
    assert p.save_allowance() == pytest.approx(60.0 + 409.536768)
    p.last_save_s = 900.0
    assert p.save_allowance() == 2700.0                             # 3 x the last save
    assert p.validation_allowance() == 900.0 and p.allowance("done") == float("inf")
    p.validations_seen = 1
    assert p.validation_allowance() == 600.0                        # 3 x 10 x median 20 s
    # the tiny CPU run's defaults: sub-second steps, a 2.2 MB checkpoint over 2 ranks
    tiny = w.HangPolicy(hang_timeout_s=None, warmup_s=900.0, rank_checkpoint_bytes=1_117_184)
    for t in [0.5] * 6:
        tiny.record_step(t)
    assert tiny.step_allowance() == 120.0
    assert tiny.save_allowance() == pytest.approx(60.0 + 0.1117184)   # not 3 x 120 s
    tiny.last_save_s = 2.0
    assert tiny.save_allowance() == pytest.approx(60.1117184)
    tiny.last_save_s = 30.0
    assert tiny.save_allowance() == 90.0
    assert tiny.validation_allowance() == 900.0                     # the first validation
    tiny.validations_seen = 1
    assert tiny.validation_allowance() == 120.0                     # floor, not 3 x 120 s
    fixed = w.HangPolicy(hang_timeout_s=4.0, warmup_s=60.0)
    assert fixed.step_allowance() == 60.0
    for _ in range(3):
        fixed.record_step(0.1)
    assert fixed.step_allowance() == 4.0 and fixed.save_allowance() == 12.0
    fixed.validations_seen = 1
    assert fixed.validation_allowance() == 12.0
    assert not w.HangPolicy(hang_timeout_s=0.0, warmup_s=60.0).enabled


@pytest.mark.parametrize("override,message,cli", [
    ("train.hang_timeout_s=-1", "train.hang_timeout_s must be >= 0 seconds (0 = off) or null "
                                "(derived), got -1.0", True),
    ("train.collective_timeout_s=300", "train.collective_timeout_s=300 must exceed "
                                       "train.hang_timeout_s and train.hang_warmup_s (=900 s): the "
                                       "collective timeout is the backstop behind the hang "
                                       "watchdog", False),
    ("train.straggler_factor=1", "train.straggler_factor must be > 1, got 1.0", False),
    ("debug.slow_rank=5", "debug.slow_rank must be -1 (none) or a rank below the world size 1, "
                          "got 5", False),
])
def test_bad_watchdog_settings_are_one_line_before_any_process_group(data, override, message,
                                                                      cli, capsys, monkeypatch):
    """The first case end to end (`python -m pipeline.train`); the others through the same
    `pipeline.train.main` in this process, with the environment the subprocess gets."""
    base, d = data
    config = _write_config(base / "bad.yaml", d)
    argv = ["--config", str(config), f"run_dir={base / 'bad'}", override]
    if cli:
        r = subprocess.run([sys.executable, "-m", "pipeline.train", *argv], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
        code, stderr = r.returncode, r.stderr
    else:
        from pipeline.train import main
        for k in set(os.environ) - set(_env()):
            monkeypatch.delenv(k)
        code = main(argv)
        stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert stderr.strip().splitlines() == [f"pipeline.train: config error: {message}"], stderr


def test_straggler_tracker_warns_once_after_n_intervals(caplog):
    from pipeline.training.metrics import StragglerTracker
    t = StragglerTracker(["a", "b", "c"], factor=1.5, intervals=2)
    with caplog.at_level("WARNING", logger="pipeline.train"):
        f = t.update([1.0, 1.0, 1.4], step=1)        # skew 1.4: not above the factor
        assert (f["straggler_rank"], f["straggler_skew"]) == (2, 1.4)
        t.update([1.0, 2.0, 1.0], step=2)            # rank 1 above (2.0): first interval
        t.update([1.0, 1.0, 2.0], step=3)            # another rank: the count starts again
        f = t.update([1.0, 1.0, 2.0], step=4)        # rank 2 twice in a row: warned
        t.update([1.0, 1.0, 3.0], step=5)            # ... once
    assert f == {"straggler_rank": 2, "straggler_host": "c", "straggler_compute_s": 2.0,
                 "median_compute_s": 1.0, "straggler_skew": 2.0}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["straggler: rank 2 (host c) computed 2.000 s per step against the median "
                        "rank's 1.000 s (2.00x) for 2 log intervals in a row (up to step 4; "
                        "train.straggler_factor=1.5)"]


def test_a_live_rank_stuck_in_a_phase_dumps_its_stacks_and_both_exit_6(data):
    """`debug.hang_rank=1` at step 5: rank 1's process stays alive (its heartbeat goes on) but
    its main thread never leaves the data phase, as on a GPU hang. Rank 0 (waiting in the next
    collective, ahead of it) is not named; rank 1 is, writes its Python stacks and exits 6 itself,
    and so does rank 0: two lines, no traceback."""
    base, d = data
    run_dir = base / "live_hang"
    config = _write_config(base / "live_hang.yaml", d, train=TRAIN,
                           checkpoint={"interval": 0, "keep": 1},
                           debug={"hang_rank": 1, "hang_at_step": 5})
    proc = _start(2, config, run_dir, log_name="log")
    code = _finish(proc, run_dir, timeout=400)
    text = (run_dir / "log.txt").read_text()
    assert code == 6, text[-4000:]
    report = json.loads((run_dir / "hang.json").read_text())
    assert report["ranks"] == [1] and report["frozen"] == [], report
    rec = report["records"]["1"]
    assert (rec["step"], rec["phase"]) == (4, "data")
    # never before the allowance; how late after it (one 0.5 s check period on a quiet machine)
    # depends on the load, so it is printed below, not asserted
    assert HANG_S <= report["silent_s"], report
    lines = _lines(text)
    assert len(lines) == 2 and "Traceback" not in text, text[-4000:]
    assert {ln.split(":")[1].strip() for ln in lines} == {"rank 0", "rank 1"}
    for ln in lines:
        assert f": hang: rank 1 (host {rec['host']}, pid {rec['pid']}) after step 4 in phase " \
               f"data: no progress for " in ln, ln
    stacks = (run_dir / "stacks_rank_00001.txt").read_text()
    # every thread's stack (faulthandler): the main thread sits in the step's data phase
    assert "in train_step" in stacks and stacks.count("hread 0x") >= 2, stacks
    assert not (run_dir / "stacks_rank_00000.txt").exists()
    print(f"\nlive rank stuck in a phase: reported after {report['silent_s']} s of silence "
          f"(allowance {report['allowance_s']} s)")


def test_sigstop_in_a_save_of_the_tiny_run_with_default_allowances(data):
    """configs/tiny_cpu.yaml as shipped (2 ranks, no `train.hang_timeout_s`: derived allowances)
    with rank 1 stopped inside the save of step 5 (its first; `debug.slow_save_s` holds it in
    the `.partial` folder): exit 6 with the one line naming rank 1 and its phase, found by its
    lost heartbeat (3 x the 5 s beat, confirmed at the next check) instead of the save
    allowance (60 s + a 1.1 MB share at 10 MB/s), well within 60 s of the stop."""
    base, d = data
    run_dir = base / "tiny_default"
    proc = _start(2, ROOT / "configs" / "tiny_cpu.yaml", run_dir, f"data.dir={d}",
                  "debug.slow_save_s=5", log_name="log")
    with _rank_1_stopped_in_save(proc, run_dir, 5) as (victim, t_stop):
        code = _finish(proc, run_dir, timeout=300)
        took = time.time() - t_stop
    text = (run_dir / "log.txt").read_text()
    assert code == 6, text[-4000:]
    report = json.loads((run_dir / "hang.json").read_text())
    rec = report["records"]["1"]
    assert report["ranks"] == [1] and (rec["phase"], rec["step"]) == ("checkpoint", 5), report
    # the lost-heartbeat allowance at the default 5 s beat: max(10 s, 3 x 5 s)
    assert (report["cause"], report["allowance_s"]) == ("heartbeat", 15.0), report
    assert took <= 60, took   # the watchdog's promise for a stopped rank, in any phase
    lines = _lines(text)
    assert len(lines) == 1 and lines[0].startswith(
        f"pipeline.train: rank 0: hang: rank 1 (host {rec['host']}, pid {victim}) after step 5 "
        f"in phase checkpoint; its process is not running"), text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    print(f"\ntiny run, default allowances, SIGSTOP in a save: exit 6 after {took:.1f} s "
          f"(allowance {report['allowance_s']:.2f} s)")
