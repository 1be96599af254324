# Two commands for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
# The torch pin: pip takes whichever build its index serves for it (a CPU build where pip is configured for
# one, as on this project's CI machines; from PyPI on Linux, a CUDA build). TORCH_INDEX picks the index,
# e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for PyTorch's CPU build; TORCH_SPEC=torch for any version.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: venv demo format lint test test-long bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: venv
	$(BIN)/swarm demo --config examples/demo.yaml

# ruff and mypy read their settings from pyproject.toml; mypy keeps a cache in .mypy_cache, so a second run is quick.
# `make format` lays out swarm/ and peers/ as `make lint` demands.
format: venv
	$(BIN)/ruff format swarm peers

lint: venv
	$(BIN)/ruff check swarm peers
	$(BIN)/ruff format --check swarm peers
	$(BIN)/python tools/mypy_baseline.py

# lint first: a type error fails in seconds, not after the live tests; -rs names every skipped test and why.
# `test` leaves out the long live runs (marked `long`: a swarm trained to a loss, churn, attacks, the demo);
# `test-long` runs just those, and CI (.ci/run) runs both.
PYTEST := $(BIN)/python -m pytest -q -rs -p no:cacheprovider --durations=20
test: lint
	$(PYTEST) -m "not long" tests

test-long: venv
	$(PYTEST) -m long tests

bench: venv
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
