"""pipeline.experiment: stage reuse keyed by inputs (`reuse`), the `--arms/--seeds/--grid`
options and their job lists, the paired bootstrap of the ratio to AR, and the per-stage
timings record. No training runs: run folders are written here the way the trainer leaves
them (a checkpoint whose rank-0 file records the resolved config)."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.experiment import Experiment, TASKS, Setting
from pipeline.experiment import reuse
from pipeline.experiment import writeup as wu
from pipeline.experiment.recipe import main, parse_arms, parse_seeds

# a real math output folder made before inputs.json, e.g. by `make experiment`: read (its small
# files copied), never written; the test runs when this variable names one
REAL_RUN = Path(os.environ.get("EXPERIMENT_REAL_RUN", "/nonexistent"))


def _manifest(shards: Path, sha: str = "a" * 64, inputs: str = "/somewhere/train.jsonl"):
    shards.mkdir(parents=True, exist_ok=True)
    (shards / "manifest.json").write_text(json.dumps({
        "format_version": 1, "tokenizer": {"kind": "spm", "hash": "t" * 64, "vocab_size": 1000},
        "max_length": 256, "options": {"inputs": [inputs]},
        "splits": {"train": [{"name": "train-000000.tar", "samples": 10, "tokens": 100,
                              "bytes": 2048, "sha256": sha,
                              "index": {"name": "train-000000.tar.idx", "sha256": "i" * 64}}]}}))


def _experiment(tmp_path, **kw):
    e = Experiment("math", str(tmp_path / "out"), pretrain_steps=20, finetune_steps=10,
                   threads=1, **kw)
    _manifest(e.shards)
    return e


def _fake_checkpoint(run_dir: Path, config: dict, step: int, world_size: int = 1):
    """A complete checkpoint folder as the trainer leaves it, as far as `reuse` reads it."""
    d = run_dir / "checkpoints" / f"step_{step:09d}"
    d.mkdir(parents=True)
    torch.save({"client_state": {"config": config, "step": step}}, d / "refusion_rank_00000.pt")
    (d / "refusion_meta.json").write_text(json.dumps({"step": step, "world_size": world_size,
                                                      "tp_size": 1, "dp_size": world_size}))
    (run_dir / "checkpoints" / "latest").write_text(d.name)
    return d


def test_keys_follow_the_inputs_not_the_places(tmp_path):
    """The key changes with the config, the steps, the seed, the shards' content and the
    initial export's key; not with the output folder or the shards' input paths."""
    e = _experiment(tmp_path)
    plan = {n: (st, ov) for n, st, ov in e.training_plan()}
    base = e.run_inputs("pretrain_ar", *plan["pretrain_ar"])
    assert base["steps"] == 20 and base["seed"] == 1234 and base["init"] is None
    assert "run_dir" not in base["config"] and "data.dir" not in base["config"]
    assert base["config"]["objective.mode"] == "ar" and base["config"]["optim.lr"] == 0.002
    k = reuse.inputs_key(base)
    # another folder with the same content (shards made from inputs elsewhere): same key
    f = _experiment(tmp_path / "elsewhere")
    _manifest(f.shards, inputs="/another/place.jsonl")
    assert f.key("pretrain_ar") == e.key("pretrain_ar") == k
    # other steps, another lr, other shards: other keys
    g = _experiment(tmp_path / "g")
    g.pretrain_steps = 21
    assert g.key("pretrain_ar") != k
    _manifest(e.shards, sha="b" * 64)
    e._data_fp, e._keys = None, {}
    assert e.key("pretrain_ar") != k
    ov = plan["pretrain_ar"][1] + ["optim.lr=1e-3"]
    assert reuse.inputs_key(e.run_inputs("pretrain_ar", 20, ov)) != e.key("pretrain_ar")
    # stage 2: the seed is train.seed, the init the pretraining's key
    e2 = _experiment(tmp_path / "s", seeds=[1234, 1235])
    p2 = {n: (st, ov) for n, st, ov in e2.training_plan()}
    one, two = (e2.run_inputs(n, *p2[n]) for n in ("refusion", "refusion_seed1235"))
    assert one["seed"] == 1234 and two["seed"] == 1235
    assert one["init"] == two["init"] == e2.key("pretrain_ar")
    assert reuse.differences(one, two) == ["seed 1234 -> 1235"]


def test_a_folder_of_other_inputs_is_refused_with_one_line(tmp_path, capsys):
    """A run folder whose inputs.json has another key stops the invocation before any training:
    one line naming the folder and what differs, exit code 2."""
    e = _experiment(tmp_path)
    assert e.check_runs()["pretrain_ar"] == "new"
    rec = json.loads((e.run_dir("pretrain_ar") / "inputs.json").read_text())
    assert rec["key"] == e.key("pretrain_ar") and rec["inputs"]["steps"] == 20
    assert set(e.check_runs().values()) == {"same"}
    f = Experiment("math", str(e.out), pretrain_steps=30, finetune_steps=10, threads=1)
    with pytest.raises(reuse.InputsMismatch) as err:
        f.check_runs()
    msg = str(err.value)
    assert msg.startswith(f"{e.run_dir('pretrain_ar')} holds a run of other inputs (steps 20 -> "
                          f"30; config.optim.warmup_steps 2 -> 3)") and "\n" not in msg
    # through the command line: the data stage finds its files, then the check refuses
    for p in ("problems/info.json", "tokenizer/spm.model"):
        (e.out / p).parent.mkdir(parents=True, exist_ok=True)
        (e.out / p).write_text("x")
    e.timings_path.write_text('{"data": 1.0}')
    assert main(["--output", str(e.out), "--pretrain-steps", "30", "--finetune-steps",
                 "10"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "steps 20 -> 30" in lines[0]
    assert e.timings_path.read_text() == '{"data": 1.0}'     # refused before writing anything


def test_a_legacy_folder_is_adopted_when_its_checkpoint_recorded_the_same_inputs(tmp_path):
    """A run folder without inputs.json (written before these records) is adopted when its
    latest checkpoint's recorded config gives the same inputs (folders elsewhere: the shards
    compared by content); with another recorded config, or no checkpoint, it is refused."""
    e = _experiment(tmp_path)
    plan = {n: (st, ov) for n, st, ov in e.training_plan()}
    old_shards = tmp_path / "old" / "shards"          # the folder the run was trained from
    shutil.copytree(e.shards, old_shards)
    cfg = reuse.resolved_config(e.config, e.train_overrides("pretrain_ar", *plan["pretrain_ar"]))
    cfg["data"]["dir"], cfg["run_dir"] = str(old_shards), "/old/place/runs/pretrain_ar"
    run = e.run_dir("pretrain_ar")
    _fake_checkpoint(run, cfg, 20)
    assert not e._finished("pretrain_ar", 19) and e._finished("pretrain_ar", 20)
    assert e.check_runs()["pretrain_ar"] == "adopted"
    assert json.loads((run / "inputs.json").read_text())["key"] == e.key("pretrain_ar")
    assert e.stage_train(e.training_plan()[:1]) is False        # finished with the same inputs: reused
    # another recorded lr: refused, the folder named
    other = tmp_path / "other"
    f = _experiment(other)
    cfg2 = json.loads(json.dumps(cfg))
    cfg2["optim"]["lr"] = 0.01
    _fake_checkpoint(f.run_dir("pretrain_ar"), cfg2, 20)
    with pytest.raises(reuse.InputsMismatch, match=r"runs/pretrain_ar holds a run of other "
                                                   r"inputs \(config.optim.lr 0.01 -> 0.002\)"):
        f.check_runs()
    # a folder with neither inputs.json nor a checkpoint cannot be checked: refused
    g = _experiment(tmp_path / "g")
    g.run_dir("pretrain_ar").mkdir(parents=True)
    (g.run_dir("pretrain_ar") / "metrics.jsonl").write_text("")
    with pytest.raises(reuse.InputsMismatch, match="no inputs.json and no complete checkpoint"):
        g.check_runs()


def test_exports_and_results_are_keyed_by_the_run_they_came_from(tmp_path):
    """An export records its run's key (source.json); a legacy export written after the run's
    checkpoint is adopted; a result records the export's key and is stale when it changes."""
    e = _experiment(tmp_path)
    e.check_runs()
    run, hf = e.run_dir("pretrain_ar"), e.hf_dir("pretrain_ar")
    step = _fake_checkpoint(run, {}, 20)
    assert reuse.check_export(hf, run, e.key("pretrain_ar")) is False      # none yet
    hf.mkdir(parents=True)
    for f in ("config.json", "tokenizer.model"):
        (hf / f).write_text("{}")
    import os
    t = (step / "refusion_meta.json").stat().st_mtime
    os.utime(hf / "config.json", (t - 10, t - 10))           # older than the checkpoint
    assert reuse.check_export(hf, run, e.key("pretrain_ar")) is False
    os.utime(hf / "config.json", (t + 10, t + 10))
    assert reuse.check_export(hf, run, e.key("pretrain_ar")) is True        # adopted
    assert json.loads((hf / "source.json").read_text())["key"] == e.key("pretrain_ar")
    assert reuse.check_export(hf, run, "another") is False
    path = e.eval_path("pretrain_ar", "test", Setting())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model_key": e.key("pretrain_ar"), "hf_dir": str(hf)}))
    assert e._cached(path, "pretrain_ar") is not None
    path.write_text(json.dumps({"model_key": "from another export", "hf_dir": str(hf)}))
    assert e._cached(path, "pretrain_ar") is None


def test_arms_seeds_and_grid_options_and_their_jobs(tmp_path, capsys):
    assert parse_arms("dual_all") == ["dual_all", "ar_continued"]
    assert parse_arms("ar_continued,refusion,refusion") == ["ar_continued", "refusion"]
    assert parse_seeds("1234, 1235") == [1234, 1235]
    for bad in ("", "x", "1,1", "-3"):
        with pytest.raises(Exception, match="--seeds"):
            parse_seeds(bad)
    assert main(["--arms", "refusion,nope", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown arm nope" in err[0] and "dual_refusion" in err[0]
    assert main(["--seeds", "1,x", "--output", str(tmp_path)]) == 2
    e = _experiment(tmp_path, arms=["dual_all", "dual_refusion"], seeds=[1234, 1235])
    assert e.arms == ["dual_all", "dual_refusion", "ar_continued"]
    assert e.stage2_runs() == ["dual_all", "dual_refusion", "ar_continued", "dual_all_seed1235",
                               "dual_refusion_seed1235", "ar_continued_seed1235"]
    ov = e.finetune_overrides("dual_refusion_seed1235")
    assert ov[2:4] == ["objective.mode=dual", "objective.dual_masking=refusion"]
    assert ov[-1] == "train.seed=1235"
    assert "objective.dual_masking=all" in e.finetune_overrides("dual_all")
    assert not any(o.startswith("train.seed") for o in e.finetune_overrides("dual_all"))
    # the AR-weight sweep arms: dual_all's options plus the weight
    w = _experiment(tmp_path / "w", arms=["dual_all_ar4", "dual_all_ar16", "dual_all_ar64",
                                          "dual_refusion_ar16"])
    for arm, masking, weight in (("dual_all_ar4", "all", "4"), ("dual_all_ar16", "all", "16"),
                                 ("dual_all_ar64", "all", "64"),
                                 ("dual_refusion_ar16", "refusion", "16")):
        ov = w.finetune_overrides(arm)
        assert ov[2:5] == ["objective.mode=dual", f"objective.dual_masking={masking}",
                           f"objective.ar_weight={weight}"]
    assert not any("ar_weight" in o for o in e.finetune_overrides("dual_all"))
    assert e.run_dir("dual_all_seed1235") == e.out / "runs" / "dual_all_seed1235"
    b = _experiment(tmp_path / "b", seeds=[1235])
    assert b.run_dir("refusion_boundary_seed1235").name == "refusion_boundary_f0.75_seed1235"
    # the default grid: per ReFusion model the paper's setting, draft_ahead and draft_every at
    # k = 4, 8 (the dual arms with bidirectional mask attention); AR of every model on test
    # and unseen; batch 1 for AR of ar_continued and the four lossless settings
    jobs = e.jobs()
    t = TASKS["math"]
    for m in ("dual_all", "dual_refusion_seed1235"):
        mine = [s for mm, n, s in jobs if mm == m and n == "test" and not s.batch_size]
        assert mine == [Setting()] + [Setting(**{**s.to_dict(), "mask_attention": (
            "bidirectional" if s.verify in ("draft_ahead", "draft_every") else "causal")})
            for s in t.default_grid]
        assert (m, "unseen", Setting()) in jobs
        ones = [s for mm, n, s in jobs if mm == m and s.batch_size == 1]
        assert [s.verify for s in ones] == ["draft_ahead"] * 2 + ["draft_every"] * 2
    assert t.paper_setting == Setting("refusion", 4, 4, 0.9, 0.4, "authors")
    assert Setting("refusion", 8, 0, 0.9, 0.9, "draft_every") in t.default_grid
    assert ("ar_continued_seed1235", "test", Setting(batch_size=1)) in jobs
    assert not any(mm.startswith("ar_continued") and s.mode == "refusion" for mm, _, s in jobs)
    assert len(jobs) == len(set(jobs)) == 2 * (3 + 2 * 5 + 3 + 1 + 2 * 4)
    # the lossless grid: the default grid without the authors' decoder, every other job kept
    lossless = _experiment(tmp_path / "l", arms=["dual_all", "dual_refusion"],
                           seeds=[1234, 1235], grid="lossless").jobs()
    dropped = [j for j in jobs if j not in lossless]
    assert not [j for j in lossless if j not in jobs]
    assert len(dropped) == 4 and {s for _, _, s in dropped} == {t.paper_setting}
    with pytest.raises(SystemExit) as exit_:
        main(["--grid", "nope", "--output", str(tmp_path)])
    assert exit_.value.code == 2 and "lossless" in capsys.readouterr().err
    full = _experiment(tmp_path / "f", grid="full").jobs()
    assert set(TASKS["math"].jobs(grid="full")) == set(full)
    assert set(t.grid) | set(t.arm_grid) | set(t.default_grid) <= {s for _, _, s in full}
    # a batch-1 decode runs on the first latency_examples problems
    e.examples = lambda set_name: list(range(1000))
    assert len(e.decode_examples("test", Setting(batch_size=1))) == t.latency_examples == 100
    assert len(e.decode_examples("test", Setting())) == 1000


def _old_name(s: Setting) -> str:
    """A setting's file-name form as it was before `mask_attention` existed (the cached result
    files of causal decodes carry these names)."""
    bs = f"_bs{s.batch_size}" if s.batch_size else ""
    if s.mode == "ar":
        return "ar" + bs
    b = "1slot" if s.num_blocks == 0 else str(s.num_blocks)
    return f"refusion_k{s.slot_size}_b{b}_s{s.slot_threshold}_t{s.token_threshold}_{s.verify}{bs}"


@pytest.mark.parametrize("grid", ["default", "full"])
def test_dual_arms_decode_with_bidirectional_mask_blocks(tmp_path, grid):
    """The arms trained with objective.mode=dual (with or without a seed suffix) decode
    draft_ahead and draft_every with bidirectional mask attention; their other settings and
    every other arm's are causal, and the causal settings keep their file names."""
    e = _experiment(tmp_path, arms=["refusion", "dual_all", "dual_refusion", "dual_all_ar4",
                                    "refusion_boundary"], seeds=[1234, 1235], grid=grid)
    jobs = e.jobs()
    dual = {"dual_all", "dual_refusion", "dual_all_seed1235", "dual_refusion_seed1235",
            "dual_all_ar4", "dual_all_ar4_seed1235"}
    assert dual <= {m for m, _, _ in jobs}
    n_bidir = 0
    for m, n, s in jobs:
        lossless = s.mode == "refusion" and s.verify in ("draft_ahead", "draft_every")
        want = "bidirectional" if m in dual and lossless else "causal"
        assert s.mask_attention == want, (m, n, s)
        if want == "causal":
            assert s.name() == _old_name(s)
        else:
            n_bidir += 1
            causal = Setting(**{**s.to_dict(), "mask_attention": "causal"})
            assert s.name() == _old_name(causal).replace(
                f"_{s.verify}", f"_{s.verify}_bidir") != causal.name()
            assert e.eval_path(m, n, s) != e.eval_path(m, n, causal)
            assert e.decode_args(s).mask_attention == "bidirectional"
            assert "bidirectional" in s.label()
    # every dual model: the 4 lossless settings at the main batch and 4 at batch 1
    assert n_bidir >= len(dual) * 8
    assert all(e.decode_args(s).mask_attention == "causal"
               for m, _, s in jobs if m not in dual)


def test_paired_bootstrap_ratio_against_a_direct_computation():
    """Identical arms: the interval is [1, 1]. Otherwise the function's interval equals the
    percentile interval computed here resample by resample with the same generator."""
    import numpy as np
    same = [True, False, True, True, False] * 40
    assert wu.paired_bootstrap_ratio(same, same) == (1.0, 1.0, 1.0)
    assert wu.paired_bootstrap_ratio([1, 1], [0, 0]) is None
    with pytest.raises(ValueError, match="equal"):
        wu.paired_bootstrap_ratio([1, 0], [1])
    rng = np.random.default_rng(7)
    a = rng.random(200) < 0.7
    b = rng.random(200) < 0.8
    got = wu.paired_bootstrap_ratio(a, b, resamples=2500, seed=3)
    gen = np.random.default_rng(3)
    ratios = []
    for start in range(0, 2500, 1000):
        for idx in gen.integers(0, 200, size=(min(1000, 2500 - start), 200)):
            ratios.append(a[idx].mean() / b[idx].mean())
    ratios.sort()
    want_lo, want_hi = np.quantile(ratios, [0.025, 0.975])
    assert got[0] == pytest.approx(a.mean() / b.mean())
    assert got[1] == pytest.approx(want_lo) and got[2] == pytest.approx(want_hi)
    assert got[1] < got[0] < got[2]
    # a known case: b always right, a right on 90%: the ratio is a's mean, the interval the
    # binomial bootstrap's, about 0.9 +- 1.96 * sqrt(0.09 / 1000)
    a = [True] * 900 + [False] * 100
    r, lo, hi = wu.paired_bootstrap_ratio(a, [True] * 1000)
    assert r == pytest.approx(0.9)
    assert lo == pytest.approx(0.9 - 1.96 * 0.3 / 1000 ** 0.5, abs=0.004)
    assert hi == pytest.approx(0.9 + 1.96 * 0.3 / 1000 ** 0.5, abs=0.004)


def test_target_needs_every_seed_and_the_batch_1_speedup():
    base = {"model": "ar_continued", "mode": "ar", "set": "test", "setting": None,
            "exact_match": 0.8, "tpf": 1.0, "examples": 20, "seconds": 2.0,
            "correct": [True] * 16 + [False] * 4}
    s = Setting("refusion", 8, 0, 0.9, 0.9, "draft_every")
    one = Setting(**{**s.to_dict(), "batch_size": 1})

    def rows(seed, em_hits, tpf, fast_s):
        sfx = "" if seed is None else f"_seed{seed}"
        corr = [True] * em_hits + [False] * (20 - em_hits)
        return [dict(base, model="ar_continued" + sfx),
                dict(base, model="ar_continued" + sfx, setting=Setting(batch_size=1).to_dict()),
                {"model": "dual_all" + sfx, "mode": "refusion", "set": "test",
                 "setting": s.to_dict(), "exact_match": em_hits / 20, "tpf": tpf,
                 "examples": 20, "seconds": 1.0, "correct": corr},
                {"model": "dual_all" + sfx, "mode": "refusion", "set": "test",
                 "setting": one.to_dict(), "exact_match": em_hits / 20, "tpf": tpf,
                 "examples": 20, "seconds": fast_s, "correct": corr}]
    easy = {"tpf": 2.5, "em_ratio": 0.95, "lower": 0.90, "speedup": 1.5, "seeds": 2}
    ok = wu.ratio_rows(rows(None, 16, 2.6, 1.0) + rows(1235, 16, 2.7, 1.0))
    assert [r["ratio"] for r in ok] == [1.0, 1.0] and [r["speedup"] for r in ok] == [2.0, 2.0]
    got = wu.check_target(ok, easy)
    assert got[("dual_all", s.name())]["met"]
    alone = wu.check_target(ok[:1], easy)[("dual_all", s.name())]
    assert not alone["met"] and alone["failed"] == ["1 seed(s) of the 2 needed"]
    slow = wu.ratio_rows(rows(None, 16, 2.6, 1.0) + rows(1235, 16, 2.7, 1.5))
    v = wu.check_target(slow, easy)[("dual_all", s.name())]
    assert not v["met"] and v["failed"] == ["batch-1 speedup 1.33 < 1.5 (seed 1235)"]
    lines = "\n".join(wu.ratio_table(ok))
    assert "Mean over seeds:" in lines and "| dual_all | k=8, token thr 0.9, verify draft_every" \
        " | 2 | 2.65 | 1.000 | 1.000 | 2.00 |" in lines


def test_timings_record_ran_and_reused_stages(tmp_path):
    """timings.json per stage: status, wall seconds, threads, processes, date; a reused stage
    keeps when it last ran."""
    e = _experiment(tmp_path)
    e._timed("train pretrain_ar", lambda: None, processes=1)
    first = json.loads(e.timings_path.read_text())["train pretrain_ar"]
    assert first["status"] == "ran" and first["threads"] == 1 and first["processes"] == 1
    assert first["date"].endswith("Z") and first["seconds"] >= 0
    f = Experiment("math", str(e.out), threads=2)
    f._last_timings = dict(f.timings)
    f.timings = {}
    f._timed("train pretrain_ar", lambda: False)
    again = json.loads(f.timings_path.read_text())["train pretrain_ar"]
    assert again["status"] == "reused" and again["threads"] == 2
    assert again["last_run"] == first and f.stage_status == {"train pretrain_ar": "reused"}
    f._timed("sweep", f.stage_sweep)                    # not asked for: skipped
    assert f.stage_status["sweep"] == "skipped" and "last_run" not in f.timings["sweep"]
    md = "\n".join(wu.timing_lines(f.timings))
    assert "| train pretrain_ar | reused |" in md and f"{first['date']} |" in md


@pytest.mark.skipif(not (REAL_RUN / "runs" / "pretrain_ar" / "checkpoints").is_dir(),
                    reason="EXPERIMENT_REAL_RUN names no run folder with checkpoints")
def test_a_real_pretraining_folder_is_adopted_from_a_copy_of_its_small_files(tmp_path):
    """The AR pretraining of a real run folder made before inputs.json (read, never written):
    a copy of its shard manifest, tokenizer and latest checkpoint's small files is adopted by
    the experiment's default invocation, so it would not be trained again."""
    from pipeline.checkpoint import find_latest
    step = find_latest(REAL_RUN / "runs" / "pretrain_ar" / "checkpoints")
    if step is None:
        pytest.skip("the real run has no complete checkpoint yet")
    out = tmp_path / "math"
    (out / "shards").mkdir(parents=True)
    shutil.copy(REAL_RUN / "shards" / "manifest.json", out / "shards" / "manifest.json")
    dst = out / "runs" / "pretrain_ar" / "checkpoints" / step.name
    dst.mkdir(parents=True)
    for f in ("refusion_rank_00000.pt", "refusion_meta.json"):
        shutil.copy(step / f, dst / f)
    (dst.parent / "latest").write_text(step.name)
    e = Experiment("math", str(out))
    assert e.check_runs()["pretrain_ar"] == "adopted"
    assert not (REAL_RUN / "runs" / "pretrain_ar" / "inputs.json").exists()


def test_dual_arms_are_fed_the_same_tokens_per_step_in_longer_rows(tmp_path):
    """A dual-stream arm takes rows of ARM_ROW_TOKENS and fewer of them: rows x length is the
    other arms' micro-batch x 256; a micro-batch that does not divide is refused (exit 2)."""
    from pipeline.common.cli import UsageError
    from pipeline.experiment.tasks import ARM_ROW_TOKENS, ROW_TOKENS

    def opts(e, name):
        return dict(o.split("=", 1) for o in e.train_overrides(name, 10, []))

    e = _experiment(tmp_path)
    plain = opts(e, "ar_continued")
    assert plain["train.micro_batch_size"] == "8" and "data.max_length" not in plain
    for arm in ("dual_all", "dual_refusion_seed7", "dual_all_ar4", "dual_all_ar16_seed7",
                "dual_all_ar64", "dual_refusion_ar16_seed7"):
        o = opts(e, arm)
        length = int(o["data.max_length"])
        assert length == ARM_ROW_TOKENS[arm.split("_seed")[0]] == 512
        assert int(o["train.micro_batch_size"]) * length == 8 * ROW_TOKENS
    odd = Experiment("math", str(tmp_path / "odd"), micro_batch_size=3)
    with pytest.raises(UsageError, match="--micro-batch-size 3: dual_all"):
        odd.train_overrides("dual_all", 10, [])


def test_the_lever_arms_train_the_recipe_with_half_the_copies_or_four_thirds_the_steps(tmp_path):
    """Issue 44's math levers: `dual_refusion_ar16_copy50` is the recipe's options plus
    `objective.dual_copy_scale=0.5` (same steps); `dual_refusion_ar16_long` the recipe's options
    at round(4/3 x finetune_steps) steps, in its inputs key too; both fed 512-token rows."""
    e = Experiment("math", str(tmp_path / "out"), pretrain_steps=20, finetune_steps=1500,
                   threads=1, arms=["dual_refusion_ar16", "dual_refusion_ar16_copy50",
                                    "dual_refusion_ar16_long"], seeds=[1234, 1235])
    _manifest(e.shards)
    recipe = e.finetune_overrides("dual_refusion_ar16")
    assert e.finetune_overrides("dual_refusion_ar16_copy50") == (
        recipe[:5] + ["objective.dual_copy_scale=0.5"] + recipe[5:])
    assert e.finetune_overrides("dual_refusion_ar16_long") == recipe
    steps = {name: s for name, s, _ in e.training_plan()}
    assert steps == {"pretrain_ar": 20, "dual_refusion_ar16": 1500,
                     "dual_refusion_ar16_copy50": 1500, "dual_refusion_ar16_long": 2000,
                     "ar_continued": 1500, "dual_refusion_ar16_seed1235": 1500,
                     "dual_refusion_ar16_copy50_seed1235": 1500,
                     "dual_refusion_ar16_long_seed1235": 2000, "ar_continued_seed1235": 1500}
    for name in ("dual_refusion_ar16_long", "dual_refusion_ar16_long_seed1235"):
        o = dict(x.split("=", 1) for x in e.train_overrides(name, steps[name], []))
        assert o["data.max_length"] == "512" and o["train.max_steps"] == "2000"
    assert e.run_inputs("dual_refusion_ar16_long", 2000, recipe)["steps"] == 2000
    # the key of a model outside the plan is computed at its own steps
    f = Experiment("math", str(tmp_path / "out"), pretrain_steps=20, finetune_steps=1500,
                   threads=1, arms=["dual_refusion_ar16"])
    assert f.key("dual_refusion_ar16_long") == e.key("dual_refusion_ar16_long")
    assert e.key("dual_refusion_ar16_long") != e.key("dual_refusion_ar16")
