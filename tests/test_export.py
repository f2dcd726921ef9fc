"""`python -m pipeline.export`: HF folder -> our model sharded over 2 TP ranks -> merged -> HF
folder that transformers loads with identical tensors and the ReFusion tokens."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from tiny_qwen3 import make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]


def test_export_round_trip_tp2_with_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = make_tiny_qwen3(tmp_path / "src", seed=6, with_tokenizer=True, hidden_size=16,
                          head_dim=8, num_attention_heads=2, num_key_value_heads=2,
                          intermediate_size=32, num_hidden_layers=2)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pipeline.export", str(src), str(out),
                           "--tp", "2", "--max-shard-bytes", "8000000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors.index.json").is_file()  # 19 MB over 8 MB shards
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(["<|beginoftext|>", "<|mask|>"]) == [151669, 151670]
    assert len(tok) == 151671
    hc = json.loads((out / "config.json").read_text())
    assert hc["vocab_size"] == 151936 and hc["mask_token_id"] == 151670
    assert not list(tmp_path.glob(".out.tmp-*"))  # the temporary folder was renamed away
    assert not list(tmp_path.glob(".export-tp-*"))  # per-rank files removed


def test_export_user_errors(tmp_path, capsys):
    from pipeline.export import main
    assert main([str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing: no such file or folder" in err[0]
    src = make_tiny_qwen3(tmp_path / "src", num_hidden_layers=1)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    assert main([str(src), str(busy)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (busy / "x").read_text() == "keep"
    assert main([str(src), str(tmp_path / "o"), "--tp", "4"]) == 2  # 2 KV heads, TP 4
    assert "not a multiple of the tensor-parallel size 4" in capsys.readouterr().err
