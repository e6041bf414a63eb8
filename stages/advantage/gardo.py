"""GARDO's advantage-side pieces (He et al. 2025, arXiv 2512.24138; code: tinnerhrhe/GARDO on flow_grpo).

- `diversity_advantages` (`--estimator gardo`): diversity-aware advantages. Per group g, with unit
  features f_i (DINOv3 image embeddings in the reference; here any per-sample column, the final latent
  by default) and d_i = min_{j ≠ i in g} (1 − cos(f_i, f_j)), the distance to the nearest other member:
  A_i = (r_i − mean_g r)·m_i, m_i = d_i / mean_g d for samples at or above the group mean, 1 below it.
  No std division (GARDO drops it so that tiny reward gaps are not blown up).
- `uncertainty` / `uncertainty_gate` (`--gate-reward`): which samples get the KL penalty. Each reward
  ranks the batch (1 = highest); U_i = rank_main(i) − mean_k rank_aux_k(i), and the gate holds the
  samples whose U is above the (1 − q) quantile of the non-negative U's (q = `--gate-fraction`, the
  reference's starting 0.1). The trainer applies its KL term to the gated rows only (`kl_gate`).

All statistics in float64; results float32 (advantages) or bool (gate).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from stages.advantage.groups import as_rewards, group_index, group_stats
from stages.errors import UserInputError
from stages.finite import check_finite

GATE_COLUMN = "kl_gate"


def nearest_distances(features: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """d_i = min over the other members j of i's group of 1 − cos(f_i, f_j), float64 [N]; 0 for a singleton.

    features: [N, ...] (flattened per row); index: dense group index [N] int64.
    """
    flat = features.detach().to("cpu", torch.float64).flatten(1)
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    distance = 1.0 - (unit @ unit.T).clamp(-1.0, 1.0)
    other = (index[:, None] == index[None, :]) & ~torch.eye(len(index), dtype=torch.bool)
    nearest = distance.masked_fill(~other, torch.inf).amin(dim=1)
    return torch.where(other.any(dim=1), nearest, torch.zeros_like(nearest))


def diversity_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    *,
    features: torch.Tensor,
    clip: float | None = None,
    sample_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """GARDO's diversity-aware advantages, float32 [N] (module docstring); features [N, ...].

    A group whose rewards are all equal (a singleton too) gets 0. A group whose members' features all
    coincide (mean distance 0) has no diversity to reward: m = 1 there (the reference divides 0 by 0).
    """
    values = as_rewards(rewards, group_ids, sample_ids)
    if features.shape[0] != len(values):
        raise ValueError(f"{len(values)} rewards but {features.shape[0]} feature rows")
    check_finite({"features": features.float()}, sample_ids, hint="check the --diversity-features column")
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.float32)
    index, num_groups = group_index(group_ids)
    _, mean, _, flat = group_stats(values, index, num_groups, unbiased=False)
    nearest = nearest_distances(features, index, num_groups)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(values))
    group_d = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, nearest) / count
    centred = values - mean[index]
    scale = torch.where(
        group_d[index] > 0, nearest / group_d[index].clamp_min(1e-300), torch.ones_like(nearest)
    )
    adv = centred * torch.where(centred < 0, torch.ones_like(scale), scale)
    adv = torch.where(flat[index], torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(torch.float32)


diversity_advantages.needs_features = True  # type: ignore[attr-defined]  # `get_estimator`'s hook


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """1 for the highest value, N for the lowest; ties in order of appearance, float64 [N]."""
    order = torch.sort(values, descending=True, stable=True).indices
    ranks = torch.empty(len(values), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    return ranks


def uncertainty(main: torch.Tensor, auxiliary: Sequence[torch.Tensor]) -> torch.Tensor:
    """U = rank of the trained reward − mean rank under the auxiliary rewards, float64 [N] (rank 1 = best)."""
    if not auxiliary:
        raise UserInputError("the KL gate needs at least one auxiliary reward (--gate-reward NAME)")
    aux = torch.stack([_ranks(a.double()) for a in auxiliary]).mean(dim=0)
    return _ranks(main.double()) - aux


def uncertainty_gate(main: torch.Tensor, auxiliary: Sequence[torch.Tensor], fraction: float) -> torch.Tensor:
    """bool [N]: the samples whose `uncertainty` exceeds the (1 − fraction) quantile of the U's ≥ 0
    (linear interpolation, numpy's default percentile); none when no U is ≥ 0."""
    if not 0 <= fraction <= 1:
        raise UserInputError(f"--gate-fraction {fraction}: must lie in [0, 1] (GARDO starts at 0.1)")
    u = uncertainty(main, auxiliary)
    candidates = u[u >= 0]
    if len(candidates) == 0:
        return torch.zeros(len(u), dtype=torch.bool)
    return u > torch.quantile(candidates, 1.0 - fraction)
