"""The pieces of the training job that `pipeline.train` (the orchestration) puts together.

- `engine.py`: the DeepSpeed config, ZeRO sizes, the model under `zero.Init` with its initial
  weights, optimizer parameter groups;
- `schedule.py`: the learning-rate schedule (`lr_at`);
- `state.py`: `TrainState` (progress counters, wandb run id, deferred validation, shard sets) with
  `state_dict()` / `load_state_dict()`, the checkpoint's client state, the resume plan;
- `startup.py`: the start-up checks (memory plan, write probe, passes per data source, a resumed
  run's lr schedule), seeds, logging;
- `validation.py`: the validation loss (the trainer's pass over all ranks, and one process);
- `metrics.py`: a step's figures and its "train" record (`StepTally`), the MFU denominator, peak
  memory, the console lines, the straggler report;
- `faults.py`: fault injection in the step (the `debug` section);
- `watchdog.py`: hang detection; `job.py`: what a process needs from its launcher;
  `memory_plan.py`: the per-GPU memory plan.
"""
