"""Cost of `shard.py --decontaminate` (data_prep/decontaminate.py): the check runs in data
prep's main process (before the duplicate filter), so its speed bounds the tokenizer workers
one process can feed.

    .venv/bin/python bench/bench_decontaminate.py [--corpus-mb 8] [--eval-items 20000]

Prints, on the interpreter's standard-library sources (the first --corpus-mb MB, as documents
of one file each, and as pieces of 200 words, the size of a short record) against a synthetic
evaluation set of --eval-items items of 60 random words (a GSM8K-size test set is ~1300):
- index build time and bytes (`EvalSets.nbytes`, and tracemalloc's peak while building);
  the evaluation words are drawn from the corpus's own words, so the look-ups are not easier
  than on real evaluation sets (no hit is expected: random 60-word items);
- the check (`Match.feed` + `finish`) in MB and words per CPU second, for whole files and
  200-word records (the word-hash cache warm, as in a long run);
- the same corpus through `pipeline.tokenizer` encoding (the SentencePiece model trained on
  it, not timed) for scale: the check's share of one tokenizer process's time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_prep import decontaminate, stdlib_corpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus-mb", type=float, default=8)
    ap.add_argument("--eval-items", type=int, default=20000)
    args = ap.parse_args()
    texts, size = [], 0
    for _, rec in stdlib_corpus.iter_records("text"):
        texts.append(rec["text"])
        size += len(rec["text"].encode())
        if size >= args.corpus_mb * 1e6:
            break
    words = decontaminate.words(" ".join(texts))
    short = [" ".join(words[i:i + 200]) for i in range(0, len(words), 200)]
    rng = random.Random(0)
    vocab = sorted(set(words))
    with tempfile.TemporaryDirectory() as d:
        ev_path = os.path.join(d, "eval.jsonl")
        with open(ev_path, "w") as f:
            for _ in range(args.eval_items):
                f.write(json.dumps({"query": " ".join(rng.choice(vocab) for _ in range(60))}) + "\n")
        t0 = time.process_time()
        ev = decontaminate.EvalSets([ev_path], decontaminate.DEFAULT_NGRAM)
        build = time.process_time() - t0
        tracemalloc.start()  # again, for the peak (tracemalloc slows it down)
        decontaminate.EvalSets([ev_path], decontaminate.DEFAULT_NGRAM)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(f"corpus: {size / 1e6:.1f} MB, {len(texts)} files, {len(words)} words; eval set: "
          f"{args.eval_items} items, {ev.grams.size} n-grams")
    print(f"index: built in {build:.2f} CPU-s; arrays {ev.nbytes() / 1e6:.1f} MB "
          f"({ev.nbytes() / ev.words.size:.1f} bytes per evaluation word); peak while building "
          f"{peak / 1e6:.1f} MB")
    for name, docs in (("whole files", texts), ("200-word records", short)):
        best = None
        for _ in range(3):  # the word-hash cache stays warm, as in a long run
            t0 = time.process_time()
            hits = 0
            for t in docs:
                m = ev.matcher()
                m.feed(t)
                hits += bool(m.finish())
            dt = time.process_time() - t0
            best = dt if best is None else min(best, dt)
        print(f"check, {name}: {size / 1e6 / best:.1f} MB/CPU-s, {len(words) / best / 1e6:.2f} M "
              f"words/CPU-s, {best / len(docs) * 1e6:.1f} us per record ({len(docs)} records, "
              f"{hits} hits; best of 3)")
    with tempfile.TemporaryDirectory() as d:
        from data_prep import train_tokenizer
        from pipeline.tokenizer import load_tokenizer
        src = os.path.join(d, "c.jsonl")
        with open(src, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        model = os.path.join(d, "spm.model")
        train_tokenizer.main(["--input", src, "--output", model, "--vocab-size", "4000"])
        tok = load_tokenizer(model)
        t0 = time.process_time()
        n = sum(len(tok.encode(t)) for t in texts)
        enc = time.process_time() - t0
    print(f"tokenizer (SentencePiece, 4000 pieces): {n / enc / 1e3:.0f}k tokens/CPU-s, "
          f"{size / 1e6 / enc:.2f} MB/CPU-s; the check on whole files costs "
          f"{100 * best_whole(ev, texts) / enc:.1f} % of that time")


def best_whole(ev, texts) -> float:
    t0 = time.process_time()
    for t in texts:
        m = ev.matcher()
        m.feed(t)
        m.finish()
    return time.process_time() - t0


if __name__ == "__main__":
    main()
