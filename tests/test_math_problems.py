"""data_prep/math_problems.py: the GSM8K-form problem generator (determinism, splits, answer
format and arithmetic, the CLI, and that shard.py reads its JSONL), and the final-answer metric
(`pipeline.inference.evaluation.final_answer`) on the generated answers and on GSM8K-style strings.

The arithmetic is checked independently of the generator's own `check_response`: every
`<<a op b=c>>c` annotation is parsed here and evaluated with Python's `fractions.Fraction`."""
import json
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from data_prep import math_problems as mp

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"train": 3000, "test": 150, "dev": 150, "test_unseen": 90}
STEP_LINE = re.compile(r"^.+ (\d+)([-+*/])(\d+) = <<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)( [a-z ]+)?\.$")


@pytest.fixture(scope="module")
def splits():
    return mp.generate(SIZES, seed=3)


def test_generation_is_deterministic_and_seeded(tmp_path):
    a = mp.generate(SIZES, seed=3)
    b = mp.generate(SIZES, seed=3)
    assert {s: [p.record() for p in v] for s, v in a.items()} == \
        {s: [p.record() for p in v] for s, v in b.items()}
    c = mp.generate(SIZES, seed=4)
    assert [p.key for p in a["train"][:50]] != [p.key for p in c["train"][:50]]
    # The written files are byte-identical across runs.
    mp.write_splits(tmp_path / "x", SIZES, seed=3)
    mp.write_splits(tmp_path / "y", SIZES, seed=3)
    for name in ("train.jsonl", "test.jsonl", "dev.jsonl", "test_unseen.jsonl", "info.json"):
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes()


def test_sizes_and_splits_are_disjoint_by_problem(splits):
    assert {s: len(v) for s, v in splits.items()} == SIZES
    keys = {s: [p.key for p in v] for s, v in splits.items()}
    for s, k in keys.items():
        assert len(set(k)) == len(k), s                        # a problem at most once per split
    assert not set(keys["train"]) & set(keys["test"])
    assert not set(keys["train"]) & set(keys["dev"])
    assert not set(keys["test"]) & set(keys["dev"])
    # The pool is a function of the key alone (not of the seed or the sizes): no held-out key
    # of any seed can be a training key of another seed.
    other = mp.generate({"train": 3000, "test": 0, "dev": 0, "test_unseen": 0}, seed=9)
    assert not {p.key for p in other["train"]} & set(keys["test"] + keys["dev"])
    # Same templates in train, test and dev; the unseen set only from templates never trained.
    seen = {p.template for p in splits["train"]}
    assert seen == set(mp.TRAIN_TEMPLATES)
    assert {p.template for p in splits["test"]} <= seen
    unseen = {p.template for p in splits["test_unseen"]}
    assert unseen == set(mp.UNSEEN_TEMPLATES) and not unseen & seen
    # The key is the template and its numbers: the question text holds those numbers.
    for p in splits["test"][:30]:
        for n in p.numbers:
            # (ages writes its multiplier as a word: twice, three times, four times)
            assert str(n) in p.question or (p.template == "ages" and n in (2, 3, 4))


def _checked_steps(response: str) -> int:
    """Parse a worked answer independently; return its final answer."""
    *lines, last = response.split("\n")
    assert re.fullmatch(r"#### \d+", last), last
    assert 2 <= len(lines) <= 4
    prev = []
    for line in lines:
        m = STEP_LINE.match(line)
        assert m, line
        a, op, b, a2, op2, b2, c, shown = m.group(1, 2, 3, 4, 5, 6, 7, 8)
        assert (a, op, b) == (a2, op2, b2) and c == shown     # text and annotation agree
        x, y = Fraction(int(a)), Fraction(int(b))
        value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op]
        assert value.denominator == 1 and value == int(c), line
        assert 0 <= int(c) <= mp.MAX_VALUE
        prev.append(int(c))
    assert int(last[5:]) == prev[-1]
    return prev[-1]


def test_answers_have_the_gsm8k_form_and_right_arithmetic(splits):
    for s, problems in splits.items():
        for p in problems:
            r = p.record()
            assert set(r) == {"query", "response", "answer", "template", "key"}
            assert r["query"].endswith("?") and "<<" not in r["query"]
            assert _checked_steps(r["response"]) == r["answer"]
            assert mp.check_response(r["response"]) == r["answer"]


def test_check_response_rejects_wrong_arithmetic_and_form():
    good = "He has 4*6 = <<4*6=24>>24 pens.\nHe has 24-5 = <<24-5=19>>19 pens left.\n#### 19"
    assert mp.check_response(good) == 19
    for bad in (good.replace("=24>>24", "=25>>25"), good.replace(">>19 pens", ">>18 pens"),
                good.replace("#### 19", "The answer is 19"),
                "He has 7/2 = <<7/2=3>>3 pens.\n#### 3"):
        with pytest.raises(ValueError):
            mp.check_response(bad)


def test_final_answer_metric():
    from pipeline.inference.evaluation import answers_match, final_answer
    assert final_answer("a\nb <<3*6=18>>18.\n#### 72") == "72"
    assert final_answer("#### 1,234") == "1234" and final_answer("####-5") == "-5"
    assert final_answer("#### 72.0") == "72" and final_answer("#### 7.5.") == "7.5"
    assert final_answer("The answer is 72") is None and final_answer("#### x") is None
    assert final_answer("#### 12\n#### 13") == "12"          # the first one, as GSM8K's regex
    ref = "He has 4*6 = <<4*6=24>>24 pens.\n#### 24"
    # Right final number with a different (even wrong) derivation: a hit, as in GSM8K.
    assert answers_match("She has 4*6 = <<4*6=23>>24 pens.\n#### 24", ref, "final_answer")
    assert not answers_match("He has 4*6 = <<4*6=24>>24 pens.\n#### 25", ref, "final_answer")
    assert not answers_match("He has 4*6 = <<4*6=24>>24 pens.", ref, "final_answer")
    assert not answers_match("no answer", "no answer either", "final_answer")   # None != hit
    assert answers_match(" same text\n", "same text") and not answers_match("a", "b")
    for p in mp.generate({"train": 0, "test": 40, "dev": 0, "test_unseen": 10}).values():
        for x in p:
            assert final_answer(x.response()) == str(x.answer)


def test_cli_writes_jsonl_that_shard_py_reads(tmp_path):
    out = tmp_path / "math"
    r = subprocess.run([sys.executable, "data_prep/math_problems.py", "--output", str(out),
                        "--train", "400", "--test", "20", "--dev", "20", "--test-unseen", "10",
                        "--seed", "1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads((out / "info.json").read_text())
    assert info["sizes"] == {"train": 400, "test": 20, "dev": 20, "test_unseen": 10}
    assert sum(info["template_counts"]["train"].values()) == 400
    assert len((out / "train.jsonl").read_text().splitlines()) == 400
    tok = tmp_path / "spm.model"
    r = subprocess.run([sys.executable, "data_prep/train_tokenizer.py", "--input",
                        str(out / "train.jsonl"), "--output", str(tok), "--vocab-size", "400"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "data_prep/shard.py", "--input", str(out / "train.jsonl"),
                        "--tokenizer", str(tok), "--output", str(tmp_path / "shards"),
                        "--max-length", "256", "--val-fraction", "0.1", "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    n = sum(e["samples"] for s in ("train", "val") for e in manifest["splits"][s])
    assert n == 400 and not manifest["skipped"].get("over_length")
    bad = subprocess.run([sys.executable, "data_prep/math_problems.py", "--output",
                          str(tmp_path / "b"), "--train", "-1"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--train" in bad.stderr


def test_templates_and_max_value_restrict_the_distribution(tmp_path):
    """--templates / --max-value (the demo's easy distribution): train, test and dev hold only
    the chosen templates, every number of every question and annotation is <= the bound
    (read back from the text, not from the generator), the pools are still disjoint by key,
    and bad values stop with one line and exit 2."""
    sizes = {"train": 600, "test": 40, "dev": 20, "test_unseen": 10}
    got = mp.generate(sizes, seed=2, templates=["share", "packs"], max_value=60)
    for split in ("train", "test", "dev"):
        assert {p.template for p in got[split]} == {"share", "packs"}, split
    assert {p.template for p in got["test_unseen"]} <= set(mp.UNSEEN_TEMPLATES)
    for p in (p for v in got.values() for p in v):
        numbers = [int(x) for x in re.findall(r"\d+", p.question + "\n" + p.response())]
        assert max(numbers) <= 60, p.record()
        assert mp.check_response(p.response()) == p.answer
    keys = {s: {p.key for p in v} for s, v in got.items()}
    assert not keys["train"] & (keys["test"] | keys["dev"])
    assert all(mp.pool_of(k) == "test" for k in keys["test"])
    # The defaults are the full distribution: numbers above 60 occur.
    full = mp.generate({"train": 200, "test": 0, "dev": 0, "test_unseen": 0}, seed=2)
    assert max(max(s.c for s in p.steps) for p in full["train"]) > 60
    assert len({p.template for p in full["train"]}) == len(mp.TRAIN_TEMPLATES)

    out = tmp_path / "easy"
    r = subprocess.run([sys.executable, "data_prep/math_problems.py", "--output", str(out),
                        "--train", "50", "--test", "5", "--dev", "0", "--test-unseen", "0",
                        "--templates", "pages", "--max-value", "80"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads((out / "info.json").read_text())
    assert info["train_templates"] == ["pages"] and info["max_value"] == 80
    assert info["template_counts"]["train"] == {"pages": 50}
    for args, msg in ((["--templates", "packs,nope"], "--templates: unknown nope"),
                      (["--templates", ","], "--templates: none given"),
                      (["--max-value", "0"], "--max-value must be >= 1"),
                      (["--max-value", "3", "--templates", "pages"],
                       "--max-value 3: template 'pages' has no problem")):
        bad = subprocess.run([sys.executable, "data_prep/math_problems.py", "--output",
                              str(tmp_path / "b"), "--train", "5", *args], cwd=ROOT,
                             capture_output=True, text=True)
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {msg}"), bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
