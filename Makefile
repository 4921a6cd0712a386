# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the suite). Both build
# .venv from the lock first (every package pinned, with hashes): locks/cpu.txt for running the project,
# locks/cpu-dev.txt (a superset) for tests, docs and benchmarks. `make lock` regenerates both.
# The CPU build of torch comes from pip's configured wheel path or index; elsewhere point pip at a CPU wheel
# index:   make demo TORCH_INDEX_URL=<your PyTorch CPU wheel index>

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
LOCK := locks/cpu.txt
DEV_LOCK := locks/cpu-dev.txt
TORCH_INDEX_URL ?=
TORCH_SOURCE = $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TARGETS := venv venv-dev demo check test test-latest lock docs clean

.PHONY: $(TARGETS)

venv: $(STAMP)
venv-dev: $(DEV_STAMP)

# The lock installs without resolving (--no-deps: it already holds every transitive package); the project
# itself then installs editable, built offline by the setuptools the lock pinned.
define install_lock
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "the locks are for Python 3.11: run make with PYTHON=<path to a python3.11>")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes --no-deps $(TORCH_SOURCE) -r $(1)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
endef

$(STAMP): $(LOCK) pyproject.toml
	$(call install_lock,$(LOCK))
	touch $@

$(DEV_STAMP): $(DEV_LOCK) $(STAMP)
	$(call install_lock,$(DEV_LOCK))
	touch $@

$(LOCK) $(DEV_LOCK):
	$(error $@ is missing: restore it with 'git checkout -- $@' or regenerate it with 'make lock')

demo: venv
	$(BIN)/areal-hpc train --config configs/quickstart.yaml

# Lint, format and types: ruff over the repository's Python, mypy over areal_hpc/ (settings and the
# per-module exceptions in pyproject.toml). About a minute, so CI runs it before the suite.
check: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite runs on TEST_WORKERS pytest-xdist workers (every Slurm test on one of them) in a fresh random
# order each time (modules shuffled, and tests within each module); the seed is printed at the top.
# `make test TEST_SEED=N` repeats the order; which worker runs what also depends on timing, so to replay a
# failure exactly run one process: `make test TEST_WORKERS=0 TEST_SEED=N`. It ends with the 20 slowest
# tests. The suite needs the dev lock (triton for kernels/, TRL's peer, MkDocs), which `make demo` goes
# without. PYTEST_ARGS adds options.
TEST_WORKERS ?= 2
TEST_SEED ?= $(shell $(PYTHON) -c "import random; print(random.randrange(10**6))")
PYTEST_ARGS ?=
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --random-order-seed=$(TEST_SEED) --durations=20 $(PYTEST_ARGS)

# Regenerate both locks from pyproject.toml and locks/cpu.in: the newest versions the ranges allow, for
# Python 3.11 on x86_64 Linux. The CPU torch wheel comes from pip's configured wheel path (TORCH_FIND_LINKS)
# or TORCH_INDEX_URL. The run lock is resolved inside the dev lock, so both agree on every shared package.
# uv runs from a venv of its own (.venv-lock), so a missing or broken lock can still be regenerated.
TORCH_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_VERSION := 0.13.9
LOCK_VENV := .venv-lock
UV_COMPILE = $(LOCK_VENV)/bin/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match --custom-compile-command 'make lock' \
	$(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS)) $(TORCH_SOURCE)
lock:
	test -x $(LOCK_VENV)/bin/uv || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet uv==$(UV_VERSION))
	$(UV_COMPILE) pyproject.toml locks/cpu.in --extra dev --extra triton --extra peer -o $(DEV_LOCK)
	$(UV_COMPILE) pyproject.toml locks/cpu.in -c $(DEV_LOCK) -o $(LOCK)

# Drift: the newest versions pyproject.toml allows (torch stays at the lock's CPU build) in a scratch venv,
# what changed against the lock, then the smoke tests (model init, RL steps, proxy, shards).
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --quiet $(TORCH_SOURCE) $$(grep -o '^torch==[^ ]*' $(DEV_LOCK))
	$(LATEST)/bin/pip install --quiet $(TORCH_SOURCE) -e '.[dev,triton,peer]'
	$(LATEST)/bin/python locks/drift.py $(DEV_LOCK)
	$(LATEST)/bin/python -m pytest -m smoke -p no:random_order --durations=5

docs: $(DEV_STAMP)
	$(BIN)/python docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

clean:
	rm -rf runs build/site $(LATEST) $(LOCK_VENV)

%::
	$(error no target '$@'; the targets are: $(TARGETS))
