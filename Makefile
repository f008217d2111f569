# aiocollect: everything runs from a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean system-deps

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,lint,redis,torch,plot]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests use (redis-server, mpirun); installed only when missing and root.
system-deps:
	@bash scripts/system-deps.sh

demo: install
	$(VENV)/bin/aiocollect run -n 4 examples/data_parallel.py

test: install system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check aiocollect tests examples
	$(VENV)/bin/mypy

bench: install
	$(VENV)/bin/aiocollect bench allreduce -n 2 --sizes 4..16M --transport tcp

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
