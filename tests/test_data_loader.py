"""The shard loader: exact resumption in fresh processes (2 DP ranks x 2 workers), epoch
coverage, packing, and the clear errors (DP size change, tokenizer, corrupt shards)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pipeline.data import DataError, build_loader
from pipeline.objective import ObjectiveConfig
from shard_fixtures import DEFAULT_TOKENIZER, random_samples, write_shards

TENSORS = ("input_ids", "position_ids", "labels", "segment_ids", "loss_weight", "is_masked")


def _take(loader, n):
    out = []
    for b in loader:
        out.append({k: b[k] for k in (*TENSORS, "keys")})
        if len(out) == n:
            break
    return out


def _kw(pack):
    return dict(micro_batch_size=2, max_length=48, dp_size=2, seed=3, num_workers=2, pack=pack,
                shuffle_buffer=4, vocab_size=64)


def _first_run(rank, world_size, data_dir, state_dir, n_first, n_total):
    out = {}
    for pack in (False, True):
        full = _take(build_loader(data_dir, "train", dp_rank=rank, **_kw(pack)), n_total)
        loader = build_loader(data_dir, "train", dp_rank=rank, **_kw(pack))
        head = _take(loader, n_first)
        with open(os.path.join(state_dir, f"state-{pack}-{rank}.json"), "w") as f:
            json.dump(loader.state_dict(), f)
        out[pack] = (full, head, loader.epoch)
    return out


def _resumed_run(rank, world_size, data_dir, state_dir, n_rest):
    out = {}
    for pack in (False, True):
        loader = build_loader(data_dir, "train", dp_rank=rank, **_kw(pack))
        with open(os.path.join(state_dir, f"state-{pack}-{rank}.json")) as f:
            loader.load_state_dict(json.load(f))
        out[pack] = (_take(loader, n_rest), loader.epoch)
    return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        for k in TENSORS:
            assert torch.equal(x[k], y[k]), k


def _in_fresh_processes(fn, world_size, args):
    """Run fn(rank, world_size, *args) for every rank, each in a newly spawned process (no
    process group is needed: the loader only takes dp_rank/dp_size)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(world_size, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, r, world_size, *args) for r in range(world_size)]
        return [f.result(timeout=600) for f in futures]


def test_resume_in_fresh_processes_equals_uninterrupted_run(tmp_path):
    data_dir, state_dir = str(tmp_path / "shards"), str(tmp_path)
    # 3 shards for 2 ranks x 2 workers = 4 streams: streams cut shards at sample level.
    write_shards(data_dir, {"train": random_samples(np.random.default_rng(0), 27)}, samples_per_shard=10)
    n_first, n_rest = 5, 9
    first = _in_fresh_processes(_first_run, 2, (data_dir, state_dir, n_first, n_first + n_rest))
    second = _in_fresh_processes(_resumed_run, 2, (data_dir, state_dir, n_rest))
    for rank in range(2):
        for pack in (False, True):
            full, head, _ = first[rank][pack]
            rest, epoch_after = second[rank][pack]
            _same(head, full[:n_first])
            _same(rest, full[n_first:])
            # ~7 samples per stream and 2 (or more when packed) per batch: epochs were crossed.
            assert epoch_after >= 1
    # The two DP ranks read disjoint samples within an epoch.
    k0 = {k for b in first[0][False][0][:3] for k in b["keys"]}
    k1 = {k for b in first[1][False][0][:3] for k in b["keys"]}
    assert not k0 & k1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_pass_covers_every_sample_once(num_workers):
    url = f"memory://cover{num_workers}"
    write_shards(url, {"train": random_samples(np.random.default_rng(1), 23)}, samples_per_shard=4)
    keys, consumed, batches = [], 0, set()
    for rank in range(3):
        loader = build_loader(url, "train", 2, 48, dp_rank=rank, dp_size=3, seed=0,
                              num_workers=num_workers, shuffle_buffer=3, infinite=False)
        for b in loader:
            keys += b["keys"]
            # all-padding rows fill the last micro-batch of the last round
            assert b["input_ids"].shape == (2, 48)
        consumed += loader.consumed_samples
        batches.add(loader.batches)
        assert loader.samples_per_epoch == 23
    assert sorted(keys) == [f"train{i:07d}" for i in range(23)]
    assert consumed == 23
    assert batches == {4}  # ceil(23 / (3 ranks x 2 rows)): every rank the same count


def test_new_epoch_reshuffles_and_redraws():
    url = "memory://epochs"
    write_shards(url, {"train": random_samples(np.random.default_rng(2), 24)}, samples_per_shard=6)
    loader = build_loader(url, "train", 1, 48, seed=5, num_workers=0, shuffle_buffer=8)
    batches = _take(loader, 48)
    e0, e1 = [b["keys"][0] for b in batches[:24]], [b["keys"][0] for b in batches[24:]]
    assert sorted(e0) == sorted(e1) == [f"train{i:07d}" for i in range(24)]
    assert e0 != e1
    # the first window (8 samples, chunks of 1) draws from across the stream, not one shard
    assert len({int(k[5:]) // 6 for k in e0[:8]}) >= 3
    # the same sample is reorganized differently in epoch 1
    by_key0 = {b["keys"][0]: b for b in batches[:24]}
    differ = sum(not torch.equal(by_key0[b["keys"][0]]["input_ids"], b["input_ids"]) for b in batches[24:])
    assert differ > 12
    # a different seed gives another order
    other = _take(build_loader(url, "train", 1, 48, seed=6, num_workers=0, shuffle_buffer=8), 24)
    assert [b["keys"][0] for b in other] != e0


def test_packing_keeps_samples_whole_and_pads_less():
    url = "memory://pack"
    samples = random_samples(np.random.default_rng(3), 40, max_length=40, min_length=4)
    write_shards(url, {"train": samples}, samples_per_shard=10)
    by_key = {f"train{i:07d}": s for i, s in enumerate(samples)}
    pad_frac = {}
    for pack in (False, "next_fit", "best_fit"):
        loader = build_loader(url, "train", 4, 48, seed=1, num_workers=0, pack=bool(pack),
                              packing=pack or "best_fit", infinite=False, shuffle_buffer=10)
        real = total = 0
        keys = []
        for b in loader:
            real += int(b["real_tokens"])
            total += b["input_ids"].numel()
            keys += b["keys"]
            for r in range(4):
                seg = b["segment_ids"][r]
                n_real = int((seg > 0).sum())
                assert (seg[:n_real] > 0).all() and (seg[n_real:] == 0).all()
                # position ids restart at 0 for every segment and are a permutation inside it
                for s in seg[:n_real].unique().tolist():
                    pos = sorted(b["position_ids"][r][seg == s].tolist())
                    assert pos == list(range(len(pos)))
        assert sorted(keys) == sorted(by_key)
        assert real == sum(len(t) for t, _ in samples)
        pad_frac[pack] = 1 - real / total
    assert pad_frac["next_fit"] < pad_frac[False] - 0.2
    assert pad_frac["best_fit"] < pad_frac["next_fit"]


def test_dp_size_change_and_other_settings_are_refused():
    url = "memory://refuse"
    write_shards(url, {"train": random_samples(np.random.default_rng(4), 12)}, samples_per_shard=6)
    loader = build_loader(url, "train", 2, 48, dp_rank=0, dp_size=2, num_workers=0)
    _take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(DataError, match="data-parallel size 2.*has 1"):
        build_loader(url, "train", 2, 48, dp_size=1, num_workers=0).load_state_dict(state)
    with pytest.raises(DataError, match="micro_batch_size"):
        build_loader(url, "train", 1, 48, dp_size=2, num_workers=0).load_state_dict(state)
    with pytest.raises(DataError, match="packing"):
        build_loader(url, "train", 2, 48, dp_size=2, num_workers=0, pack=True).load_state_dict(state)
    with pytest.raises(DataError, match="version 1 is not 2"):
        build_loader(url, "train", 2, 48, dp_size=2, num_workers=0).load_state_dict(dict(state, version=1))
    # the worker count does not change the batches: another one resumes exactly
    full = _take(build_loader(url, "train", 2, 48, dp_rank=0, dp_size=2, num_workers=0), 5)
    other_workers = build_loader(url, "train", 2, 48, dp_size=2, num_workers=2)
    other_workers.load_state_dict(state)
    _same(_take(other_workers, 3), full[2:])
    with pytest.raises(DataError, match="objective"):
        build_loader(url, "train", 2, 48, dp_size=2, num_workers=0,
                     objective_cfg=ObjectiveConfig(eps=0.1)).load_state_dict(state)
    # only the option that differs is named, not both whole objective dicts
    with pytest.raises(DataError) as err:
        build_loader(url, "train", 2, 48, dp_size=2, num_workers=0, objective_cfg=ObjectiveConfig(
            eps=0.1, ar_weight=2.0)).load_state_dict(state)
    assert str(err.value) == (f"loader state: the objective changed since the checkpoint "
                              f"(objective.ar_weight {ObjectiveConfig().ar_weight!r} -> 2.0, "
                              f"objective.eps {ObjectiveConfig().eps!r} -> 0.1); resume with the "
                              f"same data settings")
    # a state saved before an objective option existed resumes at the option's default (the
    # old behaviour), and only there
    before = dict(state, config=dict(state["config"], objective={
        k: v for k, v in state["config"]["objective"].items()
        if k not in ("boundary_labels", "natural_order_fraction")}))
    resumed = build_loader(url, "train", 2, 48, dp_rank=0, dp_size=2, num_workers=0)
    resumed.load_state_dict(before)
    _same(_take(resumed, 3), full[2:])
    with pytest.raises(DataError, match="objective"):
        build_loader(url, "train", 2, 48, dp_size=2, num_workers=0, objective_cfg=ObjectiveConfig(
            boundary_labels=True)).load_state_dict(before)
    # another shard folder: both folders named (the state records where it was read from)
    other = "memory://refuse-other"
    write_shards(other, {"train": random_samples(np.random.default_rng(5), 12)}, samples_per_shard=6)
    assert state["data_dir"] == url
    with pytest.raises(DataError) as err:
        build_loader(other, "train", 2, 48, dp_size=2, num_workers=0).load_state_dict(state)
    msg = str(err.value)
    assert msg.startswith("loader state: data was ") and "\n" not in msg
    assert f"(shards of {url} when saved, of {other} now)" in msg
    old = {k: v for k, v in state.items() if k != "data_dir"}  # a state saved before data_dir
    with pytest.raises(DataError, match=f"shards of an unrecorded folder when saved, of {other} now"):
        build_loader(other, "train", 2, 48, dp_size=2, num_workers=0).load_state_dict(old)
    same = build_loader(url, "train", 2, 48, dp_size=2, num_workers=0)
    same.load_state_dict(old)                                  # still loads
    assert same.batches == 2


def test_new_pass_over_a_grown_shard_set():
    """Shards rebuilt with more input: refused by default (the same line as any other shard
    set); with on_shard_change="new_pass" the loader continues with the next epoch over the new
    set, batch for batch what a fresh loader of the new set yields in that epoch."""
    url = "memory://grow"
    first = random_samples(np.random.default_rng(6), 12)
    write_shards(url, {"train": first}, samples_per_shard=6, max_length=48)
    kw = dict(micro_batch_size=2, max_length=48, dp_size=2, seed=3, num_workers=0,
              shuffle_buffer=4, vocab_size=64)
    loader = build_loader(url, "train", dp_rank=1, **kw)
    _take(loader, 2)            # 2 of the 3 rounds of epoch 0 (12 rows, 4 per round)
    state, old_fp = loader.state_dict(), loader.fingerprint
    assert state["cursor"][0] == 0
    more = random_samples(np.random.default_rng(7), 12)
    write_shards(url, {"train": first + more}, samples_per_shard=6, max_length=48)
    grown = build_loader(url, "train", dp_rank=1, **kw)
    with pytest.raises(DataError) as err:
        grown.load_state_dict(state)
    assert str(err.value) == (f"loader state: data was {old_fp!r} when saved, is "
                              f"{grown.fingerprint!r} now (shards of {url} when saved, of {url} "
                              f"now); resume with the same data settings")
    with pytest.raises(DataError, match="on_shard_change 'sometimes' is not one of refuse, new_pass"):
        grown.load_state_dict(state, on_shard_change="sometimes")
    change = grown.load_state_dict(state, on_shard_change="new_pass")
    assert change == {"from": old_fp, "from_dir": url, "to": grown.fingerprint, "epoch": 1,
                      "samples_per_epoch": 24}
    assert grown.cursor == (1, 0, 0) and grown.batches == 2
    # a fresh loader of the grown set: epoch 0 is 6 rounds, then epoch 1 begins
    fresh = _take(build_loader(url, "train", dp_rank=1, **kw), 6 + 6)
    resumed = _take(grown, 6)
    _same(resumed, fresh[6:])
    seen = {k for b in resumed for k in b["keys"]}
    assert any(int(k.removeprefix("train")) >= 12 for k in seen)   # samples only the new set has
    assert grown.batches == 8 and grown.epoch == 1
    # a state at the very start of an epoch (nothing of it read) begins that epoch
    write_shards("memory://grow-a", {"train": first}, samples_per_shard=6, max_length=48)
    untouched = build_loader("memory://grow-a", "train", dp_rank=1, **kw).state_dict()
    again = build_loader(url, "train", dp_rank=1, **kw)
    assert again.load_state_dict(untouched, on_shard_change="new_pass")["epoch"] == 0
    # the same switch does not accept shards of another tokenizer
    write_shards(url, {"train": first + more}, samples_per_shard=6, max_length=48,
                 tokenizer=dict(DEFAULT_TOKENIZER, hash="other-tokenizer"))
    with pytest.raises(DataError, match="made with another tokenizer"):
        build_loader(url, "train", dp_rank=1, **kw).load_state_dict(state, on_shard_change="new_pass")
    # an unchanged set: the switch changes nothing (exact continuation)
    write_shards(url, {"train": first}, samples_per_shard=6, max_length=48)
    same = build_loader(url, "train", dp_rank=1, **kw)
    assert same.load_state_dict(state, on_shard_change="new_pass") is None
    assert same.cursor == tuple(state["cursor"])


def test_tokenizer_and_shape_checks():
    url = "memory://tok"
    tok = dict(DEFAULT_TOKENIZER, vocab_size=64, mask_id=70)
    write_shards(url, {"train": random_samples(np.random.default_rng(5), 8)}, tokenizer=tok)
    with pytest.raises(DataError, match="vocab_size 64 > model vocab_size 32"):
        build_loader(url, "train", 1, 48, vocab_size=32)
    with pytest.raises(DataError, match="mask_id 70 is outside the model vocab"):
        build_loader(url, "train", 1, 48, vocab_size=66)
    build_loader(url, "train", 1, 48, vocab_size=128)
    with pytest.raises(DataError, match="tokenizer hash other"):
        build_loader(url, "train", 1, 48, vocab_size=128, tokenizer_hash="other")
    with pytest.raises(DataError, match="max_length"):
        build_loader(url, "train", 1, 16, vocab_size=128)
    with pytest.raises(DataError, match="no split 'val'"):
        build_loader(url, "val", 1, 48)
    with pytest.raises(DataError, match="packing 'first_fit' is not one of next_fit, best_fit"):
        build_loader(url, "train", 1, 48, vocab_size=128, pack=True, packing="first_fit")
    with pytest.raises(DataError, match="no manifest.json"):
        build_loader("memory://nothing-here", "train", 1, 48)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "count"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_shard_error_names_the_shard(tmp_path, damage, num_workers):
    manifest = write_shards(str(tmp_path), {"train": random_samples(np.random.default_rng(6), 12)},
                            samples_per_shard=6)
    path = tmp_path / "train-000001.tar"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2 + 100])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x17not a tar" * 300)
    else:  # the manifest promises more samples than the shard has
        manifest["splits"]["train"][1]["samples"] = 7
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loader = build_loader(str(tmp_path), "train", 2, 48, num_workers=num_workers, shuffle=False,
                          infinite=False)
    with pytest.raises(DataError, match=r"shard .*train-000001\.tar") as err:
        for _ in loader:
            pass
    assert "\n" not in str(err.value)


def test_one_pass_with_fewer_samples_than_ranks():
    url = "memory://tiny-val"
    write_shards(url, {"val": random_samples(np.random.default_rng(8), 2)})
    keys = []
    for rank in range(4):
        for b in build_loader(url, "val", 1, 48, dp_rank=rank, dp_size=4, num_workers=0,
                              shuffle=False, infinite=False):
            keys += b["keys"]
    assert keys == ["val0000000", "val0000001"]


def test_resume_does_not_replay_the_epoch(tmp_path):
    write_shards(str(tmp_path), {"train": random_samples(np.random.default_rng(10), 24)}, samples_per_shard=6)
    kw = dict(num_workers=0, shuffle=False, shuffle_buffer=4)
    full = _take(build_loader(str(tmp_path), "train", 1, 48, **kw), 20)
    loader = build_loader(str(tmp_path), "train", 1, 48, **kw)
    _take(loader, 17)
    state = loader.state_dict()
    # Sample 17 sits in shard 2; the resumed loader must not need shards 0 and 1.
    for name in ("train-000000.tar", "train-000001.tar"):
        (tmp_path / name).write_bytes(b"gone" * 100)
    resumed = build_loader(str(tmp_path), "train", 1, 48, **kw)
    resumed.load_state_dict(state)
    _same(_take(resumed, 3), full[17:])
