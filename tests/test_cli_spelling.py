"""One spelling per command-line idea across the entry points, the old spellings still accepted
but hidden from --help: --output (generate, evaluate, lm_eval, report), --batch-size,
--tensor-parallel-size (export), dashes for lm_eval's harness options."""
from __future__ import annotations

import json

import pytest


def _help(main, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("module, new, old", [
    ("pipeline.generate", ["--output", "--batch-size"], ["--json-out", "--batch_size"]),
    ("pipeline.evaluate", ["--output", "--batch-size"], ["--json-out", "--batch_size"]),
    ("pipeline.export", ["--tensor-parallel-size"], ["--tp "]),
    ("pipeline.report", ["--output"], ["--out "]),
])
def test_help_lists_the_new_spelling_only(module, new, old, capsys):
    import importlib
    text = _help(importlib.import_module(module).main, capsys)
    for flag in new:
        assert flag in text, (module, flag)
    for flag in old:
        assert flag not in text, (module, flag)


def test_lm_eval_old_and_new_spellings_parse_the_same():
    from pipeline.lm_eval import build_parser
    p = build_parser()
    new = p.parse_args(["--model", "m", "--tasks", "t", "--output", "o", "--batch-size", "3",
                        "--num-fewshot", "2", "--log-samples", "--include-path", "i",
                        "--apply-chat-template", "--fewshot-as-multiturn",
                        "--system-instruction", "s", "--confirm-run-unsafe-code"])
    old = p.parse_args(["--model", "m", "--tasks", "t", "--output_path", "o", "--batch_size", "3",
                        "--num_fewshot", "2", "--log_samples", "--include_path", "i",
                        "--apply_chat_template", "--fewshot_as_multiturn",
                        "--system_instruction", "s", "--confirm_run_unsafe_code"])
    assert vars(new) == vars(old)
    assert (new.output_path, new.batch_size, new.num_fewshot, new.apply_chat_template) == \
        ("o", 3, 2, True)
    defaults = p.parse_args(["--model", "m"])
    assert (defaults.output_path, defaults.batch_size, defaults.log_samples) == (None, 8, False)
    help_text = p.format_help()
    assert "--output_path" not in help_text and "--num_fewshot" not in help_text


def test_report_output_and_its_old_spelling_write_the_same_files(tmp_path, capsys):
    from pipeline.report import main
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"kind": "train", "step": s, "loss": 5.0 - s, "ar_loss": 2.0, "mdm_loss": 3.0 - s,
              "tokens_per_s": 100.0, "step_time_s": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main([str(run), "--output", str(tmp_path / "a")]) == 0
    assert main([str(run), "--out", str(tmp_path / "b")]) == 0
    names = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert names(tmp_path / "a") == names(tmp_path / "b") and "loss.png" in names(tmp_path / "a")
    assert (tmp_path / "a" / "summary.md").read_text() == (tmp_path / "b" / "summary.md").read_text()


def test_experiment_output_and_its_old_spelling_name_the_same_folder(tmp_path, capsys):
    """`python -m pipeline.experiment --output DIR` and the hidden `--out DIR` reach the same
    folder; `--only-report` on a folder without decode results stops with one line (exit 2)."""
    from pipeline.experiment.recipe import main
    for flag in ("--output", "--out"):
        assert main(["--task", "math", flag, str(tmp_path / "exp"), "--only-report"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: --only-report: {tmp_path / 'exp'} holds no decode results of "
                       f"task math (run without --only-report first)"), err
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "--output OUT" in help_text and "--out " not in help_text
