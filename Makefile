# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the suite). Both build
# .venv from the lock first (every package pinned, with hashes): locks/cpu.txt for running the project,
# locks/cpu-dev.txt (a superset) for tests, docs and benchmarks. `make lock` regenerates both.
# The CPU build of torch comes from pip's configured wheel path or index; elsewhere point pip at a CPU wheel
# index:   make demo TORCH_INDEX_URL=<your PyTorch CPU wheel index>

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := locks/cpu.txt
DEV_LOCK := locks/cpu-dev.txt
TORCH_INDEX_URL ?=
TORCH_SOURCE = $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TARGETS := venv demo test test-latest lock docs clean

.PHONY: $(TARGETS)

venv: $(STAMP)

# The lock installs without resolving (--no-deps: it already holds every transitive package); the project
# itself then installs editable, built offline by the setuptools the lock pinned.
define install_lock
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
	@echo "make: $@ is missing: restore it with 'git checkout -- $@' or regenerate it with 'make lock'" >&2; exit 2

demo: venv
	$(BIN)/areal-hpc train --config configs/quickstart.yaml

# Tests run in a fresh random order every time (modules shuffled, and tests within each module); the seed
# is printed at the top: `make test PYTEST_ARGS=--random-order-seed=N` repeats an order. The suite needs
# the dev lock (triton for kernels/, TRL's peer, MkDocs), which `make demo` goes without.
PYTEST_ARGS ?=
test: $(DEV_STAMP)
	$(BIN)/python -m pytest --random-order --durations=20 $(PYTEST_ARGS)

# Regenerate both locks from pyproject.toml and locks/cpu.in: the newest versions the ranges allow, for
# Python 3.11 on x86_64 Linux. The CPU torch wheel comes from pip's configured wheel path (TORCH_FIND_LINKS)
# or TORCH_INDEX_URL. The run lock is resolved inside the dev lock, so both agree on every shared package.
TORCH_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_COMPILE = $(BIN)/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match --custom-compile-command 'make lock' \
	$(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS)) $(TORCH_SOURCE)
lock: $(DEV_STAMP)
	$(UV_COMPILE) pyproject.toml locks/cpu.in --extra dev --extra kernels --extra peer -o $(DEV_LOCK)
	$(UV_COMPILE) pyproject.toml locks/cpu.in -c $(DEV_LOCK) -o $(LOCK)

# Drift: the newest versions pyproject.toml allows (torch stays at the lock's CPU build) in a scratch venv,
# what changed against the lock, then the smoke tests (model init, RL steps, proxy, shards).
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --quiet $(TORCH_SOURCE) $$(grep -o '^torch==[^ ]*' $(DEV_LOCK))
	$(LATEST)/bin/pip install --quiet $(TORCH_SOURCE) -e '.[dev,kernels,peer]'
	$(LATEST)/bin/python locks/drift.py $(DEV_LOCK)
	$(LATEST)/bin/python -m pytest -m smoke -p no:random_order --durations=5

docs: $(DEV_STAMP)
	$(BIN)/python docs/gen_reference.py --check
	$(BIN)/mkdocs build --strict --quiet --site-dir build/site

clean:
	rm -rf runs build/site $(LATEST)

%::
	@echo "make: no target '$@'; the targets are: $(TARGETS)" >&2; exit 2
