"""Work units: the pieces a run on many machines deals to its tasks, and the boundaries a
packed sample never crosses in any run.

Owns: cutting inputs into work units (`cut_units`) and reading one unit's records in input
order (`unit_reads`). Used by the plan (data_prep/plan.py) and by the one-machine pipeline
with `--pack` (data_prep/prepare.py).
Must not touch: the plan file, dealing units to tasks (data_prep/plan.py), normalizing and
tokenizing records (data_prep/prepare.py).

Work units (sizes in bytes of the stored file): an uncompressed JSONL file (`.jsonl`, or a
`.json` whose first non-blank byte is not `[`) larger than `--unit-bytes` is cut into byte
ranges that start right after a `\\n` (so each range holds whole lines: lines end with `\\n`,
`\\r\\n` or `\\r`, and a range never starts inside a `\\r\\n`); a Parquet file is cut into runs
of consecutive row groups of about `--unit-bytes` (uncompressed size from its metadata); a
JSON list, a compressed file, a text file (one document) and the stdlib corpus are read whole.
Consecutive small files share a unit until it holds `--unit-bytes`. A unit's records come in
the order a one-process run reads them, and units follow input order, so "plan order" is
input order.
"""
from __future__ import annotations

import hashlib
import io

from data_prep.sources import (BOM, PARQUET_EXTS, Fields, Source, _jsonl_records, _lines,
                               _parquet_records, iter_records)

UNIT_BYTES = 64 << 20  # default --unit-bytes
_SCAN = 1 << 20        # bytes read at a time when looking for a line end


# ----------------------------------------------------------------------------- cutting

def _first_byte(source: Source) -> bytes:
    """The first non-blank byte of a file (after a byte order mark), b"" when there is none
    in its first MiB."""
    with source.fs.open(source.path, "rb") as f:
        head = f.read(_SCAN)
    if head.startswith(BOM):
        head = head[len(BOM):]
    return head.lstrip()[:1]


def _line_cuts(source: Source, size: int, unit_bytes: int) -> list[int]:
    """Offsets (bytes) just after a `\\n`, one at or after each multiple of `unit_bytes`,
    strictly inside the file; reads only around each target."""
    cuts: list[int] = []
    with source.fs.open(source.path, "rb") as f:
        target = unit_bytes
        while target < size - unit_bytes // 4:  # no range of less than a quarter unit at the end
            pos = max(target - 1, cuts[-1] if cuts else 0)
            f.seek(pos)
            while True:
                block = f.read(_SCAN)
                if not block:
                    return cuts
                i = block.find(b"\n")
                if i >= 0:
                    cut = pos + i + 1
                    break
                pos += len(block)
            if cut >= size:
                return cuts
            cuts.append(cut)
            target = max(target + unit_bytes, cut + 1)
    return cuts


def _pieces(j: int, source: Source, ident: dict, unit_bytes: int) -> list[tuple[dict, int]]:
    """`(piece, bytes)` of input `j` in order: byte ranges, row-group runs, or the whole file."""
    size = int(ident.get("size") or 0)
    if source.is_stdlib:
        return [({"input": j}, 0)]
    lower = source.path.lower()
    if lower.endswith(PARQUET_EXTS):
        try:
            import pyarrow.parquet as pq
            with source.fs.open(source.path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
                groups = [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size)
                          for i in range(meta.num_row_groups)]
        except Exception:  # not Parquet: the run counts it as unreadable_file, once
            return [({"input": j}, size)]
        out, run, nbytes, row = [], [], 0, 0
        first = 0
        for i, (rows, b) in enumerate(groups):
            if run and nbytes + b > unit_bytes:
                out.append(({"input": j, "row_groups": run, "first_row": first}, nbytes))
                run, nbytes, first = [], 0, row
            run.append(i)
            nbytes += b
            row += rows
        if run:
            out.append(({"input": j, "row_groups": run, "first_row": first}, nbytes))
        return out or [({"input": j}, size)]
    jsonl = lower.endswith(".jsonl") or lower.endswith(".json")
    if not jsonl or size <= unit_bytes or _first_byte(source) in (b"[", b""):
        return [({"input": j}, size)]
    bounds = [0, *_line_cuts(source, size, unit_bytes), size]
    return [({"input": j, "start": a, "end": b}, b - a) for a, b in zip(bounds, bounds[1:])]


def cut_units(sources: list[Source], inputs: list[dict], unit_bytes: int) -> list[dict]:
    """Work units `[{"pieces": [...], "bytes": n}]` in input order (module docstring)."""
    units, cur, nbytes = [], [], 0
    for j, (source, ident) in enumerate(zip(sources, inputs)):
        for piece, b in _pieces(j, source, ident, unit_bytes):
            if cur and (nbytes + b > unit_bytes or len(piece) > 1):
                units.append({"pieces": cur, "bytes": nbytes})
                cur, nbytes = [], 0
            cur.append(piece)
            nbytes += b
            if len(piece) > 1:  # a range or row-group run is a unit of its own
                units.append({"pieces": cur, "bytes": nbytes})
                cur, nbytes = [], 0
    if cur:
        units.append({"pieces": cur, "bytes": nbytes})
    return units



# ----------------------------------------------------------------------------- reading a unit

class _Range(io.RawIOBase):
    """The bytes [start, end) of an open binary file, hashed (sha256) as they are read."""

    def __init__(self, f, start: int, end: int):
        f.seek(start)
        self.f, self.left, self.sha = f, end - start, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(min(len(b), self.left)) if self.left > 0 else b""
        b[:len(data)] = data
        self.left -= len(data)
        self.sha.update(data)
        return len(data)


def _range_records(source: Source, start: int, end: int, digests: dict):
    """JSONL records of the byte range [start, end) of `source` (record ids
    `name@start#line`, lines counted from the range's start); `digests["name@start"]` is set
    to the sha256 of the range's bytes once read."""
    name = f"{source.name}@{start}"
    with source.fs.open(source.path, "rb") as f:
        rng = _Range(f, start, end)
        lines = _lines(io.BufferedReader(rng, 1 << 20))
        n = 0
        for line in lines:
            if n == 0 and start == 0 and line.startswith(BOM):
                line = line[len(BOM):]
            n += 1
            if line.strip():
                yield from _jsonl_records(line, n, lines, name)
                break
        digests[name] = rng.sha.hexdigest()


def unit_reads(units: list[dict], index: int, sources: list[Source], fmt: str, fields: Fields,
               digests: dict) -> list:
    """`(source, records)` of each piece of `units[index]`, in order (the reads of
    data_prep/prepare.py `_stage_a`)."""
    reads = []
    for piece in units[index]["pieces"]:
        source = sources[piece["input"]]
        if "start" in piece:
            recs = _range_records(source, piece["start"], piece["end"], digests)
        elif "row_groups" in piece:
            recs = _parquet_records(source, fields, piece["row_groups"], piece["first_row"])
        else:
            recs = iter_records(source, fmt, fields, digests)
        reads.append((source, recs))
    return reads
