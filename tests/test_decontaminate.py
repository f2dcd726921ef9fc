"""Decontamination in data prep (`shard.py --decontaminate`, data_prep/decontaminate.py): an
evaluation item planted in a corpus record drops the record (counted per evaluation file), a
near miss (n - 1 shared consecutive words) is kept; the dropped records equal those of a plain
Python reference (sets of word n-grams); JSONL and text evaluation files; streamed text files;
a job array and a resumed run give the same shards and counts as one process; a changed
evaluation file and parts made with other settings are refused; bad input is one line, exit 2.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep import cli, decontaminate, sources, train_tokenizer
from test_data_prep import read_samples

N = 13
VOCAB = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
# evaluation items: words outside VOCAB, so random corpus text never shares their n-grams
ITEM_A = ("Sofia has fifteen boxes of eight coins each and she gives six of them away to "
          "her brother Tom before lunch")
ITEM_B = ("A train leaves the station at noon travelling at sixty miles per hour toward the "
          "coast where it meets another train")
PARA = ("the quick brown fox jumps over the lazy dog near the river bank\n"
        "while seven ravens watch from an old oak tree")
COMMON = ["--max-length", "128", "--val-fraction", "0.2", "--shard-samples", "40",
          "--no-progress"]


def _words(s: str) -> list[str]:
    return re.findall(r"\w+", s.casefold())


def _reference_dropped(records: list[dict], items: dict[str, list[str]], n: int) -> dict:
    """{file: indices of records sharing an n-gram with one of its items}: plain sets of word
    tuples, the contents of a record joined in order (the independent reference)."""
    grams = {f: {tuple(w[i:i + n]) for it in its for w in [_words(it)]
                 for i in range(len(w) - n + 1)} for f, its in items.items()}
    out = {f: set() for f in items}
    for r, rec in enumerate(records):
        if "messages" in rec:
            text = [m["content"] for m in rec["messages"]]
        else:
            text = [rec[k] for k in ("query", "response", "text") if k in rec]
        w = [x for t in text for x in _words(t)]
        mine = {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
        for f, g in grams.items():
            if mine & g:
                out[f].add(r)
    return out


def _corpus(d: Path) -> tuple[list[dict], list[dict]]:
    """(big.jsonl records, small.jsonl records): random VOCAB text, pairs and chats, with
    planted items (whole, inside a longer text, split across a pair's query and response, in a
    chat, copied across files) and near misses (n - 1 words of an item)."""
    rng = random.Random(3)
    sent = lambda k: " ".join(rng.choice(VOCAB) for _ in range(k))
    a, b, p = _words(ITEM_A), _words(ITEM_B), _words(PARA)
    big = []
    for i in range(300):
        r = rng.random()
        if r < 0.5:
            big.append({"text": f"doc{i} " + sent(rng.randint(5, 60))})
        elif r < 0.8:
            big.append({"query": f"q{i} " + sent(6), "response": sent(8)})
        else:
            big.append({"messages": [{"role": "user", "content": f"c{i} " + sent(4)},
                                     {"role": "assistant", "content": sent(6)}]})
    big[10] = {"text": f"planted one {sent(5)}. {ITEM_A.upper()}!! {sent(5)}"}
    big[40] = {"text": f"near miss {sent(3)} {' '.join(a[:N - 1])} {sent(3)} {' '.join(a[1:N])}"}
    big[70] = {"query": f"split pair {' '.join(b[:7])}", "response": f"{' '.join(b[7:])} ok"}
    big[100] = {"messages": [{"role": "user", "content": f"chat {' '.join(p[:N])}"},
                             {"role": "assistant", "content": "fine"}]}
    big[130] = {"text": f"both files {' '.join(a[2:2 + N])} and {' '.join(p[3:3 + N])}"}
    big[200] = dict(big[10])                       # an exact copy: dropped again, counted again
    big[250] = {"query": f"near pair {' '.join(b[:N - 1])}", "response": sent(5)}
    small = [dict(big[10]), {"text": f"small near {' '.join(p[:N - 1])}"},
             {"query": "x " + sent(3), "response": sent(4)}]
    d.mkdir(parents=True)
    with open(d / "b_big.jsonl", "w") as f:
        for r in big:
            f.write(json.dumps(r) + "\n")
    with open(d / "a_small.jsonl", "w") as f:
        for r in small:
            f.write(json.dumps(r) + "\n")
    return small, big


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base folder, corpus folder, tokenizer, evaluation files, all records in input order)."""
    base = tmp_path_factory.mktemp("decon")
    small, big = _corpus(base / "in")
    ev = base / "eval"
    ev.mkdir()
    with open(ev / "test.jsonl", "w") as f:  # the experiment's problem records
        f.write(json.dumps({"query": ITEM_A, "response": "She has 114 coins left.",
                            "answer": "114"}) + "\n")
        f.write(json.dumps({"query": ITEM_B, "response": "#### 3", "answer": "3"}) + "\n")
    (ev / "items.txt").write_text(f"short paragraph\n\n{PARA}\n\n\nanother short one\n")
    tok = base / "spm.model"
    assert train_tokenizer.main(["--input", str(base / "in" / "b_big.jsonl"), "--output",
                                 str(tok), "--vocab-size", "400"]) == 0
    return base, base / "in", str(tok), [str(ev / "test.jsonl"), str(ev / "items.txt")], small + big


def _manifest(out) -> dict:
    return json.loads((Path(out) / "manifest.json").read_text())


def _dataset(out) -> tuple[dict, dict]:
    m = _manifest(out)
    samples = {s: [(k, t.tolist(), meta["segments"]) for k, t, meta in rows]
               for s, rows in read_samples(str(out)).items()}
    return samples, {k: m.get(k) for k in ("skipped", "counts", "decontamination")}


def _texts(out, tok) -> str:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tok)
    return "\n".join(sp.decode(t.tolist()) for rows in read_samples(str(out)).values()
                     for _, t, _ in rows)


@pytest.fixture(scope="module")
def one_process(setup):
    base, corpus, tok, evals, _ = setup
    out = base / "one"
    assert cli.main(["--input", str(corpus), "--output", str(out), "--tokenizer", tok,
                     "--decontaminate", ",".join(evals), *COMMON]) == 0
    return out


def test_planted_items_dropped_near_misses_kept(setup, one_process, capsys):
    """Every record holding an item's 13 words (any case and punctuation, split across a
    pair's query and response, in a chat) is dropped and counted under its file, each copy
    counted; n - 1 shared words keep a record; the dropped records are the reference's."""
    base, _, tok, evals, records = setup
    ref = _reference_dropped(records, {evals[0]: [ITEM_A, ITEM_B, "She has 114 coins left."],
                                       evals[1]: [PARA]}, N)
    assert {f: sorted(v) for f, v in ref.items()} == {evals[0]: [0, 13, 73, 133, 203],
                                                      evals[1]: [103, 133]}
    m = _manifest(one_process)
    assert m["skipped"]["contaminated"] == 6  # records 0, 13, 73, 103, 133, 203
    d = m["decontamination"]
    assert d["ngram"] == N and d["fields"] is None
    assert d["files"][evals[0]] == {
        "sha256": __import__("hashlib").sha256(Path(evals[0]).read_bytes()).hexdigest(),
        "items": 2, "short_items": 4, "dropped_documents": 5}
    assert d["files"][evals[1]]["items"] == 1 and d["files"][evals[1]]["short_items"] == 2
    assert d["files"][evals[1]]["dropped_documents"] == 2
    assert m["options"]["decontaminate"]["files"][1]["name"] == evals[1]
    text = _texts(one_process, tok)
    for gone in ("planted one", "split pair", "chat", "both files"):
        assert gone not in text
    for kept in ("near miss", "near pair", "small near"):
        assert kept in text
    # the same corpus without --decontaminate keeps them, and has one more duplicate
    out = base / "plain"
    assert cli.main(["--input", str(setup[1]), "--output", str(out), "--tokenizer", tok,
                     *COMMON]) == 0
    plain = _manifest(out)
    assert "decontamination" not in plain and "decontaminate" not in plain["options"]
    assert plain["skipped"].get("duplicate", 0) == m["skipped"].get("duplicate", 0) + 2
    assert plain["counts"]["records"] == m["counts"]["records"] + 6 - 2
    assert "planted one" in _texts(out, tok)
    capsys.readouterr()


def test_summary_and_warning_name_the_match(setup, capsys, tmp_path):
    base, corpus, tok, evals, _ = setup
    assert cli.main(["--input", str(corpus / "b_big.jsonl"), "--output", str(tmp_path / "o"),
                     "--tokenizer", tok, "--decontaminate", evals[0], *COMMON]) == 0
    err = capsys.readouterr().err
    assert (f'skipped (contaminated) {corpus / "b_big.jsonl"}#11: shares the 13-word sequence '
            f'"{" ".join(_words(ITEM_A)[:N])}" with {evals[0]}:1') in err
    assert "records sharing one with test.jsonl 4" in err
    assert "contaminated 4" in err


def test_eval_files_jsonl_fields_and_text_paragraphs(tmp_path):
    """Items: every string value of a JSONL record (nested ones too) or the named fields
    (dotted paths); a JSON list; text paragraphs with their first line; short items counted."""
    long1 = " ".join(f"w{i}" for i in range(20))
    long2 = " ".join(f"v{i}" for i in range(15))
    p = tmp_path / "e.jsonl"
    p.write_text(json.dumps({"doc": {"question": long1, "choices": [long2, "yes"]},
                             "label": 2, "id": "x1"}) + "\n\n"
                 + json.dumps({"doc": {"question": long2, "choices": []}, "id": "x2"}) + "\n")
    ev = decontaminate.EvalSets([str(p)], N)
    assert ev.files[0]["items"] == 3 and ev.files[0]["short_items"] == 3
    ev = decontaminate.EvalSets([str(p)], N, ["doc.question"])
    assert ev.files[0]["items"] == 2 and ev.files[0]["short_items"] == 0
    assert ev.item_lines == [1, 3]
    assert ev.grams.size == (20 - N + 1) + (15 - N + 1) == ev.pos.size
    lst = tmp_path / "l.json"
    lst.write_text(json.dumps([{"q": long1}, {"q": "short"}]))
    ev = decontaminate.EvalSets([str(lst)], N)
    assert (ev.files[0]["items"], ev.files[0]["short_items"], ev.item_lines) == (1, 1, [1])
    t = tmp_path / "t.txt"
    half = long1.split()
    t.write_text(f"\n{' '.join(half[:9])}\n{' '.join(half[9:])}\n\nshort one\n  \n{long2}")
    ev = decontaminate.EvalSets([str(t)], N)
    assert (ev.files[0]["items"], ev.files[0]["short_items"], ev.item_lines) == (2, 1, [2, 7])
    m = ev.matcher()
    m.feed("prefix " + " ".join(long1.split()[5:5 + N]).upper() + " suffix")
    assert m.finish() == {0} and m.where.endswith(f"{t}:2")
    m = ev.matcher()
    m.feed(" ".join(long1.split()[5:5 + N - 1]) + " other " + " ".join(long1.split()[6 + N:]))
    assert m.finish() == set() and m.where is None
    ev4 = decontaminate.EvalSets([str(t)], 4)  # a smaller n uses the short paragraph's items
    assert (ev4.files[0]["items"], ev4.files[0]["short_items"]) == (2, 1)


def test_streamed_blocks_equal_whole_strings():
    """A text fed in blocks of any size (words cut at block ends) matches as the whole text;
    the n-gram hashes agree with a direct polynomial over the word hashes."""
    rng = random.Random(1)
    text = " ".join(rng.choice(["ab", "c_d", "Éé", "x1", "zz", ".", "--"]) for _ in range(400))
    w = _words(text)
    item = " ".join(w[150:150 + N])
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        Path(d, "i.txt").write_text(item)
        ev = decontaminate.EvalSets([str(Path(d, "i.txt"))], N)
    for block in (1, 2, 3, 7, 64, 10 ** 6):
        m = ev.matcher()
        for i in range(0, len(text), block):
            m.feed(text[i:i + block], final=False)
        assert m.finish() == {0}, block
    m = ev.matcher()
    m.feed(" ".join(w[:150 + N - 1]))
    assert m.finish() == set()
    wh = ev.hashes.of(w[:20])
    direct = [sum(int(wh[i + k]) * pow(0x9E3779B97F4A7C15, N - 1 - k, 2 ** 64)
                  for k in range(N)) % 2 ** 64 for i in range(20 - N + 1)]
    assert decontaminate.ngram_hashes(wh, N).tolist() == direct


def test_streamed_text_file_is_checked(setup, capsys, tmp_path, monkeypatch):
    """A text file read as a stream (`sources.TextFile`, here from 300 bytes in 64-byte
    blocks) is checked as it is scanned: planted, dropped; near miss, kept."""
    _, _, tok, evals, _ = setup
    monkeypatch.setattr(sources, "STREAM_TEXT_BYTES", 300)
    monkeypatch.setattr(sources, "_BLOCK", 64)
    rng = random.Random(2)
    filler = lambda: " ".join(rng.choice(VOCAB) for _ in range(60))
    d = tmp_path / "txt"
    d.mkdir()
    (d / "planted.txt").write_text(f"{filler()} {ITEM_B} {filler()}")
    b = _words(ITEM_B)
    (d / "near.txt").write_text(f"{filler()} {' '.join(b[:N - 1])} {filler()}")
    assert cli.main(["--input", str(d), "--output", str(tmp_path / "o"), "--tokenizer", tok,
                     "--decontaminate", evals[0], "--max-length", "64", "--no-progress"]) == 0
    m = _manifest(tmp_path / "o")
    assert m["skipped"] == {"contaminated": 1}
    assert m["decontamination"]["files"][evals[0]]["dropped_documents"] == 1
    assert m["counts"]["records"] == 1
    # half the records dropped: a note, not an error (a filter the options ask for)
    assert "note: skipped contaminated 1 of 2 input records (50.0%)" in capsys.readouterr().err


def test_limit_counts_only_records_before_the_stop(setup, capsys, tmp_path):
    """--limit N: the contaminated records before the N-th accepted one are counted, those
    after it are not (big.jsonl: planted at records 10 and 70)."""
    _, corpus, tok, evals, _ = setup
    for limit, want in ((5, 0), (30, 1), (80, 2)):
        out = tmp_path / f"l{limit}"
        assert cli.main(["--input", str(corpus / "b_big.jsonl"), "--output", str(out),
                         "--tokenizer", tok, "--decontaminate", evals[0], "--limit", str(limit),
                         *COMMON]) == 0
        m = _manifest(out)
        assert m["counts"]["records"] == limit
        assert m["skipped"].get("contaminated", 0) == want, limit
        assert m["decontamination"]["files"][evals[0]]["dropped_documents"] == want
    capsys.readouterr()


def test_array_and_resume_equal_one_process(setup, one_process, capsys, tmp_path):
    """plan / run (K = 3, reverse order) / merge and an interrupted then resumed run give the
    one-process run's samples, skip counts, counts and decontamination counts; the planted
    copies sit in different work units."""
    base, corpus, tok, evals, _ = setup
    want = _dataset(one_process)
    out = tmp_path / "arr"
    assert cli.main(["plan", "--input", str(corpus), "--output", str(out), "--tokenizer", tok,
                     "--unit-bytes", "8000", "--decontaminate", evals[0],
                     "--decontaminate", evals[1], *COMMON]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["units"]) >= 4
    assert plan["options"]["decontaminate"] == _manifest(one_process)["options"]["decontaminate"]
    for t in (2, 1, 0):
        assert cli.main(["run", "--output", str(out), "--task", str(t), "--num-tasks", "3"]) == 0
    assert cli.main(["merge", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "records sharing one with test.jsonl 5, items.txt 2" in err
    got = _dataset(out)
    assert got[1] == want[1]
    assert got[0] == want[0]
    parts = [json.loads(p.read_text()) for p in sorted(out.glob("parts/u*/manifest.json"))]
    assert sum(1 for p in parts if p["skipped"].get("contaminated")) >= 3
    # interrupted after one shard, resumed: the same folder as one uninterrupted run
    res = tmp_path / "res"
    args = ["--input", str(corpus), "--output", str(res), "--tokenizer", tok,
            "--decontaminate", ",".join(evals), *COMMON]
    assert cli.main([*args, "--stop-after-shards", "1"]) == 0
    assert not (res / "manifest.json").exists()
    assert cli.main(args) == 0
    assert "resuming: keeping 1 complete shard(s)" in capsys.readouterr().err
    assert _dataset(res) == want


def test_changed_eval_file_and_other_settings_refused(setup, capsys, tmp_path):
    """A file changed between plan and run: the run refuses, naming it; a part made with
    another n: the merge refuses, naming the option; a rerun of the one-machine command
    after a file changed: refused, naming it."""
    base, corpus, tok, evals, _ = setup
    ev = tmp_path / "ev.jsonl"
    shutil.copy(evals[0], ev)
    plan = ["plan", "--input", str(corpus / "a_small.jsonl"), "--tokenizer", tok,
            "--decontaminate", str(ev), *COMMON]
    assert cli.main([*plan, "--output", str(tmp_path / "a")]) == 0
    ev.write_text(ev.read_text() + json.dumps({"query": "added"}) + "\n")
    capsys.readouterr()
    assert cli.main(["run", "--output", str(tmp_path / "a"), "--task", "0", "--num-tasks", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--decontaminate {ev}: changed since the plan" in err
    assert "shard.py plan ... --overwrite" in err
    # parts of a plan with another n
    assert cli.main([*plan, "--output", str(tmp_path / "b")]) == 0
    assert cli.main([*plan, "--output", str(tmp_path / "c"), "--decontaminate-ngram", "8"]) == 0
    for o in ("b", "c"):
        assert cli.main(["run", "--output", str(tmp_path / o), "--task", "0", "--num-tasks", "1"]) == 0
    shutil.rmtree(tmp_path / "b" / "parts" / "u000000")
    shutil.copytree(tmp_path / "c" / "parts" / "u000000", tmp_path / "b" / "parts" / "u000000")
    capsys.readouterr()
    assert cli.main(["merge", "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "made from another plan" in err
    assert '"ngram": 13' in err and '"ngram": 8' in err and "--decontaminate" in err
    # the one-machine command over a folder made before the file changed
    one = ["--input", str(corpus / "a_small.jsonl"), "--output", str(tmp_path / "d"),
           "--tokenizer", tok, "--decontaminate", str(ev), *COMMON]
    assert cli.main(one) == 0
    ev.write_text(ev.read_text() + json.dumps({"query": "again"}) + "\n")
    capsys.readouterr()
    assert cli.main(one) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--decontaminate {ev}: changed (sha256" in err


@pytest.mark.parametrize("content, extra, message", [
    (None, [], "{f}: no such file"),
    ("", [], "{f}: empty file"),
    ('{"query": "fine"}\n{"query": broken\n', [], "{f}:2: not a JSON line"),
    ('{"query": "only a few words"}\n', [], "{f}: no item of 13 or more words (1 shorter)"),
    ('{"q": "%s"}\n' % ITEM_A, ["--decontaminate-field", "query"],
     '{f}: line 1 has no field "query" (--decontaminate-field)'),
    (b"\xff\xfe bad", [], "{f}: not UTF-8 (byte 0)"),
])
def test_bad_eval_files_one_line_exit_2(setup, capsys, tmp_path, content, extra, message):
    _, corpus, tok, _, _ = setup
    f = tmp_path / "ev.jsonl"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    for stage in ([], ["plan"]):
        code = cli.main([*stage, "--input", str(corpus / "a_small.jsonl"), "--output",
                         str(tmp_path / f"o{len(stage)}"), "--tokenizer", tok,
                         "--decontaminate", str(f), *extra, *COMMON])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert err.count("\n") == 0 and "Traceback" not in err
        assert f"shard.py: error: --decontaminate {message.format(f=f)}" in err


def test_option_errors_one_line_exit_2(setup, capsys, tmp_path):
    _, corpus, tok, evals, _ = setup
    base = ["--input", str(corpus / "a_small.jsonl"), "--output", str(tmp_path / "o"),
            "--tokenizer", tok]
    for extra, message in (
            (["--decontaminate-ngram", "8"], "--decontaminate-ngram and --decontaminate-field "
                                              "need --decontaminate"),
            (["--decontaminate", evals[0], "--decontaminate-ngram", "0"],
             "--decontaminate-ngram must be >= 1"),
            (["--decontaminate", f"{evals[0]},{evals[0]}"], f"--decontaminate {evals[0]}: given twice")):
        with pytest.raises(SystemExit) as e:
            code = cli.main([*base, *extra])
            raise SystemExit(code)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and message in err, err


def test_index_arrays_and_collision_confirmation(tmp_path):
    """Items' n-gram hashes are sorted with their positions; a forced hash collision (an
    index whose hash of one n-gram is set to another's) is not a match."""
    p = tmp_path / "e.txt"
    a = " ".join(f"a{i}" for i in range(N))
    b = " ".join(f"b{i}" for i in range(N))
    p.write_text(f"{a}\n\n{b}\n")
    ev = decontaminate.EvalSets([str(p)], N)
    assert ev.grams.size == 2 and bool(ev.grams[0] <= ev.grams[1])
    assert ev.nbytes() == 8 * 2 * N + 8 * 2 + 8 * 2 + ev.bitmap.nbytes
    assert ev.bitmap.nbytes * 8 >= 32 * 2
    # the bitmap + binary search finds exactly the hashes present (numpy's isin as reference)
    rng = np.random.default_rng(0)
    h = np.concatenate([rng.integers(0, 2 ** 63, 5000, dtype=np.int64).astype(np.uint64) * 2,
                        ev.grams, ev.grams[::-1] ^ np.uint64(1 << 63)])
    rng.shuffle(h)
    assert ev.candidates(h).tolist() == np.nonzero(np.isin(h, ev.grams))[0].tolist()
    assert ev.candidates(h).size == 2
    m = ev.matcher()
    m.feed(b)
    assert m.finish() == {0}
    # make b's n-gram hash point at a's position only: b is then a collision, not a match
    ib = int(np.nonzero(ev.pos == N)[0][0])
    ev.pos[ib] = 0
    m = ev.matcher()
    m.feed(b)
    assert m.finish() == set()


def test_relative_eval_path_is_recorded_absolute(setup, capsys, tmp_path, monkeypatch):
    """A relative --decontaminate path is recorded as its absolute path, so array tasks
    started in another folder read the same file."""
    _, corpus, tok, evals, _ = setup
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(evals[0], tmp_path / "a" / "t.jsonl")
    monkeypatch.chdir(tmp_path / "a")
    out = tmp_path / "o"
    assert cli.main(["plan", "--input", str(corpus / "b_big.jsonl"), "--output", str(out),
                     "--tokenizer", tok, "--decontaminate", "t.jsonl", *COMMON]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["options"]["decontaminate"]["files"][0]["name"] == str(tmp_path / "a" / "t.jsonl")
    monkeypatch.chdir(tmp_path / "b")
    assert cli.main(["run", "--output", str(out), "--task", "0", "--num-tasks", "1"]) == 0
    assert cli.main(["merge", "--output", str(out)]) == 0
    m = _manifest(out)
    assert m["decontamination"]["files"][str(tmp_path / "a" / "t.jsonl")]["dropped_documents"] == 4
    capsys.readouterr()
