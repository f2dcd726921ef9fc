"""Stage 0 of the experiment, data: the task's problems, tokenizer and shards (`Task.prepare`),
the held-out examples and the shards' fingerprint.

Owns: `DataStage`, methods of `recipe.Experiment` (mixed in; they read `task`, `out`,
`shards`, `threads`, `limit_examples`, `_examples`, `_data_fp`, set by its `__init__`). Must
not touch: how a task builds its data (`pipeline.experiment.tasks`), training.
"""
from __future__ import annotations

from pipeline.experiment import reuse
from pipeline.experiment.stage import _log, _run_many


class DataStage:
    """Stage 0 of `recipe.Experiment` (see the module docstring)."""

    def stage_data(self):
        """Make the task's data under `out` (`Task.prepare`); False when the shards were there.

        Raises:
            StageError: a data_prep command failed.
        """
        if not self.task.prepare(self.out, lambda cmd: _run_many([cmd], self.threads)):
            _log(f"data: {self.shards} exists, kept")
            return False

    def examples(self, set_name: str) -> list[dict]:
        """The held-out examples of a set (the first `limit_examples` when set)."""
        if set_name not in self._examples:
            ex = self.task.examples(self.out, set_name)
            self._examples[set_name] = ex[:self.limit_examples] if self.limit_examples else ex
        return self._examples[set_name]

    def data_fingerprint(self) -> str:
        """The shards' fingerprint (`reuse.data_fingerprint`), computed once per instance."""
        if self._data_fp is None:
            self._data_fp = reuse.data_fingerprint(self.shards)
        return self._data_fp
