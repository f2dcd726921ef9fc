"""The shard folder format that `data_prep/shard.py` writes and `pipeline.data` reads.

Owns: the manifest's file name and format version, its self-checksum (`manifest_checksum`,
`with_checksum`), the check of a shard set against a model's vocabulary, and `DataError` (the
one error type of a bad data folder). Reading a manifest from a folder is I/O:
`pipeline.data.shard_io.read_manifest`. This module imports no other module of the package
(shard_io and loader import it). The sample layout (tokens.npy + segments JSON) is documented
in ARCHITECTURE.md "Shard format". Must not touch: shard order, batches, loader state
(`pipeline.data.loader`).
"""
from __future__ import annotations

import hashlib
import json

# The manifest of a shard folder, and the version of the layout it describes.
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# The manifest of a folder data prep is still writing (or was interrupted writing); the loader
# never reads such a folder.
PARTIAL_MANIFEST = "manifest.partial.json"
# The manifest's checksum of itself: the sha256 (hex) of `manifest_checksum`'s canonical JSON of
# every other field. Data prep writes it (every writer of manifest.json); `read_manifest`
# refuses a manifest whose content no longer matches it (a flipped digit of `mask_id` or
# `max_length` is otherwise unseen). Manifests without it (written before it existed) load
# unchecked; `python data_prep/shard.py index DIR` adds it.
CHECKSUM_FIELD = "manifest_sha256"
# The split names data_prep writes (a manifest may list others; the loader reads any).
SPLITS = ("train", "val")


def manifest_checksum(manifest: dict) -> str:
    """The sha256 (64 hex digits) of `manifest` without `CHECKSUM_FIELD`, as canonical JSON
    (sorted keys, no spaces, UTF-8), so the file's layout (indentation, key order) does not
    matter, only its values.

    Raises:
        TypeError: a value JSON cannot hold.
    """
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def with_checksum(manifest: dict) -> dict:
    """A copy of `manifest` with `CHECKSUM_FIELD` set (last) to its `manifest_checksum`: what
    data prep writes as manifest.json."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    return {**body, CHECKSUM_FIELD: manifest_checksum(body)}


class DataError(ValueError):
    """A user-facing data problem (bad folder, manifest, shard, state); the message is one line
    naming the file/field. CLIs catch it and exit with code 2."""


def check_tokenizer(manifest: dict, vocab_size: int | None, tokenizer_hash: str | None = None,
                    where: str = "manifest.json") -> None:
    """Refuse shards that do not fit the model.

    Args:
        manifest: from `read_manifest`.
        vocab_size: the model's embedding rows (`ModelConfig.vocab_size`); None skips the check.
        tokenizer_hash: if given, the manifest's `tokenizer.hash` must equal it.
        where: name used in messages.

    Raises:
        DataError: vocab too small, a special id outside the embedding, or another tokenizer.
    """
    tok = manifest["tokenizer"]
    if tokenizer_hash is not None and tok.get("hash") != tokenizer_hash:
        raise DataError(f"{where}: shards were tokenized with {tok.get('name')!r} (hash {tok.get('hash')}), "
                        f"the model expects tokenizer hash {tokenizer_hash}")
    if vocab_size is None:
        return
    if tok["vocab_size"] > vocab_size:
        raise DataError(f"{where}: tokenizer.vocab_size {tok['vocab_size']} > model vocab_size {vocab_size}")
    for name in ("pad_id", "mask_id", "eos_id", "bos_id"):
        v = tok.get(name)
        if v is not None and not 0 <= v < vocab_size:
            raise DataError(f"{where}: tokenizer.{name} {v} is outside the model vocab [0, {vocab_size})")
