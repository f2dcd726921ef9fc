"""Opening shard folders (any fsspec URL) and checking shards against their manifest.

Owns: the fsspec filesystem of a data folder, reading and checking its manifest.json
(`read_manifest`), with one-line errors for an unknown protocol or
a missing filesystem package (`s3fs`, `gcsfs`, `aiohttp` for http(s)://) and for an HTTP
server that does not answer range requests; shard integrity (`verify_shard`: the sha256 of a
shard against manifest.json, `data.verify_shards = error | warn | off`); the wording of a
damaged shard (truncated, or changed in place).
Must not touch: shard order, batches, loader state (`pipeline.data.loader`).

Why a shard is verified whole, once, when a loader process first needs it: the loader reads
shards by random access (a sample index, then byte ranges of the samples of a window), so
the bytes read are not the file in order and cannot be fed to one running hash; and a stream
reads only part of the shards at its range's ends. So the first time a process touches a shard
(before its sample index is read), the whole file is read sequentially
in 8 MiB blocks and hashed (sha256 runs at about 1-2 GB/s on one core: ~0.2 s for a 256 MB
shard, next to minutes of training on it), then compared with the manifest. The result is
remembered per process (path + expected digest), so later windows, epochs and pieces of the same
shard cost nothing. The digest is checked before any of the shard's samples is used, so a
swapped or damaged shard never reaches a batch in `error` mode. Cost: each loader process
hashes each shard it reads from, once in its life. When a process reads only its own part of
the split (contiguous stream ranges) that is about one extra sequential pass over the data per
job; when every process reads from every shard (a global sample order), it is one pass per
process: the processes of a node share the page cache, so the disk or network sees about one
extra pass per node, and each process spends ~0.2 s of CPU per 256 MB shard. For very large
sets on slow storage, `data.verify_shards=off` skips it (a shard damaged in its tar structure
is still reported in one line).
Manifests without a `sha256` entry (older or hand-written ones) are not checked.
Sample indexes (`<shard>.idx`, `read_sample_index`) are read whole and their sha256 compared
with the manifest's `index.sha256` in the same modes (36 bytes a sample: ~10 ms of hashing for
125,000 samples); their layout and offsets are checked in every mode.
"""
from __future__ import annotations

import hashlib
import json
import sys

from pipeline.common.fs import missing_fs_package
from pipeline.data import sample_index
from pipeline.data.format import FORMAT_VERSION, MANIFEST, DataError

VERIFY_MODES = ("error", "warn", "off")
_BLOCK = 8 << 20
_VERIFIED: set = set()   # (protocol, path, expected sha256) checked in this process
_WARNED: set = set()


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
        DataError: missing/unreadable manifest, unknown format_version, missing fields.
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

    fsspec's async filesystems (http(s)://, s3://, gs://) hold an event loop and sessions that
    a forked loader worker cannot use ("This class is not fork-safe"); a new instance made in
    the worker has its own. In-memory stores are class-level, so a memory:// instance made
    again still sees the parent's files.
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


def verify_shard(fs, path: str, expected: str | None, mode: str,
                 expected_bytes: int | None = None, others=()) -> None:
    """Check the sha256 of shard `path` against `expected` (manifest.json), once per process.

    Args:
        fs, path: the shard's filesystem and path.
        expected: its `sha256` in manifest.json (hex); None = not recorded, not checked.
        mode: "error" (raise), "warn" (one `warning:` line on stderr, once per shard) or "off".
        expected_bytes: its `bytes` in manifest.json, for the message.
        others: (shard name, sha256) pairs of the split's shards (read only on a mismatch),
            to name a swapped shard.

    Raises:
        DataError: (mode "error") one line naming the shard, both digests and the likely cause
            (another shard's content, truncated, changed in place); or the shard is unreadable.
    """
    if mode == "off" or not expected:
        return
    key = (_protocol(fs), path, expected)
    if key in _VERIFIED or key in _WARNED:
        return
    try:
        got, size = _file_sha256(fs, path)
    except FileNotFoundError:
        raise _error(f"shard {path}: missing") from None
    except Exception as e:  # noqa: BLE001 - fsspec backends raise many types
        msg = no_range_message(path, e)
        raise _error(msg or f"shard {path}: unreadable ({type(e).__name__}: "
                     f"{(str(e).splitlines() or [''])[0]})") from None
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
           f"{why}; re-copy the shard or rerun data_prep/shard.py (data.verify_shards=warn|off "
           "trains on it anyway)")
    if mode == "error":
        raise _error(msg)
    _WARNED.add(key)
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def missing_index_message(data_dir: str, shard: str) -> str:
    """The one line for a shard whose manifest entry has no sample index."""
    return (f"{data_dir}/manifest.json: shard {shard} has no sample index "
            f"({sample_index.index_name(shard)}; shards written before indexes existed): write "
            f"them with `python data_prep/shard.py index {data_dir}`")


def read_sample_index(fs, root: str, entry: dict, mode: str):
    """The checked sample index (`pipeline.data.sample_index.DTYPE[N]`) of manifest shard
    entry `entry` (`name`, `samples`, `bytes`, `index`: {`name`, `bytes`, `sha256`}).

    The file is read whole in one request (36 bytes a sample); its sha256 is compared with the
    manifest's in modes "error" (raise) and "warn" (one `warning:` line), not in "off". Its
    layout and offsets are always checked (`sample_index.decode`).

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
                               entry.get("samples"), entry.get("bytes"))


class _HashingReader:
    """Read-only file wrapper that hashes every byte read, in order (sequential readers)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.sha.update(data)
        self.n += len(data)
        return data


def iter_shard_samples(data_dir: str, entries: list[dict], verify: str = "error"):
    """Samples of shards read front to back: yields `{"__key__": key, ext: bytes, ...}`.

    Args:
        data_dir: the shard folder (local path or fsspec URL).
        entries: manifest.json entries of the shards (`name`, optionally `sha256`, `bytes`).
        verify: as `verify_shard`; the bytes are hashed as they are streamed, and a shard read
            to its end is compared with its `sha256` (a reader that stops early checks nothing
            for that shard).

    Raises:
        DataError: one line: missing filesystem package, missing/unreadable/damaged shard, or
            (verify "error") a digest mismatch.
    """
    import tarfile
    fs, root = open_fs(data_dir)
    for e in entries:
        path = f"{root}/{e['name']}"
        try:
            with fs.open(path, "rb") as f:
                r = _HashingReader(f)
                sample: dict = {}
                with tarfile.open(fileobj=r, mode="r|") as tf:
                    for m in tf:
                        if not m.isfile():
                            continue
                        key, _, ext = m.name.partition(".")
                        if sample and key != sample["__key__"]:
                            yield sample
                            sample = {}
                        sample["__key__"] = key
                        sample[ext] = tf.extractfile(m).read()
                if sample:
                    yield sample
                while r.read(_BLOCK):  # the end-of-archive padding
                    pass
        except FileNotFoundError:
            raise _error(f"shard {path}: missing") from None
        except (tarfile.TarError, OSError, EOFError, ValueError) as err:
            h = damage_hint(fs, path, e.get("bytes"))
            raise _error(no_range_message(path, err)
                         or f"shard {path}: unreadable ({err}){'; ' + h if h else ''}") from None
        want = e.get("sha256")
        if verify != "off" and want and r.sha.hexdigest() != want:
            msg = (f"shard {path}: sha256 {r.sha.hexdigest()[:16]}... does not match manifest.json "
                   f"({want[:16]}...); re-copy the shard or rerun data_prep/shard.py")
            if verify == "error":
                raise _error(msg)
            print(f"warning: {msg}", file=sys.stderr, flush=True)
