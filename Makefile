# omnirl developer targets. Every target that needs the virtualenv depends on `install`,
# so each one works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN    ?= runs/demo

.PHONY: install test test-fast test-gpu lint format demo demo-vlm bench clean

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

# The GPU suite on this machine's accelerator (skipped without one; OMNIRL_GPU_SUITE_ON_CPU=1 rehearses
# it on the CPU): bf16 sample + update of the small SD3, replay ratio 1, FSDP2 on one device, throughput.
test-gpu: install
	$(PY) -m pytest -q -s -m gpu tests/gpu

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

# GRPO on the built-in tiny Qwen2.5-VL: build it, draw the visual-counting prompts (images with
# 1-9 shapes, "how many?"), run recipes/vlm_grpo.mk for DEMO_ITERATIONS iterations with fresh
# prompts each time, then print the reward table and write $(VLM_RUN)/reward_curve.png and
# $(VLM_RUN)/it<K>/responses.md (each group's answers with their rewards).
VLM_RUN ?= runs/demo-vlm
demo-vlm: install
	test -f $(VLM_RUN)/model/omnirl_model.json || $(VENV)/bin/omnirl init-model --family qwen2_5_vl --size tiny --seed 0 $(VLM_RUN)/model
	test -f $(VLM_RUN)/prompts.parquet || $(PY) recipes/tasks/visual_count.py --out $(VLM_RUN)/prompts.parquet --num-prompts 512 --seed 0
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -f recipes/vlm_grpo.mk \
	  CONFIG=recipes/configs/vlm_demo_tiny.yaml MODEL=$(VLM_RUN)/model PROMPTS=$(VLM_RUN)/prompts.parquet \
	  RUN=$(VLM_RUN) ITERATIONS=$(DEMO_ITERATIONS)
	$(VENV)/bin/omnirl report $(VLM_RUN)

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf runs .pytest_cache
