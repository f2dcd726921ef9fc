"""The scaled-down ReFusion-vs-AR experiment (`make experiment`, `python -m pipeline.experiment`).

Owns: the recipe's stages (`recipe`: data, AR pretraining, equal-compute ReFusion fine-tuning
vs AR continued training, exports, the decoding grid, the diagnosis, the report), the tasks'
fixed choices (`tasks`: `code` and `math`), the identity of a stage's inputs and its reuse
(`reuse`), the teacher-forced diagnosis (`diagnosis`) and the report's text and figures
(`writeup`). Must not touch: training, decoding and evaluation loops
(it runs `pipeline.train`, `pipeline.export` and data_prep as subprocesses and calls
`pipeline.inference.evaluation` and `pipeline.report` as libraries).
"""
from pipeline.experiment.recipe import Experiment, main
from pipeline.experiment.stage import StageError
from pipeline.experiment.tasks import TASKS, Setting

__all__ = ["Experiment", "StageError", "main", "TASKS", "Setting"]
