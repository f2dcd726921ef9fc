"""The bounded rendezvous (pipeline.parallel.rendezvous_store): a rank that cannot meet the
others at MASTER_ADDR:MASTER_PORT stops with one line and exit code 2 instead of waiting for the
30-minute collective timeout; once the ranks have met, the store keeps the collective timeout.

The failing runs are real `python -m pipeline.train` processes given one rank of a 2-process
job: an unresolvable MASTER_ADDR, a port on 127.0.0.1 where nothing listens (rank 1), and a
rank 0 whose peer never comes. The rendezvous bound is 2 s there (rank 1 still retries once
before it gives up); the time bound asserted (120 s) is generous: start-up on this machine
alone takes 10-20 s.
"""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from distributed import free_port, run_distributed
from shard_fixtures import random_samples, write_shards
from test_train import ROOT, _env, _write_config


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    base = tmp_path_factory.mktemp("rendezvous")
    write_shards(str(base / "data"),
                 {"train": random_samples(np.random.default_rng(0), 8, vocab_size=64,
                                          max_length=24, min_length=8)},
                 samples_per_shard=4)
    return _write_config(base / "run.yaml", base / "data", train={"eval_interval": 0}), base


def _run_rank(config, rank: int, master_addr: str, port: int, timeout: str | None):
    cfg, base = config
    env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}
    env.pop("REFUSION_RENDEZVOUS_TIMEOUT", None)
    if timeout is not None:
        env["REFUSION_RENDEZVOUS_TIMEOUT"] = timeout
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(cfg),
                        f"run_dir={base / f'run{rank}-{port}'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("rank,addr,timeout,expected", [
    # the node name of a Slurm cluster whose names are not host names; the default bound
    (1, "refusion-node.invalid", None,
     "MASTER_ADDR=refusion-node.invalid does not resolve"),
    # resolvable, but nobody listens there
    (1, "127.0.0.1", "2", "nothing answers at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} after 2 s"),
    # rank 0 hosts the store; its peer never arrives
    (0, "127.0.0.1", "2",
     "only 1 of 2 ranks joined the rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} "
     "within 2 s"),
    # a malformed bound is a one-line error too
    (1, "127.0.0.1", "soon", "REFUSION_RENDEZVOUS_TIMEOUT='soon' is not a positive number"),
])
def test_rendezvous_failure_is_one_line_and_exit_2(config, rank, addr, timeout, expected):
    port = free_port()
    r, elapsed = _run_rank(config, rank, addr, port, timeout)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pipeline.")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("pipeline.train: error: " + expected.format(port=port)), lines[0]
    assert lines[0].endswith("(rank 1)") == (rank == 1), lines[0]
    # no Python traceback, no C++ stack of torch's connect retries
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr[-3000:]
    assert elapsed < 120, elapsed


def test_rendezvous_timeout_env(monkeypatch):
    from pipeline.parallel import RendezvousError, rendezvous_timeout_s
    monkeypatch.delenv("REFUSION_RENDEZVOUS_TIMEOUT", raising=False)
    assert rendezvous_timeout_s() == 60.0
    monkeypatch.setenv("REFUSION_RENDEZVOUS_TIMEOUT", "2.5")
    assert rendezvous_timeout_s() == 2.5
    for bad in ("0", "-3", "inf", "nan", "1m"):
        monkeypatch.setenv("REFUSION_RENDEZVOUS_TIMEOUT", bad)
        with pytest.raises(RendezvousError, match="REFUSION_RENDEZVOUS_TIMEOUT"):
            rendezvous_timeout_s()


def _store_timeout_body(rank, world_size):
    import os
    import torch
    import torch.distributed as dist
    from pipeline.parallel import init_distributed
    os.environ["REFUSION_RENDEZVOUS_TIMEOUT"] = "7"
    init_distributed(tensor_parallel_size=1, timeout_s=1234.0)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    return t.item(), store.timeout.total_seconds()


def test_store_keeps_the_collective_timeout_after_the_rendezvous():
    """The 7 s bound applies to the join only: afterwards the store (which collectives and the
    trainer's error reporting use) waits as long as the collective timeout, 1234 s."""
    assert run_distributed(_store_timeout_body, world_size=2) == [(3.0, 1234.0), (3.0, 1234.0)]
