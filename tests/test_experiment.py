"""pipeline.experiment: the report stage (tables, frontier, target check, figures) from cached
evaluation results and metrics files written here; the training/decoding stages are the
trainer's, exporter's and evaluator's (tested in their own files)."""
import json

import pytest

from pipeline import experiment as ex


def _row(model, mode, setting, tpf, em, acc, tps=100.0):
    return {"model": model, "mode": mode, "setting": setting, "examples": 10, "tpf": tpf,
            "tps": tps, "exact_match": em, "token_accuracy": acc, "tokens": 50, "forwards": 25,
            "seconds": 1.0}


def test_grid_names_are_unique_and_ar_uses_the_same_length():
    grid = ex.grid_settings()
    assert len(grid) == 2 * 2 * 3
    names = {ex.setting_name("refusion", s) for s in grid}
    assert len(names) == len(grid) and ex.setting_name("ar", None) == "ar"
    for s in grid:   # every slot size divides the generation length: same length for AR
        assert ex.GEN_LENGTH % s["slot_size"] == 0
        assert (ex.GEN_LENGTH // s["slot_size"]) % ex.NUM_BLOCKS == 0
    assert ex.decode_args(None).gen_length == ex.GEN_LENGTH


def test_pareto_drops_dominated_settings():
    a = _row("refusion", "refusion", {"k": 1}, 2.0, 0.10, 0.5)
    b = _row("refusion", "refusion", {"k": 2}, 1.0, 0.20, 0.6)
    c = _row("refusion", "refusion", {"k": 3}, 1.0, 0.10, 0.5)   # dominated by a and b
    d = _row("refusion", "refusion", {"k": 4}, 2.0, 0.10, 0.5)   # equal to a: both kept
    assert ex.pareto([a, b, c, d]) == [b, a, d]


def test_report_stage_writes_tables_figures_and_the_target_check(tmp_path):
    e = ex.Experiment(str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1, nproc=1,
                      config="configs/experiment.yaml", micro_batch_size=2)
    grid = ex.grid_settings()
    rows = [_row("ar_continued", "ar", None, 1.0, 0.20, 0.50),
            _row("refusion", "ar", None, 1.0, 0.18, 0.45),
            _row("refusion", "refusion", grid[0], 1.6, 0.19, 0.44),    # meets the target
            _row("refusion", "refusion", grid[1], 2.5, 0.10, 0.30),    # fast, inaccurate
            _row("refusion", "refusion", {"slot_size": 99}, 9.0, 1.0, 1.0)]  # not in grid
    for i, r in enumerate(rows):
        (tmp_path / "eval").mkdir(exist_ok=True)
        (tmp_path / "eval" / f"r{i}.json").write_text(json.dumps(r))
    (tmp_path / "eval" / "refusion__val_loss.json").write_text(json.dumps(
        {"model": "refusion", "loss": {"val_loss": 5.0, "val_ar_loss": 2.0,
                                       "val_mdm_loss": 3.0}}))
    for name, mdm in (("pretrain_ar", 0.0), ("refusion", 1.5)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(
            {"kind": "train", "step": s, "loss": 3.0 + mdm, "ar_loss": 3.0, "mdm_loss": mdm,
             "consumed_tokens": 100 * s}) + "\n" for s in (1, 2)))
    (tmp_path / "diagnose").mkdir()
    (tmp_path / "diagnose" / "refusion__slot_acceptance_k4.json").write_text(json.dumps(
        {"model": "refusion", "slots": 12, "slot_size": 4, "first_token_accuracy": 0.5,
         "draft_accuracy_by_offset": [0.5, 0.25, 0.125, None], "exact_slot_drafts": 0.125,
         "accepted": {"0.1": 2.5, "0.5": 1.75, "0.9": 1.25},
         "accepted_correct": {"0.1": 1.0, "0.5": 0.75, "0.9": 0.5},
         "ar_next_token_accuracy": 0.625}))
    md = e.stage_report().read_text()
    assert ("| refusion | 4 | 12 | 0.500 | 0.50 0.25 0.12 | 0.125 | 2.50 / 1.75 / 1.25 | "
            "1.00 / 0.75 / 0.50 | 0.625 |") in md
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "| refusion | refusion | 4 | 0.5 | 0.1 | 1.60 | 100 | 0.190 | 0.440 |" in md
    assert "| 99 |" not in md and "9.00" not in md            # results of another grid ignored
    assert "i.e. >= 0.180): reached by 1 setting(s)." in md
    assert "exact-match side of the target is empty" not in md
    assert "| refusion | 5.0000 | 2.0000 | 3.0000 |" in md
    # The AR run's logged MDM term (0) is not reported as an MDM loss; steps are the run's own.
    assert "| 1. AR pretraining (from scratch) | 2 | 200 | 3.000 (3.000 / -) |" in md
    assert "| 2a. ReFusion fine-tuning | 2 | 200 | 4.500 (3.000 / 1.500) |" in md


def test_frontier_plot_draws_one_point_per_setting(tmp_path):
    grid = ex.grid_settings()
    rows = [_row("refusion", "refusion", s, 1.0 + i / 10, 0.1, 0.2) for i, s in enumerate(grid)]
    rows.append(_row("ar_continued", "ar", None, 1.0, 0.3, 0.4))
    drawn = ex.plot_frontier(rows, tmp_path / "f.png")
    panel = drawn["TPF (tokens per forward) vs exact match"]
    assert panel["AR decoding of ar_continued"] == ([0.3], [1.0])
    refusion_tpf = sorted(y for k, (xs, ys) in panel.items() if k.startswith("ReFusion")
                          for y in ys)
    assert refusion_tpf == pytest.approx([1.0 + i / 10 for i in range(len(grid))])


def test_target_check_says_when_the_baseline_exact_match_is_zero(tmp_path):
    e = ex.Experiment(str(tmp_path), pretrain_steps=4, finetune_steps=2, threads=1, nproc=1,
                      config="configs/experiment.yaml", micro_batch_size=2)
    (tmp_path / "eval").mkdir()
    for i, r in enumerate([_row("ar_continued", "ar", None, 1.0, 0.0, 0.14),
                           _row("refusion", "refusion", ex.grid_settings()[0], 0.7, 0.0, 0.15)]):
        (tmp_path / "eval" / f"r{i}.json").write_text(json.dumps(r))
    md = e.stage_report().read_text()
    assert "i.e. >= 0.000): not reached." in md          # TPF 0.7 < 1.5
    assert "exact-match side of the target is empty" in md
