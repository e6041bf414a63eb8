"""One step of a flow-matching sampler, with the log-density of the step: the single source of sampler math.

`sample` (rollout), `logprob` (replay) and `update` (training) all call `step`, so that on-policy the
recomputed log-prob equals the rollout log-prob bit for bit.

Conventions (see reference/diffusion-rl.md §0-§3):

- σ ∈ [0, 1] is the noise level, σ = 1 pure noise, σ = 0 data: x_σ = (1−σ)·x0 + σ·ε, and the model predicts
  the velocity v ≈ ε − x0. A step goes from σ to σ' < σ, Δ = σ' − σ < 0. x̂0 = x − σv, x̂1 = x + (1−σ)v.
- Samplers: `ode` (Euler), `sde` (Flow-GRPO), `cps` (coefficients-preserving), `dance` (DanceGRPO).
- A step's log-prob is a Gaussian log-density **averaged** (not summed) over all non-batch dims, so it is
  O(1) whatever the latent size; `cps` drops every constant and uses −mean((x'−μ)²) as flow_grpo does.
- All math runs in fp32 (inputs are upcast). `prev_sample` is returned in the dtype of `sample`, and the
  log-prob is evaluated at exactly that returned tensor; storing it in that dtype and replaying the step
  with the same velocity therefore reproduces the log-prob bit for bit, even for bf16/fp16 latents.
- σ values are cast to fp32 before use: pass them from the fp32 schedule table (`stages.models.schedules.flow_match_sigmas`).
- noise_level 0 makes `sde`, `cps` and `dance` exactly Euler; the log-prob of a deterministic step is
  undefined and is returned as zeros (as are std and diffusion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.errors import UserInputError
from stages.sample.config import SAMPLERS

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class StepOutput:
    """Result of one sampler step (B = batch size).

    prev_sample: x' [B, *latent] in the dtype of the input `sample` (the given tensor itself on replay).
    log_prob: [B] fp32; Gaussian log-density of x' averaged over non-batch dims (cps: −mean((x'−μ)²);
        zeros for a deterministic step).
    mean: μ [B, *latent] fp32, the step's mean (keeps the autograd graph of `velocity`).
    std: [B] fp32, the noise std s actually used: g·sqrt(−Δ) for sde, η·sqrt(−Δ) for dance, σ'·sin(aπ/2)
        for cps, 0 for a deterministic step.
    diffusion: [B] fp32, what the reference step returns as `std_dev_t`: g for sde, η for dance, s for
        cps, 0 for a deterministic step. The KL penalty divides by g on sde steps and by s otherwise
        (`stages.update.losses.kl_std`).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    diffusion: Tensor


def per_sample(value: float | Tensor, batch: int, like: Tensor, name: str) -> Tensor:
    """`value` (scalar or [B]) as an fp32 [B] tensor on the device of `like`."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"{name} must be a scalar or have one value per sample ({batch}), got {t.numel()}")
    return t


def _column(value: float | Tensor, batch: int, like: Tensor, name: str) -> Tensor:
    """`value` (scalar or [B]) as an fp32 tensor of shape [B, 1, ..., 1] broadcastable against `like`."""
    return per_sample(value, batch, like, name).view(batch, *([1] * (like.ndim - 1)))


def _gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, std²) averaged over non-batch dims: [B]. `std` is [B, 1, ...]."""
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    return lp.flatten(1).mean(dim=1)


def _drift_mean(x: Tensor, v: Tensor, sigma: Tensor, dt: Tensor, g: Tensor) -> Tensor:
    """Mean of the reverse SDE step with diffusion g: x + Δ·[v + g²/(2σ)·(x + (1−σ)v)], in flow_grpo's form."""
    return x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt


def step(
    sampler: str,
    velocity: Tensor,
    sample: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    sigma_max_safe: float | Tensor | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """One step x (at σ) → x' (at σ') of `sampler`, with the log-density of x' under the step.

    velocity, sample: [B, *latent] (any float dtype; math in fp32). sigma, sigma_next: scalars or [B].
    noise_level: a (sde, cps) or η (dance); 0 gives Euler. sigma_max_safe: for `sde`, the value used in
    place of σ inside sqrt(σ/(1−σ)) where σ == 1 (flow_grpo uses the second schedule entry σ_1); required
    when some σ == 1. noise: the standard normal ε [B, *latent] to use; otherwise drawn from `generator`.
    prev_sample: replay mode; x' is taken from the stored rollout instead of drawn, and the log-prob is
    evaluated at it.
    """
    if sampler not in SAMPLERS:
        raise UserInputError(f"unknown sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
    if noise_level < 0:
        raise UserInputError(f"noise_level={noise_level} is negative: the sampler noise level must be >= 0")
    if noise is not None and prev_sample is not None:
        raise ValueError("pass either noise (rollout) or prev_sample (replay), not both")
    x = sample.float()
    v = velocity.float()
    batch = x.shape[0]
    sig = _column(sigma, batch, x, "sigma")
    sig_next = _column(sigma_next, batch, x, "sigma_next")
    dt = sig_next - sig

    if sampler == "ode" or noise_level == 0:
        mean = x + dt * v
        out = mean.to(sample.dtype) if prev_sample is None else prev_sample
        zeros = [torch.zeros(batch, dtype=torch.float32, device=x.device) for _ in range(3)]
        return StepOutput(prev_sample=out, log_prob=zeros[0], mean=mean, std=zeros[1], diffusion=zeros[2])

    if bool((dt >= 0).any()):
        raise ValueError("a stochastic step needs sigma_next < sigma for every sample")

    if sampler == "cps":
        std = sig_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sig * v
        x1_hat = x + (1 - sig) * v
        mean = (1 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - std**2) * x1_hat
        g = std
    else:
        if sampler == "sde":
            if sigma_max_safe is not None:
                sig_den = torch.where(sig == 1, _column(sigma_max_safe, batch, x, "sigma_max_safe"), sig)
            elif bool((sig >= 1).any()):
                raise ValueError("sde step at sigma == 1 needs sigma_max_safe (the schedule's sigmas[1])")
            else:
                sig_den = sig
            g = noise_level * torch.sqrt(sig / (1 - sig_den))
        else:
            g = torch.full_like(sig, noise_level)
        mean = _drift_mean(x, v, sig, dt, g)
        std = g * torch.sqrt(-dt)

    if prev_sample is None:
        if noise is None:
            draw_device = generator.device if generator is not None else x.device
            eps = torch.randn(x.shape, generator=generator, device=draw_device, dtype=torch.float32)
            eps = eps.to(x.device)
        else:
            if noise.shape != x.shape:
                raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(x.shape)}")
            eps = noise.float()
        out = (mean.detach() + std * eps).to(sample.dtype)
    else:
        out = prev_sample
    target = out.detach().float()

    if sampler == "cps":
        log_prob = -((target - mean) ** 2).flatten(1).mean(dim=1)
    else:
        log_prob = _gaussian_log_prob(target, mean, std)
    return StepOutput(
        prev_sample=out, log_prob=log_prob, mean=mean, std=std.reshape(batch), diffusion=g.reshape(batch)
    )


def kl_to_reference(mean: Tensor, ref_mean: Tensor, diffusion: Tensor | float) -> Tensor:
    """The KL penalty per sample, [B]: mean over dims of (μ − μ_ref)² / (2d²).

    d (scalar or [B]) is chosen by `stages.update.losses.kl_std`: on sde steps flow_grpo's g
    (`StepOutput.diffusion`, the exact Gaussian KL times |Δ|), otherwise the step std s (the exact KL).
    Undefined (inf) for deterministic steps (d = 0).
    """
    batch = mean.shape[0]
    sq = ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(dim=1)
    g = _column(diffusion, batch, sq, "diffusion")
    return sq / (2 * g**2)


def guard_log_ratio(
    mean: Tensor,
    old_mean: Tensor,
    prev_sample: Tensor,
    std: Tensor | float,
    scale: Tensor | float | None = None,
) -> Tensor:
    """GRPO-Guard's normalised log-ratio (RatioNorm), [B]: c·(Δlogp + mean((μ_θ − μ_old)²)/(2c²)), c = s.

    mean: μ_θ [B, *latent] under the current weights; old_mean: the stored rollout μ_old; prev_sample: the
    stored x'; std: the step's noise std s (`StepOutput.std`, scalar or [B]). Δlogp is the difference of
    the two Gaussian log-densities of x' (std s), averaged over dims. Since x' = μ_old + s·ε this equals
    mean(ε ⊙ (μ_θ − μ_old)): the −‖δμ‖²/(2s²) bias and the 1/s scale of the plain log-ratio are removed.
    The reference code uses the batch mean of s, which is the same value when all rows share a timestep.
    `scale` (scalar or [B]) replaces c = s by another normaliser: verl-omni's c = s·sqrt|Δσ| on dance
    steps (`grpo_guard_loss`), where the bias no longer cancels exactly.
    """
    batch = mean.shape[0]
    mu = mean.float()
    mu_old = old_mean.float()
    x = prev_sample.detach().float()
    s = _column(std, batch, mu, "std")
    delta_logp = _gaussian_log_prob(x, mu, s) - _gaussian_log_prob(x, mu_old, s)
    c = s.reshape(batch) if scale is None else per_sample(scale, batch, mu, "scale")
    bias = ((mu - mu_old) ** 2).flatten(1).mean(dim=1) / (2 * c**2)
    return c * (delta_logp + bias)
