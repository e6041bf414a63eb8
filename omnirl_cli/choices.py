"""The names choice options accept, for `--help`, shell completion and validation without importing torch.

Closed sets are `Literal` types: typer lists them in help as <a|b|c>, completes them and refuses other
flag values; `config.resolve` checks values from --config, --set and OMNIRL_* variables against the
same sets. Open registries that plugins extend (rewards, algorithms, advantage estimators, model
families) stay plain strings whose built-in names are offered by completion only, so a
`module:attribute` plugin is never refused here. A set the library declares torch-free (`stages.knobs`,
a stage's config module) is taken from there; each other set mirrors the stage constant that validates
it (tests/test_cli_conventions.py holds them equal), because importing those stages here would load
torch on every `--help` and TAB. Commands generated from a stage's config (`omnirl_cli.generate`) take
their sets from its knobs and need nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from stages.knobs import DTYPES, FORMATS, MIXED_PRECISION_MODES
from stages.score.config import BUILTIN_REWARDS
from stages.score.registry import ENTRY_POINT_GROUP

# Taken from the library's torch-free registries (`stages.knobs`), so there is nothing to mirror.
Format = Literal[FORMATS]
MixedPrecision = Literal[MIXED_PRECISION_MODES]
Dtype = Literal[DTYPES]
LatentDtype = Literal["fp32", "bf16"]  # stages.sample.rollout.LATENT_DTYPES
Sampler = Literal["ode", "sde", "cps", "dance"]  # stages.sample.samplers.SAMPLERS
WindowStrategy = Literal["random", "progressive", "fixed"]  # windows.STRATEGIES but "all" (= --sde-window 0)
Layout = Literal["verl", "easyr1"]  # stages.sample.vlm_data.read_vlm_prompts
Replay = Literal["auto", "yes"]  # stages.logprob.decide.REPLAY_MODES
LrScheduler = Literal["constant", "linear", "cosine"]  # stages.update.trainer.LR_SCHEDULERS
LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]  # stages.update.token_losses.AGG_MODES
KlType = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+"]  # token_losses.KL_KINDS
OldDecay = Literal["copy", "linear_to_0_5", "delayed_linear_to_0_999"]  # family_losses.NFT_DECAY_SCHEDULES
AwmWeighting = Literal["uniform", "ghuber"]  # stages.update.family_losses.AWM_WEIGHTINGS
VaeMode = Literal["model", "pixel"]  # stages.pretrain.flow_matching.VAE_MODES
# the SIZES of the families' builders (and wan.PUBLISHED's): test, benchmark and published sizes
ModelSize = Literal["tiny", "small", "demo", "full", "medium", "1.3b", "3b", "7b", "8b"]

# Built-in names of the open registries (completion only; plugins are accepted beside them).
# Rollout engines: stages.sample.engines' diffusion engines, then stages.sample.vlm_stage.ENGINES.
ENGINES = ("diffusers", "remote", "vllm-omni", "hf", "openai")
ENGINE_ENTRY_POINTS = "omnirl.engines"
ALGORITHMS = (
    "flow_grpo",
    "dance_grpo",
    "mix_grpo",
    "grpo_guard",
    "nft",
    "awm",
    "dpo",
    "grpo",
    "dapo",
    "gspo",
)  # stages.update.losses.ALGORITHMS
FAMILIES = (  # stages.models.factory.FAMILIES
    "flux",
    "qwen2_5_vl",
    "qwen3_omni_thinker",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen_image",
    "sd3",
    "wan2_1",
    "wan2_2_5b",
    "wan2_2_a14b",
    "z_image",
)
# The rewards' built-ins and entry-point group (stages.score), for commands not generated from a config yet.
REWARDS, REWARD_ENTRY_POINTS = BUILTIN_REWARDS, ENTRY_POINT_GROUP


def complete(names: tuple[str, ...], entry_points: str | None = None) -> Callable[[str], list[str]]:
    """A typer `autocompletion` callback offering `names` (and the installed entry points of the group
    `entry_points`) that start with what was typed."""

    def offer(incomplete: str) -> list[str]:
        found = list(names)
        if entry_points:
            from importlib.metadata import entry_points as installed

            found += sorted({ep.name for ep in installed(group=entry_points)} - set(names))
        return [name for name in found if name.startswith(incomplete)]

    return offer
