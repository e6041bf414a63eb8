"""Group-relative advantage estimators (GRPO family) and the helpers around them.

All statistics are computed in float64 and the results returned as float32 (the `advantages`
column). Groups are the GRPO prompt groups (`group_id`); they need not be contiguous nor of equal
size (unequal sizes are tolerated, as in Flow-GRPO, and reported by `advantage_stats`).

Conventions:

- A = (r − mean_group)/(std + eps), Flow-GRPO's per-prompt tracker. ``std="global"``: population
  std of all rewards passed (the Flow-GRPO SD3 default; pass the whole epoch, gathered over ranks);
  ``"group"``: the group's own std, population, or Bessel-corrected with ``unbiased=True``
  (DanceGRPO, with eps 1e-8); ``"none"``: A = r − mean_group (Dr.GRPO).
- A group whose rewards are all equal gets A = 0 exactly, whatever the float rounding of its mean.
  So a singleton group gets 0 in every mode (its Bessel std is undefined; it carries no signal).
- If every group has size 1 (one sample per prompt), group statistics are meaningless and
  Flow-GRPO switches to batch normalisation: A = (r − mean_all)/(std_all + eps), std_all population
  (Bessel with ``unbiased=True``), no division with ``std="none"``. Same here, for every mode.
- ``clip`` clamps A to [−clip, clip] after normalisation (Flow-GRPO clips at 5 inside the loss).
- Failed rewards (`stages.score.scoring.failed_rewards`) are not rewards: the stage passes an
  estimator only the rows `estimated_rows` keeps, so no statistic (group or batch) sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.advantage.config import (
    AGGREGATIONS,
    ENTRY_POINT_GROUP,
    ESTIMATOR_PRESETS,
    NFT_ADV_MODES,
    STD_MODES,
    EstimatorPreset,
)
from stages.advantage.groups import as_rewards, group_index, group_stats
from stages.errors import UserInputError
from stages.plugins import load_entry_point, load_object


def _global_std(values: torch.Tensor, unbiased: bool) -> torch.Tensor:
    if len(values) < 2:
        return torch.zeros((), dtype=torch.float64)
    return values.std(correction=1 if unbiased else 0)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    *,
    std: str = "global",
    eps: float = 1e-4,
    unbiased: bool = False,
    clip: float | None = None,
    sample_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Group-relative advantages, float32 [N] (conventions in the module docstring).

    `sample_ids` only serves error messages (a NaN reward names its sample).
    """
    if std not in STD_MODES:
        raise UserInputError(f"advantage std {std!r} is not one of {', '.join(STD_MODES)}")
    if clip is not None and not clip > 0:
        raise UserInputError(f"advantage clip must be > 0, got {clip}")
    values = as_rewards(rewards, group_ids, sample_ids)
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.float32)
    index, num_groups = group_index(group_ids)
    if num_groups == len(values):
        centred = values - values.mean()
        adv = centred if std == "none" else centred / (_global_std(values, unbiased) + eps)
        if bool((values == values[0]).all()):
            adv = torch.zeros_like(values)
    else:
        _, mean, group_std, flat = group_stats(values, index, num_groups, unbiased)
        centred = values - mean[index]
        if std == "none":
            adv = centred
        elif std == "global":
            adv = centred / (_global_std(values, unbiased) + eps)
        else:
            adv = centred / (group_std[index] + eps)
        adv = torch.where(flat[index], torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(torch.float32)


def multi_reward_advantages(
    per_reward: Mapping[str, torch.Tensor | Sequence[float]],
    weights: Mapping[str, float],
    group_ids: Sequence[Hashable],
    *,
    aggregation: str = "reward_aggr",
    **kwargs: Any,
) -> torch.Tensor:
    """Advantages from several rewards, float32 [N] (MixGRPO's two aggregations).

    ``reward_aggr``: normalise the weighted sum Σ_k w_k·r_k once (Flow-GRPO's `avg`).
    ``advantage_aggr``: Σ_k w_k·A_k with each A_k normalised on its own. `kwargs` go to `group_advantages`.
    """
    if aggregation not in AGGREGATIONS:
        raise UserInputError(f"advantage aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    if not per_reward:
        raise UserInputError("multi-reward advantages need at least one reward column")
    if set(per_reward) != set(weights):
        missing = sorted(set(per_reward) ^ set(weights))
        raise UserInputError(
            f"reward {missing[0]!r} has a column or a weight but not both; give a weight per reward"
        )
    sample_ids = kwargs.get("sample_ids")
    if aggregation == "reward_aggr":
        total = sum(
            weights[name] * as_rewards(values, group_ids, sample_ids, f"reward.{name}")
            for name, values in per_reward.items()
        )
        return group_advantages(total, group_ids, **kwargs)
    clip = kwargs.pop("clip", None)
    total = sum(
        weights[name] * group_advantages(values, group_ids, **kwargs).to(torch.float64)
        for name, values in per_reward.items()
    )
    if clip is not None:
        total = total.clamp(-clip, clip)
    return total.to(torch.float32)


def estimated_rows(group_ids: Sequence[Hashable], failed: torch.Tensor) -> torch.Tensor:
    """bool [N]: the rows an estimator gets, of a rollout whose rows `failed` (bool [N]) have no reward.

    In a rollout of groups, the scored rows of groups with at least two scored members: a group left
    with one has nothing to compare with, so none of its rows gets an advantage. In a rollout of one
    sample per group (batch normalisation, see the module docstring), every scored row.
    """
    index, num_groups = group_index(group_ids)
    scored = ~failed
    if num_groups == len(scored):
        return scored
    members = torch.zeros(num_groups, dtype=torch.int64).index_add_(0, index, scored.long())
    return scored & (members[index] >= 2)


def zero_std_mask(rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable]) -> torch.Tensor:
    """bool [N]: True for samples whose group's rewards are all equal (singletons included).

    These are the samples `group_advantages` gives A = 0 for lack of spread; they carry no
    policy-gradient signal and Flow-GRPO masks them. When every group is a singleton the batch is
    normalised as one group, so the mask is all True only if all rewards are equal.
    """
    values = as_rewards(rewards, group_ids, None)
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.bool)
    index, num_groups = group_index(group_ids)
    if num_groups == len(values):
        return torch.full_like(values, bool((values == values[0]).all()), dtype=torch.bool)
    return group_stats(values, index, num_groups, unbiased=False)[3][index]


def broadcast_steps(adv: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Repeat each sample's advantage over its K trained steps: [N] -> [N, K] (a contiguous copy)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if adv.ndim != 1:
        raise ValueError(f"advantages must be 1-D [N], got shape {tuple(adv.shape)}")
    return adv.unsqueeze(1).expand(-1, num_steps).contiguous()


def best_worst_pairs(
    rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable]
) -> list[tuple[int, int]]:
    """Online-DPO pairs: (index of the best, index of the worst) sample per group, groups in first-appearance order.

    Ties go to the earliest index. Groups whose rewards are all equal (singletons included) have no
    preference and are skipped (Flow-GRPO's `dpo` mode pairs indices 0 and 1 there instead).
    """
    values = as_rewards(rewards, group_ids, None).tolist()
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(group_ids):
        members.setdefault(group, []).append(i)
    pairs = []
    for indices in members.values():
        best = max(indices, key=lambda i: (values[i], -i))
        worst = min(indices, key=lambda i: (values[i], i))
        if values[best] != values[worst]:
            pairs.append((best, worst))
    return pairs


def pair_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    *,
    clip: float | None = None,
    sample_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Online-DPO marks, float32 [N]: +1 for each group's best sample, −1 for its worst, 0 otherwise
    (Flow-GRPO's `dpo` mode); all-equal groups get 0. `clip` is accepted for a uniform signature."""
    values = as_rewards(rewards, group_ids, sample_ids)
    out = torch.zeros(len(values), dtype=torch.float32)
    for best, worst in best_worst_pairs(values, group_ids):
        out[best], out[worst] = 1.0, -1.0
    return out


def nft_optimality(adv: torch.Tensor, clip: float = 5.0, mode: str = "continuous") -> torch.Tensor:
    """DiffusionNFT optimality weight r = clamp(m(clip(A, ±c))/c/2 + 0.5, 0, 1), same shape as `adv`.

    m is verl-omni's `adv_mode` (`NFT_ADV_MODES`): continuous: m(a) = a; positive_only: max(a, 0)
    (r ∈ [½, 1]); negative_only: min(a, 0) (r ∈ [0, ½]); one_only: 1 if a > 0 else 0 (r ∈ {½, ½ + 1/(2c)});
    binary: sign(a) (r ∈ {½ − 1/(2c), ½, ½ + 1/(2c)}). At r = ½ a sample pulls its positive and negative
    branches equally (no preference).
    """
    a = adv.clamp(-clip, clip)
    if mode == "positive_only":
        a = a.clamp_min(0.0)
    elif mode == "negative_only":
        a = a.clamp_max(0.0)
    elif mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "continuous":
        raise UserInputError(f"--nft-adv-mode {mode}: choose one of {', '.join(NFT_ADV_MODES)}")
    return (a / clip / 2 + 0.5).clamp(0.0, 1.0)


def advantage_stats(
    rewards: torch.Tensor | Sequence[float], advantages: torch.Tensor, group_ids: Sequence[Hashable]
) -> dict[str, float | int]:
    """Summary to log: zero_std_ratio (fraction of groups with all-equal rewards, Flow-GRPO's metric),
    zero_std_samples, reward/advantage mean and population std, num_groups, group_size_min/max (unequal
    sizes are allowed and show here), and under verl-omni's names `critic/rewards/zero_std_ratio` (the
    same fraction), `critic/rewards/std_mean` (mean over groups of the population std of their rewards)
    and `critic/rewards/group_size` (samples ÷ groups). `zero_std_ratio` stays beside its verl-omni name:
    `omnirl report` reads it from the manifests of earlier runs."""
    values = as_rewards(rewards, group_ids, None)
    adv = torch.as_tensor(advantages).detach().to("cpu", torch.float64)
    if len(values) == 0:
        raise ValueError("advantage_stats needs at least one sample")
    index, num_groups = group_index(group_ids)
    count, _, group_std, flat = group_stats(values, index, num_groups, unbiased=False)
    return {
        "num_samples": len(values),
        "num_groups": num_groups,
        "group_size_min": int(count.min()),
        "group_size_max": int(count.max()),
        "zero_std_ratio": float(flat.double().mean()),
        "zero_std_samples": int(flat[index].sum()),
        "reward_mean": float(values.mean()),
        "reward_std": float(values.std(correction=0)),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std(correction=0)),
        "advantage_abs_mean": float(adv.abs().mean()),
        "critic/rewards/zero_std_ratio": float(flat.double().mean()),
        "critic/rewards/std_mean": float(group_std.mean()),
        "critic/rewards/group_size": len(values) / num_groups,
    }


@dataclass(frozen=True)
class AdvantageEstimator(EstimatorPreset):
    """A preset of `group_advantages` settings; call it like `group_advantages` minus those settings."""

    def __call__(
        self,
        rewards: torch.Tensor | Sequence[float],
        group_ids: Sequence[Hashable],
        *,
        clip: float | None = None,
        sample_ids: Sequence[str] | None = None,
    ) -> torch.Tensor:
        return group_advantages(
            rewards,
            group_ids,
            std=self.std,
            eps=self.eps,
            unbiased=self.unbiased,
            clip=clip,
            sample_ids=sample_ids,
        )


ESTIMATORS: dict[str, AdvantageEstimator] = {
    p.name: AdvantageEstimator(p.name, p.std, p.eps, p.unbiased, p.description) for p in ESTIMATOR_PRESETS
}


def get_estimator(name: str) -> Callable[..., torch.Tensor]:
    """The estimator `name` from `ESTIMATORS`, a `module:attribute` plugin, or an `omnirl.advantages` entry point.

    A plugin is called as ``fn(rewards, group_ids, *, clip=None, sample_ids=None) -> Tensor [N]``; one whose
    `needs_features` attribute is true also gets ``features=`` [N, ...], the `--diversity-features` column
    (as `gardo`, `stages.advantage.gardo.diversity_advantages`).
    """
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if name == "pairs":
        return pair_advantages
    if name == "gardo":
        from stages.advantage.gardo import diversity_advantages

        return diversity_advantages
    obj = (
        load_object(name, "advantage estimator")
        if ":" in name
        else load_entry_point(ENTRY_POINT_GROUP, name, "advantage estimator")
    )
    if obj is not None:
        if not callable(obj):
            raise UserInputError(f"advantage estimator {name!r} is a {type(obj).__name__}, not a callable")
        return obj
    raise UserInputError(
        f"unknown advantage estimator {name!r}; available: {', '.join(sorted(ESTIMATORS))} "
        "(or a plugin: 'package.module:function' or 'path/to/file.py:function')"
    )
