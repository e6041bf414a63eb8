# Staged GRPO / DAPO / GSPO for vision-language models through files, N iterations:
# sample (text responses) → score (text rewards) → logprob → advantage → update.
#
# The stage chain is the one of recipes/flow_grpo.mk (included below): the commands see a VLM
# --model and switch to token-level rollouts, rewards and losses. Only the defaults differ: a VLM
# preset, a verl-format prompt table, and no reward flag (the preset's score.reward applies). Every
# other variable is flow_grpo.mk's: OMNIRL (the launcher, e.g. OMNIRL="torchrun --nproc_per_node 8 -m
# omnirl_cli"), REPORT_TO (trackers), EVAL_PROMPTS, REPLAY; and it talks as flow_grpo.mk does: progress
# on stderr, each stage's result in RUN/it<K>/<stage>.json, one line per finished iteration on stdout.
#
#   make -f recipes/vlm_grpo.mk CONFIG=recipes/configs/vlm_grpo_qwen2_5_vl.yaml \
#        MODEL=models/Qwen2.5-VL-7B-Instruct PROMPTS=geo3k_train.parquet RUN=runs/geo3k ITERATIONS=10
CONFIG  ?= recipes/configs/vlm_grpo_qwen2_5_vl.yaml
RUN     ?= runs/vlm_grpo
MODEL   ?= models/qwen2_5_vl-tiny
PROMPTS ?= prompts.parquet
REWARD  ?=
# A held-out evaluation (EVAL_PROMPTS) samples with the preset's settings: no diffusion --sampler.
EVAL_FLAGS ?=

include $(dir $(lastword $(MAKEFILE_LIST)))flow_grpo.mk
