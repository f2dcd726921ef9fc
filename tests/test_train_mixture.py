"""A data mixture through `python -m pipeline.train`: the refusals a user meets before any step
(a source that would exceed its `max_epochs`, sources tokenized differently, both or neither of
data.dir / data.sources), a changed mix without a new data phase, and a new phase recorded in
the checkpoint (`data_phases`) and in metrics.jsonl (`data_phase`), with the lr schedule allowed
to change with it."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline.checkpoint.safe_load import load_checkpoint_file
from shard_fixtures import DEFAULT_TOKENIZER, random_samples, write_shards, write_train_val
from test_train import ROOT, _env, _log, _metrics, _train_forked, _write_config


def _train(config, run_dir, *overrides):
    return subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(config),
                           f"run_dir={run_dir}", *overrides], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _one_line_error(r) -> str:
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_mixture")
    write_train_val(base / "web", 24, 3, samples_per_shard=8, seed=1)
    write_train_val(base / "math", 6, 2, samples_per_shard=3, seed=2)   # 6 samples, ~100 tokens
    sources = [{"name": "web", "dir": str(base / "web"), "weight": 1},
               {"name": "math", "dir": str(base / "math"), "weight": 1}]
    config = _write_config(base / "run.yaml", base / "web", data={"dir": None, "sources": sources},
                           train={"max_steps": 3, "global_batch_size": 2, "eval_interval": 0},
                           checkpoint={"interval": 3, "keep": 3})
    return base, config


def test_refusals_before_any_step(mix, tmp_path):
    base, config = mix
    # math: 6 samples; 40 steps x 2 rows x 24 tokens at weight 1/2 need ~5 passes > 2
    m = json.loads((base / "math" / "manifest.json").read_text())
    tokens = sum(e["tokens"] for e in m["splits"]["train"])
    line = _one_line_error(_train(config, tmp_path / "a", "train.max_steps=40",
                                  "data.sources.1.max_epochs=2"))
    assert line == (f"pipeline.train: error: data.sources: source 'math' ({tokens} tokens, weight "
                    f"0.5) would be read up to {40 * 2 * 24 * 0.5 / tokens:.2f} times by step 40, "
                    f"more than its max_epochs 2; lower its weight or train.max_steps, or raise "
                    f"max_epochs")
    assert not _metrics(tmp_path / "a") if (tmp_path / "a" / "metrics.jsonl").exists() else True
    line = _one_line_error(_train(config, tmp_path / "c", f"data.dir={base / 'web'}"))
    assert line.endswith("data: set exactly one of data.dir (one shard folder) and data.sources "
                         "(a mixture); both are set")


def test_config_refusals_through_main(mix, tmp_path, capsys):
    """Refusals of config validation (before any process group, as the `data.dir` + `data.sources`
    one above through the entry point): `pipeline.train.main` in this process."""
    from pipeline.train import main
    base, config = mix

    def one_line_error(run_dir, *overrides) -> str:
        capsys.readouterr()
        assert main(["--config", str(config), f"run_dir={run_dir}", *overrides]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, out
        return out.err.strip()
    # another tokenizer in the second source: refused at validation, naming both sources
    write_shards(str(tmp_path / "other"), {"train": random_samples(np.random.default_rng(0), 5,
                                                                   max_length=24)},
                 tokenizer=dict(DEFAULT_TOKENIZER, hash="other-1"))
    line = one_line_error(tmp_path / "b", f"data.sources.1.dir={tmp_path / 'other'}",
                          "train.eval_interval=0")
    assert "data.sources[1] (math)" in line and "'web'" in line and "'math'" in line
    assert "tokenizer.hash 'fixture-0' vs 'other-1'" in line
    line = one_line_error(tmp_path / "d", "data.max_length=16")
    assert line.endswith(f"data.max_length=16 is shorter than the shards' max_length 24 "
                         f"(data.sources[0] 'web', {base / 'web'})")


def test_a_new_mix_needs_a_new_phase_which_is_recorded(mix):
    base, config = mix
    run = base / "run"
    assert _train_forked(1, config, run) == [0], _log(run)   # makes the phase-0 checkpoint
    line = _one_line_error(_train(config, run, "train.max_steps=5", "data.sources.0.weight=3"))
    assert "the data changed since the checkpoint (weight of 'web' 0.5 -> 0.75; weight of 'math' " \
           "0.5 -> 0.25); set data.phase above 0" in line
    # a new phase may come with a new schedule (here another peak lr), as override_schedule
    r = _train(config, run, "train.max_steps=5", "data.sources.0.weight=3", "data.phase=1",
               "checkpoint.interval=5", "optim.lr=2e-3")
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert "data phase 1 from step 4 (was 0): sources web 0.75, math 0.25" in log
    assert "learning-rate schedule changed from step 4 (optim.lr 0.001 -> 0.002" in log
    assert "; data.phase=1)" in log
    got = _metrics(run)
    assert [got[("train", s)]["data_phase"] for s in range(1, 6)] == [0, 0, 0, 1, 1]
    assert got[("train", 4)]["target_share_by_source"] == {"web": 0.75, "math": 0.25}
    state = load_checkpoint_file(run / "checkpoints" / "step_000000005" / "refusion_rank_00000.pt")
    phases = state["client_state"]["data_phases"]
    assert phases == [{"phase": 0, "step": 0, "weights": {"web": 0.5, "math": 0.5}},
                      {"phase": 1, "step": 3, "weights": {"web": 0.75, "math": 0.25}}]
    assert state["client_state"]["loader"]["mix"]["phase"] == 1
