# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Dependencies go into .venv; the stamp is rebuilt whenever pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
# Installed before the project when no torch is importable: on our build machines this pin resolves
# to a local CPU wheel. Elsewhere choose the build, e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test test-unit test-integration lint typecheck bench bench-engine clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "governor needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)  ## start the governor with its GPT-2 worker (random weights); extra flags via ARGS="..."
	$(PY) -m governor serve $(ARGS)

test: $(STAMP)  ## the whole suite (unit + integration), as CI runs it
	$(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff mypy
	$(PY) -m ruff check governor worker tests benchmarks
	$(PY) -m mypy

bench: $(STAMP)  ## the benchmarks whose numbers go into docs/BENCHMARKS.md
	$(PY) -m benchmarks.yield_throughput
	$(PY) -m benchmarks.memory

bench-engine: $(STAMP)  ## the GPT-2 engine vs transformers' generate (about 15 minutes on 2 cores)
	$(PY) -m benchmarks.engine_vs_hf

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
