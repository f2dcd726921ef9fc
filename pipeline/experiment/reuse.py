"""The experiment's stage reuse, keyed by inputs: a result is reused only when what made it is
the same.

Owns: what identifies a training run's inputs (`run_inputs`, `inputs_key`), their record
`<run_dir>/inputs.json`, the decision to reuse, adopt or refuse a run folder (`check_run`), and
an export's record of the run it came from (`<hf_dir>/source.json`, `check_export`). Must not
touch: training, exporting, the order of the stages (`pipeline.experiment.recipe`).

A run's inputs are the resolved run config (the YAML merged with the stage's overrides, as
`pipeline.config.load_config` gives it) without the fields that name places (`run_dir`,
`data.dir`, `init.hf_path`, `checkpoint.dir`), plus: `steps` (`train.max_steps`), `seed`
(`train.seed`), `data` (the fingerprint of the shards' manifest: tokenizer, row length, every
shard's name, counts, size and sha256; not the folder or the input paths it was made from),
`world_size` (training processes: they set the global batch), `init` (the key of the run whose
export a stage-2 run starts from; None from scratch) and `model_preset` (sha256 of the model
preset file the config names, if any). The key is the sha256 of that record as sorted-key
JSON, so a copy of an output folder elsewhere keeps its keys.

A run folder from before these records (no `inputs.json`) is adopted when the resolved config
its latest checkpoint recorded (`client_state["config"]`, the trainer's), the world size in its
`refusion_meta.json` and the fingerprint of the shards it names give the same inputs; its
`inputs.json` is then written. Anything else is refused with one line naming the folder and the
inputs that differ (`InputsMismatch`, exit code 2): results of other inputs are never mixed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.common.atomic_io import write_json
from pipeline.common.cli import UsageError

INPUTS = "inputs.json"
SOURCE = "source.json"
LOCATION_KEYS = ("run_dir", "data.dir", "init.hf_path", "checkpoint.dir")
SEPARATE_KEYS = ("train.max_steps", "train.seed")

__all__ = ["InputsMismatch", "data_fingerprint", "run_inputs", "inputs_key", "differences",
           "resolved_config", "recorded_inputs", "check_run", "check_export", "write_source"]


class InputsMismatch(UsageError):
    """A run or export folder holds a result of other inputs (one line: the folder and the
    inputs that differ); exit code 2."""


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def data_fingerprint(shards: str | os.PathLike) -> str:
    """sha256 hex of a shard folder's content as its `manifest.json` describes it: the
    tokenizer record, `max_length` and every split's shard entries (name, samples, tokens,
    bytes, sha256), the sample indexes left out (adding them keeps the shard set, as the data
    loader's own fingerprint has it) and the data_prep options (input paths) left out.

    Raises:
        InputsMismatch: no readable manifest (one line naming it).
    """
    path = Path(shards) / "manifest.json"
    try:
        m = json.loads(path.read_text())
        doc = {"tokenizer": m["tokenizer"], "max_length": m.get("max_length"),
               "splits": {s: [{k: v for k, v in e.items() if k != "index"} for e in es]
                          for s, es in m["splits"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputsMismatch(f"{path}: cannot read the shard manifest ({type(e).__name__}: "
                             f"{e})") from None
    return _sha(doc)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _preset_sha(preset) -> str | None:
    if not preset:
        return None
    from pipeline.experiment.tasks import ROOT
    for p in (Path(preset), ROOT / str(preset)):
        if p.is_file():
            return hashlib.sha256(p.read_bytes()).hexdigest()
    return f"unreadable: {preset}"


def run_inputs(config: dict, data: str, world_size: int, init: str | None) -> dict:
    """The inputs record of a training run (see the module docstring).

    Args:
        config: the resolved run config as a plain dict (`resolved_config`, or the one a
            checkpoint recorded).
        data: `data_fingerprint` of its shards; world_size: training processes; init: the key
            of the run whose export it starts from (None: from scratch).

    Returns:
        {"steps": int, "seed": int, "data": str, "world_size": int, "init": str | None,
        "model_preset": sha256 hex | None, "config": {dotted key: value}}.
    """
    flat = _flatten(config)
    return {"steps": flat.get("train.max_steps"), "seed": flat.get("train.seed"), "data": data,
            "world_size": int(world_size), "init": init,
            "model_preset": _preset_sha(flat.get("model.preset")),
            "config": {k: flat[k] for k in sorted(flat)
                       if k not in LOCATION_KEYS + SEPARATE_KEYS}}


def inputs_key(inputs: dict) -> str:
    """sha256 hex of an inputs record (`run_inputs`) as sorted-key JSON."""
    return _sha(inputs)


def differences(old: dict, new: dict, most: int = 4) -> list[str]:
    """What differs between two inputs records, in words, at most `most` items (then
    `... N more`): `steps 2400 -> 20`, `config.optim.lr 0.002 -> 0.001`, `data (other
    shards)`."""
    out = []
    short = {"data": "other shards", "init": "another initial export",
             "model_preset": "another model preset file"}
    for k in ("steps", "seed", "world_size", "data", "init", "model_preset"):
        if old.get(k) != new.get(k):
            out.append(f"{k} ({short[k]})" if k in short else f"{k} {old.get(k)} -> {new.get(k)}")
    a, b = old.get("config") or {}, new.get("config") or {}
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<unset>") != b.get(k, "<unset>"):
            out.append(f"config.{k} {json.dumps(a.get(k, '<unset>'))} -> "
                       f"{json.dumps(b.get(k, '<unset>'))}")
    if len(out) > most:
        out = out[:most] + [f"... {len(out) - most} more"]
    return out


def resolved_config(config_path: str, overrides: list[str]) -> dict:
    """The run config a `pipeline.train --config config_path overrides...` would record, as a
    plain dict (`load_config`, resolved).

    Raises:
        InputsMismatch: the config cannot be loaded (one line).
    """
    from omegaconf import OmegaConf

    from pipeline.config import ConfigError, load_config
    from pipeline.experiment.tasks import ROOT
    if not os.path.isfile(config_path) and (ROOT / config_path).is_file():
        config_path = str(ROOT / config_path)     # the trainer runs from the repository root
    try:
        return OmegaConf.to_container(load_config(config_path, overrides), resolve=True)
    except ConfigError as e:
        raise InputsMismatch(f"run config: {e}") from None


def recorded_inputs(run_dir: Path, init_of=None) -> dict | None:
    """The inputs of a run folder without `inputs.json`, from its latest complete checkpoint
    (the resolved config rank 0 saved, the world size of `refusion_meta.json`, the fingerprint
    of the shard folder the config names), or None when it has no complete checkpoint.

    Args:
        run_dir: the run folder (checkpoints under `run_dir/checkpoints`).
        init_of: callable(recorded `init.hf_path`) -> the key to record as `init` (None: None).

    Raises:
        InputsMismatch: the checkpoint, its config or its shard folder cannot be read.
    """
    from pipeline.checkpoint import find_latest
    from pipeline.checkpoint.safe_load import load_checkpoint_file
    from pipeline.checkpoint.store import META
    step = find_latest(run_dir / "checkpoints")
    if step is None:
        return None
    try:
        cfg = load_checkpoint_file(step / "refusion_rank_00000.pt")["client_state"]["config"]
        world = json.loads((step / META).read_text())["world_size"]
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is one line
        raise InputsMismatch(f"{step}: cannot read the recorded run config "
                             f"({type(e).__name__}: {e})") from None
    data = data_fingerprint(cfg["data"]["dir"])
    hf = (cfg.get("init") or {}).get("hf_path")
    init = init_of(hf) if (init_of is not None and hf
                           and (cfg.get("init") or {}).get("source") == "hf") else None
    return run_inputs(cfg, data, world, init)


def check_run(run_dir: Path, inputs: dict, init_of=None) -> str:
    """Decide what a training stage does with its run folder, before training.

    Returns:
        "new" (no folder: created, `inputs.json` written), "same" (its `inputs.json` has this
        key: resume or reuse), "adopted" (no `inputs.json`, but its latest checkpoint recorded
        the same inputs: `inputs.json` written).

    Raises:
        InputsMismatch: the folder holds a run of other inputs, or a run without
            `inputs.json` whose inputs cannot be checked (no complete checkpoint). One line.
    """
    key = inputs_key(inputs)
    rec = run_dir / INPUTS
    doc = {"key": key, "inputs": inputs}
    if rec.is_file():
        old = json.loads(rec.read_text())
        if old.get("key") == key:
            return "same"
        diff = differences(old.get("inputs") or {}, inputs)
        raise InputsMismatch(f"{run_dir} holds a run of other inputs ("
                             + "; ".join(diff or ["another key"])
                             + "): remove it or use another --output")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        old = recorded_inputs(run_dir, init_of)
        if old is None:
            raise InputsMismatch(f"{run_dir} has no {INPUTS} and no complete checkpoint to "
                                 f"compare its inputs with: remove it or use another --output")
        diff = differences(old, inputs)
        if diff:
            raise InputsMismatch(f"{run_dir} holds a run of other inputs (" + "; ".join(diff)
                                 + "): remove it or use another --output")
        write_json(rec, doc, indent=1)
        return "adopted"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(rec, doc, indent=1)
    return "new"


def check_export(hf_dir: Path, run_dir: Path, key: str) -> bool:
    """True when `hf_dir` is the export of the run `run_dir` as it is now: its `source.json`
    names `key`, or (an export from before these records) it has none and was written after
    the run's latest checkpoint (then `source.json` is written). False: export again.
    """
    from pipeline.checkpoint import find_latest
    if not ((hf_dir / "config.json").is_file() and (hf_dir / "tokenizer.model").is_file()):
        return False
    src = hf_dir / SOURCE
    if src.is_file():
        return json.loads(src.read_text()).get("key") == key
    from pipeline.checkpoint.store import META
    step = find_latest(run_dir / "checkpoints")
    if step is None or ((hf_dir / "config.json").stat().st_mtime
                        < (step / META).stat().st_mtime):
        return False
    write_source(hf_dir, run_dir, key, step.name)
    return True


def write_source(hf_dir: Path, run_dir: Path, key: str, step: str) -> None:
    """Record in `hf_dir/source.json` the run (folder, key, checkpoint) an export came from."""
    write_json(hf_dir / SOURCE, {"run_dir": str(run_dir), "key": key, "checkpoint": step},
               indent=1)
