"""The training job end to end, through its real entry point (`torchrun -m pipeline.train`), on a
two-source data mixture (`mixture_data`). The uninterrupted reference run is `main` on ranks
forked with the imports done (`_train_forked`); the runs compared with it are real launches.

What is compared against what:
- TP=2 x DP=2 ZeRO-3 (4 processes) against a single process on the same global batches: per-step
  losses, grad norms and validation losses within 1e-5, final fp32 weights (consolidated to Hugging
  Face names) within 1e-5. The single process (2 loader workers) is stopped twice by a signal sent
  to its whole process group, loader workers included (SIGTERM as SLURM preemption/scancel sends
  it, then SIGINT as Ctrl-C does): each time it exits 0 with a checkpoint at the step it stopped,
  and the restarts resume to the same numbers. Same global batches: micro-batch 1 row, global batch 4 rows. The 4-process
  run has 2 loader streams (one per DP rank, `data.num_workers=0`); the single process reads the
  same 2 streams with `data.num_workers=2` (pipeline.data: stream g owns the same contiguous sample
  range and shuffle seed either way), so each step sees the same 4 rows, and with one row per
  micro-batch the step loss (mean of micro-batch losses) is the same quantity: the single process
  accumulates GA=4 micro-batches, the 4-process run GA=2 on each of 2 DP ranks.
- An interrupted run (SIGTERM to one worker at a random step -> exit 0 after a checkpoint; then
  kill -9 of every process at a later random step; then the same command again) against the
  uninterrupted 4-process run: every step's losses equal exactly, final weights bitwise equal.
- A stop signal during the final step, where a validation is due (in-process Trainer, the
  signal flagged as its handler does): the validation is deferred to the resumed run, which
  records the value the final weights give and re-saves, so a third run has nothing to do.
- wandb offline files, read back with wandb's own reader (`wandb leet inspect --json`): the
  logged losses equal metrics.jsonl; the resumed run continues the same wandb run id.
- NaN: injected on rank 0 only (debug.nan_at_steps); "skip" must drop the update on every rank
  (weights after the step == weights before), "stop" exits non-zero naming step and batch keys
  without writing a checkpoint for that step.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shard_fixtures import TINY_MODEL, write_train_val

ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(TINY_MODEL, init_std=0.1)
MAX_STEPS = 8


def _env() -> dict:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   str(ROOT / ".cache" / "torch_extensions")),
               PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE"):
        env.pop(k, None)
    return env


def _write_config(path: Path, data_dir: Path, **sections) -> Path:
    cfg = {
        "model": {"inline": dict(MODEL)},
        "data": {"dir": str(data_dir), "num_workers": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.01},
        "train": {"max_steps": MAX_STEPS, "micro_batch_size": 1, "global_batch_size": 4,
                  "precision": "fp32", "seed": 7, "eval_interval": 4, "eval_batches": 0},
        "checkpoint": {"interval": 3, "keep": 2},
        "wandb": {"mode": "disabled"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _launch(nproc: int, config: Path, run_dir: Path, *overrides: str, log_name: str = "log",
            new_session: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "pipeline.train", "--config", str(config),
           f"run_dir={run_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "pipeline.train", "--config", str(config),
               f"run_dir={run_dir}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / f"{log_name}.txt", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=new_session)


def _train_forked(nproc: int, config: Path, run_dir: Path, *overrides: str,
                  log_name: str = "log") -> list[int]:
    """`pipeline.train`'s `main` on `nproc` ranks forked from the test's preloaded forkserver
    (`distributed.run_train_main`), not a `torchrun` / `python -m` launch: for runs that only
    make the checkpoints or metrics another run is compared with (the entry point's own
    behaviour is tested through `_launch`). Returns each rank's exit code; the ranks' output is
    appended to `run_dir/<log_name>.txt`."""
    from distributed import run_train_main
    run_dir.mkdir(parents=True, exist_ok=True)
    res = run_train_main(config, run_dir, *overrides, nproc=nproc)
    with open(run_dir / f"{log_name}.txt", "a") as f:
        f.write("".join(r.stdout + r.stderr for r in res))
    return [r.returncode for r in res]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill_tree(proc: subprocess.Popen) -> None:
    pids = _children(proc.pid)
    for p in [proc.pid, *pids]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def _finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 400) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise AssertionError(f"run timed out; log:\n{_log(run_dir)}")


def _log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(run_dir.glob("*.txt")))


def _metrics(run_dir: Path) -> dict[tuple[str, int], dict]:
    """Last line per (kind, step): a resumed run re-logs the steps after its checkpoint."""
    out = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            out[(m["kind"], m["step"])] = m
    return out


def _wait_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout:
        done = [s for k, s in _metrics(run_dir) if k == "train"]
        if done and max(done) >= step:
            return max(done)
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before step {step}:\n"
                                 f"{_log(run_dir)}")
        time.sleep(0.05)
    _kill_tree(proc)
    raise AssertionError(f"step {step} not reached in {timeout} s:\n{_log(run_dir)}")


def _hf_weights(ckpt_root: Path) -> dict[str, torch.Tensor]:
    """Final fp32 weights under Hugging Face names (independent of the TP layout)."""
    from pipeline.model import hf as hf_io
    from pipeline.checkpoint import consolidate_tp_ranks
    from pipeline.model import ModelConfig
    shards, info = consolidate_tp_ranks(ckpt_root)
    merged = hf_io.merge_tp_state_dicts(shards, ModelConfig.from_dict(dict(MODEL)))
    return {k: v.detach() for k, v in merged.items()}


def _wandb_history(run_dir: Path) -> tuple[list[str], dict[int, dict]]:
    """(run ids of the offline runs, {step: merged history items}) via `wandb leet inspect`."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    ids, hist = [], {}
    for r in runs:
        ids.append(r.name.rsplit("-", 1)[-1])
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                              "--json", str(r)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            if rec.get("type") == "history":
                item = rec["history"]["item"]
                hist.setdefault(int(item["_step"]), {}).update(item)
    return ids, hist


def mixture_data(base: Path) -> dict:
    """A two-source mixture (`data.sources`, weights 2:1) of small shard folders under `base`:
    the data of the trainer's resume, parallel and elastic tests (issue 42: every loader
    guarantee holds with a mixture)."""
    write_train_val(base / "web", 32, 5, samples_per_shard=12, seed=0)
    write_train_val(base / "math", 16, 3, samples_per_shard=6, seed=1)
    return {"dir": None, "sources": [{"name": "web", "dir": str(base / "web"), "weight": 2},
                                     {"name": "math", "dir": str(base / "math"), "weight": 1}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    config = _write_config(base / "run.yaml", base, data=mixture_data(base))
    return base, config


@pytest.fixture(scope="module")
def reference(setup):
    """The uninterrupted TP=2 x DP=2 ZeRO-3 run (wandb offline): `main` on 4 forked ranks (the
    runs compared with it go through the entry point)."""
    base, config = setup
    run_dir = base / "ref4"
    codes = _train_forked(4, config, run_dir, "train.tensor_parallel_size=2", "wandb.mode=offline")
    assert codes == [0] * 4, _log(run_dir)
    return run_dir


def test_tp2_dp2_matches_single_process(setup, reference):
    from pipeline.checkpoint import find_latest
    base, config = setup
    run_dir = base / "single"
    args = ("train.tensor_parallel_size=1", "data.num_workers=2")
    # SIGTERM, then SIGINT, to the whole process group (trainer + loader workers) mid-run
    stopped = 0
    for i, (sig, after) in enumerate(((signal.SIGTERM, 2), (signal.SIGINT, 5))):
        proc = _launch(1, config, run_dir, *args, log_name=f"log{i}", new_session=True)
        _wait_step(proc, run_dir, max(after, stopped + 1))
        os.killpg(proc.pid, sig)
        assert _finish(proc, run_dir) == 0, (sig, _log(run_dir))
        stopped = max(s for k, s in _metrics(run_dir) if k == "train")
        assert stopped < MAX_STEPS, sig
        assert find_latest(run_dir / "checkpoints").name == f"step_{stopped:09d}", sig
        text = (run_dir / f"log{i}.txt").read_text()
        assert f"signal received ({sig.name}): checkpointing at step {stopped}" in text
        assert "Traceback" not in text and "killed by signal" not in text, text[-3000:]
    proc = _launch(1, config, run_dir, *args, log_name="log2")
    assert _finish(proc, run_dir) == 0, _log(run_dir)
    assert f"resumed from {run_dir / 'checkpoints'}" in (run_dir / "log2.txt").read_text()
    # the same command once more: nothing to do, said in one line; nothing trained or saved
    lines = (run_dir / "metrics.jsonl").read_text()
    proc = _launch(1, config, run_dir, *args, log_name="log3")
    assert _finish(proc, run_dir) == 0, _log(run_dir)
    assert (f"already at train.max_steps={MAX_STEPS} (checkpoint step {MAX_STEPS}); nothing to do"
            in (run_dir / "log3.txt").read_text())
    assert (run_dir / "metrics.jsonl").read_text() == lines
    ref, one = _metrics(reference), _metrics(run_dir)
    assert sorted(ref) == sorted(one)
    assert len([k for k in ref if k[0] == "train"]) == MAX_STEPS
    assert len([k for k in ref if k[0] == "val"]) == MAX_STEPS // 4
    for key in sorted(ref):
        a, b = ref[key], one[key]
        for f in ("loss", "ar_loss", "mdm_loss", "val_loss", "grad_norm"):
            if f in a:
                assert abs(a[f] - b[f]) <= 1e-5 * max(1.0, abs(b[f])), (key, f, a[f], b[f])
        if key[0] == "train":
            assert a["consumed_samples"] == b["consumed_samples"] == 4 * key[1]
            assert a["consumed_tokens"] == b["consumed_tokens"]
            assert a["lr"] == b["lr"]
            # the two sources' tokens add up to the step's tokens
            before = ref[("train", key[1] - 1)]["consumed_tokens"] if key[1] > 1 else 0
            assert a["tokens_by_source"] == b["tokens_by_source"]
            assert sorted(a["tokens_by_source"]) == ["math", "web"]
            assert sum(a["tokens_by_source"].values()) == a["consumed_tokens"] - before
            assert a["target_share_by_source"] == pytest.approx({"web": 2 / 3, "math": 1 / 3})
            assert a["data_phase"] == 0
        for name in ("web", "math"):   # null for a source without a labelled token in the step
            x, y = a["loss_by_source"][name], b["loss_by_source"][name]
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-5 * y), (key, name)
    tokens = {n: sum(ref[("train", s)]["tokens_by_source"][n] for s in range(1, MAX_STEPS + 1))
              for n in ("web", "math")}
    assert abs(tokens["web"] / sum(tokens.values()) - 2 / 3) < 0.1, tokens   # the shares held
    # the steps really trained (loss moved) and clipping was active at least once
    train = [ref[("train", s)] for s in range(1, MAX_STEPS + 1)]
    assert max(m["grad_norm"] for m in train) > 1.0
    w4, w1 = _hf_weights(reference / "checkpoints"), _hf_weights(run_dir / "checkpoints")
    assert sorted(w4) == sorted(w1)
    from pipeline.model.init import random_hf_tensor
    from pipeline.model import ModelConfig
    mcfg = ModelConfig.from_dict(dict(MODEL))
    moved = 0.0
    for name in w1:
        torch.testing.assert_close(w4[name], w1[name], rtol=0, atol=1e-5, msg=name)
        init = random_hf_tensor(name, tuple(w1[name].shape), mcfg, seed=7)
        moved = max(moved, float((w1[name] - init).abs().max()))
    assert moved > 1e-3  # the weights changed from their (layout-independent) initialization


def test_wandb_offline_has_the_logged_metrics(reference):
    ids, hist = _wandb_history(reference)
    assert len(ids) == 1
    ref = _metrics(reference)
    for step in range(1, MAX_STEPS + 1):
        assert hist[step]["train/loss"] == ref[("train", step)]["loss"]
        assert hist[step]["train/consumed_samples"] == 4 * step
        for k in ("tokens_by_source", "loss_by_source"):   # dicts flattened by pipeline.monitor
            for name, v in ref[("train", step)][k].items():
                if v is not None:
                    assert hist[step][f"train/{k}/{name}"] == v
    assert hist[4]["val_loss"] == ref[("val", 4)]["val_loss"]
    assert hist[4]["loss_by_source/web"] == ref[("val", 4)]["loss_by_source"]["web"]


def test_sigterm_then_kill9_resume_exactly(setup, reference):
    base, config = setup
    run_dir = base / "interrupted"
    args = ("train.tensor_parallel_size=2", "wandb.mode=offline")
    seed = random.SystemRandom().randrange(2 ** 32)
    rnd = random.Random(seed)
    a, b = rnd.randint(1, 3), rnd.randint(5, 6)
    note = f"(random seed {seed}: SIGTERM after step {a}, kill -9 after step {b})"

    # 1) SIGTERM to one worker only: all ranks agree, checkpoint, exit 0.
    proc = _launch(4, config, run_dir, *args, log_name="log1")
    _wait_step(proc, run_dir, a)
    workers = _children(proc.pid)
    assert len(workers) == 4, note
    os.kill(rnd.choice(workers), signal.SIGTERM)
    assert _finish(proc, run_dir) == 0, f"{note}\n{_log(run_dir)}"
    from pipeline.checkpoint import find_latest
    stopped = max(s for k, s in _metrics(run_dir) if k == "train")
    assert stopped < MAX_STEPS, note
    assert find_latest(run_dir / "checkpoints").name == f"step_{stopped:09d}", note

    # 2) the same command: resumes; kill -9 everything at a later step.
    proc = _launch(4, config, run_dir, *args, log_name="log2")
    _wait_step(proc, run_dir, max(b, stopped + 1))
    _kill_tree(proc)

    # 3) the same command again: resumes from the latest good checkpoint and finishes.
    proc = _launch(4, config, run_dir, *args, log_name="log3")
    assert _finish(proc, run_dir) == 0, f"{note}\n{_log(run_dir)}"
    assert "resumed from" in (run_dir / "log3.txt").read_text(), note

    ref, got = _metrics(reference), _metrics(run_dir)
    # A validation due at the step where the SIGTERM stopped the run is deferred (the time
    # before a preemption goes to the checkpoint); the resumed run runs it first: no gap.
    assert sorted(ref) == sorted(got), note
    for key in ref:
        for f in ("loss", "ar_loss", "mdm_loss", "val_loss", "grad_norm", "lr",
                  "consumed_samples", "consumed_tokens"):
            if f in ref[key]:
                assert got[key][f] == ref[key][f], (note, key, f)
    # every line ever written (including steps re-run after the kill) matches the reference
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["kind"] == "train":
            assert m["loss"] == ref[("train", m["step"])]["loss"], (note, m["step"])
    w_ref, w_got = _hf_weights(reference / "checkpoints"), _hf_weights(run_dir / "checkpoints")
    for name in w_ref:
        assert torch.equal(w_ref[name], w_got[name]), (note, name)
    ids, hist = _wandb_history(run_dir)
    assert len(ids) == 3 and len(set(ids)) == 1, (note, ids)  # one wandb run, resumed twice
    assert hist[MAX_STEPS]["train/loss"] == ref[("train", MAX_STEPS)]["loss"]


def _signalled_run(rank, world_size, cfg_path, run_dir, signal_before_step):
    """One process of `pipeline.train.Trainer` on `cfg_path` (TP=1) in `run_dir`; when
    `signal_before_step` is set, a SIGTERM is flagged just before that step (as the handler
    does). Returns (exit code, the val loss of the final weights evaluated right after run())."""
    from pipeline.config import load_config, validate
    from pipeline.train import Trainer
    cfg = load_config(cfg_path, [f"run_dir={run_dir}", "train.tensor_parallel_size=1",
                                 "data.num_workers=2"])
    trainer = Trainer(cfg, validate(cfg, world_size=world_size))
    trainer.setup()
    step = trainer.train_step

    def flagged_step():
        if trainer.step + 1 == signal_before_step:
            trainer.signal_received = signal.SIGTERM
        return step()
    trainer.train_step = flagged_step
    try:
        code = trainer.run()
        return code, trainer.evaluate()["val_loss"]
    finally:
        trainer.run_lock.release()


def test_validation_deferred_by_a_signal_at_the_last_step_runs_on_resume(setup, reference):
    """A stop signal during the final step (a validation due there): the run checkpoints without
    validating; the next run validates at that step (same value as the final weights give),
    saves the step again, and a third run has nothing to do (metrics.jsonl unchanged)."""
    from distributed import run_distributed
    base, config = setup
    run_dir = base / "deferred"
    (code, final_val), = run_distributed(_signalled_run, 1, (str(config), str(run_dir), MAX_STEPS))
    assert code == 0
    got = _metrics(run_dir)
    assert ("train", MAX_STEPS) in got and ("val", MAX_STEPS) not in got
    assert ("val", MAX_STEPS // 2) in got  # the validation before the signal ran as usual
    (code, _), = run_distributed(_signalled_run, 1, (str(config), str(run_dir), 0))
    assert code == 0
    got = _metrics(run_dir)
    assert got[("val", MAX_STEPS)]["val_loss"] == final_val
    ref = _metrics(reference)
    assert sorted(got) == sorted(ref)
    assert abs(got[("val", MAX_STEPS)]["val_loss"] - ref[("val", MAX_STEPS)]["val_loss"]) <= 1e-5
    lines = (run_dir / "metrics.jsonl").read_text()
    assert sum(json.loads(x)["kind"] == "train" for x in lines.splitlines()) == MAX_STEPS
    (code, _), = run_distributed(_signalled_run, 1, (str(config), str(run_dir), 0))
    assert code == 0
    assert (run_dir / "metrics.jsonl").read_text() == lines  # the flag was cleared by the re-save


def test_nan_skip_drops_the_update_on_every_rank(setup):
    """DP=2, bf16, activation checkpointing: NaN on rank 0 only at step 3; rank 1's loss is
    finite, yet no rank applies step 3 (fp32 master weights after step 3 == after step 2)."""
    base, config = setup
    run_dir = base / "nan_skip"
    proc = _launch(2, config, run_dir, "train.nan_policy=skip", "debug.nan_at_steps=[3]",
                   "train.max_steps=4", "checkpoint.interval=1", "checkpoint.keep=10",
                   "train.eval_interval=0", "train.precision=bf16",
                   "train.activation_checkpointing=true")
    assert _finish(proc, run_dir) == 0, _log(run_dir)
    m = _metrics(run_dir)
    assert [m[("train", s)]["skipped"] for s in (1, 2, 3, 4)] == [False, False, True, False]
    assert np.isfinite(m[("train", 4)]["loss"])
    log = _log(run_dir)
    assert "rank 0: non-finite loss at step 3" in log
    assert "rank 1: non-finite loss" not in log
    ck = run_dir / "checkpoints"
    w2, w3, w4 = (_hf_weights(ck / f"step_{s:09d}") for s in (2, 3, 4))
    for name in w2:
        assert torch.equal(w2[name], w3[name]), name
    assert any(not torch.equal(w3[n], w4[n]) for n in w3)
    # (resuming DP=2 checkpoints in one process, a user error: tests/test_train_reshard.py)


def test_hf_init_tp2_then_nan_stop(setup):
    """TP=2 x ZeRO-3 initialized from a Hugging Face folder (each rank copies its slices into
    partitioned parameters): with a negligible lr the checkpointed weights equal the HF tensors.
    Then a NaN at step 3 with nan_policy=stop: non-zero exit, the step and batch keys reported,
    no checkpoint for step 3 (the latest stays step 2)."""
    from safetensors.torch import load_file
    from tiny_qwen3 import make_tiny_qwen3
    base, _ = setup
    shape = {k: MODEL[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim")}
    hf = make_tiny_qwen3(base / "hf", num_hidden_layers=MODEL["num_layers"], **shape)
    config = base / "hf_run.yaml"
    config.write_text(json.dumps({
        "init": {"source": "hf", "hf_path": str(hf)},
        "data": {"dir": str(base / "web"), "num_workers": 0},   # one folder (data.dir)
        "optim": {"lr": 1e-12, "warmup_steps": 0},
        "train": {"max_steps": 4, "micro_batch_size": 1, "global_batch_size": 2,
                  "precision": "fp32", "tensor_parallel_size": 2, "nan_policy": "stop"},
        "debug": {"nan_at_steps": [3]},
        "checkpoint": {"interval": 1}}))
    run_dir = base / "hf_nan_stop"
    proc = _launch(2, config, run_dir)
    rc = _finish(proc, run_dir)
    log = _log(run_dir)
    assert rc != 0, log
    assert "exitcode  : 3" in log, log  # torchrun's report of the workers' exit code
    assert "non-finite loss at step 3, micro-batch 0, batch keys ['train" in log
    assert "stopping (train.nan_policy=stop, no checkpoint written" in log
    from pipeline.checkpoint import find_latest, list_complete
    assert [s for s, _ in list_complete(run_dir / "checkpoints")][-1] == 2
    assert find_latest(run_dir / "checkpoints").name == "step_000000002"
    assert ("train", 3) not in _metrics(run_dir)
    ref = load_file(str(hf / "model.safetensors"))
    got = _hf_weights(run_dir / "checkpoints")
    assert sorted(got) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-9, msg=name)
