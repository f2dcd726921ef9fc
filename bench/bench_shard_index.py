"""Sample index vs tar-header walk: what a loader worker pays to start reading shards.

Before this index the loader walked every tar header of a shard (one `tarfile.next()` per
member) the first time a process needed the shard; now it reads the shard's `<shard>.idx`
(`pipeline.data.sample_index`, 44 bytes a sample) and each sample's byte range. "before" below
is the same loader with the index read replaced by that walk (`sample_index.build`, the walk
`shard.py index` does, the code the loader ran before), so both columns come from one run on
the same files.

Figures (printed):
- open: seconds for one process to get the sample locations of a new shard of `--samples`
  samples (~2 KB each, ~256 MB at 125,000);
- resume: seconds from `build_loader` + `load_state_dict` (cursor mid-shard) to the first
  batch, one process (`num_workers=0`, `verify_shards=off`: the digest check is the same in
  both and is measured separately in `pipeline/data/shard_io.py`'s docstring);
- launch: seconds from `build_loader` to the first batch (2 workers, shuffled, packed) on
  `--total` samples (quarter-length samples) in shards of 1,000 vs in 2 shards;
- bytes: bytes read from a folder of `--epoch-samples` samples in 10 shards in one shuffled,
  unpacked epoch (one process) through a counting local
  fsspec filesystem, as a multiple of the shards' bytes (target <= 1.02), with the process's
  peak RSS (`ru_maxrss`);
- dual bytes (`--dual`, only this figure): the same count for one shuffled epoch in objective
  mode "dual" (`dual_masking=refusion`, best-fit packing into rows of 2 x `--max-length`) on
  2 DP ranks x 2 loader workers, each rank a forked process, at each shuffle window of
  `--windows`, with the largest peak RSS of a loader worker (`RUSAGE_CHILDREN` of each rank
  after its workers exited), and the bytes of the batches as built (their tensors: what a
  broadcast of each micro-batch to the other TP ranks would move); `--index-version 2`: indexes without slot layouts (the loader
  reads every sample of each window in each process, as it did for every folder before them);
  `--objective refusion` (or ar): the same epoch in another objective mode.

    .venv/bin/python bench/bench_shard_index.py [--samples 125000] [--total 50000]
        [--epoch-samples 20000] [--max-length 320]
    .venv/bin/python bench/bench_shard_index.py --dual [--epoch-samples 20000] [--windows 1000,10000]
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import resource
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.writer import encode_sample, index_entry, write_sample  # noqa: E402
from pipeline.data import build_loader, sample_index, shard_io  # noqa: E402

TOKENIZER = {"kind": "hf", "name": "bench", "hash": "bench-0", "vocab_size": 1000,
             "eos_id": 1, "pad_id": 0, "mask_id": 2, "bos_id": None}


def write_folder(folder: Path, total: int, per_shard: int, max_length: int, seed: int = 0,
                 index_version: int = 3) -> int:
    """A shard folder (data prep's tar layout and index; `index_version` 2: indexes without
    slot layouts) of `total` samples; returns its bytes."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    entries, nbytes = [], 0
    for s0 in range(0, total, per_shard):
        name = f"train-{s0 // per_shard:06d}.tar"
        n = min(per_shard, total - s0)
        lengths = rng.integers(max_length // 4, max_length + 1, size=n)
        rows, layouts, tokens = [], [], 0
        with open(folder / name, "wb") as f, tarfile.open(fileobj=f, mode="w|",
                                                          format=tarfile.USTAR_FORMAT) as tar:
            for i, L in enumerate(lengths):
                ids = rng.integers(3, 1000, size=int(L)).astype(np.uint32)
                seg = [{"start": 0, "end": int(L), "prompt_length": 0,
                        "slot_starts": list(range(0, int(L), 8))}]
                w = write_sample(tar, encode_sample(f"s{s0 + i:09d}", ids, seg))
                layouts.append((sample_index.key_hash(f"s{s0 + i:09d}"), sample_index.slot_runs(seg)))
                rows.append((w["start"], *w["tokens.npy"], *w["json"], int(L)))
                tokens += int(L)
        with open(folder / name, "rb") as f:  # with each sample's digest
            rows = np.array(rows, dtype=sample_index.DTYPE_V1)
            records = sample_index.add_digests(f, rows, name)[0]
        data = sample_index.encode(records, sample_index.SlotLayout.of_samples(layouts)
                                   if index_version == 3 else None)
        (folder / sample_index.index_name(name)).write_bytes(data)
        size = (folder / name).stat().st_size
        nbytes += size
        entries.append({"name": name, "samples": n, "tokens": tokens, "bytes": size,
                        "index": index_entry(sample_index.index_name(name), data)})
    (folder / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "tokenizer": TOKENIZER, "max_length": max_length, "options": {},
         "splits": {"train": entries}, "skipped": {}}))
    return nbytes


def tar_walk(fs, root, entry, mode, with_layout=False):
    """The index as the loader found it before: walking the shard's tar headers."""
    with fs.open(f"{root}/{entry['name']}", "rb") as f:
        records = sample_index.build(f, entry["name"])[0]
    return (records, None) if with_layout else records


class Mode:
    """`with Mode(before):` the loader locates samples by a tar walk (before) or the index."""

    def __init__(self, before: bool):
        self.before, self.real = before, shard_io.read_sample_index

    def __enter__(self):
        if self.before:
            shard_io.read_sample_index = tar_walk

    def __exit__(self, *a):
        shard_io.read_sample_index = self.real


def time_open(folder: Path) -> dict:
    import fsspec
    fs = fsspec.filesystem("file")
    m = json.loads((folder / "manifest.json").read_text())
    e = m["splits"]["train"][0]
    out = {}
    for label, before in (("before", True), ("after", False)):
        t = time.perf_counter()
        rec = (tar_walk if before else shard_io.read_sample_index)(fs, str(folder), e, "error")
        out[label] = time.perf_counter() - t
        assert len(rec) == e["samples"]
    return out


def time_resume(folder: Path, max_length: int) -> dict:
    out = {}
    kw = dict(num_workers=0, shuffle=False, verify_shards="off", shuffle_buffer=1000)
    ref = build_loader(str(folder), "train", 4, max_length, **kw)
    state = ref.state_dict()
    m = json.loads((folder / "manifest.json").read_text())
    state["cursor"] = [0, m["splits"]["train"][0]["samples"] // 2 // 1000, 0]  # mid first shard
    for label, before in (("before", True), ("after", False)):
        with Mode(before):
            t = time.perf_counter()
            loader = build_loader(str(folder), "train", 4, max_length, **kw)
            loader.load_state_dict(state)
            next(iter(loader))
            out[label] = time.perf_counter() - t
    return out


def time_launch(folder: Path, max_length: int) -> dict:
    out = {}
    for label, before in (("before", True), ("after", False)):
        with Mode(before):  # forked workers inherit the patched function
            t = time.perf_counter()
            loader = build_loader(str(folder), "train", 4, 2 * max_length, num_workers=2,
                                  pack=True, verify_shards="off", shuffle_buffer=1000)
            it = iter(loader)
            next(it)
            out[label] = time.perf_counter() - t
            del it
    return out


# Bytes read through the fsspec protocol "countfile" (`register_counting_fs`), forked loader
# workers included (a shared counter; reset it before each measured read).
BYTES_READ = multiprocessing.Value("q", 0)


class _Counted(io.RawIOBase):
    """A file of the local filesystem whose reads add their length to `BYTES_READ`."""

    def __init__(self, f):
        self.f = f

    def readable(self):
        return True

    def read(self, n=-1):
        data = self.f.read(n)
        with BYTES_READ.get_lock():
            BYTES_READ.value += len(data)
        return data

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self):
        return self.f.tell()

    def close(self):
        self.f.close()
        super().close()


def register_counting_fs() -> None:
    """Register fsspec protocol "countfile": the local filesystem, every byte read through it
    counted in `BYTES_READ` (bytes, int64). Folder paths are given as `countfile://<path>`."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class CountingFS(LocalFileSystem):
        protocol = "countfile"

        def _open(self, path, mode="rb", **kw):
            return _Counted(super()._open(path, mode, **kw))

    fsspec.register_implementation("countfile", CountingFS, clobber=True)


def bytes_per_epoch(folder: Path, max_length: int, shard_bytes: int) -> dict:
    register_counting_fs()
    BYTES_READ.value = 0
    t = time.perf_counter()
    loader = build_loader(f"countfile://{folder}", "train", 8, max_length, num_workers=0,
                          verify_shards="off", infinite=False, shuffle_buffer=1000)
    n = sum(len(b["keys"]) for b in loader)
    return {"samples": n, "bytes_read": BYTES_READ.value, "ratio": BYTES_READ.value / shard_bytes,
            "seconds": time.perf_counter() - t,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _dual_rank(rank: int, folder: str, max_length: int, window: int, mode: str, out) -> None:
    from pipeline.objective import ObjectiveConfig
    loader = build_loader(f"countfile://{folder}", "train", 4, 2 * max_length, dp_rank=rank,
                          dp_size=2, num_workers=2, pack=True, infinite=False,
                          shuffle_buffer=window, objective_cfg=ObjectiveConfig(
                              mode=mode, dual_masking="refusion"))
    n = built = 0
    for b in loader:
        n += len(b["keys"])
        built += sum(v.numel() * v.element_size() for v in b.values() if hasattr(v, "numel"))
    out.put((rank, n, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, built))


def dual_bytes_per_epoch(folder: Path, max_length: int, shard_bytes: int, window: int,
                         mode: str = "dual") -> dict:
    """Bytes read by 2 DP ranks x 2 workers over one shuffled dual-mode epoch (see the module
    docstring), and the largest worker peak RSS in MB."""
    register_counting_fs()
    BYTES_READ.value = 0
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    t = time.perf_counter()
    procs = [ctx.Process(target=_dual_rank, args=(r, str(folder), max_length, window, mode, q))
             for r in range(2)]
    for p in procs:
        p.start()
    res = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return {"samples": sum(r[1] for r in res), "bytes_read": BYTES_READ.value,
            "ratio": BYTES_READ.value / shard_bytes, "seconds": time.perf_counter() - t,
            "worker_rss_mb": max(r[2] for r in res), "batch_bytes": sum(r[3] for r in res)}


def main_dual(a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ep = Path(tmp) / "epoch"
        ep_bytes = write_folder(ep, a.epoch_samples, -(-a.epoch_samples // 10), a.max_length, seed=2,
                                index_version=a.index_version)
        idx = sum(p.stat().st_size for p in ep.glob("*.idx"))
        print(f"{a.epoch_samples} samples in 10 shards, index version {a.index_version} "
              f"({idx / ep_bytes * 100:.2f} % of the shards' bytes)")
        for window in (int(w) for w in a.windows.split(",")):
            b = dual_bytes_per_epoch(ep, a.max_length, ep_bytes, window, a.objective)
            print(f"{a.objective} epoch, 2 ranks x 2 workers, window {window}: {b['samples']} samples, "
                  f"{b['bytes_read'] / 1e6:.1f} MB read = {b['ratio']:.3f} x the shard bytes "
                  f"({ep_bytes / 1e6:.1f} MB, indexes included), {b['seconds']:.1f} s, largest "
                  f"worker peak RSS {b['worker_rss_mb']:.0f} MB; the batches as built (tensors, "
                  f"what a TP broadcast of them would move): {b['batch_bytes'] / 1e6:.0f} MB = "
                  f"{b['batch_bytes'] / b['bytes_read']:.0f} x the bytes read")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=125_000, help="samples of the one-shard figures")
    p.add_argument("--total", type=int, default=50_000, help="samples of the launch figures")
    p.add_argument("--epoch-samples", type=int, default=20_000,
                   help="samples of the bytes-per-epoch figure (10 shards)")
    p.add_argument("--max-length", type=int, default=320, help="tokens per sample at most")
    p.add_argument("--dual", action="store_true", help="only the dual-mode bytes figure")
    p.add_argument("--windows", default="1000,10000", help="shuffle windows of --dual")
    p.add_argument("--objective", choices=("dual", "refusion", "ar"), default="dual",
                   help="--dual: the objective mode of that epoch (the others: to compare the "
                   "bytes of their batches)")
    p.add_argument("--index-version", type=int, choices=(2, 3), default=3,
                   help="--dual: the indexes' layout version (2: no slot layouts, the loader "
                   "reads each window whole)")
    a = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f})")
    if a.dual:
        main_dual(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big"
        t = time.perf_counter()
        nbytes = write_folder(big, a.samples, a.samples, a.max_length)
        idx = (big / "train-000000.tar.idx").stat().st_size
        print(f"one shard: {a.samples} samples, {nbytes / 1e6:.0f} MB, index {idx / 1e6:.2f} MB "
              f"(written in {time.perf_counter() - t:.0f} s)")
        o = time_open(big)
        print(f"open a new shard: before (tar walk) {o['before']:.3f} s "
              f"({o['before'] / a.samples * 1e6:.1f} us/sample), after (index) {o['after']:.4f} s "
              f"-> {o['before'] / o['after']:.0f}x")
        r = time_resume(big, a.max_length)
        print(f"resume mid-shard to first batch: before {r['before']:.3f} s, after "
              f"{r['after']:.3f} s")
        ep = Path(tmp) / "epoch"
        ep_bytes = write_folder(ep, a.epoch_samples, -(-a.epoch_samples // 10), a.max_length, seed=2)
        b = bytes_per_epoch(ep, a.max_length, ep_bytes)
        print(f"one shuffled epoch from a counting fsspec filesystem: {b['samples']} samples, "
              f"{b['bytes_read'] / 1e6:.1f} MB read = {b['ratio']:.4f} x the shard bytes "
              f"(index included), {b['seconds']:.1f} s, peak RSS {b['peak_rss_mb']:.0f} MB")
        for label, per in (("many small", 1_000), ("few large", a.total // 2)):
            d = Path(tmp) / label.replace(" ", "_")
            write_folder(d, a.total, per, a.max_length // 4, seed=1)
            s = time_launch(d, a.max_length // 4)
            print(f"launch to first batch, {a.total} samples in {-(-a.total // per)} shards "
                  f"({label}; 2 workers, packed, shuffled): before {s['before']:.2f} s, after "
                  f"{s['after']:.2f} s")


if __name__ == "__main__":
    main()
