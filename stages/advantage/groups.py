"""Rewards grouped by prompt: the checks and per-group statistics every group estimator shares
(`stages.advantage.estimators`, `stages.advantage.gardo`)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from stages.finite import check_finite


def as_rewards(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    sample_ids: Sequence[str] | None,
    what: str = "rewards",
) -> torch.Tensor:
    """Rewards as float64 [N], checked: 1-D, one group id per sample, all finite."""
    values = torch.as_tensor(rewards).detach().to("cpu", torch.float64)
    if values.ndim != 1:
        raise ValueError(f"{what} must be 1-D [N], got shape {tuple(values.shape)}")
    if len(group_ids) != len(values):
        raise ValueError(f"{len(values)} {what} but {len(group_ids)} group ids")
    check_finite({what: values}, sample_ids, hint="re-score it or drop its group before computing advantages")
    return values


def group_index(group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Map group ids to dense indices in order of first appearance: (index [N] int64, number of groups)."""
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.int64), len(dense)


def group_stats(
    values: torch.Tensor, index: torch.Tensor, num_groups: int, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: (count, mean, std, all-equal flag), each [G]. Std of a singleton is 0."""
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(values))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, values) / count
    squared = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, (values - mean[index]) ** 2)
    dof = count - 1 if unbiased else count
    std = torch.where(dof > 0, squared / dof.clamp(min=1), torch.zeros_like(squared)).sqrt()
    high = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce_(0, index, values, "amax")
    low = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce_(0, index, values, "amin")
    return count, mean, std, high == low
