"""What every stage of the experiment shares (`pipeline.experiment.recipe` orders the stages).

Owns: a stage's return value `SKIPPED`, `StageError`, the progress line (`_log`), running
commands from the repository root (`_run_many`, its environment `_env`), the names of
`_seed<N>` and `refusion_boundary_f<F>` runs. Must not touch: any stage's work.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

from pipeline.experiment.tasks import ROOT


SKIPPED = "skipped"                # a stage's return value: the options do not ask for it


class StageError(RuntimeError):
    """A stage's command failed (message: the command and its exit code)."""


def split_seed(name: str) -> tuple[str, int | None]:
    """`refusion_seed1235` -> ("refusion", 1235); a name without the suffix -> (name, None)."""
    m = re.fullmatch(r"(.+)_seed(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def boundary_run(fraction: float) -> str:
    """Run (and export) folder name of a `refusion_boundary` arm with this natural-order share."""
    return f"refusion_boundary_f{fraction:g}"


def _log(msg: str) -> None:
    print(f"[experiment {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": env.get("DS_ACCELERATOR", "cpu"),
                "WANDB_MODE": env.get("WANDB_MODE", "offline"),
                "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore::FutureWarning"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def _run_many(cmds: list[list[str]], threads: int) -> None:
    """Run commands concurrently from the repository root; raise StageError for the first
    that failed (after all have ended)."""
    from pipeline.parallel import free_port
    procs = []
    for cmd in cmds:
        _log("$ " + " ".join(cmd))
        env = _env(threads)
        env["MASTER_PORT"] = str(free_port())   # a bare trainer's gloo rendezvous: one each
        procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, env=env)))
    failed = [(cmd, p.wait()) for cmd, p in procs]
    for cmd, rc in failed:
        if rc != 0:
            raise StageError(f"exit code {rc}: {' '.join(cmd)}")
