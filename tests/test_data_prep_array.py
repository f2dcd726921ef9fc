"""Data prep as a job array (`shard.py plan / run / merge`, data_prep/plan.py and merge.py):
the merged dataset equals the one-process run's, whatever the number of tasks, their order,
retries and interruptions; stale, foreign, missing and damaged parts are refused in one line;
the trainer trains on a merged folder.

The corpus mixes JSONL (one file much larger than the rest, cut into several byte-range units,
with `\\r\\n` lines, a malformed line, a record missing a field), Parquet (row groups in
several units), text files (one empty) and exact duplicates within a unit and across units in
both directions (an early small file repeating records of the big file, a Parquet file
repeating one twice), with over-length pairs and chat turns so every kind of count moves.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import cli, train_tokenizer
from test_data_prep import read_samples

ROOT = Path(__file__).resolve().parents[1]
UNIT = "20000"  # --unit-bytes: the big file (~160 kB) becomes 8 units, Parquet 2
COMMON = ["--max-length", "64", "--val-fraction", "0.2", "--shard-samples", "50"]


def _corpus(d: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    d.mkdir(parents=True)
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    sent = lambda n: " ".join(rng.choice(words) for _ in range(n))
    big = []
    for i in range(400):
        r = rng.random()
        if r < 0.5:
            big.append({"query": f"q{i} " + sent(5), "response": sent(8)})
        elif r < 0.8:
            big.append({"text": sent(rng.randint(3, 120))})  # long ones become chunks
        else:
            big.append({"messages": [{"role": "user", "content": sent(4)},
                                     {"role": "assistant", "content": sent(6)},
                                     {"role": "user", "content": sent(3)},
                                     {"role": "assistant", "content": sent(rng.choice([5, 300]))}]})
    big[50], big[300] = dict(big[10]), dict(big[20])  # repeats inside the big file
    with open(d / "b_big.jsonl", "wb") as f:
        for i, r in enumerate(big):
            f.write(json.dumps(r).encode() + (b"\r\n" if i % 7 == 0 else b"\n"))
            if i == 100:
                f.write(b"{not json\n\n")
            if i == 200:
                f.write(b'{"query": 3}\n')
    with open(d / "a_small.jsonl", "w") as f:  # read first: the big file's copies are the repeats
        for r in (big[5], {"query": "small one", "response": "x"}, big[399], {"text": ""}):
            f.write(json.dumps(r) + "\n")
    rows = [{"query": f"pq{i} " + sent(4), "response": sent(5)} for i in range(500)]
    pq.write_table(pa.Table.from_pylist(rows + [big[7], big[7]]), d / "c.parquet",
                   row_group_size=50)
    (d / "d.txt").write_text(sent(900))
    (d / "e.txt").write_text("plain words")
    return d


def _corpus_and_tokenizer(base: Path) -> tuple[Path, Path]:
    """The test corpus under `base / "in"` and a 300-piece SentencePiece model trained on it
    (`base / "spm.model"`)."""
    corpus = _corpus(base / "in")
    tok = base / "spm.model"
    assert train_tokenizer.main(["--input", str(corpus / "d.txt"), "--input",
                                 str(corpus / "b_big.jsonl"), "--output", str(tok),
                                 "--vocab-size", "300"]) == 0
    return corpus, tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(corpus folder, SentencePiece model, base tmp folder)."""
    base = tmp_path_factory.mktemp("array")
    corpus, tok = _corpus_and_tokenizer(base)
    return corpus, str(tok), base


def _main(capsys, *args) -> tuple[int, str]:
    code = cli.main([*map(str, args)])
    return code, capsys.readouterr().err


def _plan(capsys, setup, out, *extra) -> tuple[int, str]:
    corpus, tok, _ = setup
    return _main(capsys, "plan", "--input", corpus, "--output", out, "--tokenizer", tok,
                 "--unit-bytes", UNIT, *COMMON, *extra)


def _array(capsys, setup, out, k, order=None, extra=()) -> str:
    """plan, the k tasks (in `order`), merge; returns the merge's stderr."""
    assert _plan(capsys, setup, out, *extra)[0] == 0
    for t in order or range(k):
        code, err = _main(capsys, "run", "--output", out, "--task", t, "--num-tasks", k)
        assert code == 0, err
    code, err = _main(capsys, "merge", "--output", out)
    assert code == 0, err
    return err


def _dataset(out) -> tuple[dict, dict]:
    """(samples {split: [(key, tokens list, segments)]}, {skipped, counts}) of a folder."""
    m = json.loads((Path(out) / "manifest.json").read_text())
    samples = {s: [(k, t.tolist(), meta["segments"]) for k, t, meta in rows]
               for s, rows in read_samples(str(out)).items()}
    return samples, {"skipped": m["skipped"], "counts": m["counts"]}


@pytest.fixture(scope="module")
def one_process(setup):
    """The one-machine command's dataset (unpacked)."""
    corpus, tok, base = setup
    out = base / "one"
    assert cli.main(["--input", str(corpus), "--output", str(out), "--tokenizer", tok,
                       *COMMON, "--no-progress"]) == 0
    return _dataset(out)


def test_merged_equals_one_process_for_any_k_and_order(setup, one_process, capsys, tmp_path):
    """K = 1, 3, 4 (4 in reverse order): keys, tokens, slot boundaries, splits, skip counts
    and counts all equal the one-process run's; the plan cut the big file and the Parquet."""
    samples, counts = one_process
    assert counts["skipped"] == {"duplicate": 6, "empty_text": 1, "malformed_json": 1,
                                 "missing_field": 1, "over_length": 69, "over_length_turns": 94}
    assert len(samples["train"]) == 1009 and len(samples["val"]) == 241
    for k, order in ((1, None), (3, None), (4, [3, 2, 1, 0])):
        out = tmp_path / f"k{k}"
        err = _array(capsys, setup, out, k, order)
        assert "5 duplicate(s) across units dropped" in err
        got_samples, got_counts = _dataset(out)
        assert got_counts == counts, k
        for split in ("train", "val"):
            assert got_samples[split] == samples[split], (k, split)
    plan = json.loads((tmp_path / "k1" / "plan.json").read_text())
    names = [i["name"].rsplit("/", 1)[-1] for i in plan["inputs"]]
    per_input = [sum(1 for u in plan["units"] for p in u["pieces"] if p["input"] == j)
                 for j in range(len(names))]
    assert dict(zip(names, per_input))["b_big.jsonl"] == 8
    assert dict(zip(names, per_input))["c.parquet"] == 2
    m = json.loads((tmp_path / "k4" / "manifest.json").read_text())
    assert m["plan"]["units"] == 12 and m["plan"]["duplicates_across_units"] == 5
    assert all(e["name"].startswith("parts/u") for e in m["splits"]["train"])


def test_packed_merge_equals_one_process_for_any_k(setup, one_process, capsys, tmp_path):
    """--pack: K = 1 and 3 (any order) give the packed samples of the one-process run with the
    same --unit-bytes (a pack ends at a unit's end); their items (segment keys) are, in order,
    exactly the unpacked one-process run's samples."""
    corpus, tok, _ = setup
    a, b, one = tmp_path / "p1", tmp_path / "p3", tmp_path / "one"
    _array(capsys, setup, a, 1, extra=["--pack"])
    _array(capsys, setup, b, 3, order=[2, 0, 1], extra=["--pack"])
    assert _main(capsys, "--input", corpus, "--output", one, "--tokenizer", tok, "--pack",
                 "--unit-bytes", UNIT, *COMMON, "--no-progress")[0] == 0
    (sa, ca), (sb, cb), (so, co) = _dataset(a), _dataset(b), _dataset(one)
    assert sa == sb == so and ca == cb == co == one_process[1]
    for split in ("train", "val"):
        items = [(seg.get("key", key), tokens[seg["start"]:seg["end"]])
                 for key, tokens, segs in sa[split] for seg in segs]
        assert items == [(key, tokens) for key, tokens, _ in one_process[0][split]]
        assert any(len(segs) > 1 for _, _, segs in sa[split])


def test_interrupted_task_retried_task_and_rerun_with_other_k(setup, one_process, capsys,
                                                              tmp_path):
    """A task stopped after one shard and run again resumes its unit; a task run twice and a
    rerun of all tasks with another K change nothing; the merge equals the one-process run."""
    out = tmp_path / "o"
    assert _plan(capsys, setup, out)[0] == 0
    code, err = _main(capsys, "run", "--output", out, "--task", 0, "--num-tasks", 2,
                      "--stop-after-shards", 1)
    assert code == 0 and "stopped after 1 shard(s)" in err
    code, err = _main(capsys, "merge", "--output", out)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "has no complete part (" in err and "--unit " in err and "--overwrite`" in err
    code, err = _main(capsys, "run", "--output", out, "--task", 0, "--num-tasks", 2)
    assert code == 0 and "resuming: keeping 1 complete shard(s)" in err
    for t in (0, 1):  # task 0 a second time: its parts are complete and kept
        code, err = _main(capsys, "run", "--output", out, "--task", t, "--num-tasks", 2)
        assert code == 0, err
    before = {p: p.stat().st_mtime_ns for p in (out / "parts").rglob("*.tar")}
    for t in range(5):  # another K: every part is complete and kept
        assert _main(capsys, "run", "--output", out, "--task", t, "--num-tasks", 5)[0] == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "parts").rglob("*.tar")} == before
    assert _main(capsys, "merge", "--output", out)[0] == 0
    assert _dataset(out) == one_process


def test_refusals_name_the_input_part_or_shard(setup, capsys, tmp_path):
    corpus, tok, base = setup
    # an input edited between plan and run
    src = tmp_path / "in"
    src.mkdir()
    (src / "x.jsonl").write_text(json.dumps({"query": "a", "response": "b"}) + "\n")
    out = tmp_path / "edited"
    assert _main(capsys, "plan", "--input", src, "--output", out, "--tokenizer", tok)[0] == 0
    (src / "x.jsonl").write_text(json.dumps({"query": "a", "response": "bb"}) + "\n")
    code, err = _main(capsys, "run", "--output", out, "--task", 0, "--num-tasks", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "x.jsonl changed (size 32 bytes, now 33 bytes" in err and "since the plan" in err
    # another plan over this one: refused, --overwrite replaces it
    code, err = _main(capsys, "plan", "--input", src, "--output", out, "--tokenizer", tok,
                      "--seed", "3")
    assert code == 2 and "holds another plan (other options (--seed 0, now 3" in err
    assert _main(capsys, "plan", "--input", src, "--output", out, "--tokenizer", tok,
                 "--seed", "3", "--overwrite")[0] == 0
    # a part from another plan, a missing part, a damaged shard
    good, other = tmp_path / "good", tmp_path / "other"
    _array(capsys, setup, good, 2)
    _array(capsys, setup, other, 1, extra=["--seed", "5"])
    import shutil
    shutil.rmtree(good / "parts" / "u000003")
    shutil.copytree(other / "parts" / "u000003", good / "parts" / "u000003")
    code, err = _main(capsys, "merge", "--output", good)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "parts/u000003/manifest.json: the part of unit 3 (" in err
    assert "was made from another plan" in err
    assert "rerun `shard.py run --output" in err and f"--output {good} --unit 3 --overwrite`" in err
    assert _main(capsys, "run", "--output", good, "--unit", 3, "--overwrite")[0] == 0
    assert _main(capsys, "merge", "--output", good)[0] == 0
    shutil.rmtree(good / "parts" / "u000007")
    code, err = _main(capsys, "merge", "--output", good)
    assert code == 2 and "unit 7 (" in err and "has no complete part (not run)" in err
    assert _main(capsys, "run", "--output", good, "--unit", 7)[0] == 0
    shard_file = sorted((good / "parts" / "u000002").glob("train-*.tar"))[0]
    data = bytearray(shard_file.read_bytes())
    data[700] ^= 1  # inside the first sample's tokens: same size, other bytes
    shard_file.write_bytes(bytes(data))
    code, err = _main(capsys, "merge", "--output", good)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"shard {shard_file}: sample " in err and "does not match its digest" in err
    assert "verify_shards" not in err
    assert "--unit 2 --overwrite" in err


def test_run_stage_task_from_slurm_array_environment(setup, capsys, tmp_path, monkeypatch):
    """No --task / --num-tasks: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and
    SLURM_ARRAY_TASK_COUNT; neither: one line, exit code 2."""
    out = tmp_path / "o"
    for stage in ("run", "merge"):  # no plan yet: one line, and no folder made
        code, err = _main(capsys, stage, "--output", out, "--task", 0, "--num-tasks", 1)[:2] \
            if stage == "run" else _main(capsys, stage, "--output", out)
        assert code == 2 and f"{out}/plan.json: no plan; run `shard.py plan" in err
        assert not out.exists()
    assert _plan(capsys, setup, out)[0] == 0
    code, err = _main(capsys, "run", "--output", out)
    assert code == 2 and "needs --task and --num-tasks" in err
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "11")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    code, err = _main(capsys, "run", "--output", out)
    assert code == 0 and "task 1 of 3:" in err


def test_trainer_trains_on_a_merged_folder(setup, capsys, tmp_path):
    """Two training steps of the tiny model on a merged (packed) folder, one process."""
    from shard_fixtures import tiny_model_yaml
    out = tmp_path / "data"
    _array(capsys, setup, out, 2, extra=["--pack"])
    vocab = json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""\
run_dir: {run}
model:
  inline: {tiny_model_yaml(vocab_size=vocab).replace('{{', '{').replace('}}', '}')}
data: {{dir: {out}, num_workers: 0, shuffle_buffer: 8}}
optim: {{lr: 1.0e-3, warmup_steps: 1}}
train: {{max_steps: 2, micro_batch_size: 2, precision: fp32, zero_stage: 0,
        tensor_parallel_size: 1, eval_interval: 2, eval_batches: 1}}
checkpoint: {{interval: 0, keep: 1}}
wandb: {{mode: disabled}}
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(cfg)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in rows if m["kind"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert any(m["kind"] == "val" for m in rows)
