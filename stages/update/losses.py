"""Policy losses over stored denoising steps, looked up by `--algo` name.

flow_grpo convention (diffusion-rl.md §1.2): per trained step j,
    Â = clip(A, ±adv_clip),  r = exp(logp_θ − logp_old),
    L_pg = mean_b max(−Â·r, −Â·clip(r, 1−ε, 1+ε)),
    L = L_pg + β·KL,  KL = mean_b mean_dims (μ_θ − μ_ref)² / (2g²)   (g², not s², as the reference does).
Log-probs are per-dimension means, so ratios sit near 1 and ε is ~1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.errors import UserInputError


@dataclass
class StepLoss:
    """One trained step's loss (scalar tensor) and its per-sample diagnostics ([B] tensors)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    log_ratio: torch.Tensor


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip: float | None,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_range_high: float | None = None,
) -> StepLoss:
    """PPO-clipped objective on per-sample log-probs [B]; `clip_range_high` makes the band asymmetric."""
    adv = advantages if adv_clip is None else advantages.clamp(-adv_clip, adv_clip)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    high = clip_range if clip_range_high is None else clip_range_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + high)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_term = kl.mean() if kl is not None else torch.zeros((), device=log_prob.device)
    loss = policy_loss + beta * kl_term
    was_clipped = ((ratio < 1.0 - clip_range) | (ratio > 1.0 + high)).float()
    return StepLoss(loss, policy_loss.detach(), kl_term.detach(), ratio.detach(), was_clipped, log_ratio.detach())


LossFn = Callable[..., StepLoss]
LOSSES: dict[str, LossFn] = {"flow_grpo": clipped_policy_loss}


def get_loss(name: str) -> LossFn:
    """The loss registered under `name` (an `--algo` value)."""
    if name not in LOSSES:
        raise UserInputError(f"--algo {name}: unknown algorithm (available: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]
