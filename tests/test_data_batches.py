"""`python -m pipeline.data.batches`: the samples a step fed, rebuilt from the run's checkpoints,
against what the trainer itself reports feeding (its batch keys on a non-finite loss,
`debug.nan_at_steps` with `train.nan_policy` skip, then stop), across a data phase change of a
mixture, and against the loader's own batches on two data-parallel ranks."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from shard_fixtures import write_train_val
from test_train import ROOT, _env, _log, _train_forked, _write_config


def _batches(run_dir, steps, *extra):
    return subprocess.run([sys.executable, "-m", "pipeline.data.batches", str(run_dir),
                           "--steps", steps, "--json", *extra], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _fed_keys(stderr: str, step: int) -> list[str]:
    m = re.search(rf"non-finite loss at step {step}, micro-batch 0, batch keys (\[.*?\])", stderr)
    assert m, stderr[-2000:]
    return json.loads(m.group(1).replace("'", '"'))


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    base = tmp_path_factory.mktemp("batches")
    write_train_val(base / "web", 30, 4, samples_per_shard=10, seed=1)
    write_train_val(base / "math", 9, 3, samples_per_shard=5, seed=2)
    sources = [{"name": "web", "dir": str(base / "web"), "weight": 3},
               {"name": "math", "dir": str(base / "math"), "weight": 1}]
    config = _write_config(base / "run.yaml", base / "web",
                           data={"dir": None, "sources": sources, "pack": True},
                           train={"max_steps": 4, "global_batch_size": 2, "eval_interval": 0},
                           checkpoint={"interval": 2, "keep": 5})
    return base, config


def test_the_steps_a_run_fed_across_a_phase_change(mix):
    base, config = mix
    run = base / "run"
    # The trainer runs make the checkpoints and the keys this CLI is compared with: `main` on a
    # forked rank (test_train._train_forked). Phase 0, steps 1-4: a NaN at step 3 under
    # nan_policy=skip makes the trainer name the keys it fed there and go on (a skipped update
    # changes no data order).
    assert _train_forked(1, config, run, "debug.nan_at_steps=[3]", "train.nan_policy=skip",
                         log_name="log0") == [0], _log(run)
    fed3 = _fed_keys((run / "log0.txt").read_text(), 3)
    # phase 1 (other weights) from step 5: checkpoint at 5, stopped by a NaN at step 6
    assert _train_forked(1, config, run, "train.max_steps=8", "data.phase=1",
                         "data.sources.1.weight=3", "checkpoint.interval=1",
                         "debug.nan_at_steps=[6]", "train.nan_policy=stop",
                         log_name="log1") == [3], _log(run)
    fed6 = _fed_keys((run / "log1.txt").read_text(), 6)

    got = _batches(run, "3:6")
    assert got.returncode == 0, got.stderr
    lines = [json.loads(x) for x in got.stdout.splitlines()]
    assert [(m["step"], m["micro_batch"]) for m in lines] == [(s, i) for s in range(3, 7) for i in range(2)]
    first = {m["step"]: m for m in lines if m["micro_batch"] == 0}
    assert [k for row in first[3]["rows"] for _, k in row] == fed3
    assert [k for row in first[6]["rows"] for _, k in row] == fed6
    names = {s for m in lines for row in m["rows"] for s, _ in row}
    assert names <= {"web", "math"} and "web" in names


def test_refusals_are_one_line(mix, tmp_path, capsys):
    from pipeline.data.batches import main
    base, config = mix
    # through the entry point once (exit code, no traceback) ...
    r = _batches(tmp_path / "nothing", "1:2")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr
    # ... and the other refusals through its main(), in this process
    capsys.readouterr()
    assert main([str(base / "run"), "--steps", "5:2", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: --steps 5:2: need 1 <= A <= B\n"
    assert main([str(base / "run"), "--steps", "x", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: --steps 'x': expected A:B, two step numbers\n"


def test_plan_equals_the_batches_the_loader_yields_on_two_ranks(mix):
    from pipeline.data import build_loader
    from pipeline.data.mixture import Source
    base, _ = mix
    src = [Source("web", str(base / "web"), 3), Source("math", str(base / "math"), 1)]
    for rank in range(2):
        kw = dict(dp_rank=rank, dp_size=2, seed=3, num_workers=0, pack=True, shuffle_buffer=8)
        planned = build_loader(src, "train", 2, 24, **kw)
        yielded = build_loader(src, "train", 2, 24, **kw)
        plan = list(planned.plan(9))
        it = iter(yielded)
        for rows in plan:
            b = next(it)
            assert [k for r in rows for _, k in r] == b["keys"]
        assert planned.state_dict() == {**yielded.state_dict(),
                                        "consumed_samples": planned.consumed_samples}
