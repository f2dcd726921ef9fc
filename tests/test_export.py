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


def _export_cli(src, out, *extra):
    return subprocess.run([sys.executable, "-m", "pipeline.export", str(src), str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_export_on_a_full_filesystem_is_one_line_exit_3_and_leaves_nothing(tmp_path):
    """A real full disk: a 256 KiB tmpfs (mounting needs root; skipped otherwise). The TP
    ranks' per-rank files fill it: one line naming OUT and the cause, exit 4, nothing left."""
    import os
    src = make_tiny_qwen3(tmp_path / "src", seed=1)           # about 0.6 MB of fp32 weights
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                                            str(disk)], capture_output=True).returncode != 0:
        import pytest
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = disk / "out"
        proc = _export_cli(src, out, "--tp", "2")
        assert proc.returncode == 4, proc.stderr[-3000:]
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1, proc.stderr
        assert err[0].startswith(f"export: error: {out}: no space left on device")
        assert "KiB free" in err[0] or "MiB free" in err[0]
        assert list(disk.iterdir()) == []                        # no partial output, no temp
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_export_disk_full_while_writing_the_folder(tmp_path, capsys, monkeypatch):
    """ENOSPC from the folder writer itself (the last safetensors file): exit 4, one line with
    the free space seen and the size of the weights, the temporary folder removed."""
    import errno

    from pipeline import export
    from pipeline.model import hf as hf_io
    src = make_tiny_qwen3(tmp_path / "src", seed=2, num_hidden_layers=1)
    capsys.readouterr()                                  # transformers' progress bar
    real = hf_io.write_safetensors

    def full(path, entries, metadata=None):
        real(path, entries, metadata)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(hf_io, "write_safetensors", full)
    out = tmp_path / "o"
    assert export.main([str(src), str(out)]) == 4
    err = [e for e in capsys.readouterr().err.strip().splitlines()
           if not e.startswith("export: warning: no tokenizer")]   # src has no tokenizer
    assert len(err) == 1 and err[0].startswith(f"export: error: {out}: no space left on device")
    assert "free on its filesystem; the weights take" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.setattr(hf_io, "write_safetensors", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.EDQUOT, "Disk quota exceeded")))
    assert export.main([str(src), str(out)]) == 4
    assert "disk quota exceeded" in capsys.readouterr().err
