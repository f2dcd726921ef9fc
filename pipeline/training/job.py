"""What a training process needs from its launcher, besides the process groups: the rank
variables under srun (`launcher_env`), one user-facing error line for the whole job whichever
rank raised it (`report_error` through the c10d or torchrun agent store), and telling a
collective that failed because another rank's process is gone (`lost_peer`), the line that says
a worker was restarted by torchrun (`log_restart`). Used by
`pipeline.train`'s entry point; must not touch the training step or checkpoints."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

log = logging.getLogger("pipeline.train")


def launcher_env() -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK from srun's SLURM_* variables (or a single process)
    when no torchrun set them; DeepSpeed reads LOCAL_RANK."""
    for ours, slurm, default in (("RANK", "SLURM_PROCID", "0"), ("WORLD_SIZE", "SLURM_NTASKS", "1"),
                                 ("LOCAL_RANK", "SLURM_LOCALID", "0")):
        if ours not in os.environ:
            os.environ[ours] = os.environ.get(slurm, default)
    if (os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" not in os.environ
            and "SLURM_PROCID" not in os.environ):
        # a bare single process: init_distributed binds its store to a port the kernel picks,
        # so two such runs on one host do not collide
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")
                          if "SLURM_PROCID" in os.environ else os.environ["WORLD_SIZE"])


def log_restart(run_dir) -> None:
    """On a restart by torchrun (`--max-restarts`, TORCHELASTIC_RESTART_COUNT > 0): one warning
    line saying so, with the previous attempt's hang report when `<run_dir>/hang.json` is less
    than an hour old. Call on rank 0."""
    from pipeline.training.watchdog import HANG_FILE
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not restart:
        return
    cause = ""
    report = os.path.join(run_dir, HANG_FILE)
    try:
        with open(report) as f:
            hang = json.load(f)
        if time.time() - float(hang.get("time_unix_s", 0)) < 3600:
            cause = f"; the last hang report ({report}): {hang.get('line')}"
    except (OSError, ValueError):
        pass
    log.warning("restart %d of at most %s by the launcher (--max-restarts) after the "
                "previous workers failed%s", restart,
                os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), cause)


def software_line() -> str:
    """The start-up line naming what changes a run's numbers besides its config and data: the
    torch, DeepSpeed and megatron-core versions, torch's CPU kernel level
    (`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY` overrides: AVX2 and
    AVX-512 kernels differ in the last bits) and the CUDA device, if any. A seed and config
    repeat a run bit for bit only where this line is the same."""
    import importlib.metadata as md

    import torch
    versions = []
    for name in ("deepspeed", "megatron-core"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} not installed")
    device = (f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}"
              if torch.cuda.is_available() else "no CUDA device")
    return (f"software: torch {torch.__version__} (CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}), {', '.join(versions)}; {device}")


_ERROR_KEY = "pipeline_train_error"


def default_store():
    """The process group's key-value store (torchrun's agent store or rank 0's TCPStore), or
    None before the process group exists. Store calls need no other rank's participation."""
    try:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() > 1:
            return dist.distributed_c10d._get_default_store()
    except Exception:
        pass
    return None


def agent_store():
    """A client of torchrun's agent store (torchrun / pipeline.launch set
    TORCHELASTIC_USE_AGENT_STORE and point MASTER_ADDR/MASTER_PORT at it), usable before the
    process group exists; None elsewhere or when it cannot be reached in 10 s."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
            or os.environ.get("WORLD_SIZE", "1") == "1"):
        return None
    try:
        import datetime
        from torch.distributed import PrefixStore, TCPStore
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=10))
        # one key space per torchrun restart (pipeline.parallel.attempt_store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        return PrefixStore(f"refusion/attempt_{attempt}/pre-init", store)
    except Exception:
        return None


def report_error(code: int, line: str, store=None, name_rank: bool = True) -> int:
    """Print a user-facing error line once for the whole job, whichever rank raised it: the
    first rank to report it through the store prints (a rank-only error is not lost behind
    rank 0's silence), the others stay quiet. Without a store (one process, or the store is
    gone) the line is printed. A rank other than 0 adds " (rank N)" unless `name_rank` is
    False (the line already names the ranks it concerns). Returns `code`."""
    store, first = store if store is not None else default_store(), True
    if store is not None:
        try:
            store.set(_ERROR_KEY + "_code", str(code))
            first = store.add(_ERROR_KEY, 1) == 1
        except Exception:
            first = True
    if first:
        rank = os.environ.get("RANK", "0")
        print(line if rank == "0" or not name_rank else f"{line} (rank {rank})",
              file=sys.stderr, flush=True)
    return code


def reported_error_code() -> int | None:
    """The exit code another rank reported through `report_error`, or None."""
    store = default_store()
    if store is None:
        return None
    try:
        if store.check([_ERROR_KEY + "_code"]):
            return int(store.get(_ERROR_KEY + "_code").decode())
    except Exception:
        pass
    return None


# What a collective raises when another rank's process is gone (gloo's TCP transport, NCCL).
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "remote process exited", "NCCL communicator was aborted")


def lost_peer(e: BaseException) -> str | None:
    """When `e` is a collective that failed because another rank's process is gone, its reason
    in a few words (e.g. "gloo: Read error [127.0.0.1]:22246: Connection reset by peer");
    otherwise None."""
    import re
    text = str(e).strip()
    if not isinstance(e, RuntimeError) or not any(m in text for m in _LOST_PEER_MARKERS):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])  # gloo's "[file.cc:537] "
    first = first.split(". ")[0].rstrip(".")
    return f"gloo: {first}" if "gloo" in text else first
