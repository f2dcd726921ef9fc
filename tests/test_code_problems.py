"""data_prep/code_problems.py: the MBPP-form problem generator (determinism, splits disjoint by
key, the held-out compositions, the tests' values and their power to tell compositions apart,
the CLI, and that shard.py reads its JSONL).

Every assert's expected value is checked against REFERENCE below, an implementation of each
operation written here from its phrase, apart from the generator's body lines; the canonical
bodies are also run through the sandbox (`pipeline.inference.execution`)."""
import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import code_problems as cp
from pipeline.inference.execution import run_batch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"train": 3000, "test": 150, "dev": 60, "test_unseen": 120}


def _filter(pred):
    return lambda v, p: list(filter(lambda x: pred(x, p), v))


def _each(fn):
    return lambda v, p: list(map(lambda x: fn(x, p), v))


def _loop_max(v, p):
    best = None
    for x in v:
        best = x if best is None or x > best else best
    return 0 if best is None else best


def _first_seen(v, p):
    out = []
    for x in v:
        if x not in out:
            out.append(x)
    return out


def _digits(n, p):
    n = -n if n < 0 else n
    out = []
    while True:
        out.insert(0, n % 10)
        n //= 10
        if n == 0:
            return out


REFERENCE = {
    "keep_even": _filter(lambda x, p: x % 2 == 0), "keep_odd": _filter(lambda x, p: x % 2),
    "keep_gt": _filter(lambda x, p: x > p), "keep_lt": _filter(lambda x, p: x < p),
    "add": _each(lambda x, p: x + p), "sub": _each(lambda x, p: x - p),
    "mul": _each(lambda x, p: x * p), "square": _each(lambda x, p: x ** 2),
    "mod": _each(lambda x, p: x - p * (x // p)),
    "reverse": lambda v, p: list(reversed(v)), "sort": lambda v, p: sorted(v),
    "sort_desc": lambda v, p: sorted(v)[::-1], "take": lambda v, p: v[0:p],
    "drop": lambda v, p: v[p:], "dedup": _first_seen,
    "sum": lambda v, p: sum(v), "count": lambda v, p: len(v), "max": _loop_max,
    "min": lambda v, p: -_loop_max([-x for x in v], p),
    "count_eq": lambda v, p: len([x for x in v if x == p]),
    "n_add": lambda n, p: n + p, "n_sub": lambda n, p: n - p, "n_mul": lambda n, p: n * p,
    "n_div": lambda n, p: (n - n % p) // p, "n_mod": lambda n, p: n % p,
    "n_square": lambda n, p: n ** 2, "n_abs": lambda n, p: max(n, -n), "digits": _digits,
    "to_str": lambda n, p: "%d" % n,
    "upper": lambda s, p: s.upper(), "lower": lambda s, p: s.lower(),
    "s_reverse": lambda s, p: "".join(reversed(s)), "strip": lambda s, p: s.lstrip(p).rstrip(p),
    "replace": lambda s, p: "".join(p[1] if c == p[0] else c for c in s),
    "remove": lambda s, p: "".join(c for c in s if c != p), "prefix": lambda s, p: p + s,
    "double": lambda s, p: s * 2, "s_len": lambda s, p: len(s),
    "s_count": lambda s, p: sum(c == p for c in s), "split": lambda s, p: s.split(),
    "split_on": lambda s, p: s.split(p),
    "w_reverse": lambda w, p: w[::-1], "w_sort": lambda w, p: sorted(w),
    "w_long": lambda w, p: [x for x in w if len(x) > p],
    "w_upper": lambda w, p: [x.upper() for x in w], "w_first": lambda w, p: [x[0:1] for x in w],
    "join": lambda w, p: p.join(w), "w_count": lambda w, p: len(w),
    "w_lens": lambda w, p: [len(x) for x in w],
    "d_keep_gt": lambda d, p: {k: d[k] for k in d if d[k] > p},
    "d_add": lambda d, p: {k: d[k] + p for k in d}, "d_sum": lambda d, p: sum(d.values()),
    "d_len": lambda d, p: len(d), "d_distinct": lambda d, p: len(set(d.values())),
    "d_values": lambda d, p: [d[k] for k in sorted(d.keys())],
    "d_keys": lambda d, p: sorted(d.keys()),
    "d_keys_by_value": lambda d, p: [k for _, _, k in sorted((d[k], i, k)
                                                               for i, k in enumerate(d))],
    "invert": lambda d, p: dict((v, k) for k, v in d.items()),
    "e_values": lambda d, p: [d[k] for k in sorted(d.keys())],
    "e_max_key": lambda d, p: max(list(d) or [0]),
}


def _reference(steps, x):
    for name, p in steps:
        x = REFERENCE[name](x, p)
    return x


def _parse_test(t: str):
    """(input, expected) of `assert f(<literal>) == <literal>`."""
    node = ast.parse(t).body[0]
    call, expected = node.test.left, node.test.comparators[0]
    assert call.func.id == "f" and len(call.args) == 1
    return ast.literal_eval(call.args[0]), ast.literal_eval(expected)


@pytest.fixture(scope="module")
def splits():
    return cp.generate(SIZES, seed=3)


def test_every_operation_has_a_reference():
    assert set(REFERENCE) == set(cp.OPS)


def test_generation_is_deterministic_and_seeded(tmp_path):
    small = {"train": 300, "test": 20, "dev": 10, "test_unseen": 20}
    a, b = cp.generate(small, seed=3), cp.generate(small, seed=3)
    assert {s: [p.record() for p in v] for s, v in a.items()} == \
        {s: [p.record() for p in v] for s, v in b.items()}
    c = cp.generate(small, seed=4)
    assert [p.key for p in a["train"][:50]] != [p.key for p in c["train"][:50]]
    cp.write_splits(tmp_path / "x", small, seed=3)
    cp.write_splits(tmp_path / "y", small, seed=3)
    for name in ("train.jsonl", "test.jsonl", "dev.jsonl", "test_unseen.jsonl", "info.json"):
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes()
    # a problem's tests depend on its key alone, not on the seed
    assert cp.make_problem(a["train"][0].steps) == a["train"][0]


def test_sizes_and_splits_are_disjoint_by_problem_key(splits):
    assert {s: len(v) for s, v in splits.items()} == SIZES
    keys = {s: [p.key for p in v] for s, v in splits.items()}
    for s, k in keys.items():
        assert len(set(k)) == len(k), s
    for a, b in (("train", "test"), ("train", "dev"), ("test", "dev"), ("train", "test_unseen"),
                 ("test", "test_unseen"), ("dev", "test_unseen")):
        assert not set(keys[a]) & set(keys[b]), (a, b)
    assert all(cp.pool_of(k) == "test" for k in keys["test"])
    assert all(cp.pool_of(k) == "dev" for k in keys["dev"])
    # the pool is a function of the key alone: no held-out key of one seed trains another
    other = cp.generate({"train": 3000, "test": 0, "dev": 0, "test_unseen": 0}, seed=9)
    assert not {p.key for p in other["train"]} & set(keys["test"] + keys["dev"])


def test_the_test_split_has_500_problems_by_default():
    assert cp.DEFAULT_SIZES["test"] >= 500
    got = cp.generate({"train": 0, "test": cp.DEFAULT_SIZES["test"], "dev": 0, "test_unseen": 0})
    assert len({p.key for p in got["test"]}) == cp.DEFAULT_SIZES["test"]


def test_unseen_compositions_are_never_trained_but_their_operations_are(splits):
    held = cp.HELD_OUT_PAIRS
    assert 0 < len(held) < 0.15 * len(cp.valid_pairs())

    def pairs(p):
        return set(zip(p.composition, p.composition[1:]))
    train_comps = {p.composition for p in splits["train"]}
    train_pairs = set().union(*(pairs(p) for p in splits["train"]))
    train_ops = {n for c in train_comps for n in c}
    for split in ("train", "test", "dev"):
        assert not any(pairs(p) & held for p in splits[split]), split
    assert train_ops == set(cp.OPS)                   # every operation is trained
    for p in splits["test_unseen"]:
        assert pairs(p) & held, p.key                  # a held-out pair, in that order
        assert p.composition not in train_comps
        # each operation of a held-out pair is trained in another pair, in the same place
        for a, b in pairs(p) & held:
            assert any(x == a for x, _ in train_pairs) and any(y == b for _, y in train_pairs)
    # each step (operation with its parameter) of nearly every unseen problem is trained
    # (all of them at the task's 20000 training problems)
    assert cp.steps_in_train(splits["train"], splits["test_unseen"]) >= 0.9
    # most trainable pairs occur in train (3000 problems here; 20000 in the task)
    trainable = set(cp.valid_pairs()) - held
    assert len(train_pairs) >= 0.5 * len(trainable)
    assert len({p.composition for p in splits["test_unseen"]}) >= 0.5 * SIZES["test_unseen"]


def test_expected_values_match_an_independent_reference(splits):
    n = 0
    for split, problems in splits.items():
        for p in problems:
            assert cp.MIN_TESTS <= len(p.tests) <= cp.MAX_TESTS
            for t in p.tests:
                x, want = _parse_test(t)
                assert _reference(p.steps, x) == want, (p.key, t)
                n += 1
    assert n >= 3 * sum(SIZES.values())


def test_record_form(splits):
    p = next(p for p in splits["train"] if p.composition == ("keep_even", "mul", "sum")) \
        if any(p.composition == ("keep_even", "mul", "sum") for p in splits["train"]) \
        else cp.make_problem((("keep_even", None), ("mul", 2), ("sum", None)))
    r = p.record()
    k = dict(p.steps)["mul"]
    assert r["query"] == ("Write a function `f(xs)` that takes a list of integers xs, keeps the "
                          f"even numbers, then multiplies each number by {k}, then takes the "
                          "sum, and returns the result.\ndef f(xs):")
    assert r["response"] == ("    xs = [x for x in xs if x % 2 == 0]\n"
                             f"    xs = [x * {k} for x in xs]\n    n = sum(xs)\n    return n")
    assert r["signature"] == "def f(xs):" and r["key"] == f"keep_even|mul:{k}|sum"


def test_canonical_bodies_pass_in_the_sandbox_and_other_compositions_fail(splits):
    rng = random.Random(0)
    sample = rng.sample(splits["test"], 30) + rng.sample(splits["test_unseen"], 20)
    programs = [(p.record()["signature"] + "\n" + p.record()["response"], list(p.tests))
                for p in sample]
    # a planted wrong answer per problem: the body of another composition with the same
    # signature (and, below, every problem's near misses in-process)
    by_sig = {}
    for p in splits["train"]:
        by_sig.setdefault(p.record()["signature"], []).append(p)
    wrong = []
    for p in sample:
        other = next(q for q in rng.sample(by_sig[p.record()["signature"]], 20)
                     if q.composition != p.composition)
        wrong.append((p.record()["signature"] + "\n" + other.record()["response"], list(p.tests)))
    res = run_batch(programs + wrong, timeout_s=10.0, workers=2)
    assert all(r.passed for r in res[:len(sample)]), [r for r in res if not r.passed][:3]
    assert not any(r.passed for r in res[len(sample):])


def test_tests_catch_every_near_miss_that_differs(splits):
    """A near miss (one parameter, one operation, one order changed) either behaves as the
    canonical body on every test or is caught; and one that differs on any of many fresh
    inputs is caught by the tests in at least 95% of the cases."""
    rng = random.Random(1)
    caught = differs = 0
    for p in rng.sample(splits["test"] + splits["test_unseen"], 120):
        inputs = [_parse_test(t)[0] for t in p.tests]
        for other in cp._near_misses(p.steps, random.Random(p.key)):
            t = cp.OPS[p.steps[0][0]].src
            fresh = [cp._draw_input(t, rng) for _ in range(40)]

            def out(steps, x):
                try:
                    return repr(_reference(steps, x))
                except Exception:  # noqa: BLE001
                    return "error"
            if any(out(other, x) != out(p.steps, x) for x in fresh):
                differs += 1
                caught += any(out(other, x) != out(p.steps, x) for x in inputs)
    assert differs > 100 and caught >= 0.95 * differs


def test_cli_writes_jsonl_that_shard_py_reads(tmp_path):
    out = tmp_path / "mbpp"
    r = subprocess.run([sys.executable, "data_prep/code_problems.py", "--output", str(out),
                        "--train", "400", "--test", "20", "--dev", "20", "--test-unseen", "10",
                        "--seed", "1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads((out / "info.json").read_text())
    assert info["sizes"] == {"train": 400, "test": 20, "dev": 20, "test_unseen": 10}
    assert sorted(map(tuple, info["held_out_pairs"])) == sorted(cp.HELD_OUT_PAIRS)
    assert len((out / "train.jsonl").read_text().splitlines()) == 400
    tok = tmp_path / "spm.model"
    r = subprocess.run([sys.executable, "data_prep/train_tokenizer.py", "--input",
                        str(out / "train.jsonl"), "--output", str(tok), "--vocab-size", "500"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "data_prep/shard.py", "--input", str(out / "train.jsonl"),
                        "--tokenizer", str(tok), "--output", str(tmp_path / "shards"),
                        "--max-length", "256", "--val-fraction", "0.1", "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    n = sum(e["samples"] for s in ("train", "val") for e in manifest["splits"][s])
    assert n == 400 and not manifest["skipped"].get("over_length")
    # the body round-trips through the tokenizer (indentation and all)
    from pipeline.tokenizer import load_tokenizer
    t = load_tokenizer(str(tok))
    for line in (out / "test.jsonl").read_text().splitlines():
        body = json.loads(line)["response"]
        assert t.sp.DecodeIds(t.encode(body)) == body
    bad = subprocess.run([sys.executable, "data_prep/code_problems.py", "--output",
                          str(tmp_path / "b"), "--train", "-1"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--train" in bad.stderr
