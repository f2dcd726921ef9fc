"""Shared test set-up: CPU-only DeepSpeed, offline wandb, project root on sys.path."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch intra-op thread per test process: `make test`'s 3 workers share the 2 cores, and
# each worker's default of one OpenMP thread per core oversubscribed them (the test processes'
# own trainers and forked ranks already run with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _launcher_variables_stay_in_their_module():
    """A module that starts a process group in this process (a trainer built in-process) leaves
    MASTER_PORT and friends in os.environ; restore them when the module ends, so a later module
    on the same pytest-xdist worker does not hand a stale port to the trainers it launches."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tp1():
    """megatron-core parallel_state at TP=1 in this process (gloo, world size 1, free port);
    torn down, and MASTER_ADDR/MASTER_PORT restored, after the module's tests."""
    from pipeline.parallel import free_port
    from pipeline.parallel import destroy_distributed, init_distributed
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(tensor_parallel_size=1, backend="gloo")
    yield
    destroy_distributed()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# The modules that take longest (per-module sums of --durations in a whole-suite run with 3
# workers on the 2-core machine, 6 December, nothing else running), longest first.
# `make test` runs the suite in pytest-xdist workers, one module per worker at a time
# (--dist loadfile, --no-loadscope-reorder): starting these first keeps the last worker from
# finishing a long module alone after the others are done. Order only; nothing is skipped.
LONGEST_FIRST = ("test_slurm.py", "test_train.py", "test_hang.py", "test_run_safety.py",
                 "test_memory_plan.py", "test_decoding_correct.py", "test_lm_eval.py",
                 "test_generate.py", "test_train_reshard.py", "test_export.py",
                 "test_rendezvous.py", "test_lr_schedule.py", "test_decoding.py",
                 "test_export_checkpoint.py", "test_evaluate.py", "test_levers.py",
                 "test_train_data_change.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order within kept
