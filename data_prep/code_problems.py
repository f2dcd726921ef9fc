"""`python data_prep/code_problems.py`: a deterministic generator of MBPP-form code problems.

    python data_prep/code_problems.py --output DIR [--train 20000] [--test 500] [--dev 200]
        [--test-unseen 300] [--seed 0]

Owns: the mbpp task's data (the operations, how they compose, specs, canonical bodies, assert
tests, the splits) written as JSONL query/response records that `data_prep/shard.py` and
`data_prep/train_tokenizer.py` read (`--input DIR/train.jsonl`). Must not touch: tokenization,
shards, evaluation (tests are run by `pipeline.inference.execution`).

A problem is a composition of 1 to 3 operations (OPS: list, string, integer and dict
operations with concrete parameters, e.g. `keep_gt:3`, `mul:2`, `sum`) whose types chain
(list -> list -> int, string -> words -> string, ...). It is written as
- `query`: a natural-language spec, then the signature on its own line, e.g.
  "Write a function `f(xs)` that takes a list of integers xs, keeps the even numbers, then
  multiplies each number by 2, then takes the sum, and returns the result.\\ndef f(xs):";
- `response`: the canonical body, one line per operation in a fixed style (the variable
  named by its type: xs, s, n, d, ws) and a final `return`, e.g.
  "    xs = [x for x in xs if x % 2 == 0]\\n    xs = [x * 2 for x in xs]\\n    n = sum(xs)\\n
  return n";
- `tests`: 3 to MAX_TESTS `assert f(<input>) == <output>` lines, outputs computed by running
  the canonical body on inputs drawn from the problem key. The inputs are chosen among
  PROBES drawn inputs so that every near miss (one parameter changed, an operation dropped,
  replaced by another of the same types, or two swapped) that differs from the canonical body
  on any probe fails at least one test. A composition is not used when its output is the same
  on every probe, or when dropping one of its operations changes no probe's output (a
  redundant operation: sort then reverse-sort, keep > 3 then keep > 5, ...).

Splits (files in `--output`):
- the *problem key* is the composition with its parameters (`keep_even|mul:2|sum`); the
  *composition* is the operation names alone (`keep_even,mul,sum`).
- HELD_OUT_PAIRS: the ordered pairs of operations (a then b) whose sha256 bucket is below
  UNSEEN_PAIR_FRACTION, a pure function of the pair's names. A composition holding such a pair
  (adjacent, in that order) is never trained on: `test_unseen.jsonl` holds only such problems.
  Every operation and most pairs appear in train (`info.json` lists the held-out pairs, and
  the generator refuses a pair list under which an operation would not occur in train).
- `train.jsonl`, `test.jsonl`, `dev.jsonl`: problems of the other compositions, split by
  `pool_of(key)` (first 8 bytes of the key's sha256: HELD_OUT_FRACTION each for test and
  dev), so no held-out problem is a training problem whatever the seed or sizes. Each file
  holds a key at most once. `dev` is for choosing; `test`, `test_unseen` for the figures.
- `info.json`: sizes, seed, operations, held-out pairs, counts, the formats.
Records: {"query", "response", "signature", "tests": [str], "key", "composition": [str]}.
Output is byte-identical for the same options. Exit codes: 0 done; 2 bad options (one line).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pipeline.common.atomic_io import write_json, write_text

HELD_OUT_FRACTION = 0.04      # share of problem keys in each held-out pool (test, dev)
UNSEEN_PAIR_FRACTION = 0.08   # share of ordered operation pairs never trained on
DEFAULT_SIZES = {"train": 20000, "test": 500, "dev": 200, "test_unseen": 300}
LENGTH_WEIGHTS = {1: 0.15, 2: 0.45, 3: 0.40}   # operations per problem
PROBES = 24                   # inputs drawn per problem, among which the tests are chosen
MIN_TESTS, MAX_TESTS = 3, 6
MAX_REPR = 80                 # longest input or output literal in a test


class GeneratorError(ValueError):
    """Bad generator options (one line)."""


# ------------------------------------------------------------------------ operations

# types: L list of ints (xs), I int (n), S string (s), W list of words (ws),
# D dict str -> int (d), E dict int -> str (d)
VAR = {"L": "xs", "I": "n", "S": "s", "W": "ws", "D": "d", "E": "d"}
TYPE_TEXT = {"L": "a list of integers xs", "I": "an integer n", "S": "a string s",
             "D": "a dict d from strings to integers"}
START_TYPES = ("L", "L", "L", "S", "S", "I", "D")   # the first operation's input, drawn
CHARS = "abcde"


@dataclass(frozen=True)
class Op:
    """One operation: `src` -> `dst` types, `params` (its parameter values; () for none),
    `phrase` and `line` (spec clause and body line; `{p}` / `{q}` stand for the parameter,
    `{q}` for the second value of a pair)."""

    name: str
    src: str
    dst: str
    phrase: str
    line: str
    params: tuple = ()

    def fill(self, text: str, p) -> str:
        if isinstance(p, tuple):
            return text.replace("{p}", str(p[0])).replace("{q}", str(p[1]))
        return text if p is None else text.replace("{p}", str(p))


def _r(a: int, b: int) -> tuple:
    return tuple(range(a, b + 1))


_PAIRS = tuple((a, b) for a in CHARS for b in CHARS if a != b)
OPS: dict[str, Op] = {o.name: o for o in (
    # list -> list
    Op("keep_even", "L", "L", "keeps the even numbers", "xs = [x for x in xs if x % 2 == 0]"),
    Op("keep_odd", "L", "L", "keeps the odd numbers", "xs = [x for x in xs if x % 2 == 1]"),
    Op("keep_gt", "L", "L", "keeps the numbers greater than {p}",
       "xs = [x for x in xs if x > {p}]", _r(0, 9)),
    Op("keep_lt", "L", "L", "keeps the numbers less than {p}",
       "xs = [x for x in xs if x < {p}]", _r(1, 9)),
    Op("add", "L", "L", "adds {p} to each number", "xs = [x + {p} for x in xs]", _r(1, 9)),
    Op("sub", "L", "L", "subtracts {p} from each number", "xs = [x - {p} for x in xs]",
       _r(1, 9)),
    Op("mul", "L", "L", "multiplies each number by {p}", "xs = [x * {p} for x in xs]",
       _r(2, 9)),
    Op("square", "L", "L", "squares each number", "xs = [x * x for x in xs]"),
    Op("mod", "L", "L", "takes each number modulo {p}", "xs = [x % {p} for x in xs]",
       _r(2, 9)),
    Op("reverse", "L", "L", "reverses the list", "xs = xs[::-1]"),
    Op("sort", "L", "L", "sorts the list", "xs = sorted(xs)"),
    Op("sort_desc", "L", "L", "sorts the list in descending order",
       "xs = sorted(xs, reverse=True)"),
    Op("take", "L", "L", "keeps the first {p} element(s)", "xs = xs[:{p}]", _r(1, 5)),
    Op("drop", "L", "L", "drops the first {p} element(s)", "xs = xs[{p}:]", _r(1, 4)),
    Op("dedup", "L", "L", "removes repeated numbers", "xs = list(dict.fromkeys(xs))"),
    # list -> int
    Op("sum", "L", "I", "takes the sum", "n = sum(xs)"),
    Op("count", "L", "I", "counts the numbers", "n = len(xs)"),
    Op("max", "L", "I", "takes the largest number (0 if none)", "n = max(xs, default=0)"),
    Op("min", "L", "I", "takes the smallest number (0 if none)", "n = min(xs, default=0)"),
    Op("count_eq", "L", "I", "counts the numbers equal to {p}", "n = xs.count({p})", _r(0, 9)),
    # int -> int, list, string
    Op("n_add", "I", "I", "adds {p} to it", "n = n + {p}", _r(1, 9)),
    Op("n_sub", "I", "I", "subtracts {p} from it", "n = n - {p}", _r(1, 9)),
    Op("n_mul", "I", "I", "multiplies it by {p}", "n = n * {p}", _r(2, 9)),
    Op("n_div", "I", "I", "divides it by {p} rounding down", "n = n // {p}", _r(2, 9)),
    Op("n_mod", "I", "I", "takes it modulo {p}", "n = n % {p}", _r(2, 9)),
    Op("n_square", "I", "I", "squares it", "n = n * n"),
    Op("n_abs", "I", "I", "takes its absolute value", "n = abs(n)"),
    Op("digits", "I", "L", "lists its digits", "xs = [int(c) for c in str(abs(n))]"),
    Op("to_str", "I", "S", "writes it as a string", "s = str(n)"),
    # string -> string, int, words
    Op("upper", "S", "S", "converts it to upper case", "s = s.upper()"),
    Op("lower", "S", "S", "converts it to lower case", "s = s.lower()"),
    Op("s_reverse", "S", "S", "reverses the string", "s = s[::-1]"),
    Op("strip", "S", "S", "strips '{p}' from both ends", "s = s.strip('{p}')", tuple(CHARS)),
    Op("replace", "S", "S", "replaces each '{p}' with '{q}'", "s = s.replace('{p}', '{q}')",
       _PAIRS),
    Op("remove", "S", "S", "removes every '{p}'", "s = s.replace('{p}', '')", tuple(CHARS)),
    Op("prefix", "S", "S", "puts '{p}' in front", "s = '{p}' + s", tuple(CHARS)),
    Op("double", "S", "S", "repeats it twice", "s = s + s"),
    Op("s_len", "S", "I", "takes its length", "n = len(s)"),
    Op("s_count", "S", "I", "counts the '{p}' characters", "n = s.count('{p}')", tuple(CHARS)),
    Op("split", "S", "W", "splits it into words", "ws = s.split()"),
    Op("split_on", "S", "W", "splits it at each '{p}'", "ws = s.split('{p}')", tuple(CHARS)),
    # words -> words, string, int, list
    Op("w_reverse", "W", "W", "reverses the order of the words", "ws = ws[::-1]"),
    Op("w_sort", "W", "W", "sorts the words", "ws = sorted(ws)"),
    Op("w_long", "W", "W", "keeps the words longer than {p} characters",
       "ws = [w for w in ws if len(w) > {p}]", _r(1, 3)),
    Op("w_upper", "W", "W", "converts each word to upper case", "ws = [w.upper() for w in ws]"),
    Op("w_first", "W", "W", "keeps the first letter of each word", "ws = [w[:1] for w in ws]"),
    Op("join", "W", "S", "joins the words with '{p}'", "s = '{p}'.join(ws)", ("-", ",", "+")),
    Op("w_count", "W", "I", "counts the words", "n = len(ws)"),
    Op("w_lens", "W", "L", "takes the length of each word", "xs = [len(w) for w in ws]"),
    # dicts
    Op("d_keep_gt", "D", "D", "keeps the entries whose value is greater than {p}",
       "d = {k: v for k, v in d.items() if v > {p}}", _r(0, 5)),
    Op("d_add", "D", "D", "adds {p} to each value", "d = {k: v + {p} for k, v in d.items()}",
       _r(1, 9)),
    Op("d_sum", "D", "I", "takes the sum of the values", "n = sum(d.values())"),
    Op("d_len", "D", "I", "counts the entries", "n = len(d)"),
    Op("d_distinct", "D", "I", "counts the distinct values", "n = len(set(d.values()))"),
    Op("d_values", "D", "L", "lists the values in key order", "xs = [d[k] for k in sorted(d)]"),
    Op("d_keys", "D", "W", "lists the keys in sorted order", "ws = sorted(d)"),
    Op("d_keys_by_value", "D", "W", "lists the keys ordered by value", "ws = sorted(d, key=d.get)"),
    Op("invert", "D", "E", "swaps keys and values", "d = {v: k for k, v in d.items()}"),
    Op("e_values", "E", "W", "lists the values in key order", "ws = [d[k] for k in sorted(d)]"),
    Op("e_max_key", "E", "I", "takes the largest key (0 if none)", "n = max(d, default=0)"),
)}


def _bucket(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0 ** 64


def valid_pairs() -> list[tuple[str, str]]:
    """Every ordered pair (a, b) of distinct operations whose types chain (a.dst == b.src)."""
    return [(a, b) for a in OPS for b in OPS
            if a != b and OPS[a].dst == OPS[b].src]


def held_out_pairs() -> list[tuple[str, str]]:
    """The ordered pairs never trained on (module docstring), sorted."""
    return sorted(p for p in valid_pairs() if _bucket("pair:" + ",".join(p)) < UNSEEN_PAIR_FRACTION)


HELD_OUT_PAIRS = frozenset(held_out_pairs())


def is_unseen(composition) -> bool:
    """Whether a composition (operation names in order) holds a held-out pair."""
    return any((a, b) in HELD_OUT_PAIRS for a, b in zip(composition, composition[1:]))


def pool_of(key: str) -> str:
    """The pool of a problem key: "test" or "dev" (HELD_OUT_FRACTION of keys each) or
    "train", from the first 8 bytes of sha256(key) (independent of seed and sizes)."""
    u = _bucket(key)
    return "test" if u < HELD_OUT_FRACTION else "dev" if u < 2 * HELD_OUT_FRACTION else "train"


# ------------------------------------------------------------------------ problems

Step = tuple  # (op name, parameter or None)


def step_key(step: Step) -> str:
    name, p = step
    if p is None:
        return name
    return f"{name}:" + (",".join(map(str, p)) if isinstance(p, tuple) else str(p))


def key_of(steps) -> str:
    """The problem key: `name[:param]` of each step joined by `|`."""
    return "|".join(step_key(s) for s in steps)


def signature_of(steps) -> str:
    return f"def f({VAR[OPS[steps[0][0]].src]}):"


def spec_of(steps) -> str:
    """The natural-language spec of a composition (one clause per step)."""
    first = OPS[steps[0][0]].src
    clauses = [OPS[n].fill(OPS[n].phrase, p) for n, p in steps]
    return (f"Write a function `f({VAR[first]})` that takes {TYPE_TEXT[first]}, "
            + ", then ".join(clauses) + ", and returns the result.")


def body_of(steps) -> str:
    """The canonical body: one 4-space-indented line per step and `return <var>`."""
    lines = [OPS[n].fill(OPS[n].line, p) for n, p in steps]
    lines.append(f"return {VAR[OPS[steps[-1][0]].dst]}")
    return "\n".join("    " + ln for ln in lines)


@functools.lru_cache(maxsize=None)
def compile_body(steps):
    """The canonical function of a composition (signature + body compiled in-process: the
    generator runs only its own code; no body mutates its argument, `make_problem` checks)."""
    g: dict = {}
    exec(compile(signature_of(steps) + "\n" + body_of(steps), "<canonical>", "exec"), g)
    return g["f"]


def _draw_input(t: str, rng: random.Random):
    if t == "L":
        return [rng.randint(-3, 12) for _ in range(rng.randint(3, 7))]
    if t == "I":
        return rng.randint(-20, 120)
    if t == "S":
        words = ["".join(rng.choice("aabbcdeAB") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 4))]
        s = " ".join(words)
        if rng.random() < 0.4:
            c = rng.choice(CHARS)
            s = c * rng.randint(1, 2) + s + c * rng.randint(0, 2)
        return s
    if t == "D":
        keys = rng.sample(["a", "b", "c", "x", "y", "z", "k", "m"], rng.randint(2, 5))
        return {k: rng.randint(-3, 9) for k in keys}
    raise AssertionError(t)


def _outputs(fn, inputs) -> list:
    """("ok", fn(x)) for each input x; None where it raised."""
    out = []
    for x in inputs:
        try:
            out.append(("ok", fn(x)))
        except Exception:  # noqa: BLE001 - a probe the composition does not accept
            out.append(None)
    return out


def _valid_chain(steps) -> bool:
    return all(OPS[a[0]].dst == OPS[b[0]].src for a, b in zip(steps, steps[1:]))


def _near_misses(steps, rng: random.Random) -> list[tuple]:
    """Compositions one edit away: a parameter changed, a step dropped, replaced by another
    operation of the same types, or two adjacent steps swapped (type-valid ones only)."""
    out = []
    for i, (n, p) in enumerate(steps):
        op = OPS[n]
        others = [q for q in op.params if q != p]
        for q in rng.sample(others, min(2, len(others))):
            out.append(steps[:i] + ((n, q),) + steps[i + 1:])
        if len(steps) > 1:
            out.append(steps[:i] + steps[i + 1:])
        alts = [m for m, o in OPS.items() if m != n and o.src == op.src and o.dst == op.dst]
        for m in rng.sample(alts, min(2, len(alts))):
            out.append(steps[:i] + ((m, _param(OPS[m], rng)),) + steps[i + 1:])
    for i in range(len(steps) - 1):
        out.append(steps[:i] + (steps[i + 1], steps[i]) + steps[i + 2:])
    return [s for s in out if s and _valid_chain(s) and OPS[s[0][0]].src == OPS[steps[0][0]].src]


def _param(op: Op, rng: random.Random):
    return op.params[rng.randrange(len(op.params))] if op.params else None


@dataclass(frozen=True)
class Problem:
    """A generated problem (module docstring). `steps`: ((op name, parameter), ...)."""

    steps: tuple
    tests: tuple

    @property
    def key(self) -> str:
        return key_of(self.steps)

    @property
    def composition(self) -> tuple:
        return tuple(n for n, _ in self.steps)

    def record(self) -> dict:
        sig = signature_of(self.steps)
        return {"query": spec_of(self.steps) + "\n" + sig, "response": body_of(self.steps),
                "signature": sig, "tests": list(self.tests), "key": self.key,
                "composition": list(self.composition)}


def make_problem(steps: tuple) -> Problem | None:
    """The problem of a composition with its tests (module docstring), or None when the
    composition is degenerate (fewer than MIN_TESTS usable probes, a constant output, a
    redundant step). The probes and the tests depend on the key alone."""
    rng = random.Random("probes:" + key_of(steps))
    t = OPS[steps[0][0]].src
    inputs = [_draw_input(t, rng) for _ in range(PROBES)]
    before = repr(inputs)
    outs = _outputs(compile_body(steps), inputs)
    usable = [i for i, o in enumerate(outs)
              if o is not None and len(repr(o[1])) <= MAX_REPR and len(repr(inputs[i])) <= MAX_REPR]
    if len(usable) < MIN_TESTS or len({repr(outs[i]) for i in usable}) < 2:
        return None
    if len(steps) > 1:                       # a step whose removal changes nothing
        for i in range(len(steps)):
            short = steps[:i] + steps[i + 1:]
            if _valid_chain(short) and OPS[short[0][0]].src == t:
                if all(repr(a) == repr(b) for a, b in zip(_outputs(compile_body(short), inputs),
                                                          outs)):
                    return None
    # near misses that differ from the canonical body on some usable probe must be caught
    misses = []
    for other in _near_misses(steps, rng):
        o = _outputs(compile_body(other), inputs)
        caught = {i for i in usable if repr(o[i]) != repr(outs[i])}
        if caught:
            misses.append(caught)
    chosen: list[int] = []
    for i in usable:                         # first: probes of distinct outputs
        if len(chosen) < MIN_TESTS and repr(outs[i]) not in {repr(outs[j]) for j in chosen}:
            chosen.append(i)
    for i in usable:
        if len(chosen) < MIN_TESTS and i not in chosen:
            chosen.append(i)
    left = [m for m in misses if not m & set(chosen)]
    while left and len(chosen) < MAX_TESTS:
        best = max(usable, key=lambda i: (sum(i in m for m in left), -i))
        chosen.append(best)
        left = [m for m in left if best not in m]
    if repr(inputs) != before:
        raise AssertionError(f"{key_of(steps)}: a body changed its argument")
    if left:
        return None
    chosen.sort()
    tests = tuple(f"assert f({inputs[i]!r}) == {outs[i][1]!r}" for i in chosen)
    return Problem(tuple(steps), tests)


def _draw_steps(rng: random.Random) -> tuple:
    length = rng.choices(list(LENGTH_WEIGHTS), weights=list(LENGTH_WEIGHTS.values()))[0]
    t = rng.choice(START_TYPES)
    steps: list = []
    while len(steps) < length:
        names = [n for n, o in OPS.items() if o.src == t and (not steps or n != steps[-1][0])]
        if not names:
            break
        n = names[rng.randrange(len(names))]
        steps.append((n, _param(OPS[n], rng)))
        t = OPS[n].dst
    return tuple(steps)


def generate(sizes: dict[str, int], seed: int = 0) -> dict[str, list[Problem]]:
    """The splits (module docstring), deterministic in (sizes, seed).

    Args:
        sizes: problems per split, keys "train", "test", "dev", "test_unseen".
        seed: seed of the composition streams (`random.Random(f"{seed}:seen")`, `":unseen"`).
    Returns:
        {split: [Problem, ...]} with distinct keys within each split and the pools disjoint.
    Raises:
        GeneratorError: a negative size, or a size the compositions cannot fill with distinct
            problems (50 times the size drawn in a row without a new key).
    """
    for k, v in sizes.items():
        if v < 0:
            raise GeneratorError(f"--{k.replace('_', '-')} must be >= 0, got {v}")
    check_held_out_pairs()
    want = {s: sizes.get(s, 0) for s in ("train", "test", "dev")}
    got: dict[str, list[Problem]] = {s: [] for s in want}
    keys: set[str] = set()
    rng = random.Random(f"{seed}:seen")
    misses = 0
    while any(len(got[s]) < want[s] for s in want):
        steps = _draw_steps(rng)
        k = key_of(steps)
        pool = pool_of(k)
        p = None
        if not is_unseen([n for n, _ in steps]) and len(got[pool]) < want[pool] \
                and k not in keys:
            keys.add(k)              # also a degenerate key: not drawn again
            p = make_problem(steps)
        if p is not None:
            got[pool].append(p)
            misses = 0
        else:
            misses += 1
            if misses > 50 * max(1, max(want.values())):
                short = {s: f"{len(got[s])}/{want[s]}" for s in want if len(got[s]) < want[s]}
                raise GeneratorError(f"cannot draw enough distinct problems: {short}")
    unseen: list[Problem] = []
    ukeys: set[str] = set()
    rng = random.Random(f"{seed}:unseen")
    n_unseen, misses = sizes.get("test_unseen", 0), 0
    while len(unseen) < n_unseen:
        steps = _draw_steps(rng)
        k = key_of(steps)
        p = None
        if is_unseen([n for n, _ in steps]) and k not in ukeys:
            ukeys.add(k)
            p = make_problem(steps)
        if p is not None:
            unseen.append(p)
            misses = 0
        else:
            misses += 1
            if misses > 1000 * n_unseen:
                raise GeneratorError("cannot draw enough distinct unseen-composition problems")
    return {**got, "test_unseen": unseen}


def check_held_out_pairs() -> None:
    """Every operation must occur in some trainable pair (as first and as second where its
    types allow any pair). Raises GeneratorError naming the first that does not."""
    trainable = [p for p in valid_pairs() if p not in HELD_OUT_PAIRS]
    firsts, seconds = {a for a, _ in trainable}, {b for _, b in trainable}
    for a, b in valid_pairs():
        for name, where in ((a, firsts), (b, seconds)):
            if name not in where:
                raise GeneratorError(f"held-out pairs leave operation {name!r} untrained "
                                     f"in pairs; change UNSEEN_PAIR_FRACTION")


def steps_in_train(train: list[Problem], problems: list[Problem]) -> float | None:
    """Share of `problems` whose every step (operation with its parameter) occurs in some
    `train` problem: what a model that composes trained steps line by line can solve."""
    seen = {step_key(s) for p in train for s in p.steps}
    ok = [all(step_key(s) in seen for s in p.steps) for p in problems]
    return sum(ok) / len(ok) if ok else None


def info(sizes: dict[str, int], seed: int, splits: dict[str, list[Problem]]) -> dict:
    """What `info.json` records."""
    def counts(v):
        by_len: dict[int, int] = {}
        for p in v:
            by_len[len(p.steps)] = by_len.get(len(p.steps), 0) + 1
        return {"steps": dict(sorted(by_len.items())),
                "compositions": len({p.composition for p in v})}
    return {"generator": "data_prep/code_problems.py", "seed": seed, "sizes": sizes,
            "counts": {s: counts(v) for s, v in splits.items()},
            "operations": {n: {"types": f"{o.src}->{o.dst}", "phrase": o.phrase,
                               "line": o.line, "params": list(o.params)}
                           for n, o in OPS.items()},
            "types": {"L": "list[int] xs", "I": "int n", "S": "str s", "W": "list[str] ws",
                      "D": "dict[str, int] d", "E": "dict[int, str] d"},
            "held_out_pairs": [list(p) for p in sorted(HELD_OUT_PAIRS)],
            "valid_pairs": len(valid_pairs()),
            "pairs_in_train": len({q for p in splits.get("train", [])
                                   for q in zip(p.composition, p.composition[1:])}),
            "unseen_steps_in_train": steps_in_train(splits.get("train", []),
                                                    splits.get("test_unseen", [])),
            "held_out_fraction_per_pool": HELD_OUT_FRACTION,
            "unseen_pair_fraction": UNSEEN_PAIR_FRACTION,
            "tests_per_problem": f"{MIN_TESTS} to {MAX_TESTS} asserts, chosen among {PROBES} "
                                 "probes to catch every near miss",
            "split_rule": "pool_of(key) = sha256 bucket; test and dev keys never in train; "
                          "test_unseen = compositions holding a held-out pair, never in train"}


def write_splits(out_dir: str, sizes: dict[str, int], seed: int = 0) -> dict[str, Path]:
    """Generate and write `<split>.jsonl` for every split and `info.json` (atomic writes).

    Returns:
        {split: path}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = generate(sizes, seed)
    paths = {}
    for split, problems in splits.items():
        paths[split] = out / f"{split}.jsonl"
        write_text(paths[split], "".join(json.dumps(p.record()) + "\n" for p in problems))
    write_json(out / "info.json", info(sizes, seed, splits), indent=1)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python data_prep/code_problems.py",
                                description="Write MBPP-form code problems as JSONL splits.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", required=True, help="output folder")
    for split, n in DEFAULT_SIZES.items():
        p.add_argument(f"--{split.replace('_', '-')}", type=int, default=n,
                       help=f"problems in {split}.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = {s: getattr(args, s) for s in DEFAULT_SIZES}
    try:
        paths = write_splits(args.output, sizes, args.seed)
    except (GeneratorError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(f"{s} {sizes[s]}" for s in sizes) + f": {args.output}/" +
          ", ".join(p.name for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
