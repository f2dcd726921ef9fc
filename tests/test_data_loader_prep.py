"""The loader on shards written by data_prep/shard.py with the real Qwen3 tokenizer: the
tokenizer check, and every sample recovered intact (natural order) from the reorganized rows."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from data_prep import cli
from pipeline.tokenizer import qwen3_tokenizer_dir
from pipeline.data import DataError, build_loader

ROWS = [
    {"query": "Write a function that returns the square of x.", "response": "def sq(x):\n    return x * x\n"},
    {"query": "Reverse a string s.", "response": "def rev(s):\n    return s[::-1]\n"},
    {"query": "Sum a list.", "response": "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n"},
    {"query": "Is n even?", "response": "def even(n):\n    return n % 2 == 0\n"},
    {"query": "Max of two numbers a and b, without using max().",
     "response": "def biggest(a, b):\n    if a > b:\n        return a\n    return b\n"},
    {"query": "Count vowels in text.", "response": "def vowels(t):\n    return sum(c in 'aeiou' for c in t.lower())\n"},
]


def _read_tars(out):
    import webdataset as wds
    manifest = json.loads((out / "manifest.json").read_text())
    samples = {}
    for e in manifest["splits"]["train"]:
        data = (out / e["name"]).read_bytes()
        for s in wds.tariterators.group_by_keys(
                wds.tariterators.tar_file_expander([{"stream": io.BytesIO(data), "url": e["name"]}])):
            samples[s["__key__"]] = (np.load(io.BytesIO(s["tokens.npy"])), json.loads(s["json"]))
    return manifest, samples


@pytest.mark.parametrize("pack", [False, True])
def test_loader_reads_data_prep_qwen3_shards(tmp_path, pack):
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "shards"
    code = cli.main(["--input", str(src), "--output", str(out), "--tokenizer", qwen3_tokenizer_dir(),
                       "--max-length", "128", "--slot-sizes", "4,8", "--shard-samples", "4",
                       "--no-progress"])
    assert code == 0
    manifest, samples = _read_tars(out)
    mask_id = manifest["tokenizer"]["mask_id"]
    with pytest.raises(DataError, match="vocab_size 151671 > model vocab_size 151669"):
        build_loader(str(out), "train", 2, 128, vocab_size=151669)
    loader = build_loader(str(out), "train", 2, 128, num_workers=0, vocab_size=151936, pack=pack,
                          infinite=False, seed=1)
    seen = []
    for b in loader:
        seen += b["keys"]
        keys = iter(b["keys"])
        for r in range(2):
            seg_ids = b["segment_ids"][r]
            for s in seg_ids[seg_ids > 0].unique().tolist():
                sel = seg_ids == s
                pos = b["position_ids"][r][sel]
                ids, lab, msk = b["input_ids"][r][sel], b["labels"][r][sel], b["is_masked"][r][sel]
                assert (ids[msk] == mask_id).all()
                natural = np.empty(len(pos), dtype=np.int64)
                natural[pos.numpy()] = np.where(msk.numpy(), lab.numpy(), ids.numpy())
                tokens, meta = samples[next(keys)]  # data_prep wrote one segment per sample
                assert len(meta["segments"]) == 1
                assert natural.tolist() == tokens.tolist()
    assert sorted(seen) == sorted(samples)
