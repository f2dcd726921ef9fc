"""pipeline.experiment: the tasks' fixed choices, and the report stage (tables, frontier, target
check per verify mode, side-by-side answers with the committing forwards marked, figures) from
cached results written here; the training/decoding stages are the trainer's, exporter's and
evaluator's (tested in their own files). The experiment itself is not run by the tests."""
import json

import pytest

from pipeline.experiment import Experiment, Setting, TASKS
from pipeline.experiment import writeup as wu


def _row(model, mode, setting, tpf, em, acc, tps=100.0, set_name="val", outputs=None):
    r = {"model": model, "mode": mode, "set": set_name,
         "setting": setting.to_dict() if setting else None, "examples": 10, "tpf": tpf,
         "tps": tps, "exact_match": em, "token_accuracy": acc, "tokens": 50, "forwards": 25,
         "seconds": 1.0}
    if outputs is not None:
        r["outputs"] = outputs
    return r


@pytest.mark.parametrize("name", ["code", "math", "mbpp"])
def test_jobs_are_unique_and_fit_the_generation_length(name):
    task = TASKS[name]
    jobs = task.jobs()
    assert len({(m, s, x.name()) for m, s, x in jobs}) == len(jobs)
    assert jobs[:2] == [("refusion", task.main_set, Setting()),
                        ("ar_continued", task.main_set, Setting())]
    e = Experiment(task, out="unused")
    for _, _, s in jobs:
        if s.mode == "refusion":
            a = e.decode_args(s)
            assert task.gen_length % s.slot_size == 0
            assert (task.gen_length // s.slot_size) % a.num_blocks == 0
            assert a.verify == s.verify and a.temperature == 0.0
    assert e.decode_args(Setting()).gen_length == task.gen_length


def test_math_grid_is_the_recorded_one():
    t = TASKS["math"]
    assert len(t.grid) == 12 and t.metric == "final_answer" and t.gen_length == 128
    for verify, thresholds in (("authors", {0.4, 0.9}), ("correct", {0.9})):
        part = [s for s in t.grid if s.verify == verify]
        assert len(part) == 4 * len(thresholds)
        assert {s.token_threshold for s in part} == thresholds
        assert {s.slot_size for s in part} == {4, 8} and {s.num_blocks for s in part} == {0, 4}
    assert {s.slot_threshold for s in t.grid} == {0.9}
    assert t.sizes == {"train": 80000, "test": 1000, "dev": 200, "test_unseen": 100}
    one = Setting("refusion", 8, 0, 0.9, 0.9, "correct")
    assert one in t.grid
    assert Experiment("math", out="x").decode_args(one).num_blocks == 16   # 1 slot per block
    assert one.name() == "refusion_k8_b1slot_s0.9_t0.9_correct"
    assert TASKS["code"].grid[0].name() == "refusion_k4_b2_s0.5_t0.1_authors"


def test_pareto_drops_dominated_settings():
    s = Setting("refusion")
    a = _row("refusion", "refusion", s, 2.0, 0.10, 0.5)
    b = _row("refusion", "refusion", s, 1.0, 0.20, 0.6)
    c = _row("refusion", "refusion", s, 1.0, 0.10, 0.5)   # dominated by a and b
    d = _row("refusion", "refusion", s, 2.0, 0.10, 0.5)   # equal to a: both kept
    assert wu.pareto([a, b, c, d]) == [b, a, d]


def test_marked_text_groups_tokens_by_the_forward_that_committed_them(tmp_path):
    import sentencepiece as spm
    from pipeline.tokenizer import load_tokenizer
    path = tmp_path / "t.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["Mia has 4 pens and 5 cups."] * 50), model_writer=f,
            vocab_size=40, model_type="char", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            user_defined_symbols=["<|mask|>", "<|user|>", "<|assistant|>"], minloglevel=2)
    tok = load_tokenizer(str(path))
    ids = tok.encode("Mia has 4 pens")
    fw = [2] * 4 + [4] * (len(ids) - 4)
    text = wu.marked_text(tok, ids + [tok.info.eos_id, 9], fw + [6, 6], tok.info.eos_id)
    assert text == "{2:Mia}{4: has 4 pens}"          # the space stays with its token ("▁h")
    assert wu.plain_text(tok, ids + [tok.info.eos_id], tok.info.eos_id) == "Mia has 4 pens"
    # an id past the tokenizer (an embedding row no piece uses) is dropped, not an error
    past = tok.info.vocab_size + 5
    assert wu.plain_text(tok, ids[:3] + [past] + ids[3:], tok.info.eos_id) == "Mia has 4 pens"
    assert wu.marked_text(tok, ids[:4] + [past] + ids[4:], fw[:4] + [3] + fw[4:],
                          tok.info.eos_id) == "{2:Mia}{4: has 4 pens}"


def _write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _metrics(tmp_path):
    for name, mdm in (("pretrain_ar", 0.0), ("refusion", 1.5)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"kind": "train", "step": s, "loss": 3.0 + mdm, "ar_loss": 3.0, "mdm_loss": mdm,
             "consumed_tokens": 100 * s}) + "\n" for s in (1, 2)))


def test_code_report_tables_frontier_and_target(tmp_path):
    e = Experiment("code", str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1,
                   micro_batch_size=2)
    grid = TASKS["code"].grid
    rows = [_row("ar_continued", "ar", None, 1.0, 0.20, 0.50),
            _row("refusion", "ar", None, 1.0, 0.18, 0.45),
            _row("refusion", "refusion", grid[0], 2.1, 0.19, 0.44),    # meets the target
            _row("refusion", "refusion", grid[1], 2.5, 0.10, 0.30)]    # fast, inaccurate
    for r in rows:
        _write(e.eval_path(r["model"], "val", Setting.from_dict(r["setting"])), r)
    _write(e.eval_path("refusion", "val", Setting("refusion", 99)),         # not a job: ignored
           _row("refusion", "refusion", Setting("refusion", 99), 9.0, 1.0, 1.0))
    _write(tmp_path / "eval" / "refusion__val_loss.json",
           {"model": "refusion", "loss": {"val_loss": 5.0, "val_ar_loss": 2.0,
                                          "val_mdm_loss": 3.0}})
    _metrics(tmp_path)
    _write(tmp_path / "diagnose" / "refusion__slot_acceptance_k4.json",
           {"model": "refusion", "slots": 12, "slot_size": 4, "first_token_accuracy": 0.5,
            "draft_accuracy_by_offset": [0.5, 0.25, 0.125, None], "exact_slot_drafts": 0.125,
            "accepted": {"0.1": 2.5, "0.5": 1.75, "0.9": 1.25},
            "accepted_correct": {"0.1": 1.0, "0.5": 0.75, "0.9": 0.5},
            "ar_next_token_accuracy": 0.625, "accepted_verify_correct": 1.5,
            "ar_next_token_accuracy_by_place": {"first": 0.0, "slot_first": 0.5,
                                                "within": 0.75}})
    md = e.stage_report().read_text()
    assert ("| refusion | 4 | 12 | 0.500 | 0.50 0.25 0.12 | 0.125 | 2.50 / 1.75 / 1.25 | "
            "1.00 / 0.75 / 0.50 | 1.50 | 0.625 | 0.000 / 0.500 / 0.750 |") in md
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert ("| refusion | refusion | authors | 4 | 2 blocks | 0.5 | 0.1 | 2.10 | 100 | 0.190 | "
            "0.440 | - |") in md
    assert "| 99 |" not in md and "9.00" not in md
    # no per-problem results here: the ratio without an interval; the target fails on TPF,
    # the interval and the missing batch-1 decode
    assert ("| refusion | k=4, 2 blocks, slot thr 0.5, token thr 0.1, verify authors | 2.10 | "
            "0.190 | 0.200 | 0.950 | - | - |") in md
    assert "- not met." in md and "TPF 2.10 < 2.5; lower end - < 0.9; batch-1 speedup -" in md
    assert "at every seed evaluated (at least 2), TPF >= 2.5 with exact match >= 95%" in md
    assert "| refusion | 5.0000 | 2.0000 | 3.0000 |" in md
    # The AR run's logged MDM term (0) is not reported as an MDM loss; steps are the run's own.
    assert "| 1. AR pretraining (from scratch) | 2 | 200 | 200 | 3.000 (3.000 / -) |" in md
    assert "| 2a. ReFusion fine-tuning | 2 | 200 | - | 4.500 (3.000 / 1.500) |" in md


def test_report_gives_each_runs_clean_tokens_fed(tmp_path):
    """Clean tokens (fed unmasked with next-token targets): a dual run's per-step
    `clean_tokens` summed, copies left out; an AR run's real tokens; none for the paper's
    objective. Every step's record counts once (a resumed run's re-logged step: its last)."""
    e = Experiment("math", str(tmp_path), arms=["dual_refusion_ar16", "refusion"],
                   seeds=[1234, 1235], pretrain_steps=4, finetune_steps=3, threads=1)
    for name, steps in (("pretrain_ar", 4), ("ar_continued", 3), ("refusion", 3),
                        ("dual_refusion_ar16_seed1235", 3)):
        d = e.run_dir(name)
        d.mkdir(parents=True)
        recs = [{"kind": "train", "step": s, "loss": 1.0, "ar_loss": 1.0, "mdm_loss": 0.5,
                 "consumed_tokens": 100 * s} for s in range(1, steps + 1)]
        if name.startswith("dual"):     # step s: 60 + s clean tokens, 40 - s copies
            recs = [{**r, "clean_tokens": 60 + r["step"], "copy_tokens": 40 - r["step"]}
                    for r in recs]
            # step 2 logged, lost to a crash, re-logged after the resume: the last counts
            recs.insert(1, {**recs[1], "clean_tokens": 999})
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    runs = e.training_runs()
    got = e.clean_tokens_fed(runs)
    dual = e.run_label("dual_refusion_ar16_seed1235")
    assert got == {e.run_label("pretrain_ar"): 400, e.run_label("ar_continued"): 300,
                   dual: 61 + 62 + 63}
    md = e.stage_report().read_text()
    assert f"| {dual} | 3 | 300 | 186 | " in md
    assert f"| {e.run_label('refusion')} | 3 | 300 | - | " in md


def test_target_check_says_when_the_baseline_exact_match_is_zero(tmp_path):
    e = Experiment("code", str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1)
    g = TASKS["code"].grid[0]
    for r in (_row("ar_continued", "ar", None, 1.0, 0.0, 0.14),
              _row("refusion", "refusion", g, 0.7, 0.0, 0.15)):
        _write(e.eval_path(r["model"], "val", Setting.from_dict(r["setting"])), r)
    md = e.stage_report().read_text()
    # an AR exact match of 0 gives no ratio, and the target is not met
    assert "| 0.70 | 0.000 | 0.000 | - | - | - |" in md and "- not met." in md


def test_math_report_per_verify_mode_identity_with_ar_and_side_by_side(tmp_path):
    """The math task's report from fake results on a real (small) problem set and tokenizer:
    the target is checked per verify mode, a decode whose ids equal AR's is counted as
    identical, the unseen set gets its own table, and the first problems are shown with the
    reference, AR and the sample settings' marked decodes."""
    from data_prep import math_problems as mp
    from data_prep.train_tokenizer import train
    t = TASKS["math"]
    e = Experiment("math", str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1,
                   grid="full")
    mp.write_splits(tmp_path / "problems", {"train": 300, "test": 5, "dev": 0,
                                            "test_unseen": 4})
    train([str(tmp_path / "problems" / "train.jsonl")], str(t.spm(tmp_path)), 400)
    ex = e.examples("test")
    assert len(ex) == 5 and ex[0]["reference_ids"][-1] == 3            # EOS closes it
    ref_out = [{"ids": x["reference_ids"], "commit_forward": list(range(1, len(
        x["reference_ids"]) + 1)), "text": x["reference"]} for x in ex]
    wrong = [dict(o, ids=o["ids"][:3] + [5] + o["ids"][4:]) for o in ref_out]
    paired = [dict(o, commit_forward=[(j // 4) * 2 + 2 for j in range(len(o["ids"]))])
              for o in ref_out]
    authors, correct = t.sample_settings[0], t.sample_settings[1]
    rows = [_row("ar_continued", "ar", None, 1.0, 0.9, 0.99, set_name="test", outputs=ref_out),
            _row("refusion", "ar", None, 1.0, 0.85, 0.97, set_name="test", outputs=ref_out),
            _row("refusion", "refusion", authors, 1.9, 0.10, 0.70, set_name="test",
                 outputs=wrong),
            _row("refusion", "refusion", correct, 2.2, 0.85, 0.97, set_name="test",
                 outputs=paired),
            _row("refusion", "ar", None, 1.0, 0.5, 0.9, set_name="unseen")]
    for r in rows:
        _write(e.eval_path(r["model"], r["set"], Setting.from_dict(r["setting"])), r)
    md = e.stage_report().read_text()
    assert "## Exact match relative to AR" in md and "- not met." in md
    assert ("| refusion | refusion | correct | 8 | 4 blocks | 0.9 | 0.9 | 2.20 | 100 | 0.850 | "
            "0.970 | 1.000 |") in md
    assert ("| refusion | refusion | authors | 8 | 4 blocks | 0.9 | 0.9 | 1.90 | 100 | 0.100 | "
            "0.700 | 0.000 |") in md
    assert "## Decoding `unseen` (10 examples)" in md
    assert f"**Problem 1.** {ex[0]['query']}" in md and ex[0]["reference"] in md
    from pipeline.tokenizer import load_tokenizer
    tok = load_tokenizer(str(t.spm(tmp_path)))
    first = wu.marked_text(tok, paired[0]["ids"], paired[0]["commit_forward"], 3)
    assert first.startswith("{2:") and "{4:" in first and first in md


def test_the_boundary_arm_its_runs_and_the_sweep_rule(tmp_path):
    """Issue 26's third arm: both ReFusion arms get every grid decode plus draft_ahead; the arm
    trains with boundary labels and its share, in a folder named by the share; `--sweep` adds
    one run per share; the sweep's rule picks the largest TPF among shares within 90% of AR."""
    from pipeline.experiment.evaluation import choose_fraction
    from pipeline.experiment.stage import boundary_run
    t = TASKS["math"]
    jobs = t.jobs()
    for m in ("refusion", "refusion_boundary"):
        mine = {s for mm, st, s in jobs if mm == m and st == "test"}
        assert set(t.grid) | set(t.arm_grid) | {Setting()} <= mine
    assert {s.verify for s in t.arm_grid} == {"draft_ahead"}
    assert ("refusion_boundary", "test", Setting(batch_size=1)) in jobs
    assert Setting(batch_size=1).name() == "ar_bs1"
    e = Experiment("math", str(tmp_path), natural_order_fraction=0.25)
    assert e.run_dir("refusion_boundary") == tmp_path / "runs" / "refusion_boundary_f0.25"
    assert e.stage2_runs() == ["refusion", "ar_continued", "refusion_boundary_f0.25",
                               "dual_refusion_ar16"]
    ov = e.finetune_overrides(boundary_run(0.25))
    assert "objective.boundary_labels=true" in ov and "objective.natural_order_fraction=0.25" in ov
    assert "objective.mode=refusion" in e.finetune_overrides("refusion")
    assert not any(o.startswith("objective.boundary") for o in e.finetune_overrides("refusion"))
    sw = Experiment("math", str(tmp_path / "s"), sweep=True)
    runs = sw.stage2_runs()
    assert runs[:2] == ["refusion", "ar_continued"] and len(runs) == len(set(runs)) == 7
    assert set(runs[2:]) == {boundary_run(f) for f in t.sweep_fractions} | {"dual_refusion_ar16"}
    em = {0.0: 0.5, 0.25: 0.8, 0.5: 0.85, 0.75: 0.7}
    tpf = {0.0: 2.4, 0.25: 2.2, 0.5: 2.0, 0.75: 1.9}
    assert choose_fraction(em, tpf, 0.88) == 0.25      # 0.0 is fast but below 0.792
    assert choose_fraction(em, tpf, 0.99) == 0.5       # none within 90%: the best exact match
    # a sweep's choice is what the folder uses afterwards
    (tmp_path / "s").mkdir(exist_ok=True)
    (tmp_path / "s" / "sweep.json").write_text(json.dumps({"chosen": 0.75}))
    assert Experiment("math", str(tmp_path / "s")).run_name("refusion_boundary") == \
        "refusion_boundary_f0.75"


def test_math_report_has_the_sweep_latency_and_both_arms_targets(tmp_path):
    e = Experiment("math", str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1)
    da8 = Setting("refusion", 8, 0, 0.9, 0.9, "draft_ahead")
    rows = [_row("ar_continued", "ar", None, 1.0, 0.80, 0.99, tps=4000, set_name="test"),
            _row("refusion", "ar", None, 1.0, 0.40, 0.70, set_name="test"),
            _row("refusion_boundary", "ar", None, 1.0, 0.76, 0.97, set_name="test"),
            _row("refusion", "refusion", da8, 1.5, 0.40, 0.70, set_name="test"),
            _row("refusion_boundary", "refusion", da8, 2.6, 0.76, 0.97, tps=3000,
                 set_name="test"),
            _row("ar_continued", "ar", Setting(batch_size=1), 1.0, 0.80, 0.99, tps=300,
                 set_name="test"),
            _row("refusion_boundary", "refusion", Setting(**{**da8.to_dict(), "batch_size": 1}),
                 2.6, 0.76, 0.97, tps=600, set_name="test")]
    rows[-1]["seconds"] = 0.5           # twice as fast as AR at batch 1 (1 s)
    # per-problem results of 25 problems: AR right on 20, the boundary arm's draft_ahead on 19
    rows[0]["correct"] = [True] * 20 + [False] * 5
    rows[4]["correct"] = [True] * 18 + [False, True] + [False] * 5
    for r in rows:
        _write(e.eval_path(r["model"], r["set"], Setting.from_dict(r["setting"])), r)
    _write(tmp_path / "sweep.json", {
        "set": "dev", "setting": da8.to_dict(), "ar_continued_exact_match": 0.8, "ratio": 0.9,
        "chosen": 0.5, "rows": [{"natural_order_fraction": f, "ar_exact_match": em,
                                 "ar_token_accuracy": 0.9, "tpf": tpf, "exact_match": em}
                                for f, em, tpf in ((0.0, 0.6, 2.9), (0.5, 0.75, 2.5))]})
    md = e.stage_report().read_text()
    assert "| 0.5 | 0.750 / 0.900 | 2.50 / 0.750 | **yes** |" in md
    assert "| 0 | 0.600 / 0.900 | 2.90 / 0.600 |  |" in md
    # batch 1: tokens/s, its ratio to AR at batch 1, and the same decode at the default batch
    assert ("| refusion_boundary | k=8, token thr 0.9, verify draft_ahead | 10 | 2.60 | 600 | "
            "2.00 | 3000 |") in md
    # the ratio 0.76 / 0.80 with its interval (from the per-problem results), speedup 2
    r = wu.ratio_rows([json.loads(e.eval_path(x["model"], "test", Setting.from_dict(
        x["setting"])).read_text()) for x in rows])
    mine = [x for x in r if x["model"] == "refusion_boundary"]
    assert len(mine) == 1 and mine[0]["speedup"] == 2.0 and mine[0]["lower"] is not None
    lo, hi = mine[0]["lower"], mine[0]["upper"]
    assert (f"| refusion_boundary | k=8, token thr 0.9, verify draft_ahead | 2.60 | 0.760 | "
            f"0.800 | 0.950 | [{lo:.3f}, {hi:.3f}] | 2.00 |") in md
    assert "Goal beyond it" in md and "- not met." in md     # the lower end is far below 0.9
    # batch-1 rows stay out of the main table
    assert md.count("| refusion_boundary | refusion | draft_ahead | 8 |") == 1


def test_eval_workers_take_unclaimed_items_and_leave_batch_1_to_the_parent(tmp_path, monkeypatch):
    """`--parallel` evaluation: a worker computes exactly the items no other worker has
    claimed (validation losses, decodes, diagnosis profiles), claiming each before it starts,
    never a batch-1 decode; the parent then computes only the batch-1 decodes, alone; the
    number of workers is `--parallel` bounded by cores / `--threads`."""
    import os
    import types
    from pipeline.common.atomic_io import write_json
    import pipeline.experiment.diagnosis as diag
    import pipeline.inference.loading as loading
    import pipeline.training.validation as validation
    t = TASKS["math"]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert Experiment(t, str(tmp_path), parallel=1).eval_workers() == 1
    assert Experiment(t, str(tmp_path), parallel=0, threads=1).eval_workers() == 2
    assert Experiment(t, str(tmp_path), parallel=3, threads=2).eval_workers() == 1
    assert Experiment(t, str(tmp_path), parallel=1).stage_eval_workers() == "skipped"
    done = []
    monkeypatch.setattr(loading, "load_for_inference",
                        lambda path: types.SimpleNamespace(model=path))
    monkeypatch.setattr(validation, "validation_loss", lambda *a: (
        done.append(("loss", a[0])) or {"val_loss": 1.0, "val_ar_loss": 1.0,
                                         "val_mdm_loss": 0.0}))
    monkeypatch.setattr(diag, "slot_acceptance", lambda loaded, ex, k, *a: (
        done.append(("slots", loaded, k)) or {"first_token_accuracy": 0.5,
                                              "draft_accuracy_by_offset": [0.5],
                                              "accepted": {}, "ar_next_token_accuracy": 0.5}))
    monkeypatch.setattr(diag, "first_token_effect", lambda loaded, *a: (
        done.append(("first", loaded)) or {"first_token_accuracy": {}, "exact_match": {}}))

    def experiment(worker):
        e = Experiment(t, str(tmp_path), parallel=2, threads=1, worker=worker)
        e.examples = lambda set_name: []

        def decode(loaded, model, set_name, s):
            assert loaded.model == str(e.hf_dir(model))
            done.append(("decode", model, set_name, s))
            write_json(e.eval_path(model, set_name, s), {"model": model})
        e.decode = decode
        return e

    w = experiment(True)
    for m in t.arms:
        w.hf_dir(m).mkdir(parents=True)
        (w.hf_dir(m) / "config.json").write_text("{}")
    # decodes of a verify mode this checkout's decoder lacks are left out
    from pipeline.inference.decoding import VERIFY_MODES
    jobs = [(m, n, s) for m, n, s in w.jobs() if s.mode == "ar" or s.verify in VERIFY_MODES]
    items = ([w.out / "eval" / f"{m}__val_loss.json" for m in t.arms]
             + [w.eval_path(m, n, s) for m, n, s in jobs]
             + [w.out / "diagnose" / f"{m}__slot_acceptance_k{k}.json"
                for m in t.arms for k in t.diagnose_slot_sizes]
             + [w.out / "diagnose" / f"{m}__first_token.json" for m in t.arms])
    other = set(items[::2])                      # claimed by "another worker"
    for p in other:
        p.parent.mkdir(parents=True, exist_ok=True)
        open(f"{p}.claim", "w").close()
    w.stage_eval()
    w.stage_diagnose()
    batch1 = {w.eval_path(m, n, s) for m, n, s in jobs if s.batch_size == 1}
    assert batch1 and len(done) == len(set(items) - other - batch1)
    mine = {p for p in items if p.is_file()}
    assert mine == set(items) - other - batch1
    assert all(os.path.exists(f"{p}.claim") for p in mine)
    for p in other - batch1:                     # the other worker finishes its items
        write_json(p, {"model": "x"})
    done.clear()
    parent = experiment(False)
    parent.stage_eval()
    parent.stage_diagnose()
    assert {parent.eval_path(m, n, s) for _, m, n, s in done} == batch1
    assert all(d[0] == "decode" and d[3].batch_size == 1 for d in done)
    parent._clear_claims()
    assert not list(tmp_path.rglob("*.claim"))


def test_mbpp_examples_score_their_references_by_execution(tmp_path):
    """The mbpp task's examples (from data_prep/code_problems.py and its tokenizer): the
    reference ids decode to the reference body; scored by the task's metric, the references
    pass (pass@1 1.0) and another problem's body does not."""
    import subprocess
    import sys
    from data_prep import code_problems as cp
    from pipeline.inference.evaluation import score_answers
    task = TASKS["mbpp"]
    assert task.metric == "pass_at_1" and task.unseen_set == "unseen"
    probs = task.problems_dir(tmp_path)
    cp.write_splits(probs, {"train": 300, "test": 12, "dev": 4, "test_unseen": 8}, seed=0)
    spm = task.spm(tmp_path)
    spm.parent.mkdir(parents=True)
    r = subprocess.run([sys.executable, "data_prep/train_tokenizer.py", "--input",
                        str(probs / "train.jsonl"), "--output", str(spm), "--vocab-size", "500"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from pipeline.tokenizer import load_tokenizer
    tok = load_tokenizer(str(spm))
    for set_name, n in (("test", 12), ("unseen", 8)):
        ex = task.examples(tmp_path, set_name)
        assert len(ex) == n
        for e in ex:
            assert e["reference_ids"][-1] == tok.info.eos_id
            assert tok.sp.DecodeIds(e["reference_ids"][:-1]) == e["reference"]
            assert e["query"].endswith("\n" + e["signature"]) and len(e["tests"]) >= 3
            assert len(e["reference_ids"]) <= task.gen_length
        right, extra = score_answers([e["reference"] for e in ex], ex, task.metric)
        assert right == [True] * n and extra["execution"]["passed"] == n
        shifted = [ex[(i + 1) % n]["reference"] for i in range(n)]
        right, _ = score_answers(shifted, ex, task.metric)
        assert not any(right)


def test_decode_table_puts_the_body_match_beside_pass_at_1():
    ar = _row("ar_continued", "ar", None, 1.0, 0.42, 0.9)
    ar.update(metric="pass_at_1", text_match=0.31)
    text = "\n".join(wu.decode_table([ar, _row("refusion", "ar", None, 1.0, 0.5, 0.8)]))
    assert "| 0.420 (body 0.310) |" in text
    assert "| 0.500 |" in text                   # other metrics: the cell as before


def test_mbpp_decodes_unseen_with_refusion_settings_and_reports_their_ratio(tmp_path):
    """mbpp decodes `unseen` with the paper's setting and draft_ahead k 4, 8 on every ReFusion
    arm (a dual arm with bidirectional mask attention) beside AR of every arm, and the report
    gives their pass@1 over `ar_continued`'s AR pass@1 on `unseen` with a paired interval; the
    math task's `unseen` jobs stay AR only plus its recorded extras."""
    t = TASKS["mbpp"]
    jobs = t.jobs(arms=["refusion", "dual_refusion_ar16", "ar_continued"], grid="default")
    unseen = {(m, s.name()) for m, n, s in jobs if n == "unseen"}
    assert unseen == {(m, "ar") for m in ("refusion", "dual_refusion_ar16", "ar_continued")} | {
        ("refusion", "refusion_k4_b4_s0.9_t0.4_authors"),
        ("refusion", "refusion_k4_b1slot_s0.9_t0.9_draft_ahead"),
        ("refusion", "refusion_k8_b1slot_s0.9_t0.9_draft_ahead"),
        ("dual_refusion_ar16", "refusion_k4_b4_s0.9_t0.4_authors"),
        ("dual_refusion_ar16", "refusion_k4_b1slot_s0.9_t0.9_draft_ahead_bidir"),
        ("dual_refusion_ar16", "refusion_k8_b1slot_s0.9_t0.9_draft_ahead_bidir")}
    assert all(s.mode == "ar" for m, n, s in TASKS["math"].jobs(grid="default") if n == "unseen")
    e = Experiment("mbpp", str(tmp_path), arms=["refusion"], grid="default")
    rows = [_row("ar_continued", "ar", None, 1.0, 0.8, 0.9, set_name="test"),
            _row("refusion", "ar", None, 1.0, 0.8, 0.9, set_name="test"),
            _row("refusion", "refusion", t.paper_setting, 4.5, 0.7, 0.8, set_name="test"),
            _row("ar_continued", "ar", None, 1.0, 0.5, 0.9, set_name="unseen"),
            _row("refusion", "refusion", t.paper_setting, 4.5, 0.4, 0.8, set_name="unseen")]
    rows[3]["correct"] = [True] * 5 + [False] * 5
    rows[4]["correct"] = [True] * 4 + [False] * 6
    for r in rows:
        _write(e.eval_path(r["model"], r["set"], Setting.from_dict(r["setting"])), r)
    _metrics(tmp_path)
    md = e.stage_report().read_text()
    assert "Relative to AR on `unseen`" in md
    assert "## Pass@1 relative to AR" in md and "## Exact match relative to AR" not in md
    assert "| model | decoding | TPF | pass@1 | AR pass@1 (ar_continued, same seed) |" in md
    assert "TPF >= 2.5 with pass@1 >= 95% of the AR decoding" in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| refusion | k=4, 4 blocks")]
    assert len(lines) == 2 and "| 4.50 | 0.700 | 0.800 | 0.875 | - |" in lines[0], lines
    assert "| 4.50 | 0.400 | 0.500 | 0.800 | [" in lines[1], lines


def test_mbpp_times_the_lossless_settings_at_batch_1():
    """mbpp, as math: at batch 1 on the first 100 `test` problems, AR of `ar_continued` and
    draft_ahead / draft_every at k 4, 8 of every ReFusion arm."""
    t = TASKS["mbpp"]
    ones = [(m, s.name()) for m, n, s in t.jobs(arms=["dual_refusion_ar16", "ar_continued"],
                                                 grid="default") if s.batch_size == 1]
    assert ones == [("ar_continued", "ar_bs1")] + [
        ("dual_refusion_ar16", f"refusion_k{k}_b1slot_s0.9_t0.9_{v}_bidir_bs1")
        for v in ("draft_ahead", "draft_every") for k in (4, 8)]
    assert t.latency_examples == 100
    assert t.arms == ("refusion", "ar_continued", "dual_refusion_ar16")
