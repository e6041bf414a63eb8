"""The `advantage` stage: group-normalised advantages over a whole rollout, one row per sample.

Normalisation needs every group (and, for flow_grpo's global std, every reward), so the stage reads
all shards, then writes advantages back in the samples' shard layout.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.advantage.estimators import (
    ESTIMATORS,
    advantage_stats,
    broadcast_steps,
    get_estimator,
    multi_reward_advantages,
    zero_std_mask,
)
from stages.errors import UserInputError
from stages.finite import check_finite
from stages.score.registry import reward_column

RESCORE = "re-score it (`omnirl score`) or drop its group before computing advantages"


def compute_advantages(
    data: dict[str, Any],
    *,
    estimator: str = "grpo",
    clip: float | None = None,
    drop_zero_std: bool = False,
    num_steps: int | None = None,
    weights: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Columns sample_id, advantages [N, K] (and train_mask [N]) plus summary stats.

    data: sample_id, group_id, reward [N]; K comes from `num_steps` (stored steps of the rollout).
    With `weights` (reward name → weight), advantages are aggregated per reward (MixGRPO's
    `advantage_aggr`): each `reward.<name>` column is normalised on its own, then weighted and summed.
    """
    for col in ("sample_id", "group_id", "reward"):
        if col not in data:
            hint = "the output of `omnirl score`" if col == "reward" else "the output of `omnirl sample`"
            raise UserInputError(f"--in: column '{col}' is missing; pass {hint}")
    groups = list(data["group_id"])
    ids = list(data["sample_id"])
    rewards = _numbers(data, "reward")
    check_finite({"reward": rewards}, ids, where="--in", hint=RESCORE)
    if weights:
        if estimator not in ESTIMATORS:
            raise UserInputError(
                f"--aggregation advantage_aggr works with a built-in --estimator, not {estimator!r}"
            )
        preset = ESTIMATORS[estimator]
        missing = [name for name in weights if reward_column(name) not in data]
        if missing:
            raise UserInputError(
                f"--in: column '{reward_column(missing[0])}' is missing; score with --reward {missing[0]}"
            )
        per_reward = {name: _numbers(data, reward_column(name)) for name in weights}
        check_finite({reward_column(n): v for n, v in per_reward.items()}, ids, where="--in", hint=RESCORE)
        adv = multi_reward_advantages(
            per_reward,
            weights,
            groups,
            aggregation="advantage_aggr",
            std=preset.std,
            eps=preset.eps,
            unbiased=preset.unbiased,
            clip=clip,
            sample_ids=ids,
        )
    else:
        adv = get_estimator(estimator)(rewards, groups, clip=clip, sample_ids=ids)
    check_finite({"advantages": adv}, ids, hint=f"--estimator {estimator} produced it; fix the estimator")
    stats = advantage_stats(rewards, adv, groups)
    out: dict[str, Any] = {
        "sample_id": ids,
        "advantages": broadcast_steps(adv.float(), max(1, num_steps or 1)),
    }
    if drop_zero_std:
        keep = ~zero_std_mask(rewards, groups)
        out["train_mask"] = keep
        stats["dropped_samples"] = int((~keep).sum())
    out["advantages"] = out["advantages"].to(torch.float32)
    return out, stats


def _numbers(data: dict[str, Any], column: str) -> torch.Tensor:
    """A reward column as float32 [N]; a column that does not hold one number per sample (strings,
    JSON, a tensor per row) is a one-line input error naming it."""
    values = data[column]
    if isinstance(values, torch.Tensor) and values.ndim == 1:
        return values.float()
    if isinstance(values, torch.Tensor):
        held = f"a {tuple(values.shape[1:])} tensor per sample"
    else:
        held = f"{type(values[0]).__name__} values" if len(values) else "no numbers"
    raise UserInputError(
        f"--in: column '{column}' holds {held}, not one number per sample; "
        "pass the rewards written by `omnirl score`"
    )


def reward_weights(manifests: list[Any]) -> dict[str, float]:
    """reward name → weight, as `omnirl score --reward NAME[=WEIGHT]` recorded them."""
    from stages.score.registry import parse_reward_spec

    for manifest in manifests:
        if manifest.command == "score":
            return dict(parse_reward_spec(spec) for spec in manifest.config.get("reward") or [])
    raise UserInputError(
        "--aggregation advantage_aggr: none of the --in shard sets was written by `omnirl score`"
    )
