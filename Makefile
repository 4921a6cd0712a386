# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create or refresh .venv first; `make venv` does only that.
# CPU machines pin torch through constraints/cpu.txt so no multi-GB CUDA build is pulled in.
# Where the CPU wheel is not on a local wheel path, point pip at a CPU wheel index:
#   make demo TORCH_INDEX_URL=<your PyTorch CPU wheel index>

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints/cpu.txt
TORCH_INDEX_URL ?=
STAMP := $(VENV)/.installed

.PHONY: venv demo test clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) torch $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(BIN)/areal-hpc train --config configs/quickstart.yaml

# Tests run in a fresh random order every time (modules shuffled, and tests within each module); the
# seed is printed at the top: `make test PYTEST_ARGS=--random-order-seed=N` repeats an order.
PYTEST_ARGS ?=
KERNELS_STAMP := $(VENV)/.kernels

$(KERNELS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e '.[dev,kernels]'
	touch $(KERNELS_STAMP)

# The suite also needs triton (the `kernels` extra), which `make demo` goes without (see pyproject.toml).
test: venv $(KERNELS_STAMP)
	$(BIN)/python -m pytest --random-order $(PYTEST_ARGS)

clean:
	rm -rf runs
