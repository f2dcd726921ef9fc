"""The export step of stages 1 and 2: a run's latest checkpoint to a Hugging Face folder
(`hf/<run>`), kept when it is the export of that run as it is, and the key of the run an
export came from (what every cached result records).

Owns: `ExportStage`, methods of `recipe.Experiment` (mixed in; they read `shards`, `threads`
and its run names `run_dir`, `hf_dir`, and the inputs `key` of `TrainingStage`). Must not
touch: the conversion (`pipeline.export`, run as a subprocess), what identifies an export's
source (`pipeline.experiment.reuse`).
"""
from __future__ import annotations

import json
import shutil
import sys

from pipeline.experiment import reuse
from pipeline.experiment.stage import _log, _run_many


class ExportStage:
    """The exports of `recipe.Experiment` (see the module docstring)."""

    def stage_export(self, name: str):
        """Export a run's latest checkpoint to `hf_dir`, unless the export there came from this
        run as it is (`reuse.check_export`); record its source (`source.json`)."""
        from pipeline.checkpoint import find_latest
        hf, run = self.hf_dir(name), self.run_dir(name)
        if reuse.check_export(hf, run, self.key(name)):
            _log(f"export {name}: {hf} is the export of this run, reused")
            return False
        _run_many([[sys.executable, "-m", "pipeline.export",
                    str(run / "checkpoints"), str(hf), "--tokenizer",
                    str(self.shards / "tokenizer"), "--dtype", "float32", "--overwrite"]],
                  self.threads)
        shutil.copy(self.shards / "tokenizer" / "tokenizer.model", hf / "tokenizer.model")
        reuse.write_source(hf, run, self.key(name), find_latest(run / "checkpoints").name)

    def export_key(self, model: str) -> str | None:
        """The key of the run the current export of `model` came from (its `source.json`), or
        None (no export, or one from before these records)."""
        src = self.hf_dir(model) / reuse.SOURCE
        return json.loads(src.read_text()).get("key") if src.is_file() else None
