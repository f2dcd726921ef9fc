"""slurm/pretrain.sh on a real one-node SLURM cluster: train, checkpoint on the time-limit
signal, requeue, resume from the checkpoint (not from scratch), finish.

The cluster is the project's own (tests/slurm/local_cluster.sh: Debian's Slurm, installed with
apt-get when missing, private config, node name `refusion-node` that is not a host name, so
pretrain.sh must take the master address from `scontrol show node`). The `slurm_cluster`
fixture starts it once for this module and stops it afterwards when it started it and no other
test session uses it. The cluster tests are skipped with one reason when this machine cannot
run it (not root, no apt-get) or when REFUSION_SLURM_TESTS=0, and fail when it should run but
does not.
`sbatch --wait` and exit codes are not trusted (a job step can fail while sbatch reports
success): every check reads the job's log, metrics.jsonl and checkpoint folder.
A requeued job waits for the cluster's cred_expire (10 s) plus one second before it starts
again; a test that rewrites the config for the requeued leg does so within that hold.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shard_fixtures import random_samples, tiny_model_yaml, write_shards

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "slurm" / "local_cluster.sh"
SCRIPT = ROOT / "slurm" / "pretrain.sh"

CONFIG = """\
run_dir: {run}
model:
  inline: """ + tiny_model_yaml() + """
data: {{dir: {data}, num_workers: 1, shuffle_buffer: 8}}
optim: {{lr: 1.0e-3, warmup_steps: 1, override_schedule: true}}   # legs end at another max_steps
train: {{max_steps: {max_steps}, micro_batch_size: 2, precision: fp32, zero_stage: 3,
        tensor_parallel_size: 1, eval_interval: 1, eval_batches: 1}}
checkpoint: {{interval: 0, keep: 2}}
wandb: {{mode: disabled}}
"""
GLOBAL_BATCH = 4  # micro-batch 2 x DP 2
# seconds between two checks of a job's log, metrics.jsonl, squeue or /proc: a leg's steps take
# ~0.2 s each, so a check each second let a leg run several steps past the awaited event
POLL_S = 0.2


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local one-node cluster, with SLURM_CONF pointing at it for this module's commands
    (sbatch exports it to the jobs). Skips when the machine cannot run it (the script's exit
    code 3: not root, no apt-get/dpkg, packages not installable) or REFUSION_SLURM_TESTS=0;
    fails with the script's message when it should start and does not."""
    if os.environ.get("REFUSION_SLURM_TESTS", "1") == "0":
        pytest.skip("REFUSION_SLURM_TESTS=0")
    r = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip((r.stderr.strip().splitlines() or ["local_cluster.sh: exit 3"])[-1])
    if r.returncode != 0:
        pytest.fail(f"{CLUSTER.name} start exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    conf = re.search(r"^export SLURM_CONF=(\S+)$", r.stdout, re.M)
    assert conf, r.stdout
    started = re.search(r"^# started:(.*)$", r.stdout, re.M)
    # a shared lock per test session using the cluster: the session that started it stops it
    # afterwards only when no other session (another checkout's tests) still holds one
    users = open(Path(conf.group(1)).parent.parent / "test-sessions.lock", "a")
    fcntl.flock(users, fcntl.LOCK_SH)
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", conf.group(1))
    try:
        yield conf.group(1)
    finally:
        mp.undo()
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError:
            alone = False
        if alone and started and started.group(1).strip():  # leave the machine as it was
            subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)
        users.close()


def _wait_for(what: str, cond, timeout_s: float, log: Path):
    """Poll `cond()` every `POLL_S`; fail early when the job's tasks exited abnormally or
    pretrain.sh refused to start them."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        value = cond()
        if value:
            return value
        text = log.read_text() if log.exists() else ""
        bad = re.search(r"training tasks exited with status [1-9]|slurm/pretrain.sh: error: .*", text)
        if bad:
            raise AssertionError(f"waiting for {what}: {bad.group(0)}; log:\n{text[-6000:]}")
        time.sleep(POLL_S)
    text = log.read_text() if log.exists() else "(no log)"
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; log:\n{text[-6000:]}")


def _train_lines(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if m.get("kind") == "train":
            out.append(m)
    return out


def _val_steps(metrics: Path) -> list[int]:
    out = []
    for line in metrics.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("kind") == "val":
            out.append(m["step"])
    return out


def _job_state(job: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return r.stdout.strip()


def test_sbatch_signal_checkpoint_requeue_resume(tmp_path, slurm_cluster):
    rng = np.random.default_rng(0)
    data, run, logs = tmp_path / "data", tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    write_shards(str(data), {"train": random_samples(rng, 64, vocab_size=64, max_length=32),
                             "val": random_samples(rng, 4, vocab_size=64, max_length=32)},
                 samples_per_shard=16)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run=run, data=data, max_steps=100000))
    metrics = run / "metrics.jsonl"
    ckdir = run / "checkpoints"

    r = subprocess.run(["sbatch", "--parsable", "--time=00:10:00", "--job-name=refusion-test",
                        f"--output={logs}/%x-%j.out", str(SCRIPT), str(cfg), "train.log_interval=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable})  # no .venv in a worktree
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    log = logs / f"refusion-test-{job}.out"
    try:
        # 1. it trains: wait for a few optimizer steps in metrics.jsonl
        _wait_for("3 training steps", lambda: len(_train_lines(metrics)) >= 3, 240, log)
        # 2. the time-limit warning, as --signal=B:USR1@300 delivers it: SIGUSR1 to the batch shell
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
        _wait_for("the requeue", lambda: "requeueing job" in log.read_text(), 180, log)
        first = _train_lines(metrics)
        saved = int((ckdir / "latest").read_text().strip().removeprefix("step_"))
        assert saved == first[-1]["step"] >= 3          # checkpointed at the step it stopped
        assert (ckdir / f"step_{saved:09d}" / "refusion_meta.json").is_file()
        # the requeued job (held 11 s by cred_expire) re-reads the config: 2 more steps
        assert "(restart 1)" not in log.read_text()   # written before the requeued leg starts
        cfg.write_text(CONFIG.format(run=run, data=data, max_steps=saved + 2))
        _wait_for("the resumed job to finish",
                  lambda: log.read_text().count("training tasks exited with status") >= 2
                  and _job_state(job) == "", 300, log)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)

    text = log.read_text()
    assert "restart 1" in text
    # the node's name (refusion-node) is not a host name: the master is its NodeAddr
    assert "; master 127.0.0.1:" in text
    # srun got the cores explicitly: the 2-core node split over its 2 tasks
    assert "on 1 node(s) x 2 task(s) x 1 core(s)" in text
    assert text.count("training tasks exited with status 0") == 2
    assert re.search(rf"resumed from \S+step_{saved:09d} at step {saved}\b", text), text[-3000:]
    lines = _train_lines(metrics)
    assert [m["step"] for m in lines] == list(range(1, saved + 3))  # no step trained twice
    resumed = lines[saved:]
    # continues the consumed-sample count rather than starting from scratch
    assert [m["consumed_samples"] for m in resumed] == [(saved + 1) * GLOBAL_BATCH,
                                                         (saved + 2) * GLOBAL_BATCH]
    assert (ckdir / "latest").read_text().strip() == f"step_{saved + 2:09d}"
    # validation after every step (eval_interval=1): the one due at the step that met the stop
    # signal was deferred (the margin goes to the checkpoint) and is the resumed job's first line
    assert _val_steps(metrics) == list(range(1, saved + 3))
    kinds = [(m["kind"], m["step"]) for m in map(json.loads, metrics.read_text().splitlines())]
    assert kinds.index(("val", saved)) == kinds.index(("train", saved + 1)) - 1
    assert "running the validation at step %d that the stop signal deferred" % saved in text


@pytest.mark.parametrize("args,env,message", [
    ([], {}, "not inside a Slurm job"),
    ([], {"SLURM_JOB_ID": "1"}, "missing the run config"),
    (["no/such.yaml"], {"SLURM_JOB_ID": "1"}, "config file not found: no/such.yaml"),
])
def test_pretrain_sh_usage_errors(args, env, message):
    import sys
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base["PYTHON"] = sys.executable   # the check order does not depend on a .venv in this tree
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**base, **env},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("slurm/pretrain.sh: error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_signal_margin_default_covers_a_save():
    """The template's SIGNAL_MARGIN (--signal=B:USR1@N) is at least 300 s."""
    lines = [ln for ln in SCRIPT.read_text().splitlines() if ln.startswith("#SBATCH --signal=")]
    assert len(lines) == 1
    m = re.fullmatch(r"#SBATCH --signal=B:USR1@(\d+)", lines[0].strip())
    assert m and int(m.group(1)) >= 300, lines


@pytest.mark.parametrize("step,interval,pending,expected", [
    (4, 2, False, True), (4, 2, True, False),   # due, but a stop signal is pending: skipped
    (3, 2, False, False), (3, 2, True, False), (5, 0, False, False), (1, 1, False, True),
])
def test_should_evaluate_skips_when_a_stop_signal_is_pending(step, interval, pending, expected):
    from pipeline.train import should_evaluate
    assert should_evaluate(step, interval, pending) is expected


FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$SRUN_ARGS_FILE"
"""


@pytest.mark.parametrize("env,cores,warns", [
    ({"SLURM_CPUS_ON_NODE": "2"}, 1, False),                        # the 2-core test node
    ({"SLURM_CPUS_ON_NODE": "96", "SLURM_GPUS_ON_NODE": "8"}, 12, False),  # --exclusive GPU node
    ({"SLURM_CPUS_ON_NODE": "96", "SLURM_CPUS_PER_TASK": "10"}, 10, False),  # sbatch --cpus-per-task
    ({"SLURM_CPUS_ON_NODE": "8", "SLURM_GPUS_ON_NODE": "8"}, 1, True),  # 1 core per GPU task
    ({"SLURM_CPUS_ON_NODE": "96", "CPUS_PER_TASK": "6"}, 6, False),  # explicit knob wins
])
def test_srun_gets_cpus_per_task(tmp_path, env, cores, warns):
    """pretrain.sh passes --cpus-per-task to srun (Slurm >= 22.05 does not inherit it), derived
    from the allocation; a GPU job with < 8 cores per task gets a warning line. `srun` and
    `scontrol` are replaced by scripts that record their arguments (no cluster needed)."""
    import sys
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", "#!/usr/bin/env bash\necho node0\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    args_file = tmp_path / "srun_args"
    tpn = "8" if "SLURM_GPUS_ON_NODE" in env or env.get("SLURM_CPUS_ON_NODE") == "96" else "2"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("CPUS_PER_TASK", "OMP_NUM_THREADS")}
    run_env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_ARGS_FILE": str(args_file),
               "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": tpn,
               "SLURM_JOB_NODELIST": "node0", "PYTHON": sys.executable, **env}
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_dir: x\n")
    r = subprocess.run(["bash", str(SCRIPT), str(cfg)], cwd=ROOT, env=run_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    srun_args = args_file.read_text().splitlines()
    assert f"--cpus-per-task={cores}" in srun_args, srun_args
    assert f"--ntasks-per-node={tpn}" in srun_args
    assert ("core(s) per GPU task" in r.stdout) is warns, r.stdout


@pytest.mark.parametrize("overrides,code,verdict", [
    (["train.gpu_memory_gib=80"], 0, "fits in 80.0 GiB"),
    (["train.gpu_memory_gib=80", "train.activation_checkpointing=none",
      "train.micro_batch_size=8"], 1, "does NOT fit"),
])
def test_dry_run_prints_the_memory_plan_of_the_jobs_layout(tmp_path, overrides, code, verdict):
    """REFUSION_DRY_RUN=1: the plan for the allocation's task count (4 nodes x 8 tasks of
    configs/qwen3_8b.yaml, TP 2: DP 16) with the command line's overrides, the plan's exit code
    (0 fits, 1 does not), and no training task started (`srun` records any call; no cluster)."""
    import sys
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", "#!/usr/bin/env bash\necho node0\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    args_file = tmp_path / "srun_args"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run_env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_ARGS_FILE": str(args_file),
               "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "8",
               "SLURM_JOB_NODELIST": "node[0-3]", "PYTHON": sys.executable, "REFUSION_DRY_RUN": "1"}
    r = subprocess.run(["bash", str(SCRIPT), "configs/qwen3_8b.yaml", *overrides], cwd=ROOT,
                       env=run_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == code, r.stdout + r.stderr
    assert r.stdout.startswith("memory plan per GPU (TP 2 x DP 16, ZeRO-3"), r.stdout
    assert verdict in r.stdout and not args_file.exists()
    if code == 1:  # the override reached the plan
        assert "micro-batch 8 x 4096 tokens, recompute none" in r.stdout


def test_sbatch_wandb_offline_scontrol_requeue_keeps_checkpoint_and_history(tmp_path, slurm_cluster):
    """`scontrol requeue` (as preemption does: SIGTERM to every process of the job, wandb's
    service included) with wandb offline: the leg checkpoints at the step it reached and exits
    0, the requeued job (same SLURM job id: it takes over its own run lock) resumes, and the
    one wandb run id holds every step's loss equal to metrics.jsonl (read by `wandb leet
    inspect`)."""
    from test_train import _wandb_history
    rng = np.random.default_rng(1)
    data, run, logs = tmp_path / "data", tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    write_shards(str(data), {"train": random_samples(rng, 64, vocab_size=64, max_length=32)},
                 samples_per_shard=16)
    cfg = tmp_path / "run.yaml"
    config = CONFIG.replace("wandb: {{mode: disabled}}", "wandb: {{mode: offline}}").replace(
        "eval_interval: 1", "eval_interval: 0")  # this data has no validation split
    cfg.write_text(config.format(run=run, data=data, max_steps=100000))
    metrics, ckdir = run / "metrics.jsonl", run / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env["PYTHON"] = sys.executable
    r = subprocess.run(["sbatch", "--parsable", "--time=00:10:00", "--job-name=refusion-wandb",
                        f"--output={logs}/%x-%j.out", str(SCRIPT), str(cfg), "train.log_interval=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    log = logs / f"refusion-wandb-{job}.out"
    try:
        _wait_for("3 training steps", lambda: len(_train_lines(metrics)) >= 3, 240, log)
        assert list((run / "wandb").glob("offline-run-*"))
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        _wait_for("the first leg to end", lambda: "training tasks exited with status" in
                  log.read_text(), 180, log)
        saved = int((ckdir / "latest").read_text().strip().removeprefix("step_"))
        assert saved == _train_lines(metrics)[-1]["step"] >= 3   # checkpointed where it stopped
        assert "(restart 1)" not in log.read_text()   # written before the requeued leg starts
        cfg.write_text(config.format(run=run, data=data, max_steps=saved + 2))
        _wait_for("the requeued job to finish",
                  lambda: log.read_text().count("training tasks exited with status") >= 2
                  and _job_state(job) == "", 300, log)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log.read_text()
    assert text.count("training tasks exited with status 0") == 2, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    assert re.search(rf"resumed from \S+step_{saved:09d} at step {saved}\b", text), text[-3000:]
    lines = {m["step"]: m for m in _train_lines(metrics)}
    assert sorted(lines) == list(range(1, saved + 3))
    ids, hist = _wandb_history(run)
    assert len(ids) == 2 and len(set(ids)) == 1, ids
    for step in range(1, saved + 3):
        assert hist[step]["train/loss"] == lines[step]["loss"], step


FAKE_SCONTROL = """#!/usr/bin/env bash
# `scontrol show hostnames LIST` and `scontrol -o show node NAME` of a cluster whose node names
# are not host names (NodeAddr and NodeHostName differ from NodeName)
echo "$*" >> "$SCONTROL_LOG"
case "$*" in
  "show hostnames gpu-a[01-02]") printf 'gpu-a01\\ngpu-a02\\n' ;;
  "-o show node gpu-a01")
    [ -n "${NO_NODEADDR:-}" ] && exit 1
    echo "NodeName=gpu-a01 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 CPUTot=96 NodeAddr=10.7.0.11 NodeHostName=a01-ib0 Version=22.05.8 State=IDLE" ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.parametrize("env,expected,asks_node", [
    ({}, "10.7.0.11", True),                        # NodeAddr of the first node, not its name
    ({"NO_NODEADDR": "1"}, "gpu-a01", True),        # scontrol knows no address: the node name
    ({"MASTER_ADDR": "10.9.9.9"}, "10.9.9.9", False),  # the user's choice is kept
])
def test_master_addr_is_the_first_nodes_nodeaddr(tmp_path, env, expected, asks_node):
    """pretrain.sh exports MASTER_ADDR = NodeAddr of the allocation's first node (from
    `scontrol show node`), else its name; `srun` and `scontrol` are fakes (no cluster needed)."""
    import sys
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = '#!/usr/bin/env bash\necho "$MASTER_ADDR" > "$SRUN_ARGS_FILE"\n'
    for name, body in (("srun", srun), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    out, log = tmp_path / "master_addr", tmp_path / "scontrol.log"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
    run_env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_ARGS_FILE": str(out),
               "SCONTROL_LOG": str(log), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2",
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2",
               "SLURM_JOB_NODELIST": "gpu-a[01-02]", "PYTHON": sys.executable, **env}
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_dir: x\n")
    r = subprocess.run(["bash", str(SCRIPT), str(cfg)], cwd=ROOT, env=run_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_text().strip() == expected
    assert f"master {expected}:20007" in r.stdout
    asked = log.read_text().splitlines() if log.exists() else []
    assert ("-o show node gpu-a01" in asked) is asks_node, asked


SHARD_SH = ROOT / "slurm" / "shard.sh"


def _wait_log(log_glob, tmp_path: Path, pattern: str, timeout_s: float = 180) -> str:
    """The text of the one log matching `log_glob` once it matches `pattern` (regex)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        logs = sorted(tmp_path.glob(log_glob))
        text = logs[-1].read_text() if logs else ""
        if re.search(pattern, text):
            return text
        time.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {pattern!r} in {log_glob}: {text[-3000:]}")


def test_shard_array_and_merge_on_the_cluster(tmp_path, slurm_cluster):
    """slurm/shard.sh submit: the plan job, a 2-task array, the merge after it (afterany). With
    task 1 failing (its interpreter exits 1) the merge still runs, checks the parts itself and
    fails naming a unit with no part; the array submitted again (complete parts kept) and the
    merge give the one-process run's dataset."""
    from data_prep import cli
    from test_data_prep_array import COMMON, UNIT, _corpus_and_tokenizer, _dataset
    corpus, tok = _corpus_and_tokenizer(tmp_path)
    one = tmp_path / "one"
    assert cli.main(["--input", str(corpus), "--output", str(one), "--tokenizer", str(tok),
                       *COMMON, "--no-progress"]) == 0
    flaky = tmp_path / "python.sh"  # task 1 of the first array fails before doing anything
    flaky.write_text(f'#!/bin/sh\n[ "${{SLURM_ARRAY_TASK_ID:-}}" = 1 ] && [ -e {tmp_path}/fail ] '
                     f'&& exit 1\nexec {sys.executable} "$@"\n')
    flaky.chmod(0o755)
    (tmp_path / "fail").write_text("")
    env = {**os.environ, "PYTHON": str(flaky), "PYTHONPATH": str(ROOT),
           "REFUSION_ROOT": str(ROOT)}
    r = subprocess.run(["bash", str(SHARD_SH), "submit", "2", "--", "--input", str(corpus),
                        "--output", "out", "--tokenizer", str(tok), "--unit-bytes", UNIT, *COMMON],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and re.match(r"plan \d+ array \d+ merge \d+", r.stdout), r.stderr
    text = _wait_log("logs/refusion-shard-merge-*.out", tmp_path, r"merge exited with status \d+")
    assert "merge exited with status 2" in text and "has no complete part (not run)" in text
    assert "--unit " in text and "--overwrite`" in text
    assert "run exited with status 0" in (tmp_path / "logs").joinpath(
        sorted(p.name for p in (tmp_path / "logs").glob("refusion-shard-run-*_0.out"))[0]).read_text()
    (tmp_path / "fail").unlink()
    array = subprocess.run(["sbatch", "--parsable", "--job-name=again", "--array=0-1",
                            "--output=logs/again-%A_%a.out", str(SHARD_SH), "run", "out"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert array.returncode == 0, array.stderr
    merge = subprocess.run(["sbatch", "--parsable", f"--dependency=afterany:{array.stdout.strip()}",
                            "--output=logs/again-merge-%j.out", str(SHARD_SH), "merge", "out"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert merge.returncode == 0, merge.stderr
    text = _wait_log("logs/again-merge-*.out", tmp_path, r"merge exited with status \d+")
    assert "merge exited with status 0" in text and "merged 12 part(s)" in text
    assert _dataset(tmp_path / "out") == _dataset(one)

def _task_pid(job: str, rank: int, cfg: Path) -> int | None:
    """The pid of training task `rank` of Slurm job `job` (its environment says so)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
            if b"pipeline.train" not in cmd or str(cfg).encode() not in cmd:
                continue
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"RANK={rank}".encode() in env:
            try:   # the trainer, not one of its loader workers (same command line)
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if b"pipeline.train" in Path(f"/proc/{ppid}/cmdline").read_bytes():
                    continue
            except (OSError, ValueError, IndexError):
                continue
            return int(p.name)
    return None


HANG_CONFIG = CONFIG.replace("eval_interval: 1, eval_batches: 1}", "eval_interval: 0,\n"
                             "        hang_timeout_s: 4, hang_warmup_s: 60}").replace(
    "checkpoint: {{interval: 0, keep: 2}}", "checkpoint: {{interval: 3, keep: 3}}")


def _hang_job(tmp_path: Path, name: str, max_steps: int, max_requeues: int, stops: int,
              sig: int = signal.SIGSTOP):
    """Submit pretrain.sh with `REFUSION_MAX_REQUEUES=max_requeues`, send rank 1 `sig` (SIGSTOP:
    a hung rank; SIGKILL: a dead one) `stops` times (once per leg, after a checkpoint), wait for
    the job to leave the queue. Returns (job id, log text, metrics.jsonl path, checkpoint
    folder)."""
    rng = np.random.default_rng(2)
    data, run, logs = tmp_path / "data", tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    write_shards(str(data), {"train": random_samples(rng, 64, vocab_size=64, max_length=32)},
                 samples_per_shard=16)
    cfg = tmp_path / "run.yaml"
    assert "hang_timeout_s: 4" in HANG_CONFIG and "interval: 3" in HANG_CONFIG
    cfg.write_text(HANG_CONFIG.format(run=run, data=data, max_steps=max_steps))
    metrics = run / "metrics.jsonl"
    import sys
    env = dict(os.environ, REFUSION_MAX_REQUEUES=str(max_requeues),
               REFUSION_STATE_DIR=str(tmp_path / "state"), PYTHON=sys.executable)
    r = subprocess.run(["sbatch", "--parsable", "--time=00:15:00", f"--job-name={name}",
                        f"--output={logs}/%x-%j.out", str(SCRIPT), str(cfg)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    log = logs / f"{name}-{job}.out"
    try:
        for leg in range(stops):
            # this leg trained past a checkpoint (step 3 + 3 legs' worth), and two steps more:
            # rank 1 is then back in a step's phases (4 s allowance: hang_timeout_s), not in the
            # save's longer one, which a stop found by the 10 s heartbeat rule instead
            def this_leg() -> str:
                text = log.read_text() if log.exists() else ""
                marker = f"(restart {leg})"
                return text.split(marker, 1)[1] if marker in text else ""

            def past_a_checkpoint() -> bool:
                text = this_leg()
                i = text.rfind("checkpoint step ")
                return (i >= 0 and text[i:].count(" INFO step ") >= 2
                        and "training tasks exited" not in text)
            _poll(f"leg {leg + 1} past a checkpoint", past_a_checkpoint, 300, log)
            pid = _poll("rank 1's task", lambda: _task_pid(job, 1, cfg), 60, log)
            os.kill(pid, sig)
            _poll(f"leg {leg + 1} to end", lambda: "training tasks exited with status"
                      in this_leg(), 180, log)
        # every leg's end is logged: the faulted legs, plus the leg after the last requeue
        # (squeue can miss a job between a leg's end and its requeue, so the state alone races)
        legs = min(stops, max_requeues) + 1
        _poll("the job to leave the queue", lambda: _job_state(job) == "" and
                  log.read_text().count("training tasks exited with status") >= legs, 400, log)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    return job, log.read_text(), metrics, run / "checkpoints"


def _poll(what: str, cond, timeout_s: float, log: Path):
    """Poll `cond()` every `POLL_S` (a failed leg is expected here, unlike `_wait_for`)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        value = cond()
        if value:
            return value
        time.sleep(POLL_S)
    text = log.read_text() if log.exists() else "(no log)"
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; log:\n"
                         f"{text[-6000:]}")


def _hang_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ": hang: " in ln]


def _assert_requeued_once_and_finished(job_text: str, fault_rc: int, cause: str, metrics: Path,
                                       ckdir: Path, steps: int) -> None:
    """One leg ended with `fault_rc`, one requeue line naming `cause`, the requeued job resumed
    from a checkpoint and ended with 0; the last record of every step is there once, and a step
    trained in both legs has the same loss in both."""
    text = job_text
    assert text.count(f"training tasks exited with status {fault_rc}") == 1, text[-6000:]
    assert text.count("training tasks exited with status 0") == 1, text[-6000:]
    requeues = [ln for ln in text.splitlines() if "requeue 1/3 of job" in ln]
    assert len(requeues) == 1 and cause in requeues[0], text[-6000:]
    assert re.search(r"resumed from \S+step_(\d{9}) at step \d+", text), text[-3000:]
    lines = _train_lines(metrics)
    first = {}
    for m in lines:                         # steps re-run after the resume: same loss
        if m["step"] in first:
            assert m["loss"] == first[m["step"]], m["step"]
        first.setdefault(m["step"], m["loss"])
    assert sorted(first) == list(range(1, steps + 1))
    assert (ckdir / "latest").read_text().strip() == f"step_{steps:09d}"
    last = {m["step"]: m for m in lines}
    assert [last[s]["consumed_samples"] for s in range(1, steps + 1)] == [
        GLOBAL_BATCH * s for s in range(1, steps + 1)]


def test_sbatch_hung_rank_requeues_and_finishes_every_step(tmp_path, slurm_cluster):
    """A stopped rank (SIGSTOP) in the first leg: exit 6, one requeue line with the cause; the
    requeued job resumes from the latest checkpoint and finishes every step exactly once."""
    steps = 14
    job, text, metrics, ckdir = _hang_job(tmp_path, "refusion-hang", steps, 3, stops=1)
    _assert_requeued_once_and_finished(text, 6, "a rank hung (exit 6", metrics, ckdir, steps)
    hang = _hang_lines(text)
    assert hang and all(": hang: rank 1 (host " in ln for ln in hang), hang


def test_sbatch_killed_rank_requeues_and_finishes_every_step(tmp_path, slurm_cluster):
    """A dead rank (SIGKILL of rank 1) in the first leg: srun reports the killed task's status
    137 (not the survivor's code), pretrain.sh requeues once with that cause, the requeued job
    resumes and finishes every step exactly once. The survivor, rank 0, says at most one line:
    it exits 5 when gloo reports the lost peer first, 6 when its watchdog finds rank 1's
    heartbeat gone first (srun's teardown may also kill it before either)."""
    steps = 14
    job, text, metrics, ckdir = _hang_job(tmp_path, "refusion-kill", steps, 3, stops=1,
                                          sig=signal.SIGKILL)
    _assert_requeued_once_and_finished(text, 137, "a rank's process was killed by signal 9 "
                                       "(status 137", metrics, ckdir, steps)
    assert "task 1: Killed" in text, text[-6000:]
    said = [ln for ln in text.splitlines() if ln.startswith("pipeline.train: rank 0: ")]
    assert len(said) <= 1 and all(
        "stopped because another process of this job is gone" in ln
        or ": hang: rank 1 (host " in ln for ln in said), said
    assert "Traceback" not in text, text[-6000:]


def test_sbatch_stops_after_max_requeues_with_one_line(tmp_path, slurm_cluster):
    """REFUSION_MAX_REQUEUES=1: the first hang requeues, the second ends the job with one line."""
    job, text, metrics, ckdir = _hang_job(tmp_path, "refusion-hang-max", 10 ** 5, 1, stops=2)
    assert text.count("training tasks exited with status 6") == 2, text[-6000:]
    assert len([ln for ln in text.splitlines() if "requeue 1/1 of job" in ln]) == 1
    stop = [ln for ln in text.splitlines() if "not requeueing job" in ln]
    assert len(stop) == 1, text[-6000:]
    assert stop[0].endswith(f"not requeueing job {job}: a rank hung (exit 6: the trainer's hang "
                            f"line above names it; report in <run_dir>/hang.json), after 1 fault "
                            f"requeue(s) (REFUSION_MAX_REQUEUES=1); look at the cause, then "
                            f"resubmit"), stop
