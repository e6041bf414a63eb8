# omnirl developer targets. Every target that needs the virtualenv depends on `install`,
# so each one works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN    ?= runs/demo

.PHONY: install test test-fast lint format demo bench clean

install: $(STAMP)

# CPU torch first (from local disk), then the project pinned to it by constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --durations=15

test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow and not distributed"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: install
	$(PY) -m recipes.demo --out $(RUN)

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf runs .pytest_cache
