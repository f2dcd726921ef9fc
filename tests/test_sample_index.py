"""The per-shard sample index (`<shard>.idx`): written by data prep (one machine, packed and
unpacked, and a merged array folder with rewritten units) equal to an index computed here by
walking each tar with `tarfile`; the loader reads only the indexes and byte ranges (no tar
header walk) and yields every sample as the tar holds it; `shard.py index` mends a folder made
before indexes existed and is idempotent; a damaged or missing index is one line.

References we did not write: Python's tarfile (the walk below) and numpy's .npy reader.
"""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_prep import shard
from pipeline.data import DataError, build_loader
from pipeline.data import sample_index
from pipeline.data.format import CHECKSUM_FIELD, manifest_checksum, with_checksum
from pipeline.objective import ObjectiveConfig
from shard_fixtures import random_samples, write_shards
from test_data_prep import QA_ROWS, corpus_dir, spm_model, write_jsonl  # noqa: F401 (fixtures)


def walk_index(path: Path) -> list[tuple]:
    """(start, tokens offset, tokens size, json offset, json size, tokens, key) per sample,
    found by reading the whole tar with tarfile (members grouped by key, in order)."""
    out = []
    with tarfile.open(path, "r:") as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        groups: dict = {}
        for m in members:
            key, _, ext = m.name.partition(".")
            groups.setdefault(key, {})[ext] = m
        for key, g in groups.items():
            tokens = np.load(io.BytesIO(tf.extractfile(g["tokens.npy"]).read()))
            out.append((min(m.offset for m in g.values()), g["tokens.npy"].offset_data,
                        g["tokens.npy"].size, g["json"].offset_data, g["json"].size, len(tokens), key))
    return out


def check_folder(folder: Path) -> int:
    """Every shard's index equals the walk and its manifest entry; returns the shards seen."""
    m = json.loads((folder / "manifest.json").read_text())
    n = 0
    for entries in m["splits"].values():
        for e in entries:
            ix = e["index"]
            assert ix["name"] == e["name"] + ".idx"
            data = (folder / ix["name"]).read_bytes()
            assert len(data) == ix["bytes"] and hashlib.sha256(data).hexdigest() == ix["sha256"]
            assert data[:8] == b"RFSIDX\x00\x03" and ix["version"] == 3
            N = int.from_bytes(data[8:16], "little")
            assert N == e["samples"]
            rec = np.frombuffer(data, sample_index.DTYPE, N, offset=16)
            got = [tuple(int(x) for x in r) for r in rec]
            want = walk_index(folder / e["name"])
            assert [g[:6] for g in got] == [w[:6] for w in want]
            # the slot layouts (version 3): key hash, runs of equal slot sizes per segment
            at = 16 + 44 * N
            hashes = [data[at + 16 * i:at + 16 * (i + 1)] for i in range(N)]
            counts = np.frombuffer(data, "<u4", N, at + 16 * N)
            runs = np.frombuffer(data, "<u4", 2 * int(counts.sum()), at + 20 * N).reshape(-1, 2)
            assert len(data) == at + 20 * N + 8 * int(counts.sum())
            r0 = 0
            for i, (w, js) in enumerate(zip(want, _jsons(folder / e["name"]))):
                assert hashes[i] == hashlib.blake2b(w[6].encode(), digest_size=16).digest()
                sizes = []   # (segment, slot size) per slot, from the json
                for j, seg in enumerate(json.loads(js)["segments"]):
                    b = seg["slot_starts"] + [seg["end"]]
                    sizes += [(j, y - x) for x, y in zip(b[:-1], b[1:])]
                mine, j = [], -1
                for size, packed in runs[r0:r0 + counts[i]]:
                    count, flags = int(packed) & 0xFFFF, int(packed) >> 16
                    j += flags & 1
                    mine += [(j, int(size))] * int(count)
                assert mine == sizes
                r0 += int(counts[i])
            blob = (folder / e["name"]).read_bytes()
            for g in got:  # the digest: BLAKE2b-64 (hashlib) of the sample's bytes, as uint64 LE
                end = max(g[1] + g[2], g[3] + g[4])
                h = hashlib.blake2b(blob[g[0]:end], digest_size=8).digest()
                assert g[6] == int.from_bytes(h, "little")
            assert len(got) == e["samples"] and sum(r[5] for r in got) == e["tokens"]
            n += 1
    return n


def test_data_prep_writes_the_index_packed_and_unpacked(tmp_path, spm_model, corpus_dir):
    rows = QA_ROWS + [{"query": f"q{i}", "response": "w " * (i * 7 % 60)} for i in range(1, 40)]
    src = write_jsonl(tmp_path / "qa.jsonl", rows)
    for extra in ([], ["--pack"]):
        out = tmp_path / f"out{len(extra)}"
        args = ["--input", src, "--input", corpus_dir, "--tokenizer", spm_model, "--max-length",
                64, "--val-fraction", "0.25", "--shard-samples", 7, "--output", out, "--no-progress",
                *extra]
        assert shard.main([str(a) for a in args]) == 0
        assert check_folder(out) >= 4
        m = json.loads((out / "manifest.json").read_text())
        if extra:
            assert any(len(json.loads(s)["segments"]) > 1 for s in _jsons(out / m["splits"]["train"][0]["name"]))


def _jsons(path: Path):
    with tarfile.open(path) as tf:
        return [tf.extractfile(m).read() for m in tf.getmembers() if m.name.endswith(".json")]


def test_merged_array_folder_has_checked_indexes(tmp_path, capsys):
    from test_data_prep_array import UNIT, COMMON, _corpus_and_tokenizer
    corpus, tok = _corpus_and_tokenizer(tmp_path)
    out = tmp_path / "k3"
    run = lambda *a: shard.main([str(x) for x in a])  # noqa: E731
    assert run("plan", "--input", corpus, "--output", out, "--tokenizer", tok, "--unit-bytes",
               UNIT, *COMMON, "--pack") == 0
    for t in range(3):
        assert run("run", "--output", out, "--task", t, "--num-tasks", 3) == 0
    assert run("merge", "--output", out) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["plan"]["rewritten_units"]
    names = [e["name"] for s in m["splits"].values() for e in s]
    assert any("/dedup-" in n for n in names)  # rewritten shards have their own indexes
    assert check_folder(out) == len(names)
    # a damaged index of a part is refused by the merge, naming it (a unit not rewritten)
    e = next(e for e in m["splits"]["train"] if "/dedup-" not in e["name"])
    victim = out / e["index"]["name"]
    data = bytearray(victim.read_bytes())
    data[20] ^= 1
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert run("merge", "--output", out) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and victim.name in err and "sha256" in err and "does not match" in err


@pytest.fixture
def folder(tmp_path) -> Path:
    rng = np.random.default_rng(3)
    write_shards(str(tmp_path / "d"), {"train": random_samples(rng, 45, max_length=40)},
                 samples_per_shard=10)
    return tmp_path / "d"


def _stream(folder: Path) -> dict:
    """{key: tokens} read straight from the tars."""
    out = {}
    for p in sorted(folder.glob("train-*.tar")):
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".tokens.npy"):
                    out[m.name.split(".")[0]] = np.load(io.BytesIO(tf.extractfile(m).read()))
    return out


def _keys_and_tokens(loader) -> list:
    got = []
    for b in loader:
        for key, ids, seg in zip(b["keys"], b["input_ids"], b["segment_ids"]):
            got.append((key, ids, seg))
    return got


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_reads_no_tar_headers(folder, monkeypatch, num_workers):
    """With tarfile's header walk disabled the loader yields every sample once, in manifest
    order unshuffled, with the tokens the tar holds; packed (shuffled) as well."""
    want = _stream(folder)
    ar = ObjectiveConfig(mode="ar")  # rows hold the sample's tokens in natural order
    ref = _keys_and_tokens(build_loader(str(folder), "train", 3, 40, num_workers=0, shuffle=False,
                                        infinite=False, seed=2, objective_cfg=ar))

    def refuse(*a, **k):
        raise AssertionError("the loader walked tar headers")
    monkeypatch.setattr(tarfile.TarFile, "next", refuse)
    monkeypatch.setattr(tarfile, "open", refuse)
    got = _keys_and_tokens(build_loader(str(folder), "train", 3, 40, num_workers=num_workers,
                                        shuffle=False, infinite=False, seed=2, objective_cfg=ar))
    keys = [k for k, _, _ in got]
    assert keys == sorted(want) == [k for k, _, _ in ref]
    for key, ids, seg in got:
        n = int((seg > 0).sum())
        assert ids[:n].tolist() == want[key].tolist()
    packed = build_loader(str(folder), "train", 2, 80, num_workers=num_workers, pack=True,
                          shuffle=True, shuffle_buffer=16, infinite=False, seed=2)
    seen = [k for b in packed for k in b["keys"]]
    assert sorted(seen) == sorted(want)


def test_missing_index_is_one_line_and_shard_index_mends_it(tmp_path, capsys):
    rng = np.random.default_rng(4)
    samples = random_samples(rng, 25, max_length=30)
    ref, old = tmp_path / "ref", tmp_path / "old"
    write_shards(str(ref), {"train": samples}, samples_per_shard=10)
    write_shards(str(old), {"train": samples}, samples_per_shard=10, index=False)
    assert not list(old.glob("*.idx"))
    with pytest.raises(DataError) as e:
        build_loader(str(old), "train", 2, 30)
    msg = str(e.value)
    assert "\n" not in msg and "train-000000.tar" in msg and f"shard.py index {old}" in msg
    assert shard.main(["index", str(old)]) == 0
    assert "3 sample index(es) written, 0 already valid" in capsys.readouterr().err
    for p in sorted(ref.glob("*.idx")):  # the same bytes as indexes written with the shards
        assert (old / p.name).read_bytes() == p.read_bytes()
    got = json.loads((old / "manifest.json").read_text())   # `shard.py index` adds the checksum
    assert got.pop(CHECKSUM_FIELD) == manifest_checksum(got)
    assert got == json.loads((ref / "manifest.json").read_text())
    check_folder(old)
    a = _keys_and_tokens(build_loader(str(old), "train", 2, 30, num_workers=0, infinite=False, seed=1))
    b = _keys_and_tokens(build_loader(str(ref), "train", 2, 30, num_workers=0, infinite=False, seed=1))
    assert [k for k, _, _ in a] == [k for k, _, _ in b] and len(a) == 25
    # idempotent: nothing rewritten; a lost index is written again, alone
    stat = {p.name: p.stat().st_mtime_ns for p in old.glob("*.idx")}
    assert shard.main(["index", str(old)]) == 0
    assert "0 sample index(es) written, 3 already valid" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in old.glob("*.idx")} == stat
    (old / "train-000001.tar.idx").unlink()
    assert shard.main(["index", str(old)]) == 0
    assert "1 sample index(es) written, 2 already valid" in capsys.readouterr().err
    assert (old / "train-000001.tar.idx").read_bytes() == (ref / "train-000001.tar.idx").read_bytes()
    # not a shard folder: one line, exit 2
    assert shard.main(["index", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no manifest.json" in err


def _add_shard_digests(folder: Path) -> None:
    """Record each shard's sha256 and size in manifest.json, as data prep does."""
    m = json.loads((folder / "manifest.json").read_text())
    for e in m["splits"]["train"]:
        blob = (folder / e["name"]).read_bytes()
        e["sha256"], e["bytes"] = hashlib.sha256(blob).hexdigest(), len(blob)
    (folder / "manifest.json").write_text(json.dumps(m, indent=1))


def test_shard_index_upgrades_version_1_indexes(tmp_path, capsys, monkeypatch):
    """Version-1 indexes (no per-sample digests) are read as before, each shard hashed whole
    once per process, with one note naming `shard.py index`; that command upgrades them to
    version 3 (the bytes data prep writes, under `<shard>.v3.idx`: the version-1 files stay for
    loaders that read the manifest before), resumably, refusing a shard that differs from its
    manifest entry; then the loader hashes no shard whole and yields the same batches."""
    from pipeline.data import shard_io
    samples = random_samples(np.random.default_rng(6), 25, max_length=30)
    ref, old = tmp_path / "ref", tmp_path / "old"
    for d, v in ((ref, 3), (old, 1)):
        write_shards(str(d), {"train": samples}, samples_per_shard=10, index_version=v)
        _add_shard_digests(d)
    assert (old / "train-000000.tar.idx").read_bytes()[7] == 1
    calls = []
    real = shard_io._file_sha256
    monkeypatch.setattr(shard_io, "_file_sha256", lambda fs, p: calls.append(p) or real(fs, p))
    shard_io._VERIFIED.clear()
    shard_io._NOTED_V1.clear()
    capsys.readouterr()
    before = _keys_and_tokens(build_loader(str(old), "train", 2, 30, num_workers=0, infinite=False, seed=1))
    assert sorted(calls) == [f"{old}/train-00000{i}.tar" for i in range(3)]
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and f"python data_prep/shard.py index {old}" in err
    assert "3 shard(s) of split 'train' (first: train-000000.tar) have version-1" in err
    # a shard that differs from its manifest entry is refused, its index left as it was
    shard2 = old / "train-000002.tar"
    good = shard2.read_bytes()
    shard2.write_bytes(good[:600] + bytes([good[600] ^ 1]) + good[601:])
    assert shard.main(["index", str(old)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and err.count("upgraded") == 2  # shards 0 and 1 were done
    assert f"error: shard {shard2}: sha256" in err and "damaged or replaced" in err
    assert (old / "train-000002.tar.idx").read_bytes()[7] == 1
    shard2.write_bytes(good)
    assert shard.main(["index", str(old)]) == 0  # resumes: the one left
    assert "1 sample index(es) written, 2 already valid" in capsys.readouterr().err
    for p in sorted(ref.glob("*.idx")):  # the same bytes as version-3 indexes written whole
        assert (old / p.name.replace(".idx", ".v3.idx")).read_bytes() == p.read_bytes()
        assert (old / p.name).read_bytes()[7] == 1  # the version-1 file, left in place
    want = json.loads((ref / "manifest.json").read_text())
    want.pop(CHECKSUM_FIELD, None)
    for e in want["splits"]["train"]:
        e["index"]["name"] = e["index"]["name"].replace(".idx", ".v3.idx")
    got = json.loads((old / "manifest.json").read_text())   # `shard.py index` adds the checksum
    assert got.pop(CHECKSUM_FIELD) == manifest_checksum(got)
    assert got == want
    calls.clear()
    shard_io._VERIFIED.clear()
    shard_io._NOTED_V1.clear()
    after = _keys_and_tokens(build_loader(str(old), "train", 2, 30, num_workers=0, infinite=False, seed=1))
    assert calls == [] and "note: " not in capsys.readouterr().err  # (in this process: 0 workers)
    assert [(k, t.tolist()) for k, t, _ in after] == [(k, t.tolist()) for k, t, _ in before]


def test_index_entries_are_not_part_of_the_shard_set(tmp_path):
    """A loader state resumes on the same shards whatever their manifest says of the indexes
    (a run started before `shard.py index` added them keeps its shard set)."""
    rng = np.random.default_rng(5)
    ref = tmp_path / "ref"
    write_shards(str(ref), {"train": random_samples(rng, 20, max_length=30)}, samples_per_shard=10)
    a = build_loader(str(ref), "train", 2, 30, num_workers=0)
    it = iter(a)
    next(it)
    state = a.state_dict()
    m = json.loads((ref / "manifest.json").read_text())
    for e in m["splits"]["train"]:
        e["index"]["sha256"] = "0" * 64  # not checked with verify_shards=off
    other = tmp_path / "other"
    shutil.copytree(ref, other)
    (other / "manifest.json").write_text(json.dumps(m))
    b = build_loader(str(other), "train", 2, 30, num_workers=0, verify_shards="off")
    assert b.load_state_dict(state) is None  # the same shard set: no new pass
    assert b.state_dict()["config"]["data"] == state["config"]["data"]
    m["splits"]["train"][0]["tokens"] += 1  # a shard field that is part of the set
    (other / "manifest.json").write_text(json.dumps(m))
    c = build_loader(str(other), "train", 2, 30, num_workers=0, verify_shards="off")
    with pytest.raises(DataError):
        c.load_state_dict(state)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_index_is_one_line_naming_it(folder, damage):
    victim = folder / "train-000002.tar.idx"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[16 + 36 + 4] ^= 0x10
    else:
        data = data[:-5]
    victim.write_bytes(bytes(data))
    loader = build_loader(str(folder), "train", 2, 40, num_workers=0, shuffle=False, infinite=False)
    with pytest.raises(DataError) as e:
        for _ in loader:
            pass
    msg = str(e.value)
    assert "\n" not in msg and "train-000002.tar.idx" in msg
    assert "sha256" in msg and "does not match manifest.json" in msg
    if damage == "truncate":  # the layout is checked even without digests
        loader = build_loader(str(folder), "train", 2, 40, num_workers=0, shuffle=False,
                              infinite=False, verify_shards="off")
        with pytest.raises(DataError, match=r"train-000002\.tar\.idx: \d+ bytes, expected"):
            for _ in loader:
                pass


def _range_fs(fetched: dict):
    """An fsspec filesystem over local files whose files are fsspec's buffered remote-file
    class with its default read-ahead cache (as s3fs, gcsfs and http files are): every byte
    fetched from disk is added to `fetched[path]`."""
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.spec import AbstractBufferedFile

    class RangeFile(AbstractBufferedFile):
        def _fetch_range(self, start, end):
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            fetched[self.path] = fetched.get(self.path, 0) + len(data)
            return data

    class RangeFS(LocalFileSystem):
        protocol = "rangefile"

        def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
                  **kwargs):
            if mode != "rb":
                return super()._open(path, mode, block_size=block_size, **kwargs)
            return RangeFile(self, self._strip_protocol(path), mode, block_size or "default",
                             cache_options=cache_options, **kwargs)

    return RangeFS


@pytest.mark.parametrize("pack", [False, True])
def test_an_epoch_from_a_read_ahead_filesystem_reads_each_sample_once(tmp_path, pack):
    """One shuffled epoch through a filesystem that reads ahead (5 MB blocks, fsspec's default;
    s3fs reads 50 MB) fetches from each shard exactly the byte ranges its index gives its
    samples, no more: each sample is one range read without the cache (the read-ahead fetched
    the rest of the shard at every jump of the shuffled order)."""
    import fsspec
    rng = np.random.default_rng(5)
    root = tmp_path / "d"
    write_shards(str(root), {"train": random_samples(rng, 120, max_length=40)},
                 samples_per_shard=30)
    fetched: dict = {}
    fsspec.register_implementation("rangefile", _range_fs(fetched), clobber=True)
    loader = build_loader(f"rangefile://{root}", "train", 4, 80 if pack else 40, num_workers=0,
                          pack=pack, shuffle=True, shuffle_buffer=32, infinite=False, seed=1,
                          verify_shards="off")
    assert sum(len(b["keys"]) for b in loader) == 120
    tars = sorted(root.glob("train-*.tar"))
    assert len(tars) == 4
    for tar in tars:
        idx = sample_index.decode((root / sample_index.index_name(tar.name)).read_bytes(), "t")
        ranges = int((sample_index.sample_end(idx) - idx["start"].astype(np.int64)).sum())
        assert fetched[str(tar)] == ranges < tar.stat().st_size


@pytest.mark.parametrize("block", [1, 7, 512, 1000, 4096])
def test_add_digests_equals_hashing_each_range(folder, monkeypatch, block):
    """`add_digests` reads the shard in blocks; every block size (a sample or the gap before
    the next one cut by a block's end) gives the digests of the sample ranges themselves, and
    the shard's sha256 and size."""
    monkeypatch.setattr(sample_index, "_BLOCK", block)
    tar = folder / "train-000001.tar"
    blob = tar.read_bytes()
    rec = sample_index.decode((folder / "train-000001.tar.idx").read_bytes(), "t")
    with open(tar, "rb") as f:
        got, sha, size = sample_index.add_digests(f, rec, "t")
    ends = sample_index.sample_end(rec)
    want = [int.from_bytes(hashlib.blake2b(blob[int(a):int(b)], digest_size=8).digest(), "little")
            for a, b in zip(rec["start"], ends)]
    assert [int(d) for d in got["digest"]] == want and (rec["digest"] == got["digest"]).all()
    assert sha == hashlib.sha256(blob).hexdigest() and size == len(blob)
    with open(tar, "rb") as f, pytest.raises(DataError, match="past the file's end"):
        sample_index.add_digests(io.BytesIO(f.read(int(ends[-1]) - 1)), rec, "t")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("stop", ["index_written", "first_shard_done"])
def test_a_loader_opening_the_folder_while_shard_index_upgrades_it_works(tmp_path, monkeypatch,
                                                                          stop):
    """`shard.py index` (version 2 -> 3) stopped after writing the first shard's new index but
    before the manifest names it, or after its first shard: a loader opened then and a loader
    opened before the upgrade and read after it (its manifest names the old files) both yield
    the batches of the folder indexed whole, with verification on, in modes dual (packed) and
    refusion."""
    from data_prep import writer
    samples = random_samples(np.random.default_rng(8), 30, max_length=30)
    ref, d = tmp_path / "ref", tmp_path / "d"
    for f, v in ((ref, 3), (d, 2)):
        write_shards(str(f), {"train": samples}, samples_per_shard=10, index_version=v)
        _add_shard_digests(f)
    kws = [dict(objective_cfg=ObjectiveConfig(mode="dual", dual_masking="refusion"), pack=True),
           dict(objective_cfg=ObjectiveConfig(), pack=True)]

    def batches(folder, loader=None, kw=None):
        loader = loader or build_loader(str(folder), "train", 2, 40, num_workers=0, seed=2,
                                        infinite=False, shuffle_buffer=12, **kw)
        return [(b["keys"], b["input_ids"].tolist()) for b in loader]

    want = [batches(ref, kw=kw) for kw in kws]
    early = [build_loader(str(d), "train", 2, 40, num_workers=0, seed=2, infinite=False,
                          shuffle_buffer=12, **kw) for kw in kws]
    name, real = ("write_json", writer.Output.write_json) if stop == "index_written" else \
        ("add_digests", sample_index.add_digests)
    calls = []

    def stop_at_second_call(*a, **k):   # write_json: the first call; add_digests: the second
        calls.append(1)
        if len(calls) > (name == "add_digests"):
            raise _Stop()
        return real(*a, **k)

    monkeypatch.setattr(writer.Output if name == "write_json" else sample_index, name,
                        stop_at_second_call)
    with pytest.raises(_Stop):
        writer.index_shards(str(d))
    m = json.loads((d / "manifest.json").read_text())
    assert [e["index"]["version"] for e in m["splits"]["train"]] == \
        ([2, 2, 2] if stop == "index_written" else [3, 2, 2])
    assert (d / "train-000000.tar.v3.idx").exists()
    for kw, w in zip(kws, want):
        assert batches(d, kw=kw) == w
    monkeypatch.undo()
    writer.index_shards(str(d))
    for loader, w in zip(early, want):
        assert batches(d, loader) == w
    for kw, w in zip(kws, want):
        assert batches(d, kw=kw) == w


def test_overwrite_removes_upgraded_indexes(tmp_path, spm_model, corpus_dir):
    """A folder whose version-2 indexes `shard.py index` upgraded (to `<shard>.v3.idx`, the old
    files left) and that data prep then rebuilds with --overwrite holds what a run into an
    empty folder holds: no index of the old folder is left."""
    src = ["--input", corpus_dir, "--tokenizer", spm_model, "--max-length", 64,
           "--shard-samples", 50, "--no-progress"]
    out = tmp_path / "out"
    assert shard.main([str(a) for a in [*src, "--output", out]]) == 0
    m = json.loads((out / "manifest.json").read_text())
    for entries in m["splits"].values():   # as a folder indexed before slot layouts
        for e in entries:
            rec = sample_index.decode((out / e["index"]["name"]).read_bytes(), "x")
            data = sample_index.encode(rec)
            (out / e["index"]["name"]).write_bytes(data)
            e["index"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), version=2)
    (out / "manifest.json").write_text(json.dumps(with_checksum(m)))
    assert shard.main(["index", str(out)]) == 0
    assert sorted(out.glob("*.v3.idx")) and len(list(out.glob("*.idx"))) == 2 * len(list(out.glob("*.tar")))
    assert shard.main([str(a) for a in [*src, "--output", out, "--seed", 5, "--overwrite"]]) == 0
    assert shard.main([str(a) for a in [*src, "--output", tmp_path / "fresh", "--seed", 5]]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "fresh").iterdir())


@pytest.mark.parametrize("damage", ["size", "count", "flags"])
def test_damaged_slot_layout_is_one_line_naming_it(folder, damage):
    """A version-3 index whose slot layout cannot be its samples' (runs covering more tokens
    than the sample has, an empty run, a sample's first run not starting a segment) is refused
    in one line naming the file and record, with verification off too (the sha256 is not
    checked then)."""
    victim = folder / "train-000001.tar.idx"
    data = bytearray(victim.read_bytes())
    n = int.from_bytes(data[8:16], "little")
    first_run = 16 + 44 * n + 20 * n        # sample 0's first run: size u32, count u16, flags u16
    if damage == "size":
        data[first_run:first_run + 4] = (10_000).to_bytes(4, "little")
    elif damage == "count":
        data[first_run + 4:first_run + 6] = (0).to_bytes(2, "little")
    else:
        data[first_run + 6:first_run + 8] = (0).to_bytes(2, "little")
    victim.write_bytes(bytes(data))
    loader = build_loader(str(folder), "train", 2, 40, num_workers=0, shuffle=False,
                          infinite=False, verify_shards="off")
    with pytest.raises(DataError) as e:
        for _ in loader:
            pass
    msg = str(e.value)
    assert "\n" not in msg and "train-000001.tar.idx" in msg
    assert "the slot layout of record 0 does not fit" in msg


def test_member_names_are_parsed_once_the_same_way(tmp_path):
    """The index builder and the streamed reader take keys from member names with one function
    (`split_member`): a dot in a folder of the name is not the key's end."""
    from pipeline.data.shard_io import iter_shard_samples
    assert sample_index.split_member("a/b.c/k0.tokens.npy") == ("a/b.c/k0", "tokens.npy")
    assert sample_index.split_member("k1.json") == ("k1", "json")
    path = tmp_path / "train-000000.tar"
    with tarfile.open(path, "w") as tf:
        for key in ("d.1/k0", "d.1/k1"):
            buf = io.BytesIO()
            np.save(buf, np.arange(3, dtype=np.uint32))
            for ext, data in (("tokens.npy", buf.getvalue()), ("json", b'{"segments": []}')):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    with open(path, "rb") as f:
        _, keys = sample_index.build(f, str(path))
    streamed = [s["__key__"] for s in iter_shard_samples(str(tmp_path), [{"name": path.name}],
                                                          verify="off")]
    assert keys == streamed == ["d.1/k0", "d.1/k1"]
