# UniGRPO on BAGEL through files (verl-omni's idea: one policy trained on generation rewards and on
# understanding rewards): iterations alternate between the two kinds over ONE LoRA folder.
#
#   even iteration: understanding — sample (the preset's --understand: text answers about the images of a verl table),
#                   score (text rewards), logprob, advantage, update --algo grpo (CONFIG_UND)
#   odd iteration:  generation — sample (images for a prompt file), score (image rewards), logprob,
#                   advantage, update --algo flow_grpo (CONFIG_GEN)
#
# Each update reads the previous iteration's policy (--adapter) and writes the next one. The first is an
# understanding update: its LoRA (stages/models/bagel_vlm.py LORA_TARGETS) covers both experts'
# projections, so the folder it writes is the one every later phase loads and extends; a generation
# update alone would write a LoRA on the generation expert only, which an understanding update refuses.
# Progress on stderr, each stage's result in RUN/it<K>/<stage>.json (recipes/report.mk), one report line
# per finished iteration on stdout. docs/families.md (BAGEL) says what each phase trains.
#
#   make -f recipes/unigrpo.mk MODEL=/path/to/BAGEL-7B-MoT PROMPTS_UND=vqa.parquet PROMPTS_GEN=prompts.txt \
#        RUN=runs/unigrpo ITERATIONS=20
OMNIRL      ?= omnirl
RUN         ?= runs/unigrpo
MODEL       ?= models/bagel-tiny
ITERATIONS  ?= 4
CONFIG_UND  ?= recipes/configs/unigrpo_bagel_understanding.yaml
CONFIG_GEN  ?= recipes/configs/unigrpo_bagel_generation.yaml
PROMPTS_UND ?= prompts.parquet
PROMPTS_GEN ?= prompts.txt
# empty: the preset's score.reward
REWARD_UND  ?=
REWARD_GEN  ?=
FLAGS       ?= --overwrite

ITERS  := $(shell seq 0 $(ITERATIONS))
next    = $(shell expr $(1) + 1)
kind    = $(if $(filter 0,$(shell expr $(1) % 2)),UND,GEN)
it      = $(RUN)/it$(1)
policy  = $(if $(filter 0,$(1)),,$(RUN)/it$(1)/policy/omnirl_adapter.json)
adapter = $(if $(filter 0,$(1)),,--adapter $(RUN)/it$(1)/policy)
config  = --config $(CONFIG_$(call kind,$(1)))

.PHONY: all
all: $(foreach i,$(ITERS),$(call it,$(i))/summary.txt)
include $(dir $(lastword $(MAKEFILE_LIST)))report.mk

define iteration
$(call it,$(1))/samples/_manifest.json: $(call policy,$(1)) $(CONFIG_$(call kind,$(1))) \
    $(wildcard $(PROMPTS_$(call kind,$(1))))
	@mkdir -p $(call it,$(1))
	$(OMNIRL) sample $(call config,$(1)) --model $(MODEL) $(call adapter,$(1)) --prompts $(PROMPTS_$(call kind,$(1))) \
	  --seed $(1) --iteration $(1) --out $(call it,$(1))/samples $(FLAGS) $(call result,$(call it,$(1))/sample.json)

$(call it,$(1))/rewards/_manifest.json: $(call it,$(1))/samples/_manifest.json
	$(OMNIRL) score $(call config,$(1)) --in $(call it,$(1))/samples $(REWARD_$(call kind,$(1))) \
	  --out $(call it,$(1))/rewards $(FLAGS) $(call result,$(call it,$(1))/score.json)

$(call it,$(1))/logprobs/_manifest.json: $(call it,$(1))/samples/_manifest.json
	$(OMNIRL) logprob $(call config,$(1)) --model $(MODEL) $(call adapter,$(1)) --in $(call it,$(1))/samples \
	  --out $(call it,$(1))/logprobs $(FLAGS) $(call result,$(call it,$(1))/logprob.json)

$(call it,$(1))/advantages/_manifest.json: $(call it,$(1))/rewards/_manifest.json
	$(OMNIRL) advantage $(call config,$(1)) --in $(call it,$(1))/samples --in $(call it,$(1))/rewards \
	  --out $(call it,$(1))/advantages $(FLAGS) $(call result,$(call it,$(1))/advantage.json)

$(call it,$(call next,$(1)))/policy/omnirl_adapter.json: $(call it,$(1))/logprobs/_manifest.json \
    $(call it,$(1))/advantages/_manifest.json
	$(OMNIRL) update $(call config,$(1)) --model $(MODEL) $(call adapter,$(1)) --in $(call it,$(1))/samples \
	  --in $(call it,$(1))/logprobs --in $(call it,$(1))/advantages --seed $(1) \
	  --out $(call it,$(call next,$(1)))/policy $(FLAGS) $(call result,$(call it,$(1))/update.json)

$(call it,$(1))/summary.txt: $(call it,$(1))/rewards/_manifest.json \
    $(if $(filter $(ITERATIONS),$(1)),,$(call it,$(call next,$(1)))/policy/omnirl_adapter.json)
endef

$(foreach i,$(ITERS),$(eval $(call iteration,$(i))))
