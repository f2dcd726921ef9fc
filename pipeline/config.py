"""Run configuration: the schema of `configs/*.yaml`, command-line overrides, validation.

Owns: `RunConfig`, merging YAML + `key=value` overrides, and every check that can be done
before a process group or tensor exists (batch arithmetic, TP divisibility, files that must
exist, vocabulary vs. tokenizer). Must not touch: process groups, models, data loading (it
reads only small JSON/YAML files). Usage: `validate(load_config(path, overrides), world_size)`.

Batch arithmetic (Megatron names): global batch = micro-batch x gradient-accumulation steps x
data-parallel size, data-parallel size = world size / tensor-parallel size. Give either
`train.global_batch_size` or `train.grad_accum_steps` (or both, then they must agree).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A user error in the run config: the message is one line naming the file/key."""


@dataclass
class ModelSection:
    """Network shape: a preset YAML (`configs/model/*.yaml`, fields of
    `pipeline.model.ModelConfig`) and/or inline fields that override it. `attention`: the
    attention kernel of packed forwards, auto|sdpa|flex|varlen (what each picks:
    `pipeline.model.resolve_attention`; decoding always uses SDPA); None keeps the preset's
    value (else auto). Not part of the checkpointed shape: a run may resume with another
    kernel."""
    preset: Optional[str] = None
    inline: Dict[str, Any] = field(default_factory=dict)
    attention: Optional[str] = None


@dataclass
class InitSection:
    """Initial weights. `source`: "random" (seeded, identical for every TP/DP layout) or
    "hf" (a Hugging Face Qwen3 folder at `hf_path`, this TP rank's slices copied in). The random
    init's std is the model's `init_std` field."""
    source: str = "random"
    hf_path: Optional[str] = None


@dataclass
class SourceSection:
    """One corpus of a data mixture (`data.sources`, `pipeline.data.mixture`): `name` (unique;
    the key of its metrics), `dir` (its shard folder), `weight` (its share of the training
    tokens, > 0; the weights are normalized to sum 1: a token share, not a sample share),
    `max_epochs` (at most this many passes over its training split, checked at start-up;
    null = no limit)."""
    name: str = MISSING
    dir: str = MISSING
    weight: float = MISSING
    max_epochs: Optional[float] = None


@dataclass
class DataSection:
    """Shards written by `data_prep/shard.py` (a folder, local path or fsspec URL) and how
    `pipeline.data.build_loader` reads them. `max_length`: tokens per row (None = the
    manifest's max_length); `pack`: pack several samples per row; `packing`: how
    (`best_fit`: best-fit decreasing within each shuffle window, `next_fit`: window order);
    `num_workers`: loader worker processes per rank (may change on resume: it does not change
    the batches); `shuffle_buffer`: window of the shuffle and of packing, in samples.
    `verify_shards`: "error" (default) stops with one line naming a shard (and sample) that
    differs from manifest.json, "warn" prints that line and trains on, "off" skips the check
    (what is checked when: `pipeline.data.shard_io`).
    `on_shard_change`: what a resumed run does when the training split's shard set differs from
    its checkpoint's: "refuse" (default: one line, exit 2) or "new_pass": keep weights,
    optimizer, step and lr schedule and start a new epoch over the new set (same tokenizer;
    `pipeline.data.ShardLoader.load_state_dict`).
    `sources`: a data mixture instead of `dir` (exactly one of the two), a list of
    `SourceSection` with one tokenizer, read with the settings above (ARCHITECTURE.md
    "Mixtures"). `phase`: the data phase; a resume with other sources or weights (or a changed
    shard set of a source) is refused unless `phase` is raised: a new phase keeps every
    source's read position, weights, optimizer, step and lr schedule (which may change with it,
    as with `optim.override_schedule`)."""
    dir: Optional[str] = None
    sources: List[SourceSection] = field(default_factory=list)
    phase: int = 0
    train_split: str = "train"
    val_split: str = "val"
    max_length: Optional[int] = None
    pack: bool = False
    packing: str = "best_fit"
    num_workers: int = 1
    shuffle_buffer: int = 1000
    verify_shards: str = "error"
    on_shard_change: str = "refuse"


@dataclass
class OptimSection:
    """AdamW with a learning-rate schedule (`pipeline.training.schedule.lr_at`): linear warmup
    over `warmup_steps`, then `schedule` "cosine" (to `min_lr` at `train.max_steps`) or "wsd"
    (warmup-stable-decay: `lr` until the last `decay_steps` steps, or the last
    `decay_fraction` of `train.max_steps` when `decay_steps` is null, which decay to `min_lr`
    with `decay_shape` "linear", "1-sqrt" or "cosine"). A resume whose schedule would change
    the lr of a step already taken or of the next one (e.g. a larger `train.max_steps` under
    cosine) is refused in one line unless `override_schedule: true` (the new schedule applies
    from the resumed step) or `data.on_shard_change=new_pass` starts a new pass.
    `grad_clip`: max global gradient L2 norm (0 disables). `impl`: "torch" uses
    torch.optim.AdamW (no C++ build), "deepspeed" lets DeepSpeed build its own AdamW (FusedAdam
    on GPU, DeepSpeedCPUAdam with optimizer offload). `fused` (with impl=torch):
    `torch.optim.AdamW(fused=True)`, same arithmetic (`pipeline.training.engine.make_torch_adamw`);
    off by default (docs/PERFORMANCE.md)."""
    lr: float = 2e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    decay_fraction: float = 0.1
    decay_steps: Optional[int] = None
    decay_shape: str = "linear"
    override_schedule: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    impl: str = "torch"
    fused: bool = False


@dataclass
class TrainSection:
    """Steps, batch layout, precision and parallelism.

    `max_steps`: optimizer steps. `micro_batch_size`: rows per micro-batch per data-parallel
    rank. `grad_accum_steps` / `global_batch_size`: see module docstring. `precision`: "bf16" or
    "fp32". `zero_stage`: DeepSpeed ZeRO stage (0-3). `offload_optimizer` / `offload_params`:
    ZeRO-Offload to CPU (params only with stage 3). `nan_policy`: "stop" (exit 3, no checkpoint
    written) or "skip" (drop the step's update). `log_interval`, `eval_interval` (0 = never),
    `eval_batches` (0 = the whole validation split) are in optimizer steps / micro-batches.

    Speed levers (each equal in loss and gradients to the default path, tests/test_levers.py;
    docs/PERFORMANCE.md "What to set on a cluster" says when to change them):
    - `activation_checkpointing`: "none" (default), "selective" (recompute the norms, the
      attention core and the SwiGLU activation in backward; no matrix multiply twice) or "full"
      (recompute each block); true/false spell full/none. Overrides the preset's `recompute`.
    - `loss_impl`: how the output layer + cross-entropy run over the labelled positions:
      "chunked" (default: `loss_chunk_tokens` rows at a time, recomputed in backward; megatron's
      vocab-parallel cross-entropy), "fused" (any TP size, gradients in the forward pass;
      `pipeline.model.linear_ce`) or "torch" (`torch.nn.functional.linear_cross_entropy`,
      torch >= 2.13, TP=1 only).
    - `loss_chunk_tokens`: rows of logits alive at a time in the output layer (all impls).
    - `compile`: regional `torch.compile` of each decoder block (`Qwen3.compile_layers`; the
      first steps pay the compilation).

    Hangs, stragglers, collectives (`pipeline.training.watchdog`; seconds; the allowances of
    saves and validation, with worked numbers: docs/ROBUSTNESS.md "Timeouts"):
    - `hang_timeout_s`: how long a phase of a training step (data, forward/backward, the step's
      all-reduce, optimizer) may go without progress before the job counts as hung (exit 6,
      one line per live rank naming the stuck rank(s), `<run_dir>/hang.json`). null (default)
      derives it from the step times after warm-up: max(120 s, 10 x median step time);
      0 switches the watchdog off.
    - `hang_warmup_s`: the allowance of the set-up (engine build, DeepSpeed op builds,
      checkpoint load), the first 3 steps after each start (compilation, first loader fill)
      and the first validation of each start.
    - `collective_timeout_s`: the process groups' collective timeout (the backstop behind the
      watchdog; on CUDA also NCCL's watchdog, whose flight-recorder dump goes to the run
      folder); must exceed `hang_timeout_s` and `hang_warmup_s`.
    - `straggler_factor`, `straggler_intervals`: a rank whose compute time per step (the step's
      time minus its wait in the step's all-reduce), averaged over a log interval, exceeds the
      median rank's by this factor for this many log intervals in a row gets one warning line.

    Memory plan (`pipeline.training.memory_plan`, `python -m pipeline.plan_memory`): rank 0
    prints the per-GPU plan at start-up. `memory_check`: "error" (default: a plan above the
    GPU's memory stops the job before any weight is loaded, one line, exit 2), "warn" (one
    warning line, the run goes on) or "off" (no check); on the CPU there is no check.
    `gpu_memory_gib`: the device memory to check against in GiB (null: the CUDA device's total
    memory).
    """
    max_steps: int = MISSING
    micro_batch_size: int = 1
    grad_accum_steps: Optional[int] = None
    global_batch_size: Optional[int] = None
    precision: str = "bf16"
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: Any = False
    loss_impl: str = "chunked"
    loss_chunk_tokens: int = 2048
    compile: bool = False
    tensor_parallel_size: int = 1
    seed: int = 1234
    nan_policy: str = "stop"
    log_interval: int = 1
    eval_interval: int = 0
    eval_batches: int = 0
    hang_timeout_s: Optional[float] = None
    hang_warmup_s: float = 900.0
    collective_timeout_s: float = 1800.0
    straggler_factor: float = 1.5
    straggler_intervals: int = 3
    memory_check: str = "error"
    gpu_memory_gib: Optional[float] = None


@dataclass
class DeepSpeedSection:
    """DeepSpeed numerics and ZeRO communication sizes (`pipeline.training.engine`, which
    explains each choice).

    `fp32_grad_accum`: with `train.precision=bf16`, accumulate gradients over micro-batches and
    reduce them over the data-parallel group in fp32, as Megatron does; false keeps both in
    bf16 (DeepSpeed's default: half the memory and traffic, but small per-rank contributions
    are lost). Ignored with fp32. With `train.zero_stage=0` only the all-reduce becomes fp32.

    Sizes are in elements (parameters), not bytes; null derives them from the model's hidden
    size h as DeepSpeed's Hugging Face integration does for "auto" (DeepSpeed's fixed defaults,
    5e8 / 5e7 / 1e5, fit neither a tiny nor an 8B model; Qwen3-8B: 16.8M, 15.1M, 40,960).
    - `reduce_bucket_size` (h^2): gradient elements reduced per bucket (ZeRO 1-3).
    - `prefetch_bucket_size` (0.9 h^2): parameter elements all-gathered ahead of use (ZeRO-3).
    - `param_persistence_threshold` (10 h): parameters with fewer elements are not
      partitioned (norm weights stay whole on every rank; ZeRO-3).
    - `max_live_parameters` / `max_reuse_distance` (null = DeepSpeed's 1e9): gathered
      parameter elements kept alive / reuse distance before release (ZeRO-3); the larger of the
      two, plus the largest weight, bounds the gathered weights per GPU (the memory plan's line).
    """
    fp32_grad_accum: bool = True
    reduce_bucket_size: Optional[int] = None
    prefetch_bucket_size: Optional[int] = None
    param_persistence_threshold: Optional[int] = None
    max_live_parameters: Optional[int] = None
    max_reuse_distance: Optional[int] = None


@dataclass
class CheckpointSection:
    """Where and how often to checkpoint. `dir` defaults to `<run_dir>/checkpoints`;
    `interval` in optimizer steps (0 = only at the end and on a signal); `keep` = how many
    recent checkpoints to retain; `resume` = continue from the latest one when it exists;
    `reshard` = allow resuming a ZeRO-3 checkpoint saved with another world size or
    `train.tensor_parallel_size` (`pipeline.checkpoint.reshard`; the global batch is kept).
    Off by default, so an accidental layout change stops with one line."""
    dir: Optional[str] = None
    interval: int = 1000
    keep: int = 3
    resume: bool = True
    reshard: bool = False


@dataclass
class WandbSection:
    """Weights & Biases: `mode` is "online", "offline" or "disabled"; files go under
    `<run_dir>/wandb`. The run id is stored in the checkpoint so a resumed job continues it."""
    mode: str = "disabled"
    project: str = "refusion"
    entity: Optional[str] = None
    name: Optional[str] = None


@dataclass
class LogSection:
    """Throughput accounting. `peak_tflops`: peak dense TFLOP/s of one device for MFU; None
    looks the device up (known GPU kinds) and reports MFU as n/a when unknown (e.g. CPU)."""
    peak_tflops: Optional[float] = None


@dataclass
class DebugSection:
    """Fault injection, for tests and for trying the robustness features by hand; never set in
    a real run. `nan_at_steps`: make the loss NaN on global rank 0 at these steps (1-based).
    Slowness (seconds, on every rank unless said otherwise; the watchdog must not stop a run
    slowed so, within its allowances): `slow_first_step_s` sleeps in the first step of each
    start (data phase), `slow_save_s` in each checkpoint save after DeepSpeed's files are
    written (the `.partial` folder exists), `slow_eval_s` in each validation micro-batch;
    `slow_rank` (-1 = none) sleeps `slow_rank_s` plus `slow_rank_factor` times its own time in
    the step so far, in every step before the step's all-reduce (a straggler). `hang_rank`
    (-1 = none) stops making progress forever at step `hang_at_step` (1-based; its process
    stays alive, as on a GPU hang). Their use: docs/ROBUSTNESS.md "Fault injection"."""
    nan_at_steps: List[int] = field(default_factory=list)
    slow_first_step_s: float = 0.0
    slow_save_s: float = 0.0
    slow_eval_s: float = 0.0
    slow_rank: int = -1
    slow_rank_s: float = 0.0
    slow_rank_factor: float = 0.0
    hang_rank: int = -1
    hang_at_step: int = 0


@dataclass
class RunConfig:
    """A whole training run. `run_dir` receives metrics.jsonl, wandb files and, by default,
    checkpoints. `objective` holds keyword options for `pipeline.objective` (passed through)."""
    run_dir: str = MISSING
    model: ModelSection = field(default_factory=ModelSection)
    init: InitSection = field(default_factory=InitSection)
    data: DataSection = field(default_factory=DataSection)
    objective: Dict[str, Any] = field(default_factory=dict)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    log: LogSection = field(default_factory=LogSection)
    debug: DebugSection = field(default_factory=DebugSection)


@dataclass(frozen=True)
class Plan:
    """Numbers derived by `validate`: world/TP/DP sizes, batch layout, the merged model
    fields (for `ModelConfig.from_dict(model_fields)`), the shard manifest, the tokens per
    row (`row_length`) and the checkpoint folder."""
    world_size: int
    tp_size: int
    dp_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    model_fields: Dict[str, Any]
    manifest: Dict[str, Any]
    row_length: int
    checkpoint_dir: str


def data_sources(data) -> list:
    """The run's data as `pipeline.data.mixture.Source`s: `data.sources` in order, or the one
    folder `data.dir` (named after its last path component, weight 1). `data`: the `data`
    section (DictConfig or the dict a checkpoint's saved config holds)."""
    from pipeline.data.mixture import Source, folder_name
    srcs = data.get("sources") or []
    if srcs:
        return [Source(name=str(s.get("name")), dir=str(s.get("dir")), weight=s.get("weight"),
                       max_epochs=s.get("max_epochs")) for s in srcs]
    return [Source(name=folder_name(data.get("dir")), dir=str(data.get("dir")), weight=1.0)]


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_config(path: str, overrides: List[str] | None = None) -> DictConfig:
    """Read the YAML at `path`, merge it over the `RunConfig` schema, then apply `overrides`
    (omegaconf dotlist, e.g. ["train.max_steps=10"]). Returns a DictConfig typed by `RunConfig`.

    Raises:
        ConfigError: missing/unreadable file, unknown key, wrong type (one-line message).
    """
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    schema = OmegaConf.structured(RunConfig)
    try:
        file_cfg = OmegaConf.load(path)
        _keep_words(file_cfg, path)
    except Exception as e:
        raise ConfigError(f"{path}: cannot parse YAML: {_one_line(e)}") from None
    try:
        cfg = OmegaConf.merge(schema, file_cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {_describe(e)}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
    overrides = [_quote_word(item) for item in overrides or []]
    # a key through a list (data.sources.1.weight, data.sources[1].weight) is set in place: a
    # dotlist merge would replace the list by a mapping
    indexed = [o for o in overrides if re.search(r"\.\d+(\.|$)|\[", o.split("=", 1)[0])]
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in overrides
                                                           if o not in indexed]))
    except OmegaConfBaseException as e:
        raise ConfigError(f"command-line override: {_describe(e)}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"command-line override: {_one_line(e)}") from None
    for item in indexed:
        key, value = item.split("=", 1)
        m = re.match(r"(.+?)(?:\.|\[)(\d+)\]?(?:\.|$)", key)
        seq = OmegaConf.select(cfg, m.group(1)) if m else None
        if m and (not OmegaConf.is_list(seq) or int(m.group(2)) >= len(seq)):
            n = len(seq) if OmegaConf.is_list(seq) else 0
            raise ConfigError(f"command-line override {key}: {m.group(1)} has {n} entr"
                              f"{'y' if n == 1 else 'ies'}; index {m.group(2)} is not one of them")
        try:
            OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"v={value}"])["v"], merge=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"command-line override {key}: {_describe(e)}") from None
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise ConfigError(f"command-line override {key}: {_one_line(e)}") from None
    return cfg


# YAML 1.1 reads these words as booleans (`off` -> False); a text setting such as
# data.verify_shards (error | warn | off) must keep the word as written.
_YAML_BOOL_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false"}


def _text_keys(cls=None, prefix: str = "") -> set[str]:
    """Dotted keys of the schema's `str` / `Optional[str]` fields (the text and enum settings)."""
    import dataclasses
    import typing
    cls = cls or RunConfig
    hints, out = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out |= _text_keys(t, f"{prefix}{f.name}.")
        elif t in (str, Optional[str]):
            out.add(prefix + f.name)
    return out


def _quote_word(item: str) -> str:
    """A `key=value` override of a text setting whose value YAML would read as a boolean, with
    the value quoted (`data.verify_shards=off` stays "off"); other overrides unchanged."""
    key, _, value = item.partition("=")
    if key.strip() in _text_keys() and value.strip().lower() in _YAML_BOOL_WORDS:
        return f"{key}='{value.strip()}'"
    return item


def _keep_words(file_cfg, path: str) -> None:
    """Put back the words a YAML file wrote for text settings that YAML read as booleans
    (`verify_shards: off`), from the file read again without YAML 1.1's boolean words."""
    keys = [k for k in _text_keys() if isinstance(OmegaConf.select(file_cfg, k), bool)]
    if not keys:
        return
    import yaml

    class _Words(yaml.SafeLoader):
        pass
    _Words.yaml_implicit_resolvers = {
        c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:bool"]
        for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    with open(path, encoding="utf-8") as f:
        raw = yaml.load(f, _Words)
    for k in keys:
        node = raw
        for part in k.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str):
            OmegaConf.update(file_cfg, k, node)


def _describe(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = _one_line(e)
    return f"key '{key}': {msg}" if key else msg


def _world_size_from_env() -> int:
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def _load_model_fields(cfg: DictConfig, tp: int) -> Dict[str, Any]:
    """Merged ModelConfig fields: preset, then inline; with `init.source=hf` and neither given,
    the HF folder's config.json (`pipeline.model.hf.config_from_hf`, vocab padded to a multiple of
    TP). With `init.source=hf` and a preset, the shapes must match the HF config."""
    fields: Dict[str, Any] = {}
    preset = cfg.model.preset
    if preset:
        if not os.path.isfile(preset):
            raise ConfigError(f"model.preset: file not found: {preset}")
        try:
            loaded = OmegaConf.to_container(OmegaConf.load(preset), resolve=True)
        except Exception as e:
            raise ConfigError(f"model.preset {preset}: cannot parse YAML: {_one_line(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"model.preset {preset}: expected a mapping of ModelConfig fields")
        fields.update(loaded)
    fields.update(OmegaConf.to_container(cfg.model.inline, resolve=True))
    if cfg.init.source == "hf":
        from pipeline.model.hf import config_from_hf
        try:
            hf = config_from_hf(cfg.init.hf_path, tp_size=tp).to_dict()
        except (ValueError, OSError, KeyError) as e:
            raise ConfigError(f"init.hf_path: {_one_line(e)}") from None
        if not fields:
            fields = hf
        else:
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim",
                      "tie_word_embeddings"):
                if k in fields and fields[k] != hf[k]:
                    raise ConfigError(f"model {k}={fields[k]} differs from {k}={hf[k]} of the "
                                      f"HF checkpoint {cfg.init.hf_path}")
    if not fields:
        raise ConfigError("model: give model.preset (a configs/model/*.yaml) or model.inline "
                          "fields (or init.source=hf with no preset to read the HF config)")
    from pipeline.model.config import recompute_mode
    fields["recompute"] = recompute_mode(cfg.train.activation_checkpointing)
    if cfg.model.attention is not None:
        from pipeline.model import ATTENTION_KINDS
        if cfg.model.attention not in ATTENTION_KINDS:
            raise ConfigError(f"model.attention must be one of {'|'.join(ATTENTION_KINDS)}, "
                              f"got {cfg.model.attention!r}")
        fields["attention"] = cfg.model.attention
    from pipeline.model import ModelConfig
    try:
        ModelConfig.from_dict(dict(fields), source="model")
    except (ValueError, TypeError) as e:
        raise ConfigError(_one_line(e)) from None
    return fields


def model_fields(cfg: DictConfig, tp: int) -> Dict[str, Any]:
    """The merged `ModelConfig` fields of a run (preset, inline, `train.activation_checkpointing`,
    `model.attention`) without the rest of `validate` (no shard folder needed: the memory
    planner). With `init.source=hf`, a preset and no readable `init.hf_path`, the preset alone.
    Raises ConfigError: one line naming the key."""
    try:
        if (cfg.init.source == "hf" and cfg.model.preset
                and not (cfg.init.hf_path and os.path.isfile(os.path.join(str(cfg.init.hf_path),
                                                                          "config.json")))):
            cfg = cfg.copy()
            cfg.init.source = "random"
        return _load_model_fields(cfg, tp)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None


def validate(cfg: DictConfig, world_size: int | None = None) -> Plan:
    """Check `cfg` (from `load_config`) against the launch's `world_size` (default
    WORLD_SIZE / SLURM_NTASKS, else 1) and the files it names; returns the `Plan`.

    Raises:
        ConfigError: the first problem found, as one line naming the key.
    """
    try:
        return _validate(cfg, world_size)
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise ConfigError(_describe(e)) from None


def _validate(cfg: DictConfig, world_size: int | None) -> Plan:
    ws = world_size if world_size is not None else _world_size_from_env()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required key(s) not set: {', '.join(missing)}")
    if (cfg.data.dir is not None) == bool(cfg.data.sources):
        raise ConfigError("data: set exactly one of data.dir (one shard folder) and data.sources "
                          "(a mixture); " + ("both are set" if cfg.data.dir is not None
                                             else "neither is set"))
    t, o, c = cfg.train, cfg.optim, cfg.checkpoint

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    # choices and ranges
    need(t.precision in ("bf16", "fp32"), f"train.precision must be bf16 or fp32, got {t.precision!r}")
    need(t.zero_stage in (0, 1, 2, 3), f"train.zero_stage must be 0..3, got {t.zero_stage}")
    need(t.nan_policy in ("stop", "skip"), f"train.nan_policy must be stop or skip, got {t.nan_policy!r}")
    need(cfg.wandb.mode in ("online", "offline", "disabled"),
         f"wandb.mode must be online, offline or disabled, got {cfg.wandb.mode!r}")
    need(cfg.init.source in ("random", "hf"), f"init.source must be random or hf, got {cfg.init.source!r}")
    need(o.impl in ("torch", "deepspeed"), f"optim.impl must be torch or deepspeed, got {o.impl!r}")
    need(not o.fused or o.impl == "torch",
         "optim.fused needs optim.impl=torch (optim.impl=deepspeed builds DeepSpeed's own fused "
         "Adam on GPUs)")
    from pipeline.model.config import recompute_mode
    from pipeline.model.linear_ce import LOSS_IMPLS, torch_linear_ce_available
    from pipeline.training.schedule import DECAY_SHAPES, LR_SCHEDULES, wsd_decay_steps
    try:
        recompute_mode(t.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"train.activation_checkpointing: {e}") from None
    need(t.loss_impl in LOSS_IMPLS,
         f"train.loss_impl must be one of {'|'.join(LOSS_IMPLS)}, got {t.loss_impl!r}")
    need(t.loss_chunk_tokens >= 1, f"train.loss_chunk_tokens must be >= 1, got {t.loss_chunk_tokens}")
    need(t.loss_impl != "torch" or t.tensor_parallel_size == 1,
         "train.loss_impl=torch needs train.tensor_parallel_size=1 (loss_impl=fused is the "
         "vocab-parallel one)")
    need(t.loss_impl != "torch" or torch_linear_ce_available(),
         "train.loss_impl=torch needs torch.nn.functional.linear_cross_entropy (torch >= 2.13); "
         "use loss_impl=fused")
    need(t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}")
    need(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    need(t.tensor_parallel_size >= 1, f"train.tensor_parallel_size must be >= 1, got {t.tensor_parallel_size}")
    need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    need(0 <= o.min_lr <= o.lr, f"optim.min_lr must be in [0, optim.lr], got {o.min_lr}")
    need(0 <= o.warmup_steps <= t.max_steps,
         f"optim.warmup_steps must be in [0, train.max_steps={t.max_steps}], got {o.warmup_steps}")
    need(o.schedule in LR_SCHEDULES,
         f"optim.schedule must be one of {'|'.join(LR_SCHEDULES)}, got {o.schedule!r}")
    need(o.decay_shape in DECAY_SHAPES,
         f"optim.decay_shape must be one of {'|'.join(DECAY_SHAPES)}, got {o.decay_shape!r}")
    need(0 < o.decay_fraction <= 1, f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    need(o.decay_steps is None or 1 <= o.decay_steps <= t.max_steps,
         f"optim.decay_steps must be in [1, train.max_steps={t.max_steps}], got {o.decay_steps}")
    if o.schedule == "wsd":
        decay = wsd_decay_steps(o.decay_steps, o.decay_fraction, t.max_steps)
        need(o.warmup_steps <= t.max_steps - decay,
             f"optim.warmup_steps={o.warmup_steps} overlaps the wsd decay (the last {decay} of "
             f"train.max_steps={t.max_steps} steps): lower optim.warmup_steps or the decay")
    need(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    need(t.log_interval >= 1, f"train.log_interval must be >= 1, got {t.log_interval}")
    need(t.eval_interval >= 0, f"train.eval_interval must be >= 0, got {t.eval_interval}")
    need(t.eval_batches >= 0, f"train.eval_batches must be >= 0, got {t.eval_batches}")
    import math
    hang = t.hang_timeout_s
    need(hang is None or (math.isfinite(hang) and hang >= 0),
         f"train.hang_timeout_s must be >= 0 seconds (0 = off) or null (derived), got {hang}")
    need(math.isfinite(t.hang_warmup_s) and t.hang_warmup_s > 0,
         f"train.hang_warmup_s must be > 0 seconds, got {t.hang_warmup_s}")
    need(math.isfinite(t.collective_timeout_s) and t.collective_timeout_s > 0,
         f"train.collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s}")
    need(t.collective_timeout_s > max(hang or 0.0, t.hang_warmup_s),
         f"train.collective_timeout_s={t.collective_timeout_s:g} must exceed train.hang_timeout_s "
         f"and train.hang_warmup_s (={max(hang or 0.0, t.hang_warmup_s):g} s): the collective "
         f"timeout is the backstop behind the hang watchdog")
    need(t.straggler_factor > 1, f"train.straggler_factor must be > 1, got {t.straggler_factor}")
    need(t.memory_check in ("error", "warn", "off"),
         f"train.memory_check must be error, warn or off, got {t.memory_check!r}")
    need(t.gpu_memory_gib is None or t.gpu_memory_gib > 0,
         f"train.gpu_memory_gib must be > 0 (GiB) or null, got {t.gpu_memory_gib}")
    need(t.straggler_intervals >= 1,
         f"train.straggler_intervals must be >= 1, got {t.straggler_intervals}")
    dbg = cfg.debug
    for k in ("slow_first_step_s", "slow_save_s", "slow_eval_s", "slow_rank_s"):
        need(dbg[k] >= 0, f"debug.{k} must be >= 0 seconds, got {dbg[k]}")
    need(dbg.slow_rank_factor >= 0,
         f"debug.slow_rank_factor must be >= 0, got {dbg.slow_rank_factor}")
    need(c.interval >= 0, f"checkpoint.interval must be >= 0, got {c.interval}")
    need(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    need(not t.offload_params or t.zero_stage == 3, "train.offload_params needs train.zero_stage=3")
    need(not t.offload_optimizer or t.zero_stage >= 1, "train.offload_optimizer needs train.zero_stage >= 1")
    need(cfg.log.peak_tflops is None or cfg.log.peak_tflops > 0, "log.peak_tflops must be > 0")
    for k in ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters",
              "max_reuse_distance"):
        v = cfg.deepspeed[k]
        need(v is None or v >= 1, f"deepspeed.{k} must be >= 1 (elements) or null, got {v}")
    v = cfg.deepspeed.param_persistence_threshold
    need(v is None or v >= 0, f"deepspeed.param_persistence_threshold must be >= 0 or null, got {v}")

    # parallel layout and batch arithmetic
    tp = t.tensor_parallel_size
    need(ws >= 1, f"world size must be >= 1, got {ws}")
    need(ws % tp == 0, f"train.tensor_parallel_size={tp} does not divide the world size {ws}")
    dp = ws // tp
    need(-1 <= cfg.debug.hang_rank < ws,
         f"debug.hang_rank must be -1 (none) or a rank below the world size {ws}, got "
         f"{cfg.debug.hang_rank}")
    need(cfg.debug.hang_at_step >= 0,
         f"debug.hang_at_step must be >= 0, got {cfg.debug.hang_at_step}")
    need(-1 <= cfg.debug.slow_rank < ws,
         f"debug.slow_rank must be -1 (none) or a rank below the world size {ws}, got "
         f"{cfg.debug.slow_rank}")
    per_step = t.micro_batch_size * dp
    if t.global_batch_size is None:
        ga = t.grad_accum_steps if t.grad_accum_steps is not None else 1
        need(ga >= 1, f"train.grad_accum_steps must be >= 1, got {ga}")
        gbs = per_step * ga
    else:
        gbs = t.global_batch_size
        need(gbs >= 1, f"train.global_batch_size must be >= 1, got {gbs}")
        need(gbs % per_step == 0,
             f"train.global_batch_size={gbs} is not a multiple of micro_batch_size x data-parallel "
             f"size = {t.micro_batch_size} x {dp} = {per_step}")
        ga = gbs // per_step
        need(t.grad_accum_steps is None or t.grad_accum_steps == ga,
             f"train.global_batch_size={gbs} != micro_batch_size x grad_accum_steps x data-parallel "
             f"size = {t.micro_batch_size} x {t.grad_accum_steps} x {dp}")

    # init source
    if cfg.init.source == "hf":
        need(bool(cfg.init.hf_path), "init.source=hf needs init.hf_path (a Hugging Face Qwen3 folder)")
        need(os.path.isfile(os.path.join(cfg.init.hf_path, "config.json")),
             f"init.hf_path: no config.json in {cfg.init.hf_path}")

    # model shape vs. TP
    fields = _load_model_fields(cfg, tp)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim"):
        need(isinstance(fields.get(k), int) and fields[k] >= 1,
             f"model: field {k} must be a positive integer, got {fields.get(k)!r}")
    for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        need(fields[k] % tp == 0,
             f"train.tensor_parallel_size={tp} does not divide model {k}={fields[k]}")
    need(fields["num_attention_heads"] % fields["num_key_value_heads"] == 0,
         f"model: num_key_value_heads={fields['num_key_value_heads']} does not divide "
         f"num_attention_heads={fields['num_attention_heads']}")

    # objective options
    from pipeline.objective import ObjectiveConfig
    try:
        ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"objective: {_one_line(e)}") from None

    # data
    need(cfg.data.num_workers >= 0, f"data.num_workers must be >= 0, got {cfg.data.num_workers}")
    need(cfg.data.shuffle_buffer >= 1, f"data.shuffle_buffer must be >= 1, got {cfg.data.shuffle_buffer}")
    need(cfg.data.verify_shards in ("error", "warn", "off"),
         f"data.verify_shards must be error, warn or off, got {cfg.data.verify_shards!r}")
    need(cfg.data.on_shard_change in ("refuse", "new_pass"),
         f"data.on_shard_change must be refuse or new_pass, got {cfg.data.on_shard_change!r}")
    need(cfg.data.packing in ("next_fit", "best_fit"),
         f"data.packing must be next_fit or best_fit, got {cfg.data.packing!r}")
    from pipeline.data import DataError, check_tokenizer, read_manifest
    from pipeline.data.mixture import check_same_tokenizer, normalized_weights
    need(cfg.data.phase >= 0, f"data.phase must be >= 0, got {cfg.data.phase}")
    sources = data_sources(cfg.data)
    if cfg.data.sources:
        try:
            normalized_weights(sources)
        except DataError as e:
            raise ConfigError(_one_line(e)) from None
    manifests, first = [], None
    for k, src in enumerate(sources):
        key = "data.dir" if not cfg.data.sources else f"data.sources[{k}] ({src.name})"
        try:
            manifest = read_manifest(src.dir)
            check_tokenizer(manifest, fields["vocab_size"], where=f"{key} {src.dir}")
            if first is not None:
                check_same_tokenizer(first, (src, manifest))
        except DataError as e:
            raise ConfigError(f"{key}: {_one_line(e)}") from None
        first = first or (src, manifest)
        manifests.append(manifest)
        splits = manifest.get("splits", {})
        for skey, split, used in (("data.train_split", cfg.data.train_split, True),
                                  ("data.val_split", cfg.data.val_split, t.eval_interval > 0)):
            if not used:
                continue
            need(split in splits, f"{skey}: no split {split!r} in {src.dir}/manifest.json "
                                  f"(has {sorted(splits)})" + ("" if skey == "data.train_split" else
                                  "; set train.eval_interval=0 to train without validation"))
            n = sum(int(s["samples"]) for s in splits[split])
            # pipeline.data deals one global order to the ranks: any sample count >= 1 serves any
            # layout (validation ranks without samples evaluate all-padding batches)
            need(n >= 1, f"{skey}: split {split!r} of {src.dir} has no samples")
        need(manifest["tokenizer"].get("mask_id") is not None,
             f"{key}: {src.dir}/manifest.json has no tokenizer.mask_id")
    manifest = manifests[0]
    longest = max(int(m["max_length"]) for m in manifests)
    ml = cfg.data.max_length
    if ml is not None and ml < longest:
        k = max(range(len(sources)), key=lambda i: int(manifests[i]["max_length"]))
        where = f" (data.sources[{k}] {sources[k].name!r}, {sources[k].dir})" if cfg.data.sources else ""
        raise ConfigError(f"data.max_length={ml} is shorter than the shards' max_length "
                          f"{longest}{where}")
    row = ml or longest
    mpe = fields.get("max_position_embeddings")
    need(mpe is None or row <= mpe,
         f"data.max_length: rows of {row} tokens exceed model max_position_embeddings={mpe}")

    ckdir = c.dir or os.path.join(cfg.run_dir, "checkpoints")
    return Plan(world_size=ws, tp_size=tp, dp_size=dp, micro_batch_size=t.micro_batch_size,
                grad_accum_steps=ga, global_batch_size=gbs, model_fields=fields,
                manifest=manifest, row_length=row, checkpoint_dir=ckdir)
