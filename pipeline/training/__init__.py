"""The pieces of the training job that `pipeline.train` (the orchestration) puts together.

- `engine.py`: the DeepSpeed config, ZeRO sizes, the model under `zero.Init` with its initial
  weights, optimizer parameter groups;
- `schedule.py`: the learning-rate schedule (`lr_at`);
- `state.py`: `TrainState` (progress counters, wandb run id, deferred validation, shard sets) with
  `state_dict()` / `load_state_dict()`, the checkpoint's client state, the resume plan;
- `validation.py`: the validation loss (the trainer's pass over all ranks, and one process);
- `metrics.py`: the MFU denominator, peak memory, the console lines.
"""
