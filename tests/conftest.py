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


import pytest  # noqa: E402


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
