"""The `make demo` job (scripts/demo.sh): its run config is the recipe of docs/EXPERIMENTS.md
run 5, and its summary (scripts/demo_summary.py) computes exact match, TPF and the share of
answers identical to AR from the decode files, and fails when the draft decode is not lossless
or the loss did not fall. The figures are checked against values worked out by hand here."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "scripts" / "demo_summary.py"


def test_demo_config_is_the_recipe():
    """configs/demo.yaml trains `dual_refusion_ar16` (pipeline/experiment/tasks.py) with its
    row length, and the model fits the demo tokenizer."""
    from omegaconf import OmegaConf
    from pipeline.config import load_config
    from pipeline.experiment.tasks import ARM_OBJECTIVES, ARM_ROW_TOKENS
    os.chdir(ROOT)
    cfg = load_config("configs/demo.yaml")
    for opt in ARM_OBJECTIVES["dual_refusion_ar16"]:
        key, value = opt.split("=")
        assert str(OmegaConf.select(cfg, key)).lower() == value, opt
    assert cfg.data.max_length == ARM_ROW_TOKENS["dual_refusion_ar16"]
    assert cfg.train.zero_stage == 3 and cfg.wandb.mode == "offline"
    script = (ROOT / "scripts" / "demo.sh").read_text()
    assert "SPM_VOCAB=${SPM_VOCAB:-400}" in script and cfg.model.inline.vocab_size >= 400


def _write(tmp, losses, ar_answers, draft_answers, forwards=(40, 20)):
    """Inputs of the summary: metrics with these train losses, 4 problems, two decodes.
    An answer is (token ids, text)."""
    metrics = [{"kind": "train", "step": 10 * (i + 1), "loss": x, "ar_loss": x / 20,
                "mdm_loss": x / 2, "tokens_per_s": 1000.0} for i, x in enumerate(losses)]
    metrics.append({"kind": "val", "step": 10 * len(losses), "val_loss": 1.0,
                    "val_ar_loss": 0.05, "val_mdm_loss": 0.4})
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    refs = ["a 2*3 = <<2*3=6>>6.\n#### 6", "b\n#### 10", "c\n#### 7", "d\n#### 1,000"]
    (tmp / "test.jsonl").write_text("".join(json.dumps({"query": f"q{i}", "response": r}) + "\n"
                                            for i, r in enumerate(refs)))
    for name, answers, f in (("ar", ar_answers, forwards[0]), ("draft", draft_answers,
                                                                 forwards[1])):
        tokens = sum(len(ids) for ids, _ in answers)
        doc = {"settings": {"mode": "refusion" if name == "draft" else "ar",
                            "verify": "draft_ahead", "slot_size": 4},
               "summary": {"tokens": tokens, "forwards": f},
               "results": [{"text": t, "token_ids": ids} for ids, t in answers]}
        (tmp / f"{name}.json").write_text(json.dumps(doc))


def _run(tmp):
    return subprocess.run([sys.executable, str(SUMMARY), "--metrics", str(tmp / "metrics.jsonl"),
                           "--problems", str(tmp / "test.jsonl"), "--ar", str(tmp / "ar.json"),
                           "--draft", str(tmp / "draft.json")], capture_output=True, text=True,
                          cwd=ROOT)


# Two of four final answers right: problem 0 (6) and problem 3 ("1000" = "1,000" after the
# metric's normalization); problem 1 answers 11, problem 2 has no '####'. 40 tokens.
AR = [([1] * 10, "x\n#### 6"), ([2] * 10, "y\n#### 11"), ([3] * 10, "no answer"),
      ([4] * 10, "z\n#### 1000")]


def test_summary_figures_and_lossless_pass(tmp_path):
    _write(tmp_path, [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0], AR, AR)
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # AR: 40 tokens / 40 forwards; draft: 40 / 20. Loss windows: n = 8 // 4 = 2 steps.
    assert "ar               exact match 0.500  TPF 1.00" in out
    assert "draft_ahead k=4  exact match 0.500  TPF 2.00" in out
    assert out.count("answers identical to AR 100%") == 2
    assert "of the first 2 logged steps 8.500 -> of the last 2 2.500" in out
    assert "OK:" in out and "2.00x fewer forwards" in out


def test_summary_fails_when_draft_differs_or_loss_rises(tmp_path):
    draft = [AR[0], AR[1], ([3] * 9 + [5], "no answer"), AR[3]]  # same text, other ids
    _write(tmp_path, [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0], AR, draft)
    r = _run(tmp_path)
    assert r.returncode == 1
    assert "answers identical to AR 75%" in r.stdout
    assert r.stderr.strip() == ("FAIL: draft_ahead k=4 is not lossless: 1 of 4 held-out answers "
                                "differ from AR's (first: problem 2)")
    _write(tmp_path, [2.0, 3.0, 4.0, 5.0], AR, AR)
    r = _run(tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == "FAIL: the training loss did not fall"
    # Fewer decoded answers than problems, and a missing file: one line, exit 2.
    _write(tmp_path, [9.0, 8.0], AR, AR[:3])
    r = _run(tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "3 decoded answers, 4 AR answers, 4 problems" in r.stderr
    (tmp_path / "ar.json").unlink()
    r = _run(tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: demo summary: ") and "ar.json" in r.stderr


def test_summary_prints_the_realized_shares_beside_the_weights(tmp_path):
    """--weights: each source's tokens over the logged steps against its normalized weight."""
    _write(tmp_path, [9.0, 8.0, 7.0, 6.0], AR, AR)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for i, m in enumerate(m for m in lines if m["kind"] == "train"):
        m["tokens_by_source"] = {"math": 90 + i, "stdlib": 10 - i}   # 4 steps: 366 and 34
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    r = subprocess.run([sys.executable, str(SUMMARY), "--metrics", str(tmp_path / "metrics.jsonl"),
                        "--problems", str(tmp_path / "test.jsonl"), "--ar", str(tmp_path / "ar.json"),
                        "--draft", str(tmp_path / "draft.json"), "--weights", "math=9,stdlib=1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert ("data mixture (400 tokens fed over 4 steps): math weight 0.900 realized 0.915, "
            "stdlib weight 0.100 realized 0.085") in r.stdout
