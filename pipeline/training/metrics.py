"""Step metrics of the training job: device peaks for MFU, peak memory, and the console line.

Owns: `StepTally` (a step's figures per micro-batch, its all-reduced vector, its "train"
record), `peak_flops_per_device` (the MFU and HFU denominator), `peak_memory_bytes`, `ConsoleLog`
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


def source_loss_text(by_source: dict | None) -> str:
    """" | by source: a 1.2345, b n/a" for a validation line when there are two or more sources
    (a `source_losses` dict); "" for one source or none."""
    if not by_source or len(by_source) < 2:
        return ""
    return " | by source: " + ", ".join(f"{k} {_num(v, '.4f')}" for k, v in by_source.items())


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
            log.info("validation at step %d: loss %s | ar %s | mdm %s%s (%d micro-batches per "
                     "DP rank)", m["step"], _num(m["val_loss"], ".4f"),
                     _num(m["val_ar_loss"], ".4f"), _num(m["val_mdm_loss"], ".4f"),
                     source_loss_text(m.get("loss_by_source")), m["val_batches"])
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


# The step's one all-reduced vector (`StepTally.packed`), summed over the world: loss, ar, mdm
# sums over finite micro-batches, real tokens, rows, non-finite micro-batches, signal flag, model
# FLOPs, hardware FLOPs, copy tokens, dropped copies, then tokens per source (S), CE sums per
# source (S) and labelled tokens per source (S) over finite micro-batches. TP ranks repeat their
# DP rank's figures, so global figures are sums / TP size.
NONFINITE, SIGNAL = 5, 6


class StepTally:
    """This rank's figures of one optimizer step, added up per micro-batch without reading a
    device value on the host (FLOPs and token counts from the batch's CPU tensors), packed for
    the step's all-reduce, and the step's "train" record (its fields: `pipeline.train`) read
    from the all-reduced sums.

    Args:
        mcfg: the `ModelConfig` (for `pipeline.model.flops.step_flops`).
        loss_impl: `train.loss_impl`.
        names: the data sources' names, by source id (`source_names`).
    """

    def __init__(self, mcfg, loss_impl: str, names):
        import torch
        self.mcfg, self.loss_impl, self.names = mcfg, loss_impl, tuple(names)
        self.per_micro: list = []     # detached [loss, ar, mdm] per micro-batch (on device)
        self.per_source: list = []    # detached [CE sum x S, labelled x S] per micro-batch
        self.keys_of: list[list[str]] = []   # each micro-batch's sample keys
        self.src_tokens = torch.zeros(len(self.names), dtype=torch.long)  # tokens per source
        self.tokens = self.rows = 0
        self.copy_tokens = self.dropped_copies = 0   # objective mode "dual": copies fed / left out
        self.model_flops = self.hw_flops = 0.0

    def add_batch(self, batch: dict) -> None:
        """Count a micro-batch (the loader's collate dict, on the CPU)."""
        from pipeline.model import segment_lengths
        from pipeline.model.flops import step_flops
        self.keys_of.append(list(batch.get("keys", [])))
        real = int(batch["real_tokens"])
        self.tokens += real
        self.src_tokens += source_tokens(batch, len(self.names))
        self.copy_tokens += int(batch.get("copy_tokens", 0))
        self.dropped_copies += int(batch.get("dropped_copies", 0))
        self.rows += int(batch["input_ids"].shape[0])
        seg_len = batch.get("segment_lengths")
        labelled = batch.get("label_index")
        mf, hf = step_flops(
            self.mcfg, seg_len if seg_len is not None else segment_lengths(batch["segment_ids"]),
            int(labelled.numel()) if labelled is not None
            else int((batch["labels"] != -100).sum()),
            batch["input_ids"].numel() - real, self.mcfg.recompute, self.loss_impl)
        self.model_flops += mf
        self.hw_flops += hf

    def add_losses(self, loss, stats: dict) -> None:
        """Keep a micro-batch's loss (scalar tensor) and `hybrid_loss`'s stats, detached."""
        import torch
        self.per_micro.append(torch.stack([loss.detach().float(), stats["ar_loss"].float(),
                                           stats["mdm_loss"].float()]))
        self.per_source.append(torch.cat([stats["ce_sum_by_source"],
                                          stats["labelled_by_source"].double()]))

    def packed(self, signal: bool):
        """The vector to all-reduce (DoubleTensor[11 + 3S], on the losses' device; layout
        above); `signal`: this rank received a stop signal."""
        import torch
        vals = torch.stack(self.per_micro).double()                       # [GA, 3]
        self.finite = torch.isfinite(vals[:, 0])
        by_src = torch.stack(self.per_source)                             # [GA, 2S]
        finite = self.finite[:, None]
        return torch.cat([torch.where(finite, vals, torch.zeros_like(vals)).sum(0),
                          vals.new_tensor([self.tokens, self.rows, float((~self.finite).sum()),
                                           1.0 if signal else 0.0, self.model_flops,
                                           self.hw_flops, self.copy_tokens, self.dropped_copies,
                                           *self.src_tokens.tolist()]),
                          torch.where(finite, by_src, torch.zeros_like(by_src)).sum(0)])

    def nonfinite_batches(self) -> list[tuple[int, list[str]]]:
        """(micro-batch index, its sample keys) of this rank's non-finite losses (after
        `packed`)."""
        return [(i, keys) for i, keys in enumerate(self.keys_of) if not bool(self.finite[i])]

    def record(self, sums, *, step: int, tp: int, losses: int, world_size: int,
               step_time_s: float, lr: float, grad_norm, applied: bool,
               peak_flops: float | None, consumed_samples: int, consumed_tokens: int,
               shares, dual: bool) -> dict:
        """The step's "train" record from the all-reduced `sums` (CPU).

        Args:
            step: the step's number (1-based). tp: TP size. losses: micro-batch losses of the
                step over DP ranks (DP size x GA). world_size: processes.
            step_time_s: the step's wall time. lr: the lr applied. grad_norm: DeepSpeed's (or
                None). applied: DeepSpeed applied the update. peak_flops: FLOP/s of one device
                (None: MFU/HFU null). consumed_samples / consumed_tokens: before this step.
            shares: the sources' target token shares (`target_shares`) or None.
            dual: objective mode "dual" (adds clean_tokens, copy_tokens, dropped_copies).
        """
        n_src = len(self.names)
        n_losses = losses - sums[NONFINITE].item() / tp
        tokens = int(round(sums[3].item() / tp))  # global: sum over DP ranks (TP ranks repeat)
        rows = int(round(sums[4].item() / tp))
        dt = step_time_s
        flops = sums[7].item() / tp / dt / world_size   # model FLOP/s per device
        hw = sums[8].item() / tp / dt / world_size      # hardware FLOP/s per device
        src = sums[11:].div(tp).tolist()   # [tokens x S, CE sums x S, labelled x S], global
        metrics = {
            "kind": "train", "step": step,
            "loss": (sums[0].item() / tp / n_losses) if n_losses else float("nan"),
            "ar_loss": (sums[1].item() / tp / n_losses) if n_losses else float("nan"),
            "mdm_loss": (sums[2].item() / tp / n_losses) if n_losses else float("nan"),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None and applied else None,
            "tokens_per_s": tokens / dt, "tflops_per_device": flops / 1e12,
            "mfu": (flops / peak_flops) if peak_flops else None,
            "hfu": (hw / peak_flops) if peak_flops else None,
            "peak_memory_bytes": peak_memory_bytes(),
            "consumed_samples": consumed_samples + rows,
            "consumed_tokens": consumed_tokens + tokens,
            "step_time_s": dt, "skipped": not applied,
            "tokens_by_source": {n: int(round(v)) for n, v in zip(self.names, src[:n_src])},
            "loss_by_source": source_losses(src[n_src:2 * n_src], src[2 * n_src:], self.names),
        }
        if shares is not None:
            metrics["target_share_by_source"] = dict(zip(self.names, shares))
        if dual:
            # fed tokens of the step (global): clean + copy = the step's non-padding tokens
            copies = int(round(sums[9].item() / tp))
            metrics.update({"clean_tokens": tokens - copies, "copy_tokens": copies,
                            "dropped_copies": int(round(sums[10].item() / tp))})
        return metrics
