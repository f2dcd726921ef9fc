"""The scaled-down ReFusion-vs-AR experiment (`make experiment`); see recipe.py."""
from pipeline.experiment.recipe import *  # noqa: F401,F403
from pipeline.experiment.recipe import main  # noqa: F401
