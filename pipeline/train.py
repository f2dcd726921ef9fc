"""The training job: `python -m pipeline.train --config configs/<run>.yaml [key=value ...]`.

Owns: the orchestration of a run (`Trainer`: set-up order, the training step, the loop, checkpoint
and validation cadence, auto-resume, SIGTERM/SIGUSR1/SIGINT handling, the NaN policy) and the
entry point (`main`: config errors, a dead peer's one line, exit codes). The pieces it
orchestrates live in `pipeline.training` (its `__init__` lists them) and below. Must not touch:
the network (`pipeline.model`), the objective (`pipeline.objective`), shard reading
(`pipeline.data`), the checkpoint format (`pipeline.checkpoint`), config validation
(`pipeline.config`).

Said elsewhere, once: launching, resuming, signals and exit codes for users in README.md
"Training"; the job's contract (metrics.jsonl fields, files in the run folder, resume checks) in
ARCHITECTURE.md "Training job"; what each exit code means in `pipeline.common.cli`; hang
detection in `pipeline.training.watchdog`.

One optimizer step (all ranks):
  for each of the `grad_accum_steps` micro-batches: forward -> `hybrid_loss` -> backward
  (DeepSpeed scales by 1/GA and reduces gradients over the data-parallel group only, `mpu=`);
  one all-reduce of [loss sums, token counts, non-finite flag, signal flag, ...] over the world
  (`pipeline.training.metrics.StepTally`); NaN policy; lr = `schedule.record_lr(step)`;
  DeepSpeed step (clip, AdamW). The loss of a step is the mean of its micro-batch losses over
  data-parallel ranks and accumulation steps, which is what its gradient descends.

Signals: SIGTERM, SIGUSR1 and SIGINT on any rank finish the current step; all ranks agree through
the step's all-reduce, checkpoint and exit 0; a second SIGINT aborts at once (exit 130). Loader
workers ignore these signals (`pipeline.data.loader`). The loop's only calls for the hang
watchdog are its progress ticks (`_progress`).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from pipeline.common.cli import (EXIT_DISK_FULL, EXIT_INTERRUPTED, EXIT_NONFINITE,
                                 EXIT_PEER_LOST, EXIT_USAGE)
from pipeline.training.job import (agent_store, launcher_env, log_restart, lost_peer, report_error,
                                   reported_error_code, software_line)
from pipeline.training.schedule import schedule_record
from pipeline.training.startup import (check_source_epochs, check_write_access, memory_check,
                                       resumed_schedule, seed_everything, setup_logging)
from pipeline.training.state import TrainError, TrainState

log = logging.getLogger("pipeline.train")


def should_evaluate(step: int, eval_interval: int, stop_pending: bool) -> bool:
    """Whether to validate after optimizer step `step`: every `eval_interval` steps (0 = never),
    but not when a stop signal is pending (all ranks agreed on it in the step's all-reduce):
    the time left before the job is killed (`slurm/pretrain.sh` SIGNAL_MARGIN) goes to the
    checkpoint, not to a validation pass. The checkpoint then records `eval_pending` and the
    resumed run validates at that step before training on (same weights, same val loader,
    so the val curve has no gap)."""
    return bool(eval_interval) and step % eval_interval == 0 and not stop_pending


def _first_line(e: BaseException) -> str:
    text = str(e).strip().strip("'\"")
    return text.splitlines()[0] if text else type(e).__name__


class Trainer:
    """One training run on this process (collective: every rank builds one).

    Set-up order (`setup`): signals, process groups, seeds, write check, run lock, resume
    decision, engine (model, initial weights unless resuming, optimizer), train loader,
    checkpoint state (shard-set change), wandb.
    State that survives a restart is `self.state` (`TrainState`), the engine's and the loader's.

    Args:
        cfg: a validated `RunConfig` DictConfig.
        plan: `pipeline.config.validate(cfg)`'s derived numbers.
    """

    def __init__(self, cfg, plan):
        self.cfg, self.plan = cfg, plan
        self.signal_received = 0
        self.run_lock = None          # pipeline.runlock.RunLock (rank 0)
        self.plan_lines: list[str] = []   # the memory plan, printed once the run lock is held
        self.monitor = None           # pipeline.monitor.Monitor (metrics.jsonl, wandb), set up in setup()
        self.watchdog = None          # pipeline.training.watchdog.Watchdog, started in setup()
        self.state = TrainState()
        self.stragglers = None        # pipeline.training.metrics.StragglerTracker, set up in setup()

    @property
    def step(self) -> int:
        """Optimizer steps done (`self.state.step`)."""
        return self.state.step

    # -- set-up ---------------------------------------------------------------------------

    def _install_signals(self) -> None:
        """SIGTERM/SIGUSR1/SIGINT set a flag read at the end of each step (checkpoint, exit 0).
        After the first SIGINT, Python's default handler is back: a second Ctrl-C raises
        KeyboardInterrupt (`main`: one line, exit 130)."""
        def handler(signum, frame):
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            self.signal_received = signum
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, handler)

    def setup(self) -> None:
        """Process groups, seeds, write check, run lock, engine + initial weights, loaders,
        resume (with `data.on_shard_change`), wandb."""
        import torch

        from pipeline.parallel import init_distributed, run_on_rank0

        cfg = self.cfg
        self._install_signals()
        if torch.cuda.is_available():  # NCCL's watchdog + flight recorder (parallel.nccl_defaults)
            from pipeline.parallel import nccl_defaults
            nccl_defaults(str(cfg.run_dir))
        # The ranks meet before DeepSpeed and megatron-core are imported (seconds of CPU per
        # process): a rank that cannot meet the others (RendezvousError) stops without them.
        self.info = info = init_distributed(self.plan.tp_size,
                                            timeout_s=float(cfg.train.collective_timeout_s))
        import deepspeed
        from omegaconf import OmegaConf

        from pipeline import checkpoint as ckpt
        from pipeline.model import ModelConfig
        from pipeline.objective import ObjectiveConfig
        from pipeline.training.engine import build_engine, initial_weights
        from pipeline.training.faults import Faults
        from pipeline.training.metrics import (ConsoleLog, StragglerTracker, gather_hosts,
                                               peak_flops_per_device)
        from pipeline.training.state import plan_for_resume
        from pipeline.training.watchdog import rank_checkpoint_bytes, start_watchdog

        # deepspeed.comm wraps the existing default group (zero.Init reads ranks through it).
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   auto_mpi_discovery=False)
        self.is_rank0 = info.rank == 0
        setup_logging(self.is_rank0)
        if self.is_rank0:
            log.info(software_line())
        self.device = info.device
        seed_everything(cfg.train.seed)
        self.objective_cfg = ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))
        if self.objective_cfg.mode == "dual":
            log.info("objective.mode=dual: training and validation forwards attend with the "
                     "dual pattern built on the device (flex with model.attention=flex, else a "
                     "dense [B, 1, T, T] mask and SDPA; model.attention=%s)",
                     self.plan.model_fields.get("attention") or "auto")
        self.mcfg = ModelConfig.from_dict(dict(self.plan.model_fields), source="model")
        self.ckdir = self.plan.checkpoint_dir
        self.console = ConsoleLog(cfg.train.max_steps, cfg.train.log_interval)
        self.faults = Faults(cfg.debug, info.rank)
        check_write_access(cfg.run_dir, self.ckdir, self.is_rank0)
        self._lock_run_dir()
        if self.is_rank0 and self.plan_lines:  # after the lock: a refused job prints only that
            print("\n".join(self.plan_lines), file=sys.stderr, flush=True)
        t = cfg.train
        self.stragglers = StragglerTracker(gather_hosts(), float(t.straggler_factor),
                                           int(t.straggler_intervals))
        if self.is_rank0:
            log_restart(str(cfg.run_dir))
        self.watchdog = start_watchdog(cfg.run_dir, info.rank, info.world_size, t,
                                       on_exit=self._release_lock)

        # Resume decided before building: a resumed run does not need initial weights.
        latest = run_on_rank0(lambda: ckpt.find_latest(self.ckdir) if cfg.checkpoint.resume
                              else None, (), TrainError)
        if latest is not None and cfg.checkpoint.reshard:  # another layout keeps the global batch
            self.plan = run_on_rank0(lambda: plan_for_resume(self.plan, latest), (TrainError,),
                                     TrainError)
        init, source = (None, "") if latest is not None else initial_weights(
            cfg, self.mcfg, info.tp_rank, info.tp_size)
        try:
            self.engine = build_engine(cfg, self.plan, self.mcfg, init, source)
        except (KeyError, ValueError, OSError) as e:  # the same files on every rank
            if cfg.init.source != "hf" or latest is not None:
                raise
            raise TrainError(f"init.hf_path: {_first_line(e)}") from None

        if self.watchdog is not None:  # the save allowance scales with this rank's share
            self.watchdog.policy.rank_checkpoint_bytes = rank_checkpoint_bytes(
                self.engine, info.tp_size, info.world_size)
        self.train_loader = self._build_loader(cfg.data.train_split, train=True)
        if latest is not None:
            change = self._resume()
        else:
            change = None
            self.state.lr_schedule = schedule_record(cfg.optim, cfg.train.max_steps)
            self.state.track_phase(cfg.data.phase, 0, self.train_loader)
        ld = self.train_loader
        if "phase" not in (change or {}):
            self.state.track_shard_set({"fingerprint": ld.fingerprint, "data_dir": ld.data_dir,
                                        "epoch": ld.epoch, "samples_per_epoch": ld.samples_per_epoch},
                                       change)
        check_source_epochs(self.train_loader, cfg, self.plan, self.step, self.is_rank0)
        self._init_wandb()
        self.peak_flops = peak_flops_per_device(cfg)

    def _resume(self) -> dict | None:
        """Load the latest checkpoint into the engine, `self.state` and the train loader, check
        the lr schedule against it (`startup.resumed_schedule`) and log what changed. Returns
        the loader's change (`data.on_shard_change=new_pass` or a new `data.phase`), or None."""
        from pipeline import checkpoint as ckpt
        cfg = self.cfg
        state = ckpt.load_latest(self.engine, self.ckdir, model_config=self.mcfg,
                                 reshard=bool(cfg.checkpoint.reshard))
        if state is None:
            raise RuntimeError(f"{self.ckdir}: the latest checkpoint vanished while resuming")
        self.state.load_state_dict(state)
        change = self.train_loader.load_state_dict(
            state["loader"], allow_reshard="resharded_from" in state,
            on_shard_change=cfg.data.on_shard_change)
        if change is not None and "phase" in change:   # data.phase raised: a new data phase
            log.info("data phase %d from step %d (was %d): sources %s; positions kept (samples "
                     "drawn before: %s); weights, optimizer and lr schedule continue",
                     change["phase"], self.step + 1, change["from_phase"],
                     ", ".join(f"{n} {w:.3g}" for n, w in zip(self.train_loader.source_names,
                                                                self.train_loader.source_weights)),
                     change["positions"])
        elif change is not None:  # data.on_shard_change=new_pass on a rebuilt shard set
            log.info("the training shards changed since step %d (shard set %s of %s -> %s of "
                     "%s, %d samples per epoch); data.on_shard_change=new_pass: weights, "
                     "optimizer and lr schedule continue, the data starts a new pass "
                     "(epoch %d) over the new set", self.step, change["from"],
                     change["from_dir"] or "an unrecorded folder", change["to"], cfg.data.dir,
                     change["samples_per_epoch"], change["epoch"])
        explicit = (None if change is None else f"data.phase={cfg.data.phase}"
                    if "phase" in change else "data.on_shard_change=new_pass")
        self.state.lr_schedule = resumed_schedule(self.state.lr_schedule, state["config"], cfg,
                                                  self.step, explicit)
        self.state.track_phase(cfg.data.phase, self.step, self.train_loader)
        # a validation a stop signal deferred at this step, if this run still validates there
        self.state.eval_pending = self.state.eval_pending and should_evaluate(
            self.step, cfg.train.eval_interval, False)
        log.info("resumed from %s at step %d", state["checkpoint_dir"], self.step)
        return change

    def _release_lock(self) -> None:
        """Release the run lock if this rank holds it (the watchdog calls it before a hang exit)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _progress(self, phase: str, step: int | None = None) -> None:
        """A progress tick for the hang watchdog (no I/O)."""
        if self.watchdog is not None:
            self.watchdog.progress(phase, step)

    def _lock_run_dir(self) -> None:
        """One job per run directory (`pipeline.runlock`): rank 0 takes `<run_dir>/run.lock`;
        when a live job holds it, every rank raises TrainError (one line naming the holder)."""
        from pipeline.parallel import run_on_rank0
        from pipeline.runlock import RunLock, RunLockError

        def take():
            self.run_lock = RunLock(self.cfg.run_dir).acquire()
            held = self.run_lock.took_over
            if held is not None:
                log.warning("took over the run lock of %s (host %s, pid %s, SLURM job %s): %s",
                            self.cfg.run_dir, held.get("host"), held.get("pid"),
                            held.get("slurm_job_id"), held["reason"])
        run_on_rank0(take, (RunLockError,), TrainError)

    def _build_loader(self, split: str, train: bool):
        """A `pipeline.data` loader of `split` for this data-parallel rank (the TP ranks of a DP
        group get identical batches). Training: shuffled, infinite (a mixture: its blend);
        validation: manifest order (a mixture: every source's split in turn), one pass (built
        afresh for every evaluation)."""
        d = self.cfg.data
        from pipeline.config import data_sources
        from pipeline.data import build_loader
        return build_loader(d.dir if not d.sources else data_sources(d), split,
                            self.plan.micro_batch_size, self.plan.row_length,
                            dp_rank=self.info.dp_rank, dp_size=self.info.dp_size,
                            seed=self.cfg.train.seed, num_workers=d.num_workers if train else 0,
                            objective_cfg=self.objective_cfg, pack=d.pack, packing=d.packing,
                            shuffle_buffer=d.shuffle_buffer, shuffle=train, infinite=train,
                            vocab_size=self.mcfg.vocab_size, verify_shards=d.verify_shards,
                            phase=d.phase)

    def _init_wandb(self) -> None:
        """Start (or resume, same run id) the wandb run through `pipeline.monitor.Monitor`
        (rank 0); its failure is a TrainError on every rank (one line, exit 2)."""
        from omegaconf import OmegaConf
        from pipeline.monitor import Monitor
        from pipeline.parallel import run_on_rank0
        cfg = self.cfg
        self.monitor = Monitor(cfg.run_dir, self.is_rank0, cfg.wandb,
                               OmegaConf.to_container(cfg, resolve=True))
        if cfg.wandb.mode == "disabled":
            return
        # e.g. online mode without credentials or network: RuntimeError
        self.state.wandb_run_id = run_on_rank0(
            lambda: self.monitor.start_wandb(self.state.wandb_run_id, self.step),
            (RuntimeError,), TrainError)

    # -- the loop -------------------------------------------------------------------------

    def _batch_to_device(self, batch: dict) -> dict:
        """The batch's tensors on the device. On CUDA they are pinned first, so that the copies
        are asynchronous: a copy from pageable memory makes the host wait for the stream."""
        pin = self.device.type == "cuda"
        return {k: ((v.pin_memory() if pin else v).to(self.device, non_blocking=True)
                    if hasattr(v, "to") else v) for k, v in batch.items()}

    def _next_batch(self) -> dict:
        if not hasattr(self, "_train_iter"):
            self._train_iter = iter(self.train_loader)
        return next(self._train_iter)

    def train_step(self) -> tuple[dict, bool, bool]:
        """Run one optimizer step (GA micro-batches). Returns (metrics, nonfinite, signal).

        Nothing in the micro-batch loop reads a device value on the host: the labelled positions
        and varlen boundaries come with the batch (`objective.collate`, in the loader workers),
        FLOPs are counted from the batch's CPU tensors, and the step's figures are read once,
        after its all-reduce."""
        import functools

        import torch.distributed as dist
        from pipeline.objective import hybrid_loss
        from pipeline.training.schedule import record_lr
        from pipeline.training.metrics import (NONFINITE, SIGNAL, StepTally, source_names,
                                               target_shares)

        cfg, plan, eng = self.cfg, self.plan, self.engine
        step_no = self.step + 1
        t0 = time.perf_counter()
        self.faults.start_step()
        tally = StepTally(self.mcfg, cfg.train.loss_impl, source_names(self.train_loader))
        t = cfg.train
        if t.loss_impl == "chunked":
            loss_kw = {"head": eng.module.head_logits, "chunk_tokens": t.loss_chunk_tokens}
        else:
            loss_kw = {"head_loss": functools.partial(eng.module.head_loss, impl=t.loss_impl,
                                                      chunk_tokens=t.loss_chunk_tokens)}
        for micro in range(plan.grad_accum_steps):
            self._progress("data", self.step)
            self.faults.before_batch(micro, step_no)
            batch = self._next_batch()
            tally.add_batch(batch)
            b = self._batch_to_device(batch)
            self._progress("forward_backward")
            hidden = eng(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"],
                         copy_id=b.get("copy_id"), clean_limit=b.get("clean_limit"),  # "dual"
                         return_hidden=True, cu_seqlens=b.get("cu_seqlens"),
                         max_seqlen=b.get("max_seqlen"))
            loss, stats = hybrid_loss(hidden, b, self.objective_cfg,
                                      num_sources=len(tally.names), **loss_kw)
            loss = self.faults.loss(loss, micro, step_no)
            tally.add_losses(loss, stats)
            eng.backward(loss)
            if micro < plan.grad_accum_steps - 1:
                eng.step()
        # one all-reduce over the world: losses, counts, the non-finite and signal flags
        sums = tally.packed(signal=bool(self.signal_received))
        self.faults.before_collective()
        self._progress("collective")
        t_wait = time.perf_counter()
        dist.all_reduce(sums)
        sums = sums.cpu()
        t_wait = time.perf_counter() - t_wait   # waiting for the slowest rank, mostly
        self._progress("optimizer")
        nonfinite, sig = sums[NONFINITE].item() > 0, sums[SIGNAL].item() > 0
        for micro, keys in tally.nonfinite_batches():
            print(f"pipeline.train: rank {self.info.rank}: non-finite loss at step {step_no}, "
                  f"micro-batch {micro}, batch keys {keys}", file=sys.stderr, flush=True)
        if nonfinite and cfg.train.nan_policy == "stop":
            return {"step": step_no}, True, sig

        lr = record_lr(self.step, self.state.lr_schedule)
        for g in eng.optimizer.param_groups:
            g["lr"] = lr
        eng.step()
        applied = bool(eng.was_step_applied())
        if nonfinite and applied:
            raise RuntimeError(f"step {step_no}: the loss was non-finite but DeepSpeed applied the "
                               f"update; nan_policy=skip is not supported with this ZeRO stage")
        dt = time.perf_counter() - t0
        self.stragglers.add(dt - t_wait)
        if self.watchdog is not None:
            self.watchdog.policy.record_step(dt)
        st = self.state
        metrics = tally.record(
            sums, step=step_no, tp=plan.tp_size, losses=plan.dp_size * plan.grad_accum_steps,
            world_size=plan.world_size, step_time_s=dt, lr=lr,
            grad_norm=eng.get_global_grad_norm(), applied=applied, peak_flops=self.peak_flops,
            consumed_samples=st.consumed_samples, consumed_tokens=st.consumed_tokens,
            shares=target_shares(self.train_loader, len(tally.names)),
            dual=self.objective_cfg.mode == "dual")
        st.step = step_no
        st.consumed_samples, st.consumed_tokens = (metrics["consumed_samples"],
                                                   metrics["consumed_tokens"])
        return metrics, nonfinite, sig

    def evaluate(self) -> dict:
        """Validation loss over up to `train.eval_batches` micro-batches per DP rank (0 = the
        whole split, every sample exactly once whatever the DP size), weighted by tokens and
        segments over all ranks (`pipeline.training.validation.run_validation`), so the figure
        does not depend on the DP size or micro-batch size. Returns the "val" record."""
        from pipeline.training.faults import slow_validation
        from pipeline.training.validation import run_validation

        def tick():
            slow_validation(self.cfg.debug)
            self._progress("validation")
        self._progress("validation", self.step)
        figs = run_validation(self.engine, lambda: self._build_loader(self.cfg.data.val_split,
                                                                      train=False),
                              self.plan.micro_batch_size, self.plan.row_length,
                              self.plan.tp_size, self.objective_cfg, self.device,
                              limit=self.cfg.train.eval_batches, progress=tick)
        if self.watchdog is not None:
            self.watchdog.policy.validations_seen += 1
        return {"kind": "val", "step": self.step, "val_loss": figs["val_loss"],
                "val_ar_loss": figs["val_ar_loss"], "val_mdm_loss": figs["val_mdm_loss"],
                "val_batches": figs["val_batches"], "val_tokens": figs["val_tokens"],
                "loss_by_source": figs["loss_by_source"]}

    def save(self) -> None:
        """Checkpoint now (collective) via `pipeline.checkpoint.save_checkpoint`."""
        from omegaconf import OmegaConf
        from pipeline.checkpoint import save_checkpoint
        from pipeline.training.state import checkpoint_client_state
        state = checkpoint_client_state(self.state, self.train_loader.state_dict(),
                                        OmegaConf.to_container(self.cfg, resolve=True),
                                        self.plan.global_batch_size)
        t0 = time.time()
        self._progress("checkpoint", self.step)
        save_checkpoint(self.engine, self.ckdir, self.step, state,
                        keep_last=self.cfg.checkpoint.keep, model_config=self.mcfg,
                        pause_after_write_s=float(self.cfg.debug.slow_save_s))
        if self.watchdog is not None:
            self.watchdog.policy.last_save_s = time.time() - t0
        self._last_saved = self.step
        if self.is_rank0 and self.cfg.checkpoint.reshard:  # a conversion is stale now
            from pipeline.checkpoint.reshard import remove_conversions
            remove_conversions(self.ckdir)
        log.info("checkpoint step %d saved in %.1f s", self.step, time.time() - t0)

    def _record(self, metrics: dict) -> None:
        """Rank 0: append to metrics.jsonl (MonitorError on a full disk), log to wandb (never
        raises), print the console line when due."""
        if not self.is_rank0:
            return
        metrics = dict(metrics, time_unix_s=time.time())
        self.monitor.append(metrics)
        self.monitor.log(metrics)
        self.console(metrics)

    def run(self) -> int:
        """Train to `train.max_steps`; returns the process exit code. A run resumed at (or past)
        `train.max_steps` logs one line and returns 0 without training or saving (unless a
        stop signal deferred that step's validation: it runs it and saves the step again)."""
        cfg = self.cfg
        self._last_saved = self.step
        interval = cfg.checkpoint.interval
        code = 0
        if self.step >= cfg.train.max_steps and not self.state.eval_pending:
            log.info("already at train.max_steps=%d (checkpoint step %d); nothing to do",
                     cfg.train.max_steps, self.step)
        try:
            if self.state.eval_pending:  # deferred by a stop signal at this step (should_evaluate)
                log.info("running the validation at step %d that the stop signal deferred",
                         self.step)
                self._record(self.evaluate())
                self.state.eval_pending = False
                if self.step >= cfg.train.max_steps:
                    self.save()  # the final checkpoint again, without the flag
            while self.step < cfg.train.max_steps:
                metrics, nonfinite, sig = self.train_step()
                if nonfinite and cfg.train.nan_policy == "stop":
                    if self.is_rank0:
                        print(f"pipeline.train: error: non-finite loss at step {metrics['step']}; "
                              f"stopping (train.nan_policy=stop, no checkpoint written; latest "
                              f"good checkpoint in {self.ckdir})", file=sys.stderr, flush=True)
                    code = EXIT_NONFINITE
                    break
                if self.step % cfg.train.log_interval == 0:   # the straggler report (collective)
                    self._progress("collective")
                    metrics.update(self.stragglers.collect(self.info.rank, self.info.world_size,
                                                           self.step, warn=self.is_rank0))
                metrics["data_phase"] = int(cfg.data.phase)
                self._record(metrics)
                if should_evaluate(self.step, cfg.train.eval_interval, sig):
                    self._record(self.evaluate())
                if sig:
                    self.state.eval_pending = should_evaluate(self.step,
                                                              cfg.train.eval_interval, False)
                    name = (signal.Signals(self.signal_received).name if self.signal_received
                            else "on another rank")
                    log.info("signal received (%s): checkpointing at step %d and exiting", name,
                             self.step)
                    self.save()
                    break
                if interval and self.step % interval == 0:
                    self.save()
            else:
                if self._last_saved != self.step:
                    self.save()
        except BaseException:
            code = 1
            raise
        finally:
            it = getattr(self, "_train_iter", None)
            if it is not None:  # stops the loader workers now (pipeline.data: sentinel, join)
                it.close()
            if getattr(self, "monitor", None) is not None:
                self.monitor.finish(code)   # never raises
        return code


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Parse `--config PATH [key=value ...]`, validate, train. Returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m pipeline.train",
                                 description="Train a ReFusion model (DeepSpeed ZeRO + TP).")
    ap.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="omegaconf overrides, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    from pipeline.config import ConfigError, load_config, validate
    rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    try:
        cfg = load_config(args.config, args.overrides)
        plan = validate(cfg)
        plan_lines = memory_check(cfg, plan, rank0)
    except ConfigError as e:
        # Before any process group: under torchrun / pipeline.launch the agent's store dedupes
        # (so a config error only one rank sees is still printed, once); otherwise rank 0 prints.
        store = agent_store()
        if store is not None:
            report_error(EXIT_USAGE, f"pipeline.train: config error: {e}", store)
        elif rank0:
            print(f"pipeline.train: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    launcher_env()
    from pipeline.checkpoint import CheckpointError, CheckpointWriteError
    from pipeline.common.diskspace import NotWritableError
    from pipeline.data import DataError
    from pipeline.monitor import MonitorError
    from pipeline.parallel import RendezvousError
    trainer = Trainer(cfg, plan)
    trainer.plan_lines = plan_lines
    try:
        trainer.setup()
        code = trainer.run()
    except NotWritableError as e:  # found at start-up: read-only, permission (2); no space (4)
        code = report_error(EXIT_DISK_FULL if e.failure.disk_full else EXIT_USAGE,
                             f"pipeline.train: error: {_first_line(e)}", name_rank=False)
    except (TrainError, CheckpointError, DataError, RendezvousError) as e:  # user errors at run time
        code = report_error(EXIT_USAGE, f"pipeline.train: error: {_first_line(e)}")
    except (CheckpointWriteError, MonitorError) as e:  # read-only, disk full, other write errors
        code = report_error(EXIT_DISK_FULL, f"pipeline.train: error: {_first_line(e)}",
                             name_rank=False)  # the line names the failing rank(s)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one checkpoints; see _install_signals)
        print(f"pipeline.train: rank {os.environ.get('RANK', '0')}: interrupted; no checkpoint "
              f"written for the current step", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except Exception as e:
        # A rank whose peer stopped fails in its next collective (gloo: "Connection closed by
        # peer"). A peer that reported its error: that rank's one line is the story, exit with
        # its code. A peer that died without a word (killed, crashed): one line here naming
        # this rank, exit 5 (the launcher reports the dead rank). Anything else: the traceback.
        if trainer.watchdog is not None:  # a hang was declared: its line, not a lost peer's
            trainer.watchdog.act_on_report()
        peer = reported_error_code()
        if peer is not None:
            code = peer
        else:
            lost = lost_peer(e)
            if lost is None:
                raise
            print(f"pipeline.train: rank {os.environ.get('RANK', '0')}: stopped because another "
                  f"process of this job is gone ({lost}); its own output or the launcher's line "
                  f"says why", file=sys.stderr, flush=True)
            code = EXIT_PEER_LOST
    finally:
        if trainer.watchdog is not None:
            trainer.watchdog.stop()
        if trainer.run_lock is not None:
            trainer.run_lock.release()
        from pipeline.parallel import destroy_distributed
        try:
            destroy_distributed()
        except Exception:
            pass
    return code



if __name__ == "__main__":
    exit_code = main()
    # The outcome is decided. torchrun's agent SIGTERMs the remaining workers as soon as one has
    # exited non-zero, and Python restores the default (fatal) handler during interpreter
    # shutdown: ignored from here, that signal cannot turn this worker's reported exit code into
    # "killed by SIGTERM" (an ignored disposition survives the shutdown).
    for _s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(_s, signal.SIG_IGN)
    sys.exit(exit_code)
