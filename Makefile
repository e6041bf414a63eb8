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
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not distributed"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# A complete RL run on the built-in tiny SD3 model: build it, run the staged Flow-GRPO recipe for
# DEMO_ITERATIONS iterations (JPEG-compressibility reward; the same prompts and seeds every
# iteration, so the curve shows the policy's change), then print the reward table and write
# $(RUN)/reward_curve.png and $(RUN)/it<K>/grid.png.
DEMO_ITERATIONS ?= 5
demo: install
	test -f $(RUN)/model/omnirl_model.json || $(VENV)/bin/omnirl init-model --family sd3 --size tiny --seed 0 $(RUN)/model
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -f recipes/flow_grpo.mk \
	  CONFIG=recipes/configs/demo_tiny.yaml MODEL=$(RUN)/model PROMPTS=recipes/demo_prompts.txt \
	  RUN=$(RUN) ITERATIONS=$(DEMO_ITERATIONS) SEED=0 REWARD="--reward jpeg_compressibility"
	$(VENV)/bin/omnirl report $(RUN)

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf runs .pytest_cache
