"""The per-shard sample index (`<shard>.idx`): where each sample of a tar lies, so readers never
walk tar headers.

Owns: the layout (below), encoding, decoding and checking it, building one by walking a tar
(`shard.py index`), the per-sample digest, and reading a sample's key from its member header.
Must not touch: shard order, batches, the checks against the manifest and their modes and
messages (`pipeline.data.shard_io`), writing files (callers write atomically). Imports nothing
of the package but `pipeline.data.format`.

Layout (little-endian), ARCHITECTURE.md "Shard format":
    bytes 0..7   magic b"RFSIDX\\x00\\x03" (the last byte is the layout version: 3; 1 and 2
                 are read too)
    bytes 8..15  uint64 N, the number of samples
    then N packed 44-byte records (36 bytes in version 1), in the shard's sample order:
      start         uint64  offset of the sample's first tar header (its first member's)
      tokens_offset uint64  offset of the `tokens.npy` member's data
      tokens_size   uint32  its size in bytes
      json_offset   uint64  offset of the `json` member's data
      json_size     uint32  its size in bytes
      num_tokens    uint32  L, the length of the sample's tokens (for packing without reads)
      digest        uint64  (versions 2, 3) the sample's bytes' BLAKE2b-64 (`sample_digest`)
    then, version 3 only, the samples' slot layouts (`SlotLayout`):
      N x 16 bytes  key_hash: BLAKE2b-128 of the sample's key (utf-8), the hash that seeds
                    the objective's draws (`pipeline.objective.sample_rng`)
      N x uint32    runs per sample; R = their sum
      R x 8 bytes   runs, per sample in slot order: size uint32 (tokens of each slot of the
                    run), count uint16 (slots), flags uint16 (bit 0: the run's first slot
                    starts a segment)
The sample's bytes are `[start, max(tokens_offset + tokens_size, json_offset + json_size))`;
its key is the name in the member header 512 bytes before `json_offset`, read from those bytes,
so the index holds no strings. A raw record array rather than `.npy`: a fixed 16-byte header
lets a remote reader range-read any records (`offset = 16 + 44 * i`) and a local one `np.memmap`
them (Megatron's `.idx` and Megatron-Energon's `<shard>.tar.idx` are the same idea).

Why a digest per sample (version 2): the loader reads shards by sample ranges in a shuffled
order, so a whole-shard sha256 would cost every process its own read of each shard; a digest
checks exactly the bytes read, and the index is covered by its sha256 in manifest.json.
BLAKE2b-64 (RFC 7693): a damaged sample passes with probability 2^-64.

Why slot layouts (version 3): mode "dual"'s fed length depends on the sample's slots and key,
not on L alone (`pipeline.objective.dual_fed_length`); run-length coded (data prep's slots are
k, k, ..., remainder: two runs a segment), ~35 bytes a one-segment sample, so a packer never
reads a sample.
"""
from __future__ import annotations

import hashlib
import posixpath

import numpy as np

from pipeline.data.format import DataError

SUFFIX = ".idx"
VERSION = 3              # the layout written; `decode` also reads VERSION_2 and VERSION_1
VERSION_2 = 2
VERSION_1 = 1
MAGIC = b"RFSIDX\x00" + bytes([VERSION])
HEADER_BYTES = 16
DTYPE_V1 = np.dtype([("start", "<u8"), ("tokens_offset", "<u8"), ("tokens_size", "<u4"),
                     ("json_offset", "<u8"), ("json_size", "<u4"), ("num_tokens", "<u4")])
DTYPE = np.dtype(DTYPE_V1.descr + [("digest", "<u8")])
DTYPES = {VERSION_1: DTYPE_V1, VERSION_2: DTYPE, VERSION: DTYPE}
RUN_DTYPE = np.dtype([("size", "<u4"), ("count", "<u2"), ("flags", "<u2")])
FIRST_OF_SEGMENT = 1     # RUN_DTYPE flags bit
KEY_HASH_BYTES = 16
DIGEST_BYTES = 8
MEMBERS = ("tokens.npy", "json")
_BLOCK = 8 << 20


def sample_digest(data) -> int:
    """The digest of a sample's bytes `[start, end)` (bytes, bytearray or memoryview) as a
    version-2 record stores it: `hashlib.blake2b(digest_size=8)` as a little-endian uint64."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest(), "little")


def version_of(records: np.ndarray) -> int:
    """The record version of decoded records: 2 when they carry digests (index layout version
    2 or 3), else 1."""
    return VERSION_2 if "digest" in (records.dtype.names or ()) else VERSION_1


def key_hash(key: str) -> bytes:
    """The 16-byte BLAKE2b of a sample key (utf-8) that a version-3 index stores; read as a
    little-endian integer it is the hash `pipeline.objective.sample_rng` seeds with."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=KEY_HASH_BYTES).digest()


def slot_runs(segments) -> np.ndarray:
    """The run-length coded slot sizes of one sample (`RUN_DTYPE[R]`, the version-3 layout)
    from its json `segments` (ARCHITECTURE.md "Shard format"): per segment, in slot order,
    runs of equal slot sizes (a run of more than 65535 slots is cut in two).

    Raises:
        ValueError: no segments, a segment without slots, slot starts not increasing or not
            before the segment's end, or a slot of 2^32 tokens or more.
    """
    runs = []
    if not segments:
        raise ValueError("no segments")
    for j, seg in enumerate(segments):
        starts = [int(x) for x in seg["slot_starts"]]
        bounds = np.array(starts + [int(seg["end"])], dtype=np.int64)
        sizes = np.diff(bounds)
        if not starts or np.any(sizes <= 0) or int(sizes.max()) >= 1 << 32:
            raise ValueError(f"segment {j}: slot_starts must be increasing, inside the segment")
        cut = np.flatnonzero(np.diff(sizes)) + 1
        first = True
        for a, b in zip(np.r_[0, cut], np.r_[cut, len(sizes)]):
            for c0 in range(int(a), int(b), 0xFFFF):
                runs.append((int(sizes[a]), min(0xFFFF, int(b) - c0), FIRST_OF_SEGMENT if first else 0))
                first = False
    return np.array(runs, dtype=RUN_DTYPE)


def layout_of_sample(record, data, where: str) -> tuple[bytes, np.ndarray]:
    """(key hash, slot runs) of one sample from its bytes `[start, end)` and its record, for
    `shard.py index` (version-3 layouts of older shards).

    Raises:
        DataError: one line naming `where` and the sample: no key header, json undecodable or
            without valid segments.
    """
    import json
    start = int(record["start"])
    jo = int(record["json_offset"]) - start
    try:
        key = key_from_header(bytes(data[jo - 512:jo]))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"shard {where}: sample at byte {start}: {e}") from None
    try:
        meta = json.loads(bytes(data[jo:jo + int(record["json_size"])]).decode("utf-8"))
        return key_hash(key), slot_runs(meta["segments"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DataError(f"shard {where}: sample {key}: bad segments ({e})") from None


class SlotLayout:
    """The slot layouts of a shard's samples (version 3): what `pipeline.objective.
    dual_fed_length` needs to compute a sample's fed length without reading the sample.

    Attributes:
        key_hash: uint8[N, 16] (`key_hash`). run_first: int64[N + 1], sample i's runs are
            `runs[run_first[i]:run_first[i + 1]]`. runs: `RUN_DTYPE[R]`.
    """

    def __init__(self, key_hashes: np.ndarray, run_first: np.ndarray, runs: np.ndarray):
        self.key_hash, self.run_first, self.runs = key_hashes, run_first, runs

    @classmethod
    def of_samples(cls, samples) -> "SlotLayout":
        """From `[(key_hash bytes, slot_runs array), ...]` in sample order."""
        hashes = np.frombuffer(b"".join(h for h, _ in samples), np.uint8).reshape(-1, KEY_HASH_BYTES)
        counts = np.array([len(r) for _, r in samples], dtype=np.int64)
        runs = np.concatenate([r for _, r in samples]) if samples else np.zeros(0, RUN_DTYPE)
        return cls(hashes, np.concatenate([[0], np.cumsum(counts)]), runs.astype(RUN_DTYPE))

    def __len__(self) -> int:
        return int(self.key_hash.shape[0])

    def sample(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(key hash as a little-endian int, slot sizes int64[n], segment of each slot
        int64[n] counted from 0) of sample i, slots in natural order."""
        r = self.runs[int(self.run_first[i]):int(self.run_first[i + 1])]
        count = r["count"].astype(np.int64)
        size = np.repeat(r["size"].astype(np.int64), count)
        seg = np.repeat(np.cumsum(r["flags"] & FIRST_OF_SEGMENT, dtype=np.int64) - 1, count)
        return int.from_bytes(self.key_hash[i].tobytes(), "little"), size, seg

    def encode(self) -> bytes:
        """The layout section of a version-3 index file (after the records)."""
        counts = np.diff(self.run_first).astype("<u4")
        return (np.ascontiguousarray(self.key_hash, np.uint8).tobytes() + counts.tobytes()
                + np.ascontiguousarray(self.runs, RUN_DTYPE).tobytes())


def index_name(shard_name: str) -> str:
    """The index file's name (or path) beside shard `shard_name`: `train-000000.tar.idx`."""
    return shard_name + SUFFIX


def encode(records: np.ndarray, layout: SlotLayout | None = None) -> bytes:
    """The index file's bytes for `records`, sample order: `DTYPE[N]` with `layout` (version 3),
    `DTYPE[N]` alone (version 2) or `DTYPE_V1[N]` (version 1; 1 and 2 for tests of old folders).

    Raises:
        ValueError: a layout with records without digests, or of another sample count.
    """
    version = version_of(records)
    tail = b""
    if layout is not None:
        if version != VERSION_2 or len(layout) != len(records):
            raise ValueError(f"a slot layout needs records with digests, one per sample "
                             f"({len(layout)} layouts, {len(records)} records)")
        version, tail = VERSION, layout.encode()
    records = np.ascontiguousarray(records, dtype=DTYPES[version])
    return (MAGIC[:7] + bytes([version]) + np.uint64(len(records)).astype("<u8").tobytes()
            + records.tobytes() + tail)


def decode(data: bytes, where: str, samples: int | None = None,
           shard_bytes: int | None = None, with_layout: bool = False):
    """The records of an index file's bytes, checked: `DTYPE[N]` (versions 2 and 3) or
    `DTYPE_V1[N]` (version 1; `version_of` tells them apart).

    Args:
        data: the whole file (bytes or a uint8 memmap).
        where: the start of messages, naming the index file (`sample index PATH`).
        samples: N the manifest records for the shard (None: not checked).
        shard_bytes: the shard's size in bytes (None: not checked); every member must lie in it.
        with_layout: also return the slot layouts (a `SlotLayout`; None before version 3).

    Returns:
        records, or (records, layout) with `with_layout`.

    Raises:
        DataError: one line starting with `where`: bad magic / version or length, N other
            than `samples`, offsets that do not fit the shard, or a layout whose runs do not
            add up to a sample's tokens.
    """
    head = bytes(data[:HEADER_BYTES])
    if len(head) < HEADER_BYTES or head[:7] != MAGIC[:7]:
        raise DataError(f"{where}: not a sample index (bad magic); remake it with "
                        "`python data_prep/shard.py index DIR`")
    if head[7] not in DTYPES:
        raise DataError(f"{where}: layout version {head[7]} is not supported "
                        f"(expected {VERSION_1} or {VERSION})")
    dtype = DTYPES[head[7]]
    n = int(np.frombuffer(head, "<u8", 1, 8)[0])
    expected = HEADER_BYTES + n * dtype.itemsize
    layout = None
    if head[7] == VERSION and len(data) >= expected + n * (KEY_HASH_BYTES + 4):
        at = expected + n * KEY_HASH_BYTES
        counts = np.frombuffer(data, "<u4", n, at).astype(np.int64)
        expected = at + 4 * n + int(counts.sum()) * RUN_DTYPE.itemsize
        if len(data) == expected:
            hashes = np.frombuffer(data, np.uint8, n * KEY_HASH_BYTES, HEADER_BYTES + n * dtype.itemsize)
            runs = np.frombuffer(data, RUN_DTYPE, int(counts.sum()), at + 4 * n)
            layout = SlotLayout(hashes.reshape(n, KEY_HASH_BYTES),
                                np.concatenate([[0], np.cumsum(counts)]), runs)
    elif head[7] == VERSION:
        expected += n * (KEY_HASH_BYTES + 4)
    if len(data) != expected:
        raise DataError(f"{where}: {len(data)} bytes, expected "
                        f"{expected} for {n} samples (truncated or damaged)")
    if samples is not None and n != samples:
        raise DataError(f"{where}: {n} samples, manifest.json says {samples}")
    rec = np.frombuffer(data, dtype, n, HEADER_BYTES)
    if n:
        ends = np.maximum(rec["tokens_offset"] + rec["tokens_size"], rec["json_offset"] + rec["json_size"])
        bad = (rec["tokens_offset"] < rec["start"] + 512) | (rec["json_offset"] < rec["start"] + 512)
        if shard_bytes is not None:
            bad |= ends > shard_bytes
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{where}: record {i} points outside its shard "
                            "(damaged, or the index of another shard)")
    if layout is not None and n:
        r, counts = layout.runs, np.diff(layout.run_first)
        owner = np.repeat(np.arange(n), counts)
        covered = np.bincount(owner, weights=r["size"].astype(np.float64) * r["count"], minlength=n)
        first = np.zeros(n, dtype=bool)
        has = counts > 0
        first[has] = (r["flags"][layout.run_first[:-1][has]] & FIRST_OF_SEGMENT) != 0
        bad = ~first | (covered > rec["num_tokens"])
        bad |= np.bincount(owner, weights=(r["count"] == 0) | (r["size"] == 0), minlength=n) > 0
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{where}: the slot layout of record {i} does not fit its "
                            f"{int(rec['num_tokens'][i])} tokens (damaged)")
    return (rec, layout) if with_layout else rec


def sample_end(rec: np.ndarray) -> np.ndarray:
    """One past the last byte of each sample's members, uint64[N]."""
    return np.maximum(rec["tokens_offset"] + rec["tokens_size"], rec["json_offset"] + rec["json_size"])


def split_member(name: str) -> tuple[str, str]:
    """(sample key, extension) of a tar member name, as webdataset groups members: the key is
    the path up to the first dot of the last component (`a/b.c/k0.tokens.npy` ->
    (`a/b.c/k0`, `tokens.npy`)). The one parser of member names (index builder, streamed reader)."""
    d, base = posixpath.split(name)
    key, _, ext = base.partition(".")
    return (posixpath.join(d, key) if d else key), ext


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
    key, ext = split_member(text)
    if ext != "json":
        raise ValueError(f"expected a '<key>.json' member header, found {text!r}")
    return key


def build(fileobj, where: str) -> tuple[np.ndarray, list[str]]:
    """Walk a tar's headers (data skipped by seeking) and return its index records (without
    digests: `DTYPE_V1[N]`; `add_digests` adds them) and keys.

    For `shard.py index` and checks (data prep writes the index with the tar). Token counts come
    from each `tokens.npy` header (a small read).

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
            mkey, ext = split_member(m.name)
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
    return np.array(rows, dtype=DTYPE_V1) if rows else np.zeros(0, DTYPE_V1), keys


def add_digests(fileobj, records: np.ndarray, where: str,
                on_sample=None) -> tuple[np.ndarray, str, int]:
    """Version-2 records (`DTYPE[N]`, with `digest`) of a shard's records, and the shard's
    sha256 and size, from one sequential read of the whole file in 8 MiB blocks.

    Args:
        fileobj: the shard, open for binary reading at its start.
        records: its records (`DTYPE_V1[N]` or `DTYPE[N]`; digests present are recomputed).
        where: the shard's name for messages.
        on_sample: None, or called as `on_sample(i, data)` with each sample's bytes
            `[start, end)` (a memoryview valid during the call), in file order (e.g.
            `layout_of_sample`, for a version-3 index).

    Returns:
        (records with digests, sha256 hex of the whole file, file size in bytes).

    Raises:
        DataError: one line naming the shard when a sample's range lies past the file's end.
    """
    out = np.zeros(len(records), DTYPE)
    for name in DTYPE_V1.names:
        out[name] = records[name]
    starts = out["start"].astype(np.int64)
    ends = sample_end(out).astype(np.int64)
    order = np.argsort(starts, kind="stable")
    sha, size = hashlib.sha256(), 0
    buf, buf_off = bytearray(), 0       # bytes of the file from offset buf_off on, still needed
    k = 0
    while True:
        block = fileobj.read(_BLOCK)
        if block:
            sha.update(block)
            size += len(block)
            buf += block
        while k < len(order) and (ends[order[k]] <= size or not block):
            j = order[k]
            a, b = int(starts[j]) - buf_off, int(ends[j]) - buf_off
            if int(ends[j]) > size:
                raise DataError(f"shard {where}: sample {j} ends at byte {int(ends[j])}, past the "
                                f"file's end ({size} bytes): truncated, or the index of another shard")
            with memoryview(buf) as view:
                out["digest"][j] = sample_digest(view[a:b])
                if on_sample is not None:
                    on_sample(int(j), view[a:b])
            k += 1
            # drop what no later sample needs; never past what was read (the next sample may
            # start in a block not read yet: then buf_off must stay the offset of buf[0])
            keep = min(int(starts[order[k]]), size) if k < len(order) else size
            if keep > buf_off:
                del buf[:keep - buf_off]
                buf_off = keep
        if not block:
            break
        if k == len(order):
            buf, buf_off = bytearray(), size
    return out, sha.hexdigest(), size
