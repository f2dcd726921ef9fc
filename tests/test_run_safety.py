"""Run robustness: preemption with wandb on, rank-only user errors, the launcher's exit codes,
one job per run directory, full disks, read-only folders, a rank killed mid-run, clean console
output.

What is compared against what:
- Preemption: SIGTERM at the same moment to every process of a 2-process run (trainers, their
  loader workers, wandb's service process `wandb-core`) -> exit 0, a checkpoint at the step
  reached, and the next leg (stopped in turn by SIGTERM to the launcher alone: exit 0, a
  checkpoint at its last step) continues the same wandb run id with every step's loss equal to
  metrics.jsonl, read back with wandb's own reader (`wandb leet inspect --json`).
- Folders that cannot be written: the tests run as root, where chmod does not stop a write, so
  read-only and full filesystems are real tmpfs mounts (`mount -o ro`, `remount,ro` during a
  run, a filled 4 MiB tmpfs; skipped where mounting is not permitted), and "permission denied"
  is an EACCES injected at the write probe (`tempfile.mkstemp`), in one process and on one rank
  of two. Expected: exit 2 before any step with the exact one line (setting, folder, rank,
  cause, remedy); mid-run, exit 4 with the read-only cause and no advice to free space.
- A rank killed by SIGKILL mid-run: the survivor's line and the launcher's line, exactly two,
  no traceback, the launcher's exit code 137.

Launches are the cost: tests that only read a job's outputs share it (module fixtures
`preempted`, `lock_runs`), and where a check is of the trainer rather than of its command line
(each behaviour keeps a command-line run) it runs `pipeline.train.main` in processes forked
from the preloaded forkserver (`distributed.run_train_main`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import run_train_main
from shard_fixtures import write_train_val
from test_train import (ROOT, _env, _finish, _log, _metrics, _wait_step,
                        _wandb_history, _write_config)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("safety")
    d = base / "data"
    write_train_val(d, 48, 4, samples_per_shard=12)
    return base, d


def _start(nproc: int, config: Path, run_dir: Path, *overrides: str, log_name: str = "log",
           launcher: str = "pipeline.launch") -> subprocess.Popen:
    """A run in its own session (so a test can signal every process of it)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "pipeline.train"]
    else:
        cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}",
               "-m", "pipeline.train"]
    cmd += ["--config", str(config), f"run_dir={run_dir}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / f"{log_name}.txt", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def preempted(data):
    """A 2-process run with wandb offline, stopped twice by SIGTERM: leg 1 at step 3 or later
    to every process of the job at the same moment (as SLURM does), leg 2 (resumed with a
    larger `train.max_steps`) at its first step or later to the launcher only, which forwards
    it to the workers. Returns a dict: run_dir, the process tree of leg 1 (command lines), each
    leg's exit code, last step and latest checkpoint."""
    from pipeline.checkpoint import find_latest
    base, d = data
    run_dir = base / "preempt"
    config = _write_config(base / "preempt.yaml", d, train={"max_steps": 60, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 2}, wandb={"mode": "offline"},
                           data={"num_workers": 1})
    out = {"run_dir": run_dir}
    proc = _start(2, config, run_dir, log_name="leg1")
    _wait_step(proc, run_dir, 3)
    # the launcher, both trainers, their loader workers and wandb's service (a child of rank 0)
    tree = [proc.pid, *_descendants(proc.pid)]
    out["tree"] = [_cmdline(p) for p in tree]
    for p in tree:  # as SLURM does: SIGTERM to every process of the job at the same moment
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    out["code1"] = _finish(proc, run_dir)
    assert out["code1"] == 0, _log(run_dir)
    out["reached1"] = reached = max(s for k, s in _metrics(run_dir) if k == "train")
    out["latest1"] = find_latest(run_dir / "checkpoints").name
    # the next leg: same wandb run; the launcher alone gets SIGTERM once it trained a step
    proc = _start(2, config, run_dir, f"train.max_steps={reached + 60}",
                  "optim.override_schedule=true", log_name="leg2")
    _wait_step(proc, run_dir, reached + 1)
    os.kill(proc.pid, signal.SIGTERM)   # the launcher only: it forwards to the workers
    out["code2"] = _finish(proc, run_dir)
    out["reached2"] = max(s for k, s in _metrics(run_dir) if k == "train")
    out["latest2"] = find_latest(run_dir / "checkpoints").name
    return out


def test_preemption_with_wandb_checkpoints_and_keeps_history(preempted):
    run_dir, tree, reached = preempted["run_dir"], preempted["tree"], preempted["reached1"]
    assert [c for c in tree if "wandb-core" in c], tree
    assert len(tree) >= 6, tree
    assert preempted["code1"] == 0
    text = (run_dir / "leg1.txt").read_text()
    assert reached < 60
    assert preempted["latest1"] == f"step_{reached:09d}"
    assert f"checkpointing at step {reached}" in text
    assert "Traceback" not in text, text[-4000:]
    # the next leg (stopped by test_sigterm_to_the_launcher_checkpoints_and_exits_0's signal):
    # same wandb run, every step of both legs in its history
    last = preempted["reached2"]
    assert preempted["code2"] == 0, _log(run_dir)
    ids, hist = _wandb_history(run_dir)
    assert len(ids) == 2 and len(set(ids)) == 1, ids
    m = _metrics(run_dir)
    for step in range(1, last + 1):
        assert hist[step]["train/loss"] == m[("train", step)]["loss"], step
    assert json.loads((run_dir / "wandb_state.json").read_text())["confirmed_step"] == last


# ------------------------------------------------------------------ one job per run directory

def _lock_file(run_dir: Path, **holder) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    p = run_dir / "run.lock"
    p.write_text(json.dumps(holder) + "\n")
    return p


def test_run_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, monkeypatch):
    import socket
    from pipeline.runlock import RunLock, RunLockError
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    host = socket.gethostname()
    # a live process on this host (our parent) holds it: refused, one line naming the holder
    _lock_file(tmp_path / "a", host=host, pid=os.getppid(), slurm_job_id="77", token="x")
    with pytest.raises(RunLockError) as e:
        RunLock(str(tmp_path / "a")).acquire()
    msg = str(e.value)
    assert "\n" not in msg and f"host {host}, pid {os.getppid()}, SLURM job 77" in msg
    assert f"remove {tmp_path / 'a' / 'run.lock'}" in msg
    # another host with a fresh heartbeat: refused; the same with a heartbeat older than stale_s:
    # taken over
    p = _lock_file(tmp_path / "b", host="other-node", pid=1, slurm_job_id=None, token="y")
    with pytest.raises(RunLockError):
        RunLock(str(tmp_path / "b"), stale_s=60).acquire()
    old = time.time() - 120
    os.utime(p, (old, old))
    lock = RunLock(str(tmp_path / "b"), stale_s=60).acquire()
    assert lock.took_over["host"] == "other-node" and "no heartbeat" in lock.took_over["reason"]
    assert lock.holds()
    # while held, a second taker is refused; release removes the file
    with pytest.raises(RunLockError):
        RunLock(str(tmp_path / "b"), stale_s=60).acquire()
    lock.release()
    assert not p.exists()
    # a dead process id on this host: taken over at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_file(tmp_path / "c", host=host, pid=dead.pid, slurm_job_id=None, token="z")
    lock = RunLock(str(tmp_path / "c")).acquire()
    assert lock.took_over["reason"] == "its process is gone"
    lock.release()
    # the same SLURM job (a requeue) takes over its own lock even from a live-looking holder
    _lock_file(tmp_path / "d", host="other-node", pid=1, slurm_job_id="123", token="w")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    lock = RunLock(str(tmp_path / "d")).acquire()
    assert lock.took_over["reason"] == "same SLURM job (requeued)"
    lock.release()
    # the heartbeat moves the mtime (polled until it does, at most 60 s)
    lock = RunLock(str(tmp_path / "e"), heartbeat_s=0.05).acquire()
    t0 = os.stat(lock.path).st_mtime
    deadline = time.monotonic() + 60
    while os.stat(lock.path).st_mtime <= t0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.stat(lock.path).st_mtime > t0
    lock.release()


@pytest.fixture(scope="module")
def lock_runs(data):
    """While a first job (one process) trains in run directory `locked`, a second job on that
    directory and a bare job on another (`other`: 2 steps, a validation at each) run through
    `python -m pipeline.train`; then the first job gets SIGTERM. Returns a dict: `second` and
    `other` (subprocess.CompletedProcess), `first_pid`, `first_alive` (still running after
    both), `first_code`, `run_dir`."""
    base, d = data
    config = _write_config(base / "lock.yaml", d, train={"max_steps": 400, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 1})
    run_dir = base / "locked"
    # the first job only has to hold the run directory while the others start: it sleeps 2 s
    # in each step (debug.slow_rank) instead of taking a core from them (its steps cost CPU for
    # as long as the others take)
    first = _start(1, config, run_dir, "debug.slow_rank=0", "debug.slow_rank_s=2",
                   log_name="first")
    out = {"run_dir": run_dir, "first_pid": first.pid}
    try:
        _wait_step(first, run_dir, 1)
        out["second"] = subprocess.run(
            [sys.executable, "-m", "pipeline.train", "--config", str(config),
             f"run_dir={run_dir}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
            timeout=300)
        # another run directory, another bare process on this host; it also shows the console
        # (test_console_output_has_no_import_noise_and_short_floats)
        out["other"] = subprocess.run(
            [sys.executable, "-m", "pipeline.train", "--config", str(config),
             f"run_dir={base / 'other'}", "train.max_steps=2", "train.eval_interval=1",
             "train.eval_batches=1"], cwd=ROOT, env=_env(), capture_output=True, text=True,
            timeout=300)
        out["first_alive"] = first.poll() is None
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGTERM)
        out["first_code"] = _finish(first, run_dir)
    return out


def test_second_job_on_a_run_dir_exits_2_and_bare_runs_pick_free_ports(lock_runs):
    run_dir, second, other = lock_runs["run_dir"], lock_runs["second"], lock_runs["other"]
    # same run directory: refused at start-up, one line naming the holder, exit 2
    assert second.returncode == 2, second.stderr[-3000:]
    err = [l for l in second.stderr.splitlines() if l.startswith("pipeline.")]
    assert len(err) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert err[0].startswith("pipeline.train: error: ")
    assert f"is in use by another job (host " in err[0] and f"pid {lock_runs['first_pid']}" in err[0]
    # another run directory, another bare process on this host: its own free port
    assert other.returncode == 0, other.stderr[-3000:]
    assert lock_runs["first_alive"]  # the first job was not disturbed
    assert lock_runs["first_code"] == 0, _log(run_dir)
    assert not (run_dir / "run.lock").exists()  # released at exit


# ------------------------------------------------------------------ launcher and rank-only errors

def test_rank_only_user_error_is_one_line_and_launcher_keeps_its_exit_code(data, tmp_path):
    """DP rank 1 alone reads a damaged shard (streams own contiguous sample ranges: rank 1 has
    shards 2-3): its one-line error reaches the user, rank 0 stops without a gloo traceback,
    and `pipeline.launch` exits 2 (plain torchrun: 1 and a ChildFailedError traceback)."""
    import shutil
    base, d = data
    bad = tmp_path / "data"
    shutil.copytree(d, bad)
    tar = bad / "train-000003.tar"
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 3])
    config = _write_config(tmp_path / "bad.yaml", bad, train={"max_steps": 20, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 1})
    proc = _start(2, config, tmp_path / "run", log_name="log")
    assert _finish(proc, tmp_path / "run") == 2, _log(tmp_path / "run")
    text = (tmp_path / "run" / "log.txt").read_text()
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert len(lines) == 1, text[-4000:]
    assert lines[0].startswith("pipeline.train: error: ") and "train-000003.tar" in lines[0]
    assert lines[0].endswith("(rank 1)")
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-4000:]


def test_sigterm_to_the_launcher_checkpoints_and_exits_0(preempted):
    """Leg 2 of `preempted`: SIGTERM to `pipeline.launch` alone, after a step of its own."""
    run_dir, reached = preempted["run_dir"], preempted["reached2"]
    assert preempted["code2"] == 0, _log(run_dir)
    assert preempted["reached1"] < reached < preempted["reached1"] + 60
    assert preempted["latest2"] == f"step_{reached:09d}"
    text = (run_dir / "leg2.txt").read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-4000:]


# ------------------------------------------------------------------ full disks

@pytest.fixture
def tiny_fs(tmp_path):
    """A real 4 MiB filesystem (tmpfs), unmounted afterwards; skipped where mounting is not
    permitted."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_metrics_append_on_a_full_disk_is_one_line(tiny_fs):
    from pipeline.monitor import Monitor, MonitorError
    m = Monitor(str(tiny_fs), True)
    m.append({"kind": "train", "step": 1})
    _fill(tiny_fs)
    with pytest.raises(MonitorError) as e:
        for step in range(2, 10000):   # the page of the first lines may still have room
            m.append({"kind": "train", "step": step, "pad": "x" * 512})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tiny_fs / 'metrics.jsonl'}: cannot append metrics: "
                                              f"no space left on device (free space seen: ")


def test_checkpoint_on_a_full_disk_exits_4_on_every_rank_and_resumes(data, tiny_fs):
    base, d = data
    run_dir = base / "diskfull"
    ck = tiny_fs / "ck"
    config = _write_config(base / "diskfull.yaml", d, train={"max_steps": 60, "eval_interval": 0},
                           checkpoint={"interval": 1, "keep": 1000, "dir": str(ck)})
    proc = _start(2, config, run_dir, log_name="log")
    assert _finish(proc, run_dir) == 4, _log(run_dir)
    text = (run_dir / "log.txt").read_text()
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert len(lines) == 1 and "Traceback" not in text, text[-4000:]
    from pipeline.checkpoint import find_latest, list_complete
    latest = find_latest(ck)
    n = int(latest.name.removeprefix("step_"))
    assert lines[0].startswith(f"pipeline.train: error: checkpoint {ck / f'step_{n + 1:09d}.partial'}: rank ")
    assert "could not write it: no space left on device (free space seen: " in lines[0]
    assert f"the previous checkpoint step_{n:09d} is intact and stays the latest" in lines[0]
    assert not list(ck.glob("*.partial")) and n >= 1
    assert max(s for k, s in _metrics(run_dir) if k == "train") == n + 1
    # make room (keep the latest only) and resume from it: it loads and trains on
    for step, folder in list_complete(ck)[:-1]:
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    # (the trainer's `main` on 2 forked ranks: the launch above went through the command line)
    r0, r1 = run_train_main(config, run_dir, f"train.max_steps={n + 1}", "checkpoint.interval=0",
                          "optim.override_schedule=true", nproc=2)
    assert (r0.returncode, r1.returncode) == (0, 0), r0.stderr[-3000:] + r1.stderr[-3000:]
    assert f"resumed from {latest}" in r0.stdout + r0.stderr
    assert find_latest(ck).name == f"step_{n + 1:09d}"


# ------------------------------------------------------------------ wandb without network

def test_wandb_init_is_bounded_and_its_failure_says_what_to_do(tmp_path, monkeypatch):
    """Online wandb without network blocks about 110 s by default (measured); the monitor
    passes its own init timeout (unless WANDB_INIT_TIMEOUT is set) and turns the failure into
    one line naming offline mode and `wandb sync`."""
    from types import SimpleNamespace
    import wandb
    from pipeline import monitor
    seen = {}

    def fake_init(**kw):
        seen.update(kw)
        raise wandb.errors.CommError("Failed to get resume status for run x: context deadline "
                                     "exceeded\nmore detail")
    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    m = monitor.Monitor(str(tmp_path), True, SimpleNamespace(mode="online", project="p",
                                                             entity=None, name=None), {})
    with pytest.raises(RuntimeError) as e:
        m.start_wandb(None, 0)
    assert seen["settings"].init_timeout == monitor.INIT_TIMEOUT_S
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("wandb.init failed after ")
    assert "(wandb.mode=online): Failed to get resume status for run x" in msg
    assert msg.endswith(f"use wandb.mode=offline and upload later with "
                        f"`wandb sync {tmp_path}/wandb/offline-run-*`")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")     # the user's own bound wins
    seen.clear()
    with pytest.raises(RuntimeError):
        m.start_wandb(None, 0)
    assert "settings" not in seen


def test_wandb_failure_mid_run_is_one_warning_and_metrics_go_on(tmp_path, caplog):
    from types import SimpleNamespace
    from pipeline.monitor import Monitor, read_metrics

    class DeadRun:
        calls = 0

        def log(self, items, step):
            DeadRun.calls += 1
            raise ConnectionResetError("Connection lost")

        def finish(self, exit_code):
            raise ConnectionResetError("Connection lost")
    m = Monitor(str(tmp_path), True, SimpleNamespace(mode="offline"), {})
    m.run, m.run_id = DeadRun(), "abc"
    with caplog.at_level("WARNING", logger="pipeline.monitor"):
        for step in (1, 2, 3):
            line = {"kind": "train", "step": step, "loss": 1.0 / step}
            m.append(line)
            m.log(line)
        m.finish(0)
    assert DeadRun.calls == 1                      # wandb is off after its first failure
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "ConnectionResetError: Connection lost" in warnings[0].getMessage()
    assert sorted(read_metrics(str(tmp_path / "metrics.jsonl"))) == [("train", 1), ("train", 2),
                                                                      ("train", 3)]
    assert not (tmp_path / "wandb_state.json").exists()   # nothing confirmed: the next leg re-logs


def test_config_error_seen_by_one_rank_only_is_printed_once(data, tmp_path):
    """rank 1's model preset file is missing (a node without the file): its config error
    reaches the user as one line and the launcher exits 2."""
    base, d = data
    (tmp_path / "preset_0.yaml").write_text(json.dumps({}))
    config = _write_config(tmp_path / "cfg.yaml", d)
    proc = _start(2, config, tmp_path / "run",
                  f"model.preset={tmp_path}/preset_${{oc.env:RANK}}.yaml", log_name="log")
    assert _finish(proc, tmp_path / "run", timeout=300) == 2, _log(tmp_path / "run")
    text = (tmp_path / "run" / "log.txt").read_text()
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert lines == [f"pipeline.train: config error: model.preset: file not found: "
                     f"{tmp_path}/preset_1.yaml (rank 1)"], text[-3000:]
    assert "Traceback" not in text, text[-3000:]


# ------------------------------------------------------------------ folders that cannot be written

@pytest.fixture
def mounts(tmp_path):
    """Mount tmpfs filesystems (read-only or not) for a test: real EROFS / ENOSPC from the
    kernel, which chmod cannot give a root test process. Skipped where mounting is not
    permitted; everything mounted is unmounted afterwards."""
    done = []

    def mount(path: Path, *options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=4m",) + options),
                            "tmpfs", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        done.append(path)
        return path
    try:
        yield mount
    finally:
        for p in reversed(done):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_read_only_folders_stop_every_rank_at_start_up_in_one_line(data, tmp_path, mounts):
    """A read-only checkpoint folder (2 ranks) or run folder (1 process): exit 2 before any
    step, one line naming the setting, the folder and the cause, no traceback."""
    base, d = data
    config = _write_config(tmp_path / "ro.yaml", d, train={"max_steps": 4, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 1})
    ck = mounts(tmp_path / "ck", "ro")
    run_dir = tmp_path / "run"
    proc = _start(2, config, run_dir, f"checkpoint.dir={ck}", log_name="log")
    assert _finish(proc, run_dir) == 2, _log(run_dir)
    text = (run_dir / "log.txt").read_text()
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert lines == [f"pipeline.train: error: checkpoint.dir {ck} is not writable on rank 0 (and 1 "
                     f"more rank(s)): read-only file system; set checkpoint.dir to a folder on a "
                     f"writable filesystem, or have this one remounted read-write (checked at "
                     f"start-up, nothing was trained)"], text[-4000:]
    assert "Traceback" not in text and "step 1/" not in text and not _metrics(run_dir)
    # a read-only run folder: the same, before the run lock is taken (the trainer's `main` in
    # one forked process: the 2-rank job above went through the command line)
    ro_run = mounts(tmp_path / "ro_run", "ro")
    r, = run_train_main(config, ro_run)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("pipeline.")]
    assert lines == [f"pipeline.train: error: run_dir {ro_run} is not writable on rank 0: read-only "
                     f"file system; set run_dir to a folder on a writable filesystem, or have this "
                     f"one remounted read-write (checked at start-up, nothing was trained)"], r.stderr
    assert "Traceback" not in r.stderr


def test_checkpoint_folder_turned_read_only_mid_run_names_the_cause(data, tmp_path, mounts):
    """The filesystem goes read-only during the run (as ext4/Lustre do on errors): the save
    fails with exit 4 and a line saying read-only, with no advice to free space."""
    base, d = data
    ck = mounts(tmp_path / "ck")
    config = _write_config(tmp_path / "midro.yaml", d, train={"max_steps": 400, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 1, "dir": str(ck)})
    run_dir = tmp_path / "run"
    proc = _start(1, config, run_dir, log_name="log")
    _wait_step(proc, run_dir, 1)
    r = subprocess.run(["mount", "-o", "remount,ro", str(ck)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    os.killpg(proc.pid, signal.SIGTERM)           # checkpoint now
    assert _finish(proc, run_dir) == 4, _log(run_dir)
    text = (run_dir / "log.txt").read_text()
    n = max(s for k, s in _metrics(run_dir) if k == "train")
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert lines == [f"pipeline.train: error: checkpoint {ck / f'step_{n:09d}.partial'}: rank 0 "
                     f"could not write it: read-only file system; no partial folder was left, no "
                     f"earlier checkpoint exists; set checkpoint.dir to a folder on a writable "
                     f"filesystem, or have this one remounted read-write, then rerun to resume"], \
        text[-4000:]
    assert "Traceback" not in text


def test_write_failure_causes_and_remedies(tmp_path, monkeypatch, mounts):
    """`pipeline.common.diskspace`: each errno gets its own cause and remedy (free space only
    for ENOSPC / EDQUOT); a library error that hides the errno is told apart by the probe
    (torch's "Parent directory ... does not exist" on a read-only folder); the start-up probe
    on a full filesystem and on a folder this user may not write (EACCES injected at the probe:
    chmod does not stop root)."""
    import errno
    import tempfile
    from pipeline.common import diskspace as ds
    p = tmp_path / "ck" / "step_000000001.partial"
    cases = {errno.EROFS: ("read-only file system", "remounted read-write"),
             errno.EACCES: ("permission denied (", "fix the folder's owner or permissions"),
             errno.EPERM: ("permission denied (", "fix the folder's owner or permissions"),
             errno.ENOSPC: ("no space left on device (free space seen: ", "free space on that"),
             errno.EDQUOT: ("disk quota exceeded (free space seen: ", "within your quota")}
    for n, (cause, remedy) in cases.items():
        f = ds.diagnose(OSError(n, os.strerror(n)), p)
        assert f.errno == n and f.cause.startswith(cause) and remedy in f.remedy("checkpoint.dir")
        assert ("free space" in f.cause) == (n in (errno.ENOSPC, errno.EDQUOT)), f.cause
        assert ("free space" in f.remedy("x")) == (n in (errno.ENOSPC, errno.EDQUOT))
        assert f.disk_full == (n in (errno.ENOSPC, errno.EDQUOT))
    assert f"uid {os.geteuid()})" in ds.diagnose(PermissionError(errno.EACCES, "x"), p).cause
    # torch hides the errno: the probe next to the folder tells (a real read-only mount)
    ro = mounts(tmp_path / "ro", "ro")
    hidden = RuntimeError(f"Parent directory {ro}/step_1.partial does not exist.")
    f = ds.diagnose(hidden, ro / "step_1.partial")
    assert (f.errno, f.cause) == (errno.EROFS, "read-only file system")
    f = ds.diagnose(hidden, tmp_path / "writable")                   # the probe writes fine there
    assert f.errno is None and f.cause.startswith(f"RuntimeError: Parent directory {ro}/step_1"
                                                  f".partial does not exist. (free space seen: ")
    # the start-up probe: fine, full, read-only, forbidden
    assert ds.check_writable(tmp_path / "new" / "run", ("metrics.jsonl",)) is None
    assert [q.name for q in (tmp_path / "new" / "run").iterdir()] == ["metrics.jsonl"]
    full = mounts(tmp_path / "full")
    with open(full / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    f = ds.check_writable(full / "checkpoints")
    assert f.errno == errno.ENOSPC and f.disk_full and f.cause.startswith("no space left on device")
    assert ds.check_writable(ro / "checkpoints").errno == errno.EROFS
    real = tempfile.mkstemp

    def forbidden(*a, dir=None, **kw):
        if str(dir).startswith(str(tmp_path / "forbidden")):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*a, dir=dir, **kw)
    monkeypatch.setattr(ds.tempfile, "mkstemp", forbidden)
    f = ds.check_writable(tmp_path / "forbidden")
    assert f.errno == errno.EACCES and not f.disk_full
    assert f.remedy("run_dir") == ("set run_dir to a folder this user may write, or fix the "
                                   "folder's owner or permissions")


def _write_access_on_ranks(rank, world_size, run_dir, ckdir, forbidden_rank):
    """`pipeline.training.startup.check_write_access` on 2 gloo ranks: once as is, then with
    EACCES injected at rank `forbidden_rank`'s probe of the checkpoint folder. Returns both
    outcomes."""
    import errno
    import tempfile
    import torch.distributed as dist
    from pipeline.common import diskspace
    from pipeline.training.startup import check_write_access
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out = []
    for inject in (False, True):
        if inject and rank == forbidden_rank:
            real = tempfile.mkstemp

            def forbidden(*a, dir=None, **kw):
                if str(dir) == ckdir:
                    raise PermissionError(errno.EACCES, "Permission denied")
                return real(*a, dir=dir, **kw)
            diskspace.tempfile.mkstemp = forbidden
        try:
            check_write_access(run_dir, ckdir, rank == 0)
            out.append(None)
        except diskspace.NotWritableError as e:
            out.append((str(e), e.failure.errno))
    return out


def test_every_rank_stops_on_one_rank_s_start_up_write_failure(tmp_path):
    """Rank 1 alone may not write the checkpoint folder (a node with another mount or user):
    both ranks stop with the same line naming rank 1 and the cause."""
    import errno
    from distributed import run_distributed
    ck = str(tmp_path / "ck")
    got = run_distributed(_write_access_on_ranks, 2, (str(tmp_path / "run"), ck, 1), timeout_s=120)
    assert [g[0] for g in got] == [None, None]          # writable everywhere: nothing raised
    assert got[0][1] == got[1][1]                       # the same line on both ranks
    msg, code = got[0][1]
    assert code == errno.EACCES
    assert msg.startswith(f"checkpoint.dir {ck} is not writable on rank 1: permission denied (")
    assert msg.endswith("set checkpoint.dir to a folder this user may write, or fix the folder's "
                        "owner or permissions (checked at start-up, nothing was trained)")


# ------------------------------------------------------------------ a rank that dies

def _trainer_pid(root_pid: int, rank: int) -> int:
    for p in _descendants(root_pid):
        if "pipeline.train" in _cmdline(p):
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return p
    raise AssertionError(f"no trainer of rank {rank} under {root_pid}")


def test_a_killed_rank_is_one_line_per_surviving_rank_and_the_launcher_names_it(data, tmp_path):
    """SIGKILL to rank 1 mid-run (as the OOM killer does): rank 0's collective fails; it prints
    one line naming itself and that a peer is gone (no gloo traceback) and exits 5; the launcher
    reports rank 1's death and exits with its code (128 + 9)."""
    base, d = data
    config = _write_config(tmp_path / "kill.yaml", d, train={"max_steps": 400, "eval_interval": 0},
                           checkpoint={"interval": 0, "keep": 1})
    run_dir = tmp_path / "run"
    proc = _start(2, config, run_dir, log_name="log")
    _wait_step(proc, run_dir, 2)
    victim = _trainer_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    assert _finish(proc, run_dir) == 128 + signal.SIGKILL, _log(run_dir)
    text = (run_dir / "log.txt").read_text()
    lines = [l for l in text.splitlines() if l.startswith("pipeline.")]
    assert len(lines) == 2, text[-4000:]
    assert lines[0].startswith("pipeline.train: rank 0: stopped because another process of this job "
                               "is gone (gloo: ")
    assert lines[0].endswith("); its own output or the launcher's line says why")
    assert lines[1] == (f"pipeline.launch: worker rank 1 (pid {victim}) was killed by SIGKILL; its "
                        f"output is above")
    assert "Traceback" not in text and "[rank0]" not in text, text[-4000:]


def test_launcher_reports_the_rank_that_failed_first_not_its_survivors():
    from types import SimpleNamespace as F
    from pipeline.launch import root_failure
    peer_lost, killed = 5, -signal.SIGKILL
    # same second (torchrun's timestamps are whole seconds): the dead rank, not rank 0
    assert root_failure({0: F(exitcode=peer_lost, timestamp=100),
                         1: F(exitcode=killed, timestamp=100)})[0] == 1
    # the survivor was even seen first: still the dead rank
    assert root_failure({0: F(exitcode=peer_lost, timestamp=99),
                         1: F(exitcode=killed, timestamp=100)})[0] == 1
    # a real error (code 1, its traceback) is a cause too; earliest, then lowest rank
    assert root_failure({0: F(exitcode=1, timestamp=100), 1: F(exitcode=peer_lost, timestamp=99),
                         2: F(exitcode=1, timestamp=100)})[0] == 0
    # torchrun's agent SIGTERMs the others once one worker failed: not the cause either
    assert root_failure({0: F(exitcode=-signal.SIGTERM, timestamp=100),
                         1: F(exitcode=2, timestamp=100)})[0] == 1
    # only survivors' codes: the earliest of them
    assert root_failure({0: F(exitcode=peer_lost, timestamp=101),
                         3: F(exitcode=peer_lost, timestamp=100)})[0] == 3


def test_lost_peer_is_told_from_other_errors():
    from pipeline.training.job import lost_peer as _lost_peer
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                        "Read error [127.0.0.1]:22246: Connection reset by peer. This is typically "
                        "caused by a remote worker hanging or bugs in the application. GLHF!")
    assert _lost_peer(gloo) == "gloo: Read error [127.0.0.1]:22246: Connection reset by peer"
    assert _lost_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert _lost_peer(ValueError("Connection reset by peer")) is None


# ------------------------------------------------------------------ console output

def test_console_output_has_no_import_noise_and_short_floats(lock_runs):
    """A tiny run with validation (`lock_runs`' other job): no third-party import notice, every
    printed number short (losses to 4 decimals), no float printed with 15 or more digits."""
    import re
    r = lock_runs["other"]
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Transformer Engine and Apex" not in out
    import torch   # what changes the numbers besides the config is named at start-up, once
    assert out.count(f"software: torch {torch.__version__} (CPU kernels "
                     f"{torch.backends.cpu.get_cpu_capability()}), deepspeed ") == 1, out
    assert re.search(r"validation at step 1: loss \d+\.\d{4} \| ar \d+\.\d{4} \| mdm \d+\.\d{4} ",
                     out), out
    assert re.search(r"step 2/2 \| loss \d+\.\d{4} \|", out), out
    long_floats = [t for t in re.findall(r"\d+\.\d+", out) if len(t) - 1 >= 15]
    assert not long_floats, long_floats
