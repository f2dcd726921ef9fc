"""Bytes an S3-compatible server sends for one epoch of the loader, against the shards' bytes.

A moto S3 server (`moto.server`, in a thread of this process) behind a WSGI wrapper that adds
up the body bytes of every GET it answers (and counts the GETs); the shard folder
(`bench_shard_index.write_folder`: data prep's tar layout and sample indexes, `--samples`
samples of ~2 KB in `--shards` shards, each shard's sha256 in the manifest as data prep
records it) is uploaded to it, and the loader reads
`s3://bench/shards` through s3fs (`build_loader`, one shuffled pass, `infinite=False`,
micro-batch 8). Each configuration runs in a fresh process (its forked loader workers, if
any, use the same server); the figure is bytes served during the pass / bytes of the shards
(indexes not counted in the denominator, counted when read).

Configurations (`--configs`, comma-separated `mode:verify:workers:pack`): sample index
("after") or the tar-header walk it replaced ("before", `bench_shard_index.Mode`),
`data.verify_shards` off or error (error checks each sample's digest from its version-2 index
as it is read; with version-1 indexes it read each shard whole once per process to hash it),
loader workers, unpacked or packed. moto copies the whole object for every range request, so
on a small machine keep the shards small (`--samples 3000 --shards 6`: minutes per
configuration on a loaded 2-core machine).

Needs `moto[server]` and `s3fs` (not project dependencies): run it with a venv of its own that
also sees the project's packages (a `.pth` file naming the project venv's site-packages):

    .venv/bin/python -m venv /tmp/s3venv && /tmp/s3venv/bin/pip install "moto[server]" s3fs
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" > \
        "$(/tmp/s3venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/project.pth"
    /tmp/s3venv/bin/python bench/bench_s3_bytes.py [--samples 20000] [--shards 10]
        [--max-length 320] [--configs after:off:0:unpacked,...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

for _k, _v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
               ("AWS_DEFAULT_REGION", "us-east-1")):
    os.environ[_k] = _v


class Counter:
    """WSGI wrapper: adds up the response body bytes and the number of GET requests."""

    def __init__(self, app):
        self.app, self.bytes, self.gets, self.lock = app, 0, 0, threading.Lock()

    def __call__(self, environ, start_response):
        body = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return body
        n = 0
        try:
            for chunk in body:
                n += len(chunk)
                yield chunk
        finally:
            with self.lock:
                self.bytes += n
                self.gets += 1


def _QuietHandler():
    from werkzeug.serving import WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log_request(self, *a, **k):  # one line per GET otherwise
            pass
    return Quiet


def start_server():
    """(endpoint URL, Counter) of a moto S3 server on a free local port."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server
    counter = Counter(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True,
                         request_handler=_QuietHandler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", counter


def one_pass(endpoint: str, cfg: dict, out) -> None:
    """Child process: one pass of the loader over s3://bench/shards; sends its figures."""
    import fsspec
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    from bench_shard_index import Mode
    from pipeline.data import build_loader
    t = time.perf_counter()
    with Mode(cfg["mode"] == "before"):
        loader = build_loader("s3://bench/shards", "train", 8, cfg["max_length"],
                              num_workers=cfg["workers"], pack=cfg["pack"],
                              verify_shards=cfg["verify"], infinite=False, shuffle_buffer=1000)
        n = sum(len(b["keys"]) for b in loader)
    out.send({"samples": n, "seconds": time.perf_counter() - t,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--max-length", type=int, default=320)
    p.add_argument("--configs", default="after:off:0:unpacked,after:error:0:unpacked,"
                   "before:off:0:unpacked,after:off:2:unpacked,after:off:0:packed",
                   help="comma-separated mode:verify:workers:pack")
    a = p.parse_args()
    import fsspec
    from bench_shard_index import write_folder
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    endpoint, counter = start_server()
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    fs = fsspec.filesystem("s3")
    fs.mkdir("bench")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        shard_bytes = write_folder(folder, a.samples, -(-a.samples // a.shards), a.max_length,
                                   seed=2)
        m = json.loads((folder / "manifest.json").read_text())
        for e in m["splits"]["train"]:  # as data prep records it: what verify_shards checks
            e["sha256"] = hashlib.sha256((folder / e["name"]).read_bytes()).hexdigest()
        (folder / "manifest.json").write_text(json.dumps(m))
        fs.put(str(folder) + "/", "bench/shards/", recursive=True)
    print(f"{a.samples} samples in {a.shards} shards, {shard_bytes / 1e6:.1f} MB, uploaded to "
          f"moto at {endpoint}", flush=True)
    ctx = multiprocessing.get_context("fork")
    for spec in a.configs.split(","):
        mode, verify, workers, pack = spec.split(":")
        cfg = {"mode": mode, "verify": verify, "workers": int(workers), "pack": pack == "packed",
               "max_length": a.max_length * (2 if pack == "packed" else 1)}
        with counter.lock:
            b0, g0 = counter.bytes, counter.gets
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=one_pass, args=(endpoint, cfg, send))
        proc.start()
        r = recv.recv()
        proc.join()
        with counter.lock:
            nb, ng = counter.bytes - b0, counter.gets - g0
        print(f"{mode:6s} verify={verify:5s} workers={workers} {pack:8s}: {r['samples']} samples, "
              f"{nb / 1e6:.1f} MB served in {ng} GETs = {nb / shard_bytes:.4f} x the shard bytes; "
              f"{r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
