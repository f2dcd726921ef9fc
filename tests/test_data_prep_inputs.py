"""data_prep/shard.py: input identity (stale output, resume), long texts in pieces, skip shares.

References we did not write: the Qwen3 tokenizer through transformers (whole-text encode),
SentencePiece's own encoder, hashlib / os.stat for the recorded identities, and runs into an
empty folder (for --overwrite and resume).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import fsspec
import numpy as np
import pytest

from data_prep import cli, prepare, sources, stdlib_corpus
from pipeline import tokenizer as tokenizer_io
from pipeline.tokenizer import (encode_piece, load_tokenizer, piecewise_ok, qwen3_tokenizer_dir,
                                    text_pieces)
from tests.test_data_prep import folder_bytes, read_samples, run_shard, write_jsonl
from tests.test_shard_io import http_server  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    from data_prep import train_tokenizer
    d = tmp_path_factory.mktemp("spm_inputs")
    (d / "train.txt").write_text(real_text(120_000))
    assert train_tokenizer.main(["--input", str(d / "train.txt"), "--output", str(d / "spm.model"),
                                 "--vocab-size", "500"]) == 0
    return str(d / "spm.model")


def real_text(n_chars: int) -> str:
    """Real prose and code: stdlib modules, concatenated, cut to n_chars."""
    root, out = stdlib_corpus.stdlib_root(), []
    for rel in ("textwrap.py", "argparse.py", "json/decoder.py", "difflib.py", "typing.py"):
        out.append(Path(root, rel).read_text(encoding="utf-8"))
        if sum(map(len, out)) >= n_chars:
            break
    return "".join(out)[:n_chars]


def qa_rows(n: int, start: int = 0) -> list[dict]:
    return [{"query": f"question {i}", "response": f"answer {i}"} for i in range(start, start + n)]


# ----------------------------------------------------------------------------- input identity

def test_manifest_records_inputs_and_a_changed_input_is_refused(tmp_path, spm_model, capsys):
    d = tmp_path / "in"
    d.mkdir()
    a = write_jsonl(d / "a.jsonl", qa_rows(20))
    (d / "b.txt").write_text("a plain document\n")
    args = ["--input", d, "--tokenizer", spm_model, "--max-length", 64]
    out = tmp_path / "out"
    assert run_shard(capsys, *args, "--output", out)[0] == 0
    m = json.loads((out / "manifest.json").read_text())
    want = []
    for p in (a, d / "b.txt"):
        st = os.stat(p)
        want.append({"name": str(p), "size": st.st_size, "mtime": st.st_mtime,
                     "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    assert m["inputs"] == want
    before = folder_bytes(out)
    # 200 records appended: refused in one line naming the input, nothing touched
    old_size = a.stat().st_size
    with open(a, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in qa_rows(200, start=20))
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"shard.py: error: {out}/manifest.json: input {a} changed (size "
                          f"{old_size} bytes, now {a.stat().st_size} bytes; modified "), err
    assert err.strip().endswith("since these shards were made; pass --overwrite to make the "
                                "shards again from the current inputs, or use another --output")
    assert folder_bytes(out) == before
    # --overwrite: made again, equal to a run into an empty folder
    code, err = run_shard(capsys, *args, "--output", out, "--overwrite")
    assert code == 0 and "train 221 samples" in err, err
    assert run_shard(capsys, *args, "--output", tmp_path / "fresh")[0] == 0
    assert folder_bytes(out) == folder_bytes(tmp_path / "fresh")
    # touched (or copied) with the same bytes: the sha256 says it is the same input
    os.utime(a, (1_000_000_000, 1_000_000_000))
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 0 and "already complete (same options, inputs unchanged)" in err, err
    # a new file in the folder, a file gone
    write_jsonl(d / "c.jsonl", qa_rows(3, start=500))
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 2 and f"input {d / 'c.jsonl'} is new since these shards were made" in err, err
    (d / "c.jsonl").unlink()
    (d / "b.txt").unlink()
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 2 and f"input {d / 'b.txt'} is gone since" in err, err


def test_resumed_run_verifies_its_inputs(tmp_path, spm_model, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", qa_rows(10))
    b = write_jsonl(tmp_path / "b.jsonl", qa_rows(60, start=100))
    args = ["--input", a, "--input", b, "--tokenizer", spm_model, "--max-length", 64,
            "--shard-samples", 5]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_shard(capsys, *args, "--output", full)[0] == 0
    assert run_shard(capsys, *args, "--output", part, "--stop-after-shards", 2)[0] == 0
    partial = json.loads((part / "manifest.partial.json").read_text())
    # a was read to its end before the first shard closed: its sha256 is recorded
    assert partial["inputs"][0] == {"name": str(a), "size": a.stat().st_size,
                                    "mtime": a.stat().st_mtime,
                                    "sha256": hashlib.sha256(a.read_bytes()).hexdigest()}
    # an input edited (size changed) before the rerun: refused, nothing mixed
    blob = b.read_bytes()
    b.write_bytes(blob.replace(b"answer 150", b"answer 150, edited"))
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 2 and f"input {b} changed (size" in err and "since the interrupted run" in err, err
    b.write_bytes(blob)  # back, but with a new modification time: same bytes, read and accepted
    # a's bytes changed, its size and modification time kept: found when a has been read again
    st = a.stat()
    a.write_bytes(a.read_bytes().replace(b"answer 3", b"ANSWER 3"))
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    tars = sorted(p.name for p in part.glob("*.tar"))
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 2 and sorted(p.name for p in part.glob("*.tar")) == tars, err
    assert err.strip().splitlines()[-1] == (f"shard.py: error: input {a} changed since the interrupted run (its "
                           "bytes differ from those the kept shards were made from, though its "
                           "size and modification time agree); pass --overwrite to make the "
                           "shards again from the current inputs")
    assert not (part / "manifest.json").exists()
    code, err = run_shard(capsys, *args, "--output", part)  # still refused: the old sha256 is kept
    assert code == 2 and "changed since the interrupted run" in err, err
    # restored: the resumed run equals the uninterrupted one
    a.write_bytes(a.read_bytes().replace(b"ANSWER 3", b"answer 3"))
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "keeping 2 complete shard(s)" in err, err
    got, want = folder_bytes(part), folder_bytes(full)
    mg, mw = (json.loads(x.pop("manifest.json")) for x in (got, want))
    assert got == want  # shards and tokenizer files
    for e in mg["inputs"] + mw["inputs"]:  # the files were rewritten: other times, same bytes
        e.pop("mtime")
    for m in (mg, mw):   # the manifest's checksum covers the times too
        m.pop("manifest_sha256")
    assert mg == mw


def test_fsspec_inputs_are_identified_by_their_info(tmp_path, spm_model, capsys, http_server):
    mem = fsspec.filesystem("memory")
    mem.pipe("/id_in/a.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in qa_rows(5)))
    args = ["--input", "memory://id_in/a.jsonl", "--tokenizer", spm_model, "--max-length", 64]
    out = tmp_path / "out"
    assert run_shard(capsys, *args, "--output", out)[0] == 0
    (entry,) = json.loads((out / "manifest.json").read_text())["inputs"]
    info = mem.info("/id_in/a.jsonl")
    assert entry == {"name": "memory:///id_in/a.jsonl", "size": info["size"],
                     "mtime": info["created"].isoformat(),
                     "sha256": hashlib.sha256(mem.cat("/id_in/a.jsonl")).hexdigest()}
    mem.pipe("/id_in/a.jsonl", mem.cat("/id_in/a.jsonl") + json.dumps(qa_rows(1, 9)[0]).encode())
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 2 and "input memory:///id_in/a.jsonl changed (size" in err, err
    # HTTP: the size from the server's headers (this test server sends no ETag/Last-Modified)
    web = tmp_path / "web"
    web.mkdir()
    src = write_jsonl(web / "a.jsonl", qa_rows(5))
    url = f"{http_server(web)}/a.jsonl"
    hout = tmp_path / "hout"
    assert run_shard(capsys, "--input", url, "--output", hout, "--tokenizer", spm_model)[0] == 0
    (entry,) = json.loads((hout / "manifest.json").read_text())["inputs"]
    assert entry == {"name": url, "size": src.stat().st_size,
                     "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}
    write_jsonl(src, qa_rows(6))
    code, err = run_shard(capsys, "--input", url, "--output", hout, "--tokenizer", spm_model)
    assert code == 2 and f"input {url} changed (size {entry['size']} bytes, now" in err, err


def test_identity_fields_of_remote_filesystems():
    """What s3fs, gcsfs and fsspec's HTTP filesystem report (their info keys) is recorded."""
    import datetime

    class FakeFS:
        def __init__(self, info):
            self._info = info

        def info(self, path):
            return self._info
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    cases = [  # s3fs, gcsfs, http
        ({"size": 10, "LastModified": when, "ETag": '"9b2cf535f27731c974343645a3985328"'},
         {"mtime": "2026-01-02T03:04:05+00:00", "etag": "9b2cf535f27731c974343645a3985328"}),
        ({"size": 10, "updated": "2026-01-02T03:04:05.000Z", "md5Hash": "myg1NfJ3McDW9DZFo5hTKA=="},
         {"mtime": "2026-01-02T03:04:05.000Z", "etag": "myg1NfJ3McDW9DZFo5hTKA=="}),
        ({"size": 10, "Last-Modified": "Fri, 02 Jan 2026 03:04:05 GMT", "ETag": '"5f3a-61b2"'},
         {"mtime": "Fri, 02 Jan 2026 03:04:05 GMT", "etag": "5f3a-61b2"}),
    ]
    for info, want in cases:
        got = sources.input_identity(sources.Source("s3://b/k.jsonl", FakeFS(info), "b/k.jsonl"))
        assert got == {"name": "s3://b/k.jsonl", "size": 10, **want}


# ----------------------------------------------------------------------------- long texts

@pytest.mark.parametrize("which", ["spm", "qwen3"])
def test_pieces_give_the_whole_texts_tokens(which, spm_model):
    from transformers import AutoTokenizer
    path = spm_model if which == "spm" else qwen3_tokenizer_dir()
    tok = load_tokenizer(path)
    assert piecewise_ok(tok)
    text = real_text(150_000) + "\n汉字 测试 Ünïcödé wörds ☃ 12345 <|im_end|> </s> end"
    if which == "qwen3":  # the untouched transformers tokenizer, whole text
        ref = AutoTokenizer.from_pretrained(path)
        whole = ref.encode(text, add_special_tokens=False, split_special_tokens=True)
    else:  # SentencePiece's own encoder (our loader only makes <|mask|> etc. control pieces)
        whole = tok.sp.EncodeAsIds(text)
    for target in (64, 1000, 20_000):
        pieces = text_pieces(text, target, 10 ** 9)
        assert all(safe for _, _, safe in pieces) and len(pieces) > len(text) // (2 * target)
        assert "".join(text[a:b] for a, b, _ in pieces) == text
        ids = []
        for a, b, _ in pieces:
            ids += encode_piece(tok, text[a:b], first=a == 0)
        assert ids == whole, target


def _small_pieces(monkeypatch, stream_bytes=1000, block=777, piece=300, limit=2000):
    monkeypatch.setattr(sources, "STREAM_TEXT_BYTES", stream_bytes)
    monkeypatch.setattr(sources, "_BLOCK", block)
    monkeypatch.setattr(tokenizer_io, "PIECE_CHARS", piece)
    monkeypatch.setattr(tokenizer_io, "MAX_PIECE_CHARS", limit)


def test_long_text_file_is_streamed_in_pieces(tmp_path, spm_model, capsys, monkeypatch):
    sp = load_tokenizer(spm_model)
    text = real_text(60_000)
    (tmp_path / "in").mkdir()
    doc = tmp_path / "in" / "long.txt"
    doc.write_bytes(b"\xef\xbb\xbf" + text.encode())  # a BOM: dropped, as for a small file
    (tmp_path / "in" / "blank.txt").write_text(" \n\t" * 2000)
    (tmp_path / "in" / "bad.txt").write_bytes(text[:5000].encode() + b"\xff" + text[:5000].encode())
    args = ["--input", tmp_path / "in", "--tokenizer", spm_model, "--max-length", 100,
            "--max-skip-fraction", 1]
    # the reference: the same folder made with whole-file reads and whole-text tokenization
    whole = tmp_path / "whole"
    assert run_shard(capsys, *args, "--output", whole)[0] == 0
    seen, scans = [], []
    real_encode, real_scan = prepare.encode_piece, sources.TextFile.scan
    monkeypatch.setattr(prepare, "encode_piece", lambda tok, t, first=True: (
        seen.append(len(t)), real_encode(tok, t, first))[1])
    monkeypatch.setattr(sources.TextFile, "scan", lambda self, prefix: (
        scans.append(self.source.name), real_scan(self, prefix))[1])
    _small_pieces(monkeypatch)
    out = tmp_path / "out"
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 0, err
    assert sorted(scans) == sorted(str(tmp_path / "in" / n) for n in ("bad.txt", "blank.txt", "long.txt"))
    assert len(seen) > 60_000 // 300 and max(seen) <= 2000  # tokenized a piece at a time
    assert folder_bytes(out) == folder_bytes(whole)
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {"empty_text": 1, "invalid_utf8": 1}
    assert m["counts"]["unsafe_piece_cuts"] == 0
    chunks = [t for _, t, _ in read_samples(str(out))["train"]]
    assert np.concatenate(chunks).tolist() == sp.sp.EncodeAsIds(text) + [sp.info.eos_id]
    assert [len(c) for c in chunks[:-1]] == [100] * (len(chunks) - 1)
    # two workers: the same bytes
    assert run_shard(capsys, *args, "--output", tmp_path / "two", "--workers", 2)[0] == 0
    assert folder_bytes(tmp_path / "two") == folder_bytes(whole)


def test_resume_inside_a_long_text_in_pieces(tmp_path, spm_model, capsys, monkeypatch):
    """Kept shards end inside a streamed text: its pieces are tokenized again and the chunks
    the kept shards hold are skipped; the result equals the uninterrupted run."""
    _small_pieces(monkeypatch)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(real_text(30_000))
    write_jsonl(tmp_path / "in" / "b.jsonl", qa_rows(12) + [{"text": real_text(9_000)[::-1]}])
    args = ["--input", tmp_path / "in", "--tokenizer", spm_model, "--max-length", 128,
            "--shard-samples", 9, "--pack"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_shard(capsys, *args, "--output", full)[0] == 0
    assert run_shard(capsys, *args, "--output", part, "--stop-after-shards", 3)[0] == 0
    progress = json.loads((part / "manifest.partial.json").read_text())["progress"]["train"]
    assert progress[-1]["next"][0] == 0 and progress[-1]["next"][1] > 0  # inside a.txt
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "keeping 3 complete shard(s)" in err, err
    assert folder_bytes(part) == folder_bytes(full)


def test_qwen3_long_text_in_pieces_equals_transformers(tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer
    qdir = qwen3_tokenizer_dir()
    text = real_text(40_000) + "\n混合 文本 end"
    (tmp_path / "long.txt").write_text(text)
    write_jsonl(tmp_path / "cell.jsonl", [{"text": text[::-1]}])  # an in-memory long text
    _small_pieces(monkeypatch, piece=500, limit=5000)
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", tmp_path / "long.txt", "--input", tmp_path / "cell.jsonl",
                          "--output", out, "--tokenizer", qdir, "--max-length", 4096)
    assert code == 0, err
    ref = AutoTokenizer.from_pretrained(qdir)
    got = np.concatenate([t for _, t, _ in read_samples(str(out))["train"]]).tolist()
    want = []
    for t in (text, text[::-1]):
        want += ref.encode(t, add_special_tokens=False, split_special_tokens=True) + [ref.eos_token_id]
    assert got == want


def test_unsafe_cuts_long_text_skip_and_huge_pairs(tmp_path, spm_model, capsys, monkeypatch):
    sp = load_tokenizer(spm_model)
    _small_pieces(monkeypatch)
    run = "x" * 5000  # no space after a letter for 5000 characters: two cuts at 2000
    rows = [{"text": "start " + run + " end"}, {"text": "short text"},
            {"query": "q", "response": "word " * 50_000},  # found too long after one piece
            {"query": "fits", "response": "yes"}]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    seen = []
    real_encode = prepare.tokenizers.encode_piece

    def spy(tok, t, first=True):
        seen.append(len(t))
        return real_encode(tok, t, first)
    monkeypatch.setattr(prepare.tokenizers, "encode_piece", spy)
    code, err = run_shard(capsys, "--input", src, "--output", tmp_path / "a", "--tokenizer",
                          spm_model, "--max-length", 64, "--max-skip-fraction", 1)
    assert code == 0, err
    assert max(seen) <= 2000  # the 250 000-character response was never encoded whole
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["counts"]["unsafe_piece_cuts"] == 2 and m["skipped"] == {"over_length": 1}
    assert "2 long-text cut(s) without a space near them" in err
    key = prepare.record_digest("text", (rows[0]["text"],)).hex()[:20]
    chunks = [t for k, t, _ in read_samples(str(tmp_path / "a"))["train"] if k.startswith(key)]
    ids = np.concatenate(chunks).tolist()  # the long text, chunked; its pieces decode back to it
    assert len(chunks) > 2 and ids[-1] == sp.info.eos_id and sp.sp.decode(ids[:-1]) == rows[0]["text"]
    # --long-text skip: a long text is found over-length piece by piece and skipped
    code, err = run_shard(capsys, "--input", src, "--output", tmp_path / "b", "--tokenizer",
                          spm_model, "--max-length", 64, "--long-text", "skip",
                          "--max-skip-fraction", 1)
    assert code == 0, err
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["skipped"] == {"over_length": 2} and m["counts"]["records"] == 2
    got = sorted(t.tolist() for _, t, _ in read_samples(str(tmp_path / "b"))["train"])
    assert got == sorted([sp.encode("short text") + [sp.info.eos_id], sp.qa_sample("fits", "yes")[0]])


def test_tokenizer_that_cannot_be_cut_tokenizes_texts_whole(tmp_path, capsys, monkeypatch):
    """A SentencePiece model that folds whitespace (the library's default normalization) gives
    other ids when a text is cut at a space: data prep says so and tokenizes texts whole."""
    import io

    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(real_text(30_000).splitlines()), model_writer=model,
        vocab_size=600, character_coverage=0.995, model_type="bpe", byte_fallback=True, pad_id=0, unk_id=1, bos_id=2,
        eos_id=3, user_defined_symbols=["<|mask|>", "<|user|>", "<|assistant|>"], minloglevel=2)
    path = tmp_path / "folding.model"
    path.write_bytes(model.getvalue())
    tok = load_tokenizer(str(path))
    assert not piecewise_ok(tok)
    _small_pieces(monkeypatch)
    text = real_text(20_000)
    (tmp_path / "long.txt").write_text(text)
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", tmp_path / "long.txt", "--output", out,
                          "--tokenizer", path, "--max-length", 100000)
    assert code == 0, err
    assert f"note: tokenizer {path.name} gives other tokens when a text is cut at a space" in err
    (_, tokens, _), = read_samples(str(out))["train"]
    assert tokens.tolist() == tok.sp.EncodeAsIds(text) + [tok.info.eos_id]


# ----------------------------------------------------------------------------- skip shares

def test_skip_share_threshold(tmp_path, spm_model, capsys):
    good = qa_rows(9)
    long = [{"query": f"long {i}", "response": "word " * 100} for i in range(9)]
    cases = [  # (rows, extra args, exit code, a note line)
        (good + [{"query": "no response"}], [], 0, None),           # 1 of 10: 10% is allowed
        (good + [{"query": "x"}, {"query": "y"}], [], 2, None),     # 2 of 11: 18%
        (good + [{"query": "x"}, {"query": "y"}], ["--max-skip-fraction", 0.2], 0, None),
        (good + [{"query": "x"}] * 2, ["--max-skip-fraction", 0], 2, None),
        # the filters the options ask for: a note, exit 0
        (good + good + good, [], 0, "duplicate 18 of 27 input records (66.7%): more than "
         "--max-skip-fraction 0.1, by the filters the options ask for (not an error)"),
        (good + long, [], 0, "over_length 9 of 18 input records (50.0%): more than "
         "--max-skip-fraction 0.1, by the filters the options ask for (not an error); raise "
         "--max-length to keep long records"),
    ]
    for i, (rows, extra, want, note) in enumerate(cases):
        src = write_jsonl(tmp_path / f"{i}.jsonl", rows)
        code, err = run_shard(capsys, "--input", src, "--output", tmp_path / f"o{i}",
                              "--tokenizer", spm_model, "--max-length", 64, *extra)
        assert code == want, (i, err)
        assert (tmp_path / f"o{i}" / "manifest.json").exists()
        notes = [ln for ln in err.splitlines() if "note:" in ln]
        assert notes == ([f"shard.py: note: skipped {note}"] if note else []), (i, err)
    with pytest.raises(SystemExit) as e:
        cli.main(["--input", str(src), "--output", str(tmp_path / "o9"), "--tokenizer",
                    spm_model, "--max-skip-fraction", "2"])
    assert e.value.code == 2 and "--max-skip-fraction must be in [0, 1]" in capsys.readouterr().err
