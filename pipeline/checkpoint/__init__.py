"""Training checkpoints, as a package.

- `store.py`: save (crash-safe, every rank), find the latest complete one, load, retention;
- `reshard.py`: resume a ZeRO-3 checkpoint on another data/tensor-parallel layout;
- `consolidate.py`: read a finished checkpoint offline (per-TP-rank fp32 weights, full Hugging
  Face tensors for export and inference);
- `safe_load.py`: read one checkpoint `.pt` file without running code from it (allow-list);
- `errors.py`: the error types (a leaf module).

The names below are the package's public API; import the rest from its module.
"""
from pipeline.checkpoint.consolidate import (consolidate_state_dict, consolidate_tp_ranks,
                                             hf_export_state, open_tp_ranks,
                                             read_checkpoint_info)
from pipeline.checkpoint.errors import CheckpointError, CheckpointWriteError
from pipeline.checkpoint.store import (find_latest, is_complete, list_complete, load_latest,
                                       resolve_checkpoint_dir, save_checkpoint, tag_for_step)

__all__ = ["consolidate_state_dict", "consolidate_tp_ranks", "hf_export_state",
           "open_tp_ranks", "read_checkpoint_info", "CheckpointError", "CheckpointWriteError",
           "find_latest", "is_complete", "list_complete", "load_latest", "resolve_checkpoint_dir",
           "save_checkpoint", "tag_for_step"]
