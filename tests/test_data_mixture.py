"""Data mixtures (`pipeline.data.mixture` + the loader's blend): the token-share bound over every
prefix, repeats only after exhaustion, bit-exact and elastic resume, worker counts, phases that
never re-read a sample, validation over every source, and one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data import DataError, build_loader, mixture
from pipeline.data.mixture import Source
from shard_fixtures import DEFAULT_TOKENIZER, random_samples, write_shards
from test_data_loader import TENSORS, _same

ROW = 64
SIZES = {"web": 40, "code": 23, "math": 6}   # math: small, repeats many times


def _take(loader, n):
    """The first n batches: their tensors (source included) and keys."""
    out = []
    for b in loader:
        out.append({k: b[k] for k in (*TENSORS, "source", "keys")})
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def dirs():
    out = {}
    for k, (name, n) in enumerate(SIZES.items()):
        u = f"memory://mix-{name}"
        rng = np.random.default_rng(100 + k)
        write_shards(u, {"train": random_samples(rng, n, max_length=40 + 8 * k, min_length=4),
                         "val": random_samples(rng, 3 + k, max_length=30)},
                     samples_per_shard=7, key_prefix=f"{name}/")
        out[name] = u
    return out


def _sources(dirs, weights=(0.6, 0.3, 0.1), names=tuple(SIZES)):
    return [Source(n, dirs[n], w) for n, w in zip(names, weights)]


def _loader(dirs, dp_rank=0, dp_size=1, workers=0, B=2, packing="best_fit", phase=0, **kw):
    src = kw.pop("sources", None) or _sources(dirs)
    return build_loader(src, "train", B, ROW, dp_rank=dp_rank, dp_size=dp_size, seed=5,
                        num_workers=workers, shuffle_buffer=10, pack=packing != "none",
                        packing=packing if packing != "none" else "best_fit", phase=phase, **kw)


def test_wf2q_stays_within_the_longest_sample_of_every_share():
    """Over every prefix, |tokens of s - w_s * tokens| <= the longest sample (WF2Q's bound),
    for random, bimodal and all-maximal lengths and weights from even to extreme; the
    'most under-served first' rule breaks it on the same inputs (so the test can fail)."""
    rng = np.random.default_rng(0)
    worst_wf2q, worst_greedy = 0.0, 0.0
    for S in (2, 3, 5, 8, 50):
        for trial in range(6):
            w = np.maximum(rng.dirichlet(np.full(S, 0.3)), 1e-3)
            w /= w.sum()
            for kind in ("max", "uniform", "bimodal"):
                lens = {"max": lambda: 100, "uniform": lambda: int(rng.integers(1, 101)),
                        "bimodal": lambda: 100 if rng.random() < 0.3 else 5}[kind]
                table = [[lens() for _ in range(400)] for _ in range(S)]
                items, _ = mixture.draw(mixture.BlendState.zeros(S), 400, w,
                                        lambda s, p: table[s][p % 400], lambda s, L: L)
                tok = np.zeros(S)
                for s, _, L in items:
                    tok[s] += L
                    worst_wf2q = max(worst_wf2q, float(np.abs(tok - w * tok.sum()).max()))
                # the rule Megatron's blend uses, on the same lengths
                tok, pos = np.zeros(S), np.zeros(S, int)
                for _ in range(400):
                    s = int(np.argmax(w * tok.sum() - tok))
                    tok[s] += table[s][pos[s] % 400]
                    pos[s] += 1
                    worst_greedy = max(worst_greedy, float(np.abs(tok - w * tok.sum()).max()))
    assert worst_wf2q <= 100
    assert worst_greedy > 100


def test_draw_makes_the_choices_of_the_plain_rule_at_every_draw():
    """`mixture.draw` (two heaps) against a loop of `mixture.pick` over all sources, from a
    mid-run state, on random lengths and weights."""
    rng = np.random.default_rng(3)
    for S in (1, 2, 3, 7, 50):
        w = np.maximum(rng.dirichlet(np.full(S, 0.5)), 1e-3)
        w /= w.sum()
        table = rng.integers(1, 200, size=(S, 600))
        start = mixture.BlendState(rng.integers(0, 50, S), rng.integers(0, 3000, S))
        items, end = mixture.draw(start, 500, w, lambda s, p: (s, p), lambda s, it: int(table[it]))
        tok, pos = start.tok.copy(), start.pos.copy()
        for s, it, L in items:
            want = mixture.pick(tok, w, table[np.arange(S), pos])
            assert (s, it, L) == (want, (want, int(pos[want])), int(table[want, pos[want]]))
            tok[s] += L
            pos[s] += 1
        assert np.array_equal(tok, end.tok) and np.array_equal(pos, end.pos)


def test_blend_is_deterministic_and_a_row_prefix_tracks_the_weights(dirs):
    """next_fit keeps the blend's order: after every row, each source's fed tokens are within
    one row of weight x tokens fed; best_fit reorders rows only inside a window."""
    for packing in ("next_fit", "best_fit"):
        a = _take(_loader(dirs, packing=packing), 40)
        _same(a, _take(_loader(dirs, packing=packing), 40))
        w = np.array([0.6, 0.3, 0.1])
        tok, worst = np.zeros(3), 0.0
        for b in a:
            for r in range(b["input_ids"].shape[0]):
                real = b["segment_ids"][r] > 0
                tok += np.bincount(b["source"][r][real].numpy(), minlength=3)
                worst = max(worst, float(np.abs(tok - w * tok.sum()).max()))
        if packing == "next_fit":
            assert worst <= ROW, worst
        shares = tok / tok.sum()
        assert np.abs(shares - w).max() < 0.03, shares


def _source_keys(batches, names=tuple(SIZES)):
    """{source name: keys in feeding order}."""
    out = {n: [] for n in names}
    for b in batches:
        for k in b["keys"]:
            out[k.split("/")[0]].append(k)
    return out


def test_a_small_source_repeats_only_when_exhausted_each_time_in_a_new_order(dirs):
    keys = _source_keys(_take(_loader(dirs, packing="next_fit",
                                      sources=_sources(dirs, (0.2, 0.2, 0.6))), 60))["math"]
    n = SIZES["math"]
    assert len(keys) >= 4 * n
    passes = [keys[i:i + n] for i in range(0, len(keys) - n + 1, n)]
    for p in passes:
        assert sorted(p) == sorted(passes[0]) and len(set(p)) == n   # each pass: every sample once
    assert len({tuple(p) for p in passes}) > 1                      # new orders


@pytest.mark.parametrize("packing", ["none", "best_fit"])
def test_resume_is_bit_exact_at_every_cut_and_with_any_worker_count(dirs, packing):
    full = _take(_loader(dirs, packing=packing, dp_rank=1, dp_size=2), 30)
    for cut in (1, 4, 9, 17, 25):
        first = _loader(dirs, packing=packing, dp_rank=1, dp_size=2, workers=2)
        _take(first, cut)
        resumed = _loader(dirs, packing=packing, dp_rank=1, dp_size=2, workers=cut % 3)
        resumed.load_state_dict(first.state_dict())
        _same(_take(resumed, 5), full[cut:cut + 5])


def test_resume_on_another_data_parallel_size_continues_the_global_row_list(dirs):
    def rounds(loaders, n):
        per = [_take(ld, n) for ld in loaders]
        return [k for rnd in zip(*per) for b in rnd for k in b["keys"]]

    whole = rounds([_loader(dirs, dp_rank=d, dp_size=2, B=2) for d in range(2)], 12)
    old = [_loader(dirs, dp_rank=d, dp_size=2, B=2) for d in range(2)]
    head = rounds(old, 5)
    new = _loader(dirs, dp_rank=0, dp_size=1, B=4)
    new.load_state_dict(old[1].state_dict(), allow_reshard=True)
    assert head + rounds([new], 7) == whole


def test_a_new_phase_keeps_every_source_position_and_reads_no_sample_twice(dirs):
    first = _loader(dirs, packing="next_fit")   # feeding order = blend order
    seen = _source_keys(_take(first, 7))
    state = first.state_dict()
    # the same phase with other weights: refused, naming data.phase
    other = _sources(dirs, (0.2, 0.2, 0.6))
    with pytest.raises(DataError, match=r"weight of 'web' 0\.6 -> 0\.2.*data\.phase above 0"):
        _loader(dirs, sources=other, packing="next_fit").load_state_dict(state)
    # phase 1: other weights, 'code' dropped, a new source
    rng = np.random.default_rng(9)
    write_shards("memory://mix-new", {"train": random_samples(rng, 12, max_length=30)},
                 samples_per_shard=5, key_prefix="new/")
    src = [Source("web", dirs["web"], 0.5), Source("math", dirs["math"], 0.1),
           Source("new", "memory://mix-new", 0.4)]
    second = _loader(dirs, sources=src, phase=1, packing="next_fit")
    change = second.load_state_dict(state)
    assert change["phase"] == 1 and change["from_phase"] == 0
    assert change["positions"]["new"] == 0 and change["positions"]["web"] >= len(seen["web"])
    later = _source_keys(_take(second, 12), names=("web", "math", "new", "code"))
    assert not later["code"]
    web_before = SIZES["web"] - change["positions"]["web"]   # web samples left in its pass
    assert not set(seen["web"]) & set(later["web"][:web_before])
    assert second.state_dict()["mix"]["phase"] == 1
    # a lower phase is refused
    with pytest.raises(DataError, match="phase can only go up"):
        _loader(dirs, phase=0, packing="next_fit").load_state_dict(second.state_dict())


def test_validation_reads_every_source_split_once(dirs):
    ld = build_loader(_sources(dirs), "val", 2, ROW, seed=5, num_workers=0, shuffle=False,
                      infinite=False, pack=True)
    keys = [k for b in ld for k in b["keys"]]
    assert sorted(keys) == sorted(f"{n}/val{i:07d}" for k, n in enumerate(SIZES) for i in range(3 + k))
    assert ld.source_names == tuple(SIZES)


def test_bad_mixtures_are_refused_in_one_line(dirs):
    tok = dict(DEFAULT_TOKENIZER, hash="another")
    write_shards("memory://mix-othertok", {"train": random_samples(np.random.default_rng(1), 5)},
                 tokenizer=tok)
    with pytest.raises(DataError, match=r"'web' \(memory://mix-web\) and 'x' \(memory://mix-othertok\)"
                                        r".*tokenizer\.hash"):
        _loader(dirs, sources=[Source("web", dirs["web"], 1), Source("x", "memory://mix-othertok", 1)])
    with pytest.raises(DataError, match="name 'web' is used twice"):
        _loader(dirs, sources=[Source("web", dirs["web"], 1), Source("web", dirs["code"], 1)])
    with pytest.raises(DataError, match="'code' has weight 0"):
        _loader(dirs, sources=[Source("web", dirs["web"], 1), Source("code", dirs["code"], 0)])
    one = build_loader(dirs["web"], "train", 2, ROW, seed=5, num_workers=0, pack=True,
                       shuffle_buffer=10)
    _take(one, 2)
    with pytest.raises(DataError, match="trained on one folder.*data.phase above 0"):
        _loader(dirs).load_state_dict(one.state_dict())
    assert _loader(dirs, phase=1).load_state_dict(one.state_dict())["phase"] == 1


@pytest.mark.parametrize("verify", ["error", "warn"])
def test_a_damaged_shard_of_one_source_is_named(tmp_path, verify, capsys):
    """Verification holds per source: a sample damaged in place in the second source's shard
    stops the blend with one line naming that shard ("error"), or warns and trains on."""
    rng = np.random.default_rng(4)
    for name in ("a", "b"):
        write_shards(str(tmp_path / name), {"train": random_samples(rng, 12, max_length=30)},
                     samples_per_shard=6, key_prefix=f"{name}/")
    shard = tmp_path / "b" / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    at = data.index(b"\x93NUMPY") + 140    # a token of the first array (128-byte header)
    data[at:at + 4] = (5 if data[at:at + 4] != b"\x05\x00\x00\x00" else 6).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    src = [Source("a", str(tmp_path / "a"), 1), Source("b", str(tmp_path / "b"), 1)]
    loader = build_loader(src, "train", 2, ROW, seed=5, num_workers=0, pack=True,
                          shuffle_buffer=10, verify_shards=verify)
    if verify == "error":
        with pytest.raises(DataError, match=r"b/train-000001\.tar") as err:
            _take(loader, 12)
        assert "\n" not in str(err.value)
    else:
        _take(loader, 12)
        assert "b/train-000001.tar" in capsys.readouterr().err
