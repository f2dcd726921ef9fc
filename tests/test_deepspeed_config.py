"""The DeepSpeed settings of a run config reach the engine the trainer builds.

`pipeline.train.Trainer.setup` builds a tiny bf16 ZeRO-3 engine in one gloo process; the test
reads the engine's own attributes (the ZeRO-3 optimizer's gradient-partition buffer dtype,
reduce dtype, bucket sizes, the parameter coordinator's prefetch size, which parameters stay
unpartitioned), not only the dict we pass to DeepSpeed.
"""
import os

import numpy as np

from distributed import run_distributed
from shard_fixtures import random_samples, tiny_model_yaml, write_shards

CONFIG = """\
run_dir: {run}
model:
  inline: """ + tiny_model_yaml() + """
data: {{dir: {data}, num_workers: 0, shuffle_buffer: 8}}
train: {{max_steps: 1, micro_batch_size: 2, precision: bf16, zero_stage: 3}}
wandb: {{mode: disabled}}
"""


def _engine_settings(cfg_path, overrides):
    import torch
    from pipeline.config import load_config, validate
    from pipeline.train import Trainer
    cfg = load_config(cfg_path, overrides)
    trainer = Trainer(cfg, validate(cfg, world_size=1))
    trainer.setup()
    eng = trainer.engine
    opt = eng.optimizer
    coord = opt.parameter_offload.get_param_coordinator()
    params = dict(eng.module.named_parameters())
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return {
        "param_dtype": name[params["embed_tokens.weight"].dtype],
        "grad_accum": name[opt.gradient_accumulation_dtype],
        "grad_buffer": name[opt.grad_partitions_flat_buffer.dtype],
        "reduce": name[opt.communication_data_type],
        "buckets": sorted(name[d] for d in opt.ipg_buckets),
        "reduce_bucket_size": opt.reduce_bucket_size,
        "prefetch": coord._PartitionedParameterCoordinator__prefetch_bucket_sz,
        "persistence": opt.parameter_offload.param_numel_persistence_threshold,
        "persistent": sorted(n for n, p in params.items() if getattr(p, "ds_persist", False)),
    }


def _body(rank, world_size, cfg_path):
    # Two trainers in one process: each its own run_dir (one job per run directory: the first
    # trainer's run lock is still held).
    run2 = os.path.join(os.path.dirname(cfg_path), "run2")
    return [_engine_settings(cfg_path, []),
            _engine_settings(cfg_path, [f"run_dir={run2}", "deepspeed.fp32_grad_accum=false",
                                        "deepspeed.reduce_bucket_size=5000",
                                        "deepspeed.prefetch_bucket_size=3000",
                                        "deepspeed.param_persistence_threshold=100000"])]


def test_bf16_zero3_engine_has_fp32_grads_and_derived_sizes(tmp_path):
    data = tmp_path / "data"
    write_shards(str(data), {"train": random_samples(np.random.default_rng(0), 8, vocab_size=64,
                                                     max_length=32)}, samples_per_shard=8)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run=tmp_path / "run", data=data))
    default, switched = run_distributed(_body, world_size=1, args=(str(cfg),))[0]
    # bf16 parameters; gradients accumulated and reduce-scattered in fp32 (the default)
    assert default["param_dtype"] == "bf16"
    assert (default["grad_accum"], default["grad_buffer"], default["reduce"]) == ("fp32",) * 3
    assert default["buckets"] == ["fp32"]
    # sizes derived from hidden size 32: h^2, 0.9 h^2, 10 h (DeepSpeed's defaults would be
    # 5e8, 5e7, 1e5, under which every parameter of this model would stay unpartitioned)
    assert (default["reduce_bucket_size"], default["prefetch"], default["persistence"]) == \
        (1024, 921, 320)
    assert default["persistent"] == sorted(
        [f"layers.{i}.{n}.weight" for i in range(2) for n in
         ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
          "self_attn.k_norm")] + ["norm.weight"])
    # the switch: bf16 accumulation and reduce (DeepSpeed's default); explicit sizes win
    assert (switched["grad_accum"], switched["grad_buffer"], switched["reduce"]) == ("bf16",) * 3
    assert switched["buckets"] == ["bf16"]
    assert (switched["reduce_bucket_size"], switched["prefetch"], switched["persistence"]) == \
        (5000, 3000, 100000)
    assert "embed_tokens.weight" in switched["persistent"]   # 2048 elements < 100000


def test_deepspeed_section_refuses_bad_sizes_in_one_line(tmp_path):
    import pytest
    from pipeline.config import ConfigError, load_config, validate
    data = tmp_path / "data"
    write_shards(str(data), {"train": random_samples(np.random.default_rng(0), 4, vocab_size=64,
                                                     max_length=32)}, samples_per_shard=4)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(CONFIG.format(run=tmp_path / "run", data=data))
    for override, message in (
            ("deepspeed.reduce_bucket_size=0", "deepspeed.reduce_bucket_size must be >= 1"),
            ("deepspeed.prefetch_bucket_size=-5", "deepspeed.prefetch_bucket_size must be >= 1"),
            ("deepspeed.param_persistence_threshold=-1",
             "deepspeed.param_persistence_threshold must be >= 0")):
        with pytest.raises(ConfigError) as e:
            validate(load_config(str(cfg_path), [override]), world_size=1)
        assert message in str(e.value) and "\n" not in str(e.value)
    validate(load_config(str(cfg_path), ["deepspeed.param_persistence_threshold=0"]), world_size=1)


def test_deepspeed_dict_by_precision_and_stage(tmp_path):
    """fp32 runs get no dtype keys; ZeRO stage 0 (no fp32 accumulation for bf16 params in
    DeepSpeed 0.19) gets only the fp32 all-reduce; stages 1-2 get the reduce bucket only."""
    from pipeline.config import load_config, validate
    from pipeline.training.engine import deepspeed_config
    data = tmp_path / "data"
    write_shards(str(data), {"train": random_samples(np.random.default_rng(0), 4, vocab_size=64,
                                                     max_length=32)}, samples_per_shard=4)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(CONFIG.format(run=tmp_path / "run", data=data))

    def ds(*overrides):
        cfg = load_config(str(cfg_path), list(overrides))
        return deepspeed_config(cfg, validate(cfg, world_size=1))

    fp32 = ds("train.precision=fp32")
    assert "communication_data_type" not in fp32 and "data_types" not in fp32
    stage0 = ds("train.zero_stage=0")
    assert stage0["communication_data_type"] == "fp32" and "data_types" not in stage0
    assert set(stage0["zero_optimization"]) == {"stage"}
    stage2 = ds("train.zero_stage=2")
    assert stage2["data_types"] == {"grad_accum_dtype": "fp32"}
    assert stage2["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    assert not any(k.startswith("stage3_") for k in stage2["zero_optimization"])
