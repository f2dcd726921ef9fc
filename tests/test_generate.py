"""pipeline.generate CLI on a tiny random Qwen3 checkpoint with a small SentencePiece tokenizer.

Oracles: transformers' greedy `generate` on the same prompt ids (ar mode); the tokenizer's own
decode; the per-prompt figures' definitions (TPF = tokens / forwards).
"""
import json
import os

import pytest
import torch

from tiny_qwen3 import make_tiny_qwen3


def make_spm_model_folder(folder, seed=1):
    """Tiny HF Qwen3 folder (vocab 512) + a SentencePiece `tokenizer.model` with the pieces
    data_prep uses (<pad>=0 <unk>=1 <s>=2 </s>=3 <|mask|> <|user|> <|assistant|>), trained in
    about a second on a few standard-library files."""
    import glob
    import sentencepiece as spm
    folder = make_tiny_qwen3(folder, seed=seed)
    text = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "json", "*.py"))):
        text += open(path).read().splitlines()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([t for t in text if t.strip()]), model_prefix=str(folder / "tok"),
        vocab_size=400, model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        user_defined_symbols=["<|mask|>", "<|user|>", "<|assistant|>"], byte_fallback=True,
        minloglevel=2)
    os.replace(folder / "tok.model", folder / "tokenizer.model")
    os.remove(folder / "tok.vocab")
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_spm_model_folder(tmp_path_factory.mktemp("gen") / "model")


def _run(capsys, argv):
    from pipeline.generate import main
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_refusion_cli_prints_text_and_figures(tp1, folder, capsys):
    rc, out, _ = _run(capsys, ["--model", str(folder), "--prompt", "def load(fp):",
                               "--gen-length", "16", "--slot-size", "4", "--num-blocks", "2",
                               "--slot-threshold", "0.1", "--token-threshold", "0.1", "--json"])
    assert rc == 0
    doc = json.loads(out)
    (r,) = doc["results"]
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert 1 <= r["tokens"] == len(r["token_ids"]) <= 16
    assert r["text"] == sp.decode([i for i in r["token_ids"] if i != 3 and i < 400])
    assert r["forwards"] == sum(r["forwards_by_kind"].values()) >= 2
    assert r["tpf"] == pytest.approx(r["tokens"] / r["forwards"])
    assert r["tps"] > 0
    # Plain-text output carries the same figures.
    rc, out, _ = _run(capsys, ["--model", str(folder), "--prompt", "def load(fp):",
                               "--gen-length", "16", "--num-blocks", "2"])
    assert rc == 0 and "TPF" in out and "TPS" in out and "forwards" in out


def test_ar_cli_equals_transformers_generate(tp1, folder, capsys, tmp_path):
    from transformers import Qwen3ForCausalLM
    from pipeline.tokenizer import load_tokenizer
    prompts = ["def dumps(obj):", "class JSONDecoder(object):", "x"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    rc, out, _ = _run(capsys, ["--model", str(folder), "--prompts", str(f), "--mode", "ar",
                               "--gen-length", "10", "--batch-size", "2", "--json"])
    assert rc == 0
    results = json.loads(out)["results"]
    tok = load_tokenizer(str(folder / "tokenizer.model"))
    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p, r in zip(prompts, results):
        ids = torch.tensor([tok.prompt_ids(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          do_sample=False, eos_token_id=3, pad_token_id=0)[0, ids.shape[1]:]
        ref = ref.tolist()
        if 3 in ref:
            ref = ref[:ref.index(3) + 1]
        assert r["token_ids"] == ref
        assert r["forwards_by_kind"] == {"prefill": 1, "ar": len(ref) - 1}


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model"),
    (["--prompt", "x", "--num-blocks", "3", "--gen-length", "16"], "--num-blocks"),
    (["--prompts", "BAD", "--gen-length", "16"], ":2: not JSON"),
    (["--prompt", "x", "--token-threshold", "-0.5"], "--token-threshold -0.5 must be in [0, 1]"),
    (["--prompt", "x", "--token-threshold", "1.5"], "--token-threshold 1.5 must be in [0, 1]"),
    (["--prompt", "x", "--slot-threshold", "-0.1"], "--slot-threshold -0.1 must be >= 0"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature must be >= 0"),
    (["--prompt", "x", "--verify", "correct", "--mask-attention", "bidirectional"],
     "--mask-attention bidirectional needs --verify draft_ahead or draft_every, not correct"),
])
def test_user_errors_exit_2_with_one_line(tp1, folder, capsys, tmp_path, argv, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    argv = [str(bad) if a == "BAD" else a for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(folder)] + argv
    rc, _, err = _run(capsys, argv)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_hf_tokenizer_folder_uses_the_chat_template(tp1, tmp_path, capsys):
    """A Qwen3-style folder (real Qwen3 tokenizer files, ReFusion tokens added): prompts are
    wrapped with the chat template, the mask/EOS ids are <|mask|> / <|im_end|>, and ar mode
    decodes what transformers' greedy generate decodes from the same ids."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    folder = make_tiny_qwen3(tmp_path / "qwen", seed=3, with_tokenizer=True, hidden_size=16,
                             head_dim=8, intermediate_size=32, num_attention_heads=2,
                             num_key_value_heads=1)
    rc, out, _ = _run(capsys, ["--model", str(folder), "--prompt", "Write a function.",
                               "--mode", "ar", "--gen-length", "4", "--json"])
    assert rc == 0
    (r,) = json.loads(out)["results"]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a function."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                      do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert r["token_ids"] == ref
    from pipeline.inference.loading import load_for_inference
    loaded = load_for_inference(folder)
    assert (loaded.mask_id, loaded.eos_id) == (151670, 151645)


def test_json_out_folder_and_empty_tokenizer_folder_exit_2_before_decoding(tp1, folder, capsys,
                                                                          tmp_path):
    """--output (here in its old spelling --json-out) naming an existing folder is refused up
    front (no decode whose results would be lost); a --tokenizer folder without tokenizer files
    is one line naming the option."""
    from unittest import mock
    import pipeline.generate as G
    with mock.patch.object(G, "decode_batch", side_effect=AssertionError("decoded")):
        rc, out, err = _run(capsys, ["--model", str(folder), "--prompt", "x", "--json-out",
                                     str(tmp_path)])
    assert rc == 2 and out == ""
    assert err.strip() == f"error: --output {tmp_path}: is a folder; give a file path"
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _run(capsys, ["--model", str(folder), "--prompt", "x", "--tokenizer",
                               str(empty)])
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --tokenizer {empty}: no tokenizer files")


def _bench(script, *argv):
    """`python bench/SCRIPT ARGV` in a fresh process (the command line users run)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, os.path.join(root, "bench", script), *argv],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)


def _bench_here(monkeypatch, capsys, script, *argv):
    """bench/SCRIPT's `main()` with ARGV in this process (its process group: tp1's), without
    the 5-10 s of imports a fresh process costs: a CompletedProcess-like (returncode, stdout,
    stderr). The command line itself is run by `_bench` in the tests that say so."""
    import importlib.util
    import sys
    from types import SimpleNamespace
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "bench", script)
    spec = importlib.util.spec_from_file_location(f"_bench_{script[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script prepends to it
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", [path, *argv])
    monkeypatch.chdir(root)
    capsys.readouterr()
    rc = mod.main()
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


@pytest.mark.parametrize("argv, message, launch", [
    (["--model", "/nonexistent/model"], "error: --model /nonexistent/model: no such file", False),
    (["--gen-length", "4", "--num-blocks", "2"], "error: --num-blocks 2 must divide the 1 slots",
     True),
])
def test_bench_decoding_user_errors_exit_2_with_one_line(tp1, monkeypatch, capsys, argv, message,
                                                         launch):
    """One refusal from the command line (`launch`), the other from `main()` in this process."""
    r = _bench("bench_decoding.py", *argv) if launch else _bench_here(
        monkeypatch, capsys, "bench_decoding.py", *argv)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr


def test_bench_train_step_short_row_length_exits_2_with_one_line(tmp_path):
    import numpy as np
    from shard_fixtures import random_samples, write_shards
    samples = random_samples(np.random.default_rng(0), 4, vocab_size=400, max_length=40,
                             min_length=12, first_id=7, max_segments=2, max_prompt=6)
    tok = {"kind": "spm", "name": "fixture", "hash": "fixture-0", "vocab_size": 400,
           "eos_id": 3, "pad_id": 0, "mask_id": 4, "bos_id": 2}
    write_shards(str(tmp_path), {"train": samples, "val": samples}, samples_per_shard=4,
                 tokenizer=tok)
    L = json.loads((tmp_path / "manifest.json").read_text())["max_length"]
    assert L > 16
    r = _bench("bench_train_step.py", "--data", str(tmp_path), "--row-length", "16")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: --row-length 16 is shorter than the shards' max_length "
                                f"{L} ({tmp_path}/manifest.json); use >= {L}")


def test_slot_threshold_above_1_and_token_threshold_1_are_valid(tp1, folder, capsys):
    """--slot-threshold 1.5: one slot per step; --token-threshold 1: no drafted token accepted
    by probability (only the first of each slot), so one token per slot per forward pair."""
    rc, out, err = _run(capsys, ["--model", str(folder), "--prompt", "x", "--gen-length", "8",
                                 "--slot-size", "4", "--num-blocks", "1", "--slot-threshold",
                                 "1.5", "--token-threshold", "1", "--json"])
    assert rc == 0, err
    (r,) = json.loads(out)["results"]
    assert 1 <= r["tokens"] <= 8
    kinds = r["forwards_by_kind"]
    # Each plan and each re-draft is verified once, and each verify commits one token per slot
    # (one slot planned per step), so a token costs at least two forwards.
    assert kinds["verify"] == kinds["plan"] + kinds["draft"]
    assert r["forwards"] == kinds["plan"] + kinds["draft"] + kinds["verify"]
    assert r["tpf"] <= 0.5


def test_lossless_modes_default_to_0_5_and_say_when_not_lossless(tp1, folder, capsys):
    """Issue 43 item 5: without --token-threshold, --verify draft_ahead and draft_every run at
    0.5 (recorded in the settings) and return --mode ar's ids (10 tokens: not a multiple of
    the slot size), silently; with a token threshold below 0.5 or a temperature above 0 they
    say in one stderr line that the run is not lossless, and decode on. authors keeps 0.3."""
    base = ["--model", str(folder), "--prompt", "def load(fp):", "--gen-length", "10", "--json"]
    rc, out, _ = _run(capsys, base + ["--mode", "ar"])
    assert rc == 0
    ar = json.loads(out)["results"][0]["token_ids"]

    def notes(err):
        return [ln for ln in err.splitlines() if "lossless" in ln]

    for verify in ("draft_ahead", "draft_every"):
        rc, out, err = _run(capsys, base + ["--verify", verify])
        doc = json.loads(out)
        assert rc == 0 and notes(err) == []
        assert doc["settings"]["token_threshold"] == 0.5
        assert doc["results"][0]["token_ids"] == ar
        for extra, why in ((["--token-threshold", "0.3"], "--token-threshold 0.3"),
                           (["--temperature", "0.7"], "--temperature 0.7"),
                           (["--temperature", "1", "--token-threshold", "0.2"],
                            "--temperature 1 and --token-threshold 0.2")):
            rc, out, err = _run(capsys, base + ["--verify", verify] + extra)
            assert rc == 0 and json.loads(out)["results"]
            assert notes(err) == [f"note: --verify {verify} with {why} is not lossless: its "
                                  f"output may differ from --mode ar (lossless: --temperature 0 "
                                  f"and --token-threshold >= 0.5)"]
    for verify in ("authors", "correct"):   # not claimed lossless: no note
        rc, out, err = _run(capsys, base + ["--verify", verify, "--num-blocks", "1"])
        assert rc == 0 and notes(err) == []
        assert json.loads(out)["settings"]["token_threshold"] == 0.3


def test_lossless_note_is_the_same_for_every_decoding_cli():
    """generate, evaluate and lm_eval resolve the token threshold and word the note with the
    same two functions; a threshold given explicitly is kept."""
    import argparse
    from pipeline.inference.cli import DECODING_DEFAULTS, check_decoding_args, lossless_note
    for verify, default in (("authors", 0.3), ("correct", 0.3), ("draft_ahead", 0.5),
                            ("draft_every", 0.5)):
        args = argparse.Namespace(**{**DECODING_DEFAULTS, "verify": verify, "gen_length": 16})
        check_decoding_args(args)
        assert args.token_threshold == default and lossless_note(args) is None
        args = argparse.Namespace(**{**DECODING_DEFAULTS, "verify": verify, "gen_length": 16,
                                     "token_threshold": 0.49})
        check_decoding_args(args)
        assert args.token_threshold == 0.49
        assert (lossless_note(args) is not None) == (verify in ("draft_ahead", "draft_every"))


def test_help_shows_defaults_and_json_records_settings(tp1, folder, capsys):
    from pipeline.generate import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for piece in ("(default: refusion)", "(default: 128)", "(default: 0.6)",
                  "None: by --verify, 0.3 for authors and correct, 0.5 for draft_ahead and "
                  "draft_every",
                  "(default: 0.0)", "(default: 8)", "(default: auto)",
                  "default: bfloat16 on CUDA, float32 on the CPU"):
        assert piece in help_text
    rc, out, _ = _run(capsys, ["--model", str(folder), "--prompt", "x", "--gen-length", "8",
                               "--num-blocks", "1", "--token-threshold", "0.2", "--seed", "5",
                               "--exact-cache", "--verify", "correct", "--json", "--device",
                               "cpu"])
    assert rc == 0
    s = json.loads(out)["settings"]
    assert s == {"model": str(folder), "mode": "refusion", "gen_length": 8, "slot_size": 4,
                 "num_blocks": 1, "slot_threshold": 0.6, "token_threshold": 0.2,
                 "temperature": 0.0, "seed": 5, "exact_cache": True, "verify": "correct",
                 "batch_size": 8, "mask_attention": "causal",
                 "device": "cpu", "dtype": "float32", "tokenizer": None}  # fp32: the CPU default


def test_bench_decoding_reports_the_median_of_repeats(tp1, folder, tmp_path, monkeypatch,
                                                     capsys):
    r = _bench_here(monkeypatch, capsys, "bench_decoding.py", "--model", str(folder), "--data",
                    str(tmp_path / "none"), "--prompts", "2", "--gen-length", "4",
                    "--num-blocks", "1", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "tokens/s: median of 2 timed decodes per setting" in lines[0]
    rows = [ln.split() for ln in lines[2:]]
    assert [x[0] for x in rows] == ["ar"] + ["refusion/authors"] * 7
    assert all(float(x[6]) > 0 for x in rows)  # tokens/s
    assert rows[0][3] == "8"  # 2 prompts x 4 tokens (the tiny random model emits no EOS)
    assert all(x[9] == "-" for x in rows)     # one mode: no ratio column


def test_bench_decoding_baseline_gives_a_before_line_and_a_ratio(tp1, folder, tmp_path,
                                                                monkeypatch, capsys):
    """`--baseline FILE` (here: this tree's decoding.py, a copy): each setting is decoded with
    both, a "before/..." line then ours with its tokens/s ratio; the same tokens (the same
    algorithm); a missing file is one line, exit 2."""
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = tmp_path / "decoding_before.py"
    shutil.copy(os.path.join(root, "pipeline", "inference", "decoding.py"), base)
    r = _bench_here(monkeypatch, capsys, "bench_decoding.py", "--model", str(folder), "--data",
                    str(tmp_path / "none"), "--prompts", "2", "--gen-length", "4", "--repeats",
                    "1", "--verify", "draft_ahead", "--baseline", str(base))
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:]]
    assert [x[0] for x in rows] == ["before/ar", "ar"] + ["before/draft_ahead",
                                                           "refusion/draft_ahead"] * 5
    for before, ours in zip(rows[::2], rows[1::2]):
        assert before[3:6] == ours[3:6] and before[9] == "-" and float(ours[9]) > 0
    r = _bench_here(monkeypatch, capsys, "bench_decoding.py", "--model", str(folder),
                    "--baseline", str(tmp_path / "no"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: --baseline {tmp_path / 'no'}: no such file"


def test_bench_decoding_compares_verify_modes_side_by_side(tp1, folder, tmp_path, monkeypatch,
                                                          capsys):
    """`--verify draft_ahead draft_every`: per token threshold of the grid (the slot threshold
    is unused by both), one line per mode, the same tokens (both equal AR decoding at
    threshold >= 0.5), and each mode's tokens/s over the first one's (1.00 for the first)."""
    r = _bench_here(monkeypatch, capsys, "bench_decoding.py", "--model", str(folder), "--data",
                    str(tmp_path / "none"), "--prompts", "2", "--gen-length", "8", "--repeats",
                    "1", "--verify", "draft_ahead", "draft_every")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:]]
    assert [x[0] for x in rows] == ["ar"] + ["refusion/draft_ahead", "refusion/draft_every"] * 5
    assert [x[2] for x in rows[1::2]] == ["0.9", "0.5", "0.3", "0.1", "0.0"]
    for ahead, every in zip(rows[1::2], rows[2::2]):
        assert ahead[1] == every[1] == "-" and ahead[3] == every[3]   # same tokens
        assert ahead[9] == "1.00" and float(every[9]) > 0
        if float(ahead[2]) >= 0.5:
            assert float(ahead[8]) == float(every[8]) == 1.0          # same as AR


def test_bench_decoding_mask_attention_applies_to_the_drafting_modes(folder, tmp_path):
    """`--mask-attention bidirectional` with `--verify authors draft_every`: the authors' mode
    stays causal (it does not take the option), draft_every decodes with bidirectional mask
    blocks and still equals AR decoding at token thresholds >= 0.5. Run as users run the
    script (a fresh process)."""
    r = _bench("bench_decoding.py", "--model", str(folder), "--data", str(tmp_path / "none"),
               "--prompts", "2", "--gen-length", "8", "--num-blocks", "1", "--repeats", "1",
               "--verify", "authors", "draft_every", "--mask-attention", "bidirectional")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[2:]]
    every = [x for x in rows if x[0] == "refusion/draft_every"]
    assert len(every) == 5 and any(x[0] == "refusion/authors" for x in rows)
    assert all(float(x[8]) == 1.0 for x in every if float(x[2]) >= 0.5)


def test_device_resolution(monkeypatch):
    """--device auto|cpu|cuda[:N]: auto = CUDA when available (local rank modulo the visible
    GPUs), bf16 the default dtype on CUDA, fp32 on the CPU; bad values are UsageErrors."""
    from pipeline.common.cli import UsageError
    from pipeline.inference.loading import default_dtype, resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device(None)
    assert resolve_device("cpu") == torch.device("cpu")
    for bad, msg in (("cuda", "CUDA is not available"), ("cuda:1", "CUDA is not available"),
                     ("tpu", "expected auto, cpu, cuda or cuda:N"),
                     ("cuda:x", "expected auto, cpu, cuda or cuda:N")):
        with pytest.raises(UsageError, match=msg):
            resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 1)        # 3 mod 2 visible GPUs
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 1)        # the current device
    assert resolve_device("CUDA:0") == torch.device("cuda", 0)
    with pytest.raises(UsageError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")
    assert default_dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_cuda_device_without_cuda_is_one_line(tp1, folder, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc, out, err = _run(capsys, ["--model", str(folder), "--prompt", "x", "--device", "cuda"])
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        f"error: --device cuda: CUDA is not available here (torch {torch.__version__}, CUDA "
        f"build {torch.version.cuda}); use --device cpu or auto"]


def test_bf16_on_cpu_decoding_tensors_follow_the_model(tp1, folder, monkeypatch):
    """A bf16 model (on the CPU): parameters and KV cache in bf16, every tensor the model sees
    on the parameters' device, weights equal to the fp32 load cast to bf16, tokens decoded."""
    from pipeline.inference import decoding
    from pipeline.inference.loading import load_for_inference
    from pipeline.model import KVCache
    fp32 = load_for_inference(folder, device="cpu")
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}   # CPU default
    loaded = load_for_inference(folder, dtype=torch.bfloat16, device="cpu")
    params = dict(loaded.model.named_parameters())
    for k, p in fp32.model.named_parameters():
        assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], p.to(torch.bfloat16))
    dev = next(loaded.model.parameters()).device
    seen, caches = [], []
    real_for_model = KVCache.for_model.__func__

    def for_model(cls, model, batch_size, capacity):
        c = real_for_model(cls, model, batch_size, capacity)
        caches.append(c)
        return c
    monkeypatch.setattr(KVCache, "for_model", classmethod(for_model))

    def hook(module, args, kwargs):
        seen.extend(t for t in list(args) + list(kwargs.values()) if torch.is_tensor(t))
    h = loaded.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        ids = [loaded.tokenizer.prompt_ids("hello"), loaded.tokenizer.prompt_ids("x = 1")]
        out_r = decoding.refusion_generate(loaded.model, ids, 8, 4, 2, 0.5, 0.3, 0.0,
                                           loaded.mask_id, None)
        out_a = decoding.ar_generate(loaded.model, ids, 6, 0.7, None, seed=3)
    finally:
        h.remove()
    assert seen and all(t.device == dev for t in seen)
    assert caches and all(k.dtype == torch.bfloat16 and k.device == dev
                          for c in caches for k in c.keys + c.values)
    assert [len(t) for t in out_r.tokens] == [8, 8] and [len(t) for t in out_a.tokens] == [6, 6]
    assert out_r.seconds > 0 and out_a.seconds > 0


@pytest.mark.parametrize("verify", ["draft_ahead", "draft_every"])
def test_verify_draft_ahead_from_the_command_line_equals_ar_mode(tp1, folder, capsys, verify):
    """`--verify draft_ahead` / `draft_every` (greedy, the default token threshold 0.6 >= 0.5)
    print the same ids as `--mode ar`, and record the setting; the default --num-blocks 2,
    which does not divide the 3 slots, is not checked (slots go left to right)."""
    base = ["--model", str(folder), "--prompt", "a b c", "--prompt", "x", "--gen-length", "12",
            "--json", "--device", "cpu"]
    rc, out, err = _run(capsys, base + ["--verify", verify])
    assert rc == 0, err
    da = json.loads(out)
    rc, out, _ = _run(capsys, base + ["--mode", "ar"])
    assert rc == 0
    ar = json.loads(out)
    assert da["settings"]["verify"] == verify
    assert [r["token_ids"] for r in da["results"]] == [r["token_ids"] for r in ar["results"]]
    assert all(len(r["token_ids"]) > 0 for r in da["results"])
    # bidirectional mask blocks (a dual-trained model's): still AR decoding's ids
    rc, out, err = _run(capsys, base + ["--verify", verify, "--mask-attention", "bidirectional"])
    assert rc == 0, err
    bi = json.loads(out)
    assert bi["settings"]["mask_attention"] == "bidirectional"
    assert da["settings"]["mask_attention"] == "causal"
    assert [r["token_ids"] for r in bi["results"]] == [r["token_ids"] for r in ar["results"]]
