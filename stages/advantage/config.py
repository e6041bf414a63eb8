"""`advantage`'s settings as one typed config, and the names its knobs take; torch-free.

`AdvantageConfig` is the single declaration of every `omnirl advantage` option (help, choices, panel),
from which the CLI generates its options (`omnirl_cli.generate`). The built-in estimators are listed
here once, as data (`ESTIMATOR_PRESETS`): `stages.advantage.estimators` turns them into callables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import knob

STD_MODES = ("global", "group", "none")
AGGREGATIONS = ("reward_aggr", "advantage_aggr")
ENTRY_POINT_GROUP = "omnirl.advantages"
# DiffusionNFT's advantage → optimality maps (verl-omni adv_mode; `stages.advantage.estimators.nft_optimality`)
NFT_ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")


@dataclass(frozen=True)
class EstimatorPreset:
    """A named preset of `group_advantages` settings: its std mode (`STD_MODES`), eps and Bessel correction."""

    name: str
    std: str
    eps: float
    unbiased: bool
    description: str


ESTIMATOR_PRESETS = (
    EstimatorPreset(
        "grpo", "global", 1e-4, False, "Flow-GRPO: group mean, population std of the batch, eps 1e-4"
    ),
    EstimatorPreset(
        "grpo_group", "group", 1e-4, False, "Flow-GRPO with per-group std (Wan, FLUX-fast configs)"
    ),
    EstimatorPreset(
        "dance", "group", 1e-8, True, "DanceGRPO: group mean, Bessel-corrected group std, eps 1e-8"
    ),
    EstimatorPreset("drgrpo", "none", 0.0, False, "Dr.GRPO: group mean subtracted, no std division"),
    EstimatorPreset(
        "grpo_verl", "group", 1e-6, True, "verl/EasyR1 GRPO: group mean, Bessel group std, eps 1e-6"
    ),
    EstimatorPreset(
        "grpo_trl", "group", 1e-4, True, "trl/VLM-R1 GRPO: group mean, Bessel group std, eps 1e-4"
    ),
    EstimatorPreset(
        "grpo_batch_std", "global", 1e-4, True, "trl scale_rewards='batch' (Lite-PPO): group mean, batch std"
    ),
)
# `pairs` (+1 best, −1 worst of each group) and `gardo` (diversity-aware) are built in beside the presets.
ESTIMATOR_NAMES = (*(p.name for p in ESTIMATOR_PRESETS), "pairs", "gardo")
# --std MODE replaces --estimator by the preset with that std.
STD_ESTIMATORS = {"global": "grpo", "group": "grpo_group", "none": "drgrpo"}


@dataclass
class AdvantageConfig:
    """Every setting of the `advantage` stage (`omnirl advantage`)."""

    inputs: list[Path] | None = knobs.inputs()
    out: Path | None = knobs.out()
    estimator: str = knob(
        "grpo",
        f"One of {', '.join(ESTIMATOR_NAMES)} (grpo: flow_grpo's, global std; dance: unbiased group std; "
        "drgrpo: no std; pairs: +1 best, −1 worst of each group, online DPO; gardo: (r − group mean) × the "
        "sample's diversity ÷ its group's, above the mean, no std (GARDO); docs/algorithms.md has each), "
        "or a plugin module:function.",
        names=ESTIMATOR_NAMES,
        entry_points=ENTRY_POINT_GROUP,
    )
    std: str | None = knob(None, "Override the estimator's std.", choices=STD_MODES)
    std_ddof: int | None = knob(
        None,
        "Degrees-of-freedom correction of the group estimators' std, overriding the estimator's: 0 population "
        "std (flow_grpo), 1 Bessel's correction (verl-omni, DanceGRPO, verl). Default: the estimator's (0 for "
        "grpo and grpo_group, 1 for dance, grpo_verl, grpo_trl and grpo_batch_std).",
        low=0,
        high=1,
    )
    clip: float | None = knob(None, "Clip advantages to ±CLIP.")
    drop_zero_std: bool = knob(False, "Mark samples of all-equal-reward groups as not trained (flow_grpo).")
    aggregation: str = knob(
        "reward_aggr",
        "reward_aggr: normalise the weighted total reward (flow_grpo); advantage_aggr: normalise each "
        "reward.<name> on its own, then weight and sum (MixGRPO).",
        choices=AGGREGATIONS,
    )
    diversity_features: str = knob(
        "final_latent",
        "--estimator gardo: the per-sample column whose cosine distances measure diversity (GARDO uses "
        "DINOv3 image embeddings, which omnirl does not compute; default: the final latent).",
    )
    gate_reward: list[str] | None = knob(
        None,
        "GARDO's KL gate: an auxiliary reward NAME (a reward.NAME column; repeat for several, e.g. "
        "aesthetic and imagereward scored with weight 0). Writes kl_gate: the samples the trained reward "
        "ranks furthest below the auxiliaries' mean rank, which `update --beta` alone penalises.",
    )
    gate_fraction: float = knob(
        0.1,
        "GARDO's KL gate: the share of the samples with a non-negative rank gap that are gated (the "
        "reference's starting 0.1).",
        low=0.0,
        high=1.0,
    )
    fmt: str = knobs.shard_format()
    overwrite: bool = knobs.overwrite()

    def __post_init__(self) -> None:
        if isinstance(self.gate_reward, str):  # one name from a preset, as the flag given once
            self.gate_reward = [self.gate_reward]

    def estimator_name(self) -> str:
        """The estimator that runs: --std's preset when given, else --estimator."""
        return STD_ESTIMATORS[self.std] if self.std is not None else self.estimator
