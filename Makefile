# Entry points: `make train`, `make test`, `make lint`. Each creates .venv on first use.
# Two stamps, so each target installs only what it needs: `make train` the runtime dependencies
# (no torch, transformers or trackers), `make test` the test extras on top. Each stamp is redone
# when pyproject.toml changes; a venv made by `make train` gains the test extras on `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test
LINT_PATHS := jaxscale tests benchmarks experiments
# pip byte-compiles every file it installs: 95 of the 143 s that `.[test]` took to install here
# (measured). --no-compile skips that; Python compiles a module when it is first imported and
# keeps the .pyc, so only what runs is compiled, once. That needs bytecode writing on, whatever
# the caller's environment says.
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: train test lint clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "jaxscale needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(RUNTIME_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

# .[test] includes the runtime dependencies, so it renews the runtime stamp too.
# JAX's CUDA plugin (for plans compiled by the GPU compiler: tests/test_gpu_topology.py) goes in a
# folder of its own, put on PYTHONPATH by the one test that uses it: installed in the venv, it makes
# every JAX process print CUDA driver messages on stderr on a host without a GPU.
GPU_PLAN := $(VENV)/gpu-plan
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e ".[test]"
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	  $(PIP_INSTALL) --no-deps --upgrade --target $(GPU_PLAN) jax-cuda12-plugin==$$v jax-cuda12-pjrt==$$v
	touch $@ $(RUNTIME_STAMP)

train: $(RUNTIME_STAMP)
	$(BIN)/python -m jaxscale.train --config=configs/tiny.py --workdir=runs/tiny

lint: $(TEST_STAMP)
	$(BIN)/ruff check $(LINT_PATHS)

# Lint first: it takes seconds, the suite minutes.
# Two workers, one test file each at a time (module fixtures stay shared), the longest files first
# (tests/conftest.py); compiling is single-threaded; a third worker on two cores only added
# contention (CONTRIBUTING.md).
# Compiled programs are cached per session.
# Tests marked serial measure contention between processes and run alone afterwards.
test: lint $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

clean:
	rm -rf $(VENV) runs .pytest_cache
