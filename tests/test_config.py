"""Run config: schema, overrides, validation errors (one line, exit 2), derived batch layout, the
lr schedule (against torch's own schedulers) and the layout-independent random init (against
`hf_io`'s TP merge)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config, validate
from shard_fixtures import TINY_MODEL, random_samples, write_shards

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(TINY_MODEL)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfgdata") / "shards"
    rng = np.random.default_rng(0)
    write_shards(str(d), {"train": random_samples(rng, 40, vocab_size=64, max_length=16),
                          "val": random_samples(rng, 16, vocab_size=64, max_length=16)},
                 samples_per_shard=10, max_length=16)
    return d


def _cfg(tmp_path: Path, data_dir: Path, text: str | None = None, **sections) -> Path:
    base = {"run_dir": str(tmp_path / "run"), "model": {"inline": dict(MODEL)},
            "data": {"dir": str(data_dir), "num_workers": 0},
            "train": {"max_steps": 10, "micro_batch_size": 1}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    p = tmp_path / "run.yaml"
    p.write_text(text if text is not None else json.dumps(base))
    return p


def _error(path, overrides=(), world_size=1) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(str(path), list(overrides)), world_size=world_size)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_valid_config_and_derived_batch_layout(tmp_path, data_dir):
    path = _cfg(tmp_path, data_dir, train={"max_steps": 10, "micro_batch_size": 2,
                                           "global_batch_size": 8, "tensor_parallel_size": 2})
    plan = validate(load_config(str(path)), world_size=4)
    assert (plan.tp_size, plan.dp_size, plan.grad_accum_steps, plan.global_batch_size) == (2, 2, 2, 8)
    assert plan.row_length == 16 and plan.checkpoint_dir == str(tmp_path / "run" / "checkpoints")
    # overrides win over the file; GA given instead of the global batch
    plan = validate(load_config(str(path), ["train.global_batch_size=null",
                                            "train.grad_accum_steps=3"]), world_size=4)
    assert plan.global_batch_size == 2 * 3 * 2
    assert plan.model_fields.get("attention", "auto") == "auto"
    plan = validate(load_config(str(path), ["model.attention=flex"]), world_size=4)
    assert plan.model_fields["attention"] == "flex"
    from pipeline.training.engine import deepspeed_config
    ds = deepspeed_config(load_config(str(path)), plan)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * \
        ds["gradient_accumulation_steps"] * plan.dp_size
    assert ds["bf16"]["enabled"] and ds["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("overrides, world, expected", [
    (["train.tensor_parallel_size=2"], 3, "train.tensor_parallel_size=2 does not divide the world size 3"),
    (["train.tensor_parallel_size=8"], 8, "does not divide model num_attention_heads=4"),
    (["train.tensor_parallel_size=4"], 4, "does not divide model num_key_value_heads=2"),
    (["train.global_batch_size=6"], 4, "train.global_batch_size=6 is not a multiple of micro_batch_size x data-parallel size = 1 x 4"),
    (["train.global_batch_size=8", "train.grad_accum_steps=3"], 2, "train.global_batch_size=8 != micro_batch_size x grad_accum_steps"),
    (["train.max_stepz=3"], 1, "key 'train.max_stepz'"),
    (["train.max_steps=abc"], 1, "train.max_steps"),
    (["train.nan_policy=retry"], 1, "train.nan_policy must be stop or skip"),
    (["train.precision=fp16"], 1, "train.precision must be bf16 or fp32"),
    (["wandb.mode=cloud"], 1, "wandb.mode must be online, offline or disabled"),
    (["optim.warmup_steps=11"], 1, "optim.warmup_steps must be in [0, train.max_steps=10]"),
    (["optim.schedule=step"], 1, "optim.schedule must be one of cosine|wsd, got 'step'"),
    (["optim.schedule=wsd", "optim.decay_shape=exp"], 1, "optim.decay_shape must be one of linear|1-sqrt|cosine"),
    (["optim.schedule=wsd", "optim.decay_steps=11"], 1, "optim.decay_steps must be in [1, train.max_steps=10], got 11"),
    (["optim.schedule=wsd", "optim.decay_fraction=0"], 1, "optim.decay_fraction must be in (0, 1], got 0"),
    (["optim.schedule=wsd", "optim.warmup_steps=5", "optim.decay_steps=6"], 1, "optim.warmup_steps=5 overlaps the wsd decay (the last 6 of train.max_steps=10 steps)"),
    (["model.preset=configs/model/nope.yaml"], 1, "model.preset: file not found"),
    (["model.inline.num_key_value_heads=3"], 1, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (["model.inline.vocab_size=32"], 1, "tokenizer.vocab_size 64 > model vocab_size 32"),
    (["data.dir=/nonexistent/shards"], 1, "data.dir: /nonexistent/shards: no manifest.json"),
    (["data.train_split=dev"], 1, "data.train_split: no split 'dev'"),
    (["train.eval_interval=5", "data.val_split=test"], 1, "data.val_split: no split 'test'"),
    (["data.packing=first_fit"], 1, "data.packing must be next_fit or best_fit, got 'first_fit'"),
    (["data.on_shard_change=always"], 1, "data.on_shard_change must be refuse or new_pass, got 'always'"),
    (["data.max_length=8"], 1, "data.max_length=8 is shorter than the shards' max_length 16"),
    (["init.source=hf"], 1, "init.source=hf needs init.hf_path"),
    (["init.source=hf", "init.hf_path=/nonexistent"], 1, "init.hf_path: no config.json in /nonexistent"),
    (["objective.mode=bert"], 1, "objective: objective.mode must be 'refusion' or 'ar'"),
    (["train.offload_params=true", "train.zero_stage=2"], 1, "train.offload_params needs train.zero_stage=3"),
    (["checkpoint.keep=0"], 1, "checkpoint.keep must be >= 1"),
    (["model.attention=flash"], 1, "model.attention must be one of auto|sdpa|flex|varlen, got 'flash'"),
    (["log.peak_tflops=0"], 1, "log.peak_tflops must be > 0"),
    (["train.activation_checkpointing=sometimes"], 1,
     "train.activation_checkpointing: recompute must be one of none|selective|full"),
    (["train.loss_impl=liger"], 1, "train.loss_impl must be one of chunked|fused|torch, got 'liger'"),
    (["train.loss_chunk_tokens=0"], 1, "train.loss_chunk_tokens must be >= 1"),
    (["train.loss_impl=torch", "train.tensor_parallel_size=2"], 2,
     "train.loss_impl=torch needs train.tensor_parallel_size=1"),
    (["optim.fused=true", "optim.impl=deepspeed"], 1, "optim.fused needs optim.impl=torch"),
])
def test_validation_errors_name_the_key(tmp_path, data_dir, overrides, world, expected):
    assert expected in _error(_cfg(tmp_path, data_dir), overrides, world)


def test_activation_checkpointing_modes_and_the_boolean_alias(tmp_path, data_dir):
    """`train.activation_checkpointing` takes none|selective|full and the old true/false (=
    full/none); the model's `recompute` field gets the mode."""
    path = _cfg(tmp_path, data_dir)
    for value, mode in (("selective", "selective"), ("full", "full"), ("none", "none"),
                        ("true", "full"), ("false", "none")):
        plan = validate(load_config(str(path), [f"train.activation_checkpointing={value}"]))
        assert plan.model_fields["recompute"] == mode, value
    assert validate(load_config(str(path))).model_fields["recompute"] == "none"


def test_missing_required_keys_and_files(tmp_path, data_dir):
    assert "run_dir" in _error(_cfg(tmp_path, data_dir, text="train: {max_steps: 3}\n"))
    assert "config file not found" in _error(tmp_path / "absent.yaml")
    bad = _cfg(tmp_path, data_dir, text="train: [1, 2\n")
    assert "cannot parse YAML" in _error(bad)
    assert "not of the form key=value" in _error(_cfg(tmp_path, data_dir), ["train.max_steps"])


def test_hf_folder_supplies_the_model_shape(tmp_path, data_dir):
    from tiny_qwen3 import make_tiny_qwen3
    hf = make_tiny_qwen3(tmp_path / "hf", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    path = _cfg(tmp_path, data_dir, text=json.dumps({
        "run_dir": str(tmp_path / "run"), "init": {"source": "hf", "hf_path": str(hf)},
        "data": {"dir": str(data_dir), "num_workers": 0}, "train": {"max_steps": 2}}))
    plan = validate(load_config(str(path)), world_size=2)
    assert plan.model_fields["hidden_size"] == 32 and plan.model_fields["num_layers"] == 2
    # an inline shape that disagrees with the checkpoint is refused
    msg = _error(path, ["model.inline.hidden_size=48"])
    assert "model hidden_size=48 differs from hidden_size=32 of the HF checkpoint" in msg


def test_cli_config_error_is_one_line_and_exit_2(tmp_path, data_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE"):
        env.pop(k, None)
    path = _cfg(tmp_path, data_dir)
    r = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(path),
                        "train.tensor_parallel_size=3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "Warning" not in ln
             and not ln.startswith("  ")]
    assert lines == ["pipeline.train: config error: train.tensor_parallel_size=3 does not divide "
                     "the world size 1"], r.stderr
    r = subprocess.run([sys.executable, "-m", "pipeline.train"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--config" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("warmup, max_steps, min_lr", [(5, 40, 1e-5), (0, 10, 0.0), (10, 10, 0.0)])
def test_lr_schedule_matches_torch_schedulers(warmup, max_steps, min_lr):
    """Linear warmup + cosine, against torch.optim.lr_scheduler.LinearLR/CosineAnnealingLR."""
    from pipeline.training.schedule import lr_at
    lr = 3e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, max_steps - warmup),
                                                     eta_min=min_lr)
    if warmup:
        lin = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0,
                                                total_iters=max(1, warmup - 1))
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [lin, cos], milestones=[warmup])
    else:
        sched = cos
    for step in range(max_steps):
        assert lr_at(step, lr, min_lr, warmup, max_steps) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), step
        opt.step()
        sched.step()


def test_random_init_is_independent_of_the_tp_layout():
    """TP=2 shards of the seeded init, merged by hf_io, equal the TP=1 init (HF names)."""
    from pipeline.model import hf as hf_io
    from pipeline.model import ModelConfig
    from pipeline.model.init import random_tp_shards
    cfg = ModelConfig.from_dict(dict(MODEL, init_std=0.05))
    one = hf_io.merge_tp_state_dicts([dict(random_tp_shards(cfg, 3, 0, 1))], cfg)
    two = hf_io.merge_tp_state_dicts([dict(random_tp_shards(cfg, 3, r, 2)) for r in range(2)], cfg)
    assert sorted(one) == sorted(two)
    for k in one:
        assert torch.equal(one[k], two[k]), k
    q = one["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (32, 32) and abs(float(q.std()) - 0.05) < 0.01
    down = one["model.layers.1.mlp.down_proj.weight"]
    assert abs(float(down.std()) - 0.05 / 2.0) < 0.006  # std / sqrt(2 * num_layers)
    assert torch.equal(one["model.norm.weight"], torch.ones(32))
    other = hf_io.merge_tp_state_dicts([dict(random_tp_shards(cfg, 4, 0, 1))], cfg)
    assert not torch.equal(other["model.embed_tokens.weight"], one["model.embed_tokens.weight"])


def test_shipped_run_configs_validate(tmp_path, data_dir):
    """configs/*.yaml load against the schema; with their required paths given they validate
    for the launch they are written for (Qwen3-8B: 32 processes, TP=2 -> GA 4)."""
    from pipeline.model import hf as hf_io
    from pipeline.model import ModelConfig
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in shipped} >= {"tiny_cpu.yaml", "qwen3_8b.yaml"}
    os.chdir(ROOT)  # presets are relative to the repository root
    for p in shipped:
        load_config(str(p))
    plan = validate(load_config("configs/tiny_cpu.yaml", [f"data.dir={data_dir}"]), world_size=2)
    assert (plan.dp_size, plan.grad_accum_steps) == (2, 1)
    assert ("set exactly one of data.dir (one shard folder) and data.sources (a mixture); neither "
            "is set") in _error("configs/qwen3_8b.yaml")
    assert "init.source=hf needs init.hf_path" in _error("configs/qwen3_8b.yaml",
                                                         [f"data.dir={data_dir}"], world_size=32)
    hf = tmp_path / "qwen3_8b_config_only"
    hf.mkdir()
    cfg8b = ModelConfig.from_yaml("configs/model/qwen3_8b.yaml")
    (hf / "config.json").write_text(json.dumps(hf_io.hf_config_dict(cfg8b)))
    plan = validate(load_config("configs/qwen3_8b.yaml", [f"data.dir={data_dir}", f"init.hf_path={hf}",
                                                          "data.num_workers=1"]), world_size=32)
    assert (plan.tp_size, plan.dp_size, plan.grad_accum_steps) == (2, 16, 4)
    assert plan.model_fields["recompute"] == "full" and plan.row_length == 4096
    # the dual-stream recipe (docs/EXPERIMENTS.md run 5's dual_refusion_ar16) at the 8B shape:
    # rows of 2 x 4096 tokens, half the rows, so the tokens per step of the paper's config
    cfg = load_config("configs/qwen3_8b_dual.yaml", [f"data.dir={data_dir}", f"init.hf_path={hf}",
                                                      "data.num_workers=1"])
    dual = validate(cfg, world_size=32)
    assert (dual.tp_size, dual.dp_size, dual.grad_accum_steps) == (2, 16, 4)
    assert (cfg.objective.mode, cfg.objective.dual_masking, cfg.objective.ar_weight) == (
        "dual", "refusion", 16)
    assert dual.row_length == 8192 and dual.model_fields == plan.model_fields
    assert dual.global_batch_size * dual.row_length == plan.global_batch_size * plan.row_length
    from omegaconf import OmegaConf

    from pipeline.objective import ObjectiveConfig
    ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))   # the trainer's check


def _enum_spellings() -> set[tuple[str, str]]:
    """(key, value) of every enum setting's value as the docs write it (`key=value`,
    `key=a|b`, `key = a | b | c`) and as validate's messages list its choices
    (`key must be a, b or c`); an enum setting is a text setting listed with alternatives."""
    import re
    from pipeline.config import _text_keys
    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in [root / "README.md", root / "ARCHITECTURE.md",
                                     *root.glob("docs/*.md"), *root.glob("data_prep/*.md"),
                                     *root.glob("pipeline/**/*.py")]]
    keys, out, enums = _text_keys(), set(), set()
    word = r"[A-Za-z0-9_-]+"
    for text in texts:
        for m in re.finditer(rf"\b([a-z_]+\.[a-z_]+) ?= ?({word}(?: ?\| ?{word})*)", text):
            if m.group(1) in keys:
                out |= {(m.group(1), v.strip()) for v in m.group(2).split("|")}
                if "|" in m.group(2):
                    enums.add(m.group(1))
        for m in re.finditer(rf"([a-z_]+\.[a-z_]+) must be ((?:{word}, )*{word}) or ({word}), got",
                             text):
            if m.group(1) in keys:
                out |= {(m.group(1), v) for v in [*m.group(2).split(", "), m.group(3)]}
                enums.add(m.group(1))
    return {(k, v) for k, v in out if k in enums}


def test_every_documented_enum_spelling_is_read_as_written(tmp_path, data_dir):
    """`data.verify_shards=off` (YAML reads `off` as a boolean) and every other documented
    value of a text setting, on the command line and in the YAML file, reach validate as the
    word written, and validate does not reject it as a choice."""
    spellings = _enum_spellings()
    assert {("data.verify_shards", "off"), ("data.verify_shards", "warn"),
            ("wandb.mode", "disabled"), ("train.precision", "fp32")} <= spellings
    assert len({k for k, _ in spellings}) >= 8
    base = _cfg(tmp_path, data_dir)
    for key, value in sorted(spellings):
        section, name = key.split(".")
        doc = json.loads(base.read_text())
        doc.setdefault(section, {})[name] = "@VALUE@"
        yaml_file = tmp_path / f"{section}-{name}-{value}.yaml"  # the word bare, as YAML
        yaml_file.write_text(json.dumps(doc).replace('"@VALUE@"', value))
        for cfg in (load_config(str(base), [f"{key}={value}"]), load_config(str(yaml_file))):
            got = cfg[section][name]
            assert got == value, (key, value, got)
            try:
                validate(cfg, world_size=1)
            except ConfigError as e:  # another rule may object (e.g. init.source=hf needs a path)
                assert f"{key} must be" not in str(e), (key, value, str(e))
