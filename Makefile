# aiocollect: everything runs from a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed
PYTEST_ARGS ?=
# make test runs the suite on this many pytest-xdist workers (auto: one per core, at most
# 4; PYTEST_WORKERS=0 runs it in this process, one test at a time).
PYTEST_WORKERS ?= auto

.PHONY: install demo test lint bench clean system-deps torch-suite stress soak-elastic

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Everything: what make test, demo and bench need (torch included). The torch extra is a
# range (docs/torch.md); make test runs on TORCH_SPEC, the CPU build of 2.13.0.
TORCH_SPEC ?= torch==2.13.0
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,lint,redis,torch,plot]' '$(TORCH_SPEC)'
	touch $(STAMP) $(LINT_STAMP)

# What make lint needs: the core, the lint tools and the libraries whose types mypy reads
# (the lint extra); no torch (docs/testing.md, "Lint").
$(LINT_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[lint]'
	touch $(LINT_STAMP)

install: $(STAMP)

# Debian packages the tests use (redis-server, mpirun); installed only when missing and root.
system-deps:
	@bash scripts/system-deps.sh

demo: install
	$(VENV)/bin/aiocollect run -n 4 examples/data_parallel.py

test: install system-deps
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 $(PYTEST_ARGS)

# The whole stress matrix (every transport and mode x both loops x worlds 2-4, 8 rounds);
# make test runs a subset of it (docs/testing.md).
stress: install
	AIOCOLLECT_STRESS=full $(PY) -m pytest -q tests/stress $(PYTEST_ARGS)

# mypy --strict reads torch's own types for aiocollect/torch: without torch installed it
# checks everything else and says so (after make install it checks all; CI does).
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check aiocollect tests examples scripts
	$(VENV)/bin/ruff format --check aiocollect tests examples scripts
	@if $(PY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; \
	then echo "$(VENV)/bin/mypy"; $(VENV)/bin/mypy; \
	else echo "lint: torch is not installed: mypy skips aiocollect/torch (make install checks it)"; \
	  echo "$(VENV)/bin/mypy --exclude '^aiocollect/torch/'"; \
	  $(VENV)/bin/mypy --exclude '^aiocollect/torch/'; fi
	$(VENV)/bin/lint-imports

# torch's own DistributedTest suite (from the installed wheel) against "aiocollect" and "gloo"
# in the same run; prints passed/failed/skipped for each (docs/torch.md). ~5 min.
TORCH_SUITE_LOGS ?= /tmp/aiocollect-torch-suite
torch-suite: install
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest
	$(PY) scripts/torch_dist_suite.py --log-dir $(TORCH_SUITE_LOGS) $(TORCH_SUITE_ARGS)

# The torch backend across the torch releases it supports: tests/torch and the DDP example in
# scratch venvs, with the newest torch the registry serves and with the oldest in
# pyproject's torch extra; prints each version with pass/fail (docs/torch.md). Downloads
# several GB; PIP_CONFIG_FILE=/dev/null ignores a pip configuration that caps torch.
.PHONY: torch-compat
torch-compat:
	bash scripts/torch_compat.sh

# Elastic groups: SIGKILL a random member 20 times, a replacement joins each time; prints
# regroup time p50/p99 (docs/failures.md, "Elastic groups"). Not part of make test (~1 min).
soak-elastic: install
	$(PY) scripts/soak_elastic.py --kills 20 $(SOAK_ARGS)

bench: install
	$(VENV)/bin/aiocollect bench allreduce -n 2 --sizes 4..16M --transport tcp

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache build dist *.egg-info
