"""Rollout correction: importance weights and rejection masks for rollouts whose log-probs were computed
by another engine than the trainer's (vLLM-Omni, a remote server, another precision or kernel).

verl's decoupled mode (docs/algo/rollout_corr.md there; verl-omni docs/algo/rollout_correction.md):
three policies, the rollout engine's π_rollout (`log_probs`, written by `omnirl sample`), the trainer's
recomputation π_old of the same rows (`old_log_probs`, `omnirl logprob`) and the trained π_θ. The PPO
ratio is π_θ/π_old as always; each element's policy-gradient term is further multiplied by a weight of
the rollout gap

    δ = log π_old − log π_rollout,  ρ = exp(clamp(δ, ±20))                       (`level` token)
    δ_seq = Σ_t δ_t over the row's valid elements, ρ = exp(clamp(δ_seq, ±20))     (`level` sequence)

- `is`: w = min(ρ, is_threshold), a truncated importance weight (TIS);
- `rs`: w = 1 if rs_lower ≤ ρ ≤ rs_upper else 0 (rejection), upper = --rollout-rs-threshold (default
  --rollout-is-threshold), lower = --rollout-rs-threshold-lower (default 1/upper);
- `is_rs`: their product.

An element is a stored denoising step for diffusion ([N, K]) and a response token for VLMs ([N, T],
padding weighs 0); `sequence` gives every element of a row the row's weight. As in verl-omni's diffusion
losses, a rejected element keeps its place in the loss's mean (weight 0, not removed from the count),
and the KL and entropy terms are not weighted. The weights are detached constants of the rollout.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from stages.errors import UserInputError

LOG_RATIO_BOUND = 20.0  # verl's safety bound on a log-ratio before exp (e^±20)
WEIGHTS = "rollout_correction_weights"  # the data column the objectives read (verl `rollout_is_weights`)
# `omnirl logprob` suggests --rollout-correction above this mean |Δlogp| between the rollout and the replay:
# two orders of magnitude above the bf16 noise of matched engines (~1e-5, verl-omni's measurement).
SUGGEST_ABOVE = 1e-3


class Settings(Protocol):
    """The --rollout-correction options (fields of `UpdateConfig`; verl's `rollout_is`, `rollout_rs` and
    their thresholds)."""

    rollout_correction: str
    rollout_correction_level: str
    rollout_is_threshold: float
    rollout_rs_threshold: float | None
    rollout_rs_threshold_lower: float | None

    def rs_bounds(self) -> tuple[float, float]: ...


def rollout_ratio(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """ρ = π_old/π_rollout per element [N, T] (fp32; padding 1): per element at `token` level, the
    product over the row's valid elements at `sequence` level, each log bounded to ±20 first."""
    valid = mask.bool()
    delta = torch.where(valid, old_log_probs.float() - rollout_log_probs.float(), torch.zeros(()))
    if level == "sequence":
        delta = delta.sum(dim=1, keepdim=True).expand_as(delta)
    return torch.exp(delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: Settings,
    rows: list[int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-element multipliers of the policy-gradient term, [N, T] fp32 (0 at padding), and their metrics.

    old_log_probs, rollout_log_probs, mask: [N, T] (mask 1 at valid elements; all ones for diffusion
    steps). Metrics, over the valid elements of `rows` (default all), one value per row at `sequence`
    level, under verl's names: `rollout_corr/rollout_is_mean`, `_max`, `_min` (truncated weights) and
    `rollout_corr/rollout_is_truncated_fraction` (ρ > threshold) for is; `rollout_corr/rollout_rs_masked_fraction`
    (elements rejected) and `rollout_corr/rollout_rs_seq_masked_fraction` (rows with any rejection) for rs;
    `rollout_corr/logprob_abs_diff_mean`, `_max` (|δ| per element) always.
    """
    valid = mask.bool()
    rho = rollout_ratio(old_log_probs, rollout_log_probs, valid, cfg.rollout_correction_level)
    weights = valid.float()
    selected = torch.arange(rho.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.int64)
    seen = valid[selected]
    if cfg.rollout_correction_level == "sequence":  # one value per row: its first valid element's (all equal)
        seen = seen & (seen.cumsum(dim=1) == 1)
    stat = rho[selected][seen].double()
    gap = (old_log_probs.float() - rollout_log_probs.float())[selected][valid[selected]].abs().double()
    metrics: dict[str, float] = {
        "rollout_corr/logprob_abs_diff_mean": float(gap.mean()) if gap.numel() else 0.0,
        "rollout_corr/logprob_abs_diff_max": float(gap.max()) if gap.numel() else 0.0,
    }
    if cfg.rollout_correction in ("is", "is_rs"):
        truncated = rho.clamp(max=cfg.rollout_is_threshold)
        weights = weights * truncated
        w = stat.clamp(max=cfg.rollout_is_threshold)
        metrics.update(
            {
                "rollout_corr/rollout_is_mean": float(w.mean()) if w.numel() else 1.0,
                "rollout_corr/rollout_is_max": float(w.max()) if w.numel() else 1.0,
                "rollout_corr/rollout_is_min": float(w.min()) if w.numel() else 1.0,
                "rollout_corr/rollout_is_truncated_fraction": float(
                    (stat > cfg.rollout_is_threshold).double().mean()
                )
                if stat.numel()
                else 0.0,
            }
        )
    if cfg.rollout_correction in ("rs", "is_rs"):
        lower, upper = cfg.rs_bounds()
        keep = (rho >= lower) & (rho <= upper)
        weights = weights * keep.float()
        rejected = (~keep[selected]) & valid[selected]
        elements = valid[selected].sum()
        metrics.update(
            {
                "rollout_corr/rollout_rs_masked_fraction": float(rejected.sum() / elements.clamp(min=1)),
                "rollout_corr/rollout_rs_seq_masked_fraction": float(rejected.any(dim=1).double().mean())
                if len(selected)
                else 0.0,
            }
        )
    return weights, metrics


def suggestion(abs_delta_mean: float | None) -> str | None:
    """The one line `omnirl logprob` prints when its replay's mean |Δlogp| exceeds `SUGGEST_ABOVE`."""
    if abs_delta_mean is None or not abs_delta_mean > SUGGEST_ABOVE:
        return None
    return (
        f"rollout-vs-replay mean |Δlogp| {abs_delta_mean:.3g} > {SUGGEST_ABOVE:g}: the rollout engine's "
        "log-probs differ from the trainer's; consider `omnirl update --rollout-correction is` with these "
        "old_log_probs (docs/algorithms.md, Rollout correction)"
    )


def attach(
    data: dict[str, Any], cfg: Settings, rows: list[int], *, tokens: bool
) -> tuple[dict[str, Any], dict[str, float]]:
    """`data` with the `WEIGHTS` column of `correction_weights` added, and its metrics over `rows`;
    `data` itself and no metrics when --rollout-correction is off.

    The rollout's log-probs are `log_probs` (`omnirl sample`), the trainer's `old_log_probs` (`omnirl
    logprob`), [N, K] steps or, with `tokens`, [N, T] response tokens masked by `response_mask`.
    """
    if cfg.rollout_correction == "off":
        return data, {}
    missing = [c for c in ("log_probs", "old_log_probs") if c not in data]
    if missing:
        raise UserInputError(
            f"--rollout-correction {cfg.rollout_correction} compares the rollout's log_probs (omnirl sample) "
            f"with old_log_probs (omnirl logprob); '{missing[0]}' is not in --in: pass both shard sets"
        )
    rollout, old = data["log_probs"], data["old_log_probs"]
    if tokens:
        mask = data["response_mask"]
        rollout, old = rollout[:, : mask.shape[1]], old[:, : mask.shape[1]]
    else:
        mask = torch.ones(rollout.shape, dtype=torch.bool)
    if rollout.shape != old.shape or rollout.shape != mask.shape:
        raise UserInputError(
            f"--rollout-correction: log_probs {tuple(rollout.shape)} and old_log_probs {tuple(old.shape)} "
            "differ in shape; recompute old_log_probs with omnirl logprob on these samples"
        )
    weights, metrics = correction_weights(old, rollout, mask, cfg, rows)
    return {**data, WEIGHTS: weights}, metrics
