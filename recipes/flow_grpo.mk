# Staged Flow-GRPO: sample → score → logprob → advantage → update, N iterations, through files.
#
# Every artifact is a target whose completion marker (a shard set's _manifest.json, an adapter's
# omnirl_adapter.json) is written last, so a re-run does nothing and deleting one artifact re-runs
# only what depends on it.
#
#   make -f recipes/flow_grpo.mk RUN=runs/x MODEL=models/sd3-tiny PROMPTS=prompts.txt ITERATIONS=4
#
# Knobs (override on the command line): GROUP, NUM_PROMPTS, STEPS, RESOLUTION, GUIDANCE, SAMPLER,
# NOISE, BATCH, REWARD, LR, CLIP, BETA, FRACTION, EXTRA_SAMPLE, EXTRA_UPDATE.
OMNIRL     ?= omnirl
RUN        ?= runs/flow_grpo
MODEL      ?= models/sd3-tiny
PROMPTS    ?= prompts.txt
ITERATIONS ?= 4
GROUP      ?= 8
NUM_PROMPTS ?= 4
STEPS      ?= 10
RESOLUTION ?= 64
GUIDANCE   ?= 1.0
SAMPLER    ?= sde
NOISE      ?= 0.7
BATCH      ?= 8
REWARD     ?= --reward jpeg_compressibility
LR         ?= 3e-4
CLIP       ?= 1e-4
BETA       ?= 0.0
FRACTION   ?= 1.0
EXTRA_SAMPLE ?=
EXTRA_UPDATE ?=
FLAGS      ?= --json --overwrite

last       := $(shell expr $(ITERATIONS) - 1)
ITERS      := $(shell seq 0 $(last))
policy      = $(if $(filter 0,$(1)),,$(RUN)/it$(1)/policy/omnirl_adapter.json)
adapter     = $(if $(filter 0,$(1)),,--adapter $(RUN)/it$(1)/policy)

.PHONY: all
all: $(RUN)/it$(ITERATIONS)/policy/omnirl_adapter.json

define iteration
$(RUN)/it$(1)/samples/_manifest.json: $(call policy,$(1))
	$(OMNIRL) sample --model $(MODEL) $(call adapter,$(1)) --prompts $(PROMPTS) --num-prompts $(NUM_PROMPTS) \
	  -n $(GROUP) --steps $(STEPS) --resolution $(RESOLUTION) --guidance $(GUIDANCE) --sampler $(SAMPLER) \
	  --noise-level $(NOISE) --batch-size $(BATCH) --seed $(1) $(EXTRA_SAMPLE) --out $(RUN)/it$(1)/samples $(FLAGS) >/dev/null

$(RUN)/it$(1)/rewards/_manifest.json: $(RUN)/it$(1)/samples/_manifest.json
	$(OMNIRL) score --in $(RUN)/it$(1)/samples $(REWARD) --out $(RUN)/it$(1)/rewards $(FLAGS) >/dev/null

$(RUN)/it$(1)/logprobs/_manifest.json: $(RUN)/it$(1)/samples/_manifest.json $(call policy,$(1))
	$(OMNIRL) logprob --model $(MODEL) $(call adapter,$(1)) --in $(RUN)/it$(1)/samples \
	  --out $(RUN)/it$(1)/logprobs $(FLAGS) >/dev/null

$(RUN)/it$(1)/advantages/_manifest.json: $(RUN)/it$(1)/samples/_manifest.json $(RUN)/it$(1)/rewards/_manifest.json
	$(OMNIRL) advantage --in $(RUN)/it$(1)/samples --in $(RUN)/it$(1)/rewards \
	  --out $(RUN)/it$(1)/advantages $(FLAGS) >/dev/null

$(RUN)/it$(shell expr $(1) + 1)/policy/omnirl_adapter.json: $(RUN)/it$(1)/samples/_manifest.json \
    $(RUN)/it$(1)/logprobs/_manifest.json $(RUN)/it$(1)/advantages/_manifest.json $(call policy,$(1))
	$(OMNIRL) update --model $(MODEL) $(call adapter,$(1)) --in $(RUN)/it$(1)/samples \
	  --in $(RUN)/it$(1)/logprobs --in $(RUN)/it$(1)/advantages --algo flow_grpo --lr $(LR) \
	  --clip-range $(CLIP) --beta $(BETA) --timestep-fraction $(FRACTION) --seed $(1) $(EXTRA_UPDATE) \
	  --out $(RUN)/it$(shell expr $(1) + 1)/policy $(FLAGS) >/dev/null
endef

$(foreach i,$(ITERS),$(eval $(call iteration,$(i))))

# Score the last policy's samples too, so the report shows where training ended.
.PHONY: final
final: $(RUN)/it$(ITERATIONS)/rewards/_manifest.json
$(eval $(call iteration,$(ITERATIONS)))
