"""The `advantage` stage: group-normalised advantages over a whole rollout, one row per sample.

Normalisation needs every group (and, for flow_grpo's global std, every reward), so the stage reads
all shards, then writes advantages back in the samples' shard layout.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.advantage.estimators import advantage_stats, broadcast_steps, get_estimator, zero_std_mask
from stages.errors import UserInputError


def compute_advantages(
    data: dict[str, Any],
    *,
    estimator: str = "grpo",
    clip: float | None = None,
    drop_zero_std: bool = False,
    num_steps: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Columns sample_id, advantages [N, K] (and train_mask [N]) plus summary stats.

    data: sample_id, group_id, reward [N]; K comes from `num_steps` (stored steps of the rollout).
    """
    for col in ("sample_id", "group_id", "reward"):
        if col not in data:
            hint = "the output of `omnirl score`" if col == "reward" else "the output of `omnirl sample`"
            raise UserInputError(f"--in: column '{col}' is missing; pass {hint}")
    rewards = data["reward"].float()
    groups = list(data["group_id"])
    ids = list(data["sample_id"])
    adv = get_estimator(estimator)(rewards, groups, clip=clip, sample_ids=ids)
    stats = advantage_stats(rewards, adv, groups)
    out: dict[str, Any] = {"sample_id": ids, "advantages": broadcast_steps(adv.float(), max(1, num_steps or 1))}
    if drop_zero_std:
        keep = ~zero_std_mask(rewards, groups)
        out["train_mask"] = keep
        stats["dropped_samples"] = int((~keep).sum())
    out["advantages"] = out["advantages"].to(torch.float32)
    return out, stats
