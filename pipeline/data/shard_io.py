"""Opening shard folders (any fsspec URL) and checking shards against their manifest.

Owns: the fsspec filesystem of a data folder, reading and checking its manifest.json
(`read_manifest`), with one-line errors for an unknown protocol or a missing filesystem package
(`s3fs`, `gcsfs`, `aiohttp` for http(s)://) and for an HTTP server that does not answer range
requests; shard integrity under `data.verify_shards = error | warn | off` and the wording of a
damaged shard (truncated, swapped, or changed in place).
Must not touch: shard order, batches, loader state (`pipeline.data.loader`).

How shards are verified (what a user sees, and the figures: data_prep/README.md "Shard
verification: per-sample digests"):
- Sample index version 2 or 3: when a process first needs a shard, the index's sha256
  (`read_sample_index`) and the shard's size (`check_shard_size`, one stat) against the
  manifest; then each sample read against its digest (`check_sample`). A damaged sample stops
  (mode `error`) the process that reads it, when it reads it, and only that one.
- Version 1 (no digests): the shard hashed whole (`verify_shard`) the first time a process
  touches it, remembered per process, with one note naming `shard.py index`.
- Read front to back (`iter_shard_samples`): the same checks in read order.
- A manifest without `sha256` / `bytes` entries is not checked against them; manifest.json
  against its own checksum when it has one (`pipeline.data.format.CHECKSUM_FIELD`).
Sample indexes' layout and offsets are checked in every mode, `off` included; a shard damaged
in its tar structure is reported in one line in every mode. The check functions share their
arguments: `fs, path` (the shard), `mode` ("error": raise `DataError`, one line naming the shard
and the likely cause; "warn": one `warning:` line on stderr per shard, then go on; "off"),
`others` (the split's other shards' manifest values, read only on a mismatch to name a swapped
shard), `training` (the message names `data.verify_shards`; False outside training).
"""
from __future__ import annotations

import hashlib
import json
import sys

from pipeline.common.fs import missing_fs_package
from pipeline.data import sample_index
from pipeline.data.format import (CHECKSUM_FIELD, FORMAT_VERSION, MANIFEST, DataError,
                                  manifest_checksum)

VERIFY_MODES = ("error", "warn", "off")
_BLOCK = 8 << 20
_VERIFIED: set = set()   # (protocol, path, expected sha256 or size) checked in this process
_WARNED: set = set()
_TRAIN_HINT = " (data.verify_shards=warn|off trains on it anyway)"
_SAMPLE_WARNED: set = set()   # (protocol, shard path): warned of a sample digest mismatch


def _error(msg: str) -> Exception:
    return DataError(msg)


def _protocol(fs) -> str:
    p = fs.protocol
    return p if isinstance(p, str) else p[0]


def open_fs(url: str):
    """`(fs, root)` of a data folder: local path or fsspec URL (root without trailing `/`).

    Raises:
        DataError: one line naming the URL when the protocol is unknown or its filesystem
            package is not installed (with the `pip install` that fixes it).
    """
    import fsspec
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise _error(f"{url}: {missing_fs_package(url, e)}") from None
    return fs, root.rstrip("/")


def read_manifest(data_dir: str) -> dict:
    """Read and check `<data_dir>/manifest.json`.

    Args:
        data_dir: local folder or fsspec URL (e.g. `memory://shards`, `s3://bucket/shards`).

    Returns:
        The manifest dict.

    Raises:
        DataError: missing/unreadable manifest, unknown format_version, missing fields, or a
            recorded checksum its content no longer matches.
    """
    fs, root = open_fs(data_dir)  # one-line DataError for a missing fsspec package
    path = f"{root}/{MANIFEST}"
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise DataError(f"{data_dir}: no {MANIFEST} (not a shard folder written by data_prep/shard.py)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: expected a JSON object")
    if CHECKSUM_FIELD in manifest:
        want = manifest[CHECKSUM_FIELD]
        try:
            got = manifest_checksum(manifest)
        except TypeError:   # json.loads gives JSON values only; kept for hand-made dicts
            got = None
        if got != want:
            raise DataError(f"{path}: content does not match its {CHECKSUM_FIELD} (edited or "
                            "damaged after data prep: a changed value such as tokenizer.mask_id "
                            "or max_length would mislead the trainer); restore it or rerun "
                            "data_prep/shard.py")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r} is not "
                        f"supported (expected {FORMAT_VERSION})")
    for field in ("tokenizer", "max_length", "splits"):
        if field not in manifest:
            raise DataError(f"{path}: missing field {field!r}")
    if not isinstance(manifest["tokenizer"], dict) or not isinstance(manifest["splits"], dict):
        raise DataError(f"{path}: tokenizer and splits must be JSON objects")
    for field in ("vocab_size", "pad_id", "mask_id", "eos_id"):
        if manifest["tokenizer"].get(field) is None:
            raise DataError(f"{path}: tokenizer.{field} is missing")
    return manifest


def fs_for_this_process(fs):
    """`fs`, or a fresh instance with the same options when `fs` was made in another process.

    fsspec's async filesystems (http(s)://, s3://, gs://) hold an event loop and sessions a
    forked worker cannot use ("This class is not fork-safe"). memory:// stores are
    class-level, so a new instance still sees the parent's files.
    """
    import os
    if getattr(fs, "_pid", os.getpid()) == os.getpid():
        return fs
    return type(fs)(*getattr(fs, "storage_args", ()), **getattr(fs, "storage_options", {}))


def no_range_message(path: str, error: BaseException) -> str | None:
    """The one-line explanation when `error` is fsspec's refusal of an HTTP server that ignores
    range requests (it answers a ranged GET with the whole file), else None."""
    text = str(error)
    if "range" in text.lower() and ("http" in text.lower() or path.startswith(("http://", "https://"))):
        return (f"{path}: the HTTP server does not support range requests (HTTP Range / 206 "
                "Partial Content), which the loader needs to read shards by offset; serve the "
                "folder with a server that does (nginx, S3, `python -m http.server` does not) "
                "or copy the shards to a local or s3:// folder")
    return None


def damage_hint(fs, path: str, expected_bytes: int | None) -> str:
    """Words for a shard that cannot be parsed: truncated (shorter than the manifest says),
    longer, or damaged in place (same size as written); '' when the size is not known."""
    if expected_bytes is None:
        return ""
    try:
        size = int(fs.size(path))
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if size < expected_bytes:
        return f"truncated: {size} of {expected_bytes} bytes"
    if size > expected_bytes:
        return f"{size} bytes, manifest.json says {expected_bytes}: changed after data prep"
    return (f"damaged in place: its size is the {size} bytes data prep wrote, but its content "
            "differs (run with data.verify_shards=error to check digests)")


def _file_sha256(fs, path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def _unreadable(path: str, e: Exception) -> Exception:
    """The one-line error of shard `path` that could not be opened or read (`e`, any type an
    fsspec backend raises): missing, a server without range requests, or unreadable."""
    if isinstance(e, FileNotFoundError):
        return _error(f"shard {path}: missing")
    return _error(no_range_message(path, e) or f"shard {path}: unreadable ({type(e).__name__}: "
                  f"{(str(e).splitlines() or [''])[0]})")


def _report(msg: str, mode: str, seen: set, key, note: str = "") -> None:
    """A failed check of a shard: raise `msg` (mode "error"), else print it as one `warning:`
    line (with `note` appended) and remember `key` in `seen`, so the caller warns once."""
    if mode == "error":
        raise _error(msg)
    seen.add(key)
    print(f"warning: {msg}{note}", file=sys.stderr, flush=True)


def verify_shard(fs, path: str, expected: str | None, mode: str,
                 expected_bytes: int | None = None, others=(), training: bool = True) -> None:
    """Check the sha256 of shard `path` against `expected` (manifest.json hex; None: not
    checked), once per process. expected_bytes: its manifest `bytes`, for the message; others:
    (shard name, sha256) pairs. Raises DataError (mode "error": a mismatch; any mode: the shard
    is unreadable)."""
    if mode == "off" or not expected:
        return
    key = (_protocol(fs), path, expected)
    if key in _VERIFIED or key in _WARNED:
        return
    try:
        got, size = _file_sha256(fs, path)
    except Exception as e:  # noqa: BLE001 - fsspec backends raise many types
        raise _unreadable(path, e) from None
    if got == expected:
        _VERIFIED.add(key)
        return
    other = next((name for name, sha in others if sha == got), None)
    if other:
        why = f"its content is shard {other} of the manifest (swapped or renamed shards?)"
    elif expected_bytes is not None and size != expected_bytes:
        why = (f"truncated: {size} of {expected_bytes} bytes" if size < expected_bytes
               else f"{size} bytes, manifest.json says {expected_bytes}")
    else:
        why = "same size, different bytes: damaged in place (bit flip, bad copy?)"
    msg = (f"shard {path}: sha256 {got[:16]}... does not match manifest.json ({expected[:16]}...): "
           f"{why}; re-copy the shard or rerun data_prep/shard.py{_TRAIN_HINT if training else ''}")
    _report(msg, mode, _WARNED, key)


def check_shard_size(fs, path: str, expected_bytes: int | None, mode: str, others=(),
                     training: bool = True) -> None:
    """Check the size of shard `path` against its manifest `bytes` (`expected_bytes`; None: not
    checked), once per process (one stat). others: (shard name, bytes) pairs. Raises DataError
    (mode "error": a mismatch; any mode but "off": a missing or unreadable shard)."""
    if mode == "off" or expected_bytes is None:
        return
    key = (_protocol(fs), path, ("bytes", expected_bytes))
    if key in _VERIFIED or key in _WARNED:
        return
    try:
        size = int(fs.size(path))
    except Exception as e:  # noqa: BLE001 - fsspec backends raise many types
        raise _unreadable(path, e) from None
    if size == expected_bytes:
        _VERIFIED.add(key)
        return
    own = path.rsplit("/", 1)[-1]
    other = next((name for name, n in others if n == size and not path.endswith("/" + name)
                  and name != own), None)
    if size < expected_bytes:
        why = f"truncated: {size} of {expected_bytes} bytes"
    else:
        why = f"{size} bytes, manifest.json says {expected_bytes}: changed after data prep"
    if other:
        why += f"; its size is that of shard {other} of the manifest (swapped or renamed shards?)"
    msg = (f"shard {path}: {why}; re-copy the shard or rerun data_prep/shard.py"
           f"{_TRAIN_HINT if training else ''}")
    _report(msg, mode, _WARNED, key)


def check_sample(fs, path: str, sample: int, key: str, data, expected: int, mode: str,
                 index_name: str = "", swapped_with=None, training: bool = True) -> None:
    """Check the bytes of one sample read from shard `path` against the digest its version-2
    sample index records (`pipeline.data.sample_index.sample_digest`).

    Args:
        sample: the sample's position in the shard (0-based).
        key: its key as read from its bytes (`#<sample>` when unreadable), for the message.
        data: the sample's bytes `[start, end)` as read. expected: the record's `digest` (uint64).
        index_name: the sample index's name, for the message.
        swapped_with: None, or a callable naming another shard whose index records these bytes
            at this position (or None); called only on a mismatch.
    Raises:
        DataError: (mode "error") a mismatch, naming the sample's key and position too.
    """
    if mode == "off":
        return
    if sample_index.sample_digest(data) == expected:
        return
    wkey = (_protocol(fs), path)
    if mode != "error" and wkey in _SAMPLE_WARNED:
        return
    other = swapped_with() if swapped_with is not None else None
    if other:
        why = f"its bytes are those of shard {other} of the manifest (swapped or renamed shards?)"
    else:
        why = ("the shard has the size data prep wrote but other bytes: damaged in place (bit "
               "flip, bad copy) or replaced by another file of the same size")
    msg = (f"shard {path}: sample {key} (#{sample} of the shard) does not match its digest in "
           f"{index_name or 'its sample index'}: {why}; re-copy the shard or rerun "
           f"data_prep/shard.py{_TRAIN_HINT if training else ''}")
    _report(msg, mode, _SAMPLE_WARNED, wkey, " (further mismatches in this shard are not reported)")


_NOTED_V1: list = []


def note_version_1_indexes(data_dir: str, split: str, shards: list[str]) -> None:
    """Print, once per process, the note that `shards` (names) of `split` have version-1 sample
    indexes (no per-sample digests), so each loader process hashes them whole, and the
    command that upgrades them."""
    if _NOTED_V1 or not shards:
        return
    _NOTED_V1.append(data_dir)
    print(f"note: {data_dir}: {len(shards)} shard(s) of split {split!r} (first: {shards[0]}) have "
          "version-1 sample indexes, without per-sample digests: with data.verify_shards on, each "
          "loader process reads and hashes those shards whole before their first sample; "
          f"`python data_prep/shard.py index {data_dir}` upgrades them to per-sample "
          "verification", file=sys.stderr, flush=True)


_NOTED_NO_LAYOUT: list = []


def note_indexes_without_layouts(data_dir: str, split: str, shards: list[str]) -> None:
    """Print, once per process, the note that `shards` (names) of `split` have sample indexes
    without slot layouts (before version 3), so in objective mode "dual" packing reads every
    sample of a shuffle window in each loader process, and the command that adds them."""
    if _NOTED_NO_LAYOUT or not shards:
        return
    _NOTED_NO_LAYOUT.append(data_dir)
    print(f"note: {data_dir}: {len(shards)} shard(s) of split {split!r} (first: {shards[0]}) have "
          "sample indexes without slot layouts (before version 3): packing in objective mode dual "
          "reads every sample of each shuffle window in every loader process to learn its fed "
          f"length; `python data_prep/shard.py index {data_dir}` adds them",
          file=sys.stderr, flush=True)


def missing_index_message(data_dir: str, shard: str) -> str:
    """The one line for a shard whose manifest entry has no sample index."""
    return (f"{data_dir}/manifest.json: shard {shard} has no sample index "
            f"({sample_index.index_name(shard)}; shards written before indexes existed): write "
            f"them with `python data_prep/shard.py index {data_dir}`")


def read_sample_index(fs, root: str, entry: dict, mode: str, with_layout: bool = False):
    """The checked sample index (`pipeline.data.sample_index.DTYPE[N]`, or `DTYPE_V1[N]` for a
    version-1 file) of manifest shard entry `entry` (`name`, `samples`, `bytes`, `index`:
    {`name`, `bytes`, `sha256`}); with `with_layout`, (records, `SlotLayout` or None before
    version 3).

    Read whole in one request; the sha256 is checked in modes "error" and "warn", the layout and
    offsets always (`sample_index.decode`).

    Raises:
        DataError: one line naming the index file: missing, unreadable, sha256 mismatch
            (mode "error"), or a bad layout / sample count / offset.
    """
    ix = entry["index"]
    path = f"{root}/{ix['name']}"
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise _error(f"sample index {path}: missing (rerun `python data_prep/shard.py index` on "
                     "the folder)") from None
    except Exception as e:  # noqa: BLE001 - fsspec backends raise many types
        raise _error(no_range_message(path, e) or f"sample index {path}: unreadable "
                     f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    want = ix.get("sha256")
    if mode != "off" and want:
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            msg = (f"sample index {path}: sha256 {got[:16]}... does not match manifest.json "
                   f"({want[:16]}...; {len(data)} bytes, manifest says {ix.get('bytes')}): damaged "
                   "or replaced; re-copy it or rerun `python data_prep/shard.py index` on the folder")
            if mode == "error":
                raise _error(msg)
            key = (_protocol(fs), path, want)
            if key not in _WARNED:
                _WARNED.add(key)
                print(f"warning: {msg}", file=sys.stderr, flush=True)
    return sample_index.decode(data, f"shard {root}/{entry['name']}: sample index {ix['name']}",
                               entry.get("samples"), entry.get("bytes"), with_layout=with_layout)


class _KeepingReader:
    """Read-only file wrapper for sequential readers that keeps the bytes read from offset
    `kept_from` on (`keep`), so a sample's byte range can be digested once the tar reader has
    passed it."""

    def __init__(self, f, keep: bool = False):
        self.f, self.n = f, 0
        self.keep, self.buf, self.kept_from = keep, bytearray(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.n += len(data)
        if self.keep:
            self.buf += data
        return data

    def range(self, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of the file (kept ones); drops those before `start`."""
        if start < self.kept_from or end > self.n:
            raise EOFError(f"bytes [{start}, {end}) are not where the sample index says")
        del self.buf[:start - self.kept_from]
        self.kept_from = start
        return bytes(self.buf[:end - start])


def _digest_index(fs, root: str, entry: dict, verify: str):
    """The records of shard `entry`'s sample index (checked as `read_sample_index`) when its
    manifest entry names one with per-sample digests (version 2 or 3) and `verify` is on, else
    None."""
    ix = entry.get("index")
    if verify == "off" or not isinstance(ix, dict) or not isinstance(ix.get("name"), str) \
            or int(ix.get("version", sample_index.VERSION_1)) < sample_index.VERSION_2:
        return None
    idx = read_sample_index(fs, root, entry, verify)
    return idx if sample_index.version_of(idx) == sample_index.VERSION_2 else None


def iter_shard_samples(data_dir: str, entries: list[dict], verify: str = "error"):
    """Samples of shards read front to back: yields `{"__key__": key, ext: bytes, ...}`.

    Every sample is checked before it is yielded, as the loader checks what it reads (module
    docstring), so a reader that stops early has checked all it got.

    Args:
        data_dir: the shard folder (local path or fsspec URL).
        entries: manifest.json entries of the shards (`name`, optionally `sha256`, `bytes`,
            `index`).
        verify: the mode ("off": nothing checked but the tar structure).

    Raises:
        DataError: one line: missing filesystem package, missing/unreadable/damaged shard or
            sample index, or (verify "error") a size or digest mismatch.
    """
    import tarfile
    fs, root = open_fs(data_dir)
    for e in entries:
        path = f"{root}/{e['name']}"
        idx = _digest_index(fs, root, e, verify)
        if idx is not None:
            check_shard_size(fs, path, e.get("bytes"), verify, training=False)
        else:
            verify_shard(fs, path, e.get("sha256"), verify, e.get("bytes"), training=False)
        index_name = (e.get("index") or {}).get("name", "")
        count = 0

        def checked(sample: dict, r) -> dict:
            if idx is not None:
                if count >= len(idx):
                    raise _error(f"shard {path}: more samples than its sample index's {len(idx)}")
                rec = idx[count]
                end = int(sample_index.sample_end(idx[count:count + 1])[0])
                raw = r.range(int(rec["start"]), end)
                check_sample(fs, path, count, sample["__key__"], raw, int(rec["digest"]), verify,
                             index_name, training=False)
            return sample
        try:
            with fs.open(path, "rb") as f:
                r = _KeepingReader(f, keep=idx is not None)
                sample: dict = {}
                with tarfile.open(fileobj=r, mode="r|") as tf:
                    for m in tf:
                        if not m.isfile():
                            continue
                        key, ext = sample_index.split_member(m.name)
                        if sample and key != sample["__key__"]:
                            yield checked(sample, r)
                            count += 1
                            sample = {}
                        sample["__key__"] = key
                        sample[ext] = tf.extractfile(m).read()
                if sample:
                    yield checked(sample, r)
                while r.read(_BLOCK):  # the end-of-archive padding
                    pass
        except FileNotFoundError:
            raise _error(f"shard {path}: missing") from None
        except (tarfile.TarError, OSError, EOFError, ValueError) as err:
            if isinstance(err, DataError):
                raise
            h = damage_hint(fs, path, e.get("bytes"))
            raise _error(no_range_message(path, err)
                         or f"shard {path}: unreadable ({err}){'; ' + h if h else ''}") from None
