# aiocollect: everything runs from a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed
DIST_STAMP := $(VENV)/.dist-installed
DOCS_STAMP := $(VENV)/.docs-installed
PYTEST_ARGS ?=
# make test runs the suite on this many pytest-xdist workers (auto: one per core, at most
# 4; PYTEST_WORKERS=0 runs it in this process, one test at a time).
PYTEST_WORKERS ?= auto

.PHONY: install demo test test-axis lint bench clean system-deps torch-suite stress soak-elastic scale \
	dist test-dist docs test-responsiveness compiled test-compiled

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Everything: what make test, demo and bench need (torch included). The torch extra is a
# range (docs/torch.md); make test runs on TORCH_SPEC, the CPU build of 2.13.0.
TORCH_SPEC ?= torch==2.13.0
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,lint,redis,torch,plot,mpi]' '$(TORCH_SPEC)'
	touch $(STAMP) $(LINT_STAMP)

# What make lint needs: the core, the lint tools and the libraries whose types mypy reads
# (the lint extra); no torch (docs/testing.md, "Lint").
$(LINT_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[lint]'
	touch $(LINT_STAMP)

# What make dist needs: the standard build front end and twine (the dist extra).
$(DIST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dist]'
	touch $(DIST_STAMP)

# What make docs needs: MkDocs, its theme and mkdocstrings (the docs extra).
$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

install: $(STAMP)

# The compiled core (docs/design.md, "The compiled core"): the one-frame path's modules
# compiled by mypyc, beside their sources; a built tree loads them (AIOCOLLECT_PURE=1 turns
# them off). Not part of install: it measured within the noise of the pure path
# (docs/benchmarks.md, "The compiled core"). Minutes of CPU, so tools/build_core.py skips
# it while build/mypyc/stamp matches the sources; without a C compiler it says so and
# exits 0. CORE_ARGS=--clean removes it, CORE_ARGS=--strict fails where it cannot build.
CORE_ARGS ?=
compiled: $(STAMP)
	$(PY) tools/build_core.py $(CORE_ARGS)

# Debian packages the tests use (redis-server, mpirun); installed only when missing and root.
system-deps:
	@bash tools/system-deps.sh

demo: install
	$(VENV)/bin/aiocollect run -n 4 examples/data_parallel.py

test: install system-deps
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 $(PYTEST_ARGS)

# The whole stress matrix (every transport and mode x both loops x worlds 2-4, 8 rounds),
# and 500 open/close cycles of the lifecycle leak test; make test runs a subset of both
# (docs/testing.md).
stress: install
	AIOCOLLECT_STRESS=full AIOCOLLECT_AXIS=full $(PY) -m pytest -q tests/stress \
	  tests/failure/test_lifecycle.py::test_open_close_cycles_leak_no_fds_or_tasks $(PYTEST_ARGS)

# A small send/recv round trip within a bound while bulk allreduces run (tcp, auto; both
# loops): a target the library does not meet yet on a shared two-core host, so make test
# leaves it out; run it on a host with nothing else running (docs/testing.md).
test-responsiveness: install
	AIOCOLLECT_RESPONSIVENESS=1 $(PY) -m pytest -q -n 0 tests/transport/test_small_behind_bulk.py \
	  $(PYTEST_ARGS)

# The transport axis's other modes (tls, shared memory without pulls, shared memory with its
# socket on TCP): the tests on the axis (marked "transports") over those modes; make test
# runs them over the default path and its transports (tests/support/transports.py). CI runs
# both.
test-axis: install system-deps
	AIOCOLLECT_AXIS=extended $(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 \
	  -m "transports or axis" $(PYTEST_ARGS)

# The suites of the per-operation path with the compiled core in use (make test runs the
# pure path); --strict fails unless it builds and loads.
test-compiled: install system-deps
	$(PY) tools/build_core.py --strict
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 tests/unit tests/transport \
	  tests/collectives $(PYTEST_ARGS)

# mypy --strict (the package and the tests) reads torch's own types for aiocollect/torch and
# tests/torch: without torch installed it checks everything else and says so (after make
# install it checks all; CI does). The last step lists every module of aiocollect/ over 600
# lines and fails if there is one (tools/check_module_size.py).
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check aiocollect tests examples tools
	$(VENV)/bin/ruff format --check aiocollect tests examples tools
	@if $(PY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; \
	then echo "$(VENV)/bin/mypy"; $(VENV)/bin/mypy; \
	else echo "lint: torch is not installed: mypy skips aiocollect/torch and tests/torch (make install checks them)"; \
	  echo "$(VENV)/bin/mypy --exclude '^(aiocollect|tests)/torch/'"; \
	  $(VENV)/bin/mypy --exclude '^(aiocollect|tests)/torch/'; fi
	$(VENV)/bin/lint-imports
	$(PY) tools/check_module_size.py

# torch's own DistributedTest suite (from the installed wheel) against "aiocollect" and "gloo"
# in the same run; prints passed/failed/skipped for each (docs/torch.md). ~5 min.
TORCH_SUITE_LOGS ?= /tmp/aiocollect-torch-suite
torch-suite: install
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest
	$(PY) tools/torch_dist_suite.py --log-dir $(TORCH_SUITE_LOGS) $(TORCH_SUITE_ARGS)

# The torch backend across the torch releases it supports: tests/torch and the DDP example in
# scratch venvs, with the newest torch the registry serves and with the oldest in
# pyproject's torch extra; prints each version with pass/fail (docs/torch.md). Downloads
# several GB; PIP_CONFIG_FILE=/dev/null ignores a pip configuration that caps torch.
.PHONY: torch-compat
torch-compat:
	bash tools/torch_compat.sh

# Groups of 512 and 1,024 ranks (processes of 128 ranks each, TCP links on demand) through a
# standalone store: formed, every collective exact (tests/scale/test_many_ranks.py;
# docs/multinode.md, "Forming large groups"). Not part of make test (minutes).
scale: install
	AIOCOLLECT_SCALE=1 $(PY) -m pytest -q -s -n 0 -m scale tests/scale $(PYTEST_ARGS)

# Elastic groups: SIGKILL a random member 20 times, a replacement joins each time; prints
# regroup time p50/p99 (docs/failures.md, "Elastic groups"). Not part of make test (~1 min).
soak-elastic: install
	$(PY) tools/soak_elastic.py --kills 20 $(SOAK_ARGS)

# The source distribution and the wheel in dist/, built as any installer builds them (the
# wheel from the sdist, in an isolated environment), and their metadata checked.
dist: $(DIST_STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# The wheel from make dist installed in a fresh venv outside the checkout (torch too), then
# the command line, the launcher, the pytest plugin and the torch backend run from there
# (tests/packaging; a few minutes, mostly installing torch).
test-dist: install dist
	AIOCOLLECT_DIST=$(CURDIR)/dist $(PY) -m pytest -q -o faulthandler_timeout=0 tests/packaging \
	  $(PYTEST_ARGS)

# The documentation site in site/: every public name documented (tools/check_docstrings.py),
# then the guides and the API reference (docs/reference/, from the docstrings) built by
# MkDocs; --strict turns every warning (a broken link, say) into a failure.
docs: $(DOCS_STAMP)
	$(PY) tools/check_docstrings.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: install
	$(VENV)/bin/aiocollect bench allreduce -n 2 --sizes 4..16M --transport tcp

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache build dist site \
	  *.egg-info
	find aiocollect -name '*.so' -delete
