# omnirl developer targets. Every target that needs the virtualenv depends on `install`,
# so each one works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN    ?= runs/demo

.PHONY: FORCE install test test-fast test-gpu lint format demo demo-online demo-model demo-edit demo-edit-model demo-jpeg demo-vlm demo-omni bench bench-gpu docs clean

install: $(STAMP)

# CPU torch first (from local disk), then the project pinned to it by constraints.txt.
$(STAMP): pyproject.toml constraints.txt tests/reference-oracles.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/reference-oracles -r tests/reference-oracles.txt
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not distributed"

# The GPU suite on this machine's accelerator (skipped without one; OMNIRL_GPU_SUITE_ON_CPU=1 rehearses
# it on the CPU): bf16 sample + update of the small SD3, replay ratio 1, FSDP2 on one device, throughput.
test-gpu: install
	$(PY) -m pytest -q -s -m gpu tests/gpu

# docs/cli.md, the CLI reference, regenerated from every command's --help (tests/test_docs.py checks it).
docs: install
	$(PY) docs/gen_cli.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The demo that visibly learns: the committed pretrained tiny SD3 (DEMO_MODEL, 64 px coloured shapes,
# made by `make demo-model`) learns GenEval-style prompts of one family (DEMO_TAGS) naming the shapes
# DEMO_SHAPES (comma-separated; circle: the shape it draws best) with the geneval_shapes reward
# through the staged Flow-GRPO recipe. Each iteration's policy is also evaluated on held-out prompts
# with fixed seeds (recipes/eval.mk), two stages at a time (DEMO_JOBS: an evaluation beside the next
# iteration's sampling and scoring). Each finished iteration prints its line (training and held-out
# reward mean ± se, strict accuracy, losses; recipes/report.mk), the stages' progress goes to stderr;
# at the end the report prints the table (reward mean ± standard error, strict accuracy) and writes
# $(RUN)/reward_curve.png, $(RUN)/before_after.png and $(RUN)/it<K>/grid.png. Settings:
# recipes/configs/demo_shapes.yaml.
DEMO_ITERATIONS ?= 8
DEMO_MODEL      ?= recipes/models/demo-shapes
DEMO_CONFIG     ?= recipes/configs/demo_shapes.yaml
DEMO_TAGS       ?= colors
DEMO_SHAPES     ?= circle
DEMO_PROMPTS    ?= 256
DEMO_EVAL       ?= 64
DEMO_JOBS       ?= 2
DEMO_EVAL_FLAGS ?= --sampler ode --group-size 4 --num-prompts $(DEMO_EVAL)
# DiffusionNFT never reads rollout log-probs, so the demo skips the replay (auto or yes for Flow-GRPO:
# recipes/flow_grpo.mk's REPLAY; demo-jpeg takes its default, auto).
DEMO_REPLAY     ?= no
DEMO_REWARD     := --reward geneval_shapes --reward geneval_shapes_strict=0
SHAPES          := $(PY) recipes/tasks/shapes.py

DEMO_TASK       := --tags $(DEMO_TAGS) --shapes $(DEMO_SHAPES) --num-prompts $(DEMO_PROMPTS) $(DEMO_EVAL)

# The task's settings, rewritten only when they change, so a run directory drawn for another task
# (an older demo, other DEMO_TAGS) redraws its prompts, and the recipe resamples from them.
$(RUN)/task.txt: FORCE
	@mkdir -p $(RUN) && echo '$(DEMO_TASK)' > $@.new && \
	  if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
FORCE:

$(RUN)/prompts.jsonl $(RUN)/heldout.jsonl &: $(RUN)/task.txt | install
	$(SHAPES) --out $(RUN)/prompts.jsonl --num-prompts $(DEMO_PROMPTS) --seed 1 --tags $(DEMO_TAGS) --shapes $(DEMO_SHAPES)
	$(SHAPES) --out $(RUN)/heldout.jsonl --num-prompts $(DEMO_EVAL) --seed 2 --tags $(DEMO_TAGS) --shapes $(DEMO_SHAPES)

demo: install $(RUN)/prompts.jsonl
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -j$(DEMO_JOBS) -f recipes/flow_grpo.mk \
	  CONFIG=$(DEMO_CONFIG) MODEL=$(DEMO_MODEL) PROMPTS=$(RUN)/prompts.jsonl RUN=$(RUN) \
	  ITERATIONS=$(DEMO_ITERATIONS) REWARD="$(DEMO_REWARD)" REPLAY=$(DEMO_REPLAY) \
	  EVAL_PROMPTS=$(RUN)/heldout.jsonl EVAL_FLAGS="$(DEMO_EVAL_FLAGS)"
	$(VENV)/bin/omnirl report $(RUN)

# The same run through `omnirl online` (sampler, scorer and trainer in their own processes, no files
# between stages), then the same held-out evaluation of its checkpoints (a line per evaluated iteration)
# and the same report.
ONLINE_RUN ?= runs/demo-online
demo-online: install
	$(MAKE) --no-print-directory $(ONLINE_RUN)/prompts.jsonl RUN=$(ONLINE_RUN)
	OMP_NUM_THREADS=1 $(VENV)/bin/omnirl online --config $(DEMO_CONFIG) --model $(DEMO_MODEL) \
	  --prompts $(ONLINE_RUN)/prompts.jsonl $(DEMO_REWARD) --iterations $(DEMO_ITERATIONS) \
	  --save-trajectories --out $(ONLINE_RUN)
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -j$(DEMO_JOBS) -f recipes/eval.mk \
	  CONFIG=$(DEMO_CONFIG) MODEL=$(DEMO_MODEL) RUN=$(ONLINE_RUN) ITERATIONS=$(DEMO_ITERATIONS) \
	  REWARD="$(DEMO_REWARD)" EVAL_PROMPTS=$(ONLINE_RUN)/heldout.jsonl EVAL_FLAGS="$(DEMO_EVAL_FLAGS)"
	$(VENV)/bin/omnirl report $(ONLINE_RUN)

# `make leaderboard`: every diffusion algorithm on the demo's model and task (recipes/leaderboard.mk).
include recipes/leaderboard.mk

# Rebuilds the committed demo model from scratch with the project's own code and checks that every
# file is byte-identical to $(DEMO_MODEL) (same result needs the same CPU kind and torch threads: 1).
# Two stages (`omnirl pretrain` twice, the second continuing from the first):
# 1. general: 4096 rendered shapes images of all six GenEval families (recipes/tasks/shapes.py,
#    seed 0), `init-model --size demo`, `pretrain --vae pixel` (5000 + 500 pixel-VAE steps, 3000
#    rectified-flow steps) -> $(MODEL_RUN)/model (≈ 8 CPU-minutes);
# 2. focus: 4096 images of the one-shape families the demo draws from (single_object, colors,
#    counting; seed 3), 4000 more rectified-flow steps on them, the VAE kept -> $(MODEL_RUN)/focus
#    (≈ 15 CPU-minutes), which is $(DEMO_MODEL).
MODEL_RUN ?= runs/demo-model
FOCUS_TAGS := single_object,colors,counting
demo-model: install
	test -f $(MODEL_RUN)/data/captions.jsonl || \
	  $(SHAPES) --out $(MODEL_RUN)/data/captions.jsonl --num-prompts 4096 --seed 0 --images $(MODEL_RUN)/data
	test -f $(MODEL_RUN)/base/omnirl_model.json || \
	  $(VENV)/bin/omnirl init-model --family sd3 --size demo --seed 0 $(MODEL_RUN)/base
	test -f $(MODEL_RUN)/model/omnirl_model.json || OMP_NUM_THREADS=1 $(VENV)/bin/omnirl pretrain \
	  --model $(MODEL_RUN)/base --data $(MODEL_RUN)/data --vae pixel --steps 3000 --seed 0 --out $(MODEL_RUN)/model
	test -f $(MODEL_RUN)/data-focus/captions.jsonl || $(SHAPES) --out $(MODEL_RUN)/data-focus/captions.jsonl \
	  --num-prompts 4096 --seed 3 --tags $(FOCUS_TAGS) --images $(MODEL_RUN)/data-focus
	test -f $(MODEL_RUN)/focus/omnirl_model.json || OMP_NUM_THREADS=1 $(VENV)/bin/omnirl pretrain \
	  --model $(MODEL_RUN)/model --data $(MODEL_RUN)/data-focus --vae pixel --vae-steps 0 --vae-encoder-steps 0 \
	  --steps 4000 --seed 1 --out $(MODEL_RUN)/focus
	diff -r $(MODEL_RUN)/focus $(DEMO_MODEL) && echo "$(MODEL_RUN)/focus is byte-identical to $(DEMO_MODEL)"

# Image editing: the committed pretrained tiny FLUX.1 Kontext (EDIT_MODEL, made by `make demo-edit-model`:
# source, instruction -> result on edit pairs of the shapes world) learns the same kind of edit on fresh
# sources (recipes/tasks/shape_edits.py: EDIT_KINDS recolor and/or move, EDIT_SHAPES the recoloured
# shapes) with the staged recipe, trained on the edit-success metric geneval_shapes_strict on the result
# (EDIT_REWARD; edit_preservation against the source and the dense geneval_shapes reported at weight 0),
# each iteration's policy evaluated on held-out edits with fixed seeds: 57.0% -> 79.7% in 8 iterations
# (docs/demo.md). The report's grids show source -> result. Settings: recipes/configs/demo_edit.yaml.
EDIT_RUN            ?= runs/demo-edit
EDIT_MODEL          ?= recipes/models/demo-edit
EDIT_CONFIG         ?= recipes/configs/demo_edit.yaml
EDIT_ITERATIONS     ?= 8
EDIT_KINDS          ?= recolor
EDIT_SHAPES         ?= circle
EDIT_PROMPTS        ?= 256
EDIT_EVAL           ?= 64
EDIT_EVAL_FLAGS     ?= --sampler ode --group-size 4 --num-prompts $(EDIT_EVAL)
EDIT_REWARD         := --reward geneval_shapes_strict --reward edit_preservation=0 --reward geneval_shapes=0
EDITS               := $(PY) recipes/tasks/shape_edits.py
EDIT_TASK           := --kinds $(EDIT_KINDS) --shapes $(EDIT_SHAPES)
demo-edit: install
	test -f $(EDIT_RUN)/prompts/edits.jsonl || $(EDITS) $(EDIT_TASK) --out $(EDIT_RUN)/prompts/edits.jsonl --num-prompts $(EDIT_PROMPTS) --seed 1
	test -f $(EDIT_RUN)/heldout/edits.jsonl || $(EDITS) $(EDIT_TASK) --out $(EDIT_RUN)/heldout/edits.jsonl --num-prompts $(EDIT_EVAL) --seed 2
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -j$(DEMO_JOBS) -f recipes/flow_grpo.mk \
	  CONFIG=$(EDIT_CONFIG) MODEL=$(EDIT_MODEL) PROMPTS=$(EDIT_RUN)/prompts/edits.jsonl RUN=$(EDIT_RUN) \
	  ITERATIONS=$(EDIT_ITERATIONS) REWARD="$(EDIT_REWARD)" REPLAY=no \
	  EVAL_PROMPTS=$(EDIT_RUN)/heldout/edits.jsonl EVAL_FLAGS="$(EDIT_EVAL_FLAGS)"
	$(VENV)/bin/omnirl report $(EDIT_RUN)

# Rebuilds the committed edit model from scratch with the project's own code and checks that every file is
# byte-identical to $(EDIT_MODEL) (same CPU kind, one torch thread): 2048 recolour edits of one circle
# (shape_edits.py --targets, seed 0: source, instruction, result), `init-model --family flux_kontext
# --size tiny`, then `omnirl pretrain` three times on the pairs:
# 1. `--vae pixel` (EDIT_PRETRAIN_FLAGS) -> $(EDIT_MODEL_RUN)/model;
# 2. its pixel VAE's decoder fitted 3000 steps more, so that it draws all six colours (after 1500 steps it
#    drew red as yellow, blue as cyan, purple as grey), and 500 more transformer steps (EDIT_DECODER_FLAGS)
#    -> $(EDIT_MODEL_RUN)/decoder;
# 3. 1000 more transformer steps, the VAE kept (EDIT_FOCUS_FLAGS) -> $(EDIT_MODEL_RUN)/focus, which is
#    $(EDIT_MODEL).
EDIT_MODEL_RUN      ?= runs/demo-edit-model
EDIT_PRETRAIN_FLAGS := --vae pixel --vae-steps 1500 --vae-encoder-steps 300 --steps 1500 --text-length 16
EDIT_DECODER_FLAGS  := --vae pixel --vae-steps 3000 --vae-encoder-steps 0 --steps 500 --text-length 16
EDIT_FOCUS_FLAGS    := --vae pixel --vae-steps 0 --vae-encoder-steps 0 --steps 1000 --text-length 16
demo-edit-model: install
	test -f $(EDIT_MODEL_RUN)/pairs/edits.jsonl || $(EDITS) --kinds recolor --shapes circle \
	  --out $(EDIT_MODEL_RUN)/pairs/edits.jsonl --num-prompts 2048 --seed 0 --targets
	test -f $(EDIT_MODEL_RUN)/base/omnirl_model.json || \
	  $(VENV)/bin/omnirl init-model --family flux_kontext --size tiny --seed 0 $(EDIT_MODEL_RUN)/base
	test -f $(EDIT_MODEL_RUN)/model/omnirl_model.json || OMP_NUM_THREADS=1 $(VENV)/bin/omnirl pretrain \
	  --model $(EDIT_MODEL_RUN)/base --data $(EDIT_MODEL_RUN)/pairs $(EDIT_PRETRAIN_FLAGS) --seed 0 --out $(EDIT_MODEL_RUN)/model
	test -f $(EDIT_MODEL_RUN)/decoder/omnirl_model.json || OMP_NUM_THREADS=1 $(VENV)/bin/omnirl pretrain \
	  --model $(EDIT_MODEL_RUN)/model --data $(EDIT_MODEL_RUN)/pairs $(EDIT_DECODER_FLAGS) --seed 1 --out $(EDIT_MODEL_RUN)/decoder
	test -f $(EDIT_MODEL_RUN)/focus/omnirl_model.json || OMP_NUM_THREADS=1 $(VENV)/bin/omnirl pretrain \
	  --model $(EDIT_MODEL_RUN)/decoder --data $(EDIT_MODEL_RUN)/pairs $(EDIT_FOCUS_FLAGS) --seed 2 --out $(EDIT_MODEL_RUN)/focus
	diff -r $(EDIT_MODEL_RUN)/focus $(EDIT_MODEL) && echo "$(EDIT_MODEL_RUN)/focus is byte-identical to $(EDIT_MODEL)"

# The first demo: the random tiny SD3 learns JPEG compressibility (nothing to see, but every stage runs).
JPEG_RUN ?= runs/demo-jpeg
JPEG_ITERATIONS ?= 5
demo-jpeg: install
	test -f $(JPEG_RUN)/model/omnirl_model.json || $(VENV)/bin/omnirl init-model --family sd3 --size tiny --seed 0 $(JPEG_RUN)/model
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -f recipes/flow_grpo.mk \
	  CONFIG=recipes/configs/demo_tiny.yaml MODEL=$(JPEG_RUN)/model PROMPTS=recipes/demo_prompts.txt \
	  RUN=$(JPEG_RUN) ITERATIONS=$(JPEG_ITERATIONS) SEED=0 REWARD="--reward jpeg_compressibility"
	$(VENV)/bin/omnirl report $(JPEG_RUN)

# GRPO on the built-in tiny Qwen2.5-VL: build it, draw the visual-counting prompts (images with
# 1-9 shapes, "how many?"), run recipes/vlm_grpo.mk for VLM_ITERATIONS iterations with fresh
# prompts each time, then print the reward table and write $(VLM_RUN)/reward_curve.png and
# $(VLM_RUN)/it<K>/responses.md (each group's answers with their rewards).
VLM_RUN ?= runs/demo-vlm
VLM_ITERATIONS ?= 5
demo-vlm: install
	test -f $(VLM_RUN)/model/omnirl_model.json || $(VENV)/bin/omnirl init-model --family qwen2_5_vl --size tiny --seed 0 $(VLM_RUN)/model
	test -f $(VLM_RUN)/prompts.parquet || $(PY) recipes/tasks/visual_count.py --out $(VLM_RUN)/prompts.parquet --num-prompts 512 --seed 0
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -f recipes/vlm_grpo.mk \
	  CONFIG=recipes/configs/vlm_demo_tiny.yaml MODEL=$(VLM_RUN)/model PROMPTS=$(VLM_RUN)/prompts.parquet \
	  RUN=$(VLM_RUN) ITERATIONS=$(VLM_ITERATIONS)
	$(VENV)/bin/omnirl report $(VLM_RUN)

# GRPO on the built-in tiny Qwen3-Omni thinker (MoE, vision and audio towers): build it, draw the omni
# counting prompts (a digit asked in text, in an image of shapes or in a sound of beeps; every batch
# mixes the three), run recipes/vlm_grpo.mk for OMNI_ITERATIONS iterations, then print the reward table.
OMNI_RUN ?= runs/demo-omni
OMNI_ITERATIONS ?= 4
demo-omni: install
	test -f $(OMNI_RUN)/model/omnirl_model.json || $(VENV)/bin/omnirl init-model --family qwen3_omni_thinker --size tiny --seed 0 $(OMNI_RUN)/model
	test -f $(OMNI_RUN)/prompts.parquet || $(PY) recipes/tasks/omni_count.py --out $(OMNI_RUN)/prompts.parquet --num-prompts 384 --seed 0
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -f recipes/vlm_grpo.mk \
	  CONFIG=recipes/configs/omni_demo_tiny.yaml MODEL=$(OMNI_RUN)/model PROMPTS=$(OMNI_RUN)/prompts.parquet \
	  RUN=$(OMNI_RUN) ITERATIONS=$(OMNI_ITERATIONS)
	$(VENV)/bin/omnirl report $(OMNI_RUN)

bench: install
	$(PY) benchmarks/run_all.py

# Full-size Qwen-Image (random weights, built on the accelerator) at verl-omni's recipe shape, within 8
# minutes; without an accelerator, the CPU rehearsal at --size small (docs/real-checkpoints.md).
bench-gpu: install
	$(PY) benchmarks/bench_real_size.py

clean:
	rm -rf runs .pytest_cache
