"""Process groups: torch.distributed start-up, megatron-core tensor/data-parallel groups, and
the `mpu` adapter DeepSpeed needs.

Owns: creating and destroying the default process group and megatron-core's
`parallel_state` groups; answering "which TP/DP rank am I". Must not touch: models,
optimizers, data.

Layout: megatron-core's default order puts tensor-parallel ranks adjacent
(ranks 0..tp-1 form TP group 0), so a TP group sits inside one node when tp <= GPUs/node.

Traps this module exists to avoid (../shared/FINDINGS.md):
- without `mpu=` DeepSpeed treats every rank as data-parallel: pass `MegatronMPU()`;
- `deepspeed.zero.Init(mpu=...)` alone partitions over the whole world: also pass
  `data_parallel_group=parallel_state.get_data_parallel_group()`.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits.

    Attributes:
        rank / world_size: global rank and number of processes.
        local_rank: rank on this node (selects the GPU).
        tp_rank / tp_size: tensor-parallel rank and group size.
        dp_rank / dp_size: data-parallel rank and group size (world_size = tp_size * dp_size).
        device: `cuda:<local_rank>` when CUDA is available, else `cpu`.
    """

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def init_distributed(tensor_parallel_size: int = 1, backend: str | None = None,
                     timeout_s: float = 1800.0) -> ParallelInfo:
    """Start torch.distributed (if needed) and megatron-core's TP/DP groups.

    Reads the launcher's environment: torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or srun
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); MASTER_ADDR/MASTER_PORT must be set for
    more than one process (defaults 127.0.0.1:29500 for a single process).

    Args:
        tensor_parallel_size: size of each tensor-parallel group; must divide the world size.
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
        timeout_s: collective timeout in seconds.

    Returns:
        ParallelInfo for this process.

    Raises:
        ValueError: the world size is not a multiple of `tensor_parallel_size`.
    """
    from megatron.core import parallel_state

    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if world_size % tensor_parallel_size != 0:
        raise ValueError(f"world size {world_size} is not a multiple of tensor_parallel_size "
                         f"{tensor_parallel_size}")
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device)


def destroy_distributed() -> None:
    """Tear down megatron-core groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class MegatronMPU:
    """The `mpu` object DeepSpeed expects, backed by megatron-core `parallel_state`.

    DeepSpeed calls these to find the model-parallel (= tensor-parallel here) and
    data-parallel groups; pass an instance as `deepspeed.initialize(..., mpu=MegatronMPU())`.
    """

    @staticmethod
    def get_model_parallel_rank() -> int:
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_rank()

    @staticmethod
    def get_model_parallel_group():
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_group()

    @staticmethod
    def get_model_parallel_world_size() -> int:
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_world_size()

    @staticmethod
    def get_data_parallel_rank() -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_rank()

    @staticmethod
    def get_data_parallel_group():
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_group()

    @staticmethod
    def get_data_parallel_world_size() -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_world_size()

    # Names some DeepSpeed versions use for the same groups.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
