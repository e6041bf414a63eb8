# Staged Flow-GRPO through files: sample → score → logprob → advantage → update, N iterations.
#
# Every artifact is a target whose completion marker (a shard set's _manifest.json, an adapter's
# omnirl_adapter.json) is written last, so a re-run does nothing and deleting one artifact re-runs
# only what depends on it. Hyperparameters live in the YAML preset (CONFIG); this file only wires
# inputs to outputs and seeds each iteration.
#
#   make -f recipes/flow_grpo.mk CONFIG=recipes/configs/flow_grpo_sd3.yaml MODEL=models/sd3 \
#        PROMPTS=prompts.txt RUN=runs/x ITERATIONS=4 REWARD="--reward ocr"
#
# It talks (recipes/report.mk): each stage's progress on stderr, its --json result in
# RUN/it<K>/<stage>.json, and on stdout one line per finished iteration (se: standard error):
#   it<K>  reward MEAN ± SE (se, n N)  [NAMED_REWARD MEAN ...]  [held-out reward MEAN ± SE (se, n N) ...]
#          zero-std Z  pg_loss L  ratio R  clipfrac C          (means over the update's optimizer steps)
# RUN/README.md, the dataset card each finished shard set rewrites, makes the run folder a dataset:
# datasets.load_dataset(RUN, "samples") gives one split per iteration (stages/shards/run_card.py).
#
# OMNIRL starts every stage: `omnirl` (default), or a launcher, e.g.
#   OMNIRL="torchrun --nproc_per_node 8 -m omnirl_cli"
#   OMNIRL="accelerate launch --config_file recipes/accelerate/fsdp2_8gpu.yaml -m omnirl_cli"
# SP: the sequence-parallel degree (--sp-degree) of sample, logprob and update, and of the held-out
# evaluation's sampling (score and advantage take none): each group of SP consecutive ranks of the
# OMNIRL launch shares every sample's tokens (FLUX, Qwen-Image, Wan; docs/scaling.md). 1: none.
# 8 GPUs as 4 dp × 2 sp, Qwen-Image at 1024²; and 8 × sp for Wan 2.1 14B at 480p, sharded by FSDP2:
#   make -f recipes/flow_grpo.mk CONFIG=recipes/configs/flow_grpo_qwen_image.yaml MODEL=/path/to/Qwen-Image \
#        SP=2 OMNIRL="accelerate launch --config_file recipes/accelerate/ddp_8gpu.yaml -m omnirl_cli" \
#        FLAGS="--overwrite --set sample.resolution=1024" PROMPTS=ocr.parquet RUN=runs/ocr-1024
#   make -f recipes/flow_grpo.mk CONFIG=recipes/configs/flow_grpo_wan2_1.yaml \
#        MODEL=/path/to/Wan2.1-T2V-14B-Diffusers SP=8 \
#        OMNIRL="accelerate launch --config_file recipes/accelerate/fsdp2_8gpu.yaml -m omnirl_cli" \
#        FLAGS="--overwrite --set sample.resolution=480x832" PROMPTS=ocr.parquet RUN=runs/wan14b
# REPORT_TO: experiment trackers that score and update log to (--report-to), e.g. REPORT_TO=tensorboard
# or REPORT_TO=wandb,tensorboard; empty (default): the preset's report_to, else none.
OMNIRL     ?= omnirl
REPORT_TO  ?=
SP         ?= 1
CONFIG     ?= recipes/configs/flow_grpo_sd3.yaml
RUN        ?= runs/flow_grpo
MODEL      ?= models/sd3-tiny
PROMPTS    ?= prompts.txt
ITERATIONS ?= 4
REWARD     ?= --reward jpeg_compressibility
# Sampling seed of every iteration; empty (the default) uses the iteration number, so each
# iteration draws fresh prompts and noise. A fixed SEED re-samples the same prompts and noise
# each time, which makes the reward curve a clean measure of how the policy changed.
SEED       ?=
FLAGS      ?= --overwrite
# A held-out prompt file: each iteration's policy is also evaluated on it (recipes/eval.mk).
EVAL_PROMPTS ?=
# The replay of each rollout (`omnirl logprob --replay $(REPLAY)`). auto: run the model only when the
# replay can give other log-probs than the rollout's own (another engine than the in-process
# diffusers one, other weights, dtype, mixed precision or device type, a quantized attention backend
# on one side only, a text rollout, a preset's logprob --reference / --means); otherwise logprob
# loads nothing and writes the sample ids only, and
# update trains on the rollout's log-probs, the very values the replay would give (docs/real-checkpoints.md).
# yes: always replay. no: skip `omnirl logprob` (algorithms that never read rollout log-probs:
# DiffusionNFT, AWM, DPO); update then reads only the samples and the advantages.
REPLAY     ?= auto
ifeq ($(filter $(REPLAY),auto yes no),)
$(error REPLAY=$(REPLAY): choose auto, yes or no)
endif

ITERS   := $(shell seq 0 $(ITERATIONS))
next     = $(shell expr $(1) + 1)
tracking = $(if $(REPORT_TO),--report-to $(REPORT_TO))
sp       = $(if $(filter-out 1,$(SP)),--sp-degree $(SP))
policy   = $(if $(filter 0,$(1)),,$(RUN)/it$(1)/policy/omnirl_adapter.json)
adapter  = $(if $(filter 0,$(1)),,--adapter $(RUN)/it$(1)/policy)
it       = $(RUN)/it$(1)
seed     = $(if $(SEED),$(SEED),$(1))
logprobs = $(if $(filter no,$(REPLAY)),,$(call it,$(1))/logprobs)

.PHONY: all
# N updates, plus the samples and rewards of the last policy so the report shows where it ended; a
# line per iteration.
all: $(foreach i,$(ITERS),$(call it,$(i))/summary.txt)
include $(dir $(lastword $(MAKEFILE_LIST)))report.mk
ifneq ($(EVAL_PROMPTS),)
include $(dir $(lastword $(MAKEFILE_LIST)))eval.mk
all: eval
endif

define iteration
$(call it,$(1))/samples/_manifest.json: $(call policy,$(1)) $(CONFIG) $(wildcard $(PROMPTS))
	@mkdir -p $(call it,$(1))
	$(OMNIRL) sample --config $(CONFIG) --model $(MODEL) $(call adapter,$(1)) --prompts $(PROMPTS) \
	  --seed $(call seed,$(1)) --iteration $(1) --out $(call it,$(1))/samples $(sp) $(FLAGS) \
	  $(call result,$(call it,$(1))/sample.json)

$(call it,$(1))/rewards/_manifest.json: $(call it,$(1))/samples/_manifest.json
	$(OMNIRL) score --config $(CONFIG) --in $(call it,$(1))/samples $(REWARD) --out $(call it,$(1))/rewards \
	  $(tracking) $(FLAGS) $(call result,$(call it,$(1))/score.json)

$(call it,$(1))/logprobs/_manifest.json: $(call it,$(1))/samples/_manifest.json
	$(OMNIRL) logprob --config $(CONFIG) --model $(MODEL) $(call adapter,$(1)) --in $(call it,$(1))/samples \
	  --replay $(REPLAY) --out $(call it,$(1))/logprobs $(sp) $(FLAGS) $(call result,$(call it,$(1))/logprob.json)

$(call it,$(1))/advantages/_manifest.json: $(call it,$(1))/rewards/_manifest.json
	$(OMNIRL) advantage --config $(CONFIG) --in $(call it,$(1))/samples --in $(call it,$(1))/rewards \
	  --out $(call it,$(1))/advantages $(FLAGS) $(call result,$(call it,$(1))/advantage.json)

$(call it,$(call next,$(1)))/policy/omnirl_adapter.json: $(addsuffix /_manifest.json,$(call logprobs,$(1))) \
    $(call it,$(1))/advantages/_manifest.json
	$(OMNIRL) update --config $(CONFIG) --model $(MODEL) $(call adapter,$(1)) --in $(call it,$(1))/samples \
	  $(addprefix --in ,$(call logprobs,$(1))) --in $(call it,$(1))/advantages --seed $(1) \
	  --out $(call it,$(call next,$(1)))/policy $(sp) $(tracking) $(FLAGS) \
	  $(call result,$(call it,$(1))/update.json)

# Iteration K's line once it is scored and its update is done (the last iteration has none).
$(call it,$(1))/summary.txt: $(call it,$(1))/rewards/_manifest.json \
    $(if $(filter $(ITERATIONS),$(1)),,$(call it,$(call next,$(1)))/policy/omnirl_adapter.json)
endef

$(foreach i,$(ITERS),$(eval $(call iteration,$(i))))
