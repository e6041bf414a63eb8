"""Outcome-reward advantages for text/VLM GRPO: dropping constant-reward groups from the token loss.

The math is `stages.advantage.estimators.group_advantages`; the upstream presets (`grpo_verl`,
`grpo_trl`, `grpo_batch_std`, vlm-grpo.md §2) are registered in `estimators.ESTIMATORS`.

Differences from verl's `compute_grpo_outcome_advantage` that remain: a singleton group gets
A = 0 here (verl: A = r, as if mean 0 and std 1), and a batch of singletons is normalised as one
group (verl: A = r). With groups of ≥ 2 samples the values agree (A = (r − mean)/(std + ε), Bessel std).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from stages.advantage.estimators import zero_std_mask


def drop_constant_groups(
    mask: torch.Tensor, rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Remove the responses of groups whose rewards are all equal from the token loss.

    `mask` [B, T] -> (mask with those rows zeroed, same dtype; kept rows bool [B]). Such groups
    have A = 0, so they add no policy gradient, but left in the batch they would still dilute the
    token-mean denominator and feed the KL/entropy terms. This is DAPO's dynamic-sampling filter
    (verl `filter_groups`, EasyR1 `online_filtering`) applied at loss time; refilling the batch
    with new groups is the sampler's job. Singleton groups count as constant (A = 0 here; verl's
    filter keeps them, since its singletons get A = r).
    """
    kept = ~zero_std_mask(rewards, group_ids).to(mask.device)
    if mask.ndim != 2 or mask.shape[0] != len(kept):
        raise ValueError(f"mask must be [B, T] with B = {len(kept)} rewards, got {tuple(mask.shape)}")
    return torch.where(kept.unsqueeze(-1), mask, torch.zeros_like(mask)), kept
