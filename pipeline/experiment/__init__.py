"""The scaled-down ReFusion-vs-AR experiment (`make experiment`, `python -m pipeline.experiment`).

Owns: the recipe's stages (`recipe`: their order, the CLI and `Experiment`, which mixes in one
class per stage: `data`; `training`, AR pretraining and equal-compute ReFusion fine-tuning vs
AR continued training; `export`; `evaluation`, the decoding grid and the diagnosis; `report`;
what they share in `stage`), the tasks' fixed choices (`tasks`: `code`, `math`, `mbpp`), the
identity of a stage's inputs and its reuse (`reuse`), the teacher-forced diagnosis
(`diagnosis`), the report's text and figures (`writeup`) and its ratios to AR and target
check (`ratios`). Must not touch: training, decoding and evaluation loops
(it runs `pipeline.train`, `pipeline.export` and data_prep as subprocesses and calls
`pipeline.inference.evaluation` and `pipeline.report` as libraries).
"""
from pipeline.experiment.recipe import Experiment, main
from pipeline.experiment.stage import StageError
from pipeline.experiment.tasks import TASKS, Setting

__all__ = ["Experiment", "StageError", "main", "TASKS", "Setting"]
