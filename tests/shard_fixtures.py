"""Write small shard folders in the ARCHITECTURE.md "Shard format", for tests and benches.

Independent of data_prep/shard.py on purpose (it is written with webdataset's TarWriter
straight from the format description), so loader tests do not depend on the producer.

    samples = random_samples(np.random.default_rng(0), 40, vocab_size=64, max_length=48)
    manifest = write_shards("memory://ds", {"train": samples}, samples_per_shard=10)
"""
from __future__ import annotations

import json

import numpy as np

DEFAULT_TOKENIZER = {"kind": "hf", "name": "fixture", "hash": "fixture-0", "vocab_size": 64,
                     "eos_id": 1, "pad_id": 0, "mask_id": 2, "bos_id": None}


def random_segments(rng: np.random.Generator, length: int, max_segments: int = 3,
                    slot_sizes=(1, 2, 3, 4, 8), max_prompt: int = 6) -> list[dict]:
    """Random valid segments covering `length` tokens (each with a non-empty response).

    Slot sizes are drawn per segment from `slot_sizes`; prompt lengths in [0, max_prompt].
    """
    n_seg = int(rng.integers(1, max_segments + 1))
    n_seg = max(1, min(n_seg, length // 2))
    cuts = np.sort(rng.choice(np.arange(1, length), size=n_seg - 1, replace=False)) if n_seg > 1 else []
    bounds = [0, *[int(c) for c in cuts], length]
    segments = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        P = int(rng.integers(0, min(max_prompt, b - a - 1) + 1))
        k = int(rng.choice(slot_sizes))
        segments.append({"start": a, "end": b, "prompt_length": P,
                         "slot_starts": list(range(a + P, b, k))})
    return segments


def random_samples(rng: np.random.Generator, n: int, vocab_size: int = 64, max_length: int = 48,
                   min_length: int = 4, first_id: int = 3, **segment_kw) -> list[tuple[np.ndarray, list]]:
    """`n` random (tokens uint32[L], segments) samples, L in [min_length, max_length].

    Token ids are drawn from [first_id, vocab_size) so they never equal the special ids of
    DEFAULT_TOKENIZER.
    """
    out = []
    for _ in range(n):
        L = int(rng.integers(min_length, max_length + 1))
        tokens = rng.integers(first_id, vocab_size, size=L).astype(np.uint32)
        out.append((tokens, random_segments(rng, L, **segment_kw)))
    return out


def write_shards(data_dir: str, splits: dict, samples_per_shard: int = 10,
                 tokenizer: dict | None = None, max_length: int | None = None,
                 options: dict | None = None, index: bool = True, index_version: int = 3,
                 key_prefix: str = "") -> dict:
    """Write `<data_dir>/manifest.json` and `<split>-NNNNNN.tar` shards, each with its sample
    index `<shard>.idx` (`index=False`: a folder as written before sample indexes existed;
    `index_version=1`: indexes without per-sample digests, 2: without slot layouts, as
    written before those existed).

    Args:
        data_dir: local folder or fsspec URL.
        splits: {"train": [(tokens, segments), ...], ...}; keys are `<split>NNNNNNN`.
        samples_per_shard: samples per tar (the last one may hold fewer).
        tokenizer: manifest "tokenizer" entry (default DEFAULT_TOKENIZER).
        max_length: manifest max_length (default: the longest sample).
        key_prefix: put before every key (folders of a mixture with keys of their own).

    Returns:
        The manifest dict (as written).
    """
    import fsspec
    import webdataset as wds

    fs, root = fsspec.core.url_to_fs(data_dir)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    manifest_splits = {}
    longest = 0
    for split, samples in splits.items():
        entries = []
        for s0 in range(0, len(samples), samples_per_shard):
            name = f"{split}-{s0 // samples_per_shard:06d}.tar"
            chunk = samples[s0:s0 + samples_per_shard]
            tmp = f"{root}/.{name}.tmp"
            with fs.open(tmp, "wb") as f:
                with wds.TarWriter(f, mtime=0) as w:
                    for i, (tokens, segments) in enumerate(chunk):
                        w.write({"__key__": f"{key_prefix}{split}{s0 + i:07d}",
                                 "tokens.npy": np.asarray(tokens, dtype=np.uint32),
                                 "json": {"segments": segments}})
            fs.mv(tmp, f"{root}/{name}")
            entry = {"name": name, "samples": len(chunk), "tokens": int(sum(len(t) for t, _ in chunk))}
            if index:
                entry["index"] = write_index(fs, root, name, index_version)
            entries.append(entry)
            longest = max([longest, *(len(t) for t, _ in chunk)])
        manifest_splits[split] = entries
    manifest = {"format_version": 1, "tokenizer": dict(tokenizer or DEFAULT_TOKENIZER),
                "max_length": int(max_length or longest), "options": dict(options or {}),
                "splits": manifest_splits, "skipped": {}}
    with fs.open(f"{root}/manifest.json", "wb") as f:
        f.write(json.dumps(manifest, indent=1).encode())
    return manifest


def write_index(fs, root: str, name: str, version: int = 3) -> dict:
    """Write the sample index of shard `<root>/<name>` (built by walking its tar:
    `pipeline.data.sample_index.build`, and with `version` >= 2 its samples' digests from one
    read of it, `add_digests`, with version 3 also each sample's slot layout from its bytes:
    what `shard.py index` does) and return its manifest `index` entry (`version` recorded from
    version 2 on, as manifests before it had none)."""
    import hashlib

    from pipeline.data import sample_index
    layouts = {}
    with fs.open(f"{root}/{name}", "rb") as f:
        records, _ = sample_index.build(f, name)
        if version >= 2:
            f.seek(0)
            records = sample_index.add_digests(f, records, name, lambda i, b: layouts.__setitem__(
                i, sample_index.layout_of_sample(records[i], b, name)))[0]
    layout = (sample_index.SlotLayout.of_samples([layouts[i] for i in range(len(records))])
              if version == 3 else None)
    data = sample_index.encode(records, layout)
    iname = sample_index.index_name(name)
    with fs.open(f"{root}/{iname}", "wb") as f:
        f.write(data)
    entry = {"name": iname, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {**entry, "version": version} if version >= 2 else entry


def write_train_val(data_dir: str, n_train: int, n_val: int, samples_per_shard: int,
                    seed: int = 0, max_length: int = 24, min_length: int = 8) -> dict:
    """A shard folder with a train and a val split of random samples (vocabulary 64), drawn
    in that order from `np.random.default_rng(seed)`: the small training set the trainer
    tests share. Returns the manifest."""
    rng = np.random.default_rng(seed)
    kw = dict(vocab_size=64, max_length=max_length, min_length=min_length)
    return write_shards(str(data_dir), {"train": random_samples(rng, n_train, **kw),
                                        "val": random_samples(rng, n_val, **kw)},
                        samples_per_shard=samples_per_shard)


# The tiny Qwen3 shape the trainer tests share (its vocabulary is the fixtures' 64 ids).
TINY_MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "max_position_embeddings": 64}


def tiny_model_yaml(**extra) -> str:
    """`TINY_MODEL` (plus `extra` fields) as a YAML flow mapping for a run config's
    `model.inline`, with braces doubled for `str.format` templates."""
    fields = {**TINY_MODEL, **extra}
    return "{{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}}"
