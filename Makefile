# Every target sets itself up on a fresh machine that has only python3 + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q -n 2 --dist worksteal

demo: $(STAMP)
	$(PY) -m examples.demo $(ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site
