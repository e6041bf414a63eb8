"""Token-level policy-gradient math for VLM/LLM GRPO (verl conventions, vlm-grpo.md §2).

Shapes: B responses × T response tokens. `mask` [B, T] (bool or 0/1) marks the valid response
tokens; every function ignores the other positions, even when they hold NaN or inf (padding
log-probs often do). Inputs in bf16/fp16 are promoted to float32 before any arithmetic.

- `aggregate`: verl's four `loss_agg_mode`s, used for the policy, KL and entropy terms (GSPO's policy
  term is always seq-mean-token-mean, as verl's gspo loss ignores `loss_agg_mode`).
- `kl_penalty`: per-token KL estimators against a reference policy.
- `policy_loss`: the clipped surrogate with DAPO clip-higher, dual-clip and GSPO sequence ratios.
- `grpo_loss`: policy loss + kl_coef·KL − entropy_coef·entropy, the GRPO actor objective.

Group advantages come from `stages.advantage.estimators` (verl/trl presets `grpo_verl`,
`grpo_trl`); a [B] advantage is broadcast over the response tokens. All-equal-reward groups are
removed from the loss upstream (`omnirl advantage --drop-zero-std` → `train_mask`), so they count in
no denominator (DAPO's dynamic-sampling filter). Note: verl gives a singleton group A = r; here A = 0.
The objective that calls these on stored rollouts is `stages.update.token_objective.TokenPolicyGradient`.
"""

from __future__ import annotations

import torch

from stages.errors import UserInputError
from stages.models.tokens import fp32 as _fp32
from stages.update.config_rules import AGG_MODES, KL_KINDS

RATIO_TYPES = ("token", "sequence")

# verl's numerical guards: token log-ratio clamp, GSPO log-ratio cap, k3 inner and outer clamps.
TOKEN_LOG_RATIO_CLAMP = 20.0
SEQUENCE_LOG_RATIO_MAX = 10.0
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bool [B, T] of valid tokens, checked against the shape of `like`."""
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the values have {tuple(like.shape)}")
    return mask != 0


def _masked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`values` with invalid positions set to 0 (a select, so NaN/inf padding cannot leak)."""
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens of the whole batch; 0 when there are none."""
    return _masked(values, valid).sum() / valid.sum().clamp(min=1)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_len: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (verl `loss_agg_mode`).

    With m the valid tokens, n_b = Σ_t m_bt, S the rows with n_b > 0 (fully masked rows, e.g.
    dropped groups, are not counted) and L = `norm_len` (default T):

    - ``token-mean``: Σ_bt m·l / Σ_bt m (DAPO, trl `dapo`/`bnpo`; verl default).
    - ``seq-mean-token-mean``: mean over S of (Σ_t m·l / n_b) (original GRPO, trl `grpo`).
    - ``seq-mean-token-sum``: mean over S of Σ_t m·l.
    - ``seq-mean-token-sum-norm``: Σ_bt m·l / (|S|·L) (Dr.GRPO, = trl `dr_grpo`). L should be a
      constant (the max response length), not the padded length of the batch. verl divides by L
      only and rescales micro-batches outside `agg_loss`; over a whole mini-batch that is this value.

    `num_tokens` / `num_seqs` replace Σ m and |S| by counts over a larger batch, so the losses of
    micro-batches add up to the loss of the whole batch (gradient accumulation, data parallel).
    An empty batch gives 0.
    """
    valid = _valid(mask, loss_mat)
    values = _masked(_fp32(loss_mat), valid)
    if mode == "token-mean":
        count = valid.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return values.sum() / count.clamp(min=1)
    if mode not in AGG_MODES:
        raise UserInputError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")
    row_tokens = valid.sum(-1)
    seqs = (row_tokens > 0).sum() if num_seqs is None else torch.tensor(float(num_seqs))
    seqs = seqs.clamp(min=1)
    row_sums = values.sum(-1)
    if mode == "seq-mean-token-mean":
        return (row_sums / row_tokens.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return row_sums.sum() / seqs
    length = loss_mat.shape[-1] if norm_len is None else norm_len
    if not length > 0:
        raise UserInputError(f"norm_len for seq-mean-token-sum-norm must be > 0, got {norm_len}")
    return row_sums.sum() / (seqs * length)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from sampled-token log-probs, float32 [B, T].

    With d = logp − ref_logp (Schulman's estimators, verl `kl_penalty`):

    - ``k1`` / ``kl``: d (unbiased, high variance, can be negative).
    - ``abs``: |d|.
    - ``k2`` / ``mse``: ½·d² (biased, low variance; its gradient is the true KL gradient's estimator).
    - ``k3`` / ``low_var_kl``: e^(−d) + d − 1 = ref/π − log(ref/π) − 1 ≥ 0, unbiased under samples
      from π. As in verl/EasyR1, −d is clamped to [−20, 20] (no overflow) and the result to
      [−10, 10] (in effect ≤ 10): unclamped k3 gave NaNs at step 0 on Qwen2.5-VL (NeMo-RL #874).
    - ``k1+`` / ``k3+``: straight-through, the value of k1/k3 with the gradient of k2 (verl).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    if kind not in KL_KINDS:
        raise UserInputError(f"KL estimator {kind!r} is not one of {', '.join(KL_KINDS)}")
    d = _fp32(logp) - _fp32(ref_logp)
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    k2 = 0.5 * d.square()
    if kind in ("k2", "mse"):
        return k2
    if kind == "k1+":
        return k2 + (d - k2).detach()
    inner = (-d).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    k3 = (torch.expm1(inner) - inner).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    if kind == "k3+":
        return k2 + (k3 - k2).detach()
    return k3


def _ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor, ratio_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance ratio [B, T] and the raw token log-ratio [B, T] (padding set to 0)."""
    log_ratio = _masked(logp - old_logp, valid)
    if ratio_type == "token":
        return torch.exp(log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)), log_ratio
    if ratio_type != "sequence":
        raise UserInputError(f"ratio type {ratio_type!r} is not one of {', '.join(RATIO_TYPES)}")
    # GSPO-token: value s_b = exp(mean_t log-ratio) on every token, gradient s_b·∇logp_t per token.
    seq_log_ratio = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
    combined = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    return torch.exp(_masked(combined, valid).clamp(max=SEQUENCE_LOG_RATIO_MAX)), log_ratio


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    ratio_type: str = "token",
    agg_mode: str | None = None,
    norm_len: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss (scalar) and its diagnostics (detached scalars).

    `logp` [B, T] carries the gradient; `old_logp` [B, T] are the rollout policy's log-probs;
    `advantages` is [B] (broadcast over tokens) or [B, T]. Per token, with r the ratio:

        l = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)),  and for A < 0: l = min(l, −A·c)

    clip_high > clip_low is DAPO's clip-higher (0.2/0.28); c = `dual_clip_c` (verl `clip_ratio_c`,
    3.0, > 1; None turns dual-clip off) bounds the loss of negative-advantage tokens whose ratio
    exploded. `ratio_type` "token": r = exp(clamp(logp − old_logp, ±20)). "sequence" (GSPO-token):
    r = s_b = exp(mean over valid t of (logp − old_logp)), capped at e^10, computed as
    sg[s_b]·π/sg[π] so each token keeps its own gradient; GSPO's clip range is ~3e-4/4e-4 and verl's
    gspo applies no dual-clip (pass None to match). `agg_mode` defaults to "token-mean", or
    "seq-mean-token-mean" for sequence ratios (the GSPO paper; `grpo_loss` always uses it for them, as
    verl does); the other aggregation arguments are `aggregate`'s. `weights` [B, T] multiply each token's
    term before aggregation (rollout_correction.py; a weight of 0 still counts in the denominator).

    Metrics (means over valid tokens): pg_loss; pg_clipfrac (the clipped branch is active:
    A > 0 and r > 1 + clip_high, or A < 0 and r < 1 − clip_low), split into pg_clipfrac_higher and
    pg_clipfrac_lower; pg_clipfrac_dual (A < 0 and r > c, verl's "pg_clipfrac_lower"); ppo_kl
    (mean of old_logp − logp, the k1 estimate of KL(old‖new)); ratio_mean.
    """
    if not 0 <= clip_low < 1 or not clip_high >= 0:
        raise UserInputError(
            f"clip range must satisfy 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}"
        )
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise UserInputError(f"dual-clip constant must be > 1 (or None to disable), got {dual_clip_c}")
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ in shape")
    valid = _valid(mask, logp)
    logp, old_logp = _fp32(logp), _fp32(old_logp)
    adv = _fp32(advantages)
    if adv.shape == logp.shape[:1]:
        adv = adv.unsqueeze(-1)
    elif adv.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(adv.shape)}")
    adv = adv.expand_as(logp)
    ratio, log_ratio = _ratio(logp, old_logp, valid, ratio_type)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip_c), per_token)
    if weights is not None:
        per_token = per_token * weights.float()
    mode = agg_mode or ("seq-mean-token-mean" if ratio_type == "sequence" else "token-mean")
    loss = aggregate(per_token, valid, mode, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs)

    with torch.no_grad():
        r = ratio.detach()
        higher = (adv > 0) & (r > 1.0 + clip_high)
        lower = (adv < 0) & (r < 1.0 - clip_low)
        dual = (adv < 0) & (r > dual_clip_c) if dual_clip_c is not None else torch.zeros_like(valid)
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": _masked_mean((higher | lower).float(), valid),
            "pg_clipfrac_higher": _masked_mean(higher.float(), valid),
            "pg_clipfrac_lower": _masked_mean(lower.float(), valid),
            "pg_clipfrac_dual": _masked_mean(dual.float(), valid),
            "ppo_kl": _masked_mean(-log_ratio, valid),
            "ratio_mean": _masked_mean(r, valid),
        }
    return loss, metrics


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "low_var_kl",
    entropy_coef: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    ratio_type: str = "token",
    agg_mode: str = "token-mean",
    norm_len: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO actor loss: pg_loss + kl_coef·agg(KL(π‖π_ref)) − entropy_coef·agg(entropy), scalar.

    The KL is the in-loss penalty (verl `use_kl_loss`, kl_loss_coef 0.001 text / 0.01 VLM with
    low_var_kl; DAPO, Dr.GRPO and GSPO run with kl_coef 0); `ref_logp` [B, T] is needed when
    kl_coef ≠ 0. `entropy` [B, T] (from `token_entropy`, with gradient) is needed when
    entropy_coef ≠ 0; a positive coefficient rewards entropy.

    Aggregation as verl's actor: KL and entropy always use `agg_mode` (verl `loss_agg_mode`, default
    token-mean); so does the policy term for token ratios, while for sequence ratios (GSPO) it is
    always seq-mean-token-mean, whatever `agg_mode` says. `weights` [B, T] weigh the policy term alone
    (`policy_loss`). Metrics: `policy_loss`'s plus loss, kl_loss and entropy (when given).
    """
    if kl_coef != 0 and ref_logp is None:
        raise UserInputError(
            f"kl_coef={kl_coef} needs reference-policy log-probs; compute them or set kl_coef to 0"
        )
    if entropy_coef != 0 and entropy is None:
        raise UserInputError(
            f"entropy_coef={entropy_coef} needs the token entropies; pass them or set it to 0"
        )
    agg = {"norm_len": norm_len, "num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, metrics = policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        ratio_type=ratio_type,
        agg_mode="seq-mean-token-mean" if ratio_type == "sequence" else agg_mode,
        weights=weights,
        **agg,
    )
    if ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kl_kind), mask, agg_mode, **agg)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    if entropy is not None:
        ent = aggregate(entropy, mask, agg_mode, **agg)
        loss = loss - entropy_coef * ent
        metrics["entropy"] = ent.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
