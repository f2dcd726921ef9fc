"""Process groups: torch.distributed start-up, megatron-core tensor/data-parallel groups, and
the `mpu` adapter DeepSpeed needs.

Owns: creating and destroying the default process group and megatron-core's
`parallel_state` groups; answering "which TP/DP rank am I". Must not touch: models,
optimizers, data.

Layout: megatron-core's default order puts tensor-parallel ranks adjacent
(ranks 0..tp-1 form TP group 0), so a TP group sits inside one node when tp <= GPUs/node.

Traps this module exists to avoid (each trains silently wrong):
- without `mpu=` DeepSpeed treats every rank as data-parallel: pass `MegatronMPU()`;
- `deepspeed.zero.Init(mpu=...)` alone partitions over the whole world: also pass
  `data_parallel_group=parallel_state.get_data_parallel_group()`.

This is the one home of the device choice (`local_device_index`, `bind_local_device`) and of
the rendezvous (`rendezvous_store`, `attempt_store`; user's view: docs/TRAINING.md "On SLURM").
"""
from __future__ import annotations

import datetime
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits.

    Attributes:
        rank / world_size: global rank and number of processes.
        local_rank: rank on this node (the launcher's LOCAL_RANK / SLURM_LOCALID).
        tp_rank / tp_size: tensor-parallel rank and group size.
        dp_rank / dp_size: data-parallel rank and group size (world_size = tp_size * dp_size).
        device: `cuda:<local_rank mod visible GPUs>` when CUDA is available, else `cpu`.
    """

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device


RENDEZVOUS_TIMEOUT_ENV = "REFUSION_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0


class RendezvousError(RuntimeError):
    """The ranks could not meet: MASTER_ADDR does not resolve, MASTER_ADDR:MASTER_PORT cannot be
    reached, or not every rank arrived within the rendezvous timeout. The message is one line."""


def rendezvous_timeout_s() -> float:
    """Seconds a rank waits to join the rendezvous: $REFUSION_RENDEZVOUS_TIMEOUT, default 60.

    Raises:
        RendezvousError: the variable is not a positive finite number.
    """
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise RendezvousError(
            f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


def rendezvous_store(rank: int, world_size: int, timeout_s: float,
                     rendezvous_s: float | None = None) -> dist.TCPStore:
    """The process group's TCP store at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), the one
    torch's env:// rendezvous would make, but joined within `rendezvous_s` seconds: torch's own
    waits the whole collective timeout (30 min) and logs a C++ stack per retry when
    MASTER_ADDR does not resolve or nobody listens. Other ranks poll with plain socket connects
    (once a second) until something listens; after the join the timeout becomes `timeout_s`.

    Args:
        rank / world_size: this process's global rank and the number of processes.
        rendezvous_s: the bound on the join (seconds); default `rendezvous_timeout_s()`.
    Raises:
        RendezvousError: MASTER_ADDR/MASTER_PORT unset or malformed, MASTER_ADDR does not
            resolve (at once), rank 0 cannot bind the port, or nobody listens / not all ranks
            joined within the bound.
    """
    if rendezvous_s is None:
        rendezvous_s = rendezvous_timeout_s()
    addr, port_text = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RendezvousError(f"MASTER_ADDR={addr!r} / MASTER_PORT={port_text!r}: {world_size} "
                              f"processes need both (an address of rank 0's node and a TCP port)")
    port = int(port_text)
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise RendezvousError(
            f"MASTER_ADDR={addr} does not resolve ({getattr(e, 'strerror', e)}); "
            f"set it to an address of rank 0's node that every node can reach (under Slurm: the "
            f"node's NodeAddr in `scontrol show node`)") from None
    deadline = time.monotonic() + rendezvous_s
    if rank != 0:
        # torch's client would retry on its own, but log a C++ stack trace on every failed try
        while True:
            left = deadline - time.monotonic()
            try:
                socket.create_connection((addr, port), timeout=max(0.1, min(5.0, left))).close()
                break
            except OSError as e:
                if time.monotonic() + 1.0 >= deadline:
                    raise RendezvousError(
                        f"nothing answers at {where} after {rendezvous_s:g} s "
                        f"({e.strerror or e}): is rank 0 running on that node? "
                        f"({RENDEZVOUS_TIMEOUT_ENV} sets the wait)") from None
            time.sleep(1.0)
    left = max(1.0, deadline - time.monotonic())
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=left), multi_tenant=True)
    except dist.DistError as e:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        joined = re.search(r"(\d+)/(\d+) clients joined", detail)
        if rank == 0 and joined:
            raise RendezvousError(
                f"only {joined.group(1)} of {world_size} ranks joined the rendezvous at {where} "
                f"within {rendezvous_s:g} s: the others have not started or cannot reach that "
                f"address ({RENDEZVOUS_TIMEOUT_ENV} sets the wait)") from None
        raise RendezvousError(f"rendezvous at {where} failed: {detail} "
                              f"({RENDEZVOUS_TIMEOUT_ENV}={rendezvous_s:g} s)") from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


# NCCL's own watchdog and flight recorder (torch's variables), set on CUDA unless the user set
# them: `nccl_defaults`.
NCCL_TRACE_ENTRIES = 2000


def nccl_defaults(dump_dir: str, environ=None) -> dict[str, str]:
    """Switch on NCCL's error handling and flight recorder, writing its dump into `dump_dir`.

    Sets, only where unset, the variables docs/ROBUSTNESS.md "NCCL" lists and explains, in
    `environ` (default `os.environ`), and returns those it set (name -> value). `dump_dir`: the
    run folder (created if missing). Call before the process group exists; NCCL only (untested).
    """
    env = os.environ if environ is None else environ
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
              "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(dump_dir, "nccl_trace_rank_")}
    done = {k: v for k, v in wanted.items() if k not in env}
    if done:
        os.makedirs(dump_dir, exist_ok=True)
        env.update(done)
    return done


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous on this host).

    Drawn at random from [10000, start of `/proc/sys/net/ipv4/ip_local_port_range`) and checked
    by binding it: below the ephemeral range no outgoing connection (a gloo mesh, a store
    client) can be handed it before the caller binds. Where the range cannot be read or leaves
    no room, the kernel picks (port 0).
    """
    import random
    import socket
    low = 10000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = low
    rng = random.SystemRandom()
    for _ in range(64 if ephemeral_start - low >= 1024 else 0):
        port = rng.randrange(low, ephemeral_start)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_device_index(local_rank: int, visible_devices: int) -> int:
    """The CUDA device index of a task: `local_rank mod visible_devices` (with
    `--gpus-per-task=1` / `--gpu-bind` a task sees one GPU, numbered 0, whatever its local rank).

    Raises:
        ValueError: `visible_devices < 1` or `local_rank < 0`.
    """
    if visible_devices < 1:
        raise ValueError(f"no visible GPU (visible_devices={visible_devices})")
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    return local_rank % visible_devices


def bind_local_device(local_rank: int) -> torch.device:
    """Select this process's device (`local_device_index`) and return it (`cuda:i` or `cpu`).
    On CUDA, `LOCAL_RANK` is rewritten to `i` before any DeepSpeed call, because DeepSpeed uses it
    as a device index (engine `set_device`, `zero.Init`); the node-local rank stays in
    `ParallelInfo.local_rank`. On the CPU the environment is left alone.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_device_index(local_rank, torch.cuda.device_count())
    os.environ["LOCAL_RANK"] = str(index)  # DeepSpeed reads it as a device index
    torch.cuda.set_device(index)
    return torch.device(f"cuda:{index}")


def init_megatron_groups(tensor_parallel_size: int, backend: str, timeout_s: float) -> None:
    """megatron-core's TP/DP groups over the existing default group (no-op when they exist).

    `backend` (`dist.get_backend()`) including NCCL skips megatron's extra gloo groups
    (`create_gloo_process_groups=False`; their getters then raise AssertionError): nothing here
    uses them and their TCP set-up can hang on multi-NIC nodes. "gloo" keeps megatron's default.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        create_gloo_process_groups="nccl" not in str(backend))


def attempt_store(timeout_s: float) -> dist.Store:
    """A client of torchrun's agent store (MASTER_ADDR:MASTER_PORT) whose keys live under
    `refusion/attempt_<TORCHELASTIC_RESTART_COUNT>/`.

    torchrun keeps its agent store across `--max-restarts` restarts and env:// uses it without a
    per-attempt prefix, so restarted workers would read the dead workers' addresses (gloo:
    "connectFullMesh failed ... Connection refused"). timeout_s: the collective timeout.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"refusion/attempt_{attempt}", base)


def init_distributed(tensor_parallel_size: int = 1, backend: str | None = None,
                     timeout_s: float = 1800.0) -> ParallelInfo:
    """Start torch.distributed (if needed) and megatron-core's TP/DP groups.

    Reads torchrun's (RANK, WORLD_SIZE, LOCAL_RANK) or srun's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID) environment; MASTER_ADDR/MASTER_PORT must be set for more than one process
    (a lone process without them takes 127.0.0.1 and a free port, not 29500). Device:
    `bind_local_device`; rendezvous: `rendezvous_store`, or under torchrun `attempt_store`.

    Args:
        tensor_parallel_size: size of each tensor-parallel group; must divide the world size.
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
        timeout_s: collective timeout in seconds.

    Returns ParallelInfo. Raises ValueError (world size not a multiple of
    `tensor_parallel_size`) or RendezvousError (the ranks could not meet).
    """
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if world_size % tensor_parallel_size != 0:
        raise ValueError(f"world size {world_size} is not a multiple of tensor_parallel_size "
                         f"{tensor_parallel_size}")
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    device = bind_local_device(local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = None
        if world_size == 1 and "MASTER_PORT" not in os.environ:
            # a lone process needs no agreed port: its store binds one the kernel picks, in the
            # same call (a port chosen first and bound later can be taken in between)
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world_size=1, is_master=True,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            os.environ["MASTER_PORT"] = str(store.port)
        elif "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = "29500"
        if world_size > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            store = rendezvous_store(rank, world_size, timeout_s)
        elif world_size > 1:
            store = attempt_store(timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    # megatron-core is imported only now (seconds of CPU): a rank that cannot meet the others
    # says so without paying for it
    init_megatron_groups(tensor_parallel_size, dist.get_backend(), timeout_s)
    from megatron.core import parallel_state
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device)


def destroy_distributed() -> None:
    """Tear down megatron-core groups and the default process group (safe to call twice)."""
    # not imported yet: no megatron groups to tear down (and no seconds spent importing it)
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class MegatronMPU:
    """The `mpu` object DeepSpeed expects (its model-parallel = our TP group, and the DP group),
    backed by megatron-core `parallel_state`: `deepspeed.initialize(..., mpu=MegatronMPU())`."""

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


def init_single_process() -> ParallelInfo:
    """A one-process gloo group with megatron-core's groups at TP=1, for inference and tools
    (decoding, evaluation, export); does nothing when a group already exists. A free port on
    127.0.0.1 is taken unless MASTER_PORT is set."""
    return init_distributed(tensor_parallel_size=1, backend="gloo")


def broadcast_from_rank0(obj):
    """Every rank returns rank 0's `obj` (picklable), so all ranks act on one decision;
    `obj` itself without a process group or with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_on_rank0(fn, errors: tuple[type[BaseException], ...], raise_as):
    """Run `fn()` on rank 0 only and return its result on every rank (collective).

    When rank 0's call raises one of `errors`, every rank raises `raise_as(first line of the
    message)`, so no rank waits in a collective; other exceptions propagate on rank 0 only (the
    others then fail in their next collective).
    """
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except errors as e:
            text = str(e).strip().strip("'\"")
            error = text.splitlines()[0] if text else type(e).__name__
    result, error = broadcast_from_rank0((result, error))
    if error is not None:
        raise raise_as(error)
    return result

