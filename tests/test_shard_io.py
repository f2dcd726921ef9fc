"""Remote and damaged shards: the loader and data prep over HTTP (with and without range
requests) and memory://, a missing filesystem package in one line at every entry point, and
shard integrity (swapped shards, a flipped bit, a tar damaged in the middle or truncated).

References we did not write: Python's http.server (the range-capable handler below follows
RFC 9110 byte ranges), fsspec's HTTP and memory filesystems, hashlib, tarfile, and the same
loader reading a local copy of the folder.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import tarfile
import threading
from pathlib import Path

import fsspec
import numpy as np
import pytest

from pipeline.data import shard_io
from pipeline.data import DataError, build_loader
from shard_fixtures import random_samples, write_shards
from test_data_prep_safety import spm_model  # noqa: F401 (a module fixture)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers

def _handler(folder: Path, ranges: bool):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _file(self):
            p = folder / self.path.lstrip("/").split("?")[0]
            return p if p.is_file() else None

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        def _serve(self, head: bool):
            p = self._file()
            if p is None:
                self.send_error(404)
                return
            data = p.read_bytes()
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")) if ranges else None
            if m:
                a = int(m.group(1))
                b = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                body = data[a:b + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            else:
                body = data
                self.send_response(200)
            if ranges:
                self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
    return Handler


@pytest.fixture
def http_server():
    """Start servers on 127.0.0.1: `serve(folder, ranges=True)` -> base URL."""
    servers = []

    def serve(folder: Path, ranges: bool = True) -> str:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(folder, ranges))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"
    yield serve
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def add_digests(folder: Path) -> dict:
    """Record each shard's sha256 and size in manifest.json, as data_prep/shard.py does."""
    mpath = folder / "manifest.json"
    m = json.loads(mpath.read_text())
    for entries in m["splits"].values():
        for e in entries:
            blob = (folder / e["name"]).read_bytes()
            e["sha256"], e["bytes"] = hashlib.sha256(blob).hexdigest(), len(blob)
    mpath.write_text(json.dumps(m))
    return m


def make_folder(folder: Path, n: int = 30, per_shard: int = 10, index_version: int = 2) -> Path:
    rng = np.random.default_rng(0)
    write_shards(str(folder), {"train": random_samples(rng, n, vocab_size=64, max_length=24)},
                 samples_per_shard=per_shard, max_length=24, index_version=index_version)
    add_digests(folder)
    return folder


def one_pass(data_dir: str, **kw) -> list:
    loader = build_loader(data_dir, "train", 2, 64, num_workers=kw.pop("num_workers", 0),
                          shuffle=kw.pop("shuffle", False), infinite=False,
                          vocab_size=kw.pop("vocab_size", 64), seed=1, **kw)
    return [(tuple(b["keys"]), b["input_ids"].clone()) for b in loader]


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and bool((x[1] == y[1]).all()) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- remote reads

def test_loader_over_http_with_ranges_and_memory(tmp_path, http_server):
    local = make_folder(tmp_path / "shards")
    want = one_pass(str(local), shuffle=True)
    assert sum(len(k) for k, _ in want) >= 30
    base = http_server(tmp_path)
    assert same_batches(one_pass(f"{base}/shards", shuffle=True), want)
    mem = fsspec.filesystem("memory")
    for p in local.iterdir():
        mem.pipe(f"/sio/shards/{p.name}", p.read_bytes())
    assert same_batches(one_pass("memory://sio/shards", shuffle=True), want)
    # with a loader worker process as well (the fork inherits nothing it needs from here)
    assert same_batches(one_pass(f"{base}/shards", shuffle=True, num_workers=1), want)


def test_http_server_without_ranges_is_one_line(tmp_path, http_server):
    make_folder(tmp_path / "shards")
    base = http_server(tmp_path, ranges=False)
    with pytest.raises(DataError) as e:  # shuffled: reads start inside shards (sample ranges)
        one_pass(f"{base}/shards", verify_shards="off", shuffle=True)
    msg = str(e.value)
    assert "\n" not in msg and "does not support range requests" in msg and "train-00000" in msg


def test_data_prep_reads_http_and_memory_inputs(tmp_path, http_server, capsys, spm_model):
    from data_prep import cli
    from test_data_prep import folder_bytes
    spm = spm_model
    rows = [{"query": f"q{i}", "response": f"r{i} " * (i % 7 + 1)} for i in range(40)]
    src = tmp_path / "web" / "qa.jsonl"
    src.parent.mkdir()
    src.write_bytes(b"\r\n".join(json.dumps(r).encode() for r in rows))
    fsspec.filesystem("memory").pipe("/sio_in/qa.jsonl", src.read_bytes())
    base = http_server(tmp_path / "web")
    outs = {}
    for name, url in (("local", str(src)), ("http", f"{base}/qa.jsonl"), ("mem", "memory://sio_in/qa.jsonl")):
        out = tmp_path / f"out_{name}"
        code = cli.main(["--input", url, "--output", str(out), "--tokenizer", str(spm),
                           "--max-length", "64", "--no-progress"])
        assert code == 0, capsys.readouterr().err
        outs[name] = {k: v for k, v in folder_bytes(out).items() if k.endswith(".tar")}
    assert outs["local"] and outs["http"] == outs["local"] == outs["mem"]
    capsys.readouterr()
    code = cli.main(["--input", str(src), "--output", f"{base}/out", "--tokenizer", str(spm),
                       "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "read-only" in err, err
    # and the training loader reads what data prep wrote, over HTTP
    want = one_pass(str(tmp_path / "out_local"), vocab_size=None)
    got = one_pass(http_server(tmp_path) + "/out_local", vocab_size=None)
    assert same_batches(got, want)


def test_missing_filesystem_package_is_one_line_everywhere(tmp_path, capsys, spm_model):
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed: nothing is missing")
    except ImportError:
        pass
    url = "s3://no-bucket/shards"
    with pytest.raises(DataError) as e:
        build_loader(url, "train", 1, 8)
    assert str(e.value) == (f"{url}: the s3:// filesystem needs a package that is not installed "
                            "(Install s3fs to access S3); pip install s3fs")
    from data_prep import cli
    for flag in ("--input", "--output"):
        args = {"--input": str(tmp_path / "x.jsonl"), "--output": str(tmp_path / "o")}
        (tmp_path / "x.jsonl").write_text('{"text": "t"}\n')
        args[flag] = url
        code = cli.main(["--input", args["--input"], "--output", args["--output"],
                           "--tokenizer", spm_model, "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install s3fs" in err, err
    from data_prep import train_tokenizer
    code = train_tokenizer.main(["--input", str(tmp_path / "x.jsonl"), "--output", f"{url}/t.model"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install s3fs" in err, err
    from pipeline.inference.evaluation import shard_qa_examples
    with pytest.raises(DataError) as e:
        shard_qa_examples(url, "val", 4)
    assert "pip install s3fs" in str(e.value)
    # the trainer's config check
    from pipeline.config import ConfigError, load_config, validate
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"run_dir": str(tmp_path / "run"), "data": {"dir": url},
                               "model": {"inline": {"vocab_size": 64, "hidden_size": 32,
                                                    "intermediate_size": 64, "num_layers": 1,
                                                    "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "head_dim": 8,
                                                    "max_position_embeddings": 64}},
                               "train": {"max_steps": 1, "micro_batch_size": 1}}))
    with pytest.raises(ConfigError) as e:
        validate(load_config(str(cfg)), world_size=1)
    assert "\n" not in str(e.value) and "pip install s3fs" in str(e.value)


# ----------------------------------------------------------------------------- integrity

def test_swapped_shards_stop_with_one_line_index_v1(tmp_path):
    """Version-1 indexes (no per-sample digests): the whole shard's sha256 names the swap."""
    d = make_folder(tmp_path / "shards", index_version=1)
    a, b = d / "train-000000.tar", d / "train-000001.tar"
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)
    with pytest.raises(DataError) as e:
        one_pass(str(d))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"shard {d}/train-000000.tar: sha256 ")
    assert "its content is shard train-000001.tar" in msg
    # in a loader worker process too: the same single line reaches the caller
    shard_io._VERIFIED.clear()
    with pytest.raises(DataError) as e:
        one_pass(str(d), num_workers=1)
    assert "\n" not in str(e.value) and "its content is shard train-000001.tar" in str(e.value)


def _token_offset(path: Path, sample: int) -> int:
    """Byte offset of the first token of a sample's tokens.npy in the tar (tarfile + npy header)."""
    with tarfile.open(path) as tf:
        members = [m for m in tf.getmembers() if m.name.endswith(".tokens.npy")]
        m = members[sample]
        with tf.extractfile(m) as f:
            raw = f.read()
    header = raw.index(b"\n") + 1  # the npy header ends with a newline
    return m.offset_data + header


def test_flipped_bit_error_warn_off_index_v1(tmp_path, capsys, monkeypatch):
    d = make_folder(tmp_path / "shards", index_version=1)
    clean = one_pass(str(d))
    shard = d / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    off = _token_offset(shard, 3)
    blob[off] ^= 1  # the low bit of one token id
    shard.write_bytes(bytes(blob))
    shard_io._VERIFIED.clear()
    with pytest.raises(DataError) as e:
        one_pass(str(d))
    assert "\n" not in str(e.value) and f"shard {shard}: sha256" in str(e.value)
    assert "damaged in place" in str(e.value)
    capsys.readouterr()
    warned = one_pass(str(d), verify_shards="warn")
    err = capsys.readouterr().err
    assert err.count("warning: shard") == 1 and str(shard) in err
    assert "sha256" in err
    assert not same_batches(warned, clean)  # the flipped token is what trains
    diff = [int((x[1] != y[1]).sum()) for x, y in zip(warned, clean)]
    assert sum(diff) == 1
    assert same_batches(one_pass(str(d), verify_shards="off"), warned)
    assert capsys.readouterr().err == ""
    with pytest.raises(DataError):
        build_loader(str(d), "train", 1, 24, verify_shards="maybe")


def test_each_shard_is_hashed_once_per_process_index_v1(tmp_path, monkeypatch):
    d = make_folder(tmp_path / "shards", n=40, per_shard=10, index_version=1)
    calls = []
    real = shard_io._file_sha256
    monkeypatch.setattr(shard_io, "_file_sha256", lambda fs, p: calls.append(p) or real(fs, p))
    shard_io._VERIFIED.clear()
    loader = build_loader(str(d), "train", 2, 24, num_workers=0, shuffle_buffer=8, vocab_size=64)
    it = iter(loader)
    for _ in range(60):  # three epochs of 20 micro-batches
        next(it)
    assert sorted(calls) == sorted(f"{d}/train-00000{i}.tar" for i in range(4))


def _count_whole_hashes(monkeypatch) -> list:
    calls = []
    real = shard_io._file_sha256
    monkeypatch.setattr(shard_io, "_file_sha256", lambda fs, p: calls.append(p) or real(fs, p))
    shard_io._VERIFIED.clear()
    return calls


def test_flipped_byte_is_caught_when_its_sample_is_read(tmp_path, capsys, monkeypatch):
    """Version-2 indexes: no shard is hashed whole; a flipped token byte stops the pass at the
    sample that holds it (error), warns once (warn), or trains as is (off)."""
    d = make_folder(tmp_path / "shards")
    calls = _count_whole_hashes(monkeypatch)
    clean = one_pass(str(d))
    shard = d / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    blob[_token_offset(shard, 3)] ^= 1  # the low bit of one token id of sample 13
    shard.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        one_pass(str(d), num_workers=1)  # from a loader worker: the same one line
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"shard {shard}: sample train0000013 (#3 of the shard) "
                                              "does not match its digest in train-000001.tar.idx")
    assert "damaged in place" in msg and "re-copy the shard" in msg
    capsys.readouterr()
    warned = one_pass(str(d), verify_shards="warn")
    err = capsys.readouterr().err
    assert err.count("warning: shard") == 1 and "sample train0000013" in err
    diff = [int((x[1] != y[1]).sum()) for x, y in zip(warned, clean)]
    assert len(warned) == len(clean) and sum(diff) == 1  # the flipped token is what trains
    assert same_batches(one_pass(str(d), verify_shards="off"), warned)
    assert capsys.readouterr().err == ""
    assert calls == []  # never a whole-shard hash


def test_damaged_sample_stops_only_its_reader(tmp_path):
    """Verification is per sample read: a damaged sample another rank reads does not stop this
    rank (error mode); the rank that reads it stops there, after the samples before it."""
    d = make_folder(tmp_path / "shards")
    shard = d / "train-000000.tar"
    blob = bytearray(shard.read_bytes())
    blob[_token_offset(shard, 2)] ^= 2  # sample 2: round 0, rows 2-3 are rank 1's
    shard.write_bytes(bytes(blob))

    def rank(r):
        return build_loader(str(d), "train", 2, 64, dp_rank=r, dp_size=2, num_workers=0,
                            shuffle=False, infinite=False, vocab_size=64, seed=1)
    keys = [k for b in rank(0) for k in b["keys"]]
    assert keys == [f"train{i:07d}" for i in range(30) if i % 4 in (0, 1)]
    with pytest.raises(DataError, match=r"train-000000\.tar: sample train0000002 \(#2 of"):
        for _ in rank(1):
            pass


def test_swapped_shards_of_equal_size_are_caught_by_sample_digests(tmp_path, monkeypatch):
    d = make_folder(tmp_path / "shards")
    a, b = d / "train-000000.tar", d / "train-000001.tar"
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    assert len(blob_a) == len(blob_b)  # the size check at open cannot see this swap
    calls = _count_whole_hashes(monkeypatch)
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)
    with pytest.raises(DataError) as e:
        one_pass(str(d))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"shard {a}: sample train0000010 (#0 of the shard) does "
                                              "not match its digest")
    assert "its bytes are those of shard train-000001.tar of the manifest" in msg
    assert calls == []
    # a file of the same size that is no shard of the manifest: damaged or replaced
    write_shards(str(tmp_path / "other"), {"train": random_samples(np.random.default_rng(9), 10,
                                                                   vocab_size=64, max_length=24)})
    foreign = (tmp_path / "other" / "train-000000.tar").read_bytes()
    a.write_bytes(foreign[:len(blob_a)].ljust(len(blob_a), b"\0"))
    b.write_bytes(blob_b)
    with pytest.raises(DataError) as e:
        one_pass(str(d))
    msg = str(e.value)
    assert msg.startswith(f"shard {a}: sample train0000000 (#0 of the shard) does not match")
    assert "damaged in place (bit flip, bad copy) or replaced by another file of the same size" in msg


def test_truncated_or_resized_shard_is_caught_at_open(tmp_path, capsys, monkeypatch):
    d = make_folder(tmp_path / "shards")
    calls = _count_whole_hashes(monkeypatch)
    shard = d / "train-000002.tar"
    blob = shard.read_bytes()
    shard.write_bytes(blob[:len(blob) - 1024])
    loader = build_loader(str(d), "train", 2, 64, num_workers=0, shuffle=False, infinite=False,
                          vocab_size=64)
    with pytest.raises(DataError) as e:
        for _ in loader:
            pass
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"shard {shard}: truncated: {len(blob) - 1024} of {len(blob)} bytes")
    assert loader.consumed_samples == 20  # shards 0 and 1 were read; shard 2 stops at open
    capsys.readouterr()
    assert len([k for b in build_loader(str(d), "train", 2, 64, num_workers=0, shuffle=False,
                                        infinite=False, vocab_size=64, verify_shards="warn")
                for k in b["keys"]]) == 30  # the samples still lie in the shorter file
    assert capsys.readouterr().err.count("warning: shard") == 1
    assert calls == []


def test_damaged_tar_is_not_called_truncated(tmp_path):
    d = make_folder(tmp_path / "shards")
    shard = d / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tf:
        m = tf.getmembers()[8]  # a header in the middle of the shard
    blob[m.offset:m.offset + 512] = b"\x7f" * 512
    shard.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        one_pass(str(d), verify_shards="off")
    msg = str(e.value)
    assert "\n" not in msg and "truncated" not in msg and "damaged in place" in msg, msg
    shard.write_bytes(bytes(blob[:len(blob) // 2]))  # now really truncated
    with pytest.raises(DataError) as e:
        one_pass(str(d), verify_shards="off")
    assert f"truncated: {len(blob) // 2} of {len(blob)} bytes" in str(e.value)


def test_streamed_reader_checks_digests(tmp_path, capsys):
    """`iter_shard_samples` (pipeline.evaluate's reader) checks each sample it streams against
    its digest (version-2 index): the damaged sample is named."""
    d = make_folder(tmp_path / "shards", n=25, per_shard=10)
    entries = json.loads((d / "manifest.json").read_text())["splits"]["train"]
    got = list(shard_io.iter_shard_samples(str(d), entries))
    assert [s["__key__"] for s in got] == [f"train{i:07d}" for i in range(25)]
    with tarfile.open(d / "train-000002.tar") as tf:  # the same bytes tarfile reads
        ref = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    assert got[24]["tokens.npy"] == ref["train0000024.tokens.npy"]
    shard = d / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    blob[_token_offset(shard, 2)] ^= 4
    shard.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        list(shard_io.iter_shard_samples(str(d), entries))
    assert "\n" not in str(e.value) and f"shard {shard}: sample train0000012 (#2 of the shard)" \
        in str(e.value), str(e.value)
    assert len(list(shard_io.iter_shard_samples(str(d), entries, verify="warn"))) == 25
    assert capsys.readouterr().err.count("warning: shard") == 1


def _qa_reference(folder: Path, split: str = "train") -> list[tuple[int, dict]]:
    """(global sample number, example) of every query/response segment of `split`, read with
    tarfile straight from the shards in manifest order (no checks)."""
    import io
    out, n = [], 0
    for e in json.loads((folder / "manifest.json").read_text())["splits"][split]:
        with tarfile.open(folder / e["name"]) as tf:
            files = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for key in sorted({name.split(".")[0] for name in files}):
            toks = np.load(io.BytesIO(files[f"{key}.tokens.npy"])).tolist()
            for seg in json.loads(files[f"{key}.json"])["segments"]:
                a, p = seg["start"], seg["prompt_length"]
                if p > 0:
                    out.append((n, {"prompt_ids": toks[a:a + p],
                                    "reference_ids": toks[a + p:seg["end"]]}))
            n += 1
    return out


@pytest.mark.parametrize("index_version", [2, 1])
def test_shard_qa_examples_checks_every_sample_it_returns(tmp_path, index_version):
    """`shard_qa_examples` (pipeline.evaluate's examples) checks each sample it returns, also
    when `limit` stops it inside a shard: a damaged sample among those returned is refused in
    one line; one after the limit is read only with version-1 indexes (the shard is hashed
    whole before its first sample) and refused there, not seen with per-sample digests."""
    from pipeline.inference.evaluation import shard_qa_examples
    d = make_folder(tmp_path / "shards", n=30, per_shard=10, index_version=index_version)
    ref = _qa_reference(d)
    limit = next(i for i, (n, _) in enumerate(ref) if n >= 13) + 1   # ends in shard 1
    last = ref[limit - 1][0]                                        # its sample, 3 <= last % 10
    assert 13 <= last < 19 and ref[limit][0] > last
    assert shard_qa_examples(str(d), "train", limit) == [ex for _, ex in ref[:limit]]
    shard = d / "train-000001.tar"
    clean = shard.read_bytes()
    for damaged, refused in ((last, True), (last + 1, index_version == 1)):
        blob = bytearray(clean)
        blob[_token_offset(shard, damaged - 10)] ^= 4
        shard.write_bytes(bytes(blob))
        shard_io._VERIFIED.clear()
        if refused:
            with pytest.raises(DataError) as e:
                shard_qa_examples(str(d), "train", limit)
            msg = str(e.value)
            assert "\n" not in msg and f"shard {shard}" in msg, msg
            if index_version == 2:
                assert f"sample train{damaged:07d} (#{damaged - 10} of the shard)" in msg, msg
        else:
            assert shard_qa_examples(str(d), "train", limit) == [ex for _, ex in ref[:limit]]
        assert len(shard_qa_examples(str(d), "train", limit, verify="off")) == limit
    shard.write_bytes(clean)


def test_manifest_checksum_refuses_an_edited_manifest(tmp_path, spm_model, capsys):
    """Data prep records manifest.json's sha256 of its own canonical JSON; a flipped digit of
    `tokenizer.mask_id` or `max_length` is refused in one line naming the file (the loader and
    the CLIs exit 2, as for any data error), a re-indented one is not; a manifest without the
    field (older folders) loads, and `shard.py index` adds the field."""
    from data_prep import cli, shard
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"query": f"q{i}", "response": f"r{i} " * (i % 5 + 1)})
                           + "\n" for i in range(30)))
    out = tmp_path / "out"
    assert cli.main(["--input", str(src), "--output", str(out), "--tokenizer", spm_model,
                     "--max-length", "64", "--no-progress"]) == 0
    mpath = out / "manifest.json"
    text = mpath.read_text()
    m = json.loads(text)
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}   # written out independently
    want = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest()
    assert m["manifest_sha256"] == want
    assert shard_io.read_manifest(str(out)) == m
    mpath.write_text(json.dumps(m, indent=4, sort_keys=True))   # layout only: still loads
    assert shard_io.read_manifest(str(out)) == m
    mask_id, max_length = m["tokenizer"]["mask_id"], m["max_length"]
    for old, new in ((f'"mask_id": {mask_id}', f'"mask_id": {mask_id + 1}'),
                     (f'\n "max_length": {max_length}', f'\n "max_length": {max_length * 10}')):
        assert text.count(old) == 1
        mpath.write_text(text.replace(old, new))
        for read in (lambda: shard_io.read_manifest(str(out)),
                     lambda: build_loader(str(out), "train", 2, 1024, num_workers=0)):
            with pytest.raises(DataError) as e:
                read()
            msg = str(e.value)
            assert "\n" not in msg and str(mpath) in msg and "manifest_sha256" in msg, msg
        capsys.readouterr()
        assert shard.main(["index", str(out)]) == 2   # not blessed by `shard.py index`
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "manifest_sha256" in err, err
    del m["manifest_sha256"]   # a folder from before the checksum: loads unchecked
    mpath.write_text(json.dumps(m, indent=1))
    assert shard_io.read_manifest(str(out)) == m
    assert shard.main(["index", str(out)]) == 0
    assert json.loads(mpath.read_text())["manifest_sha256"] == want
