"""Launch to training step 1 by samples per shard, with sample indexes and with the tar walk.

What is timed: `torch.distributed.run --nproc_per_node 2 ... pipeline.train` (gloo, CPU, the
tests' tiny model `tests/shard_fixtures.TINY_MODEL` with the tokenizer's vocabulary; 2 ranks,
2 loader workers each, micro-batch 2, global batch 4, `max_steps=1`), from the start of the
command to the trainer's "step 1/1" log line, on the same samples written by data prep once
in small shards and once in a few large ones, unpacked and packed (`data.pack`, best fit, the
default shuffle window of 1,000 samples). Shards are verified as in a real run
(`data.verify_shards=error`: with version-2 sample indexes, each shard's size when a process
first needs it and each sample's digest when it is read) unless `--verify off`.
"after" is the loader as it is (each shard's `<shard>.idx`, version 2); "v1" is the same loader
on the same tars with version-1 indexes (the records without their digests, in a folder of links
beside the data, `v1_twin`), which makes each loader process hash each shard it touches whole
before its first sample, as every folder did before version 2; "before" is the same loader with
the index read replaced by the walk of the shard's tar headers
(`pipeline.data.sample_index.build`, the code the loader ran before indexes existed: the loader
itself no longer has that path, it refuses a folder without indexes), patched into each rank
before its loader is built (loader workers are forked from it and inherit it).
Also printed: "first batch", the slowest rank's seconds from its loader's first `iter` to its
first batch (worker start, shard hashing, index reads or tar walks, the samples' reads: the
loader's share of the launch, less noisy than the whole on a busy machine); the peak RSS
(VmHWM) and the largest private memory (USS) seen of the rank processes and of the loader
workers (polled from /proc every 0.2 s; a forked worker's RSS counts pages it shares with its
rank, its USS is what it holds itself); and how long data prep took.
Each run appends a JSON line to `<data>/runs/results.jsonl` (its log beside it).

The data (synthetic query/response records of a few words, ~50 tokens a sample, a 300-piece
SentencePiece tokenizer trained on the first 20,000 of them, `data_prep/shard.py
--shard-samples S` for the smallest layout, the larger layouts regrouped from it (`regroup`),
`--sizes` the first shards of each) is kept under `--data` and reused by later runs; the
seconds data prep took are recorded there (`prep_times.json`) the first time it runs.

    .venv/bin/python bench/bench_launch.py [--data /tmp/idx_bench] [--samples 1000000]
        [--shard-samples 10000,250000] [--sizes 1000000,250000] [--modes after,v1,before]
        [--before-up-to 250000] [--pack no,yes] [--verify error|off] [--timeout 1800]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = ("alpha beta gamma delta river stone cloud green light north south small large quick "
         "slow bright dark paper metal glass water field tower window garden market number "
         "letter question answer simple method result value table chair apple orange yellow "
         "purple silver golden winter summer spring autumn morning evening").split()
STEP1 = re.compile(r"step 1/\d+ \|")
FIRST = re.compile(r"bench: rank \d+: first training batch after ([0-9.]+) s")


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    """`n` distinct query/response JSONL records (a few words each), written atomically."""
    rng = np.random.default_rng(seed)
    w = np.array(WORDS)
    q_len = rng.integers(1, 4, size=n)
    r_len = rng.integers(2, 6, size=n)
    picks = rng.integers(0, len(w), size=(n, 14))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            q = " ".join(w[picks[i, :q_len[i]]])
            r = " ".join(w[picks[i, 5:5 + r_len[i]]])
            f.write(json.dumps({"query": f"item {i}: {q}?", "response": r}) + "\n")
    os.replace(tmp, path)


def prepare(data: Path, n: int, shard_samples: list[int]) -> dict:
    """Corpus, tokenizer and one shard folder per `shard_samples` under `data` (kept when
    present): data prep writes the smallest layout, the others are regrouped from it
    (`regroup`). Returns {folder name: data prep seconds} (as first measured)."""
    data.mkdir(parents=True, exist_ok=True)
    times_path = data / "prep_times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    corpus = data / f"corpus-{n}.jsonl"
    if not corpus.exists():
        t = time.perf_counter()
        write_corpus(corpus, n)
        print(f"corpus: {n} records written in {time.perf_counter() - t:.0f} s", flush=True)
    tok = data / "spm.model"
    if not tok.exists():
        subprocess.run([sys.executable, str(ROOT / "data_prep/train_tokenizer.py"), "--input",
                        str(corpus), "--output", str(tok), "--vocab-size", "300",
                        "--max-sentences", "20000"], check=True, cwd=ROOT)
    small = min(shard_samples)
    for s in sorted(shard_samples):
        name = f"shards-{n}-{s}"
        out = data / name
        if (out / "manifest.json").exists():
            continue
        t = time.perf_counter()
        if s == small:
            subprocess.run([sys.executable, str(ROOT / "data_prep/shard.py"), "--input",
                            str(corpus), "--output", str(out), "--tokenizer", str(tok),
                            "--max-length", "128", "--shard-samples", str(s), "--workers",
                            str(os.cpu_count() or 1), "--no-progress"], check=True, cwd=ROOT)
        else:
            regroup(data / f"shards-{n}-{small}", out, s)
        times[name] = time.perf_counter() - t
        times_path.write_text(json.dumps(times, indent=1))
        print(f"{'data prep' if s == small else 'regrouped'} {name}: {times[name]:.0f} s",
              flush=True)
    return times


def regroup(small: Path, out: Path, per: int) -> None:
    """`small`'s train samples in shards of `per` samples (a multiple of its samples per
    shard): each new tar is its small tars' members back to back (each one's end-of-archive
    blocks dropped, the end blocks written once), its index the small indexes with their
    offsets moved, its manifest entry with bytes and sha256 as data prep records them. The
    same samples and member bytes as data prep writes with `--shard-samples per
    --shard-bytes` large enough (its default 256 MB would cut ~125,000 of these samples),
    without tokenizing again."""
    import hashlib

    from data_prep.writer import index_entry
    from pipeline.data import sample_index
    m = json.loads((small / "manifest.json").read_text())
    entries = m["splits"]["train"]
    k = per // entries[0]["samples"]
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    new = []
    for g in range(0, len(entries), k):
        name, recs, off, sha = f"train-{g // k:06d}.tar", [], 0, hashlib.sha256()
        with open(tmp / name, "wb") as f:
            for e in entries[g:g + k]:
                idx = sample_index.decode((small / e["index"]["name"]).read_bytes(), e["name"])
                end = -(-int(sample_index.sample_end(idx).max()) // 512) * 512
                with open(small / e["name"], "rb") as src:
                    part = src.read(end)
                f.write(part)
                sha.update(part)
                r = idx.copy()
                for col in ("start", "tokens_offset", "json_offset"):
                    r[col] += off
                recs.append(r)
                off += end
            tail = b"\0" * (1024 + (-(off + 1024)) % 10240)  # end blocks, 10 KiB records
            f.write(tail)
            sha.update(tail)
        data = sample_index.encode(np.concatenate(recs))
        (tmp / sample_index.index_name(name)).write_bytes(data)
        group = entries[g:g + k]
        new.append({"name": name, "samples": sum(e["samples"] for e in group),
                    "tokens": sum(e["tokens"] for e in group), "bytes": off + len(tail),
                    "sha256": sha.hexdigest(),
                    "index": index_entry(sample_index.index_name(name), data)})
    m["splits"] = {"train": new}
    (tmp / "manifest.json").write_text(json.dumps(m, indent=1))
    os.replace(tmp, out)


def subset(folder: Path, samples: int) -> Path:
    """`folder`'s first shards holding `samples` samples, as a folder of links to them with
    its own manifest (made once, beside `folder`)."""
    m = json.loads((folder / "manifest.json").read_text())
    entries, total = [], 0
    for e in m["splits"]["train"]:
        if total >= samples:
            break
        entries.append(e)
        total += e["samples"]
    if total == m_total(m):
        return folder
    out = folder.with_name(f"{folder.name}-first{total}")
    if not (out / "manifest.json").exists():
        out.mkdir(exist_ok=True)
        for e in entries:
            for name in (e["name"], e["index"]["name"]):
                if not (out / name).exists():
                    (out / name).symlink_to(folder / name)
        m["splits"] = {"train": entries}
        (out / "manifest.json").write_text(json.dumps(m, indent=1))
    return out


def v1_twin(folder: Path) -> Path:
    """`folder` with version-1 sample indexes (its version-2 records without their digests):
    a folder of links to its tars, with its own indexes and manifest (made once, beside it)."""
    from data_prep.writer import index_entry
    from pipeline.data import sample_index
    out = folder.with_name(f"{folder.name}-idxv1")
    if (out / "manifest.json").exists():
        return out
    out.mkdir(exist_ok=True)
    m = json.loads((folder / "manifest.json").read_text())
    for e in m["splits"]["train"]:
        rec = sample_index.decode((folder / e["index"]["name"]).read_bytes(), e["name"])
        v1 = np.zeros(len(rec), sample_index.DTYPE_V1)
        for col in sample_index.DTYPE_V1.names:
            v1[col] = rec[col]
        data = sample_index.encode(v1)
        (out / e["index"]["name"]).write_bytes(data)
        if not (out / e["name"]).exists():
            (out / e["name"]).symlink_to(folder / e["name"])
        entry = index_entry(e["index"]["name"], data)
        entry.pop("version")  # as written before version 2
        e["index"] = entry
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    return out


def m_total(manifest: dict) -> int:
    return sum(e["samples"] for e in manifest["splits"]["train"])


def write_config(path: Path, data_dir: Path, run_dir: Path, pack: bool, verify: str) -> None:
    from shard_fixtures import TINY_MODEL
    m = json.loads((data_dir / "manifest.json").read_text())
    model = dict(TINY_MODEL, vocab_size=m["tokenizer"]["vocab_size"],
                 max_position_embeddings=max(64, m["max_length"]))
    cfg = {"run_dir": str(run_dir), "model": {"inline": model},
           "data": {"dir": str(data_dir), "num_workers": 2, "pack": pack,
                    "verify_shards": verify},
           "optim": {"lr": 1e-3, "warmup_steps": 1},
           "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 4,
                     "precision": "fp32", "tensor_parallel_size": 1, "eval_interval": 0,
                     "eval_batches": 0},
           "checkpoint": {"interval": 0, "keep": 1}, "wandb": {"mode": "disabled"}}
    path.write_text(json.dumps(cfg))  # JSON is YAML


class PeakRSS(threading.Thread):
    """Polls /proc every 0.2 s for the descendants of `pid`; keeps each one's VmHWM (bytes)
    and largest USS (bytes), and its depth below `pid` (see `peaks`)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.hwm, self.uss, self.depth = pid, {}, {}, {}
        self.stop = threading.Event()

    def run(self):
        import psutil
        root = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                break
            for k in kids:
                try:
                    with open(f"/proc/{k.pid}/status") as f:
                        hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
                    if k.pid not in self.depth:
                        d, p = 1, k.ppid()
                        while p != self.pid and p > 1:
                            d, p = d + 1, psutil.Process(p).ppid()
                        self.depth[k.pid] = d
                    self.hwm[k.pid] = max(hwm, self.hwm.get(k.pid, 0))
                    with open(f"/proc/{k.pid}/smaps_rollup") as f:
                        uss = sum(int(l.split()[1]) * 1024 for l in f
                                  if l.startswith(("Private_Clean", "Private_Dirty")))
                    self.uss[k.pid] = max(uss, self.uss.get(k.pid, 0))
                except (OSError, StopIteration, psutil.Error):
                    pass
            self.stop.wait(0.2)

    def peaks(self) -> dict:
        """MB: `ranks` / `workers`, the largest peak RSS (VmHWM) of a rank process / of a loader
        worker; `ranks_uss` / `workers_uss`, the largest private memory (USS) seen in one (a
        forked worker's RSS counts the pages it shares with its rank). torchrun is `pid`: ranks
        are depth 1 below it, their loader workers depth 2."""
        out = {}
        for label, d in (("ranks", 1), ("workers", 2)):
            for suffix, table in (("", self.hwm), ("_uss", self.uss)):
                v = [h for p, h in table.items() if self.depth.get(p) == d]
                out[label + suffix] = max(v) / 2 ** 20 if v else float("nan")
            out[f"n_{label}"] = len([p for p in self.hwm if self.depth.get(p) == d])
        return out


def launch(cfg: Path, before: bool, timeout: float, log: Path) -> dict:
    """Run the 2-rank trainer once; seconds to the "step 1/1" line, exit code, peak RSS."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false",
               REFUSION_BENCH_LOCATE="tar_walk" if before else "index")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "trainer", "--config", str(cfg)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    rss = PeakRSS(p.pid)
    rss.start()
    step1, first = None, []
    with open(log, "w") as f:
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        for line in p.stdout:
            f.write(line)
            if step1 is None and STEP1.search(line):
                step1 = time.perf_counter() - t0
            hit = FIRST.search(line)
            if hit:
                first.append(float(hit.group(1)))
        code = p.wait()
        timer.cancel()
    rss.stop.set()
    rss.join()
    return {"step1_s": step1, "total_s": time.perf_counter() - t0, "rc": code,
            "first_batch_s": max(first) if first else None, **rss.peaks()}


def trainer(argv: list[str]) -> int:
    """The trainer under torchrun, locating samples as REFUSION_BENCH_LOCATE says; prints
    "bench: rank R: first training batch after S s" (from the loader's first `iter`)."""
    from pipeline.data import loader as loader_mod
    if os.environ.get("REFUSION_BENCH_LOCATE") == "tar_walk":
        from pipeline.data import sample_index, shard_io

        def tar_walk(fs, root, entry, mode, with_layout=False):
            with fs.open(f"{root}/{entry['name']}", "rb") as f:
                records = sample_index.build(f, entry["name"])[0]
            return (records, None) if with_layout else records
        shard_io.read_sample_index = tar_walk
    plain_iter, first = loader_mod.ShardLoader.__iter__, []

    def timed_iter(self):
        t = time.perf_counter()
        for b in plain_iter(self):
            if not first:
                first.append(1)
                print(f"bench: rank {os.environ.get('RANK')}: first training batch after "
                      f"{time.perf_counter() - t:.2f} s", flush=True)
            yield b
    loader_mod.ShardLoader.__iter__ = timed_iter
    from pipeline.train import main as train_main
    return train_main(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/idx_bench"),
                   help="folder for the corpus, tokenizer and shards (reused when present)")
    p.add_argument("--samples", type=int, default=1_000_000, help="records (= samples)")
    p.add_argument("--shard-samples", default="10000,250000",
                   help="comma-separated samples per shard, one folder each")
    p.add_argument("--sizes", default="",
                   help="comma-separated sample counts to launch on (the first shards of each "
                        "folder; default: --samples)")
    p.add_argument("--modes", default="after,before",
                   help="after (index), v1 (version-1 index: whole-shard hashes), "
                        "before (tar walk)")
    p.add_argument("--before-up-to", type=int, default=None,
                   help="run `before` only on sizes up to this many samples")
    p.add_argument("--pack", default="no,yes", help="no, yes or both, comma-separated")
    p.add_argument("--verify", default="error", choices=("error", "off"),
                   help="data.verify_shards of the runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per trainer launch")
    p.add_argument("--prepare-only", action="store_true")
    a = p.parse_args()
    layouts = sorted(int(s) for s in a.shard_samples.split(","))
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else [a.samples]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    times = prepare(a.data, a.samples, layouts)
    for name, sec in times.items():
        print(f"{name}: {'data prep' if name.endswith(f'-{layouts[0]}') else 'regrouped'} "
              f"{sec:.0f} s", flush=True)
    if a.prepare_only:
        return
    runs = a.data / "runs"
    runs.mkdir(exist_ok=True)
    for n in sizes:
        for pack in (x == "yes" for x in a.pack.split(",")):
            for mode in a.modes.split(","):
                if mode == "before" and a.before_up_to is not None and n > a.before_up_to:
                    continue
                for s in layouts:  # the layouts side by side
                    d = subset(a.data / f"shards-{a.samples}-{s}", n)
                    if mode == "v1":
                        d = v1_twin(d)
                    shards = json.loads((d / "manifest.json").read_text())["splits"]["train"]
                    tag = f"{d.name}-{'packed' if pack else 'unpacked'}-{mode}-verify_{a.verify}"
                    cfg = runs / f"{tag}.json"
                    shutil.rmtree(runs / tag, ignore_errors=True)  # else it resumes at step 1
                    write_config(cfg, d, runs / tag, pack, a.verify)
                    r = launch(cfg, mode == "before", a.timeout, runs / f"{tag}.log")
                    r.update(samples=n, samples_per_shard=s, shards=len(shards), pack=pack,
                             mode=mode, verify=a.verify, load=os.getloadavg()[0],
                             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
                    with open(runs / "results.jsonl", "a") as f:
                        f.write(json.dumps(r) + "\n")
                    fmt = lambda v: f"{v:.1f} s" if v is not None else "none"  # noqa: E731
                    print(f"{n:8d} samples in {len(shards):3d} shards, "
                          f"{'packed' if pack else 'unpacked':8s} {mode:6s} verify {a.verify}: "
                          f"launch to step 1 "
                          f"{fmt(r['step1_s'])}, first batch {fmt(r['first_batch_s'])} (exit "
                          f"{r['rc']}, {r['total_s']:.0f} s); peak RSS MB (USS): rank "
                          f"{r['ranks']:.0f} ({r['ranks_uss']:.0f}), loader worker "
                          f"{r['workers']:.0f} ({r['workers_uss']:.0f}); load "
                          f"{r['load']:.1f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        sys.exit(trainer(sys.argv[2:]))
    main()
