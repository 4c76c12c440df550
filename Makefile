# The two commands of a fresh machine: `make test` and `make demo`.
# Both create .venv when it is missing and install the project with its dev extra.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roundhouse-installed

.PHONY: install test lint typecheck unit demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: install
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/roundhouse demo

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
