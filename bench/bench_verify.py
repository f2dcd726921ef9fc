"""Shard verification with per-sample digests (sample index version 2) against the whole-shard
sha256 it replaces (version 1), side by side in one process on the same tar files.

Figures (printed; `data.verify_shards=error` unless said):
- open: seconds from `build_loader` to the first batch (one process, `num_workers=0`, manifest
  order), on one shard of `--samples` samples (~2.7 KB each, 341 MB at 125,000): version 1
  hashes the shard whole first (`pipeline.data.shard_io.verify_shard`), version 2 reads its
  index and stats the shard (`check_shard_size`); the same with a resume in the middle of the
  shard (`load_state_dict`, cursor at half the shard). The two folders share the tar (a link);
  it is in the page cache for both (it was just written), so version 1 is timed at its best
  (sha256 at memory speed; from disk or object storage it also pays the read).
- read path: microseconds a sample of `Reader.read` (one range read, key, tokens, json) over
  `--read-samples` samples of that shard with verify off and error (version 2: the BLAKE2b-64 of
  the bytes read, `check_sample`), two readers called in turn on each sample; and the digest
  alone.
- bytes: bytes read from a folder of `--epoch-samples` samples in 10 shards in one shuffled,
  unpacked epoch through a counting local fsspec filesystem (all processes, loader workers
  included), as a multiple of the shards' bytes, version 1 and 2, one process and 2 workers.
Each figure is the median of `--repeats` rounds; the rounds of the two versions (or modes)
alternate.

    .venv/bin/python bench/bench_verify.py [--samples 125000] [--read-samples 20000]
        [--epoch-samples 20000] [--repeats 3] [--max-length 320] [--figures open,read,bytes]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_launch import v1_twin  # noqa: E402
from bench_shard_index import BYTES_READ, register_counting_fs, write_folder  # noqa: E402
from pipeline.data import build_loader, sample_index, shard_io  # noqa: E402
from pipeline.data.order import Order  # noqa: E402
from pipeline.data.reader import Reader  # noqa: E402



def add_sha256(folder: Path) -> None:
    """Record each shard's sha256 in manifest.json, as data prep does (version 1 checks it)."""
    m = json.loads((folder / "manifest.json").read_text())
    for e in m["splits"]["train"]:
        h = hashlib.sha256()
        with open(folder / e["name"], "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        e["sha256"] = h.hexdigest()
    (folder / "manifest.json").write_text(json.dumps(m, indent=1))


def fresh_process_state() -> None:
    """Forget what this process verified and noted (as a new loader process would)."""
    shard_io._VERIFIED.clear()
    shard_io._WARNED.clear()
    shard_io._NOTED_V1.append("quiet")  # the version-1 note: not part of the timing


def time_open(folder: Path, max_length: int, resume: bool) -> float:
    fresh_process_state()
    t = time.perf_counter()
    loader = build_loader(str(folder), "train", 4, max_length, num_workers=0, shuffle=False,
                          shuffle_buffer=1000, verify_shards="error")
    if resume:
        state = loader.state_dict()
        n = json.loads((folder / "manifest.json").read_text())["splits"]["train"][0]["samples"]
        state["cursor"] = [0, n // 2 // 1000, 0]
        loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - t


def time_reads(folder: Path, n: int) -> dict:
    """Seconds a sample of `Reader.read` over the first n samples, verify "off" and "error"
    (indexes read beforehand), the two readers called in turn on each sample so that both see
    the same load."""
    readers = {}
    for verify in ("off", "error"):
        fresh_process_state()
        spec = build_loader(str(folder), "train", 4, 4096, num_workers=0, shuffle=False,
                            verify_shards=verify).spec
        readers[verify] = Reader(spec, Order(spec))
        readers[verify].length(0)  # the index (and the size check) outside the timing
    spent = {"off": 0.0, "error": 0.0}
    clock = time.perf_counter
    for g in range(n):
        for verify in (("off", "error") if g % 2 else ("error", "off")):
            t = clock()
            readers[verify].read(g)
            spent[verify] += clock() - t
    for r in readers.values():
        r.close()
    return {k: v / n for k, v in spent.items()}


def time_digests(folder: Path, n: int) -> float:
    """Seconds a sample of `sample_index.sample_digest` alone on the first n samples' bytes."""
    rec = sample_index.decode((folder / "train-000000.tar.idx").read_bytes(), "bench")[:n]
    ends = sample_index.sample_end(rec)
    with open(folder / "train-000000.tar", "rb") as f:
        blob = f.read(int(ends[-1]))
    pieces = [blob[int(a):int(b)] for a, b in zip(rec["start"], ends)]
    t = time.perf_counter()
    for p in pieces:
        sample_index.sample_digest(p)
    return (time.perf_counter() - t) / n


def epoch_bytes(folder: Path, max_length: int, workers: int) -> int:
    register_counting_fs()
    fresh_process_state()
    BYTES_READ.value = 0
    loader = build_loader(f"countfile://{folder}", "train", 8, max_length, num_workers=workers,
                          verify_shards="error", infinite=False, shuffle_buffer=1000)
    n = sum(len(b["keys"]) for b in loader)
    assert n == sum(e["samples"] for e in json.loads((folder / "manifest.json").read_text())["splits"]["train"])
    return int(BYTES_READ.value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=125_000, help="samples of the one-shard figures")
    p.add_argument("--read-samples", type=int, default=20_000, help="samples of the read-path figure")
    p.add_argument("--epoch-samples", type=int, default=20_000,
                   help="samples of the bytes-per-epoch figure (10 shards)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-length", type=int, default=320, help="tokens per sample at most")
    p.add_argument("--figures", default="open,read,bytes", help="which figures, comma-separated")
    a = p.parse_args()
    figures = a.figures.split(",")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        v2 = Path(tmp) / "big"
        t = time.perf_counter()
        nbytes = write_folder(v2, a.samples, a.samples, a.max_length)
        add_sha256(v2)
        v1 = v1_twin(v2)
        print(f"one shard: {a.samples} samples, {nbytes / 1e6:.0f} MB; index version 2 "
              f"{(v2 / 'train-000000.tar.idx').stat().st_size / 1e6:.2f} MB, version 1 "
              f"{(v1 / 'train-000000.tar.idx').stat().st_size / 1e6:.2f} MB (written in "
              f"{time.perf_counter() - t:.0f} s)", flush=True)
        for resume in (False, True) if "open" in figures else ():
            got = {"v1": [], "v2": []}
            for _ in range(a.repeats):
                got["v1"].append(time_open(v1, a.max_length, resume))
                got["v2"].append(time_open(v2, a.max_length, resume))
            m1, m2 = statistics.median(got["v1"]), statistics.median(got["v2"])
            print(f"{'resume mid-shard' if resume else 'open'} to first batch, verify error: "
                  f"version 1 (whole-shard sha256) {m1:.3f} s, version 2 (size + digests) "
                  f"{m2:.4f} s -> {m1 / m2:.0f}x (rounds: v1 "
                  f"{', '.join(f'{x:.3f}' for x in got['v1'])}; v2 "
                  f"{', '.join(f'{x:.4f}' for x in got['v2'])})", flush=True)
        got = {"off": [], "error": []}
        if "read" not in figures:
            a.repeats = 0
        else:
            time_reads(v2, 2000)  # warm-up (page cache, imports), not counted
        for r in range(a.repeats):
            for verify, t in time_reads(v2, a.read_samples).items():
                got[verify].append(t)
        if a.repeats:
            off, on = statistics.median(got["off"]), statistics.median(got["error"])
            dig = statistics.median(time_digests(v2, a.read_samples) for _ in range(a.repeats))
            print(f"read path ({a.read_samples} samples, version 2): verify off {off * 1e6:.1f} "
                  f"us a sample, error {on * 1e6:.1f} us -> {on / off:.3f}x; the digest alone "
                  f"{dig * 1e6:.2f} us a sample (rounds, us: off "
                  f"{', '.join(f'{x * 1e6:.1f}' for x in got['off'])}; error "
                  f"{', '.join(f'{x * 1e6:.1f}' for x in got['error'])})", flush=True)
        if "bytes" not in figures:
            return
        ep2 = Path(tmp) / "epoch"
        ep_bytes = write_folder(ep2, a.epoch_samples, -(-a.epoch_samples // 10), a.max_length, seed=2)
        add_sha256(ep2)
        ep1 = v1_twin(ep2)
        for workers in (0, 2):
            r = {name: epoch_bytes(d, a.max_length, workers) / ep_bytes
                 for name, d in (("v1", ep1), ("v2", ep2))}
            print(f"one shuffled epoch, verify error, {workers or 'no'} loader workers: bytes read "
                  f"/ shards' bytes: version 1 {r['v1']:.3f}, version 2 {r['v2']:.3f} (indexes "
                  "included)", flush=True)


if __name__ == "__main__":
    main()
