# Two set-up commands (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates and fills its own virtual environment on first use. `make experiment` runs the
# scaled-down ReFusion-vs-AR recipe (docs/EXPERIMENTS.md; not part of `make test`) on
# TASK=math (GSM8K-form word problems, the default; four arms, about 1.6 hours on the
# 2-core VM of run 5, 2.5 times that on run 4's: docs/EXPERIMENTS.md) or
# TASK=code (stdlib functions, 47 minutes) or TASK=mbpp (MBPP-form code problems, pass@1 by running
# their tests); EXPERIMENT_ARGS passes options, e.g. "--pretrain-steps 400"
# or "--arms dual_all --seeds 1234,1235" (stages whose inputs are unchanged are reused).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed JIT-compiles C++ ops once per machine; keep them inside the project (git-ignored).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1
TASK ?= math

.PHONY: venv demo test experiment clean

venv: $(VENV)/.installed

# torch 2.13.0 first: on CPU machines it resolves to the CPU wheel; a bare `torch` pulls CUDA.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$${TORCH_VERSION:-2.13.0}"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: venv
	bash scripts/demo.sh

experiment: venv
	$(PY) -m pipeline.experiment --task $(TASK) $(EXPERIMENT_ARGS)

# pytest-xdist: 3 workers on 2 cores, one test module per worker at a time, longest modules
# first (tests/conftest.py). Much of the suite waits (SLURM requeues, hang allowances, process
# start-up), so three workers overlap that waiting with another module's work.
TEST_WORKERS ?= 3
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

clean:
	rm -rf $(VENV) .cache
