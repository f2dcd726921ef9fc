import sys

from pipeline.experiment.recipe import main

sys.exit(main())
