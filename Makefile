# Two entry points: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "jaxscale needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

train: $(STAMP)
	$(BIN)/python -m jaxscale.train --config=configs/tiny.py --workdir=runs/tiny

# Two workers, one test file each at a time (module fixtures stay shared); compiling is
# single-threaded, so two workers keep both cores busy. Compiled programs are cached per session.
# Tests marked serial measure contention between processes and run alone afterwards.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

clean:
	rm -rf $(VENV) runs .pytest_cache
