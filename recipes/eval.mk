# Held-out evaluation of a run's policies: the policy of iteration K (the base model for K = 0)
# samples EVAL_PROMPTS with one fixed seed and is scored, into RUN/it<K>/eval/{samples,rewards}, so
# every iteration is measured on the same prompts and starting noise and `omnirl report RUN` can put
# them in one table, one curve and a before/after grid.
#
# recipes/flow_grpo.mk includes this file when EVAL_PROMPTS is given (`make -f recipes/flow_grpo.mk
# ... EVAL_PROMPTS=heldout.jsonl`); on its own it evaluates a finished run, e.g. an `omnirl online`
# one (whose it<K>/policy checkpoints exist):
#
#   make -f recipes/eval.mk CONFIG=recipes/configs/demo_shapes.yaml MODEL=... RUN=runs/online \
#        ITERATIONS=6 EVAL_PROMPTS=heldout.jsonl REWARD="--reward geneval_shapes"
#
# Sampling takes CONFIG's sample settings with EVAL_FLAGS on top (flags win): by default the
# deterministic ODE sampler, so the evaluation shows the policy's mean behaviour, not its exploration.
#
# Each stage's --json result goes to RUN/it<K>/eval/<stage>.json, its progress to stderr, and stdout gets
# a line per evaluated iteration (recipes/report.mk). OMNIRL starts every stage: `omnirl` (default) or a
# launcher, e.g. OMNIRL="torchrun --nproc_per_node 8 -m omnirl_cli". The evaluation logs to no tracker
# (flow_grpo.mk's REPORT_TO is the training's): `omnirl report RUN --report-to T` sends its statistics
# as their own series (eval/reward/mean ...).
OMNIRL       ?= omnirl
CONFIG       ?= recipes/configs/flow_grpo_sd3.yaml
RUN          ?= runs/flow_grpo
MODEL        ?= models/sd3-tiny
ITERATIONS   ?= 4
REWARD       ?= --reward jpeg_compressibility
EVAL_PROMPTS ?= heldout.jsonl
EVAL_SEED    ?= 0
# The iterations to evaluate (default: all of 0..ITERATIONS).
EVAL_ITERS   ?= $(shell seq 0 $(ITERATIONS))
EVAL_FLAGS   ?= --sampler ode
FLAGS        ?= --overwrite
# The sampling's sequence-parallel degree (--sp-degree; 1: none), as recipes/flow_grpo.mk's SP.
SP           ?= 1

eval_policy  = $(if $(filter 0,$(1)),,$(RUN)/it$(1)/policy/omnirl_adapter.json)
eval_adapter = $(if $(filter 0,$(1)),,--adapter $(RUN)/it$(1)/policy)
eval_sp      = $(if $(filter-out 1,$(SP)),--sp-degree $(SP))

include $(dir $(lastword $(MAKEFILE_LIST)))report.mk

.PHONY: eval
eval: $(foreach i,$(EVAL_ITERS),$(RUN)/it$(i)/summary.txt)

define evaluation
$(RUN)/it$(1)/eval/samples/_manifest.json: $(call eval_policy,$(1)) $(CONFIG) $(wildcard $(EVAL_PROMPTS))
	@mkdir -p $(RUN)/it$(1)/eval
	$(OMNIRL) sample --config $(CONFIG) --model $(MODEL) $(call eval_adapter,$(1)) --prompts $(EVAL_PROMPTS) \
	  --seed $(EVAL_SEED) $(EVAL_FLAGS) --out $(RUN)/it$(1)/eval/samples $(eval_sp) $(FLAGS) \
	  $(call result,$(RUN)/it$(1)/eval/sample.json)

$(RUN)/it$(1)/eval/rewards/_manifest.json: $(RUN)/it$(1)/eval/samples/_manifest.json
	$(OMNIRL) score --config $(CONFIG) --in $(RUN)/it$(1)/eval/samples $(REWARD) \
	  --out $(RUN)/it$(1)/eval/rewards $(FLAGS) $(call result,$(RUN)/it$(1)/eval/score.json)

# Iteration K's line also waits for its evaluation.
$(RUN)/it$(1)/summary.txt: $(RUN)/it$(1)/eval/rewards/_manifest.json
endef

$(foreach i,$(EVAL_ITERS),$(eval $(call evaluation,$(i))))
