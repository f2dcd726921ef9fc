"""The per-shard sample index (`<shard>.idx`): where each sample of a tar lies, so readers never
walk tar headers.

Owns: the index file's layout (below), encoding and decoding it, checking it against its shard's
manifest entry, building one by walking a tar (for shards written before indexes existed:
`shard.py index`), and reading a sample's key from the member header inside its byte range.
Must not touch: shard order, batches (`pipeline.data.loader`), sha256 checks of files
(`pipeline.data.shard_io`), writing files (callers write atomically). Imports nothing else of
the package but `pipeline.data.format`.

Layout (little-endian), ARCHITECTURE.md "Shard format":
    bytes 0..7   magic b"RFSIDX\\x00\\x01" (the last byte is the layout version, 1)
    bytes 8..15  uint64 N, the number of samples
    then N packed 36-byte records, in the shard's sample order:
      start         uint64  offset of the sample's first tar header (its first member's)
      tokens_offset uint64  offset of the `tokens.npy` member's data
      tokens_size   uint32  its size in bytes
      json_offset   uint64  offset of the `json` member's data
      json_size     uint32  its size in bytes
      num_tokens    uint32  L, the length of the sample's tokens (for packing without reads)
The sample's bytes are `[start, max(tokens_offset + tokens_size, json_offset + json_size))`;
its key is the name in the member header that precedes the `json` data (512 bytes before
`json_offset`), read from those bytes, so the index holds no strings. 36 bytes a sample: 4.5 MB
for 125,000 samples, ~1.8% of a 256 MB shard of 2 KB samples. Why a raw record array and not
`.npy`: the magic, the count and a fixed 16-byte header let a remote reader range-read any
records (`offset = 16 + 36 * i`) and a local reader `np.memmap` it, and the layout is stated
here in full (Megatron's `.idx` beside each `.bin` and Megatron-Energon's `<shard>.tar.idx`
are the same idea).
"""
from __future__ import annotations

import posixpath

import numpy as np

from pipeline.data.format import DataError

SUFFIX = ".idx"
VERSION = 1
MAGIC = b"RFSIDX\x00" + bytes([VERSION])
HEADER_BYTES = 16
DTYPE = np.dtype([("start", "<u8"), ("tokens_offset", "<u8"), ("tokens_size", "<u4"),
                  ("json_offset", "<u8"), ("json_size", "<u4"), ("num_tokens", "<u4")])
MEMBERS = ("tokens.npy", "json")


def index_name(shard_name: str) -> str:
    """The index file's name (or path) beside shard `shard_name`: `train-000000.tar.idx`."""
    return shard_name + SUFFIX


def encode(records: np.ndarray) -> bytes:
    """The index file's bytes for `records` (a `DTYPE[N]` array, sample order)."""
    records = np.ascontiguousarray(records, dtype=DTYPE)
    return MAGIC + np.uint64(len(records)).astype("<u8").tobytes() + records.tobytes()


def decode(data: bytes, where: str, samples: int | None = None,
           shard_bytes: int | None = None) -> np.ndarray:
    """The `DTYPE[N]` records of an index file's bytes, checked.

    Args:
        data: the whole file (bytes or a uint8 memmap).
        where: the start of messages, naming the index file (`sample index PATH`).
        samples: N the manifest records for the shard (None: not checked).
        shard_bytes: the shard's size in bytes (None: not checked); every member must lie in it.

    Raises:
        DataError: one line starting with `where`: bad magic / version, a length that is not
            16 + 36 N, N other than `samples`, or offsets that do not fit the shard.
    """
    head = bytes(data[:HEADER_BYTES])
    if len(head) < HEADER_BYTES or head[:7] != MAGIC[:7]:
        raise DataError(f"{where}: not a sample index (bad magic); remake it with "
                        "`python data_prep/shard.py index DIR`")
    if head[7] != VERSION:
        raise DataError(f"{where}: layout version {head[7]} is not supported "
                        f"(expected {VERSION})")
    n = int(np.frombuffer(head, "<u8", 1, 8)[0])
    if len(data) != HEADER_BYTES + n * DTYPE.itemsize:
        raise DataError(f"{where}: {len(data)} bytes, expected "
                        f"{HEADER_BYTES + n * DTYPE.itemsize} for {n} samples (truncated or damaged)")
    if samples is not None and n != samples:
        raise DataError(f"{where}: {n} samples, manifest.json says {samples}")
    rec = np.frombuffer(data, DTYPE, n, HEADER_BYTES)
    if n:
        ends = np.maximum(rec["tokens_offset"] + rec["tokens_size"], rec["json_offset"] + rec["json_size"])
        bad = (rec["tokens_offset"] < rec["start"] + 512) | (rec["json_offset"] < rec["start"] + 512)
        if shard_bytes is not None:
            bad |= ends > shard_bytes
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{where}: record {i} points outside its shard "
                            "(damaged, or the index of another shard)")
    return rec


def sample_end(rec: np.ndarray) -> np.ndarray:
    """One past the last byte of each sample's members, uint64[N]."""
    return np.maximum(rec["tokens_offset"] + rec["tokens_size"], rec["json_offset"] + rec["json_size"])


def key_from_header(block: bytes) -> str:
    """The sample key of a USTAR member header (512 bytes): its path without the extension.

    Raises:
        ValueError: not a `<key>.json` header (e.g. a name longer than USTAR holds).
    """
    name = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    text = name.decode("utf-8")
    d, base = posixpath.split(text)
    key, _, ext = base.partition(".")
    if ext != "json":
        raise ValueError(f"expected a '<key>.json' member header, found {text!r}")
    return posixpath.join(d, key) if d else key


def build(fileobj, where: str) -> tuple[np.ndarray, list[str]]:
    """Walk a tar's headers (data skipped by seeking) and return its index records and keys.

    For shards written before indexes (`shard.py index`) and for checks; data prep writes the
    index while it writes the tar (`data_prep/writer.py`). The token count comes from each
    `tokens.npy` header (a small read).

    Raises:
        DataError: unreadable tar, a sample without tokens.npy or json, a tokens.npy that is
            not a 1-D array.
    """
    import io
    import tarfile
    rows, keys = [], []
    key, found, start = None, {}, 0

    def close():
        missing = [e for e in MEMBERS if e not in found]
        if missing:
            raise DataError(f"shard {where}: sample {key} lacks {', '.join(missing)}")
        rows.append((start, *found["tokens.npy"], *found["json"], found["len"]))
        keys.append(key)

    try:
        tf = tarfile.open(fileobj=fileobj, mode="r:")
        while True:
            m = tf.next()
            if m is None:
                break
            tf.members.clear()
            if not m.isfile():
                continue
            d, base = posixpath.split(m.name)
            mkey, _, ext = base.partition(".")
            mkey = posixpath.join(d, mkey) if d else mkey
            if mkey != key:
                if key is not None:
                    close()
                key, found, start = mkey, {}, m.offset
            if ext in MEMBERS:
                found[ext] = (m.offset_data, m.size)
            if ext == "tokens.npy":
                pos = fileobj.tell()
                fileobj.seek(m.offset_data)
                head = io.BytesIO(fileobj.read(min(m.size, 4096)))
                version = np.lib.format.read_magic(head)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, _ = read_header(head)
                if len(shape) != 1:
                    raise DataError(f"shard {where}: sample {mkey}: tokens.npy is not 1-D")
                found["len"] = int(shape[0])
                fileobj.seek(pos)
        if key is not None:
            close()
    except DataError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise DataError(f"shard {where}: unreadable ({e})") from None
    return np.array(rows, dtype=DTYPE) if rows else np.zeros(0, DTYPE), keys
