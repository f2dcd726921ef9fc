"""The shard folder format that `data_prep/shard.py` writes and `pipeline.data` reads.

Owns: the manifest's file name and format version, the check of a shard set against a model's
vocabulary, and `DataError` (the one error type of a bad data folder). Reading a manifest from
a folder is I/O: `pipeline.data.shard_io.read_manifest`. This module imports no other module of
the package (shard_io and loader import it). The sample layout (tokens.npy + segments JSON) is
documented in ARCHITECTURE.md "Shard format". Must not touch: shard order, batches, loader
state (`pipeline.data.loader`).
"""
from __future__ import annotations

# The manifest of a shard folder, and the version of the layout it describes.
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# The manifest of a folder data prep is still writing (or was interrupted writing); the loader
# never reads such a folder.
PARTIAL_MANIFEST = "manifest.partial.json"
# The split names data_prep writes (a manifest may list others; the loader reads any).
SPLITS = ("train", "val")


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
