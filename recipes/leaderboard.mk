# The leaderboard, included by the Makefile: every diffusion algorithm on the `make demo` model and task.
#
# Each algorithm of LEADERBOARD_ALGOS runs recipes/flow_grpo.mk (the demo's staged recipe, as `make demo`
# does) into $(LEADERBOARD_RUN)/<algo> with its preset recipes/configs/leaderboard/<algo>.yaml: the demo's
# sample budget and optimizer (demo_shapes.yaml) with the loss knobs of the algorithm's reference preset,
# each file saying what it took and left. All of them share the committed demo model (DEMO_MODEL, built
# once by `make demo-model`), the reward, the same training prompts (drawn once into
# $(LEADERBOARD_RUN)/prompts.jsonl), the same sampling seeds per iteration, LEADERBOARD_ITERATIONS
# iterations, and the held-out evaluation of every iteration's policy on the same prompts and noise
# (recipes/eval.mk). `omnirl report` summarises each run (its table, curve and grids), then
# recipes/leaderboard.py prints the held-out strict accuracy and reward ± standard error per algorithm
# and iteration as a Markdown table and writes $(LEADERBOARD_RUN)/leaderboard.png, a curve per algorithm.
#
#   make leaderboard                                     # all of them, 8 iterations each
#   make leaderboard LEADERBOARD_ALGOS="nft flow_grpo"   # some of them
#   make leaderboard-dgpo                                # one run (its own report), no table
#
# A finished run is kept: a later `make leaderboard` redoes only what is missing or older than its
# preset. DEMO_PROMPTS, DEMO_EVAL and DEMO_JOBS (the Makefile's) set the task's size and parallelism;
# LEADERBOARD_FLAGS is flow_grpo.mk's FLAGS for every stage of every run, e.g. a smaller budget for a
# smoke test: LEADERBOARD_FLAGS="--overwrite --set sample.num_prompts=2 --set sample.group_size=4".
LEADERBOARD_RUN        ?= runs/leaderboard
LEADERBOARD_ALGOS      ?= nft flow_grpo dance_grpo mix_grpo grpo_guard flow_dppo awm dgpo dpo
LEADERBOARD_ITERATIONS ?= $(DEMO_ITERATIONS)
LEADERBOARD_CONFIGS    ?= recipes/configs/leaderboard
LEADERBOARD_FLAGS      ?= --overwrite
# The algorithms that never read rollout log-probs skip the replay (recipes/flow_grpo.mk's REPLAY=no,
# as DEMO_REPLAY); the others take its default, auto.
LEADERBOARD_NO_REPLAY  := nft awm dgpo dpo
# The demo's held-out evaluation, each sample with its own starting noise under every preset (dance_grpo
# and mix_grpo train with one per group), so every algorithm's it0 row is the same base model's.
LEADERBOARD_EVAL_FLAGS := $(DEMO_EVAL_FLAGS) --set sample.same_noise=false

.PHONY: leaderboard $(addprefix leaderboard-,$(LEADERBOARD_ALGOS))

leaderboard: $(addprefix leaderboard-,$(LEADERBOARD_ALGOS))
	$(PY) recipes/leaderboard.py $(LEADERBOARD_RUN) $(LEADERBOARD_ALGOS)

$(addprefix leaderboard-,$(LEADERBOARD_ALGOS)): leaderboard-%: install
	$(MAKE) --no-print-directory $(LEADERBOARD_RUN)/prompts.jsonl RUN=$(LEADERBOARD_RUN)
	OMP_NUM_THREADS=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MAKE) --no-print-directory -j$(DEMO_JOBS) -f recipes/flow_grpo.mk \
	  CONFIG=$(LEADERBOARD_CONFIGS)/$*.yaml MODEL=$(DEMO_MODEL) PROMPTS=$(LEADERBOARD_RUN)/prompts.jsonl \
	  RUN=$(LEADERBOARD_RUN)/$* ITERATIONS=$(LEADERBOARD_ITERATIONS) REWARD="$(DEMO_REWARD)" \
	  REPLAY=$(if $(filter $*,$(LEADERBOARD_NO_REPLAY)),no,auto) FLAGS="$(LEADERBOARD_FLAGS)" \
	  EVAL_PROMPTS=$(LEADERBOARD_RUN)/heldout.jsonl EVAL_FLAGS="$(LEADERBOARD_EVAL_FLAGS)"
	$(VENV)/bin/omnirl report $(LEADERBOARD_RUN)/$*
