"""Step metrics of the training job: device peaks for MFU, peak memory, and the console line.

Owns: `peak_flops_per_device` (the MFU and HFU denominator), `peak_memory_bytes`, `ConsoleLog`
(the console line of a train or validation record, train losses averaged over the steps since
the previous line, Megatron-style), `StragglerTracker` (the slowest rank of a log interval,
its skew, the straggler warning) and the per-source accounting helpers (`source_names`,
`target_shares`, `source_tokens`, `source_losses`: a loader's data sources, the tokens of a
batch per source, the per-source loss of summed CE). What a record holds is the trainer's
(`pipeline.train`); where records go is `pipeline.monitor`'s. Must not touch: metrics.jsonl,
wandb.
"""
from __future__ import annotations

import logging

log = logging.getLogger("pipeline.train")


def source_names(loader) -> tuple[str, ...]:
    """Names of the loader's data sources, indexed by source id (a batch's `source` values):
    its `source_names`, or ("data",) for a loader of one shard folder without them."""
    return tuple(str(n) for n in (getattr(loader, "source_names", None) or ("data",)))


def target_shares(loader, n: int) -> tuple[float, ...] | None:
    """Target token share of each of the `n` sources (the normalized `data.sources[i].weight`,
    the loader's `source_weights`); (1.0,) for one source without them; None when several
    sources have none.

    Raises:
        ValueError: the loader gives a number of weights other than `n`.
    """
    w = getattr(loader, "source_weights", None)
    if w is None:
        return (1.0,) if n == 1 else None
    if len(w) != n:
        raise ValueError(f"the loader gives {len(w)} source weight(s) for {n} source name(s)")
    return tuple(float(x) for x in w)


def source_tokens(batch: dict, n: int):
    """Non-padding tokens of a micro-batch per source (the batch's `real_tokens`, split).

    Args:
        batch: a collate dict on the CPU (`source`, `segment_ids`: LongTensor[B, T]; no
            `source` = every token of source 0).
        n: number of sources.

    Returns:
        LongTensor[n] (CPU), summing to `real_tokens`.

    Raises:
        ValueError: a token's source id is >= n (the loader's ids and names disagree).
    """
    import torch
    real = batch["segment_ids"] > 0
    src = batch.get("source")
    if src is None:
        counts = torch.zeros(n, dtype=torch.long)
        counts[0] = real.sum()
        return counts
    counts = torch.bincount(src[real], minlength=n)
    if counts.numel() > n:
        raise ValueError(f"batch source id {counts.numel() - 1} >= the loader's {n} source "
                         f"name(s)")
    return counts


def source_losses(ce_sums, labelled, names) -> dict:
    """Per-source mean cross-entropy: {name: ce_sums[i] / labelled[i] (nats), None when the
    source had no labelled token}. `ce_sums`, `labelled`: sequences of len(names) floats."""
    return {name: (float(c) / float(k) if float(k) > 0 else None)
            for name, c, k in zip(names, ce_sums, labelled)}


def peak_flops_per_device(cfg) -> float | None:
    """Peak FLOP/s of one device: `log.peak_tflops` when set, else the table of known parts by
    CUDA device name (`pipeline.model.PEAK_BF16_TFLOPS`), else None with one notice (CPU or
    unknown GPU: MFU is reported as null, never a guessed figure)."""
    if cfg.log.peak_tflops is not None:
        return float(cfg.log.peak_tflops) * 1e12
    import torch
    from pipeline.model import peak_tflops_of_device
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tflops = peak_tflops_of_device(name)
    if tflops is None:
        log.info("MFU not reported: no peak TFLOP/s known for device %r; set log.peak_tflops",
                 name)
        return None
    return tflops * 1e12


def peak_memory_bytes() -> int:
    """Peak memory of this process in bytes: CUDA max allocated on GPU, else peak RSS (CPU)."""
    import torch
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


class ConsoleLog:
    """Console lines of the training job (rank 0).

    A train record is printed every `log_interval` steps (and at a skipped step); its losses are
    the means over the steps since the previous line (one step's MDM term is noisy), while
    metrics.jsonl and wandb keep every step. A validation record is printed at once.

    Args:
        max_steps: `train.max_steps` (printed as `step i/N`).
        log_interval: `train.log_interval`.
    """

    def __init__(self, max_steps: int, log_interval: int):
        self.max_steps, self.log_interval = max_steps, log_interval
        self._window: list[tuple[float, float, float]] = []

    def __call__(self, m: dict) -> None:
        """Print `m` (a record with `kind` "train" or "val") when its line is due."""
        if m["kind"] != "train":
            log.info("validation at step %d: loss %s | ar %s | mdm %s (%d micro-batches per DP "
                     "rank)", m["step"], _num(m["val_loss"], ".4f"), _num(m["val_ar_loss"], ".4f"),
                     _num(m["val_mdm_loss"], ".4f"), m["val_batches"])
            return
        if not m["skipped"]:
            self._window.append((m["loss"], m["ar_loss"], m["mdm_loss"]))
        if m["step"] % self.log_interval and not m["skipped"]:
            return
        m = dict(m)
        if self._window:
            n = len(self._window)
            m["loss"], m["ar_loss"], m["mdm_loss"] = (sum(v[i] for v in self._window) / n
                                                      for i in range(3))
            self._window.clear()
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
        hfu = f"{100 * m['hfu']:.1f}%" if m.get("hfu") is not None else "n/a"
        log.info("step %d/%d | loss %.4f | ar %.4f | mdm %.4f (means since last line) | lr %.3e | "
                 "grad norm %s | %.0f tokens/s | %.3f TFLOP/s/device | MFU %s | HFU %s | peak mem "
                 "%.2f GiB | samples %d | tokens %d%s", m["step"], self.max_steps, m["loss"],
                 m["ar_loss"], m["mdm_loss"], m["lr"], _num(m["grad_norm"], ".3f"),
                 m["tokens_per_s"], m["tflops_per_device"], mfu, hfu,
                 m["peak_memory_bytes"] / 2 ** 30,
                 m["consumed_samples"], m["consumed_tokens"],
                 " | SKIPPED (non-finite loss)" if m["skipped"] else "")


def gather_hosts() -> list[str]:
    """Every rank's host name, indexed by global rank (collective: one all-gather; this host
    alone without a process group)."""
    import socket
    import torch.distributed as dist
    hosts = [socket.gethostname()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
    return hosts


class StragglerTracker:
    """The straggler report of each log interval: this rank's compute time per step (`add`),
    every rank's mean over the interval (`collect`, collective) judged by `update`.

    Args:
        hosts: host name of each global rank (list of str, indexed by rank).
        factor: `train.straggler_factor`: skew above which the slowest rank counts as a straggler.
        intervals: `train.straggler_intervals`: log intervals in a row, with the same slowest
            rank above `factor`, before its warning line (printed once per rank per run).
    """

    def __init__(self, hosts: list, factor: float, intervals: int):
        self.hosts, self.factor, self.intervals = list(hosts), factor, intervals
        self._run: tuple[int, int] = (-1, 0)   # (slowest rank, intervals in a row above factor)
        self.warned: set[int] = set()
        self._compute_s: list[float] = []   # this rank's compute time per step since `collect`

    def add(self, seconds: float) -> None:
        """Note this rank's compute time of one step (seconds: the step's time minus its wait in
        the step's all-reduce)."""
        self._compute_s.append(float(seconds))

    def collect(self, rank: int, world_size: int, step: int, warn: bool = True) -> dict:
        """End the log interval (collective: one all-reduce of one float per rank): every rank's
        mean compute time per step since the last call, judged by `update` (its record)."""
        import torch
        import torch.distributed as dist
        mine = sum(self._compute_s) / len(self._compute_s) if self._compute_s else 0.0
        self._compute_s = []
        per_rank = [mine]
        if dist.is_initialized() and world_size > 1:
            v = torch.zeros(world_size, dtype=torch.float64)
            v[rank] = mine
            dist.all_reduce(v)
            per_rank = v.tolist()
        return self.update(per_rank, step, warn=warn)

    def update(self, per_rank: list[float], step: int, warn: bool = True) -> dict:
        """Judge one log interval.

        Args:
            per_rank: each rank's mean compute time per step over the interval (seconds,
                indexed by global rank).
            step: optimizer steps done (for the warning line).
            warn: log the warning line from this process (rank 0).

        Returns:
            {"straggler_rank": int, "straggler_host": str, "straggler_compute_s": float,
            "median_compute_s": float, "straggler_skew": float (slowest / median; 1.0 when the
            median is 0)}.
        """
        import statistics
        slowest = max(range(len(per_rank)), key=lambda r: (per_rank[r], -r))
        median = statistics.median(per_rank)
        skew = per_rank[slowest] / median if median > 0 else 1.0
        rank, run = self._run
        above = skew > self.factor
        run = (run + 1 if rank == slowest else 1) if above else 0
        self._run = (slowest, run)
        host = self.hosts[slowest] if slowest < len(self.hosts) else "?"
        if run >= self.intervals and slowest not in self.warned:
            self.warned.add(slowest)
            if warn:
                log.warning("straggler: rank %d (host %s) computed %.3f s per step against the "
                            "median rank's %.3f s (%.2fx) for %d log intervals in a row (up to "
                            "step %d; train.straggler_factor=%g)", slowest, host,
                            per_rank[slowest], median, skew, run, step, self.factor)
        return {"straggler_rank": slowest, "straggler_host": host,
                "straggler_compute_s": per_rank[slowest], "median_compute_s": median,
                "straggler_skew": skew}
