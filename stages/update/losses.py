"""Policy-gradient losses over stored denoising steps, and the `--algo` registry that picks them.

flow_grpo convention (diffusion-rl.md §1.2): per trained step j,
    Â = clip(A, ±adv_clip),  r = exp(logp_θ − logp_old),
    L_pg = mean_b max(−Â·r, −Â·clip(r, 1−ε, 1+ε)),
    L = L_pg + β·KL,  KL = mean_b mean_dims (μ_θ − μ_ref)² / (2·d²)   (`kl_std` gives d per sampler).
Log-probs are per-dimension means, so ratios sit near 1 and ε is ~1e-4. Metrics (`ratio_metrics`) follow
verl-omni's names (ppo_kl = mean(−log r), Bessel ratio_std) plus flow_grpo's approx_kl = ½·mean((log r)²).

The family members differ in which stored steps they train and in the ratio they clip:
- `flow_grpo`: the first int(K·fraction) stored steps, in order (flow_grpo trains 9 of 10).
- `dance_grpo`: per sample, a random int((K−1)·fraction) of the first K−1 steps (the last is never
  trained): DanceGRPO's timestep subsampling (§2).
- `mix_grpo`: every stored step, i.e. the SDE window the rollout stored (MixGRPO, §3).
- `grpo_guard`: flow_grpo's steps with GRPO-Guard's normalised ratio and 1/|Δ| reweighting (§1.6);
  needs the rollout means `old_means` (`omnirl logprob --means` under the sampling weights).
- `flow_dppo`: flow_grpo's steps, the unclipped ratio objective with Flow-DPPO's trust region: a row is
  dropped only when the exact Gaussian KL of its step to the rollout's exceeds `--kl-mask-threshold` and
  its ratio moves further in its advantage's direction (`family_losses.flow_dppo_loss`); advantages are
  not clipped, as in verl-omni. The rollout means are `old_means` when given, else replayed under the
  weights the update starts from (verl-omni's old-policy pass).

`nft`, `awm` (forward process on the final latent), `dpo` (preference pairs) and `dgpo` (group
preference on the final latents of ODE rollouts) are registered here too; their objectives live in
forward_objectives.py and their loss math in family_losses.py.

Token-level algorithms for text/VLM rollouts (`family="token"`, math in token_losses.py) differ in
their defaults (vlm-grpo.md §2): `grpo` (verl: clip 0.2/0.2, dual-clip 3, token-mean), `dapo`
(clip-higher 0.2/0.28) and `gspo` (sequence ratio, clip 3e-4/4e-4, no dual-clip; its policy term is
always seq-mean-token-mean, KL and entropy follow `--loss-agg-mode` as in verl). Dr.GRPO is `grpo` with
`--loss-agg-mode seq-mean-token-sum-norm` and the `drgrpo` advantage. As in verl, token advantages are
not clipped (the diffusion family clips at ±5 as flow_grpo and verl-omni do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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
    extra: dict[str, float] = field(default_factory=dict)  # the loss's own metrics (`actor/...`)


def ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor) -> dict[str, float]:
    """Diagnostics of one trained step's ratios: ratio [B] (the ratio that is clipped) and the plain
    log π_θ − log π_old [B].

    verl-omni's names: ratio_mean; ratio_std, Bessel-corrected like torch's default (0 for one row);
    ppo_kl = mean(−log r), the k1 estimate of KL(old‖new). flow_grpo's approx_kl = ½·mean((log r)²).
    """
    r, lr = ratio.detach().double(), log_ratio.detach().double()
    return {
        "actor/ratio_mean": r.mean().item(),
        "actor/ratio_std": r.std().item() if r.numel() > 1 else 0.0,
        "actor/ppo_kl": (-lr).mean().item(),
        "actor/approx_kl": (0.5 * lr.square()).mean().item(),
    }


def kl_std(sampler: str, diffusion: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The d of the KL penalty mean_dims (μ_θ − μ_ref)²/(2d²) of a replayed step, [B].

    `sde`: the diffusion coefficient g (`StepOutput.diffusion`), flow_grpo's and verl-omni's choice,
    which is the exact Gaussian KL times |Δσ|. `dance` and `cps`: the step's noise std s
    (`StepOutput.std`; η·sqrt(|Δσ|) for dance), the exact KL between the two step Gaussians, as
    verl-omni's dance_sde and cps steps divide by their std_dev_t = s.
    """
    return diffusion if sampler == "sde" else std


def ppo_terms(
    adv: torch.Tensor, ratio: torch.Tensor, clip_range: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row max(−Â·r, −Â·clip(r, 1−ε, 1+ε_high)) and whether r left the band, both [B]."""
    per_row = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + high))
    return per_row, ((ratio < 1.0 - clip_range) | (ratio > 1.0 + high)).float()


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
    weights: torch.Tensor | None = None,
) -> StepLoss:
    """PPO-clipped objective on per-sample log-probs [B]; `clip_range_high` makes the band asymmetric;
    `weights` [B] multiply each row's policy term (rollout_correction.py)."""
    adv = advantages if adv_clip is None else advantages.clamp(-adv_clip, adv_clip)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    per_row, was_clipped = ppo_terms(
        adv, ratio, clip_range, clip_range if clip_range_high is None else clip_range_high
    )
    policy_loss = (per_row if weights is None else per_row * weights).mean()
    kl_term = kl.mean() if kl is not None else torch.zeros((), device=log_prob.device)
    loss = policy_loss + beta * kl_term
    return StepLoss(
        loss, policy_loss.detach(), kl_term.detach(), ratio.detach(), was_clipped, log_ratio.detach()
    )


PG_COLUMNS = ("latents", "sigmas", "log_probs", "old_log_probs", "ref_means", "old_means")
TOKEN_COLUMNS = (
    *("sample_id", "group_id", "images", "videos", "audios", "messages", "prompt_ids", "prompt_mask"),
    *("response_ids", "response_mask"),
    *("log_probs", "old_log_probs", "ref_log_probs"),
)
TOKEN_NEEDS = ("images", "prompt_ids", "prompt_mask", "response_ids", "response_mask")


@dataclass(frozen=True)
class Algorithm:
    """An `--algo` choice: its objective family (objectives.py), which stored steps a policy-gradient
    member trains, the input columns it reads and those it cannot do without, its default ratio clip,
    dual-clip and advantage clip (None: not clipped), and its default `--train-timesteps` (forward and
    group families). `guard` / `kl_mask`: GRPO-Guard's ratio / Flow-DPPO's KL trust region in place of
    the clipped ratio."""

    name: str
    family: str = "policy_gradient"
    steps: str = "prefix"
    guard: bool = False
    kl_mask: bool = False
    columns: tuple[str, ...] = PG_COLUMNS
    needs: tuple[str, ...] = ("latents", "sigmas")
    clip: tuple[float, float] = (1e-4, 1e-4)
    ratio: str = "token"
    dual_clip: float | None = None
    adv_clip: float | None = 5.0
    timesteps: int = 6


# What the token algorithms share: VLM columns and verl's unclipped advantages.
TOKEN: dict[str, Any] = {"family": "token", "columns": TOKEN_COLUMNS, "needs": TOKEN_NEEDS, "adv_clip": None}

# One per built-in name (`stages.update.config_rules.ALGORITHM_NAMES`, which --algo offers), in its order.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("flow_grpo"),
        Algorithm("dance_grpo", steps="random"),
        Algorithm("mix_grpo", steps="all"),
        Algorithm("grpo_guard", guard=True, needs=("latents", "sigmas", "old_means")),
        Algorithm("flow_dppo", kl_mask=True, adv_clip=None),
        Algorithm("nft", family="forward", columns=("final_latent",), needs=("final_latent",)),
        Algorithm("awm", family="forward", columns=("final_latent",), needs=("final_latent",)),
        # the reference's clip_range 5e-2 on its DSM ratio and num_train_timesteps 4 (DGPO config/dgpo.py);
        # group_id is every rollout's (online too), so only final_latent is a column it cannot do without
        Algorithm(
            "dgpo",
            family="group",
            columns=("final_latent", "group_id"),
            needs=("final_latent",),
            clip=(5e-2, 5e-2),
            timesteps=4,
        ),
        Algorithm(
            "dpo",
            family="preference",
            columns=("final_latent", "group_id"),
            needs=("final_latent", "group_id"),
        ),
        Algorithm("grpo", **TOKEN, clip=(0.2, 0.2), dual_clip=3.0),
        Algorithm("dapo", **TOKEN, clip=(0.2, 0.28), dual_clip=3.0),
        Algorithm("gspo", **TOKEN, clip=(3e-4, 4e-4), ratio="sequence"),
    )
}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered under `name` (an `--algo` value)."""
    if name not in ALGORITHMS:
        raise UserInputError(f"--algo {name}: unknown algorithm (available: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name]


def step_plan(
    algo: Algorithm, num_rows: int, num_steps: int, fraction: float, rng: random.Random
) -> torch.Tensor:
    """Stored-step indices to train per sample, [N, T] int64 (column t is the t-th trained step).

    prefix: the first int(K·fraction) steps (at least 1); all: every step; random: per sample a random
    permutation of the first K−1 steps, of which int((K−1)·fraction) are kept (at least 1).
    """
    if algo.steps == "prefix":
        steps = list(range(max(1, int(num_steps * fraction))))
        return torch.tensor(steps, dtype=torch.int64).expand(num_rows, -1)
    if algo.steps == "all":
        return torch.arange(num_steps).expand(num_rows, -1)
    pool = max(1, num_steps - 1)
    keep = max(1, int(pool * fraction))
    return torch.tensor([rng.sample(range(pool), keep) for _ in range(num_rows)], dtype=torch.int64)
