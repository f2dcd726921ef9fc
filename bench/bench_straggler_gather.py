"""What the straggler report costs: the one all-reduce of one float per rank that the trainer
runs at each log interval (`pipeline.training.metrics.StragglerTracker.collect`), timed in N
gloo processes.

    python bench/bench_straggler_gather.py [--procs 2] [--iters 500] [--step-s 0.2]

Prints the per-call time (median, p90, mean, in microseconds) and its share of one training
step of `--step-s` seconds (0.2 s: the tiny CPU run of the tests; with `train.log_interval=1`
the report runs every step, with the default 1 as well; larger intervals divide the share).
A benchmark, not a test: it prints figures and asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _worker(rank: int, world: int, port: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times = []
    for i in range(iters + 20):
        v = torch.zeros(world, dtype=torch.float64)   # what collect sends: one slot per rank
        v[rank] = 0.123
        t0 = time.perf_counter()
        dist.all_reduce(v)
        per_rank = v.tolist()
        max(range(world), key=lambda r: per_rank[r])
        statistics.median(per_rank)
        if i >= 20:                                    # warm-up calls not counted
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--step-s", type=float, default=0.2,
                    help="a training step's time to compare with (seconds)")
    args = ap.parse_args()
    import torch.multiprocessing as mp
    from pipeline.parallel import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.procs, port, args.iters, q))
             for r in range(args.procs)]
    for p in procs:
        p.start()
    times = sorted(q.get(timeout=600))
    for p in procs:
        p.join(timeout=60)
    med, p90 = times[len(times) // 2], times[int(0.9 * len(times))]
    mean = sum(times) / len(times)
    print(f"straggler all-reduce, {args.procs} gloo processes, {len(times)} calls: median "
          f"{med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, mean {mean * 1e6:.0f} us")
    print(f"share of a {args.step_s:g} s step at train.log_interval=1: {100 * mean / args.step_s:.3f}%"
          f"; at log_interval=10: {100 * mean / args.step_s / 10:.4f}%")


if __name__ == "__main__":
    main()
