"""`python data_prep/math_problems.py`: a deterministic generator of GSM8K-form word problems.

    python data_prep/math_problems.py --output DIR [--train 80000] [--test 200] [--dev 200]
        [--test-unseen 100] [--seed 0] [--templates NAME,...] [--max-value 999]

Owns: the math task's data (templates, number ranges, the answer format, the splits) written
as JSONL query/response records that `data_prep/shard.py` and `data_prep/train_tokenizer.py`
read (`--input DIR/train.jsonl`). Must not touch: tokenization, shards, evaluation (the
final-answer metric is `pipeline.inference.evaluation.final_answer`).

A problem is a multi-step word problem with integer arithmetic (+, -, *, /), 2 to 4 steps,
drawn from a template: the template fixes the chain of operations, the numbers are drawn from
fixed ranges (every intermediate result a whole number from 0 to MAX_VALUE, divisions exact),
and the surface (names, objects, units, phrasing variants) is drawn after the numbers. The
answer is written as GSM8K writes it: one sentence per step carrying a calculator annotation,
then the final answer on its own line, e.g.

    Mia buys 4 boxes with 6 pens in each box, so she has 4*6 = <<4*6=24>>24 pens.
    She gives away 5 pens, so she has 24-5 = <<24-5=19>>19 pens left.
    #### 19

Splits (files in `--output`):
- `train.jsonl`: problems of the TRAIN_TEMPLATES whose *problem key* falls in the training
  pool; `test.jsonl` and `dev.jsonl`: problems of the same templates whose keys fall in the
  held-out pools. The problem key is the template name and its numbers (not the names,
  objects or phrasing), and the pool is a pure function of the key (`pool_of`: the first 8
  bytes of its sha256), so no test or dev problem's arithmetic appears in training under
  another surface, whatever the seed or sizes. Each file holds a key at most once.
- `test_unseen.jsonl`: problems of the UNSEEN_TEMPLATES, never used for training (other
  sentence frames and orders of the same operations): what the model does beyond the
  templates it saw.
- `--templates` restricts train, test and dev to some TRAIN_TEMPLATES (default: all), and
  `--max-value` lowers the bound on every number (default MAX_VALUE): an easier distribution
  (the `make demo` job's). The problem keys and pools are the same whatever these options.
- `dev.jsonl` is for choosing model size and budget; `test.jsonl` and `test_unseen.jsonl` are
  for the reported figures only.
- `info.json`: sizes, seed, templates per split, number ranges, the answer format.
Records: {"query": question, "response": worked answer, "answer": final number (int),
"template": name, "key": problem key}. Output is byte-identical for the same options.
Exit codes: 0 done; 2 bad options (one line).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: import the repository's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pipeline.common.atomic_io import write_json, write_text

MAX_VALUE = 999        # every operand, intermediate and final result is in [0, MAX_VALUE]
HELD_OUT_FRACTION = 0.04   # share of problem keys in each held-out pool (test, dev)
DEFAULT_SIZES = {"train": 80000, "test": 200, "dev": 200, "test_unseen": 100}

ANNOTATION = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)")


class GeneratorError(ValueError):
    """Bad generator options (one line)."""


# ------------------------------------------------------------------------ surface vocabulary

NAMES = (("Mia", "she"), ("Liam", "he"), ("Ava", "she"), ("Noah", "he"), ("Zoe", "she"),
         ("Omar", "he"), ("Lena", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Ken", "he"),
         ("Nora", "she"), ("Ivan", "he"), ("Maya", "she"), ("Leo", "he"), ("Ana", "she"),
         ("Sam", "he"), ("Ella", "she"), ("Tom", "he"), ("Iris", "she"), ("Ben", "he"))
ITEMS = ("pens", "apples", "stickers", "marbles", "cookies", "cards", "shells", "stamps",
         "beads", "books", "eggs", "toys", "candies", "pencils", "buttons", "coins")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"),
              ("crate", "crates"), ("basket", "baskets"))
PLANTS = ("tomatoes", "roses", "carrots", "tulips", "onions", "peppers")
GOODS = (("notebook", "notebooks"), ("shirt", "shirts"), ("ticket", "tickets"),
         ("sandwich", "sandwiches"), ("lamp", "lamps"), ("mug", "mugs"))
VEHICLES = ("car", "bus", "train", "truck", "boat")
EVENTS = ("concert", "museum", "zoo", "play", "fair")
LIQUIDS = ("water", "juice", "milk", "oil")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _pick(rng: random.Random, seq):
    return seq[rng.randrange(len(seq))]


def _names(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return rng.sample(NAMES, n)


# ------------------------------------------------------------------------ problems


@dataclass(frozen=True)
class Step:
    """One step of a worked answer: `a op b = c`, written `lead a op b = <<a op b=c>>c tail.`

    `lead` / `tail`: the sentence around the calculation (tail may be empty)."""

    a: int
    op: str
    b: int
    c: int
    lead: str
    tail: str = ""

    def text(self) -> str:
        e = f"{self.a}{self.op}{self.b}"
        tail = f" {self.tail}" if self.tail else ""
        return f"{self.lead} {e} = <<{e}={self.c}>>{self.c}{tail}."


@dataclass(frozen=True)
class Problem:
    """A generated problem. `key`: template name + numbers (the identity the splits use)."""

    template: str
    numbers: tuple[int, ...]
    question: str
    steps: tuple[Step, ...]

    @property
    def key(self) -> str:
        return f"{self.template}:" + ",".join(map(str, self.numbers))

    @property
    def answer(self) -> int:
        return self.steps[-1].c

    def response(self) -> str:
        return "\n".join(s.text() for s in self.steps) + f"\n#### {self.answer}"

    def record(self) -> dict:
        return {"query": self.question, "response": self.response(), "answer": self.answer,
                "template": self.template, "key": self.key}


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0 or a % b:
        raise AssertionError(f"inexact division {a}/{b}")
    return a // b


def _step(a: int, op: str, b: int, lead: str, tail: str = "") -> Step:
    return Step(a, op, b, _apply(a, op, b), lead, tail)


# Each template draws its numbers (returning None when they break a constraint, so the caller
# draws again) and then the surface. Number ranges are the difficulty: see info.json.


def _t_packs(rng):
    """buy packs of items, give some away (2 steps: *, -)."""
    a, b = rng.randint(2, 12), rng.randint(2, 24)
    c = rng.randint(1, a * b - 1)
    (n, p), obj, (box, boxes) = _names(rng, 1)[0], _pick(rng, ITEMS), _pick(rng, CONTAINERS)
    q = (f"{n} buys {a} {boxes} of {obj}. Each {box} has {b} {obj}. {_cap(p)} gives {c} {obj} "
         f"to a friend. How many {obj} does {n} have left?")
    if rng.random() < 0.5:
        q = (f"{n} has {a} {boxes} with {b} {obj} in each {box}. After giving away {c} {obj}, "
             f"how many {obj} does {p} have?")
    s1 = _step(a, "*", b, f"{n} has", obj)
    s2 = _step(s1.c, "-", c, f"After giving {c} away, {p} has", f"{obj} left")
    return (a, b, c), q, (s1, s2)


def _t_wage(rng):
    """hourly wage x hours x days, minus spending (3 steps: *, *, -)."""
    a, b, c = rng.randint(5, 20), rng.randint(2, 8), rng.randint(2, 6)
    d = rng.randint(1, a * b * c - 1)
    (n, p) = _names(rng, 1)[0]
    job = _pick(rng, ("at a cafe", "in a garden", "at a shop", "as a tutor"))
    q = (f"{n} works {job} and earns ${a} per hour. {_cap(p)} works {b} hours a day for {c} "
         f"days and then spends ${d}. How much money does {p} have left?")
    s1 = _step(a, "*", b, f"{n} earns", "dollars a day")
    s2 = _step(s1.c, "*", c, f"In {c} days {p} earns", "dollars")
    s3 = _step(s2.c, "-", d, f"After spending ${d}, {p} has", "dollars left")
    return (a, b, c, d), q, (s1, s2, s3)


def _t_share(rng):
    """has some, gets more, shares equally (2 steps: +, /)."""
    c = rng.randint(2, 9)
    total = c * rng.randint(2, 40)
    a = rng.randint(1, total - 1)
    b = total - a
    (n, p), obj = _names(rng, 1)[0], _pick(rng, ITEMS)
    q = (f"{n} has {a} {obj}. {_cap(p)} gets {b} more {obj} and shares all of them equally "
         f"among {c} friends. How many {obj} does each friend get?")
    s1 = _step(a, "+", b, f"{n} has", obj)
    s2 = _step(s1.c, "/", c, "Each friend gets", obj)
    return (a, b, c), q, (s1, s2)


def _t_garden(rng):
    """rows x plants, some fail, the rest in bunches (3 steps: *, -, /)."""
    a, b, d = rng.randint(2, 12), rng.randint(3, 20), rng.randint(2, 8)
    rest = d * rng.randint(1, a * b // d) if a * b >= d else 0
    c = a * b - rest
    if rest <= 0 or c <= 0:
        return None
    (n, p), plant = _names(rng, 1)[0], _pick(rng, PLANTS)
    q = (f"{n} plants {a} rows of {plant} with {b} plants in each row. {c} of the plants do "
         f"not grow. {_cap(p)} sells the rest in bunches of {d}. How many bunches does {p} "
         f"sell?")
    s1 = _step(a, "*", b, f"{n} plants", plant)
    s2 = _step(s1.c, "-", c, f"Of these, {c} do not grow, so", "plants grow")
    s3 = _step(s2.c, "/", d, f"{_cap(p)} sells", "bunches")
    return (a, b, c, d), q, (s1, s2, s3)


def _t_shopping(rng):
    """two kinds of goods at unit prices (3 steps: *, *, +)."""
    a, b, c, d = rng.randint(2, 9), rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 30)
    (n, p) = _names(rng, 1)[0]
    (_, g1), (_, g2) = rng.sample(GOODS, 2)
    q = (f"{n} buys {a} {g1} for ${b} each and {c} {g2} for ${d} each. How much does {p} "
         f"spend in total?")
    s1 = _step(a, "*", b, f"The {g1} cost", "dollars")
    s2 = _step(c, "*", d, f"The {g2} cost", "dollars")
    s3 = _step(s1.c, "+", s2.c, f"In total {p} spends", "dollars")
    return (a, b, c, d), q, (s1, s2, s3)


def _t_pages(rng):
    """book pages, pages per day x days, pages left (2 steps: *, -)."""
    b, c = rng.randint(5, 40), rng.randint(2, 12)
    a = b * c + rng.randint(1, 400)
    if a > MAX_VALUE:
        return None
    (n, p) = _names(rng, 1)[0]
    q = (f"A book has {a} pages. {n} reads {b} pages a day for {c} days. How many pages does "
         f"{p} still have to read?")
    s1 = _step(b, "*", c, f"{n} reads", "pages")
    s2 = _step(a, "-", s1.c, f"{_cap(p)} still has to read", "pages")
    return (a, b, c), q, (s1, s2)


def _t_ages(rng):
    """ages: older by, times as old, sum (4 steps: +, *, +, +)."""
    a, b, m = rng.randint(2, 70), rng.randint(1, 60), rng.randint(2, 4)
    (n1, _), (n2, _), (n3, _) = _names(rng, 3)
    word = {2: "twice", 3: "three times", 4: "four times"}[m]
    q = (f"{n1} is {a} years old. {n2} is {b} years older than {n1}, and {n3} is {word} as old "
         f"as {n2}. What is the sum of their ages?")
    s1 = _step(a, "+", b, f"{n2} is", "years old")
    s2 = _step(s1.c, "*", m, f"{n3} is", "years old")
    s3 = _step(a, "+", s1.c, f"{n1} and {n2} together are", "years old")
    s4 = _step(s3.c, "+", s2.c, "The sum of their ages is", "years")
    return (a, b, m), q, (s1, s2, s3, s4)


def _t_school(rng):
    """students per class x classes x items each, in boxes (3 steps: *, *, /)."""
    a, b, c = rng.randint(10, 40), rng.randint(2, 8), rng.randint(1, 5)
    divisors = [d for d in range(2, 13) if (a * b * c) % d == 0]
    if a * b * c > MAX_VALUE or not divisors:
        return None
    d = _pick(rng, divisors)
    obj = _pick(rng, ("pencils", "notebooks", "erasers", "rulers", "folders"))
    q = (f"A school has {b} classes with {a} students in each class. Every student needs {c} "
         f"{obj}, and the {obj} come in boxes of {d}. How many boxes does the school need?")
    s1 = _step(a, "*", b, "There are", "students")
    s2 = _step(s1.c, "*", c, "They need", obj)
    s3 = _step(s2.c, "/", d, "The school needs", "boxes")
    return (a, b, c, d), q, (s1, s2, s3)


def _t_times(rng):
    """has some, another has k times as many, a third has fewer, total (4 steps)."""
    a, b = rng.randint(2, 40), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    (n1, _), (n2, _), (n3, _) = _names(rng, 3)
    obj = _pick(rng, ITEMS)
    q = (f"{n1} has {a} {obj}. {n2} has {b} times as many {obj} as {n1}, and {n3} has {c} fewer "
         f"{obj} than {n2}. How many {obj} do they have together?")
    s1 = _step(a, "*", b, f"{n2} has", obj)
    s2 = _step(s1.c, "-", c, f"{n3} has", obj)
    s3 = _step(a, "+", s1.c, f"{n1} and {n2} have", obj)
    s4 = _step(s3.c, "+", s2.c, "Together they have", obj)
    return (a, b, c), q, (s1, s2, s3, s4)


def _t_travel(rng):
    """speed x hours, plus a further stretch, there and back (3 steps: *, +, *)."""
    a, b, c = rng.randint(10, 90), rng.randint(2, 6), rng.randint(1, 60)
    veh = _pick(rng, VEHICLES)
    unit = _pick(rng, ("miles", "kilometers"))
    q = (f"A {veh} travels at {a} {unit} per hour for {b} hours and then goes {c} {unit} more. "
         f"It comes back the same way. How many {unit} does it travel in all?")
    s1 = _step(a, "*", b, f"In {b} hours the {veh} travels", unit)
    s2 = _step(s1.c, "+", c, "One way is", unit)
    s3 = _step(s2.c, "*", 2, "There and back it travels", unit)
    return (a, b, c), q, (s1, s2, s3)


def _t_savings(rng):
    """saves per week, buys something, then earns more (3 steps: *, -, +)."""
    a, b = rng.randint(3, 25), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    d = rng.randint(1, 80)
    (n, p), (item, _) = _names(rng, 1)[0], _pick(rng, GOODS)
    q = (f"{n} saves ${a} every week for {b} weeks. Then {p} buys a {item} for ${c} and gets "
         f"${d} as a gift. How much money does {p} have now?")
    s1 = _step(a, "*", b, f"{n} saves", "dollars")
    s2 = _step(s1.c, "-", c, f"After buying the {item}, {p} has", "dollars")
    s3 = _step(s2.c, "+", d, f"With the gift {p} has", "dollars")
    return (a, b, c, d), q, (s1, s2, s3)


def _t_bake(rng):
    """trays x items, eats some, shares the rest into bags, gives bags away (4 steps)."""
    a, b, d = rng.randint(2, 8), rng.randint(4, 24), rng.randint(2, 6)
    rest = d * rng.randint(2, a * b // d) if a * b // d >= 2 else 0
    c = a * b - rest
    if rest <= 0 or c <= 0:
        return None
    bags = rest // d
    e = rng.randint(1, bags - 1)
    (n, p) = _names(rng, 1)[0]
    food = _pick(rng, ("cookies", "muffins", "rolls", "cupcakes"))
    q = (f"{n} bakes {a} trays of {food} with {b} {food} on each tray. {_cap(p)} eats {c} of "
         f"them and puts the rest in bags of {d}. Then {p} gives away {e} bags. How many bags "
         f"does {p} keep?")
    s1 = _step(a, "*", b, f"{n} bakes", food)
    s2 = _step(s1.c, "-", c, f"After eating {c}, {p} has", food)
    s3 = _step(s2.c, "/", d, "That makes", "bags")
    s4 = _step(s3.c, "-", e, f"{_cap(p)} keeps", "bags")
    return (a, b, c, d, e), q, (s1, s2, s3, s4)


# Templates never used for training (the unseen-template test set): other sentence frames and
# other chains of the same operations.


def _u_tickets(rng):
    """adult and child tickets (3 steps: *, *, +), other words than `shopping`."""
    a, b = rng.randint(8, 40), rng.randint(2, 20)
    c, d = rng.randint(2, 9), rng.randint(2, 9)
    ev = _pick(rng, EVENTS)
    q = (f"Tickets to the {ev} cost ${a} for an adult and ${b} for a child. A group of {c} "
         f"adults and {d} children goes to the {ev}. How much do they pay?")
    s1 = _step(c, "*", a, "The adults pay", "dollars")
    s2 = _step(d, "*", b, "The children pay", "dollars")
    s3 = _step(s1.c, "+", s2.c, "Together they pay", "dollars")
    return (a, b, c, d), q, (s1, s2, s3)


def _u_tank(rng):
    """fill rate x minutes, a leak, what is still missing (3 steps: *, -, -)."""
    b, c = rng.randint(2, 20), rng.randint(2, 15)
    d = rng.randint(1, b * c - 1)
    a = (b * c - d) + rng.randint(1, 300)
    if a > MAX_VALUE:
        return None
    liq = _pick(rng, LIQUIDS)
    q = (f"A tank holds {a} liters of {liq}. It is filled at {b} liters per minute for {c} "
         f"minutes, and then {d} liters leak out. How many more liters are needed to fill the "
         f"tank?")
    s1 = _step(b, "*", c, "The tank gets", "liters")
    s2 = _step(s1.c, "-", d, "After the leak it has", "liters")
    s3 = _step(a, "-", s2.c, "It still needs", "liters")
    return (a, b, c, d), q, (s1, s2, s3)


def _u_groups(rng):
    """split into groups, add to each group, count some groups (3 steps: /, +, *)."""
    b = rng.randint(2, 9)
    a = b * rng.randint(2, 30)
    c, d = rng.randint(1, 20), rng.randint(2, b)
    (n, p), obj = _names(rng, 1)[0], _pick(rng, ITEMS)
    q = (f"{n} splits {a} {obj} into {b} equal groups and then adds {c} {obj} to each group. "
         f"How many {obj} are in {d} of the groups?")
    s1 = _step(a, "/", b, "Each group has", obj)
    s2 = _step(s1.c, "+", c, "After adding, each group has", obj)
    s3 = _step(s2.c, "*", d, f"{_cap(str(d))} groups have", obj)
    return (a, b, c, d), q, (s1, s2, s3)


TRAIN_TEMPLATES: dict[str, Callable] = {
    "packs": _t_packs, "wage": _t_wage, "share": _t_share, "garden": _t_garden,
    "shopping": _t_shopping, "pages": _t_pages, "ages": _t_ages, "school": _t_school,
    "times": _t_times, "travel": _t_travel, "savings": _t_savings, "bake": _t_bake}
UNSEEN_TEMPLATES: dict[str, Callable] = {
    "tickets": _u_tickets, "tank": _u_tank, "groups": _u_groups}


MAX_DRAWS = 100_000     # draws of one template before a `max_value` counts as unreachable


def make_problem(name: str, rng: random.Random, max_value: int = MAX_VALUE) -> Problem:
    """One problem of template `name` (TRAIN_TEMPLATES or UNSEEN_TEMPLATES) drawn with `rng`;
    numbers are redrawn until every value is within [0, max_value].

    Raises:
        GeneratorError: MAX_DRAWS draws in a row had a value above `max_value`."""
    fn = TRAIN_TEMPLATES.get(name) or UNSEEN_TEMPLATES[name]
    for _ in range(MAX_DRAWS):
        got = fn(rng)
        if got is None:
            continue
        numbers, question, steps = got
        values = [v for s in steps for v in (s.a, s.b, s.c)]
        if min(values) < 0 or max(values) > max_value:
            continue
        return Problem(name, tuple(numbers), question, tuple(steps))
    raise GeneratorError(f"--max-value {max_value}: template {name!r} has no problem with "
                         f"every number <= {max_value} (in {MAX_DRAWS} draws)")


def pool_of(key: str) -> str:
    """The pool of a problem key: "test" or "dev" (HELD_OUT_FRACTION of keys each) or
    "train", from the first 8 bytes of sha256(key) (independent of seed and sizes)."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64
    if u < HELD_OUT_FRACTION:
        return "test"
    if u < 2 * HELD_OUT_FRACTION:
        return "dev"
    return "train"


def generate(sizes: dict[str, int], seed: int = 0, templates=None,
             max_value: int = MAX_VALUE) -> dict[str, list[Problem]]:
    """The splits (module docstring), deterministic in (sizes, seed, templates, max_value).

    Args:
        sizes: problems per split, keys "train", "test", "dev", "test_unseen".
        seed: seed of the problem stream (`random.Random(f"{seed}:{stream}")`).
        templates: names of TRAIN_TEMPLATES for train, test and dev (None: all of them).
        max_value: every operand, intermediate and final result is at most this.

    Returns:
        {split: [Problem, ...]} with distinct keys within each split and the pools disjoint.
    Raises:
        GeneratorError: a negative size, an unknown or empty template list, a max_value
            below 1 or one a template cannot meet, or a size the templates cannot fill with
            distinct problems (the draw gives up after 50 times the size in a row without a
            new key).
    """
    for k, v in sizes.items():
        if v < 0:
            raise GeneratorError(f"--{k.replace('_', '-')} must be >= 0, got {v}")
    seen_names = check_templates(templates)
    if max_value < 1:
        raise GeneratorError(f"--max-value must be >= 1, got {max_value}")
    out: dict[str, list[Problem]] = {}
    want = {s: sizes.get(s, 0) for s in ("train", "test", "dev")}
    got = {s: [] for s in want}
    keys = {s: set() for s in want}
    rng = random.Random(f"{seed}:seen")
    misses = 0
    while any(len(got[s]) < want[s] for s in want):
        p = make_problem(seen_names[rng.randrange(len(seen_names))], rng, max_value)
        pool = pool_of(p.key)
        if len(got[pool]) < want[pool] and p.key not in keys[pool]:
            got[pool].append(p)
            keys[pool].add(p.key)
            misses = 0
        else:
            misses += 1
            if misses > 50 * max(1, max(want.values())):
                short = {s: f"{len(got[s])}/{want[s]}" for s in want if len(got[s]) < want[s]}
                raise GeneratorError(f"cannot draw enough distinct problems: {short}")
    out.update(got)
    unseen, ukeys = [], set()
    rng = random.Random(f"{seed}:unseen")
    u_names = sorted(UNSEEN_TEMPLATES)
    misses = 0
    while len(unseen) < sizes.get("test_unseen", 0):
        p = make_problem(u_names[rng.randrange(len(u_names))], rng, max_value)
        if p.key not in ukeys:
            unseen.append(p)
            ukeys.add(p.key)
            misses = 0
        else:
            misses += 1
            if misses > 50 * sizes["test_unseen"]:
                raise GeneratorError("cannot draw enough distinct unseen-template problems")
    out["test_unseen"] = unseen
    return out


def check_templates(templates) -> list[str]:
    """The sorted training template names `templates` (an iterable of names; None: all of
    TRAIN_TEMPLATES) selects. Raises GeneratorError naming an unknown one, or for none."""
    if templates is None:
        return sorted(TRAIN_TEMPLATES)
    names = sorted(set(templates))
    unknown = [n for n in names if n not in TRAIN_TEMPLATES]
    if unknown or not names:
        what = "unknown " + ", ".join(unknown) if unknown else "none given"
        raise GeneratorError(f"--templates: {what} (training templates: "
                             f"{', '.join(sorted(TRAIN_TEMPLATES))})")
    return names


def check_response(response: str) -> int:
    """Validate a worked answer: every `<<a op b=c>>c` annotation is right (c = a op b, the
    number after `>>` repeats c, divisions exact) and the last line is `#### N`.

    Returns:
        the final answer N.
    Raises:
        ValueError: naming the first wrong annotation or a missing final line.
    """
    lines = response.split("\n")
    m = re.fullmatch(r"#### (\d+)", lines[-1])
    if not m:
        raise ValueError(f"last line {lines[-1]!r} is not '#### N'")
    for line in lines[:-1]:
        found = ANNOTATION.findall(line)
        if len(found) != 1:
            raise ValueError(f"{line!r}: expected one <<a op b=c>>c annotation")
        a, op, b, c, shown = found[0]
        if op == "/" and int(a) % int(b):
            raise ValueError(f"{line!r}: inexact division")
        if _apply(int(a), op, int(b)) != int(c) or c != shown:
            raise ValueError(f"{line!r}: wrong arithmetic")
    return int(m.group(1))


def info(sizes: dict[str, int], seed: int, splits: dict[str, list[Problem]], templates=None,
         max_value: int = MAX_VALUE) -> dict:
    """What `info.json` records: options, templates per split and their counts, difficulty,
    format."""
    counts = {s: dict(sorted(Counter(p.template for p in v).items())) for s, v in splits.items()}
    return {"generator": "data_prep/math_problems.py", "seed": seed, "sizes": sizes,
            "template_counts": counts,
            "train_templates": check_templates(templates),
            "unseen_templates": sorted(UNSEEN_TEMPLATES),
            "steps_per_problem": "2 to 4 (fixed by the template)",
            "operations": ["+", "-", "*", "/"],
            "max_value": max_value, "held_out_fraction_per_pool": HELD_OUT_FRACTION,
            "templates": {n: (f.__doc__ or "").strip() for n, f in
                          {**TRAIN_TEMPLATES, **UNSEEN_TEMPLATES}.items()},
            "answer_format": "one sentence per step with a <<a op b=c>>c annotation; last "
                             "line '#### N'",
            "split_rule": "pool_of(template:numbers) = sha256 bucket; test and dev keys never "
                          "in train; test_unseen from templates never in train"}


def write_splits(out_dir: str, sizes: dict[str, int], seed: int = 0, templates=None,
                 max_value: int = MAX_VALUE) -> dict[str, Path]:
    """Generate (`generate`'s arguments) and write `<split>.jsonl` for every split and
    `info.json` (atomic writes).

    Returns:
        {split: path}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    splits = generate(sizes, seed, templates, max_value)
    for split, problems in splits.items():
        paths[split] = out / f"{split}.jsonl"
        write_text(paths[split], "".join(json.dumps(p.record()) + "\n" for p in problems))
    write_json(out / "info.json", info(sizes, seed, splits, templates, max_value), indent=1)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python data_prep/math_problems.py",
                                description="Write GSM8K-form word problems as JSONL splits.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", required=True, help="output folder")
    for split, n in DEFAULT_SIZES.items():
        p.add_argument(f"--{split.replace('_', '-')}", type=int, default=n,
                       help=f"problems in {split}.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--templates", default=None,
                   help="comma list of training templates for train/test/dev (default: all: "
                        + ",".join(sorted(TRAIN_TEMPLATES)) + ")")
    p.add_argument("--max-value", type=int, default=MAX_VALUE,
                   help="largest number of any problem (operands and results)")
    args = p.parse_args(argv)
    sizes = {s: getattr(args, s) for s in DEFAULT_SIZES}
    templates = (None if args.templates is None
                 else [t.strip() for t in args.templates.split(",") if t.strip()])
    try:
        paths = write_splits(args.output, sizes, args.seed, templates, args.max_value)
    except (GeneratorError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(f"{s} {sizes[s]}" for s in sizes) + f": {args.output}/" +
          ", ".join(p.name for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
