"""Export of a real training checkpoint: `pipeline.train` runs TP=2 x DP=2 ZeRO-3 (4 processes,
fp32) for a few steps; `pipeline.export` turns its checkpoint into a Hugging Face folder;
transformers' Qwen3ForCausalLM loaded from it gives the logits of the trained model, which are
computed independently of the export code: the trainer's own engine resumed from the
checkpoint (4 processes), vocab-parallel logits all-gathered over the TP group.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_distributed
from pipeline.parallel import free_port
from shard_fixtures import random_samples, tiny_model_yaml, write_shards

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """\
run_dir: {run}
model:
  inline: """ + tiny_model_yaml(init_std=0.2) + """
data: {{dir: {data}, num_workers: 0, shuffle_buffer: 8}}
optim: {{lr: 1.0e-2, warmup_steps: 0}}
train: {{max_steps: 3, micro_batch_size: 2, precision: fp32, zero_stage: 3,
        tensor_parallel_size: 2}}
checkpoint: {{interval: 0, keep: 1}}
wandb: {{mode: disabled}}
"""
PROBE = torch.tensor([[3, 17, 5, 42, 9, 11, 60, 7], [8, 8, 21, 33, 2, 50, 13, 4]])


def _trained_logits(rank, world_size, cfg_path):
    """Rebuild the trainer (auto-resume from its checkpoint) and return full-vocab logits."""
    from pipeline.config import load_config, validate
    from pipeline.model import gather_logits
    from pipeline.train import Trainer
    cfg = load_config(cfg_path)
    trainer = Trainer(cfg, validate(cfg, world_size=world_size))
    trainer.setup()
    assert trainer.step == 3                      # resumed, not a fresh model
    # precision fp32 must mean fp32 parameters (deepspeed 0.19 zero.Init(dtype=...) on CPU
    # silently picks bf16; the trainer must let the DeepSpeed config choose)
    assert all(p.dtype == torch.float32 for p in trainer.engine.module.parameters())
    engine = trainer.engine
    engine.eval()
    pos = torch.arange(PROBE.shape[1]).expand_as(PROBE)
    with torch.no_grad():
        shard = engine(PROBE, pos)
    return gather_logits(shard)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_ckpt")
    rng = np.random.default_rng(1)
    write_shards(str(tmp / "data"), {"train": random_samples(rng, 48, vocab_size=64,
                                                            max_length=24)},
                 samples_per_shard=12)
    cfg = tmp / "run.yaml"
    cfg.write_text(CONFIG.format(run=tmp / "run", data=tmp / "data"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_port", str(free_port()), "-m", "pipeline.train", "--config", str(cfg)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ckdir = tmp / "run" / "checkpoints"
    assert (ckdir / "latest").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    assert (ckdir / "latest").read_text() == "step_000000003"
    return tmp, cfg, ckdir


def test_export_training_checkpoint_matches_trained_model(trained):
    from transformers import AutoModelForCausalLM

    from pipeline import export
    from pipeline.model.tp import partition_dim
    tmp, cfg, ckdir = trained
    info = json.loads((ckdir / "step_000000003" / "refusion_layout.json").read_text())
    assert info["tp_size"] == 2 and info["dp_size"] == 2
    # the recorded partition dims agree with the model engineer's independent table
    assert {k: v["partition_dim"] for k, v in info["params"].items()} == {
        k: partition_dim(k) for k in info["params"]}

    out = tmp / "hf"
    assert export.main([str(ckdir), str(out), "--dtype", "float32"]) == 0
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["mask_token_id"] == 2 and hf_cfg["eos_token_id"] == 1  # from the manifest
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(PROBE).logits

    ref = run_distributed(_trained_logits, 4, (str(cfg),))
    torch.testing.assert_close(ref[0], ref[3])                  # every rank agrees
    print(f"max abs logit difference HF export vs trained model: "
          f"{(hf_logits - ref[0]).abs().max().item():.2e}")
    torch.testing.assert_close(hf_logits, ref[0], rtol=1e-4, atol=1e-4)


def test_export_cli_rejects_incomplete_checkpoint(tmp_path, capsys):
    from pipeline import export
    (tmp_path / "ck" / "step_000000005.partial").mkdir(parents=True)
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("export: error:") and len(err.strip().splitlines()) == 1


@pytest.fixture()
def fake_run(tmp_path, monkeypatch):
    """A complete step folder whose rank-0 client_state records `data.dir` (a shard folder with
    a data_prep SentencePiece copy in `tokenizer/`); the DeepSpeed consolidation is replaced by
    a tiny HF model's tensors (what is tested here is only the tokenizer choice)."""
    from data_prep import stdlib_corpus, train_tokenizer
    from pipeline import checkpoint
    from pipeline.model import hf as hf_io
    from tiny_qwen3 import make_tiny_qwen3
    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for rel in ("textwrap.py", "string.py", "bisect.py"):
        (corpus / rel.replace(".py", ".txt")).write_bytes(
            Path(stdlib_corpus.stdlib_root(), rel).read_bytes())
    assert train_tokenizer.main(["--input", str(corpus), "--output",
                                 str(data / "tokenizer" / "tokenizer.model"),
                                 "--vocab-size", "600"]) == 0
    (data / "manifest.json").write_text(json.dumps(
        {"tokenizer": {"kind": "spm", "files": "tokenizer", "eos_id": 3, "mask_id": 4}}))
    step = tmp_path / "ck" / "step_000000007"
    step.mkdir(parents=True)
    torch.save({"client_state": {"config": {"data": {"dir": str(data)}}}},
               step / "refusion_rank_00000.pt")
    (step / "refusion_meta.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_000000007")
    src = make_tiny_qwen3(tmp_path / "tiny", vocab_size=600, hidden_size=16, head_dim=8,
                          num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                          num_hidden_layers=1)
    from transformers import Qwen3ForCausalLM
    state = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    monkeypatch.setattr(checkpoint, "hf_export_state",
                        lambda d: (state, hf_io.config_from_hf(src), {"eos_token_id": 3}))
    return tmp_path / "ck", data


def test_export_checkpoint_defaults_to_the_runs_shard_tokenizer(fake_run, tmp_path, capsys):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from pipeline.tokenizer import SPMTokenizer, load_tokenizer
    from pipeline import export
    ck, data = fake_run
    out = tmp_path / "hf"
    assert export.main([str(ck), str(out)]) == 0
    assert f"tokenizer from the run's shards: {data / 'tokenizer'}" in capsys.readouterr().err
    model = data / "tokenizer" / "tokenizer.model"
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tok = AutoTokenizer.from_pretrained(out)
    assert (len(tok), tok.eos_token_id) == (600, 3)
    assert tok.encode("hello world", add_special_tokens=False) == sp.EncodeAsIds("hello world")
    assert isinstance(load_tokenizer(str(out)), SPMTokenizer)
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == 4


def test_export_checkpoint_without_tokenizer_warns(fake_run, tmp_path, capsys):
    import shutil

    from pipeline import export
    ck, data = fake_run
    shutil.rmtree(data)                     # the shards are gone
    out = tmp_path / "hf"
    assert export.main([str(ck / "step_000000007"), str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export: warning: no tokenizer written"), err
    assert "--tokenizer" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_zero3_per_tensor_reader_equals_deepspeed_zero_to_fp32(trained):
    """Our per-parameter ZeRO-3 reader against DeepSpeed's own consolidation of the same TP
    rank (`get_fp32_state_dict_from_zero_checkpoint`): every parameter and row range exactly,
    also when the optimizer files are unmapped after every read."""
    from pipeline.checkpoint import consolidate as checkpoint
    _, _, ckdir = trained
    step = ckdir / "step_000000003"
    for tp_rank in (0, 1):
        want = checkpoint._per_tp_rank_state_dict(step, tp_rank)     # DeepSpeed's zero_to_fp32
        for remap in (0, 128 * 2 ** 20):
            rd = checkpoint._Zero3RankReader(step, tp_rank, remap_bytes=remap)
            assert rd.dp == 2 and set(rd.shapes) == set(want)
            for name, w in want.items():
                assert torch.equal(rd.read(name), w), (tp_rank, name)
                if w.dim() == 2 and w.shape[0] > 3:
                    assert torch.equal(rd.read(name, 1, w.shape[0] - 1), w[1:-1]), name
            rd.close()
    readers, _ = checkpoint.open_tp_ranks(ckdir)
    assert all(isinstance(r, checkpoint._Zero3RankReader) for r in readers)


def test_checkpoint_loads_for_inference_like_its_export(trained, tp1, tmp_path, monkeypatch):
    """Issue 9: a training checkpoint loads straight into the model (no Hugging Face folder
    written, no whole-model state in memory): the same weights, bit for bit, and the same
    decoded tokens as its exported folder, in fp32 and in bf16."""
    from pipeline import export
    from pipeline.model import hf as hf_io
    from pipeline.inference.decoding import ar_generate, refusion_generate
    from pipeline.inference.loading import load_model
    _, _, ckdir = trained
    folder = tmp_path / "hf"
    assert export.main([str(ckdir), str(folder), "--dtype", "float32"]) == 0

    def no_folder(*a, **k):
        raise AssertionError("a Hugging Face folder was written")
    monkeypatch.setattr(hf_io, "save_hf_folder", no_folder)
    monkeypatch.setattr(hf_io, "write_safetensors", no_folder)
    prompts = [PROBE[0, :5].tolist(), PROBE[1, :3].tolist()]
    for dtype in (torch.float32, torch.bfloat16):
        from_ckpt, cfg, _ = load_model(ckdir, dtype, device="cpu")
        from_hf, _, _ = load_model(folder, dtype, device="cpu")
        a, b = dict(from_ckpt.named_parameters()), dict(from_hf.named_parameters())
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == dtype and torch.equal(a[k], b[k]), k
        for m in (from_ckpt, from_hf):
            assert m.lm_head.weight is not m.embed_tokens.weight   # untied model stays untied
        outs = [(ar_generate(m, prompts, 8, 0.0, None).tokens,
                 refusion_generate(m, prompts, 8, 4, 1, 0.5, 0.3, 0.0, 2, 1).tokens)
                for m in (from_ckpt, from_hf)]
        assert outs[0] == outs[1] and len(outs[0][0][0]) == 8
