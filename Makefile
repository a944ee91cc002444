# One command for everything CI checks: make check
PY := .venv/bin/python

.PHONY: setup check fmt fmt-check lint types imports test unit

setup:
	bash scripts/setup

fmt:
	$(PY) -m ruff format .

fmt-check:
	$(PY) -m ruff format --check .

lint:
	$(PY) -m ruff check .

types:
	$(PY) -m mypy

# The layer contracts in pyproject.toml ([tool.importlinter]).
imports:
	.venv/bin/lint-imports

unit:
	$(PY) -m pytest -q -m "not vllm and not interop"

test:
	$(PY) -m pytest -q

check: fmt-check lint types imports test
