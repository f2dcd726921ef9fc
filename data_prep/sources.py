"""Input reading for data preparation: paths, globs, fsspec URLs and the embedded stdlib corpus.

Owns: resolving `--input` arguments to a sorted list of sources, reading their records
(JSON list, JSONL, plain text, Parquet, the stdlib corpus) and normalizing each record to a
query/response pair or a text document, or to a skip reason. Memory: JSONL is streamed
line by line; a JSON list or a text file is read whole (one file at a time).
Must not touch: tokenization, slots, shards (data_prep/shard.py).

Skip reasons produced here (counted, never fatal):
`malformed_json` (a JSONL line, or a whole JSON-list file, that does not parse),
`invalid_utf8` (a line or file that is not UTF-8, or a JSON string with a lone surrogate),
`wrong_type` (a record that is not an object, or a field that is not a string),
`missing_field` (no query/response or text field), `empty_response` / `empty_text`
(nothing but whitespace), `unreadable_file` (a file that cannot be read or decompressed: a
non-Parquet `.parquet`, a bad or truncated `.gz`; counted once per file, with a one-line
warning on stderr naming it; records read before the damage are kept).
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import posixpath
import sys
import zlib
from dataclasses import dataclass
from typing import Iterator

import fsspec

from data_prep import stdlib_corpus
from pipeline.common.fs import missing_fs_package

STDLIB = "stdlib"  # the --input name of the embedded default corpus
TEXT_EXTS = (".txt", ".md", ".rst")
JSON_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.bz2", ".jsonl.xz", ".jsonl.zst")
PARQUET_EXTS = (".parquet",)
KNOWN_EXTS = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, dropped at the start of a file


# what reading/decompressing a damaged file raises (gzip.BadGzipFile and bz2 errors are OSError,
# a truncated stream EOFError, pyarrow's ArrowInvalid a ValueError)
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)


def _unreadable(name: str, error: BaseException) -> dict:
    """Warn (one line, naming the file) and return the `unreadable_file` skip record."""
    detail = (str(error).strip().splitlines() or [""])[0]
    print(f"warning: {name}: unreadable file ({type(error).__name__}: {detail}); "
          "rest of the file skipped", file=sys.stderr)
    return {"_error": "unreadable_file"}


def url_to_fs(url: str, what: str = "input"):
    """`fsspec.core.url_to_fs(url)`, or InputError with one line (`<what> <url>: ...`) when the
    protocol is unknown or its filesystem package is missing."""
    try:
        return fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise InputError(f"{what} {url}: {missing_fs_package(url, e)}") from None


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (`prog: error: ... (see --help)`), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class InputError(Exception):
    """An input that cannot be used at all (missing, unknown type); one-line message."""


@dataclass(frozen=True)
class Source:
    """One input: the stdlib corpus or one file (`fs` + `path`); `name` is what is recorded."""
    name: str
    fs: object = None
    path: str = ""

    @property
    def is_stdlib(self) -> bool:
        return self.fs is None


@dataclass(frozen=True)
class Fields:
    """Field names of records (the reference format uses query/response; text for raw text)."""
    query: str = "query"
    response: str = "response"
    text: str = "text"


def _has_known_ext(path: str) -> bool:
    return path.lower().endswith(KNOWN_EXTS)


_MAGIC = ("*", "?", "[")
SHARD_MANIFEST, SHARD_PARTIAL = "manifest.json", "manifest.partial.json"


def _is_shard_folder(fs, folder: str, listed: set[str] | None) -> bool:
    """True when `folder` holds a shard manifest: manifest.partial.json, or a manifest.json
    with the shard format (`format_version` and `splits`). `listed`: the known files below
    (a folder's `find`), else the filesystem is asked."""
    def has(name):
        p = f"{folder}/{name}"
        return p in listed if listed is not None else fs.isfile(p)
    if has(SHARD_PARTIAL):
        return True
    if not has(SHARD_MANIFEST):
        return False
    try:
        with fs.open(f"{folder}/{SHARD_MANIFEST}", "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and "format_version" in m and "splits" in m


def _excluded(fs, path: str, top: str, output: str | None, listed: set[str] | None,
              cache: dict) -> bool:
    """True when a folder strictly between `top` and the file `path` is the output folder
    or a shard folder (so shards, manifests and tokenizer files are never read as data)."""
    d = posixpath.dirname(path)
    while d.startswith(top + "/"):
        if d not in cache:
            cache[d] = d == output or _is_shard_folder(fs, d, listed)
        if cache[d]:
            return True
        d = posixpath.dirname(d)
    return False


def _output_root(output: str | None, fs) -> str | None:
    """The output folder as a path of `fs` (None when there is none or it is on another fs)."""
    if not output:
        return None
    try:
        ofs, root = fsspec.core.url_to_fs(output)
    except (ValueError, ImportError):
        return None
    return root.rstrip("/") if type(ofs) is type(fs) else None


def resolve_inputs(inputs: list[str], output: str | None = None) -> list[Source]:
    """Expand `--input` values into sources, in argument order (each glob/folder sorted).

    Each value is `stdlib`, a local path, a glob, a folder (files with a known extension
    below it) or an fsspec URL (`memory://...`, `file://...`, `s3://...` with the backend
    installed). Folders and globs leave out what lies in a subfolder that is the `output`
    folder or holds a shard manifest (manifest.partial.json, or manifest.json of the shard
    format): earlier outputs are never read as data. Raises InputError naming the value when
    it matches nothing, when a file named explicitly has an unknown extension, or when a
    folder is the `output` folder itself.
    """
    out: list[Source] = []
    for value in inputs:
        if value == STDLIB:
            out.append(Source(name=STDLIB))
            continue
        try:
            fs, _, paths = fsspec.get_fs_token_paths(value)
        except (ValueError, ImportError) as e:
            raise InputError(f"input {value}: {missing_fs_package(value, e)}") from None
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        oroot = _output_root(output, fs)
        stripped = fs._strip_protocol(value)
        glob_top = None
        if any(c in stripped for c in _MAGIC):  # the folder above the first wildcard
            head = stripped[:min(stripped.find(c) for c in _MAGIC if c in stripped)]
            glob_top = head.rsplit("/", 1)[0] if "/" in head else ""
        found, cache = [], {}
        for p in sorted(paths):
            if fs.isdir(p):
                p = p.rstrip("/")
                if p == oroot:
                    raise InputError(f"input {value}: is also the --output folder (its manifest "
                                     "and tokenizer files would be read as data); use another --output")
                listed = set(fs.find(p))
                found += sorted(f for f in listed if _has_known_ext(f)
                                and not _excluded(fs, f, p, oroot, listed, cache))
            elif fs.isfile(p):
                if not _has_known_ext(p):
                    raise InputError(f"input {value}: unknown file type {posixpath.basename(p)!r} "
                                     f"(expected one of {', '.join(KNOWN_EXTS)})")
                if glob_top is None or not _excluded(fs, p, glob_top, oroot, None, cache):
                    found.append(p)
        if not found:
            raise InputError(f"input {value}: no such file (or no .jsonl/.json/.txt/.parquet file in it)")
        for p in found:
            name = p if protocol in ("file", "local") else f"{protocol}://{p.split('://')[-1]}"
            out.append(Source(name=name, fs=fs, path=p))
    return out


def _check_str(value) -> str | None:
    """None if `value` is a well-formed str, else the skip reason."""
    if not isinstance(value, str):
        return "wrong_type"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogate from a JSON "\ud800" escape
        return "invalid_utf8"
    return None


def normalize(record, fmt: str, fields: Fields = Fields()) -> tuple:
    """Turn one raw record into `("qa", query, response)`, `("text", text)` or `("skip", reason)`.

    fmt: "qa", "text" or "auto" (qa when the record has the query or response field, else
    text when it has the text field). `record` may carry `_error` (a reading failure).
    """
    if isinstance(record, dict) and "_error" in record:
        return ("skip", record["_error"])
    if not isinstance(record, dict):
        return ("skip", "wrong_type")
    if fmt == "auto":
        fmt = "qa" if (fields.query in record or fields.response in record) else "text"
    if fmt == "qa":
        if fields.query not in record or fields.response not in record:
            return ("skip", "missing_field")
        q, r = record[fields.query], record[fields.response]
        bad = _check_str(q) or _check_str(r)
        if bad:
            return ("skip", bad)
        if not r.strip():
            return ("skip", "empty_response")
        return ("qa", q, r)
    if fields.text not in record:
        return ("skip", "missing_field")
    t = record[fields.text]
    bad = _check_str(t)
    if bad:
        return ("skip", bad)
    if not t.strip():
        return ("skip", "empty_text")
    return ("text", t)


def _json_list(raw: bytes, name: str) -> Iterator[tuple[str, object]]:
    try:
        items = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        yield name, {"_error": "invalid_utf8"}
        return
    except json.JSONDecodeError:
        yield name, {"_error": "malformed_json"}
        return
    for i, item in enumerate(items):
        yield f"{name}#{i}", item


def _lines(f) -> Iterator[bytes]:
    """Lines of a binary stream, split at `\n`, `\r\n` or `\r` (old Mac), each returned
    with one `\n` at its end (none on a last line without terminator). Latin-1 maps bytes to
    code points one to one and UTF-8 never uses the bytes 0x0A / 0x0D inside a character, so
    the bytes come back unchanged; Python's universal newlines do the splitting (in C)."""
    text = io.TextIOWrapper(f, encoding="latin-1", newline=None)
    try:
        for line in text:
            yield line.encode("latin-1")
    finally:
        try:
            text.detach()  # the caller closes `f`
        except (ValueError, OSError):
            pass


def _json_records(f, name: str) -> Iterator[tuple[str, object]]:
    """Records of an open binary JSON file: one JSON list (first non-blank byte `[`, read
    whole) or JSONL, streamed line by line (record ids `name#line`, from 1; lines end at
    `\n`, `\r\n` or `\r`)."""
    n = 0
    f = _lines(f)
    for line in f:
        if n == 0 and line.startswith(BOM):
            line = line[len(BOM):]
        n += 1
        if not line.strip():
            continue
        break
    else:
        return  # empty or blank
    if line.lstrip()[:1] == b"[":  # one JSON list (the reference ReFusion data format)
        yield from _json_list(line + b"".join(f), name)
        return
    while True:
        rid = f"{name}#{n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield rid, {"_error": "invalid_utf8"}
        else:
            try:
                yield rid, json.loads(text)
            except json.JSONDecodeError:
                yield rid, {"_error": "malformed_json"}
        for line in f:
            n += 1
            if line.strip():
                break
        else:
            return


def _parquet_records(source: Source, fields: Fields) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    i = 0
    try:
        with source.fs.open(source.path, "rb") as f:
            pf = pq.ParquetFile(f)
            wanted = [c for c in (fields.query, fields.response, fields.text)
                      if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(columns=wanted or None, batch_size=4096):
                for row in batch.to_pylist():
                    # a null cell is a missing field
                    yield f"{source.name}#{i}", {k: v for k, v in row.items() if v is not None}
                    i += 1
    except _READ_ERRORS + (pa.ArrowException,) as e:
        yield f"{source.name}#{i}", _unreadable(source.name, e)


def iter_records(source: Source, fmt: str, fields: Fields = Fields()) -> Iterator[tuple[str, object]]:
    """Yield `(record_id, raw_record)` for one source, in file order.

    `raw_record` is what the file holds (any JSON value for JSON inputs, a dict otherwise) or
    `{"_error": reason}` for a line/file that could not be read; pass it to `normalize`.
    For the stdlib corpus, fmt selects text documents ("text"), query/response pairs ("qa")
    or both ("auto"). A UTF-8 byte order mark at the start of a JSON/JSONL/text file is dropped.
    """
    if source.is_stdlib:
        yield from stdlib_corpus.iter_records(fmt)
        return
    lower = source.path.lower()
    if lower.endswith(PARQUET_EXTS):
        yield from _parquet_records(source, fields)
        return
    try:
        with source.fs.open(source.path, "rb", compression="infer") as f:
            if not lower.endswith(TEXT_EXTS):
                yield from _json_records(f, source.name)
                return
            raw = f.read()
    except _READ_ERRORS as e:
        yield source.name, _unreadable(source.name, e)
        return
    if raw.startswith(BOM):  # a UTF-8 byte order mark (Windows editors) is not content
        raw = raw[len(BOM):]
    try:
        yield source.name, {fields.text: raw.decode("utf-8")}
    except UnicodeDecodeError:
        yield source.name, {"_error": "invalid_utf8"}
