# Two commands for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
# The CPU build of torch; override with e.g. TORCH_SPEC="torch" on a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: venv demo test bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: venv
	$(BIN)/swarm demo --config examples/demo.yaml

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 tests

bench: venv
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info
