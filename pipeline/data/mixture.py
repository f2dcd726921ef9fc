"""Data mixtures: several shard folders ("sources") read as one training stream, each with a
share of the tokens.

Owns: `Source`, the blend rule, the blend state and what a new data phase keeps of it, the
epochs each source needs. Must not touch: shards, packing, process groups
(`pipeline.data.loader` walks the blend window by window and packs it; ARCHITECTURE.md
"Mixtures").

The blend. Weights are token shares (normalized to sum 1). The blend is a sequence of draws;
draw n takes the next sample of one source, chosen by worst-case fair weighted fair queueing
(WF2Q, Bennett and Zhang, "WF2Q: Worst-case Fair Weighted Fair Queueing", INFOCOM 1996): with
`tok[s]` the tokens drawn from source s in this phase and `T = sum(tok)`, the sources not ahead
of their share (`tok[s] / w[s] <= T`) are eligible, and among them the one whose next sample
would end earliest at its own rate (`(tok[s] + len_next[s]) / w[s]`, lowest index on a tie)
is drawn. Over every prefix of the blend, `|tok[s] - w[s] * T|` stays below the longest sample
drawn (<= one packed row's tokens): WF2Q's bound, checked on random and adversarial lengths by
tests/test_data_mixture.py (Megatron's "most under-served first" exceeds it by up to 1.7x there).
A sample's tokens are the tokens it feeds: its sample index's count, or in objective mode "dual"
its fed length (clean tokens + masked copies, `objective.dual_fed_length`).
Each source's samples come in their own shuffled order (the one-folder order of
`pipeline.data.loader`, seeded by the run seed and the source's name), epoch after epoch: a
source repeats only when all its samples were drawn, each repeat in a new order.

Phases (`data.phase`). A checkpoint records the phase, the sources (name, weight, shard-set
fingerprint) and the blend state. A resume with the same phase must have the same sources and
weights; a higher phase may change both: every source keeps its position (samples drawn, so no
sample of a source is drawn twice before the source is exhausted across phases; a source whose
shard set changed, or that is new, starts at its beginning), the token counts restart at 0
(the new weights hold from the phase's first draw); `next_phase_state`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from pipeline.data.format import DataError


@dataclass(frozen=True)
class Source:
    """One corpus of a mixture (`data.sources[i]`; each field's meaning: pipeline/config.py
    `SourceSection`): `name` (unique; metrics key `tokens_by_source/<name>`), `dir`,
    `weight` (before normalization, > 0), `max_epochs` (None: no limit)."""
    name: str
    dir: str
    weight: float = 1.0
    max_epochs: float | None = None


def folder_name(data_dir: str) -> str:
    """The source name of a one-folder run (`data.dir`): the folder's last path component."""
    return str(data_dir).rstrip("/").rsplit("/", 1)[-1] or "data"


def normalized_weights(sources) -> tuple[float, ...]:
    """Weights of `sources` divided by their sum (float64, deterministic). Raises DataError: a
    weight that is not a finite number > 0, or names that repeat."""
    names = [s.name for s in sources]
    for s in sources:
        if not (isinstance(s.weight, (int, float)) and math.isfinite(s.weight) and s.weight > 0):
            raise DataError(f"data.sources: source {s.name!r} has weight {s.weight!r}; a weight "
                            f"is a token share > 0")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DataError(f"data.sources: the name {dup[0]!r} is used twice; names must be unique")
    total = float(sum(float(s.weight) for s in sources))
    return tuple(float(s.weight) / total for s in sources)


def source_seed(seed: int, name: str) -> int:
    """The seed of source `name`'s own sample order in a run of seed `seed` (63 bits of a
    sha256): independent orders per source, unchanged when other sources are added."""
    return int(hashlib.sha256(f"{int(seed)}:{name}".encode()).hexdigest()[:15], 16)


def pick(tok: np.ndarray, weights: np.ndarray, next_len: np.ndarray) -> int:
    """The source index of the next draw (WF2Q, module docstring), computed plainly over all
    sources: the definition `draw` implements with heaps (tests compare the two). `tok`: int64[S]
    tokens drawn from each source in this phase; `weights`: float64[S], normalized; `next_len`:
    int64[S] tokens of each source's next sample."""
    start = tok / weights
    eligible = start <= float(tok.sum())
    if not eligible.any():   # rounding: the least advanced sources are eligible
        eligible = start == start.min()
    return int(np.argmin(np.where(eligible, (tok + next_len) / weights, np.inf)))


@dataclass
class BlendState:
    """Where the blend is: `pos[s]` samples drawn from source s since the run began (all
    phases; its epoch is `pos[s] // samples[s]`), `tok[s]` tokens drawn from it in this phase.
    Both int64[S], in the order of the run's sources."""
    pos: np.ndarray
    tok: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> "BlendState":
        return cls(np.zeros(n, np.int64), np.zeros(n, np.int64))

    def copy(self) -> "BlendState":
        return BlendState(self.pos.copy(), self.tok.copy())

    def to_list(self) -> list[int]:
        return [int(v) for v in self.pos] + [int(v) for v in self.tok]

    @classmethod
    def from_list(cls, v, n: int) -> "BlendState":
        a = np.asarray(v, dtype=np.int64)
        return cls(a[:n].copy(), a[n:2 * n].copy())


def draw(state: BlendState, n: int, weights: np.ndarray, sample_of, length_of):
    """`n` draws of the blend from `state` (not changed), with `pick`'s choices: WF2Q with two
    heaps (waiting sources by start tag `tok / w`, eligible ones by finish tag
    `(tok + len) / w`), O(log S) a draw.

    Args:
        weights: float64[S], normalized.
        sample_of: `(s, p) -> item`, the item (any value) at position p of source s.
        length_of: `(s, item) -> int`, its tokens.
    Returns:
        (items: list of (source, item, tokens), state after the draws).
    """
    import heapq
    st = state.copy()
    S = len(weights)
    w = [float(x) for x in weights]
    tok = [int(x) for x in st.tok]
    pos = [int(x) for x in st.pos]
    total = sum(tok)
    item = [sample_of(s, pos[s]) for s in range(S)]
    nxt = [int(length_of(s, item[s])) for s in range(S)]
    waiting = [(tok[s] / w[s], s) for s in range(S)]   # start tags
    heapq.heapify(waiting)
    eligible: list = []                                 # (finish tag, source)
    out = []
    for _ in range(n):
        floor = total if eligible or waiting[0][0] <= total else waiting[0][0]  # (rounding)
        while waiting and waiting[0][0] <= floor:
            _, s = heapq.heappop(waiting)
            heapq.heappush(eligible, ((tok[s] + nxt[s]) / w[s], s))
        _, s = heapq.heappop(eligible)
        L = nxt[s]
        out.append((s, item[s], L))
        tok[s] += L
        total += L
        pos[s] += 1
        item[s] = sample_of(s, pos[s])
        nxt[s] = int(length_of(s, item[s]))
        heapq.heappush(waiting, (tok[s] / w[s], s))
    return out, BlendState(np.array(pos, np.int64), np.array(tok, np.int64))


def phase_change(saved: dict | None, now: dict) -> str | None:
    """Why a checkpoint's mixture (`saved`, the loader state's "mix" entry, or None for a
    one-folder checkpoint) cannot continue as `now` in the same phase, or None when it can; both
    {"phase": int, "sources": [{"name", "weight", "data"}]}. Raises DataError: `now`'s phase is
    lower than the saved one."""
    if saved is None:
        return "the checkpoint trained on one folder (data.dir)"
    if now["phase"] < saved["phase"]:
        raise DataError(f"data.phase is {now['phase']}, the checkpoint is in phase "
                        f"{saved['phase']}; a phase can only go up")
    if now["phase"] > saved["phase"]:
        return None
    old = {s["name"]: s for s in saved["sources"]}
    new = {s["name"]: s for s in now["sources"]}
    diffs = [f"source {n!r} added" for n in new if n not in old]
    diffs += [f"source {n!r} removed" for n in old if n not in new]
    for n in new:
        if n in old:
            if abs(old[n]["weight"] - new[n]["weight"]) > 1e-12:
                diffs.append(f"weight of {n!r} {old[n]['weight']:.4g} -> {new[n]['weight']:.4g}")
            if old[n]["data"] != new[n]["data"]:
                diffs.append(f"shards of {n!r} changed")
    if not diffs and [s["name"] for s in saved["sources"]] != [s["name"] for s in now["sources"]]:
        diffs.append("the sources' order changed")
    return "; ".join(diffs) or None


def next_phase_state(saved: dict | None, saved_window: list | None, now: dict) -> BlendState:
    """The blend state a new phase starts from.

    Args:
        saved: the checkpoint's "mix" entry (None: a one-folder checkpoint: every source starts
            at its beginning).
        saved_window: the saved `window` entry: [blend state at the start of the cursor's
            window, each source's position after the window's consumed rows].
        now: this run's {"phase", "sources": [{"name", "weight", "data"}]}.
    Returns:
        Positions kept by source name (0 for a new source or one whose shards changed), token
        counts 0. A source continues after the last of its samples fed in the checkpoint's
        window: its samples of that window packed into rows not yet fed (best_fit reorders a
        window's rows) and drawn before that one are not read in this pass.
    """
    st = BlendState.zeros(len(now["sources"]))
    if saved is None or not saved_window:
        return st
    kept = [int(v) for v in saved_window[1]]
    old = {s["name"]: (i, s["data"]) for i, s in enumerate(saved["sources"])}
    for j, s in enumerate(now["sources"]):
        if s["name"] in old and old[s["name"]][1] == s["data"]:
            st.pos[j] = kept[old[s["name"]][0]]
    return st


def epochs_needed(tokens: list[int], weights, fed_tokens: int) -> list[float]:
    """`w[s] * fed_tokens / tokens[s]` per source (inf for an empty one): the passes over
    each source's training split (`tokens`, from the manifests) a run feeding at most
    `fed_tokens` tokens (steps x global batch rows x row length) makes, with normalized
    `weights`."""
    return [(w * fed_tokens) / t if t > 0 else math.inf for t, w in zip(tokens, weights)]


_TOKENIZER_KEYS = ("hash", "vocab_size", "pad_id", "mask_id", "eos_id", "bos_id", "added_tokens")


def check_same_tokenizer(a: tuple, b: tuple) -> None:
    """Refuse two sources `a`, `b` ((Source, its manifest dict)) whose shards were made with
    different tokenizers.

    Raises:
        DataError: one line naming both sources and the first differing tokenizer field.
    """
    (sa, ma), (sb, mb) = a, b
    for k in _TOKENIZER_KEYS:
        va, vb = ma["tokenizer"].get(k), mb["tokenizer"].get(k)
        if va != vb:
            raise DataError(f"data.sources: sources {sa.name!r} ({sa.dir}) and {sb.name!r} "
                            f"({sb.dir}) were tokenized differently (tokenizer.{k} {va!r} vs "
                            f"{vb!r}); every source of a mixture needs the same tokenizer")
