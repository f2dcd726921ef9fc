"""Checkpoint files are read with `weights_only=True` and an allow-list
(`pipeline.checkpoint.safe_load`): a checkpoint folder whose pickles would run code is refused
by `python -m pipeline.export` and `python -m pipeline.evaluate` with one line naming the file
and the global, exit code 2, and the code is never run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.common.cli import EXIT_USAGE
from shard_fixtures import TINY_MODEL
from tiny_qwen3 import qwen_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickles as `exec(code)`: creates `marker` when a loader runs the pickle's code."""

    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self):
        return (exec, (self.code,))


def _step_folder(root: Path, files: dict[str, object], model_config: dict | None = None) -> Path:
    """A complete step folder shaped like ours (meta, layout, model config) holding `files`
    ({name: object saved with torch.save})."""
    step = root / "ckpt" / "step_000000001"
    step.mkdir(parents=True)
    (step / "refusion_meta.json").write_text(json.dumps(
        {"step": 1, "tag": step.name, "world_size": 1, "tp_size": 1, "dp_size": 1}))
    (step / "refusion_layout.json").write_text(json.dumps(
        {"tp_size": 1, "dp_size": 1, "params": {}}))
    (step / "refusion_model_config.json").write_text(json.dumps(model_config or {}))
    for name, obj in files.items():
        torch.save(obj, step / name)
    return step


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _assert_refused(proc: subprocess.CompletedProcess, bad_file: Path, marker: Path) -> None:
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(bad_file) in lines[0] and "exec" in lines[0] and "allow-list" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_payload_runs_code_when_loaded_without_the_allow_list(tmp_path):
    """The control: the same file loaded with `weights_only=False` does run the code."""
    marker = tmp_path / "ran"
    torch.save({"module": _Payload(marker)}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("cli", ["export", "evaluate"])
def test_cli_refuses_a_zero3_model_states_file_that_runs_code(tmp_path, cli):
    marker = tmp_path / "ran"
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    step = _step_folder(tmp_path, {
        name: {"module": _Payload(marker), "param_shapes": []},
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {}}})
    if cli == "export":
        proc = _cli("pipeline.export", step.parent, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    else:
        proc = _cli("pipeline.evaluate", "--model", step.parent, "--data",
                    tmp_path / "none.jsonl", "--tokenizer", qwen_tokenizer_dir())
    _assert_refused(proc, step / name, marker)


def test_export_checks_zero2_files_before_deepspeed_unpickles_them(tmp_path):
    """ZeRO 1-2 ranks are merged by DeepSpeed's zero_to_fp32 (weights_only=False): every file
    is checked with the allow-list first."""
    marker = tmp_path / "ran"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    step = _step_folder(tmp_path, {"mp_rank_00_model_states.pt": {"module": {}},
                                   name: {"optimizer_state_dict": _Payload(marker)}})
    proc = _cli("pipeline.export", step, tmp_path / "out")
    _assert_refused(proc, step / name, marker)


def test_evaluate_refuses_a_rank_file_that_runs_code(tmp_path):
    """Rank 0's `refusion_rank_00000.pt` (the run settings evaluate reads first)."""
    marker = tmp_path / "ran"
    name = "refusion_rank_00000.pt"
    step = _step_folder(tmp_path, {name: {"client_state": _Payload(marker), "rng": {}}})
    proc = _cli("pipeline.evaluate", "--model", step, "--data", tmp_path / "none.jsonl")
    _assert_refused(proc, step / name, marker)


def test_run_tokenizer_lookup_does_not_swallow_a_refused_rank_file(tmp_path):
    """Export's tokenizer lookup reads the same file: it reports it instead of ignoring it."""
    from pipeline.checkpoint.safe_load import UnsafeCheckpointError
    from pipeline.export import run_tokenizer_dir
    marker = tmp_path / "ran"
    step = _step_folder(tmp_path, {"refusion_rank_00000.pt": {"client_state": _Payload(marker)}})
    with pytest.raises(UnsafeCheckpointError, match="refusion_rank_00000.pt: .* exec"):
        run_tokenizer_dir(step)
    assert not marker.exists()


def test_reshard_checks_zero3_files_before_deepspeed_converts_them(tmp_path):
    """Resuming on another layout hands the step folder's ZeRO-3 files to DeepSpeed's
    ds_to_universal (weights_only=False): every file is checked with the allow-list first."""
    from pipeline.checkpoint import reshard
    from pipeline.checkpoint.safe_load import UnsafeCheckpointError
    marker = tmp_path / "ran"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    step = _step_folder(tmp_path, {"zero_pp_rank_0_mp_rank_00_model_states.pt": {"module": {}},
                                   name: {"optimizer_state_dict": _Payload(marker)}},
                        model_config=dict(TINY_MODEL))
    with pytest.raises(UnsafeCheckpointError, match=f"{name}: not loaded: it names exec"):
        reshard.convert_to_universal(step, 1)
    assert not marker.exists()


def test_numpy_state_pickled_by_numpy_1_and_2_both_load(tmp_path):
    """A rank file's numpy RNG state names `_reconstruct` by the writing numpy's module path:
    `numpy.core.multiarray` (numpy 1.x) or `numpy._core.multiarray` (numpy 2). Both load,
    to the same array; a legacy (non-zip) torch file lets the test rewrite the name."""
    import numpy as np
    from pipeline.checkpoint.safe_load import load_checkpoint_file
    state = {"rng": {"numpy": np.random.RandomState(3).get_state()}}
    path = tmp_path / "rank.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    names = [n for n in (b"numpy._core.multiarray", b"numpy.core.multiarray") if n in raw]
    assert len(names) == 1, "the writing numpy names _reconstruct by one of the two paths"
    other = (b"numpy.core.multiarray" if names[0] == b"numpy._core.multiarray"
             else b"numpy._core.multiarray")
    renamed = tmp_path / "renamed.pt"
    renamed.write_bytes(raw.replace(names[0], other))
    for p in (path, renamed):
        got = load_checkpoint_file(p)["rng"]["numpy"]
        assert got[0] == state["rng"]["numpy"][0]
        assert np.array_equal(got[1], state["rng"]["numpy"][1]) and got[1].dtype == np.uint32
