"""Resume a ZeRO-3 (+ tensor-parallel) checkpoint on another layout: a different data-parallel
size, a different tensor-parallel size, or both.

Owns: converting one complete step folder written by `pipeline.checkpoint.save_checkpoint`
with layout (TP a, DP b) into DeepSpeed *universal checkpoint* folders for a TP size c, and
loading them into a fresh engine of layout (TP c, DP d). Must not touch: the checkpoint
folder it reads (never modified), the training loop, the data loader (its state is made
layout-independent by `pipeline.data`; this module only hands the saved states over).

How (library first, our code only where the library cannot):
1. Per old TP rank, DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`, the
   ZeRO-3 path) merges the DP partitions of the fp32 master weights and of Adam's `exp_avg` /
   `exp_avg_sq` into one tensor per parameter (`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`) and
   writes the optimizer's common state (`zero/optimizer_state.pt`, with Adam's step). It is
   run on a view of one TP rank's files at a time because its own TP merge (AutoTP metadata)
   knows nothing of megatron-core's fused layers: our `qkv_proj` shard on TP rank r is
   `[q_r; k_r; v_r]` and `gate_up_proj` is `[gate_r; up_r]`, so a plain concatenation of rank
   shards is not the full tensor.
2. Only when the TP size changes: each of fp32 / exp_avg / exp_avg_sq is merged over the old
   TP ranks by `pipeline.model.hf.merge_tp_state_dicts` (the model-aware merge export uses) and cut
   for each new TP rank by `pipeline.model.hf.iter_tp_shard` (the slicing `init.source=hf` uses).
   Adam's moments are elementwise, so they follow exactly the weights' permutation.
3. Loading: DeepSpeed's ZeRO-3 universal loader
   (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`) reads
   this TP rank's folder and partitions every tensor over the new DP group. It copies the
   hyperparameters of optimizer group 0 onto every group (it assumes they are equal); ours
   differ (weight decay 0 for norms), so the groups' hyperparameters of the fresh engine are
   put back afterwards; and it hands one shared `step` tensor to every sub-group, which
   torch's Adam increments in place once per sub-group, so each sub-group gets its own copy.

Layout of the conversion (inside the checkpoint root, atomic like a save):

    <root>/universal/<tag>_tp<c>/            complete (holds `refusion_universal.json`)
        tp_<r>/zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt, tp_<r>/zero/optimizer_state.pt
    <root>/universal/<tag>_tp<c>.partial/    a conversion in progress or crashed: ignored,
                                             deleted by the next conversion

Exactness: weights and moments are moved, never recomputed: after loading, every gathered
fp32 weight and Adam moment equals the saved one bit for bit. What changes with the layout is
the order of floating-point reductions in later steps (gradient all-reduce over another DP
size, matmuls split over another TP size), so later losses equal an old-layout run only
within float tolerance.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.safe_load import check_checkpoint_files, load_checkpoint_file

log = logging.getLogger(__name__)

__all__ = ["ReshardError", "universal_dir", "convert_to_universal", "load_universal",
           "saved_client_states", "saved_global_batch", "remove_conversions"]

MARKER = "refusion_universal.json"
KEYS = ("fp32", "exp_avg", "exp_avg_sq")
UNIVERSAL = "universal"


class ReshardError(ValueError):
    """A checkpoint that cannot be resharded (not ZeRO-3, missing files, shapes that do not
    fit the new layout); the message is one line naming the folder."""


def universal_dir(step_dir: str | os.PathLike, tp_size: int) -> Path:
    """Where the conversion of `step_dir` for TP size `tp_size` lives:
    `<root>/universal/<tag>_tp<tp_size>` (root = the checkpoint root holding `step_dir`)."""
    step_dir = Path(step_dir)
    return step_dir.parent / UNIVERSAL / f"{step_dir.name}_tp{tp_size}"


def _ds_universal_one_tp_rank(step_dir: Path, tp_rank: int, work: Path) -> Path:
    """Run DeepSpeed's ZeRO-3 universal converter over the DP files of one TP rank; returns the
    folder holding `zero/`. The files are shown to it through symlinks renamed to TP rank 0
    (it would otherwise try its AutoTP merge)."""
    from deepspeed.checkpoint import ds_to_universal

    mp = f"_mp_rank_{tp_rank:02d}_"
    files = sorted(f for f in step_dir.iterdir() if mp in f.name and f.name.startswith(
        ("zero_pp_rank_", "bf16_zero_pp_rank_")) and f.name.endswith("_states.pt"))
    if not any(f.name.endswith("_optim_states.pt") for f in files):
        raise ReshardError(f"{step_dir}: no ZeRO-3 optimizer files of TP rank {tp_rank} "
                           f"(zero_pp_rank_*{mp}optim_states.pt); only ZeRO-3 checkpoints reshard")
    check_checkpoint_files(files)     # ds_to_universal unpickles them with weights_only=False
    view = work / f"src_tp{tp_rank}" / step_dir.name
    view.mkdir(parents=True)
    for f in files:
        (view / f.name.replace(mp, "_mp_rank_00_")).symlink_to(f.resolve())
    out = work / f"old_tp{tp_rank}"
    args = argparse.Namespace(input_folder=str(view), output_folder=str(out),
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    return out


def _read_universal(path: Path, shape: list[int]) -> torch.Tensor:
    """One universal tensor (DeepSpeed stores ZeRO-3 merges flat, sometimes in a dict under
    "param") at its per-TP-rank shape."""
    x = load_checkpoint_file(path)
    t = x["param"] if isinstance(x, dict) else x
    return t.reshape(shape)


def _retarget_tp(old_dirs: list[Path], new_tp: int, cfg, out: Path, layout: dict) -> None:
    """Merge each key over the old TP ranks and cut it for `new_tp` ranks into
    `out/tp_<r>/zero/<name>/<key>.pt`. `layout`: `refusion_layout.json` of the saved checkpoint
    (per-parameter per-TP-rank shapes)."""
    from pipeline.model import hf

    shapes = [{n: p["shape"] for n, p in layout["params"].items()} for _ in old_dirs]

    names = sorted(p.name for p in (old_dirs[0] / "zero").iterdir() if p.is_dir())
    for key in KEYS:
        shards = [{n: _read_universal(d / "zero" / n / f"{key}.pt", shapes[r][n])
                   for n in names} for r, d in enumerate(old_dirs)]
        full = hf.merge_tp_state_dicts(shards, cfg, vocab_rows=cfg.vocab_size)
        del shards
        src = hf.TensorSource(full)
        for r in range(new_tp):
            for name, t in hf.iter_tp_shard(src, cfg, r, new_tp):
                d = out / f"tp_{r}" / "zero" / name
                d.mkdir(parents=True, exist_ok=True)
                torch.save({"param": t.clone()}, d / f"{key}.pt")
        del full, src
    for r in range(new_tp):
        shutil.copy2(old_dirs[0] / "zero" / "optimizer_state.pt",
                     out / f"tp_{r}" / "zero" / "optimizer_state.pt")


def convert_to_universal(step_dir: str | os.PathLike, new_tp: int) -> Path:
    """Convert a complete ZeRO-3 step folder into per-TP-rank universal folders for `new_tp`
    TP ranks (any DP size can load them). Run on one process (rank 0); the step folder is only
    read. Atomic: written under `<dest>.partial` and renamed; an existing complete conversion is
    reused; conversions of other steps are deleted (they are stale).

    Args:
        step_dir: a complete checkpoint step folder (`refusion_meta.json`,
            `refusion_layout.json`, `refusion_model_config.json`, DeepSpeed ZeRO-3 files).
        new_tp: the TP size to convert for.

    Returns:
        The complete conversion folder (`universal_dir(step_dir, new_tp)`).

    Raises:
        ReshardError: not a ZeRO-3 checkpoint, files missing, or the model's sizes (heads,
            intermediate size, vocabulary rows) not divisible by `new_tp`.
    """
    from pipeline.model import ModelConfig

    step_dir = Path(step_dir)
    dest = universal_dir(step_dir, new_tp)
    if (dest / MARKER).is_file():
        return dest
    meta = json.loads((step_dir / "refusion_meta.json").read_text())
    if int(meta.get("zero_stage", 3)) != 3:
        raise ReshardError(f"{step_dir}: saved with ZeRO stage {meta.get('zero_stage')}; "
                           f"checkpoint.reshard supports ZeRO-3 checkpoints only")
    mcfg_path = step_dir / "refusion_model_config.json"
    if not mcfg_path.is_file():
        raise ReshardError(f"{mcfg_path}: missing; the TP layout of the weights is unknown")
    cfg = ModelConfig.from_dict(json.loads(mcfg_path.read_text()), source=str(mcfg_path))
    for what, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n % new_tp:
            raise ReshardError(f"{mcfg_path}: model {what}={n} is not divisible by the new "
                               f"tensor-parallel size {new_tp}")
    old_tp = int(meta["tp_size"])
    t0 = time.time()
    uroot = dest.parent
    uroot.mkdir(parents=True, exist_ok=True)
    for child in uroot.iterdir():  # stale conversions (other steps) and crashed ones
        if child != dest:
            shutil.rmtree(child, ignore_errors=True)
    partial = dest.with_name(dest.name + ".partial")
    work = partial / "work"
    work.mkdir(parents=True)
    old_dirs = [_ds_universal_one_tp_rank(step_dir, r, work) for r in range(old_tp)]
    if new_tp == old_tp:
        for r, d in enumerate(old_dirs):
            (partial / f"tp_{r}").mkdir()
            os.rename(d / "zero", partial / f"tp_{r}" / "zero")
    else:
        layout = json.loads((step_dir / "refusion_layout.json").read_text())
        _retarget_tp(old_dirs, new_tp, cfg, partial, layout)
    shutil.rmtree(work)
    (partial / MARKER).write_text(json.dumps({
        "source": str(step_dir), "step": meta["step"], "old_tp_size": old_tp,
        "old_dp_size": meta["dp_size"], "new_tp_size": new_tp,
        "converted_in_s": round(time.time() - t0, 3)}))
    os.rename(partial, dest)
    log.info("converted %s (TP %d, DP %d) to a universal checkpoint for TP %d in %.1f s: %s",
             step_dir, old_tp, meta["dp_size"], new_tp, time.time() - t0, dest)
    return dest


def load_universal(engine, conv_dir: str | os.PathLike, tp_rank: int,
                   load_optimizer_states: bool = True) -> None:
    """Load this TP rank's part of a conversion into a fresh ZeRO-3 engine (collective over the
    engine's DP group): fp32 master weights, Adam moments and step, and the module's
    (bf16/fp32) partitions, each partitioned over the engine's DP group by DeepSpeed.

    Args:
        engine: a fresh `deepspeed.DeepSpeedEngine` with a ZeRO-3 optimizer.
        conv_dir: `convert_to_universal`'s result.
        tp_rank: this process's tensor-parallel rank.
        load_optimizer_states: False loads the weights only (fresh Adam moments).

    Raises:
        ReshardError: the engine is not ZeRO-3, or a parameter is missing from the conversion.
    """
    opt = engine.optimizer
    folder = Path(conv_dir) / f"tp_{tp_rank}"
    if not hasattr(opt, "load_hp_checkpoint_state_from_checkpoint_dir_stage3"):
        raise ReshardError(f"{conv_dir}: this run is not ZeRO-3 (train.zero_stage=3 is needed "
                           f"to resume on another layout)")
    missing = [n for n in opt.param_names.values() if not (folder / "zero" / n).is_dir()]
    if missing:
        raise ReshardError(f"{folder}: parameters missing from the conversion: {missing[:5]}")
    if load_optimizer_states:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        opt.load_hp_checkpoint_state_from_checkpoint_dir_stage3(str(folder))
        for g, h in zip(opt.optimizer.param_groups, hyper):
            g.update(h)
        # DeepSpeed gives every sub-group the *same* step tensor; torch's Adam increments it in
        # place once per sub-group, so the second sub-group would use step + 2 in its bias
        # correction (measured: the no-decay group's update off by ~10%). One tensor each.
        for flat in opt.fp32_partitioned_groups_flat:
            st = opt.optimizer.state.get(flat, {})
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
    else:
        opt.load_module_checkpoint_state_from_checkpoint_dir_stage3(str(folder), True)


def saved_client_states(step_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every old rank's `refusion_rank_<rank>.pt` (client_state + RNG), in rank order."""
    step_dir = Path(step_dir)
    meta = json.loads((step_dir / "refusion_meta.json").read_text())
    return [load_checkpoint_file(step_dir / f"refusion_rank_{r:05d}.pt")
            for r in range(int(meta["world_size"]))]


def saved_global_batch(step_dir: str | os.PathLike) -> int | None:
    """The global batch (rows per optimizer step) of the run that saved `step_dir`: recorded in
    old rank 0's client_state, else derived from its saved config (micro-batch x accumulation
    x DP size); None when neither is there."""
    step_dir = Path(step_dir)
    meta = json.loads((step_dir / "refusion_meta.json").read_text())
    cs = load_checkpoint_file(step_dir / "refusion_rank_00000.pt")["client_state"]
    if cs.get("global_batch_size"):
        return int(cs["global_batch_size"])
    train = (cs.get("config") or {}).get("train") or {}
    if train.get("global_batch_size"):
        return int(train["global_batch_size"])
    if train.get("micro_batch_size"):
        return int(train["micro_batch_size"]) * int(train.get("grad_accum_steps") or 1) * \
            int(meta["dp_size"])
    return None


def remove_conversions(root_dir: str | os.PathLike) -> None:
    """Delete `<root_dir>/universal` (conversions are only needed until the run has saved a
    checkpoint of its own layout). Call on one process."""
    shutil.rmtree(Path(root_dir) / UNIVERSAL, ignore_errors=True)
