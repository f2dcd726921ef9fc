"""Input reading for data preparation: paths, globs, fsspec URLs and the embedded stdlib corpus.

Owns: resolving `--input` arguments to a sorted list of sources, reading their records
(JSON list, JSONL, plain text, Parquet, the stdlib corpus) and normalizing each record to a
query/response pair, a chat conversation or a text document, or to a skip reason (with a
one-line description of the record's shape for the skips caused by it), and the identity of
each input file (`input_identity`, `input_changes`: size, modification time, ETag/checksum where
the filesystem reports one, and the sha256 of the bytes when the file was read to its end).
Memory: JSONL is streamed line by line; a JSON list is read whole; a text file up to
`STREAM_TEXT_BYTES` is read whole, a larger one is streamed (`TextFile`: read twice in
blocks, never held whole).
Must not touch: tokenization, slots, shards (data_prep/prepare.py).

Skip reasons produced here (counted, never fatal):
`malformed_json` (a JSONL line, or a whole JSON-list file, that does not parse),
`invalid_utf8` (a line or file that is not UTF-8, or a JSON string with a lone surrogate),
`wrong_type` (a record that is not an object, or a field that is not a string),
`missing_field` (no query/response, messages or text field), `empty_response` / `empty_text`
(nothing but whitespace; for a chat: no assistant turn with content), `no_assistant_turn` (a
chat with no assistant turn after another message), `unsupported_role:<role>` (a chat message
whose role is not system, user or assistant, e.g. `unsupported_role:tool`), `tool_calls` (an
assistant message with tool calls), `unreadable_file` (a file that cannot be read or decompressed: a
non-Parquet `.parquet`, a bad or truncated `.gz`; counted once per file, with a one-line
warning on stderr naming it; records read before the damage are kept).
"""
from __future__ import annotations

import argparse
import codecs
import datetime
import hashlib
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
from pipeline.data.format import MANIFEST, PARTIAL_MANIFEST

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
    """Field names of records (the reference format uses query/response; text for raw text;
    messages for chat conversations, a list of {"role", "content"} objects)."""
    query: str = "query"
    response: str = "response"
    text: str = "text"
    messages: str = "messages"


def _has_known_ext(path: str) -> bool:
    return path.lower().endswith(KNOWN_EXTS)


_MAGIC = ("*", "?", "[")


def _is_shard_folder(fs, folder: str, listed: set[str] | None) -> bool:
    """True when `folder` holds a shard manifest: manifest.partial.json, or a manifest.json
    with the shard format (`format_version` and `splits`). `listed`: the known files below
    (a folder's `find`), else the filesystem is asked."""
    def has(name):
        p = f"{folder}/{name}"
        return p in listed if listed is not None else fs.isfile(p)
    if has(PARTIAL_MANIFEST):
        return True
    if not has(MANIFEST):
        return False
    try:
        with fs.open(f"{folder}/{MANIFEST}", "rb") as f:
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


CHAT_ROLES = ("system", "user", "assistant")
# skip reasons caused by a record's shape: the first record skipped for each is described
SHAPE_REASONS = ("missing_field", "wrong_type", "tool_calls", "no_assistant_turn")
_MAX_NAMES = 8


def _type_name(value) -> str:
    """`a string`, `an integer`, ... for messages about JSON values."""
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
             list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _names(keys) -> str:
    """`"a", "b", "c"` (at most _MAX_NAMES, then `and N more`), or `no fields`."""
    keys = [str(k) for k in keys]
    if not keys:
        return "no fields"
    shown = ", ".join(json.dumps(k, ensure_ascii=False) for k in keys[:_MAX_NAMES])
    return shown + (f" and {len(keys) - _MAX_NAMES} more" if len(keys) > _MAX_NAMES else "")


def expected_fields(fmt: str, fields: Fields) -> str:
    """What a record of `fmt` must hold, in words (for skip messages)."""
    q, r, t, m = (json.dumps(x, ensure_ascii=False) for x in
                  (fields.query, fields.response, fields.text, fields.messages))
    return {"qa": f"{q} and {r}", "text": t, "chat": f"{m} (a list of role/content messages)",
            "auto": f"{m} (chat), {q} and {r} (pair) or {t} (document)"}[fmt]


def role_reason(role: str) -> str:
    """The skip reason of a chat message with an unsupported `role`: `unsupported_role:<role>`
    (the role's letters, digits and `_.-`, at most 32 characters)."""
    import re
    return "unsupported_role:" + (re.sub(r"[^A-Za-z0-9_.-]", "_", role)[:32] or "''")


def _chat(messages, name: str) -> tuple:
    """Normalize a chat record's messages (see `normalize`)."""
    if not isinstance(messages, list):
        return ("skip", "wrong_type", f"{name} is {_type_name(messages)}; expected a list of "
                "objects with \"role\" and \"content\"")
    turns: list[str] = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            return ("skip", "wrong_type", f"{where} is {_type_name(m)}; expected an object with "
                    "\"role\" and \"content\"")
        present = [k for k, v in m.items() if v is not None]
        role = m.get("role")
        if role is None:
            return ("skip", "missing_field", f"{where} has fields {_names(present)}; expected "
                    "\"role\" and \"content\"")
        if not isinstance(role, str):
            return ("skip", "wrong_type", f"{where}.role is {_type_name(role)}; expected a string")
        if role not in CHAT_ROLES:
            return ("skip", role_reason(role), f"{where} has role {json.dumps(role)}; expected "
                    f"{', '.join(CHAT_ROLES)}")
        if m.get("tool_calls") or m.get("function_call"):
            return ("skip", "tool_calls", f"{where} ({role}) has tool calls; they are not rendered")
        content = m.get("content")
        if content is None:
            return ("skip", "missing_field", f"{where} has fields {_names(present)}; expected "
                    "\"role\" and \"content\"")
        bad = _check_str(content)
        if bad:
            detail = (f"{where}.content is {_type_name(content)}; expected a string"
                      if bad == "wrong_type" else None)
            return ("skip", bad, detail)
        turns += [role, content]
    answers = [turns[j + 1] for j in range(2, len(turns), 2) if turns[j] == "assistant"]
    if not any(a.strip() for a in answers):
        if answers:
            return ("skip", "empty_response", None)
        roles = _names(turns[0::2]) if turns else "no messages"
        return ("skip", "no_assistant_turn", f"{name} has roles {roles}; expected an "
                "assistant turn after another message")
    return ("chat", *turns)


def normalize(record, fmt: str, fields: Fields = Fields()) -> tuple:
    """Turn one raw record into `("qa", query, response)`, `("text", text)`,
    `("chat", role_0, content_0, role_1, content_1, ...)` or `("skip", reason, detail)`.

    fmt: "qa", "text", "chat" or "auto" (chat when the record has the messages field, else qa
    when it has the query or response field, else text). `record` may carry `_error` (a
    reading failure). `text` may be a `TextFile` (a large text file, streamed; checked for
    UTF-8 and emptiness when it is read). `detail` is a one-line description of the record's
    shape (the fields it has and those expected) for the reasons caused by it, else None.
    Chat roles are system, user and assistant; see the module docstring for the reasons.
    """
    if isinstance(record, dict) and "_error" in record:
        return ("skip", record["_error"], None)
    if not isinstance(record, dict):
        return ("skip", "wrong_type", f"the record is {_type_name(record)}; expected an object "
                f"with {expected_fields(fmt, fields)}")
    asked = fmt
    if fmt == "auto":
        fmt = ("chat" if fields.messages in record else
               "qa" if (fields.query in record or fields.response in record) else "text")
    # a record with none of the fields: say every shape `auto` accepts
    missing = ("skip", "missing_field", f"the record has fields {_names(record)}; expected "
               f"{expected_fields(asked if fmt == 'text' else fmt, fields)}")
    if fmt == "chat":
        if fields.messages not in record:
            return missing
        return _chat(record[fields.messages], json.dumps(fields.messages, ensure_ascii=False))
    if fmt == "qa":
        if fields.query not in record or fields.response not in record:
            return missing
        q, r = record[fields.query], record[fields.response]
        for name, v in ((fields.query, q), (fields.response, r)):
            bad = _check_str(v)
            if bad:
                return ("skip", bad, f"{json.dumps(name)} is {_type_name(v)}; expected a string"
                        if bad == "wrong_type" else None)
        if not r.strip():
            return ("skip", "empty_response", None)
        return ("qa", q, r)
    if fields.text not in record:
        return missing
    t = record[fields.text]
    if isinstance(t, TextFile):
        return ("text", t)
    bad = _check_str(t)
    if bad:
        return ("skip", bad, f"{json.dumps(fields.text)} is {_type_name(t)}; expected a string"
                if bad == "wrong_type" else None)
    if not t.strip():
        return ("skip", "empty_text", None)
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
    yield from _jsonl_records(line, n, f, name)


def _jsonl_records(line: bytes, n: int, f, name: str) -> Iterator[tuple[str, object]]:
    """JSONL records from the non-blank `line` (line number `n`, from 1) and the lines after
    it in `f` (blank ones skipped); record ids `name#line`."""
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


def _parquet_records(source: Source, fields: Fields, row_groups: list[int] | None = None,
                     first_row: int = 0) -> Iterator[tuple[str, object]]:
    """Rows of a Parquet file (only `row_groups` when given; `first_row`: the index of their
    first row in the file, for record ids `name#row`) as dicts without null cells."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    i = first_row
    try:
        with source.fs.open(source.path, "rb") as f:
            pf = pq.ParquetFile(f)
            wanted = [c for c in (fields.query, fields.response, fields.text, fields.messages)
                      if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(columns=wanted or None, batch_size=4096,
                                         row_groups=row_groups):
                for row in batch.to_pylist():
                    # a null cell is a missing field
                    yield f"{source.name}#{i}", {k: v for k, v in row.items() if v is not None}
                    i += 1
    except _READ_ERRORS + (pa.ArrowException,) as e:
        yield f"{source.name}#{i}", _unreadable(source.name, e)


class _HashingReader(io.RawIOBase):
    """A raw binary stream over `f` that hashes (sha256) and counts the bytes read."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        b[:len(data)] = data
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def drain(self) -> str:
        """Read to the end; the sha256 hex digest of every byte of the file."""
        for data in iter(lambda: self.f.read(1 << 20), b""):
            self.sha.update(data)
        return self.sha.hexdigest()


def _open_hashed(source: Source):
    """(decompressed binary stream, hashing reader of the stored bytes) for `source`;
    compression is inferred from the name, as `fsspec.open(..., compression="infer")` does."""
    from fsspec.compression import compr
    from fsspec.utils import infer_compression
    raw = source.fs.open(source.path, "rb")
    hashed = _HashingReader(raw)
    buffered = io.BufferedReader(hashed, 1 << 20)
    codec = infer_compression(source.path)
    return (compr[codec](buffered, mode="rb") if codec else buffered), hashed, raw


STREAM_TEXT_BYTES = 4 << 20  # text files larger than this are streamed (TextFile)
_BLOCK = 1 << 18             # bytes read at a time from a streamed text file


class TextFile:
    """A text file (.txt/.md/.rst) read in blocks, never held whole (see `normalize`).

    `scan(prefix)` reads it once: sha256 of `prefix + b"\\0" + content` (the record digest of
    data_prep/prepare.py), whether any character is not whitespace, and the sha256 of the
    stored bytes (`file_sha256`). `pieces(piece_end, limit)` reads it again and yields the
    text in the pieces that would be cut from the whole text; it raises InputError when the
    bytes differ from the first read. Content: UTF-8 without a leading byte order mark; a read
    error raises one of the reading errors (OSError, ...), bad UTF-8 UnicodeDecodeError.
    """

    def __init__(self, source: Source, size: int):
        self.source, self.size = source, size
        self.file_sha256: str | None = None

    def _blocks(self) -> Iterator[tuple[bytes, bytes, str]]:
        """(stored bytes, content bytes, decoded text) blocks: the content is the stored bytes
        without a leading byte order mark."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        with self.source.fs.open(self.source.path, "rb") as f:
            stored = f.read(_BLOCK)
            content = stored[len(BOM):] if stored.startswith(BOM) else stored
            while True:
                text = decoder.decode(content, final=not stored)
                yield stored, content, text
                if not stored:
                    return
                stored = content = f.read(_BLOCK)

    def scan(self, prefix: bytes, on_text=None) -> tuple[bytes, bool]:
        """(record digest, has a non-whitespace character) from one read of the file. Bad
        UTF-8 raises UnicodeDecodeError after the file has been read to its end (so
        `file_sha256` is known either way). `on_text(text, final)`, when given, gets the
        decoded text block by block (`final` on the last; not called after bad UTF-8)."""
        h, whole, nonblank = hashlib.sha256(prefix + b"\0"), hashlib.sha256(), False
        decoder, bad = codecs.getincrementaldecoder("utf-8")(), None
        with self.source.fs.open(self.source.path, "rb") as f:
            for i, stored in enumerate(iter(lambda: f.read(_BLOCK), b"")):
                whole.update(stored)
                content = stored[len(BOM):] if i == 0 and stored.startswith(BOM) else stored
                h.update(content)
                if bad is None:
                    try:
                        text = decoder.decode(content)
                        nonblank = nonblank or (bool(text) and not text.isspace())
                        if on_text is not None:
                            on_text(text, False)
                    except UnicodeDecodeError as e:
                        bad = e
        self.file_sha256 = whole.hexdigest()
        if bad is None:
            try:
                text = decoder.decode(b"", final=True)
                if on_text is not None:
                    on_text(text, True)
            except UnicodeDecodeError as e:
                bad = e
        if bad is not None:
            raise bad
        return h.digest(), nonblank

    def pieces(self, piece_end, limit: int) -> Iterator[tuple[str, bool]]:
        """`(piece, safe)` in order: `piece_end(text, start) -> (end, safe)` places each end
        (pipeline.tokenizer.piece_end), given at least `limit` + 1 characters after `start`
        (or the end of the text), so the pieces are those of the whole text."""
        whole, buf, pos = hashlib.sha256(), "", 0
        blocks = self._blocks()
        while True:
            try:
                stored, _, text = next(blocks)
            except StopIteration:
                break
            except _READ_ERRORS as e:  # read fine a moment ago (scan): not a skip, a failure
                raise InputError(f"input {self.source.name}: cannot be read again "
                                 f"({type(e).__name__}: {e})") from None
            whole.update(stored)
            buf = buf[pos:] + text
            pos = 0
            while len(buf) - pos > limit:
                end, safe = piece_end(buf, pos)
                yield buf[pos:end], safe
                pos = end
        while pos < len(buf):
            end, safe = piece_end(buf, pos)
            yield buf[pos:end], safe
            pos = end
        if whole.hexdigest() != self.file_sha256:
            raise InputError(f"input {self.source.name}: changed while being read; rerun the "
                             "same command")


def _file_sha256(source: Source) -> str:
    """sha256 hex of the stored bytes of `source` (one sequential read)."""
    h = hashlib.sha256()
    with source.fs.open(source.path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def iter_records(source: Source, fmt: str, fields: Fields = Fields(),
                 digests: dict | None = None) -> Iterator[tuple[str, object]]:
    """Yield `(record_id, raw_record)` for one source, in file order.

    `raw_record` is what the file holds (any JSON value for JSON inputs, a dict otherwise) or
    `{"_error": reason}` for a line/file that could not be read; pass it to `normalize`.
    For the stdlib corpus, fmt selects text documents ("text"), query/response pairs ("qa")
    or both ("auto"). A UTF-8 byte order mark at the start of a JSON/JSONL/text file is dropped.
    A text file larger than `STREAM_TEXT_BYTES` comes as `{text: TextFile}` (streamed).
    digests: when given, `digests[source.name]` is set to the sha256 hex of the file's stored
    bytes once it has been read to its end (JSON, JSONL, text; not Parquet, which is read
    by random access).
    """
    if source.is_stdlib:
        yield from stdlib_corpus.iter_records(fmt)
        return
    lower = source.path.lower()
    if lower.endswith(PARQUET_EXTS):
        yield from _parquet_records(source, fields)
        return
    if lower.endswith(TEXT_EXTS):
        try:
            size = int(source.fs.size(source.path) or 0)
        except _READ_ERRORS:
            size = 0
        if size > STREAM_TEXT_BYTES:
            doc = TextFile(source, size)
            yield source.name, {fields.text: doc}
            if digests is not None and doc.file_sha256:
                digests[source.name] = doc.file_sha256
            return
    try:
        f, hashed, raw_file = _open_hashed(source)
        with raw_file, f:
            if not lower.endswith(TEXT_EXTS):
                yield from _json_records(f, source.name)
                if digests is not None:
                    digests[source.name] = hashed.drain()
                return
            raw = f.read()
            if digests is not None:
                digests[source.name] = hashed.drain()
    except _READ_ERRORS as e:
        yield source.name, _unreadable(source.name, e)
        return
    if raw.startswith(BOM):  # a UTF-8 byte order mark (Windows editors) is not content
        raw = raw[len(BOM):]
    try:
        yield source.name, {fields.text: raw.decode("utf-8")}
    except UnicodeDecodeError:
        yield source.name, {"_error": "invalid_utf8"}


# ----------------------------------------------------------------------------- input identity

def _jsonable_time(value):
    """A modification time from fsspec's info as JSON: a number stays, a datetime becomes
    ISO 8601 text, anything else its str."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return str(value)


def input_identity(source: Source) -> dict:
    """`{"name", "size", "mtime", "etag"}` of an input from its filesystem's info (`mtime`:
    the modification time, or the creation time where that is all the filesystem reports;
    HTTP: Last-Modified; `etag`: an ETag / checksum where it reports one, e.g. s3's and
    HTTP's ETag, gcs's md5Hash), absent
    keys left out. The stdlib corpus is `{"name": "stdlib"}` (its Python version is an
    option). Raises InputError when the file cannot be stat'ed."""
    if source.is_stdlib:
        return {"name": source.name}
    try:
        info = source.fs.info(source.path)
    except (OSError, ValueError) as e:
        raise InputError(f"input {source.name}: cannot read its size and time ({e})") from None
    out = {"name": source.name, "size": info.get("size")}
    for k in ("mtime", "LastModified", "Last-Modified", "last_modified", "updated", "modified",
              "created"):
        if info.get(k) is not None:
            out["mtime"] = _jsonable_time(info[k])
            break
    for k in ("ETag", "etag", "md5Hash", "Content-MD5", "crc32c", "Digest", "checksum"):
        if info.get(k) is not None:
            out["etag"] = str(info[k]).strip('"')
            break
    return out


def _show(key: str, value) -> str:
    if key == "mtime" and isinstance(value, (int, float)):
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc).isoformat(
            timespec="microseconds")
    return f"{value} bytes" if key == "size" else str(value)


def input_changes(recorded: list[dict], current: list[dict], sources: list[Source]) -> str | None:
    """The first difference between `recorded` input identities (a manifest's "inputs") and
    `current` ones (`input_identity` of `sources`), in words (`input X changed (size 1 bytes,
    now 2 bytes)`, `input X is new`, `input X is gone`; `(and N more)` when there are more),
    or None when they agree. A file whose size is unchanged but whose modification time or
    ETag differs is read once and compared with the recorded sha256 when there is one:
    equal content is no change (a file copied or touched)."""
    rec = {e.get("name"): e for e in recorded if isinstance(e, dict)}
    by_name = {s.name: s for s in sources}
    changes = [f"input {n} is new" for n in by_name if n not in rec]
    changes += [f"input {n} is gone" for n in rec if n not in by_name]
    for cur in current:
        old = rec.get(cur["name"])
        if old is None:
            continue
        diff = [k for k in ("size", "mtime", "etag") if old.get(k) != cur.get(k)]
        if not diff:
            continue
        if "size" not in diff and old.get("sha256"):
            try:
                if _file_sha256(by_name[cur["name"]]) == old["sha256"]:
                    continue
            except _READ_ERRORS:
                pass
        said = [f"{'modified' if k == 'mtime' else k} {_show(k, old.get(k))}, "
                f"now {_show(k, cur.get(k))}" for k in diff]
        changes.append(f"input {cur['name']} changed ({'; '.join(said)})")
    if not changes:
        return None
    return changes[0] + (f" (and {len(changes) - 1} more)" if len(changes) > 1 else "")
