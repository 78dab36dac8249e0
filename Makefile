# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is pinned exactly here (not in pyproject): a CPU build of 2.13.0 is what
# these machines carry; a loose requirement would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install demo test test-all fuzz lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check src tests $(wildcard benchmarks)

test: install lint
	$(BIN)/python -m pytest -q -x

test-all: install
	$(BIN)/python -m pytest -q -m "slow or not slow"

# the property-based bad-input suite at length: thousands of generated inputs per
# entry point instead of the fixed few that `make test` runs
fuzz: install
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_fuzz.py

demo: install
	$(BIN)/python -m xmodlm demo

bench: install
	$(BIN)/python -m xmodlm bench --json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
