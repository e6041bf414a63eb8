"""Diffusion-RL losses beyond flow_grpo's clipped ratio (reference/diffusion-rl.md §1.6, §4, §5, §7).

Pure functions of tensors the trainer has already computed (step means, velocities, per-sample errors); none
runs a model. Math is fp32 (inputs are upcast). Shapes: B = rows of a micro-batch (a row may be one
(sample, timestep) pair), `*` = latent dims, "mean over dims" averages every non-batch dim.

- `grpo_guard_loss`: PPO objective on GRPO-Guard's normalised ratio, per stored step; returns a `StepLoss`.
- `flow_dppo_loss`: Flow-DPPO's ratio objective with its exact-KL trust region, per stored step; a `StepLoss`.
- `nft_loss`, `nft_old_decay`, `nft_old_refresh`: DiffusionNFT's forward-process loss, old-policy schedule
  and refresh interval (its optimality weight and `adv_mode` are `stages.advantage.estimators.nft_optimality`).
- `awm_loss`, `awm_psi`: Advantage-Weighted Matching.
- `diffusion_dpo_loss`: Diffusion-DPO on per-sample denoising errors (`fm_error`).
- `dgpo_loss`, `dgpo_old_decay`: DGPO's group-preference loss and its old policy's schedule.

All but `grpo_guard_loss` and `flow_dppo_loss` return (loss scalar, metrics): `actor/...` floats named like the trainer's and
verl-omni's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from stages.errors import UserInputError
from stages.sample.samplers import guard_log_ratio, per_sample
from stages.update.config_rules import AWM_WEIGHTINGS, NFT_DECAY_SCHEDULES
from stages.update.losses import StepLoss, ppo_terms, ratio_metrics

_GHUBER_DELTA = 1e-10


def _column(rows: Tensor, like: Tensor) -> Tensor:
    """[B] → [B, 1, ..., 1], broadcastable against `like`."""
    return rows.view(-1, *([1] * (like.ndim - 1)))


def _mean_dims(x: Tensor) -> Tensor:
    return x.flatten(1).mean(dim=1)


def _velocity_gap(v: Tensor, other: Tensor | None) -> Tensor:
    """mean over batch and dims of (v − other)², other detached; 0 when `other` is None."""
    if other is None:
        return torch.zeros((), device=v.device)
    return ((v - other.detach().float()) ** 2).mean()


def fm_error(v: Tensor, eps: Tensor, x0: Tensor) -> Tensor:
    """Per-sample flow-matching error mean_dims (v − (ε − x0))², [B] fp32 (AWM's ℓ, Diffusion-DPO's L).

    v: predicted velocity [B, *]; eps: the noise ε used to build x_t [B, *]; x0: clean latent [B, *].
    """
    return _mean_dims((v.float() - (eps.float() - x0.float())) ** 2)


def grpo_guard_loss(
    mean: Tensor,
    old_mean: Tensor,
    prev_sample: Tensor,
    std: Tensor | float,
    dt: Tensor | float,
    advantages: Tensor,
    *,
    clip_range: float,
    adv_clip: float | None,
    kl: Tensor | None = None,
    beta: float = 0.0,
    clip_range_high: float | None = None,
    weights: Tensor | None = None,
    scale: Tensor | float | None = None,
) -> StepLoss:
    """GRPO-Guard (§1.6): PPO-clipped objective on the RatioNorm ratio r̃, reweighted by 1/|Δ| per row.

    mean: μ_θ [B, *] (`StepOutput.mean` of the replayed step, with grad); old_mean: the stored rollout μ_old
    [B, *]; prev_sample: the stored x' [B, *]; std: the step's noise std s (`StepOutput.std`, [B] or scalar);
    dt: Δ = σ' − σ < 0 ([B] or scalar); advantages: [B]; kl: optional [B] penalty (`kl_to_reference`);
    weights: optional [B] multipliers of each row's clipped term (rollout_correction.py).

    log r̃ = `guard_log_ratio` = s·(Δlogp + mean(δμ²)/(2s²)) = mean(ε ⊙ (μ_θ − μ_old)), r̃ = exp(log r̃),
    L = mean_b[max(−Â·r̃, −Â·clip(r̃, 1−ε, 1+ε_high)) / |Δ_b|] + β·mean_b KL.
    Each row's clipped term is divided by its own |Δ_b| before the batch mean. The reference divides the
    batch mean by (mean_b sqrt|Δ_b|)² and uses s = mean_b(sqrt|Δ|)·mean_b(g): identical whenever the rows
    share a timestep (flow_grpo's layout), and still a per-step normalisation when they do not. The KL term
    is not reweighted, as in the reference. `log_ratio` in the result is log r̃ (what the ratio and the
    clip fraction are computed from). Meant for `sde`/`dance` steps, where s = g·sqrt(−Δ) is the exact
    step std (g = η on dance steps), so log r̃ = mean(ε ⊙ δμ) on both. On dance steps verl-omni scales
    by mean(sqrt|Δ|)·η·sqrt|Δ| = η·|Δ| instead (its dance std_dev_t already holds sqrt|Δ|); omnirl keeps
    the exact std by default, GRPO-Guard's RatioNorm as flow_grpo defines it for its sde steps, and takes
    verl-omni's normaliser as `scale` ([B] or scalar, `guard_log_ratio`; `update --guard-dance-scale
    eta_dsigma`). The 1/|Δ_b| reweighting is the same either way.
    """
    batch = mean.shape[0]
    s = per_sample(std, batch, mean, "std")
    step = per_sample(dt, batch, mean, "dt")
    if bool((s <= 0).any()):
        raise UserInputError(
            "--algo grpo_guard: a trained step is deterministic (noise std 0); "
            "use --sampler sde or dance with --noise-level > 0"
        )
    if bool((step >= 0).any()):
        raise ValueError("dt = sigma_next - sigma must be negative for every row")
    adv = advantages.float()
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    log_ratio = guard_log_ratio(mean, old_mean, prev_sample, s, scale)
    ratio = torch.exp(log_ratio)
    high = clip_range if clip_range_high is None else clip_range_high
    per_row, was_clipped = ppo_terms(adv, ratio, clip_range, high)
    per_row = per_row / -step
    policy_loss = (per_row if weights is None else per_row * weights).mean()
    kl_term = kl.float().mean() if kl is not None else torch.zeros((), device=mean.device)
    loss = policy_loss + beta * kl_term
    return StepLoss(
        loss, policy_loss.detach(), kl_term.detach(), ratio.detach(), was_clipped, log_ratio.detach()
    )


def flow_dppo_loss(
    mean: Tensor,
    old_mean: Tensor,
    std: Tensor | float,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    kl_threshold: float,
    adv_clip: float | None = None,
    kl: Tensor | None = None,
    beta: float = 0.0,
    weights: Tensor | None = None,
) -> StepLoss:
    """Flow-DPPO (arXiv 2606.11025; verl-omni `flow_dppo`): the ratio objective with a trust region from the
    exact KL between the current and the rollout step Gaussians, in place of ratio clipping.

    mean: μ_θ [B, *] (`StepOutput.mean`, with grad); old_mean: the rollout's μ_old [B, *]; std: the step's
    noise std s, shared by both Gaussians ([B] or scalar, `StepOutput.std`); log_prob / old_log_prob: [B];
    advantages: [B]; kl: optional [B] penalty to the reference (`kl_to_reference`); weights: optional [B]
    multipliers of each row's policy term (verl-omni's rollout_is_weights; detached here).

        r = exp(logp_θ − logp_old),  D = mean_dims (μ_θ − μ_old)² / (2s²)  (= KL(N(μ_θ, s²) ‖ N(μ_old, s²))
        per dimension), masked_b = D_b ≥ δ ∧ ((Â_b > 0 ∧ r_b > 1) ∨ (Â_b < 0 ∧ r_b < 1)),
        L = mean_b w_b·[masked_b ? 0 : −Â_b·r_b] + β·mean_b KL   (w = 1 without `weights`).

    A row leaves the objective only when it is outside the trust region and still moving away from the
    rollout; corrective updates stay. Advantages are clipped only when `adv_clip` is given (verl-omni does
    not). s is the exact step std on every sampler; verl-omni's std_dev_t·sqrt(−Δ) equals it on sde steps.
    """
    batch = mean.shape[0]
    s = per_sample(std, batch, mean, "std")
    if bool((s <= 0).any()):
        raise UserInputError(
            "--algo flow_dppo: a trained step is deterministic (noise std 0); "
            "use --sampler sde, cps or dance with --noise-level > 0"
        )
    adv = advantages.float()
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        drift = _mean_dims((mean.detach().float() - old_mean.detach().float()) ** 2) / (2 * s**2)
        outside = drift >= kl_threshold
        pos = outside & (ratio > 1.0) & (adv > 0)
        neg = outside & (ratio < 1.0) & (adv < 0)
        masked = pos | neg
    per_row = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    if weights is not None:
        per_row = per_row * weights.detach().float()
    policy_loss = per_row.mean()
    kl_term = kl.float().mean() if kl is not None else torch.zeros((), device=mean.device)
    loss = policy_loss + beta * kl_term
    extra = {
        "actor/kl_new_old_mean": drift.mean().item(),
        "actor/kl_new_old_max": drift.max().item(),
        "actor/kl_mask_fraction": outside.float().mean().item(),
        "actor/pos_rm_fraction": pos.float().mean().item(),
        "actor/neg_rm_fraction": neg.float().mean().item(),
        "actor/masked_fraction": masked.float().mean().item(),
        "actor/unmasked_fraction": 1.0 - masked.float().mean().item(),
    }
    return StepLoss(
        loss,
        policy_loss.detach(),
        kl_term.detach(),
        ratio.detach(),
        masked.float(),
        log_ratio.detach(),
        extra,
    )


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    v_ref: Tensor | None,
    x0: Tensor,
    x_t: Tensor,
    t: Tensor | float,
    optimality: Tensor,
    *,
    beta: float,
    kl_beta: float = 0.0,
    adv_clip: float = 5.0,
    weight_floor: float = 1e-5,
    kl_rows: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DiffusionNFT forward-process loss (§4), on x_t = (1−t)·x0 + t·ε.

    v_theta: trainable velocity [B, *]; v_old: the old adapter's velocity [B, *] (detached here); v_ref:
    reference velocity [B, *] or None (no KL term); x0, x_t: [B, *]; t: σ per row ([B] or scalar);
    optimality: r [B] in [0, 1] (`stages.advantage.estimators.nft_optimality`); kl_rows: bool [B], the
    rows the KL term averages over (GARDO's gate; None: all).

        v⁺ = β·v_θ + (1−β)·v_old,  v⁻ = (1+β)·v_old − β·v_θ,  x̂0^± = x_t − t·v^±,
        w^± = max(mean_dims|x̂0^± − x0|, floor) (detached),  ℓ^± = mean_dims (x̂0^± − x0)² / w^±,
        L = c·mean_b[(r·ℓ⁺ + (1−r)·ℓ⁻)/β] + β_KL·mean(v_θ − v_ref)²,

    with c = `adv_clip` (5): the reference multiplies by its advantage clip. At v_θ = v_old and r = ½ the
    policy term has zero gradient. Metrics: pg_loss = policy_loss (the policy term), kl_loss = ref_kl_loss
    (mean (v_θ − v_ref)², unweighted), total_loss = L, positive_loss / negative_loss (mean ℓ^±),
    old_deviate (mean (v_θ − v_old)²), reward_prob_mean (mean r).
    """
    if beta <= 0:
        raise UserInputError(
            f"DiffusionNFT beta={beta}: must be positive (the loss divides by it; default 1.0)"
        )
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref, the reference velocity")
    v = v_theta.float()
    v_o = v_old.detach().float()
    x0f = x0.float()
    xt = x_t.float()
    batch = v.shape[0]
    tt = _column(per_sample(t, batch, v, "t"), v)
    r = per_sample(optimality, batch, v, "optimality")
    err_pos = xt - tt * (beta * v + (1.0 - beta) * v_o) - x0f
    err_neg = xt - tt * ((1.0 + beta) * v_o - beta * v) - x0f
    w_pos = _mean_dims(err_pos.detach().abs()).clamp_min(weight_floor)
    w_neg = _mean_dims(err_neg.detach().abs()).clamp_min(weight_floor)
    loss_pos = _mean_dims(err_pos**2) / w_pos
    loss_neg = _mean_dims(err_neg**2) / w_neg
    policy_loss = (adv_clip * (r * loss_pos + (1.0 - r) * loss_neg) / beta).mean()
    if kl_rows is not None and v_ref is not None:
        kl = _velocity_gap(v[kl_rows], v_ref[kl_rows])
    else:
        kl = _velocity_gap(v, v_ref)
    loss = policy_loss + kl_beta * kl
    metrics = {
        "actor/pg_loss": policy_loss.item(),
        "actor/kl_loss": kl.item(),
        "actor/positive_loss": loss_pos.mean().item(),
        "actor/negative_loss": loss_neg.mean().item(),
        "actor/old_deviate": ((v.detach() - v_o) ** 2).mean().item(),
        "actor/reward_prob_mean": r.mean().item(),
        # verl-omni's DiffusionNFT names; pg_loss and kl_loss stay, as every algorithm logs them
        "actor/policy_loss": policy_loss.item(),
        "actor/ref_kl_loss": kl.item(),
        "actor/total_loss": loss.item(),
    }
    return loss, metrics


def nft_old_decay(step: int, schedule: str) -> float:
    """λ of the old-policy update θ_old ← λ·θ_old + (1−λ)·θ after `step` optimizer steps (§4).

    copy: 0; linear_to_0_5: min(0.001·step, 0.5); delayed_linear_to_0_999: 0 for the first 75 steps, then
    min(0.0075·(step − 75), 0.999).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if schedule == "copy":
        return 0.0
    if schedule == "linear_to_0_5":
        return min(0.001 * step, 0.5)
    if schedule == "delayed_linear_to_0_999":
        return min(max(0.0, 0.0075 * (step - 75)), 0.999)
    raise UserInputError(
        f"old-policy decay schedule {schedule!r} is unknown: choose one of {', '.join(NFT_DECAY_SCHEDULES)}"
    )


def nft_old_refresh(
    before: int, after: int, schedule: str, *, fixed: float | None = None, interval: int = 1
) -> float | None:
    """λ of the old-policy refresh that ends an update taking the optimizer from step `before` to `after`,
    or None when the old policy stays as it is.

    The old policy is refreshed when the update crosses a multiple of `interval` optimizer steps
    (verl-omni old_policy_update_interval: with one optimizer step per update, every `interval`-th update),
    with λ = `fixed` when given (verl-omni old_policy_decay), else `nft_old_decay(after, schedule)`.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    if after // interval == before // interval:
        return None
    return fixed if fixed is not None else nft_old_decay(after, schedule)


def old_policy_metrics(decay: float | None) -> dict[str, float]:
    """verl-omni's `old_policy/*` record of one refresh decision (`nft_old_refresh`'s λ, None: skipped)."""
    applied = decay is not None
    return {
        "old_policy/update_applied": float(applied),
        "old_policy/copy_update": float(applied and decay == 0),
        "old_policy/ema_update": float(applied and decay != 0),
        "old_policy/decay": float(decay or 0.0),
    }


def awm_psi(
    v: Tensor, eps: Tensor, x0: Tensor, t: Tensor | float, *, weighting: str = "uniform", p: float = 0.25
) -> Tensor:
    """AWM's pseudo log-prob ψ per row, [B] fp32 (§5), with ℓ = `fm_error(v, eps, x0)`.

    uniform: ψ = −ℓ;  ghuber: ψ = −[(ℓ + 1e-10)^p − (1e-10)^p]·t/p (generalised Huber, t = σ of the row).
    """
    if weighting not in AWM_WEIGHTINGS:
        raise UserInputError(
            f"AWM weighting {weighting!r} is unknown: choose one of {', '.join(AWM_WEIGHTINGS)}"
        )
    err = fm_error(v, eps, x0)
    if weighting == "uniform":
        return -err
    if p <= 0:
        raise UserInputError(f"AWM ghuber power p={p}: must be positive (default 0.25)")
    tt = per_sample(t, err.shape[0], err, "t")
    return -((err + _GHUBER_DELTA) ** p - _GHUBER_DELTA**p) * tt / p


def awm_loss(
    v_theta: Tensor,
    v_old: Tensor,
    eps: Tensor,
    x0: Tensor,
    t: Tensor | float,
    advantages: Tensor,
    *,
    weighting: str = "uniform",
    p: float = 0.25,
    clip_range: float = 1.0,
    adv_clip: float = 5.0,
    ref_v: Tensor | None = None,
    beta: float = 0.0,
    ema_v: Tensor | None = None,
    ema_beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Advantage-Weighted Matching (§5): PPO on exp(ψ_θ − ψ_old), with ψ from `awm_psi`.

    v_theta: trainable velocity at x_t = (1−t)·x0 + t·ε [B, *]; v_old: the velocity of the weights that
    produced the rollout, on the same (t, ε) ([B, *], detached here; pass v_theta.detach() on-policy);
    eps, x0: [B, *]; t: [B] or scalar; advantages: [B]; ref_v / ema_v: reference / EMA-adapter velocities.

        Â = clip(A, ±c)/c ∈ [−1, 1],  ratio = exp(ψ_θ − ψ_old),
        L = mean_b max(−Â·ratio, −Â·clip(ratio, 1−ε, 1+ε)) + β·mean(v_θ − v_ref)² + β_ema·mean(v_θ − v_ema)².

    On-policy the ratio is 1 and ∇L = ∇ mean_b(−Â·ψ_θ): for uniform weighting the advantage-weighted
    flow-matching gradient ∇ mean_b(Â·ℓ_b).
    """
    if beta > 0 and ref_v is None:
        raise ValueError("beta > 0 needs ref_v, the reference velocity")
    if ema_beta > 0 and ema_v is None:
        raise ValueError("ema_beta > 0 needs ema_v, the EMA adapter's velocity")
    psi = awm_psi(v_theta, eps, x0, t, weighting=weighting, p=p)
    with torch.no_grad():
        psi_old = awm_psi(v_old.detach(), eps, x0, t, weighting=weighting, p=p)
    log_ratio = psi - psi_old
    ratio = torch.exp(log_ratio)
    adv = advantages.float().clamp(-adv_clip, adv_clip) / adv_clip
    per_row, was_clipped = ppo_terms(adv, ratio, clip_range, clip_range)
    policy_loss = per_row.mean()
    v = v_theta.float()
    kl = _velocity_gap(v, ref_v)
    ema_kl = _velocity_gap(v, ema_v)
    loss = policy_loss + beta * kl + ema_beta * ema_kl
    metrics = {
        "actor/pg_loss": policy_loss.item(),
        "actor/kl_loss": kl.item(),
        "actor/ema_kl_loss": ema_kl.item(),
        "actor/fm_loss": fm_error(v.detach(), eps, x0).mean().item(),
        "actor/pg_clipfrac": was_clipped.mean().item(),
        **ratio_metrics(ratio, log_ratio),
    }
    return loss, metrics


def diffusion_dpo_loss(
    err_w: Tensor, err_l: Tensor, ref_err_w: Tensor, ref_err_l: Tensor, *, beta: float
) -> tuple[Tensor, dict[str, float]]:
    """Diffusion-DPO (§7) over P preference pairs; every argument is a per-sample error [P] (`fm_error`).

    err_w / err_l: the policy's error on the preferred / rejected sample; ref_err_*: the frozen reference's
    (detached here), each pair sharing one t and one ε. With implicit rewards
    ρ_w = −½β·(L_w − L_w^ref), ρ_l = −½β·(L_l − L_l^ref) and z = ρ_w − ρ_l:
    L = mean −log σ(z) (ln 2 when policy = reference). Metrics: rewards/chosen = mean ρ_w,
    rewards/rejected = mean ρ_l, rewards/margins = mean z, implicit_acc = fraction of pairs with z > 0.
    """
    if beta <= 0:
        raise UserInputError(f"Diffusion-DPO beta={beta}: must be positive (reference 5000, verl-omni 2000)")
    shapes = {tuple(x.shape) for x in (err_w, err_l, ref_err_w, ref_err_l)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"DPO errors must be four [P] tensors of one shape, got {sorted(shapes)}")
    chosen = -0.5 * beta * (err_w.float() - ref_err_w.detach().float())
    rejected = -0.5 * beta * (err_l.float() - ref_err_l.detach().float())
    z = chosen - rejected
    loss = -F.logsigmoid(z).mean()
    metrics = {
        "actor/dpo_loss": loss.item(),
        "actor/implicit_acc": (z > 0).float().mean().item(),
        "actor/rewards/chosen": chosen.detach().mean().item(),
        "actor/rewards/rejected": rejected.detach().mean().item(),
        "actor/rewards/margins": z.detach().mean().item(),
    }
    return loss, metrics


def dgpo_old_decay(step: int) -> float:
    """λ of DGPO's old policy θ_old ← λ·θ_old + (1−λ)·θ after the optimizer step that follows `step`
    earlier ones: min(0.3, 0.001·step) (the reference's EMA "ref" that its DSM clip compares against)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(0.3, 0.001 * step)


def dgpo_loss(
    v_theta: Tensor,
    v_ref: Tensor,
    v_old: Tensor | None,
    eps: Tensor,
    x0: Tensor,
    advantages: Tensor,
    groups: Tensor,
    *,
    beta: float,
    clip_range: float,
    adv_clip: float | None = 5.0,
    kl_beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DGPO (arXiv 2510.08425): group-level DPO on the final latents of ODE rollouts, as the reference's
    gradient-equivalent loss.

    v_theta: trainable velocity at x_t = (1−t)·x0 + t·ε [B, *]; v_ref: the frozen reference's [B, *]
    (detached here; also the KL's reference); v_old: the old policy's, for the DSM clip ([B, *] or None:
    no clip); eps, x0: [B, *], one ε per group; advantages: [B]; groups: [B] ints, equal within a group,
    every member of a group present (G_g = its rows here).

        ℓ = `fm_error`(v_θ),  δ = sg(ℓ − ℓ_ref),  Â = clip(A, ±c),
        w_g = σ(β/G_g · Σ_{i∈g} Â_i·δ_i)  (detached),
        ρ = exp(ℓ_old − ℓ), clipped_i = Â_i > 0 ? ρ_i > 1 + ε : ρ_i < 1 − ε,  ℓ̃ = clipped ? sg(ℓ) : ℓ,
        L = mean_b w_g(b)·Â_b·ℓ̃_b + β_KL·mean (v_θ − v_ref)².

    ∇L is, per group, ∇ of −log σ(R(G⁺) − R(G⁻)) with the implicit reward R = −β·(ℓ − ℓ_ref) summed over
    the group's rows weighted by their advantages (the positive and negative sets), up to the constant
    β/G_g: the weight σ(·) is the sigmoid of the group's current preference margin.
    """
    if beta <= 0:
        raise UserInputError(f"DGPO beta={beta}: must be positive (reference 100)")
    err = fm_error(v_theta, eps, x0)
    with torch.no_grad():
        ref_err = fm_error(v_ref.detach(), eps, x0)
    adv = advantages.float()
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    clipped = torch.zeros_like(adv, dtype=torch.bool)
    if v_old is not None:
        with torch.no_grad():
            ratio = torch.exp(fm_error(v_old.detach(), eps, x0) - err.detach())
            clipped = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    trained = torch.where(clipped, err.detach(), err)
    _, member, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
    with torch.no_grad():
        terms = adv * beta * (err.detach() - ref_err) / sizes[member].float()
        margins = torch.zeros(len(sizes), device=adv.device).index_add_(0, member, terms)
        weight = torch.sigmoid(margins)[member]
    policy_loss = (weight * adv * trained).mean()
    kl = _velocity_gap(v_theta.float(), v_ref)
    loss = policy_loss + kl_beta * kl
    metrics = {
        "actor/pg_loss": policy_loss.item(),
        "actor/kl_loss": kl.item(),
        "actor/fm_loss": err.detach().mean().item(),
        "actor/pg_clipfrac": clipped.float().mean().item(),
        "actor/group_weight_mean": weight.mean().item(),
    }
    return loss, metrics
