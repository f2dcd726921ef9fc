"""The embedded default corpus: the running interpreter's standard library sources.

Owns: listing the stdlib `.py` files and turning them into records, either whole files as
text documents (`{"text": source}`) or query/response pairs extracted with `ast`
(`{"query": decorators + signature + docstring, "response": the rest of the body}`).
Must not touch: tokenization, shards (see data_prep/prepare.py).

The corpus is real code on every machine; it depends on the interpreter version, so the
manifest records `sys.version` next to it (see shard.py options).
"""
from __future__ import annotations

import ast
import os
import sysconfig
import warnings
from typing import Iterator

# Directories left out: installed third-party code and the (large, repetitive) test suites.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_root() -> str:
    """Folder of the running interpreter's standard library sources (`sysconfig` "stdlib")."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative paths (POSIX separators) of the stdlib `.py` files under `root`.

    Test suites, `site-packages` and caches are excluded. Raises FileNotFoundError when
    `root` holds no `.py` file (e.g. a stripped interpreter without sources).
    """
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                out.append(rel.replace(os.sep, "/"))
    if not out:
        raise FileNotFoundError(f"no .py sources under the standard library folder {root}")
    return sorted(out)


def qa_pairs(source: str) -> Iterator[tuple[str, str, str]]:
    """Yield `(qualified_name, query, response)` for every documented function in `source`.

    A function (sync or async, methods and nested functions included) qualifies when its
    body starts with a docstring and has at least one statement after it. The query is the
    source from the first decorator (or `def`) through the end of the docstring line; the
    response is the source from the line after the docstring through the function's last
    line. Both lose the common indentation of the function's non-blank lines (blank lines
    become bare newlines), so `query + response` is the function's source, dedented; the
    split is at a line boundary and the query keeps its trailing newline.
    Files that do not parse yield nothing.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old sources
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)

    def visit(stmts: list, prefix: str) -> Iterator[tuple[str, str, str]]:
        # Only statement lists can hold a def: walk bodies, never expressions.
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                if not isinstance(node, ast.ClassDef):
                    pair = _split_function(node, lines)
                    if pair is not None:
                        yield (name, *pair)
                yield from visit(node.body, name + ".")
                continue
            for attr in ("body", "orelse", "finalbody"):
                sub = getattr(node, attr, None)
                if isinstance(sub, list):
                    yield from visit(sub, prefix)
            for extra in getattr(node, "handlers", []) + getattr(node, "cases", []):
                yield from visit(extra.body, prefix)

    yield from visit(tree.body, "")


def _split_function(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]):
    body = fn.body
    if len(body) < 2 or ast.get_docstring(fn, clean=False) is None:
        return None
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    doc_end = body[0].end_lineno
    if body[1].lineno <= doc_end:  # `"""doc"""; x = 1` on one line: no clean split
        return None
    query_lines = lines[first - 1:doc_end]
    response_lines = lines[doc_end:fn.end_lineno]
    if not "".join(response_lines).strip():
        return None
    margins = [len(l) - len(l.lstrip(" \t")) for l in query_lines + response_lines if l.strip()]
    margin = min(margins)

    def dedent(block: list[str]) -> str:
        return "".join(l[margin:] if l.strip() else l.lstrip(" \t") for l in block)

    return dedent(query_lines), dedent(response_lines)


def iter_records(fmt: str, root: str | None = None) -> Iterator[tuple[str, dict]]:
    """Yield `(record_id, record)` for the stdlib corpus in a fixed order.

    fmt: "text" (one `{"text": source}` per file), "qa" (one `{"query", "response"}` per
    documented function), or "both"/"auto" (per file: its text record, then its pairs).
    record_id is `"stdlib/<relative path>"` or `"stdlib/<relative path>::<qualified name>"`;
    it is stable across runs on the same interpreter version.
    Files that are not valid UTF-8 are yielded as `{"text": None, "_error": "invalid_utf8"}`.
    """
    if fmt not in ("text", "qa", "both", "auto"):
        raise ValueError(f"unknown stdlib format {fmt!r}")
    root = root or stdlib_root()
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield f"stdlib/{rel}", {"_error": "invalid_utf8"}
            continue
        if fmt in ("text", "both", "auto"):
            yield f"stdlib/{rel}", {"text": source}
        if fmt in ("qa", "both", "auto"):
            for name, query, response in qa_pairs(source):
                yield f"stdlib/{rel}::{name}", {"query": query, "response": response}
