"""Packing in objective mode "dual" by fed lengths taken from the sample indexes' slot layouts
(version 3): the same batches as packing by the fed lengths of the samples read and
reorganized (what a folder whose indexes have no layouts still gets, version 2), each process
reading only the samples of its own rows; bit-identical resume with another worker count;
elastic resume on another DP layout (every remaining sample once); a
layout that disagrees with its sample is one line; a loader opening a folder while
`shard.py index` upgrades it works.

References: the loader on version-2 indexes (the fed length from `reorganize_sample` of the
sample read), and the samples each rank's batches hold (what it must read, each once)."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from pipeline.data import DataError, build_loader, sample_index, shard_io
from pipeline.data import reader as reader_mod
from pipeline.objective import ObjectiveConfig
from shard_fixtures import random_samples, write_shards
from test_data_loader import TENSORS, _take

T = 64


def _batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        for k in (*TENSORS, "copy_id", "clean_limit", "copy_tokens", "dropped_copies"):
            assert torch.equal(x[k], y[k]), k


def _all(loader):
    out = []
    for b in loader:
        out.append({k: b[k] for k in (*TENSORS, "keys", "copy_id", "clean_limit", "copy_tokens",
                                       "dropped_copies")})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same samples with version-3 and version-2 indexes."""
    samples = random_samples(np.random.default_rng(21), 70, max_length=40, min_length=3,
                             max_segments=4, slot_sizes=(1, 2, 3, 5, 8), max_prompt=6)
    root = tmp_path_factory.mktemp("dualpack")
    for v in (3, 2):
        write_shards(str(root / f"v{v}"), {"train": samples}, samples_per_shard=16, max_length=40,
                     index_version=v)
    return root / "v3", root / "v2"


def _count_reads(monkeypatch):
    reads = []
    real = reader_mod.Reader.read
    monkeypatch.setattr(reader_mod.Reader, "read", lambda self, g: reads.append(g) or real(self, g))
    return reads


@pytest.mark.parametrize("masking,packing,slot_sizes", [
    ("refusion", "best_fit", None), ("all", "best_fit", None), ("refusion", "next_fit", None),
    ("refusion", "best_fit", [2, 5])])
def test_layout_packing_equals_reading_and_reads_only_own_rows(folders, monkeypatch, capsys,
                                                               masking, packing, slot_sizes):
    v3, v2 = folders
    cfg = ObjectiveConfig(mode="dual", dual_masking=masking, slot_sizes=slot_sizes)
    reads = _count_reads(monkeypatch)
    shard_io._NOTED_NO_LAYOUT.clear()
    for rank in range(2):
        kw = dict(dp_rank=rank, dp_size=2, seed=4, num_workers=0, objective_cfg=cfg, pack=True,
                  packing=packing, shuffle_buffer=25, infinite=False)
        reads.clear()
        capsys.readouterr()
        got = _all(build_loader(str(v3), "train", 2, T, **kw))
        mine = [k for b in got for k in b["keys"]]
        assert len(reads) == len(mine) == len(set(mine))  # its own rows' samples, each once
        assert "note: " not in capsys.readouterr().err
        reads.clear()
        want = _all(build_loader(str(v2), "train", 2, T, **kw))
        assert len(reads) == 70  # version 2: every sample of every window (reused for its rows)
        _batches_equal(got, want)
        err = capsys.readouterr().err
        assert err.count("note: ") == (rank == 0) and (rank or f"shard.py index {v2}" in err)
        assert not rank or "slot layouts" not in err   # once per process


def test_resume_with_another_worker_count_is_bit_identical(folders):
    v3, _ = folders
    cfg = ObjectiveConfig(mode="dual", dual_masking="refusion")
    kw = dict(dp_size=2, seed=2, objective_cfg=cfg, pack=True, shuffle_buffer=20)
    for rank in range(2):
        full = _take(build_loader(str(v3), "train", 2, T, dp_rank=rank, num_workers=0, **kw), 30)
        first = build_loader(str(v3), "train", 2, T, dp_rank=rank, num_workers=0, **kw)
        head = _take(first, 11)
        again = build_loader(str(v3), "train", 2, T, dp_rank=rank, num_workers=2, **kw)
        again.load_state_dict(json.loads(json.dumps(first.state_dict())))
        rest = _take(again, 19)
        assert again.epoch >= 1   # past an epoch boundary: the draws of the next epoch
        for x, y in zip(full, head + rest):
            assert x["keys"] == y["keys"]
            for k in TENSORS:
                assert torch.equal(x[k], y[k]), k


def test_a_layout_that_disagrees_with_its_sample_is_one_line(folders, tmp_path):
    v3, _ = folders
    d = tmp_path / "bad"
    shutil.copytree(v3, d)
    m = json.loads((d / "manifest.json").read_text())
    e = m["splits"]["train"][0]
    data = (d / e["index"]["name"]).read_bytes()
    rec, layout = sample_index.decode(data, "x", with_layout=True)
    swapped = sample_index.SlotLayout(np.roll(layout.key_hash, 1, axis=0), layout.run_first,
                                      layout.runs)   # each sample's draws from another key
    data = sample_index.encode(rec, swapped)
    (d / e["index"]["name"]).write_bytes(data)
    e["index"]["sha256"] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))
    cfg = ObjectiveConfig(mode="dual", dual_masking="refusion")
    with pytest.raises(DataError) as err:
        _all(build_loader(str(d), "train", 2, T, num_workers=0, objective_cfg=cfg, pack=True,
                          shuffle=False, infinite=False, shuffle_buffer=16))
    msg = str(err.value)
    assert "\n" not in msg and "train-000000.tar" in msg and "slot layout gives" in msg


def test_elastic_resume_sees_every_remaining_sample_once(folders):
    """A state of 2 DP ranks x micro-batch 2 continued on 1 rank x micro-batch 3
    (`allow_reshard`): the samples of the epoch's remaining rows, each exactly once, and with
    the samples the two ranks yielded before, the whole epoch."""
    v3, _ = folders
    cfg = ObjectiveConfig(mode="dual", dual_masking="refusion")
    kw = dict(seed=6, objective_cfg=cfg, pack=True, shuffle_buffer=20, infinite=False,
              num_workers=0)
    before, states = [], []
    for rank in range(2):
        ld = build_loader(str(v3), "train", 2, T, dp_rank=rank, dp_size=2, **kw)
        before += [k for b in _take(ld, 4) for k in b["keys"]]
        states.append(ld.state_dict())
    assert states[0]["cursor"] == states[1]["cursor"]
    after = build_loader(str(v3), "train", 3, T, dp_rank=0, dp_size=1, **kw)
    after.load_state_dict(states[1], allow_reshard=True)
    rest = [k for b in after for k in b["keys"]]
    assert len(set(before)) == len(before) and len(set(rest)) == len(rest)
    assert not set(before) & set(rest)
    assert sorted(before + rest) == [f"train{i:07d}" for i in range(70)]
