"""Export CLI: write a Hugging Face Qwen3 folder from a model source.

    python -m pipeline.export SRC OUT [--tensor-parallel-size N] [--tokenizer PATH] [--dtype bfloat16]
                                      [--max-shard-bytes B] [--overwrite]

Owns: turning a source into full Hugging Face tensors plus config, then writing the folder
(through `pipeline.model.hf.save_hf_folder`: config.json, safetensors, tokenizer files with the
ReFusion tokens added). Must not touch: training, the network definition, checkpoint writing.

Source kinds (one function each, `SOURCES`; detection in `detect_source`):
- `hf`: a Hugging Face Qwen3 folder. The weights make a round trip through our model: N
  processes (gloo) each build `pipeline.model.Qwen3` as one rank of a TP group of N on the meta
  device (its parameter names and per-rank shapes, no weights), read their slices one parameter
  at a time, check each against the model and stream them into a per-rank safetensors file;
  the parent merges those into HF tensors one tensor at a time.
- `checkpoint`: a training checkpoint (root or step folder, `pipeline.checkpoint` layout):
  the fp32 master weights of each TP rank read one parameter at a time (ZeRO-3:
  `pipeline.checkpoint.open_tp_ranks`; ZeRO 0-2: DeepSpeed's zero_to_fp32), then the TP merge
  of `pipeline.model.hf`; its tokenizer
  is the copy in the run's shard folder (`<data.dir>/tokenizer`) when that still exists.
Without any tokenizer the folder gets none, and one warning line says so.

Memory: one tensor at a time. The per-rank parts are streamed into safetensors files (`hf`:
each rank reads its slices one parameter at a time; `checkpoint`: the ZeRO-3 fp32 partitions
are read per parameter, `pipeline.checkpoint.open_tp_ranks`), and each Hugging Face tensor is
merged, cast and written on its own (`pipeline.model.hf.lazy_merged_state`,
`pipeline.model.hf.write_safetensors`): peak memory is about the largest tensor in fp32 plus
its cast copy, whatever the model size (`bench/bench_export.py` measures it).

Exit codes: 0 done; 2 usage or input error (one line on stderr, no traceback); 4 no space
left on the output's device, or disk quota exceeded (one line naming OUT, the cause and the
free space seen; the partial output is removed).
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline.common.cli import DTYPES, EXIT_DISK_FULL, EXIT_USAGE, hidden_alias
from pipeline.model import ModelConfig, hf
from pipeline.model.tp import tp_shard_shapes
from pipeline.parallel import free_port

# export writes Hugging Face weights in these dtypes
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ExportSource:
    """What a source kind hands to the writer.

    Attributes:
        state: full HF tensors (`{hf_name: Tensor | hf.LazyTensor}`, lazy ones produced one
            at a time by the writer), as `Qwen3ForCausalLM.state_dict()` names them.
        cfg: the model config.
        tokenizer_src: folder with tokenizer files to copy (None: none written).
        config_extra: extra config.json keys (token ids such as `mask_token_id`).
        close: called once the folder is written (or the export failed): removes what the
            source needed meanwhile (the per-rank files of the `hf` round trip).
    """

    state: dict
    cfg: ModelConfig
    tokenizer_src: Path | None = None
    config_extra: dict = field(default_factory=dict)
    close: Callable[[], None] | None = None


# --------------------------------------------------------------------------------------------
# Source kind: Hugging Face folder (round trip through our TP model)
# --------------------------------------------------------------------------------------------

def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()


def _stored_dtype(src: Path) -> torch.dtype:
    st = hf.SafetensorsFolder(src)
    name = "model.embed_tokens.weight"
    if name not in st:
        raise KeyError(f"{src}: tensor {name} missing from the checkpoint")
    dtype = st.get_slice(name)[0:1].dtype
    st.close()
    return dtype


def _hf_rank(rank: int, world_size: int, port: int, src: str, out_dir: str, dtype) -> None:
    """One TP rank: build our model on the meta device (names and per-rank shapes, no
    weights), read this rank's slice of each parameter from `src`, check it against the model
    and stream it into `out_dir/tp<rank>.safetensors` (one parameter in memory at a time)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from pipeline.model import Qwen3
    from pipeline.parallel import destroy_distributed, init_distributed
    try:
        info = init_distributed(tensor_parallel_size=world_size, backend="gloo")
        cfg = hf.config_from_hf(src, tp_size=world_size)
        with torch.device("meta"):
            model = Qwen3(cfg, dtype=dtype, init_weights=False)
        params = dict(model.named_parameters())
        read = hf.tp_param_reader(src, cfg, info.tp_rank, world_size)

        def load(name, want=None):
            t = read(name)
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{src}: {name} has shape {tuple(t.shape)} on TP rank "
                                 f"{info.tp_rank}, the model expects {tuple(params[name].shape)}")
            return t.to(want or dtype)

        entries = {n: hf.LazyTensor(tuple(p.shape), dtype, lambda d=None, n=n: load(n, d))
                   for n, p in params.items()}
        hf.write_safetensors(Path(out_dir) / f"tp{info.tp_rank}.safetensors", entries)
    finally:
        destroy_distributed()


def from_hf_folder(src: Path, args) -> ExportSource:
    """`hf` source: round trip through `Qwen3` sharded over `args.tp` ranks and merged back.

    Raises:
        ValueError / KeyError / FileNotFoundError: bad config or missing tensors (user errors).
    """
    hc = hf.read_hf_config(src)
    cfg = hf.config_from_hf(src, tp_size=args.tp)   # validates before any process starts
    dtype = _stored_dtype(src)
    import torch.multiprocessing as mp
    from safetensors import safe_open
    # Per-rank files go next to the output (the system temp folder may be too small for 8B);
    # they stay until the merged tensors are written (`ExportSource.close`).
    tmp = Path(tempfile.mkdtemp(prefix=".export-tp-", dir=args.work_dir))
    import logging
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)   # its "Terminating process ..." after a rank failed
    try:
        mp.start_processes(_hf_rank, args=(args.tp, free_port(), str(src), str(tmp), dtype),
                           nprocs=args.tp, join=True, start_method="spawn")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for err in (errno.ENOSPC, errno.EDQUOT):   # a rank's OSError arrives as text
            if isinstance(e, mp.ProcessRaisedException) and f"[Errno {err}]" in str(e):
                raise OSError(err, os.strerror(err), str(tmp)) from None
        raise
    finally:
        spawn_log.setLevel(level)

    def read(native, rank, start=None, stop=None):
        # reopened per read: pages read through the memory map do not stay resident
        with safe_open(str(tmp / f"tp{rank}.safetensors"), framework="pt") as f:
            sl = f.get_slice(native)
            return sl[:] if start is None else sl[start:stop]

    shapes = tp_shard_shapes(cfg, args.tp)
    state = hf.lazy_merged_state(read, shapes, dtype, cfg, args.tp,
                                    vocab_rows=int(hc["vocab_size"]))
    extra = {k: hc[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                "mask_token_id") if k in hc}
    return ExportSource(state=state, cfg=cfg,
                        tokenizer_src=src if _has_tokenizer(src) else None,
                        config_extra=extra, close=lambda: shutil.rmtree(tmp, ignore_errors=True))


# --------------------------------------------------------------------------------------------
# Source kind: training checkpoint (pipeline.checkpoint layout, DeepSpeed ZeRO + TP)
# --------------------------------------------------------------------------------------------

def from_training_checkpoint(src: Path, args) -> ExportSource:
    """`checkpoint` source: a step folder or checkpoint root written by
    `pipeline.checkpoint.save_checkpoint`; each TP rank consolidated over its DP ranks, then
    merged (`pipeline.checkpoint.hf_export_state`). `--tensor-parallel-size` is not used.

    Raises:
        pipeline.checkpoint.CheckpointError (a ValueError): incomplete or foreign checkpoint.
    """
    from pipeline import checkpoint
    state, cfg, extra = checkpoint.hf_export_state(src)
    return ExportSource(state=state, cfg=cfg, config_extra=extra,
                        tokenizer_src=run_tokenizer_dir(src))


def run_tokenizer_dir(src: Path) -> Path | None:
    """The tokenizer copy of the shards a checkpoint's run trained on, or None.

    The run config in rank 0's client_state (`refusion_rank_00000.pt` of the step folder, or of
    the latest complete one under a root) gives `data.dir`; its `manifest.json` names the copy
    (`tokenizer.files`, default `tokenizer`). Only a local folder that still holds tokenizer
    files counts (a SentencePiece `tokenizer.model` or Hugging Face files).

    Raises:
        pipeline.checkpoint.safe_load.UnsafeCheckpointError: that file names a type outside
            the checkpoint allow-list (any other unreadable file: None).
    """
    from pipeline import checkpoint
    from pipeline.checkpoint.safe_load import UnsafeCheckpointError, load_checkpoint_file
    step = src if checkpoint.is_complete(src) else checkpoint.find_latest(src)
    try:
        ours = load_checkpoint_file(Path(step) / "refusion_rank_00000.pt")
        from pipeline.config import data_sources   # a mixture's sources share one tokenizer
        data_dir = Path(data_sources(ours["client_state"]["config"]["data"])[0].dir)
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - an old or foreign checkpoint: no default tokenizer
        return None
    if "://" in str(data_dir):
        return None
    sub = "tokenizer"
    try:
        import json
        sub = json.loads((data_dir / "manifest.json").read_text())["tokenizer"].get("files", sub)
    except Exception:  # noqa: BLE001 - manifest gone or unreadable: try the default name
        pass
    folder = data_dir / str(sub)
    if any((folder / f).is_file() for f in ("tokenizer.model", "tokenizer.json",
                                             "tokenizer_config.json")):
        return folder
    return None


SOURCES: dict[str, Callable[[Path, argparse.Namespace], ExportSource]] = {
    "hf": from_hf_folder,
    "checkpoint": from_training_checkpoint,
}


def detect_source(src: Path) -> str:
    """Which source kind `src` is (a key of `SOURCES`).

    Raises:
        FileNotFoundError: `src` does not exist. ValueError: no known kind matches.
    """
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or folder")
    if (src / "config.json").is_file() and (
            (src / "model.safetensors").is_file()
            or (src / "model.safetensors.index.json").is_file()):
        return "hf"
    from pipeline import checkpoint
    if checkpoint.find_latest(src) is not None or checkpoint.is_complete(src):
        return "checkpoint"
    raise ValueError(f"{src}: not a known source (expected a Hugging Face folder with "
                     f"config.json and model.safetensors[.index.json], or a training checkpoint "
                     f"folder with a complete step_<N>/)")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def export(src, out, tp: int = 1, tokenizer=None, dtype: str | None = None,
           max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
           overwrite: bool = False) -> Path:
    """Export `src` (any kind in `SOURCES`) to a Hugging Face folder `out`; see module doc.

    Args:
        tp: tensor-parallel ranks for the round trip (hf source).
        tokenizer: tokenizer folder or SentencePiece model file overriding the source's own
            (an HF folder's tokenizer files; a checkpoint: its run's shard folder tokenizer,
            `run_tokenizer_dir`). With none, one warning line on stderr.
        dtype: "float32" / "bfloat16" / "float16" (default: as stored).
    Returns:
        `Path(out)`.
    """
    src, out = Path(src), Path(out)
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (use --overwrite)")
    kind = detect_source(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(tp=tp, work_dir=str(out.parent))
    cast = DTYPES[dtype] if dtype else None
    source = None
    try:
        source = SOURCES[kind](src, args)
        tok = Path(tokenizer) if tokenizer is not None else source.tokenizer_src
        if tok is None:
            print(f"export: warning: no tokenizer written ({src} has none to copy; pass "
                  f"--tokenizer)", file=sys.stderr)
        elif tokenizer is None and kind == "checkpoint":
            print(f"export: tokenizer from the run's shards: {tok}", file=sys.stderr)
        extra = dict(source.config_extra)  # save_hf_folder sets mask_token_id from the tokenizer
        return hf.save_hf_folder(source.state, source.cfg, out, tokenizer_src=tok,
                                    max_shard_bytes=max_shard_bytes, dtype=cast,
                                    config_extra=extra, overwrite=overwrite)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        need = None
        if source is not None:
            need = sum(math.prod(v.shape) * (cast if cast is not None and
                                              v.dtype.is_floating_point else v.dtype).itemsize
                       for v in source.state.values())
        raise DiskFullError(out, e.errno, need) from None
    finally:
        if source is not None and source.close is not None:
            source.close()


def _size(n: int) -> str:
    """A byte count for people: `1.5 GiB`, `12.0 MiB`, `3.0 KiB`, `512 bytes`."""
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} bytes"


class DiskFullError(OSError):
    """The output's filesystem is full, or the user's quota is: exit code 4, one line naming
    the output folder, the cause, the free space seen and the size of the weights. The partial
    output was removed (the writer works in a temporary sibling folder)."""

    def __init__(self, out: Path, err: int, need_bytes: int | None):
        try:
            free = shutil.disk_usage(out.parent).free
        except OSError:
            free = None
        cause = ("disk quota exceeded" if err == errno.EDQUOT else "no space left on device")
        seen = f"{_size(free)} free on its filesystem" if free is not None else "free space unknown"
        want = f"; the weights take {_size(need_bytes)}" if need_bytes else ""
        super().__init__(err, f"{out}: {cause} while writing the export ({seen}{want}); "
                              f"no partial output left")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.export",
                                description="Write a Hugging Face Qwen3 folder from SRC.")
    p.add_argument("src", help="source: a Hugging Face Qwen3 folder, or a training checkpoint "
                               "(root or step_<N> folder)")
    p.add_argument("out", help="output folder (must be absent or empty unless --overwrite)")
    p.add_argument("--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks for the round trip of a Hugging Face folder "
                        "through our model (as train.tensor_parallel_size)")
    hidden_alias(p, "--tp", dest="tp", type=int)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer: a Hugging Face tokenizer folder, a SentencePiece model "
                        "file, or a folder holding one as tokenizer.model (e.g. <shards>/"
                        "tokenizer) (default: the source's; for a training checkpoint, the "
                        "tokenizer copy in its run's shard folder)")
    p.add_argument("--dtype", default=None, choices=sorted(EXPORT_DTYPES),
                   help="cast weights (default: as stored)")
    p.add_argument("--max-shard-bytes", type=int, default=hf.DEFAULT_MAX_SHARD_BYTES,
                   help="split model.safetensors above this size (bytes)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = p.parse_args(argv)
    try:
        out = export(a.src, a.out, tp=a.tp, tokenizer=a.tokenizer, dtype=a.dtype,
                     max_shard_bytes=a.max_shard_bytes, overwrite=a.overwrite)
    except DiskFullError as e:
        print(f"export: error: {e.strerror}", file=sys.stderr)
        return EXIT_DISK_FULL
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"export: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    print(f"export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
