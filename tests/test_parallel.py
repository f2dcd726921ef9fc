"""megatron-core TP/DP groups over gloo: ranks land where the layout says; the device a task
picks from LOCAL_RANK and the visible GPUs; no megatron gloo groups under NCCL."""
import os

import pytest
import torch

from distributed import run_distributed


def _body(rank, world_size):
    from pipeline.parallel import MegatronMPU, init_distributed
    info = init_distributed(tensor_parallel_size=2)
    mpu = MegatronMPU()
    return (info.tp_rank, info.dp_rank, info.tp_size, info.dp_size,
            mpu.get_model_parallel_rank(), mpu.get_data_parallel_world_size())


def test_tp2_dp2_layout():
    results = run_distributed(_body, world_size=4)
    # TP ranks adjacent: ranks 0,1 form TP group 0; ranks 0,2 form DP group 0.
    assert results == [(0, 0, 2, 2, 0, 2), (1, 0, 2, 2, 1, 2),
                       (0, 1, 2, 2, 0, 2), (1, 1, 2, 2, 1, 2)]


@pytest.mark.parametrize("local_rank,visible,expected", [
    (0, 8, 0), (7, 8, 7),        # --gpus-per-node=8: every task sees the node's GPUs
    (5, 1, 0), (0, 1, 0),        # --gpus-per-task=1 / --gpu-bind: one visible GPU, numbered 0
    (5, 4, 1), (3, 2, 1),        # fewer visible GPUs than tasks: round robin
])
def test_local_device_index(local_rank, visible, expected):
    from pipeline.parallel import local_device_index
    assert local_device_index(local_rank, visible) == expected


@pytest.mark.parametrize("local_rank,visible", [(0, 0), (-1, 2)])
def test_local_device_index_refuses(local_rank, visible):
    from pipeline.parallel import local_device_index
    with pytest.raises(ValueError):
        local_device_index(local_rank, visible)


def test_bind_local_device_rewrites_local_rank_for_deepspeed(monkeypatch):
    """Local rank 5 with one visible GPU: cuda:0 is selected and LOCAL_RANK (which DeepSpeed
    uses as a device index) says 0; on CPU nothing changes."""
    from pipeline import parallel
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert parallel.bind_local_device(5) == torch.device("cpu")   # this machine: no CUDA
    assert os.environ["LOCAL_RANK"] == "5"
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    assert parallel.bind_local_device(5) == torch.device("cuda:0")
    assert selected == [0] and os.environ["LOCAL_RANK"] == "0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert parallel.bind_local_device(6) == torch.device("cuda:2")
    assert selected == [0, 2] and os.environ["LOCAL_RANK"] == "2"


def _gloo_groups_body(rank, world_size):
    """Real megatron-core groups over a real gloo default group: with backend "nccl" the gloo
    data-parallel group is not created (its getter asserts), with "gloo" it is."""
    import datetime
    import torch.distributed as dist
    from megatron.core import parallel_state
    from pipeline.parallel import init_megatron_groups
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    init_megatron_groups(1, "nccl", 120)
    try:
        parallel_state.get_data_parallel_group_gloo()
        nccl_has_gloo = True
    except AssertionError:
        nccl_has_gloo = False
    dp_size = parallel_state.get_data_parallel_world_size()
    parallel_state.destroy_model_parallel()
    init_megatron_groups(1, "gloo", 120)
    gloo_group = parallel_state.get_data_parallel_group_gloo()
    return nccl_has_gloo, dp_size, dist.get_world_size(gloo_group)


def test_no_megatron_gloo_groups_with_nccl():
    assert run_distributed(_gloo_groups_body, world_size=2) == [(False, 2, 2), (False, 2, 2)]


def test_single_process_without_master_port_takes_a_free_port():
    """A bare one-process run (no launcher variables) starts even when 29500 is taken."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import os, socket\n"
            "s = socket.socket()\n"
            "try:\n"
            "    s.bind(('127.0.0.1', 29500)); s.listen()\n"   # hold 29500 (or it is held already)
            "except OSError:\n"
            "    pass\n"
            "from pipeline.parallel import destroy_distributed, init_distributed\n"
            "info = init_distributed(1)\n"
            "print(info.world_size, os.environ['MASTER_PORT'])\n"
            "destroy_distributed()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    world, port = r.stdout.split()[-2:]
    assert world == "1" and port != "29500"


def test_free_port_lies_below_the_ephemeral_range_and_is_bindable():
    """No outgoing connection can be handed a free_port() port: it is below the kernel's
    ephemeral range, and it can be bound (listened on) right away."""
    import socket
    from pathlib import Path
    from pipeline.parallel import free_port
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if start - 10000 < 1024:
        pytest.skip(f"ephemeral range starts at {start}: free_port falls back to port 0")
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < start for p in ports), ports
    assert len(ports) > 1   # drawn at random, not one fixed port
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()
