"""A compact set of fixed-width digests for data preparation's exact-duplicate filter.

Owns: `DigestSet`, which remembers 16-byte record digests in about 16 bytes each and tells a
new digest from a repeat and from a *key collision* (a different digest whose first
`key_bytes` bytes, the sample key, are already taken).
Must not touch: hashing or normalizing records (data_prep/prepare.py).

Layout: a sorted numpy array of `S16` values (16 bytes per digest) plus a small dict buffer
of recent digests (key prefix -> digest). When the buffer holds max(min_buffer, len(array) / 8)
digests it is sorted and merged into the array (`np.insert` at `searchsorted` positions, O(n)
per merge, O(n log n) in all). Costs per digest: 16 bytes in the array, plus the buffer's
Python objects (~140 bytes each, at most 1/8 of the array), and during a merge the old and the
new array coexist for a moment. Measured with tracemalloc for 10^6 digests: 22.8 bytes held,
33.7 at the peak (a Python set of 16-byte `bytes`: 82.6); the growth of data prep's peak RSS
is ~40 bytes per record (`bench/bench_data_prep.py --memory`).
Lookups: a dict probe and one binary search, O(log n). Two digests sharing the first
`key_bytes` bytes are neighbours in sorted order, so a key collision is found by looking at
the two neighbours of the insertion point.
"""
from __future__ import annotations

import numpy as np

NEW, DUPLICATE, KEY_COLLISION = "new", "duplicate", "key_collision"


class DigestSet:
    """Set of `width`-byte digests (bytes); `add` reports new / duplicate / key collision.

    Args:
        width: digest length in bytes (16 for records).
        key_bytes: the prefix that must be unique among distinct digests (10: the 80-bit keys).
        min_buffer: digests kept in the dict buffer before a merge into the sorted array.
    """

    def __init__(self, width: int = 16, key_bytes: int = 10, min_buffer: int = 1 << 14):
        if not 0 < key_bytes <= width:
            raise ValueError(f"key_bytes {key_bytes} must be in (0, width={width}]")
        self.width, self.key_bytes, self.min_buffer = width, key_bytes, min_buffer
        self.sorted = np.zeros(0, dtype=f"S{width}")
        self.buffer: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return int(self.sorted.size) + len(self.buffer)

    def nbytes(self) -> int:
        """Bytes held by the sorted array (the buffer's Python objects not included)."""
        return int(self.sorted.nbytes)

    def _full(self, i: int) -> bytes:
        # numpy's S dtype drops trailing NULs when an item is read back: pad to the width
        return bytes(self.sorted[i]).ljust(self.width, b"\0")

    def add(self, digest: bytes) -> str:
        """Insert `digest` (exactly `width` bytes); returns NEW, DUPLICATE (already present,
        not inserted again) or KEY_COLLISION (another digest has the same key prefix; not
        inserted)."""
        if len(digest) != self.width:
            raise ValueError(f"digest of {len(digest)} bytes, expected {self.width}")
        key = digest[:self.key_bytes]
        other = self.buffer.get(key)
        if other is not None:
            return DUPLICATE if other == digest else KEY_COLLISION
        n = self.sorted.size
        if n:
            i = int(np.searchsorted(self.sorted, np.bytes_(digest)))
            for j in (i - 1, i):
                if 0 <= j < n:
                    near = self._full(j)
                    if near == digest:
                        return DUPLICATE
                    if near[:self.key_bytes] == key:
                        return KEY_COLLISION
        self.buffer[key] = digest
        if len(self.buffer) >= max(self.min_buffer, n // 8):
            self._merge()
        return NEW

    def _merge(self) -> None:
        new = np.array(sorted(self.buffer.values()), dtype=f"S{self.width}")
        self.buffer = {}
        if self.sorted.size:
            new = np.insert(self.sorted, np.searchsorted(self.sorted, new), new)
        self.sorted = new
